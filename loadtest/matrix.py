#!/usr/bin/env python3
"""The holdout matrix: the gateway's in-flight caps on upstreams
of many shapes, each one's capacity halving under a steady overload.

    matrix.py run [--quick | --smoke] [--shapes 4x20,8x50] [--variants a,b]
                  [--phase-secs P1,P2] [--warmup S] [--settle S]
                  [--connections N] [--fixedrate PATH] [--out DIR]
    matrix.py report RUN_DIR   re-make summary.json/summary.md/the plots
                               from RUN_DIR's raw results
    matrix.py check RUN_DIR    validate the outputs already there

loadtest/matrix.sh is the wrapper: it compiles fixedrate, makes sure of
matplotlib in .venv, and runs `matrix.py run`.

A shape is W workers at S ms (mock-upstream --workers W --service-ms S
--threads 2 --finish-abandoned): its nominal capacity C = W * 1000 / S rps.
Shapes: W in {4, 8, 32} x S in {20, 50, 200}. Variants, each on a fresh mock
and gateway (free loopback ports, bound to port 0, never one twice a run):

  adaptive_q50    max_in_flight = 256, queue = 64, queue_timeout_ms = 50,
                  adaptive = { min = 1, max = 256 }
  adaptive_q1000  the same with queue_timeout_ms = 1000
  rate_limit      no in-flight cap; the route has a global token bucket of
                  C/s (capacity C): right for the first capacity

Per run: the unloaded latency through the gateway (sequential GETs, the
median); then fixedrate (open loop, latency from each request's intended send
time) offers 2C rps:
  phase 1  P1 s (default 10); the first --warmup s (4) are not measured:
           the controller's cold start (a slow start from min that passes
           the workers once, by up to as many again, for two round trips)
           is not the steady state the targets are about;
  guard    phase 2's fixedrate starts where phase 1's schedule ends, so the
           load never pauses; the halving waits queue_timeout_ms + 100 ms
           more (a request of phase 1 still in the gateway's queue reaches
           the mock before it slows down: the mock fixes a request's
           service time when it arrives);
  halving  POST /control?service_ms=2S: capacity C/2;
  phase 2  P2 s from the halving (default 10); the first --settle s (3) are
           not measured.
A thread samples every 100 ms the gateway's gateway_in_flight_limit /
gateway_in_flight / gateway_in_flight_queued (upstream "up") and the mock's
/stats (in_flight: held, being served or waiting for a worker; waiting; ok).

Figures per shape and variant, each phase over its measured window: goodput
(2xx/s) as % of the capacity then (C, then C/2); the mock's in_flight p50/p90
and waiting p90; admitted (2xx) p50/p99 over the unloaded latency (after the
halving: the unloaded latency + S, what the mock's extra S ms add); 5xx other
than 503; the share of 503s (and of 429s); the settle time: seconds from the
halving until the limit stays within +-25% of its median over phase 2's
measured window (never: it is still outside at the end).

Targets, held for the adaptive variants; rate_limit's rows are for
comparison: goodput >= 90% of capacity before and after; upstream waiting
p90 <= W/4 in both phases; admitted p99 <= 2x unloaded in both phases; no
5xx other than 503; settle <= 3 s.

Writes RUN_DIR (default loadtest/results/matrix-<timestamp>/): summary.json,
summary.md (the table, a pass/fail line per target), matrix.png (per shape
and variant: the limit, the gateway's and the mock's in-flight and the
mock's queue over time, the halving marked), goodput.png, and per run
runs/<WxS>-<variant>/ with the configs, logs, fixedrate's JSON per phase,
the unloaded latencies and timeline.json.

Exit status: 0 when every run completed and the outputs are well formed
(the targets are reported, never change it), 1 otherwise, 2 on bad usage,
130 on Ctrl-C. Every process it starts is stopped, by PID, on the way out.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from lt import files, metrics, tables
from lt.plots import pyplot, save_png
from lt.files import load_json
from lt.procs import log, warn
from lt.stats import percentile, rnd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GATEWAY = ROOT / "target/release/gateway"
MOCK = ROOT / "target/release/mock-upstream"
FIXEDRATE = HERE / "results/.tools/fixedrate"
RESULTS = HERE / "results"
PATH = "/api/matrix"

ALL_SHAPES = [(w, s) for w in (4, 8, 32) for s in (20, 50, 200)]
VARIANTS = {
    "adaptive_q50": {"adaptive": True, "queue_timeout_ms": 50},
    "adaptive_q1000": {"adaptive": True, "queue_timeout_ms": 1000},
    "rate_limit": {"adaptive": False, "queue_timeout_ms": 0},
}
ADAPTIVE_MAX = 256
QUEUE = 64
PRESETS = {
    # 27 runs of ~27 s: about 13 minutes. The warm-up covers the cold
    # start: a slow start from min = 1 to 32 workers at 200 ms takes ~3 s.
    "full": {"shapes": ALL_SHAPES, "phase1": 10.0, "phase2": 10.0, "warmup": 4.0, "settle": 3.0},
    # The diagonal (every W, every S once), shorter phases: 9 runs, about 3 minutes.
    "quick": {"shapes": [(4, 200), (8, 50), (32, 20)], "phase1": 8.0, "phase2": 8.0, "warmup": 4.0, "settle": 3.0},
    # One shape, a few seconds a phase: checks that the outputs are made.
    "smoke": {"shapes": [(8, 20)], "phase1": 3.0, "phase2": 4.0, "warmup": 1.0, "settle": 2.0},
}
SAMPLE_SECS = 0.1
FIXEDRATE_TIMEOUT = 3.0  # s fixedrate waits for outstanding requests after its schedule

# Targets, held for the adaptive variants.
T_GOODPUT_PCT = 90.0
T_QUEUE_FRACTION = 0.25  # of the workers
T_P99_RATIO = 2.0
T_SETTLE_S = 3.0
SETTLE_BAND = 0.25
# A phase whose load generator fell this far behind its schedule once is
# noted: the host stalled, and every process on it with the generator.
SEND_LAG_NOTED_MS = 25.0

TARGETS = [
    ("goodput", f"goodput >= {T_GOODPUT_PCT:g}% of capacity, before and after the halving"),
    ("queue", "upstream queue (waiting) p90 <= workers/4, both phases"),
    ("p99", f"admitted p99 <= {T_P99_RATIO:g}x unloaded latency, both phases"),
    ("no_5xx", "no 5xx other than 503"),
    ("settle", f"limit settles within +-{SETTLE_BAND * 100:g}% of its median in <= {T_SETTLE_S:g} s (adaptive only)"),
]


class RunError(Exception):
    pass


# ------------------------------------------------------------------ processes

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: a server outlives nothing of ours, even a SIGKILL of
    # this script. Only used while no other thread runs (before fork safety
    # matters).
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)


class Procs:
    """Every process started, stopped by its PID (never by name)."""

    def __init__(self) -> None:
        self.live: list[tuple[str, subprocess.Popen, int, float]] = []

    def start(self, name, argv, log_path, stop_sig=signal.SIGTERM, stop_wait=5.0, env=None, die_with_parent=True):
        f = open(log_path, "wb")
        try:
            p = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches us only: we stop them
                preexec_fn=_die_with_parent if die_with_parent and threading.active_count() == 1 else None,
            )
        finally:
            f.close()
        self.live.append((name, p, stop_sig, stop_wait))
        return p

    def stop(self, p: subprocess.Popen) -> int | None:
        for i, (name, q, sig, wait) in enumerate(self.live):
            if q is p:
                del self.live[i]
                return self._stop(name, q, sig, wait)
        return p.poll()

    @staticmethod
    def _stop(name, p, sig, wait):
        if p.poll() is None:
            try:
                p.send_signal(sig)  # os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                warn(f"{name} (PID {p.pid}) did not exit {wait:g} s after signal {int(sig)}: SIGKILL")
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    warn(f"{name} (PID {p.pid}) survives SIGKILL")
        return p.returncode

    def stop_all(self) -> None:
        while self.live:
            name, p, sig, wait = self.live.pop()
            self._stop(name, p, sig, wait)


class Ports:
    """Free loopback ports: bound to port 0, never one handed out twice."""

    def __init__(self) -> None:
        self.used: set[int] = set()

    def take(self, n: int) -> list[int]:
        socks, ports = [], []
        try:
            for _ in range(50 * n):
                if len(ports) == n:
                    break
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind(("127.0.0.1", 0))
                socks.append(s)
                p = s.getsockname()[1]
                if p not in self.used:
                    self.used.add(p)
                    ports.append(p)
        finally:
            for s in socks:
                s.close()
        if len(ports) != n:
            raise RunError("could not find free loopback ports")
        return ports


# ------------------------------------------------------------------ HTTP


class Http:
    """A keep-alive HTTP/1.1 client to one 127.0.0.1 port (reconnects on error)."""

    def __init__(self, port: int, timeout: float = 2.0) -> None:
        self.port, self.timeout, self.conn = port, timeout, None

    def request(self, method: str, path: str) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=b"" if method == "POST" else None)
                r = self.conn.getresponse()
                body = r.read()
                if r.getheader("connection", "").lower() == "close":
                    self.close()
                return r.status, body
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def wait_ready(port: int, path: str, proc: subprocess.Popen, what: str, secs: float) -> None:
    deadline = time.monotonic() + secs
    h = Http(port, timeout=1.0)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RunError(f"{what} exited (status {proc.returncode}) before it was ready")
            try:
                st, _ = h.request("GET", path)
                if st == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
    finally:
        h.close()
    raise RunError(f"{what} not ready on 127.0.0.1:{port}{path} after {secs:g} s")


WANT = {"gateway_in_flight_limit": "limit", "gateway_in_flight": "gw_in_flight", "gateway_in_flight_queued": "gw_queued"}


def parse_metrics(text: str) -> dict:
    out = {}
    for name, labels, v in metrics.samples(text):
        key = WANT.get(name)
        if key and labels.get("kind") == "upstream" and labels.get("name") == "up":
            out[key] = v
    return out


class Poller(threading.Thread):
    """Samples the gateway's gauges and the mock's /stats every 100 ms."""

    def __init__(self, admin_port: int, mock_port: int, base: float) -> None:
        super().__init__(daemon=True)
        self.admin, self.mock, self.base = Http(admin_port, 1.0), Http(mock_port, 1.0), base
        self.samples: list[dict] = []
        self.stop_ev = threading.Event()
        self.errors = 0

    def run(self) -> None:
        nxt = time.monotonic()
        while not self.stop_ev.is_set():
            t = time.monotonic()
            row = {"t": round(t - self.base, 4)}
            try:
                st, body = self.admin.request("GET", "/metrics")
                if st == 200:
                    row.update(parse_metrics(body.decode("utf-8", "replace")))
            except (OSError, http.client.HTTPException):
                self.errors += 1
            try:
                st, body = self.mock.request("GET", "/stats")
                if st == 200:
                    s = json.loads(body)
                    for k in ("in_flight", "waiting", "ok", "failed", "total"):
                        if k in s:
                            row["up_" + k] = s[k]
            except (OSError, http.client.HTTPException, ValueError):
                self.errors += 1
            self.samples.append(row)
            nxt += SAMPLE_SECS
            wait = nxt - time.monotonic()
            if wait < 0:
                nxt = time.monotonic()
                wait = 0
            self.stop_ev.wait(wait)
        self.admin.close()
        self.mock.close()

    def finish(self) -> list[dict]:
        self.stop_ev.set()
        self.join(timeout=5)
        return list(self.samples)


# ------------------------------------------------------------------ one run


def shape_key(w: int, s: int) -> str:
    return f"{w}x{s}"


def capacity(w: int, s: int) -> float:
    return w * 1000.0 / s


def connections_for(w: int, s: int, variant: str) -> int:
    # 8W covers the offered rate (2C) at twice the doubled service time
    # (2C * 2S * 2 = 8W); + 320: an adaptive gateway can hold up to
    # max_in_flight (256) + queue (64) at once, none of them the client's
    # doing. The same for rate_limit, so the variants are driven alike.
    return min(2000, max(64, 8 * w) + ADAPTIVE_MAX + QUEUE)


def gateway_config(pp: int, ap: int, mp: int, w: int, s: int, variant: str) -> str:
    v = VARIANTS[variant]
    c = capacity(w, s)
    up = [
        "[[upstreams]]",
        'name = "up"',
        f'servers = ["127.0.0.1:{mp}"]',
        "read_timeout_ms = 10000",
    ]
    route = ["[[routes]]", 'name = "r"', 'path_prefix = "/"', 'upstream = "up"']
    if v["adaptive"]:
        up += [
            f"max_in_flight = {ADAPTIVE_MAX}",
            f"queue = {QUEUE}",
            f"queue_timeout_ms = {v['queue_timeout_ms']}",
            f"adaptive = {{ min = 1, max = {ADAPTIVE_MAX} }}",
        ]
    else:
        cap = f"{c:g}"
        route.append(f'limit = {{ algorithm = "token_bucket", capacity = {cap}, refill_per_sec = {cap}, scope = "global" }}')
    return "\n".join(
        [
            f"# Made by loadtest/matrix.py: shape {shape_key(w, s)} ({w} workers, {s} ms), variant {variant}.",
            "[server]",
            f'listen = ["127.0.0.1:{pp}"]',
            f'admin_listen = "127.0.0.1:{ap}"',
            "threads = 2",
            "grace_period_secs = 1",
            "",
            "[limiter]",
            'backend = "local"',
            "",
            *up,
            "",
            *route,
            "",
        ]
    )


def unloaded_count(s: int) -> int:
    return max(10, min(30, 3000 // s))


def sleep_until(t: float) -> None:
    d = t - time.monotonic()
    if d > 0:
        time.sleep(d)


def wait_proc(p: subprocess.Popen, deadline: float) -> int | None:
    try:
        return p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def run_one(w: int, s: int, variant: str, opts, bins: dict, ports: Ports, procs: Procs, run_dir: Path) -> None:
    """One shape x variant; raw results into run_dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    c = capacity(w, s)
    rate = 2 * c
    conns = opts.connections or connections_for(w, s, variant)
    qt = VARIANTS[variant]["queue_timeout_ms"]
    guard = qt / 1000.0 + 0.1
    p1, p2, warm, settle = opts.phase1, opts.phase2, opts.warmup, opts.settle
    mp, pp, ap = ports.take(3)
    meta = {
        "shape": shape_key(w, s), "workers": w, "service_ms": s, "service_ms_after": 2 * s,
        "variant": variant, "config": VARIANTS[variant], "capacity_rps": c, "capacity_after_rps": c / 2,
        "offered_rps": rate, "connections": conns, "phase1_s": p1, "phase2_s": p2, "warmup_s": warm,
        "settle_s": settle, "guard_s": guard, "ports": {"mock": mp, "proxy": pp, "admin": ap},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_before": os.getloadavg(),
    }

    mock = procs.start(
        "mock-upstream",
        [bins["mock"], "--listen", f"127.0.0.1:{mp}", "--workers", w, "--service-ms", s, "--threads", 2, "--finish-abandoned"],
        run_dir / "mock-upstream.log",
    )
    gw = None
    poller = None
    f1 = f2 = None
    try:
        wait_ready(mp, "/healthz", mock, "mock-upstream", 10)
        cfg = run_dir / "gateway.toml"
        cfg.write_text(gateway_config(pp, ap, mp, w, s, variant))
        chk = subprocess.run([str(bins["gateway"]), "check", "-c", str(cfg)], capture_output=True, text=True, timeout=30)
        (run_dir / "gateway-check.txt").write_text(chk.stdout + chk.stderr)
        if chk.returncode != 0:
            raise RunError(f"the generated config fails 'gateway check': {(chk.stdout + chk.stderr).strip()[-400:]}")
        env = dict(os.environ, GATEWAY_LOG="warn")
        gw = procs.start("gateway", [bins["gateway"], "run", "-c", cfg], run_dir / "gateway.log", stop_sig=signal.SIGTERM, stop_wait=6.0, env=env)
        wait_ready(ap, "/readyz", gw, "gateway", 30)

        # The unloaded latency through the gateway: sequential requests.
        h = Http(pp, timeout=5.0)
        lat = []
        try:
            st, _ = h.request("GET", PATH)  # the first opens the upstream connection: not counted
            if st != 200:
                raise RunError(f"a request through the gateway answered {st}")
            for _ in range(unloaded_count(s)):
                t = time.perf_counter()
                st, _ = h.request("GET", PATH)
                lat.append((time.perf_counter() - t) * 1000.0)
                if st != 200:
                    raise RunError(f"an unloaded request through the gateway answered {st}")
        finally:
            h.close()
        (run_dir / "unloaded.json").write_text(json.dumps({"ms": lat, "median_ms": statistics.median(lat)}) + "\n")
        ctl = Http(mp, timeout=2.0)
        ctl.request("POST", "/stats/reset")

        fr_common = [opts.fixedrate, "--url", f"http://127.0.0.1:{pp}{PATH}", "--rate", f"{rate:g}",
                     "--connections", conns, "--timeout", f"{FIXEDRATE_TIMEOUT:g}"]
        base = time.monotonic()
        poller = Poller(ap, mp, base)
        poller.start()
        time.sleep(0.3)  # a few samples before the load
        t_p1 = time.monotonic()
        f1 = procs.start("fixedrate phase 1", fr_common + ["--warmup", f"{warm:g}", "--duration", f"{p1 - warm:g}",
                                                         "--out", run_dir / "phase1.json"],
                         run_dir / "phase1.log", stop_sig=signal.SIGTERM, stop_wait=2.0, die_with_parent=False)
        sleep_until(t_p1 + p1)
        t_p2 = time.monotonic()
        f2 = procs.start("fixedrate phase 2", fr_common + ["--warmup", f"{guard + settle:g}", "--duration", f"{p2 - settle:g}",
                                                         "--out", run_dir / "phase2.json"],
                         run_dir / "phase2.log", stop_sig=signal.SIGTERM, stop_wait=2.0, die_with_parent=False)
        sleep_until(t_p1 + p1 + guard)
        t_half = time.monotonic()
        st, body = ctl.request("POST", f"/control?service_ms={2 * s}")
        ctl.close()
        if st != 200:
            raise RunError(f"POST /control answered {st}: {body[:200]!r}")
        meta["control_response"] = body.decode("utf-8", "replace")
        rc1 = wait_proc(f1, t_p1 + p1 + FIXEDRATE_TIMEOUT + 10)
        rc2 = wait_proc(f2, t_p2 + guard + p2 + FIXEDRATE_TIMEOUT + 10)
        t_end = time.monotonic()
        samples = poller.finish()
        poller = None
        for name, p, rc in (("phase 1", f1, rc1), ("phase 2", f2, rc2)):
            if rc is None:
                procs.stop(p)
                raise RunError(f"fixedrate {name} did not finish in time (killed)")
            procs.stop(p)
            if rc != 0:
                raise RunError(f"fixedrate {name} exited {rc}: {(run_dir / ('phase%s.log' % name[-1])).read_text()[-400:]}")
        f1 = f2 = None
        meta.update({
            "t_phase1_start": t_p1 - base, "t_phase2_start": t_p2 - base, "t_halve": t_half - base,
            "t_end": t_end - base, "samples": len(samples),
        })
        (run_dir / "timeline.json").write_text(json.dumps(samples) + "\n")
        # The final counters, for the record.
        for port, path, name in ((ap, "/metrics", "metrics-end.txt"), (mp, "/stats", "upstream-stats-end.json")):
            try:
                hh = Http(port, 2.0)
                _, body = hh.request("GET", path)
                hh.close()
                (run_dir / name).write_bytes(body)
            except OSError:
                pass
        if gw.poll() is not None:
            raise RunError(f"the gateway exited (status {gw.returncode}) during the run")
        meta["loadavg_after"] = os.getloadavg()
    finally:
        if poller is not None:
            poller.finish()
        for p in (f1, f2):
            if p is not None:
                procs.stop(p)
        if gw is not None:
            rc = procs.stop(gw)
            meta["gateway_exit"] = rc
        meta["mock_exit"] = procs.stop(mock)
        (run_dir / "run.json").write_text(json.dumps(meta, indent=2) + "\n")


