"""The cost of `charge`: a route charged by the answer against the same route
without `charge`, side by side in one gateway, in one run.

One mock upstream answering `POST .../chat/completions` like an LLM API, and
per variant one gateway whose config has both routes on that upstream:

    charged  /charged/...  charge = { response = ["sse:usage.total_tokens",
             "json:usage.total_tokens"], estimate = "json:max_tokens",
             max = 4096 }; token bucket (1e9 at 1e9/s, per client) with
             cost = "response"
    plain    /plain/...    the same route without charge; the same bucket,
             cost 1

Variants (--variants): `redis` (the deployment shape: Redis backend, leases
and standing shares on, a redis-server of its own), `leases` (Redis backend,
leases on, shares off: a charged tier spent from leases and settled through
them) and `local` (the local backend). Four targets per variant: plain-json, charged-json, plain-sse,
charged-sse (`"stream": true`). In rounds (the order forward, then reversed,
...; machine drift hits every target alike), each round:

1. max throughput: wrk (closed loop, -t1 -c16 by default) POSTs
   {"max_tokens": M, "stream": ...} to each target for --duration s:
   requests/s; the gateway's CPU per request (utime + stime of its process
   from /proc/PID/stat over the window, over requests); Redis's script calls
   (evalsha and the like, INFO commandstats) and all its commands per
   request; the gateway's charge reasons and decision paths (/metrics).
2. time to first byte, in paired windows: one client (this process,
   stdlib sockets, one keep-alive connection for all three) sends
   --triples triples: the plain request twice (A, B) and the charged one
   (C), in the six orders in turn; `x-mock-tokens` fixes the answer (the
   same on every request), SSE answers with `x-mock-chunk-ms` before each
   piece. Send -> first byte of the body, and send -> last byte. Each
   --window consecutive triples are a paired window: its median of C - A
   is what `charge` adds there; its noise is how far apart two identical
   plain requests sent side by side typically land (the median of |B - A|),
   and its median of B - A is reported beside it. One connection, because
   two connections can differ by a few µs (the worker thread each lands
   on) that a route would be blamed for.

Then per round charged / plain (CPU per request, Redis calls per request)
and the medians over rounds, and the checks: CPU ratio <= --cpu-limit (json
and sse); the added TTFB (the median of the windows' C - A) at most the
noise of the paired windows (the median of their median |B - A|), with
every request's C - A pooled and its 95% interval beside it (what charge
adds, resolved: the noise is a spread, not a standard error, so a cost of
a few µs is reported, not failed for being measured precisely); Redis script
calls per request beyond the replica's heartbeats (one a second whatever
the traffic) of charged <= plain's. Writes --out/summary.md, summary.json,
charge.png, raw/ (each window's wrk JSON and TTFB samples), config/, logs/.
Exit status 0 when every check holds, 1 otherwise.
"""

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lt.files import git_commit, write_json  # noqa: E402
from lt.metrics import samples  # noqa: E402
from lt.plots import pyplot, save_png  # noqa: E402
from lt.procs import free_ports, log, warn  # noqa: E402
from lt.stats import percentile  # noqa: E402
from lt.tables import table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "loadtest"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SECRET = "charge-bench-secret"
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")
KINDS = ("json", "sse")
VARIANT_TEXT = {"redis": "`redis` (Redis backend, leases and standing shares on)",
                "leases": "`leases` (Redis backend, leases on, shares off)", "local": "`local` (local backend)"}
VARIANTS = tuple(VARIANT_TEXT)
ROUTES = ("plain", "charged")


# --- configs ---------------------------------------------------------------------------------


def gateway_config(variant, port, admin, upstream, redis_port, threads):
    limiter = 'backend = "local"\n'
    redis = ""
    if variant != "local":
        shares = "true" if variant == "redis" else "false"
        limiter = ('backend = "redis"\non_redis_failure = "local"\ninstances = 1\n\n'
                   f"[limiter.leases]\nenabled = true\n\n[limiter.shares]\nenabled = {shares}\n")
        redis = (f'[redis]\nurls = ["redis://127.0.0.1:{redis_port}"]\n'
                 f'key_prefix = "charge-bench-{variant}"\n')
    bucket = 'algorithm = "token_bucket", capacity = 1000000000, refill_per_sec = 1000000000, scope = "client"'
    return f"""# loadtest/charge_bench.py, variant {variant}: both routes on one upstream.
[server]
listen = ["127.0.0.1:{port}"]
admin_listen = "127.0.0.1:{admin}"
threads = {threads}
grace_period_secs = 1

[limiter]
{limiter}
{redis}
[plans.bench]
capacity = 1000000000
refill_per_sec = 1000000000

[[api_keys]]
id = "bench"
key = "{SECRET}"
plan = "bench"

[[upstreams]]
name = "llm"
servers = ["127.0.0.1:{upstream}"]

[[routes]]
name = "charged"
path_prefix = "/charged"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["sse:usage.total_tokens", "json:usage.total_tokens"], estimate = "json:max_tokens", max = 4096 }}
limit = {{ {bucket}, cost = "response" }}

[[routes]]
name = "plain"
path_prefix = "/plain"
methods = ["POST"]
upstream = "llm"
require_api_key = true
limit = {{ {bucket} }}
"""


WRK_LUA = """-- loadtest/charge_bench.py: POST $CHARGE_BODY (JSON) with wrk's fast path
-- (no request() hook); the JSON summary of bench/wrk-summary.lua at the end.
dofile(os.getenv("WRK_SUMMARY_LUA"))
wrk.method = "POST"
wrk.body = os.getenv("CHARGE_BODY")
wrk.headers["content-type"] = "application/json"
"""


def body(kind, max_tokens, pad=0):
    """A chat-completion request; `pad` bytes more of conversation (a real
    one carries its history), before `max_tokens` so the estimate's scan
    reads them all."""
    content = "Say something." + ("x" * pad)
    return json.dumps({"model": "mock", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "stream": kind == "sse"}, separators=(",", ":"))


