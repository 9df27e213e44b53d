//! One replica cut off from Redis while another keeps it: the cut replica's
//! link goes through a `tcp-forwarder` of the test's own, stopped with
//! SIGSTOP (silence: no RST, no bytes) and continued with SIGCONT. After
//! every heal the replica must decide on Redis again within a bounded
//! number of failback probes, every time (a replica left on its fallback
//! over-admits its share for as long as it stays there). In some rounds the
//! link also forgets its flows, as a NAT or a stateful firewall does after
//! a partition: the connections open before it stay silent for good, and
//! only new ones work.

use crate::support;

use std::time::{Duration, Instant};

use support::load::Load;
use support::{
    family_sum, wait_for, ForwarderGuard, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS,
};

const PROBE_INTERVAL_MS: u64 = 100;

/// Failback takes `PROBES_TO_FAIL_BACK` (3) good probes in a row. Before
/// them, after a heal: the probe under way may still fail; where the link
/// forgot its flows, up to two probes may be answered on the old connection
/// before the forgetting reaches it, then one fails on it and replaces it.
/// So at most 2 + 1 + 3: the bound is stated in probes, not in time.
const PROBES_AFTER_HEAL: f64 = 6.0;

fn config(redis_url: &str, up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
on_redis_failure = "local"
instances = 2
retry_after_jitter_ms = 0

[redis]
urls = ["{redis_url}"]
timeout_ms = 15
probe_interval_ms = {PROBE_INTERVAL_MS}

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 1000000000, refill_per_sec = 1000000000, scope = "global" }}
"#,
        up.addr
    )
}

/// The last lines a replica logged about its limiter.
fn limiter_log(gw: &GatewayGuard) -> String {
    let log = gw.log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("limiter")).collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

fn backend_is(gw: &GatewayGuard, backend: &str) -> bool {
    gw.metric(&format!("gateway_limiter_backend{{backend=\"{backend}\"}}")) == 1.0
}

/// Failback probes this replica has sent, good or failed.
fn probes(gw: &GatewayGuard) -> f64 {
    family_sum(&gw.raw_metrics(), "gateway_redis_probes_total")
}

/// 24 blackholes of one replica's link, 0.6–2.4 s each, under load on both
/// replicas; every fourth one also forgets the link's flows. After every
/// heal the cut replica fails back within `PROBES_AFTER_HEAL` probes
/// (counted by `/metrics`, not timed), and the replica that kept Redis
/// never leaves it. (Before the probe replaced a connection silent past
/// its budget, the first forgetting round left the replica on its fallback
/// for good.)
#[test]
fn a_healed_replica_always_fails_back() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let mut link = ForwarderGuard::start(&format!("127.0.0.1:{}", redis.port));
    let cut = GatewayGuard::start(&config(&link.url(), &up));
    let kept = GatewayGuard::start(&config(&redis.url(), &up));
    let load = Load::start(vec![cut.addr, kept.addr], cut.admin, "/r", 2, 240);
    let mut rng = fastrand::Rng::with_seed(28);
    let mut worst = 0.0f64;
    let mut per_heal = Vec::new();
    for round in 1..=24 {
        link.stop();
        wait_for(
            &format!("round {round}: the cut replica to fail over"),
            Duration::from_secs(10),
            || backend_is(&cut, "local").then_some(()),
        );
        std::thread::sleep(Duration::from_millis(rng.u64(600..2400)));
        // The fallback is visible while it lasts: seconds on /readyz and
        // in /metrics (set by each probe).
        let ready = cut.admin_get("/readyz").json();
        assert!(
            ready["fallback_secs"].as_f64().is_some_and(|s| s > 0.0),
            "round {round}: /readyz on the fallback: {ready}"
        );
        assert!(cut.metric("gateway_fallback_seconds") > 0.0);
        let before = probes(&cut);
        if round % 4 == 0 {
            link.forget_flows();
        }
        link.resume();
        // A generous deadline only ends a stuck run; the assert is the count.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !backend_is(&cut, "redis") {
            if Instant::now() > deadline {
                panic!(
                    "round {round}: the healed replica stayed on its fallback 20 s after the heal; its limiter log:\n{}",
                    limiter_log(&cut)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let used = probes(&cut) - before;
        per_heal.push(used);
        worst = worst.max(used);
        assert!(
            used <= PROBES_AFTER_HEAL,
            "round {round}: {used} probes after the heal before failback (bound {PROBES_AFTER_HEAL}); its limiter log:\n{}",
            limiter_log(&cut)
        );
        assert_eq!(cut.metric("gateway_fallback_seconds"), 0.0);
        assert!(
            !cut.admin_get("/readyz").text().contains("fallback_secs"),
            "round {round}: /readyz back on Redis"
        );
        assert!(
            backend_is(&kept, "redis"),
            "round {round}: the replica that kept Redis left it"
        );
    }
    let report = load.stop();
    assert_eq!(report.server_errors(), 0, "no 5xx through a partition");
    println!(
        "FIGURES partition: 24 heals, probes to fail back per heal {per_heal:?}, worst {worst} (bound {PROBES_AFTER_HEAL}); transitions to local {}",
        cut.metric("gateway_fallback_transitions_total{to=\"local\"}")
    );
}

/// A replica that stays on its fallback says so: a WARN line with how long
/// and the last probe's error (repeated every 10 s while it lasts), and
/// `/readyz` carries the seconds; it fails back once the link heals.
#[test]
fn a_long_stay_on_the_fallback_is_logged() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let link = ForwarderGuard::start(&format!("127.0.0.1:{}", redis.port));
    let cut = GatewayGuard::start(&config(&link.url(), &up));
    link.stop();
    // Idle: the heartbeat notices the silence within its second.
    wait_for(
        "the cut replica to fail over",
        Duration::from_secs(10),
        || backend_is(&cut, "local").then_some(()),
    );
    let line = wait_for(
        "the still-on-the-fallback warning",
        Duration::from_secs(30),
        || {
            cut.log()
                .lines()
                .find(|l| l.contains("still on the fallback"))
                .map(str::to_string)
        },
    );
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("on_fallback_secs=1"), "{line}");
    assert!(line.contains("last_probe_error="), "{line}");
    let ready = cut.admin_get("/readyz").json();
    assert!(
        ready["fallback_secs"].as_f64().is_some_and(|s| s >= 10.0),
        "{ready}"
    );
    link.resume();
    wait_for("failback after the heal", Duration::from_secs(20), || {
        backend_is(&cut, "redis").then_some(())
    });
}
