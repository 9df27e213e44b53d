#!/usr/bin/env python3
"""The report of loadtest/capacity_halves.sh: summary.json,
report.md and the plots.

    capacity_halves.py report RUN_DIR   analyse RUN_DIR, write the outputs
    capacity_halves.py check RUN_DIR    validate the outputs already there

RUN_DIR holds run.json (the parameters) and runs/<run>/ for "rate_only" and
"adaptive", each with requests.csv and timeline.csv (written by
capacity_halves_locustfile.py), `started` and `halved_at` (unix times) and
Locust's CSVs.

The figures, per run:
  * failures seen by clients, as a % of requests: 5xx that are not the
    gateway's own refusals (502/504 for the upstream), client timeouts and
    connection errors. The gateway's refusals (429, and 503 with a
    problem+json body) are counted apart, never as failures;
  * the upstream's concurrency after adaptation: the median of the mock's
    in_flight, sampled every 250 ms, over [halving + 5 s, end], and its
    distance from the workers count in %;
  * admitted (2xx) latency: p99 over the run, before the halving and after
    it, each against the upstream's unloaded latency then (its service time:
    100 ms, then 200 ms). Over the whole run the ratio is the p99 of each
    request's latency divided by the unloaded latency when it was sent;
  * requests, admitted, refused 429, refused 503, failures.

Targets (judged for the adaptive run, shown for both): failures <= 1 %;
upstream concurrency within 10 % of its workers; admitted p99 <= 2x the
unloaded latency (over the run, and after the halving).

Exit status: 0 when the outputs are written (check: when they are well
formed), 2 on bad input (check: 1 when something is missing).
"""

import argparse
import functools
import math
import os
import statistics
import sys
import time

from lt import files, metrics, tables
from lt.plots import pyplot, save_png
from lt.files import read_float, read_text
from lt.stats import percentile, rnd

RUNS = ("rate_only", "adaptive")
PNGS = ("capacity-halves.png", "latency.png")
ADAPT_SECS = 5.0
FAILURE_OUTCOMES = ("failed_5xx", "failed_timeout", "failed_conn", "failed_other")
TARGET_FAIL_PCT = 1.0
TARGET_CONC_PCT = 10.0
TARGET_P99_RATIO = 2.0


die = functools.partial(files.die, "capacity_halves.py")


# ------------------------------------------------------------------ reading


def read_requests(run_dir):
    rows = files.read_csv(
        os.path.join(run_dir, "requests.csv"), lambda r: (float(r["t"]), float(r["ms"]), int(r["status"]), r["outcome"])
    )
    rows.sort()
    return rows


def _number(v):
    try:
        return float(v) if v not in ("", None) else None
    except ValueError:
        return None


def read_timeline(run_dir):
    def row(r):
        out = {k: _number(v) for k, v in r.items()}
        return out if out.get("t") is not None else None

    return files.read_csv(os.path.join(run_dir, "timeline.csv"), row)


def read_locust_total(run_dir):
    r = files.locust_aggregated(run_dir)
    try:
        return None if r is None else {"requests": int(r["Request Count"]), "failures": int(r["Failure Count"])}
    except (KeyError, ValueError):
        return None


# ------------------------------------------------------------------ maths


def pct(a, b):
    return 100.0 * a / b if b else None


