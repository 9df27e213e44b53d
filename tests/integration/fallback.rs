//! Redis failing under steady load through the real gateway: killed,
//! stopped, restarted, paused, its scripts flushed, full. Every request must
//! still be answered (no 5xx from the limiter), no request may wait on a dead
//! Redis once the breaker is open, and the gateway must fail back by itself.
//! Each test prints a `FIGURES` line for the record.

use crate::support;

use std::time::Duration;

use support::load::{Load, Report};
use support::{free_port, Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS};

const BUDGET_MS: u64 = 15;

fn config(
    redis_port: u16,
    up: &UpstreamGuard,
    instances: u32,
    on_failure: &str,
    limit: &str,
) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
on_redis_failure = "{on_failure}"
instances = {instances}
retry_after_jitter_ms = 0

[redis]
urls = ["redis://127.0.0.1:{redis_port}"]
timeout_ms = {BUDGET_MS}
probe_interval_ms = 100

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = {limit}
"#,
        up.addr
    )
}

/// Admits everything: the tests measure availability and latency, not limits.
const OPEN: &str = r#"{ algorithm = "token_bucket", capacity = 1000000000, refill_per_sec = 1000000000, scope = "global" }"#;

/// Load on the gateway, two clients, already flowing (200 answered).
fn steady_load(gw: &GatewayGuard) -> Load {
    let load = Load::start(vec![gw.addr], gw.admin, "/r", 2, 30);
    load.wait_answers(200);
    load
}

/// Waits for the fail-back, lets the load run on Redis a little, then
/// `finish`es it.
fn after_failback(
    gw: &GatewayGuard,
    load: Load,
    name: &str,
    fault: Duration,
    recover: Duration,
) -> Report {
    gw.wait_backend("redis", Duration::from_secs(15));
    load.wait_answers(200);
    finish(load, name, fault, recover)
}

/// Stops the load, prints its figures and checks every request was served.
fn finish(load: Load, name: &str, fault: Duration, recover: Duration) -> Report {
    let r = load.stop();
    r.print_figures(name, fault, recover);
    assert_served(name, &r);
    r
}

fn assert_served(name: &str, r: &Report) {
    assert_eq!(r.server_errors(), 0, "{name}: 5xx or dropped requests");
    assert_eq!(
        r.count(|s| s.status != 200),
        0,
        "{name}: every request admitted"
    );
    assert!(
        r.samples.len() > 100,
        "{name}: the load ran ({} requests)",
        r.samples.len()
    );
}

#[test]
fn kill_9_then_restart() {
    let up = UpstreamGuard::start();
    let port = free_port();
    let redis = RedisGuard::start_on(port, &[]);
    let gw = GatewayGuard::start(&config(port, &up, 1, "local", OPEN));
    let load = steady_load(&gw);
    let fault = load.now();
    drop(redis); // SIGKILL, reaped
    gw.wait_backend("local", Duration::from_secs(15));
    load.wait_answers(500);
    let recover = load.now();
    let _redis = RedisGuard::start_on(port, &[]);
    let r = after_failback(&gw, load, "kill-9+restart", fault, recover);
    assert!(
        r.slowest(fault, recover) < Duration::from_secs(2),
        "no request waited on a dead Redis"
    );
    // One failover, one failback: the request path's connection, dead with
    // the old Redis, is renewed at failback instead of failing once more.
    // (Start-up on Redis is not a transition.)
    assert_eq!(
        gw.metric("gateway_fallback_transitions_total{to=\"local\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("gateway_fallback_transitions_total{to=\"redis\"}"),
        1.0
    );
}

#[test]
fn sigstop_then_sigcont() {
    let up = UpstreamGuard::start();
    let port = free_port();
    let redis = RedisGuard::start_on(port, &[]);
    let gw = GatewayGuard::start(&config(port, &up, 1, "local", OPEN));
    let load = steady_load(&gw);
    let fault = load.now();
    redis.signal("STOP");
    gw.wait_backend("local", Duration::from_secs(15));
    load.wait_answers(700);
    let recover = load.now();
    redis.signal("CONT");
    let r = after_failback(&gw, load, "sigstop+sigcont", fault, recover);
    let open = r.backend_at("local", fault).expect("fell back") + Duration::from_millis(20);
    assert!(
        r.slowest(open, recover) < Duration::from_millis(BUDGET_MS + 500),
        "once the breaker is open no request waits on the stopped Redis: {:?}",
        r.slowest(open, recover)
    );
}

#[test]
fn client_pause() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let gw = GatewayGuard::start(&config(redis.port, &up, 1, "local", OPEN));
    let load = steady_load(&gw);
    let fault = load.now();
    assert!(redis
        .cmd(&["CLIENT", "PAUSE", "1200", "ALL"])
        .contains("OK"));
    gw.wait_backend("local", Duration::from_secs(15));
    let recover = fault + Duration::from_millis(1200);
    after_failback(&gw, load, "client-pause", fault, recover);
}

