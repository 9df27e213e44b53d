#!/usr/bin/env python3
"""Set-up helpers for loadtest/surge.sh (standard library only).

    prepare.py ports N
        prints N free loopback TCP ports, one a line (bound to port 0 and
        released, so another process could take one in between: surge.sh
        checks that each server it starts is really listening).

    prepare.py riders --count N --out riders.csv
        generates N rider identities: an API key each (random, for this run
        only) and a client address from 198.18.0.0/15, the range set aside for
        benchmarking (RFC 2544). Only Locust reads the keys.

    prepare.py keys --riders riders.csv [--plan rider]
        prints the riders' [[api_keys]] entries (SHA-256 of each key), to add
        to a real deployment's gateway.toml for a test against it.

    prepare.py configs --template surge.gateway.toml --riders riders.csv
        --out-dir DIR --replicas 3 --proxy-ports P,P,P --admin-ports A,A,A
        --redis-url URL --upstream ADDR --capacity RPS [--share 0.9]
        writes DIR/surge-gw<i>.toml for each replica and prints their paths.
"""

import argparse
import csv
import hashlib
import ipaddress
import pathlib
import re
import secrets
import sys

from lt.procs import free_ports

# The riders' traffic mix (weights of the Locust tasks), which the global
# budgets of the three routes follow.
ROUTE_WEIGHTS = {"RIDE": 5, "FARE": 2, "NEARBY": 1}


def make_riders(count, out):
    base = ipaddress.IPv4Address("198.18.0.0")
    if count > 2**17 - 2:
        sys.exit("at most 131070 riders (one address each in 198.18.0.0/15)")
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "key", "ip"])
        for i in range(count):
            w.writerow([f"rider-{i:05d}", "surge-" + secrets.token_hex(16), str(base + i + 1)])


def read_riders(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fmt_rate(x):
    return f"{x:.3f}".rstrip("0").rstrip(".")


def budgets(capacity, share):
    """Per-route global (refill_per_sec, burst) that add up to share*capacity."""
    total = sum(ROUTE_WEIGHTS.values())
    out = {}
    for name, w in ROUTE_WEIGHTS.items():
        rate = capacity * share * w / total
        burst = max(1, round(rate * 0.2))
        out[name] = (rate, burst)
    return out


def render(template, values):
    text = template
    for k, v in values.items():
        text = text.replace(f"@@{k}@@", str(v))
    left = sorted(set(re.findall(r"@@([A-Z0-9_]+)@@", text)))
    if left:
        sys.exit(f"template placeholders left unfilled: {', '.join(left)}")
    return text


def api_keys(riders, plan="rider"):
    """The [[api_keys]] entries of the riders: only the keys' SHA-256."""
    out = []
    for r in riders:
        digest = hashlib.sha256(r["key"].encode()).hexdigest()
        out.append(f'[[api_keys]]\nid = "{r["id"]}"\nsha256 = "{digest}"\nplan = "{plan}"\n')
    return out


def make_configs(a):
    template = pathlib.Path(a.template).read_text()
    riders = read_riders(a.riders)
    proxy = a.proxy_ports.split(",")
    admin = a.admin_ports.split(",")
    if len(proxy) != a.replicas or len(admin) != a.replicas:
        sys.exit("need one proxy and one admin port per replica")
    keys = api_keys(riders)
    values = {
        "REDIS_URL": a.redis_url,
        "UPSTREAM_ADDR": a.upstream,
        "UPSTREAM_CAPACITY": fmt_rate(a.capacity),
        "GLOBAL_SHARE_PCT": fmt_rate(a.share * 100),
        "INSTANCES": a.replicas,
        "THREADS": a.threads,
        "REDIS_TIMEOUT_MS": a.redis_timeout_ms,
        "API_KEYS": "\n".join(keys),
    }
    for name, (rate, burst) in budgets(a.capacity, a.share).items():
        values[f"{name}_RPS"] = fmt_rate(rate)
        values[f"{name}_BURST"] = burst
    out_dir = pathlib.Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(a.replicas):
        v = dict(values, PROXY_ADDR=f"127.0.0.1:{proxy[i]}", ADMIN_ADDR=f"127.0.0.1:{admin[i]}")
        path = out_dir / f"surge-gw{i}.toml"
        path.write_text(render(template, v))
        print(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("ports")
    sp.add_argument("n", type=int)
    sr = sub.add_parser("riders")
    sr.add_argument("--count", type=int, required=True)
    sr.add_argument("--out", required=True)
    sk = sub.add_parser("keys")
    sk.add_argument("--riders", required=True)
    sk.add_argument("--plan", default="rider")
    sc = sub.add_parser("configs")
    sc.add_argument("--template", required=True)
    sc.add_argument("--riders", required=True)
    sc.add_argument("--out-dir", required=True)
    sc.add_argument("--replicas", type=int, default=3)
    sc.add_argument("--proxy-ports", required=True)
    sc.add_argument("--admin-ports", required=True)
    sc.add_argument("--redis-url", required=True)
    sc.add_argument("--upstream", required=True)
    sc.add_argument("--capacity", type=float, required=True)
    sc.add_argument("--share", type=float, default=0.9)
    sc.add_argument("--threads", type=int, default=1)
    sc.add_argument("--redis-timeout-ms", type=int, default=15)
    a = p.parse_args()
    if a.cmd == "ports":
        print("\n".join(str(x) for x in free_ports(a.n)))
    elif a.cmd == "riders":
        make_riders(a.count, a.out)
    elif a.cmd == "keys":
        print("\n".join(api_keys(read_riders(a.riders), a.plan)))
    else:
        make_configs(a)


if __name__ == "__main__":
    main()