def analyse(name, run_dir, meta):
    rows = read_requests(run_dir)
    tl = read_timeline(run_dir)
    if not rows:
        die(f"{run_dir}: no requests recorded")
    t0 = read_float(os.path.join(run_dir, "started")) or rows[0][0]
    t_half = read_float(os.path.join(run_dir, "halved_at"))
    halved = t_half is not None
    if not halved:
        t_half = t0 + meta["halve_at_secs"]
    t_end = t0 + meta["run_secs"]
    if tl:
        t_end = min(t_end, tl[-1]["t"])
    t_end = max(t_end, rows[-1][0])
    svc0, svc1 = meta["service_ms"], meta["service_ms_after"]
    workers = meta["workers"]

    rows = [r for r in rows if t0 - 1 <= r[0] <= t_end]
    n = len(rows)
    counts = {}
    for r in rows:
        counts[r[3]] = counts.get(r[3], 0) + 1
    failures = sum(counts.get(k, 0) for k in FAILURE_OUTCOMES)
    adm = [r for r in rows if r[3] == "admitted"]
    adm_before = [r[1] for r in adm if r[0] < t_half]
    adm_after = [r[1] for r in adm if r[0] >= t_half]
    adm_adapted = [r[1] for r in adm if r[0] >= t_half + ADAPT_SECS]
    norm = [r[1] / (svc0 if r[0] < t_half else svc1) for r in adm]
    p99_all = percentile([r[1] for r in adm], 99)
    p99_before = percentile(adm_before, 99)
    p99_after = percentile(adm_after, 99)
    p99_adapted = percentile(adm_adapted, 99)

    after_fail = sum(1 for r in rows if r[0] >= t_half and r[3] in FAILURE_OUTCOMES)
    after_n = sum(1 for r in rows if r[0] >= t_half)

    # The upstream after adaptation.
    win = [s for s in tl if t_half + ADAPT_SECS <= s["t"] <= t_end]

    def med(key, samples=win):
        vals = [s[key] for s in samples if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    def series_stat(key, fn, samples=win):
        vals = [s[key] for s in samples if s.get(key) is not None]
        return fn(vals) if vals else None

    conc = med("mock_in_flight")
    conc_dev = None if conc is None else 100.0 * (conc - workers) / workers
    before = [s for s in tl if t0 + 5 <= s["t"] < t_half]

    def served_rps(samples):
        pts = [(s["t"], s["mock_ok"]) for s in samples if s.get("mock_ok") is not None]
        if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
            return None
        return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])

    dur = max(t_end - t0, 1e-3)
    figures = {
        "requests": n,
        "admitted": counts.get("admitted", 0),
        "refused_429": counts.get("refused_429", 0),
        "refused_503": counts.get("refused_503", 0),
        "failures": failures,
        "failures_by_kind": {k: counts.get(k, 0) for k in FAILURE_OUTCOMES},
        "failure_pct": rnd(pct(failures, n), 2),
        "failure_pct_after_halving": rnd(pct(after_fail, after_n), 2),
        "offered_rps": rnd(n / dur),
        "admitted_rps": rnd(counts.get("admitted", 0) / dur),
        "upstream_in_flight_median_after_adapt": conc,
        "upstream_in_flight_p90_after_adapt": series_stat("mock_in_flight", lambda v: percentile(v, 90)),
        "upstream_in_flight_max_after_adapt": series_stat("mock_in_flight", max),
        "upstream_waiting_median_after_adapt": med("mock_waiting"),
        "upstream_concurrency_dev_pct": rnd(conc_dev),
        "upstream_in_flight_median_before_halving": med("mock_in_flight", before),
        "upstream_served_rps_before_halving": rnd(served_rps(before)),
        "upstream_served_rps_after_adapt": rnd(served_rps(win)),
        "upstream_capacity_rps_before": round(workers * 1000.0 / svc0, 1),
        "upstream_capacity_rps_after": round(workers * 1000.0 / svc1, 1),
        "adaptive_limit_median_after_adapt": med("gw_limit"),
        "adaptive_limit_min_after_adapt": series_stat("gw_limit", min),
        "adaptive_limit_max_after_adapt": series_stat("gw_limit", max),
        "adaptive_limit_median_before_halving": med("gw_limit", before),
        "gateway_queued_median_after_adapt": med("gw_queued"),
        "rtt_min_ms_end": next((s["rtt_min_ms"] for s in reversed(tl) if s.get("rtt_min_ms") is not None), None),
        "p50_admitted_ms": rnd(percentile([r[1] for r in adm], 50)),
        "p99_admitted_ms": rnd(p99_all),
        "p99_admitted_ratio": rnd(percentile(norm, 99), 2),
        "p99_admitted_before_ms": rnd(p99_before),
        "p99_admitted_before_ratio": rnd(None if p99_before is None else p99_before / svc0, 2),
        "p99_admitted_after_ms": rnd(p99_after),
        "p99_admitted_after_ratio": rnd(None if p99_after is None else p99_after / svc1, 2),
        "p99_admitted_after_adapt_ms": rnd(p99_adapted),
        "p99_admitted_after_adapt_ratio": rnd(None if p99_adapted is None else p99_adapted / svc1, 2),
        "halved": halved,
        "halved_at_s": rnd(t_half - t0, 2),
        "window_s": rnd(t_end - t0, 2),
        "samples": len(tl),
        "samples_after_adapt": len(win),
        "locust_total": read_locust_total(run_dir),
        "locust_cpu_warnings": sum(
            1 for line in read_text(os.path.join(run_dir, "locust.log")).splitlines() if "CPU usage" in line
        ),
        "loadavg_before": read_text(os.path.join(run_dir, "loadavg-before")).strip() or None,
        "loadavg_after": read_text(os.path.join(run_dir, "loadavg-after")).strip() or None,
    }

    # Per-second series for the plots (by completion time).
    nb = int(math.ceil(t_end - t0)) + 1
    bins = {k: [0] * nb for k in ("admitted", "refused_429", "refused_503", "failures")}
    lat = [[] for _ in range(nb)]
    for t, ms, _st, oc in rows:
        i = int((t + ms / 1000.0) - t0)
        if not 0 <= i < nb:
            continue
        key = "failures" if oc in FAILURE_OUTCOMES else oc
        if key in bins:
            bins[key][i] += 1
        if oc == "admitted":
            lat[i].append(ms)
    series = {
        "t0": t0,
        "t_half": t_half - t0,
        "t_end": t_end - t0,
        "timeline": [dict(s, t=s["t"] - t0) for s in tl],
        "bins": bins,
        "p50": [percentile(v, 50) for v in lat],
        "p99": [percentile(v, 99) for v in lat],
    }
    return figures, series


