"""The concert-surge rider: Locust load for loadtest/surge.sh.

A concert ends and every rider's phone hammers the matching service: each
simulated rider loops, 0.1-0.3 s apart, over

    POST /api/rides/request      weight 5 (JSON ride body)
    POST /api/fares/estimate     weight 2 (JSON fare body)
    GET  /api/drivers/nearby     weight 1 (?lat=..&lng=..&radius_km=3)

Each rider has its own identity: its own API key (generated for the run) in
`x-api-key`, and its own client address in `X-Forwarded-For`, as the load
balancer in front of the gateways would send it. Each request goes to one of
the targets picked at random (a round-robin load balancer, seen from one
rider). A 429 is a rejection, not a failure: it is recorded under the
request's name plus " [429]", so Locust's failures are only the real ones
(5xx, connection errors, any other unexpected status).

Environment (all optional but SURGE_TARGETS):
    SURGE_TARGETS        comma-separated base URLs, e.g. http://127.0.0.1:8081,...
    SURGE_RIDERS         CSV of id,key,ip (loadtest/prepare.py riders); without
                         it riders get made-up keys (fine against the bare upstream)
    SURGE_OUT            folder for this phase's own records (below); unset: none
    SURGE_PHASE          phase name printed in progress lines
    SURGE_UPSTREAM_STATS URL of the mock upstream's GET /stats, sampled each second
    SURGE_PROGRESS_SECS  seconds between progress lines (default 5)
    SURGE_PROCESSES      Locust's --processes N, when N > 1: rider i of worker w
                         takes identity i*N + w, so no two riders share a key

Records written to SURGE_OUT:
    requests-<pid>.csv   one row per request: t (unix s), name, kind
                         (ok | rejected | failed), status, ms
    upstream.csv         t, total, ok, failed: the upstream's counters each second
"""

import csv
import itertools
import json
import os
import random
import sys
import time
import urllib.request

import gevent
from locust import between, events, task
from locust.contrib.fasthttp import FastHttpSession, FastHttpUser
from locust.runners import MasterRunner, WorkerRunner

from lt.csvlog import CsvLog

TARGETS = [t.strip().rstrip("/") for t in os.environ.get("SURGE_TARGETS", "").split(",") if t.strip()]
OUT = os.environ.get("SURGE_OUT", "")
PHASE = os.environ.get("SURGE_PHASE", "surge")
UPSTREAM_STATS = os.environ.get("SURGE_UPSTREAM_STATS", "")
PROGRESS_SECS = float(os.environ.get("SURGE_PROGRESS_SECS", "5"))

# The venue: riders around one stadium.
VENUE = (51.5560, -0.2796)


def _load_riders():
    path = os.environ.get("SURGE_RIDERS", "")
    if not path:
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


RIDERS = _load_riders()
_next_rider = itertools.count()


# Every request, one CSV row, flushed in batches.
LOG = CsvLog(["t", "name", "kind", "status", "ms"], 2000)


@events.init.add_listener
def _on_init(environment, **_kw):
    if not TARGETS:
        sys.exit("SURGE_TARGETS is not set (comma-separated base URLs)")
    if OUT and not isinstance(environment.runner, MasterRunner):
        LOG.open(os.path.join(OUT, f"requests-{os.getpid()}.csv"))
    if not isinstance(environment.runner, WorkerRunner):
        gevent.spawn(_monitor, environment)


@events.request.add_listener
def _on_request(request_type, name, response_time, response, exception, start_time=None, **_kw):
    status = getattr(response, "status_code", 0) or 0
    if name.endswith(" [429]"):
        kind = "rejected"
    elif exception is not None:
        kind = "failed"
    else:
        kind = "ok"
    LOG.add([f"{start_time or time.time():.3f}", name, kind, status, f"{response_time:.3f}"])


@events.quitting.add_listener
def _on_quit(environment, **_kw):
    LOG.close()


def _upstream_counts():
    try:
        with urllib.request.urlopen(UPSTREAM_STATS, timeout=2) as r:
            s = json.load(r)
        return s.get("total", 0), s.get("ok", 0), s.get("failed", 0)
    except Exception:  # the sampler must never stop the test
        return None


