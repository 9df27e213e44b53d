//! What an on-call engineer relies on, through the real binary: metrics that
//! move as requests flow, readiness on the fallback, hot reload (SIGHUP and
//! file change) that never drops a request, a broken file that changes
//! nothing, shadow mode, and secrets that never leak.

use crate::support;

use std::time::Duration;

use support::{
    free_port, wait_for, Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS,
};

fn config(redis_url: &str, up: &UpstreamGuard, route_limit: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["{redis_url}"]
# Generous: these tests count decisions exactly, so a stall of the (shared,
# busy) test machine must not send one to the fallback. Failover has its own
# tests (integration::fallback).
timeout_ms = 1000
probe_interval_ms = 50

[clients]
trusted_proxies = ["127.0.0.1/32"]

[plans.free]
capacity = 100
refill_per_sec = 100

[[api_keys]]
id = "canary-client"
key = "CANARY-SECRET-7f3a9"
plan = "free"

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "limited"
path_prefix = "/limited"
upstream = "up"
limit = {route_limit}

[[routes]]
name = "open"
path_prefix = "/open"
upstream = "up"
"#,
        up.addr
    )
}

const TB3: &str =
    r#"{ algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.001, scope = "global" }"#;
const TB6: &str =
    r#"{ algorithm = "token_bucket", capacity = 6, refill_per_sec = 0.001, scope = "global" }"#;

/// Starts a request the upstream holds for `delay_ms` and waits until it is
/// there, so a reload happens while it is in flight.
fn slow_request_in_flight(
    gw: &GatewayGuard,
    up: &UpstreamGuard,
    delay_ms: &'static str,
) -> std::thread::JoinHandle<std::io::Result<support::Response>> {
    let addr = gw.addr;
    let handle = std::thread::spawn(move || {
        Client::connect(addr)
            .and_then(|mut c| c.request("GET", "/open/slow", &[("x-mock-delay-ms", delay_ms)], b""))
    });
    wait_for("the slow request upstream", Duration::from_secs(5), || {
        (up.count("/open/slow") == 1).then_some(())
    });
    handle
}

fn admitted(gw: &GatewayGuard, n: usize, path: &str) -> usize {
    let mut c = gw.client();
    (0..n)
        .filter(|_| c.get(path).expect("request").status == 200)
        .count()
}

#[test]
fn every_metric_family_moves_as_requests_flow() {
    let mut redis = Some(RedisGuard::start());
    let up = UpstreamGuard::start();
    let url = redis.as_ref().map(|r| r.url()).unwrap_or_default();
    let gw = GatewayGuard::start(&config(&url, &up, TB3));
    assert_eq!(gw.metric("gateway_limiter_backend{backend=\"redis\"}"), 1.0);
    assert_eq!(admitted(&gw, 5, "/limited"), 3);
    admitted(&gw, 2, "/open");
    admitted(&gw, 1, "/missing");
    let m = |s: &str| gw.metric(s);
    assert_eq!(
        m("gateway_requests_total{route=\"limited\",status=\"200\"}"),
        3.0
    );
    assert_eq!(
        m("gateway_requests_total{route=\"limited\",status=\"429\"}"),
        2.0
    );
    assert_eq!(
        m("gateway_requests_total{route=\"open\",status=\"200\"}"),
        2.0
    );
    assert_eq!(
        m("gateway_requests_total{route=\"(none)\",status=\"404\"}"),
        1.0
    );
    assert_eq!(
        m("gateway_ratelimit_decisions_total{tier=\"route\",route=\"limited\",decision=\"rejected\"}"),
        2.0
    );
    assert_eq!(
        m("gateway_ratelimit_decisions_total{tier=\"route\",route=\"limited\",decision=\"allowed\"}"),
        3.0
    );
    assert_eq!(
        m("gateway_redis_call_duration_seconds_count"),
        4.0,
        "one Redis call per limited request; the second denial is answered from memory"
    );
    // Sequential requests: each went alone, in a batch of one.
    assert_eq!(m("gateway_redis_batch_size_count"), 4.0);
    assert_eq!(m("gateway_redis_batch_size_bucket{le=\"1\"}"), 4.0);
    assert_eq!(
        m("gateway_upstream_duration_seconds_count{route=\"limited\"}"),
        3.0
    );

    // Redis dies: the next limited request fails over; the gauge and counter follow.
    drop(redis.take());
    // (/limited's denial is remembered; a keyed request needs Redis.)
    gw.client()
        .request("GET", "/open", &[("x-api-key", "CANARY-SECRET-7f3a9")], b"")
        .expect("request");
    wait_for("fallback to local", Duration::from_secs(5), || {
        (gw.metric("gateway_limiter_backend{backend=\"local\"}") == 1.0).then_some(())
    });
    assert_eq!(m("gateway_limiter_backend{backend=\"redis\"}"), 0.0);
    assert!(m("gateway_fallback_transitions_total{to=\"local\"}") >= 1.0);
    assert!(
        gw.admin_get("/readyz").text().contains("\"local\""),
        "ready, on the fallback"
    );

    // Reloads: one good, one bad.
    gw.rewrite_config(&config(&url, &up, TB6));
    gw.signal("HUP");
    wait_for("a counted good reload", Duration::from_secs(5), || {
        (gw.metric("gateway_config_reloads_total{result=\"ok\"}") >= 1.0).then_some(())
    });
    gw.rewrite_config("this is not toml [");
    gw.signal("HUP");
    wait_for("a counted bad reload", Duration::from_secs(5), || {
        (gw.metric("gateway_config_reloads_total{result=\"error\"}") >= 1.0).then_some(())
    });
    let text = gw.metrics();
    assert!(
        !text.contains("CANARY") && !text.contains("127.0.0.1"),
        "labels never carry secrets or addresses"
    );

    // A request the upstream holds is in flight until it has been counted.
    let raw_in_flight =
        || support::series(&gw.raw_metrics(), "gateway_requests_in_flight").map(str::to_string);
    assert_eq!(raw_in_flight().as_deref(), Some("0"));
    let slow = slow_request_in_flight(&gw, &up, "600");
    assert_eq!(raw_in_flight().as_deref(), Some("1"));
    assert_eq!(slow.join().unwrap().expect("slow request").status, 200);
    assert_eq!(m("gateway_requests_in_flight"), 0.0);
    assert_eq!(
        m("gateway_requests_total{route=\"open\",status=\"200\"}"),
        4.0
    );
}