def targets(f):
    """(title, passed, value) for one run's figures."""
    out = []
    fp = f["failure_pct"]
    out.append((f"failures <= {TARGET_FAIL_PCT:g}% of requests", fp is not None and fp <= TARGET_FAIL_PCT, f"{fp}%"))
    dev = f["upstream_concurrency_dev_pct"]
    out.append(
        (
            f"upstream concurrency within {TARGET_CONC_PCT:g}% of its workers after {ADAPT_SECS:g} s of adaptation",
            dev is not None and abs(dev) <= TARGET_CONC_PCT,
            f"median in_flight {f['upstream_in_flight_median_after_adapt']} ({dev:+.1f}%)" if dev is not None else "n/a",
        )
    )
    r = f["p99_admitted_ratio"]
    out.append(
        (
            f"admitted p99 <= {TARGET_P99_RATIO:g}x unloaded latency, whole run",
            r is not None and r <= TARGET_P99_RATIO,
            f"{r}x (p99 {f['p99_admitted_ms']} ms)",
        )
    )
    r = f["p99_admitted_after_ratio"]
    out.append(
        (
            f"admitted p99 <= {TARGET_P99_RATIO:g}x unloaded latency, after the halving",
            r is not None and r <= TARGET_P99_RATIO,
            f"{r}x (p99 {f['p99_admitted_after_ms']} ms vs 200)" if r is not None else "n/a",
        )
    )
    return out


# ------------------------------------------------------------------ report


def fmt(x, unit=""):
    if x is None:
        return "n/a"
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return f"{x}{unit}"


