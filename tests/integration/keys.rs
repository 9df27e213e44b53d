//! Route limits keyed on request attributes (a header, a query parameter,
//! or the client with one of them) and requests that cost more than one
//! token, through the real gateway on both backends. Counts against the
//! exact bound; the upstream sees exactly what was admitted.

use crate::support;

use support::{GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

fn config(up: &UpstreamGuard, backend: &str) -> String {
    format!(
        r#"
{SERVER}

[limiter]
retry_after_jitter_ms = 0
{backend}

[clients]
trusted_proxies = ["127.0.0.1/32"]

[tiers.ip]
algorithm = "token_bucket"
capacity = 1000
refill_per_sec = 0.001

[plans.big]
capacity = 1000
refill_per_sec = 0.001

[[api_keys]]
id = "alice"
key = "alice-secret-key"
plan = "big"

[[api_keys]]
id = "bob"
key = "bob-secret-key"
plan = "big"

[[upstreams]]
name = "up"
servers = ["{addr}"]

# 10 tokens per tenant, 3 per request: 3 requests.
[[routes]]
name = "reports"
path_prefix = "/reports"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 10, refill_per_sec = 0.001, key = "header:x-tenant-id", cost = 3 }}

# 6 per tenant an hour, 2 per request: 3 requests.
[[routes]]
name = "search"
path_prefix = "/search"
upstream = "up"
limit = {{ algorithm = "fixed_window", limit = 6, window_secs = 3600, key = "query:tenant", cost = 2 }}

# Per key and tenant; without the header, the key's own bucket.
[[routes]]
name = "export"
path_prefix = "/export"
upstream = "up"
limit = {{ algorithm = "sliding_log", limit = 4, window_secs = 3600, key = "client+header:x-tenant-id", missing = "client", cost = 2 }}
"#,
        addr = up.addr
    )
}

fn statuses(gw: &GatewayGuard, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    let mut c = gw.client();
    (0..n)
        .map(|_| c.request("GET", path, headers, b"").map_or(0, |r| r.status))
        .collect()
}

