//! Sentinel and Cluster through the real gateway: limits across cluster slots
//! stay all-or-nothing, and a killed master (cluster or sentinel) is survived
//! under load and followed back to exact shared limits.

use crate::support;

use std::time::Duration;

use support::load::Load;
use support::topology::{quoted, ClusterGuard, SentinelGuard, MASTER_NAME};
use support::{family_sum, wait_for, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS};

fn config(redis: &str, up: &UpstreamGuard, tiers: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
{redis}
timeout_ms = 50
probe_interval_ms = 100

[clients]
trusted_proxies = ["127.0.0.1/32"]

{tiers}

[[upstreams]]
name = "up"
servers = ["{}"]
"#,
        up.addr
    )
}

/// Three tiers whose keys land in different slots.
const SPREAD: &str = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 20
refill_per_sec = 0.001

[plans.tiny]
capacity = 3
refill_per_sec = 0.001

[[api_keys]]
id = "alice"
key = "alice-secret"
plan = "tiny"

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = { algorithm = "sliding_log", limit = 1000, window_secs = 3600, scope = "global" }
"#;

/// A plan of 3 and a route whose requests cost 100 of a log of 1000: the
/// route tier is reserved first in its own slot and refunded whole (100
/// entries) when the plan rejects.
const COSTLY: &str = r#"
[plans.tiny]
capacity = 3
refill_per_sec = 0.001

[[api_keys]]
id = "alice"
key = "alice-secret"
plan = "tiny"

[[routes]]
name = "c"
path_prefix = "/c"
upstream = "up"
limit = { algorithm = "sliding_log", limit = 1000, window_secs = 3600, scope = "global", cost = 100 }
"#;

const OPEN: &str = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 1000000000
refill_per_sec = 1000000000

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = { algorithm = "token_bucket", capacity = 1000000000, refill_per_sec = 1000000000, scope = "global" }
"#;

#[test]
fn cluster_tiers_in_different_slots_are_all_or_nothing() {
    let cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let gw = GatewayGuard::start(&config(&redis, &up, SPREAD));
    let mut c = gw.client();
    let with_key = [("x-api-key", "alice-secret")];
    let got: Vec<u16> = (0..10)
        .map(|_| {
            c.request("GET", "/r", &with_key, b"")
                .expect("request")
                .status
        })
        .collect();
    assert_eq!(got, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
    // The 7 rejections were refunded on the ip and route tiers: the ip bucket
    // spent 3 of 20, and this request takes one more.
    let r = c.get("/r").expect("request");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit"),
        Some("\"ip\";r=16;t=4000"),
        "headers: {:?}",
        r.headers
    );
    assert_eq!(up.count("/r"), 4);
}

/// A cluster that requires a password: the gateway's own connection to each
/// master authenticates as the cluster client does, so three tiers in
/// different slots (on different masters) are decided and refunded there
/// exactly as without one, with no Redis error, and the password appears in
/// no log line and no metric.
#[test]
fn cluster_with_a_password_decides_on_every_master() {
    const PASSWORD: &str = "cluster-pass-7f3a9c";
    let cluster = ClusterGuard::start_with_password(PASSWORD);
    let up = UpstreamGuard::start();
    let redis = format!("{}\npassword = \"{PASSWORD}\"", cluster.redis_section());
    let gw = GatewayGuard::start(&config(&redis, &up, SPREAD));
    let mut c = gw.client();
    let with_key = [("x-api-key", "alice-secret")];
    // Spaced, so all but the first few go by the slot map, on the masters'
    // own connections.
    let got: Vec<u16> = (0..10)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(50));
            c.request("GET", "/r", &with_key, b"")
                .expect("request")
                .status
        })
        .collect();
    let admitted = got.iter().filter(|&&s| s == 200).count();
    let metrics = gw.metrics();
    let errors = family_sum(&metrics, "gateway_redis_errors_total");
    eprintln!(
        "FIGURES cluster-password: {got:?}: {admitted} of 10 admitted (bound 3), {errors} Redis errors"
    );
    assert_eq!(got, [200, 200, 200, 429, 429, 429, 429, 429, 429, 429]);
    assert_eq!(errors, 0.0, "no Redis error, so no fallback: {metrics}");
    let r = c.get("/r").expect("request");
    assert_eq!(
        r.header("ratelimit"),
        Some("\"ip\";r=16;t=4000"),
        "the 7 rejections refunded on the ip tier: {:?}",
        r.headers
    );
    assert_eq!(up.count("/r"), 4);
    assert!(!gw.log().contains(PASSWORD), "the password in the log");
    assert!(!metrics.contains(PASSWORD), "the password in the metrics");
}

