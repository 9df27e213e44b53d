//! The three tiers through the real gateway binary and a real Redis: every
//! tier and algorithm, client identity (XFF, IPv6 prefixes), API keys, the
//! 401/403 paths, the headers and body a client sees, and three replicas
//! sharing one limit.

use crate::support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Client, GatewayGuard, RedisGuard, Response, UpstreamGuard, SERVER_2_THREADS};

/// A config with one upstream, the given tiers and routes, on Redis.
fn config(redis: &RedisGuard, up: &UpstreamGuard, body: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
headers = "both"
retry_after_jitter_ms = 0

[redis]
urls = ["{}"]
timeout_ms = 500
probe_interval_ms = 50

[clients]
trusted_proxies = ["127.0.0.1/32"]
deny = ["203.0.113.0/24"]
allow = ["192.0.2.0/24"]

[plans.tiny]
capacity = 3
refill_per_sec = 0.01

[plans.big]
capacity = 1000
refill_per_sec = 1000

[[api_keys]]
id = "alice"
key = "alice-secret"
plan = "tiny"

[[api_keys]]
id = "bob"
key = "bob-secret"
plan = "big"

[[upstreams]]
name = "up"
servers = ["{}"]

{body}
"#,
        redis.url(),
        up.addr
    )
}

fn get(c: &mut Client, path: &str, headers: &[(&str, &str)]) -> Response {
    c.request("GET", path, headers, b"").expect("request")
}

fn statuses(c: &mut Client, n: usize, path: &str, headers: &[(&str, &str)]) -> Vec<u16> {
    (0..n).map(|_| get(c, path, headers).status).collect()
}

fn ok_then_429(ok: usize, rejected: usize) -> Vec<u16> {
    let mut v = vec![200; ok];
    v.extend(vec![429; rejected]);
    v
}

#[test]
fn ip_tier_limits_each_client_address_behind_a_trusted_proxy() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 4
refill_per_sec = 0.01

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    let a = [("x-forwarded-for", "198.51.100.1")];
    assert_eq!(statuses(&mut c, 6, "/a", &a), ok_then_429(4, 2));
    let r = get(&mut c, "/a", &a);
    assert_eq!(r.json()["violated-policies"], serde_json::json!(["ip"]));
    // Another address has its own bucket; a forged hop left of it changes nothing.
    let b = [("x-forwarded-for", "198.51.100.1, 198.51.100.2")];
    assert_eq!(statuses(&mut c, 5, "/a", &b), ok_then_429(4, 1));
    // IPv4-mapped IPv6 is the IPv4 client.
    assert_eq!(
        statuses(
            &mut c,
            1,
            "/a",
            &[("x-forwarded-for", "::ffff:198.51.100.1")]
        ),
        [429]
    );
    // Rotating addresses inside one IPv6 /64 buys nothing.
    let v6: Vec<u16> = (0..6)
        .map(|i| {
            get(
                &mut c,
                "/a",
                &[("x-forwarded-for", &format!("2001:db8:1:2::{i:x}"))],
            )
            .status
        })
        .collect();
    assert_eq!(v6, ok_then_429(4, 2));
    assert_eq!(
        statuses(&mut c, 1, "/a", &[("x-forwarded-for", "2001:db8:1:3::1")]),
        [200]
    );
    // Garbage XFF entries are skipped: the client is the trusted peer itself.
    assert_eq!(
        statuses(&mut c, 1, "/a", &[("x-forwarded-for", "not-an-ip")]),
        [200]
    );
    assert_eq!(up.count("/a"), 4 + 4 + 4 + 1 + 1);
}

#[test]
fn untrusted_peers_cannot_choose_their_address() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 3
refill_per_sec = 0.01

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"#;
    let cfg = config(&redis, &up, body).replace(
        "trusted_proxies = [\"127.0.0.1/32\"]",
        "trusted_proxies = []",
    );
    let gw = GatewayGuard::start(&cfg);
    let mut c = gw.client();
    let got: Vec<u16> = (0..5)
        .map(|i| get(&mut c, "/x", &[("x-forwarded-for", &format!("10.0.0.{i}"))]).status)
        .collect();
    assert_eq!(
        got,
        ok_then_429(3, 2),
        "XFF from an untrusted peer is ignored"
    );
}

#[test]
fn key_tier_uses_the_plan_and_unknown_keys_cost_nothing() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"

