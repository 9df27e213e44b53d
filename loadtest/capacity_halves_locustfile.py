"""Locust load for loadtest/capacity_halves.sh.

Every user loops over `GET /api/rides/request` with a short think time
(CH_THINK_MIN..CH_THINK_MAX seconds, seeded), against one gateway. A request
that takes longer than CH_TIMEOUT seconds is abandoned (the client hangs up)
and counted as a failure. Each answer is classified:

    admitted      2xx
    refused_429   429 (the gateway's rate limit)
    refused_503   503 with an application/problem+json body: the gateway's
                  own in-flight cap (queue full or queue timeout), never sent
                  upstream
    failed_5xx    any other non-2xx (502/504 from the gateway for the
                  upstream, a 503 without problem+json from the upstream)
    failed_timeout  no answer within CH_TIMEOUT
    failed_conn   any other connection error

Locust's own statistics see refusals as successes under the names
"... [429]" / "... [503 gateway]", so its failures are the real ones.

A sampler greenlet polls, every CH_SAMPLE_SECS (0.25), the mock upstream's
GET /stats and the gateway's GET /metrics and writes timeline.csv; it prints a
progress line every CH_PROGRESS_SECS (3).

Environment:
    CH_TARGET          the gateway's base URL (required)
    CH_OUT             folder for the records below (required)
    CH_RUN             run name for the progress lines
    CH_UPSTREAM        the mock upstream's base URL (for /stats)
    CH_ADMIN           the gateway's admin base URL (for /metrics)
    CH_SEED            random seed (think times), default 26
    CH_TIMEOUT         client timeout in seconds, default 3
    CH_THINK_MIN/MAX   think time bounds in seconds, default 0.2/0.4

Records written to CH_OUT:
    requests.csv   t (start, unix s), ms, status, outcome (above)
    timeline.csv   t, mock_in_flight, mock_waiting, mock_total, mock_ok,
                   mock_failed, service_ms, gw_limit, gw_in_flight, gw_queued,
                   rtt_min_ms, rtt_sample_ms, refusals_queue_full,
                   refusals_timeout, refusals_other
    started        the unix time the load started (written at test start)
"""

import csv
import json
import os
import random
import sys
import time
import urllib.request

import gevent
from locust import between, events, task
from locust.contrib.fasthttp import FastHttpUser

from lt import metrics
from lt.csvlog import CsvLog

TARGET = os.environ.get("CH_TARGET", "").rstrip("/")
OUT = os.environ.get("CH_OUT", "")
RUN = os.environ.get("CH_RUN", "run")
UPSTREAM = os.environ.get("CH_UPSTREAM", "").rstrip("/")
ADMIN = os.environ.get("CH_ADMIN", "").rstrip("/")
SEED = int(os.environ.get("CH_SEED", "26"))
TIMEOUT = float(os.environ.get("CH_TIMEOUT", "3"))
THINK_MIN = float(os.environ.get("CH_THINK_MIN", "0.2"))
THINK_MAX = float(os.environ.get("CH_THINK_MAX", "0.4"))
SAMPLE_SECS = float(os.environ.get("CH_SAMPLE_SECS", "0.25"))
PROGRESS_SECS = float(os.environ.get("CH_PROGRESS_SECS", "3"))
UPSTREAM_NAME = os.environ.get("CH_UPSTREAM_NAME", "matching")

NAME = "GET /api/rides/request"
TIMELINE_FIELDS = [
    "t",
    "mock_in_flight",
    "mock_waiting",
    "mock_total",
    "mock_ok",
    "mock_failed",
    "service_ms",
    "gw_limit",
    "gw_in_flight",
    "gw_queued",
    "rtt_min_ms",
    "rtt_sample_ms",
    "refusals_queue_full",
    "refusals_timeout",
    "refusals_other",
]

random.seed(SEED)


class _Log(CsvLog):
    """requests.csv, flushed in batches; counts per outcome for progress."""

    def __init__(self):
        super().__init__(["t", "ms", "status", "outcome"], 1000)
        self.counts = {}

    def add(self, t, ms, status, outcome):
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        super().add((f"{t:.3f}", f"{ms:.1f}", status, outcome))


LOG = _Log()
STATE = {"sampler": None, "stop": False}


@events.init.add_listener
def _on_init(environment, **_kw):
    if not TARGET or not OUT:
        sys.exit("CH_TARGET and CH_OUT must be set")
    LOG.open(os.path.join(OUT, "requests.csv"))


@events.test_start.add_listener
def _on_start(environment, **_kw):
    with open(os.path.join(OUT, "started"), "w") as f:
        f.write(f"{time.time():.3f}\n")
    STATE["sampler"] = gevent.spawn(_sampler, environment)


@events.test_stop.add_listener
def _on_stop(environment, **_kw):
    STATE["stop"] = True
    if STATE["sampler"] is not None:
        STATE["sampler"].join(timeout=2)
    LOG.flush()


@events.quitting.add_listener
def _on_quit(environment, **_kw):
    LOG.close()