#[test]
fn ready_at_once_when_redis_is_down() {
    let up = UpstreamGuard::start();
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let gw = GatewayGuard::start_opts(&config(&dead, &up, TB3), false);
    let r = gw.admin_get("/readyz");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["backend"], "local");
    assert_eq!(gw.admin_get("/healthz").status, 200);
    // Serving on local buckets: instances = 1, so the whole limit applies.
    assert_eq!(admitted(&gw, 5, "/limited"), 3);
}

#[test]
fn sighup_applies_a_new_limit_without_dropping_a_request_in_flight() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&redis.url(), &up, TB3));
    let in_flight = slow_request_in_flight(&gw, &up, "800");
    gw.rewrite_config(&config(&redis.url(), &up, TB6));
    gw.signal("HUP");
    wait_for("the reload", Duration::from_secs(5), || {
        (gw.metric("gateway_config_reloads_total{result=\"ok\"}") >= 1.0).then_some(())
    });
    assert_eq!(admitted(&gw, 8, "/limited"), 6, "the new capacity applies");
    let r = in_flight
        .join()
        .expect("thread")
        .expect("the in-flight request completes");
    assert_eq!(r.status, 200);
    assert!(gw.log().contains("config reloaded"), "the reload is logged");
}

#[test]
fn a_changed_file_is_picked_up_and_a_broken_one_changes_nothing() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&redis.url(), &up, TB3));
    let in_flight = slow_request_in_flight(&gw, &up, "1500");
    gw.rewrite_config(&config(&redis.url(), &up, TB6));
    wait_for("the file-change reload", Duration::from_secs(10), || {
        (gw.metric("gateway_config_reloads_total{result=\"ok\"}") >= 1.0).then_some(())
    });
    let r = in_flight
        .join()
        .expect("thread")
        .expect("the in-flight request completes");
    assert_eq!(
        r.status, 200,
        "no request in flight is dropped by a file-change reload"
    );
    assert_eq!(admitted(&gw, 8, "/limited"), 6);

    // A broken file: a wrong type and a dangling upstream.
    let broken = config(&redis.url(), &up, TB3)
        .replace("threads = 2", "threads = \"many\"")
        .replace(
            "upstream = \"up\"\n\n[[routes]]\nname = \"open\"",
            "upstream = \"up\"\n\n[[routes]]\nname = \"open2\"\nupstream_typo = 1",
        );
    gw.rewrite_config(&broken);
    wait_for("the failed reload", Duration::from_secs(10), || {
        (gw.metric("gateway_config_reloads_total{result=\"error\"}") >= 1.0).then_some(())
    });
    let log = gw.log();
    assert!(
        log.contains("server.threads (line"),
        "the error names the key: {log}"
    );
    // Still serving the last good config (capacity 6, bucket already drained).
    assert_eq!(gw.client().get("/limited").expect("request").status, 429);
    assert_eq!(gw.client().get("/open/x").expect("request").status, 200);
}