[[routes]]
name = "admin"
path_prefix = "/admin"
upstream = "up"
require_api_key = true
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    assert_eq!(
        statuses(&mut c, 4, "/k", &[("x-api-key", "alice-secret")]),
        ok_then_429(3, 1)
    );
    let r = get(&mut c, "/k", &[("authorization", "Bearer alice-secret")]);
    assert_eq!(r.status, 429, "the bearer form is the same key");
    assert_eq!(r.json()["violated-policies"], serde_json::json!(["key"]));
    assert_eq!(
        statuses(&mut c, 5, "/k", &[("authorization", "Bearer bob-secret")]),
        [200; 5]
    );

    let keys_before = redis.keys();
    // What the limiter decided (a Redis call, a lease, ...): not Redis's
    // own call count, which the replica's heartbeat and lease sweeper add
    // to whenever they run (one landed among these 50 on a loaded host).
    let decided = || support::family_sum(&gw.raw_metrics(), "gateway_limiter_decisions_total");
    let decided_before = decided();
    for i in 0..50 {
        let r = get(&mut c, "/k", &[("x-api-key", &format!("guess-{i}"))]);
        assert_eq!(r.status, 401);
        assert!(
            !r.text().contains("guess"),
            "the body never echoes a key: {}",
            r.text()
        );
    }
    // Keys may expire meanwhile (a refilled bucket, the probe's key); none may appear.
    let keys_after = redis.keys();
    assert!(
        keys_after.is_subset(&keys_before),
        "unknown keys created Redis keys: {keys_after:?} vs {keys_before:?}"
    );
    assert_eq!(
        decided(),
        decided_before,
        "unknown keys cost no limiter call"
    );

    let r = get(&mut c, "/admin/x", &[]);
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["message"], "this route requires an API key");
    let r = get(
        &mut c,
        "/k",
        &[
            ("x-api-key", "alice-secret"),
            ("authorization", "Bearer bob-secret"),
        ],
    );
    assert_eq!(r.status, 400, "two different keys in one request");
    assert_eq!(up.count("/k"), 3 + 5);
    let keys: String = redis.cmd(&["KEYS", "*"]);
    assert!(
        !keys.contains("secret"),
        "Redis keys carry ids, never secrets: {keys}"
    );
    assert!(keys.contains("rl:key:tiny:tb-3-0.01:k:alice"), "{keys}");
    // bob's bucket refills at 1000/s: once what it spent (and what a lease
    // took for it) is back, its key has expired.
    support::wait_for(
        "bob's full bucket to expire",
        Duration::from_secs(5),
        || (!redis.cmd(&["KEYS", "*"]).contains("k:bob")).then_some(()),
    );
}

#[test]
fn deny_and_allow_lists_come_before_any_limiter_work() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 1
refill_per_sec = 0.01

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    let calls = redis.calls("evalsha");
    let r = get(&mut c, "/d", &[("x-forwarded-for", "203.0.113.77")]);
    assert_eq!(r.status, 403);
    assert_eq!(
        statuses(&mut c, 5, "/d", &[("x-forwarded-for", "192.0.2.10")]),
        [200; 5],
        "allow-listed: never limited"
    );
    assert_eq!(
        redis.calls("evalsha"),
        calls,
        "neither list spends a limiter call"
    );
    assert_eq!(up.count("/d"), 5);
}

#[test]
fn every_algorithm_as_a_route_limit() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[[routes]]
name = "tb"
path_prefix = "/tb"
upstream = "up"
limit = { algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.01, scope = "client" }

[[routes]]
name = "fw"
path_prefix = "/fw"
upstream = "up"
limit = { algorithm = "fixed_window", limit = 3, window_secs = 3600, scope = "global" }

[[routes]]
name = "sw"
path_prefix = "/sw"
upstream = "up"
limit = { algorithm = "sliding_window", limit = 3, window_secs = 3600, scope = "client" }

[[routes]]
name = "sl"
path_prefix = "/sl"
methods = ["POST"]
upstream = "up"
limit = { algorithm = "sliding_log", limit = 2, window_secs = 3600, scope = "client" }

