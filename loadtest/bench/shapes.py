"""Crowd shapes (--shapes): one run measuring the limited gateway targets
under several shapes of traffic side by side, each shape its own gateways.

    hot    one client (127.0.0.1, one API key), as without --clients
    crowd  --clients N Zipf clients, every per-client bucket 1,000,000 tokens
           refilling 1,000,000/s: a crowd far below its limits
    near   the same crowd with the ip tier at --client-capacity tokens
           refilling --client-refill/s (100 and 10 by default): the crowd's
           head over its limit, as real crowds have. The route's bucket stays
           large: with one API key for every client it is one shared bucket

A shaped target is named `<target>@<shape>` (gateway_redis@near) and belongs
to every group its base target belongs to (register), so the rest of the
bench measures it as it measures the base. This module also owns what the
shapes add to a run: each target's bucket sizes (limits), the per-round
figures of each shape, the shapes' checks, their table and their plot."""

from __future__ import annotations

import common
from common import MANY_CLIENTS_CAPACITY, MANY_CLIENTS_REFILL, median

SHAPES = ("hot", "crowd", "near")
ALIASES = {"crowd-near": "near", "far": "crowd", "crowd-far": "crowd"}
# The targets a shape is a variant of: the limited ones a crowd is sent to.
SHAPED_BASES = ["gateway_local", "gateway_redis", "gateway_redis_unshared", "gateway_redis_cluster"]
# With --shapes and no --targets.
DEFAULT_BASES = ["gateway_local", "gateway_redis", "gateway_redis_unshared"]
# The crowd near its limits, unless --client-capacity / --client-refill say otherwise.
NEAR_CAPACITY = 100
NEAR_REFILL = 10.0
# With crowd or near and no --clients.
DEFAULT_CLIENTS = 1_000_000
# One client's buckets: never a limit.
HUGE = 1_000_000_000
# The limits every shape is held to (key, label, op, limit, the shapes it applies to).
SHAPE_CHECKS = [
    ("redis_vs_local_rps", "gateway_redis rps / gateway_local rps, the median of the per-round ratios", ">=", 0.97,
     SHAPES),
    ("redis_cpu_us_per_req_above_idle", "Redis CPU µs per request above Redis's idle CPU, gateway_redis", "<=", 1.0,
     ("near",)),
    ("script_calls_per_req", "script calls per request, gateway_redis", "<=", 0.01, ("near",)),
]
# The decision paths of gateway_limiter_decisions_total{path}, in the order the table shows them.
PATHS = ("share", "lease", "redis", "denied_cache", "fallback", "fail_open", "fail_closed", "local")


def parse(text: str) -> list[str]:
    """--shapes a,b: the shapes in the order given, each once; ValueError naming a bad one."""
    out: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        name = ALIASES.get(name, name)
        if name not in SHAPES:
            raise ValueError(f"unknown shape {raw.strip()!r}; known: {', '.join(SHAPES)} "
                             f"(aliases: {', '.join(f'{a} = {b}' for a, b in ALIASES.items())})")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError("--shapes names no shape")
    return out


def shaped(base: str, shape: str) -> str:
    return f"{base}@{shape}"


def base_of(t: str) -> str:
    return t.split("@", 1)[0]


def shape_of(t: str) -> str | None:
    return t.split("@", 1)[1] if "@" in t else None


def expand(targets: list[str], shapes: list[str]) -> list[str]:
    """The run's targets with each shaped base replaced by one target per
    shape, grouped by shape (so a shape's gateway_local and gateway_redis are
    measured close together) where the first of them stood."""
    bases = [t for t in targets if t in SHAPED_BASES]
    if not bases:
        return list(targets)
    out: list[str] = []
    for t in targets:
        if t not in SHAPED_BASES:
            out.append(t)
        elif t == bases[0]:
            out += [shaped(b, s) for s in shapes for b in bases]
    return out


def register(targets: list[str]) -> None:
    """Puts each shaped target into its base's groups (common's lists, in
    place, so every module that imported them sees it); a crowd's into the
    many-clients targets too, the hot client's not."""
    groups = [common.GATEWAY_TARGETS, common.REDIS_TARGETS, common.CLUSTER_TARGETS, common.LIMITED_TARGETS,
              common.SHARES_TARGETS]
    for t in targets:
        shape = shape_of(t)
        if shape is None:
            continue
        for g in groups:
            if base_of(t) in g and t not in g:
                g.append(t)
        if shape != "hot" and base_of(t) in common.MANY_CLIENTS_TARGETS and t not in common.MANY_CLIENTS_TARGETS:
            common.MANY_CLIENTS_TARGETS.append(t)