#[test]
fn shadow_mode_decides_and_counts_but_never_rejects() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let shadow = r#"{ algorithm = "fixed_window", limit = 2, window_secs = 3600, scope = "global", shadow = true }"#;
    let cfg = config(&redis.url(), &up, shadow).replace(
        "[plans.free]",
        "[tiers.ip]\nalgorithm = \"token_bucket\"\ncapacity = 1\nrefill_per_sec = 0.001\nshadow = true\n\n[plans.free]",
    );
    let gw = GatewayGuard::start(&cfg);
    assert_eq!(
        admitted(&gw, 10, "/limited"),
        10,
        "shadow limits never reject"
    );
    assert_eq!(up.count("/limited"), 10);
    assert_eq!(
        gw.metric("gateway_ratelimit_decisions_total{tier=\"route\",route=\"limited\",decision=\"shadow_rejected\"}"),
        8.0
    );
    assert_eq!(
        gw.metric("gateway_ratelimit_decisions_total{tier=\"ip\",route=\"limited\",decision=\"shadow_rejected\"}"),
        9.0
    );
    wait_for(
        "shadow rejections in the access log",
        Duration::from_secs(5),
        || {
            gw.log()
                .contains("shadow_rejected_by=\"ip,route\"")
                .then_some(())
        },
    );
}

#[test]
fn a_canary_secret_never_leaks() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&redis.url(), &up, TB3));
    let secret = "CANARY-SECRET-7f3a9";
    let mut c = gw.client();
    let mut bodies = String::new();
    for (path, headers) in [
        ("/limited", vec![("x-api-key", secret)]),
        (
            "/limited",
            vec![("authorization", "Bearer CANARY-SECRET-7f3a9")],
        ),
        ("/open?api_key=CANARY-SECRET-7f3a9", vec![]),
        ("/open", vec![("x-api-key", "CANARY-SECRET-7f3a9-wrong")]),
        ("/nowhere?k=CANARY-SECRET-7f3a9", vec![]),
        ("/open/%zzCANARY-SECRET-7f3a9", vec![]),
    ] {
        for _ in 0..3 {
            let r = c.request("GET", path, &headers, b"").expect("request");
            if r.status != 200 {
                bodies.push_str(&r.text());
            }
        }
    }
    assert!(!bodies.contains(secret), "error bodies: {bodies}");
    let keys = redis.cmd(&["KEYS", "*"]);
    assert!(
        !keys.is_empty() && !keys.contains(secret),
        "redis keys: {keys}"
    );
    assert!(!gw.metrics().contains(secret), "metrics");
    wait_for("access lines", Duration::from_secs(5), || {
        gw.log().contains("canary-client").then_some(())
    });
    assert!(!gw.log().contains(secret), "logs: {}", gw.log());
}

/// A flood of refusals does not flood the log. With the defaults
/// (`[log] refusals_per_sec = 20`), a 3 s spray that is mostly 429s writes
/// at most 20 refusal lines a second, each written line says how many were
/// left out before it, and lines written plus lines left out (the metric)
/// are every refusal. `gateway_requests_total` still counts each. With
/// `access = false` no request line is written at all (this spray has no
/// errors or 5xx, which would be).
#[test]
fn a_flood_of_refusals_writes_a_bounded_log() {
    for access in [true, false] {
        let up = UpstreamGuard::start();
        let gw = GatewayGuard::start(&format!(
            r#"
{SERVER_2_THREADS}

[log]
access = {access}

[limiter]
backend = "local"

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 5, refill_per_sec = 1 }}
"#,
            up.addr
        ));
        let started = std::time::Instant::now();
        let mut statuses = std::collections::HashMap::<u16, u64>::new();
        let mut c = gw.client();
        while started.elapsed() < Duration::from_secs(3) {
            let s = c.get("/x").expect("request").status;
            *statuses.entry(s).or_default() += 1;
        }
        let secs = started.elapsed().as_secs() + 1;
        let refused = statuses.get(&429).copied().unwrap_or(0);
        let log = gw.log();
        let lines: Vec<&str> = log.lines().filter(|l| l.contains("request_id=")).collect();
        let refusal_lines = lines.iter().filter(|l| l.contains(" status=429")).count() as u64;
        let said_left_out: u64 = lines
            .iter()
            .filter_map(|l| l.split(" left_out=").nth(1))
            .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .sum();
        let left_out = gw.metric("gateway_access_log_left_out_total") as u64;
        let counted = gw.metric("gateway_requests_total{route=\"r\",status=\"429\"}") as u64;
        println!(
            "FIGURES access log (access={access}): {refused} refusals in {secs} s; {refusal_lines} lines written ({} in all), left out {left_out} (the written lines say {said_left_out}); gateway_requests_total counts {counted}",
            lines.len()
        );
        assert!(refused > 500, "a flood: {statuses:?}");
        assert_eq!(counted, refused, "the metrics count every refusal");
        if access {
            assert!(
                refusal_lines > 0 && refusal_lines <= 20 * secs,
                "{refusal_lines}"
            );
            assert_eq!(refusal_lines + left_out, refused, "written + left out");
            assert!(
                said_left_out > 0 && said_left_out <= left_out,
                "{said_left_out}"
            );
            assert!(
                lines.iter().any(|l| l.contains(" status=200")),
                "admitted lines stay"
            );
        } else {
            assert!(lines.is_empty(), "access = false: {:?}", lines.first());
        }
    }
}
