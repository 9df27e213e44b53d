#!/usr/bin/env bash
# Identity at scale: `gateway check`, start-up, reload and memory with a
# keys file of 10,000, 100,000 and 1,000,000 keys, beside an empty one, and
# (--p99) the p99 of admitted requests while a million keys reload back to
# back, against windows with no reload in the same run.
#
#   loadtest/keys.sh [--sizes 10000,100000,1000000] [--repeat 3] [--p99]
#                    [--rate 2000] [--window 8] [--pairs 3] [--out DIR]
#
#   loadtest/keys.sh --sizes 10000 --repeat 1   # a quick look, about 10 s
#   loadtest/keys.sh --p99                      # the full table, about 3 min
#
# Writes loadtest/results/keys-<timestamp>/ (summary.md, summary.json,
# keys.png, logs/). Needs target/release/{gateway,mock-upstream} (it never
# builds them) and matplotlib in .venv. Everything runs on 127.0.0.1.
set -euo pipefail

me=keys.sh
source "$(dirname -- "${BASH_SOURCE[0]}")/lib.sh"

help_opt "$@"
need_bins "$gateway" "$mock"
need_venv matplotlib
fixedrate
args=("$@")
if [[ " $* " != *" --out "* ]]; then
  args+=(--out "$here/results/keys-$(date +%Y%m%d-%H%M%S)")
fi
exec "$py" "$here/keys.py" --fixedrate "$tools/fixedrate" "${args[@]}"