# ------------------------------------------------------------------ analysis


def phase_figures(fr: dict, cap: float, unloaded: float, samples: list, lo: float, hi: float) -> dict:
    status = {int(k): v for k, v in fr.get("status", {}).items()}
    sent = fr.get("sent", 0)
    dur = fr.get("duration_s") or (hi - lo)
    ok = sum(v for k, v in status.items() if 200 <= k < 300)
    s503 = status.get(503, 0)
    s429 = status.get(429, 0)
    other5 = {str(k): v for k, v in status.items() if 500 <= k < 600 and k != 503}
    okl = fr.get("ok_latency_ms") or {}

    def okv(k):
        v = okl.get(k)
        return None if v is None or v < 0 else v

    win = [x for x in samples if lo <= x["t"] <= hi]

    def col(k):
        return [x[k] for x in win if x.get(k) is not None]

    served = None
    pts = [(x["t"], x["up_ok"]) for x in win if x.get("up_ok") is not None]
    if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
        served = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    goodput = ok / dur if dur else None
    p50, p99 = okv("p50"), okv("p99")
    errs = fr.get("errors", {})
    return {
        "window_s": [rnd(lo, 2), rnd(hi, 2)],
        "capacity_rps": cap,
        "unloaded_ms": rnd(unloaded, 2),
        "sent": sent,
        "ok": ok,
        "goodput_rps": rnd(goodput),
        "goodput_pct": rnd(100.0 * goodput / cap if goodput is not None else None),
        "upstream_served_rps": rnd(served),
        "status": {str(k): v for k, v in sorted(status.items())},
        "s503": s503,
        "s429": s429,
        "s5xx_other": sum(other5.values()),
        "s5xx_other_by_status": other5,
        "share_503_pct": rnd(100.0 * s503 / sent if sent else None, 2),
        "share_429_pct": rnd(100.0 * s429 / sent if sent else None, 2),
        "errors": sum(errs.values()) if isinstance(errs, dict) else errs,
        "unfinished": fr.get("unfinished", 0),
        "never_sent": fr.get("never_sent", 0),
        "max_send_lag_ms": fr.get("max_send_lag_ms"),
        "ok_p50_ms": rnd(p50, 2),
        "ok_p90_ms": rnd(okv("p90"), 2),
        "ok_p99_ms": rnd(p99, 2),
        "ok_max_ms": rnd(okv("max"), 2),
        "ok_p50_ratio": rnd(p50 / unloaded if p50 is not None and unloaded else None, 2),
        "ok_p99_ratio": rnd(p99 / unloaded if p99 is not None and unloaded else None, 2),
        "all_p99_ms": rnd((fr.get("latency_ms") or {}).get("p99"), 2),
        "samples": len(win),
        "upstream_in_flight_p50": percentile(col("up_in_flight"), 50),
        "upstream_in_flight_p90": percentile(col("up_in_flight"), 90),
        "upstream_waiting_p90": percentile(col("up_waiting"), 90),
        "limit_median": rnd(statistics.median(col("limit")), 1) if col("limit") else None,
        "limit_min": min(col("limit")) if col("limit") else None,
        "limit_max": max(col("limit")) if col("limit") else None,
        "gateway_in_flight_p50": percentile(col("gw_in_flight"), 50),
        "gateway_queued_p90": percentile(col("gw_queued"), 90),
    }


