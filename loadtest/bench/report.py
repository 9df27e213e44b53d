"""The report: summary.md (the table, the targets, memory, TLS),
chart.png and memory.png from summary.json, and publishing a run into
docs/benchmarks.md between its markers."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import sys
from pathlib import Path

import shapes
from checks import CLIENTS_CHECKS, compute_context
from common import ANCHOR_PIPELINES, HERE, REDIS_TARGETS, ROOT, log
from lt.plots import pyplot, save_png  # after common, which puts loadtest/ on sys.path

# --- report: markdown table and chart ----------------------------------------------------


def fmt(v, nd=1, pct=False):
    if v is None:
        return "n/a"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def fmt_limit(v) -> str:
    """A check's limit: as given (0.5, 1.3), whole large ones with separators (1,000,000)."""
    return f"{v:,.0f}" if abs(v) >= 10000 and float(v).is_integer() else f"{v:g}"


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
        L.append("")
        L += anchor_md(s)
        L += failed_md(s)
        L += ["| target | value | limit | result |", "|---|--:|--:|---|"]
        for c in s["checks"]:
            if c["value"] is not None:
                L.append(f"| {c['label']} | {fmt(c['value'], 3)} | {c['op']} {fmt_limit(c['limit'])} | "
                         f"{'**pass**' if c['pass'] else '**FAIL**'} |")
        return "\n".join(L + memory_md(s)) + "\n"
    L.append(f"Run `{run['dir']}` ({run['mode']}): {run['rounds']} rounds, alternating order; "
             f"{run['connections']} connections; gateway `server.threads` = nginx `worker_processes` = "
             f"{'bare_proxy `--threads` = ' if 'pingora_bare' in T else ''}{run['threads']}; "
             f"mock-upstream `--threads {run['upstream_threads']}`; max throughput: wrk -t{run['wrk_threads']} "
             f"for {run['duration_s']:g} s; latency: fixedrate (open loop, coordinated-omission corrected) at "
             f"{fmt(s['fixed_rate_rps'], 0)} rps (half gateway_off's max) for {run['latency_duration_s']:g} s; "
             f"medians of rounds."
             + (f" The Redis targets run `[limiter.leases] period_ms = {run['lease_period_ms']}`."
                if run.get("lease_period_ms") else ""))
    L.append("")
    L.append(f"Machine: {m['nproc']} × {m['cpu_model']}, Linux {m['kernel']}, {m['mem_gib']} GiB; "
             f"{m['nginx']}; {m['wrk']}; {m['redis'].split(' sha=')[0]}; {m['gateway']} "
             f"(commit {m['git_commit']}{', dirty tree' if m['git_dirty'] else ''}, binary built {m['gateway_binary_built']}"
             + (f"; the gateway measured: `{m['gateway_binary']}`, {m['gateway_note']}" if m.get("gateway_note") else "")
             + ").")
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
                 + (f"; {fmt(T['gateway_redis'].get('redis_cpu_us_per_req_above_idle'), 2)} µs per request above "
                    f"Redis's idle CPU ({fmt(T['gateway_redis'].get('redis_idle_cpu_ms_per_s'), 2)} ms per second "
                    "with no traffic)" if T.get('gateway_redis', {}).get('redis_cpu_us_per_req_above_idle') is not None else "")
                 + (f"; commands per request (those a script runs included): {cmds}" if cmds else "") + ".")
        L.append("")
    shares = [(t, d.get("lease_share")) for t, d in T.items()
              if t in REDIS_TARGETS and d.get("lease_share") is not None]
    if shares:
        L.append("Decided on a lease (no round trip to Redis), share of the max-throughput window's requests: "
                 + ", ".join(f"`{t}` {100 * v:.1f}%" for t, v in shares) + ".")
        toks = [(t, d["lease_tokens_per_req"]) for t, d in T.items()
                if t in REDIS_TARGETS and d.get("lease_tokens_per_req")]
        if toks:
            L.append("Lease tokens per request (`gateway_lease_tokens_total`): " + "; ".join(
                f"`{t}` " + ", ".join(f"{k} {v:.3f}" for k, v in x.items()) for t, x in toks) + ".")
        L.append("")
    standing = [(t, d) for t, d in T.items() if t in REDIS_TARGETS and d.get("share_decided") is not None
                and t in ((s.get("run") or {}).get("shares") or {}).get("targets", [])]
    if standing:
        L.append("Decided on a standing share (`[limiter.shares]`: every tier decided by the replica's own "
                 "share, no Redis call), share of the max-throughput window's requests: " + ", ".join(
                     f"`{t}` {100 * d['share_decided']:.1f}%"
                     + (f" ({d['shares_entries']:,.0f} share entries at the end)"
                        if d.get("shares_entries") is not None else "") for t, d in standing) + ".")
        L.append("")
    L += paired_md(s)
    L += cluster_md(s)
    L += clients_md(s)
    L.append("*proxy CPU*: the proxy's processes (for `direct`, the upstream itself) from `/proc/PID/stat` over the "
             "max-throughput window, per request. *other load*: CPU used meanwhile by processes this benchmark did "
             "not start, in % of one core (noise; kernel threads and processes that came and went inside a window are not "
             "counted).")
    L.append("")
    ctx = s.get("context") or compute_context(s)
    if any(c["value"] is not None for c in ctx):
        L.append("Context (informational, not targets; `pingora_bare` is Pingora alone, "
                 "`examples/bare_proxy.rs` with default settings):")
        L.append("")
        for c in ctx:
            L.append(f"- {c['label']}: {fmt(c['value'], 3)}")
        L.append("")
    L += tls_md(s)
    L += anchor_md(s)
    L += shapes.markdown(s, fmt_limit)
    L += failed_md(s)
    if s.get("shapes"):
        L += ["With `--shapes`, the checks below read the hot shape's targets (`gateway_redis@hot` as "
              "`gateway_redis`), the standing shares' the far-below crowd's (`@crowd`).", ""]
    L.append("| target | value | limit | result |")
    L.append("|---|--:|--:|---|")
    for c in s["checks"]:
        if many_clients(c) or c["key"].startswith("shape_"):
            continue  # in their own tables: beside the before, or the shapes' section
        res = "n/a" if c["pass"] is None else ("**pass**" if c["pass"] else "**FAIL**")
        L.append(f"| {c['label']} | {fmt(c['value'], 3)} | {c['op']} {fmt_limit(c['limit'])} | {res} |")
    L += clients_checks_md(s)
    L += memory_md(s)
    return "\n".join(L) + "\n"


