#!/usr/bin/env python3
"""The chaos soak: three gateway replicas sharing one Redis, sprayed with one
API key's requests while a seeded schedule breaks Redis, the replicas' links
to it, and the replicas themselves. Checks that the key's plan (capacity 50,
refill 20/s) still holds across the whole run, that nothing answers 5xx, how
long each replica stays on its fallback after a fault heals, and that the
plan's monthly quota (1,000,000: it never binds) ends with `used` equal to
what the upstream received, but for what SIGKILLs explain (the quota check).

    chaos.py [--seeds 1,2,3 | --runs N --seed-base S] [--duration SECS]
             [--clients N] [--out DIR] [--bin-dir DIR]
             [--max-fallback-after-heal SECS] [--slack N]
             [--faults KIND,... | --faults none] [--quota N] [--redis-dir DIR]

Per run (one seed), on 127.0.0.1 and free ports only:
  * redis-server (AOF, fsync always, in a folder under --redis-dir, /dev/shm
    by default, so a SIGKILL loses nothing and a busy disk's fsync is no
    unplanned stall);
  * an upstream (this script, in a child process) that logs the arrival time
    of every request: the admitted count is what it received;
  * three tcp-forwarders to Redis and three gateways, each replica's
    [redis] url pointing at its own forwarder (a forwarder is a link to cut);
  * --clients threads spraying the three replicas over keep-alive connections;
  * a watcher polling each replica's /readyz every 50 ms (backend,
    fallback_secs) and /metrics every 500 ms;
  * a fault every 4-8 s, chosen by random.Random(seed) among redis-stall
    (SIGSTOP 2 s), redis-restart (SIGKILL, restart on the same port and AOF
    ~1 s later), blackhole (SIGSTOP one forwarder 3 s), replica-kill (SIGKILL
    one gateway, restart it ~1 s later), replica-term (SIGTERM one gateway,
    wait for its PID to exit, at most TERM_WAIT_SECS, then restart it ~1 s
    later) and reload (rewrite one gateway's config in place: the gateway
    polls its file). None in the last QUIET_TAIL_SECS. --faults narrows the
    kinds drawn from (still seeded);
  * a ledger watcher reading the quota's count and lease ledger from Redis
    every 50 ms (ledger.csv);
  * at the end: the traffic stops, SETTLE_SECS later (two lease periods and
    1.5 s: every lease back or due back) the quota's `used` is read from
    every replica (/usage?period=month&format=jsonl and /limits?key=chaos)
    and compared with the upstream's count.

Outputs in --out (default loadtest/results/chaos-<timestamp>/): summary.json
(every run), table.md (also printed), chaos.png, and seed-<S>/ per run:
config/ and logs/, faults.json, arrivals.txt (the upstream's stamps), ledger.csv,
responses.csv.gz (every response: time, replica, status, ms), per_second.csv,
watcher.csv (/readyz samples), watcher-metrics.csv, metrics-gw*.txt (each
gateway's /metrics at the end).

The quota: used - upstream must lie within what the SIGKILLs explain:
at least -sum over SIGKILLs of min(the tokens the killed replica left in the
ledger, its 200s of the last two lease periods + its requests cut in
flight) (Redis gives back with an unspent lease what was spent since the
last report, a quarter period), at most +sum of its requests cut in flight
(admitted by Redis, never forwarded); a SIGTERM explains nothing, and must
leave nothing in the ledger. A difference is attributed: the drift (Redis's
count - what the ledger holds - the upstream's count so far) is measured on
the quiet stretches between disturbances (planned faults, and stays on the
fallback no fault explains), so each disturbance gets its step.

The figures: T (first to last request sent), admitted (requests the upstream
received), the exact bound 50 + 20 T, the worst window overshoot (over every
window of the upstream's stamps), slack (per run, the partition slack of
docs/design/fallback-bound.md: for every stay of a replica on its fallback while Redis decided for
another, 50/3 + 20/3 x the seconds of that overlap; its share on top of what
Redis admits until its debt is charged back at failback), and
per fault the seconds from its heal until the replicas it hit (all three for
Redis faults) were seen on Redis again (50 ms resolution). Stays on the
fallback that no fault explains are listed too.

Exit status: 0 when every run passed; 1 when a run had a 5xx, admitted more
than bound + slack, had a gateway die on its own, ended with the quota's
used off the upstream's count by more than the SIGKILLs explain, or (with
--max-fallback-after-heal) left a replica on its fallback longer than that
after a heal; 2 on bad usage or when the stack could not be set up; 130 on
Ctrl-C. Every process it starts is stopped by PID, on every exit path.
"""

import argparse
import gzip
import http.client
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from datetime import datetime

from lt import files, tables
from lt.plots import pyplot, save_png
from lt.procs import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The key's plan: the limit under test.
CAPACITY = 50
REFILL = 20.0
REPLICAS = 3
API_KEY = "chaos-soak-key-0001"
KEY_ID = "chaos"
# A monthly quota that never binds in a run: its `used` must end equal to
# what the upstream received, less what SIGKILLs explain.
QUOTA_LIMIT = 1_000_000
QUOTA_PERIOD = "month"
LEASE_PERIOD_MS = 100  # limiter.leases.period_ms in the generated configs
# Before `used` is read: traffic stopped, then two lease periods (Redis
# takes a dead holder's unspent tokens back two periods after its grant)
# and a second more (the live replicas' sweepers return theirs within a
# period and a quarter).
SETTLE_SECS = 2 * LEASE_PERIOD_MS / 1000.0 + 1.5
LEDGER_EVERY = 0.05  # the quota's lease ledger, read from Redis straight

# Faults: every 4-8 s (start to start), none in the run's last seconds so
# that every replica has time to fail back before the run ends.
FAULT_KINDS = ("redis-stall", "redis-restart", "blackhole", "replica-kill", "replica-term", "reload")
# Faults aimed at one replica (the others hit Redis, so all three).
REPLICA_FAULTS = ("blackhole", "replica-kill", "replica-term", "reload")
FAULT_GAP_SECS = (4.0, 8.0)
QUIET_TAIL_SECS = 10.0
STALL_SECS = 2.0
REDIS_DOWN_SECS = 1.0
BLACKHOLE_SECS = 3.0
REPLICA_DOWN_SECS = 1.0
# A SIGTERMed gateway drains for GRACE_SECS and gives its leases back: it is
# waited for (by PID) this long, then SIGKILLed (counted as a kill).
TERM_WAIT_SECS = 6.0
# The longest a fault is planned to last: a fault must heal before the
# quiet tail begins, so none starts later than this before it.
LONGEST_FAULT_SECS = 3.0

WATCH_EVERY = 0.05
METRICS_EVERY = 10  # /metrics on every 10th /readyz poll (500 ms)
PROGRESS_EVERY = 5.0
CLIENT_TIMEOUT = 5.0
# A client that cannot reach a replica leaves it alone this long, so that a
# killed replica costs a few errors per thread rather than a busy loop.
CLIENT_SKIP_SECS = 0.05
GRACE_SECS = 1  # server.grace_period_secs in the generated configs
# The fallback's debts are charged at failback, within about this long of a
# heal (the soak measures 0.3-0.4 s): a disturbance of the quota's drift
# lasts until then.
FAILBACK_MARGIN = 0.6
# A local episode that starts this long after a fault's heal is not blamed
# on that fault.
EPISODE_BLAME_SECS = 1.0

_print_lock = threading.Lock()


def say(msg):
    with _print_lock:
        print(f"{datetime.now():%H:%M:%S} {msg}", flush=True)


class SetupError(Exception):
    """The stack could not be brought up (exit status 2)."""


class Closed(Exception):
    """A process was to be started after the run's teardown began."""


# ------------------------------------------------------------- processes


class Proc:
    """One child process, in a session of its own (so a Ctrl-C reaches only
    this script, which then stops it by PID)."""

    def __init__(self, kind, name, argv, log_path, env=None, capture_stdout=False):
        self.kind, self.name, self.argv, self.log_path = kind, name, argv, log_path
        self.log = open(log_path, "ab")
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else self.log,
            stderr=self.log,
            start_new_session=True,
            env=env,
        )
        self.pid = self.popen.pid
        self.paused = False  # SIGSTOPped by a fault
        self.killed_by_us = False

    def alive(self):
        return self.popen.poll() is None

    def signal(self, sig):
        # Popen.send_signal polls first: a reaped PID is never signalled.
        if self.alive():
            self.popen.send_signal(sig)

    def pause(self):
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self.signal(signal.SIGCONT)
        self.paused = False

    def kill(self):
        """SIGKILL and reap (a fault, or the end of a teardown)."""
        self.killed_by_us = True
        if self.paused:
            self.resume()
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def term(self, timeout):
        """SIGTERM, then wait for this PID to exit at most `timeout` s (a
        fault: the graceful stop). Its exit code, or None when it had to be
        SIGKILLed."""
        self.killed_by_us = True
        if self.paused:
            self.resume()
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def first_line(self, timeout):
        """The first stdout line (capture_stdout only): the address it bound."""
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.popen.stdout.fileno()
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive() and not select.select([fd], [], [], 0)[0]:
                raise SetupError(f"{self.name} printed no address (see {self.log_path})")
            if select.select([fd], [], [], min(left, 0.2))[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise SetupError(f"{self.name} exited (see {self.log_path})")
                buf += chunk
        return buf.split(b"\n", 1)[0].decode().strip()

    def close_files(self):
        self.log.close()
        if self.popen.stdout:
            self.popen.stdout.close()


class Procs:
    """Every process of one run. Once closed, nothing more is started: a
    fault still running when the teardown begins cannot leak a restart."""

    def __init__(self):
        self.lock = threading.Lock()
        self.all = []
        self.closed = False

    def spawn(self, *args, **kwargs):
        with self.lock:
            if self.closed:
                raise Closed()
            p = Proc(*args, **kwargs)
            self.all.append(p)
            return p

    def stop_all(self):
        with self.lock:
            self.closed = True
            procs = [p for p in self.all if p.alive()]
        gateways = [p for p in procs if p.kind == "gateway"]
        # Gateways first, all at once: SIGTERM drains within the grace period.
        for p in gateways:
            p.killed_by_us = True
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECS + 2
        for p in gateways:
            try:
                p.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"{p.name} (PID {p.pid}) still up {GRACE_SECS + 2}s after SIGTERM: SIGKILL")
                p.kill()
        for p in procs:
            if p.kind == "gateway":
                continue
            p.killed_by_us = True
            if p.paused:
                p.resume()
            if p.kind == "forwarder":
                p.kill()  # no state to save
                continue
            p.signal(signal.SIGTERM)
            try:
                p.popen.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
        for p in self.all:
            p.close_files()