def table_rows(runs, meta):
    s0, s1 = meta["service_ms"], meta["service_ms_after"]
    w = meta["workers"]

    def both(fn):
        return [fn(runs[r]) for r in RUNS]

    def count(key):
        return lambda f: f"{f[key]:,} ({pct(f[key], f['requests']):.1f}%)" if f["requests"] else "0"

    return [
        ("requests", both(lambda f: f"{f['requests']:,} ({f['offered_rps']} rps)")),
        ("admitted (2xx)", both(count("admitted"))),
        ("refused 429 (rate limit)", both(count("refused_429"))),
        ("refused 503 (gateway, problem+json)", both(count("refused_503"))),
        (
            "**failures** (5xx / timeouts / conn. errors)",
            both(
                lambda f: f"**{f['failures']:,} ({fmt(f['failure_pct'], '%')})** "
                f"{f['failures_by_kind']['failed_5xx']}/{f['failures_by_kind']['failed_timeout']}/"
                f"{f['failures_by_kind']['failed_conn'] + f['failures_by_kind']['failed_other']}"
            ),
        ),
        ("failures after the halving", both(lambda f: fmt(f["failure_pct_after_halving"], "%"))),
        (
            f"**upstream in_flight, median after halving+{ADAPT_SECS:g} s** (workers {w})",
            both(
                lambda f: f"**{fmt(f['upstream_in_flight_median_after_adapt'])} ({f['upstream_concurrency_dev_pct']:+.1f}%)**"
                if f["upstream_concurrency_dev_pct"] is not None
                else "n/a"
            ),
        ),
        (
            "upstream in_flight p90 / max, same window",
            both(lambda f: f"{fmt(f['upstream_in_flight_p90_after_adapt'])} / {fmt(f['upstream_in_flight_max_after_adapt'])}"),
        ),
        ("upstream waiting (queued in it), median, same window", both(lambda f: fmt(f["upstream_waiting_median_after_adapt"]))),
        (
            "upstream served rps before / after (capacity "
            f"{runs['adaptive']['upstream_capacity_rps_before']:g} / {runs['adaptive']['upstream_capacity_rps_after']:g})",
            both(lambda f: f"{fmt(f['upstream_served_rps_before_halving'])} / {fmt(f['upstream_served_rps_after_adapt'])}"),
        ),
        (
            "adaptive limit before / after adaptation: median (min-max)",
            both(
                lambda f: "no cap"
                if f["adaptive_limit_median_after_adapt"] is None
                else f"{fmt(f['adaptive_limit_median_before_halving'])} / {fmt(f['adaptive_limit_median_after_adapt'])} "
                f"({fmt(f['adaptive_limit_min_after_adapt'])}-{fmt(f['adaptive_limit_max_after_adapt'])})"
            ),
        ),
        ("admitted p50, whole run", both(lambda f: fmt(f["p50_admitted_ms"], " ms"))),
        (
            f"**admitted p99, whole run** (÷ unloaded {s0}/{s1} ms)",
            both(lambda f: f"**{fmt(f['p99_admitted_ms'], ' ms')} ({fmt(f['p99_admitted_ratio'], 'x')})**"),
        ),
        (
            f"admitted p99 before the halving (÷ {s0} ms)",
            both(lambda f: f"{fmt(f['p99_admitted_before_ms'], ' ms')} ({fmt(f['p99_admitted_before_ratio'], 'x')})"),
        ),
        (
            f"**admitted p99 after the halving** (÷ {s1} ms)",
            both(lambda f: f"**{fmt(f['p99_admitted_after_ms'], ' ms')} ({fmt(f['p99_admitted_after_ratio'], 'x')})**"),
        ),
        (
            f"admitted p99 after halving+{ADAPT_SECS:g} s (÷ {s1} ms)",
            both(lambda f: f"{fmt(f['p99_admitted_after_adapt_ms'], ' ms')} ({fmt(f['p99_admitted_after_adapt_ratio'], 'x')})"),
        ),
    ]


