#!/usr/bin/env bash
# The fast-path benchmark: the gateway side by side with nginx and with Pingora
# alone, on loopback.
#
#   loadtest/bench.sh [--quick] [--duration SECS] [--connections N] [--threads N]
#                     [--rounds N] [--latency-duration SECS] [--warmup SECS]
#                     [--wrk-threads N] [--upstream-threads N] [--rate RPS]
#                     [--paired-rounds N] [--lease-period-ms N]
#                     [--targets a,b,...] [--memory | --no-memory | --memory-only]
#                     [--memory-clients N] [--memory-max-entries N] [--no-memory-redis]
#                     [--clients N [--zipf S] [--over PCT]] [--cluster-nodes N]
#                     [--client-capacity C] [--client-refill R]
#                     [--shapes hot,crowd,near]
#                     [--anchor-connections N] [--redis-idle SECS]
#                     [--gateway-bin PATH [--gateway-note TEXT]]
#                     [--bin-dir DIR] [--perf] [--publish] [--out DIR] [--no-build]
#
# Targets, each measured in every round, rounds alternating the order
# (forward, reversed, ...) so drift in the machine hits all alike:
#   direct                the load generator against the upstream itself
#   nginx_limit_req       nginx proxy_pass (upstream keep-alive) + limit_req
#                         keyed by client address, admitting everything
#   pingora_bare          Pingora alone (examples/bare_proxy.rs): one fixed
#                         upstream peer, default settings, the system allocator;
#                         what Pingora itself costs per request
#   gateway_off           the gateway with no limits configured
#   gateway_local         all three tiers (ip, API key plan, route) on the local backend
#   gateway_local_notop   gateway_local with [admin] top = false (no top-K of
#                         refused clients): beside gateway_local with
#                         --clients N --over P, what the top-K costs
#   gateway_traced_001    gateway_local with [tracing] at sample_ratio 0.01, spans
#                         exported over OTLP/HTTP to a sink of the run's own
#                         (loadtest/bench/otlp_sink.py: reads each batch, 200)
#   gateway_traced_1      the same at 1.0: every request traced and exported
#   gateway_traced_down   the same at 1.0, its collector down (nothing listens
#                         on its otlp_endpoint): every span counted dropped
#   gateway_jwt           gateway_local, the client named by a verified RS256 JWT
#                         (Authorization: Bearer, [auth.jwt] with a key file made
#                         per run) instead of an API key: the JWT target, its
#                         CPU per request against gateway_local's, with a hot
#                         client
#   gateway_key_padded    gateway_local with a header as long as that token beside
#                         its key: the token's bytes without the JWT work (context)
#   gateway_redis         all three tiers on Redis, admitting everything, with
#                         [limiter.shares] enabled = true (standing shares:
#                         each replica deciding its part of every big token
#                         bucket with no Redis call)
#   gateway_redis_unshared  gateway_redis with shares off (no [limiter.shares]):
#                         the "before" beside it in the same run. With --quick
#                         and by default only with --clients, unless --targets
#                         names it
#   gateway_redis_cluster the same as gateway_redis (shares on) on a Redis
#                         Cluster: three masters, no replicas, on 127.0.0.1
#                         (redis-cli --cluster create); [redis] mode = "cluster"
#                         with the three seed URLs
#   gateway_redis_denied  one client already over its route limit, flooding: all 429
#   gateway_tls           gateway_off on its [server.tls] listener: HTTP/1.1 with
#                         keep-alive over TLS (wrk and fixedrate to https://)
#   nginx_tls             nginx_limit_req with `listen ssl`, the same certificate
#   redis_anchor          the standing shares' anchor, envoyproxy/ratelimit's
#                         way: no gateway; a fresh redis-server of its own
#                         driven by loadtest/bench/redis_anchor.c (compiled
#                         into the tools folder like fixedrate.c): per request
#                         three descriptors (the client's address, the API
#                         key, route + client), each INCRBY key 1 + EXPIRE
#                         key 60, from the same N Zipf clients as
#                         wrk-clients.lua, --anchor-connections (8)
#                         connections each with one pipeline in flight; per
#                         round one max-throughput-length window with 16
#                         requests (96 commands) per pipeline and one with 1.
#                         Reported: its requests/s and Redis CPU per request
#                         (INFO cpu delta / requests) beside the gateways'.
#                         Needs --clients; by default measured only with it
#
# Before any window, a target with [limiter.shares] (gateway_redis,
# gateway_redis_cluster) is waited for, up to 15 s with a progress line, until
# its /metrics (admin listener) shows gateway_shares_usable 1, then 1.5 s more
# while its shares fill: the windows measure the steady state. One whose gauge
# never shows 1 is FAILED (named in summary.md, exit status 1), stopped and
# left out; the others are measured.
#
# The TLS pair serves one ECDSA P-256 certificate signed by a CA, both made per
# run with the openssl CLI into the run folder (tls/); ssl protocols TLS 1.2
# and 1.3 on both, each side's default ciphers (the negotiated ones, from
# openssl s_client, are in the summary). Reported, never pass/fail: CPU per
# request gateway_tls / nginx_tls beside gateway_off / nginx_limit_req, and
# what TLS adds on each side.
#
# Per target and round: max throughput (wrk, --connections fixed) with the CPU
# the proxy's processes spent per request (/proc/PID/stat; nginx: master and
# workers), then p50/p99 latency at a fixed rate of half gateway_off's median
# max, measured from each request's intended send time (loadtest/bench/
# fixedrate.c: coordinated-omission corrected). For the Redis targets, Redis's
# CPU per request (INFO cpu) and script calls per request (INFO commandstats),
# both summed over the nodes for the cluster (each node's share kept too),
# bytes on the wire to Redis per request, and bytes per bucket (MEMORY USAGE
# of sampled keys; used_memory growth per key when many are held; n/a when
# nothing is left to sample). Before each Redis target's max-throughput window
# (and the anchor's), Redis's idle CPU over --redis-idle seconds (2) with the
# gateway connected and no load; the per-request figures above idle subtract
# it. The
# cluster's targets (outgrowing one Redis), passed or failed: its Redis CPU
# per decision <= 1.5x standalone's, its gateway CPU per request <= 1.2x
# standalone's.
# With gateway_local and gateway_redis both measured, --paired-rounds windows
# (default twice --rounds) then drive the two at once, half the fixed rate
# each, and pool each one's latencies: the leases' p99 added over
# gateway_local is taken from them, since the machine's noise lands on both
# alike.
# Each number reported is the median of the rounds. For context (reported, never
# pass/fail): gateway_off's and nginx_limit_req's CPU per request relative to
# pingora_bare's.
# The standing shares' targets, with --clients only, passed or failed and each
# shown beside gateway_redis_unshared's figure (the before): gateway_redis max
# rps >= 0.95x gateway_local's; its Redis CPU per request <= 2 µs and <= 1/4 of
# the anchor's (16 per pipeline); script calls per request <= 0.01;
# gateway_redis_cluster's Redis CPU per request above idle <= 1.3x
# gateway_redis's.
#
# Writes loadtest/results/bench-<timestamp>/: summary.json, summary.md (the
# table, with the targets passed or failed), chart.png, the configs, the
# logs and every raw wrk/fixedrate/redis_anchor result.
#
#   (default)        3 rounds, 15 s max-throughput + 15 s fixed-rate windows,
#                    then the memory step: about 27 minutes (12 targets: all
#                    but gateway_redis_unshared and redis_anchor)
#   --quick          3 rounds of 5 s + 4 s windows, no memory step: about 9 minutes
#                    (those 12; each takes 3 × 14.4 s with Redis's idle
#                    sample; with --clients also gateway_redis_unshared, the
#                    same, and redis_anchor, 3 × 14.6 s)
#   --memory         add the memory step (the default outside --quick): a gateway
#                    on the local backend with local_max_entries = 1,000,000 and
#                    an ip tier is sent 1.2 million distinct clients (wrk naming
#                    each in X-Forwarded-For from trusted 127.0.0.1); its VmRSS
#                    before, at the cap and after. Then its Redis variant
#                    (standing shares): the same on the Redis backend (a fresh
#                    redis-server of its own) with [limiter.shares] enabled =
#                    true and an ip tier of 1,000,000 tokens refilling
#                    1,000,000/s (cut into a pool and standing shares;
#                    gateway.memory-redis.toml), sent once its /metrics shows
#                    gateway_shares_usable 1 and 1.5 s more (up to 15 s, else
#                    FAILED, exit status 1): VmRSS before, at the cap and after,
#                    gateway_shares_entries along the way and at the end (a
#                    target: <= local_max_entries), bytes per client ((RSS at
#                    the cap - before) / share entries then), Redis's keys
#                    (DBSIZE) and used_memory at the end. Both side by side in
#                    summary.md/.json (memory, memory_redis) and memory.png.
#                    About two minutes each; --no-memory-redis: the local one only
#   --memory-only    only the memory step
#   --clients N      many-clients mode: in the max-throughput windows of
#                    gateway_local, gateway_redis, gateway_redis_unshared and
#                    gateway_redis_cluster, wrk (wrk-clients.lua) sends each
#                    request from one of N clients, named in X-Forwarded-For
#                    from trusted 127.0.0.1, Zipf-distributed (--zipf S, 1.0:
#                    rank r sends in proportion to 1/r^S); --over PCT (3) % of
#                    the clients are over their limit (a route allowing each
#                    one request, capacity 1, refill 0.000001/s: 429s after).
#                    The per-client buckets (the ip tier and the route's
#                    per-client bucket) hold 1,000,000 tokens and refill
#                    1,000,000/s, every target alike (the ip tier's:
#                    --client-capacity, --client-refill): full again within a
#                    second, a crowd far below its limits (a standing share of
#                    a bucket refilling slower would never fill). Adds
#                    gateway_redis_unshared and redis_anchor to the default
#                    targets and the standing shares' checks. Latency windows
#                    keep one client.
#   --client-capacity C, --client-refill R  the crowd's ip tier: C tokens
#                    refilling R/s (1,000,000 and 1,000,000 by default; with
#                    --shapes, the near shape's: 100 and 10 by default). The
#                    route's per-client bucket stays 1,000,000 at 1,000,000/s:
#                    with one API key for every client it is one shared bucket
#   --shapes LIST    crowd shapes side by side in one run (hot, crowd, near;
#                    crowd-near is near): gateway_local, gateway_redis,
#                    gateway_redis_unshared and gateway_redis_cluster (those
#                    of --targets; by default the first three) run once per
#                    shape, each its own gateway, named <target>@<shape>,
#                    grouped by shape, every round alternating the order
#                    across all of them:
#                      hot    one client, as without --clients (the leases'
#                             hot client)
#                      crowd  --clients N (1,000,000 unless given) Zipf
#                             clients, every per-client bucket 1,000,000 at
#                             1,000,000/s: the crowd far below its limits
#                      near   the same crowd, the ip tier --client-capacity
#                             refilling --client-refill/s (100 and 10): its
#                             head over its limit, a quarter or so of the
#                             requests refused
#                    Per shape and round in summary.md (a table) and
#                    shapes.png (a plot): max rps of each, its ratio to
#                    gateway_local's in the same round, proxy CPU µs/req,
#                    Redis CPU µs/req (gross and above idle), script calls
#                    and all Redis commands per request, the share answered
#                    429, the share decided on a share / lease / Redis call /
#                    denied cache / fallback (gateway_limiter_decisions_total
#                    {path}) and the refusals per request by tier
#                    (gateway_ratelimit_decisions_total{decision="rejected"}).
#                    Checked: per shape, gateway_redis rps >= 0.97x
#                    gateway_local's (the median of the per-round ratios);
#                    near: Redis CPU above idle <= 1 µs and script calls <=
#                    0.01 per request. The bench's other checks read the hot
#                    shape's targets, the standing shares' the crowd's. The
#                    near shape has no latency window (its one client at the
#                    fixed rate would be refused by its own ip tier); the
#                    paired windows drive the hot pair
#   --anchor-connections  redis_anchor's connections to its Redis (8)
#   --gateway-bin    measure this gateway binary, not target/release/gateway
#                    (an A/B, or a commit built elsewhere); --gateway-note says
#                    what it is, in the summary
#   --bin-dir DIR    take gateway, mock-upstream and examples/bare_proxy from
#                    DIR, not target/release (a worktree with no build of its
#                    own); needs --no-build
#   --perf           also record a perf profile of each proxy during one extra
#                    max-throughput window (perf-<target>.txt, .data)
#   --publish        copy the table and chart into docs/benchmarks.md
#   --cluster-nodes  the masters of gateway_redis_cluster (3); 1 is a control:
#                    cluster mode's own cost, on one process like standalone
#   --threads        the gateway's server.threads = nginx's worker_processes
#                    = bare_proxy's --threads (2)
#   --upstream-threads  mock-upstream's --threads (1)
#
# Everything it starts (redis-server, mock-upstream, nginx, bare_proxy,
# gateways) listens on 127.0.0.1 at free ports and is stopped by PID on exit.
# The gateways run with GATEWAY_LOG=warn (no access log). Exit status: 0 when
# every target holds, 1 when one fails (the results are still
# written) or the build fails, 2 on bad usage or a failed run.
#
# Builds what it measures first: cargo build --release --workspace --bin gateway
# --bin mock-upstream --example bare_proxy (a no-op when fresh; --no-build skips it
# and measures the binaries already in target/release). Installs what it lacks:
# wrk, nginx, redis-server, redis-tools, openssl, a C compiler and OpenSSL's
# headers with apt-get; matplotlib into the repo's .venv with pip.
set -euo pipefail

