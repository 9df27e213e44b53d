"""From the rounds to the summary: each target's medians, the Redis figures,
the targets passed or failed, and the ratios given for context."""

from __future__ import annotations

import common
import shapes
from common import ANCHOR, ANCHOR_PIPELINES, REDIS_TARGETS, TLS_TARGETS, median

# The targets: (key, label, op, limit).
CHECKS = [
    ("redis_vs_off_rps", "gateway_redis rps / gateway_off rps", ">=", 0.85),
    ("p99_added_ms", "p99 added by gateway_redis over gateway_off (ms, fixed rate)", "<=", 0.5),
    ("denied_vs_off_rps", "gateway_redis_denied rps / gateway_off rps", ">=", 1.5),
    ("denied_script_calls_per_req", "script calls per denied request", "<=", 0.1),
    ("redis_cpu_us_per_decision", "Redis CPU µs per three-tier decision", "<=", 10.0),
    ("off_vs_nginx_cpu", "gateway_off CPU / nginx_limit_req CPU per request", "<=", 1.5),
    # Outgrowing one Redis: the Redis Cluster (three masters) against the
    # one standalone Redis, measured side by side in the same rounds.
    ("cluster_vs_standalone_redis_cpu",
     "Redis CPU per three-tier decision, cluster (summed over its nodes) / standalone (Redis Cluster)", "<=", 1.5),
    ("cluster_vs_standalone_gateway_cpu",
     "gateway CPU per request, gateway_redis_cluster / gateway_redis (Redis Cluster)", "<=", 1.2),
    # Leases: the shared limit at local speed (hot client).
    ("redis_vs_local_rps", "gateway_redis rps / gateway_local rps (leases)", ">=", 0.97),
    ("p99_added_over_local_ms",
     "p99 added by gateway_redis over gateway_local (ms; paired windows, pooled, when run; leases)",
     "<=", 0.1),
    ("script_calls_per_req", "script calls per request, gateway_redis (leases)", "<=", 0.01),
    ("redis_cpu_us_per_req", "Redis CPU µs per request, gateway_redis (leases)", "<=", 0.5),
    ("redis_cpu_us_per_req_above_idle",
     "Redis CPU µs per request above Redis's idle CPU, gateway_redis (leases)", "<=", 0.5),
    ("cluster_vs_standalone_redis_cpu_above_idle",
     "Redis CPU per request above idle, cluster (summed over its nodes) / standalone (Redis Cluster, leases)",
     "<=", 1.5),
    # Verified JWTs: a hot client's token is checked once, then cached.
    ("jwt_vs_key_cpu",
     "gateway CPU per request, gateway_jwt (RS256 JWT) / gateway_local (API key), hot client (verified JWTs)",
     "<=", 1.1),
    # Traces: a span per request, sampled at 0.01, exported off the request path.
    ("traced_001_vs_local_cpu",
     "gateway CPU per request, gateway_traced_001 ([tracing] at 0.01) / gateway_local (tracing off) (traces)",
     "<=", 1.05),
]

# Standing shares, "the long tail at local speed": with --clients N
# (many-clients mode) only, gateway_redis running [limiter.shares]; each is
# shown beside the same figure of gateway_redis_unshared (shares off), the
# "before" in the same run.
# (key, label, op, limit, the before's key or None)
CLIENTS_CHECKS = [
    ("clients_redis_vs_local_rps", "gateway_redis rps / gateway_local rps, many clients (standing shares)",
     ">=", 0.95, "clients_unshared_vs_local_rps"),
    ("clients_redis_cpu_us_per_req", "Redis CPU µs per request, gateway_redis, many clients (standing shares)",
     "<=", 2.0, "clients_unshared_cpu_us_per_req"),
    ("clients_redis_cpu_vs_anchor",
     "Redis CPU per request, gateway_redis / the anchor's (INCRBY + EXPIRE, 16 requests per pipeline), "
     "many clients (standing shares)", "<=", 0.25, "clients_unshared_cpu_vs_anchor"),
    ("clients_script_calls_per_req", "script calls per request, gateway_redis, many clients (standing shares)",
     "<=", 0.01, "clients_unshared_script_calls_per_req"),
    # The top-K of refused clients: --over P% of the crowd is refused, each
    # refusal counted in gateway_local's top-K and in nothing else in
    # gateway_local_notop's ([admin] top = false).
    ("clients_top_vs_notop_cpu",
     "gateway CPU per request, gateway_local (top-K on) / gateway_local_notop ([admin] top = false), many clients, "
     "--over of them refused (top-K)", "<=", 1.03, None),
    ("clients_cluster_vs_standalone_redis_cpu_above_idle",
     "Redis CPU per request above idle, gateway_redis_cluster (summed over its nodes) / gateway_redis, "
     "many clients (standing shares)", "<=", 1.3, None),
]