def write_report(run_dir, meta, runs, verdicts):
    L = []
    L.append("# Capacity halves: rate limits alone vs adaptive concurrency")
    L.append("")
    L.append(
        f"{meta['users']} users, each looping `GET /api/rides/request` with {meta['think_min']:g}-{meta['think_max']:g} s "
        f"of think time and a {meta['client_timeout']:g} s client timeout, for {meta['run_secs']} s per run "
        f"(seed {meta['seed']}). Upstream: mock-upstream with {meta['workers']} workers at {meta['service_ms']} ms "
        f"({runs['adaptive']['upstream_capacity_rps_before']:g} rps); at {meta['halve_at_secs']:g} s its service time becomes "
        f"{meta['service_ms_after']} ms (capacity {runs['adaptive']['upstream_capacity_rps_after']:g} rps). Route limit: "
        f"global token bucket {meta['rate']:g}/s, burst {meta['burst']:g}, right for the first capacity and too high after. "
        f"`adaptive` adds `queue = {meta['queue']}`, `queue_timeout_ms = {meta['queue_timeout_ms']}`, "
        f"`adaptive = {{ enabled = true, min = {meta['adaptive_min']}, max = {meta['adaptive_max']} }}` on the upstream."
    )
    L.append("")
    L.append(f"Mode `{meta['mode']}`, {meta['cpus']} CPUs, commit {meta['git_commit']}, started {meta['started_at']}.")
    L.append("")
    L += tables.table(("", *RUNS), "lrr", [(title, *cells) for title, cells in table_rows(runs, meta)])
    L.append("")
    L.append("## Targets")
    L.append("")
    L.append("Judged on the adaptive run; rate_only's verdicts are for comparison.")
    L.append("")
    rows = []
    for i, (title, _ok, _v) in enumerate(verdicts["adaptive"]):
        cells = []
        for r in RUNS:
            _t, ok, v = verdicts[r][i]
            cells.append(f"{'PASS' if ok else 'FAIL'} {v}")
        rows.append((title, cells[0], f"**{cells[1]}**"))
    L += tables.table(("target", *RUNS), "lll", rows)
    L.append("")
    L.append("## Notes")
    L.append("")
    L.append(
        "* Failures are what a client sees go wrong: non-2xx answers other than the gateway's refusals "
        "(gateway 502/504, an upstream 503 without problem+json), client timeouts "
        f"({meta['client_timeout']:g} s) and connection errors, shown as 5xx/timeouts/other. The gateway's "
        "429s and problem+json 503s are refusals: answered at once, never sent upstream."
    )
    L.append(
        f"* The upstream's in_flight (waiting for a worker + being served) is sampled every 250 ms from its `/stats`; "
        f"the window is [halving + {ADAPT_SECS:g} s, end]. Unloaded latency = the mock's service time; "
        "the whole-run ratio is the p99 of each admitted request's latency over the service time when it was sent."
    )
    for r in RUNS:
        f = runs[r]
        lt = f["locust_total"]
        notes = [
            f"halving at {f['halved_at_s']} s" + ("" if f["halved"] else " (NOT recorded: assumed)"),
            f"{f['samples']} samples ({f['samples_after_adapt']} after adaptation)",
        ]
        if lt:
            notes.append(f"Locust counted {lt['requests']:,} requests, {lt['failures']:,} failures")
        if f["rtt_min_ms_end"] is not None:
            notes.append(f"learnt unloaded round trip at the end {f['rtt_min_ms_end']} ms")
        if f["gateway_queued_median_after_adapt"] is not None:
            notes.append(f"gateway queue median after adaptation {fmt(f['gateway_queued_median_after_adapt'])}")
        refusals = verdict_refusals(run_dir, r)
        if refusals:
            notes.append("gateway in-flight refusals by reason: " + ", ".join(f"{k} {v:,.0f}" for k, v in refusals.items()))
        notes.append(f"load average before {f['loadavg_before']}, after {f['loadavg_after']}")
        if f["locust_cpu_warnings"]:
            notes.append(f"Locust warned of its CPU {f['locust_cpu_warnings']} time(s): latencies inflated")
        L.append(f"* `{r}`: " + "; ".join(notes) + ".")
    L.append("")
    L.append("Plots: `capacity-halves.png` (upstream in_flight/waiting, the adaptive limit, outcomes per second), "
             "`latency.png` (admitted p50/p99 per second). Locust's own report: `runs/<run>/locust.html`.")
    L.append("")
    L.append("![capacity halves](capacity-halves.png)")
    L.append("")
    L.append("![latency](latency.png)")
    L.append("")
    with open(os.path.join(run_dir, "report.md"), "w") as fh:
        fh.write("\n".join(L))


