"""Measuring: CPU from /proc, Redis's INFO, the gateway's /metrics, the load
generators (wrk for max throughput, fixedrate for latency at a fixed rate), a
window's numbers from snapshots before and after, perf, the memory step, and
what the machine was doing."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from common import (ANCHOR, ANCHOR_PIPELINES, CLK_TCK, HERE, MANY_CLIENTS_TARGETS, MEMORY_REDIS_CAPACITY,
                    MEMORY_REDIS_REFILL, OVER_PATH, PATH, REDIS_TARGETS, ROOT, SCRIPT_COMMANDS, SHARES_GAUGE,
                    SHARES_SETTLE_S, SHARES_WAIT_S, TLS_TARGETS, BenchError, key_prefix, log, warn)
from lt.procs import free_ports
from targets import Targets, http_get, start_redis_server, wait_until

# --- /proc and Redis counters -----------------------------------------------------------


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process (all its threads, live or exited)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


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


METRIC_RE = re.compile(r'^(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)$')
PLAIN_METRIC_RE = re.compile(r'^(\w+)\s+([0-9.eE+-]+)$')


def gateway_metrics(admin: str) -> dict:
    """Status counts and failover counters from the gateway's /metrics."""
    status, _, body = http_get(f"http://{admin}/metrics", timeout=5)
    out = {"status": {}, "fallback": {}, "backend": {}, "decided_by": {}, "lease_tokens": {}, "shares": {},
           "rejected_by_tier": {}}
    if status != 200:
        return out
    for line in body.decode(errors="replace").splitlines():
        m = METRIC_RE.match(line.strip())
        if not m:
            # The standing shares' gauges (gateway_shares_usable, gateway_shares_entries) carry no labels.
            pm = PLAIN_METRIC_RE.match(line.strip())
            if pm and pm.group(1).startswith("gateway_shares_"):
                out["shares"][pm.group(1)] = float(pm.group(2))
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
        elif name == "gateway_limiter_decisions_total":
            out["decided_by"][lab.get("path", "?")] = value
        elif name == "gateway_lease_tokens_total":
            out["lease_tokens"][lab.get("event", "?")] = value
        elif name == "gateway_ratelimit_decisions_total" and lab.get("decision") == "rejected":
            # Which tier refused, summed over routes (the crowd's shapes: where the 429s come from).
            tier = lab.get("tier", "?")
            out["rejected_by_tier"][tier] = out["rejected_by_tier"].get(tier, 0) + value
    return out


NET_KEYS = ("total_net_input_bytes", "total_net_output_bytes")


def merge_info(infos: list[dict]) -> dict:
    """Several Redis nodes' INFO as one: CPU and command counters summed."""
    if len(infos) == 1:
        return infos[0]
    cmd: dict = {}
    for i in infos:
        for c, v in i["cmd"].items():
            t = cmd.setdefault(c, {"calls": 0, "usec": 0})
            t["calls"] += v["calls"]
            t["usec"] += v["usec"]
    return {"cmd": cmd, "cpu": sum(i["cpu"] for i in infos),
            **{k: str(sum(int(i.get(k, 0)) for i in infos)) for k in NET_KEYS}}


def delta_counts(a: dict, b: dict) -> dict:
    keys = set(a) | set(b)
    return {k: int(b.get(k, 0) - a.get(k, 0)) for k in sorted(keys) if b.get(k, 0) - a.get(k, 0)}


# --- a window's numbers ----------------------------------------------------------------------