me=bench.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

help_opt "$@"

command -v cargo >/dev/null || PATH=$HOME/.cargo/bin:$PATH

# Build what is measured: cargo is a no-op when the binaries are fresh. Others
# may be editing src/ meanwhile; --no-build measures the binaries as they are.
no_build=0
bin_dir=$root/target/release
prev=""
for arg in "$@"; do
  case $arg in --no-build) no_build=1 ;; esac
  [[ $prev == --bin-dir ]] && bin_dir=$arg
  prev=$arg
done
bins=("$bin_dir/gateway" "$bin_dir/mock-upstream" "$bin_dir/examples/bare_proxy")
if [[ $bin_dir != "$root/target/release" ]] && ((!no_build)); then
  echo "bench.sh: --bin-dir measures binaries built elsewhere: add --no-build" >&2
  exit 2
fi
if ((no_build)); then
  for bin in "${bins[@]}"; do
    if [[ ! -x $bin ]]; then
      echo "bench.sh: --no-build, but $bin is missing" >&2
      exit 1
    fi
  done
else
  echo "bench.sh: cargo build --release --workspace --bin gateway --bin mock-upstream --example bare_proxy" >&2
  if ! (cd "$root" && cargo build --release --workspace --bin gateway --bin mock-upstream --example bare_proxy); then
    echo "bench.sh: the build failed (nothing measured); --no-build measures the binaries already built" >&2
    exit 1
  fi
fi

need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || need+=(nginx)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v openssl >/dev/null || need+=(openssl)
((${#need[@]} == 0)) || apt_install "${need[@]}"
export PATH=$PATH:/usr/sbin

need_venv matplotlib
# The fixed-rate load generator, compiled when its source is newer.
fixedrate

args=()
for arg in "$@"; do
  [[ $arg == --no-build ]] || args+=("$arg")
done
exec "$py" "$here/bench/bench.py" run --tools "$tools" "${args[@]}"
