"""The targets: every server the benchmark measures or needs, started on
127.0.0.1 at free ports and stopped by PID (never by name): Redis, the mock
upstream, nginx, the bare Pingora proxy and one gateway per gateway target;
their configs rendered from the templates beside this file, each primed with
one request before anything is measured."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import common
import shapes
from common import (ANCHOR, API_KEY, CLUSTER_TARGETS, GATEWAY_TARGETS, HERE, JWT_TARGETS, LIMITED_TARGETS,
                    NGINX_TARGETS, OVER_PATH, PADDED_TARGETS, PATH, REDIS_TARGETS, SHARES_GAUGE, SHARES_SETTLE_S,
                    SHARES_TARGETS, SHARES_WAIT_S, TLS_TARGETS, TRACED_DOWN, TRACED_TARGETS, NO_TOP_TARGETS, BenchError,
                    key_prefix, log, warn)
from lt.procs import free_ports  # after common, which puts loadtest/ on sys.path

# --- processes ------------------------------------------------------------------


def cluster_ports(n: int) -> list[int]:
    """Free ports for Redis Cluster nodes: each at most 55535, its cluster bus
    (the port + 10000) free too. Below the usual ephemeral range (32768+) as
    far as possible, so no outgoing connection takes one meanwhile."""
    rng = random.Random(os.getpid())
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(20000, 32000)
        if p in ports:
            continue
        socks = []
        try:
            for q in (p, p + 10000):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            ports.append(p)
        except OSError:
            pass
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


def metric_value(text: str, name: str) -> float | None:
    """The value of metric `name` in a Prometheus text body (the first sample,
    labelled or not), or None when it is not there."""
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+|NaN)\s*$", line.strip())
        if m:
            try:
                return float(m.group(1))
            except ValueError:
                return None
    return None


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


def make_jwt_files(d: Path) -> dict:
    """An RS256 key pair (openssl) and one token it signs, good for a day:
    gateway_jwt's issuer reads the public key as a key file, and every
    request of the run sends the token (a hot client)."""
    import base64

    d.mkdir(exist_ok=True)
    openssl(["genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "jwt.key"], d)
    openssl(["pkey", "-in", "jwt.key", "-pubout", "-out", "jwt.pub.pem"], d)

    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    header = b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "bench"}).encode())
    claims = {"iss": "bench-issuer", "aud": "bench", "sub": "bench-client", "exp": int(time.time()) + 86400}
    msg = f"{header}.{b64(json.dumps(claims).encode())}"
    sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(d / "jwt.key")], input=msg.encode(),
                         capture_output=True, check=True).stdout
    return {"public": d / "jwt.pub.pem", "token": f"{msg}.{b64(sig)}"}


def jwt_section(public: Path) -> str:
    return (
        "[[auth.jwt.issuers]]\n"
        'issuer = "bench-issuer"\n'
        f'key_files = ["{public}"]\n'
        'audiences = ["bench"]\n'
        'algorithms = ["RS256"]\n'
        'default_plan = "bench"\n'
    )


def headers_of(t: str, jwt: dict | None) -> dict:
    """What a target's requests carry: the API key, gateway_jwt's token, or
    (gateway_key_padded) the key and a header the token's length."""
    if t in LIMITED_TARGETS:
        return {"x-api-key": API_KEY}
    if t in JWT_TARGETS and jwt:
        return {"authorization": f"Bearer {jwt['token']}"}
    if t in PADDED_TARGETS and jwt:
        return {"x-api-key": API_KEY, "x-pad": "p" * len(jwt["token"])}
    return {}


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


class Redis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen | None = None  # a cluster node's process

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

    def pipe(self, commands: list[str]) -> list[str]:
        """Many commands over one connection (redis-cli reading stdin): one answer line each."""
        out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(self.port)], input="\n".join(commands) + "\n",
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise BenchError(f"redis-cli (pipe of {len(commands)}): {out.stderr.strip()}")
        return out.stdout.splitlines()



