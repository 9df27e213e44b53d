#!/usr/bin/env bash
# Capacity halves: an upstream whose capacity nobody knows, on loopback, with
# rate limits alone and with adaptive concurrency.
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

me=capacity_halves.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

mode=default
users="" spawn="" run_time="" out=""
rate=75 burst=100 workers=8 service_ms=100 timeout_s=3
queue=100 queue_timeout_ms=50 adaptive_min=2 adaptive_max=200 seed=26
think_min=0.2 think_max=0.4
value_opts=("${locust_opts[@]}" "--rate rate a number" "--burst burst a number"
  "--workers workers a number" "--service-ms service_ms a number" "--timeout timeout_s seconds"
  "--queue queue a number" "--queue-timeout-ms queue_timeout_ms a number" "--seed seed a number")
parse_opts "$@"

case $mode in
  default) : "${users:=100}" "${spawn:=50}" "${run_time:=60}" ;;
  quick) : "${users:=100}" "${spawn:=50}" "${run_time:=40}" ;;
  smoke) : "${users:=40}" "${spawn:=40}" "${run_time:=12}" ;;
esac
progress_secs=3
[[ $mode == smoke ]] && progress_secs=2

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

# --- prerequisites -----------------------------------------------------------

need_bins "$gateway" "$mock"
need_venv locust matplotlib

# --- the run folder ------------------------------------------------------------

out_dir capacity-halves capacity-halves-smoke runs

# --- cleanup: everything started here, by PID ------------------------------------

gw_pid=""
mock_pid=""
locust_pid=""
progress_pid=""

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
traps cleanup

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
  "git_commit": "$(git_commit)",
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

# run_one NAME ADAPTIVE(0|1): a fresh mock and gateway, Locust, the halving.
run_one() {
  local name=$1 adaptive=$2 dir=$out/runs/$1 mp pp ap started target wait_s
  mkdir -p "$dir"
  free_ports 3
  mp=${ports[0]} pp=${ports[1]} ap=${ports[2]}
  local mock_url=http://127.0.0.1:$mp admin_url=http://127.0.0.1:$ap proxy_url=http://127.0.0.1:$pp

  "$mock" --listen "127.0.0.1:$mp" --service-ms "$service_ms" --workers "$workers" --threads 2 \
    >"$dir/mock-upstream.log" 2>&1 &
  mock_pid=$!
  wait_until 10 "mock-upstream on $mock_url" bash -c "kill -0 $mock_pid && curl -fsS $mock_url/healthz"

  write_config "$dir/gateway.toml" "$pp" "$ap" "$mp" "$adaptive"
  gateway_check "$dir/gateway.toml" "$dir/gateway-check.txt"
  GATEWAY_LOG=warn "$gateway" run --config "$dir/gateway.toml" >"$dir/gateway.log" 2>&1 &
  gw_pid=$!
  wait_readyz "$gw_pid" "$admin_url" gateway "$dir/gateway.log"
  log "== run $name: mock :$mp ($workers workers, $service_ms ms), gateway :$pp (admin :$ap)$( ((adaptive)) && echo ", adaptive concurrency on")"
  busy_check "$dir/loadavg-before"

  locust_start "$dir" "$name" capacity_halves_locustfile.py "|Error" \
    CH_TARGET="$proxy_url" CH_OUT="$dir" CH_RUN="$name" CH_UPSTREAM="$mock_url" CH_ADMIN="$admin_url" \
    CH_SEED="$seed" CH_TIMEOUT="$timeout_s" CH_THINK_MIN="$think_min" CH_THINK_MAX="$think_max" \
    CH_PROGRESS_SECS="$progress_secs"

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

  locust_wait "$dir"
  curl -fsS "$admin_url/metrics" >"$dir/metrics-end.txt" 2>/dev/null || true
  curl -fsS "$mock_url/stats" >"$dir/upstream-stats-end.json" 2>/dev/null || true
  kill -0 "$gw_pid" 2>/dev/null || echo "$me: the gateway (PID $gw_pid) died during run $name" >&2
  stop_servers
  locust_ok "$dir" "run $name"
  if [[ ! -s $dir/requests.csv || ! -s $dir/halved_at ]]; then
    echo "$me: run $name recorded no requests or no halving" >&2
    exit 1
  fi
  log "== run $name done: $(($(wc -l <"$dir/requests.csv") - 1)) requests; the upstream's counters $(counters total ok failed max_in_flight max_waiting <"$dir/upstream-stats-end.json")"
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
