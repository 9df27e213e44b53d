#!/usr/bin/env bash
# Capacity halves (issue #26): an upstream whose capacity nobody knows, on loopback.
#
#   loadtest/capacity_halves.sh [--quick | --smoke] [--users N] [--spawn-rate R]
#                               [--run-time T] [--rate RPS] [--burst N]
#                               [--workers N] [--service-ms MS] [--timeout S]
#                               [--queue N] [--queue-timeout-ms MS] [--seed N]
#                               [--out DIR]
#
# Starts, on 127.0.0.1 only and on free ports picked at run time, the mock
# "matching service" (target/release/mock-upstream --workers 8 --service-ms
# 100: 80 rps) and one gateway in front of it, whose route has a global token
# bucket right for that capacity (--rate, default 75/s). Locust users
# (loadtest/capacity_halves_locustfile.py) loop GET /api/rides/request with
# a short think time and a client timeout. At a third of the run the driver
# POSTs /control?service_ms=200 to the mock: the same workers take twice as
# long, capacity halves (40 rps), and the rate limit is now too high. Twice,
# with the same seed and users, each on a fresh mock and gateway:
#   rate_only  the route's rate limit alone
#   adaptive   plus queue/queue_timeout_ms and adaptive = { enabled = true,
#              min = 2, max = 200 } on the upstream
# A sampler polls the mock's /stats and the gateway's /metrics every 250 ms.
# Writes loadtest/results/capacity-halves-<timestamp>/: run.json, Locust's
# CSVs and HTML report per run (runs/<run>/), summary.json, report.md (the
# table and the targets) and the PNG plots (loadtest/capacity_halves.py).
#
#   (default)  100 users, spawned at 50/s, 60 s per run: about 2 minutes
#   --quick    the same users, 40 s per run: about 1.5 minutes
#   --smoke    40 users for 12 s per run; checks that summary.json,
#              report.md and the PNGs are made and well-formed (about 35 s)
# Explicit options win over the presets. --run-time takes seconds or Locust's
# 90s / 3m / 1m30s forms.
#
# Exit status: 0 when both runs completed and the outputs were made (the
# targets are reported PASS/FAIL in report.md but do not change it; --smoke
# also validates the outputs), 1 otherwise, 2 on bad usage. Everything it
# starts is stopped on exit, by PID.
#
# Needs target/release/gateway and target/release/mock-upstream (it never
# builds them) and Locust and matplotlib in .venv (installed from
# loadtest/requirements.txt when missing).
set -euo pipefail

root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
here=$root/loadtest
gateway=$root/target/release/gateway
mock=$root/target/release/mock-upstream
venv=$root/.venv
py=$venv/bin/python
me=capacity_halves.sh

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

mode=default
users="" spawn="" run_time="" out=""
rate=75 burst=100 workers=8 service_ms=100 timeout_s=3
queue=100 queue_timeout_ms=50 adaptive_min=2 adaptive_max=200 seed=26
think_min=0.2 think_max=0.4
while (($#)); do
  case $1 in
    --quick) mode=quick ;;
    --smoke) mode=smoke ;;
    --users) users=${2:?--users needs a number}; shift ;;
    --spawn-rate) spawn=${2:?--spawn-rate needs a number}; shift ;;
    --run-time) run_time=${2:?--run-time needs a duration}; shift ;;
    --rate) rate=${2:?--rate needs a number}; shift ;;
    --burst) burst=${2:?--burst needs a number}; shift ;;
    --workers) workers=${2:?--workers needs a number}; shift ;;
    --service-ms) service_ms=${2:?--service-ms needs a number}; shift ;;
    --timeout) timeout_s=${2:?--timeout needs seconds}; shift ;;
    --queue) queue=${2:?--queue needs a number}; shift ;;
    --queue-timeout-ms) queue_timeout_ms=${2:?--queue-timeout-ms needs a number}; shift ;;
    --seed) seed=${2:?--seed needs a number}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "$me: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

case $mode in
  default) : "${users:=100}" "${spawn:=50}" "${run_time:=60}" ;;
  quick) : "${users:=100}" "${spawn:=50}" "${run_time:=40}" ;;
  smoke) : "${users:=40}" "${spawn:=40}" "${run_time:=12}" ;;
esac
progress_secs=3
[[ $mode == smoke ]] && progress_secs=2