# The standing shares' checks, made in many-clients mode only.
MANY_CLIENTS_KEYS = {k for k, *_ in CLIENTS_CHECKS}


def many_clients(c: dict) -> bool:
    """Whether check `c` is one of the standing shares' (known by its key, so
    a summary.json from before they carried `many_clients` reads alike)."""
    return c.get("key") in MANY_CLIENTS_KEYS


def paired_md(s: dict) -> list[str]:
    """The paired latency windows (the leases' p99 added): both targets at once."""
    pl = s.get("paired_latency")
    if not pl or not pl.get("windows"):
        return []
    a, b = pl["pair"]
    L = [f"Paired latency ({pl['windows']} windows, `{a}` and `{b}` driven at once by two fixedrate processes at "
         f"{fmt(pl['rate_each'], 0)} rps each, so the machine's noise lands on both alike; every window's "
         "latencies pooled per target):", "",
         "| target | requests | p50 ms | p90 ms | p99 ms | p99.9 ms |", "|---|--:|--:|--:|--:|--:|"]
    for t in (a, b):
        d = pl[t]
        L.append(f"| `{t}` | {d['samples']:,} | {fmt(d['p50_ms'], 3)} | {fmt(d['p90_ms'], 3)} | "
                 f"{fmt(d['p99_ms'], 3)} | {fmt(d['p999_ms'], 3)} |")
    diffs = pl["p99_added_ms_windows"]
    spread = ""
    if len(diffs) >= 2:
        # How finely this machine resolves p99 added: the windows' own differences.
        spread = (f"; their median {statistics.median(diffs):+.3f} ms, mean {statistics.fmean(diffs):+.3f} ms, "
                  f"standard error of the mean {statistics.stdev(diffs) / len(diffs) ** 0.5:.3f} ms")
    shown = pl["p99_added_ms_windows"]
    L += ["", f"p99 added by `{b}`: {fmt(pl.get('p99_added_ms'), 3)} ms pooled (each window's own: "
          + ", ".join(f"{x:+.3f}" for x in shown[:12]) + (", ..." if len(shown) > 12 else "") + f" ms{spread}).", ""]
    return L


