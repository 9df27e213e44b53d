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
    "gateway_jwt",
    "gateway_key_padded",
    "gateway_redis",
    "gateway_redis_cluster",
    "gateway_redis_denied",
    "gateway_tls",
    "nginx_tls",
]
GATEWAY_TARGETS = [t for t in TARGETS if t.startswith("gateway_")]
REDIS_TARGETS = ["gateway_redis", "gateway_redis_cluster", "gateway_redis_denied"]
# On the Redis Cluster (three masters) rather than the one standalone Redis.
CLUSTER_TARGETS = ["gateway_redis_cluster"]
CLUSTER_NODES = 3  # the masters of gateway_redis_cluster (bench.py --cluster-nodes sets it)
LIMITED_TARGETS = ["gateway_local", "gateway_redis", "gateway_redis_cluster", "gateway_redis_denied"]
# With --clients N, these are sent traffic from N clients (wrk-clients.lua);
# the others keep one client (the denied target's point is one client over).
MANY_CLIENTS_TARGETS = ["gateway_local", "gateway_redis", "gateway_redis_cluster"]
NGINX_TARGETS = ["nginx_limit_req", "nginx_tls"]
# gateway_local with the client named by a verified JWT (RS256, a key file)
# instead of an API key: the same hot client, the same tiers.
JWT_TARGETS = ["gateway_jwt"]
# gateway_local with a header as long as gateway_jwt's token beside its API
# key: what the token's bytes cost (read, parsed, sent upstream) with no JWT work.
PADDED_TARGETS = ["gateway_key_padded"]
TLS_TARGETS = ["gateway_tls", "nginx_tls"]
API_KEY = "bench-key-0001"
PATH = "/api/bench"
# Many-clients mode: the clients over their limit ask for this path, whose
# route allows each client one request (gateway.tiers.toml's bench-over route).
OVER_PATH = "/api/over"
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def warn(msg: str, warnings: list | None = None) -> None:
    print(f"{time.strftime('%H:%M:%S')} WARNING: {msg}", flush=True)
    if warnings is not None:
        warnings.append(msg)


class BenchError(Exception):
    pass


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None

