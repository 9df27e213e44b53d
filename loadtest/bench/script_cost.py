#!/usr/bin/env python3
"""What one batch of decisions costs Redis, with nothing else on the machine
competing: limiter.lua driven by redis-benchmark, no gateway, no load
generator beside it: a standalone Redis beside a Redis Cluster.

  .venv/bin/python loadtest/bench/script_cost.py [--calls N] [--batches 4,16,64]
                                                 [--hot-calls N] [--out DIR]

Two measurements, each as Redis CPU (INFO used_cpu_user + used_cpu_sys) per
decision, on a standalone redis-server and a Redis Cluster of three masters,
all on 127.0.0.1 at free ports, started here and stopped by PID:

split  A batch of B requests as the many-clients benchmark sends it: each
       request from its own client (its ip bucket, new or nearly so), all
       with one API key (its plan bucket and the route's bucket scoped to it:
       two hot buckets). Standalone decides it in one call. The cluster gets
       it as the gateway splits it: one call per master, with that master's
       share (every request's plan tier on one master, its route tier on
       another, a third of the ip tiers on each), the buckets of a call read
       one GET each as across slots. One connection, one call at a time.
hot    One global bucket on one cluster master, B requests per call, eight
       connections: the decisions a second one master's core can give one
       hot bucket (its saturation point), by batch size.

Keys are placed on a chosen master with a hash tag; the ip buckets' names are
random per call (redis-benchmark's __rand_int__, a million of them). Writes
summary.json, summary.md (tables) and chart.png into DIR (default
loadtest/results/script-cost-<timestamp>/).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, BenchError, log  # noqa: E402
from lt.procs import free_ports  # noqa: E402
from targets import Procs, Redis, cluster_ports, form_cluster, start_redis_server  # noqa: E402

SCRIPT = ROOT / "src/limiter/limiter.lua"
BIG = 1_000_000_000
# kind, p1, p2 per bucket (limiter.lua): token buckets admitting everything.
# The per-client ones refill slowly, so they stay in Redis as in the benchmark.
IP = (1, BIG, 0.01)
PLAN = (1, BIG, BIG)
ROUTE = (1, BIG, 0.01)


def slot_owner(nodes: list[Redis]) -> dict[int, int]:
    """Slot -> index of the master serving it (each master's own CLUSTER NODES line)."""
    owner: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for line in n.cmd("CLUSTER", "NODES").splitlines():
            f = line.split()
            if "myself" in f[2]:
                for rng in f[8:]:
                    lo, _, hi = rng.partition("-")
                    for s in range(int(lo), int(hi or lo) + 1):
                        owner[s] = i
    if len(owner) != 16384:
        raise BenchError(f"the masters serve {len(owner)} of 16384 slots")
    return owner


def tags(nodes: list[Redis]) -> list[str]:
    """A hash tag per master: keys named with it live there."""
    owner = slot_owner(nodes)
    found: dict[int, str] = {}
    for i in range(10_000):
        t = f"n{i}"
        found.setdefault(owner[int(nodes[0].cmd("CLUSTER", "KEYSLOT", t))], t)
        if len(found) == len(nodes):
            return [found[i] for i in range(len(nodes))]
    raise BenchError("no hash tag found for every master")


def call_args(sha: str, requests: list[list[tuple[str, tuple]]], across_slots: bool) -> list[str]:
    """EVALSHA arguments deciding `requests` (each a list of (bucket, rule)),
    laid out as the gateway's run_script lays them out. `across_slots`
    declares only the first bucket and names the rest in ARGV, where
    run_script declares every bucket of the first one's slot: here the keys
    share a hash tag, and this makes a call read them one GET each, as a
    node's buckets in many slots are read."""
    buckets: list[tuple[str, tuple]] = []
    index: dict[str, int] = {}
    for r in requests:
        for name, rule in r:
            if name not in index:
                buckets.append((name, rule))
                index[name] = len(buckets)
    declared = 1 if across_slots else len(buckets)
    shapes: list[tuple] = []
    shape_of: dict[tuple, int] = {}
    per_request = []
    for r in requests:
        shape = tuple(index[name] for name, _ in r)
        if shape not in shape_of:
            shapes.append(shape)
            shape_of[shape] = len(shapes)
        per_request.append(shape_of[shape])
    a = ["EVALSHA", sha, str(declared), *[b[0] for b in buckets[:declared]], "", str(len(requests)), str(len(shapes)),
         str(len(buckets) - declared), *[b[0] for b in buckets[declared:]]]
    for _, (kind, p1, p2) in buckets:
        a += [str(kind), f"{p1:g}", f"{p2:g}"]
    for shape in shapes:
        a.append(str(len(shape)))
        for k in shape:
            a += [str(k), "1"]
    a += [str(q) for q in per_request]
    return a


def bench(r: Redis, argv: list[str], calls: int, conns: int, pipeline: int) -> tuple[float, float, float]:
    """redis-benchmark sending `argv` `calls` times: (Redis CPU s, wall s, s inside the script)."""
    r.cmd("CONFIG", "RESETSTAT")
    before = r.info()["cpu"]
    t0 = time.monotonic()
    out = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(r.port), "-n", str(calls), "-c", str(conns),
                          "-P", str(pipeline), "-r", "1000000", "-q", *argv], capture_output=True, text=True,
                         timeout=600)
    wall = time.monotonic() - t0
    info = r.info()
    if out.returncode != 0 or "ERR" in out.stdout:
        raise BenchError(f"redis-benchmark on {r.port}: {out.stdout[-500:]}{out.stderr[-500:]}")
    done = info["cmd"].get("evalsha", {}).get("calls", 0)
    errors = int(info.get("total_error_replies", 0))
    if done != calls or errors:
        raise BenchError(f"redis-benchmark on {r.port}: {done} of {calls} calls ran, {errors} error replies")
    return info["cpu"] - before, wall, info["cmd"]["evalsha"]["usec"] / 1e6


