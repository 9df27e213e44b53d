"""Tenants sharing an LLM upstream (loadtest/llm_tenants.sh): its configs,
its report and the report's check. Run from loadtest/ as a module:

    python -m lt.llm_tenants config --out RUN_DIR --replicas N
        --proxy-ports P,.. --admin-ports A,.. --redis-url URL --upstream ADDR
        [--capacity 20000 --refill 333 --noisy-users 14 --quiet-users 3 ...]
        writes RUN_DIR/config/gateway-<i>.toml (one per replica) and
        RUN_DIR/tenants.json (the tenants, their keys and their load, for
        the Locust file; the keys are made for the run and thrown away)
    python -m lt.llm_tenants report RUN_DIR
        summary.json, report.md and llm-tenants.png
    python -m lt.llm_tenants check RUN_DIR
        validates them (exit 1 when something is missing)

The truth is the upstream's: `GET /stats/llm` of the mock upstream (saved
as RUN_DIR/upstream-llm.json) lists every usage it reported, with its time
(microseconds since the mock started) and its tenant (`x-mock-client`).
Locust's side (RUN_DIR/locust/requests.csv) gives the requests sent,
admitted (2xx) and refused (429) per tenant.

A token bucket of capacity C refilled at r per second lets a client spend at
most C + r*T in any window of T seconds (the bucket full at its start, and
everything that drips in during it); with charge by the answer a request is
admitted on its estimate (max_tokens, at most `max`), which is at least
what the mock generates, and settled to the true count, so the tokens the
upstream reports for a tenant in any 60 s window are bound by C + 60 r. The
report takes, per tenant, the most the upstream reported in any 60 s window
(sliding over the reports' times) and holds it to that bound.

Exit status of report: 0 when every acceptance point holds, 1 when one does
not, 2 on bad input. This module is scenario-specific (the rest of lt/ is
shared); matplotlib is imported only by the plots.
"""

import argparse
import bisect
import functools
import hashlib
import math
import os
import re
import secrets
import sys
import time

from lt import files, metrics, tables
from lt.files import read_float, read_text
from lt.plots import pyplot, save_png
from lt.stats import percentile, rnd

TENANTS = ("A", "B", "C")
IDS = {"A": "tenant-a", "B": "tenant-b", "C": "tenant-c"}
COLORS = {"A": "tab:red", "B": "tab:blue", "C": "tab:green"}
WINDOW_SECS = 60
STEADY_FROM = 30.0
REQ_BIN_SECS = 5
PNGS = ("llm-tenants.png",)

die = functools.partial(files.die, "llm_tenants")


# ------------------------------------------------------------------ config


def tenant_specs(a):
    """The three tenants' load (what tenants.json holds, keys aside)."""
    return [
        {"tenant": "A", "role": "noisy", "users": a.noisy_users, "think": [0.2, 0.6], "max_tokens": a.noisy_max_tokens,
         "stream_share": 0.5, "no_max_tokens_share": 0.0, "chunk_ms": 5},
        {"tenant": "B", "role": "quiet", "users": a.quiet_users, "think": [2.0, 4.0], "max_tokens": a.quiet_max_tokens,
         "stream_share": 0.0, "no_max_tokens_share": 0.0, "chunk_ms": 0},
        {"tenant": "C", "role": "quiet", "users": a.quiet_users, "think": [2.0, 4.0], "max_tokens": a.quiet_max_tokens,
         "stream_share": 1.0, "no_max_tokens_share": 0.5, "chunk_ms": 10},
    ]


def fmt_num(x):
    return f"{x:.3f}".rstrip("0").rstrip(".")