def _monitor(environment):
    """Samples the upstream each second; prints a progress line every few."""
    start = time.time()
    out = None
    if OUT and UPSTREAM_STATS:
        os.makedirs(OUT, exist_ok=True)
        out = open(os.path.join(OUT, "upstream.csv"), "w", newline="")
        w = csv.writer(out)
        w.writerow(["t", "total", "ok", "failed"])
    window = []  # (t, total) of the last few seconds
    last_print = start
    try:
        while True:
            gevent.sleep(1.0 - (time.time() - start) % 1.0)
            now = time.time()
            up = _upstream_counts() if UPSTREAM_STATS else None
            if up is not None:
                if out:
                    w.writerow([f"{now:.3f}", *up])
                    out.flush()
                window.append((now, up[0]))
                window = window[-6:]
            if now - last_print >= PROGRESS_SECS - 0.01:
                last_print = now
                st = environment.stats.total
                runner = environment.runner
                users = runner.user_count if runner else 0
                line = (
                    f"[{PHASE}] t={now - start:5.0f}s users={users:5d} "
                    f"rps={st.current_rps:7.1f} fail/s={st.current_fail_per_sec:6.1f} "
                    f"reqs={st.num_requests}"
                )
                if len(window) >= 2 and window[-1][0] > window[0][0]:
                    ups = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
                    line += f" upstream_rps={ups:6.1f}"
                print(line, file=sys.stderr, flush=True)
    finally:
        if out:
            out.close()


def _ride_body(rider):
    lat = VENUE[0] + random.uniform(-0.01, 0.01)
    lng = VENUE[1] + random.uniform(-0.01, 0.01)
    return {
        "rider_id": rider,
        "pickup": {"lat": round(lat, 6), "lng": round(lng, 6)},
        "dropoff": {"lat": round(lat + random.uniform(-0.2, 0.2), 6), "lng": round(lng + random.uniform(-0.2, 0.2), 6)},
        "product": random.choice(["standard", "xl", "pool"]),
        "seats": random.randint(1, 4),
    }


class SurgeRider(FastHttpUser):
    wait_time = between(0.1, 0.3)
    # Not used for requests (each rider has one session per target below), but
    # Locust wants a host.
    host = TARGETS[0] if TARGETS else "http://127.0.0.1"

    def on_start(self):
        n = next(_next_rider)
        runner = self.environment.runner
        worker = getattr(runner, "worker_index", 0) if isinstance(runner, WorkerRunner) else 0
        workers = max(1, int(os.environ.get("SURGE_PROCESSES", "1")))
        idx = n * workers + worker
        if RIDERS:
            r = RIDERS[idx % len(RIDERS)]
            self.rider_id, key, ip = r["id"], r["key"], r["ip"]
        else:
            self.rider_id, key, ip = f"rider-{idx:05d}", f"anon-{idx}", f"198.18.{idx // 254 % 256}.{idx % 254 + 1}"
        self.headers = {"x-api-key": key, "X-Forwarded-For": ip}
        self.sessions = [
            FastHttpSession(
                t,
                self.environment.events.request,
                user=self,
                concurrency=1,
                max_retries=0,
                network_timeout=60.0,
                connection_timeout=60.0,
            )
            for t in TARGETS
        ]

    def _send(self, method, path, name, body=None):
        session = random.choice(self.sessions)
        with session.request(method, path, name=name, json=body, headers=self.headers, catch_response=True) as resp:
            if resp.status_code == 429:
                resp.request_meta["name"] = f"{name} [429]"
                resp.success()
            elif 200 <= resp.status_code < 300:
                resp.success()
            else:
                # A message without the URL, so Locust groups failures by cause.
                err = getattr(resp, "error", None)
                if resp.status_code:
                    resp.failure(f"HTTP {resp.status_code}")
                else:
                    resp.failure(f"connection error: {type(err).__name__ if err else 'unknown'}")

    @task(5)
    def ride_request(self):
        self._send("POST", "/api/rides/request", "POST /api/rides/request", _ride_body(self.rider_id))

    @task(2)
    def fare_estimate(self):
        body = _ride_body(self.rider_id)
        body.pop("seats")
        self._send("POST", "/api/fares/estimate", "POST /api/fares/estimate", body)

    @task(1)
    def nearby_drivers(self):
        lat = VENUE[0] + random.uniform(-0.01, 0.01)
        lng = VENUE[1] + random.uniform(-0.01, 0.01)
        self._send(
            "GET",
            f"/api/drivers/nearby?lat={lat:.5f}&lng={lng:.5f}&radius_km=3",
            "GET /api/drivers/nearby",
        )
