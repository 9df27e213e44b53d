#!/usr/bin/env python3
"""The fast-path benchmark behind loadtest/bench.sh (run that, not this).

    bench.py run [options]          the benchmark: see loadtest/bench.sh --help
    bench.py report RUN_DIR         (re)write summary.md and chart.png from summary.json
    bench.py publish RUN_DIR        copy a run's table and chart into docs/benchmarks.md
    bench.py publish-cluster RUN_DIR...  runs with gateway_redis_cluster into its section

Every server it needs is started here, on 127.0.0.1 and free ports, and
stopped by PID on exit: a Redis, the mock upstream, nginx (Debian's, in the
foreground), the bare Pingora proxy and one gateway per gateway target. Load
goes to 127.0.0.1 only, for bounded times.

Targets, side by side (see docs/benchmarks.md):
    direct                the load generator against the upstream itself
    nginx_limit_req       nginx proxy_pass + limit_req keyed by client address
    pingora_bare          Pingora alone: examples/bare_proxy.rs, default settings
    gateway_off           the gateway with no limiter work at all
    gateway_local         all three tiers on the local backend
    gateway_local_notop   gateway_local with [admin] top = false (no top-K of refused
                          clients); with --clients N --over P, what the top-K costs
    gateway_traced_001    gateway_local with [tracing] at sample_ratio 0.01, spans to an
                          OTLP/HTTP sink of the run's own (otlp_sink.py)
    gateway_traced_1      the same at 1.0: every request traced and exported
    gateway_traced_down   the same at 1.0 with its collector down (a port nothing
                          listens on): every batch fails, every span dropped
    gateway_jwt           gateway_local with the client named by a verified RS256 JWT
                          ([auth.jwt], a key file) instead of an API key: one hot client
    gateway_key_padded    gateway_local with a header the token's length beside its key:
                          the token's bytes without the JWT work (context for gateway_jwt)
    gateway_redis         all three tiers on Redis, admitting everything, with
                          [limiter.shares] enabled = true (standing shares)
    gateway_redis_unshared gateway_redis with shares off: the before (with --clients,
                          or named in --targets)
    gateway_redis_cluster the same as gateway_redis on a Redis Cluster of three masters
    gateway_redis_denied  one client over its route limit, flooding: all 429
    gateway_tls           gateway_off on its [server.tls] listener (HTTP/1.1, keep-alive)
    nginx_tls             nginx_limit_req with `listen ssl`, the same certificate
    redis_anchor          the standing shares' anchor: its own redis-server driven the way
                          envoyproxy/ratelimit does (redis_anchor.c: INCRBY + EXPIRE
                          per descriptor, three per request, 16 or 1 requests per
                          pipeline) from the same Zipf clients; needs --clients

The TLS pair shares one ECDSA P-256 certificate signed by a CA, both made per
run with the openssl CLI into RUN_DIR/tls/; TLS 1.2 and 1.3 on both sides,
each with its default ciphers (the ones negotiated are recorded).

Per target and round: max throughput (wrk, fixed connections) with the CPU
the proxy's processes spent per request (/proc/PID/stat utime+stime; nginx:
master + workers), and p50/p99 latency at a fixed rate of half gateway_off's
median maximum, measured from each request's intended send time (fixedrate.c:
coordinated-omission corrected). For the Redis targets, Redis's CPU per
request (INFO cpu) and script calls per request (INFO commandstats), summed
over the nodes for the cluster. With --clients N, the limited targets' max-
throughput windows come from N Zipf-distributed clients (wrk-clients.lua), every
per-client bucket 1,000,000 tokens refilling 1,000,000/s, and the standing shares'
targets are checked beside gateway_redis_unshared's figures. A target with [limiter.shares]
is measured once its /metrics shows gateway_shares_usable 1 (and 1.5 s more). Rounds
alternate the order of the targets (forward, then reversed), so drift in the
machine hits all of them alike; each number reported is the median of rounds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shutil
import signal
import sys
from pathlib import Path

# The parts, each by what it does: common (names, paths, logging), targets
# (the servers), measure (a window's numbers), checks (medians and the
# targets), report (summary.md, charts, docs/benchmarks.md).
import common
import shapes
from checks import summarize
from common import (ANCHOR, ANCHOR_PIPELINES, CLIENTS_ONLY_TARGETS, GATEWAY_TARGETS, LIMITED_TARGETS,
                    MANY_CLIENTS_CAPACITY, MANY_CLIENTS_REFILL, MANY_CLIENTS_TARGETS, OVER_PATH, PATH, REDIS_TARGETS,
                    RESULTS, ROOT, SHARES_GAUGE, SHARES_SETTLE_S, SHARES_WAIT_S, TARGETS, log, warn)
from common import BenchError, median
from measure import Meter, build_anchor, busy_others, machine_info, pool_paired
from report import publish, publish_cluster, write_report
from targets import Targets


def is_wrk_tls_connection_line(line: str) -> bool:
    """A line the TLS listener logs per wrk connection, not per request (see run)."""
    return "Illegal SNI extension: ignoring IP address" in line or "tls handshake eof" in line


def run(args) -> int:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    # gateway_redis_unshared and redis_anchor (standing shares) belong to many-clients
    # mode: measured by default only with --clients, or when --targets names them.
    targets = ([t for t in TARGETS if t in args.targets] if args.targets
               else list(shapes.DEFAULT_BASES) if args.shapes
               else [t for t in TARGETS if t not in CLIENTS_ONLY_TARGETS or args.clients])
    if args.shapes:
        # Each limited target once per crowd shape (gateway_redis@near, ...), in
        # the same rounds; the rest of the bench sees each as its base target.
        targets = shapes.expand(targets, args.shapes)
        shapes.register(targets)
    if args.memory_only:
        targets = ["direct"]
    if "pingora_bare" in targets and not common.BARE.exists():
        print(f"bench: {common.BARE} is missing (the pingora_bare target): build first: "
              f"cargo build --release --example bare_proxy", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else RESULTS / f"bench-{stamp}"
    for d in ("config", "logs", "raw"):
        (out / d).mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    tools = Path(args.tools).resolve()
    warnings: list[str] = []
    if ANCHOR in targets:
        try:
            build_anchor(tools)
        except BenchError as e:
            print(f"bench: {e}", file=sys.stderr)
            return 2
    tg = Targets(args, out, targets, warnings)
    meter = Meter(args, out, tools, tg)

    def on_signal(sig, _frame):
        raise KeyboardInterrupt(f"signal {sig}")

    signal.signal(signal.SIGTERM, on_signal)
    started = dt.datetime.now().isoformat(timespec="seconds")
    machine = machine_info(tg.gateway)
    machine["gateway_binary"] = str(tg.gateway_source)
    if args.gateway_bin:
        machine["gateway_note"] = args.gateway_note or "--gateway-bin"
    thr: dict[str, list] = {t: [] for t in targets}
    lat: dict[str, list] = {t: [] for t in targets}
    extra: dict = {}
    rate = args.rate
    rc = 0
    try:
        others = busy_others(set())
        if others:
            warn("other processes are busy on this machine before the run (numbers will be noisy): " +
                 "; ".join(f"PID {o['pid']} {o['cpu_pct']}% {o['cmd']}" for o in others), tg.warnings)
        log(f"run folder: {out}")
        tg.start_servers(targets)
        # A target with [limiter.shares] is measured once its shares are
        # in use (gateway_shares_usable 1) and full; one whose gauge never
        # shows 1 is failed, stopped and left out of the windows.
        failed_targets = tg.wait_shares(targets)
        for t, why in failed_targets.items():
            warn(f"{t} FAILED, not measured: {why}", tg.warnings)
            tg.drop(t)
            targets.remove(t)
            thr.pop(t, None)
            lat.pop(t, None)
        extra["failed_targets"] = failed_targets
        if not args.memory_only:
            tg.prime(targets)
            extra["tls_negotiated"] = tg.negotiated(targets)
            per = args.warmup + args.duration + 0.7 + args.redis_idle
            per_l = args.warmup + args.latency_duration + 0.7
            served = [t for t in targets if t != ANCHOR]
            # A crowd near its limits has no latency window: its one client
            # at the fixed rate would be refused by its own ip tier.
            timed = [t for t in served if shapes.has_latency_window(t, args)]
            if len(timed) < len(served):
                log("no fixed-rate windows for " + ", ".join(t for t in served if t not in timed)
                    + ": the crowd's ip tier would refuse the one client they send")
            eta = args.rounds * (len(served) * per + len(timed) * per_l)
            if ANCHOR in targets:
                eta += args.rounds * (args.redis_idle + len(ANCHOR_PIPELINES) * (args.warmup + args.duration + 0.3))
            log("up: " + ", ".join(f"{t} {tg.t[t]['url']}" for t in targets))
            log(f"{args.rounds} rounds x {len(targets)} targets, max throughput then fixed-rate latency: about "
                f"{eta / 60:.1f} min")
            orders = []
            for rnd in range(args.rounds):
                order = targets if rnd % 2 == 0 else list(reversed(targets))
                orders.append(order)
                for t in order:
                    if t == ANCHOR:
                        r = meter.anchor(f"thr{rnd + 1}")
                        thr[t].append(r)
                        other = max(x["other_cpu_pct"] for x in r["pipelines"].values())
                        log(f"[max {rnd + 1}/{args.rounds}] {t:<21} " + "; ".join(
                            f"{p} per pipeline {x['rps']:>9,.0f} req/s, Redis {x['redis_cpu_us_per_req']:.2f} µs/req"
                            for p, x in r["pipelines"].items()) + f"  other load {other:.0f}%")
                        continue
                    r = meter.throughput(t, f"thr{rnd + 1}")
                    thr[t].append(r)
                    extra_s = ""
                    if t in REDIS_TARGETS and "redis_cpu_us_per_req" in r:
                        extra_s = (f", Redis {r['redis_cpu_us_per_req']:.2f} µs/req, "
                                   f"{r['script_calls_per_req']:.3f} script calls/req")
                        if args.shapes and r.get("decided_by_share"):
                            extra_s += ", decided by " + " ".join(
                                f"{k} {100 * v:.1f}%" for k, v in sorted(r["decided_by_share"].items(),
                                                                           key=lambda x: -x[1]) if v >= 0.0005)
                        elif r.get("share_decided"):
                            extra_s += f", {100 * r['share_decided']:.1f}% on a share"
                        if "redis_nodes_cpu_us_per_req" in r:
                            extra_s += " (summed over nodes: " + " + ".join(
                                f"{x:.1f}" for x in r["redis_nodes_cpu_us_per_req"]) + " µs)"
                    if r.get("share_429") is not None:
                        extra_s += f", {r['clients']:,} clients, {100 * r['share_429']:.1f}% 429"
                        if args.shapes and r.get("rejected_by_tier"):
                            extra_s += " (refused per req: " + ", ".join(
                                f"{k} {v:.3f}" for k, v in r["rejected_by_tier"].items()) + ")"
                    log(f"[max {rnd + 1}/{args.rounds}] {t:<21} {r['rps']:>9,.0f} rps  "
                        f"{r['cpu_us_per_req']:6.1f} µs/req CPU ({r['proxy_cpu_cores']:.2f} cores){extra_s}"
                        f"  other load {r['other_cpu_pct']:.0f}%")
            if rate is None and served:
                off = median(r["rps"] for r in thr.get("gateway_off", []))
                if off is None:
                    off = median(r["rps"] for r in thr[served[0]])
                    warn(f"gateway_off not measured: the fixed rate is half {served[0]}'s max", tg.warnings)
                rate = round(off / 2)
            if served:
                log(f"fixed rate: {rate:,} rps for {args.latency_duration:g}s per target and round")
            for rnd in range(args.rounds if timed else 0):
                order = [t for t in orders[rnd] if t in timed]
                for t in order:
                    r = meter.fixed_rate(t, f"lat{rnd + 1}", rate)
                    lat[t].append(r)
                    log(f"[lat {rnd + 1}/{args.rounds}] {t:<21} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
                        f"p99.9 {r['p999_ms']:.3f} ms  ({r['cpu_us_per_req']:.1f} µs/req CPU)  other load "
                        f"{r['other_cpu_pct']:.0f}%")
            extra["orders"] = orders
            # The leases' p99 added over gateway_local: both driven at once, so the
            # noise this machine makes lands on both (measure.paired_latency).
            pair = [t for t in ("gateway_local", "gateway_redis") if t in timed]
            if args.shapes:
                # The hot client's pair (or the far-below crowd's: its latency windows keep one client too).
                pair = next(([f"gateway_local@{sh}", f"gateway_redis@{sh}"] for sh in args.shapes
                             if {f"gateway_local@{sh}", f"gateway_redis@{sh}"} <= set(timed)), [])
            if len(pair) == 2 and args.paired_rounds > 0:
                log(f"paired latency: {pair[0]} and {pair[1]} at once, {rate / 2:,.0f} rps each, "
                    f"{args.paired_rounds} windows of {args.latency_duration:g}s")
                windows = []
                for rnd in range(args.paired_rounds):
                    w = meter.paired_latency(pair, f"pair{rnd + 1}", rate)
                    windows.append(w)
                    log(f"[pair {rnd + 1}/{args.paired_rounds}] " + "  ".join(
                        f"{t} p99 {w[t]['p99_ms']:.3f} ms" for t in pair)
                        + f"  added {w[pair[1]]['p99_ms'] - w[pair[0]]['p99_ms']:+.3f} ms")
                extra["paired_latency"] = pool_paired(pair, windows)
            if args.perf:
                extra["perf"] = meter.perf([t for t in targets if t not in ("direct", ANCHOR)])
        if args.memory or args.memory_only:
            # The local backend, then the Redis backend with standing shares.
            extra["memory"] = meter.memory("local")
            if args.memory_redis:
                extra["memory_redis"] = meter.memory("redis")
                if extra["memory_redis"].get("failed"):
                    extra["failed_targets"]["memory (Redis backend, shares)"] = extra["memory_redis"]["failed"]
        for t in targets:
            p = tg.t[t]["proc"]
            if p.poll() is not None:
                warn(f"{t}: its process (PID {p.pid}) exited during the run with {p.returncode}", tg.warnings)
    except KeyboardInterrupt:
        print("bench: interrupted; stopping what it started", file=sys.stderr)
        tg.procs.stop_all()
        return 130
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        tg.procs.stop_all()
        return 2
    finally:
        tg.procs.stop_all()
        if not args.perf:  # perf reports need the binary they profiled; nothing else does
            shutil.rmtree(out / "bin", ignore_errors=True)

    # What the gateways logged at warn level or above (bare_proxy installs no
    # logger: only a panic would show). A request abandoned by wrk at the end
    # of a window is logged as "Downstream ConnectionClosed": counted, not
    # warned about. So are gateway_tls's per-connection lines: wrk sends the IP
    # address as SNI (rustls: "Illegal SNI extension", ignored) and opens one
    # connection it closes at once to check the address ("tls handshake eof").
    gateway_logs = {}
    memory_gateways = (["memory-gateway"] if "memory" in extra else []) + \
        (["memory-redis-gateway"] if "memory_redis" in extra else [])
    for t in list(targets) + memory_gateways:
        lp = out / "logs" / f"{t}.log"
        if (t in GATEWAY_TARGETS or t in memory_gateways or t == "pingora_bare") and lp.exists():
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
                     f"first: {rest[0][:240]}", tg.warnings)
    extra["gateway_logs"] = gateway_logs

    machine["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
    run_info = {
        "dir": str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out),
        "mode": "memory-only" if args.memory_only else ("quick" if args.quick else "full"),
        "rounds": args.rounds, "duration_s": args.duration, "latency_duration_s": args.latency_duration,
        "warmup_s": args.warmup, "connections": args.connections, "threads": args.threads,
        "wrk_threads": args.wrk_threads, "upstream_threads": args.upstream_threads,
        "path": PATH, "api_key_header_on": LIMITED_TARGETS, "lease_period_ms": args.lease_period_ms,
        "paired_rounds": args.paired_rounds,
        "clients": {"n": args.clients, "zipf": args.zipf, "over_pct": args.over, "over_path": OVER_PATH,
                    "targets": [t for t in targets if t in MANY_CLIENTS_TARGETS],
                    "per_client_capacity": None if args.shapes else MANY_CLIENTS_CAPACITY,
                    "per_client_refill_per_sec": None if args.shapes else MANY_CLIENTS_REFILL,
                    "ip_tier": None if args.shapes else {
                        "capacity": args.client_capacity or MANY_CLIENTS_CAPACITY,
                        "refill_per_sec": args.client_refill or MANY_CLIENTS_REFILL},
                    "note": "max-throughput windows only; the fixed-rate windows keep one client; the route's "
                            "per-client bucket holds per_client_capacity tokens and refills "
                            "per_client_refill_per_sec, every target alike; the ip tier holds ip_tier "
                            "(--client-capacity, --client-refill); with --shapes, each shape's own (run.shapes)"}
        if args.clients else None,
        "shapes": shapes.describe(args, args.shapes) if args.shapes else None,
        "shares": {"targets": sorted(tg.shares), "section": "[limiter.shares] enabled = true",
                   "waited_for": f"{SHARES_GAUGE} 1 (at most {SHARES_WAIT_S:g} s), then {SHARES_SETTLE_S:g} s"}
        if tg.shares else None,
        "anchor": {"connections": args.anchor_connections, "requests_per_pipeline": list(ANCHOR_PIPELINES),
                   "descriptors_per_request": 3, "commands": "INCRBY key 1 + EXPIRE key 60 per descriptor",
                   "client": "loadtest/bench/redis_anchor.c"} if ANCHOR in targets else None,
        "started_at": started, "finished_at": dt.datetime.now().isoformat(timespec="seconds"),
        "load_generators": {"max_throughput": "wrk (closed loop, fixed connections)",
                            "latency": "loadtest/bench/fixedrate.c (open loop, latency from the intended send time)"},
    }
    if args.shapes and not args.memory_only:
        extra["shapes"] = shapes.summarize(thr, args.shapes, shapes.describe(args, args.shapes))
    summary = summarize(args, targets if not args.memory_only else [], thr, lat, rate, extra)
    noise = [d["other_cpu_pct"] for d in summary["targets"].values() if d.get("other_cpu_pct") is not None]
    if noise and max(noise) > 25:
        warn(f"noisy run: processes this run did not start used up to {max(noise):.0f}% of a core (median per "
             f"target) during the windows; re-run on a quiet machine before drawing conclusions", tg.warnings)
    summary["noisy"] = bool(noise and max(noise) > 25)
    summary["run"] = run_info
    summary["machine"] = machine
    summary["warnings"] = tg.warnings
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
    if extra.get("failed_targets"):
        log(f"not measured (FAILED): {', '.join(extra['failed_targets'])}")
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
    r.add_argument("--redis-idle", type=float, default=2.0,
                   help="seconds of no traffic before each Redis target's max-throughput window, to measure "
                        "Redis's idle CPU (0: not measured)")
    r.add_argument("--rounds", type=int)
    r.add_argument("--connections", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--wrk-threads", type=int, default=2)
    r.add_argument("--upstream-threads", type=int, default=1)
    r.add_argument("--rate", type=float)
    r.add_argument("--lease-period-ms", type=int, default=None,
                   help="[limiter.leases] period_ms for the Redis targets (default: the gateway's own)")
    r.add_argument("--anchor-connections", type=int, default=8,
                   help="redis_anchor's connections to its Redis, each with one pipeline in flight (8)")
    r.add_argument("--paired-rounds", type=int, default=None,
                   help="windows driving gateway_local and gateway_redis at once for the leases' p99 added "
                        "(default: twice --rounds; 0: none)")
    r.add_argument("--targets")
    r.add_argument("--memory", action="store_true", default=None)
    r.add_argument("--no-memory", dest="memory", action="store_false")
    r.add_argument("--memory-only", action="store_true")
    r.add_argument("--memory-clients", type=int, default=1_200_000)
    r.add_argument("--memory-max-entries", type=int, default=1_000_000)
    r.add_argument("--memory-timeout", type=int, default=600)
    r.add_argument("--no-memory-redis", dest="memory_redis", action="store_false",
                   help="the memory step without its Redis variant (standing shares: the Redis backend with "
                        "[limiter.shares])")
    r.add_argument("--clients", type=int, default=0)
    r.add_argument("--client-capacity", type=int, default=None,
                   help="the ip tier's capacity for the crowd (--clients; with --shapes: the near shape's), "
                        "1,000,000 by default (near: 100)")
    r.add_argument("--client-refill", type=float, default=None,
                   help="the ip tier's refill per second for the crowd (--clients; with --shapes: the near "
                        "shape's), 1,000,000 by default (near: 10)")
    r.add_argument("--shapes", help="measure the limited targets under these shapes side by side in one run: "
                                    "hot (one client), crowd (far below its limits), near (the crowd near its "
                                    "limits; alias crowd-near)")
    r.add_argument("--bin-dir", help="where the gateway, mock-upstream and examples/bare_proxy are "
                                     "(default: target/release)")
    r.add_argument("--cluster-nodes", type=int, default=common.CLUSTER_NODES)
    r.add_argument("--zipf", type=float, default=1.0)
    r.add_argument("--over", type=float, default=3.0)
    r.add_argument("--gateway-bin")
    r.add_argument("--gateway-note")
    r.add_argument("--perf", action="store_true")
    r.add_argument("--publish", action="store_true")
    r.add_argument("--out")
    r.add_argument("--tools", required=True)
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    pc = sub.add_parser("publish-cluster")
    pc.add_argument("dirs", nargs="+")
    pub = sub.add_parser("publish")
    pub.add_argument("dir")
    args = ap.parse_args()

    if args.cmd == "report":
        write_report(Path(args.dir))
        print((Path(args.dir) / "summary.md").read_text())
        return 0
    if args.cmd == "publish-cluster":
        publish_cluster([Path(d).resolve() for d in args.dirs])
        return 0
    if args.cmd == "publish":
        publish(Path(args.dir).resolve())
        return 0

    if args.bin_dir:
        common.set_bin_dir(Path(args.bin_dir).resolve())
    if args.shapes is not None:
        try:
            args.shapes = shapes.parse(args.shapes)
        except ValueError as e:
            ap.error(str(e))
        if args.clients == 0 and any(s != "hot" for s in args.shapes):
            args.clients = shapes.DEFAULT_CLIENTS
        if args.targets is not None and not any(t.strip() in shapes.SHAPED_BASES for t in args.targets.split(",")):
            ap.error(f"--shapes needs one of {', '.join(shapes.SHAPED_BASES)} among --targets")
    if args.client_capacity is not None and args.client_capacity < 1:
        ap.error("--client-capacity must be at least 1 (tokens)")
    if args.client_refill is not None and args.client_refill <= 0:
        ap.error("--client-refill must be positive (tokens per second)")
    if (args.client_capacity or args.client_refill) and not args.clients:
        ap.error("--client-capacity and --client-refill size the crowd's ip tier: they need --clients N or "
                 "--shapes with crowd or near")
    if args.cluster_nodes < 1:
        ap.error("--cluster-nodes must be at least 1")
    common.CLUSTER_NODES = args.cluster_nodes
    if args.quick:
        defaults = dict(duration=5, latency_duration=4, warmup=1, rounds=3, memory=False)
    else:
        defaults = dict(duration=15, latency_duration=15, warmup=2, rounds=3, memory=True)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.paired_rounds is None:
        args.paired_rounds = 2 * args.rounds
    if args.lease_period_ms is not None and args.lease_period_ms <= 0:
        ap.error("--lease-period-ms must be positive")
    if args.paired_rounds < 0:
        ap.error("--paired-rounds must be 0 or more")
    if args.targets:
        args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        bad = [t for t in args.targets if t not in TARGETS]
        if bad:
            ap.error(f"unknown targets {bad}; known: {', '.join(TARGETS)}")
    for k in ("duration", "latency_duration", "rounds", "connections", "threads", "wrk_threads", "upstream_threads"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be positive")
    if args.clients < 0 or args.clients > 4_194_304:
        ap.error("--clients must be between 1 and 4,194,304 (addresses from 100.64.0.0/10)")
    if args.targets and ANCHOR in args.targets and not args.clients:
        ap.error(f"{ANCHOR} drives a crowd: it needs --clients N (many-clients mode)")
    if args.anchor_connections < 1 or args.anchor_connections > 256:
        ap.error("--anchor-connections must be between 1 and 256")
    if args.zipf < 0 or not 0 <= args.over <= 100:
        ap.error("--zipf must be >= 0 and --over a percentage")
    if args.connections < args.wrk_threads:
        ap.error("--connections must be at least --wrk-threads")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