def split_batch(b: int, tag: list[str], tagged: bool) -> tuple[list, list[list]]:
    """The batch standalone decides in one call, and its shares per master.
    `tagged`: the plan bucket and the route bucket scoped to the same API key
    carry one hash tag (the key's), so they live on one master."""
    plan = (f"rl:key:{{{tag[0]}}}:bench", PLAN)
    route = (f"rl:route:{{{tag[0 if tagged else 1]}}}:bench", ROUTE)
    # Each request's own ip bucket: redis-benchmark gives each placeholder
    # its own random number on every call.
    reqs = [[(f"rl:ip:{{{tag[i % 3]}}}:{i}:__rand_int__", IP), plan, route] for i in range(b)]
    shares: list[list] = [[], [], []]
    for i, r in enumerate(reqs):
        on: dict[int, list] = {0: [], 1: [], 2: []}
        for bucket in r:
            on[tag.index(bucket[0].split("{")[1].split("}")[0])].append(bucket)
        for node in range(3):
            if on[node]:
                shares[node].append(on[node])
    return reqs, shares


def split_row(a, b: int, tagged: bool, tag: list[str], standalone: Redis, nodes: list[Redis], sha: dict) -> dict:
    reqs, shares = split_batch(b, tag, tagged)
    what = f"batch of {b}{', tagged' if tagged else ''}"
    log(f"split: {what}: standalone, {a.calls} calls")
    cpu_s, wall_s, in_s = bench(standalone, call_args(sha[standalone.port], reqs, False), a.calls, 1, 1)
    row = {"batch": b, "tagged": tagged, "standalone_us_per_decision": cpu_s * 1e6 / (a.calls * b),
           "standalone_script_us_per_decision": in_s * 1e6 / (a.calls * b),
           "cluster_script_us_per_decision": 0.0, "cluster_nodes_us_per_decision": []}
    for i, n in enumerate(nodes):
        if not shares[i]:
            row["cluster_nodes_us_per_decision"].append(0.0)
            continue
        log(f"split: {what}: cluster master {i + 1} ({len(shares[i])} shares), {a.calls} calls")
        cpu_n, _, in_n = bench(n, call_args(sha[n.port], shares[i], True), a.calls, 1, 1)
        row["cluster_nodes_us_per_decision"].append(cpu_n * 1e6 / (a.calls * b))
        row["cluster_script_us_per_decision"] += in_n * 1e6 / (a.calls * b)
    row["cluster_us_per_decision"] = sum(row["cluster_nodes_us_per_decision"])
    row["ratio"] = row["cluster_us_per_decision"] / row["standalone_us_per_decision"]
    row["calls_per_decision"] = {"standalone": 1 / b, "cluster": sum(1 for s in shares if s) / b}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000, help="calls per batch size and server (split)")
    ap.add_argument("--batches", default="1,4,16,64", help="requests per batch")
    ap.add_argument("--hot-calls", type=int, default=40_000, help="calls per batch size (hot)")
    ap.add_argument("--out")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    out = Path(a.out) if a.out else RESULTS / f"script-cost-{dt.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    try:
        (sp,) = free_ports(1)
        standalone = start_redis_server(procs, "redis", sp, out / f"redis-{sp}.log")
        nodes = [start_redis_server(procs, f"redis-cluster-{p}", p, out / f"redis-{p}.log",
                                    cluster_dir=out / "redis" / str(p)) for p in cluster_ports(3)]
        form_cluster(nodes, out / "redis-cluster-create.txt")
        src = SCRIPT.read_text()
        sha = {r.port: r.cmd("SCRIPT", "LOAD", src).strip() for r in [standalone, *nodes]}
        tag = tags(nodes)
        log(f"standalone on {sp}; cluster masters on {', '.join(str(n.port) for n in nodes)}; hash tags {tag}")

        split = []
        for tagged in (False, True):
            for b in batches:
                split.append(split_row(a, b, tagged, tag, standalone, nodes, sha))
        hot = []
        for b in batches:
            one = (f"rl:route:{{{tag[0]}}}:global", ROUTE[:1] + (BIG, BIG))
            argv = call_args(sha[nodes[0].port], [[one]] * b, True)
            log(f"hot: one global bucket, {b} requests per call, 8 connections, {a.hot_calls} calls")
            calls = a.hot_calls
            cpu_s, wall_s, _ = bench(nodes[0], argv, calls, 8, 1)
            hot.append({"batch": b, "us_per_decision": cpu_s * 1e6 / (calls * b),
                        "decisions_per_cpu_second": calls * b / cpu_s,
                        "decisions_per_s_measured": calls * b / wall_s, "cpu_share": cpu_s / wall_s})
    finally:
        procs.stop_all()

    summary = {"run": out.name, "when": dt.datetime.now().isoformat(timespec="seconds"),
               "calls": a.calls, "hot_calls": a.hot_calls, "split": split, "hot": hot}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = report(summary)
    (out / "summary.md").write_text(md)
    chart(summary, out / "chart.png")
    print(md)
    log(f"wrote {out}/: summary.json, summary.md, chart.png")
    return 0