# Context, not targets (never pass/fail, no effect on the exit status): how
# much of the gateway's CPU per request is Pingora's own.
CONTEXT = [
    ("off_vs_bare_cpu", "gateway_off CPU / pingora_bare CPU per request", "gateway_off", "pingora_bare"),
    ("jwt_vs_padded_key_cpu",
     "gateway_jwt CPU / gateway_key_padded CPU per request: JWT work beyond the token's bytes (verified JWTs)",
     "gateway_jwt", "gateway_key_padded"),
    ("padded_vs_key_cpu",
     "gateway_key_padded CPU / gateway_local CPU per request: what a token-sized header costs (verified JWTs)",
     "gateway_key_padded", "gateway_local"),
    ("bare_vs_nginx_cpu", "pingora_bare CPU / nginx_limit_req CPU per request", "pingora_bare", "nginx_limit_req"),
    ("traced_1_vs_local_cpu",
     "gateway_traced_1 CPU / gateway_local CPU per request: every request traced and exported (traces)",
     "gateway_traced_1", "gateway_local"),
    ("traced_down_vs_traced_1_cpu",
     "gateway_traced_down CPU / gateway_traced_1 CPU per request: the collector down (traces)",
     "gateway_traced_down", "gateway_traced_1"),
]


def summarize(args, targets, thr, lat, rate, extra) -> dict:
    s: dict = {"targets": {}}
    s["many_clients"] = args.clients or None
    for t in targets:
        if t == ANCHOR:  # not an HTTP target: its own figures (summarize_anchor)
            continue
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
            d["redis_cpu_us_per_req_above_idle"] = median(r.get("redis_cpu_us_per_req_above_idle") for r in tr)
            d["redis_idle_cpu_ms_per_s"] = median(r.get("redis_idle_cpu_ms_per_s") for r in tr)
            d["script_calls_per_req"] = median(r.get("script_calls_per_req") for r in tr)
            d["lease_share"] = median(r.get("lease_share") for r in tr)
            d["share_decided"] = median(r.get("share_decided") for r in tr)
            d["shares_entries"] = median(r.get("shares_entries") for r in tr)
            events = sorted({k for r in tr for k in r.get("lease_tokens_per_req", {})})
            if events:
                d["lease_tokens_per_req"] = {k: median(r.get("lease_tokens_per_req", {}).get(k, 0) for r in tr)
                                             for k in events}
            d["redis_script_usec_per_call"] = median(r.get("redis_script_usec_per_call") for r in tr)
            d["redis_net_bytes_per_req"] = median(r.get("redis_net_bytes_per_req") for r in tr)
            # Every Redis command per request, the ones scripts run inside included.
            cmds = sorted({c for r in tr for c in r.get("redis_calls", {})})
            d["redis_commands_per_req"] = {
                c: round(median(r.get("redis_calls", {}).get(c, 0) / max(r["requests"], 1) for r in tr), 4)
                for c in cmds}
            nodes = [r["redis_nodes_cpu_us_per_req"] for r in tr if "redis_nodes_cpu_us_per_req" in r]
            if nodes:
                d["redis_nodes_cpu_us_per_req"] = [median(x[i] for x in nodes) for i in range(len(nodes[0]))]
                calls = [r["redis_nodes_script_calls_per_req"] for r in tr]
                d["redis_nodes_script_calls_per_req"] = [median(x[i] for x in calls) for i in range(len(calls[0]))]
            mem = [r["redis_memory"] for r in tr if r.get("redis_memory")]
            if mem:
                d["redis_memory"] = {
                    "keys_max": max(m["keys"] for m in mem),
                    "memory_usage_bytes_per_key": median(m["memory_usage_bytes_per_key"] for m in mem),
                    "used_memory_growth_per_key": median(m["used_memory_growth_per_key"] for m in mem),
                }
        if any(r.get("share_429") is not None for r in tr):
            d["clients"] = max(r.get("clients", 0) for r in tr)
            d["share_429"] = median(r.get("share_429") for r in tr)
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
                      "commands_per_req": g["redis_commands_per_req"],
                      "net_bytes_per_req": g["redis_net_bytes_per_req"], **redis_memory_figures(g)}
    if "gateway_redis_cluster" in s["targets"]:
        g = s["targets"]["gateway_redis_cluster"]
        s["redis_cluster"] = {"nodes": common.CLUSTER_NODES, "cpu_us_per_req": g["redis_cpu_us_per_req"],
                              "script_calls_per_req": g["script_calls_per_req"],
                              "script_usec_per_call": g["redis_script_usec_per_call"],
                              "commands_per_req": g["redis_commands_per_req"],
                              "net_bytes_per_req": g["redis_net_bytes_per_req"],
                              "nodes_cpu_us_per_req": g.get("redis_nodes_cpu_us_per_req"),
                              "nodes_script_calls_per_req": g.get("redis_nodes_script_calls_per_req"),
                              **redis_memory_figures(g)}
    if "gateway_redis_denied" in s["targets"]:
        g = s["targets"]["gateway_redis_denied"]
        s.setdefault("redis", {})["denied_cpu_us_per_req"] = g["redis_cpu_us_per_req"]
        s["redis"]["denied_script_calls_per_req"] = g["script_calls_per_req"]
    if ANCHOR in targets and thr.get(ANCHOR):
        s["anchor"] = summarize_anchor(thr[ANCHOR], s["targets"])
    s["fixed_rate_rps"] = rate
    s.update(extra)
    s["checks"] = shaped_checks(s) if s.get("shapes") else compute_checks(s)
    s["context"] = compute_context(s)
    if any(t in s["targets"] for t in TLS_TARGETS):
        s["tls"] = compute_tls(s["targets"], extra.get("tls_negotiated", {}))
    return s


