#!/usr/bin/env python3
"""The fast-path benchmark behind loadtest/bench.sh (run that, not this).

    bench.py run [options]          the benchmark: see loadtest/bench.sh --help
    bench.py report RUN_DIR         (re)write summary.md and chart.png from summary.json
    bench.py publish RUN_DIR        copy a run's table and chart into BENCHMARKS.md

Every server it needs is started here, on 127.0.0.1 and free ports, and
stopped by PID on exit: a Redis, the mock upstream, nginx (Debian's, in the
foreground), the bare Pingora proxy and one gateway per gateway target. Load
goes to 127.0.0.1 only, for bounded times.

Targets, side by side (see BENCHMARKS.md):
    direct                the load generator against the upstream itself
    nginx_limit_req       nginx proxy_pass + limit_req keyed by client address
    pingora_bare          Pingora alone: examples/bare_proxy.rs, default settings
    gateway_off           the gateway with no limiter work at all
    gateway_local         all three tiers on the local backend
    gateway_redis         all three tiers on Redis, admitting everything
    gateway_redis_denied  one client over its route limit, flooding: all 429
    gateway_tls           gateway_off on its [server.tls] listener (HTTP/1.1, keep-alive)
    nginx_tls             nginx_limit_req with `listen ssl`, the same certificate

The TLS pair shares one ECDSA P-256 certificate signed by a CA, both made per
run with the openssl CLI into RUN_DIR/tls/; TLS 1.2 and 1.3 on both sides,
each with its default ciphers (the ones negotiated are recorded).

Per target and round: max throughput (wrk, fixed connections) with the CPU
the proxy's processes spent per request (/proc/PID/stat utime+stime; nginx:
master + workers), and p50/p99 latency at a fixed rate of half gateway_off's
median maximum, measured from each request's intended send time (fixedrate.c:
coordinated-omission corrected). For the Redis targets, Redis's CPU per
request (INFO cpu) and script calls per request (INFO commandstats). Rounds
alternate the order of the targets (forward, then reversed), so drift in the
machine hits all of them alike; each number reported is the median of rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GATEWAY = ROOT / "target/release/gateway"
MOCK = ROOT / "target/release/mock-upstream"
BARE = ROOT / "target/release/examples/bare_proxy"
RESULTS = ROOT / "loadtest/results"
CLK_TCK = os.sysconf("SC_CLK_TCK")

TARGETS = [
    "direct",
    "nginx_limit_req",
    "pingora_bare",
    "gateway_off",
    "gateway_local",
    "gateway_redis",
    "gateway_redis_denied",
    "gateway_tls",
    "nginx_tls",
]
GATEWAY_TARGETS = [t for t in TARGETS if t.startswith("gateway_")]
REDIS_TARGETS = ["gateway_redis", "gateway_redis_denied"]
LIMITED_TARGETS = ["gateway_local", "gateway_redis", "gateway_redis_denied"]
NGINX_TARGETS = ["nginx_limit_req", "nginx_tls"]
TLS_TARGETS = ["gateway_tls", "nginx_tls"]
API_KEY = "bench-key-0001"
PATH = "/api/bench"
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")

# The issue's targets: (key, label, op, limit).
CHECKS = [
    ("redis_vs_off_rps", "gateway_redis rps / gateway_off rps", ">=", 0.85),
    ("p99_added_ms", "p99 added by gateway_redis over gateway_off (ms, fixed rate)", "<=", 0.5),
    ("denied_vs_off_rps", "gateway_redis_denied rps / gateway_off rps", ">=", 1.5),
    ("denied_script_calls_per_req", "script calls per denied request", "<=", 0.1),
    ("redis_cpu_us_per_decision", "Redis CPU µs per three-tier decision", "<=", 10.0),
    ("off_vs_nginx_cpu", "gateway_off CPU / nginx_limit_req CPU per request", "<=", 1.5),
]

# Context, not targets of the issue (never pass/fail, no effect on the exit
# status): how much of the gateway's CPU per request is Pingora's own.
CONTEXT = [
    ("off_vs_bare_cpu", "gateway_off CPU / pingora_bare CPU per request", "gateway_off", "pingora_bare"),
    ("bare_vs_nginx_cpu", "pingora_bare CPU / nginx_limit_req CPU per request", "pingora_bare", "nginx_limit_req"),
]


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def warn(msg: str, warnings: list | None = None) -> None:
    print(f"{time.strftime('%H:%M:%S')} WARNING: {msg}", flush=True)
    if warnings is not None:
        warnings.append(msg)


class BenchError(Exception):
    pass


# --- processes ------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


class Procs:
    """Everything this run started, stopped by PID on exit (never by name)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen, int]] = []

    def start(self, name: str, argv: list[str], log_path: Path, stop_sig=signal.SIGTERM, env=None):
        f = open(log_path, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        f.close()
        self.items.append((name, p, stop_sig))
        return p

    def stop(self, p: subprocess.Popen, sig: int, secs: float = 10.0) -> None:
        if p.poll() is not None:
            return
        try:
            p.send_signal(sig)
            p.wait(timeout=secs)
        except subprocess.TimeoutExpired:
            print(f"bench: PID {p.pid} did not exit after signal {sig} within {secs}s: SIGKILL", file=sys.stderr)
            p.kill()
            p.wait()
        except ProcessLookupError:
            pass

    def stop_one(self, p: subprocess.Popen) -> None:
        for i, (_, q, sig) in enumerate(self.items):
            if q is p:
                self.stop(q, sig)
                del self.items[i]
                return

    def stop_all(self) -> None:
        # Gateways first (they hold connections to the others), Redis last.
        for _, p, sig in reversed(self.items):
            try:
                if p.poll() is None:
                    p.send_signal(sig)
            except ProcessLookupError:
                pass
        for _, p, sig in reversed(self.items):
            self.stop(p, sig)
        self.items.clear()


def http_get(url: str, headers: dict | None = None, timeout: float = 2.0,
             context: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_until(what: str, pred, secs: float, proc: subprocess.Popen | None = None, log_path: Path | None = None):
    deadline = time.monotonic() + secs
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise BenchError(f"{what}: the process exited ({proc.returncode}) before it was ready\n{tail}")
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
    raise BenchError(f"{what}: not ready after {secs}s\n{tail}")


# --- TLS: the certificate and what was negotiated --------------------------------------


def openssl(argv: list[str], cwd: Path) -> None:
    out = subprocess.run(["openssl", *argv], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(f"openssl {' '.join(argv)}: {out.stderr.strip()}")


def make_tls_files(d: Path) -> dict:
    """A CA and an ECDSA P-256 leaf it signs (127.0.0.1, localhost), for the TLS pair."""
    d.mkdir(exist_ok=True)
    p256 = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl(["req", "-x509", *p256, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=loadtest bench CA"], d)
    openssl(["req", *p256, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=localhost"], d)
    (d / "tls.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\nbasicConstraints = CA:FALSE\n"
                               "keyUsage = digitalSignature\nextendedKeyUsage = serverAuth\n")
    openssl(["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "tls.ext", "-out", "tls.crt"], d)
    return {"ca": d / "ca.crt", "cert": d / "tls.crt", "key": d / "tls.key"}


def negotiated_tls(addr: str) -> dict:
    """What `openssl s_client` (OpenSSL's client defaults, as wrk's) negotiates with addr."""
    out = subprocess.run(["openssl", "s_client", "-connect", addr, "-servername", "localhost"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"^New, (\S+), Cipher is (\S+)", out, re.M)
    key = re.search(r"^(?:Server Temp Key|Negotiated TLS1\.3 group): (.+)$", out, re.M)
    return {"protocol": m.group(1) if m else None, "cipher": m.group(2) if m else None,
            "key_exchange": key.group(1).strip() if key else None}


def nginx_ssl_directives(tls: dict) -> str:
    """nginx_tls's ssl_* directives (one line): its ciphers are nginx's defaults."""
    return (f"ssl_certificate {tls['cert']}; ssl_certificate_key {tls['key']}; "
            f"ssl_protocols TLSv1.2 TLSv1.3;")


# --- /proc and Redis counters -----------------------------------------------------------


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process (all its threads, live or exited)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def children_of(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return kids


def proc_status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def all_process_ticks() -> dict[int, int]:
    """utime + stime of every user-space process (kernel threads left out)."""
    d = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[6]) & 0x00200000:  # PF_KTHREAD
            continue
        d[int(p)] = int(fields[11]) + int(fields[12])
    return d


class Redis:
    def __init__(self, port: int) -> None:
        self.port = port

    def cmd(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=10,
        )
        if out.returncode != 0:
            raise BenchError(f"redis-cli {' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def info(self) -> dict:
        txt = self.cmd("INFO", "everything")
        d: dict = {"cmd": {}}
        for line in txt.splitlines():
            if line.startswith("cmdstat_"):
                name, rest = line[len("cmdstat_"):].split(":", 1)
                kv = dict(x.split("=", 1) for x in rest.split(","))
                d["cmd"][name] = {"calls": int(kv["calls"]), "usec": int(kv["usec"])}
            elif ":" in line and not line.startswith("#"):
                k, v = line.split(":", 1)
                d[k] = v.strip()
        d["cpu"] = float(d.get("used_cpu_sys", 0)) + float(d.get("used_cpu_user", 0))
        return d


METRIC_RE = re.compile(r'^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$')


def gateway_metrics(admin: str) -> dict:
    """Status counts and failover counters from the gateway's /metrics."""
    status, _, body = http_get(f"http://{admin}/metrics", timeout=5)
    out = {"status": {}, "fallback": {}, "backend": {}}
    if status != 200:
        return out
    for line in body.decode(errors="replace").splitlines():
        m = METRIC_RE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        lab = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if name == "gateway_requests_total":
            s = lab.get("status", "?")
            out["status"][s] = out["status"].get(s, 0) + value
        elif name == "gateway_fallback_transitions_total":
            out["fallback"][lab.get("to", "?")] = value
        elif name == "gateway_limiter_backend":
            out["backend"][lab.get("backend", "?")] = value
    return out


def delta_counts(a: dict, b: dict) -> dict:
    keys = set(a) | set(b)
    return {k: int(b.get(k, 0) - a.get(k, 0)) for k in sorted(keys) if b.get(k, 0) - a.get(k, 0)}


# --- the run ----------------------------------------------------------------------------


class Bench:
    def __init__(self, args, out: Path, tools: Path, targets: list[str]) -> None:
        self.a = args
        self.out = out
        self.tools = tools
        self.procs = Procs()
        self.warnings: list[str] = []
        self.t: dict[str, dict] = {}  # target -> {url, pids(), admin, headers, proc, ssl}
        self.tls: dict | None = None  # the TLS pair's files: ca, cert, key
        self.tls_client: ssl.SSLContext | None = None  # trusts that CA
        self.redis: Redis | None = None
        self.redis_proc = None
        self.mock_proc = None
        self.our_pids: list[int] = []
        self.fixedrate = tools / "fixedrate"
        # Copies of the binaries, taken at the start: a rebuild during the run
        # cannot change what is measured, and perf can still resolve symbols.
        (out / "bin").mkdir(exist_ok=True)
        self.gateway = out / "bin" / "gateway"
        self.mock = out / "bin" / "mock-upstream"
        self.bare = out / "bin" / "bare_proxy"
        shutil.copy2(GATEWAY, self.gateway)
        shutil.copy2(MOCK, self.mock)
        if "pingora_bare" in targets:
            shutil.copy2(BARE, self.bare)

    # servers

    def render(self, template: str, dest: Path, **subs) -> Path:
        text = (HERE / template).read_text()
        for k, v in subs.items():
            text = text.replace(f"@@{k}@@", str(v))
        left = re.findall(r"@@\w+@@", text)
        if left:
            raise BenchError(f"{template}: unfilled placeholders {left}")
        dest.write_text(text)
        return dest

    def start_servers(self, targets: list[str]) -> None:
        a, out = self.a, self.out
        ports = iter(free_ports(2 + 3 * len(targets) + 2))
        logs = out / "logs"
        cfg = out / "config"
        self.redis_port = next(ports)
        self.mock_port = next(ports)
        upstream = f"127.0.0.1:{self.mock_port}"

        if any(t in REDIS_TARGETS for t in targets):
            rl = logs / "redis.log"
            self.redis_proc = self.procs.start(
                "redis",
                ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"],
                rl,
            )
            self.redis = Redis(self.redis_port)
            wait_until("redis-server", lambda: self.redis.cmd("PING").strip() == "PONG", 10, self.redis_proc, rl)
            self.our_pids.append(self.redis_proc.pid)

        ml = logs / "mock-upstream.log"
        self.mock_proc = self.procs.start(
            "mock-upstream",
            [str(self.mock), "--listen", upstream, "--threads", str(a.upstream_threads)],
            ml,
        )
        wait_until("mock-upstream", lambda: http_get(f"http://{upstream}/healthz")[0] == 200, 10, self.mock_proc, ml)
        self.our_pids.append(self.mock_proc.pid)
        self.t["direct"] = {"url": f"http://{upstream}{PATH}", "pids": lambda: [self.mock_proc.pid],
                            "headers": {}, "proc": self.mock_proc}

        if any(t in TLS_TARGETS for t in targets):
            self.tls = make_tls_files(out / "tls")
            self.tls_client = ssl.create_default_context(cafile=str(self.tls["ca"]))
        for t in [t for t in targets if t in NGINX_TARGETS]:
            self.start_nginx(t, next(ports), upstream)

        if "pingora_bare" in targets:
            port = next(ports)
            bl = logs / "pingora_bare.log"
            p = self.procs.start(
                "pingora_bare",
                [str(self.bare), "--listen", f"127.0.0.1:{port}", "--upstream", upstream, "--threads", str(a.threads)],
                bl,
            )
            url = f"http://127.0.0.1:{port}{PATH}"
            wait_until("pingora_bare", lambda: http_get(url)[0] == 200, 10, p, bl)
            self.t["pingora_bare"] = {"url": url, "pids": lambda p=p: [p.pid], "headers": {}, "proc": p, "log": bl}
            self.our_pids.append(p.pid)

        redis_section = (
            "[redis]\n"
            'mode = "standalone"\n'
            f'urls = ["redis://127.0.0.1:{self.redis_port}"]\n'
            "timeout_ms = 15\n"
            "probe_interval_ms = 250\n"
            'key_prefix = "@@PREFIX@@"'
        )
        for t in [t for t in targets if t in GATEWAY_TARGETS]:
            port, admin_port = next(ports), next(ports)
            subs = dict(THREADS=a.threads, LISTEN_ADDR=f"127.0.0.1:{port}", ADMIN_ADDR=f"127.0.0.1:{admin_port}",
                        UPSTREAM_ADDR=upstream)
            dest = cfg / f"{t}.toml"
            tls_port = next(ports) if t == "gateway_tls" else None
            if t == "gateway_off":
                self.render("gateway.off.toml", dest, **subs)
            elif t == "gateway_tls":
                self.render("gateway.tls.toml", dest, **subs, TLS_LISTEN_ADDR=f"127.0.0.1:{tls_port}",
                            CERT_FILE=self.tls["cert"], KEY_FILE=self.tls["key"])
            else:
                backend = "local" if t == "gateway_local" else "redis"
                denied = t == "gateway_redis_denied"
                self.render(
                    "gateway.tiers.toml", dest, **subs, BACKEND=backend, API_KEY=API_KEY,
                    REDIS_SECTION=redis_section.replace("@@PREFIX@@", f"bench-{t}") if backend == "redis" else "",
                    ROUTE_CAPACITY=1 if denied else 1000000000,
                    ROUTE_REFILL="0.000001" if denied else 1000000000,
                )
            chk = subprocess.run([str(self.gateway), "check", "-c", str(dest)], capture_output=True, text=True)
            (logs / f"{t}-check.txt").write_text(chk.stdout + chk.stderr)
            if chk.returncode != 0:
                raise BenchError(f"gateway check -c {dest} failed:\n{chk.stdout}{chk.stderr}")
            gl = logs / f"{t}.log"
            env = dict(os.environ, GATEWAY_LOG="warn")
            p = self.procs.start(t, [str(self.gateway), "run", "-c", str(dest)], gl, stop_sig=signal.SIGINT, env=env)
            admin = f"127.0.0.1:{admin_port}"
            url = f"https://127.0.0.1:{tls_port}{PATH}" if tls_port else f"http://127.0.0.1:{port}{PATH}"
            self.t[t] = {"url": url, "pids": lambda p=p: [p.pid], "admin": admin,
                         "headers": {"x-api-key": API_KEY} if t in LIMITED_TARGETS else {}, "proc": p, "log": gl,
                         "ssl": self.tls_client if tls_port else None}
            self.our_pids.append(p.pid)

        for t in [t for t in targets if t in GATEWAY_TARGETS]:
            info = self.t[t]
            want = "redis" if t in REDIS_TARGETS else "local"

            def ready(info=info, want=want):
                st, _, body = http_get(f"http://{info['admin']}/readyz")
                j = json.loads(body)
                return st == 200 and j.get("ready") and j.get("backend") == want

            wait_until(f"{t} (/readyz backend {want})", ready, 30, info["proc"], info["log"])

    def start_nginx(self, t: str, port: int, upstream: str) -> None:
        """One nginx (master + workers) for nginx_limit_req or nginx_tls, from nginx.conf."""
        a, out, logs = self.a, self.out, self.out / "logs"
        tls = t in TLS_TARGETS
        (out / "nginx-tmp").mkdir(exist_ok=True)
        conf = self.render("nginx.conf", out / "config" / f"{t}.conf", THREADS=a.threads, RUN_DIR=out, NAME=t,
                           UPSTREAM_ADDR=upstream, LISTEN=f"127.0.0.1:{port}" + (" ssl" if tls else ""),
                           SSL_DIRECTIVES=nginx_ssl_directives(self.tls) if tls else "# plaintext")
        argv = ["nginx", "-p", str(out), "-c", str(conf), "-e", str(logs / f"{t}-error.log")]
        chk = subprocess.run(argv[:1] + ["-t", "-q"] + argv[1:], capture_output=True, text=True)
        if chk.returncode != 0:
            raise BenchError(f"nginx -t ({t}) failed:\n{chk.stderr}")
        nl = logs / f"{t}.log"
        p = self.procs.start(t, argv, nl)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{port}{PATH}"
        ctx = self.tls_client if tls else None
        wait_until(t, lambda: http_get(url, context=ctx)[0] == 200, 10, p, nl)
        workers = children_of(p.pid)
        if len(workers) != a.threads:
            warn(f"{t}: nginx has {len(workers)} worker processes, expected {a.threads}", self.warnings)
        self.t[t] = {"url": url, "pids": lambda p=p: [p.pid] + children_of(p.pid),
                     "headers": {}, "proc": p, "workers": workers, "ssl": ctx}
        self.our_pids += [p.pid] + workers

    def negotiated(self, targets: list[str]) -> dict:
        """The TLS version and cipher each TLS target negotiates (openssl s_client)."""
        res = {}
        for t in [t for t in targets if t in TLS_TARGETS]:
            res[t] = negotiated_tls(self.t[t]["url"].split("/")[2])
            log(f"{t}: {res[t]['protocol']} {res[t]['cipher']} ({res[t]['key_exchange']})")
        return res

    def prime(self, targets: list[str]) -> None:
        """One request per target, its answer kept; the denied client spends its token."""
        for t in targets:
            info = self.t[t]
            hdr = info["headers"]
            statuses = []
            for _ in range(3 if t == "gateway_redis_denied" else 1):
                st, headers, body = http_get(info["url"], hdr, context=info.get("ssl"))
                statuses.append(st)
            with open(self.out / "logs" / f"{t}-first-response.txt", "w") as f:
                f.write(f"GET {info['url']} {hdr}\n{statuses}\n")
                for k, v in headers.items():
                    f.write(f"{k}: {v}\n")
                f.write("\n" + body.decode(errors="replace")[:2000] + "\n")
            want = 429 if t == "gateway_redis_denied" else 200
            if statuses[-1] != want:
                raise BenchError(f"{t}: expected {want} from {info['url']}, got {statuses} "
                                 f"(see logs/{t}-first-response.txt)")

    # measurements

    def snapshot(self, target: str) -> dict:
        info = self.t[target]
        s = {"wall": time.monotonic(), "all": all_process_ticks()}
        pids = info["pids"]()
        s["pids"] = pids
        s["proxy"] = sum(cpu_ticks(p) for p in pids)
        s["upstream"] = cpu_ticks(self.mock_proc.pid)
        if self.redis is not None:
            s["redis"] = self.redis.info()
        if "admin" in info:
            s["metrics"] = gateway_metrics(info["admin"])
        return s

    def diff(self, target: str, b: dict, e: dict, requests: int, wall: float, loadgen_ticks: float) -> dict:
        r: dict = {}
        n = max(requests, 1)
        us = 1e6 / CLK_TCK
        if sorted(b["pids"]) != sorted(e["pids"]):
            warn(f"{target}: its processes changed during the window ({b['pids']} -> {e['pids']})", self.warnings)
        r["cpu_us_per_req"] = (e["proxy"] - b["proxy"]) * us / n
        r["upstream_cpu_us_per_req"] = (e["upstream"] - b["upstream"]) * us / n
        r["proxy_cpu_cores"] = (e["proxy"] - b["proxy"]) / CLK_TCK / wall
        # Noise: CPU that user-space processes this run did not start used
        # meanwhile (those that started and ended inside the window are missed).
        ours = set(self.our_pids) | set(b["pids"]) | set(e["pids"]) | {os.getpid()}
        foreign = sum(t - b["all"].get(p, 0) for p, t in e["all"].items() if p not in ours)
        r["other_cpu_pct"] = round(100.0 * max(foreign, 0) / CLK_TCK / wall, 1)  # of one core
        if "redis" in b:
            rb, re_ = b["redis"], e["redis"]
            r["redis_cpu_us_per_req"] = (re_["cpu"] - rb["cpu"]) * 1e6 / n
            calls = {}
            for c in set(rb["cmd"]) | set(re_["cmd"]):
                d = re_["cmd"].get(c, {"calls": 0})["calls"] - rb["cmd"].get(c, {"calls": 0})["calls"]
                if d:
                    calls[c] = d
            calls.pop("info", None)  # our own INFO
            r["redis_calls"] = calls
            script = sum(calls.get(c, 0) for c in SCRIPT_COMMANDS)
            r["script_calls_per_req"] = script / n
            usec = sum(re_["cmd"].get(c, {"usec": 0})["usec"] - rb["cmd"].get(c, {"usec": 0})["usec"]
                       for c in SCRIPT_COMMANDS)
            r["redis_script_usec_per_call"] = usec / script if script else None
        if "metrics" in b:
            mb, me = b["metrics"], e["metrics"]
            r["gateway_status"] = delta_counts(mb["status"], me["status"])
            fb = delta_counts(mb["fallback"], me["fallback"])
            if fb:
                r["fallback_transitions"] = fb
                warn(f"{target}: the limiter failed over during the window: {fb}", self.warnings)
            if target in REDIS_TARGETS and me["backend"].get("redis", 1) != 1:
                warn(f"{target}: the limiter backend is not Redis at the end of the window: {me['backend']}",
                     self.warnings)
        return r

    def loadgen(self, argv: list[str], timeout: float, env=None) -> tuple[int, float, str]:
        """Runs a load generator to completion; returns (exit code, its CPU ticks, "").

        Reaped with wait4, which also gives the generator's own CPU time (taken
        out of the "other load" figure)."""
        errf = open(self.out / "logs" / "loadgen.stderr", "ab")
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errf, env=env)
        errf.close()
        deadline = time.monotonic() + timeout
        try:
            while True:
                pid, status, ru = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    return p.returncode, (ru.ru_utime + ru.ru_stime) * CLK_TCK, ""
                if time.monotonic() > deadline:
                    raise BenchError(f"{argv[0]} did not finish within {timeout:.0f}s")
                time.sleep(0.05)
        except BaseException:
            if p.returncode is None:  # interrupted or timed out: stop it, by PID
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
            raise

    def wrk_argv(self, target: str, secs: float, json_path: Path | None) -> tuple[list[str], dict]:
        info = self.t[target]
        argv = ["wrk", "-t", str(self.a.wrk_threads), "-c", str(self.a.connections), "-d", f"{secs:g}s",
                "--timeout", "5s", "-s", str(HERE / "wrk-summary.lua")]
        for k, v in info["headers"].items():
            argv += ["-H", f"{k}: {v}"]
        argv.append(info["url"])
        env = dict(os.environ, WRK_JSON=str(json_path) if json_path else "/dev/null")
        return argv, env

    def throughput(self, target: str, tag: str) -> dict:
        a = self.a
        if a.warmup > 0:
            argv, env = self.wrk_argv(target, a.warmup, None)
            self.loadgen(argv, a.warmup + 30, env)
        jp = self.out / "raw" / f"{tag}-{target}-wrk.json"
        argv, env = self.wrk_argv(target, a.duration, jp)
        b = self.snapshot(target)
        rc, lg_ticks, _ = self.loadgen(argv, a.duration + 30, env)
        e = self.snapshot(target)
        if rc != 0 or not jp.exists():
            raise BenchError(f"wrk failed against {target} (exit {rc}); see logs/loadgen.stderr")
        w = json.loads(jp.read_text())
        secs = w["duration_us"] / 1e6
        r = {"rps": w["requests"] / secs, "requests": w["requests"], "secs": secs,
             "wrk_errors": {k: v for k, v in w["errors"].items() if v},
             "wrk_latency_ms": {k: v / 1000 for k, v in w["latency_us"].items()}}
        r.update(self.diff(target, b, e, w["requests"], e["wall"] - b["wall"], lg_ticks))
        r["loadgen_cpu_cores"] = lg_ticks / CLK_TCK / (e["wall"] - b["wall"])
        self.check_statuses(target, "wrk", r, w)
        return r

    def fixed_rate(self, target: str, tag: str, rate: float) -> dict:
        a = self.a
        info = self.t[target]
        jp = self.out / "raw" / f"{tag}-{target}-fixedrate.json"
        argv = [str(self.fixedrate), "--url", info["url"], "--rate", f"{rate:.0f}",
                "--duration", f"{a.latency_duration:g}", "--warmup", f"{a.warmup:g}",
                "--connections", str(a.connections), "--timeout", "5", "--out", str(jp)]
        for k, v in info["headers"].items():
            argv += ["--header", f"{k}: {v}"]
        b = self.snapshot(target)
        rc, lg_ticks, _ = self.loadgen(argv, a.latency_duration + a.warmup + 30)
        e = self.snapshot(target)
        if rc != 0 or not jp.exists():
            raise BenchError(f"fixedrate failed against {target} (exit {rc}); see logs/loadgen.stderr")
        f = json.loads(jp.read_text())
        lat = f["latency_ms"]
        r = {"rate": rate, "rate_achieved": f["rate_achieved"], "p50_ms": lat["p50"], "p90_ms": lat["p90"],
             "p99_ms": lat["p99"], "p999_ms": lat["p999"], "max_ms": lat["max"],
             "service_time_ms": f["service_time_ms"], "status": f["status"],
             "errors": {k: v for k, v in f["errors"].items() if v}, "reconnects": f["reconnects"],
             "unfinished": f["unfinished"], "never_sent": f["never_sent"]}
        if target in TLS_TARGETS:
            r["tls"] = f.get("tls")  # what fixedrate's own connections negotiated
        d = self.diff(target, b, e, f["completed_total"], e["wall"] - b["wall"], lg_ticks)
        r.update({k: v for k, v in d.items()})
        r["loadgen_cpu_cores"] = lg_ticks / CLK_TCK / (e["wall"] - b["wall"])
        self.check_statuses(target, "fixedrate", r, f)
        return r

    def check_statuses(self, target: str, tool: str, r: dict, raw: dict) -> None:
        want = "429" if target == "gateway_redis_denied" else "200"
        odd = []
        if tool == "wrk":
            errs = dict(raw["errors"])
            non2xx = errs.pop("status", 0)
            if want == "200" and non2xx:
                odd.append(f"{non2xx} non-2xx responses (wrk)")
            if want == "429" and non2xx != raw["requests"]:
                odd.append(f"{raw['requests'] - non2xx} of {raw['requests']} responses were 2xx/3xx, not 429 (wrk)")
            if any(errs.values()):
                odd.append(f"socket errors {dict((k, v) for k, v in errs.items() if v)} (wrk)")
        else:
            others = {s: n for s, n in raw["status"].items() if s != want}
            if others:
                odd.append(f"statuses other than {want}: {others} (fixedrate)")
            if any(raw["errors"].values()):
                odd.append(f"errors {raw['errors']} (fixedrate)")
            if raw["reconnects"]:
                odd.append(f"{raw['reconnects']} reconnects: the server closed keep-alive connections (fixedrate)")
            if raw["unfinished"] or raw["never_sent"]:
                odd.append(f"{raw['unfinished']} unfinished and {raw['never_sent']} never-sent requests: "
                           f"the target did not keep up with {raw['rate_target']:.0f} rps (fixedrate)")
        gs = r.get("gateway_status")
        if gs:
            others = {s: n for s, n in gs.items() if s != want}
            # wrk stops with up to one request in flight per connection; the
            # gateway counts each such abandoned request as "aborted" (as "5xx"
            # in builds before that label existed).
            aborted = sum(others.values()) if tool == "wrk" and set(others) <= {"aborted", "5xx", "499"} else 0
            if aborted and aborted <= self.a.connections:
                r["aborted_at_wrk_stop"] = aborted
            elif others:
                odd.append(f"gateway /metrics counted statuses other than {want}: {others}")
        for o in odd:
            warn(f"{target}: {o}", self.warnings)
        if odd:
            r["odd"] = odd

    def perf(self, targets: list[str]) -> dict:
        """perf record -g on each proxy during one extra max-throughput window."""
        res = {}
        secs = min(self.a.duration, 10)
        for t in targets:
            pids = self.t[t]["pids"]()
            data = self.out / f"perf-{t}.data"
            log(f"perf: {t} for {secs:g}s (an extra window; its numbers are not used)")
            rec = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", str(data), "-p", ",".join(map(str, pids)),
                                    "--", "sleep", f"{secs + 1:g}"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(0.5)
                argv, env = self.wrk_argv(t, secs, None)
                self.loadgen(argv, secs + 30, env)
                rec.wait(timeout=secs + 30)
            except BaseException:
                if rec.poll() is None:
                    rec.send_signal(signal.SIGINT)
                    rec.wait()
                raise
            txt = self.out / f"perf-{t}.txt"
            with open(txt, "w") as f:
                subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "-g", "none",
                                "--sort", "dso,symbol", "--percent-limit", "0.5"],
                               stdout=f, stderr=subprocess.DEVNULL)
            res[t] = str(txt.relative_to(self.out))
        return res

    def memory(self) -> dict:
        """The local backend holding a million distinct client buckets."""
        a = self.a
        port, admin_port = free_ports(2)
        cfg = self.out / "config" / "memory.toml"
        self.render("gateway.memory.toml", cfg, THREADS=a.threads, LISTEN_ADDR=f"127.0.0.1:{port}",
                    ADMIN_ADDR=f"127.0.0.1:{admin_port}", UPSTREAM_ADDR=f"127.0.0.1:{self.mock_port}",
                    MAX_ENTRIES=a.memory_max_entries)
        chk = subprocess.run([str(self.gateway), "check", "-c", str(cfg)], capture_output=True, text=True)
        if chk.returncode != 0:
            raise BenchError(f"gateway check -c {cfg} failed:\n{chk.stdout}{chk.stderr}")
        gl = self.out / "logs" / "memory-gateway.log"
        p = self.procs.start("memory-gateway", [str(self.gateway), "run", "-c", str(cfg)], gl, signal.SIGINT,
                             env=dict(os.environ, GATEWAY_LOG="warn"))
        admin = f"127.0.0.1:{admin_port}"
        url = f"http://127.0.0.1:{port}/"
        wait_until("memory gateway", lambda: http_get(f"http://{admin}/readyz")[0] == 200, 30, p, gl)
        for i in range(20):
            http_get(url, {"X-Forwarded-For": f"198.51.100.{i + 1}"})
        time.sleep(0.5)
        rss0 = proc_status_kb(p.pid, "VmRSS")
        total = a.memory_clients

        def served() -> int:
            return int(sum(gateway_metrics(admin)["status"].values()))

        base = served()
        log(f"memory: RSS {rss0 / 1024:.1f} MiB before; {total:,} distinct clients (X-Forwarded-For) next, "
            f"local_max_entries = {a.memory_max_entries:,}")
        env = dict(os.environ, XFF_CLIENTS="4194304", XFF_THREADS=str(a.wrk_threads), XFF_PATH="/")
        errf = open(self.out / "logs" / "memory-wrk.txt", "wb")
        w = subprocess.Popen(["wrk", "-t", str(a.wrk_threads), "-c", str(a.connections), "-d", f"{a.memory_timeout}s",
                              "--timeout", "5s", "-s", str(HERE / "wrk-xff.lua"), url],
                             stdout=errf, stderr=subprocess.STDOUT, env=env)
        errf.close()
        curve = [(0, rss0)]
        t0 = time.monotonic()
        last_print = 0.0
        n = 0
        try:
            while w.poll() is None:
                time.sleep(1.0)
                n = served() - base
                rss = proc_status_kb(p.pid, "VmRSS")
                curve.append((n, rss))
                el = time.monotonic() - t0
                if el - last_print >= 5 or n >= total:
                    last_print = el
                    log(f"memory: {n:,}/{total:,} clients, {n / el:,.0f} rps, RSS {rss / 1024:.1f} MiB")
                if n >= total:
                    break
        finally:
            if w.poll() is None:
                w.send_signal(signal.SIGINT)
                try:
                    w.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
        elapsed = time.monotonic() - t0
        time.sleep(1.0)
        n = served() - base
        rss1 = proc_status_kb(p.pid, "VmRSS")
        hwm = proc_status_kb(p.pid, "VmHWM")
        statuses = {k: int(v) for k, v in gateway_metrics(admin)["status"].items()}
        curve.append((n, rss1))
        alive = p.poll() is None
        self.procs.stop_one(p)
        if n < total:
            warn(f"memory: only {n:,} of {total:,} clients were served within {a.memory_timeout}s", self.warnings)
        if not alive:
            warn("memory: the gateway died during the memory step", self.warnings)
        at_cap_point = next(((k, rss) for k, rss in curve if k >= a.memory_max_entries), None)
        at_cap_clients, at_cap = at_cap_point if at_cap_point else (None, None)
        res = {
            "clients": n,
            "clients_target": total,
            "local_max_entries": a.memory_max_entries,
            "rss_before_mib": round(rss0 / 1024, 1),
            "rss_at_cap_mib": round(at_cap / 1024, 1) if at_cap else None,
            "rss_at_cap_clients": at_cap_clients,
            "rss_after_mib": round(rss1 / 1024, 1),
            "hwm_mib": round(hwm / 1024, 1),
            "bytes_per_entry": round((at_cap - rss0) * 1024 / min(at_cap_clients, a.memory_max_entries))
            if at_cap else None,
            "growth_after_cap_pct": round(100.0 * (rss1 - at_cap) / at_cap, 1) if at_cap else None,
            "rps": round(n / elapsed),
            "statuses": statuses,
            "rss_curve": [{"clients": k, "rss_mib": round(v / 1024, 1)} for k, v in curve],
        }
        log(f"memory: {n:,} clients: RSS {res['rss_before_mib']} -> {res['rss_after_mib']} MiB "
            f"(at the cap: {res['rss_at_cap_mib']} MiB; peak {res['hwm_mib']} MiB)")
        return res


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        txt = (out.stdout + out.stderr).strip().splitlines()[0]
        return txt
    except Exception:
        return "unknown"


def machine_info(gateway: Path) -> dict:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = proc_meminfo_gib()
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    gw_mtime = dt.datetime.fromtimestamp(gateway.stat().st_mtime).isoformat(timespec="seconds")
    import hashlib

    h = hashlib.sha256()
    with open(gateway, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": os.uname().release,
        "mem_gib": mem,
        "nginx": tool_version(["nginx", "-v"]),
        "wrk": tool_version(["wrk", "-v"]).split(" Copyright")[0],
        "redis": tool_version(["redis-server", "--version"]),
        "gateway": tool_version([str(gateway), "--version"]),
        "gateway_binary_built": gw_mtime,
        "gateway_sha256": h.hexdigest()[:16],
        "git_commit": git.stdout.strip() or "unknown",
        "git_dirty": bool(dirty.stdout.strip()),
        "loadavg_start": open("/proc/loadavg").read().split()[:3],
    }


def proc_meminfo_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    return 0.0


def busy_others(exclude: set[int], secs: float = 1.0) -> list[dict]:
    """Processes not ours that used over 10% of a core during a short sample."""

    def sample():
        d = {}
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    d[int(p)] = cpu_ticks(int(p))
                except (OSError, IndexError, ValueError):
                    pass
        return d

    a = sample()
    time.sleep(secs)
    b = sample()
    out = []
    for pid, t in b.items():
        if pid in exclude or pid == os.getpid():
            continue
        used = (t - a.get(pid, t)) / CLK_TCK / secs
        if used > 0.10:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:100]
            except OSError:
                cmd = "?"
            out.append({"pid": pid, "cpu_pct": round(100 * used), "cmd": cmd.strip()})
    return out


def summarize(args, targets, thr, lat, rate, extra) -> dict:
    s: dict = {"targets": {}}
    for t in targets:
        tr = thr.get(t, [])
        lr = lat.get(t, [])
        d = {
            "rps": median(r["rps"] for r in tr),
            "cpu_us_per_req": median(r["cpu_us_per_req"] for r in tr),
            "p50_ms": median(r["p50_ms"] for r in lr),
            "p99_ms": median(r["p99_ms"] for r in lr),
            "p90_ms": median(r["p90_ms"] for r in lr),
            "p999_ms": median(r["p999_ms"] for r in lr),
            "upstream_cpu_us_per_req": median(r["upstream_cpu_us_per_req"] for r in tr),
            "cpu_us_per_req_at_fixed_rate": median(r["cpu_us_per_req"] for r in lr),
            "rps_rounds": [round(r["rps"]) for r in tr],
            "cpu_us_per_req_rounds": [round(r["cpu_us_per_req"], 2) for r in tr],
            "p99_ms_rounds": [round(r["p99_ms"], 4) for r in lr],
            "other_cpu_pct": median([r["other_cpu_pct"] for r in tr] + [r["other_cpu_pct"] for r in lr]),
        }
        if t in REDIS_TARGETS:
            d["redis_cpu_us_per_req"] = median(r.get("redis_cpu_us_per_req") for r in tr)
            d["script_calls_per_req"] = median(r.get("script_calls_per_req") for r in tr)
            d["redis_script_usec_per_call"] = median(r.get("redis_script_usec_per_call") for r in tr)
            # Every Redis command per request, the ones scripts run inside included.
            cmds = sorted({c for r in tr for c in r.get("redis_calls", {})})
            d["redis_commands_per_req"] = {
                c: round(median(r.get("redis_calls", {}).get(c, 0) / max(r["requests"], 1) for r in tr), 4)
                for c in cmds}
        statuses: dict = {}
        for r in lr:
            for k, v in r["status"].items():
                statuses[k] = statuses.get(k, 0) + v
        d["fixed_rate_statuses"] = statuses
        s["targets"][t] = d
    if "gateway_redis" in s["targets"]:
        g = s["targets"]["gateway_redis"]
        s["redis"] = {"cpu_us_per_req": g["redis_cpu_us_per_req"], "script_calls_per_req": g["script_calls_per_req"],
                      "script_usec_per_call": g["redis_script_usec_per_call"],
                      "commands_per_req": g["redis_commands_per_req"]}
    if "gateway_redis_denied" in s["targets"]:
        g = s["targets"]["gateway_redis_denied"]
        s.setdefault("redis", {})["denied_cpu_us_per_req"] = g["redis_cpu_us_per_req"]
        s["redis"]["denied_script_calls_per_req"] = g["script_calls_per_req"]
    s["fixed_rate_rps"] = rate
    s.update(extra)
    s["checks"] = compute_checks(s)
    s["context"] = compute_context(s)
    if any(t in s["targets"] for t in TLS_TARGETS):
        s["tls"] = compute_tls(s["targets"], extra.get("tls_negotiated", {}))
    return s


def compute_tls(T: dict, negotiated: dict) -> dict:
    """The TLS pair's CPU per request side by side (reported, never pass/fail),
    with the plaintext pair of the same run and what TLS adds on each side."""

    def cpu(t):
        return T.get(t, {}).get("cpu_us_per_req")

    def ratio(x, y):
        return x / y if x is not None and y else None

    def added(tls, plain):
        return cpu(tls) - cpu(plain) if cpu(tls) is not None and cpu(plain) is not None else None

    return {
        "gateway_cpu_us_per_req": cpu("gateway_tls"),
        "nginx_cpu_us_per_req": cpu("nginx_tls"),
        "ratio": ratio(cpu("gateway_tls"), cpu("nginx_tls")),
        "plaintext_ratio": ratio(cpu("gateway_off"), cpu("nginx_limit_req")),
        "gateway_tls_added_us_per_req": added("gateway_tls", "gateway_off"),
        "nginx_tls_added_us_per_req": added("nginx_tls", "nginx_limit_req"),
        "negotiated": negotiated,
    }


def compute_context(s: dict) -> list[dict]:
    """CPU-per-request ratios for context (informational, never pass/fail)."""
    T = s["targets"]
    out = []
    for key, label, num, den in CONTEXT:
        x, y = T.get(num, {}).get("cpu_us_per_req"), T.get(den, {}).get("cpu_us_per_req")
        out.append({"key": key, "label": label, "value": x / y if x is not None and y else None})
    return out


def compute_checks(s: dict) -> list[dict]:
    T = s["targets"]

    def get(t, k):
        return T.get(t, {}).get(k)

    def ratio(x, y):
        return x / y if x is not None and y else None

    vals = {
        "redis_vs_off_rps": ratio(get("gateway_redis", "rps"), get("gateway_off", "rps")),
        "p99_added_ms": (get("gateway_redis", "p99_ms") - get("gateway_off", "p99_ms"))
        if get("gateway_redis", "p99_ms") is not None and get("gateway_off", "p99_ms") is not None else None,
        "denied_vs_off_rps": ratio(get("gateway_redis_denied", "rps"), get("gateway_off", "rps")),
        "denied_script_calls_per_req": get("gateway_redis_denied", "script_calls_per_req"),
        "redis_cpu_us_per_decision": get("gateway_redis", "redis_cpu_us_per_req"),
        "off_vs_nginx_cpu": ratio(get("gateway_off", "cpu_us_per_req"), get("nginx_limit_req", "cpu_us_per_req")),
    }
    checks = list(CHECKS)
    mem = s.get("memory")
    if mem:
        vals["memory_growth_after_cap_pct"] = mem.get("growth_after_cap_pct")
        checks.append(("memory_growth_after_cap_pct",
                       f"local backend RSS growth from the cap ({mem['local_max_entries']:,}) to "
                       f"{mem['clients']:,} clients (%): bounded", "<=", 10.0))
    out = []
    for key, label, op, limit in checks:
        v = vals[key]
        ok = None if v is None else (v >= limit if op == ">=" else v <= limit)
        out.append({"key": key, "label": label, "value": v, "op": op, "limit": limit, "pass": ok})
    return out


# --- report: markdown table and chart ----------------------------------------------------


def fmt(v, nd=1, pct=False):
    if v is None:
        return "n/a"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def markdown(s: dict) -> str:
    run, m = s["run"], s["machine"]
    T = s["targets"]
    L = []
    if not T:
        L.append(f"Run `{run['dir']}` ({run['mode']}).")
        L.append("")
        L.append(f"Machine: {m['nproc']} × {m['cpu_model']}, Linux {m['kernel']}, {m['mem_gib']} GiB; "
                 f"{m['gateway']} (commit {m['git_commit']}{', dirty tree' if m['git_dirty'] else ''}, "
                 f"binary built {m['gateway_binary_built']}).")
        L += ["", "| target (issue) | value | limit | result |", "|---|--:|--:|---|"]
        for c in s["checks"]:
            if c["value"] is not None:
                L.append(f"| {c['label']} | {fmt(c['value'], 3)} | {c['op']} {c['limit']:g} | "
                         f"{'**pass**' if c['pass'] else '**FAIL**'} |")
        return "\n".join(L + memory_md(s)) + "\n"
    L.append(f"Run `{run['dir']}` ({run['mode']}): {run['rounds']} rounds, alternating order; "
             f"{run['connections']} connections; gateway `server.threads` = nginx `worker_processes` = "
             f"{'bare_proxy `--threads` = ' if 'pingora_bare' in T else ''}{run['threads']}; "
             f"mock-upstream `--threads {run['upstream_threads']}`; max throughput: wrk -t{run['wrk_threads']} "
             f"for {run['duration_s']:g} s; latency: fixedrate (open loop, coordinated-omission corrected) at "
             f"{fmt(s['fixed_rate_rps'], 0)} rps (half gateway_off's max) for {run['latency_duration_s']:g} s; "
             f"medians of rounds.")
    L.append("")
    L.append(f"Machine: {m['nproc']} × {m['cpu_model']}, Linux {m['kernel']}, {m['mem_gib']} GiB; "
             f"{m['nginx']}; {m['wrk']}; {m['redis'].split(' sha=')[0]}; {m['gateway']} "
             f"(commit {m['git_commit']}{', dirty tree' if m['git_dirty'] else ''}, binary built {m['gateway_binary_built']}).")
    L.append("")
    L.append("| target | max rps | proxy CPU µs/req | upstream CPU µs/req | p50 ms | p99 ms | Redis CPU µs/req | script calls/req | other load % |")
    L.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for t, d in T.items():
        L.append(
            f"| `{t}` | {fmt(d['rps'], 0)} | {fmt(d['cpu_us_per_req'], 1)} | {fmt(d['upstream_cpu_us_per_req'], 1)} | "
            f"{fmt(d['p50_ms'], 3)} | {fmt(d['p99_ms'], 3)} | {fmt(d.get('redis_cpu_us_per_req'), 2) if t in REDIS_TARGETS else ''} | "
            f"{fmt(d.get('script_calls_per_req'), 3) if t in REDIS_TARGETS else ''} | {fmt(d['other_cpu_pct'], 0)} |")
    L.append("")
    rd = s.get("redis")
    if rd and rd.get("cpu_us_per_req") is not None:
        cmds = ", ".join(f"{k} {v:g}" for k, v in (rd.get("commands_per_req") or {}).items())
        L.append(f"Redis during `gateway_redis`: {fmt(rd['cpu_us_per_req'], 2)} µs CPU and "
                 f"{fmt(rd['script_calls_per_req'], 3)} script calls per request"
                 + (f", {fmt(rd['script_usec_per_call'], 2)} µs inside the script per call" if rd.get('script_usec_per_call') else "")
                 + (f"; commands per request (those a script runs included): {cmds}" if cmds else "") + ".")
        L.append("")
    L.append("*proxy CPU*: the proxy's processes (for `direct`, the upstream itself) from `/proc/PID/stat` over the "
             "max-throughput window, per request. *other load*: CPU used meanwhile by processes this benchmark did "
             "not start, in % of one core (noise; kernel threads and processes that came and went inside a window are not "
             "counted).")
    L.append("")
    ctx = s.get("context") or compute_context(s)
    if any(c["value"] is not None for c in ctx):
        L.append("Context (informational, not targets of the issue; `pingora_bare` is Pingora alone, "
                 "`examples/bare_proxy.rs` with default settings):")
        L.append("")
        for c in ctx:
            L.append(f"- {c['label']}: {fmt(c['value'], 3)}")
        L.append("")
    L += tls_md(s)
    L.append("| target (issue) | value | limit | result |")
    L.append("|---|--:|--:|---|")
    for c in s["checks"]:
        res = "n/a" if c["pass"] is None else ("**pass**" if c["pass"] else "**FAIL**")
        L.append(f"| {c['label']} | {fmt(c['value'], 3)} | {c['op']} {c['limit']:g} | {res} |")
    L += memory_md(s)
    return "\n".join(L) + "\n"


def tls_md(s: dict) -> list[str]:
    """The TLS pair's paragraph of summary.md (reported, not a target of the issue)."""
    tls = s.get("tls")
    if not tls:
        return []
    neg = "; ".join(f"`{t}` {n['protocol']} {n['cipher']} ({n['key_exchange']})"
                    for t, n in tls.get("negotiated", {}).items())
    return [
        "TLS (reported, not pass/fail; HTTP/1.1 keep-alive over TLS, one ECDSA P-256 certificate for both):",
        "",
        f"- CPU µs/req: `gateway_tls` {fmt(tls['gateway_cpu_us_per_req'], 1)}, `nginx_tls` "
        f"{fmt(tls['nginx_cpu_us_per_req'], 1)}; gateway_tls / nginx_tls: **{fmt(tls['ratio'], 3)}**",
        f"- the same run in plaintext: gateway_off / nginx_limit_req {fmt(tls['plaintext_ratio'], 3)}",
        f"- what TLS adds per request: gateway {fmt(tls['gateway_tls_added_us_per_req'], 1)} µs "
        f"(gateway_tls − gateway_off), nginx {fmt(tls['nginx_tls_added_us_per_req'], 1)} µs "
        f"(nginx_tls − nginx_limit_req)",
        f"- negotiated (openssl s_client): {neg or 'n/a'}",
        "",
    ]


def memory_md(s: dict) -> list[str]:
    L = []
    mem = s.get("memory")
    if mem:
        L.append("")
        L.append(f"Memory (local backend, `local_max_entries` = {mem['local_max_entries']:,}): {mem['clients']:,} distinct "
                 f"clients through X-Forwarded-For at {mem['rps']:,} rps; gateway VmRSS {mem['rss_before_mib']} MiB "
                 f"before, {mem['rss_at_cap_mib']} MiB once the cap was reached (at {mem['rss_at_cap_clients']:,} clients), "
                 f"{mem['rss_after_mib']} "
                 f"MiB after (peak {mem['hwm_mib']} MiB); ≈{mem['bytes_per_entry']} bytes per bucket; "
                 f"growth past the cap {mem['growth_after_cap_pct']} %.")
    if s.get("warnings"):
        L.append("")
        L.append("Warnings:")
        for w in s["warnings"]:
            L.append(f"- {w}")
    return L


def chart(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = s["targets"]
    names = list(T)
    x = range(len(names))
    colors = {"direct": "#999999", "nginx_limit_req": "#2ca02c", "pingora_bare": "#ff7f0e",
              "nginx_tls": "#98df8a", "gateway_tls": "#9467bd"}
    col = [colors.get(n, "#1f77b4") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))

    ax = axes[0]
    rps = [T[n]["rps"] or 0 for n in names]
    ax.bar(x, rps, color=col)
    for i, n in enumerate(names):
        ax.scatter([i] * len(T[n]["rps_rounds"]), T[n]["rps_rounds"], color="black", s=10, zorder=3)
        ax.text(i, rps[i], f"{rps[i] / 1000:.1f}k", ha="center", va="bottom", fontsize=8)
    ax.set_title(f"max throughput (wrk, {s['run']['connections']} conns)")
    ax.set_ylabel("requests / s")

    ax = axes[1]
    cpu = [T[n]["cpu_us_per_req"] or 0 for n in names]
    red = [(T[n].get("redis_cpu_us_per_req") or 0) if n in REDIS_TARGETS else 0 for n in names]
    ax.bar(x, cpu, color=col, label="proxy process")
    ax.bar(x, red, bottom=cpu, color="#d62728", label="Redis")
    for i in x:
        ax.text(i, cpu[i] + red[i], f"{cpu[i] + red[i]:.1f}", ha="center", va="bottom", fontsize=8)
    # Room for the labels: a zero-height Redis bar on top of the tallest bar
    # would otherwise pin the axis there (its sticky edge) and cut the label off.
    ax.set_ylim(0, max([cpu[i] + red[i] for i in x] + [1]) * 1.08)
    ax.set_title("CPU per request at max throughput")
    ax.set_ylabel("µs / request")
    ax.legend(fontsize=8)

    ax = axes[2]
    w = 0.4
    p50 = [T[n]["p50_ms"] or 0 for n in names]
    p99 = [T[n]["p99_ms"] or 0 for n in names]
    ax.bar([i - w / 2 for i in x], p50, w, label="p50", color="#9ecae1")
    ax.bar([i + w / 2 for i in x], p99, w, label="p99", color="#08519c")
    for i in x:
        ax.text(i + w / 2, p99[i], f"{p99[i]:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_title(f"latency at {s['fixed_rate_rps']:,.0f} rps (CO-corrected)")
    ax.set_ylabel("ms (log scale)")
    ax.legend(fontsize=8)

    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels([n.replace("gateway_", "gw_") for n in names], rotation=30, ha="right", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    m = s["machine"]
    fig.suptitle(f"loadtest/bench.sh {s['run']['mode']} — {m['nproc']} vCPU {m['cpu_model']}, {s['run']['started_at']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_chart(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mem = s["memory"]
    xs = [p["clients"] / 1e6 for p in mem["rss_curve"]]
    ys = [p["rss_mib"] for p in mem["rss_curve"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker=".", color="#1f77b4")
    ax.axvline(mem["local_max_entries"] / 1e6, color="#d62728", linestyle="--",
               label=f"local_max_entries = {mem['local_max_entries']:,}")
    ax.set_xlabel("distinct clients sent (millions)")
    ax.set_ylabel("gateway VmRSS (MiB)")
    ax.set_title("local backend: RSS while new clients arrive")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path) -> dict:
    s = json.loads((out / "summary.json").read_text())
    (out / "summary.md").write_text(markdown(s))
    try:
        if s["targets"]:
            chart(s, out / "chart.png")
        if s.get("memory"):
            memory_chart(s, out / "memory.png")
    except ImportError as e:
        print(f"bench: no chart ({e}); install matplotlib into .venv", file=sys.stderr)
    return s


def replace_block(text: str, name: str, body: str) -> str:
    begin = f"<!-- {name}:begin (written by loadtest/bench.sh --publish) -->"
    block = f"{begin}\n{body}\n<!-- {name}:end -->"
    pat = re.compile(rf"<!-- {name}:begin.*?<!-- {name}:end -->", re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def publish(out: Path) -> None:
    """Puts a run's tables and charts into BENCHMARKS.md, between its markers.

    The targets table goes between <!-- bench:begin --> and <!-- bench:end -->,
    the memory step's result between <!-- bench-memory:begin/end -->; the rest
    of the file is left as it is. The charts are copied to loadtest/bench/."""
    s = write_report(out)
    bm = ROOT / "BENCHMARKS.md"
    text = bm.read_text() if bm.exists() else "# Benchmarks\n"
    if s["targets"]:
        shutil.copyfile(out / "chart.png", HERE / "latest-chart.png")
        shutil.copyfile(out / "summary.json", HERE / "latest-summary.json")
        body = markdown(dict(s, memory=None)) + "\n![the targets side by side](loadtest/bench/latest-chart.png)\n"
        text = replace_block(text, "bench", body)
    if s.get("memory"):
        shutil.copyfile(out / "memory.png", HERE / "latest-memory.png")
        m = s["machine"]
        body = (f"Run `{s['run']['dir']}` ({s['run']['started_at']}; {m['gateway']}, commit {m['git_commit']}"
                f"{', dirty tree' if m['git_dirty'] else ''}).\n" + "\n".join(memory_md(dict(s, warnings=[])))
                + "\n\n![RSS while new clients arrive](loadtest/bench/latest-memory.png)\n")
        text = replace_block(text, "bench-memory", body)
    bm.write_text(text)
    log(f"published {out.name} into {bm}")


# --- main ---------------------------------------------------------------------------------


def is_wrk_tls_connection_line(line: str) -> bool:
    """A line the TLS listener logs per wrk connection, not per request (see run)."""
    return "Illegal SNI extension: ignoring IP address" in line or "tls handshake eof" in line


def run(args) -> int:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    targets = [t for t in TARGETS if t in args.targets] if args.targets else list(TARGETS)
    if args.memory_only:
        targets = ["direct"]
    if "pingora_bare" in targets and not BARE.exists():
        print(f"bench: {BARE} is missing (the pingora_bare target): build first: "
              f"cargo build --release --example bare_proxy", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else RESULTS / f"bench-{stamp}"
    for d in ("config", "logs", "raw"):
        (out / d).mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    tools = Path(args.tools).resolve()
    b = Bench(args, out, tools, targets)

    def on_signal(sig, _frame):
        raise KeyboardInterrupt(f"signal {sig}")

    signal.signal(signal.SIGTERM, on_signal)
    started = dt.datetime.now().isoformat(timespec="seconds")
    machine = machine_info(b.gateway)
    thr: dict[str, list] = {t: [] for t in targets}
    lat: dict[str, list] = {t: [] for t in targets}
    extra: dict = {}
    rate = args.rate
    rc = 0
    try:
        others = busy_others(set())
        if others:
            warn("other processes are busy on this machine before the run (numbers will be noisy): " +
                 "; ".join(f"PID {o['pid']} {o['cpu_pct']}% {o['cmd']}" for o in others), b.warnings)
        log(f"run folder: {out}")
        b.start_servers(targets)
        if not args.memory_only:
            b.prime(targets)
            extra["tls_negotiated"] = b.negotiated(targets)
            per = args.warmup + args.duration + 0.7
            per_l = args.warmup + args.latency_duration + 0.7
            eta = len(targets) * args.rounds * (per + per_l)
            log("up: " + ", ".join(f"{t} {b.t[t]['url']}" for t in targets))
            log(f"{args.rounds} rounds x {len(targets)} targets, max throughput then fixed-rate latency: about "
                f"{eta / 60:.1f} min")
            orders = []
            for rnd in range(args.rounds):
                order = targets if rnd % 2 == 0 else list(reversed(targets))
                orders.append(order)
                for t in order:
                    r = b.throughput(t, f"thr{rnd + 1}")
                    thr[t].append(r)
                    extra_s = ""
                    if t in REDIS_TARGETS:
                        extra_s = (f", Redis {r['redis_cpu_us_per_req']:.2f} µs/req, "
                                   f"{r['script_calls_per_req']:.3f} script calls/req")
                    log(f"[max {rnd + 1}/{args.rounds}] {t:<21} {r['rps']:>9,.0f} rps  "
                        f"{r['cpu_us_per_req']:6.1f} µs/req CPU ({r['proxy_cpu_cores']:.2f} cores){extra_s}"
                        f"  other load {r['other_cpu_pct']:.0f}%")
            if rate is None:
                off = median(r["rps"] for r in thr.get("gateway_off", []))
                if off is None:
                    off = median(r["rps"] for r in thr[targets[0]])
                    warn(f"gateway_off not measured: the fixed rate is half {targets[0]}'s max", b.warnings)
                rate = round(off / 2)
            log(f"fixed rate: {rate:,} rps for {args.latency_duration:g}s per target and round")
            for rnd in range(args.rounds):
                order = orders[rnd]
                for t in order:
                    r = b.fixed_rate(t, f"lat{rnd + 1}", rate)
                    lat[t].append(r)
                    log(f"[lat {rnd + 1}/{args.rounds}] {t:<21} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                        f"p99.9 {r['p999_ms']:.3f} ms  ({r['cpu_us_per_req']:.1f} µs/req CPU)  other load "
                        f"{r['other_cpu_pct']:.0f}%")
            extra["orders"] = orders
            if args.perf:
                extra["perf"] = b.perf([t for t in targets if t != "direct"])
        if args.memory or args.memory_only:
            extra["memory"] = b.memory()
        for t in targets:
            p = b.t[t]["proc"]
            if p.poll() is not None:
                warn(f"{t}: its process (PID {p.pid}) exited during the run with {p.returncode}", b.warnings)
    except KeyboardInterrupt:
        print("bench: interrupted; stopping what it started", file=sys.stderr)
        b.procs.stop_all()
        return 130
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        b.procs.stop_all()
        return 2
    finally:
        b.procs.stop_all()
        if not args.perf:  # perf reports need the binary they profiled; nothing else does
            shutil.rmtree(out / "bin", ignore_errors=True)

    # What the gateways logged at warn level or above (bare_proxy installs no
    # logger: only a panic would show). A request abandoned by wrk at the end
    # of a window is logged as "Downstream ConnectionClosed": counted, not
    # warned about. So are gateway_tls's per-connection lines: wrk sends the IP
    # address as SNI (rustls: "Illegal SNI extension", ignored) and opens one
    # connection it closes at once to check the address ("tls handshake eof").
    gateway_logs = {}
    for t in list(targets) + (["memory-gateway"] if "memory" in extra else []):
        lp = out / "logs" / f"{t}.log"
        if (t in GATEWAY_TARGETS or t in ("memory-gateway", "pingora_bare")) and lp.exists():
            lines = [ln for ln in lp.read_text(errors="replace").splitlines()
                     if re.search(r"\b(WARN|ERROR|panic)", ln, re.I)]
            aborts = [ln for ln in lines if "Downstream ConnectionClosed" in ln]
            tls_conn = [ln for ln in lines if is_wrk_tls_connection_line(ln)]
            rest = [ln for ln in lines if "Downstream ConnectionClosed" not in ln and not is_wrk_tls_connection_line(ln)]
            gateway_logs[t] = {"warn_or_error_lines": len(lines), "downstream_closed": len(aborts),
                               "other_first": rest[:5]}
            if tls_conn:
                gateway_logs[t]["wrk_tls_connection_lines"] = len(tls_conn)
            if rest:
                warn(f"{t} logged {len(rest)} warning/error lines (besides {len(aborts)} downstream-closed), "
                     f"first: {rest[0][:240]}", b.warnings)
    extra["gateway_logs"] = gateway_logs

    machine["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    run_info = {
        "dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
        "mode": "memory-only" if args.memory_only else ("quick" if args.quick else "full"),
        "rounds": args.rounds, "duration_s": args.duration, "latency_duration_s": args.latency_duration,
        "warmup_s": args.warmup, "connections": args.connections, "threads": args.threads,
        "wrk_threads": args.wrk_threads, "upstream_threads": args.upstream_threads,
        "path": PATH, "api_key_header_on": LIMITED_TARGETS,
        "started_at": started, "finished_at": dt.datetime.now().isoformat(timespec="seconds"),
        "load_generators": {"max_throughput": "wrk (closed loop, fixed connections)",
                            "latency": "loadtest/bench/fixedrate.c (open loop, latency from the intended send time)"},
    }
    summary = summarize(args, targets if not args.memory_only else [], thr, lat, rate, extra)
    noise = [d["other_cpu_pct"] for d in summary["targets"].values() if d.get("other_cpu_pct") is not None]
    if noise and max(noise) > 25:
        warn(f"noisy run: processes this run did not start used up to {max(noise):.0f}% of a core (median per "
             f"target) during the windows; re-run on a quiet machine before drawing conclusions", b.warnings)
    summary["noisy"] = bool(noise and max(noise) > 25)
    summary["run"] = run_info
    summary["machine"] = machine
    summary["warnings"] = b.warnings
    summary["rounds"] = {"max_throughput": thr, "fixed_rate": lat} if not args.memory_only else {}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    write_report(out)
    print()
    print((out / "summary.md").read_text())
    log(f"wrote {out}/: summary.json, summary.md" + (", chart.png" if summary["targets"] else "")
        + (", memory.png" if summary.get("memory") else ""))
    if args.publish:
        publish(out)
    failed = [c for c in summary["checks"] if c["pass"] is False]
    if failed:
        log(f"{len(failed)} of {len(summary['checks'])} targets FAIL: " + "; ".join(c["label"] for c in failed))
        rc = 1
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(prog="bench.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--quick", action="store_true")
    r.add_argument("--duration", type=float)
    r.add_argument("--latency-duration", type=float)
    r.add_argument("--warmup", type=float)
    r.add_argument("--rounds", type=int)
    r.add_argument("--connections", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--wrk-threads", type=int, default=2)
    r.add_argument("--upstream-threads", type=int, default=1)
    r.add_argument("--rate", type=float)
    r.add_argument("--targets")
    r.add_argument("--memory", action="store_true", default=None)
    r.add_argument("--no-memory", dest="memory", action="store_false")
    r.add_argument("--memory-only", action="store_true")
    r.add_argument("--memory-clients", type=int, default=1_200_000)
    r.add_argument("--memory-max-entries", type=int, default=1_000_000)
    r.add_argument("--memory-timeout", type=int, default=600)
    r.add_argument("--perf", action="store_true")
    r.add_argument("--publish", action="store_true")
    r.add_argument("--out")
    r.add_argument("--tools", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    pub = sub.add_parser("publish")
    pub.add_argument("dir")
    args = ap.parse_args()

    if args.cmd == "report":
        write_report(Path(args.dir))
        print((Path(args.dir) / "summary.md").read_text())
        return 0
    if args.cmd == "publish":
        publish(Path(args.dir).resolve())
        return 0

    if args.quick:
        defaults = dict(duration=5, latency_duration=4, warmup=1, rounds=3, memory=False)
    else:
        defaults = dict(duration=15, latency_duration=15, warmup=2, rounds=3, memory=True)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.targets:
        args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        bad = [t for t in args.targets if t not in TARGETS]
        if bad:
            ap.error(f"unknown targets {bad}; known: {', '.join(TARGETS)}")
    for k in ("duration", "latency_duration", "rounds", "connections", "threads", "wrk_threads", "upstream_threads"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive")
    if args.connections < args.wrk_threads:
        ap.error("--connections must be at least --wrk-threads")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