CONFIG = """\
# Made by loadtest/llm_tenants.sh (lt/llm_tenants.py config): replica {i} of {n}.
# Three tenants (API keys) on one plan share an LLM upstream; the chat route is
# charged by the answer, and its token bucket gives each tenant its own budget
# of tokens: capacity {capacity}, refilled at {refill}/s ({per_min:,.0f} a minute).
[server]
listen = ["127.0.0.1:{proxy}"]
admin_listen = "127.0.0.1:{admin}"
threads = {threads}
grace_period_secs = 1

[limiter]
backend = "redis"
instances = {n}
headers = "both"
leases = {{ enabled = {leases} }}

[redis]
urls = ["{redis}"]
timeout_ms = {redis_timeout_ms}
key_prefix = "llmt"

[clients]
api_key_header = "x-api-key"

# The tenants' plan: a request bucket that never binds here (the tokens are
# the route's), a day quota of requests and a month quota of tokens (cost =
# "response": what the answers said), both far from binding; the report reads
# the month quota's `used` from /limits against what the upstream reported.
[plans.llm]
capacity = 1000
refill_per_sec = 200
quotas = [{{ limit = 1000000, period = "day" }}, {{ limit = 1000000000, period = "month", cost = "response" }}]

{keys}
[[upstreams]]
name = "llm"
servers = ["{upstream}"]
read_timeout_ms = 30000

[[routes]]
name = "chat"
path_prefix = "/v1/chat/completions"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["sse:usage.total_tokens", "json:usage.total_tokens"], estimate = "json:max_tokens", default_estimate = {default_estimate}, max = {max} }}
limit = {{ algorithm = "token_bucket", capacity = {capacity}, refill_per_sec = {refill}, scope = "client", cost = "response" }}
"""


def make_config(a):
    proxy = a.proxy_ports.split(",")
    admin = a.admin_ports.split(",")
    if len(proxy) != a.replicas or len(admin) != a.replicas:
        die("need one proxy and one admin port per replica")
    specs = tenant_specs(a)
    keys = []
    for s in specs:
        s["id"] = IDS[s["tenant"]]
        s["key"] = "llmt-" + secrets.token_hex(16)
        digest = hashlib.sha256(s["key"].encode()).hexdigest()
        keys.append(f'[[api_keys]]\nid = "{s["id"]}"\nsha256 = "{digest}"\nplan = "llm"\n')
    os.makedirs(os.path.join(a.out, "config"), exist_ok=True)
    for i in range(a.replicas):
        text = CONFIG.format(
            i=i, n=a.replicas, proxy=proxy[i], admin=admin[i], threads=a.threads, redis=a.redis_url,
            redis_timeout_ms=a.redis_timeout_ms, upstream=a.upstream, capacity=a.capacity, refill=fmt_num(a.refill),
            per_min=a.refill * 60, leases="true" if a.leases == "on" else "false",
            default_estimate=a.default_estimate, max=a.max, keys="\n".join(keys),
        )
        path = os.path.join(a.out, "config", f"gateway-{i}.toml")
        with open(path, "w") as f:
            f.write(text)
        print(path)
    files.write_json(os.path.join(a.out, "tenants.json"), {
        "note": "keys made for this run only",
        "tenants": specs,
    })


# ------------------------------------------------------------------ reading


def read_requests(loc):
    def row(r):
        return {
            "t": float(r["t"]),
            "tenant": r["tenant"],
            "stream": r["stream"] == "1",
            "status": int(r["status"]),
            "ms": float(r["ms"]),
            "tokens": int(r["tokens"]) if r["tokens"] not in ("", None) else None,
            "retry_after": r["retry_after"],
            "ratelimit": r["ratelimit"] == "1",
        }

    rows = files.read_csv(os.path.join(loc, "requests.csv"), row)
    rows.sort(key=lambda r: r["t"])
    return rows


