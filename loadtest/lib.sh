# The load tests' shared shell: sourced (never run) by surge.sh,
# capacity_halves.sh, chaos.sh, matrix.sh and bench.sh, after `set -euo
# pipefail` and with `me` set to the script's name (for its messages).
#
# Sets root, here, venv, py, gateway and mock, and gives: log, usage,
# help_opt, parse_opts, to_secs,
# need_bins, as_root, apt_install, need_venv, fixedrate, out_dir,
# free_ports, stop_pid, wait_until, wait_readyz, nap, busy_check, git_commit, traps,
# gateway_check, locust_start, locust_wait and counters.

root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
here=$root/loadtest
gateway=$root/target/release/gateway
mock=$root/target/release/mock-upstream
venv=$root/.venv
py=$venv/bin/python
lt_script=${BASH_SOURCE[1]}

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*"; }

# usage: the script's header comment, from its line 2 to `set -euo`.
usage() {
  sed -n '2,/^set -euo/p' "$lt_script" | sed '$d' | sed 's/^# \{0,1\}//'
}

# help_opt ARG...: prints usage and exits 0 when one ARG is -h or --help.
help_opt() {
  local arg
  for arg in "$@"; do
    case $arg in -h | --help) usage; exit 0 ;; esac
  done
}

# parse_opts ARG...: the command line: --quick and --smoke (into $mode),
# --help, and the options of $value_opts, each "--flag variable what-it-takes"
# (locust_opts: the Locust scenarios' --users, --spawn-rate, --run-time and
# --out). Exit status 2 on an unknown option, 1 on a missing value.
locust_opts=("--users users a number" "--spawn-rate spawn a number"
  "--run-time run_time a duration" "--out out a folder")
