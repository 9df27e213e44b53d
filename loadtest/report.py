#!/usr/bin/env python3
"""Turns a surge run's records into summary.json, report.md and plots.

    report.py RUN_DIR            analyse RUN_DIR (written by loadtest/surge.sh)
    report.py RUN_DIR --check    only validate RUN_DIR's summary.json, report.md
                                 and PNGs (the smoke test's check)

RUN_DIR holds run.json (the run's parameters) and phases/<phase>/ for each of
"unprotected" and "protected": requests-*.csv (one row per request, written by
locustfile.py), upstream.csv (the mock upstream's counters each second) and
Locust's own CSVs.

Every figure is taken over the phase's steady window: from the end of the
ramp-up plus a settling time to the end of the phase, by completion time.
Latencies are Locust's response times (client side, connection to last byte).

Exit status: 0 when the analysis is written and, unless --no-acceptance, every
acceptance point holds; 1 when an acceptance point fails; 2 on bad input.
"""

import argparse
import functools
import glob
import math
import os
import re
import sys
import time

from lt import files, metrics, stats, tables
from lt.plots import pyplot, save_png
from lt.stats import percentile

PHASES = ("unprotected", "protected")
PHASE_KEYS = (
    "requests",
    "rps",
    "p50_ms",
    "p95_ms",
    "p99_ms",
    "failure_pct",
    "rejected_pct",
    "avg_429_ms",
    "p99_admitted_ms",
    "upstream_rps",
    "upstream_capacity_rps",
)
# The published figures for the same scenario (the seeds' table).
PUBLISHED = {
    "unprotected": {"p99": "40 s", "failures": "20%", "share_429": "-", "avg_429": "-", "upstream": "378 / ~150 rps"},
    "protected": {"p99": "590 ms (admitted)", "failures": "0.1%", "share_429": "-", "avg_429": "2 ms", "upstream": "105 / ~150 rps"},
}
PNGS = ("latency.png", "upstream.png", "outcomes.png")


die = functools.partial(files.die, "report.py")


# ---------------------------------------------------------------- reading


def read_requests(phase_dir):
    """Rows (start_t, done_t, kind, status, ms, name) of every request."""
    def row(r):
        t, ms = float(r["t"]), float(r["ms"])
        return (t, t + ms / 1000.0, r["kind"], int(r["status"]), ms, r["name"])

    rows = []
    for path in sorted(glob.glob(os.path.join(phase_dir, "requests-*.csv"))):
        rows += files.read_csv(path, row)
    return rows


def read_upstream(phase_dir):
    return files.read_csv(
        os.path.join(phase_dir, "upstream.csv"), lambda r: (float(r["t"]), int(r["total"]), int(r["ok"]), int(r["failed"]))
    )


def read_locust_totals(phase_dir):
    """Locust's own whole-phase Aggregated row, for cross-checking."""
    r = files.locust_aggregated(phase_dir)
    if r is None:
        return None

    def num(k):
        try:
            return round(float(r[k]), 3)
        except (KeyError, ValueError):
            return None

    return {
        "requests": int(num("Request Count") or 0),
        "failures": int(num("Failure Count") or 0),
        "rps": num("Requests/s"),
        "avg_ms": num("Average Response Time"),
        "p50_ms": num("50%"),
        "p95_ms": num("95%"),
        "p99_ms": num("99%"),
        "max_ms": num("Max Response Time"),
    }


def read_text(path):
    return files.read_text(path).strip() or None


def locust_cpu_warnings(phase_dir):
    path = os.path.join(phase_dir, "locust.log")
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as f:
        return sum(1 for line in f if "CPU usage" in line or "cpu threshold" in line)


# ---------------------------------------------------------------- maths


def rnd(x, nd=3):
    return stats.rnd(x, nd)