def upstream_reports(run_dir, t0):
    """{tenant: [(seconds since the load started, tokens)]} from the mock's
    /stats/llm, and its reported_total; the mock's times mapped through
    clock.json."""
    try:
        s = files.load_json(os.path.join(run_dir, "upstream-llm.json"))
    except (OSError, ValueError) as e:
        die(f"upstream-llm.json: {e}")
    try:
        clock = files.load_json(os.path.join(run_dir, "locust", "clock.json"))
        mock_start = clock["wall"] - clock["mock_uptime"]
    except (OSError, ValueError, KeyError):
        die("locust/clock.json: missing (the mock's clock against ours)")
    out = {t: [] for t in TENANTS}
    other = 0
    for us, n, client in s.get("reports", []):
        t = mock_start + us / 1e6 - t0
        if client in out:
            out[client].append((t, n))
        else:
            other += n
    for v in out.values():
        v.sort()
    return out, s.get("reported_total"), other


def max_window(reports, secs):
    """The most tokens in any window [s, s + secs) over reports [(t, n)]
    sorted by t, and the window's start (None when there are none)."""
    best, start = 0, None
    j, total = 0, 0
    for i in range(len(reports)):
        while j < len(reports) and reports[j][0] < reports[i][0] + secs:
            total += reports[j][1]
            j += 1
        if total > best:
            best, start = total, reports[i][0]
        total -= reports[i][1]
    return best, start


def quota_used(run_dir, tenant):
    """The month quota's `used` (tokens charged) of a tenant, from the
    gateway's /limits at the end, or None."""
    try:
        v = files.load_json(os.path.join(run_dir, "logs", f"limits-{IDS[tenant]}.json"))
    except (OSError, ValueError):
        return None
    for b in v.get("buckets", []):
        if b.get("tier") == "quota-month":
            return b.get("used")
    return None


def gateway_metrics(run_dir, replicas):
    """Rejections by tier and charged requests by reason, summed over the
    replicas' /metrics at the end."""
    rejected, charged = {}, {}
    for i in range(replicas):
        text = read_text(os.path.join(run_dir, "logs", f"metrics-gw{i}.txt"))
        for name, labels, v in metrics.samples(text):
            if name == "gateway_ratelimit_decisions_total" and labels.get("decision") == "rejected":
                k = labels.get("tier", "?")
                rejected[k] = rejected.get(k, 0) + v
            elif name == "gateway_charged_requests_total":
                k = labels.get("reason", "?")
                charged[k] = charged.get(k, 0) + v
    return rejected, charged


LOG_PROBLEM = re.compile(r"\b(WARN|ERROR|warn|error|panick?ed)\b")


def gateway_log_problems(run_dir, replicas):
    """(count, first few) of the gateways' WARN/ERROR lines (GATEWAY_LOG=warn:
    only those are written)."""
    lines = []
    for i in range(replicas):
        for line in read_text(os.path.join(run_dir, "logs", f"gateway-{i}.log")).splitlines():
            if LOG_PROBLEM.search(line):
                lines.append(f"gateway-{i}: {line.strip()}")
    return len(lines), lines[:8]


# ------------------------------------------------------------------ analysis


