#!/usr/bin/env bash
# The run command: builds the gateway, starts Redis, two mock upstreams and the
# gateway (with the repo's gateway.toml, on free loopback ports), sends a short
# burst to every route and prints what happened. Then keeps running until
# Ctrl-C; with --once it stops everything it started and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

once=0 build=1
for arg in "$@"; do
  case "$arg" in
    --once) once=1 ;;
    # The test command's: it just built target/release's binaries, with the
    # features its dev-dependencies unify in; `cargo build` alone would
    # build them again without those.
    --no-build) build=0 ;;
    -h|--help) echo "usage: scripts/demo.sh [--once] [--no-build]"; exit 0 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done

scripts/setup.sh
if ((build)); then
  echo "demo: building (release)..."
  cargo build --release --quiet --workspace --bins
else
  for bin in target/release/gateway target/release/mock-upstream; do
    [ -x "$bin" ] || { echo "demo: --no-build, but $bin is missing (cargo build --release --workspace)" >&2; exit 1; }
  done
fi

work=$(mktemp -d)
pids=()
gateway_pid=""
cleanup() {
  # SIGINT is the gateway's fast shutdown (SIGTERM would drain for its grace
  # period); the others get SIGTERM (background jobs of a script ignore SIGINT).
  [ -n "$gateway_pid" ] && kill -INT "$gateway_pid" 2>/dev/null || true
  for pid in "${pids[@]}"; do [ "$pid" = "$gateway_pid" ] || kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

mapfile -t ports < <(python3 scripts/free_port.py 5)
p_redis=${ports[0]} p_rides=${ports[1]} p_geo=${ports[2]} p_proxy=${ports[3]} p_admin=${ports[4]}

redis-server --port "$p_redis" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$work" --logfile "$work/redis.log" &
pids+=($!)
target/release/mock-upstream --listen "127.0.0.1:$p_rides" 2>"$work/rides.log" &
pids+=($!)
target/release/mock-upstream --listen "127.0.0.1:$p_geo" 2>"$work/geo.log" &
pids+=($!)

sed -e "s#127.0.0.1:8080#127.0.0.1:$p_proxy#" \
    -e "s#127.0.0.1:9901#127.0.0.1:$p_admin#" \
    -e "s#redis://127.0.0.1:6379#redis://127.0.0.1:$p_redis#" \
    -e "s#127.0.0.1:9001#127.0.0.1:$p_rides#" \
    -e "s#127.0.0.1:9002#127.0.0.1:$p_geo#" \
    gateway.toml > "$work/gateway.toml"
# `check` compares the config's keys with the runtime keys in Redis: it
# runs once Redis answers, or it would warn that it could not.
for _ in $(seq 1 100); do
  redis-cli -p "$p_redis" ping 2>/dev/null | grep -q PONG && break
  sleep 0.1
done
target/release/gateway check -c "$work/gateway.toml" >/dev/null
GATEWAY_LOG=${GATEWAY_LOG:-warn} target/release/gateway run -c "$work/gateway.toml" 2>"$work/gateway.log" &
gateway_pid=$!
pids+=($!)

echo -n "demo: waiting for the gateway to use Redis"
for _ in $(seq 1 100); do
  if curl -fsS "http://127.0.0.1:$p_admin/readyz" 2>/dev/null | grep -q '"redis"'; then break; fi
  echo -n "."; sleep 0.1
done
echo

python3 scripts/demo_burst.py "127.0.0.1:$p_proxy" "127.0.0.1:$p_rides" "127.0.0.1:$p_geo"

echo "gateway:  http://127.0.0.1:$p_proxy   (try: curl -i -X POST -H 'x-api-key: demo-key-123' http://127.0.0.1:$p_proxy/api/rides/request)"
echo "admin:    http://127.0.0.1:$p_admin/metrics  /readyz  /healthz"
echo "redis:    redis-cli -p $p_redis"
if ((once)); then
  echo "demo: --once: stopping everything"
  exit 0
fi
echo "demo: running; Ctrl-C stops everything"
while true; do sleep 3600; done