# --- processes -------------------------------------------------------------------------------


class Proc:
    """A server started here, stopped by its PID."""

    def __init__(self, name, argv, log_path, env=None):
        self.name = name
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
        self.pid = self.p.pid

    def alive(self):
        return self.p.poll() is None

    def stop(self, sig=signal.SIGTERM, secs=10):
        if self.p.poll() is None:
            try:
                os.kill(self.pid, sig)
                self.p.wait(secs)
            except subprocess.TimeoutExpired:
                warn(f"{self.name} (PID {self.pid}) did not exit within {secs}s: SIGKILL")
                os.kill(self.pid, signal.SIGKILL)
                self.p.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def get(url, timeout=2):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode(errors="replace")


def wait_for(what, check, proc, secs=30):
    t0 = time.monotonic()
    while time.monotonic() - t0 < secs:
        if proc is not None and not proc.alive():
            tail = Path(proc.log_path).read_text(errors="replace")[-3000:]
            raise SystemExit(f"{what}: exited ({proc.p.returncode}) before it was ready:\n{tail}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what}: not ready after {secs}s")


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine_busy_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7]


def own_ticks():
    """This process and its waited children (wrk), in clock ticks."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (me.ru_utime + me.ru_stime + ch.ru_utime + ch.ru_stime) * CLK_TCK


def redis_cmdstats(port):
    if port is None:
        return {}
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), "info", "commandstats"],
                         capture_output=True, text=True, timeout=10).stdout
    stats = {}
    for line in out.splitlines():
        m = re.match(r"cmdstat_([^:]+):calls=(\d+),usec=(\d+)", line.strip())
        if m:
            stats[m.group(1)] = int(m.group(2))
    return stats


def gateway_counters(admin):
    """The charge reasons, decision paths and statuses from /metrics."""
    try:
        _, text = get(f"http://127.0.0.1:{admin}/metrics", timeout=5)
    except OSError:
        return {}
    c = {}
    for name, labels, v in samples(text):
        if name == "gateway_charged_requests_total":
            c[f"charged:{labels.get('reason', '?')}"] = v
        elif name in ("gateway_charged_units_total",):
            c["charged_units"] = v
        elif name == "gateway_settled_tokens_total":
            c[f"settled:{labels.get('kind', '?')}"] = v
        elif name == "gateway_limiter_decisions_total":
            k = f"decided:{labels.get('path', '?')}"
            c[k] = c.get(k, 0) + v
        elif name == "gateway_fallback_transitions_total":
            c[f"fallback_to:{labels.get('to', '?')}"] = v
        elif name == "gateway_redis_errors_total":
            k = f"redis_errors:{labels.get('reason', '?')}"
            c[k] = c.get(k, 0) + v
        elif name == "gateway_requests_total":
            k = f"status:{labels.get('status', '?')}"
            c[k] = c.get(k, 0) + v
    return c


def delta(a, b):
    return {k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) - a.get(k, 0)}


# --- the max-throughput window ------------------------------------------------------------------


class Bench:
    def __init__(self, a, out, gws, mock, redis, redis_port):
        self.a, self.out, self.gws, self.mock, self.redis, self.redis_port = a, out, gws, mock, redis, redis_port
        self.lua = out / "config" / "wrk-post.lua"
        self.lua.write_text(WRK_LUA)

    def ours(self):
        t = sum(cpu_ticks(g["proc"].pid) for g in self.gws.values()) + cpu_ticks(self.mock.pid)
        if self.redis:
            t += cpu_ticks(self.redis.pid)
        return t + own_ticks()

    def throughput(self, variant, kind, route, secs, tag):
        g = self.gws[variant]
        url = f"http://127.0.0.1:{g['port']}/{route}/v1/chat/completions"
        wrk_json = self.out / "raw" / f"wrk-{tag}.json"
        env = dict(os.environ, WRK_JSON=str(wrk_json), WRK_SUMMARY_LUA=str(HERE / "bench" / "wrk-summary.lua"),
                   CHARGE_BODY=body(kind, self.a.max_tokens, self.a.body_pad))
        argv = [self.a.wrk, f"-t{self.a.wrk_threads}", f"-c{self.a.connections}", f"-d{secs}s",
                "-s", str(self.lua), "-H", f"x-api-key: {SECRET}", url]
        pid = g["proc"].pid
        rport = self.redis_port if variant != "local" else None
        cmd0, met0 = redis_cmdstats(rport), gateway_counters(g["admin"])
        gw0, mock0, ours0, busy0 = cpu_ticks(pid), cpu_ticks(self.mock.pid), self.ours(), machine_busy_ticks()
        t0 = time.monotonic()
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=secs + 30)
        wall = time.monotonic() - t0
        gw1, mock1, ours1, busy1 = cpu_ticks(pid), cpu_ticks(self.mock.pid), self.ours(), machine_busy_ticks()
        cmd1, met1 = redis_cmdstats(rport), gateway_counters(g["admin"])
        if r.returncode != 0 or not wrk_json.exists():
            raise SystemExit(f"wrk failed on {url} ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        w = json.loads(wrk_json.read_text())
        n = w["requests"]
        cmds = delta(cmd0, cmd1)
        scripts = sum(v for k, v in cmds.items() if k in SCRIPT_COMMANDS)
        # The replica's heartbeats (one a second, whatever the traffic): heartbeat.lua is the
        # only script calling ZCARD, once per call.
        heartbeats = cmds.get("zcard", 0)
        above = max(0, scripts - heartbeats) if rport else None
        met = delta(met0, met1)
        errors = sum(w["errors"].values())
        return {
            "requests": n,
            "rps": n / (w["duration_us"] / 1e6),
            "errors": w["errors"],
            "non2xx_or_errors": errors,
            "gateway_cpu_us_per_req": (gw1 - gw0) / CLK_TCK * 1e6 / n if n else None,
            "mock_cpu_us_per_req": (mock1 - mock0) / CLK_TCK * 1e6 / n if n else None,
            "wall_s": wall,
            "redis_script_calls": scripts if rport else None,
            "redis_script_calls_per_req": scripts / n if rport and n else None,
            "redis_heartbeats": heartbeats if rport else None,
            "redis_script_calls_above_idle_per_req": above / n if rport and n else None,
            "redis_commands_per_req": sum(cmds.values()) / n if rport and n else None,
            "redis_commands": cmds,
            "other_load_pct": max(0.0, (busy1 - busy0) - (ours1 - ours0)) / CLK_TCK / wall * 100,
            "gateway_metrics": met,
            "latency_us": w["latency_us"],
        }


# --- the paired TTFB window --------------------------------------------------------------------


class Conn:
    """A keep-alive HTTP/1.1 connection; one request at a time, timed."""

    def __init__(self, port):
        self.port = port
        self.s = None

    def open(self):
        self.s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self):
        if self.s is not None:
            self.s.close()
            self.s = None

    def request(self, raw):
        """(status, first body byte s, end s, body) after sending raw; the times
        from just before the send."""
        if self.s is None:
            self.open()
        clock = time.perf_counter
        t0 = clock()
        self.s.sendall(raw)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = self.s.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the headers")
            buf += chunk
        t_recv = clock()
        head, rest = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        keep = hdrs.get("connection", "").lower() != "close"
        t_first = None
        body_out = bytearray()
        if "chunked" in hdrs.get("transfer-encoding", "").lower():
            data = rest
            while True:
                # A chunk-size line, its data, CRLF; the first data byte's arrival is t_first.
                while b"\r\n" not in data:
                    more = self.s.recv(65536)
                    if not more:
                        raise ConnectionError("closed mid-body")
                    t_recv = clock()
                    data += more
                line, data = data.split(b"\r\n", 1)
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    while not (data.startswith(b"\r\n") or b"\r\n\r\n" in data):
                        more = self.s.recv(65536)
                        if not more:
                            break
                        data += more
                    break
                if t_first is None:
                    if not data:
                        more = self.s.recv(65536)
                        if not more:
                            raise ConnectionError("closed mid-body")
                        t_recv = clock()
                        data += more
                    t_first = t_recv
                while len(data) < size + 2:
                    more = self.s.recv(65536)
                    if not more:
                        raise ConnectionError("closed mid-body")
                    data += more
                body_out += data[:size]
                data = data[size + 2:]
        else:
            length = int(hdrs.get("content-length", "0"))
            data = rest
            if length and not data:
                data += self.s.recv(65536)
                t_recv = clock()
            if length:
                t_first = t_recv
            while len(data) < length:
                more = self.s.recv(65536)
                if not more:
                    raise ConnectionError("closed mid-body")
                data += more
            body_out += data[:length]
        t_end = clock()
        if not keep:
            self.close()
        return status, (t_first or t_end) - t0, t_end - t0, bytes(body_out)


def raw_request(port, route, kind, a):
    b = body(kind, a.max_tokens, a.body_pad).encode()
    extra = f"x-mock-chunk-ms: {a.chunk_ms}\r\n" if kind == "sse" and a.chunk_ms else ""
    return (f"POST /{route}/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"x-api-key: {SECRET}\r\ncontent-type: application/json\r\ncontent-length: {len(b)}\r\n"
            f"x-mock-tokens: {a.ttfb_tokens}\r\n{extra}\r\n").encode() + b


# Each of the three requests in each place equally often, and after each
# other kind equally often.
ORDERS = ("ABC", "BCA", "CAB", "ACB", "BAC", "CBA")


def ttfb_window(port, kind, a, n, tag, out, rng):
    """n triples, one request at a time on one keep-alive connection: A and
    B the plain route (the same request twice), C the charged one, in the
    six orders in turn. One connection for all three: two connections can
    differ by a few µs (which worker thread serves each), which a route
    would otherwise be blamed for. The samples, in send order."""
    plain = raw_request(port, "plain", kind, a)
    reqs = {"A": plain, "B": plain, "C": raw_request(port, "charged", kind, a)}
    conn = Conn(port)
    rows = []
    bad = 0
    try:
        for i in range(n):
            order = ORDERS[i % len(ORDERS)]
            rec = {"i": i, "order": order}
            for k in order:
                try:
                    status, first, end, resp = conn.request(reqs[k])
                except (OSError, ConnectionError, ValueError):
                    conn.close()
                    status, first, end, resp = 0, None, None, b""
                ok = status == 200 and (b"[DONE]" in resp if kind == "sse" else b'"usage"' in resp)
                if not ok:
                    bad += 1
                    first = end = None
                rec[f"{k}_ttfb_ms"] = None if first is None else first * 1e3
                rec[f"{k}_end_ms"] = None if end is None else end * 1e3
            rows.append(rec)
            if a.gap_ms:
                time.sleep(a.gap_ms / 1e3 * (0.5 + rng.random()))
    finally:
        conn.close()
    write_json(out / "raw" / f"ttfb-{tag}.json", rows)
    return rows, bad


def diffs(rows, what, x):
    """x - A of each triple: C - A what the charged route adds, B - A what
    the plain route shows against itself."""
    return [r[f"{x}_{what}_ms"] - r[f"A_{what}_ms"] for r in rows
            if r[f"{x}_{what}_ms"] is not None and r[f"A_{what}_ms"] is not None]


def windows(rows, what, size):
    """The paired windows of a round: each `size` consecutive triples (a
    last, shorter run is left out): its median of charged - plain (C - A),
    its median of plain - plain (B - A), and its noise, the median size of
    plain - plain (|B - A|: how far apart two identical requests sent side
    by side typically land)."""
    out = []
    for s in range(0, len(rows) - size + 1, size):
        c, b = diffs(rows[s:s + size], what, "C"), diffs(rows[s:s + size], what, "B")
        if c and b:
            out.append((statistics.median(c), statistics.median(b), statistics.median(abs(x) for x in b)))
    return out


def median_ci(vals, z=1.96):
    """The median and a distribution-free ~95% confidence interval for it
    (order statistics)."""
    s = sorted(vals)
    n = len(s)
    if n == 0:
        return None, None, None
    k = max(0, int((n - z * n ** 0.5) / 2))
    return statistics.median(s), s[k], s[min(n - 1, n - 1 - k)]


def added_and_noise(wins):
    """What charge adds, the median of the windows' charged - plain, and the
    noise of the paired windows, the median of their noise (how far apart
    two identical plain requests side by side typically land). A spread,
    not a standard error: it does not shrink as samples are added, so a
    cost of a few µs is not failed for being measured precisely, while a
    buffered body or a Redis round trip per request (tens of µs and more)
    is."""
    if not wins:
        return None, None
    return statistics.median(w[0] for w in wins), statistics.median(w[2] for w in wins)


def ttfb_summary(rows, size):
    out = {}
    for what in ("ttfb", "end"):
        plain = [r[f"{k}_{what}_ms"] for r in rows for k in "AB"]
        charged = [r[f"C_{what}_ms"] for r in rows]
        wins = windows(rows, what, size)
        added, noise = added_and_noise(wins)
        out[what] = {
            "plain_p50_ms": percentile(plain, 50), "plain_p99_ms": percentile(plain, 99),
            "charged_p50_ms": percentile(charged, 50), "charged_p99_ms": percentile(charged, 99),
            "windows": [list(w) for w in wins], "added_ms": added, "noise_ms": noise,
        }
    return out


# --- the report ---------------------------------------------------------------------------


def fmt(x, nd=1, unit=""):
    return "" if x is None else f"{x:,.{nd}f}{unit}"


def med(vals):
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else None


def ratio(x, y):
    return None if x is None or y is None or y == 0 else x / y


def report(a, out, meta, rounds, pooled_ttfb, logs_summary):
    variants = a.variants
    rows_tp, rows_ratio, rows_ttfb = [], [], []
    per = {}  # (variant, kind) -> lists over rounds
    for rd in rounds:
        for v in variants:
            for kind in KINDS:
                p, c = rd["targets"][f"{v}/plain-{kind}"], rd["targets"][f"{v}/charged-{kind}"]
                cr = ratio(c["gateway_cpu_us_per_req"], p["gateway_cpu_us_per_req"])
                rr = ratio(c["redis_script_calls_per_req"], p["redis_script_calls_per_req"])
                d = per.setdefault((v, kind), {k: [] for k in (
                    "cpu_ratio", "calls_ratio", "plain_calls", "charged_calls", "plain_calls_above",
                    "charged_calls_above", "plain_cpu", "charged_cpu", "plain_rps", "charged_rps", "rps_ratio",
                    "ttfb_windows", "end_windows",
                    "plain_ttfb_p50", "charged_ttfb_p50", "plain_ttfb_p99", "charged_ttfb_p99")})
                d["cpu_ratio"].append(cr)
                d["calls_ratio"].append(rr)
                for side, t in (("plain", p), ("charged", c)):
                    d[f"{side}_calls"].append(t["redis_script_calls_per_req"])
                    d[f"{side}_calls_above"].append(t["redis_script_calls_above_idle_per_req"])
                    d[f"{side}_cpu"].append(t["gateway_cpu_us_per_req"])
                    d[f"{side}_rps"].append(t["rps"])
                d["rps_ratio"].append(ratio(c["rps"], p["rps"]))
                t = rd["ttfb"].get(f"{v}/{kind}")
                if t:
                    for what in ("ttfb", "end"):
                        d[f"{what}_windows"] += [tuple(w) for w in t[what]["windows"]]
                    for side in ("plain", "charged"):
                        d[f"{side}_ttfb_p50"].append(t["ttfb"][f"{side}_p50_ms"])
                        d[f"{side}_ttfb_p99"].append(t["ttfb"][f"{side}_p99_ms"])
                redis_v = v != "local"
                rows_tp.append([rd["round"], rd["order"], v, kind,
                                f"{p['rps']:,.0f} / {c['rps']:,.0f}",
                                f"{fmt(p['gateway_cpu_us_per_req'])} / {fmt(c['gateway_cpu_us_per_req'])}",
                                f"**{fmt(cr, 3)}**",
                                (f"{fmt(p['redis_script_calls_per_req'], 5)} / {fmt(c['redis_script_calls_per_req'], 5)}"
                                 if redis_v else ""),
                                fmt(rr, 2) if redis_v else "",
                                (f"{fmt(p['redis_script_calls_above_idle_per_req'], 5)} / "
                                 f"{fmt(c['redis_script_calls_above_idle_per_req'], 5)}" if redis_v else ""),
                                f"{p['other_load_pct']:.0f} / {c['other_load_pct']:.0f}"])
                if t and t["ttfb"]["windows"]:
                    tt, te = t["ttfb"], t["end"]
                    rows_ttfb.append([rd["round"], v, kind,
                                      f"{fmt(tt['plain_p50_ms'], 3)} / {fmt(tt['plain_p99_ms'], 3)}",
                                      f"{fmt(tt['charged_p50_ms'], 3)} / {fmt(tt['charged_p99_ms'], 3)}",
                                      ", ".join(f"{w[0]:+.3f}" for w in tt["windows"]),
                                      ", ".join(f"{w[1]:+.3f}" for w in tt["windows"]),
                                      ", ".join(f"{w[2]:.3f}" for w in tt["windows"]),
                                      f"{fmt(te['plain_p50_ms'], 2)} / {fmt(te['charged_p50_ms'], 2)}",
                                      f"{te['added_ms']:+.3f} ({te['noise_ms']:.3f})",
                                      t["bad"]])
    checks = []
    medians = {}
    for (v, kind), d in per.items():
        m = {k: med(vals) for k, vals in d.items() if not k.endswith("_windows")}
        for what in ("ttfb", "end"):
            m[f"{what}_diff"], m[f"{what}_noise"] = added_and_noise(d[f"{what}_windows"])
        medians[f"{v}/{kind}"] = m
        redis_v = v != "local"
        rows_ratio.append([v, kind, f"{fmt(m['plain_rps'], 0)} / {fmt(m['charged_rps'], 0)}", fmt(m["rps_ratio"], 3),
                           f"{fmt(m['plain_cpu'])} / {fmt(m['charged_cpu'])}", f"**{fmt(m['cpu_ratio'], 3)}**",
                           (f"{fmt(m['plain_calls'], 5)} / {fmt(m['charged_calls'], 5)}" if redis_v else ""),
                           (f"{fmt(m['plain_calls_above'], 5)} / {fmt(m['charged_calls_above'], 5)}"
                            if redis_v else ""),
                           ("" if m["plain_ttfb_p50"] is None else
                            f"{m['plain_ttfb_p50']:.3f} / {m['charged_ttfb_p50']:.3f}"),
                           "" if m["ttfb_diff"] is None else f"**{m['ttfb_diff']:+.3f}** ({m['ttfb_noise']:.3f})",
                           "" if m["end_diff"] is None else f"{m['end_diff']:+.3f} ({m['end_noise']:.3f})"])
        ok = m["cpu_ratio"] is not None and m["cpu_ratio"] <= a.cpu_limit
        checks.append({"name": f"{v} {kind}: gateway CPU per request, charged / plain <= {a.cpu_limit}",
                       "value": m["cpu_ratio"], "ok": ok,
                       "text": (f"median of the per-round ratios {fmt(m['cpu_ratio'], 3)} "
                                f"({', '.join(fmt(x, 3) for x in d['cpu_ratio'])})")})
        if d["ttfb_windows"]:
            pool = pooled_ttfb[f"{v}/{kind}"]
            ok = m["ttfb_diff"] <= m["ttfb_noise"]
            wins = d["ttfb_windows"]
            checks.append({"name": f"{v} {kind}: time to first byte added by charge within the noise of the paired windows",
                           "value": m["ttfb_diff"], "noise": m["ttfb_noise"], "ok": ok,
                           "text": (f"charged − plain, the median over the {len(wins)} paired windows of "
                                    f"{a.window} triples, {m['ttfb_diff']:+.3f} ms (windows "
                                    f"{min(w[0] for w in wins):+.3f} to {max(w[0] for w in wins):+.3f}) against the "
                                    f"windows' noise {m['ttfb_noise']:.3f} ms, the median over them of how far apart "
                                    f"two identical plain requests land (median |B − A|; windows "
                                    f"{min(w[2] for w in wins):.3f} to {max(w[2] for w in wins):.3f}); plain − plain's "
                                    f"own window medians {min(w[1] for w in wins):+.3f} to "
                                    f"{max(w[1] for w in wins):+.3f}; every request pooled: charged − plain "
                                    f"{pool['ttfb_diff'][0]:+.3f} ms, 95% interval [{pool['ttfb_diff'][1]:+.3f}, "
                                    f"{pool['ttfb_diff'][2]:+.3f}]; plain − plain {pool['ttfb_aa'][0]:+.3f} "
                                    f"[{pool['ttfb_aa'][1]:+.3f}, {pool['ttfb_aa'][2]:+.3f}]")})
        if redis_v:
            ok = (m["charged_calls_above"] is not None and m["plain_calls_above"] is not None
                  and m["charged_calls_above"] <= m["plain_calls_above"])
            checks.append({"name": f"{v} {kind}: Redis script calls per request, charged <= plain",
                           "value": [m["plain_calls_above"], m["charged_calls_above"]], "ok": ok,
                           "text": (f"beyond the heartbeats, median plain {fmt(m['plain_calls_above'], 5)}, charged "
                                    f"{fmt(m['charged_calls_above'], 5)} (per round plain "
                                    f"{', '.join(fmt(x, 5) for x in d['plain_calls_above'])}; charged "
                                    f"{', '.join(fmt(x, 5) for x in d['charged_calls_above'])}); gross, heartbeats "
                                    f"included: plain {fmt(m['plain_calls'], 5)}, charged {fmt(m['charged_calls'], 5)}")})
    lines = ["# The cost of `charge`: a charged route against the same route without it", "",
             f"commit {meta['commit']}, gateway binary of {meta['gateway_mtime']}, {meta['cpus']} CPUs; "
             f"{a.rounds} round(s) (order forward, reversed, ...), {meta['wall_s']:.0f} s in all; variants: "
             f"{', '.join(VARIANT_TEXT[v] for v in variants)}. Max throughput: wrk -t{a.wrk_threads} "
             f"-c{a.connections} -d{a.duration}s POSTing `max_tokens` {a.max_tokens} (the mock answers a random "
             f"count up to it) in a body of {len(body('json', a.max_tokens, getattr(a, 'body_pad', 0)))} bytes. TTFB: {a.triples} triples per round and kind on one keep-alive connection, "
             f"plain, plain again and charged in the six orders in turn, in paired windows of {a.window} triples, "
             f"one client, `x-mock-tokens: {a.ttfb_tokens}`, SSE with `x-mock-chunk-ms: "
             f"{a.chunk_ms}`. Load average before {meta['loadavg_before']}, after {meta['loadavg_after']}; other "
             f"processes' CPU during the throughput windows: median {fmt(meta['other_load_pct_median'], 0)} % of "
             f"a core (max {fmt(meta['other_load_pct_max'], 0)} %).", "",
             "## Max throughput, per round (plain / charged)", "",
             "Gateway CPU: utime + stime of its process over the window, per request. Script calls: evalsha and "
             "the like in Redis's `INFO commandstats`, per request, gross and beyond the replica's heartbeats "
             "(one a second whatever the traffic; counted by ZCARD, which only heartbeat.lua calls).", ""]
    lines += table(["round", "order", "variant", "kind", "rps", "gateway CPU µs/req", "CPU ratio",
                    "script calls/req", "calls ratio", "beyond heartbeats", "other load %"],
                   "rllrrrrrrrr", rows_tp)
    if rows_ttfb:
        lines += ["", "## Time to first byte, paired windows, per round (ms)", "",
                  f"Send → first byte of the body (p50 / p99), and send → last byte (end). Each window: "
                  f"{a.window} triples (plain A, plain B, charged C on one connection); its median of C − A "
                  f"(what charge adds), its median of B − A (the plain route against itself) and its noise, "
                  f"the median of |B − A| (how far apart two identical requests side by side typically land).",
                  ""]
        lines += table(["round", "variant", "kind", "plain p50 / p99", "charged p50 / p99",
                        "windows' charged − plain", "windows' plain − plain", "windows' noise",
                        "end p50 plain / charged", "Δ end (noise)", "failed"],
                       "rllrrlllrrr", rows_ttfb)
    lines += ["", "## Medians over rounds", ""]
    lines += table(["variant", "kind", "rps plain / charged", "rps ratio", "CPU µs/req plain / charged",
                    "CPU ratio", "script calls/req plain / charged", "beyond heartbeats",
                    "TTFB p50 ms plain / charged", "Δ TTFB ms (windows' noise)", "Δ end ms (noise)"],
                   "llrrrrrrrrr", rows_ratio)
    lines += ["", "## Checks", ""]
    for c in checks:
        lines.append(f"- **{'PASS' if c['ok'] else 'FAIL'}** {c['name']}: {c['text']}")
    lines += ["", "## Notes", ""]
    for v in variants:
        lines.append(f"- gateway {v}: {logs_summary[v]}")
    off_share = ("fallback_to:", "redis_errors:", "decided:redis", "decided:fallback")
    for rd in rounds:
        windows = [(n, t["gateway_metrics"]) for n, t in rd["targets"].items()]
        windows += [(f"TTFB {n}", t.get("gateway_metrics", {})) for n, t in rd["ttfb"].items()]
        for name, m in windows:
            off = {k: int(x) for k, x in m.items() if k.startswith(off_share)}
            if off:
                lines.append(f"- round {rd['round']}, {name}: not all on the standing share: "
                             + ", ".join(f"{k} {x:,}" for k, x in off.items()))
    for rd in rounds[:1]:
        for name, t in rd["targets"].items():
            m = t["gateway_metrics"]
            keys = ", ".join(f"{k} {int(x):,}" for k, x in m.items() if k.startswith(("charged:", "decided:", "settled:")))
            cmds = ", ".join(f"{k} {x / t['requests']:.5f}" for k, x in sorted(t["redis_commands"].items())
                             if x) if t["redis_commands"] else ""
            lines.append(f"- round 1, {name}: {t['requests']:,} requests, errors {t['non2xx_or_errors']}; "
                         f"{keys}" + (f"; Redis commands per request: {cmds}" if cmds else ""))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    summary = {"run": meta, "rounds": rounds, "medians": medians, "checks": checks, "pooled_ttfb": pooled_ttfb,
               "ok": all(c["ok"] for c in checks)}
    write_json(out / "summary.json", summary)
    plot(a, out, per)
    print("\n".join(lines))
    return summary["ok"]


def plot(a, out, per):
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    keys = list(per)
    labels = [f"{v}\n{k}" for v, k in keys]
    xs = range(len(keys))
    ax = axes[0][0]
    for i, key in enumerate(keys):
        d = per[key]
        ax.scatter([i - 0.1] * len(d["plain_cpu"]), d["plain_cpu"], color="tab:blue",
                   label="plain" if i == 0 else None)
        ax.scatter([i + 0.1] * len(d["charged_cpu"]), d["charged_cpu"], color="tab:red",
                   label="charged" if i == 0 else None)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("gateway CPU µs per request")
    ax.set_title("CPU per request, each round")
    ax.legend()
    ax = axes[0][1]
    for i, key in enumerate(keys):
        d = per[key]
        ax.scatter([i] * len(d["cpu_ratio"]), d["cpu_ratio"], color="tab:purple")
    ax.axhline(a.cpu_limit, color="gray", linestyle="--", label=f"limit {a.cpu_limit}")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("charged / plain")
    ax.set_title("CPU ratio, each round")
    ax.legend()
    ax = axes[1][0]
    for i, key in enumerate(keys):
        d = per[key]
        wins = d["ttfb_windows"]
        if wins:
            ax.scatter([i - 0.12] * len(wins), [w[0] for w in wins], color="tab:red", s=12,
                       label="charged − plain, each window" if i == 0 else None)
            ax.scatter([i + 0.12] * len(wins), [w[1] for w in wins], color="tab:gray", s=12,
                       label="plain − plain, each window" if i == 0 else None)
            added, noise = added_and_noise(wins)
            ax.hlines([noise, -noise], i - 0.3, i + 0.3, color="tab:gray", linestyle="--",
                      label="noise (± median |plain − plain|)" if i == 0 else None)
            ax.hlines([added], i - 0.3, i + 0.3, color="tab:red", linewidth=2,
                      label="added (median of the windows)" if i == 0 else None)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_yscale("symlog", linthresh=0.01)
    lim = max([abs(x) for d in per.values() for w in d["ttfb_windows"] for x in w[:3]] or [0.01])
    ax.set_ylim(-lim * 1.6, lim * 1.6)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ms (linear within ±0.01)")
    ax.set_title("TTFB: each paired window's median difference")
    ax.legend(fontsize=7, loc="upper left", framealpha=0.6)
    ax = axes[1][1]
    for i, key in enumerate(keys):
        d = per[key]
        ax.scatter([i - 0.1] * len(d["plain_rps"]), d["plain_rps"], color="tab:blue",
                   label="plain" if i == 0 else None)
        ax.scatter([i + 0.1] * len(d["charged_rps"]), d["charged_rps"], color="tab:red",
                   label="charged" if i == 0 else None)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("requests/s")
    ax.set_title("max throughput, each round")
    ax.legend()
    fig.suptitle(f"charge vs plain: {a.rounds} rounds")
    fig.tight_layout()
    save_png(fig, out / "charge.png", 100)


# --- main ----------------------------------------------------------------------------------


def log_summary(path):
    text = Path(path).read_text(errors="replace")
    bad = [ln for ln in text.splitlines() if re.search(r"\b(WARN|ERROR)\b", ln)]
    if not bad:
        return "no WARN or ERROR lines in its log"
    shown = "; ".join(f"`{ln[:260]}`" for ln in bad[:5])
    return f"{len(bad)} WARN/ERROR line(s) in its log" + (", the first five: " if len(bad) > 5 else ": ") + shown


def on_term(*_):
    """SIGTERM: exit through the finally blocks, which stop every server by PID."""
    raise SystemExit(143)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=4, help="seconds of each max-throughput window")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--wrk-threads", type=int, default=1)
    ap.add_argument("--triples", type=int, default=200, help="TTFB triples per round and kind")
    ap.add_argument("--window", type=int, default=50, help="triples per paired TTFB window")
    ap.add_argument("--chunk-ms", type=int, default=20, help="x-mock-chunk-ms on the SSE TTFB requests")
    ap.add_argument("--ttfb-tokens", type=int, default=1, help="x-mock-tokens on the TTFB requests")
    ap.add_argument("--gap-ms", type=float, default=0, help="a random pause (0.5-1.5x) between TTFB triples")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--body-pad", type=int, default=0,
                    help="bytes of conversation added to every request body (the estimate's scan reads them)")
    ap.add_argument("--variants", default="redis", help="redis, leases, local, or several (redis,leases)")
    ap.add_argument("--threads", type=int, default=2, help="gateway worker threads")
    ap.add_argument("--cpu-limit", type=float, default=1.1)
    ap.add_argument("--no-ttfb", action="store_true")
    ap.add_argument("--gateway", default=str(ROOT / "target/release/gateway"))
    ap.add_argument("--mock", default=str(ROOT / "target/release/mock-upstream"))
    ap.add_argument("--wrk", default=shutil.which("wrk") or "/usr/bin/wrk")
    ap.add_argument("--out", required=True)
    ap.add_argument("--report-only", action="store_true",
                    help="make summary.md, summary.json and charge.png again from --out's summary.json")
    a = ap.parse_args()
    if a.report_only:
        out = Path(a.out)
        old = json.loads((out / "summary.json").read_text())
        ra = argparse.Namespace(**old["run"]["args"])
        if not hasattr(ra, "window"):
            ap.error(f"{out} was written by the paired design before windows (--pairs); run it again")
        logs_summary = {v: log_summary(out / "logs" / f"gateway-{v}.log") for v in ra.variants}
        sys.exit(0 if report(ra, out, old["run"], old["rounds"], old["pooled_ttfb"], logs_summary) else 1)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not a.variants or any(v not in VARIANTS for v in a.variants):
        ap.error("--variants takes redis, leases, local, or several (redis,leases)")
    if a.rounds < 1 or a.triples < 0 or a.duration <= 0 or a.window < 1:
        ap.error("--rounds >= 1, --triples >= 0, --window >= 1, --duration > 0")
    if 0 < a.triples < a.window:
        ap.error(f"--triples {a.triples} makes no whole window of --window {a.window}")
    out = Path(a.out)
    for d in ("config", "logs", "raw", ".bin"):
        (out / d).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, on_term)

    # The binaries as they are now: a build that replaces them mid-run changes nothing here.
    gw_bin, mock_bin = out / ".bin" / "gateway", out / ".bin" / "mock-upstream"
    shutil.copy2(a.gateway, gw_bin)
    shutil.copy2(a.mock, mock_bin)
    meta = {"commit": git_commit(ROOT, "unknown"), "cpus": os.cpu_count(),
            "gateway_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.stat(a.gateway).st_mtime)),
            "loadavg_before": " ".join(open("/proc/loadavg").read().split()[:3]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "args": {k: v for k, v in vars(a).items()}}
    load1 = float(meta["loadavg_before"].split()[0])
    if load1 > (os.cpu_count() or 1) / 2:
        warn(f"the machine is already busy (1-min load {load1} on {os.cpu_count()} CPUs): figures will be noisy")

    procs = []
    gws = {}
    redis = None
    redis_port = None
    t_start = time.monotonic()
    try:
        on_redis = any(v != "local" for v in a.variants)
        nports = 1 + 2 * len(a.variants) + (1 if on_redis else 0)
        ports = free_ports(nports)
        mock_port = ports.pop()
        mock = Proc("mock-upstream", [str(mock_bin), "--listen", f"127.0.0.1:{mock_port}", "--threads", "1"],
                    out / "logs" / "mock-upstream.log")
        procs.append(mock)
        wait_for("mock-upstream", lambda: get(f"http://127.0.0.1:{mock_port}/healthz")[0] == 200, mock)
        if on_redis:
            redis_port = ports.pop()
            redis = Proc("redis-server", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--daemonize", "no",
                                          "--loglevel", "warning"], out / "logs" / "redis.log")
            procs.append(redis)
            wait_for("redis-server", lambda: subprocess.run(
                ["redis-cli", "-h", "127.0.0.1", "-p", str(redis_port), "ping"],
                capture_output=True, text=True, timeout=5).stdout.strip() == "PONG", redis)
        for v in a.variants:
            port, admin = ports.pop(), ports.pop()
            cfg = out / "config" / f"gateway-{v}.toml"
            cfg.write_text(gateway_config(v, port, admin, mock_port, redis_port, a.threads))
            r = subprocess.run([str(gw_bin), "check", "-c", str(cfg)], capture_output=True, text=True)
            (out / "logs" / f"gateway-{v}-check.txt").write_text(r.stdout + r.stderr)
            if r.returncode != 0:
                raise SystemExit(f"gateway check refused {cfg}:\n{r.stdout}{r.stderr}")
            p = Proc(f"gateway-{v}", [str(gw_bin), "run", "-c", str(cfg)], out / "logs" / f"gateway-{v}.log",
                     env=dict(os.environ, GATEWAY_LOG="warn"))
            procs.append(p)
            want = '"backend":"redis"' if v != "local" else None
            wait_for(f"gateway {v}", lambda: (lambda s: s[0] == 200 and (want is None or want in s[1]))(
                get(f"http://127.0.0.1:{admin}/readyz")), p)
            gws[v] = {"proc": p, "port": port, "admin": admin}
        log(f"up: mock-upstream :{mock_port}" + (f", redis :{redis_port}" if redis else "") + ", gateways " +
            ", ".join(f"{v} :{g['port']} (admin :{g['admin']}, PID {g['proc'].pid})" for v, g in gws.items()))
        bench = Bench(a, out, gws, mock, redis, redis_port)
        targets = [(v, k, r) for v in a.variants for k in KINDS for r in ROUTES]
        log(f"warm-up: 1 s of wrk on each of the {len(targets)} targets")
        for v, k, r in targets:
            w = bench.throughput(v, k, r, 1, f"warmup-{v}-{r}-{k}")
            if w["non2xx_or_errors"]:
                tail = Path(gws[v]["proc"].log_path).read_text(errors="replace")[-2000:]
                raise SystemExit(f"warm-up {v}/{r}-{k}: {w['errors']} errors or non-2xx:\n{tail}")
        if not a.no_ttfb:
            for v in a.variants:
                for k in KINDS:
                    ttfb_window(gws[v]["port"], k, a, 12, f"warmup-{v}-{k}", out, random.Random(0))
        rounds = []
        all_ttfb = {}
        rng = random.Random(1)
        for rn in range(1, a.rounds + 1):
            fwd = rn % 2 == 1
            order = targets if fwd else list(reversed(targets))
            rd = {"round": rn, "order": "forward" if fwd else "reversed", "targets": {}, "ttfb": {}}
            log(f"round {rn}/{a.rounds} ({rd['order']}): max throughput, {a.duration:g} s per target")
            for v, k, r in order:
                name = f"{v}/{r}-{k}"
                w = bench.throughput(v, k, r, a.duration, f"r{rn}-{v}-{r}-{k}")
                rd["targets"][name] = w
                calls = (f", {w['redis_script_calls']} script calls ({w['redis_heartbeats']} heartbeats)"
                         if w["redis_script_calls"] is not None else "")
                off = {k: int(x) for k, x in w["gateway_metrics"].items()
                       if k.startswith(("fallback_to:", "redis_errors:", "decided:redis", "decided:fallback"))}
                log(f"  {name:<20} {w['rps']:>8,.0f} rps, gateway {w['gateway_cpu_us_per_req']:6.1f} µs/req"
                    f"{calls}, errors {w['non2xx_or_errors']}, other load {w['other_load_pct']:.0f} %"
                    + (f"; {off}" if off else ""))
                if w["non2xx_or_errors"]:
                    warn(f"{name}: {w['errors']} (wrk counts non-2xx/3xx answers as status errors)")
            if not a.no_ttfb:
                ttfb_order = [(v, k) for v in a.variants for k in KINDS]
                if not fwd:
                    ttfb_order.reverse()
                for v, k in ttfb_order:
                    t0 = time.monotonic()
                    met0 = gateway_counters(gws[v]["admin"])
                    rows, bad = ttfb_window(gws[v]["port"], k, a, a.triples, f"r{rn}-{v}-{k}", out, rng)
                    s = ttfb_summary(rows, a.window)
                    s["bad"] = bad
                    s["gateway_metrics"] = delta(met0, gateway_counters(gws[v]["admin"]))
                    off = {x: int(y) for x, y in s["gateway_metrics"].items()
                           if x.startswith(("fallback_to:", "redis_errors:", "decided:redis", "decided:fallback"))}
                    rd["ttfb"][f"{v}/{k}"] = s
                    all_ttfb.setdefault(f"{v}/{k}", []).append(rows)
                    tw = s["ttfb"]["windows"]
                    log(f"  TTFB {v}/{k}: {a.triples} triples in {time.monotonic() - t0:.1f} s; p50 plain "
                        f"{s['ttfb']['plain_p50_ms']:.3f} ms, charged {s['ttfb']['charged_p50_ms']:.3f} ms; "
                        f"windows' charged - plain {', '.join(f'{w[0]:+.3f}' for w in tw)} ms, plain - plain "
                        f"{', '.join(f'{w[1]:+.3f}' for w in tw)} ms; failed {bad}" + (f"; {off}" if off else ""))
            rounds.append(rd)
            log(f"round {rn} done ({time.monotonic() - t_start:.0f} s in all)")
        for v, g in gws.items():
            try:
                (out / "logs" / f"gateway-{v}-metrics.txt").write_text(get(f"http://127.0.0.1:{g['admin']}/metrics")[1])
            except OSError:
                pass
    finally:
        for p in reversed(procs):
            p.stop(signal.SIGINT if p.name.startswith("gateway") else signal.SIGTERM)
        shutil.rmtree(out / ".bin", ignore_errors=True)
    meta["loadavg_after"] = " ".join(open("/proc/loadavg").read().split()[:3])
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    others = [t["other_load_pct"] for rd in rounds for t in rd["targets"].values()]
    meta["other_load_pct_median"] = med(others)
    meta["other_load_pct_max"] = max(others) if others else None
    pooled = {}
    for key, per_round in all_ttfb.items():
        pooled[key] = {f"{what}_{name}": median_ci([x for rows in per_round for x in diffs(rows, what, side)])
                       for what in ("ttfb", "end") for name, side in (("diff", "C"), ("aa", "B"))}
    logs_summary = {v: log_summary(out / "logs" / f"gateway-{v}.log") for v in a.variants}
    ok = report(a, out, meta, rounds, pooled, logs_summary)
    log(f"wrote {out}/summary.md, summary.json, charge.png ({meta['wall_s']:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