# Seconds from 120, 90s, 3m, 1m30s, 1h.
to_secs() {
  local s=$1 total=0 n
  if [[ $s =~ ^[0-9]+$ ]]; then
    echo "$s"
    return
  fi
  [[ $s =~ ^([0-9]+h)?([0-9]+m)?([0-9]+s)?$ && -n $s ]] || return 1
  for part in "${BASH_REMATCH[@]:1}"; do
    [[ -z $part ]] && continue
    n=${part%?}
    case $part in
      *h) total=$((total + n * 3600)) ;;
      *m) total=$((total + n * 60)) ;;
      *s) total=$((total + n)) ;;
    esac
  done
  echo "$total"
}
run_secs=$(to_secs "$run_time") || { echo "$me: bad --run-time '$run_time'" >&2; exit 2; }
for v in users workers service_ms queue queue_timeout_ms seed burst; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "$me: --${v//_/-} must be a whole number" >&2; exit 2; }
done
((users >= 1 && workers >= 1 && service_ms >= 1)) || { echo "$me: --users, --workers and --service-ms must be at least 1" >&2; exit 2; }
for v in spawn rate timeout_s; do
  [[ ${!v} =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$me: --${v/_s/} must be a number" >&2; exit 2; }
done
((run_secs >= 9)) || { echo "$me: --run-time must be at least 9 s" >&2; exit 2; }
service_ms_after=$((2 * service_ms))
halve_at=$(awk -v t="$run_secs" 'BEGIN {printf "%.3f", t / 3}')

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- prerequisites -----------------------------------------------------------

for bin in "$gateway" "$mock"; do
  if [[ ! -x $bin ]]; then
    echo "$me: $bin is missing: build first: cargo build --release" >&2
    exit 1
  fi
done

as_root() {
  if ((EUID == 0)); then "$@"; else sudo "$@"; fi
}

if [[ ! -x $py ]]; then
  log "creating the virtualenv $venv"
  if ! python3 -m venv "$venv"; then
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
fi
if ! "$py" -c 'import locust, matplotlib' 2>/dev/null; then
  log "installing Locust and matplotlib into $venv"
  "$py" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
fi

# --- the run folder ------------------------------------------------------------

stamp=$(date +%Y%m%d-%H%M%S)
if [[ -z $out ]]; then
  if [[ $mode == smoke ]]; then
    # Keep only the latest smoke run's outputs.
    rm -rf -- "$here"/results/capacity-halves-smoke-*
    out=$here/results/capacity-halves-smoke-$stamp
  else
    out=$here/results/capacity-halves-$stamp
  fi
fi
mkdir -p "$out/runs"
out=$(cd -- "$out" && pwd)

# --- cleanup: everything started here, by PID ------------------------------------

gw_pid=""
mock_pid=""
locust_pid=""
progress_pid=""
sleep_pid=""

# stop_pid PID SIGNAL SECONDS: signal, wait up to SECONDS, then SIGKILL; reap.
stop_pid() {
  local pid=$1 sig=$2 secs=$3 i
  [[ -n $pid ]] || return 0
  kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
  kill "-$sig" "$pid" 2>/dev/null || true
  for ((i = 0; i < secs * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "$me: PID $pid did not exit after SIG$sig within ${secs}s: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

stop_servers() {
  stop_pid "$gw_pid" TERM 10
  stop_pid "$mock_pid" TERM 5
  gw_pid="" mock_pid=""
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  stop_pid "$sleep_pid" TERM 1
  stop_pid "$locust_pid" INT 10
  stop_pid "$progress_pid" TERM 2
  stop_servers
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# wait_until SECONDS DESCRIPTION COMMAND...: polls COMMAND every 0.2 s.
wait_until() {
  local secs=$1 what=$2 i
  shift 2
  for ((i = 0; i < secs * 5; i++)); do
    if "$@" >/dev/null 2>&1; then
      return 0
    fi
    sleep 0.2
  done
  echo "$me: $what not ready after ${secs}s" >&2
  return 1
}

# nap SECONDS: an interruptible sleep (a signal to this script acts at once).
nap() {
  sleep "$1" &
  sleep_pid=$!
  wait "$sleep_pid" || true
  sleep_pid=""
}

log "run folder: $out"
log "mode $mode: $users users (spawn $spawn/s), ${run_secs}s per run; upstream $workers workers at $service_ms ms, ${service_ms_after} ms from ${halve_at}s; route limit $rate/s (burst $burst)"

cat >"$out/run.json" <<JSON
{
  "mode": "$mode",
  "users": $users,
  "spawn_rate": $spawn,
  "run_secs": $run_secs,
  "halve_at_secs": $halve_at,
  "workers": $workers,
  "service_ms": $service_ms,
  "service_ms_after": $service_ms_after,
  "rate": $rate,
  "burst": $burst,
  "queue": $queue,
  "queue_timeout_ms": $queue_timeout_ms,
  "adaptive_min": $adaptive_min,
  "adaptive_max": $adaptive_max,
  "client_timeout": $timeout_s,
  "think_min": $think_min,
  "think_max": $think_max,
  "seed": $seed,
  "cpus": $(nproc),
  "gateway_mtime": "$(date -r "$gateway" -Iseconds)",
  "git_commit": "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)",
  "started_at": "$(date -Iseconds)"
}
JSON

# write_config FILE PROXY_PORT ADMIN_PORT UPSTREAM_PORT ADAPTIVE(0|1)
write_config() {
  local file=$1 pp=$2 ap=$3 up=$4 adaptive=$5 cap extra=""
  cap=$burst
  if ((adaptive)); then
    extra="queue = $queue
queue_timeout_ms = $queue_timeout_ms
adaptive = { enabled = true, min = $adaptive_min, max = $adaptive_max }"
  fi
  cat >"$file" <<TOML
# Made by loadtest/capacity_halves.sh.
[server]
listen = ["127.0.0.1:$pp"]
admin_listen = "127.0.0.1:$ap"
threads = 2
grace_period_secs = 1

[limiter]
backend = "local"

[[upstreams]]
name = "matching"
servers = ["127.0.0.1:$up"]
read_timeout_ms = 5000
$extra

[[routes]]
name = "ride-request"
path_prefix = "/"
upstream = "matching"
limit = { algorithm = "token_bucket", capacity = $cap, refill_per_sec = $rate, scope = "global" }
TOML
}

# busy_check FILE: records the load average; warns when something else keeps
# the CPUs busy (a build, another benchmark): every latency is inflated then.
busy_check() {
  cut -d' ' -f1-3 /proc/loadavg >"$1"
  local load cpus
  load=$(cut -d' ' -f1 /proc/loadavg)
  cpus=$(nproc)
  if awk -v l="$load" -v c="$cpus" 'BEGIN {exit !(l > c / 2)}'; then
    echo "$me: warning: the machine is already busy (1-min load $load on $cpus CPUs): latencies will be inflated" >&2
  fi
}

# run_one NAME ADAPTIVE(0|1): a fresh mock and gateway, Locust, the halving.
run_one() {
  local name=$1 adaptive=$2 dir=$out/runs/$1 rc ports mp pp ap started target wait_s
  mkdir -p "$dir"
  mapfile -t ports < <("$py" "$here/prepare.py" ports 3)
  if ((${#ports[@]} != 3)); then
    echo "$me: could not find free loopback ports" >&2
    exit 1
  fi
  mp=${ports[0]} pp=${ports[1]} ap=${ports[2]}
  local mock_url=http://127.0.0.1:$mp admin_url=http://127.0.0.1:$ap proxy_url=http://127.0.0.1:$pp

  "$mock" --listen "127.0.0.1:$mp" --service-ms "$service_ms" --workers "$workers" --threads 2 \
    >"$dir/mock-upstream.log" 2>&1 &
  mock_pid=$!
  wait_until 10 "mock-upstream on $mock_url" bash -c "kill -0 $mock_pid && curl -fsS $mock_url/healthz"

  write_config "$dir/gateway.toml" "$pp" "$ap" "$mp" "$adaptive"
  if ! "$gateway" check --config "$dir/gateway.toml" >"$dir/gateway-check.txt" 2>&1; then
    cat "$dir/gateway-check.txt" >&2
    echo "$me: the generated gateway config does not pass 'gateway check'" >&2
    exit 1
  fi
  GATEWAY_LOG=warn "$gateway" run --config "$dir/gateway.toml" >"$dir/gateway.log" 2>&1 &
  gw_pid=$!
  if ! wait_until 30 "gateway on $admin_url/readyz" bash -c "kill -0 $gw_pid && curl -fsS $admin_url/readyz"; then
    tail -20 "$dir/gateway.log" >&2
    exit 1
  fi
  log "== run $name: mock :$mp ($workers workers, $service_ms ms), gateway :$pp (admin :$ap)$( ((adaptive)) && echo ", adaptive concurrency on")"
  busy_check "$dir/loadavg-before"

  (
    cd "$here"
    export CH_TARGET=$proxy_url CH_OUT=$dir CH_RUN=$name CH_UPSTREAM=$mock_url CH_ADMIN=$admin_url
    export CH_SEED=$seed CH_TIMEOUT=$timeout_s CH_THINK_MIN=$think_min CH_THINK_MAX=$think_max
    export CH_PROGRESS_SECS=$progress_secs
    exec timeout -s INT --kill-after=15 $((run_secs + 60)) "$py" -m locust -f "$here/capacity_halves_locustfile.py" \
      --headless -u "$users" -r "$spawn" -t "${run_secs}s" --stop-timeout 0 --only-summary \
      --csv "$dir/locust" --html "$dir/locust.html"
  ) >"$dir/locust.log" 2>&1 &
  locust_pid=$!
  # Progress lines (and trouble) while it runs; tail ends with Locust.
  tail -n +1 -F --pid="$locust_pid" "$dir/locust.log" 2>/dev/null |
    grep --line-buffered -E "^\[$name\]|CPU usage|cpu threshold|Traceback|Error" &
  progress_pid=$!

  # The halving, a third into the load (from Locust's test start).
  if ! wait_until 30 "Locust's start (run $name)" bash -c "[[ -s $dir/started ]] || ! kill -0 $locust_pid"; then
    exit 1
  fi
  if [[ -s $dir/started ]]; then
    started=$(cat "$dir/started")
    target=$(awk -v s="$started" -v h="$halve_at" 'BEGIN {printf "%.3f", s + h}')
    wait_s=$(awk -v t="$target" -v n="$(date +%s.%N)" 'BEGIN {d = t - n; if (d < 0) d = 0; printf "%.3f", d}')
    [[ $wait_s =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$me: bad wait '$wait_s' before the halving" >&2; exit 1; }
    nap "$wait_s"
    if kill -0 "$locust_pid" 2>/dev/null; then
      date +%s.%N >"$dir/halved_at"
      curl -fsS -X POST "$mock_url/control?service_ms=$service_ms_after" >"$dir/control.json"
      log "== run $name: capacity halves now: the mock's service time ${service_ms} -> ${service_ms_after} ms ($(cat "$dir/control.json"))"
    fi
  fi

  set +e
  wait "$locust_pid"
  rc=$?
  wait "$progress_pid"
  set -e
  locust_pid="" progress_pid=""
  cut -d' ' -f1-3 /proc/loadavg >"$dir/loadavg-after"
  curl -fsS "$admin_url/metrics" >"$dir/metrics-end.txt" 2>/dev/null || true
  curl -fsS "$mock_url/stats" >"$dir/upstream-stats-end.json" 2>/dev/null || true
  kill -0 "$gw_pid" 2>/dev/null || echo "$me: the gateway (PID $gw_pid) died during run $name" >&2
  stop_servers
  # Locust exits 1 when any request failed: expected for rate_only.
  if ((rc != 0 && rc != 1)); then
    tail -30 "$dir/locust.log" >&2
    echo "$me: Locust failed in run $name (exit $rc)" >&2
    exit 1
  fi
  if [[ ! -s $dir/requests.csv || ! -s $dir/halved_at ]]; then
    echo "$me: run $name recorded no requests or no halving" >&2
    exit 1
  fi
  log "== run $name done: $(($(wc -l <"$dir/requests.csv") - 1)) requests; the upstream's counters $("$py" -c '
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception:
    s = {}
print(" ".join("%s=%s" % (k, s.get(k)) for k in ("total", "ok", "failed", "max_in_flight", "max_waiting")))' "$dir/upstream-stats-end.json")"
}

run_one rate_only 0
run_one adaptive 1

if [[ $(date -r "$gateway" -Iseconds) != $(sed -n 's/.*"gateway_mtime": "\(.*\)".*/\1/p' "$out/run.json") ]]; then
  echo "$me: warning: target/release/gateway changed during the run (rebuilt): the two runs may differ in more than the config" >&2
fi

# --- the report --------------------------------------------------------------------

log "== report"
if ! "$py" "$here/capacity_halves.py" report "$out"; then
  echo "$me: the report could not be made" >&2
  exit 1
fi
if ! "$py" "$here/capacity_halves.py" check "$out"; then
  echo "$me: the outputs are incomplete; kept in $out" >&2
  exit 1
fi
log "report: $out/report.md"