[[routes]]
name = "lb"
path_prefix = "/lb"
upstream = "up"
limit = { algorithm = "leaky_bucket", rate_per_sec = 20, max_delay_ms = 100, scope = "global" }
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    let ip1 = [("x-forwarded-for", "198.51.100.1")];
    let ip2 = [("x-forwarded-for", "198.51.100.2")];

    // Client scope: per API key when one is sent, else per address.
    assert_eq!(statuses(&mut c, 4, "/tb", &ip1), ok_then_429(3, 1));
    assert_eq!(statuses(&mut c, 4, "/tb", &ip2), ok_then_429(3, 1));
    assert_eq!(
        statuses(&mut c, 4, "/tb", &[("x-api-key", "bob-secret"), ip1[0]]),
        ok_then_429(3, 1)
    );

    // Global scope: one bucket for everyone.
    assert_eq!(statuses(&mut c, 2, "/fw", &ip1), [200, 200]);
    assert_eq!(statuses(&mut c, 2, "/fw", &ip2), [200, 429]);
    let r = get(&mut c, "/fw", &ip1);
    let retry: u64 = r
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .expect("seconds");
    assert!(
        (1..=3600).contains(&retry),
        "Retry-After {retry} within the hour window"
    );

    assert_eq!(statuses(&mut c, 4, "/sw", &ip1), ok_then_429(3, 1));
    assert_eq!(statuses(&mut c, 1, "/sw", &ip2), [200]);

    let posts: Vec<u16> = (0..3)
        .map(|_| c.request("POST", "/sl", &ip1, b"{}").expect("post").status)
        .collect();
    assert_eq!(posts, ok_then_429(2, 1));

    // Leaky bucket: 10 concurrent requests; slots 50 ms apart, at most 100 ms
    // of waiting: 3 go upstream (after 0, 50 and 100 ms), the rest are 429.
    let addr = gw.addr;
    let handles: Vec<_> = (0..10)
        .map(|_| {
            std::thread::spawn(move || {
                Client::connect(addr)
                    .and_then(|mut c| c.get("/lb"))
                    .map(|r| r.status)
            })
        })
        .collect();
    let mut lb: Vec<u16> = handles
        .into_iter()
        .map(|h| h.join().expect("thread").expect("request"))
        .collect();
    lb.sort();
    assert_eq!(lb, ok_then_429(3, 7));
    assert_eq!(up.count("/lb"), 3);

    for (path, n) in [("/tb", 9), ("/fw", 3), ("/sw", 4), ("/sl", 2)] {
        assert_eq!(up.count(path), n, "upstream count on {path}");
    }
}