class Meter:
    """Measures the targets a Targets started: one window at a time."""

    def __init__(self, args, out: Path, tools: Path, tg: Targets) -> None:
        self.a = args
        self.out = out
        self.tg = tg
        self.warnings = tg.warnings
        self.fixedrate = tools / "fixedrate"
        self.anchor_bin = tools / "redis_anchor"  # build_anchor(tools) compiles it

    def snapshot(self, target: str) -> dict:
        info = self.tg.t[target]
        s = {"wall": time.monotonic(), "all": all_process_ticks()}
        pids = info["pids"]()
        s["pids"] = pids
        s["proxy"] = sum(cpu_ticks(p) for p in pids)
        s["upstream"] = cpu_ticks(self.tg.mock_proc.pid)
        nodes = self.tg.redis_nodes(target)
        if nodes:
            infos = [r.info() for r in nodes]
            s["redis"] = merge_info(infos)
            if len(infos) > 1:
                s["redis_nodes"] = infos
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
        ours = set(self.tg.our_pids) | set(b["pids"]) | set(e["pids"]) | {os.getpid()}
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
            # Bytes on the wire to and from Redis (clients, not the cluster bus).
            r["redis_net_bytes_per_req"] = sum(int(re_.get(k, 0)) - int(rb.get(k, 0)) for k in NET_KEYS) / n
        if "redis_nodes" in b:
            # Each node's share: a hot key (one bucket every request touches)
            # loads one node more than the others.
            r["redis_nodes_cpu_us_per_req"] = [(y["cpu"] - x["cpu"]) * 1e6 / n
                                               for x, y in zip(b["redis_nodes"], e["redis_nodes"])]
            r["redis_nodes_script_calls_per_req"] = [
                sum(y["cmd"].get(c, {"calls": 0})["calls"] - x["cmd"].get(c, {"calls": 0})["calls"]
                    for c in SCRIPT_COMMANDS) / n
                for x, y in zip(b["redis_nodes"], e["redis_nodes"])]
        if "metrics" in b:
            mb, me = b["metrics"], e["metrics"]
            r["gateway_status"] = delta_counts(mb["status"], me["status"])
            # How the limiter decided the window's requests (a binary from
            # before leases counts none: no share is reported).
            paths = delta_counts(mb.get("decided_by", {}), me.get("decided_by", {}))
            if sum(paths.values()) > 0:
                r["lease_share"] = paths.get("lease", 0) / sum(paths.values())
                # Requests whose every tier a standing share decided (no Redis call).
                r["share_decided"] = paths.get("share", 0) / sum(paths.values())
                # Every path's share (share, lease, redis, denied_cache, ...): where Redis calls come from.
                r["decided_by_share"] = {k: v / sum(paths.values()) for k, v in paths.items()}
            refused = delta_counts(mb.get("rejected_by_tier", {}), me.get("rejected_by_tier", {}))
            if refused:
                r["rejected_by_tier"] = {k: v / n for k, v in refused.items()}
            gauges = me.get("shares", {})
            if "gateway_shares_entries" in gauges:
                r["shares_entries"] = gauges["gateway_shares_entries"]
            if target in self.tg.shares and gauges.get(SHARES_GAUGE) != 1:
                warn(f"{target}: {SHARES_GAUGE} is {gauges.get(SHARES_GAUGE, 'absent')} at the end of the window "
                     "(its shares were not in use)", self.warnings)
            # Tokens leased, given back and lost (expired unreturned) per request.
            lt = delta_counts(mb.get("lease_tokens", {}), me.get("lease_tokens", {}))
            if lt:
                r["lease_tokens_per_req"] = {k: v / n for k, v in lt.items()}
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

    def many_clients(self, target: str) -> bool:
        """Whether the target is sent --clients N clients (wrk-clients.lua) rather than one."""
        return bool(self.a.clients) and target in MANY_CLIENTS_TARGETS

    def wrk_argv(self, target: str, secs: float, json_path: Path | None) -> tuple[list[str], dict]:
        info = self.tg.t[target]
        many = self.many_clients(target)
        script = HERE / ("wrk-clients.lua" if many else "wrk-summary.lua")
        argv = ["wrk", "-t", str(self.a.wrk_threads), "-c", str(self.a.connections), "-d", f"{secs:g}s",
                "--timeout", "5s", "-s", str(script)]
        for k, v in info["headers"].items():
            argv += ["-H", f"{k}: {v}"]
        argv.append(info["url"])
        env = dict(os.environ, WRK_JSON=str(json_path) if json_path else "/dev/null")
        if many:
            env.update(WRK_SUMMARY_LUA=str(HERE / "wrk-summary.lua"), CLIENTS_N=str(self.a.clients),
                       CLIENTS_ZIPF=f"{self.a.zipf:g}", CLIENTS_OVER_PCT=f"{self.a.over:g}", CLIENTS_PATH=PATH,
                       CLIENTS_OVER_PATH=OVER_PATH)
        return argv, env

    def redis_idle(self, target: str) -> float | None:
        """Redis's CPU per second with the target up and no traffic (summed
        over a cluster's nodes): its own housekeeping (serverCron at `hz`,
        the cluster bus) and the gateway's heartbeats, spent whatever the
        load. Measured before the warm-up, so no lease is outstanding."""
        nodes = self.tg.redis_nodes(target)
        if not nodes or self.a.redis_idle <= 0:
            return None
        t0, c0 = time.monotonic(), sum(r.info()["cpu"] for r in nodes)
        time.sleep(self.a.redis_idle)
        t1, c1 = time.monotonic(), sum(r.info()["cpu"] for r in nodes)
        return (c1 - c0) / (t1 - t0)

    def throughput(self, target: str, tag: str) -> dict:
        a = self.a
        idle = self.redis_idle(target)
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
        if idle is not None and "redis_cpu_us_per_req" in r:
            # What the requests cost Redis: the window's CPU less what Redis
            # spends idle over as long.
            r["redis_idle_cpu_ms_per_s"] = idle * 1e3
            r["redis_cpu_us_per_req_above_idle"] = max(
                0.0, r["redis_cpu_us_per_req"] - idle * (e["wall"] - b["wall"]) * 1e6 / max(w["requests"], 1))
        if self.many_clients(target):
            r["clients"] = self.a.clients
        self.check_statuses(target, "wrk", r, w)
        if self.tg.redis_nodes(target) and target in REDIS_TARGETS:
            r["redis_memory"] = self.redis_memory(target)
        return r

    def anchor(self, tag: str) -> dict:
        """The standing shares' anchor for one round: redis_anchor.c drives the anchor's own
        redis-server the way envoyproxy/ratelimit does (per request, three
        descriptors, each INCRBY + EXPIRE 60), from --clients N Zipf clients
        (as wrk-clients.lua draws them), one window of --duration seconds per
        requests-per-pipeline setting (ANCHOR_PIPELINES), each after a warm-up.
        Redis's CPU per request is INFO cpu's delta over the window's requests;
        its idle CPU (no client) is measured first, as for the gateways."""
        a, r = self.a, self.tg.anchor
        idle = self.redis_idle(ANCHOR)
        res: dict = {"redis_idle_cpu_ms_per_s": idle * 1e3 if idle is not None else None, "pipelines": {}}
        for i, p in enumerate(ANCHOR_PIPELINES):
            argv = [str(self.anchor_bin), "--port", str(r.port), "--pipeline", str(p),
                    "--connections", str(a.anchor_connections), "--clients", str(a.clients), "--zipf", f"{a.zipf:g}",
                    "--over", f"{a.over:g}"]
            if a.warmup > 0:
                rc, _, _ = self.loadgen(argv + ["--duration", f"{a.warmup:g}", "--seed", str(2 * i + 1)],
                                        a.warmup + 30)
                if rc != 0:
                    raise BenchError(f"redis_anchor (warm-up, {p} per pipeline) failed (exit {rc}); "
                                     "see logs/loadgen.stderr")
            jp = self.out / "raw" / f"{tag}-{ANCHOR}-p{p}.json"
            b_all, b_info, b_wall = all_process_ticks(), r.info(), time.monotonic()
            rc, lg_ticks, _ = self.loadgen(argv + ["--duration", f"{a.duration:g}", "--seed", str(2 * i + 2),
                                                   "--out", str(jp)], a.duration + 30)
            e_info, e_wall, e_all = r.info(), time.monotonic(), all_process_ticks()
            if rc != 0 or not jp.exists():
                raise BenchError(f"redis_anchor ({p} per pipeline) failed (exit {rc}); see logs/loadgen.stderr")
            w = json.loads(jp.read_text())
            n = max(w["requests"], 1)
            wall = e_wall - b_wall
            calls = {}
            for c in set(b_info["cmd"]) | set(e_info["cmd"]):
                d = e_info["cmd"].get(c, {"calls": 0})["calls"] - b_info["cmd"].get(c, {"calls": 0})["calls"]
                if d and c != "info":
                    calls[c] = d
            cpu = e_info["cpu"] - b_info["cpu"]
            ours = set(self.tg.our_pids) | {os.getpid()}
            foreign = sum(t - b_all.get(q, 0) for q, t in e_all.items() if q not in ours)
            res["pipelines"][str(p)] = {
                "requests_per_pipeline": p, "rps": w["rps"], "requests": w["requests"], "secs": w["seconds"],
                "connections": w["connections"], "errors": w["errors"],
                "redis_cpu_us_per_req": cpu * 1e6 / n,
                "redis_cpu_us_per_req_above_idle": max(0.0, cpu * 1e6 / n - idle * wall * 1e6 / n)
                if idle is not None else None,
                "redis_cpu_cores": cpu / wall,
                "redis_commands_per_req": {c: round(v / n, 4) for c, v in sorted(calls.items())},
                "redis_net_bytes_per_req": sum(int(e_info.get(k, 0)) - int(b_info.get(k, 0)) for k in NET_KEYS) / n,
                "keys": sum(int(m.group(1)) for m in re.finditer(r"keys=(\d+)", " ".join(
                    v for k, v in e_info.items() if isinstance(v, str) and k.startswith("db")))),
                "loadgen_cpu_cores": lg_ticks / CLK_TCK / wall,
                "other_cpu_pct": round(100.0 * max(foreign, 0) / CLK_TCK / wall, 1),
            }
        return res

    def redis_memory(self, target: str, samples: int = 100) -> dict:
        """Bytes per bucket in Redis, right after a window (token buckets expire
        once full, so later most would be gone): MEMORY USAGE of up to
        `samples` random keys of the target's, and, with many keys, the growth
        of used_memory since the server started over the keys it holds now."""
        prefix = f"{key_prefix(target)}:"
        keys = used = 0
        sizes: list[int] = []
        for r in self.tg.redis_nodes(target):
            info = r.info()
            used += int(info.get("used_memory", 0)) - self.tg.used_memory_start.get(r.port, 0)
            keys += sum(int(m.group(1)) for m in re.finditer(r"keys=(\d+)", " ".join(
                v for k, v in info.items() if isinstance(v, str) and k.startswith("db"))))
            names = [k for k in r.pipe(["RANDOMKEY"] * samples) if k.startswith(prefix) and "replicas" not in k]
            names = sorted(set(names))
            if names:
                sizes += [int(x) for x in r.pipe([f"MEMORY USAGE {k} SAMPLES 0" for k in names]) if x.isdigit()]
        return {"keys": keys, "sampled": len(sizes),
                "memory_usage_bytes_per_key": round(sum(sizes) / len(sizes), 1) if sizes else None,
                "used_memory_growth_per_key": round(used / keys, 1) if keys >= 1000 else None}

    def fixedrate_argv(self, target: str, rate: float, connections: int, out: Path) -> list[str]:
        """fixedrate against `target` for one latency window, its JSON to `out`."""
        a, info = self.a, self.tg.t[target]
        argv = [str(self.fixedrate), "--url", info["url"], "--rate", f"{rate:.0f}",
                "--duration", f"{a.latency_duration:g}", "--warmup", f"{a.warmup:g}",
                "--connections", str(connections), "--timeout", "5", "--out", str(out)]
        for k, v in info["headers"].items():
            argv += ["--header", f"{k}: {v}"]
        return argv

    def fixed_rate(self, target: str, tag: str, rate: float) -> dict:
        a = self.a
        jp = self.out / "raw" / f"{tag}-{target}-fixedrate.json"
        argv = self.fixedrate_argv(target, rate, a.connections, jp)
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

    def paired_latency(self, pair: list[str], tag: str, rate: float) -> dict:
        """Both targets of `pair` driven at once, each at half the fixed rate
        (so the machine carries what one fixed-rate window does): whatever
        else the machine is doing lands on both alike, which sequential
        windows cannot promise. Each target's latencies are kept whole
        (`--samples`) so the rounds pool into one distribution."""
        a = self.a
        procs, files = [], {}
        errf = open(self.out / "logs" / "loadgen.stderr", "ab")
        try:
            for t in pair:
                jp = self.out / "raw" / f"{tag}-{t}-paired.json"
                sp = self.out / "raw" / f"{tag}-{t}-paired.lat"
                argv = self.fixedrate_argv(t, rate / 2, max(1, a.connections // 2), jp) + ["--samples", str(sp)]
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errf))
                files[t] = (jp, sp)
            deadline = time.monotonic() + a.latency_duration + a.warmup + 30
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            for p in procs:  # interrupted or timed out: stop ours, by PID
                if p.poll() is None:
                    p.kill()
                    p.wait()
            raise
        finally:
            errf.close()
        out = {}
        for t, p in zip(pair, procs):
            jp, sp = files[t]
            if p.returncode != 0 or not jp.exists():
                raise BenchError(f"fixedrate failed against {t} (exit {p.returncode}); see logs/loadgen.stderr")
            f = json.loads(jp.read_text())
            lat = f["latency_ms"]
            r = {"rate": rate / 2, "rate_achieved": f["rate_achieved"], "p50_ms": lat["p50"],
                 "p99_ms": lat["p99"], "p999_ms": lat["p999"], "samples": str(sp)}
            self.check_statuses(t, "fixedrate", r, f)
            out[t] = r
        return out

    def check_statuses(self, target: str, tool: str, r: dict, raw: dict) -> None:
        want = "429" if target == "gateway_redis_denied" else "200"
        odd = []
        # --clients: the clients over their limit are answered 429, by design.
        mixed = tool == "wrk" and self.many_clients(target)
        full = r.get("gateway_status")
        if mixed and full is not None:
            served = sum(v for k, v in full.items() if k in ("200", "429"))
            r["share_429"] = round(full.get("429", 0) / served, 4) if served else None
            r["gateway_status"] = {k: v for k, v in full.items() if k != "429"}
        if tool == "wrk":
            errs = dict(raw["errors"])
            non2xx = errs.pop("status", 0)
            if want == "200" and non2xx and not mixed:
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
        if mixed and full is not None:
            r["gateway_status"] = full
        for o in odd:
            warn(f"{target}: {o}", self.warnings)
        if odd:
            r["odd"] = odd

    def perf(self, targets: list[str]) -> dict:
        """perf record -g during one extra max-throughput window per target: on
        the proxy, and on a Redis target's Redis servers (summed over a
        cluster's nodes) in a second report."""
        res = {}
        secs = min(self.a.duration, 10)
        for t in targets:
            profiles = {t: self.tg.t[t]["pids"]()}
            redis = self.tg.redis_pids(t)
            if redis:
                profiles[f"{t}-redis"] = redis
            log(f"perf: {', '.join(profiles)} for {secs:g}s (an extra window; its numbers are not used)")
            recs = [subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", str(self.out / f"perf-{name}.data"),
                                      "-p", ",".join(map(str, pids)), "--", "sleep", f"{secs + 1:g}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for name, pids in profiles.items()]
            try:
                time.sleep(0.5)
                argv, env = self.wrk_argv(t, secs, None)
                self.loadgen(argv, secs + 30, env)
                for rec in recs:
                    rec.wait(timeout=secs + 30)
            except BaseException:
                for rec in recs:
                    if rec.poll() is None:
                        rec.send_signal(signal.SIGINT)
                        rec.wait()
                raise
            for name in profiles:
                txt = self.out / f"perf-{name}.txt"
                with open(txt, "w") as f:
                    subprocess.run(["perf", "report", "-i", str(self.out / f"perf-{name}.data"), "--stdio",
                                    "--no-children", "-g", "none", "--sort", "dso,symbol", "--percent-limit", "0.5"],
                                   stdout=f, stderr=subprocess.DEVNULL)
                res[name] = str(txt.relative_to(self.out))
        return res

    def memory(self, variant: str = "local") -> dict:
        """The memory step: a gateway sent --memory-clients distinct clients
        (wrk-xff.lua), its VmRSS before, at the cap (local_max_entries) and
        after. `variant` "local": the local backend (gateway.memory.toml, one
        ip-tier bucket per client). "redis" (standing shares): the Redis backend with
        [limiter.shares] (gateway.memory-redis.toml) on a fresh redis-server of
        its own, the ip tier big enough to be cut, measured once
        gateway_shares_usable is 1 (and SHARES_SETTLE_S more); adds the share
        entries (gateway_shares_entries) along the way and at the end, and
        Redis's keys (DBSIZE) and used_memory."""
        a = self.a
        redis_variant = variant == "redis"
        name = "memory-redis-gateway" if redis_variant else "memory-gateway"
        tag = "memory (Redis, shares)" if redis_variant else "memory"
        logs = self.out / "logs"
        port, admin_port, redis_port = free_ports(3)
        subs = dict(THREADS=a.threads, LISTEN_ADDR=f"127.0.0.1:{port}", ADMIN_ADDR=f"127.0.0.1:{admin_port}",
                    UPSTREAM_ADDR=f"127.0.0.1:{self.tg.mock_port}", MAX_ENTRIES=a.memory_max_entries)
        redis = None
        used0 = 0
        if redis_variant:
            # A fresh redis-server of its own, as the Redis targets' (stopped by PID at the end).
            redis = start_redis_server(self.tg.procs, "redis-memory", redis_port, logs / "redis-memory.log")
            used0 = int(redis.info().get("used_memory", 0))
            cfg = self.out / "config" / "memory-redis.toml"
            self.tg.render("gateway.memory-redis.toml", cfg, **subs, REDIS_PORT=redis_port,
                           CLIENT_CAPACITY=MEMORY_REDIS_CAPACITY, CLIENT_REFILL=MEMORY_REDIS_REFILL)
        else:
            cfg = self.out / "config" / "memory.toml"
            self.tg.render("gateway.memory.toml", cfg, **subs)
        chk = subprocess.run([str(self.tg.gateway), "check", "-c", str(cfg)], capture_output=True, text=True)
        (logs / f"{name}-check.txt").write_text(chk.stdout + chk.stderr)
        if chk.returncode != 0:
            raise BenchError(f"gateway check -c {cfg} failed:\n{chk.stdout}{chk.stderr}")
        gl = logs / f"{name}.log"
        p = self.tg.procs.start(name, [str(self.tg.gateway), "run", "-c", str(cfg)], gl,
                                signal.SIGINT, env=dict(os.environ, GATEWAY_LOG="warn"))
        admin = f"127.0.0.1:{admin_port}"
        url = f"http://127.0.0.1:{port}/"
        want = "redis" if redis_variant else "local"

        def ready() -> bool:
            st, _, body = http_get(f"http://{admin}/readyz")
            return st == 200 and json.loads(body).get("backend", want) == want

        wait_until(f"{tag} gateway (/readyz backend {want})", ready, 30, p, gl)
        shares_usable_after = None
        if redis_variant:
            t0 = time.monotonic()
            last = None
            while time.monotonic() - t0 < SHARES_WAIT_S:
                if p.poll() is not None:
                    break
                try:
                    last = gateway_metrics(admin)["shares"].get(SHARES_GAUGE)
                except Exception:  # noqa: BLE001 (a slow /metrics: ask again)
                    last = None
                if last == 1:
                    break
                time.sleep(0.2)
            if last != 1:
                self.tg.procs.stop_one(p)
                self.tg.procs.stop_one(redis.proc)
                why = (f"its /metrics did not show {SHARES_GAUGE} 1 within {SHARES_WAIT_S:g} s "
                       f"(last seen: {last}; config/memory-redis.toml, logs/{name}.log)")
                warn(f"{tag}: FAILED, not measured: {why}", self.warnings)
                return {"variant": "redis", "failed": why, "local_max_entries": a.memory_max_entries}
            shares_usable_after = round(time.monotonic() - t0, 1)
            log(f"{tag}: {SHARES_GAUGE} 1 after {shares_usable_after} s; {SHARES_SETTLE_S:g} s more for the "
                "shares to fill")
            time.sleep(SHARES_SETTLE_S)
        for i in range(20):
            http_get(url, {"X-Forwarded-For": f"198.51.100.{i + 1}"})
        time.sleep(0.5)
        rss0 = proc_status_kb(p.pid, "VmRSS")
        total = a.memory_clients
        m0 = gateway_metrics(admin)
        base = int(sum(m0["status"].values()))

        def dbsize() -> int | None:
            try:
                return int(redis.cmd("DBSIZE").strip())
            except (BenchError, ValueError, subprocess.TimeoutExpired):
                return None

        log(f"{tag}: RSS {rss0 / 1024:.1f} MiB before; {total:,} distinct clients (X-Forwarded-For) next, "
            f"local_max_entries = {a.memory_max_entries:,}")
        env = dict(os.environ, XFF_CLIENTS="4194304", XFF_THREADS=str(a.wrk_threads), XFF_PATH="/")
        errf = open(logs / f"{name.replace('-gateway', '')}-wrk.txt", "wb")
        w = subprocess.Popen(["wrk", "-t", str(a.wrk_threads), "-c", str(a.connections), "-d", f"{a.memory_timeout}s",
                              "--timeout", "5s", "-s", str(HERE / "wrk-xff.lua"), url],
                             stdout=errf, stderr=subprocess.STDOUT, env=env)
        errf.close()
        # (clients, RSS kB, share entries, Redis keys): the last two for the Redis variant only.
        curve = [(0, rss0, m0["shares"].get("gateway_shares_entries") if redis_variant else None,
                  dbsize() if redis_variant else None)]
        t0 = time.monotonic()
        last_print = 0.0
        n = 0
        try:
            while w.poll() is None:
                time.sleep(1.0)
                m = gateway_metrics(admin)
                n = int(sum(m["status"].values())) - base
                rss = proc_status_kb(p.pid, "VmRSS")
                ent = m["shares"].get("gateway_shares_entries") if redis_variant else None
                keys = dbsize() if redis_variant else None
                curve.append((n, rss, ent, keys))
                el = time.monotonic() - t0
                if el - last_print >= 5 or n >= total:
                    last_print = el
                    log(f"{tag}: {n:,}/{total:,} clients, {n / el:,.0f} rps, RSS {rss / 1024:.1f} MiB"
                        + (f", {ent:,.0f} share entries, {keys:,} Redis keys" if redis_variant and ent is not None
                           and keys is not None else ""))
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
        # The share gauge is set on each heartbeat (every second): two, so the
        # end's figure counts every request sent.
        time.sleep(2.2 if redis_variant else 1.0)
        m1 = gateway_metrics(admin)
        n = int(sum(m1["status"].values())) - base
        rss1 = proc_status_kb(p.pid, "VmRSS")
        hwm = proc_status_kb(p.pid, "VmHWM")
        statuses = {k: int(v) for k, v in m1["status"].items()}
        entries1 = m1["shares"].get("gateway_shares_entries") if redis_variant else None
        keys1 = dbsize() if redis_variant else None
        curve.append((n, rss1, entries1, keys1))
        alive = p.poll() is None
        self.tg.procs.stop_one(p)
        redis_end = None
        if redis_variant:
            info = redis.info()
            used1 = int(info.get("used_memory", 0))
            ks = [k for _, _, _, k in curve if k is not None]
            redis_end = {
                "keys": keys1,
                "keys_max": max(ks) if ks else None,
                "used_memory_mib": round(used1 / 1048576, 1),
                "used_memory_start_mib": round(used0 / 1048576, 1),
                "used_memory_growth_mib": round((used1 - used0) / 1048576, 1),
                "used_memory_rss_mib": round(int(info.get("used_memory_rss", 0)) / 1048576, 1),
                "bytes_per_key": round((used1 - used0) / keys1) if keys1 and keys1 >= 1000 else None,
                "expired_keys": int(info.get("expired_keys", 0)),
                "evicted_keys": int(info.get("evicted_keys", 0)),
                "script_calls": sum(v["calls"] for c, v in info["cmd"].items() if c in SCRIPT_COMMANDS),
            }
            self.tg.procs.stop_one(redis.proc)
        if n < total:
            warn(f"{tag}: only {n:,} of {total:,} clients were served within {a.memory_timeout}s", self.warnings)
        if not alive:
            warn(f"{tag}: the gateway died during the memory step", self.warnings)
        if redis_variant:
            # At the cap: the sample with the most share entries, the table at
            # its fullest. Clients sent past it are no measure: a shard that is
            # full drops its full shares (a bucket refilling 1,000,000/s is full
            # again within microseconds: nearly all of them), so the entries
            # fall while the hash tables keep their capacity.
            withe = [(k, rss, ent) for k, rss, ent, _ in curve if ent is not None]
            at_cap_point = max(withe, key=lambda x: x[2]) if withe else None
        else:
            at_cap_point = next(((k, rss, ent) for k, rss, ent, _ in curve if k >= a.memory_max_entries), None)
        at_cap_clients, at_cap, at_cap_entries = at_cap_point if at_cap_point else (None, None, None)
        res = {
            "variant": variant,
            "backend": want,
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
            "rss_curve": [{"clients": k, "rss_mib": round(v / 1024, 1),
                           **({"shares_entries": ent, "redis_keys": keys} if redis_variant else {})}
                          for k, v, ent, keys in curve],
        }
        if redis_variant:
            ents = [e for _, _, e, _ in curve if e is not None]
            decided = delta_counts(m0.get("decided_by", {}), m1.get("decided_by", {}))
            fb = delta_counts(m0["fallback"], m1["fallback"])
            after_peak = [(k, e) for k, _, e, _ in curve if e is not None and at_cap_clients is not None
                          and k > at_cap_clients]
            low = min(after_peak, key=lambda x: x[1]) if after_peak else None
            res.update({
                "at_cap_basis": "the sample with the most share entries (gateway_shares_entries), the table at its "
                                "fullest",
                "entries_after_sweep": {"clients": low[0], "shares_entries": low[1]} if low else None,
                "section": "[limiter.shares] enabled = true (fraction: the default)",
                "ip_tier": {"capacity": MEMORY_REDIS_CAPACITY, "refill_per_sec": MEMORY_REDIS_REFILL},
                "shares_usable_after_s": shares_usable_after,
                "settle_s": SHARES_SETTLE_S,
                "shares_entries": entries1,
                "shares_entries_max": max(ents) if ents else None,
                "shares_entries_at_cap": at_cap_entries,
                # Bytes per client: RSS at the cap less before, over the share
                # entries held then (bytes_per_entry: over the clients sent by
                # then, as the local variant's).
                "bytes_per_share_entry": round((at_cap - rss0) * 1024 / at_cap_entries)
                if at_cap and at_cap_entries else None,
                "bytes_per_share_entry_end": round((rss1 - rss0) * 1024 / entries1) if entries1 else None,
                "decided_by": decided,
                "fallback_transitions": fb,
                "backend_at_end": m1["backend"],
                "redis": redis_end,
            })
            if fb:
                warn(f"{tag}: the limiter failed over during the step: {fb}", self.warnings)
            if entries1 is not None and entries1 > a.memory_max_entries:
                warn(f"{tag}: {entries1:,.0f} share entries at the end, over local_max_entries "
                     f"({a.memory_max_entries:,})", self.warnings)
        log(f"{tag}: {n:,} clients: RSS {res['rss_before_mib']} -> {res['rss_after_mib']} MiB "
            f"(at the cap: {res['rss_at_cap_mib']} MiB; peak {res['hwm_mib']} MiB)"
            + (f"; {entries1:,.0f} share entries at the end (at most {res['shares_entries_max']:,.0f}); Redis "
               f"{redis_end['keys']} keys, used_memory {redis_end['used_memory_mib']} MiB"
               if redis_variant and entries1 is not None else ""))
        return res


def build_anchor(tools: Path) -> Path:
    """redis_anchor.c compiled into `tools` when missing or older than its
    source (as loadtest/lib.sh compiles fixedrate.c)."""
    src, exe = HERE / "redis_anchor.c", tools / "redis_anchor"
    if not exe.exists() or src.stat().st_mtime > exe.stat().st_mtime:
        log("compiling loadtest/bench/redis_anchor.c")
        tools.mkdir(parents=True, exist_ok=True)
        tmp = tools / "redis_anchor.tmp"
        out = subprocess.run(["cc", "-O2", "-Wall", "-o", str(tmp), str(src), "-lm"], capture_output=True, text=True)
        if out.returncode != 0:
            raise BenchError(f"cc redis_anchor.c failed:\n{out.stderr}")
        tmp.replace(exe)
    return exe


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


def pool_paired(pair: list[str], windows: list[dict]) -> dict:
    """The paired windows' latencies pooled per target (one distribution
    each, from every window), and p99 added = the second's p99 less the
    first's; each window's own difference is kept for the spread."""
    from array import array

    def pct(v, p):
        return v[min(len(v) - 1, int(p / 100 * len(v)))] / 1e6 if v else None

    out: dict = {"pair": pair, "windows": len(windows), "rate_each": windows[0][pair[0]]["rate"] if windows else None}
    for t in pair:
        v = array("q")
        for w in windows:
            with open(w[t]["samples"], "rb") as f:
                v.frombytes(f.read())
        v = sorted(v)
        out[t] = {"samples": len(v), "p50_ms": pct(v, 50), "p90_ms": pct(v, 90), "p99_ms": pct(v, 99),
                  "p999_ms": pct(v, 99.9)}
    a, b = pair
    if out[a]["p99_ms"] is not None and out[b]["p99_ms"] is not None:
        out["p99_added_ms"] = out[b]["p99_ms"] - out[a]["p99_ms"]
        out["p50_added_ms"] = out[b]["p50_ms"] - out[a]["p50_ms"]
    out["p99_added_ms_windows"] = [round(w[b]["p99_ms"] - w[a]["p99_ms"], 4) for w in windows]
    return out
