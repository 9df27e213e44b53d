#!/usr/bin/env python3
"""A capacity plan from a benchmark run's measured constants.

    loadtest/capacity.py SUMMARY.json [SUMMARY.json ...] [--md OUT.md] [--publish]

A SUMMARY.json may also be loadtest/bench/script_cost.py's: from one hot
global bucket's cost per decision at two batch sizes it takes the bucket's
own cost per request (what a request adds to a call that its batch makes
anyway), which then sizes the hot-key node and the `shards` a global limit
needs.

Reads loadtest/bench.sh's summary.json (one run, or several: a figure found
in a later file replaces the same figure from an earlier one, so a
many-clients run can follow a one-client run) and prints, for 10k, 100k and
1M requests per second and 1M, 10M and 100M distinct clients: how many
gateway cores, Redis Cluster nodes and how much Redis memory carry the load,
and what saturates first. The same table as markdown goes to --md (default:
capacity.md beside the last SUMMARY.json); --publish also puts it, with the
command that made it, into docs/benchmarks.md between <!-- capacity:begin/end -->.

Measured, from the run(s), each printed with where it came from:
  gateway CPU µs per request by path (gateway_off, gateway_local,
  gateway_redis, gateway_redis_cluster); Redis CPU µs per three-tier decision,
  standalone and cluster (summed over the nodes), and the busiest node's share;
  bytes on the wire to and from Redis per request; bytes per bucket in Redis
  (used_memory growth per key when the run held many keys, else MEMORY USAGE
  of sampled keys); bytes per bucket on the local backend (the memory step).

Assumed, the named constants below: change them to match the hardware.
Loopback figures from a 2-vCPU machine shared by the load generator, the
proxy, the upstream and Redis: on dedicated cores every figure here is
pessimistic, not optimistic.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from report import replace_block  # noqa: E402  (docs/benchmarks.md's marked blocks, as bench.py writes them)

ROOT = Path(__file__).resolve().parent.parent

# --- assumptions ----------------------------------------------------------------------------

# A Redis node runs its commands on one thread: its usable CPU is one core,
# kept at 70 % so a burst or a failover's extra load does not queue.
REDIS_NODE_CPU_CORES = 1.0
REDIS_NODE_CPU_TARGET = 0.70
# Each master has this many replicas (each holds a full copy of its master's
# data and receives its write stream).
REPLICAS_PER_MASTER = 1
# Memory a Redis node may fill with buckets (of its RAM, leaving room for
# fragmentation, the replication buffer and a fork).
REDIS_NODE_MEMORY_GIB = 16.0
# A node's network: 10 Gbit/s, kept at 70 %.
REDIS_NODE_NET_GBIT = 10.0
REDIS_NODE_NET_TARGET = 0.70
# A gateway core kept at 70 % (bursts, GC-free but not queue-free).
GATEWAY_CORE_TARGET = 0.70
# Buckets per distinct client held in Redis: the ip tier's and the route's
# per-client bucket (the API key's plan bucket is per key, not per client).
BUCKETS_PER_CLIENT = 2
# Every client's buckets are resident at once (the worst case: each was seen
# within its bucket's time to refill).
RESIDENT_SHARE = 1.0
# The hottest single bucket (a big tenant's API-key plan bucket, or a global
# route limit) is touched by this share of all requests; its one node serves
# all of them, however many nodes the cluster has.
HOT_KEY_SHARE = 0.05
# Tiers per decision (ip, plan, route): one tier's share of a decision's
# Redis CPU, on the node owning that tier's bucket (used for the hot key only
# when no script_cost.py run gives its measured ceiling).
TIERS_PER_DECISION = 3
# A hot bucket may take this share of its master's budget; the rest serves
# the calls and the other buckets every batch brings that master anyway.
HOT_BUDGET_SHARE = 0.5
# The local fallback's cap per gateway process (local_max_entries).
LOCAL_MAX_ENTRIES = 1_000_000
# The gateway's own CPU when Redis is on another host: the benchmark's
# loopback figure (the same socket work either way).

RPS_STEPS = [10_000, 100_000, 1_000_000]
CLIENT_STEPS = [1_000_000, 10_000_000, 100_000_000]

GIB = 1024 ** 3


# --- the measured constants ------------------------------------------------------------------


def measured(paths: list[Path]) -> dict:
    """Each constant from the last file that has it, with its source."""
    c: dict = {}

    def put(key, value, src):
        if value is not None:
            c[key] = (float(value), src)

    for p in paths:
        s = json.loads(p.read_text())
        if "hot" in s:  # loadtest/bench/script_cost.py
            # us per decision at batch B = per call / B + per request: the two
            # largest batches give both.
            lo, hi = sorted(s["hot"], key=lambda r: r["batch"])[-2:]
            per_call = ((lo["us_per_decision"] - hi["us_per_decision"])
                        / (1 / lo["batch"] - 1 / hi["batch"]))
            src = f"{s.get('run', p.parent.name)}: hot[batch={lo['batch']}, {hi['batch']}].us_per_decision"
            put("hot_us.request", hi["us_per_decision"] - per_call / hi["batch"], src)
            put("hot_us.call", per_call, src)
            continue
        name = Path((s.get("run") or {}).get("dir") or p.parent.name).name
        clients = (s.get("run") or {}).get("clients")
        tag = f"{name}" + (f", {clients['n']:,} clients" if clients else ", one client")
        T = s.get("targets", {})
        for t in ("gateway_off", "gateway_local", "gateway_redis", "gateway_redis_cluster"):
            put(f"gw_us.{t}", T.get(t, {}).get("cpu_us_per_req"), f"{tag}: targets.{t}.cpu_us_per_req")
        r, rc = s.get("redis") or {}, s.get("redis_cluster") or {}
        put("redis_us.standalone", r.get("cpu_us_per_req"), f"{tag}: redis.cpu_us_per_req")
        put("redis_us.cluster", rc.get("cpu_us_per_req"), f"{tag}: redis_cluster.cpu_us_per_req (summed over nodes)")
        nodes = rc.get("nodes_cpu_us_per_req")
        if nodes and sum(nodes) > 0:
            put("cluster_busiest_share", max(nodes) / sum(nodes),
                f"{tag}: redis_cluster.nodes_cpu_us_per_req (busiest / sum)")
        put("net_bytes.cluster", rc.get("net_bytes_per_req"), f"{tag}: redis_cluster.net_bytes_per_req")
        put("net_bytes.standalone", r.get("net_bytes_per_req"), f"{tag}: redis.net_bytes_per_req")
        for src_name, src in (("redis", r), ("redis_cluster", rc)):
            put("bucket_bytes.usage", src.get("memory_usage_bytes_per_key"),
                f"{tag}: {src_name}.memory_usage_bytes_per_key (MEMORY USAGE, sampled)")
            put("bucket_bytes.growth", src.get("used_memory_growth_per_key"),
                f"{tag}: {src_name}.used_memory_growth_per_key ({int(src.get('keys_max') or 0):,} keys)")
        mem = s.get("memory") or {}
        put("local_bytes", mem.get("bytes_per_entry"), f"{name}: memory.bytes_per_entry (the memory step)")
    return c


def value(c: dict, *keys, default=None):
    for k in keys:
        if k in c:
            return c[k][0]
    return default


# --- the plan ---------------------------------------------------------------------------------


def plan(c: dict) -> list[dict]:
    gw_us = value(c, "gw_us.gateway_redis_cluster", "gw_us.gateway_redis")
    redis_us = value(c, "redis_us.cluster", "redis_us.standalone")
    if gw_us is None or redis_us is None:
        raise SystemExit("capacity.py: the summaries hold no gateway_redis(_cluster) figures: run "
                         "loadtest/bench.sh --targets gateway_redis,gateway_redis_cluster first")
    net = value(c, "net_bytes.cluster", "net_bytes.standalone", default=0.0)
    bucket = value(c, "bucket_bytes.growth", "bucket_bytes.usage")
    local = value(c, "local_bytes")
    node_cpu_us = REDIS_NODE_CPU_CORES * REDIS_NODE_CPU_TARGET * 1e6  # µs of CPU per second per node
    node_mem = REDIS_NODE_MEMORY_GIB * GIB
    node_net = REDIS_NODE_NET_GBIT * 1e9 / 8 * REDIS_NODE_NET_TARGET
    hot_us_per_req = value(c, "hot_us.request", default=redis_us / TIERS_PER_DECISION)
    rows = []
    for rps in RPS_STEPS:
        for clients in CLIENT_STEPS:
            gw_cores = rps * gw_us / 1e6 / GATEWAY_CORE_TARGET
            cpu_masters = rps * redis_us / node_cpu_us
            data = clients * BUCKETS_PER_CLIENT * RESIDENT_SHARE * bucket if bucket else 0.0
            mem_masters = data / node_mem
            # A master's clients' traffic plus its write stream to each replica.
            net_masters = rps * net * (1 + REPLICAS_PER_MASTER) / node_net
            need = {"Redis CPU per node": cpu_masters, "replica memory": mem_masters, "the network": net_masters}
            masters = max(1, math.ceil(max(need.values())))
            hot = rps * HOT_KEY_SHARE * hot_us_per_req / 1e6 / REDIS_NODE_CPU_CORES  # cores on one node
            binding = max(need, key=need.get)
            if hot > REDIS_NODE_CPU_TARGET:
                first = (f"a hot key on one node ({hot:.2f} cores > {REDIS_NODE_CPU_TARGET:.0%} of one; "
                         f"more nodes do not help)")
            else:
                first = f"{binding} (sets {masters} master{'s' if masters > 1 else ''})"
                if hot > REDIS_NODE_CPU_TARGET / 2:
                    first += f"; the hot key's node next ({hot:.2f} cores)"
            rows.append({
                "rps": rps, "clients": clients, "gateway_cores": gw_cores, "masters": masters,
                "redis_nodes": masters * (1 + REPLICAS_PER_MASTER),
                "cpu_masters": cpu_masters, "mem_masters": mem_masters, "net_masters": net_masters,
                "redis_data_gib": data / GIB, "redis_memory_gib": data * (1 + REPLICAS_PER_MASTER) / GIB,
                "hot_key_cores": hot,
                # A global limit every request passes: the sub-buckets it needs
                # so that each one's work stays within its share of a master.
                "global_shards": max(1, math.ceil(
                    rps * hot_us_per_req / 1e6 / (REDIS_NODE_CPU_TARGET * HOT_BUDGET_SHARE))),
                "local_mib_per_gateway": min(clients * BUCKETS_PER_CLIENT, LOCAL_MAX_ENTRIES) * local / 2 ** 20
                if local else None,
                "saturates_first": first,
            })
    return rows


def human(n: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n:g}"


def constants_md(c: dict) -> list[str]:
    L = ["Measured (from the run; a later summary replaces an earlier one's figure):", ""]
    names = {
        "gw_us.gateway_off": "gateway CPU µs/req, no limits",
        "gw_us.gateway_local": "gateway CPU µs/req, three tiers local",
        "gw_us.gateway_redis": "gateway CPU µs/req, three tiers on standalone Redis",
        "gw_us.gateway_redis_cluster": "gateway CPU µs/req, three tiers on the Redis Cluster (the plan's path)",
        "redis_us.standalone": "Redis CPU µs per three-tier decision, standalone",
        "redis_us.cluster": "Redis CPU µs per three-tier decision, cluster, summed over nodes (the plan's)",
        "cluster_busiest_share": "busiest cluster node's share of the cluster's Redis CPU",
        "net_bytes.cluster": "bytes to and from Redis per request, cluster",
        "net_bytes.standalone": "bytes to and from Redis per request, standalone",
        "bucket_bytes.growth": "bytes per bucket in Redis, used_memory growth per key (the plan's when present)",
        "bucket_bytes.usage": "bytes per bucket in Redis, MEMORY USAGE (a lower bound: no dict/expiry overhead)",
        "local_bytes": "bytes per bucket on the local backend (gateway RSS)",
        "hot_us.request": "one hot global bucket: Redis CPU µs a request adds on its master (the plan's)",
        "hot_us.call": "one hot global bucket: Redis CPU µs per call (paid by the batch)",
    }
    for k, label in names.items():
        if k in c:
            v, src = c[k]
            L.append(f"- {label}: **{v:.3g}** ({src})")
    L += ["", "Assumed (constants at the top of `loadtest/capacity.py`):", ""]
    L += [f"- a Redis node: {REDIS_NODE_CPU_CORES:g} core at {REDIS_NODE_CPU_TARGET:.0%}, "
          f"{REDIS_NODE_MEMORY_GIB:g} GiB for buckets, {REDIS_NODE_NET_GBIT:g} Gbit/s at {REDIS_NODE_NET_TARGET:.0%}; "
          f"{REPLICAS_PER_MASTER} replica per master",
          f"- a gateway core at {GATEWAY_CORE_TARGET:.0%}; its CPU per request as measured on loopback",
          f"- {BUCKETS_PER_CLIENT} buckets per client (ip tier, route per client), "
          f"{RESIDENT_SHARE:.0%} of clients resident at once",
          f"- the hottest bucket sees {HOT_KEY_SHARE:.0%} of requests; "
          + ("each adds the measured µs per request on its master" if "hot_us.request" in c else
             f"one tier costs 1/{TIERS_PER_DECISION} of a decision's Redis CPU on its node"),
          "- *shards for one global limit*: the sub-buckets (`shards`) a global limit that every request passes "
          f"needs so that each takes at most {HOT_BUDGET_SHARE:.0%} of a master's {REDIS_NODE_CPU_TARGET:.0%}; "
          "a batch still calls every sub-bucket's master (the call is the batch's, counted in the masters' CPU)",
          f"- the local fallback holds at most {LOCAL_MAX_ENTRIES:,} buckets per gateway process"]
    return L


def table_md(rows: list[dict]) -> list[str]:
    L = ["| rps | clients | gateway cores | Redis masters (CPU / memory / network) | Redis nodes with replicas "
         "| Redis memory (data × copies) | hot-key node CPU | shards for one global limit "
         "| local fallback per gateway | saturates first |",
         "|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|"]
    for r in rows:
        local = f"{r['local_mib_per_gateway']:,.0f} MiB" if r["local_mib_per_gateway"] is not None else "n/a"
        L.append(f"| {human(r['rps'])} | {human(r['clients'])} | {r['gateway_cores']:,.1f} | "
                 f"**{r['masters']}** ({r['cpu_masters']:.2f} / {r['mem_masters']:.2f} / {r['net_masters']:.2f}) | "
                 f"{r['redis_nodes']} | {r['redis_memory_gib']:,.1f} GiB ({r['redis_data_gib']:,.1f} × "
                 f"{1 + REPLICAS_PER_MASTER}) | {r['hot_key_cores']:.2f} cores | {r['global_shards']} | {local} | "
                 f"{r['saturates_first']} |")
    return L


def table_text(rows: list[dict]) -> str:
    head = ("rps", "clients", "gw cores", "masters", "cpu/mem/net", "nodes", "Redis GiB", "hot key", "shards",
            "saturates first")
    out = [head]
    for r in rows:
        out.append((human(r["rps"]), human(r["clients"]), f"{r['gateway_cores']:,.1f}", str(r["masters"]),
                    f"{r['cpu_masters']:.2f}/{r['mem_masters']:.2f}/{r['net_masters']:.2f}", str(r["redis_nodes"]),
                    f"{r['redis_memory_gib']:,.1f}", f"{r['hot_key_cores']:.2f}", str(r["global_shards"]),
                    r["saturates_first"]))
    w = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(x.rjust(w[i]) if i < len(head) - 1 else x for i, x in enumerate(row)) for row in out)


def main() -> int:
    ap = argparse.ArgumentParser(prog="capacity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", type=Path,
                    help="summary.json of loadtest/bench.sh runs (and of a loadtest/bench/script_cost.py run)")
    ap.add_argument("--md", type=Path, help="where the markdown goes (default: capacity.md beside the last summary)")
    ap.add_argument("--publish", action="store_true", help="also into docs/benchmarks.md, between its capacity markers")
    a = ap.parse_args()
    for p in a.summaries:
        if not p.exists():
            ap.error(f"{p}: no such file")
    c = measured(a.summaries)
    rows = plan(c)
    md = "\n".join(constants_md(c) + [""] + table_md(rows)) + "\n"
    print("\n".join(constants_md(c)))
    print()
    print(table_text(rows))
    out = a.md or a.summaries[-1].parent / "capacity.md"
    out.write_text(md)
    print(f"\nwrote {out}", file=sys.stderr)
    if a.publish:
        rel = [str(p.resolve().relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
               for p in a.summaries]
        body = f"```sh\nloadtest/capacity.py {' '.join(rel)}\n```\n\n" + md
        bm = ROOT / "docs" / "benchmarks.md"
        bm.write_text(replace_block(bm.read_text(), "capacity", body, by="loadtest/capacity.py --publish"))
        print(f"published into {bm}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