def analyse(run_dir, meta):
    loc = os.path.join(run_dir, "locust")
    rows = read_requests(loc)
    if not rows:
        die(f"{loc}/requests.csv: no requests recorded")
    t0 = read_float(os.path.join(loc, "started")) or rows[0]["t"]
    t_end = t0 + meta["run_secs"]
    reports, reported_total, other = upstream_reports(run_dir, t0)
    cap, refill = meta["capacity"], meta["refill"]
    bound = cap + refill * WINDOW_SECS
    specs = {s["tenant"]: s for s in files.load_json(os.path.join(run_dir, "tenants.json"))["tenants"]}
    span = max(1.0, t_end - t0)

    tenants = {}
    for name in TENANTS:
        mine = [r for r in rows if r["tenant"] == name]
        ok = [r for r in mine if 200 <= r["status"] < 300]
        r429 = [r for r in mine if r["status"] == 429]
        failed = [r for r in mine if not (200 <= r["status"] < 300) and r["status"] != 429]
        rep = reports[name]
        total = sum(n for _t, n in rep)
        most, most_at = max_window(rep, WINDOW_SECS)
        # The steady part: from STEADY_FROM s (half of a shorter run) to the
        # end, when the noisy tenant's burst is long spent.
        steady_from = STEADY_FROM if span >= 2 * STEADY_FROM else span / 2
        steady = sum(n for t, n in rep if steady_from <= t <= span)
        steady_secs = span - steady_from
        ra = [float(r["retry_after"]) for r in r429 if re.fullmatch(r"[0-9]+(\.[0-9]+)?", r["retry_after"] or "")]
        client_tokens = sum(r["tokens"] or 0 for r in ok)
        used = quota_used(run_dir, name)
        spec = specs.get(name, {})
        tenants[name] = {
            "id": IDS[name],
            "role": spec.get("role"),
            "users": spec.get("users"),
            "max_tokens": spec.get("max_tokens"),
            "stream_share": spec.get("stream_share"),
            "requests": len(mine),
            "admitted": len(ok),
            "refused_429": len(r429),
            "failed": len(failed),
            "failed_statuses": sorted({r["status"] for r in failed}),
            "streamed": sum(1 for r in mine if r["stream"]),
            "tokens_reported": total,
            "reports": len(rep),
            "tokens_max_window": most,
            "tokens_max_window_start_s": rnd(most_at, 1),
            "window_secs": WINDOW_SECS,
            "bound_window": bound,
            "held": most <= bound,
            "tokens_steady": steady,
            "tokens_per_sec_steady": rnd(steady / steady_secs if steady_secs > 0 else None, 1),
            "steady_from_s": rnd(steady_from, 1),
            "steady_secs": rnd(steady_secs, 1),
            "tokens_per_sec_run": rnd(total / span, 1),
            "tokens_read_by_client": client_tokens,
            "answers_without_usage": sum(1 for r in ok if r["tokens"] is None),
            "charged_month_quota_used": used,
            "p50_admitted_ms": rnd(percentile([r["ms"] for r in ok], 50)),
            "p99_admitted_ms": rnd(percentile([r["ms"] for r in ok], 99)),
            "p50_429_ms": rnd(percentile([r["ms"] for r in r429], 50), 2),
            "refused_without_retry_after": sum(1 for r in r429 if not r["retry_after"]),
            "refused_without_ratelimit": sum(1 for r in r429 if not r["ratelimit"]),
            "retry_after_median_s": rnd(percentile(ra, 50), 1),
            "retry_after_max_s": rnd(max(ra) if ra else None, 1),
        }

    rejected, charged = gateway_metrics(run_dir, meta["replicas"])
    log_count, log_lines = gateway_log_problems(run_dir, meta["replicas"])
    loc_cpu = sum(1 for line in read_text(os.path.join(loc, "locust.log")).splitlines() if "CPU usage" in line)
    agg = files.locust_aggregated(loc)
    figures = {
        "tenants": tenants,
        "bound_window": bound,
        "budget_per_sec": refill,
        "reported_total": reported_total,
        "reported_other_clients": other,
        "gateway_rejections_by_tier": rejected,
        "gateway_charged_requests_by_reason": charged,
        "gateway_log_problems": log_count,
        "gateway_log_problem_lines": log_lines,
        "locust_total": None if agg is None else {"requests": int(agg["Request Count"]), "failures": int(agg["Failure Count"])},
        "locust_cpu_warnings": loc_cpu,
        "loadavg_before": read_text(os.path.join(loc, "loadavg-before")).strip() or None,
        "loadavg_after": read_text(os.path.join(loc, "loadavg-after")).strip() or None,
        "window_s": rnd(span, 1),
    }

    # Per-second series (by the upstream's report times, and by request start
    # on our side) for the plot.
    nb = int(math.ceil(span)) + 1
    series = {"nb": nb, "tokens": {}, "trailing": {}, "admitted": {}, "refused": {}}
    for name in TENANTS:
        tok = [0] * nb
        for t, n in reports[name]:
            i = int(t)
            if 0 <= i < nb:
                tok[i] += n
        series["tokens"][name] = tok
        times = [t for t, _n in reports[name]]
        cum = [0]
        for _t, n in reports[name]:
            cum.append(cum[-1] + n)
        trailing = []
        for s in range(nb):
            hi = bisect.bisect_right(times, s)
            lo = bisect.bisect_right(times, s - WINDOW_SECS)
            trailing.append(cum[hi] - cum[lo])
        series["trailing"][name] = trailing
        adm, ref = [0] * nb, [0] * nb
        for r in rows:
            if r["tenant"] != name:
                continue
            i = int(r["t"] - t0)
            if not 0 <= i < nb:
                continue
            if 200 <= r["status"] < 300:
                adm[i] += 1
            elif r["status"] == 429:
                ref[i] += 1
        series["admitted"][name], series["refused"][name] = adm, ref
    return figures, series


