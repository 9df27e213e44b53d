#!/usr/bin/env bash
# The concert-surge load test: the before/after table, on loopback.
#
#   loadtest/surge.sh [--quick | --smoke] [--users N] [--spawn-rate R]
#                     [--run-time T] [--capacity RPS] [--max-queue-ms MS]
#                     [--processes N] [--out DIR]
#
# Starts, on 127.0.0.1 only and on free ports picked at run time: a Redis, the
# mock "matching service" (target/release/mock-upstream, serving --capacity
# rps and failing with 503 the requests that would queue past --max-queue-ms,
# default 2000) and three gateway replicas sharing the Redis, each with a
# config made from loadtest/surge.gateway.toml. Then it runs Locust headless
# twice with the same riders (loadtest/locustfile.py):
#   unprotected  straight to the matching service
#   protected    through the three gateways, in random order
# and writes loadtest/results/surge-<timestamp>/: Locust's CSVs, summary.json,
# report.md (the table) and PNG plots (loadtest/report.py).
#
#   (default)  200 riders, spawned at 20/s, 120 s per phase, capacity 50 rps:
#              about 5 minutes on a 2-core machine
#   --quick    the same riders, 50 s per phase: both phases in under 3 minutes
#   --smoke    20 riders for 8 s per phase against a 20 rps service; checks that
#              summary.json, report.md and the PNGs are made and well-formed
#              (about 40 s; scripts/test.sh runs it)
# Explicit options win over the presets. --run-time takes seconds or Locust's
# 90s / 3m / 1m30s forms. --processes N runs Locust in N processes (for a big
# machine; on 2 cores one process is cheaper).
#
# Exit status: 0 when the run passed (the acceptance points for a full or
# quick run; the output checks for --smoke), 1 otherwise, 2 on bad usage.
# Everything it starts is stopped on exit, by PID.
#
# Needs target/release/gateway and target/release/mock-upstream (it never
# builds them), redis-server (installed with apt-get when missing) and Locust
# and matplotlib in .venv (installed from loadtest/requirements.txt when
# missing).
set -euo pipefail

root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
here=$root/loadtest
gateway=$root/target/release/gateway
mock=$root/target/release/mock-upstream
venv=$root/.venv
py=$venv/bin/python

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

mode=default
users="" spawn="" run_time="" capacity="" processes="" out=""
max_queue_ms=2000
replicas=3
share=0.9
while (($#)); do
  case $1 in
    --quick) mode=quick ;;
    --smoke) mode=smoke ;;
    --users) users=${2:?--users needs a number}; shift ;;
    --spawn-rate) spawn=${2:?--spawn-rate needs a number}; shift ;;
    --run-time) run_time=${2:?--run-time needs a duration}; shift ;;
    --capacity) capacity=${2:?--capacity needs a number}; shift ;;
    --max-queue-ms) max_queue_ms=${2:?--max-queue-ms needs a number}; shift ;;
    --processes) processes=${2:?--processes needs a number}; shift ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "surge.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

case $mode in
  default) : "${users:=200}" "${spawn:=20}" "${run_time:=120}" "${capacity:=50}" ;;
  quick) : "${users:=200}" "${spawn:=40}" "${run_time:=50}" "${capacity:=50}" ;;
  smoke) : "${users:=20}" "${spawn:=20}" "${run_time:=8}" "${capacity:=20}" ;;
esac
settle=5
[[ $mode == smoke ]] && settle=1

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
run_secs=$(to_secs "$run_time") || { echo "surge.sh: bad --run-time '$run_time'" >&2; exit 2; }
[[ $users =~ ^[1-9][0-9]*$ ]] || { echo "surge.sh: --users must be a whole number" >&2; exit 2; }
for v in spawn capacity; do
  [[ ${!v} =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "surge.sh: --${v/spawn/spawn-rate} must be a number" >&2; exit 2; }
done
[[ $max_queue_ms =~ ^[0-9]+$ ]] || { echo "surge.sh: --max-queue-ms must be a whole number" >&2; exit 2; }
[[ -z $processes || $processes =~ ^[1-9][0-9]*$ ]] || { echo "surge.sh: --processes must be a number" >&2; exit 2; }
((run_secs >= 2)) || { echo "surge.sh: --run-time must be at least 2 s" >&2; exit 2; }

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }

# --- prerequisites -----------------------------------------------------------

for bin in "$gateway" "$mock"; do
  if [[ ! -x $bin ]]; then
    echo "surge.sh: $bin is missing: build first: cargo build --release" >&2
    exit 1
  fi
done

as_root() {
  if ((EUID == 0)); then "$@"; else sudo "$@"; fi
}

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  log "installing redis-server and redis-tools"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq redis-server redis-tools >/dev/null
fi

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
    rm -rf -- "$here"/results/smoke-*
    out=$here/results/smoke-$stamp
  else
    out=$here/results/surge-$stamp
  fi