fn run(gw: &GatewayGuard, up: &UpstreamGuard, backend: &str) {
    let ok3 = [200, 200, 200, 429];
    // Header-keyed, cost 3 of 10: three per tenant, tenants apart.
    assert_eq!(statuses(gw, "/reports", &[("x-tenant-id", "acme")], 4), ok3);
    assert_eq!(statuses(gw, "/reports", &[("x-tenant-id", "beta")], 4), ok3);
    let r = gw
        .client()
        .request("GET", "/reports", &[("x-tenant-id", "gamma")], b"")
        .unwrap();
    assert_eq!(
        r.header("x-ratelimit-remaining"),
        Some("7"),
        "10 - 3: {:?}",
        r.headers
    );
    // A 429 tells what the bucket holds, as /limits does: 1 token, under
    // the cost of 3. Its policy names every tier, as a 200's does, also
    // when a remembered denial answers (the second 429, on Redis).
    let delta = [("x-tenant-id", "delta")];
    assert_eq!(statuses(gw, "/reports", &delta, 3), [200, 200, 200]);
    for _ in 0..2 {
        let r = gw.client().request("GET", "/reports", &delta, b"").unwrap();
        assert_eq!(r.status, 429);
        assert_eq!(
            r.header("x-ratelimit-remaining"),
            Some("1"),
            "{:?}",
            r.headers
        );
        let policy = r.header("ratelimit-policy").unwrap_or("");
        assert!(
            policy.contains("\"ip\";q=1000") && policy.contains("\"route\";q=10"),
            "{policy}"
        );
        assert!(
            r.header("ratelimit")
                .is_some_and(|v| v.starts_with("\"route\";r=1;")),
            "{:?}",
            r.headers
        );
    }
    // Every request that reached the limiter is counted once per tier:
    // acme 4, beta 4, gamma 1, delta 5.
    let ip_decisions: f64 = ["allowed", "rejected", "not_asked"]
        .iter()
        .map(|d| {
            gw.metric(&format!(
                "gateway_ratelimit_decisions_total{{tier=\"ip\",route=\"reports\",decision=\"{d}\"}}"
            ))
        })
        .sum();
    assert_eq!(ip_decisions, 14.0, "{backend}");

    // Without the header (missing = "reject"): 400 naming it; twice: 400.
    let r = gw.client().get("/reports").unwrap();
    assert_eq!(r.status, 400);
    assert!(r.text().contains("header x-tenant-id"), "{}", r.text());
    let twice = [("x-tenant-id", "acme"), ("x-tenant-id", "beta")];
    let r = gw.client().request("GET", "/reports", &twice, b"").unwrap();
    assert_eq!(r.status, 400);
    assert!(r.text().contains("more than once"), "{}", r.text());

    // Query-keyed, cost 2 of 6, values compared decoded.
    let got: Vec<u16> = ["acme", "%61cme", "ac%6De", "acme"]
        .iter()
        .map(|t| statuses(gw, &format!("/search?q=x&tenant={t}"), &[], 1)[0])
        .collect();
    assert_eq!(got, ok3, "one tenant however it is spelled");
    assert_eq!(statuses(gw, "/search?tenant=beta", &[], 4), ok3);
    assert_eq!(statuses(gw, "/search?tenant=a&tenant=b", &[], 1), [400]);

    // Client + header, cost 2 of 4: two per (key, tenant); without the
    // header the key's own bucket (missing = "client").
    let alice = ("x-api-key", "alice-secret-key");
    let bob = ("x-api-key", "bob-secret-key");
    let ok2 = [200, 200, 429];
    assert_eq!(
        statuses(gw, "/export", &[alice, ("x-tenant-id", "acme")], 3),
        ok2
    );
    assert_eq!(
        statuses(gw, "/export", &[bob, ("x-tenant-id", "acme")], 3),
        ok2
    );
    assert_eq!(
        statuses(gw, "/export", &[alice, ("x-tenant-id", "beta")], 3),
        ok2
    );
    assert_eq!(statuses(gw, "/export", &[alice], 3), ok2);

    // /limits names attribute-keyed buckets by their value (the log's
    // entries, one per token, read from Redis's sorted set or locally).
    let limits = |q: &str| -> serde_json::Value {
        let r = gw.admin_get(&format!("/limits?{q}"));
        assert_eq!(r.status, 200, "{q}: {}", r.text());
        r.json()["buckets"][0].clone()
    };
    // A keyed route asked for without its value: told how to name one.
    let r = gw.admin_get("/limits?ip=127.0.0.1&route=reports");
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text()
            .contains("keyed on header:x-tenant-id: name the value too"),
        "{}",
        r.text()
    );
    let v = limits("route=reports&value=gamma");
    assert_eq!(
        (v["limit"].as_u64(), v["remaining"].as_u64()),
        (Some(10), Some(7)),
        "{v}"
    );
    // (On Redis, with this replica's lease beside what Redis holds.)
    let v = limits("route=reports&value=delta");
    let lease = v["lease"]["tokens"].as_u64().unwrap_or(0);
    assert_eq!(v["remaining"].as_u64().map(|r| r + lease), Some(1), "{v}");
    let v = limits("key=alice&route=export&value=acme");
    assert_eq!(
        (v["limit"].as_u64(), v["remaining"].as_u64()),
        (Some(4), Some(0)),
        "{v}"
    );
    assert!(v["reset_ms"].as_u64().unwrap() > 3_500_000, "{v}");
    let v = limits("key=alice&route=export");
    assert_eq!(
        v["remaining"].as_u64(),
        Some(0),
        "missing = client: the key's own bucket: {v}"
    );
    let v = limits("key=bob&route=export&value=beta");
    assert_eq!(v["remaining"].as_u64(), Some(4), "{v}");
    assert_eq!(v["backend"], backend);

    // Admitted: reports 3+3+1+3, search 3+3, export 2+2+2+2.
    assert_eq!(up.count("/reports"), 10, "{backend}");
    assert_eq!(up.count("/search"), 6, "{backend}");
    assert_eq!(up.count("/export"), 8, "{backend}");
    println!(
        "FIGURES keys-{backend}: header cost 3 of 10: 3 of 4 admitted per tenant (bound 3); \
         query cost 2 of 6: 3 of 4 (bound 3); client+header cost 2 of 4: 2 of 3 (bound 2)"
    );
}

#[test]
fn attribute_keys_and_cost_on_redis() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let backend = format!(
        "backend = \"redis\"\n\n[redis]\nurls = [\"{}\"]\ntimeout_ms = 200",
        redis.url()
    );
    let gw = GatewayGuard::start(&config(&up, &backend));
    run(&gw, &up, "redis");
    // The buckets are named by value, escaped, never by anything secret.
    let keys = redis.keys();
    assert!(keys.iter().any(|k| k.ends_with(":h:acme")), "{keys:?}");
    assert!(
        keys.iter().any(|k| k.ends_with(":k:alice/h:beta")),
        "{keys:?}"
    );
    assert!(!keys.iter().any(|k| k.contains("secret")), "{keys:?}");
}

#[test]
fn attribute_keys_and_cost_on_the_local_backend() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&up, "backend = \"local\""));
    run(&gw, &up, "local");
}