def acceptance(f, meta):
    """(title, passed, value) of each acceptance point."""
    t = f["tenants"]
    out = []
    for name in TENANTS:
        x = t[name]
        out.append((
            f"{name}: the upstream's tokens in any {WINDOW_SECS} s window ≤ C + r·{WINDOW_SECS} = {f['bound_window']:,.0f}",
            x["held"],
            f"{x['tokens_max_window']:,}",
        ))
    a = t["A"]
    out.append(("A (noisy) was over its budget: refused with 429", a["refused_429"] > 0, f"{a['refused_429']:,} 429s"))
    # Over T steady seconds a token bucket admits r*T, give or take what it
    # held at the start and at the end: less than about one estimate each.
    r, secs = meta["refill"], a["steady_secs"] or 0
    tol = 2 * meta["noisy_max_tokens"] / secs if secs else float("inf")
    rate = a["tokens_per_sec_steady"]
    out.append((
        f"A (noisy) held at its budget, not over it and not starved: tokens/s from {fmt(a['steady_from_s'])} s to "
        f"the end within r ± 2·max_tokens/T = {fmt_num(r)} ± {tol:.0f}",
        rate is not None and abs(rate - r) <= tol,
        f"{fmt(rate)} tokens/s over {fmt(secs)} s",
    ))
    for name in ("B", "C"):
        x = t[name]
        out.append((
            f"{name} (quiet) got everything it asked for: no 429, no failure",
            x["refused_429"] == 0 and x["failed"] == 0 and x["admitted"] == x["requests"],
            f"{x['admitted']:,}/{x['requests']:,} admitted, {x['refused_429']} 429, {x['failed']} failed",
        ))
    nofail = sum(t[n]["failed"] for n in TENANTS)
    out.append(("no failures (5xx, connection errors) for any tenant", nofail == 0, f"{nofail}"))
    return out


# ------------------------------------------------------------------ report


def fmt(x, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, int):
        return f"{x:,}{unit}"
    return f"{x}{unit}"


def main_table(f):
    rows = []
    for name in TENANTS:
        x = f["tenants"][name]
        label = f"{name} ({x['role']}, {x['users']} users)"
        rows.append((
            label,
            fmt(x["requests"]),
            fmt(x["admitted"]),
            fmt(x["refused_429"]),
            fmt(x["failed"]),
            fmt(x["tokens_reported"]),
            fmt(x["tokens_max_window"]),
            fmt(x["bound_window"]),
            "yes" if x["held"] else "**NO**",
        ))
    header = ("tenant", "requests sent", "admitted (2xx)", "429", "failed", "tokens reported by the upstream",
              f"most in any {WINDOW_SECS} s", f"bound, any {WINDOW_SECS} s (C + r·{WINDOW_SECS})", "held")
    return tables.table(header, "lrrrrrrrl", rows)


def charged_cell(x):
    used, rep = x["charged_month_quota_used"], x["tokens_reported"]
    if used is None:
        return "n/a"
    diff = used - rep
    return f"{fmt(used)} ({'= reported' if diff == 0 else f'{diff:+,}'})"