def summarize_anchor(rounds: list[dict], T: dict) -> dict:
    """The standing shares' anchor (redis_anchor.c, envoyproxy/ratelimit's
    way) over the rounds: per requests-per-pipeline setting the medians of its
    requests/s and Redis CPU per request, and beside them the Redis targets'
    Redis CPU per request from the same run's max-throughput windows."""
    out: dict = {"redis_idle_cpu_ms_per_s": median(r.get("redis_idle_cpu_ms_per_s") for r in rounds),
                 "pipelines": {}}
    for p in ANCHOR_PIPELINES:
        ws = [r["pipelines"][str(p)] for r in rounds if str(p) in r.get("pipelines", {})]
        if not ws:
            continue
        cmds = sorted({c for w in ws for c in w.get("redis_commands_per_req", {})})
        out["pipelines"][str(p)] = {
            "requests_per_pipeline": p,
            "rps": median(w["rps"] for w in ws),
            "redis_cpu_us_per_req": median(w["redis_cpu_us_per_req"] for w in ws),
            "redis_cpu_us_per_req_above_idle": median(w.get("redis_cpu_us_per_req_above_idle") for w in ws),
            "redis_cpu_cores": median(w.get("redis_cpu_cores") for w in ws),
            "redis_net_bytes_per_req": median(w.get("redis_net_bytes_per_req") for w in ws),
            "redis_commands_per_req": {c: median(w.get("redis_commands_per_req", {}).get(c, 0) for w in ws)
                                       for c in cmds},
            "keys_max": max(w.get("keys", 0) for w in ws),
            "connections": ws[0].get("connections"),
            "other_cpu_pct": median(w.get("other_cpu_pct") for w in ws),
            "rps_rounds": [round(w["rps"]) for w in ws],
            "redis_cpu_us_per_req_rounds": [round(w["redis_cpu_us_per_req"], 3) for w in ws],
        }
    pip = out["pipelines"].get("16", {}).get("redis_cpu_us_per_req")
    beside = {}
    for t in REDIS_TARGETS:
        d = T.get(t)
        if not d or t == "gateway_redis_denied":
            continue
        x = d.get("redis_cpu_us_per_req")
        beside[t] = {"redis_cpu_us_per_req": x,
                     "redis_cpu_us_per_req_above_idle": d.get("redis_cpu_us_per_req_above_idle"),
                     "script_calls_per_req": d.get("script_calls_per_req"), "rps": d.get("rps"),
                     "vs_anchor_pipelined": x / pip if x is not None and pip else None}
    out["gateways"] = beside
    return out


