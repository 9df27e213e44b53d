"""Sends a short burst to each demo route through the gateway and prints a
table: per route, requests sent / admitted / rejected and what the upstream
counted. Used by scripts/demo.sh; loopback only, bounded."""
import http.client
import json
import sys

gateway, rides, geo = sys.argv[1], sys.argv[2], sys.argv[3]

# (route, method, path, headers, requests)
BURSTS = [
    ("ride-request", "POST", "/api/rides/request", {"x-api-key": "demo-key-123"}, 30),
    ("fare-estimate", "POST", "/api/fares/estimate", {"x-forwarded-for": "198.51.100.10"}, 30),
    ("nearby-drivers", "GET", "/api/drivers/nearby?lat=52.5&lng=13.4&radius_km=3", {"x-forwarded-for": "198.51.100.11"}, 40),
    ("trip-history", "GET", "/api/trips/history", {"x-forwarded-for": "198.51.100.12"}, 110),
    ("zone-stats", "GET", "/api/admin/zones/stats", {"authorization": "Bearer acme-secret-456"}, 15),
    ("login", "POST", "/api/auth/login", {"x-forwarded-for": "198.51.100.13"}, 8),
    ("unknown key", "GET", "/api/anything", {"x-api-key": "not-a-key"}, 3),
    ("denied client", "GET", "/api/anything", {"x-forwarded-for": "203.0.113.9"}, 3),
]


def stats(addr):
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    c.request("GET", "/stats")
    return json.loads(c.getresponse().read())


def upstream_count(path):
    p = path.split("?")[0]
    return sum(stats(a)["paths"].get(p, 0) for a in (rides, geo))


host, port = gateway.rsplit(":", 1)
conn = http.client.HTTPConnection(host, int(port), timeout=10)
rows = []
for route, method, path, headers, n in BURSTS:
    before = upstream_count(path)
    codes = {}
    for _ in range(n):
        body = b'{"pickup":"stadium"}' if method == "POST" else None
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        codes[r.status] = codes.get(r.status, 0) + 1
    admitted = sum(v for k, v in codes.items() if 200 <= k < 300)
    rows.append((route, n, admitted, codes.get(429, 0), upstream_count(path) - before,
                 ", ".join(f"{k}x{v}" for k, v in sorted(codes.items()))))

print()
print(f"{'route':<16} {'sent':>5} {'admitted':>9} {'rejected':>9} {'upstream':>9}  statuses")
print("-" * 72)
for route, sent, ok, rej, up, codes in rows:
    print(f"{route:<16} {sent:>5} {ok:>9} {rej:>9} {up:>9}  {codes}")
print()
bad = [r for r in rows if r[2] != r[4]]
if bad:
    print("MISMATCH: the upstream did not count exactly the admitted requests:", bad)
    sys.exit(1)
print("The upstream counted exactly the admitted requests on every route.")