def detail_table(f):
    rows = []
    for name in TENANTS:
        x = f["tenants"][name]
        rows.append((
            name,
            f"{x['max_tokens'] or 'n/a'}, {round(100 * (x['stream_share'] or 0))}% streamed",
            fmt(x["tokens_per_sec_steady"]),
            fmt(x["tokens_per_sec_run"]),
            charged_cell(x),
            f"{fmt(x['tokens_read_by_client'])} / {fmt(x['reports'])} usages",
            f"{fmt(x['p50_admitted_ms'])} / {fmt(x['p99_admitted_ms'])}",
            "n/a" if not x["refused_429"] else f"{fmt(x['p50_429_ms'])} ms, Retry-After {fmt(x['retry_after_median_s'])} s "
            f"(max {fmt(x['retry_after_max_s'])}); without Retry-After {x['refused_without_retry_after']}, "
            f"without RateLimit {x['refused_without_ratelimit']}",
        ))
    steady = f["tenants"]["A"]["steady_from_s"]
    header = ("tenant", "max_tokens", f"tokens/s from {fmt(steady)} s (budget {fmt_num(f['budget_per_sec'])})",
              "tokens/s, whole run", "charged (month quota used; diff)", "tokens read from the 2xx answers",
              "admitted p50 / p99 ms", "429s: p50, Retry-After")
    return tables.table(header, "llrrrrrl", rows)


def write_report(run_dir, meta, f, verdicts):
    L = []
    L.append("# Tenants sharing an LLM upstream: charged by the answer")
    L.append("")
    L.append(
        f"Three API keys on one plan, {meta['run_secs']} s, through {meta['replicas']} gateway replica(s) on one Redis to "
        f"mock-upstream's `POST /v1/chat/completions` (service time {meta['service_ms']} ms). The route is charged by the "
        "answer (`charge = { response = [\"sse:usage.total_tokens\", \"json:usage.total_tokens\"], estimate = "
        f"\"json:max_tokens\", default_estimate = {meta['default_estimate']}, max = {meta['max']} }}`) and its limit is a "
        f"token bucket per tenant counting those tokens (capacity C = {meta['capacity']:,}, refill r = "
        f"{fmt_num(meta['refill'])}/s: {meta['refill'] * 60:,.0f} a minute, `cost = \"response\"`, `scope = \"client\"`). "
        f"A (noisy): {meta['noisy_users']} users, `max_tokens` {meta['noisy_max_tokens']}, half streamed, 0.2-0.6 s apart, "
        f"no back-off; B and C (quiet): {meta['quiet_users']} users each, 2-4 s apart, `max_tokens` "
        f"{meta['quiet_max_tokens']} (B JSON answers; C streamed, half without `max_tokens`). Leases "
        f"(`[limiter.leases]`) {meta.get('leases', 'on')}."
    )
    L.append("")
    L.append(
        f"Mode `{meta['mode']}`, {meta['cpus']} CPUs, load average before {f['loadavg_before']} and after "
        f"{f['loadavg_after']}, commit {meta['git_commit']}, gateway built {meta['gateway_mtime']}, started "
        f"{meta['started_at']}."
    )
    L.append("")
    L += main_table(f)
    L.append("")
    L.append(
        f"Tokens are what the upstream reported (`GET /stats/llm`, per `x-mock-client`); \"most in any {WINDOW_SECS} s\" "
        "slides a window over the reports' times. A token bucket lets a client spend at most C + r·T in any T "
        "seconds: the bucket full at the window's start and what drips in during it."
    )
    L.append("")
    L.append("## Acceptance")
    L.append("")
    L += tables.table(("point", "result", "value"), "lll",
                      [(t, "PASS" if ok else "**FAIL**", v) for t, ok, v in verdicts])
    L.append("")
    L.append("## Details")
    L.append("")
    L += detail_table(f)
    L.append("")
    L.append("## Notes")
    L.append("")
    rej = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(f["gateway_rejections_by_tier"].items())) or "none"
    chg = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(f["gateway_charged_requests_by_reason"].items())) or "none"
    L.append(f"* The gateways' rejections by tier (`gateway_ratelimit_decisions_total{{decision=\"rejected\"}}`): {rej}.")
    L.append(f"* Charged requests by reason (`gateway_charged_requests_total`): {chg}.")
    L.append(
        f"* The upstream reported {fmt(f['reported_total'])} tokens in all"
        + (f" ({fmt(f['reported_other_clients'])} for no tenant)" if f["reported_other_clients"] else "")
        + ". \"Charged\" is the month quota's `used` (`cost = \"response\"`) from `/limits?key=ID` a second after the "
        "load stopped; a request cut off when Locust stopped may be reported by the upstream (it reports as it starts "
        "the answer) and not charged."
    )
    lt_ = f["locust_total"]
    if lt_:
        L.append(f"* Locust counted {lt_['requests']:,} requests and {lt_['failures']:,} failures (429s are not failures).")
    if f["locust_cpu_warnings"]:
        L.append(f"* Locust warned of its CPU {f['locust_cpu_warnings']} time(s): its latencies are inflated.")
    if f["gateway_log_problems"]:
        L.append(f"* The gateways logged {f['gateway_log_problems']} WARN/ERROR line(s); the first:")
        L.append("")
        L.append("  ```")
        for line in f["gateway_log_problem_lines"]:
            L.append(f"  {line[:400]}")
        L.append("  ```")
    else:
        L.append("* The gateways logged no WARN/ERROR line.")
    L.append("")
    L.append("![tokens per second per tenant](llm-tenants.png)")
    L.append("")
    with open(os.path.join(run_dir, "report.md"), "w") as fh:
        fh.write("\n".join(L))