def settle_time(samples: list, t_half: float, lo: float, hi: float):
    """Seconds from the halving until the limit stays within +-25% of its
    median over [lo, hi] (phase 2's measured window); (None, median) when it
    is outside at the end."""
    meas = [x["limit"] for x in samples if lo <= x["t"] <= hi and x.get("limit") is not None]
    if not meas:
        return None, None
    m = statistics.median(meas)
    after = [x for x in samples if t_half <= x["t"] <= hi and x.get("limit") is not None]
    band = SETTLE_BAND * m
    last_out = None
    for i, x in enumerate(after):
        if abs(x["limit"] - m) > band:
            last_out = i
    if last_out is None:
        return 0.0, m
    if last_out == len(after) - 1:
        return None, m
    return after[last_out + 1]["t"] - t_half, m


def gateway_log_summary(path: Path) -> dict:
    """WARN/ERROR lines of the gateway's log (GATEWAY_LOG=warn), by message
    with the addresses and timestamps taken out."""
    kinds: dict[str, int] = {}
    n = 0
    try:
        with open(path, errors="replace") as f:
            for line in f:
                m = re.search(r"\b(WARN|ERROR)\b\s+(.*)", line)
                if not m:
                    continue
                n += 1
                msg = re.sub(r"\d+(\.\d+)*(:\d+)?", "N", m.group(2))[:110]
                kinds[f"{m.group(1)} {msg}"] = kinds.get(f"{m.group(1)} {msg}", 0) + 1
    except OSError:
        pass
    top = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:3])
    return {"lines": n, "top": top}