def verdict_refusals(run_dir, r):
    """gateway_in_flight_refusals_total by reason, from the metrics at the end."""
    text = read_text(os.path.join(run_dir, "runs", r, "metrics-end.txt"))
    out = {}
    for name, labels, v in metrics.samples(text):
        if name == "gateway_in_flight_refusals_total":
            reason = labels.get("reason", "?")
            out[reason] = out.get(reason, 0) + v
    return out


# ------------------------------------------------------------------ plots


def plots(run_dir, meta, series):
    plt = pyplot()

    w = meta["workers"]
    fig, axes = plt.subplots(3, 2, figsize=(14, 10), sharex="col", sharey="row")
    for c, r in enumerate(RUNS):
        s = series[r]
        tl = s["timeline"]
        t = [x["t"] for x in tl]

        def col(key):
            return [x.get(key) if x.get(key) is not None else float("nan") for x in tl]

        ax = axes[0][c]
        ax.plot(t, col("mock_in_flight"), label="upstream in_flight", color="tab:blue", lw=1.2)
        ax.plot(t, col("mock_waiting"), label="upstream waiting", color="tab:orange", lw=1.0)
        ax.axhline(w, color="grey", ls=":", lw=1, label=f"workers ({w})")
        ax.set_title(r)
        ax.set_ylabel("requests held by the upstream")

        ax = axes[1][c]
        lim = col("gw_limit")
        if any(not math.isnan(v) for v in lim):
            ax.plot(t, lim, label="adaptive limit", color="tab:green", lw=1.4)
            ax.plot(t, col("gw_in_flight"), label="gateway in flight", color="tab:blue", lw=0.8, alpha=0.8)
            ax.plot(t, col("gw_queued"), label="gateway queued", color="tab:purple", lw=0.8, alpha=0.8)
        else:
            ax.text(0.5, 0.5, "no in-flight cap (rate limit only)", transform=ax.transAxes, ha="center", va="center")
        ax.axhline(w, color="grey", ls=":", lw=1)
        ax.set_ylabel("gateway in-flight cap")

        ax = axes[2][c]
        b = s["bins"]
        x = list(range(len(b["admitted"])))
        ax.plot(x, b["admitted"], label="admitted/s", color="tab:green", lw=1.2)
        ax.plot(x, b["refused_429"], label="refused 429/s", color="tab:orange", lw=1.0)
        ax.plot(x, b["refused_503"], label="refused 503/s (gateway)", color="tab:purple", lw=1.0)
        ax.plot(x, b["failures"], label="failures/s", color="tab:red", lw=1.4)
        ax.set_ylabel("per second")
        ax.set_xlabel("seconds since the load started")

        for row in axes:
            a = row[c]
            a.axvline(s["t_half"], color="black", ls="--", lw=1)
            a.axvline(s["t_half"] + ADAPT_SECS, color="black", ls=":", lw=0.8)
            a.set_xlim(0, s["t_end"])
            a.grid(alpha=0.3)
        axes[0][c].text(s["t_half"], 1.0, " capacity halves", transform=axes[0][c].get_xaxis_transform(), va="top", fontsize=8)
    for row in axes:
        for a in row:
            if a.get_legend_handles_labels()[0]:
                a.legend(loc="upper left", fontsize=8)
    fig.suptitle(
        f"Capacity halves at {meta['halve_at_secs']:g} s ({meta['workers']} workers, {meta['service_ms']} -> "
        f"{meta['service_ms_after']} ms): rate limit {meta['rate']:g}/s alone vs with adaptive concurrency"
    )
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "capacity-halves.png"), 90)

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    for c, r in enumerate(RUNS):
        s = series[r]
        ax = axes[c]
        x = list(range(len(s["p99"])))
        nan = float("nan")
        ax.plot(x, [v if v is not None else nan for v in s["p99"]], label="admitted p99", color="tab:red")
        ax.plot(x, [v if v is not None else nan for v in s["p50"]], label="admitted p50", color="tab:blue")
        th = s["t_half"]
        ax.plot([0, th, th, s["t_end"]], [meta["service_ms"], meta["service_ms"], meta["service_ms_after"], meta["service_ms_after"]],
                color="grey", ls=":", label="unloaded")
        ax.plot([0, th, th, s["t_end"]], [2 * meta["service_ms"], 2 * meta["service_ms"], 2 * meta["service_ms_after"],
                2 * meta["service_ms_after"]], color="black", ls=":", lw=0.8, label="2x unloaded (target)")
        ax.axvline(th, color="black", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_title(r)
        ax.set_xlabel("seconds since the load started (by completion)")
        ax.set_xlim(0, s["t_end"])
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("ms")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, os.path.join(run_dir, "latency.png"), 90)