# ------------------------------------------------------------------ plot


def moving_avg(vals, k):
    out, acc = [], 0.0
    for i, v in enumerate(vals):
        acc += v
        if i >= k:
            acc -= vals[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot(run_dir, meta, f, series):
    plt = pyplot()
    nb = series["nb"]
    x = list(range(nb))
    r, bound = meta["refill"], f["bound_window"]
    fig, axes = plt.subplots(3, 1, figsize=(12, 11), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 2]})

    ax = axes[0]
    for name in TENANTS:
        tok = series["tokens"][name]
        ax.plot(x, tok, color=COLORS[name], lw=0.6, alpha=0.35)
        ax.plot(x, moving_avg(tok, 10), color=COLORS[name], lw=2.0,
                label=f"{name} ({f['tenants'][name]['role']}): 10 s average")
    ax.axhline(r, color="black", ls="--", lw=1.2, label=f"budget: r = {fmt_num(r)} tokens/s per tenant")
    ax.set_ylabel("tokens per second (upstream-reported)")
    ax.set_title("Tokens per second per tenant (thin: each second; thick: 10 s average)")
    ax.set_yscale("symlog", linthresh=100)
    ax.set_ylim(0, None)

    ax = axes[1]
    for name in TENANTS:
        ax.plot(x, series["trailing"][name], color=COLORS[name], lw=1.6, label=name)
    ax.axhline(bound, color="black", ls="--", lw=1.2, label=f"bound C + r·{WINDOW_SECS} = {bound:,.0f}")
    ax.axhline(r * WINDOW_SECS, color="grey", ls=":", lw=1.2, label=f"r·{WINDOW_SECS} = {r * WINDOW_SECS:,.0f} (the steady budget)")
    ax.set_ylabel(f"tokens in the last {WINDOW_SECS} s")
    ax.set_ylim(0, bound * 1.12)

    ax = axes[2]
    nan = float("nan")
    k = REQ_BIN_SECS
    xb = [i * k + k / 2 for i in range((nb + k - 1) // k)]

    def binned(vals):
        out = [sum(vals[i:i + k]) / min(k, len(vals) - i) for i in range(0, len(vals), k)]
        return [v if v else nan for v in out]

    for name in TENANTS:
        ax.plot(xb, binned(series["admitted"][name]), color=COLORS[name], lw=1.4, marker="o", ms=3,
                label=f"{name} admitted/s")
        ref = series["refused"][name]
        if any(ref):
            ax.plot(xb, binned(ref), color=COLORS[name], lw=1.0, ls="--", marker="x", ms=3, label=f"{name} 429/s")
    ax.set_yscale("log")
    ax.set_ylabel(f"requests per second ({k} s bins, by start)")
    ax.set_xlabel("seconds since the load started")

    for a in axes:
        a.grid(alpha=0.3, which="both")
        a.set_xlim(0, nb - 1)
        a.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        f"Three tenants sharing an LLM upstream: token bucket per tenant C = {meta['capacity']:,}, "
        f"r = {fmt_num(r)}/s (cost = response)"
    )
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "llm-tenants.png"), 100)