def analyse(run_dir: Path) -> dict:
    meta = load_json(run_dir / "run.json")
    w, s, variant = meta["workers"], meta["service_ms"], meta["variant"]
    row = {k: meta[k] for k in ("shape", "workers", "service_ms", "variant", "capacity_rps", "offered_rps", "connections")}
    row["adaptive"] = VARIANTS[variant]["adaptive"]
    row["held_to_targets"] = row["adaptive"]
    err = run_dir / "error.txt"
    if err.exists():
        row["error"] = err.read_text().strip()
        return row
    try:
        samples = load_json(run_dir / "timeline.json")
        un = load_json(run_dir / "unloaded.json")
        fr1 = load_json(run_dir / "phase1.json")
        fr2 = load_json(run_dir / "phase2.json")
    except (OSError, ValueError) as e:
        row["error"] = f"raw results missing: {e}"
        return row
    unloaded = un["median_ms"]
    unloaded_after = unloaded + s  # the mock adds S ms; the gateway's own part is unchanged
    t1 = meta["t_phase1_start"]
    th = meta["t_halve"]
    w1 = (t1 + meta["warmup_s"], t1 + meta["phase1_s"])
    w2 = (th + meta["settle_s"], th + meta["phase2_s"])
    before = phase_figures(fr1, meta["capacity_rps"], unloaded, samples, *w1)
    after = phase_figures(fr2, meta["capacity_rps"] / 2, unloaded_after, samples, *w2)
    settle, settle_median = settle_time(samples, th, *w2)
    row.update({
        "unloaded_ms": rnd(unloaded, 2),
        "unloaded_after_ms": rnd(unloaded_after, 2),
        "t_halve_s": rnd(th, 2),
        "before": before,
        "after": after,
        "s5xx_other": before["s5xx_other"] + after["s5xx_other"],
        "errors": before["errors"] + after["errors"],
        "share_503_pct": rnd(100.0 * (before["s503"] + after["s503"]) / max(1, before["sent"] + after["sent"]), 2),
        "share_429_pct": rnd(100.0 * (before["s429"] + after["s429"]) / max(1, before["sent"] + after["sent"]), 2),
        "settle_s": rnd(settle, 1) if row["adaptive"] else None,
        "settle_never": row["adaptive"] and settle is None and settle_median is not None,
        "settle_median_limit": settle_median,
        "samples": len(samples),
        "loadavg": [meta.get("loadavg_before"), meta.get("loadavg_after")],
        "gateway_log": gateway_log_summary(run_dir / "gateway.log"),
    })
    qmax = w * T_QUEUE_FRACTION

    def le(x, bound):
        return x is not None and x <= bound

    checks = {
        "goodput": all(p["goodput_pct"] is not None and p["goodput_pct"] >= T_GOODPUT_PCT for p in (before, after)),
        "queue": all(le(p["upstream_waiting_p90"], qmax) for p in (before, after)),
        "p99": all(le(p["ok_p99_ratio"], T_P99_RATIO) for p in (before, after)),
        "no_5xx": row["s5xx_other"] == 0,
        "settle": le(settle, T_SETTLE_S) if row["adaptive"] else None,
    }
    row["checks"] = checks
    row["passed"] = all(v for v in checks.values() if v is not None)
    return row