def analyse_phase(name, phase_dir, meta):
    rows = read_requests(phase_dir)
    if not rows:
        die(f"{phase_dir}: no requests recorded")
    t0 = min(r[0] for r in rows)
    t_end = max(r[1] for r in rows)
    ramp = meta["users"] / max(meta["spawn_rate"], 1e-9)
    w_start = t0 + ramp + meta.get("settle_secs", 5)
    if t_end - w_start < 1.0:  # too short a run for a steady window: use it all
        w_start = t0
    win = [r for r in rows if w_start <= r[1] <= t_end]
    dur = max(t_end - w_start, 1e-3)
    n = len(win)
    all_ms = sorted(r[4] for r in win)
    admitted = sorted(r[4] for r in win if r[2] != "rejected")
    rejected = sorted(r[4] for r in win if r[2] == "rejected")
    failed = sum(1 for r in win if r[2] == "failed")
    ok = sum(1 for r in win if r[2] == "ok")
    statuses = {}
    for r in win:
        statuses[str(r[3])] = statuses.get(str(r[3]), 0) + 1

    up = read_upstream(phase_dir)
    up_win = [s for s in up if w_start <= s[0] <= t_end]
    upstream = {"rps": None, "ok_rps": None, "failed_rps": None, "peak_1s_rps": None}
    if len(up_win) >= 2 and up_win[-1][0] > up_win[0][0]:
        span = up_win[-1][0] - up_win[0][0]
        upstream["rps"] = (up_win[-1][1] - up_win[0][1]) / span
        upstream["ok_rps"] = (up_win[-1][2] - up_win[0][2]) / span
        upstream["failed_rps"] = (up_win[-1][3] - up_win[0][3]) / span
        upstream["peak_1s_rps"] = max(
            (b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(up_win, up_win[1:]) if b[0] > a[0]
        )

    summary = {
        "requests": n,
        "rps": rnd(n / dur, 1),
        "p50_ms": rnd(percentile(all_ms, 50)),
        "p95_ms": rnd(percentile(all_ms, 95)),
        "p99_ms": rnd(percentile(all_ms, 99)),
        "failure_pct": rnd(100.0 * failed / n if n else 0.0),
        "rejected_pct": rnd(100.0 * len(rejected) / n if n else 0.0),
        "avg_429_ms": rnd(sum(rejected) / len(rejected)) if rejected else None,
        "p99_admitted_ms": rnd(percentile(admitted, 99)),
        "upstream_rps": rnd(upstream["rps"], 1),
        "upstream_capacity_rps": meta["capacity_rps"],
        # Beyond the contract's keys:
        "avg_ms": rnd(sum(all_ms) / n) if n else None,
        "max_ms": rnd(all_ms[-1]) if all_ms else None,
        "p50_admitted_ms": rnd(percentile(admitted, 50)),
        "p95_admitted_ms": rnd(percentile(admitted, 95)),
        "p50_429_ms": rnd(percentile(rejected, 50)),
        "p99_429_ms": rnd(percentile(rejected, 99)),
        "max_429_ms": rnd(rejected[-1]) if rejected else None,
        "ok_rps": rnd(ok / dur, 1),
        "failures": failed,
        "rejected": len(rejected),
        "statuses": dict(sorted(statuses.items())),
        "upstream_ok_rps": rnd(upstream["ok_rps"], 1),
        "upstream_failed_rps": rnd(upstream["failed_rps"], 1),
        "upstream_peak_1s_rps": rnd(upstream["peak_1s_rps"], 1),
        "window": {
            "start_offset_secs": rnd(w_start - t0, 1),
            "secs": rnd(dur, 1),
            "ramp_secs": rnd(ramp, 1),
        },
        "locust_totals": read_locust_totals(phase_dir),
        "locust_cpu_warnings": locust_cpu_warnings(phase_dir),
        "loadavg_before": read_text(os.path.join(phase_dir, "loadavg-before")),
        "loadavg_after": read_text(os.path.join(phase_dir, "loadavg-after")),
    }
    series = time_series(rows, up, t0, t_end)
    series["window_start"] = w_start - t0
    return summary, series


def time_series(rows, up, t0, t_end):
    """Per-second bins (by completion time) since the phase's first request."""
    nbins = int(math.ceil(t_end - t0)) + 1
    bins = [[] for _ in range(nbins)]
    for r in rows:
        i = int(r[1] - t0)
        if 0 <= i < nbins:
            bins[i].append(r)
    s = {"t": [], "p50": [], "p99": [], "adm_p50": [], "adm_p99": [], "rej_avg": [], "ok": [], "rejected": [], "failed": []}
    for i, b in enumerate(bins):
        all_ms = sorted(r[4] for r in b)
        adm = sorted(r[4] for r in b if r[2] != "rejected")
        rej = [r[4] for r in b if r[2] == "rejected"]
        s["t"].append(i + 0.5)
        s["p50"].append(percentile(all_ms, 50))
        s["p99"].append(percentile(all_ms, 99))
        s["adm_p50"].append(percentile(adm, 50))
        s["adm_p99"].append(percentile(adm, 99))
        s["rej_avg"].append(sum(rej) / len(rej) if rej else None)
        s["ok"].append(sum(1 for r in b if r[2] == "ok"))
        s["rejected"].append(len(rej))
        s["failed"].append(sum(1 for r in b if r[2] == "failed"))
    s["up_t"], s["up_rps"] = [], []
    for a, b in zip(up, up[1:]):
        if b[0] > a[0]:
            s["up_t"].append((a[0] + b[0]) / 2 - t0)
            s["up_rps"].append((b[1] - a[1]) / (b[0] - a[0]))
    return s


# ---------------------------------------------------------------- output


def fmt_ms(x):
    if x is None:
        return "-"
    if x >= 1000:
        return f"{x / 1000:.2f} s"
    if x >= 100:
        return f"{x:.0f} ms"
    if x >= 10:
        return f"{x:.1f} ms"
    return f"{x:.2f} ms"


def fmt_pct(x):
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    if x < 0.1:
        return f"{x:.3f}%"
    return f"{x:.1f}%" if x < 10 else f"{x:.0f}%"


def acceptance(ph):
    u, p = ph["unprotected"], ph["protected"]
    cap = p["upstream_capacity_rps"]

    def le(a, b):
        return a is not None and b is not None and a <= b

    checks = [
        (
            "unprotected: the upstream is overloaded (non-429 failures >= 5%)",
            u["failure_pct"] is not None and u["failure_pct"] >= 5.0,
            f"{fmt_pct(u['failure_pct'])} failures, upstream at {u['upstream_rps']} rps against {cap}",
        ),
        (
            "protected: the upstream at or under its capacity",
            le(p["upstream_rps"], cap),
            f"{p['upstream_rps']} rps against {cap} (busiest second {p['upstream_peak_1s_rps']})",
        ),
        (
            "protected: non-429 failures <= 0.5%",
            le(p["failure_pct"], 0.5),
            f"{fmt_pct(p['failure_pct'])} ({p['failures']} of {p['requests']})",
        ),
        (
            "protected: 429s answered in <= 2 ms on average (as Locust measures)",
            le(p["avg_429_ms"], 2.0),
            f"avg {fmt_ms(p['avg_429_ms'])}, p99 {fmt_ms(p['p99_429_ms'])}, over {p['rejected']} 429s",
        ),
        (
            "protected: admitted p99 at most a fifth of the unprotected p99",
            le(p["p99_admitted_ms"], (u["p99_ms"] or 0) / 5.0),
            f"{fmt_ms(p['p99_admitted_ms'])} against {fmt_ms(u['p99_ms'])} / 5 = {fmt_ms((u['p99_ms'] or 0) / 5.0)}",
        ),
    ]
    return checks


def table(ph):
    header = ("Phase", "Requests", "Median", "p95", "p99", "p99 admitted", "rps", "Failures (non-429)", "429 share",
              "429 latency (avg)", "Upstream rps / capacity")
    rows = []
    labels = {"unprotected": "Unprotected (straight to the service)", "protected": "Protected (3 gateways + Redis)"}
    for name in PHASES:
        s = ph[name]
        ratio = ""
        if s["upstream_rps"] is not None and s["upstream_capacity_rps"]:
            ratio = f" ({s['upstream_rps'] / s['upstream_capacity_rps']:.2f}x)"
        rows.append((
            labels[name], f"{s['requests']:,}", fmt_ms(s["p50_ms"]), fmt_ms(s["p95_ms"]), fmt_ms(s["p99_ms"]),
            fmt_ms(s["p99_admitted_ms"]), f"{s['rps']:.0f}", fmt_pct(s["failure_pct"]), fmt_pct(s["rejected_pct"]),
            fmt_ms(s["avg_429_ms"]),
            f"{'-' if s['upstream_rps'] is None else s['upstream_rps']} / {s['upstream_capacity_rps']:g}{ratio}",
        ))
    return "\n".join(tables.table(header, "l" + "r" * 10, rows)) + "\n"


def published_table():
    u, p = PUBLISHED["unprotected"], PUBLISHED["protected"]
    rows = [
        ("No limiter", u["p99"], u["failures"], "-", u["upstream"]),
        ("Redis Lua token bucket per rider (20, 10/s)", p["p99"], p["failures"], p["avg_429"], p["upstream"]),
    ]
    return "\n".join(tables.table(
        ("Published (same scenario)", "p99", "Failures", "429 latency (avg)", "Service rps / capacity"), "lrrrr", rows
    )) + "\n"


def write_report(run_dir, meta, ph, checks, gateway_notes):
    u, p = ph["unprotected"], ph["protected"]
    lines = []
    lines.append(f"# Concert surge: before/after ({meta.get('mode', 'run')})\n")
    desc = (
        f"Run {os.path.basename(os.path.abspath(run_dir))} on {meta.get('cpus', '?')} CPU(s): "
        f"{meta['users']} riders (spawned at {meta['spawn_rate']:g}/s), {meta['run_secs']} s per phase; "
        f"the matching service serves {meta['capacity_rps']:g} rps"
    )
    if meta.get("max_queue_ms"):
        desc += f" (the mock upstream: it fails a request with 503 once it would queue over {meta['max_queue_ms']} ms)"
    desc += f". Protected: {meta.get('replicas', '?')} gateway replicas sharing one Redis"
    if meta.get("budgets"):
        desc += (
            f"; global route budgets {meta['budgets']} rps (ride-request/fare-estimate/nearby-drivers, "
            f"sum {meta.get('budget_sum', '?')}, {meta.get('share_pct', '?')}% of capacity) and a token bucket "
            f"per rider (capacity 20, refill 10/s)"
        )
    lines.append(desc + ".\n")
    lines.append(
        f"Figures cover each phase's steady window (from {u['window']['start_offset_secs']:g} s / "
        f"{p['window']['start_offset_secs']:g} s after its first request, i.e. after the ramp-up and "
        f"{meta.get('settle_secs', 5):g} s of settling, to its end). Latencies are Locust's, client side. "
        "Failures exclude 429s; 429 share is of all requests; upstream rps counts every request the "
        "service received (served or failed).\n"
    )
    lines.append(table(ph))
    lines.append(
        f"Goodput (2xx answers per second): unprotected {u['ok_rps']}, protected {p['ok_rps']}. "
        f"Upstream failed (503) per second: unprotected {u['upstream_failed_rps']}, protected {p['upstream_failed_rps']}.\n"
    )
    lines.append(published_table())
    lines.append("## Acceptance\n")
    if checks is None:
        lines.append("Not judged for a smoke run.\n")
    else:
        for title, ok, detail in checks:
            lines.append(f"- [{'x' if ok else ' '}] {'PASS' if ok else 'FAIL'} {title}: {detail}")
        lines.append("")
    lines.append("## Notes\n")
    for name in PHASES:
        lt = ph[name]["locust_totals"]
        if lt:
            lines.append(
                f"- {name}: Locust's own totals over the whole phase (ramp-up included): {lt['requests']:,} requests, "
                f"{lt['failures']:,} failures, median {fmt_ms(lt['p50_ms'])}, p99 {fmt_ms(lt['p99_ms'])}, {lt['rps']} rps."
            )
        w = ph[name]["locust_cpu_warnings"]
        if w:
            lines.append(f"- {name}: Locust warned {w} time(s) about its own CPU usage: its latencies may be inflated.")
        lines.append(f"- {name}: statuses in the window: {ph[name]['statuses']}")
        la = ph[name].get("loadavg_before")
        if la:
            lines.append(
                f"- {name}: load average before the phase {la} (1/5/15 min, {meta.get('cpus', '?')} CPUs), "
                f"after {ph[name].get('loadavg_after')}; a load above half the CPUs before a phase means "
                "something else was running and the latencies are inflated."
            )
    for note in gateway_notes:
        lines.append(f"- {note}")
    lines.append("")
    lines.append("## Plots\n")
    lines.append("![latency over time](latency.png)\n")
    lines.append("![upstream rps against capacity](upstream.png)\n")
    lines.append("![outcomes per second](outcomes.png)\n")
    lines.append(
        "Files: `summary.json` (these figures), `phases/<phase>/locust_*.csv` and `locust.html` (Locust's own), "
        "`phases/<phase>/requests-*.csv` (every request), `phases/<phase>/upstream.csv` (the service's counters "
        "each second), `config/` (the generated gateway configs), `logs/` (servers' logs, gateway metrics).\n"
    )
    with open(os.path.join(run_dir, "report.md"), "w") as f:
        f.write("\n".join(lines))


def plots(run_dir, meta, series):
    plt = pyplot()

    colors = {"unprotected": "#d62728", "protected": "#1f77b4"}

    def clean(xs, ys):
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    # Latency over time, both phases.
    fig, ax = plt.subplots(figsize=(10, 5.5))
    u, p = series["unprotected"], series["protected"]
    ax.plot(*clean(u["t"], u["p99"]), color=colors["unprotected"], lw=2, label="unprotected p99")
    ax.plot(*clean(u["t"], u["p50"]), color=colors["unprotected"], lw=1, ls="--", label="unprotected median")
    ax.plot(*clean(p["t"], p["adm_p99"]), color=colors["protected"], lw=2, label="protected p99 (admitted)")
    ax.plot(*clean(p["t"], p["adm_p50"]), color=colors["protected"], lw=1, ls="--", label="protected median (admitted)")
    ax.plot(*clean(p["t"], p["rej_avg"]), color="#2ca02c", lw=1, label="protected 429s (average)")
    ax.axvspan(0, max(u["window_start"], p["window_start"]), color="0.9", label="ramp-up + settling (not in the table)")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the phase's first request")
    ax.set_ylabel("response time (ms, log scale)")
    ax.set_title(f"Concert surge: latency per second, {meta['users']} riders")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "latency.png"), 110)

    # Upstream rps against its capacity.
    fig, ax = plt.subplots(figsize=(10, 5))
    for name in PHASES:
        s = series[name]
        ax.plot(s["up_t"], s["up_rps"], color=colors[name], lw=1.8, label=f"{name}: requests reaching the service")
    ax.axhline(meta["capacity_rps"], color="k", ls="--", lw=1.2, label=f"service capacity ({meta['capacity_rps']:g} rps)")
    ax.set_xlabel("seconds since the phase's first request")
    ax.set_ylabel("requests per second at the upstream")
    ax.set_title("The matching service: load received against its capacity")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(0, max([meta["capacity_rps"] * 1.3] + [max(series[n]["up_rps"] or [0]) * 1.25 for n in PHASES]))
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "upstream.png"), 110)

    # What the riders got, per second.
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=False)
    for ax, name in zip(axes, PHASES):
        s = series[name]
        ax.stackplot(
            s["t"],
            s["ok"],
            s["failed"],
            s["rejected"],
            labels=["2xx", "failed (5xx, errors)", "429 rejected"],
            colors=["#2ca02c", "#d62728", "#ff7f0e"],
            alpha=0.8,
        )
        ax.set_title(f"{name}: answers per second")
        ax.set_xlabel("seconds since the phase's first request")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "outcomes.png"), 110)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def read_metrics(path):
    """[(name, {label: value}, number)] of one Prometheus text dump."""
    return list(metrics.samples(files.read_text(path)))