#[test]
fn headers_and_body_tell_the_client_where_it_stands() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 400
refill_per_sec = 100

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = { algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.5, scope = "client" }
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    let h = [("x-api-key", "alice-secret")];
    let r = get(&mut c, "/r", &h);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("x-ratelimit-limit"),
        Some("2"),
        "the route tier is the most restrictive"
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("1"));
    let reset: u64 = r
        .header("x-ratelimit-reset")
        .expect("reset")
        .parse()
        .expect("unix seconds");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("time")
        .as_secs();
    assert!(
        reset >= now && reset <= now + 5,
        "reset {reset} vs now {now}"
    );
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"ip\";q=400;w=4, \"key\";q=3;w=300, \"route\";q=2;w=4")
    );
    assert_eq!(r.header("ratelimit"), Some("\"route\";r=1;t=2"));

    get(&mut c, "/r", &h);
    let r = get(&mut c, "/r", &h);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    let p = r.json();
    assert_eq!(
        p["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(p["violated-policies"], serde_json::json!(["route"]));
    let ms = p["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!(ms > 0 && ms <= 2000, "retry_after_ms {ms}");
    let retry: u64 = r
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .expect("seconds");
    assert_eq!(
        retry,
        ms.div_ceil(1000),
        "Retry-After is the wait rounded up to whole seconds"
    );
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    // The connection stays open after a 429, for a POST with a body too.
    assert_eq!(get(&mut c, "/other", &[]).status, 404);
    let r = c
        .request("POST", "/r", &h, b"{\"pickup\":\"stadium\"}")
        .expect("post");
    assert_eq!(r.status, 429);
    assert_eq!(
        r.header("connection"),
        Some("keep-alive"),
        "{:?}",
        r.headers
    );
    assert_eq!(
        get(&mut c, "/other", &[]).status,
        404,
        "the same connection serves on"
    );
}

#[test]
fn three_replicas_share_one_limit() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[[routes]]
name = "g"
path_prefix = "/g"
upstream = "up"
limit = { algorithm = "token_bucket", capacity = 20, refill_per_sec = 10, scope = "global" }
"#;
    let cfg = config(&redis, &up, body)
        .replace("backend = \"redis\"", "backend = \"redis\"\ninstances = 3");
    let gws: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&cfg)).collect();
    let addrs: Vec<_> = gws.iter().map(|g| g.addr).collect();
    let calls_before = redis.calls("evalsha");
    let admitted = Arc::new(AtomicU64::new(0));
    let sent = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let run_for = Duration::from_millis(1500);
    let clients: Vec<_> = (0..6)
        .map(|i| {
            let (addrs, admitted, sent) = (addrs.clone(), admitted.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut conns: Vec<Client> = addrs
                    .iter()
                    .map(|a| Client::connect(*a).expect("connect"))
                    .collect();
                let mut n = i;
                while started.elapsed() < run_for {
                    let c = &mut conns[n % 3];
                    n += 1;
                    let r = c.get("/g").expect("request");
                    assert!(r.status == 200 || r.status == 429, "status {}", r.status);
                    sent.fetch_add(1, Ordering::Relaxed);
                    if r.status == 200 {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client thread");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = admitted.load(Ordering::Relaxed);
    let sent = sent.load(Ordering::Relaxed);
    let bound = 20.0 + 10.0 * elapsed;
    assert!(
        admitted as f64 <= bound,
        "admitted {admitted} > capacity + rate x {elapsed:.2}s = {bound:.1}"
    );
    assert!(
        admitted >= 20,
        "at least the burst was admitted: {admitted}"
    );
    assert!(sent > admitted, "the load exceeded the limit: sent {sent}");
    assert_eq!(
        up.count("/g"),
        admitted,
        "the upstream saw exactly the admitted requests"
    );
    // One call decides all tiers of a request; a client known to be denied
    // until T is answered from memory until T, so denials may cost none.
    let calls = redis.calls("evalsha") - calls_before;
    assert!(
        calls >= admitted && calls <= sent,
        "script calls {calls}: admitted {admitted}, sent {sent}"
    );
    eprintln!("FIGURES three replicas: sent {sent}, admitted {admitted}, bound {bound:.1} over {elapsed:.2}s, script calls {calls}");
}

#[test]
fn one_script_call_decides_all_three_tiers() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 100000
refill_per_sec = 100000

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = { algorithm = "sliding_window", limit = 100000, window_secs = 60, scope = "client" }
"#;
    // Without leases: every request is one call.
    let no_leases = format!("{body}\n[limiter.leases]\nenabled = false\n");
    let gw = GatewayGuard::start(&config(&redis, &up, &no_leases));
    let before = redis.calls("evalsha");
    fifty_admitted_on_three_tiers(&gw);
    assert_eq!(
        redis.calls("evalsha") - before,
        50,
        "exactly one EVALSHA per request for three tiers"
    );
    drop(gw);
    // With leases (the default) a hot client's three tiers are decided here
    // from tokens Redis debited ahead: a few calls for the 50.
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let before = redis.calls("evalsha");
    fifty_admitted_on_three_tiers(&gw);
    let calls = redis.calls("evalsha") - before;
    let leased = gw.metric("gateway_limiter_decisions_total{path=\"lease\"}");
    assert!(calls <= 10, "{calls} calls for 50 requests with leases");
    assert!(leased >= 40.0, "{leased} of 50 decided on a lease");
}

/// 50 of bob's requests on one connection, each admitted with all three
/// tiers in its RateLimit-Policy.
fn fifty_admitted_on_three_tiers(gw: &GatewayGuard) {
    let mut c = gw.client();
    for _ in 0..50 {
        let r = c
            .request("GET", "/r", &[("x-api-key", "bob-secret")], b"")
            .expect("request");
        assert_eq!(r.status, 200);
        let policy = r.header("ratelimit-policy").unwrap_or_default();
        assert!(
            policy.contains("\"ip\"") && policy.contains("\"key\"") && policy.contains("\"route\""),
            "{policy}"
        );
    }
}

#[test]
fn a_flooding_client_is_answered_from_memory_until_its_retry_time() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let body = r#"
[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = { algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.001, scope = "client" }
"#;
    let gw = GatewayGuard::start(&config(&redis, &up, body));
    let mut c = gw.client();
    let before = redis.calls("evalsha");
    let got = statuses(&mut c, 200, "/r", &[]);
    assert_eq!(got, ok_then_429(2, 198));
    let calls = redis.calls("evalsha") - before;
    assert_eq!(
        calls, 3,
        "2 admissions + the first denial; the other 197 denials cost no call"
    );
    let r = get(&mut c, "/r", &[]);
    assert_eq!(r.status, 429);
    let retry: u64 = r
        .header("retry-after")
        .expect("retry-after")
        .parse()
        .expect("seconds");
    assert!(
        (990..=1000).contains(&retry),
        "the remembered wait: {retry}s"
    );
}
