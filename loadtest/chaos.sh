#!/usr/bin/env bash
# The chaos soak: three gateway replicas sharing Redis, one API key's plan
# (50 + 20/s, and a monthly quota that never binds) under a seeded schedule
# of faults (Redis stalled or restarted, a replica's link to Redis
# blackholed, a replica killed or stopped with SIGTERM, a config reloaded).
# At the end the quota's `used` is checked against the upstream's count.
#
#   loadtest/chaos.sh [--seeds 1,2,3 | --runs N --seed-base S] [--duration SECS]
#                     [--clients N] [--out DIR] [--bin-dir DIR]
#                     [--max-fallback-after-heal SECS] [--slack N]
#                     [--faults KIND,... | --faults none] [--quota N] [--redis-dir DIR]
#
#   loadtest/chaos.sh --runs 1 --duration 30    # a quick check, about 40 s
#   loadtest/chaos.sh --runs 3 --duration 60    # about 3.5 min
#   loadtest/chaos.sh                           # seeds 1..10, 90 s each: ~16 min
#   loadtest/chaos.sh --runs 1 --faults redis-stall   # one kind of fault only
#
# Writes loadtest/results/chaos-<timestamp>/ (summary.json, table.md,
# chaos.png, seed-<S>/ per run). Everything runs on 127.0.0.1; every process
# it starts is stopped by PID, Ctrl-C included. See loadtest/chaos.py's
# docstring (chaos.sh --help) for what a run does and the exit status.
#
# Needs target/release/{gateway,tcp-forwarder} (it never builds them),
# redis-server (installed with apt-get when missing) and matplotlib in .venv
# (installed from loadtest/requirements.txt's pin when missing).
set -euo pipefail

me=chaos.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

need_redis
# Only matplotlib is needed here (not Locust): install just its pinned line.
need_venv matplotlib

exec "$py" "$here/chaos.py" "$@"