def cluster_md(s: dict) -> list[str]:
    """gateway_redis_cluster beside gateway_redis: the side-by-side table."""
    T, rc = s["targets"], s.get("redis_cluster")
    if not rc or "gateway_redis" not in T:
        return []
    a, b = T["gateway_redis"], T["gateway_redis_cluster"]

    def ratio(x, y):
        return fmt(x / y, 2) + "×" if x is not None and y else "n/a"

    def nodes(xs, nd):
        return f" ({' + '.join(fmt(x, nd) for x in xs)})" if xs and len(xs) > 1 else ""

    n = rc["nodes"]

    rows = [
        ("max rps", fmt(a["rps"], 0), fmt(b["rps"], 0), ratio(b["rps"], a["rps"])),
        ("gateway CPU µs/req", fmt(a["cpu_us_per_req"], 1), fmt(b["cpu_us_per_req"], 1),
         ratio(b["cpu_us_per_req"], a["cpu_us_per_req"])),
        (f"Redis CPU µs/req (cluster: summed over {n} node{'s' if n != 1 else ''})", fmt(a["redis_cpu_us_per_req"], 2),
         f"{fmt(b['redis_cpu_us_per_req'], 2)}{nodes(rc.get('nodes_cpu_us_per_req'), 1)}",
         ratio(b["redis_cpu_us_per_req"], a["redis_cpu_us_per_req"])),
        ("Redis CPU µs/req above Redis's idle CPU", fmt(a.get("redis_cpu_us_per_req_above_idle"), 2),
         fmt(b.get("redis_cpu_us_per_req_above_idle"), 2),
         ratio(b.get("redis_cpu_us_per_req_above_idle"), a.get("redis_cpu_us_per_req_above_idle"))),
        ("Redis idle CPU, ms per second (no traffic)", fmt(a.get("redis_idle_cpu_ms_per_s"), 2),
         fmt(b.get("redis_idle_cpu_ms_per_s"), 2), ratio(b.get("redis_idle_cpu_ms_per_s"), a.get("redis_idle_cpu_ms_per_s"))),
        ("script calls/req (cluster: summed over nodes)", fmt(a["script_calls_per_req"], 3),
         f"{fmt(b['script_calls_per_req'], 3)}{nodes(rc.get('nodes_script_calls_per_req'), 3)}",
         ratio(b["script_calls_per_req"], a["script_calls_per_req"])),
        ("µs inside the script per call", fmt(a.get("redis_script_usec_per_call"), 2),
         fmt(b.get("redis_script_usec_per_call"), 2), ""),
        ("p50 / p99 ms at the fixed rate", f"{fmt(a['p50_ms'], 3)} / {fmt(a['p99_ms'], 3)}",
         f"{fmt(b['p50_ms'], 3)} / {fmt(b['p99_ms'], 3)}", ""),
        ("Redis bytes per bucket (MEMORY USAGE)", fmt((s.get("redis") or {}).get("memory_usage_bytes_per_key"), 0),
         fmt(rc.get("memory_usage_bytes_per_key"), 0), ""),
        ("Redis bytes per bucket (used_memory growth / keys held)",
         fmt((s.get("redis") or {}).get("used_memory_growth_per_key"), 0), fmt(rc.get("used_memory_growth_per_key"), 0),
         ""),
        ("bytes to and from Redis per request", fmt((s.get("redis") or {}).get("net_bytes_per_req"), 0),
         fmt(rc.get("net_bytes_per_req"), 0), ratio(rc.get("net_bytes_per_req"),
                                                    (s.get("redis") or {}).get("net_bytes_per_req"))),
    ]
    if a.get("share_429") is not None or b.get("share_429") is not None:
        rows.append(("share answered 429 (clients over their limit)", fmt(100 * (a.get("share_429") or 0), 1) + " %",
                     fmt(100 * (b.get("share_429") or 0), 1) + " %", ""))
    cmds = ", ".join(f"{k} {v:g}" for k, v in (rc.get("commands_per_req") or {}).items())
    L = [f"Redis Cluster ({n} master{'s' if n != 1 else ''}, no replicas) beside the standalone Redis, same rounds:", "",
         "| | `gateway_redis` | `gateway_redis_cluster` | cluster / standalone |", "|---|--:|--:|--:|"]
    L += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    L += ["", f"Commands per request on the cluster, summed over its nodes (those a script runs included): {cmds}.", ""]
    return L


def clients_md(s: dict) -> list[str]:
    """The many-clients mode's line: who sent the max-throughput windows."""
    c = (s.get("run") or {}).get("clients")
    if not c:
        return []
    shares = ", ".join(f"`{t}` {fmt(100 * s['targets'][t]['share_429'], 1)} %" for t in c["targets"]
                       if s["targets"].get(t, {}).get("share_429") is not None)
    return [f"Many clients (`--clients {c['n']} --zipf {c['zipf']:g} --over {c['over_pct']:g}`): in the max-throughput "
            f"windows of {', '.join(f'`{t}`' for t in c['targets'])}, every request came from one of {c['n']:,} clients "
            f"(X-Forwarded-For from trusted 127.0.0.1), the client of rank r sending in proportion to 1/r^{c['zipf']:g}; "
            f"{c['over_pct']:g} % of the clients are over their limit (answered 429 after their first request). "
            f"Share answered 429: {shares or 'n/a'}. The fixed-rate (latency) windows keep one client."
            + per_client_md(c), ""]


def per_client_md(c: dict) -> str:
    """The crowd's buckets, for clients_md (with --shapes: each shape's, in its own section)."""
    if not c.get("per_client_capacity"):
        return ""
    ip = c.get("ip_tier") or {"capacity": c["per_client_capacity"], "refill_per_sec": c["per_client_refill_per_sec"]}
    if (ip["capacity"], ip["refill_per_sec"]) == (c["per_client_capacity"], c["per_client_refill_per_sec"]):
        return (f" The per-client buckets (the ip tier, the route's per-client bucket) hold "
                f"{c['per_client_capacity']:,} tokens and refill {c['per_client_refill_per_sec']:,}/s, every target "
                "alike: a crowd far below its limits.")
    return (f" The ip tier holds {ip['capacity']:,} tokens and refills {ip['refill_per_sec']:,g}/s "
            f"(`--client-capacity`, `--client-refill`); the route's per-client bucket {c['per_client_capacity']:,} "
            f"refilling {c['per_client_refill_per_sec']:,}/s, every target alike. Smaller than the far-below "
            "crowd's, so these targets had no fixed-rate windows: their ip tier would refuse the one client sent.")