def start_redis_server(procs: Procs, name: str, port: int, log_path: Path,
                       cluster_dir: Path | None = None) -> Redis:
    """One redis-server on 127.0.0.1:`port` without persistence, answering
    PING; with `cluster_dir`, a cluster node keeping its nodes.conf there."""
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--loglevel", "warning"]
    if cluster_dir is not None:
        cluster_dir.mkdir(parents=True, exist_ok=True)
        argv += ["--dir", str(cluster_dir), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "5000"]
    p = procs.start(name, argv, log_path)
    r = Redis(port)
    r.proc = p
    wait_until(f"redis-server ({name})", lambda: r.cmd("PING").strip() == "PONG", 10, p, log_path)
    return r


def form_cluster(nodes: list[Redis], create_log: Path) -> None:
    """Joins cluster nodes as masters without replicas: redis-cli --cluster
    create for three or more (its output into `create_log`), by hand below
    that (each its even share of the slots, then one handshake); returns once
    every node reports cluster_state:ok."""
    if len(nodes) >= 3:
        out = subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        create_log.write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise BenchError(f"redis-cli --cluster create failed ({create_log}):\n{out.stdout[-2000:]}")
    else:
        for i, r in enumerate(nodes):
            lo, hi = 16384 * i // len(nodes), 16384 * (i + 1) // len(nodes) - 1
            if r.cmd("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)).strip() != "OK":
                raise BenchError(f"CLUSTER ADDSLOTSRANGE {lo} {hi} failed on node {r.port}")
        for r in nodes[1:]:
            nodes[0].cmd("CLUSTER", "MEET", "127.0.0.1", str(r.port))
    wait_until("the Redis Cluster (cluster_state:ok on every node)",
               lambda: all("cluster_state:ok" in r.cmd("CLUSTER", "INFO") for r in nodes), 30)


# --- the servers --------------------------------------------------------------------------


class Targets:
    """Every server of the run and how to reach each target: self.t[name] =
    {url, pids(), headers, proc, and for gateways admin and log}."""

    def __init__(self, args, out: Path, targets: list[str], warnings: list[str]) -> None:
        self.a = args
        self.out = out
        self.procs = Procs()
        self.warnings = warnings
        self.t: dict[str, dict] = {}  # target -> {url, pids(), admin, headers, proc, ssl}
        self.tls: dict | None = None  # the TLS pair's files: ca, cert, key
        self.tls_client: ssl.SSLContext | None = None  # trusts that CA
        self.redis: Redis | None = None
        self.redis_proc = None
        self.cluster: list[Redis] = []  # the Redis Cluster's masters, for CLUSTER_TARGETS
        self.anchor: Redis | None = None  # redis_anchor's own redis-server (the standing shares' anchor)
        self.shares: set[str] = set()  # the gateway targets whose config enables [limiter.shares]
        self.used_memory_start: dict[int, int] = {}  # port -> used_memory before any gateway ran
        self.mock_proc = None
        self.our_pids: list[int] = []
        # Copies of the binaries, taken at the start: a rebuild during the run
        # cannot change what is measured, and perf can still resolve symbols.
        (out / "bin").mkdir(exist_ok=True)
        self.gateway = out / "bin" / "gateway"
        self.mock = out / "bin" / "mock-upstream"
        self.bare = out / "bin" / "bare_proxy"
        self.gateway_source = (Path(args.gateway_bin).resolve() if getattr(args, "gateway_bin", None)
                               else common.GATEWAY)
        shutil.copy2(self.gateway_source, self.gateway)
        shutil.copy2(common.MOCK, self.mock)
        if "pingora_bare" in targets:
            shutil.copy2(common.BARE, self.bare)

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
        ports = iter(free_ports(3 + 3 * len(targets) + 2))
        logs = out / "logs"
        cfg = out / "config"
        self.redis_port = next(ports)
        self.mock_port = next(ports)
        upstream = f"127.0.0.1:{self.mock_port}"

        if any(t in REDIS_TARGETS and t not in CLUSTER_TARGETS for t in targets):
            self.redis = start_redis_server(self.procs, "redis", self.redis_port, logs / "redis.log")
            self.redis_proc = self.redis.proc
            self.our_pids.append(self.redis_proc.pid)

        if any(t in CLUSTER_TARGETS for t in targets):
            self.start_cluster(cluster_ports(common.CLUSTER_NODES))
        for r in ([self.redis] if self.redis else []) + self.cluster:
            self.used_memory_start[r.port] = int(r.info().get("used_memory", 0))
        if ANCHOR in targets:
            # The standing shares' anchor: a fresh redis-server of its own, driven by redis_anchor.c.
            port = next(ports)
            self.anchor = start_redis_server(self.procs, "redis-anchor", port, logs / "redis-anchor.log")
            self.our_pids.append(self.anchor.proc.pid)
            self.t[ANCHOR] = {"url": f"redis://127.0.0.1:{port}", "pids": lambda p=self.anchor.proc: [p.pid],
                              "headers": {}, "proc": self.anchor.proc, "log": logs / "redis-anchor.log"}

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

        jwt = make_jwt_files(out / "jwt") if any(t in JWT_TARGETS + PADDED_TARGETS for t in targets) else None
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
        cluster_section = (
            "[redis]\n"
            'mode = "cluster"\n'
            "urls = [" + ", ".join(f'"redis://127.0.0.1:{r.port}"' for r in self.cluster) + "]\n"
            "timeout_ms = 15\n"
            "probe_interval_ms = 250\n"
            'key_prefix = "@@PREFIX@@"'
        )
        over_route = (
            "[[routes]]\n"
            'name = "bench-over"\n'
            f'path_prefix = "{OVER_PATH}"\n'
            'upstream = "mock"\n'
            'limit = { algorithm = "token_bucket", capacity = 1, refill_per_sec = 0.000001, scope = "client" }\n'
        )
        if any(t in TRACED_TARGETS for t in targets):
            self.sink_port = next(ports)
            # Nothing ever listens here: gateway_traced_down's collector is down.
            self.down_port = next(ports)
            self.procs.start("otlp-sink", [sys.executable, str(HERE / "otlp_sink.py"), str(self.sink_port)],
                             logs / "otlp-sink.log")
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
                backend = "redis" if t in REDIS_TARGETS else "local"
                # The per-client buckets: a crowd's (--clients, a crowd shape) or one client's.
                lim = shapes.limits(t, a)
                many = lim["many"]
                denied = t == "gateway_redis_denied"
                section = cluster_section if t in CLUSTER_TARGETS else redis_section
                shares = t in SHARES_TARGETS and backend == "redis"
                if shares:
                    self.shares.add(t)
                self.render(
                    "gateway.tiers.toml", dest, **subs, BACKEND=backend, API_KEY=API_KEY,
                    REDIS_SECTION=section.replace("@@PREFIX@@", key_prefix(t)) if backend == "redis" else "",
                    LEASES_SECTION=f"[limiter.leases]\nperiod_ms = {a.lease_period_ms}   # --lease-period-ms"
                    if a.lease_period_ms and backend == "redis" else "# [limiter.leases]: the defaults",
                    SHARES_SECTION="[limiter.shares]\nenabled = true   # standing shares: no Redis call"
                    if shares else "# [limiter.shares]: off (the default)",
                    ROUTE_CAPACITY=1 if denied else shapes.number(lim["route_capacity"]),
                    ROUTE_REFILL="0.000001" if denied else shapes.number(lim["route_refill"]),
                    CLIENT_CAPACITY=shapes.number(lim["ip_capacity"]),
                    CLIENT_REFILL=shapes.number(lim["ip_refill"]),
                    OVER_PATH=OVER_PATH,
                    TRUSTED_PROXIES='trusted_proxies = ["127.0.0.1/32"]   # --clients: wrk plays the load balancer'
                    if many else "# one client: no trusted proxy",
                    OVER_ROUTE=over_route if many else "",
                    AUTH_SECTION=jwt_section(jwt["public"]) if t in JWT_TARGETS and jwt else "# no [auth.jwt]",
                    ADMIN_SECTION="[admin]\ntop = false   # no top-K of refused clients"
                    if t in NO_TOP_TARGETS else "# [admin] top: on (the default)",
                    TRACING_SECTION=(f'[tracing]\notlp_endpoint = "http://127.0.0.1:'
                                     f'{self.down_port if t == TRACED_DOWN else self.sink_port}"\n'
                                     f"sample_ratio = {TRACED_TARGETS[t]}\n")
                    if t in TRACED_TARGETS else "# no [tracing]",
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
                         "headers": headers_of(t, jwt),
                         "proc": p, "log": gl,
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

    def wait_shares(self, targets: list[str]) -> dict[str, str]:
        """Standing shares: waits (at most SHARES_WAIT_S) until every target of `targets`
        whose config enables [limiter.shares] shows gateway_shares_usable 1 on
        its /metrics, then SHARES_SETTLE_S more (the shares fill from empty),
        so the windows measure the steady state. Returns {target: why} for
        those whose gauge never showed 1."""
        waiting = [t for t in targets if t in self.shares]
        if not waiting:
            return {}
        t0 = time.monotonic()
        last: dict[str, str] = {}
        ok: list[str] = []
        next_log = 0.0
        while waiting:
            for t in list(waiting):
                info = self.t[t]
                if info["proc"].poll() is not None:
                    last[t] = f"the gateway exited ({info['proc'].returncode})"
                    continue
                try:
                    st, _, body = http_get(f"http://{info['admin']}/metrics", timeout=2)
                    v = metric_value(body.decode(errors="replace"), SHARES_GAUGE) if st == 200 else None
                    last[t] = (f"{SHARES_GAUGE} {v:g}" if v is not None
                               else f"no {SHARES_GAUGE} gauge" if st == 200 else f"/metrics answered {st}")
                except Exception as e:  # noqa: BLE001 (a slow or refused /metrics: try again)
                    v, last[t] = None, f"/metrics: {e}"
                if v == 1:
                    waiting.remove(t)
                    ok.append(t)
                    log(f"{t}: {SHARES_GAUGE} 1 after {time.monotonic() - t0:.1f} s")
            el = time.monotonic() - t0
            if not waiting or el >= SHARES_WAIT_S:
                break
            if el >= next_log:
                log(f"waiting for {SHARES_GAUGE} 1 on {', '.join(waiting)} ({el:.1f} of {SHARES_WAIT_S:g} s; "
                    + "; ".join(f"{t}: {last.get(t, 'not asked yet')}" for t in waiting) + ")")
                next_log = el + 2.0
            time.sleep(0.2)
        failed = {t: (f"its /metrics (http://{self.t[t]['admin']}/metrics) did not show {SHARES_GAUGE} 1 within "
                      f"{SHARES_WAIT_S:g} s of the wait ([limiter.shares] enabled = true in config/{t}.toml; "
                      f"last seen: {last.get(t, 'nothing')})") for t in waiting}
        if ok:
            log(f"shares usable on {', '.join(ok)}: {SHARES_SETTLE_S:g} s more for them to fill")
            time.sleep(SHARES_SETTLE_S)
        return failed

    def drop(self, t: str) -> None:
        """Stops a target that cannot be measured (by its PID) and forgets it."""
        info = self.t.pop(t, None)
        if info and info.get("proc") is not None:
            self.procs.stop_one(info["proc"])

    def start_cluster(self, ports: list[int]) -> None:
        """A Redis Cluster of `len(ports)` masters (no replicas) on 127.0.0.1,
        made with redis-cli --cluster create as tests/integration/support/topology.rs does
        (which takes three or more; fewer are given the slots by hand)."""
        base = self.out / "redis-cluster"
        for port in ports:
            r = start_redis_server(self.procs, f"redis-cluster-{port}", port,
                                   self.out / "logs" / f"redis-cluster-{port}.log", cluster_dir=base / str(port))
            self.cluster.append(r)
            self.our_pids.append(r.proc.pid)
        form_cluster(self.cluster, self.out / "logs" / "redis-cluster-create.txt")
        log(f"Redis Cluster up: {len(ports)} masters on ports {', '.join(map(str, ports))}")

    def redis_nodes(self, target: str) -> list[Redis]:
        """The Redis servers a target's limiter uses (none for the others):
        the cluster's masters or the standalone Redis (the anchor: its own)."""
        if target == ANCHOR:
            return [self.anchor] if self.anchor is not None else []
        if target in CLUSTER_TARGETS:
            return list(self.cluster)
        return [self.redis] if self.redis is not None else []

    def redis_pids(self, target: str) -> list[int]:
        """The processes of `redis_nodes(target)` (the standalone Redis for its targets only)."""
        if target == ANCHOR or target in CLUSTER_TARGETS:
            return [r.proc.pid for r in self.redis_nodes(target) if r.proc is not None]
        return [self.redis_proc.pid] if self.redis is not None and target in REDIS_TARGETS else []

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
        for t in [t for t in targets if t != ANCHOR]:
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