def gateway_notes(run_dir):
    """What the gateways' logs and /metrics (taken after the run) say."""
    notes = []
    logs = sorted(glob.glob(os.path.join(run_dir, "logs", "gateway-[0-9]*.log")))
    for path in logs:
        with open(path, errors="replace") as f:
            lines = [ANSI.sub("", l).rstrip() for l in f if l.strip()]
        interesting = [l for l in lines if any(w in l for w in ("WARN", "ERROR", "panick"))]
        if interesting:
            notes.append(
                f"{os.path.basename(path)}: {len(interesting)} warning/error line(s) with GATEWAY_LOG=warn "
                f"(lines at the very end of the protected phase are Locust closing its connections); "
                f"first: `{interesting[0][:240]}`"
            )
    dumps = sorted(glob.glob(os.path.join(run_dir, "logs", "metrics-gw*.txt")))
    rejected_by_tier, statuses, per_replica = {}, {}, []
    redis_sum = redis_count = 0.0
    for path in dumps:
        served = 0
        for name, labels, v in read_metrics(path):
            if name == "gateway_ratelimit_decisions_total" and labels.get("decision") == "rejected":
                t = labels.get("tier", "?")
                rejected_by_tier[t] = rejected_by_tier.get(t, 0) + int(v)
            elif name == "gateway_requests_total":
                st = labels.get("status", "?")
                statuses[st] = statuses.get(st, 0) + int(v)
                served += int(v)
            elif name == "gateway_redis_call_duration_seconds_sum":
                redis_sum += v
            elif name == "gateway_redis_call_duration_seconds_count":
                redis_count += v
            elif name == "gateway_fallback_transitions_total" and labels.get("to") == "local" and v > 0:
                notes.append(f"{os.path.basename(path)}: fell back to local limiting {int(v)} time(s) during the run")
        per_replica.append(served)
    if dumps:
        notes.append(
            f"gateway metrics, all replicas: answers by status {dict(sorted(statuses.items()))}; "
            f"rejections by tier {dict(sorted(rejected_by_tier.items())) or '{}'}; requests per replica {per_replica}"
            + (f"; mean Redis call {1000 * redis_sum / redis_count:.2f} ms over {int(redis_count):,} calls" if redis_count else "")
        )
    if logs and not any("warning/error" in n for n in notes):
        notes.append("gateway logs (GATEWAY_LOG=warn): no warnings or errors.")
    return notes