def number(x: float) -> str:
    """A bucket size for the TOML: whole numbers as integers, others as given."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def limits(t: str, a) -> dict:
    """A gateway target's per-client buckets: whether it is sent a crowd
    (trusted proxy, the over route), its ip tier and its route's bucket.
    Unshaped targets keep the bench's rule: with --clients, a crowd, the ip
    tier of the targets it is sent to at --client-capacity / --client-refill
    (1,000,000 by default), the others' (one client) at 1,000,000."""
    shape = shape_of(t)
    if shape is None:
        many = bool(a.clients)
        crowd = t in common.MANY_CLIENTS_TARGETS
        ip = ((a.client_capacity or MANY_CLIENTS_CAPACITY, a.client_refill or MANY_CLIENTS_REFILL) if many and crowd
              else (MANY_CLIENTS_CAPACITY, MANY_CLIENTS_REFILL) if many else (HUGE, HUGE))
    elif shape == "hot":
        many, ip = False, (HUGE, HUGE)
    elif shape == "crowd":
        many, ip = True, (MANY_CLIENTS_CAPACITY, MANY_CLIENTS_REFILL)
    else:
        many, ip = True, near_tier(a)
    route = (MANY_CLIENTS_CAPACITY, MANY_CLIENTS_REFILL) if many else (HUGE, HUGE)
    return {"many": many, "ip_capacity": ip[0], "ip_refill": ip[1], "route_capacity": route[0],
            "route_refill": route[1]}


def has_latency_window(t: str, a) -> bool:
    """Whether a target is measured at the fixed rate: not when its crowd's ip
    tier is smaller than the far-below crowd's (the near shape, or
    --client-capacity / --client-refill with --clients), since the fixed-rate
    windows send one client, whom its own ip tier would refuse."""
    if t not in common.MANY_CLIENTS_TARGETS:
        return True
    lim = limits(t, a)
    return not (lim["many"] and (lim["ip_capacity"] < MANY_CLIENTS_CAPACITY or lim["ip_refill"] < MANY_CLIENTS_REFILL))


def near_tier(a) -> tuple[float, float]:
    return (a.client_capacity or NEAR_CAPACITY, a.client_refill or NEAR_REFILL)


def describe(a, shapes: list[str]) -> dict:
    """summary.json's run.shapes: each shape's crowd and buckets."""
    out = {}
    for s in shapes:
        lim = limits(shaped("gateway_local", s), a)
        out[s] = {"clients": a.clients if lim["many"] else 1,
                  "ip_tier": {"capacity": lim["ip_capacity"], "refill_per_sec": lim["ip_refill"]},
                  "route_bucket": {"capacity": lim["route_capacity"], "refill_per_sec": lim["route_refill"]},
                  "what": {"hot": "one client (127.0.0.1, one API key)",
                           "crowd": "the crowd far below its limits",
                           "near": "the crowd near its limits: its head over the ip tier"}[s]}
    return out


# --- the figures ---------------------------------------------------------------------------


def row(r: dict) -> dict:
    """One max-throughput window's figures for the shapes' table."""
    paths = r.get("decided_by_share") or {}
    return {
        "rps": r.get("rps"),
        "cpu_us_per_req": r.get("cpu_us_per_req"),
        "redis_cpu_us_per_req": r.get("redis_cpu_us_per_req"),
        "redis_cpu_us_per_req_above_idle": r.get("redis_cpu_us_per_req_above_idle"),
        "script_calls_per_req": r.get("script_calls_per_req"),
        "share_429": r.get("share_429"),
        "decided_by": {p: paths[p] for p in PATHS if paths.get(p)},
        "rejected_by_tier": r.get("rejected_by_tier") or {},
        "redis_commands_per_req": {c: round(v / max(r.get("requests", 1), 1), 4)
                                   for c, v in sorted((r.get("redis_calls") or {}).items())},
        # Every command Redis ran (scripts' inner ones included, our INFO not) per request.
        "redis_commands_total_per_req": (sum((r.get("redis_calls") or {}).values()) / max(r.get("requests", 1), 1)
                                         if "redis_calls" in r else None),
        "other_cpu_pct": r.get("other_cpu_pct"),
    }


def summarize(thr: dict, shapes: list[str], described: dict) -> dict:
    """Per shape (`described`: describe's): every round's figures of each
    shaped target, and the ratios to gateway_local round by round (the windows
    of one round are minutes apart at most; rounds apart, the machine drifts).
    From the rounds alone, so `bench.py report` can make it again."""
    out: dict = {"order": shapes, "shapes": described, "per_shape": {}}
    for s in shapes:
        ts = [t for t in thr if shape_of(t) == s]
        rounds = max((len(thr[t]) for t in ts), default=0)
        per: dict = {"targets": {base_of(t): [row(r) for r in thr[t]] for t in ts}, "ratios": {}}
        local = per["targets"].get("gateway_local")
        for b in per["targets"]:
            if b == "gateway_local" or not local:
                continue
            xs = per["targets"][b]
            per["ratios"][f"{b}/gateway_local"] = [x["rps"] / y["rps"] if x.get("rps") and y.get("rps") else None
                                                   for x, y in zip(xs, local)]
        per["medians"] = {b: {k: median(x.get(k) for x in xs)
                              for k in ("rps", "cpu_us_per_req", "redis_cpu_us_per_req",
                                        "redis_cpu_us_per_req_above_idle", "script_calls_per_req", "share_429")}
                          for b, xs in per["targets"].items()}
        per["median_ratios"] = {k: median(v) for k, v in per["ratios"].items()}
        per["rounds"] = rounds
        out["per_shape"][s] = per
    return out


