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

me=surge.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

mode=default
users="" spawn="" run_time="" capacity="" processes="" out=""
max_queue_ms=2000
replicas=3
share=0.9
value_opts=("${locust_opts[@]}" "--capacity capacity a number"
  "--max-queue-ms max_queue_ms a number" "--processes processes a number")
parse_opts "$@"

case $mode in
  default) : "${users:=200}" "${spawn:=20}" "${run_time:=120}" "${capacity:=50}" ;;
  quick) : "${users:=200}" "${spawn:=40}" "${run_time:=50}" "${capacity:=50}" ;;
  smoke) : "${users:=20}" "${spawn:=20}" "${run_time:=8}" "${capacity:=20}" ;;
esac
settle=5
[[ $mode == smoke ]] && settle=1

run_secs=$(to_secs "$run_time") || { echo "$me: bad --run-time '$run_time'" >&2; exit 2; }
[[ $users =~ ^[1-9][0-9]*$ ]] || { echo "$me: --users must be a whole number" >&2; exit 2; }
for v in spawn capacity; do
  [[ ${!v} =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$me: --${v/spawn/spawn-rate} must be a number" >&2; exit 2; }
done
[[ $max_queue_ms =~ ^[0-9]+$ ]] || { echo "$me: --max-queue-ms must be a whole number" >&2; exit 2; }
[[ -z $processes || $processes =~ ^[1-9][0-9]*$ ]] || { echo "$me: --processes must be a number" >&2; exit 2; }
((run_secs >= 2)) || { echo "$me: --run-time must be at least 2 s" >&2; exit 2; }

# --- prerequisites -----------------------------------------------------------

need_bins "$gateway" "$mock"
need_redis
need_venv locust matplotlib

# --- the run folder ------------------------------------------------------------

out_dir surge smoke config logs phases

# --- cleanup: everything started here, by PID ------------------------------------

gw_pids=()
mock_pid=""
redis_pid=""
locust_pid=""
progress_pid=""

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
traps cleanup

# --- servers ---------------------------------------------------------------------

alive() {
  kill -0 "$1" 2>/dev/null
}

free_ports $((2 * replicas + 2))
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
gateway_check "$out/config/surge-gw0.toml" "$out/logs/gateway-check.txt"

for ((i = 0; i < replicas; i++)); do
  GATEWAY_LOG=warn "$gateway" run -c "$out/config/surge-gw$i.toml" >"$out/logs/gateway-$i.log" 2>&1 &
  gw_pids+=($!)
done
targets=()
for ((i = 0; i < replicas; i++)); do
  admin=http://127.0.0.1:${admin_ports[i]}
  wait_readyz "${gw_pids[i]}" "$admin" "gateway $i (Redis backend)" "$out/logs/gateway-$i.log" '"backend":"redis"'
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
  "git_commit": "$(git_commit)",
  "started_at": "$(date -Iseconds)"
}
JSON

# --- the phases ------------------------------------------------------------------

# run_phase NAME TARGETS: one headless Locust run into $out/phases/NAME.
run_phase() {
  local name=$1 tgts=$2 dir=$out/phases/$1 rc
  mkdir -p "$dir"
  curl -fsS -X POST "$mock_url/stats/reset" >/dev/null
  log "== phase $name: $users riders -> $tgts for ${run_secs}s"
  busy_check "$dir/loadavg-before"
  local vars=(SURGE_TARGETS="$tgts" SURGE_RIDERS="$out/riders.csv" SURGE_OUT="$dir" SURGE_PHASE="$name"
    SURGE_UPSTREAM_STATS="$mock_url/stats" SURGE_PROCESSES="${processes:-1}") extra=()
  [[ $mode == smoke ]] && vars+=(SURGE_PROGRESS_SECS=2)
  if [[ -n $processes && $processes != 1 ]]; then
    extra=(--processes "$processes")
  fi
  locust_start "$dir" "$name" locustfile.py "" "${vars[@]}" -- "${extra[@]}"
  locust_wait "$dir"
  locust_ok "$dir" "phase $name"
  if ! compgen -G "$dir/requests-*.csv" >/dev/null; then
    echo "$me: phase $name recorded no requests" >&2
    exit 1
  fi
  log "== phase $name done: the service's counters $( (curl -fsS "$mock_url/stats" || echo '{}') | counters total ok failed)"
}

run_phase unprotected "$mock_url"
# Let the service's queue (at most max-queue-ms long) drain before phase two.
sleep $((max_queue_ms / 1000 + 1))
run_phase protected "$(IFS=,; echo "${targets[*]}")"

for ((i = 0; i < replicas; i++)); do
  curl -fsS "http://127.0.0.1:${admin_ports[i]}/metrics" >"$out/logs/metrics-gw$i.txt" 2>/dev/null || true
  alive "${gw_pids[i]}" || echo "$me: gateway $i (PID ${gw_pids[i]}) died during the run" >&2
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
  echo "$me: the report could not be made" >&2
  exit 1
fi
if [[ $mode == smoke ]]; then
  if "$py" "$here/report.py" "$out" --check; then
    log "smoke: ok (outputs in $out)"
    exit 0
  fi
  echo "$me: smoke check failed; outputs kept in $out" >&2
  exit 1
fi
log "report: $out/report.md"
if ((rc != 0)); then
  echo "$me: some acceptance points failed (see above)" >&2
  exit 1
fi
log "all acceptance points hold"