def redis_memory_figures(d: dict) -> dict:
    """A Redis target's bytes per bucket (key), for summary.json's redis and redis_cluster."""
    m = d.get("redis_memory") or {}
    return {"memory_usage_bytes_per_key": m.get("memory_usage_bytes_per_key"),
            "used_memory_growth_per_key": m.get("used_memory_growth_per_key"), "keys_max": m.get("keys_max")}


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


def shaped_checks(s: dict) -> list[dict]:
    """With --shapes: the bench's own checks read the hot shape's targets
    (gateway_redis@hot as gateway_redis), the standing shares' many-clients
    checks the far-below crowd's (its figures as before the shapes), and each
    shape's own targets come after (shapes.checks)."""
    T = s["targets"]
    unshaped = {t: d for t, d in T.items() if shapes.shape_of(t) is None}

    def view(shape: str, many) -> dict:
        return dict(s, many_clients=many, targets={
            **unshaped, **{shapes.base_of(t): d for t, d in T.items() if shapes.shape_of(t) == shape}})

    out = compute_checks(view("hot", None))
    if "crowd" in s["shapes"]["order"]:
        keys = {k for k, *_ in CLIENTS_CHECKS}
        out += [dict(c, shape="crowd") for c in compute_checks(view("crowd", s.get("many_clients") or 1))
                if c["key"] in keys]
    return out + shapes.checks(s["shapes"])