#[test]
fn cluster_refunds_a_costly_tier_whole() {
    let cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let gw = GatewayGuard::start(&config(&redis, &up, COSTLY));
    let mut c = gw.client();
    let with_key = [("x-api-key", "alice-secret")];
    let got: Vec<u16> = (0..5)
        .map(|_| {
            c.request("GET", "/c", &with_key, b"")
                .expect("request")
                .status
        })
        .collect();
    assert_eq!(got, [200, 200, 200, 429, 429]);
    // 3 admitted took 300 of 1000; the 2 rejected gave their 100 back, so
    // a request without a key (route tier only) leaves 1000 - 400.
    let r = c.get("/c").expect("request");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("ratelimit"),
        Some("\"route\";r=600;t=3600"),
        "headers: {:?}",
        r.headers
    );
    assert_eq!(up.count("/c"), 4);
}

/// Kills master `victim` while `load` runs, waits for the gateway to fall
/// back, the cluster to promote a replica and the gateway to fail back, then
/// stops the load: its report and when the kill came.
fn kill_under_load(
    cluster: &mut ClusterGuard,
    victim: usize,
    gw: &GatewayGuard,
    load: Load,
    name: &str,
) -> (support::load::Report, Duration) {
    let fault = load.now();
    cluster.kill(victim);
    gw.wait_backend("local", Duration::from_secs(20));
    cluster.wait_ok(); // a replica has been promoted
    let recovered = load.now();
    gw.wait_backend("redis", Duration::from_secs(30));
    load.wait_answers(300);
    let r = load.stop();
    r.print_figures(name, fault, recovered);
    (r, fault)
}

#[test]
fn cluster_master_killed_under_load() {
    let mut cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let gw = GatewayGuard::start(&config(&redis, &up, OPEN));
    let load = Load::start(vec![gw.addr], gw.admin, "/r", 2, 60);
    load.wait_answers(300);
    let before = cluster.evalsha_calls();
    let victim = cluster.masters()[0];
    let (r, _) = kill_under_load(&mut cluster, victim, &gw, load, "cluster-master-killed");
    assert_eq!(r.server_errors(), 0);
    assert_eq!(r.count(|s| s.status != 200), 0);
    assert!(
        cluster.evalsha_calls() > before,
        "Redis decides again after the failover"
    );
}

#[test]
fn sentinel_failover_is_followed() {
    let mut s = SentinelGuard::start();
    let up = UpstreamGuard::start();
    assert_eq!(s.sentinel_count(), 3);
    let redis = format!(
        "mode = \"sentinel\"\nurls = [{}]\nsentinel_master = \"{MASTER_NAME}\"",
        quoted(&s.urls())
    );
    let gw = GatewayGuard::start(&config(&redis, &up, OPEN));
    let replica_port = s.replica.as_ref().map(|r| r.port).expect("replica");
    let load = Load::start(vec![gw.addr], gw.admin, "/r", 2, 60);
    load.wait_answers(300);
    let fault = load.now();
    s.master = None; // kill -9 the master
    gw.wait_backend("local", Duration::from_secs(10));
    wait_for(
        "the sentinels to promote the replica",
        Duration::from_secs(30),
        || (s.master_port() == Some(replica_port)).then_some(()),
    );
    let recovered = load.now();
    gw.wait_backend("redis", Duration::from_secs(30));
    let calls = s.replica.as_ref().map(|r| r.calls("evalsha")).unwrap_or(0);
    load.wait_answers(300);
    let r = load.stop();
    r.print_figures("sentinel-failover", fault, recovered);
    assert_eq!(r.server_errors(), 0);
    assert_eq!(r.count(|s| s.status != 200), 0);
    let after = s.replica.as_ref().map(|r| r.calls("evalsha")).unwrap_or(0);
    assert!(
        after > calls || calls > 0,
        "the promoted replica now runs the limiter"
    );
}