def _get(url, timeout=1.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace")


def parse_metrics(text, upstream=UPSTREAM_NAME):
    """The adaptive cap's series for one upstream, from Prometheus text."""
    out = {}
    refusals = {}
    for name, labels, v in metrics.samples(text):
        if labels.get("kind") == "upstream" and labels.get("name") == upstream:
            if name == "gateway_in_flight_limit":
                out["gw_limit"] = v
            elif name == "gateway_in_flight":
                out["gw_in_flight"] = v
            elif name == "gateway_in_flight_queued":
                out["gw_queued"] = v
            elif name == "gateway_in_flight_refusals_total":
                reason = labels.get("reason", "other")
                refusals[reason] = refusals.get(reason, 0) + v
        elif name == "gateway_adaptive_rtt_seconds" and labels.get("upstream") == upstream:
            est = labels.get("estimate")
            if est in ("min", "sample"):
                out[f"rtt_{est}_ms"] = round(v * 1000, 3)
    if refusals:
        out["refusals_queue_full"] = refusals.pop("queue_full", 0)
        out["refusals_timeout"] = refusals.pop("timeout", 0)
        out["refusals_other"] = sum(refusals.values())
    return out


def _sample():
    row = {"t": f"{time.time():.3f}"}
    if UPSTREAM:
        try:
            s = json.loads(_get(UPSTREAM + "/stats"))
            row.update(
                mock_in_flight=s.get("in_flight"),
                mock_waiting=s.get("waiting"),
                mock_total=s.get("total"),
                mock_ok=s.get("ok"),
                mock_failed=s.get("failed"),
                service_ms=s.get("service_ms"),
            )
        except Exception:  # a missed sample must never stop the run
            pass
    if ADMIN:
        try:
            row.update(parse_metrics(_get(ADMIN + "/metrics")))
        except Exception:
            pass
    return row


def _sampler(environment):
    f = open(os.path.join(OUT, "timeline.csv"), "w", newline="")
    w = csv.DictWriter(f, fieldnames=TIMELINE_FIELDS, extrasaction="ignore")
    w.writeheader()
    start = time.time()
    last_print = start
    prev_counts, prev_t = {}, start
    n = 0
    try:
        while not STATE["stop"]:
            n += 1
            gevent.sleep(max(0.0, start + n * SAMPLE_SECS - time.time()))
            row = _sample()
            w.writerow(row)
            f.flush()
            now = time.time()
            if now - last_print >= PROGRESS_SECS - 0.01:
                counts = dict(LOG.counts)
                dt = max(now - prev_t, 1e-3)

                def rate(*keys):
                    return sum(counts.get(k, 0) - prev_counts.get(k, 0) for k in keys) / dt

                users = environment.runner.user_count if environment.runner else 0
                lim = row.get("gw_limit")
                print(
                    f"[{RUN}] t={now - start:5.1f}s users={users:4d} "
                    f"ok/s={rate('admitted'):6.1f} 429/s={rate('refused_429'):6.1f} "
                    f"503/s={rate('refused_503'):6.1f} fail/s={rate('failed_5xx', 'failed_timeout', 'failed_conn'):5.1f} "
                    f"upstream in_flight={row.get('mock_in_flight', '?')} waiting={row.get('mock_waiting', '?')} "
                    f"service_ms={row.get('service_ms', '?')}"
                    + (f" limit={lim:.0f} queued={row.get('gw_queued', 0):.0f}" if lim is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )
                last_print, prev_counts, prev_t = now, counts, now
    finally:
        f.close()


class Rider(FastHttpUser):
    host = TARGET or "http://127.0.0.1"
    wait_time = between(THINK_MIN, THINK_MAX)
    network_timeout = TIMEOUT
    connection_timeout = TIMEOUT
    max_retries = 0
    concurrency = 1

    @task
    def ride_request(self):
        t = time.time()
        with self.client.get("/api/rides/request", name=NAME, catch_response=True) as resp:
            ms = (time.time() - t) * 1000.0
            status = resp.status_code or 0
            ctype = (resp.headers or {}).get("content-type", "") if status else ""
            if 200 <= status < 300:
                outcome = "admitted"
                resp.success()
            elif status == 429:
                outcome = "refused_429"
                resp.request_meta["name"] = f"{NAME} [429]"
                resp.success()
            elif status == 503 and "application/problem+json" in ctype:
                outcome = "refused_503"
                resp.request_meta["name"] = f"{NAME} [503 gateway]"
                resp.success()
            elif status:
                outcome = "failed_5xx" if status >= 500 else "failed_other"
                resp.failure(f"HTTP {status}")
            else:
                err = getattr(resp, "error", None)
                ename = type(err).__name__ if err is not None else "unknown"
                if "timeout" in ename.lower() or "timed out" in str(err).lower():
                    outcome = "failed_timeout"
                    resp.failure(f"client timeout ({TIMEOUT:g} s)")
                else:
                    outcome = "failed_conn"
                    resp.failure(f"connection error: {ename}")
        LOG.add(t, ms, status, outcome)