#[test]
fn script_flush_reloads_without_failing_over() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let gw = GatewayGuard::start(&config(redis.port, &up, 1, "local", OPEN));
    let load = steady_load(&gw);
    let fault = load.now();
    // Each flush with requests between it and the next.
    for _ in 0..5 {
        assert!(redis.cmd(&["SCRIPT", "FLUSH"]).contains("OK"));
        load.wait_answers(70);
    }
    let recover = load.now();
    load.wait_answers(150);
    let r = finish(load, "script-flush", fault, recover);
    assert_eq!(
        r.backend_at("local", fault),
        None,
        "NOSCRIPT is reloaded, not failed over"
    );
    assert_eq!(
        gw.metric("gateway_fallback_transitions_total{to=\"local\"}"),
        0.0
    );
    assert!(redis.calls("evalsha") > 0);
}

#[test]
fn a_full_redis_fails_over_and_back() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]);
    let gw = GatewayGuard::start(&config(redis.port, &up, 1, "local", OPEN));
    let load = steady_load(&gw);
    let fault = load.now();
    let mut filled = false;
    for i in 0..200 {
        let out = redis.cmd(&["SETRANGE", &format!("junk:{i}"), "200000", "x"]);
        if out.contains("OOM") {
            filled = true;
            break;
        }
    }
    assert!(filled, "Redis reached maxmemory");
    // Full by a margin: at the first refusal Redis is over its limit by
    // less than a client's buffers, and a client that goes idle (its
    // buffers freed) can bring it back under, letting writes through again.
    let used: u64 = redis
        .cmd(&["INFO", "memory"])
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:")?.trim().parse().ok())
        .expect("used_memory");
    redis.cmd(&["CONFIG", "SET", "maxmemory", &(used - 500_000).to_string()]);
    gw.wait_backend("local", Duration::from_secs(15));
    load.wait_answers(300);
    let recover = load.now();
    assert!(redis.cmd(&["FLUSHALL"]).contains("OK"));
    after_failback(&gw, load, "oom", fault, recover);
}

#[test]
fn deny_mode_answers_503_and_allow_mode_admits() {
    let up = UpstreamGuard::start();
    let dead = free_port();
    let limit =
        r#"{ algorithm = "token_bucket", capacity = 1, refill_per_sec = 0.001, scope = "global" }"#;
    let gw = GatewayGuard::start_opts(&config(dead, &up, 1, "deny", limit), false);
    let r = gw.client().get("/r").expect("request");
    assert_eq!(r.status, 503);
    assert_eq!(
        r.json()["type"],
        "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
    );
    drop(gw);
    let gw = GatewayGuard::start_opts(&config(dead, &up, 1, "allow", limit), false);
    let mut c = gw.client();
    assert!(
        (0..5).all(|_| c.get("/r").expect("request").status == 200),
        "allow: fail open"
    );
}

#[test]
fn three_replicas_in_fallback_share_the_limit() {
    let up = UpstreamGuard::start();
    let dead = free_port(); // Redis never comes up
    let limit = r#"{ algorithm = "token_bucket", capacity = 30, refill_per_sec = 0.001, scope = "global" }"#;
    let cfg = config(dead, &up, 3, "local", limit);
    let gws: Vec<GatewayGuard> = (0..3)
        .map(|_| GatewayGuard::start_opts(&cfg, false))
        .collect();
    // One client sprays all three replicas round-robin.
    let mut conns: Vec<Client> = gws.iter().map(|g| g.client()).collect();
    let mut admitted = 0;
    for i in 0..90 {
        if conns[i % 3].get("/r").expect("request").status == 200 {
            admitted += 1;
        }
    }
    eprintln!("FIGURES three-replicas-fallback: sent=90 admitted={admitted} bound=30 (3 x 30/3)");
    assert_eq!(
        admitted, 30,
        "3 replicas x (30 / 3) each: the shared limit, not 3x it"
    );
    assert_eq!(up.count("/r"), 30);
}