def checks(sh: dict) -> list[dict]:
    """The shapes' targets, passed or failed: each shape's median of per-round
    rps ratios, and for the crowd near its limits Redis's CPU and calls."""
    out = []
    for key, label, op, limit, applies in SHAPE_CHECKS:
        for s in sh["order"]:
            if s not in applies:
                continue
            per = sh["per_shape"].get(s, {})
            if key == "redis_vs_local_rps":
                v = (per.get("median_ratios") or {}).get("gateway_redis/gateway_local")
            else:
                v = ((per.get("medians") or {}).get("gateway_redis") or {}).get(key)
            ok = None if v is None else (v >= limit if op == ">=" else v <= limit)
            out.append({"key": f"shape_{s}_{key}", "label": f"{label} ({s})", "value": v, "op": op,
                        "limit": limit, "pass": ok, "shape": s})
    return out


# --- the report ---------------------------------------------------------------------------


def fmt(v, nd=1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def size(v) -> str:
    """A bucket size or rate: whole ones with separators (1,000,000), others as given (0.5)."""
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:g}"


def pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}"


def markdown(s: dict, fmt_limit) -> list[str]:
    """summary.md's shapes section: what each shape is, every round's figures
    per shape and target, the ratios round by round, and the shapes' checks."""
    sh = s.get("shapes")
    if not sh:
        return []
    L = ["## Crowd shapes, side by side", ""]
    for name in sh["order"]:
        d = sh["shapes"][name]
        ip, rt = d["ip_tier"], d["route_bucket"]
        L.append(f"- **{name}**: {d['what']}; {d['clients']:,} client{'s' if d['clients'] != 1 else ''}; ip tier "
                 f"{size(ip['capacity'])} tokens refilling {size(ip['refill_per_sec'])}/s; the route's bucket "
                 f"{size(rt['capacity'])} refilling {size(rt['refill_per_sec'])}/s")
    L += ["", "Every max-throughput window, by shape and round (Redis CPU above its idle CPU, measured before each "
          "window; *decided by*: `gateway_limiter_decisions_total{path}`, the share of the window's decisions; "
          "*refused by*: `gateway_ratelimit_decisions_total{decision=\"rejected\"}` by tier, per request):", "",
          "| shape | round | target | max rps | ÷ local | proxy CPU µs/req | Redis CPU µs/req (above idle) | "
          "script calls/req | Redis commands/req | 429 % | decided by % | refused by, per req | other load % |",
          "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|---|---|--:|"]
    for name in sh["order"]:
        per = sh["per_shape"].get(name) or {}
        for i in range(per.get("rounds", 0)):
            for b, xs in per["targets"].items():
                if i >= len(xs):
                    continue
                x = xs[i]
                rs = per["ratios"].get(f"{b}/gateway_local") or []
                ratio = 1.0 if b == "gateway_local" else rs[i] if i < len(rs) else None
                dec = ", ".join(f"{p} {pct(v)}" for p, v in x["decided_by"].items())
                ref = ", ".join(f"{t} {v:.3f}" for t, v in x["rejected_by_tier"].items() if v)
                redis = (f"{fmt(x['redis_cpu_us_per_req'], 2)} ({fmt(x['redis_cpu_us_per_req_above_idle'], 2)})"
                         if b != "gateway_local" else "")
                calls = fmt(x["script_calls_per_req"], 4) if b != "gateway_local" else ""
                cmds = fmt(x.get("redis_commands_total_per_req"), 4) if b != "gateway_local" else ""
                L.append(f"| {name} | {i + 1} | `{b}` | {fmt(x['rps'], 0)} | {fmt(ratio, 3)} | "
                         f"{fmt(x['cpu_us_per_req'], 1)} | {redis} | {calls} | {cmds} | {pct(x['share_429'])} | "
                         f"{dec} | {ref} | {fmt(x['other_cpu_pct'], 0)} |")
    L += ["", "Ratios to `gateway_local` round by round (and their median):", "",
          "| shape | ratio | " + " | ".join(f"round {i + 1}" for i in range(max(
              (p.get("rounds", 0) for p in sh["per_shape"].values()), default=0))) + " | median |",
          "|---|---|" + "--:|" * (max((p.get("rounds", 0) for p in sh["per_shape"].values()), default=0) + 1)]
    for name in sh["order"]:
        per = sh["per_shape"].get(name) or {}
        for k, vs in per.get("ratios", {}).items():
            L.append(f"| {name} | {k.replace('/gateway_local', '')} | " + " | ".join(fmt(v, 3) for v in vs)
                     + f" | {fmt(per['median_ratios'].get(k), 3)} |")
    cmds = []
    for name in sh["order"]:
        xs = ((sh["per_shape"].get(name) or {}).get("targets") or {}).get("gateway_redis") or []
        for i, x in enumerate(xs):
            c = ", ".join(f"{k} {v:g}" for k, v in x["redis_commands_per_req"].items() if v >= 0.0001)
            if c:
                cmds.append(f"- {name}, round {i + 1}: {c}")
    if cmds:
        L += ["", "Redis commands per request during `gateway_redis`, by command (INFO commandstats: those a "
              "script runs are counted too, so a command beyond the script calls' own is a call of its own or "
              "another script's):", ""] + cmds
    cs = [c for c in s.get("checks", []) if c.get("shape") and c["key"].startswith("shape_")]
    if cs:
        L += ["", "| shape target | value | limit | result |", "|---|--:|--:|---|"]
        for c in cs:
            res = "n/a" if c["pass"] is None else ("**pass**" if c["pass"] else "**FAIL**")
            L.append(f"| {c['label']} | {fmt(c['value'], 3)} | {c['op']} {fmt_limit(c['limit'])} | {res} |")
    L += ["", "![the shapes' ratios, Redis CPU and script calls per round](shapes.png)", ""]
    return L