# ------------------------------------------------------------------ report


def fmt(x, unit="", nd=None):
    if x is None:
        return "n/a"
    if nd is not None:
        x = round(x, nd)
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x}{unit}"


def failed_list(row) -> list[str]:
    return [k for k, v in row.get("checks", {}).items() if v is False]


COLUMNS = [
    "shape", "variant", "C→C/2 rps", "goodput % before/after", "up in_flight p50/p90 before", "up in_flight p50/p90 after",
    "up waiting p90 before/after", "p50/p99 ÷ unloaded before", "p50/p99 ÷ unloaded after", "5xx≠503",
    "503 %", "429 %", "limit median before/after", "settle s", "verdict",
]


def row_cells(r) -> list[str]:
    shape = f"{r['workers']}w × {r['service_ms']} ms"
    if r.get("error"):
        return [shape, r["variant"], f"{fmt(r['capacity_rps'], nd=1)}→{fmt(r['capacity_rps'] / 2, nd=1)}"] + ["-"] * (len(COLUMNS) - 4) + [
            "ERROR: " + r["error"].splitlines()[0][:80]]
    b, a = r["before"], r["after"]
    if r["adaptive"]:
        settle = "never" if r["settle_never"] else fmt(r["settle_s"])
        limit = f"{fmt(b['limit_median'])}/{fmt(a['limit_median'])}"
    else:
        settle, limit = "-", "no cap"
    fails = failed_list(r)
    if r["held_to_targets"]:
        verdict = "PASS" if not fails else "FAIL: " + ",".join(fails)
    else:
        verdict = "ref" + (" (would fail: " + ",".join(fails) + ")" if fails else " (would pass)")
    return [
        shape,
        r["variant"],
        f"{fmt(r['capacity_rps'], nd=1)}→{fmt(r['capacity_rps'] / 2, nd=1)}",
        f"{fmt(b['goodput_pct'])}/{fmt(a['goodput_pct'])}",
        f"{fmt(b['upstream_in_flight_p50'])}/{fmt(b['upstream_in_flight_p90'])}",
        f"{fmt(a['upstream_in_flight_p50'])}/{fmt(a['upstream_in_flight_p90'])}",
        f"{fmt(b['upstream_waiting_p90'])}/{fmt(a['upstream_waiting_p90'])} (≤{fmt(r['workers'] * T_QUEUE_FRACTION)})",
        f"{fmt(b['ok_p50_ratio'])}/{fmt(b['ok_p99_ratio'])}",
        f"{fmt(a['ok_p50_ratio'])}/{fmt(a['ok_p99_ratio'])}",
        fmt(r["s5xx_other"]),
        fmt(r["share_503_pct"], nd=1),
        fmt(r["share_429_pct"], nd=1),
        limit,
        settle,
        verdict,
    ]


def target_lines(rows) -> list[tuple[str, str]]:
    held = [r for r in rows if r["held_to_targets"] and not r.get("error")]
    errored = [r for r in rows if r.get("error")]
    out = []
    for key, title in TARGETS:
        fails = [f"{r['shape']} {r['variant']}" for r in held if r["checks"].get(key) is False]
        n = sum(1 for r in held if r["checks"].get(key) is not None)
        if not n:
            out.append((title, "n/a (no adaptive rows)"))
            continue
        verdict = "PASS" if not fails else "FAIL"
        line = f"{verdict}: {n - len(fails)}/{n} adaptive rows"
        if fails:
            line += " (failed: " + ", ".join(fails) + ")"
        out.append((title, line))
    if errored:
        out.append(("runs that did not complete", ", ".join(f"{r['shape']} {r['variant']}" for r in errored)))
    return out


