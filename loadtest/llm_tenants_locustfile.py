"""Locust load for loadtest/llm_tenants.sh: three tenants sharing an LLM API.

Each tenant is an API key on the same plan; the gateway's chat route is
charged by the answer (`charge`) and its token bucket (`cost = "response"`,
`scope = "client"`) gives every tenant its own budget of tokens. The users
of a tenant loop `POST /v1/chat/completions` against the gateway(s):

    A (noisy)  LT_NOISY_USERS users, 0.2-0.6 s apart, `max_tokens` 2000,
               every other request streamed: far over its budget. It does not
               back off on Retry-After.
    B (quiet)  LT_QUIET_USERS users, 2-4 s apart, `max_tokens` 256, JSON
               answers: well under its budget.
    C (quiet)  LT_QUIET_USERS users, 2-4 s apart, streamed answers; half of
               its requests carry `max_tokens` 256, half none (the route's
               `default_estimate`, and the mock's own default of 256).

(The numbers are the defaults; the tenants file written by
`lt/llm_tenants.py config` holds them.) Every request sends the tenant's key
in `x-api-key` and its name in `x-mock-client`, so that the mock upstream
tags the usage it reports (`GET /stats/llm`) with the tenant: that is the
truth the report compares the budgets with. A streamed request also sends
`x-mock-chunk-ms` (a pause before each server-sent event).

A 429 is a rejection, not a failure: recorded under the request's name plus
" [429]". Failures are other non-2xx answers and connection errors.

Environment:
    LT_TARGETS         comma-separated gateway base URLs (each request goes to
                       one at random); required
    LT_TENANTS         the tenants file (JSON, from `lt/llm_tenants.py
                       config`); required
    LT_OUT             folder for the records below; required
    LT_UPSTREAM        the mock upstream's base URL (its /stats/llm, sampled
                       for the progress lines, and its clock)
    LT_SEED            random seed (think times, stream choices), default 7
    LT_PROGRESS_SECS   seconds between progress lines, default 5

Records written to LT_OUT:
    requests.csv   t (start, unix s), tenant, stream (0/1), status, ms,
                   tokens (usage.total_tokens read from the answer, empty
                   when none), retry_after (its value on a 429), ratelimit
                   (1 when the answer had RateLimit or X-RateLimit headers)
    started        the unix time the load started
    clock.json     {"wall": unix s, "mock_uptime": s}: the mock upstream's
                   clock (its /stats/llm times count from its start) against
                   ours, read at the start
"""

import json
import os
import random
import sys
import time
import urllib.request

import gevent
from locust import between, events, task
from locust.contrib.fasthttp import FastHttpSession, FastHttpUser

from lt.csvlog import CsvLog

TARGETS = [t.strip().rstrip("/") for t in os.environ.get("LT_TARGETS", "").split(",") if t.strip()]
TENANTS_FILE = os.environ.get("LT_TENANTS", "")
OUT = os.environ.get("LT_OUT", "")
UPSTREAM = os.environ.get("LT_UPSTREAM", "").rstrip("/")
SEED = int(os.environ.get("LT_SEED", "7"))
PROGRESS_SECS = float(os.environ.get("LT_PROGRESS_SECS", "5"))

PATH = "/v1/chat/completions"


def _load_tenants():
    if not TENANTS_FILE:
        return {}
    with open(TENANTS_FILE) as f:
        return {t["tenant"]: t for t in json.load(f)["tenants"]}


TENANTS = _load_tenants()
random.seed(SEED)


class _Log(CsvLog):
    """requests.csv, flushed in batches; counts per tenant and outcome for
    the progress lines."""

    def __init__(self):
        super().__init__(["t", "tenant", "stream", "status", "ms", "tokens", "retry_after", "ratelimit"], 500)
        self.counts = {}

    def record(self, t, tenant, stream, status, ms, tokens, retry_after, ratelimit):
        kind = "ok" if 200 <= status < 300 else "429" if status == 429 else "failed"
        key = (tenant, kind)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.add(
            (f"{t:.3f}", tenant, int(stream), status, f"{ms:.1f}", "" if tokens is None else tokens, retry_after,
             int(ratelimit))
        )


LOG = _Log()
STATE = {"monitor": None, "stop": False}


@events.init.add_listener
def _on_init(environment, **_kw):
    if not TARGETS or not TENANTS or not OUT:
        sys.exit("LT_TARGETS, LT_TENANTS and LT_OUT must be set")
    LOG.open(os.path.join(OUT, "requests.csv"))


def _get_json(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode("utf-8", "replace"))


@events.test_start.add_listener
def _on_start(environment, **_kw):
    now = time.time()
    with open(os.path.join(OUT, "started"), "w") as f:
        f.write(f"{now:.3f}\n")
    if UPSTREAM:
        try:
            t0 = time.time()
            up = _get_json(UPSTREAM + "/stats")
            t1 = time.time()
            with open(os.path.join(OUT, "clock.json"), "w") as f:
                json.dump({"wall": (t0 + t1) / 2, "mock_uptime": up["uptime_secs"], "read_ms": (t1 - t0) * 1000}, f)
                f.write("\n")
        except Exception as e:  # the report says when the clock is missing
            print(f"[llm-tenants] could not read the mock's clock: {e}", file=sys.stderr, flush=True)
    STATE["monitor"] = gevent.spawn(_monitor, environment, now)


@events.test_stop.add_listener
def _on_stop(environment, **_kw):
    STATE["stop"] = True
    LOG.flush()


@events.quitting.add_listener
def _on_quit(environment, **_kw):
    LOG.close()


