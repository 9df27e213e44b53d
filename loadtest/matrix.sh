#!/usr/bin/env bash
# The holdout matrix: the gateway's in-flight caps (adaptive
# concurrency) on upstreams of many shapes, each one's capacity halving under
# a steady 2x overload, on loopback.
#
#   loadtest/matrix.sh [--quick | --smoke] [--shapes 4x20,8x50,...]
#                      [--variants adaptive_q50,adaptive_q1000,rate_limit]
#                      [--phase-secs P1,P2] [--warmup S] [--settle S]
#                      [--connections N] [--out DIR]
#
#   (default)  workers {4,8,32} x service {20,50,200} ms x 3 variants:
#              27 runs, phases 10 + 10 s: about 13 minutes
#   --quick    shapes 4x200, 8x50, 32x20 (every W and S once), phases 8 + 8 s:
#              9 runs, about 3 minutes
#   --smoke    shape 8x20, phases 3 + 4 s: 3 runs, about 40 s; checks only
#              that summary.json, summary.md and the plots are made and well
#              formed (the latest smoke run is kept, older ones removed)
#
# Compiles loadtest/bench/fixedrate.c into loadtest/results/.tools/ when it
# is missing or older than its source (as bench.sh does), makes sure of
# matplotlib in .venv, then runs loadtest/matrix.py (its docstring says what
# each run does and what is measured). Needs target/release/gateway and
# target/release/mock-upstream: it never builds them (it runs a copy of them
# taken at the start, so a rebuild meanwhile does not mix builds).
#
# Writes loadtest/results/matrix-<timestamp>/ (--out): summary.md,
# summary.json, matrix.png, goodput.png, runs/<WxS>-<variant>/.
# Exit status: 0 when every run completed and the outputs are well formed
# (the matrix's targets are reported PASS/FAIL, never change it), 1 otherwise,
# 2 on bad usage. Everything started is stopped by PID, Ctrl-C included.
set -euo pipefail

me=matrix.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

help_opt "$@"

need_bins "$gateway" "$mock"
need_venv matplotlib
fixedrate

# Python in the background, so a signal to this script is passed on to it
# (by its PID) and it stops what it started.
"$py" -u "$here/matrix.py" run --fixedrate "$tools/fixedrate" "$@" &
pid=$!
trap 'kill -INT "$pid" 2>/dev/null || true' INT
trap 'kill -TERM "$pid" 2>/dev/null || true' TERM
rc=0
while :; do
  wait "$pid" && rc=0 || rc=$?
  # wait returns early (>128) when a trapped signal arrives: wait again.
  kill -0 "$pid" 2>/dev/null || break
done
trap - INT TERM
case $rc in
  0) log "$me: done" ;;
  2) ;;
  130 | 143) log "$me: interrupted" ;;
  *) log "$me: finished with status $rc (see above)" ;;
esac
exit "$rc"