def compute_checks(s: dict) -> list[dict]:
    T = s["targets"]

    def get(t, k):
        return T.get(t, {}).get(k)

    def ratio(x, y):
        return x / y if x is not None and y else None

    def added(t, base, k):
        x, y = get(t, k), get(base, k)
        return x - y if x is not None and y is not None else None

    vals = {
        "redis_vs_off_rps": ratio(get("gateway_redis", "rps"), get("gateway_off", "rps")),
        "p99_added_ms": added("gateway_redis", "gateway_off", "p99_ms"),
        "denied_vs_off_rps": ratio(get("gateway_redis_denied", "rps"), get("gateway_off", "rps")),
        "denied_script_calls_per_req": get("gateway_redis_denied", "script_calls_per_req"),
        "redis_cpu_us_per_decision": get("gateway_redis", "redis_cpu_us_per_req"),
        "off_vs_nginx_cpu": ratio(get("gateway_off", "cpu_us_per_req"), get("nginx_limit_req", "cpu_us_per_req")),
        "cluster_vs_standalone_redis_cpu": ratio(get("gateway_redis_cluster", "redis_cpu_us_per_req"),
                                                 get("gateway_redis", "redis_cpu_us_per_req")),
        "cluster_vs_standalone_gateway_cpu": ratio(get("gateway_redis_cluster", "cpu_us_per_req"),
                                                   get("gateway_redis", "cpu_us_per_req")),
        "redis_vs_local_rps": ratio(get("gateway_redis", "rps"), get("gateway_local", "rps")),
        # Both driven at once when the run had paired windows (the machine's
        # noise then lands on both); else the sequential windows' medians.
        "p99_added_over_local_ms": (s.get("paired_latency") or {}).get(
            "p99_added_ms", added("gateway_redis", "gateway_local", "p99_ms")),
        "script_calls_per_req": get("gateway_redis", "script_calls_per_req"),
        "redis_cpu_us_per_req": get("gateway_redis", "redis_cpu_us_per_req"),
        "redis_cpu_us_per_req_above_idle": get("gateway_redis", "redis_cpu_us_per_req_above_idle"),
        "jwt_vs_key_cpu": ratio(get("gateway_jwt", "cpu_us_per_req"), get("gateway_local", "cpu_us_per_req")),
        "traced_001_vs_local_cpu": ratio(get("gateway_traced_001", "cpu_us_per_req"),
                                         get("gateway_local", "cpu_us_per_req")),
        "cluster_vs_standalone_redis_cpu_above_idle": ratio(
            get("gateway_redis_cluster", "redis_cpu_us_per_req_above_idle"),
            get("gateway_redis", "redis_cpu_us_per_req_above_idle")),
    }
    checks = list(CHECKS)
    anchor16 = ((s.get("anchor") or {}).get("pipelines") or {}).get("16", {}).get("redis_cpu_us_per_req")
    vals.update({
        "clients_redis_vs_local_rps": vals["redis_vs_local_rps"],
        "clients_unshared_vs_local_rps": ratio(get("gateway_redis_unshared", "rps"), get("gateway_local", "rps")),
        "clients_redis_cpu_us_per_req": get("gateway_redis", "redis_cpu_us_per_req"),
        "clients_unshared_cpu_us_per_req": get("gateway_redis_unshared", "redis_cpu_us_per_req"),
        "clients_redis_cpu_vs_anchor": ratio(get("gateway_redis", "redis_cpu_us_per_req"), anchor16),
        "clients_unshared_cpu_vs_anchor": ratio(get("gateway_redis_unshared", "redis_cpu_us_per_req"), anchor16),
        "clients_script_calls_per_req": get("gateway_redis", "script_calls_per_req"),
        "clients_top_vs_notop_cpu": ratio(get("gateway_local", "cpu_us_per_req"),
                                          get("gateway_local_notop", "cpu_us_per_req")),
        "clients_unshared_script_calls_per_req": get("gateway_redis_unshared", "script_calls_per_req"),
        "clients_cluster_vs_standalone_redis_cpu_above_idle": vals["cluster_vs_standalone_redis_cpu_above_idle"],
    })
    mem = s.get("memory")
    if mem:
        vals["memory_growth_after_cap_pct"] = mem.get("growth_after_cap_pct")
        checks.append(("memory_growth_after_cap_pct",
                       f"local backend RSS growth from the cap ({mem['local_max_entries']:,}) to "
                       f"{mem['clients']:,} clients (%): bounded", "<=", 10.0))
    mr = s.get("memory_redis")
    if mr and not mr.get("failed"):
        # On the Redis backend the local state is the standing shares;
        # for a million clients and more it stays within local_max_entries.
        seen = [x for x in (mr.get("shares_entries"), mr.get("shares_entries_max")) if x is not None]
        vals["memory_redis_shares_entries"] = max(seen) if seen else None
        checks.append(("memory_redis_shares_entries",
                       f"Redis backend with [limiter.shares]: gateway_shares_entries, the most seen (every second) "
                       f"and at the end, {mr['clients']:,} clients (standing shares): within local_max_entries", "<=",
                       float(mr["local_max_entries"])))
    out = []
    for key, label, op, limit in checks:
        v = vals[key]
        ok = None if v is None else (v >= limit if op == ">=" else v <= limit)
        out.append({"key": key, "label": label, "value": v, "op": op, "limit": limit, "pass": ok})
    if s.get("many_clients"):
        # The standing shares' targets hold in many-clients mode only; the before beside each.
        for key, label, op, limit, before in CLIENTS_CHECKS:
            v = vals[key]
            ok = None if v is None else (v >= limit if op == ">=" else v <= limit)
            c = {"key": key, "label": label, "value": v, "op": op, "limit": limit, "pass": ok,
                 "many_clients": True, "before": vals[before] if before else None}
            if key == "clients_cluster_vs_standalone_redis_cpu_above_idle" and v is None:
                # The check is cluster <= 1.3 x standalone. With shares, Redis's
                # CPU under load can be within its idle rate on both (above idle
                # 0, the figure being clamped there): no ratio, but the
                # inequality still decides (0 <= 1.3 x 0 holds).
                x = get("gateway_redis_cluster", "redis_cpu_us_per_req_above_idle")
                y = get("gateway_redis", "redis_cpu_us_per_req_above_idle")
                if x is not None and y == 0:
                    c["pass"] = x <= limit * y
                    c["shown"] = f"{x:.3f} / {y:.3f} µs"
                    c["note"] = ("no ratio: gateway_redis's Redis CPU under load is within its idle rate "
                                 f"(above idle 0); the cluster's above idle is {x:.3f} µs per request")
            out.append(c)
    return out