def chart(s: dict, path, pyplot, save_png) -> None:
    """shapes.png: per shape and round, gateway_redis's (and the unshared's)
    rps over gateway_local's, Redis CPU per request above idle, and script
    calls per request."""
    sh = s["shapes"]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    colors = {"hot": "#d62728", "crowd": "#1f77b4", "near": "#2ca02c"}
    rounds_n = max((p.get("rounds", 0) for p in sh["per_shape"].values()), default=0)

    def style(unshared: bool) -> dict:
        # gateway_redis solid and filled, gateway_redis_unshared (the before) dashed and hollow.
        return dict(ls="--", marker="s", mfc="none") if unshared else dict(ls="-", marker="o")

    for j, name in enumerate(sh["order"]):
        per = sh["per_shape"].get(name) or {}
        col = colors.get(name, "#555555")
        dx = 0.08 * (j - (len(sh["order"]) - 1) / 2)  # side by side within a round
        for k, vs in per.get("ratios", {}).items():
            xs = [i + 1 + dx for i, v in enumerate(vs) if v is not None]
            ys = [v for v in vs if v is not None]
            lab = f"{name}: {k.replace('/gateway_local', '').replace('gateway_', 'gw_')}"
            axes[0].plot(xs, ys, color=col, label=lab, **style("unshared" in k))
        for b in ("gateway_redis", "gateway_redis_unshared"):
            xs_ = per.get("targets", {}).get(b) or []
            lab = f"{name}: {b.replace('gateway_', 'gw_')}"
            for ax, key, floor in ((axes[1], "redis_cpu_us_per_req_above_idle", None),
                                   (axes[2], "script_calls_per_req", 1e-5)):
                pts = [(i + 1 + dx, x.get(key)) for i, x in enumerate(xs_) if x.get(key) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [max(p[1], floor) if floor else p[1] for p in pts], color=col,
                            label=lab, **style(b != "gateway_redis"))
    axes[0].axhline(0.97, color="#555555", ls=":", lw=1, label="target: 0.97")
    axes[0].set_title("max rps ÷ gateway_local's, same shape and round")
    axes[0].set_ylabel("ratio")
    axes[1].axhline(1.0, color="#555555", ls=":", lw=1, label="near's target: 1 µs")
    axes[1].set_title("Redis CPU per request above idle")
    axes[1].set_ylabel("µs / request")
    axes[2].axhline(0.01, color="#555555", ls=":", lw=1, label="near's target: 0.01")
    axes[2].set_yscale("log")
    axes[2].set_title("script calls per request (log; 0 drawn at 1e-5)")
    axes[2].set_ylabel("calls / request")
    for ax in axes:
        ax.set_xlabel("round")
        ax.set_xticks(list(range(1, rounds_n + 1)))
        ax.set_xlim(0.5, rounds_n + 0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    m, run = s["machine"], s["run"]
    fig.suptitle(f"loadtest/bench.sh {run['mode']} --shapes {','.join(sh['order'])} — {m['nproc']} vCPU "
                 f"{m['cpu_model']}, {run['started_at']}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, 110)