# ------------------------------------------------------------- helpers


def http_get(port, path, timeout=1.0):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def readyz(port, timeout=1.0):
    """The replica's /readyz as a dict; {} when it does not answer."""
    try:
        _, body = http_get(port, "/readyz", timeout)
        return json.loads(body)
    except (OSError, http.client.HTTPException, ValueError):
        return {}


def metric(text, series):
    """The value of one exact series in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


def redis_ping(port, timeout=0.5):
    """True when Redis answers PONG (not LOADING: the AOF is read by then)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_for(what, secs, check, proc=None):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise SetupError(f"{what}: {proc.name} exited (see {proc.log_path})")
        v = check()
        if v:
            return v
        time.sleep(0.05)
    raise SetupError(f"{what}: not within {secs}s")


def write_atomically(path, text):
    # The gateway polls its file: it must never read half of one.
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RedisError(Exception):
    pass


class Resp:
    """A minimal Redis client (RESP2, pipelined commands) for reading the
    quota's count and lease ledger straight from Redis, not through a
    replica's forwarder. Any failure raises OSError or RedisError."""

    def __init__(self, port, timeout=0.3):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.f = self.sock.makefile("rb")

    def close(self):
        for c in (self.f, self.sock):
            try:
                c.close()
            except OSError:
                pass

    def pipeline(self, *cmds):
        out = b""
        for cmd in cmds:
            out += b"*%d\r\n" % len(cmd)
            for a in cmd:
                a = str(a).encode()
                out += b"$%d\r\n%s\r\n" % (len(a), a)
        self.sock.sendall(out)
        return [self._read() for _ in cmds]

    def _read(self):
        line = self.f.readline()
        if not line.endswith(b"\r\n"):
            raise OSError("redis: connection closed")
        t, rest = line[:1], line[1:-2]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            return RedisError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            if len(data) != n + 2:
                raise OSError("redis: connection closed")
            return data[:-2].decode()
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise OSError(f"redis: unexpected reply {line[:40]!r}")


def quota_snapshot(conn, bucket):
    """(Redis's now in µs, the quota's raw count or None, its ledger
    {holder: (out, reclaim_at_us)}) in one round trip; bucket None: found
    first by SCAN (the bucket exists from the key's first admitted request)."""
    if bucket is None:
        cursor = "0"
        while True:
            rep = conn.pipeline(["SCAN", cursor, "MATCH", f"*:quota:{QUOTA_PERIOD}:*:k:{KEY_ID}", "COUNT", 1000])[0]
            if isinstance(rep, RedisError):
                raise rep
            cursor, keys = rep
            if keys:
                bucket = keys[0]
                break
            if cursor == "0":
                return None, None, None, {}
    now, raw, ledger = conn.pipeline(["TIME"], ["GET", bucket], ["HGETALL", "{" + bucket + "}:leases"])
    for rep in (now, raw, ledger):
        if isinstance(rep, RedisError):
            raise rep
    count = int(raw.split()[1]) if raw else None
    holders = {}
    for h, v in zip(ledger[::2], ledger[1::2]):
        o, at = v.split()
        holders[h] = (int(o), int(at))
    return bucket, int(now[0]) * 1_000_000 + int(now[1]), count, holders


class LedgerWatch(threading.Thread):
    """Reads the quota's raw count and its lease ledger (one field per
    holder: one per gateway process) from Redis every LEDGER_EVERY, so that
    what a stopped replica left in the ledger, and when Redis took it back,
    can be told afterwards (`holders_at_stops`)."""

    def __init__(self, stack, t0):
        super().__init__(name="ledger", daemon=True)
        self.stack, self.t0 = stack, t0
        self.bucket = None
        self.samples = []  # (t, redis_now_us, raw count, {holder: (out, reclaim_at_us)})
        self.stop_flag = threading.Event()

    def last_count(self):
        return self.samples[-1][2] if self.samples else None

    def run(self):
        conn = None
        while not self.stop_flag.is_set():
            try:
                if conn is None:
                    conn = Resp(self.stack.redis_port)
                bucket, now, count, holders = quota_snapshot(conn, self.bucket)
                if bucket is not None:
                    self.bucket = bucket
                    self.samples.append((round(time.monotonic() - self.t0, 3), now, count, holders))
            except (OSError, RedisError, ValueError, IndexError):
                # Redis stalled, restarting or loading: no sample.
                if conn is not None:
                    conn.close()
                conn = None
            self.stop_flag.wait(LEDGER_EVERY)
        if conn is not None:
            conn.close()


# ------------------------------------------------------------- the upstream


def serve_upstream(arrivals_path):
    """Child mode: answers 200 at once and appends each request's arrival
    (time.monotonic(), the same clock as the parent's) to arrivals_path. A
    process of its own, so the load threads' GIL does not delay the stamps."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock = threading.Lock()
    out = open(arrivals_path, "a")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def answer(self):
            t = time.monotonic()
            with lock:
                # Flushed per line: the parent counts them while the run goes.
                out.write(f"{t:.6f}\n")
                out.flush()
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = answer

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

    srv = Server(("127.0.0.1", 0), Handler)
    print(f"listening on 127.0.0.1:{srv.server_address[1]}", flush=True)
    srv.serve_forever()


# ------------------------------------------------------------- the stack


def gateway_config(listen, admin, redis_port, upstream_port, jitter, generation, quota=QUOTA_LIMIT):
    quotas = (f'# Never binds in a run: its `used` is checked against the upstream\'s count.\n'
              f'quotas = [{{ limit = {quota}, period = "{QUOTA_PERIOD}" }}]' if quota
              else "quotas = []  # --quota 0: none")
    return f"""# chaos.py replica config, generation {generation} (a reload fault rewrites it)
[server]
listen = ["127.0.0.1:{listen}"]
admin_listen = "127.0.0.1:{admin}"
threads = 2
grace_period_secs = {GRACE_SECS}

[limiter]
backend = "redis"
on_redis_failure = "local"
instances = {REPLICAS}
retry_after_jitter_ms = {jitter}

[limiter.leases]
enabled = true
period_ms = {LEASE_PERIOD_MS}

[redis]
urls = ["redis://127.0.0.1:{redis_port}"]
timeout_ms = 15
probe_interval_ms = 100

[plans.basic]
capacity = {CAPACITY}
refill_per_sec = {REFILL:g}
{quotas}

[[api_keys]]
id = "{KEY_ID}"
key = "{API_KEY}"
plan = "basic"

[[upstreams]]
name = "up"
servers = ["127.0.0.1:{upstream_port}"]