# ---------------------------------------------------------------- check


def check(run_dir):
    """Validates the outputs' shape; returns a list of problems."""
    problems = []
    try:
        summary = files.load_json(os.path.join(run_dir, "summary.json"))
    except (OSError, ValueError) as e:
        return [f"summary.json: {e}"]
    phases = summary.get("phases", {})
    for name in PHASES:
        ph = phases.get(name)
        if not isinstance(ph, dict):
            problems.append(f"summary.json: phases.{name} missing")
            continue
        for k in PHASE_KEYS:
            if k not in ph:
                problems.append(f"summary.json: phases.{name}.{k} missing")
                continue
            v = ph[k]
            nullable = k == "avg_429_ms" and name == "unprotected"
            if v is None and nullable:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                problems.append(f"summary.json: phases.{name}.{k} = {v!r} is not a number >= 0")
        if isinstance(ph.get("requests"), int) and ph["requests"] <= 0:
            problems.append(f"summary.json: phases.{name}.requests is 0")
    prot = phases.get("protected") or {}
    if isinstance(prot.get("statuses"), dict) and not any(k.startswith("2") for k in prot["statuses"]):
        problems.append("protected phase: no 2xx answer came through the gateways")
    if isinstance(prot.get("statuses"), dict) and set(prot["statuses"]) - {"200", "429"}:
        problems.append(f"protected phase: unexpected statuses {prot['statuses']}")
    try:
        with open(os.path.join(run_dir, "report.md")) as f:
            md = f.read()
        for needle in ("| Phase |", "| Unprotected", "| Protected", "latency.png", "upstream.png"):
            if needle not in md:
                problems.append(f"report.md: missing {needle!r}")
    except OSError as e:
        problems.append(f"report.md: {e}")
    return problems + files.png_problems(run_dir, PNGS, min_size=2000)


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--check", action="store_true", help="only validate the outputs already in RUN_DIR")
    ap.add_argument("--no-acceptance", action="store_true", help="do not judge the acceptance points (smoke runs)")
    a = ap.parse_args()

    if a.check:
        return files.report_problems(check(a.run_dir), "smoke check")

    meta = files.read_meta(a.run_dir, die)
    phases, series = {}, {}
    for name, phase_dir in files.parts(a.run_dir, "phases", PHASES, die):
        phases[name], series[name] = analyse_phase(name, phase_dir, meta)

    checks = None if a.no_acceptance else acceptance(phases)
    notes = gateway_notes(a.run_dir)
    summary = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": meta,
        "phases": phases,
        "acceptance": None
        if checks is None
        else {"passed": all(c[1] for c in checks), "checks": [{"check": t, "passed": ok, "detail": d} for t, ok, d in checks]},
        "gateway_notes": notes,
    }
    files.write_json(os.path.join(a.run_dir, "summary.json"), summary)
    write_report(a.run_dir, meta, phases, checks, notes)
    plots(a.run_dir, meta, series)

    print(table(phases))
    if checks is not None:
        for title, ok, detail in checks:
            print(f"{'PASS' if ok else 'FAIL'}  {title}: {detail}")
        if not all(c[1] for c in checks):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