/// A route limited by one global token bucket: its config, the slot its
/// bucket hashes to, and the most a run may admit (capacity + refill over
/// the span of the run's requests).
struct GlobalBucket {
    route: &'static str,
    capacity: u64,
    refill: f64,
}

impl GlobalBucket {
    fn tiers(&self) -> String {
        format!(
            r#"
[[routes]]
name = "{0}"
path_prefix = "/{0}"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = {1}, refill_per_sec = {2}, scope = "global" }}
"#,
            self.route, self.capacity, self.refill
        )
    }

    fn slot(&self) -> u16 {
        let alg = ratelimit_gateway::config::Algorithm::TokenBucket {
            capacity: self.capacity,
            refill_per_sec: self.refill,
        };
        let key =
            ratelimit_gateway::limiter::keys::bucket_key("rl", "route", self.route, &alg, "global");
        ratelimit_gateway::limiter::slot(&key)
    }

    /// The run's span and the most it may admit.
    fn bound(&self, r: &support::load::Report) -> (Duration, usize) {
        let (first, last) = r.span();
        let ran = last - first;
        (
            ran,
            (self.capacity as f64 + self.refill * ran.as_secs_f64()).floor() as usize,
        )
    }
}

/// A route whose one global bucket's slot is moved to another master while
/// requests flow: through MIGRATING/IMPORTING (the key reached by ASK once
/// moved) to the new owner, no limiter 5xx and never more admitted than the
/// bucket allows (capacity + refill over the whole run: the bucket refills
/// throughout, so admissions happen in every state of the move).
#[test]
fn cluster_slot_migrated_under_load() {
    let cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let bucket = GlobalBucket {
        route: "m",
        capacity: 50,
        refill: 200.0,
    };
    let gw = GatewayGuard::start(&config(&redis, &up, &bucket.tiers()));
    let slot = bucket.slot();
    let from = cluster.owner(slot);
    let to = *cluster
        .masters()
        .iter()
        .find(|&&m| m != from)
        .expect("another master");
    let load = Load::start(vec![gw.addr], gw.admin, "/m", 2, 60);
    load.wait_answers(200);
    let fault = load.now();
    cluster.migrate_slot(slot, to, Duration::from_millis(400));
    let moved = load.now();
    assert_eq!(cluster.owner(slot), to, "slot {slot} moved");
    load.wait_answers(300);
    let r = load.stop();
    r.print_figures("cluster-slot-migrated", fault, moved);
    let (ran, bound) = bucket.bound(&r);
    let during = r.count(|s| s.status == 200 && s.at >= fault && s.at <= moved);
    let admitted = r.count(|s| s.status == 200);
    let refused = r.count(|s| s.status == 429);
    eprintln!(
        "FIGURES cluster-slot-migrated: slot {slot} from node {from} to node {to}; {} requests in {:.2} s, {admitted} admitted (bound {bound} = {} + {}/s), {during} of them during the move, {refused} refused, upstream {}",
        r.count(|_| true),
        ran.as_secs_f64(),
        bucket.capacity,
        bucket.refill,
        up.count("/m")
    );
    assert_eq!(r.server_errors(), 0);
    assert_eq!(admitted + refused, r.count(|_| true), "only 200 and 429");
    assert!(admitted <= bound, "{admitted} admitted, bound {bound}");
    assert!(refused > 0, "the load must exceed the bound to test it");
    assert!(during > 0, "admissions while the slot moved");
    assert_eq!(up.count("/m"), admitted as u64);
    // A resharding is the cluster's business: the gateway follows it
    // without giving up on Redis.
    assert_eq!(
        r.backend_at("local", fault),
        None,
        "the move sent the gateway to its fallback: {}",
        gw.log()
            .lines()
            .filter(|l| l.contains("failing over"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The master serving a route's global bucket killed while requests flow:
/// the replica that takes over has the bucket (replicated), the fallback in
/// between spends from what this replica last knew and its debt is charged
/// back at failback, so across the whole run no limiter 5xx and never more
/// admitted than the bucket allows (capacity + refill over the run).
#[test]
fn cluster_master_killed_under_load_keeps_the_bound() {
    let mut cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let bucket = GlobalBucket {
        route: "k",
        capacity: 50,
        refill: 100.0,
    };
    let gw = GatewayGuard::start(&config(&redis, &up, &bucket.tiers()));
    let victim = cluster.owner(bucket.slot());
    let load = Load::start(vec![gw.addr], gw.admin, "/k", 2, 60);
    load.wait_answers(300);
    let (r, fault) = kill_under_load(
        &mut cluster,
        victim,
        &gw,
        load,
        "cluster-master-killed-bound",
    );
    let (ran, bound) = bucket.bound(&r);
    let last = r.span().1;
    let admitted = r.count(|s| s.status == 200);
    let local_at = r.backend_at("local", fault).unwrap_or(fault);
    let back_at = r.backend_at("redis", local_at).unwrap_or(last);
    let phase = |from: Duration, to: Duration| {
        let n = r.count(|s| s.status == 200 && s.at >= from && s.at < to);
        (n, (to.saturating_sub(from)).as_millis())
    };
    eprintln!(
        "FIGURES cluster-master-killed-bound: {} requests in {:.2} s, {admitted} admitted (bound {bound} = {} + {}/s), upstream {}; admitted (ms) before the kill {:?}, until local {:?}, on local {:?}, after failback {:?}",
        r.count(|_| true),
        ran.as_secs_f64(),
        bucket.capacity,
        bucket.refill,
        up.count("/k"),
        phase(Duration::ZERO, fault),
        phase(fault, local_at),
        phase(local_at, back_at),
        phase(back_at, last + Duration::from_millis(1)),
    );
    assert_eq!(r.server_errors(), 0);
    assert!(admitted <= bound, "{admitted} admitted, bound {bound}");
    assert!(
        r.count(|s| s.status == 429) > 0,
        "the load must exceed the bound"
    );
    assert_eq!(up.count("/k"), admitted as u64);
    let fallbacks = gw.metric("gateway_fallback_transitions_total{to=\"local\"}");
    eprintln!("FIGURES cluster-master-killed-bound: fell back {fallbacks} time(s)");
    // One fault, one fallback: the slot map read before the kill (naming the
    // dead master) is not used again after the failback.
    assert_eq!(fallbacks, 1.0, "fallbacks for one killed master");
}

/// A cluster node whose bus port (port + 10000) is taken exits at once;
/// its guard says so, naming the port, instead of waiting ten seconds for
/// a PING, and a node started on a free port skips such ports.
#[test]
fn a_cluster_node_whose_bus_port_is_taken_is_told_and_another_port_is_used() {
    let bus = (0..50)
        .filter_map(|_| std::net::TcpListener::bind("127.0.0.1:0").ok())
        .find(|l| l.local_addr().is_ok_and(|a| a.port() > 10_000))
        .expect("a listener above port 10000");
    let port = bus.local_addr().expect("address").port() - 10_000;
    let args = ["--cluster-enabled", "yes"];
    let err = std::panic::catch_unwind(|| RedisGuard::start_on(port, &args))
        .err()
        .expect("its bus port is taken");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains(&format!("redis-server on port {port} exited at start")),
        "{msg}"
    );
    let node = RedisGuard::start_with(&args);
    assert_eq!(node.cmd(&["PING"]).trim(), "PONG");
}