def write_md(out: Path, summary: dict) -> None:
    rows = summary["rows"]
    p = summary["params"]
    L = ["# Holdout matrix: in-flight caps on upstreams of many shapes", ""]
    L.append(
        f"Mode `{p['mode']}`. Per shape (W workers at S ms, capacity C = W·1000/S rps) and variant, a fresh "
        f"`mock-upstream --workers W --service-ms S --threads 2 --finish-abandoned` behind a fresh gateway; fixedrate "
        f"offers 2C rps (open loop, latency from the intended send time) for {p['phase1_s']:g} s (the first "
        f"{p['warmup_s']:g} s not measured), then the mock's service time becomes 2S (capacity C/2) and the same load "
        f"runs {p['phase2_s']:g} s more (the first {p['settle_s']:g} s not measured). Variants: `adaptive_q50` / "
        f"`adaptive_q1000`: `max_in_flight = {ADAPTIVE_MAX}`, `queue = {QUEUE}`, `queue_timeout_ms = 50 / 1000`, "
        f"`adaptive = {{ min = 1, max = {ADAPTIVE_MAX} }}`; `rate_limit`: no in-flight cap, a global token bucket of C/s "
        f"(capacity C) on the route."
    )
    L.append("")
    L.append(f"{summary['machine']['cpus']} CPUs, load average at the start {summary['machine']['loadavg_start']}; "
             f"gateway {summary['gateway']['mtime']} (sha256 {summary['gateway']['sha256'][:12]}), commit "
             f"{summary['git']['commit']}{' with local changes' if summary['git']['dirty'] else ''}; "
             f"started {summary['started_at']}.")
    L.append("")
    L += tables.table(COLUMNS, "ll" + "r" * (len(COLUMNS) - 3) + "l", [row_cells(r) for r in rows])
    L.append("")
    L.append("## Targets")
    L.append("")
    L.append("Held for the adaptive variants; the `rate_limit` rows are for comparison (`ref`).")
    L.append("")
    for title, line in target_lines(rows):
        L.append(f"* {title}: **{line}**")
    L.append("")
    L.append("## How to read it")
    L.append("")
    L.append(
        "* goodput: 2xx answered per second over the phase's measured window, as % of the capacity then (C, then C/2).\n"
        "* up in_flight / waiting: the mock's own `/stats`, sampled every 100 ms over the measured window; in_flight "
        "counts the requests it holds (served + waiting for a worker), waiting those without a worker (its queue).\n"
        "* p50/p99 ÷ unloaded: the 2xx latencies (from the intended send time) over the median of sequential "
        "unloaded requests through the gateway measured before the load; after the halving the unloaded latency "
        "is that + S (the mock's extra service time).\n"
        "* 5xx≠503: 5xx answers other than 503 over both measured windows. 503 % / 429 %: the gateway's refusals "
        "(the mock itself never answers 503 in workers mode), as a share of the requests sent in both windows.\n"
        f"* settle: seconds from the halving until the limit stays within ±{SETTLE_BAND * 100:g}% of its median over "
        "phase 2's measured window (`never`: it is still outside at the end).\n"
        "* Per run the raw results are in `runs/<WxS>-<variant>/` (fixedrate's JSON per phase, `timeline.json`, "
        "configs, logs, the final `/metrics`)."
    )
    notes = list(summary.get("notes") or [])
    for r in rows:
        gl = r.get("gateway_log") or {}
        if gl.get("lines"):
            first = next(iter(gl["top"]))
            notes.append(f"`{r['shape']} {r['variant']}`: the gateway logged {gl['lines']} WARN/ERROR line(s), "
                         f"mostly `{first}`")
        for ph in ("before", "after"):
            p = r.get(ph) or {}
            lag = p.get("max_send_lag_ms") or 0
            if lag >= SEND_LAG_NOTED_MS:
                notes.append(f"`{r['shape']} {r['variant']}` {ph}: the load generator fell {lag:.0f} ms behind its "
                             "schedule once: the host stalled (the gateway and the mock run on it too), and the "
                             "row's figures include that stall")
            if p.get("never_sent") or p.get("unfinished"):
                notes.append(f"`{r['shape']} {r['variant']}` {ph}: {p.get('never_sent', 0)} request(s) never sent "
                             f"(every connection busy) and {p.get('unfinished', 0)} unanswered at the end, out of "
                             f"{p.get('sent', 0) + p.get('never_sent', 0)} scheduled; the mock served "
                             f"{fmt(p.get('upstream_served_rps'))} rps meanwhile")
    if notes:
        L.append("")
        L.append("## Notes")
        L.append("")
        for n in notes:
            L.append(f"* {n}")
    L.append("")
    L.append("![matrix](matrix.png)")
    L.append("")
    L.append("![goodput](goodput.png)")
    L.append("")
    (out / "summary.md").write_text("\n".join(L))


