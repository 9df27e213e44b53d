"""What every part of the benchmark shares: where things are, the targets'
names and groups, logging, the error that ends a run, the median of rounds."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# loadtest/'s shared package `lt`, after this folder (whose report.py is not
# loadtest/report.py).
if str(HERE.parent) not in sys.path:
    sys.path.append(str(HERE.parent))
ROOT = HERE.parent.parent
# The binaries measured; bench.py --bin-dir DIR looks in DIR instead (set_bin_dir).
GATEWAY = ROOT / "target/release/gateway"
MOCK = ROOT / "target/release/mock-upstream"
BARE = ROOT / "target/release/examples/bare_proxy"
RESULTS = ROOT / "loadtest/results"
CLK_TCK = os.sysconf("SC_CLK_TCK")

TARGETS = [
    "direct",
    "nginx_limit_req",
    "pingora_bare",
    "gateway_off",
    "gateway_local",
    "gateway_local_notop",
    "gateway_traced_001",
    "gateway_traced_1",
    "gateway_traced_down",
    "gateway_jwt",
    "gateway_key_padded",
    "gateway_redis",
    "gateway_redis_unshared",
    "gateway_redis_cluster",
    "gateway_redis_denied",
    "gateway_tls",
    "nginx_tls",
    "redis_anchor",
]
GATEWAY_TARGETS = [t for t in TARGETS if t.startswith("gateway_")]
REDIS_TARGETS = ["gateway_redis", "gateway_redis_unshared", "gateway_redis_cluster", "gateway_redis_denied"]
# On the Redis Cluster (three masters) rather than the one standalone Redis.
CLUSTER_TARGETS = ["gateway_redis_cluster"]
CLUSTER_NODES = 3  # the masters of gateway_redis_cluster (bench.py --cluster-nodes sets it)
LIMITED_TARGETS = ["gateway_local", "gateway_local_notop", "gateway_traced_001", "gateway_traced_1", "gateway_traced_down",
                   "gateway_redis", "gateway_redis_unshared", "gateway_redis_cluster",
                   "gateway_redis_denied"]
# With --clients N, these are sent traffic from N clients (wrk-clients.lua);
# the others keep one client (the denied target's point is one client over).
MANY_CLIENTS_TARGETS = ["gateway_local", "gateway_local_notop", "gateway_redis", "gateway_redis_unshared", "gateway_redis_cluster"]
# These run with [limiter.shares] enabled = true (standing shares: part of
# every big token bucket decided by the replica itself, no Redis call);
# gateway_redis_unshared is gateway_redis without it, the "before" in the same run.
SHARES_TARGETS = ["gateway_redis", "gateway_redis_cluster"]
# Before a shares target is measured: up to this long for its /metrics to show
# gateway_shares_usable 1 (a replica starts using its shares ~3.1 s after its
# first heartbeat), then SHARES_SETTLE_S more (the shares fill from empty at
# the buckets' refill rates: within a second at the many-clients sizes).
SHARES_GAUGE = "gateway_shares_usable"
SHARES_WAIT_S = 15.0
SHARES_SETTLE_S = 1.5
# Many-clients mode (--clients N): every per-client bucket (the ip tier and the
# route's per-client bucket) holds this many tokens and refills this many per
# second, for every target alike: a crowd far below its limits, each bucket
# full again within a second (a share of a bucket refilling at 0.01/s would
# never fill). The over route keeps capacity 1, refill 0.000001/s.
MANY_CLIENTS_CAPACITY = 1000000
MANY_CLIENTS_REFILL = 1000000
# The memory step's Redis variant (standing shares, gateway.memory-redis.toml): the ip
# tier every new client gets a bucket of, big enough to be cut into a pool and
# standing shares (floor(fraction x capacity) >= 16), full again within a
# second (a share a client used once is full, so droppable, by the next sweep).
MEMORY_REDIS_CAPACITY = 1000000
MEMORY_REDIS_REFILL = 1000000
# The standing shares' anchor: a redis-server of its own driven the way envoyproxy/ratelimit
# drives one (INCRBY + EXPIRE per descriptor, three descriptors per request,
# pipelined) by redis_anchor.c, from --clients N Zipf clients; each round
# measures these requests-per-pipeline settings, one window each.
ANCHOR = "redis_anchor"
ANCHOR_PIPELINES = (16, 1)
# Measured by default only in many-clients mode (--clients N); --targets
# naming them measures them anyway (the anchor always needs --clients).
CLIENTS_ONLY_TARGETS = ["gateway_redis_unshared", ANCHOR]
NGINX_TARGETS = ["nginx_limit_req", "nginx_tls"]
# gateway_local with the client named by a verified JWT (RS256, a key file)
# instead of an API key: the same hot client, the same tiers.
JWT_TARGETS = ["gateway_jwt"]
# gateway_local with a header as long as gateway_jwt's token beside its API
# key: what the token's bytes cost (read, parsed, sent upstream) with no JWT work.
PADDED_TARGETS = ["gateway_key_padded"]
TLS_TARGETS = ["gateway_tls", "nginx_tls"]
# gateway_local with [tracing] on, at these sample ratios, exporting to an
# OTLP/HTTP sink of the run's own (targets.py: reads each batch, answers 200);
# gateway_traced_down at 1.0 to a port nothing listens on (a collector that
# is down: every batch fails, every span is counted dropped).
TRACED_TARGETS = {"gateway_traced_001": 0.01, "gateway_traced_1": 1.0, "gateway_traced_down": 1.0}
TRACED_DOWN = "gateway_traced_down"
# gateway_local with [admin] top = false: no top-K of refused clients. Beside
# gateway_local with --clients N --over P (P% of the crowd refused, each
# refusal counted in gateway_local's top-K): what the top-K costs.
NO_TOP_TARGETS = ["gateway_local_notop"]
API_KEY = "bench-key-0001"
PATH = "/api/bench"
# Many-clients mode: the clients over their limit ask for this path, whose
# route allows each client one request (gateway.tiers.toml's bench-over route).
OVER_PATH = "/api/over"
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def key_prefix(target: str) -> str:
    """A gateway target's Redis key prefix ([redis] key_prefix): its name,
    a crowd shape's `@` (gateway_redis@near) as `-`."""
    return f"bench-{target.replace('@', '-')}"


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def warn(msg: str, warnings: list | None = None) -> None:
    print(f"{time.strftime('%H:%M:%S')} WARNING: {msg}", flush=True)
    if warnings is not None:
        warnings.append(msg)


def set_bin_dir(d: Path) -> None:
    """Measure the binaries of another build folder (a worktree with no build
    of its own, the lead's target/release): its gateway, mock-upstream and
    examples/bare_proxy. Read through this module (common.GATEWAY, ...)."""
    global GATEWAY, MOCK, BARE
    GATEWAY, MOCK, BARE = d / "gateway", d / "mock-upstream", d / "examples" / "bare_proxy"


class BenchError(Exception):
    pass


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