fi
mkdir -p "$out/config" "$out/logs" "$out/phases"
out=$(cd -- "$out" && pwd)

# --- cleanup: everything started here, by PID ------------------------------------

gw_pids=()
mock_pid=""
redis_pid=""
locust_pid=""
progress_pid=""

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
    echo "surge.sh: PID $pid did not exit after SIG$sig within ${secs}s: SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  set +e
  stop_pid "$locust_pid" INT 10
  stop_pid "$progress_pid" TERM 2
  local pid
  for pid in "${gw_pids[@]}"; do
    kill -INT "$pid" 2>/dev/null
  done
  for pid in "${gw_pids[@]}"; do
    stop_pid "$pid" INT 10
  done
  stop_pid "$mock_pid" TERM 5
  stop_pid "$redis_pid" TERM 5
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- servers ---------------------------------------------------------------------

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
  echo "surge.sh: $what not ready after ${secs}s" >&2
  return 1
}

alive() {
  kill -0 "$1" 2>/dev/null
}

mapfile -t ports < <("$py" "$here/prepare.py" ports $((2 * replicas + 2)))
if ((${#ports[@]} != 2 * replicas + 2)); then
  echo "surge.sh: could not find free loopback ports" >&2
  exit 1
fi
redis_port=${ports[0]}
mock_port=${ports[1]}
proxy_ports=("${ports[@]:2:replicas}")
admin_ports=("${ports[@]:2+replicas:replicas}")
mock_url=http://127.0.0.1:$mock_port

log "run folder: $out"
log "mode $mode: $users riders, spawn $spawn/s, ${run_secs}s per phase; service capacity $capacity rps"

redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --loglevel warning >"$out/logs/redis.log" 2>&1 &
redis_pid=$!
wait_until 10 "redis-server on 127.0.0.1:$redis_port" \
  bash -c "kill -0 $redis_pid && [[ \$(redis-cli -h 127.0.0.1 -p $redis_port ping) == PONG ]]"

"$mock" --listen "127.0.0.1:$mock_port" --capacity-rps "$capacity" --max-queue-ms "$max_queue_ms" \
  --threads 1 >"$out/logs/mock-upstream.log" 2>&1 &
mock_pid=$!
wait_until 10 "mock-upstream on $mock_url" bash -c "kill -0 $mock_pid && curl -fsS $mock_url/healthz"

"$py" "$here/prepare.py" riders --count "$users" --out "$out/riders.csv"
"$py" "$here/prepare.py" configs --template "$here/surge.gateway.toml" --riders "$out/riders.csv" \
  --out-dir "$out/config" --replicas "$replicas" \
  --proxy-ports "$(IFS=,; echo "${proxy_ports[*]}")" --admin-ports "$(IFS=,; echo "${admin_ports[*]}")" \
  --redis-url "redis://127.0.0.1:$redis_port" --upstream "127.0.0.1:$mock_port" \
  --capacity "$capacity" --share "$share" >/dev/null
if ! "$gateway" check -c "$out/config/surge-gw0.toml" >"$out/logs/gateway-check.txt" 2>&1; then
  cat "$out/logs/gateway-check.txt" >&2
  echo "surge.sh: the generated gateway config does not pass 'gateway check'" >&2
  exit 1
fi

for ((i = 0; i < replicas; i++)); do
  GATEWAY_LOG=warn "$gateway" run -c "$out/config/surge-gw$i.toml" >"$out/logs/gateway-$i.log" 2>&1 &
  gw_pids+=($!)
done
targets=()
for ((i = 0; i < replicas; i++)); do
  admin=http://127.0.0.1:${admin_ports[i]}
  if ! wait_until 30 "gateway $i (Redis backend) on $admin/readyz" \
    bash -c "kill -0 ${gw_pids[i]} && curl -fsS $admin/readyz | grep -q '\"backend\":\"redis\"'"; then
    tail -20 "$out/logs/gateway-$i.log" >&2
    exit 1
  fi
  targets+=("http://127.0.0.1:${proxy_ports[i]}")
done
log "up: redis :$redis_port, mock-upstream :$mock_port ($capacity rps), gateways ${proxy_ports[*]} (admin ${admin_ports[*]}), all on Redis"

budgets=$(grep -o 'refill_per_sec = [0-9.]*, scope = "global"' "$out/config/surge-gw0.toml" | awk '{print $3}' | tr -d , | paste -sd/ -)
budget_sum=$(echo "$budgets" | tr / '\n' | awk '{s += $1} END {printf "%g", s}')
share_pct=$(awk -v s="$share" 'BEGIN {printf "%g", s * 100}')
cat >"$out/run.json" <<JSON
{
  "mode": "$mode",
  "users": $users,
  "spawn_rate": $spawn,
  "run_secs": $run_secs,
  "settle_secs": $settle,
  "capacity_rps": $capacity,
  "max_queue_ms": $max_queue_ms,
  "replicas": $replicas,
  "budgets": "$budgets",
  "budget_sum": "$budget_sum",
  "share_pct": "$share_pct",
  "processes": "${processes:-1}",
  "cpus": $(nproc),
  "git_commit": "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)",
  "started_at": "$(date -Iseconds)"
}
JSON

# --- the phases ------------------------------------------------------------------

# busy_check FILE: records the load average; warns when something else is
# already keeping the CPUs busy (a build, another benchmark): every latency
# measured then is inflated.
busy_check() {
  cut -d' ' -f1-3 /proc/loadavg >"$1"
  local load cpus
  load=$(cut -d' ' -f1 /proc/loadavg)
  cpus=$(nproc)
  if awk -v l="$load" -v c="$cpus" 'BEGIN {exit !(l > c / 2)}'; then
    echo "surge.sh: warning: the machine is already busy (1-min load $load on $cpus CPUs): latencies will be inflated" >&2
  fi
}

# run_phase NAME TARGETS: one headless Locust run into $out/phases/NAME.
run_phase() {
  local name=$1 tgts=$2 dir=$out/phases/$1 rc
  mkdir -p "$dir"
  curl -fsS -X POST "$mock_url/stats/reset" >/dev/null
  log "== phase $name: $users riders -> $tgts for ${run_secs}s"
  busy_check "$dir/loadavg-before"
  local extra=()
  if [[ -n $processes && $processes != 1 ]]; then
    extra=(--processes "$processes")
  fi
  (
    cd "$here"
    export SURGE_TARGETS=$tgts SURGE_RIDERS=$out/riders.csv SURGE_OUT=$dir SURGE_PHASE=$name
    export SURGE_UPSTREAM_STATS=$mock_url/stats SURGE_PROCESSES=${processes:-1}
    [[ $mode == smoke ]] && export SURGE_PROGRESS_SECS=2
    exec timeout -s INT --kill-after=15 $((run_secs + 60)) "$py" -m locust -f "$here/locustfile.py" \
      --headless -u "$users" -r "$spawn" -t "${run_secs}s" --stop-timeout 0 --only-summary \
      --csv "$dir/locust" --html "$dir/locust.html" "${extra[@]}"
  ) >"$dir/locust.log" 2>&1 &
  locust_pid=$!
  # Show the progress lines (and trouble) while it runs; tail ends with Locust.
  # In the background, so that a signal to this script is handled at once.
  tail -n +1 -F --pid="$locust_pid" "$dir/locust.log" 2>/dev/null |
    grep --line-buffered -E "^\[$name\]|CPU usage|cpu threshold|Traceback" &
  progress_pid=$!
  set +e
  wait "$locust_pid"
  rc=$?
  wait "$progress_pid"
  set -e
  locust_pid="" progress_pid=""
  cut -d' ' -f1-3 /proc/loadavg >"$dir/loadavg-after"
  # Locust exits 1 when any request failed: expected when unprotected.
  if ((rc != 0 && rc != 1)); then
    tail -30 "$dir/locust.log" >&2
    echo "surge.sh: Locust failed in phase $name (exit $rc)" >&2
    exit 1
  fi
  if ! compgen -G "$dir/requests-*.csv" >/dev/null; then
    echo "surge.sh: phase $name recorded no requests" >&2
    exit 1
  fi
  local stats
  stats=$(curl -fsS "$mock_url/stats" || echo '{}')
  log "== phase $name done: the service's counters $(echo "$stats" | "$py" -c '
import json, sys
s = json.load(sys.stdin)
print(" ".join("%s=%s" % (k, s.get(k)) for k in ("total", "ok", "failed")))')"
}

run_phase unprotected "$mock_url"
# Let the service's queue (at most max-queue-ms long) drain before phase two.
sleep $((max_queue_ms / 1000 + 1))
run_phase protected "$(IFS=,; echo "${targets[*]}")"

for ((i = 0; i < replicas; i++)); do
  curl -fsS "http://127.0.0.1:${admin_ports[i]}/metrics" >"$out/logs/metrics-gw$i.txt" 2>/dev/null || true
  alive "${gw_pids[i]}" || echo "surge.sh: gateway $i (PID ${gw_pids[i]}) died during the run" >&2
done

# --- the report --------------------------------------------------------------------

log "== report"
report_args=()
[[ $mode == smoke ]] && report_args=(--no-acceptance)
set +e
"$py" "$here/report.py" "$out" "${report_args[@]}"
rc=$?
set -e
if ((rc == 2)); then
  echo "surge.sh: the report could not be made" >&2
  exit 1
fi
if [[ $mode == smoke ]]; then
  if "$py" "$here/report.py" "$out" --check; then
    log "smoke: ok (outputs in $out)"
    exit 0
  fi
  echo "surge.sh: smoke check failed; outputs kept in $out" >&2
  exit 1
fi
log "report: $out/report.md"
if ((rc != 0)); then
  echo "surge.sh: some acceptance points failed (see above)" >&2
  exit 1
fi
log "all acceptance points hold"