def print_table(rows) -> None:
    cells = [COLUMNS] + [row_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    for j, c in enumerate(cells):
        print("  ".join(x.ljust(widths[i]) if i in (0, 1, len(COLUMNS) - 1) else x.rjust(widths[i]) for i, x in enumerate(c)))
        if j == 0:
            print("  ".join("-" * wd for wd in widths))
    for title, line in target_lines(rows):
        print(f"target: {title}: {line}")


def plots(out: Path, rows: list) -> None:
    plt = pyplot()
    import matplotlib.ticker

    shapes = []
    for r in rows:
        if (r["workers"], r["service_ms"]) not in shapes:
            shapes.append((r["workers"], r["service_ms"]))
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    nr, nc = len(shapes), len(variants)
    height = 2.9 * nr + 1.0
    fig, axes = plt.subplots(nr, nc, figsize=(5.2 * nc, height), squeeze=False)
    for i, (w, s) in enumerate(shapes):
        for j, v in enumerate(variants):
            ax = axes[i][j]
            r = next((x for x in rows if x["workers"] == w and x["service_ms"] == s and x["variant"] == v), None)
            title = f"{w}w × {s} ms, {v}"
            if r is None or r.get("error"):
                ax.text(0.5, 0.5, "not run" if r is None else "error", transform=ax.transAxes, ha="center", va="center")
                ax.set_title(title, fontsize=9)
                continue
            tl = r.pop("_timeline", [])
            t = [x["t"] for x in tl]

            def col(k):
                return [x.get(k, float("nan")) if x.get(k) is not None else float("nan") for x in tl]

            ax.plot(t, col("up_in_flight"), color="tab:orange", lw=1.0, label="upstream in_flight")
            ax.plot(t, col("up_waiting"), color="tab:red", lw=0.8, ls=":", label="upstream waiting")
            ax.plot(t, col("gw_in_flight"), color="tab:blue", lw=0.8, alpha=0.8, label="gateway in flight")
            if r["adaptive"]:
                ax.plot(t, col("limit"), color="tab:green", lw=1.5, label="limit")
            ax.axhline(w, color="grey", ls="--", lw=0.8, label=f"workers ({w})")
            ax.axvline(r["t_halve_s"], color="black", ls="--", lw=1)
            b, a = r["before"], r["after"]
            for lo, hi in (b["window_s"], a["window_s"]):
                ax.axvspan(lo, hi, color="grey", alpha=0.08)
            if not r["adaptive"]:
                # Its queue runs to hundreds: a log scale above W.
                ax.set_yscale("symlog", linthresh=w)
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _p: f"{y:g}"))
            ax.set_ylim(bottom=0)
            verdict = "PASS" if r["passed"] else "FAIL"
            if not r["held_to_targets"]:
                verdict = "ref"
            ax.set_title(f"{title}: goodput {fmt(b['goodput_pct'])}%/{fmt(a['goodput_pct'])}%, {verdict}", fontsize=8.5)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=7)
            if i == nr - 1:
                ax.set_xlabel("s since the load started (dashed: halving; shaded: measured)", fontsize=7.5)
    handles, labels = [], []
    for row in axes:
        for ax in row:
            for h, lbl in zip(*ax.get_legend_handles_labels()):
                if not lbl.startswith("workers") and lbl not in labels:
                    handles.append(h)
                    labels.append(lbl)
    handles.append(plt.Line2D([], [], color="grey", ls="--"))
    labels.append("workers")
    fig.suptitle("Holdout matrix: requests held over time; capacity halves at the dashed line",
                 y=1 - 0.12 / height, va="top", fontsize=10)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.4 / height), ncol=len(labels),
               fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    save_png(fig, out / "matrix.png", 75)

    # Goodput bars: before / after, per shape and variant.
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(shapes) * nc / 2 + 1.5) + 2.6, 3.8))
    width = 0.8 / (2 * nc)
    colors = {"adaptive_q50": "tab:green", "adaptive_q1000": "tab:blue", "rate_limit": "tab:grey"}
    for j, v in enumerate(variants):
        for k, ph in enumerate(("before", "after")):
            xs, ys = [], []
            for i, (w, s) in enumerate(shapes):
                r = next((x for x in rows if x["workers"] == w and x["service_ms"] == s and x["variant"] == v), None)
                if r is None or r.get("error"):
                    continue
                xs.append(i - 0.4 + width * (2 * j + k) + width / 2)
                ys.append(r[ph]["goodput_pct"] or 0)
            ax.bar(xs, ys, width, color=colors.get(v, "tab:purple"), alpha=0.55 if k == 0 else 1.0,
                   hatch=None if k == 0 else "//", label=f"{v} {ph}")
    ax.axhline(T_GOODPUT_PCT, color="black", ls="--", lw=0.8, label=f"target {T_GOODPUT_PCT:g}%")
    ax.axhline(100, color="grey", ls=":", lw=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{w}w×{s}ms" for w, s in shapes], fontsize=8)
    ax.set_ylabel("goodput, % of capacity")
    ax.set_title("Goodput before (light) / after (hatched) the halving", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_png(fig, out / "goodput.png", 80)


def git_state() -> dict:
    commit = files.git_commit(ROOT, "unknown")
    try:
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", False
    return {"commit": commit, "dirty": dirty}


def report(out: Path) -> dict:
    params = load_json(out / "params.json")
    rows = []
    for w, s in params["shapes"]:
        for v in params["variants"]:
            d = out / "runs" / f"{shape_key(w, s)}-{v}"
            if not (d / "run.json").exists():
                continue
            r = analyse(d)
            try:
                r["_timeline"] = load_json(d / "timeline.json")
            except (OSError, ValueError):
                r["_timeline"] = []
            rows.append(r)
    summary = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_at": params.get("started_at"),
        "params": {k: params[k] for k in ("mode", "shapes", "variants", "phase1_s", "phase2_s", "warmup_s", "settle_s")},
        "machine": params.get("machine", {}),
        "gateway": params.get("gateway", {}),
        "git": params.get("git", {}),
        "notes": params.get("notes", []),
        "targets": {
            "goodput_pct_min": T_GOODPUT_PCT, "upstream_waiting_p90_max": "workers * 0.25",
            "admitted_p99_ratio_max": T_P99_RATIO, "s5xx_other_max": 0, "settle_s_max": T_SETTLE_S,
            "settle_band": SETTLE_BAND, "held_for": [v for v in VARIANTS if VARIANTS[v]["adaptive"]],
        },
        "rows": [],
    }
    plots(out, rows)  # pops the timelines
    summary["rows"] = rows
    summary["target_lines"] = [{"target": t, "result": l} for t, l in target_lines(rows)]
    held = [r for r in rows if r["held_to_targets"] and not r.get("error")]
    summary["adaptive_all_passed"] = bool(held) and all(r["passed"] for r in held)
    files.write_json(out / "summary.json", summary)
    write_md(out, summary)
    return summary


# ------------------------------------------------------------------ check


ROW_KEYS = ("shape", "variant", "before", "after", "s5xx_other", "share_503_pct", "settle_s", "checks", "passed", "unloaded_ms")
PHASE_KEYS = ("goodput_pct", "upstream_in_flight_p50", "upstream_in_flight_p90", "upstream_waiting_p90", "ok_p50_ratio", "ok_p99_ratio")


def check(out: Path) -> list[str]:
    problems = []
    try:
        s = load_json(out / "summary.json")
        rows = s["rows"]
        expect = len(s["params"]["shapes"]) * len(s["params"]["variants"])
        if len(rows) != expect:
            problems.append(f"summary.json: {len(rows)} rows, expected {expect}")
        for r in rows:
            tag = f"{r.get('shape')} {r.get('variant')}"
            if r.get("error"):
                problems.append(f"summary.json: {tag}: {r['error']}")
                continue
            for k in ROW_KEYS:
                if k not in r:
                    problems.append(f"summary.json: {tag}: {k} missing")
            for ph in ("before", "after"):
                p = r.get(ph, {})
                for k in PHASE_KEYS:
                    if k not in p:
                        problems.append(f"summary.json: {tag}: {ph}.{k} missing")
                    # No 2xx at all (an overloaded reference run): no latency ratios.
                    elif not isinstance(p[k], (int, float)) and not (k.startswith("ok_") and p.get("ok") == 0):
                        problems.append(f"summary.json: {tag}: {ph}.{k} is {p[k]!r}")
                if not p.get("sent", 0) + p.get("never_sent", 0):
                    problems.append(f"summary.json: {tag}: {ph}: no requests scheduled")
                if not p.get("samples"):
                    problems.append(f"summary.json: {tag}: {ph}: no timeline samples")
            if r.get("adaptive") and r.get("after", {}).get("limit_median") is None:
                problems.append(f"summary.json: {tag}: no adaptive limit sampled")
        if "target_lines" not in s:
            problems.append("summary.json: target_lines missing")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"summary.json: {e!r}")
    try:
        md = (out / "summary.md").read_text()
        if tables.row(COLUMNS) not in md or "## Targets" not in md:
            problems.append("summary.md: the table or the targets are missing")
        for _k, title in TARGETS:
            if title not in md:
                problems.append(f"summary.md: no line for target '{title}'")
    except OSError as e:
        problems.append(f"summary.md: {e}")
    return problems + files.png_problems(out, ("matrix.png", "goodput.png"), 2000, "not a PNG", "missing")


# ------------------------------------------------------------------ main


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: WORKERSxSERVICE_MS, e.g. 8x50")
        sh = (int(m.group(1)), int(m.group(2)))
        if sh not in out:
            out.append(sh)
    return out


def parse_variants(text: str) -> list[str]:
    alias = {"q50": "adaptive_q50", "q1000": "adaptive_q1000", "rl": "rate_limit", "rate": "rate_limit"}
    out = []
    for part in text.split(","):
        v = alias.get(part.strip(), part.strip())
        if v not in VARIANTS:
            raise argparse.ArgumentTypeError(f"unknown variant {part!r}: one of {', '.join(VARIANTS)} (or q50, q1000, rl)")
        if v not in out:
            out.append(v)
    return out