def anchor_md(s: dict) -> list[str]:
    """The standing shares' anchor (envoyproxy/ratelimit's way, on its own
    Redis) beside the gateways' Redis CPU per request from the same run."""
    an = s.get("anchor")
    if not an or not an.get("pipelines"):
        return []
    run = s.get("run") or {}
    c, ar = run.get("clients") or {}, run.get("anchor") or {}
    ps = an["pipelines"]
    base = ps.get("16", {}).get("redis_cpu_us_per_req")

    def vs(x):
        return fmt(x / base, 3) + "×" if x is not None and base else "n/a"

    L = [f"The anchor: envoyproxy/ratelimit's way, on a redis-server of its own "
         f"(`loadtest/bench/redis_anchor.c`): per request three descriptors (the client's address, the API key, the "
         f"route with the client), each `INCRBY key 1` + `EXPIRE key 60`; {ar.get('connections', '?')} connections, "
         f"each with one pipeline in flight; the clients drawn as in the gateways' windows"
         + (f" ({c['n']:,} clients, Zipf {c['zipf']:g})" if c else "")
         + f"; one {run.get('duration_s', 0):g} s window per setting and round, medians of rounds. Its requests/s "
         "go straight to Redis; the gateways' are HTTP requests through the proxy (max-throughput windows).", "",
         "| | requests/s | Redis CPU µs/req | above Redis's idle CPU | script calls/req | Redis commands/req "
         "| Redis CPU / the anchor's (16 per pipeline) |",
         "|---|--:|--:|--:|--:|---|--:|"]
    for p in ANCHOR_PIPELINES:
        d = ps.get(str(p))
        if not d:
            continue
        cmds = ", ".join(f"{k} {v:g}" for k, v in d.get("redis_commands_per_req", {}).items())
        L.append(f"| anchor, {p} request{'s' if p != 1 else ''} per pipeline | {fmt(d['rps'], 0)} | "
                 f"{fmt(d['redis_cpu_us_per_req'], 2)} | {fmt(d.get('redis_cpu_us_per_req_above_idle'), 2)} | | "
                 f"{cmds} | {vs(d['redis_cpu_us_per_req'])} |")
    T = s["targets"]
    for t, g in (an.get("gateways") or {}).items():
        cmds = ", ".join(f"{k} {v:g}" for k, v in (T.get(t, {}).get("redis_commands_per_req") or {}).items()
                         if v >= 0.0005)
        L.append(f"| `{t}` | {fmt(g.get('rps'), 0)} | {fmt(g.get('redis_cpu_us_per_req'), 2)} | "
                 f"{fmt(g.get('redis_cpu_us_per_req_above_idle'), 2)} | {fmt(g.get('script_calls_per_req'), 3)} | "
                 f"{cmds} | {vs(g.get('redis_cpu_us_per_req'))} |")
    L += ["", f"The anchor's Redis idle: {fmt(an.get('redis_idle_cpu_ms_per_s'), 2)} ms CPU per second with no client; "
          "the gateways' Redis CPU is summed over the cluster's nodes for `gateway_redis_cluster`.", ""]
    return L


def clients_checks_md(s: dict) -> list[str]:
    """The standing shares' targets (many-clients mode), each beside
    gateway_redis_unshared's figure: the before."""
    cs = [c for c in s.get("checks", []) if many_clients(c)]
    if not cs:
        return []
    L = ["", "Standing shares (many clients; after: `gateway_redis` with `[limiter.shares]`, before: "
             "`gateway_redis_unshared`, shares off, same run):", "",
         "| target | after | before | limit | result |", "|---|--:|--:|--:|---|"]
    for c in cs:
        res = "n/a" if c["pass"] is None else ("**pass**" if c["pass"] else "**FAIL**")
        L.append(f"| {c['label']} | {c.get('shown') or fmt(c['value'], 3)} | {fmt(c.get('before'), 3)} | "
                 f"{c['op']} {fmt_limit(c['limit'])} | {res} |")
    notes = [f"- {c['label']}: {c['note']}." for c in cs if c.get("note")]
    return L + ([""] + notes if notes else [])


def failed_md(s: dict) -> list[str]:
    """Targets started but failed before any window (e.g. shares never usable)."""
    f = s.get("failed_targets") or {}
    if not f:
        return []
    return ["Targets FAILED, not measured:", ""] + [f"- `{t}`: {why}" for t, why in f.items()] + [""]


