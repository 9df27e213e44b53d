//! Operators' view of a client's buckets: `GET`/`DELETE /limits` on the
//! admin listener and `gateway limits show|reset`, on the Redis backend
//! (three replicas on one Redis) and on the local backend, through real
//! gateway processes. Every count is against the exact bound.

use crate::support;

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::{wait_for, Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

const TOKEN: &str = "test-admin-token-0123456789";

/// A plan of 5 for `alice`, a client route (fixed window of 8 an hour), a
/// global route (token bucket of 100) and an IP tier of 50; `backend` and
/// `admin` go into their sections.
fn config(up: &UpstreamGuard, backend: &str, admin: &str) -> String {
    format!(
        r#"
{SERVER}

{admin}

[limiter]
retry_after_jitter_ms = 0
{backend}

[clients]
trusted_proxies = ["127.0.0.1/32"]

[tiers.ip]
algorithm = "token_bucket"
capacity = 50
refill_per_sec = 0.001

[plans.small]
capacity = 5
refill_per_sec = 0.001

[[api_keys]]
id = "alice"
key = "alice-secret-key"
plan = "small"

[[upstreams]]
name = "up"
servers = ["{addr}"]

[[routes]]
name = "rides"
path_prefix = "/rides"
upstream = "up"
limit = {{ algorithm = "fixed_window", limit = 8, window_secs = 3600 }}

[[routes]]
name = "status"
path_prefix = "/status"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 100, refill_per_sec = 0.001, scope = "global" }}
"#,
        addr = up.addr
    )
}

/// Three replicas on `redis`, without leases: every figure below is what
/// Redis holds after each request (with leases, a replica holds tokens of
/// its own: `a_replicas_lease_is_shown_beside_what_redis_holds`).
fn redis_backend(redis: &RedisGuard) -> String {
    redis_backend_with(redis, "enabled = false")
}

fn redis_backend_with(redis: &RedisGuard, leases: &str) -> String {
    format!(
        "backend = \"redis\"\ninstances = 3\n\n[limiter.leases]\n{leases}\n\n[redis]\nurls = [\"{}\"]\ntimeout_ms = 200\nprobe_interval_ms = 100",
        redis.url()
    )
}

/// With leases, `/limits` on the replica holding one shows it beside what
/// Redis holds: the two add up to what the client has left. (A lease of a
/// minute, so it is still out when read.)
#[test]
fn a_replicas_lease_is_shown_beside_what_redis_holds() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let cfg = config(
        &up,
        &redis_backend_with(&redis, "enabled = true\nperiod_ms = 60000"),
        "",
    );
    let gw = GatewayGuard::start(&cfg);
    let got: Vec<u16> = (0..10).map(|_| status(&gw, "/status")).collect();
    assert_eq!(got, [200, 200, 200, 200, 200, 429, 429, 429, 429, 429]);
    let (s, v) = admin(&gw, "GET", "/limits?ip=127.0.0.1", None);
    assert_eq!(s, 200, "{v}");
    let ip = &v["buckets"][0];
    assert_eq!(ip["tier"], "ip", "{v}");
    let lease = ip["lease"]["tokens"].as_u64().unwrap_or(0);
    assert!(lease > 0, "the ip bucket is leased: {v}");
    assert!(ip["lease"]["expires_ms"].as_u64().unwrap_or(0) > 0, "{v}");
    // 5 admitted of 50 (the 5 refused by the plan took nothing).
    assert_eq!(
        ip["remaining"].as_u64().unwrap() + lease,
        45,
        "Redis's remaining and the lease: {v}"
    );
    // The plan's bucket is too small to lease (a share of 5 / 3 replicas):
    // each request took its ip and route tiers from leases and asked Redis
    // for its plan alone.
    let spent = gw.metric("gateway_lease_tokens_total{event=\"spent\"}");
    assert!(spent >= 2.0, "{spent} leased tokens spent");

    // `gateway limits show` reads Redis itself, and asks the replica at
    // server.admin_listen for its lease: the same figures.
    let (ok, out, err) = cli(&gw, &["show", "--ip", "127.0.0.1", "--json"]);
    assert!(ok, "{err}");
    let shown: Value = serde_json::from_str(&out).expect("json");
    let first = &shown["buckets"][0];
    assert_eq!(first["tier"], "ip", "{shown}");
    assert_eq!(first["lease"]["tokens"].as_u64(), Some(lease), "{shown}");
    assert_eq!(first["remaining"], ip["remaining"], "{shown}");
    assert!(
        shown["leases"]
            .as_str()
            .unwrap_or("")
            .contains("admin_listen"),
        "{shown}"
    );
    let (ok, table, err) = cli(&gw, &["show", "--ip", "127.0.0.1"]);
    assert!(ok, "{err}");
    assert!(table.contains(&format!("{lease} (")), "{table}");
    assert!(table.contains("leases: of the replica at"), "{table}");
}