# ------------------------------------------------------------------ check


def check(run_dir):
    problems = []
    try:
        s = files.load_json(os.path.join(run_dir, "summary.json"))
        for name in TENANTS:
            x = s["tenants"][name]
            for k in ("requests", "admitted", "refused_429", "failed", "tokens_reported", "tokens_max_window",
                      "bound_window", "held"):
                if k not in x:
                    problems.append(f"summary.json: tenants.{name}.{k} missing")
            if not x.get("requests"):
                problems.append(f"summary.json: tenant {name} sent no requests")
        if "acceptance" not in s:
            problems.append("summary.json: acceptance missing")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"summary.json: {e}")
    md = read_text(os.path.join(run_dir, "report.md"))
    if "| tenant | requests sent |" not in md or "## Acceptance" not in md:
        problems.append("report.md: the table or the acceptance points are missing")
    problems += files.png_problems(run_dir, PNGS, min_size=10_000, bad="not a PNG", missing="missing")
    for name in ("requests.csv", "locust_stats.csv", "clock.json", "started"):
        if not os.path.exists(os.path.join(run_dir, "locust", name)):
            problems.append(f"locust/{name}: missing")
    if not os.path.exists(os.path.join(run_dir, "upstream-llm.json")):
        problems.append("upstream-llm.json: missing")
    return problems


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(prog="llm_tenants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("--out", required=True)
    c.add_argument("--replicas", type=int, default=1)
    c.add_argument("--proxy-ports", required=True)
    c.add_argument("--admin-ports", required=True)
    c.add_argument("--redis-url", required=True)
    c.add_argument("--upstream", required=True)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--redis-timeout-ms", type=int, default=50)
    c.add_argument("--leases", choices=("on", "off"), default="on")
    c.add_argument("--capacity", type=int, default=20000)
    c.add_argument("--refill", type=float, default=333)
    c.add_argument("--default-estimate", type=int, default=256)
    c.add_argument("--max", type=int, default=4096)
    c.add_argument("--noisy-users", type=int, default=14)
    c.add_argument("--quiet-users", type=int, default=3)
    c.add_argument("--noisy-max-tokens", type=int, default=2000)
    c.add_argument("--quiet-max-tokens", type=int, default=256)
    for cmd in ("report", "check"):
        sub.add_parser(cmd).add_argument("run_dir")
    a = ap.parse_args()
    if a.cmd == "config":
        make_config(a)
        return 0
    if a.cmd == "check":
        return files.report_problems(check(a.run_dir), "check")
    meta = files.read_meta(a.run_dir, die)
    f, series = analyse(a.run_dir, meta)
    verdicts = acceptance(f, meta)
    summary = dict(f, generated_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), run=meta,
                   acceptance=[{"point": t, "passed": ok, "value": v} for t, ok, v in verdicts],
                   passed=all(ok for _t, ok, _v in verdicts))
    files.write_json(os.path.join(a.run_dir, "summary.json"), summary)
    write_report(a.run_dir, meta, f, verdicts)
    plot(a.run_dir, meta, f, series)
    print("\n".join(main_table(f)))
    for t, ok, v in verdicts:
        print(f"{'PASS' if ok else 'FAIL'}  {t}: {v}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
