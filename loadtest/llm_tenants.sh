#!/usr/bin/env bash
# Tenants sharing an LLM upstream: one noisy tenant held at its token budget
# while the others get everything they ask for, on loopback.
#
#   loadtest/llm_tenants.sh [--quick | --smoke] [--duration T] [--replicas N]
#                           [--noisy-users N] [--quiet-users N]
#                           [--capacity TOKENS] [--refill TOKENS_PER_SEC]
#                           [--service-ms MS] [--leases on|off] [--seed N]
#                           [--out DIR]
#
# Starts, on 127.0.0.1 only and on free ports picked at run time: a Redis,
# the mock upstream (target/release/mock-upstream, which answers
# POST .../chat/completions like an LLM API: a random number of tokens up to
# the request's max_tokens, in a JSON body or server-sent events, with the
# usage at the end) and --replicas gateways (default 1) on that Redis, with
# a config made for the run (lt/llm_tenants.py config): three API keys on
# one plan, and a /v1/chat/completions route charged by the answer
# (charge = { response = ["sse:usage.total_tokens", "json:usage.total_tokens"],
# estimate = "json:max_tokens", default_estimate = 256, max = 4096 }) whose
# limit is a token bucket per tenant counting those tokens (capacity 20000,
# refill 333/s: 20,000 a minute, cost = "response", scope = "client").
# Locust (loadtest/llm_tenants_locustfile.py) then runs the tenants:
#   A  noisy: 14 users, max_tokens 2000, half streamed, 0.2-0.6 s apart,
#      no back-off: about a hundred times its budget
#   B  quiet: 3 users, max_tokens 256, JSON answers, 2-4 s apart
#   C  quiet: 3 users, streamed, half with max_tokens 256 and half without
# (20 users in all). A progress line every 5 s gives each tenant's 2xx/s,
# 429/s and the tokens/s the upstream reported. Then it reads the truth from
# the upstream (GET /stats/llm: every usage it reported, per tenant) and
# writes loadtest/results/llm-tenants-<timestamp>/: report.md (per tenant:
# requests sent, admitted, 429s, tokens reported, the most in any 60 s window
# against the bucket's bound C + 60 r, held or not; the acceptance points),
# summary.json, llm-tenants.png (tokens per second per tenant with the
# budget's rate, tokens in the trailing 60 s with the bound, requests per
# second), Locust's CSVs and HTML report (locust/), the configs (config/),
# the servers' logs, /metrics and /limits (logs/), upstream-llm.json.
#
#   (default)  90 s
#   --quick    60 s
#   --smoke    12 s, 6 noisy and 2+2 quiet users; checks that summary.json,
#              report.md and the PNG are made and well formed (about 20 s)
# --leases off turns the gateway's token leases off ([limiter.leases]; on
# by default, as in the gateway). Explicit options win over the presets. --duration (or --run-time) takes
# seconds or Locust's 90s / 3m / 1m30s forms.
#
# Exit status: 0 when every acceptance point holds (--smoke: when the
# outputs are well formed), 1 otherwise, 2 on bad usage. Everything it starts
# is stopped on exit, by PID.
#
# Needs target/release/gateway and target/release/mock-upstream (it never
# builds them), redis-server (installed with apt-get when missing) and
# Locust and matplotlib in .venv (installed from loadtest/requirements.txt
# when missing).
set -euo pipefail

me=llm_tenants.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

mode=default
run_time="" out="" noisy_users="" quiet_users=""
replicas=1 capacity=20000 refill=333 service_ms=50 seed=7 leases=on
value_opts=("--duration run_time a duration" "--run-time run_time a duration" "--out out a folder"
  "--replicas replicas a number" "--noisy-users noisy_users a number" "--quiet-users quiet_users a number"
  "--capacity capacity a number" "--refill refill a number" "--service-ms service_ms a number"
  "--leases leases on-or-off" "--seed seed a number")
parse_opts "$@"

case $mode in
  default) : "${run_time:=90}" "${noisy_users:=14}" "${quiet_users:=3}" ;;
  quick) : "${run_time:=60}" "${noisy_users:=14}" "${quiet_users:=3}" ;;
  smoke) : "${run_time:=12}" "${noisy_users:=6}" "${quiet_users:=2}" ;;