# No route limit: the key's plan is the limit under test.
[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"""


class Replica:
    def __init__(self, idx, listen, admin, config_path):
        self.idx, self.listen, self.admin, self.config_path = idx, listen, admin, config_path
        self.name = f"gw{idx}"
        self.forwarder = None
        self.proc = None
        self.jitter = 0
        self.generation = 0
        self.restarts = 0


class Stack:
    """Redis, the upstream, the forwarders and the gateways of one run."""

    def __init__(self, run_dir, bin_dir, procs, redis_parent=None, quota=QUOTA_LIMIT):
        self.run_dir, self.bin_dir, self.procs = run_dir, bin_dir, procs
        self.quota = quota
        self.logs = os.path.join(run_dir, "logs")
        self.config_dir = os.path.join(run_dir, "config")
        os.makedirs(self.logs, exist_ok=True)
        os.makedirs(self.config_dir, exist_ok=True)
        self.redis_dir = tempfile.mkdtemp(prefix="chaos-redis-", dir=redis_parent)
        self.redis = None
        self.redis_port = None
        self.redis_starts = 0
        self.upstream = None
        self.upstream_port = None
        self.arrivals_path = os.path.join(run_dir, "arrivals.raw")
        self.replicas = []
        self.env = dict(os.environ, GATEWAY_LOG="info,access=off,rustls=error")

    # -- Redis
    def start_redis(self):
        if self.redis_port is None:
            self.redis_port = free_ports(1)[0]
        self.redis_starts += 1
        argv = [
            "redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
            "--dir", self.redis_dir, "--appendonly", "yes", "--appendfsync", "always",
            "--save", "", "--daemonize", "no", "--loglevel", "warning",
            # Diagnostics only: LATENCY LATEST at the end shows whether Redis
            # itself (an fsync, say) was slow when a replica failed over.
            "--latency-monitor-threshold", "10",
        ]
        self.redis = self.procs.spawn("redis", "redis", argv, os.path.join(self.logs, "redis.log"))
        wait_for(f"redis on :{self.redis_port}", 15, lambda: redis_ping(self.redis_port), self.redis)

    # -- the upstream
    def start_upstream(self):
        argv = [sys.executable, os.path.abspath(__file__), "--serve-upstream", self.arrivals_path]
        self.upstream = self.procs.spawn(
            "upstream", "upstream", argv, os.path.join(self.logs, "upstream.log"), capture_stdout=True
        )
        addr = self.upstream.first_line(10)
        self.upstream_port = int(addr.rsplit(":", 1)[1])

    # -- forwarders and gateways
    def start_replicas(self):
        ports = free_ports(2 * REPLICAS)
        fwd = os.path.join(self.bin_dir, "tcp-forwarder")
        for i in range(REPLICAS):
            r = Replica(i, ports[i], ports[REPLICAS + i], os.path.join(self.config_dir, f"gw{i}.toml"))
            argv = [fwd, "--listen", "127.0.0.1:0", "--to", f"127.0.0.1:{self.redis_port}"]
            r.forwarder = self.procs.spawn(
                "forwarder", f"forwarder{i}", argv, os.path.join(self.logs, f"forwarder{i}.log"),
                capture_stdout=True,
            )
            line = r.forwarder.first_line(10)
            if not line.startswith("listening on "):
                raise SetupError(f"forwarder{i} said {line!r}, expected 'listening on ADDR'")
            r.forwarder_port = int(line.rsplit(":", 1)[1])
            self.write_config(r)
            self.check_config(r)
            self.replicas.append(r)
        for r in self.replicas:
            self.start_gateway(r)
        for r in self.replicas:
            wait_for(
                f"{r.name} on Redis (/readyz on :{r.admin})", 30,
                lambda r=r: readyz(r.admin).get("backend") == "redis", r.proc,
            )

    def write_config(self, r):
        text = gateway_config(r.listen, r.admin, r.forwarder_port, self.upstream_port, r.jitter, r.generation,
                              self.quota)
        write_atomically(r.config_path, text)

    def check_config(self, r):
        out = subprocess.run(
            [os.path.join(self.bin_dir, "gateway"), "check", "-c", r.config_path],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30,
        )
        with open(os.path.join(self.logs, f"check-{r.name}.txt"), "w") as f:
            f.write(out.stdout + out.stderr)
        if out.returncode != 0:
            raise SetupError(f"gateway check -c {r.config_path} failed:\n{out.stdout}{out.stderr}")

    def start_gateway(self, r):
        argv = [os.path.join(self.bin_dir, "gateway"), "run", "-c", r.config_path]
        r.proc = self.procs.spawn(
            "gateway", r.name, argv, os.path.join(self.logs, f"{r.name}.log"), env=self.env
        )

    def metrics_text(self, r, timeout=1.0):
        try:
            status, body = http_get(r.admin, "/metrics", timeout)
            return body.decode() if status == 200 else ""
        except (OSError, http.client.HTTPException):
            return ""

    def redis_diagnostics(self):
        """LATENCY LATEST and the AOF's fsync figures (since Redis's last start)."""
        out = {}
        for name, cmd in (("latency_latest", ["LATENCY", "LATEST"]), ("persistence", ["INFO", "persistence"])):
            try:
                res = subprocess.run(
                    ["redis-cli", "-h", "127.0.0.1", "-p", str(self.redis_port)] + cmd,
                    stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=5,
                )
                out[name] = res.stdout
            except (OSError, subprocess.SubprocessError) as e:
                out[name] = repr(e)
        keep = ("aof_delayed_fsync", "aof_last_write_status", "aof_rewrites")
        return {
            "latency_latest": out["latency_latest"].split(),
            "aof": {k: v for k, _, v in (ln.strip().partition(":") for ln in out["persistence"].splitlines())
                    if k in keep},
            "starts": self.redis_starts,
        }

    def cleanup_dirs(self):
        shutil.rmtree(self.redis_dir, ignore_errors=True)


# ------------------------------------------------------------- the load


class Client(threading.Thread):
    """Sprays the replicas in a seeded random order, one request at a time,
    over one keep-alive connection per replica, until the run's end."""

    def __init__(self, idx, seed, replicas, t0, end, n_secs):
        super().__init__(name=f"client{idx}", daemon=True)
        self.rng = random.Random(seed * 1000 + idx)
        self.ports = [r.listen for r in replicas]
        self.t0, self.end = t0, end
        self.first_send = None
        self.last_send = None
        # Live counters, read by the progress line (racy reads are fine).
        self.ok = self.rejected = self.server_errors = self.other = self.errors = 0
        self.by_replica = [dict() for _ in self.ports]  # status (0: error) -> count
        n = n_secs + 2
        self.per_sec = {k: [0] * n for k in ("ok", "429", "5xx", "other", "errors")}
        self.events = []  # 5xx answers and connection errors: (t, replica, what)
        # Every response (status 0: a connection error): send time, replica,
        # status, milliseconds. Arrays keep a 90 s flood small.
        self.rec_t, self.rec_r, self.rec_s, self.rec_ms = array("d"), array("b"), array("H"), array("f")
        self.stop_flag = threading.Event()

    def note(self, t, i, status, key):
        self.rec_t.append(t)
        self.rec_r.append(i)
        self.rec_s.append(status)
        self.rec_ms.append((time.monotonic() - self.t0 - t) * 1000.0)
        s = int(t)
        if 0 <= s < len(self.per_sec[key]):
            self.per_sec[key][s] += 1

    def run(self):
        conns = [None] * len(self.ports)
        skip_until = [0.0] * len(self.ports)
        headers = {"x-api-key": API_KEY}
        while not self.stop_flag.is_set():
            now = time.monotonic()
            if now >= self.end:
                break
            usable = [i for i in range(len(self.ports)) if skip_until[i] <= now]
            if not usable:
                time.sleep(0.01)
                continue
            i = self.rng.choice(usable)
            t = now - self.t0
            if self.first_send is None:
                self.first_send = t
            self.last_send = t
            try:
                if conns[i] is None:
                    conns[i] = http.client.HTTPConnection("127.0.0.1", self.ports[i], timeout=CLIENT_TIMEOUT)
                conns[i].request("GET", "/chaos", headers=headers)
                resp = conns[i].getresponse()
                resp.read()
                status = resp.status
                if resp.will_close:
                    conns[i].close()
                    conns[i] = None
            except (OSError, http.client.HTTPException) as e:
                if conns[i] is not None:
                    conns[i].close()
                conns[i] = None
                skip_until[i] = time.monotonic() + CLIENT_SKIP_SECS
                self.errors += 1
                self.note(t, i, 0, "errors")
                self.by_replica[i][0] = self.by_replica[i].get(0, 0) + 1
                if len(self.events) < 20000:
                    self.events.append((round(t, 3), i, type(e).__name__))
                continue
            self.by_replica[i][status] = self.by_replica[i].get(status, 0) + 1
            if status == 200:
                self.ok += 1
                self.note(t, i, status, "ok")
            elif status == 429:
                self.rejected += 1
                self.note(t, i, status, "429")
            elif status >= 500:
                self.server_errors += 1
                self.note(t, i, status, "5xx")
                if len(self.events) < 20000:
                    self.events.append((round(t, 3), i, f"HTTP {status}"))
            else:
                self.other += 1
                self.note(t, i, status, "other")
        for c in conns:
            if c is not None:
                c.close()


# ------------------------------------------------------------- the watcher


class Watcher(threading.Thread):
    """Polls one replica's /readyz every WATCH_EVERY (its backend, and the
    fallback_secs it carries while on the fallback) and its /metrics every
    METRICS_EVERY polls (the backend gauge, the reload and probe counters)."""

    def __init__(self, stack, replica, t0):
        super().__init__(name=f"watch-{replica.name}", daemon=True)
        self.stack, self.r, self.t0 = stack, replica, t0
        self.samples = []  # (t, state, fallback_secs): state redis|local|starting|down
        self.metrics = []  # (t, local gauge, reloads ok, probes ok, probes failed)
        self.stop_flag = threading.Event()

    def last_state(self):
        return self.samples[-1][1] if self.samples else "?"

    def run(self):
        n = 0
        nxt = time.monotonic()
        while not self.stop_flag.is_set():
            t = time.monotonic() - self.t0
            j = readyz(self.r.admin, timeout=0.5)
            if not j:
                state = "down"
            elif not j.get("ready"):
                state = "starting"
            else:
                state = j.get("backend", "?")
            self.samples.append((round(t, 3), state, j.get("fallback_secs")))
            if n % METRICS_EVERY == 0:
                text = self.stack.metrics_text(self.r, timeout=0.5)
                if text:
                    self.metrics.append((
                        round(time.monotonic() - self.t0, 3),
                        metric(text, 'gateway_limiter_backend{backend="local"}'),
                        metric(text, 'gateway_config_reloads_total{result="ok"}'),
                        metric(text, 'gateway_redis_probes_total{result="ok"}'),
                        metric(text, 'gateway_redis_probes_total{result="failed"}'),
                    ))
            n += 1
            nxt += WATCH_EVERY
            self.stop_flag.wait(max(0.0, nxt - time.monotonic()))
            nxt = max(nxt, time.monotonic() - WATCH_EVERY)


# ------------------------------------------------------------- the faults


def fault_schedule(seed, duration, kinds=FAULT_KINDS):
    """(offset, kind, replica) from the seed alone, so a seed replays the
    same faults whatever the machine's timings. A replica index is drawn for
    every fault, used or not, to keep the stream aligned across kinds.
    `kinds` (--faults) narrows the mix: no kinds, no faults."""
    rng = random.Random(seed)
    plan = []
    if not kinds:
        return plan
    t = rng.uniform(*FAULT_GAP_SECS)
    while t <= duration - QUIET_TAIL_SECS - LONGEST_FAULT_SECS:
        plan.append((round(t, 3), rng.choice(kinds), rng.randrange(REPLICAS)))
        t += rng.uniform(*FAULT_GAP_SECS)
    return plan


