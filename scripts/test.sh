#!/usr/bin/env bash
# The test command: installs what is missing (scripts/setup.sh --for-tests:
# also what only tests need), then runs every check the
# project has: format, lints, the whole test suite (real Redis, real gateway
# processes), config checks, deployment-file checks, the load-test smoke runs
# and the demo.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=0
# Where the time goes: each step's wall time, printed at the end (on a
# failure too, up to the step that failed).
names=() secs=()
current="setup (scripts/setup.sh --for-tests)" started=$SECONDS
close_step() { names+=("$current"); secs+=($((SECONDS - started))); }
step() {
  close_step
  current="$*" started=$SECONDS
  echo; echo "==> $*"; steps=$((steps + 1))
}
report_times() {
  close_step
  echo
  echo "time per step (s):"
  for i in "${!names[@]}"; do printf '%6d  %s\n' "${secs[$i]}" "${names[$i]}"; done
  printf '%6d  total\n' "$SECONDS"
}
trap report_times EXIT

scripts/setup.sh --for-tests

step "cargo fmt --check"
cargo fmt --all -- --check

# One release profile for everything, so clippy, the tests and the demo share
# one build of Pingora and its C dependencies. The workspace is the gateway and
# its test tools (tools/: mock-upstream, tcp-forwarder).
step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --release --workspace --all-targets -- -D warnings

# cargo test builds only the binaries of the package whose tests use them: the
# integration tests find the test tools next to the gateway, so the workspace's
# binaries are built first. With the tests, so with the features the
# dev-dependencies unify in, as the test run's: it then builds only the benches
# and the example as tests, not the gateway a second time.
step "cargo build --workspace --bins --tests (the gateway, the test tools, the tests)"
cargo build --release --workspace --bins --tests

step "cargo test (unit, property, conformance and integration tests)"
cargo test --release --workspace --all-targets

step "gateway check: gateway.toml and the contract"
target/release/gateway check -c gateway.toml
if [ -f ../shared/spec/gateway.contract.toml ]; then
  # The contract takes its secrets from the environment, as a deployment does.
  REDIS_PASSWORD=contract-check GATEWAY_ADMIN_TOKEN=contract-check-token-0123 \
    target/release/gateway check -c ../shared/spec/gateway.contract.toml >/dev/null
  echo "../shared/spec/gateway.contract.toml: ok"
  # As it stands: "#>" lines are keys still being built; they stay
  # comments until shared/ drops the marker once the work has landed.
fi

if [ -x scripts/check_deploy.sh ]; then
  step "deployment files (hadolint, kubernetes-validate, embedded config)"
  scripts/check_deploy.sh target/release/gateway
fi

if [ -x scripts/image.sh ]; then
  # The binary the tests just used, in the Dockerfile's runtime stage: the
  # project is compiled once per run, not again inside the image (a user's
  # `scripts/image.sh` or `docker build .` builds the build stage too).
  step "container image (scripts/image.sh --binary: the Dockerfile's runtime stage with this run's gateway, built with buildah, run as uid 65532, read-only)"
  scripts/image.sh --binary target/release/gateway
fi

# The load-test smokes check that each scenario runs end to end and writes
# well-formed outputs (no figure of theirs is a target), each on loopback
# ports of its own: they run side by side, their outputs shown in turn.
smokes=()
[ -x loadtest/surge.sh ] && smokes+=("surge:loadtest/surge.sh --smoke")
[ -x loadtest/capacity_halves.sh ] && smokes+=("capacity halves:loadtest/capacity_halves.sh --smoke")
[ -x loadtest/matrix.sh ] && smokes+=("holdout matrix:loadtest/matrix.sh --smoke")
if ((${#smokes[@]})); then
  step "load-test smokes, side by side (${#smokes[@]}: surge, capacity halves, holdout matrix)"
  pids=() logs=()
  trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
  for s in "${smokes[@]}"; do
    log=$(mktemp /tmp/test-smoke.XXXXXX)
    # shellcheck disable=SC2086 # the command's words
    ${s#*:} >"$log" 2>&1 &
    pids+=($!) logs+=("$log")
  done
  (while sleep 15; do echo "    ... smokes running, $((SECONDS - started)) s"; done) &
  ticker=$!
  failed=0
  for i in "${!smokes[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    echo "---- ${smokes[$i]%%:*} (${smokes[$i]#*:}): exit $rc"
    cat "${logs[$i]}"
    rm -f "${logs[$i]}"
    ((rc == 0)) || failed=1
  done
  kill "$ticker" 2>/dev/null
  wait "$ticker" 2>/dev/null || true
  trap - INT TERM
  ((failed == 0)) || { echo "test.sh: a load-test smoke failed (its output is above)"; exit 1; }
fi

step "demo (scripts/demo.sh --once --no-build: the binaries cargo test built)"
scripts/demo.sh --once --no-build

echo
echo "test.sh: $steps passed, 0 failed"