# ------------------------------------------------------------------ check


def check(run_dir):
    problems = []
    try:
        s = files.load_json(os.path.join(run_dir, "summary.json"))
        for r in RUNS:
            f = s["runs"][r]
            for k in ("requests", "admitted", "refused_429", "refused_503", "failures", "failure_pct",
                      "upstream_in_flight_median_after_adapt", "p99_admitted_ms", "p99_admitted_after_ms"):
                if k not in f:
                    problems.append(f"summary.json: runs.{r}.{k} missing")
            if not f.get("requests"):
                problems.append(f"summary.json: runs.{r} has no requests")
            if not f.get("halved"):
                problems.append(f"summary.json: runs.{r}: the halving was not recorded")
            if not f.get("samples"):
                problems.append(f"summary.json: runs.{r}: no timeline samples")
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"summary.json: {e}")
    md = read_text(os.path.join(run_dir, "report.md"))
    if tables.row(("", *RUNS)) not in md or "## Targets" not in md:
        problems.append("report.md: the table or the targets are missing")
    problems += files.png_problems(run_dir, PNGS, bad="not a PNG", missing="missing")
    for r in RUNS:
        for name in ("locust_stats.csv", "locust_stats_history.csv", "requests.csv", "timeline.csv"):
            if not os.path.exists(os.path.join(run_dir, "runs", r, name)):
                problems.append(f"runs/{r}/{name}: missing")
    return problems


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("report", "check"))
    ap.add_argument("run_dir")
    a = ap.parse_args()
    if a.cmd == "check":
        return files.report_problems(check(a.run_dir), "check")
    meta = files.read_meta(a.run_dir, die)
    runs, series = {}, {}
    for r, d in files.parts(a.run_dir, "runs", RUNS, die):
        runs[r], series[r] = analyse(r, d, meta)
    verdicts = {r: targets(runs[r]) for r in RUNS}
    summary = {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": meta,
        "runs": runs,
        "targets": {
            r: [{"target": t, "passed": ok, "value": v} for t, ok, v in verdicts[r]] for r in RUNS
        },
        "adaptive_passed": all(ok for _t, ok, _v in verdicts["adaptive"]),
    }
    files.write_json(os.path.join(a.run_dir, "summary.json"), summary)
    write_report(a.run_dir, meta, runs, verdicts)
    plots(a.run_dir, meta, series)
    width = max(len(t) for t, _ in table_rows(runs, meta))
    print(f"{'':{width}}  {'rate_only':>28}  {'adaptive':>28}")
    for title, cells in table_rows(runs, meta):
        print(f"{title.replace('**', ''):{width}}  {cells[0].replace('**', ''):>28}  {cells[1].replace('**', ''):>28}")
    for t, ok, v in verdicts["adaptive"]:
        print(f"adaptive {'PASS' if ok else 'FAIL'}  {t}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