esac
progress_secs=5
[[ $mode == smoke ]] && progress_secs=3

run_secs=$(to_secs "$run_time") || { echo "$me: bad --duration '$run_time'" >&2; exit 2; }
for v in replicas noisy_users quiet_users capacity service_ms seed; do
  [[ ${!v} =~ ^[0-9]+$ ]] || { echo "$me: --${v//_/-} must be a whole number" >&2; exit 2; }
done
[[ $leases == on || $leases == off ]] || { echo "$me: --leases must be on or off" >&2; exit 2; }
[[ $refill =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$me: --refill must be a number" >&2; exit 2; }
((replicas >= 1 && replicas <= 8)) || { echo "$me: --replicas must be 1 to 8" >&2; exit 2; }
((noisy_users >= 1 && quiet_users >= 1)) || { echo "$me: --noisy-users and --quiet-users must be at least 1" >&2; exit 2; }
((run_secs >= 5)) || { echo "$me: --duration must be at least 5 s" >&2; exit 2; }
users=$((noisy_users + 2 * quiet_users))
spawn=$users # everyone within the first second
threads=2
((replicas > 1)) && threads=1

# --- prerequisites -----------------------------------------------------------

need_bins "$gateway" "$mock"
need_redis
need_venv locust matplotlib

# --- the run folder ------------------------------------------------------------

out_dir llm-tenants llm-tenants-smoke config logs locust

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
  stop_pid "$sleep_pid" TERM 1
  stop_pid "$locust_pid" INT 10
  stop_pid "$progress_pid" TERM 2
  local pid
  for pid in "${gw_pids[@]}"; do
    stop_pid "$pid" INT 10
  done
  stop_pid "$mock_pid" TERM 5
  stop_pid "$redis_pid" TERM 5
  exit "$rc"
}
traps cleanup

# --- servers ---------------------------------------------------------------------

free_ports $((2 * replicas + 2))
redis_port=${ports[0]}
mock_port=${ports[1]}
proxy_ports=("${ports[@]:2:replicas}")
admin_ports=("${ports[@]:2+replicas:replicas}")
mock_url=http://127.0.0.1:$mock_port
admin0=http://127.0.0.1:${admin_ports[0]}

log "run folder: $out"
log "mode $mode: ${run_secs}s; tenant A $noisy_users users (noisy), B and C $quiet_users users each; budget per tenant: token bucket $capacity + $refill/s; $replicas gateway(s), leases $leases"

redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
  --daemonize no --loglevel warning >"$out/logs/redis.log" 2>&1 &
redis_pid=$!
wait_until 10 "redis-server on 127.0.0.1:$redis_port" \
  bash -c "kill -0 $redis_pid && [[ \$(redis-cli -h 127.0.0.1 -p $redis_port ping) == PONG ]]"

"$mock" --listen "127.0.0.1:$mock_port" --service-ms "$service_ms" --threads 1 \
  >"$out/logs/mock-upstream.log" 2>&1 &
mock_pid=$!
wait_until 10 "mock-upstream on $mock_url" bash -c "kill -0 $mock_pid && curl -fsS $mock_url/healthz"

(cd "$here" && "$py" -m lt.llm_tenants config --out "$out" --replicas "$replicas" \
  --proxy-ports "$(IFS=,; echo "${proxy_ports[*]}")" --admin-ports "$(IFS=,; echo "${admin_ports[*]}")" \
  --redis-url "redis://127.0.0.1:$redis_port" --upstream "127.0.0.1:$mock_port" --threads "$threads" \
  --leases "$leases" --capacity "$capacity" --refill "$refill" --noisy-users "$noisy_users" --quiet-users "$quiet_users") >/dev/null
gateway_check "$out/config/gateway-0.toml" "$out/logs/gateway-check.txt"

for ((i = 0; i < replicas; i++)); do
  GATEWAY_LOG=warn "$gateway" run -c "$out/config/gateway-$i.toml" >"$out/logs/gateway-$i.log" 2>&1 &
  gw_pids+=($!)
done
targets=()
for ((i = 0; i < replicas; i++)); do
  wait_readyz "${gw_pids[i]}" "http://127.0.0.1:${admin_ports[i]}" "gateway $i (Redis backend)" \
    "$out/logs/gateway-$i.log" '"backend":"redis"'
  targets+=("http://127.0.0.1:${proxy_ports[i]}")
done
log "up: redis :$redis_port, mock-upstream :$mock_port (LLM answers, ${service_ms} ms), gateway(s) ${proxy_ports[*]} (admin ${admin_ports[*]})"

cat >"$out/run.json" <<JSON
{
  "mode": "$mode",
  "run_secs": $run_secs,
  "users": $users,
  "noisy_users": $noisy_users,
  "quiet_users": $quiet_users,
  "noisy_max_tokens": 2000,
  "quiet_max_tokens": 256,
  "capacity": $capacity,
  "refill": $refill,
  "default_estimate": 256,
  "max": 4096,
  "replicas": $replicas,
  "leases": "$leases",
  "service_ms": $service_ms,
  "seed": $seed,
  "cpus": $(nproc),
  "gateway_mtime": "$(date -r "$gateway" -Iseconds)",
  "git_commit": "$(git_commit)",
  "started_at": "$(date -Iseconds)"
}
JSON

# --- the load --------------------------------------------------------------------

dir=$out/locust
curl -fsS -X POST "$mock_url/stats/reset" >/dev/null
log "== load: $users users (A $noisy_users, B $quiet_users, C $quiet_users) -> ${targets[*]} for ${run_secs}s"
busy_check "$dir/loadavg-before"
locust_start "$dir" "llm-tenants" llm_tenants_locustfile.py "|Error" \
  LT_TARGETS="$(IFS=,; echo "${targets[*]}")" LT_TENANTS="$out/tenants.json" LT_OUT="$dir" \
  LT_UPSTREAM="$mock_url" LT_SEED="$seed" LT_PROGRESS_SECS="$progress_secs"
locust_wait "$dir"
locust_ok "$dir" "the load"
[[ -s $dir/requests.csv ]] || { echo "$me: no requests recorded" >&2; exit 1; }

# The settlements reach Redis every 100 ms: a second, then the truth and the
# gateways' side of it.
nap 1
curl -fsS "$mock_url/stats/llm" >"$out/upstream-llm.json"
curl -fsS "$mock_url/stats" >"$out/logs/upstream-stats.json" 2>/dev/null || true
for t in tenant-a tenant-b tenant-c; do
  curl -fsS "$admin0/limits?key=$t" >"$out/logs/limits-$t.json" 2>/dev/null || true
done
for ((i = 0; i < replicas; i++)); do
  curl -fsS "http://127.0.0.1:${admin_ports[i]}/metrics" >"$out/logs/metrics-gw$i.txt" 2>/dev/null || true
  kill -0 "${gw_pids[i]}" 2>/dev/null || echo "$me: gateway $i (PID ${gw_pids[i]}) died during the run" >&2
done
log "== load done: $(($(wc -l <"$dir/requests.csv") - 1)) requests; the upstream reported $("$py" -c 'import json,sys; print(json.load(sys.stdin)["reported_total"])' <"$out/upstream-llm.json") tokens"

# --- the report --------------------------------------------------------------------

log "== report"
set +e
(cd "$here" && "$py" -m lt.llm_tenants report "$out")
rc=$?
set -e
if ((rc == 2)); then
  echo "$me: the report could not be made" >&2
  exit 1
fi
if ! (cd "$here" && "$py" -m lt.llm_tenants check "$out"); then
  echo "$me: the outputs are incomplete; kept in $out" >&2
  exit 1
fi
if [[ $mode == smoke ]]; then
  log "smoke: ok (outputs in $out)"
  exit 0
fi
log "report: $out/report.md"
if ((rc != 0)); then
  echo "$me: some acceptance points failed (see above)" >&2
  exit 1
fi
log "all acceptance points hold"