def tls_md(s: dict) -> list[str]:
    """The TLS pair's paragraph of summary.md (reported, not a target)."""
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
    mr = s.get("memory_redis")
    if mem and not (mr and not mr.get("failed")):  # else in memory_redis_md's table, beside the Redis variant
        L.append("")
        L.append(f"Memory (local backend, `local_max_entries` = {mem['local_max_entries']:,}): {mem['clients']:,} distinct "
                 f"clients through X-Forwarded-For at {mem['rps']:,} rps; gateway VmRSS {mem['rss_before_mib']} MiB "
                 f"before, {mem['rss_at_cap_mib']} MiB once the cap was reached (at {fmt_int(mem['rss_at_cap_clients'])} "
                 f"clients), {mem['rss_after_mib']} "
                 f"MiB after (peak {mem['hwm_mib']} MiB); ≈{mem['bytes_per_entry']} bytes per bucket; "
                 f"growth past the cap {mem['growth_after_cap_pct']} %.")
    if mr and mr.get("failed"):
        L += ["", "Memory, Redis backend with standing shares (`[limiter.shares]`): **FAILED**, not measured: "
              f"{mr['failed']}."]
    elif mr:
        L += memory_redis_md(mem, mr)
    if s.get("warnings"):
        L.append("")
        L.append("Warnings:")
        for w in s["warnings"]:
            L.append(f"- {w}")
    return L


def fmt_int(v) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def memory_redis_md(mem: dict | None, mr: dict) -> list[str]:
    """The memory step's Redis variant (standing shares) beside the local one."""
    rd = mr.get("redis") or {}
    tier = mr.get("ip_tier") or {}
    loc = mem or {}

    def mib(d, k):
        return f"{d[k]}" if d.get(k) is not None else "n/a"

    rows = [
        ("distinct clients sent (X-Forwarded-For)", fmt_int(loc.get("clients")), fmt_int(mr["clients"])),
        ("requests/s while sending", fmt_int(loc.get("rps")), fmt_int(mr["rps"])),
        ("gateway VmRSS before, MiB", mib(loc, "rss_before_mib"), mib(mr, "rss_before_mib")),
        ("gateway VmRSS at the cap, MiB (local: the first sample past the cap's clients; Redis: the most share "
         "entries seen)",
         f"{mib(loc, 'rss_at_cap_mib')} ({fmt_int(loc.get('rss_at_cap_clients'))} clients)",
         f"{mib(mr, 'rss_at_cap_mib')} ({fmt_int(mr.get('rss_at_cap_clients'))} clients, "
         f"{fmt_int(mr.get('shares_entries_at_cap'))} entries)"),
        ("gateway VmRSS after, MiB (peak)", f"{mib(loc, 'rss_after_mib')} ({mib(loc, 'hwm_mib')})",
         f"{mib(mr, 'rss_after_mib')} ({mib(mr, 'hwm_mib')})"),
        ("growth past the cap, %", mib(loc, "growth_after_cap_pct"), mib(mr, "growth_after_cap_pct")),
        ("entries held at the end (most seen)", "n/a (no gauge; at most the cap)",
         f"{fmt_int(mr.get('shares_entries'))} ({fmt_int(mr.get('shares_entries_max'))}) "
         "`gateway_shares_entries`"),
        ("**bytes per client**: (RSS at the cap − before) / entries held then (local: the clients sent, up to "
         "the cap)", fmt_int(loc.get("bytes_per_entry")), fmt_int(mr.get("bytes_per_share_entry"))),
        ("Redis keys (DBSIZE) at the end (most seen)", "",
         f"{fmt_int(rd.get('keys'))} ({fmt_int(rd.get('keys_max'))})"),
        ("Redis used_memory at the end, MiB (growth since its start)", "",
         f"{mib(rd, 'used_memory_mib')} ({mib(rd, 'used_memory_growth_mib')})"),
    ]
    decided = mr.get("decided_by") or {}
    tot = sum(decided.values())
    dec = ", ".join(f"{k} {100 * v / tot:.1f} %" for k, v in sorted(decided.items(), key=lambda x: -x[1])) if tot else ""
    L = ["", f"Memory, local backend beside the Redis backend with `[limiter.shares] enabled = true` (a fresh "
             f"redis-server of its own; the ip tier {fmt_int(tier.get('capacity'))} tokens refilling "
             f"{fmt_int(tier.get('refill_per_sec'))}/s, cut into a pool and standing shares; sent once "
             f"`gateway_shares_usable` was 1, after {mr.get('shares_usable_after_s')} s, and {mr.get('settle_s', 0):g} s "
             f"more), `local_max_entries` = {mr['local_max_entries']:,} on both:", "",
         "| | local backend | Redis backend, shares on |", "|---|--:|--:|"]
    L += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    notes = []
    if dec:
        notes.append(f"How the Redis variant's requests were decided (`gateway_limiter_decisions_total`): {dec}.")
    if rd:
        notes.append(f"Redis at the end: {fmt_int(rd.get('expired_keys'))} keys expired, "
                     f"{fmt_int(rd.get('script_calls'))} script calls in all, used_memory_rss "
                     f"{mib(rd, 'used_memory_rss_mib')} MiB"
                     + (f", ≈{rd['bytes_per_key']} bytes per key held (used_memory growth / keys)"
                        if rd.get("bytes_per_key") else "") + ".")
    sw = mr.get("entries_after_sweep")
    if sw and mr.get("shares_entries_at_cap") and sw["shares_entries"] < 0.5 * mr["shares_entries_at_cap"]:
        notes.append(f"The share table at its fullest held {fmt_int(mr['shares_entries_at_cap'])} entries "
                     f"({fmt_int(mr.get('rss_at_cap_clients'))} clients sent); a shard that is full drops its full "
                     f"shares (a bucket refilling {fmt_int(tier.get('refill_per_sec'))}/s is full again within "
                     f"microseconds: nearly all), down to {fmt_int(sw['shares_entries'])} entries at "
                     f"{fmt_int(sw['clients'])} clients, then it grows again; the tables keep their capacity, so RSS "
                     "stays near its level at the cap.")
    if mr.get("fallback_transitions"):
        notes.append(f"The limiter failed over during the step: {mr['fallback_transitions']}.")
    notes.append("The share gauge is set on each heartbeat (every second): the entries at the cap may lag the "
                 "RSS sample by up to a second's requests; the end's figure is read two heartbeats after the last.")
    return L + [""] + notes