parse_opts() {
  local spec flag var what found
  while (($#)); do
    case $1 in
      --quick) mode=quick ;;
      --smoke) mode=smoke ;;
      -h | --help) usage; exit 0 ;;
      *)
        found=""
        for spec in "${value_opts[@]}"; do
          read -r flag var what <<<"$spec"
          [[ $1 == "$flag" ]] || continue
          if (($# < 2)) || [[ -z $2 ]]; then
            echo "$me: $flag needs $what" >&2
            exit 1
          fi
          printf -v "$var" '%s' "$2"
          shift
          found=1
          break
        done
        [[ -n $found ]] || { echo "$me: unknown option $1 (see --help)" >&2; exit 2; }
        ;;
    esac
    shift
  done
}

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

# need_bins BIN...: exits 1 when one is missing (the scripts never build).
need_bins() {
  local bin
  for bin in "$@"; do
    if [[ ! -x $bin ]]; then
      echo "$me: $bin is missing: build first: cargo build --release" >&2
      exit 1
    fi
  done
}

as_root() {
  if ((EUID == 0)); then "$@"; else sudo "$@"; fi
}

# apt_install [APT-GET OPTION...] PACKAGE...: Debian's packages, quietly. No
# service is started by the install (policy-rc.d, or none in a container):
# the load tests run their own servers in the foreground.
apt_install() {
  local a pkgs=()
  for a in "$@"; do [[ $a == -* ]] || pkgs+=("$a"); done
  log "installing ${pkgs[*]} (apt-get)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}

# need_redis: redis-server and redis-cli, installed when missing.
need_redis() {
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    apt_install redis-server redis-tools
  fi
}

# need_venv MODULE...: the virtualenv, with MODULE... importable; what is
# missing is installed at loadtest/requirements.txt's pins.
need_venv() {
  if [[ ! -x $py ]]; then
    log "creating the virtualenv $venv"
    if ! python3 -m venv "$venv"; then
      apt_install python3-venv
      python3 -m venv "$venv"
    fi
  fi
  if ! "$py" -c "import $(IFS=,; echo "$*")" 2>/dev/null; then
    local m pins=()
    for m in "$@"; do
      pins+=("$(grep -iE "^$m([=<>~ ]|$)" "$here/requirements.txt" || echo "$m")")
    done
    log "installing ${pins[*]} into $venv (loadtest/requirements.txt's pins)"
    "$py" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
  fi
}

# fixedrate: loadtest/bench/fixedrate.c compiled into $tools (C with
# OpenSSL, for its https:// mode) when missing or older than its source.
tools=$here/results/.tools
fixedrate() {
  local need=()
  command -v cc >/dev/null || need+=(gcc libc6-dev)
  [[ -e /usr/include/openssl/ssl.h ]] || need+=(libssl-dev)
  ((${#need[@]} == 0)) || apt_install --no-install-recommends "${need[@]}"
  mkdir -p "$tools"
  if [[ ! -x $tools/fixedrate || $here/bench/fixedrate.c -nt $tools/fixedrate ]]; then
    log "compiling loadtest/bench/fixedrate.c"
    cc -O2 -Wall -o "$tools/fixedrate.tmp" "$here/bench/fixedrate.c" -lssl -lcrypto
    mv "$tools/fixedrate.tmp" "$tools/fixedrate"
  fi
}

# out_dir NAME SMOKE_NAME SUBDIR...: unless --out gave $out, the run folder
# loadtest/results/NAME-<timestamp> (SMOKE_NAME-<timestamp> in smoke mode,
# the older smoke runs' folders removed); made with SUBDIR... in it.
out_dir() {
  local name=$1 smoke=$2 stamp sub
  shift 2
  stamp=$(date +%Y%m%d-%H%M%S)
  if [[ -z $out ]]; then
    if [[ $mode == smoke ]]; then
      # Keep only the latest smoke run's outputs.
      rm -rf -- "$here/results/$smoke"-*
      out=$here/results/$smoke-$stamp
    else
      out=$here/results/$name-$stamp
    fi
  fi
  for sub in "$@"; do mkdir -p "$out/$sub"; done
  out=$(cd -- "$out" && pwd)
}

# free_ports N: N free loopback ports into the array `ports`.
free_ports() {
  mapfile -t ports < <("$py" "$here/prepare.py" ports "$1")
  if ((${#ports[@]} != $1)); then
    echo "$me: could not find free loopback ports" >&2
    exit 1
  fi
}

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

# traps CLEANUP: CLEANUP on every exit, Ctrl-C and SIGTERM included (it
# should start with `local rc=$?; trap - EXIT INT TERM` and end `exit "$rc"`).
traps() {
  trap "$1" EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

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

# wait_readyz PID ADMIN_URL WHAT LOG [PATTERN]: waits up to 30 s for the
# gateway PID to answer ADMIN_URL/readyz (with a body matching PATTERN, when
# given); exits 1, showing the end of its LOG, when it does not.
wait_readyz() {
  local pid=$1 admin=$2 what=$3 log=$4 pattern=${5:-} check
  check="kill -0 $pid && curl -fsS $admin/readyz"
  [[ -z $pattern ]] || check+=" | grep -q '$pattern'"
  if ! wait_until 30 "$what on $admin/readyz" bash -c "$check"; then
    tail -20 "$log" >&2
    exit 1
  fi
}

# nap SECONDS: an interruptible sleep (a signal to the script acts at once).
sleep_pid=""
nap() {
  sleep "$1" &
  sleep_pid=$!
  wait "$sleep_pid" || true
  sleep_pid=""
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

git_commit() {
  git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown
}

# gateway_check CONFIG REPORT: `gateway check` of a generated config (its
# output into REPORT); exits 1 when it does not pass.
gateway_check() {
  if ! "$gateway" check -c "$1" >"$2" 2>&1; then
    cat "$2" >&2
    echo "$me: the generated gateway config does not pass 'gateway check'" >&2
    exit 1
  fi
}

# locust_start DIR NAME LOCUSTFILE GREP [VAR=VALUE...] [-- LOCUST ARG...]:
# headless Locust in the background ($locust_pid) for $run_secs s of
# $users users spawned at $spawn/s, its CSVs and HTML into DIR, its output
# into DIR/locust.log; the lines of it matching "^[NAME]|CPU usage|cpu
# threshold|Traceback" and GREP (e.g. "|Error", or "") shown meanwhile
# ($progress_pid, ends with Locust: in the background so that a signal to the
# script is handled at once). VAR=VALUE: its environment.
locust_start() {
  local dir=$1 name=$2 file=$3 grep_more=$4 envs=()
  shift 4
  while (($#)) && [[ $1 != -- ]]; do
    envs+=("$1")
    shift
  done
  (($#)) && shift
  (
    cd "$here"
    exec env "${envs[@]}" timeout -s INT --kill-after=15 $((run_secs + 60)) "$py" -m locust -f "$here/$file" \
      --headless -u "$users" -r "$spawn" -t "${run_secs}s" --stop-timeout 0 --only-summary \
      --csv "$dir/locust" --html "$dir/locust.html" "$@"
  ) >"$dir/locust.log" 2>&1 &
  locust_pid=$!
  tail -n +1 -F --pid="$locust_pid" "$dir/locust.log" 2>/dev/null |
    grep --line-buffered -E "^\[$name\]|CPU usage|cpu threshold|Traceback$grep_more" &
  progress_pid=$!
}

# locust_wait DIR: waits for locust_start's Locust; its exit status into
# $locust_rc; the load average after into DIR/loadavg-after.
locust_wait() {
  set +e
  wait "$locust_pid"
  locust_rc=$?
  wait "$progress_pid"
  set -e
  locust_pid="" progress_pid=""
  cut -d' ' -f1-3 /proc/loadavg >"$1/loadavg-after"
}

# locust_ok DIR WHAT: exits 1 unless $locust_rc is 0 or 1 (Locust exits 1
# when any request failed: expected without the gateway's protection).
locust_ok() {
  if ((locust_rc != 0 && locust_rc != 1)); then
    tail -30 "$1/locust.log" >&2
    echo "$me: Locust failed in $2 (exit $locust_rc)" >&2
    exit 1
  fi
}

# counters KEY... <STATS.json: "KEY=value ..." of the mock upstream's /stats.
counters() {
  "$py" -c '
import json, sys
try:
    s = json.load(sys.stdin)
except Exception:
    s = {}
print(" ".join("%s=%s" % (k, s.get(k)) for k in sys.argv[1:]))' "$@"
}