class Faults(threading.Thread):
    def __init__(self, stack, plan, t0, duration):
        super().__init__(name="faults", daemon=True)
        self.stack, self.plan, self.t0, self.duration = stack, plan, t0, duration
        self.log = []  # one dict per fault that ran
        self.skipped = []
        self.error = None
        self.stop_flag = threading.Event()

    def now(self):
        return time.monotonic() - self.t0

    def nap(self, secs):
        # A fault under way always heals: an early stop only shortens it.
        self.stop_flag.wait(secs)

    def run(self):
        try:
            last_heal = 0.0
            for n, (at, kind, ri) in enumerate(self.plan, 1):
                # A fault that healed late pushes the next one back a little.
                start = max(at, last_heal + 1.0)
                if start > self.duration - QUIET_TAIL_SECS - LONGEST_FAULT_SECS:
                    self.skipped.append({"n": n, "kind": kind, "planned": at, "why": "would reach the quiet tail"})
                    continue
                if self.stop_flag.wait(max(0.0, start - self.now())):
                    return
                entry = {"n": n, "kind": kind, "planned": at}
                if kind in REPLICA_FAULTS:
                    entry["replica"] = ri
                entry["start"] = round(self.now(), 3)
                target = f" gw{ri}" if "replica" in entry else ""
                say(f"  fault {n} {kind}{target} at {entry['start']:.1f}s")
                getattr(self, kind.replace("-", "_"))(entry, ri)
                entry["heal"] = round(self.now(), 3)
                entry["secs"] = round(entry["heal"] - entry["start"], 3)
                last_heal = entry["heal"]
                self.log.append(entry)
                extra = f" ({entry['note']})" if entry.get("note") else ""
                say(f"  fault {n} {kind}{target} healed at {entry['heal']:.1f}s after {entry['secs']:.1f}s{extra}")
        except Closed:
            pass
        except BaseException as e:  # reported by the main thread
            self.error = e

    def redis_stall(self, entry, _):
        self.stack.redis.pause()
        self.nap(STALL_SECS)
        self.stack.redis.resume()

    def redis_restart(self, entry, _):
        self.stack.redis.kill()
        self.nap(REDIS_DOWN_SECS)
        self.stack.start_redis()  # same port and dir: the AOF is reloaded

    def blackhole(self, entry, ri):
        fwd = self.stack.replicas[ri].forwarder
        fwd.pause()
        self.nap(BLACKHOLE_SECS)
        fwd.resume()

    def replica_kill(self, entry, ri):
        r = self.stack.replicas[ri]
        entry["pid"] = r.proc.pid
        entry["signal_at"] = round(self.now(), 4)
        r.proc.kill()
        self.nap(REPLICA_DOWN_SECS)
        self.restart_gateway(entry, r)

    def replica_term(self, entry, ri):
        # The graceful stop: it drains for its grace period and gives back
        # every lease; waited for by PID, at most TERM_WAIT_SECS.
        r = self.stack.replicas[ri]
        entry["pid"] = r.proc.pid
        entry["signal_at"] = round(self.now(), 4)
        code = r.proc.term(TERM_WAIT_SECS)
        entry["exited_at"] = round(self.now(), 4)
        entry["exit_secs"] = round(entry["exited_at"] - entry["signal_at"], 3)
        entry["exit_code"] = code
        if code is None:
            entry["forced_kill"] = True
            entry["note"] = f"still up {TERM_WAIT_SECS:g}s after SIGTERM: SIGKILLed"
        else:
            entry["note"] = f"exited {code} after {entry['exit_secs']:.2f}s"
        self.nap(REPLICA_DOWN_SECS)
        self.restart_gateway(entry, r)

    def restart_gateway(self, entry, r):
        # The same config and ports; a listener port may linger, so a
        # start that dies at once is tried again.
        for attempt in range(5):
            self.stack.start_gateway(r)
            r.restarts += 1
            try:
                wait_for(f"{r.name} restarted", 20, lambda: readyz(r.admin).get("ready"), r.proc)
                entry["backend_when_ready"] = readyz(r.admin).get("backend")
                if attempt:
                    entry["note"] = ", ".join(x for x in (entry.get("note"), f"{attempt + 1} starts") if x)
                return
            except SetupError:
                if r.proc.alive() or attempt == 4:
                    raise
                time.sleep(0.5)

    def reload(self, entry, ri):
        r = self.stack.replicas[ri]
        before = metric(self.stack.metrics_text(r), 'gateway_config_reloads_total{result="ok"}') or 0.0
        r.jitter = 1 - r.jitter
        r.generation += 1
        self.stack.write_config(r)
        # The gateway polls its file's content every 500 ms (docs/operator/
        # reload.md): the reload is seen in its counter, not signalled.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            now = metric(self.stack.metrics_text(r), 'gateway_config_reloads_total{result="ok"}') or 0.0
            if now > before:
                entry["note"] = f"retry_after_jitter_ms={r.jitter}"
                return
            time.sleep(0.05)
        entry["note"] = "reload NOT seen in gateway_config_reloads_total within 5s"


# ------------------------------------------------------------- analysis


def worst_window(arrivals):
    """max over windows [t_i, t_j] of (j - i + 1) - (CAPACITY + REFILL (t_j - t_i)):
    (j - REFILL t_j) - min over i <= j of (i - REFILL t_i), + 1 - CAPACITY."""
    best, where = None, None
    low, low_i = float("inf"), 0
    for j, t in enumerate(arrivals):
        v = j - REFILL * t
        if v < low:
            low, low_i = v, j
        over = v - low + 1 - CAPACITY
        if best is None or over > best:
            best, where = over, (arrivals[low_i], t, j - low_i + 1)
    return best, where


def episodes(samples, backend="local"):
    """Intervals a replica was seen on `backend` (its fallback by default):
    [first such sample, first sample after that on another] (end None: still
    there at the end)."""
    out, start = [], None
    for t, state, _ in samples:
        if state == backend and start is None:
            start = t
        elif state != backend and start is not None:
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, None))
    return out


def back_on_redis(samples, heal, run_end):
    """Seconds from a heal until the replica was seen on Redis again: 0 when
    it was on Redis just before and just after the heal; (secs, stuck)."""
    before = None
    for t, state, _ in samples:
        if t <= heal:
            before = state
            continue
        if state == "redis":
            if before == "redis":
                return 0.0, False
            return round(t - heal, 3), False
        before = state
    return round(run_end - heal, 3), True


def partition_slack(watchers, run_end):
    """The partition slack (docs/design/fallback-bound.md): each time a replica decides on its
    fallback while Redis decides for another, its share (CAPACITY/n + REFILL/n
    x that time) can come on top of what Redis admits, until its debt is
    charged at failback. Summed over every such stay, whatever caused it."""
    stays = [[(s, run_end if e is None else e) for s, e in episodes(w.samples)] for w in watchers]
    on_redis = [[(s, run_end if e is None else e) for s, e in episodes(w.samples, "redis")]
                for w in watchers]
    total = 0.0
    for ri, mine in enumerate(stays):
        others = sorted(iv for rj, ivs in enumerate(on_redis) if rj != ri for iv in ivs)
        for s, e in mine:
            overlap, cursor = 0.0, s
            for a, b in others:
                lo, hi = max(a, cursor), min(b, e)
                if hi > lo:
                    overlap += hi - lo
                    cursor = hi
            if overlap > 0:
                total += CAPACITY / REPLICAS + REFILL / REPLICAS * overlap
    return total


def affected(fault):
    if fault["kind"].startswith("redis-"):
        return list(range(REPLICAS))
    return [fault["replica"]]


def find_quota_used(obj):
    """The `used` of the key's quota bucket in a /limits answer (searched
    for: a dict with tier quota-<period> and a used field)."""
    if isinstance(obj, dict):
        if obj.get("tier") == f"quota-{QUOTA_PERIOD}" and "used" in obj:
            return obj["used"]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            u = find_quota_used(v)
            if u is not None:
                return u
    return None


def read_quota(stack):
    """The end-of-run figures: the upstream's count, the quota's `used` as
    every replica's /usage and /limits tell it (all read Redis), and Redis's
    raw count and ledger."""
    with open(stack.arrivals_path, "rb") as f:
        upstream = f.read().count(b"\n")
    usage, limits = {}, {}
    for r in stack.replicas:
        try:
            st, body = http_get(r.admin, f"/usage?period={QUOTA_PERIOD}&format=jsonl", 5)
            rows = [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()] if st == 200 else []
            usage[r.name] = next((row.get("used") for row in rows if row.get("key") == KEY_ID), None)
            if st != 200:
                usage[r.name] = f"HTTP {st}"
        except (OSError, http.client.HTTPException, ValueError) as e:
            usage[r.name] = repr(e)
        try:
            st, body = http_get(r.admin, f"/limits?key={KEY_ID}", 5)
            limits[r.name] = find_quota_used(json.loads(body)) if st == 200 else f"HTTP {st}"
        except (OSError, http.client.HTTPException, ValueError) as e:
            limits[r.name] = repr(e)
    raw = {"count": None, "ledger": {}, "due": 0}
    try:
        conn = Resp(stack.redis_port, timeout=2)
        try:
            bucket, now, count, holders = quota_snapshot(conn, None)
        finally:
            conn.close()
        raw = {
            "bucket": bucket, "count": count,
            "ledger": {h: {"out": o, "reclaim_in_ms": round((at - now) / 1000, 1)} for h, (o, at) in holders.items()},
            # What /usage leaves out: holdings whose reclaim time has passed.
            "due": sum(o for o, at in holders.values() if at <= now),
        }
    except (OSError, RedisError, ValueError, IndexError) as e:
        raw["error"] = repr(e)
    used = next((u for u in usage.values() if isinstance(u, int)), None)
    return {"upstream": upstream, "used": used, "usage_by_replica": usage, "limits_by_replica": limits, "redis": raw}


def holders_at_stops(samples, fault_log):
    """For each replica stopped by a fault (SIGKILL or SIGTERM), its holder
    in the quota's lease ledger: the field present before the signal that no
    call changes after the process is gone. `left`: the tokens it still held
    there when it died (Redis gives them back two lease periods after its
    last grant: its unspent lease, and what it spent since its last report);
    0 when its field was gone by then (a graceful stop gave everything
    back)."""
    out = {}
    for f in fault_log:
        if f["kind"] not in ("replica-kill", "replica-term") or "signal_at" not in f:
            continue
        t_sig = f["signal_at"]
        t_gone = f.get("exited_at", t_sig) + 0.05  # a call already sent may still land
        # A holder's field comes and goes (it leaves the ledger whenever
        # its holdings settle to 0): every holder seen shortly before.
        around = [smp for smp in samples if t_sig - 0.3 <= smp[0] <= t_gone]
        after = [smp for smp in samples if t_gone < smp[0] <= t_gone + 1.0]
        seen_before = sorted({h for smp in around for h in smp[3]})
        info = {"holders_before": seen_before, "samples_after": len(after)}
        if not around or not after:
            info["holder"] = None
            info["why"] = "no ledger samples around the stop (Redis unreadable?)"
            out[f["n"]] = info
            continue
        cands = []
        for h in seen_before:
            vals = [smp[3].get(h) for smp in after]
            present = [v for v in vals if v is not None]
            # Frozen: one value while present, and once gone, gone for good.
            gone_at = next((i for i, v in enumerate(vals) if v is None), None)
            if len(set(present)) <= 1 and (gone_at is None or all(v is None for v in vals[gone_at:])):
                cands.append(h)
        info["candidates"] = cands
        # Its last value after the process was gone (None: gone already).
        lefts = {}
        for h in cands:
            seen = [(smp[0], smp[3][h]) for smp in samples if smp[0] > t_gone and h in smp[3]]
            lefts[h] = seen[-1][1][0] if seen else 0
            if seen:
                info.setdefault("reclaimed_at", {})[h] = next(
                    (smp[0] for smp in samples if smp[0] > seen[-1][0] and h not in smp[3]), None)
        info["holder"] = cands[0] if len(cands) == 1 else None
        if not cands:
            info["why"] = "no field of it in the ledger: it held no quota lease"
        elif len(cands) > 1:
            info["why"] = f"{len(cands)} candidate holders: their sum counted"
        info["left"] = sum(lefts.values())
        info["left_by_holder"] = lefts
        out[f["n"]] = info
    return out