const ALICE: (&str, &str) = ("x-api-key", "alice-secret-key");

fn status(gw: &GatewayGuard, path: &str) -> u16 {
    gw.client()
        .request("GET", path, &[ALICE], b"")
        .map_or(0, |r| r.status)
}

/// An admin request; a token goes as `bearer` in lower case, which is the
/// same scheme (RFC 9110 §11.1).
fn admin(gw: &GatewayGuard, method: &str, path: &str, token: Option<&str>) -> (u16, Value) {
    let auth = token.map(|t| format!("bearer {t}"));
    let r = admin_raw(gw, method, path, auth.as_deref());
    let body = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    (r.status, body)
}

fn admin_raw(
    gw: &GatewayGuard,
    method: &str,
    path: &str,
    authorization: Option<&str>,
) -> support::http::Response {
    let headers: Vec<(&str, &str)> = authorization
        .iter()
        .map(|a| ("authorization", *a))
        .collect();
    Client::connect(gw.admin)
        .and_then(|mut c| c.request(method, path, &headers, b""))
        .expect("admin request")
}

/// (tier, route) -> (limit, remaining, backend) of a `/limits` answer.
fn buckets(v: &Value) -> Vec<(String, String, u64, u64, String)> {
    v["buckets"]
        .as_array()
        .unwrap_or_else(|| panic!("no buckets in {v}"))
        .iter()
        .map(|b| {
            (
                b["tier"].as_str().unwrap().to_string(),
                b["route"].as_str().unwrap_or("-").to_string(),
                b["limit"].as_u64().unwrap(),
                b["remaining"].as_u64().unwrap(),
                b["backend"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn b(
    tier: &str,
    route: &str,
    limit: u64,
    remaining: u64,
    backend: &str,
) -> (String, String, u64, u64, String) {
    (tier.into(), route.into(), limit, remaining, backend.into())
}

fn cli(gw: &GatewayGuard, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
        .arg("limits")
        .args(args)
        .arg("--config")
        .arg(&gw.config_path)
        .output()
        .expect("run gateway limits");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Three replicas on one Redis: what one admits, another shows; a reset
/// through the third (or the CLI) makes the buckets whole for all three,
/// including the replica that remembered a denial.
#[test]
fn inspect_and_reset_across_three_replicas_on_redis() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let cfg = config(&up, &redis_backend(&redis), "");
    let gws: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&cfg)).collect();
    let (a, bb, c) = (&gws[0], &gws[1], &gws[2]);

    // Through A: the plan of 5 admits 5 of 6 on /rides (the route's window
    // of 8 is charged 5), and 2 on /status.
    let got: Vec<u16> = (0..6).map(|_| status(a, "/rides")).collect();
    assert_eq!(got, [200, 200, 200, 200, 200, 429]);
    // B is refused too, and remembers the denial.
    assert_eq!(status(bb, "/rides"), 429);

    let (s, v) = admin(c, "GET", "/limits?key=alice", None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        buckets(&v),
        [
            b("key", "-", 5, 0, "redis"),
            b("route", "rides", 8, 3, "redis"),
            b("route", "status", 100, 100, "redis"),
        ],
        "{v}"
    );
    assert!(
        !v.to_string().contains("alice-secret-key"),
        "a secret in {v}"
    );
    // Reading spent nothing.
    let (_, again) = admin(a, "GET", "/limits?key=alice", None);
    assert_eq!(buckets(&again), buckets(&v));
    let (s, v) = admin(bb, "GET", "/limits?ip=127.0.0.1&route=rides", None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        buckets(&v),
        [b("route", "rides", 8, 8, "redis")],
        "anonymous requests from 127.0.0.1 have their own bucket"
    );
    let (_, v) = admin(bb, "GET", "/limits?ip=127.0.0.1", None);
    assert_eq!(
        buckets(&v)[0],
        b("ip", "-", 50, 45, "redis"),
        "5 admitted; the 2 refused charged no tier: {v}"
    );

    // The CLI reads Redis itself and agrees.
    let (ok, out, err) = cli(c, &["show", "--key", "alice", "--json"]);
    assert!(ok, "{err}");
    let cli_view: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(buckets(&cli_view), buckets(&again));

    // Reset through C (loopback admin, no token configured: allowed).
    let (s, v) = admin(c, "DELETE", "/limits?key=alice", None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["backend"], "redis");
    assert_eq!(
        v["redis_buckets_deleted"], 2,
        "the key and rides buckets held state: {v}"
    );
    // B forgets its remembered denial within a heartbeat.
    wait_for("B admits after the reset", Duration::from_secs(5), || {
        (status(bb, "/rides") == 200).then_some(())
    });
    // One admitted on B; the plan of 5 admits exactly 4 more, across A and C.
    let after: Vec<u16> = (0..5)
        .map(|i| status(if i % 2 == 0 { a } else { c }, "/rides"))
        .collect();
    assert_eq!(after, [200, 200, 200, 200, 429]);
    let (_, v) = admin(a, "GET", "/limits?key=alice&route=rides", None);
    assert_eq!(buckets(&v), [b("route", "rides", 8, 3, "redis")], "{v}");
    assert_eq!(up.count("/rides"), 10, "upstream saw exactly the admitted");

    // The CLI's reset, then show as a table.
    let (ok, out, err) = cli(a, &["reset", "--key", "alice"]);
    assert!(ok, "{err}");
    assert!(
        out.contains("reset key") && out.contains("backend: redis"),
        "{out}"
    );
    let (ok, out, _) = cli(a, &["show", "--key", "alice", "--route", "rides"]);
    assert!(ok);
    assert!(
        out.lines()
            .nth(1)
            .is_some_and(|l| l.contains("rides") && l.contains(" 8 ")),
        "{out}"
    );
    println!("FIGURES limits-redis: 5 of 6 admitted (bound 5), reset, then 5 of 6 across three replicas (bound 5); upstream {}", up.count("/rides"));
}

/// The local backend: the buckets live in the gateway, the CLI asks its
/// admin port, and a configured token guards resetting (reading changes
/// nothing and is open, as the contract says).
#[test]
fn inspect_and_reset_on_the_local_backend_with_a_token() {
    let up = UpstreamGuard::start();
    let admin_section = format!("[admin]\ntoken = \"{TOKEN}\"");
    let gw = GatewayGuard::start(&config(&up, "backend = \"local\"", &admin_section));
    let got: Vec<u16> = (0..6).map(|_| status(&gw, "/rides")).collect();
    assert_eq!(got, [200, 200, 200, 200, 200, 429]);

    // A reset without the token, or with a wrong one: 401, and the
    // challenge RFC 9110 §11.6.1 asks for.
    for auth in [None, Some("Bearer wrong-token-0123456789")] {
        let r = admin_raw(&gw, "DELETE", "/limits?key=alice", auth);
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(
            r.header("www-authenticate"),
            Some("Bearer realm=\"gateway admin\""),
            "{auth:?}"
        );
    }
    // Another method: 405 naming the ones served.
    let r = admin_raw(&gw, "POST", "/limits?key=alice", None);
    assert_eq!(r.status, 405);
    assert_eq!(r.header("allow"), Some("GET, DELETE"));
    let (s, v) = admin(&gw, "GET", "/limits?key=alice", None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        buckets(&v),
        [
            b("key", "-", 5, 0, "local"),
            b("route", "rides", 8, 3, "local"),
            b("route", "status", 100, 100, "local"),
        ]
    );
    let log = gw.log();
    assert!(
        !log.contains(TOKEN) && !log.contains("alice-secret-key"),
        "a secret in the log"
    );

    // Questions that cannot be answered say why.
    for (q, want, what) in [
        ("/limits?key=bob", 404, "no API key has id \"bob\""),
        (
            "/limits?key=alice&route=nope",
            404,
            "no route is named \"nope\"",
        ),
        ("/limits?ip=1.2.3", 400, "not an IP address"),
        ("/limits", 400, "missing query parameter: name a client"),
        ("/limits?route=rides", 400, "missing query parameter"),
    ] {
        for method in ["GET", "DELETE"] {
            let (s, v) = admin(&gw, method, q, Some(TOKEN));
            assert_eq!(s, want, "{method} {q}: {v}");
            assert!(
                v["error"].as_str().unwrap_or("").contains(what),
                "{method} {q}: {v}"
            );
        }
    }

    // The CLI names what is missing in its own flags.
    let (ok, _, err) = cli(&gw, &["show"]);
    assert!(!ok);
    assert!(err.contains("--key ID or --ip ADDRESS"), "{err}");

    // The CLI goes through the admin port (the config gives it the token).
    let (ok, out, err) = cli(&gw, &["reset", "--key", "alice", "--json"]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["backend"], "local");
    assert_eq!(v["local_buckets_deleted"], 2, "{v}");
    let again: Vec<u16> = (0..6).map(|_| status(&gw, "/rides")).collect();
    assert_eq!(again, [200, 200, 200, 200, 200, 429], "whole again: 5 of 6");
    let (ok, out, _) = cli(&gw, &["show", "--ip", "127.0.0.1"]);
    assert!(ok);
    assert!(out.contains("ip ") && out.contains("local"), "{out}");
    assert_eq!(up.count("/rides"), 10);
    println!("FIGURES limits-local: 5 of 6 admitted (bound 5), reset, 5 of 6 again (bound 5)");
}