def parse_phases(text: str) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("--phase-secs P1,P2, e.g. 8,10")
    return a, b


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cmd_run(a) -> int:
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    pre = PRESETS[mode]
    shapes = a.shapes or pre["shapes"]
    variants = a.variants or list(VARIANTS)
    p1, p2 = a.phase_secs or (pre["phase1"], pre["phase2"])
    warm = a.warmup if a.warmup is not None else min(pre["warmup"], p1 / 2)
    settle = a.settle if a.settle is not None else min(pre["settle"], p2 / 2)
    if not (0 <= warm < p1 and 0 <= settle < p2):
        print("matrix.py: the warm-up must be shorter than phase 1 and the settling than phase 2", file=sys.stderr)
        return 2
    if p1 + p2 > 300:
        print("matrix.py: at most 300 s of load per run", file=sys.stderr)
        return 2
    for b in (GATEWAY, MOCK, a.fixedrate):
        if not Path(b).is_file() or not os.access(b, os.X_OK):
            print(f"matrix.py: {b} is missing (gateway/mock: cargo build --release; fixedrate: loadtest/matrix.sh compiles it)", file=sys.stderr)
            return 1

    stamp = time.strftime("%Y%m%d-%H%M%S")
    if a.out:
        out = Path(a.out)
    elif mode == "smoke":
        for old in RESULTS.glob("matrix-smoke-*"):  # keep the latest smoke run only
            shutil.rmtree(old, ignore_errors=True)
        out = RESULTS / f"matrix-smoke-{stamp}"
    else:
        out = RESULTS / f"matrix-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()

    # The servers are run from a copy, so a rebuild of target/release
    # during the run (someone else's cargo build) cannot mix two builds.
    bindir = out / "bin"
    bindir.mkdir(exist_ok=True)
    bins = {}
    for name, src in (("gateway", GATEWAY), ("mock", MOCK)):
        dst = bindir / src.name
        shutil.copy2(src, dst)
        bins[name] = dst
    gw_info = {"path": str(GATEWAY), "mtime": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(GATEWAY.stat().st_mtime)),
               "sha256": sha256(bins["gateway"])}
    a.phase1, a.phase2, a.warmup, a.settle = p1, p2, warm, settle

    load = os.getloadavg()
    notes = []
    if load[0] > (os.cpu_count() or 1) / 2:
        msg = (f"the machine was already busy at the start (1-min load {load[0]:.2f} on {os.cpu_count()} CPUs): "
               "latencies and goodput are inflated/noisy")
        warn(msg)
        notes.append(msg)
    git = git_state()
    if git["dirty"]:
        notes.append("src/ had uncommitted changes when the run started; the gateway binary's build time is "
                     f"{gw_info['mtime']} (it may or may not include them)")
    params = {
        "mode": mode, "shapes": shapes, "variants": variants, "phase1_s": p1, "phase2_s": p2, "warmup_s": warm,
        "settle_s": settle, "connections": a.connections, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load]},
        "gateway": gw_info, "git": git, "notes": notes, "argv": sys.argv[1:],
    }
    (out / "params.json").write_text(json.dumps(params, indent=2) + "\n")

    runs = [(w, s, v) for (w, s) in shapes for v in variants]
    per_run = 3.0 + p1 + p2 + 1.2 + max(unloaded_count(s) * s for w, s in shapes) / 1000.0
    log(f"holdout matrix, mode {mode}: {len(shapes)} shape(s) x {len(variants)} variant(s) = {len(runs)} runs, "
        f"phases {p1:g} s + {p2:g} s (about {len(runs) * per_run / 60:.1f} min); output {out}")

    procs = Procs()
    ports = Ports()
    failed = 0

    def on_signal(signum, frame):
        # Once: a second signal (Ctrl-C reaches both this process and the
        # wrapper, which passes it on) must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(143)

    # Set explicitly: a background job of a script starts with SIGINT ignored.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    t_start = time.monotonic()
    try:
        for i, (w, s, v) in enumerate(runs, 1):
            tag = f"{shape_key(w, s)}-{v}"
            d = out / "runs" / tag
            c = capacity(w, s)
            log(f"[{i}/{len(runs)}] {w} workers x {s} ms (C {c:g} rps), {v}: offering {2 * c:g} rps, "
                f"capacity halves at ~{p1 + VARIANTS[v]['queue_timeout_ms'] / 1000 + 0.1:.1f} s")
            t = time.monotonic()
            try:
                run_one(w, s, v, a, bins, ports, procs, d)
                (d / "error.txt").unlink(missing_ok=True)
            except (RunError, OSError, subprocess.SubprocessError, ValueError) as e:
                failed += 1
                (d / "error.txt").write_text(f"{e}\n")
                warn(f"[{i}/{len(runs)}] {tag} failed: {e}")
                continue
            r = analyse(d)
            b, af = r["before"], r["after"]
            log(f"[{i}/{len(runs)}] {tag} done in {time.monotonic() - t:.0f} s: goodput {fmt(b['goodput_pct'])}% / "
                f"{fmt(af['goodput_pct'])}%, p99 {fmt(b['ok_p99_ratio'])}x / {fmt(af['ok_p99_ratio'])}x unloaded, "
                f"upstream waiting p90 {fmt(b['upstream_waiting_p90'])} / {fmt(af['upstream_waiting_p90'])}, "
                f"503 {fmt(r['share_503_pct'])}%, 5xx other {r['s5xx_other']}"
                + (f", limit {fmt(b['limit_median'])} -> {fmt(af['limit_median'])}, settle "
                   f"{'never' if r['settle_never'] else fmt(r['settle_s'], ' s')}" if r["adaptive"] else "")
                + (f": {'PASS' if r['passed'] else 'FAIL ' + ','.join(failed_list(r))}" if r["held_to_targets"] else ""))
    except KeyboardInterrupt:
        warn("interrupted: stopping everything started")
        procs.stop_all()
        return 130
    finally:
        procs.stop_all()
        shutil.rmtree(bindir, ignore_errors=True)
    if time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(GATEWAY.stat().st_mtime)) != gw_info["mtime"]:
        warn("target/release/gateway was rebuilt during the run; the runs used the copy taken at the start")

    log(f"all runs done in {(time.monotonic() - t_start) / 60:.1f} min; the report")
    summary = report(out)
    problems = check(out)
    print()
    print_table(summary["rows"])
    print()
    for p in problems:
        print(f"check: {p}")
    log(f"summary: {out / 'summary.md'} ({'outputs ok' if not problems else f'{len(problems)} problem(s)'})")
    return 1 if failed or problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the matrix")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="3 shapes (4x200, 8x50, 32x20), phases 6+8 s: about 3 min")
    g.add_argument("--smoke", action="store_true", help="one shape (8x20), phases 3+4 s: checks the outputs")
    r.add_argument("--shapes", type=parse_shapes, help="WxS,...: workers x service ms, e.g. 4x20,32x200")
    r.add_argument("--variants", type=parse_variants, help=f"some of {','.join(VARIANTS)} (q50,q1000,rl)")
    r.add_argument("--phase-secs", type=parse_phases, help="P1,P2: phase 1 and phase 2 (from the halving), s")
    r.add_argument("--warmup", type=float, help="s of phase 1 not measured (2; smoke 1)")
    r.add_argument("--settle", type=float, help="s of phase 2 not measured (3; smoke 2)")
    r.add_argument("--connections", type=int, help="fixedrate connections (default max(64, 8W) + 320, at most 2000)")
    r.add_argument("--fixedrate", default=str(FIXEDRATE), help="the fixedrate binary")
    r.add_argument("--out", help="output folder (default loadtest/results/matrix-<timestamp>/)")
    for name in ("report", "check"):
        p = sub.add_parser(name)
        p.add_argument("run_dir")
    a = ap.parse_args()
    if a.cmd == "run":
        if a.connections is not None and not 1 <= a.connections <= 2000:
            ap.error("--connections: 1..2000")
        return cmd_run(a)
    out = Path(a.run_dir)
    if a.cmd == "report":
        summary = report(out)
        print_table(summary["rows"])
        return 0
    return files.report_problems(check(out), "check")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