def chart(s: dict, path: Path) -> None:
    plt = pyplot()

    T = s["targets"]
    names = list(T)
    x = range(len(names))
    colors = {"direct": "#999999", "nginx_limit_req": "#2ca02c", "pingora_bare": "#ff7f0e",
              "nginx_tls": "#98df8a", "gateway_tls": "#9467bd", "gateway_redis_cluster": "#17becf",
              "gateway_redis_unshared": "#aec7e8"}
    col = [colors.get(n, "#1f77b4") for n in names]
    pl = s.get("paired_latency") or {}
    paired = bool(pl.get("p99_added_ms_windows"))
    # Standing shares: Redis CPU per request, the gateways' beside the anchor's.
    redis_bars = [(n, T[n].get("redis_cpu_us_per_req"), colors.get(n, "#1f77b4")) for n in names
                  if n in REDIS_TARGETS and n != "gateway_redis_denied" and T[n].get("redis_cpu_us_per_req") is not None]
    for p in ANCHOR_PIPELINES:
        d = ((s.get("anchor") or {}).get("pipelines") or {}).get(str(p))
        if d:
            redis_bars.append((f"anchor, {p}/pipeline", d["redis_cpu_us_per_req"], "#7f7f7f"))
    anchor_panel = bool(s.get("anchor") or "gateway_redis_unshared" in T) and bool(redis_bars)
    npanels = 3 + paired + anchor_panel
    fig, axes = plt.subplots(1, npanels, figsize=(5.3 * npanels, 5.2))

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
    ax.bar(x, red, bottom=cpu, color="#d62728", label="Redis (cluster: summed over its nodes)"
           if "gateway_redis_cluster" in T else "Redis")
    for i in x:
        ax.text(i, cpu[i] + red[i], f"{cpu[i] + red[i]:.1f}", ha="center", va="bottom", fontsize=8)
    # Room for the labels: a zero-height Redis bar on top of the tallest bar
    # would otherwise pin the axis there (its sticky edge) and cut the label off.
    # (1.25: room for the legend above the bars, gateway_redis_unshared's among them.)
    ax.set_ylim(0, max([cpu[i] + red[i] for i in x] + [1]) * 1.25)
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

    if paired:
        # The leases' p99 added: each paired window's own difference, and the pooled one.
        ax = axes[3]
        d = pl["p99_added_ms_windows"]
        ax.scatter(range(1, len(d) + 1), d, color="#08519c", s=12, label="one window")
        ax.axhline(pl["p99_added_ms"], color="#d62728", label=f"pooled: {pl['p99_added_ms']:+.3f} ms")
        ax.axhline(0.1, color="#555555", ls="--", lw=1, label="target: 0.1 ms")
        ax.axhline(0, color="#999999", lw=0.8)
        ax.set_title(f"p99 added, {pl['pair'][1]} over {pl['pair'][0]}, driven at once\n"
                     f"({pl['windows']} windows, {pl['rate_each']:,.0f} rps each)", fontsize=10)
        ax.set_xlabel("window")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if anchor_panel:
        ax = axes[-1]
        xs = range(len(redis_bars))
        vals = [v for _, v, _ in redis_bars]
        ax.bar(xs, vals, color=[c for _, _, c in redis_bars])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(2.0, color="#d62728", ls="--", lw=1, label="standing shares' target: 2 µs (gateway_redis)")
        if min(vals) > 0 and max(vals) / min(vals) > 20:
            ax.set_yscale("log")
            ax.set_ylim(min(vals) / 2, max(vals + [2.0]) * 3)  # room for the labels and the legend
        else:
            ax.set_ylim(0, max(vals + [2.0]) * 1.12)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([n.replace("gateway_", "gw_") for n, _, _ in redis_bars], rotation=30, ha="right",
                           fontsize=9)
        ax.set_title("Redis CPU per request (standing shares; anchor: INCRBY+EXPIRE,\n16 or 1 requests per pipeline)",
                     fontsize=10)
        ax.set_ylabel("µs / request" + (" (log scale)" if ax.get_yscale() == "log" else ""))
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[:3]:
        ax.set_xticks(list(x))
        ax.set_xticklabels([n.replace("gateway_", "gw_") for n in names], rotation=30, ha="right", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    m = s["machine"]
    c = s["run"].get("clients")
    who = f", --clients {c['n']:,} (Zipf {c['zipf']:g}, {c['over_pct']:g} % over)" if c else ""
    note = f", gateway: {m['gateway_note']}" if m.get("gateway_note") else ""
    fig.suptitle(f"loadtest/bench.sh {s['run']['mode']}{who} — {m['nproc']} vCPU {m['cpu_model']}, "
                 f"{s['run']['started_at']}{note}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, 110)


def memory_chart(s: dict, path: Path) -> None:
    plt = pyplot()

    mem = s["memory"]
    mr = s.get("memory_redis")
    if mr and (mr.get("failed") or not mr.get("rss_curve")):
        mr = None
    fig, axes = plt.subplots(1, 2 if mr else 1, figsize=(13, 4.4) if mr else (7, 4), squeeze=False)
    ax = axes[0][0]
    variants = [(mem, "local backend", "#1f77b4")] + ([(mr, "Redis backend, [limiter.shares]", "#d62728")] if mr else [])
    for m, label, color in variants:
        xs = [p["clients"] / 1e6 for p in m["rss_curve"]]
        ys = [p["rss_mib"] for p in m["rss_curve"]]
        ax.plot(xs, ys, marker=".", color=color, label=label)
    ax.axvline(mem["local_max_entries"] / 1e6, color="#555555", linestyle="--",
               label=f"local_max_entries = {mem['local_max_entries']:,}")
    ax.set_xlabel("distinct clients sent (millions)")
    ax.set_ylabel("gateway VmRSS (MiB)")
    ax.set_title("RSS while new clients arrive" if mr else "local backend: RSS while new clients arrive")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if mr:
        ax = axes[0][1]
        pts = [p for p in mr["rss_curve"] if p.get("shares_entries") is not None]
        ax.plot([p["clients"] / 1e6 for p in pts], [p["shares_entries"] / 1e6 for p in pts], marker=".",
                color="#d62728", label="gateway_shares_entries")
        kp = [p for p in mr["rss_curve"] if p.get("redis_keys") is not None]
        ax.plot([p["clients"] / 1e6 for p in kp], [p["redis_keys"] / 1e6 for p in kp], marker=".",
                color="#7f7f7f", label="Redis keys (DBSIZE)")
        ax.axhline(mr["local_max_entries"] / 1e6, color="#555555", linestyle="--",
                   label=f"local_max_entries = {mr['local_max_entries']:,}")
        ax.set_xlabel("distinct clients sent (millions)")
        ax.set_ylabel("millions")
        ax.set_title("Redis backend with standing shares: entries held")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, 110)


def write_report(out: Path) -> dict:
    s = json.loads((out / "summary.json").read_text())
    if s.get("shapes") and (s.get("rounds") or {}).get("max_throughput"):
        # The shapes' per-round figures, made again from the rounds (a report of an older run reads alike).
        sh = s["shapes"]
        s["shapes"] = shapes.summarize(s["rounds"]["max_throughput"], sh["order"], sh["shapes"])
    (out / "summary.md").write_text(markdown(s))
    try:
        if s["targets"]:
            chart(s, out / "chart.png")
        if s.get("memory"):
            memory_chart(s, out / "memory.png")
        if s.get("shapes"):
            shapes.chart(s, out / "shapes.png", pyplot, save_png)
    except ImportError as e:
        print(f"bench: no chart ({e}); install matplotlib into .venv", file=sys.stderr)
    return s


def replace_block(text: str, name: str, body: str, by: str = "loadtest/bench.sh --publish") -> str:
    begin = f"<!-- {name}:begin (written by {by}) -->"
    block = f"{begin}\n{body}\n<!-- {name}:end -->"
    pat = re.compile(rf"<!-- {name}:begin.*?<!-- {name}:end -->", re.S)
    if pat.search(text):
        return pat.sub(lambda _: block, text)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def cluster_run_md(s: dict, chart_name: str) -> list[str]:
    """One run's part of docs/benchmarks.md's Redis Cluster section."""
    run, m, T = s["run"], s["machine"], s["targets"]
    c = run.get("clients")
    who = (f"{c['n']:,} clients, Zipf {c['zipf']:g}, {c['over_pct']:g} % over their limit (max-throughput windows)"
           if c else "one client (127.0.0.1, one API key)")
    binary = (f"; the gateway measured: {m['gateway_note']}" if m.get("gateway_note")
              else f"; commit {m['git_commit']}{', dirty tree' if m['git_dirty'] else ''}")
    L = [f"**Run `{run['dir']}`** ({run['mode']}: {run['rounds']} rounds of {run['duration_s']:g} s + "
         f"{run['latency_duration_s']:g} s, alternating order; {who}; {m['gateway']}{binary}; "
         f"binary built {m['gateway_binary_built']}; other load up to "
         f"{max((d.get('other_cpu_pct') or 0) for d in T.values()):.0f} % of a core):", "",
         "| target | max rps | proxy CPU µs/req | Redis CPU µs/req | script calls/req | other load % |",
         "|---|--:|--:|--:|--:|--:|"]
    for t, d in T.items():
        L.append(f"| `{t}` | {fmt(d['rps'], 0)} | {fmt(d['cpu_us_per_req'], 1)} | "
                 f"{fmt(d.get('redis_cpu_us_per_req'), 2) if t in REDIS_TARGETS else ''} | "
                 f"{fmt(d.get('script_calls_per_req'), 3) if t in REDIS_TARGETS else ''} | "
                 f"{fmt(d['other_cpu_pct'], 0)} |")
    L.append("")
    L += cluster_md(s)
    L += clients_md(s)
    for ch in s["checks"]:
        if ch["key"].startswith("cluster_") and ch["value"] is not None:
            L.append(f"- {ch['label']}: {fmt(ch['value'], 3)} (limit {ch['op']} {fmt_limit(ch['limit'])}): "
                     f"{'**pass**' if ch['pass'] else '**FAIL**'}")
    failovers = [w for w in s.get("warnings", []) if "failed over" in w]
    if failovers:
        L.append(f"- the limiter failed over to the local backend in {len(failovers)} windows (Redis slower than "
                 f"`timeout_ms` = 15 on the loaded machine): those windows' Redis figures count some decisions "
                 f"made locally")
    L += ["", f"![{run['dir']}](../loadtest/bench/{chart_name})", ""]
    return L


def publish_cluster(outs: list[Path]) -> None:
    """Puts runs with gateway_redis_cluster into docs/benchmarks.md between
    <!-- bench-cluster:begin/end -->; their charts go to loadtest/bench/."""
    body: list[str] = []
    for i, out in enumerate(outs):
        s = write_report(out)
        if "redis_cluster" not in s:
            raise SystemExit(f"{out}: no gateway_redis_cluster in this run")
        name = f"cluster-chart-{i + 1}.png"
        shutil.copyfile(out / "chart.png", HERE / name)
        body += cluster_run_md(s, name)
    bm = ROOT / "docs" / "benchmarks.md"
    bm.write_text(replace_block(bm.read_text(), "bench-cluster", "\n".join(body).rstrip("\n") + "\n",
                                "loadtest/bench/bench.py publish-cluster"))
    log(f"published {', '.join(o.name for o in outs)} into {bm} (Redis Cluster)")


def publish(out: Path) -> None:
    """Puts a run's tables and charts into docs/benchmarks.md, between its markers.

    The targets table goes between <!-- bench:begin --> and <!-- bench:end -->,
    the memory step's result between <!-- bench-memory:begin/end -->; the rest
    of the file is left as it is. The charts are copied to loadtest/bench/."""
    s = write_report(out)
    bm = ROOT / "docs" / "benchmarks.md"
    text = bm.read_text() if bm.exists() else "# Benchmarks\n"
    if s["targets"]:
        shutil.copyfile(out / "chart.png", HERE / "latest-chart.png")
        shutil.copyfile(out / "summary.json", HERE / "latest-summary.json")
        body = markdown(dict(s, memory=None)) + "\n![the targets side by side](../loadtest/bench/latest-chart.png)\n"
        if s.get("shapes") and (out / "shapes.png").exists():
            shutil.copyfile(out / "shapes.png", HERE / "latest-shapes.png")
            body = body.replace("](shapes.png)", "](../loadtest/bench/latest-shapes.png)")
        text = replace_block(text, "bench", body)
    if s.get("memory"):
        shutil.copyfile(out / "memory.png", HERE / "latest-memory.png")
        m = s["machine"]
        body = (f"Run `{s['run']['dir']}` ({s['run']['started_at']}; {m['gateway']}, commit {m['git_commit']}"
                f"{', dirty tree' if m['git_dirty'] else ''}).\n" + "\n".join(memory_md(dict(s, warnings=[])))
                + "\n\n![RSS while new clients arrive](../loadtest/bench/latest-memory.png)\n")
        text = replace_block(text, "bench-memory", body)
    bm.write_text(text)
    log(f"published {out.name} into {bm}")