def quota_drift(samples, arrivals_abs, t0, fault_log, duration, unplanned=()):
    """Where a difference between used and the upstream's count came from.
    At each ledger sample, drift = Redis's count - what the ledger holds for
    holders (leased, not reported spent) - the upstream's count so far: what
    Redis counts as spent beyond what was admitted. It does not move when
    Redis takes a dead holder's tokens back (count and ledger drop
    together), and once every lease is back it is used - upstream.

    The run is cut into disturbances (a planned fault from its start to its
    heal plus FAILBACK_MARGIN, or a stay on the fallback no fault explains:
    a Redis call over its budget on a busy machine; overlapping ones merged)
    and the quiet stretches between them; each disturbance's step is the
    drift's median over the quiet stretch after it minus that before it."""
    import bisect

    arr = sorted(a - t0 for a in arrivals_abs)
    pts = [(t, c - sum(o for o, _ in hs.values()) - bisect.bisect_right(arr, t))
           for t, _, c, hs in samples if c is not None]

    def median(lo, hi):
        v = sorted(d for t, d in pts if lo <= t <= hi)
        return v[len(v) // 2] if v else None

    spans = [(f["start"] - 0.05, f["heal"] + FAILBACK_MARGIN,
              f"{f['kind']}" + (f" gw{f['replica']}" if "replica" in f else "") + f" at {f['start']:.1f}s", f["kind"])
             for f in fault_log]
    spans += [(e["start"] - 0.05, (duration if e["end"] is None else e["end"]) + FAILBACK_MARGIN,
               f"unplanned fallback {e['replica']} at {e['start']:.1f}s", "unplanned-fallback")
              for e in unplanned]
    spans.sort()
    groups = []
    for lo, hi, label, kind in spans:
        if groups and lo <= groups[-1]["to"] + 0.15:  # too short a quiet stretch to measure
            g = groups[-1]
            g["to"] = max(g["to"], hi)
            g["what"].append(label)
            g["kinds"].add(kind)
        else:
            groups.append({"from": lo, "to": hi, "what": [label], "kinds": {kind}})
    # Two disturbances with no sample between them (Redis unreadable, or
    # too short a gap) are one.
    merged = []
    for g in groups:
        if merged and not any(merged[-1]["to"] < t < g["from"] for t, _ in pts):
            m = merged[-1]
            m["to"] = max(m["to"], g["to"])
            m["what"] += g["what"]
            m["kinds"] |= g["kinds"]
        else:
            merged.append(g)
    groups = merged
    # The traffic ends at `duration`; the drift after it (every lease back) is the final one.
    edges = [float("-inf")] + [x for g in groups for x in (g["from"], g["to"])] + [float("inf")]

    def head_tail(lo, hi):
        ts = [t for t, _ in pts if lo <= t <= hi]
        if not ts:
            # Before the first sample: no request yet, so no drift.
            return (0, 0) if lo == float("-inf") else (None, None)
        return median(ts[0], ts[0] + 0.5), median(ts[-1] - 0.5, ts[-1])

    quiet = [(edges[i], edges[i + 1]) + head_tail(edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
    out = []
    for i, (lo, hi, head, tail) in enumerate(quiet):
        # A quiet stretch should not move it: say so if it did.
        if head is not None and tail is not None and head != tail:
            out.append({"from": round(max(lo, 0.0), 3), "to": round(min(hi, duration), 3),
                        "what": ["no disturbance seen"], "kinds": ["none"], "before": head, "after": tail,
                        "step": tail - head})
        if i < len(groups):
            g, before, after = groups[i], tail, quiet[i + 1][2]
            out.append({"from": round(g["from"], 3), "to": round(g["to"], 3), "what": g["what"],
                        "kinds": sorted(g["kinds"]), "before": before, "after": after,
                        "step": None if before is None or after is None else after - before})
    return {"before_first": quiet[0][2], "at_end": median(duration + 0.3, float("inf")), "steps": out}


def quota_check(q, faults_log, holders, clients, t_measured):
    """used against the upstream's count. The rule: a SIGKILLed replica can
    (a) leave in the ledger tokens it spent since its last report (a
    quarter lease period), which Redis gives back with its unspent lease:
    used lower by at most min(what it left there, its 200s of the last two
    lease periods before the kill + its requests cut in flight); (b) die
    between Redis's admission and the upstream: used higher by at most its
    requests in flight (sent before the kill, answered by a connection
    error). So -sum(a) <= used - upstream <= sum(b) over the SIGKILLs; a
    SIGTERM (a graceful stop) explains nothing."""
    kills, terms, low, high, per = 0, 0, 0, 0, []
    for f in faults_log:
        if f["kind"] not in ("replica-kill", "replica-term"):
            continue
        ri, t_sig = f["replica"], f["signal_at"]
        # Sent before the signal, answered after it by a connection error.
        in_flight = sum(
            1 for c in clients for t, r, st, ms in zip(c.rec_t, c.rec_r, c.rec_s, c.rec_ms)
            if r == ri and st == 0 and t <= t_sig <= t + ms / 1000.0 + 0.002
        )
        ok_last = sum(
            1 for c in clients for t, r, st in zip(c.rec_t, c.rec_r, c.rec_s)
            if r == ri and st == 200 and t_sig - 2 * LEASE_PERIOD_MS / 1000 <= t <= t_sig
        )
        h = holders.get(f["n"], {})
        killed = f["kind"] == "replica-kill" or f.get("forced_kill")
        # What Redis can give back that the upstream did receive: what the
        # killed replica spent from its lease since its last report (within
        # a quarter period), so at most its 200s of the last two periods and
        # its requests cut in flight; and never more than it left in the
        # ledger.
        credit = min(h.get("left") or 0, ok_last + in_flight)
        entry = {"n": f["n"], "kind": f["kind"], "replica": f"gw{ri}", "at": t_sig,
                 "sigkill": bool(killed), "in_flight": in_flight,
                 f"200s_last_{2 * LEASE_PERIOD_MS}ms": ok_last,
                 "holder": h.get("holder"), "left_in_ledger": h.get("left"),
                 "may_recredit": credit if killed else 0,
                 "reclaimed_at": h.get("reclaimed_at"), "why": h.get("why")}
        if f["kind"] == "replica-term":
            entry["exit_code"], entry["exit_secs"] = f.get("exit_code"), f.get("exit_secs")
        per.append(entry)
        if killed:
            kills += 1
            low -= credit
            high += in_flight
        else:
            terms += 1
    res = {"upstream": q["upstream"], "used": q["used"], "kills": kills, "terms": terms,
           "allowed": [low, high], "stops": per, "read": q, "read_at": t_measured}
    res["diff"] = None if q["used"] is None else q["used"] - q["upstream"]
    failures = []
    if q.get("month_changed"):
        res["note"] = "the run crossed a month boundary (UTC): used is this month's only, not checked"
    elif q["used"] is None:
        failures.append(f"the quota's used could not be read ({q['usage_by_replica']})")
    else:
        if not low <= res["diff"] <= high:
            failures.append(f"quota used {q['used']} - upstream {q['upstream']} = {res['diff']:+d}, "
                            f"outside what the SIGKILLs explain [{low:+d}, {high:+d}]")
        others = {str(v) for v in list(q["usage_by_replica"].values()) + list(q["limits_by_replica"].values())}
        if others != {str(q["used"])}:
            failures.append(f"replicas disagree on used: /usage {q['usage_by_replica']}, /limits {q['limits_by_replica']}")
    for e in per:
        if e["kind"] == "replica-term" and not e["sigkill"] and e["left_in_ledger"]:
            failures.append(f"fault {e['n']}: SIGTERMed {e['replica']} left {e['left_in_ledger']} tokens in the ledger")
    res["failures"] = failures
    return res


def analyse(seed, clients, watchers, faults, arrivals_abs, t0, duration, args, procs_died, quota=None):
    first = min(c.first_send for c in clients if c.first_send is not None)
    last = max(c.last_send for c in clients if c.last_send is not None)
    T = last - first
    # Times from the first request sent: the bucket was full then.
    arrivals = sorted(a - t0 - first for a in arrivals_abs)
    admitted = len(arrivals)
    bound = CAPACITY + REFILL * T
    over, where = worst_window(arrivals)
    run_end = duration

    def total(attr):
        return sum(getattr(c, attr) for c in clients)

    fault_log = []
    per_replica_last = {}
    for f in faults.log:
        per = {}
        for ri in affected(f):
            secs, stuck = back_on_redis(watchers[ri].samples, f["heal"], run_end)
            per[f"gw{ri}"] = {"secs": secs, "stuck": stuck}
            per_replica_last[ri] = (f["n"], secs, stuck)
        f = dict(f, fallback_after_heal=per, fallback_after_heal_max=max(v["secs"] for v in per.values()))
        fault_log.append(f)
    longest = max((f["fallback_after_heal_max"] for f in fault_log), default=0.0)
    after_final = max((v[1] for v in per_replica_last.values()), default=0.0)
    stuck = sorted({k for f in fault_log for k, v in f["fallback_after_heal"].items() if v["stuck"]})

    # A stay on the fallback that no fault explains is odd: list them. Only
    # faults that cut a replica from Redis explain one; a kill or a reload
    # should never send a replica to its fallback.
    unexplained = []
    for ri, w in enumerate(watchers):
        for s, e in episodes(w.samples):
            blamed = any(
                f["kind"] in ("redis-stall", "redis-restart", "blackhole")
                and ri in affected(f) and f["start"] - 0.1 <= s <= f["heal"] + EPISODE_BLAME_SECS
                for f in faults.log
            )
            if not blamed:
                unexplained.append({"replica": f"gw{ri}", "start": s, "end": e})

    slack_calc = partition_slack(watchers, run_end)
    slack = args.slack if args.slack is not None else slack_calc
    kinds = {k: sum(1 for f in faults.log if f["kind"] == k) for k in FAULT_KINDS}
    s5 = total("server_errors")
    errors = total("errors")

    failures = []
    if s5:
        failures.append(f"{s5} 5xx answers")
    if admitted > bound + slack:
        failures.append(f"admitted {admitted} > bound {bound:.1f} + slack {slack:.1f}")
    if args.max_fallback_after_heal is not None and longest > args.max_fallback_after_heal:
        failures.append(f"a replica stayed on its fallback {longest:.2f}s after a heal (bound {args.max_fallback_after_heal}s)")
    if procs_died:
        failures.append("died on their own: " + ", ".join(procs_died))
    if quota is not None:
        failures += quota["failures"]

    max_fb_secs = {}
    for ri, w in enumerate(watchers):
        vals = [fb for _, _, fb in w.samples if isinstance(fb, (int, float))]
        max_fb_secs[f"gw{ri}"] = max(vals) if vals else None

    return {
        "seed": seed,
        "T": round(T, 3),
        "first_send": round(first, 3),
        "admitted": admitted,
        "client_200s": total("ok"),
        "bound": round(bound, 2),
        "pct_of_bound": round(100.0 * admitted / bound, 2) if bound else None,
        "worst_window_overshoot": round(over, 2) if over is not None else None,
        "worst_window": {"from": round(where[0], 3), "to": round(where[1], 3), "arrivals": where[2]} if where else None,
        "slack": round(slack, 2),
        "slack_computed": round(slack_calc, 2),
        "over_bound": round(admitted - bound, 2),
        "responses": {"200": total("ok"), "429": total("rejected"), "5xx": s5, "other": total("other")},
        "status_5xx": s5,
        "conn_errors": errors,
        "status_429": total("rejected"),
        "by_replica": {
            f"gw{i}": {str(k): sum(c.by_replica[i].get(k, 0) for c in clients)
                       for k in sorted({k for c in clients for k in c.by_replica[i]})}
            for i in range(REPLICAS)
        },
        "longest_fallback_after_heal": longest,
        "fallback_after_final_fault": after_final,
        "stuck_on_fallback": stuck,
        "unexplained_fallback_episodes": unexplained,
        "max_fallback_secs_seen": max_fb_secs,
        "faults_by_kind": kinds,
        "faults": fault_log,
        "faults_skipped": faults.skipped,
        "events_sample": sorted(e for c in clients for e in c.events)[:200],
        "died": procs_died,
        "quota": quota,
        "pass": not failures,
        "failures": failures,
    }


# ------------------------------------------------------------- one run


def run_one(seed, args, out_dir):
    run_dir = os.path.join(out_dir, f"seed-{seed}")
    os.makedirs(run_dir, exist_ok=True)
    procs = Procs()
    stack = Stack(run_dir, args.bin_dir, procs, args.redis_dir, args.quota)
    clients, watchers, faults, ledger = [], [], None, None
    quota_read, t_measured = None, None
    try:
        say(f"== seed {seed}: {args.duration:g}s, {args.clients} clients; run folder {run_dir}")
        stack.start_upstream()
        stack.start_redis()
        stack.start_replicas()
        say(
            f"   up: redis :{stack.redis_port}, upstream :{stack.upstream_port}, "
            + ", ".join(f"gw{r.idx} :{r.listen} (admin :{r.admin}, via :{r.forwarder_port})" for r in stack.replicas)
            + "; all on Redis"
        )
        plan = fault_schedule(seed, args.duration, args.fault_kinds)
        planned = ", ".join(
            f"{at:.1f}s {k}" + (f" gw{ri}" if k in REPLICA_FAULTS else "")
            for at, k, ri in plan
        )
        say(f"   faults planned: {planned or 'none fits in this duration'}")

        month_at_start = time.strftime("%Y-%m", time.gmtime())  # the quota's period (quota_time_zone UTC)
        t0 = time.monotonic()
        end = t0 + args.duration
        watchers = [Watcher(stack, r, t0) for r in stack.replicas]
        clients = [Client(i, seed, stack.replicas, t0, end, int(args.duration)) for i in range(args.clients)]
        faults = Faults(stack, plan, t0, args.duration)
        ledger = LedgerWatch(stack, t0)
        for th in watchers + clients + [faults, ledger]:
            th.start()

        counted, offset = 0, 0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(PROGRESS_EVERY, left))
            # Count the upstream's lines written since the last look.
            with open(stack.arrivals_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            counted += chunk.count(b"\n")
            offset += len(chunk)
            elapsed = time.monotonic() - t0
            on_fb = [w.r.name for w in watchers if w.last_state() != "redis"]
            states = ",".join(f"{w.r.name}={w.last_state()}" for w in watchers if w.last_state() != "redis")
            lastf = faults.log[-1] if faults.log else None
            lf = (
                f"{lastf['kind']}{' gw%d' % lastf['replica'] if 'replica' in lastf else ''} "
                f"{lastf['start']:.1f}-{lastf['heal']:.1f}s" if lastf else "none"
            )
            bound_now = CAPACITY + REFILL * elapsed
            say(
                f"[seed {seed}] {min(elapsed, args.duration):5.1f}/{args.duration:g}s  admitted {counted} "
                f"(bound now {bound_now:.0f})  429s {sum(c.rejected for c in clients)}  "
                f"5xx {sum(c.server_errors for c in clients)}  errors {sum(c.errors for c in clients)}  "
                f"quota count {num(ledger.last_count(), 'd')}  "
                f"not on redis: {states if on_fb else '-'}  last fault: {lf}"
            )
            if faults.error:
                raise faults.error

        for c in clients:
            c.join(CLIENT_TIMEOUT + 2)
        faults.stop_flag.set()
        faults.join(30)
        if faults.error:
            raise faults.error
        # A last look at every replica, then the watchers stop.
        time.sleep(0.2)
        for w in watchers:
            w.stop_flag.set()
            w.join(5)
        # The quota: no traffic since the clients stopped; once every lease
        # is back (or due back), its used against the upstream's count.
        if args.quota:
            time.sleep(max(0.0, SETTLE_SECS - 0.2))
            t_measured = round(time.monotonic() - t0, 3)
            quota_read = read_quota(stack)
            quota_read["month_changed"] = time.strftime("%Y-%m", time.gmtime()) != month_at_start
        ledger.stop_flag.set()
        ledger.join(5)
        if args.quota:
            say(f"   quota after {SETTLE_SECS:g}s idle: used {quota_read['used']}, upstream {quota_read['upstream']}, "
                f"Redis count {quota_read['redis'].get('count')} with {quota_read['redis'].get('due')} due back "
                f"from {len(quota_read['redis'].get('ledger', {}))} ledger holder(s)")

        diagnostics = {"redis": stack.redis_diagnostics(), "cpu_secs": cpu_secs(procs)}
        died = []
        for r in stack.replicas:
            text = stack.metrics_text(r, timeout=2)
            with open(os.path.join(run_dir, f"metrics-{r.name}.txt"), "w") as f:
                f.write(text)
        for p in procs.all:
            if not p.alive() and not p.killed_by_us:
                died.append(f"{p.name} (PID {p.pid}, exit {p.popen.returncode})")
    finally:
        for th in clients + watchers + [x for x in (faults, ledger) if x]:
            th.stop_flag.set()
        procs.stop_all()
        stack.cleanup_dirs()

    with open(stack.arrivals_path) as f:
        arrivals_abs = [float(x) for x in f.read().split()]
    quota = None
    if args.quota:
        holders = holders_at_stops(ledger.samples, faults.log)
        quota = quota_check(quota_read, faults.log, holders, clients, t_measured)
    result = analyse(seed, clients, watchers, faults, arrivals_abs, t0, args.duration, args, died, quota)
    if quota:
        quota["drift"] = quota_drift(ledger.samples, arrivals_abs, t0, faults.log, args.duration,
                                     result["unexplained_fallback_episodes"])
    result["plan"] = [{"at": at, "kind": k, "replica": ri} for at, k, ri in plan]
    result["gateway_log_lines"] = gateway_log_summary(stack)
    result["diagnostics"] = diagnostics
    save_run_files(run_dir, result, clients, watchers, arrivals_abs, t0, stack)
    with open(os.path.join(run_dir, "ledger.csv"), "w") as f:
        # t: the load's clock; count: the quota's count in Redis (leased
        # tokens included); one row per holder (none: an empty ledger).
        f.write("t,count,holder,out,reclaim_in_ms\n")
        for t, now, count, hs in ledger.samples:
            for h, (o, at) in sorted(hs.items()) or [("", (None, None))]:
                f.write(f"{t},{'' if count is None else count},{h},{'' if o is None else o},"
                        f"{'' if at is None else round((at - now) / 1000, 1)}\n")
    return result


def cpu_secs(procs):
    """CPU seconds used by each process still running, and by this script:
    on a small machine the load generator competes with the gateways."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for p in procs.all:
        if not p.alive():
            continue
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[p.name] = round((int(fields[11]) + int(fields[12])) / tick, 2)
        except (OSError, IndexError, ValueError):
            pass
    t = os.times()
    out["chaos.py (load, watcher)"] = round(t.user + t.system, 2)
    return out


def gateway_log_summary(stack):
    """Per gateway log: WARN and ERROR lines counted by message (timestamp
    and key=value fields dropped), and each failback's on_fallback_ms (how
    long the stay lasted, as the gateway saw it)."""
    out = {}
    for r in stack.replicas:
        path = os.path.join(stack.logs, f"{r.name}.log")
        by_message = {}
        failbacks = []
        try:
            with open(path, errors="replace") as f:
                for line in f:
                    m = re.match(r"\S+\s+(WARN|ERROR)\s+(.*)", line)
                    if m:
                        msg = re.split(r" \w+=", m.group(2), maxsplit=1)[0].strip()
                        key = f"{m.group(1)} {msg}"
                        by_message[key] = by_message.get(key, 0) + 1
                    if "failing back" in line:
                        fb = re.search(r"on_fallback_ms=(\d+)", line)
                        if fb:
                            failbacks.append(int(fb.group(1)))
        except OSError:
            pass
        out[r.name] = {"warn_error_by_message": by_message, "failbacks_on_fallback_ms": failbacks,
                       "restarts": r.restarts}
    return out


def save_run_files(run_dir, result, clients, watchers, arrivals_abs, t0, stack):
    first = result["first_send"]
    with open(os.path.join(run_dir, "faults.json"), "w") as f:
        json.dump({"plan": result["plan"], "ran": result["faults"], "skipped": result["faults_skipped"]}, f, indent=2)
    with open(os.path.join(run_dir, "arrivals.txt"), "w") as f:
        f.write("# seconds since the first request sent\n")
        for a in sorted(arrivals_abs):
            f.write(f"{a - t0 - first:.6f}\n")
    os.remove(stack.arrivals_path)
    with open(os.path.join(run_dir, "watcher.csv"), "w") as f:
        f.write("t,replica,state,fallback_secs\n")
        rows = sorted((t, w.r.name, s, fb) for w in watchers for t, s, fb in w.samples)
        for t, name, s, fb in rows:
            f.write(f"{t},{name},{s},{'' if fb is None else fb}\n")
    with open(os.path.join(run_dir, "watcher-metrics.csv"), "w") as f:
        f.write("t,replica,backend_local,reloads_ok,probes_ok,probes_failed\n")
        for w in watchers:
            for row in w.metrics:
                f.write(",".join([str(row[0]), w.r.name] + ["" if v is None else f"{v:g}" for v in row[1:]]) + "\n")
    rows = sorted(
        (t, r, st, ms) for c in clients for t, r, st, ms in zip(c.rec_t, c.rec_r, c.rec_s, c.rec_ms)
    )
    with gzip.open(os.path.join(run_dir, "responses.csv.gz"), "wt", compresslevel=1) as f:
        f.write("t,replica,status,ms\n")  # t: the load's clock (seconds since t0); status 0: connection error
        for t, r, st, ms in rows:
            f.write(f"{t:.4f},gw{r},{st},{ms:.2f}\n")
    # Client-side counts per second of the load's clock; admitted from the
    # upstream's stamps, by second since t0.
    n = len(clients[0].per_sec["ok"])
    adm = [0] * n
    for a in arrivals_abs:
        s = int(a - t0)
        if 0 <= s < n:
            adm[s] += 1
    with open(os.path.join(run_dir, "per_second.csv"), "w") as f:
        f.write("second,admitted,client_200,client_429,client_5xx,client_other,conn_errors\n")
        for s in range(n):
            vals = [sum(c.per_sec[k][s] for c in clients) for k in ("ok", "429", "5xx", "other", "errors")]
            f.write(f"{s},{adm[s]}," + ",".join(map(str, vals)) + "\n")


# ------------------------------------------------------------- outputs


def fmt_kinds(k):
    short = {"redis-stall": "stall", "redis-restart": "restart", "blackhole": "blackhole",
             "replica-kill": "kill", "replica-term": "term", "reload": "reload"}
    return ", ".join(f"{short[n]} {k[n]}" for n in FAULT_KINDS if k.get(n))


def num(v, spec):
    return "-" if v is None else format(v, spec)


def table(results):
    header = ("seed", "T (s)", "admitted", "bound", "% of bound", "worst window overshoot", "slack", "5xx",
              "conn errors", "429s", "longest fallback after heal (s)", "after final fault (s)",
              "fallbacks no fault explains", "upstream", "quota used", "diff", "SIGKILL allowance", "SIGKILLs",
              "SIGTERMs", "faults", "pass")
    rows = []
    for r in results:
        fb = f"{r['longest_fallback_after_heal']:.2f}" + (" STUCK " + "/".join(r["stuck_on_fallback"]) if r["stuck_on_fallback"] else "")
        q = r.get("quota") or {}
        lo, hi = q.get("allowed", (None, None))
        allowed = "-" if lo is None else f"{lo:+d} to {hi:+d}" if (lo, hi) != (0, 0) else "0"
        rows.append((
            r["seed"], f"{r['T']:.1f}", r["admitted"], f"{r['bound']:.1f}", num(r["pct_of_bound"], ".1f"),
            num(r["worst_window_overshoot"], "+.1f"), f"{r['slack']:.1f}", r["status_5xx"], r["conn_errors"],
            r["status_429"], fb, f"{r['fallback_after_final_fault']:.2f}",
            len(r["unexplained_fallback_episodes"]), num(q.get("upstream"), "d"), num(q.get("used"), "d"),
            num(q.get("diff"), "+d"), allowed, num(q.get("kills"), "d"), num(q.get("terms"), "d"),
            fmt_kinds(r["faults_by_kind"]) or "-", "yes" if r["pass"] else "NO",
        ))
    return "\n".join(tables.table(header, "r" * 19 + "ll", rows)) + "\n"


FAULT_COLOURS = {
    "redis-stall": "#d62728", "redis-restart": "#9467bd", "blackhole": "#ff7f0e",
    "replica-kill": "#8c564b", "replica-term": "#17becf", "reload": "#2ca02c",
}


def plot(out_dir, results):
    import bisect

    plt = pyplot()
    from matplotlib.patches import Patch

    n = len(results)
    fig, axes = plt.subplots(n + 1, 1, figsize=(12, 2.4 * (n + 1) + 0.6), squeeze=False)
    axes = axes[:, 0]
    curves = []
    for ax, r in zip(axes, results):
        run_dir = os.path.join(out_dir, f"seed-{r['seed']}")
        with open(os.path.join(run_dir, "arrivals.txt")) as f:
            arr = [float(x) for x in f if not x.startswith("#")]
        T = r["T"]
        secs = int(T) + 1
        per = [0] * secs
        for a in arr:
            if 0 <= a < secs:
                per[int(a)] += 1
        first = r["first_send"]
        for f in r["faults"]:
            ax.axvspan(f["start"] - first, f["heal"] - first, color=FAULT_COLOURS[f["kind"]], alpha=0.25, lw=0)
        ax.bar(range(secs), per, width=0.9, align="edge", color="#1f77b4", alpha=0.85)
        ax.axhline(REFILL, color="black", lw=1, ls="--")
        # Above the bars, one lane per replica marks its stays on the
        # fallback, so a stay that outlives its fault stands out.
        peak = max(max(per, default=0), CAPACITY + REFILL)
        lane = peak * 0.12
        with open(os.path.join(run_dir, "watcher.csv")) as fh:
            next(fh)
            rows = [ln.rstrip("\n").split(",") for ln in fh]
        for ri in range(REPLICAS):
            samples = [(float(t) - first, st, None) for t, name, st, _ in rows if name == f"gw{ri}"]
            spans = [(s0, (e if e is not None else T) - s0) for s0, e in episodes(samples)]
            y = peak * 1.08 + lane * ri
            ax.broken_barh(spans, (y, lane * 0.7), color="#e377c2")
            ax.text(T + 0.4, y + lane * 0.35, f"gw{ri}", fontsize=7, va="center")
        ax.set_ylim(0, peak * 1.08 + lane * REPLICAS + lane * 0.3)
        ax.set_yticks([v for v in ax.get_yticks() if 0 <= v <= peak])
        ax.set_xlim(0, T + 0.4 + max(1.5, T * 0.03))
        ax.set_ylabel("admitted / s")
        ax.set_title(
            f"seed {r['seed']}: admitted {r['admitted']} / bound {r['bound']:.0f} ({r['pct_of_bound']:.1f}%), "
            f"worst window {num(r['worst_window_overshoot'], '+.1f')}, slack {r['slack']:.0f}, "
            f"5xx {r['status_5xx']}, longest fallback after heal {r['longest_fallback_after_heal']:.2f}s, "
            f"quota used {num((r.get('quota') or {}).get('used'), 'd')} (upstream "
            f"{num((r.get('quota') or {}).get('upstream'), 'd')})",
            fontsize=9,
        )
        # Sampled on a grid: count(arrivals <= t) - (50 + 20 t).
        grid = [i * 0.05 for i in range(int(T / 0.05) + 1)]
        curves.append((r["seed"], grid, [bisect.bisect_right(arr, t) - (CAPACITY + REFILL * t) for t in grid]))
    handles = [Patch(color=c, alpha=0.35, label=k) for k, c in FAULT_COLOURS.items()]
    handles += [
        Patch(color="#1f77b4", label="admitted per second (upstream)"),
        plt.Line2D([], [], color="black", ls="--", lw=1, label=f"refill {REFILL:g}/s"),
        Patch(color="#e377c2", label="replica on its fallback (lanes gw0..gw2)"),
    ]
    fig.legend(handles=handles, fontsize=8, ncol=4, loc="upper center", frameon=False)
    ax = axes[-1]
    longest = max(r["T"] for r in results)
    ax.set_xlim(0, longest + 0.4 + max(1.5, longest * 0.03))  # aligned with the panels above
    low = 0.0
    for seed, xs, ys in curves:
        ax.plot(xs, ys, lw=1, label=f"seed {seed}")
        # The first second (the bucket's burst filling) is left off the scale.
        low = min([low] + [y for x, y in zip(xs, ys) if x >= 1.0])
    high = max([0.0] + [max(ys) for _, _, ys in curves])
    ax.set_ylim(low - 3, high + 3)
    ax.axhline(0, color="black", lw=1, ls="--")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("admitted - (50 + 20 t)")
    ax.set_title("cumulative admitted minus the exact bound (above 0: over it; the first second's fill is off scale)",
                 fontsize=9)
    if len(curves) <= 12:
        ax.legend(fontsize=7, ncol=6, loc="best")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    save_png(fig, os.path.join(out_dir, "chaos.png"), 110)


def write_outputs(out_dir, results, args, interrupted):
    summary = {
        "params": {
            "duration": args.duration, "clients": args.clients, "seeds": args.seed_list,
            "fault_kinds": list(args.fault_kinds), "redis_dir": args.redis_dir,
            "capacity": CAPACITY, "refill_per_sec": REFILL, "replicas": REPLICAS,
            "quota": {"limit": args.quota, "period": QUOTA_PERIOD} if args.quota else None,
            "lease_period_ms": LEASE_PERIOD_MS,
            "settle_secs": SETTLE_SECS,
            "slack": "computed per run" if args.slack is None else args.slack,
            "max_fallback_after_heal": args.max_fallback_after_heal,
            "bin_dir": args.bin_dir, "cpus": os.cpu_count(),
            "loadavg_end": loadavg(),
            "git_commit": files.git_commit(ROOT), "interrupted": interrupted,
        },
        "runs": results,
        "pass": all(r["pass"] for r in results) and not interrupted,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    t = table(results)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(t)
    print()
    print(t)
    for r in results:
        if r["failures"]:
            print(f"seed {r['seed']} FAILED: " + "; ".join(r["failures"]))
        if r["unexplained_fallback_episodes"]:
            eps = ", ".join(
                f"{e['replica']} {e['start']:.1f}-" + ("end" if e["end"] is None else f"{e['end']:.1f}s")
                for e in r["unexplained_fallback_episodes"]
            )
            print(f"seed {r['seed']}: stays on the fallback no fault explains (load clock): {eps}")
        if r["stuck_on_fallback"]:
            print(f"seed {r['seed']}: still on the fallback at the end: {', '.join(r['stuck_on_fallback'])}")
        q = r.get("quota")
        if q:
            stops = "; ".join(
                f"{e['kind']} {e['replica']} at {e['at']:.1f}s: in flight {e['in_flight']}, "
                f"200s in the last {2 * LEASE_PERIOD_MS} ms {e[f'200s_last_{2 * LEASE_PERIOD_MS}ms']}, "
                f"left in the ledger {num(e['left_in_ledger'], 'd')}"
                + (f", exit {e['exit_code']} after {e['exit_secs']}s" if e["kind"] == "replica-term" else "")
                + (f" ({e['why']})" if e.get("why") else "")
                for e in q["stops"]
            )
            d = q.get("drift") or {}
            steps = "; ".join(
                " + ".join(x["what"]) + ": " + (f"{x['step']:+d}" if x["step"] is not None else "?")
                for x in d.get("steps", []) if x["step"] != 0
            )
            print(f"seed {r['seed']} quota: used {num(q['used'], 'd')} - upstream {q['upstream']} = {num(q['diff'], '+d')} "
                  f"(SIGKILLs explain {q['allowed'][0]:+d} to {q['allowed'][1]:+d}); drift before any disturbance "
                  f"{num(d.get('before_first'), '+d')}, at the end {num(d.get('at_end'), '+d')}; "
                  f"what moved it: {steps or 'nothing'}; stops: {stops or 'none'}")
    # Per kind of disturbance, over the steps that had one kind only.
    by_kind = {}
    for r in results:
        for x in ((r.get("quota") or {}).get("drift") or {}).get("steps", []):
            key = x["kinds"][0] if len(x["kinds"]) == 1 else "mixed"
            k = by_kind.setdefault(key, {"disturbances": 0, "moved": 0, "sum": 0, "unknown": 0, "steps": []})
            k["disturbances"] += 1
            if x["step"] is None:
                k["unknown"] += 1
            else:
                k["moved"] += x["step"] != 0
                k["sum"] += x["step"]
                if x["step"]:
                    k["steps"].append(x["step"])
    summary["quota_drift_by_kind"] = by_kind
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if by_kind:
        print("quota drift by disturbance (all runs; 'mixed': overlapping kinds): " + "; ".join(
            f"{k}: {v['disturbances']}, {v['moved']} moved it (total {v['sum']:+d}"
            + (f": {', '.join(f'{x:+d}' for x in v['steps'])}" if v["steps"] else "") + ")"
            + (f", {v['unknown']} unmeasured" if v["unknown"] else "")
            for k, v in sorted(by_kind.items())))
    try:
        plot(out_dir, results)
    except Exception as e:  # the numbers matter more than the picture
        print(f"chaos.py: the plot failed: {e!r}", file=sys.stderr)
    say(f"outputs: {out_dir}/summary.json, table.md, chaos.png")


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return None


# ------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 1,2,3")
    p.add_argument("--runs", type=int, default=10, help="runs seeds seed-base .. seed-base+runs-1 (default 10)")
    p.add_argument("--seed-base", type=int, default=1, help="first seed with --runs (default 1)")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per run (default 90)")
    p.add_argument("--clients", type=int, default=6, help="client threads (default 6)")
    p.add_argument("--out", help="output folder (default loadtest/results/chaos-<timestamp>/)")
    p.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"),
                   help="where gateway and tcp-forwarder are (default target/release)")
    p.add_argument("--max-fallback-after-heal", type=float, default=None,
                   help="fail a run whose replica stays on its fallback longer than this after a heal")
    p.add_argument("--slack", type=float, default=None,
                   help="requests over the exact bound tolerated (default: per run, the sum over "
                        "blackhole and replica-kill faults of 50/3 + 20/3 x their seconds)")
    p.add_argument("--faults", default=",".join(FAULT_KINDS),
                   help="the fault kinds drawn from, comma-separated, or 'none' (default: all of "
                        + ", ".join(FAULT_KINDS) + ")")
    p.add_argument("--quota", type=int, default=QUOTA_LIMIT,
                   help=f"the plan's monthly quota (default {QUOTA_LIMIT:,}: it never binds in a run); "
                        "0: none (no quota check, as the soak was before it had one)")
    p.add_argument("--redis-dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
                   help="where Redis's AOF folder is made (default /dev/shm, a tmpfs: a SIGKILLed Redis "
                        "loses nothing either way, and a busy disk's fsync stalls are not faults the "
                        "soak planned; else the system's temp dir)")
    p.add_argument("--serve-upstream", metavar="ARRIVALS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_upstream:
        return a
    if a.seeds:
        try:
            a.seed_list = [int(s) for s in a.seeds.split(",") if s.strip()]
        except ValueError:
            p.error("--seeds takes whole numbers, comma-separated")
    else:
        if a.runs < 1:
            p.error("--runs must be at least 1")
        a.seed_list = list(range(a.seed_base, a.seed_base + a.runs))
    if not a.seed_list:
        p.error("no seeds")
    if a.duration < QUIET_TAIL_SECS + 5:
        p.error(f"--duration must be at least {QUIET_TAIL_SECS + 5:g}s")
    if a.clients < 1:
        p.error("--clients must be at least 1")
    if a.quota < 0:
        p.error("--quota must be 0 (none) or more")
    if a.faults.strip() == "none":
        a.fault_kinds = ()
    else:
        a.fault_kinds = tuple(k.strip() for k in a.faults.split(",") if k.strip())
        bad = [k for k in a.fault_kinds if k not in FAULT_KINDS]
        if bad or not a.fault_kinds:
            p.error(f"--faults: unknown {', '.join(bad) or '(empty)'}; choose among {', '.join(FAULT_KINDS)} or none")
    a.bin_dir = os.path.abspath(a.bin_dir)
    return a


def main(argv):
    args = parse_args(argv)
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    for b in ("gateway", "tcp-forwarder"):
        if not os.access(os.path.join(args.bin_dir, b), os.X_OK):
            print(f"chaos.py: {args.bin_dir}/{b} is missing: build first (cargo build --release)", file=sys.stderr)
            return 2
    if not shutil.which("redis-server"):
        print("chaos.py: redis-server is not installed", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.join(ROOT, "loadtest", "results", f"chaos-{datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(out_dir, exist_ok=True)
    out_dir = os.path.abspath(out_dir)

    # SIGTERM unwinds like Ctrl-C, through every run's teardown.
    def on_term(*_):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_term)
    say(f"chaos soak: seeds {args.seed_list}, {args.duration:g}s each, {args.clients} clients; "
        f"limit {CAPACITY} + {REFILL:g}/s over {REPLICAS} replicas; slack "
        + ("computed per run (sum over blackhole and replica-kill faults of 50/3 + 20/3 x D)"
           if args.slack is None else f"{args.slack:g}"))
    results, interrupted, rc = [], False, 0
    try:
        for seed in args.seed_list:
            results.append(run_one(seed, args, out_dir))
            r = results[-1]
            say(f"== seed {seed}: admitted {r['admitted']} / bound {r['bound']:.1f} ({r['pct_of_bound']:.1f}%), "
                f"slack {r['slack']:.1f}, worst window {num(r['worst_window_overshoot'], '+.1f')}, 5xx {r['status_5xx']}, "
                f"errors {r['conn_errors']}, longest fallback after heal {r['longest_fallback_after_heal']:.2f}s"
                + (f", quota used {r['quota']['used']} vs upstream {r['quota']['upstream']} "
                   f"({num(r['quota']['diff'], '+d')}; SIGKILLs {r['quota']['kills']}, SIGTERMs {r['quota']['terms']}, "
                   f"allowed {r['quota']['allowed'][0]:+d} to {r['quota']['allowed'][1]:+d})" if r["quota"] else "")
                + ": "
                + ("pass" if r["pass"] else "FAIL: " + "; ".join(r["failures"])))
    except KeyboardInterrupt:
        interrupted, rc = True, 130
        say("interrupted: every process stopped")
    except SetupError as e:
        print(f"chaos.py: {e}", file=sys.stderr)
        rc = 2
    if results:
        write_outputs(out_dir, results, args, interrupted)
        if rc == 0 and not all(r["pass"] for r in results):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
