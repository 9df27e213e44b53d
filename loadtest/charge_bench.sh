#!/usr/bin/env bash
# The cost of `charge`: a route charged by the answer (LLM tokens read from
# the JSON or SSE usage) against the same route without `charge`, both in
# one gateway on one mock upstream, measured side by side in one run.
#
#   loadtest/charge_bench.sh [--rounds 3] [--duration 4] [--connections 16]
#                            [--triples 200] [--window 50] [--chunk-ms 20] [--ttfb-tokens 1]
#                            [--max-tokens 256] [--body-pad 0] [--variants redis[,local]]
#                            [--threads 2] [--cpu-limit 1.1] [--no-ttfb]
#                            [--out DIR]
#
#   loadtest/charge_bench.sh                          # 3 rounds, about 3 minutes
#   loadtest/charge_bench.sh --rounds 1 --triples 50  # a quick look, about a minute
#   loadtest/charge_bench.sh --variants redis,local   # the local backend too (about twice as long)
#   loadtest/charge_bench.sh --out DIR --report-only  # summary.md, .json and the PNG again from DIR
#
# Four targets per variant: plain-json, charged-json, plain-sse, charged-sse.
# Each round (the order forward, reversed, ...): max throughput with wrk
# (rps, the gateway's CPU per request, Redis script calls per request), then
# time to first byte from one client sending triples (plain, plain,
# charged, in rotating order, on one connection) in paired windows of 50.
# Checks: CPU per request charged / plain <= 1.1; the TTFB charge adds
# within the noise of the paired windows (how far plain lands from plain);
# Redis calls per request of charged <= plain's. loadtest/charge_bench.py's docstring has the
# details.
#
# Writes loadtest/results/charge-<timestamp>/ (summary.md, summary.json,
# charge.png, raw/, config/, logs/). Needs target/release/{gateway,mock-upstream}
# (it never builds them; it runs copies taken at its start), wrk,
# redis-server (installed with apt-get when missing) and matplotlib in .venv.
# Everything runs on 127.0.0.1; every process it starts is stopped by PID.
# Exit status: 0 when every check holds, 1 otherwise, 2 on bad usage.
set -euo pipefail

me=charge_bench.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

help_opt "$@"
need_bins "$gateway" "$mock"
need_redis
command -v wrk >/dev/null || apt_install wrk
need_venv matplotlib
args=("$@")
if [[ " $* " != *" --out "* ]]; then
  args+=(--out "$here/results/charge-$(date +%Y%m%d-%H%M%S)")
fi
exec "$py" "$here/charge_bench.py" --gateway "$gateway" --mock "$mock" "${args[@]}"