def report(s: dict) -> str:
    L = [f"**Run `{s['run']}`**: limiter.lua alone (redis-benchmark), {s['calls']:,} calls per batch size and "
         f"server, one connection; Redis CPU per decision (INFO used_cpu_user + used_cpu_sys).", "",
         "| requests per batch | plan and route buckets | standalone µs/decision | cluster µs/decision (3 masters: each) | cluster / standalone"
         " | of which inside the script, standalone / cluster | calls per decision, standalone / cluster |",
         "|--:|---|--:|--:|--:|--:|--:|"]
    for r in s["split"]:
        each = " + ".join(f"{x:.2f}" for x in r["cluster_nodes_us_per_decision"])
        c = r["calls_per_decision"]
        where = "one hash tag: one master" if r["tagged"] else "by name: two masters"
        L.append(f"| {r['batch']} | {where} | {r['standalone_us_per_decision']:.2f} | {r['cluster_us_per_decision']:.2f}"
                 f" ({each}) | {r['ratio']:.2f}× | {r['standalone_script_us_per_decision']:.2f} /"
                 f" {r['cluster_script_us_per_decision']:.2f} | {c['standalone']:.3f} / {c['cluster']:.3f} |")
    L += ["", f"One global bucket on one cluster master ({s['hot_calls']:,} calls, 8 connections):", "",
          "| requests per call | Redis CPU µs/decision | decisions per CPU-second (the master's ceiling) |"
          " measured decisions/s | the master's CPU busy |",
          "|--:|--:|--:|--:|--:|"]
    for r in s["hot"]:
        L.append(f"| {r['batch']} | {r['us_per_decision']:.2f} | {r['decisions_per_cpu_second']:,.0f} |"
                 f" {r['decisions_per_s_measured']:,.0f} | {100 * r['cpu_share']:.0f} % |")
    return "\n".join(L) + "\n"


def chart(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    plain = [r for r in s["split"] if not r["tagged"]]
    tagged = [r for r in s["split"] if r["tagged"]]
    bs = [r["batch"] for r in plain]
    x = range(len(bs))
    ax.bar([i - 0.27 for i in x], [r["standalone_us_per_decision"] for r in plain], 0.27, label="standalone")
    ax.bar(list(x), [r["cluster_us_per_decision"] for r in plain], 0.27, label="cluster, 3 masters (summed)")
    ax.bar([i + 0.27 for i in x], [r["cluster_us_per_decision"] for r in tagged], 0.27,
           label="cluster, plan + route tagged together")
    ax.set_xticks(list(x), [str(b) for b in bs])
    ax.set_xlabel("requests per batch")
    ax.set_ylabel("Redis CPU µs per three-tier decision")
    ax.set_title("A batch split over three masters")
    ax.legend()
    hb = [r["batch"] for r in s["hot"]]
    bx.bar([str(b) for b in hb], [r["decisions_per_cpu_second"] / 1000 for r in s["hot"]], color="#d62728")
    bx.set_xlabel("requests per call")
    bx.set_ylabel("thousand decisions per CPU-second")
    bx.set_title("One global bucket: one master's ceiling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"script_cost: {e}", file=sys.stderr)
        sys.exit(2)