def _upstream_tokens():
    """Tokens the upstream reported so far, per tenant (None when it cannot
    be read)."""
    try:
        s = _get_json(UPSTREAM + "/stats/llm")
    except Exception:  # a missed sample must never stop the run
        return None
    out = {}
    for _t, n, client in s.get("reports", []):
        out[client] = out.get(client, 0) + n
    return out


def _monitor(environment, start):
    """A progress line every PROGRESS_SECS: per tenant, answers per second
    (2xx, 429, failures) on our side and tokens per second the upstream
    reported."""
    prev_counts, prev_tokens, prev_t = {}, {}, start
    n = 0
    while not STATE["stop"]:
        n += 1
        gevent.sleep(max(0.0, start + n * PROGRESS_SECS - time.time()))
        if STATE["stop"]:
            break
        now = time.time()
        dt = max(now - prev_t, 1e-3)
        counts = dict(LOG.counts)
        tokens = _upstream_tokens() if UPSTREAM else None
        parts = []
        for name in sorted(TENANTS):

            def rate(kind):
                return (counts.get((name, kind), 0) - prev_counts.get((name, kind), 0)) / dt

            part = f"{name}: ok/s={rate('ok'):5.1f} 429/s={rate('429'):6.1f}"
            if rate("failed"):
                part += f" fail/s={rate('failed'):5.1f}"
            if tokens is not None:
                part += f" tokens/s={(tokens.get(name, 0) - prev_tokens.get(name, 0)) / dt:6.0f}"
            parts.append(part)
        users = environment.runner.user_count if environment.runner else 0
        print(f"[llm-tenants] t={now - start:5.1f}s users={users:3d} | " + " | ".join(parts), file=sys.stderr, flush=True)
        prev_counts, prev_t = counts, now
        if tokens is not None:
            prev_tokens = tokens


def usage_tokens(body, stream):
    """usage.total_tokens of an answer: the JSON body's, or the last
    server-sent event's that holds one; None when there is none."""
    try:
        text = body.decode("utf-8", "replace") if isinstance(body, (bytes, bytearray)) else (body or "")
        if not stream:
            v = json.loads(text).get("usage") or {}
            return v.get("total_tokens")
        found = None
        for line in text.splitlines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if not data or data == "[DONE]":
                continue
            ev = json.loads(data)
            u = ev.get("usage") if isinstance(ev, dict) else None
            if isinstance(u, dict) and u.get("total_tokens") is not None:
                found = u["total_tokens"]
        return found
    except (ValueError, AttributeError, TypeError):
        return None


class _Tenant(FastHttpUser):
    """One user of a tenant; subclasses name the tenant."""

    abstract = True
    tenant = ""
    host = TARGETS[0] if TARGETS else "http://127.0.0.1"

    def on_start(self):
        self.spec = TENANTS[self.tenant]
        self.rng = random.Random(f"{SEED}-{self.tenant}-{id(self)}")
        self.sessions = [
            FastHttpSession(
                t,
                self.environment.events.request,
                user=self,
                concurrency=1,
                max_retries=0,
                network_timeout=60.0,
                connection_timeout=10.0,
            )
            for t in TARGETS
        ]
        self.n = 0

    @task
    def chat(self):
        spec = self.spec
        self.n += 1
        stream = self.rng.random() < spec["stream_share"]
        body = {"model": "mock-llm", "messages": [{"role": "user", "content": f"question {self.n} from {self.tenant}"}],
                "stream": stream}
        if spec["max_tokens"] and self.rng.random() >= spec.get("no_max_tokens_share", 0.0):
            body["max_tokens"] = spec["max_tokens"]
        headers = {"x-api-key": spec["key"], "x-mock-client": self.tenant, "content-type": "application/json"}
        if stream and spec.get("chunk_ms"):
            headers["x-mock-chunk-ms"] = str(spec["chunk_ms"])
        name = f"{self.tenant} POST {PATH} ({'stream' if stream else 'json'})"
        session = self.rng.choice(self.sessions)
        t = time.time()
        tokens, retry_after, ratelimit = None, "", False
        with session.post(PATH, data=json.dumps(body), headers=headers, name=name, catch_response=True) as resp:
            ms = (time.time() - t) * 1000.0
            status = resp.status_code or 0
            names = [k.lower() for k in (resp.headers or {}).keys()] if status else []
            ratelimit = any(k.startswith("ratelimit") or k.startswith("x-ratelimit") for k in names)
            if 200 <= status < 300:
                tokens = usage_tokens(resp.content, stream)
                resp.success()
            elif status == 429:
                retry_after = (resp.headers or {}).get("retry-after", "") or ""
                resp.request_meta["name"] = f"{name} [429]"
                resp.success()
            elif status:
                resp.failure(f"HTTP {status}")
            else:
                err = getattr(resp, "error", None)
                resp.failure(f"connection error: {type(err).__name__ if err is not None else 'unknown'}")
        LOG.record(t, self.tenant, stream, status, ms, tokens, retry_after, ratelimit)


def _spec(tenant, key):
    return TENANTS.get(tenant, {}).get(key)


class TenantA(_Tenant):
    tenant = "A"
    fixed_count = _spec("A", "users") or 0
    wait_time = between(*(_spec("A", "think") or (0.2, 0.6)))


class TenantB(_Tenant):
    tenant = "B"
    fixed_count = _spec("B", "users") or 0
    wait_time = between(*(_spec("B", "think") or (2, 4)))


class TenantC(_Tenant):
    tenant = "C"
    fixed_count = _spec("C", "users") or 0
    wait_time = between(*(_spec("C", "think") or (2, 4)))
