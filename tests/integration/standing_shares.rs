//! Standing shares (`[limiter.shares]`) through real gateway replicas
//! sharing one real Redis: a big bucket's tier is decided on each replica's
//! share with no call, the rest on the bucket's pool in Redis, and the sum
//! stays within capacity + rate × time. Every figure is a count against the
//! exact bound; nothing here asserts a time.

use crate::leases::{worst_interval, Interval, Spray};
use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use support::{Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS};

/// A replica (its own 2 threads, `instances = 3`) with shares of `fraction`,
/// the hot key on `plan`, and `ip` as its per-client tier (or none).
fn config(redis_url: &str, up: &UpstreamGuard, fraction: f64, plan: &str, ip: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
on_redis_failure = "deny"
instances = 3
retry_after_jitter_ms = 0

[limiter.leases]
enabled = true
period_ms = 100

[limiter.shares]
enabled = true
fraction = {fraction}

[redis]
urls = ["{redis_url}"]
timeout_ms = 50
probe_interval_ms = 50

[clients]
trusted_proxies = ["127.0.0.1/32"]

{ip}

[plans.hot]
{plan}

[[api_keys]]
id = "hot"
key = "hot-secret"
plan = "hot"

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
"#,
        up.addr
    )
}

/// Waits until the replica decides on its shares (it has been counted in
/// the replica set for an announcement's life).
pub(crate) fn wait_usable(g: &GatewayGuard) {
    support::wait_for(
        "the replica to use its shares",
        Duration::from_secs(15),
        || (g.metric("gateway_shares_usable") == 1.0).then_some(()),
    );
}

fn share_decisions(gws: &[GatewayGuard]) -> Vec<f64> {
    gws.iter()
        .map(|g| g.metric("gateway_limiter_decisions_total{path=\"share\"}"))
        .collect()
}

/// Sprays the hot key over `gws` (and replicas `join` adds while it runs)
/// for `secs`; returns the worst interval at the upstream and the share of
/// the bound admitted.
fn hot_key(
    up: &UpstreamGuard,
    gws: &mut Vec<GatewayGuard>,
    capacity: f64,
    rate: f64,
    secs: u64,
    mut join: impl FnMut(&mut Vec<GatewayGuard>, &RwLock<Vec<SocketAddr>>, Duration),
) -> (Interval, f64, usize) {
    let targets = Arc::new(RwLock::new(gws.iter().map(|g| g.addr).collect::<Vec<_>>()));
    let spray = Spray::start_growing(targets.clone(), 5, 4);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(secs) {
        join(gws, &targets, started.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (per, round_trips) = spray.stop_timed();
    let arrivals = up.arrivals("/r");
    assert_eq!(arrivals.len() as u64, per.iter().sum::<u64>());
    let worst = worst_interval(&arrivals, &round_trips, capacity, rate);
    let span = (arrivals[arrivals.len() - 1].0 - arrivals[0].0) as f64 / 1e6;
    let share = arrivals.len() as f64 / (capacity + rate * span);
    (worst, share, arrivals.len())
}

/// A hot key of 100, 150/s, sprayed over three replicas above its limit for
/// 10 s with shares of a quarter (each replica 8 tokens at 12.5/s, the pool
/// 75 at 112.5/s): within capacity + rate × every interval of the
/// upstream's arrivals, at least 97 % of the bound, part of it on shares.
#[test]
fn a_hot_key_on_shares_keeps_its_rate_over_every_interval() {
    const CAPACITY: f64 = 100.0;
    const RATE: f64 = 150.0;
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let plan = format!("capacity = {CAPACITY}\nrefill_per_sec = {RATE}");
    let mut gws: Vec<GatewayGuard> = (0..3)
        .map(|_| GatewayGuard::start(&config(&redis.url(), &up, 0.25, &plan, "")))
        .collect();
    gws.iter().for_each(wait_usable);
    let (i, share, n) = hot_key(&up, &mut gws, CAPACITY, RATE, 10, |_, _, _| {});
    let on_shares = share_decisions(&gws);
    println!(
        "FIGURES hot key on shares: {n} admitted, {:.1}% of capacity + rate x span; worst interval {:+.1} over the bound by arrival times, {:+.1} with its earliest decision allowed for ({:.1} tokens); decided on shares per replica {on_shares:?}",
        100.0 * share,
        i.worst_plain,
        i.worst,
        i.allowance_at_worst
    );
    assert!(
        i.worst <= 0.0,
        "an interval saw {:.1} over the bound",
        i.worst
    );
    assert!(share >= 0.97, "admitted {:.1}% of the bound", 100.0 * share);
    assert!(
        on_shares.iter().all(|&d| d > 0.0),
        "every replica used its share: {on_shares:?}"
    );
}

/// Scale-out from 3 to 5 replicas mid-run: the same hot key sprayed for 14
/// s, two replicas started after 4 s and sprayed as soon as they answer.
/// The joiners use no share until the others have counted them (shares cut
/// by 5), and start theirs empty: the bound holds over every interval.
#[test]
fn scaling_out_from_three_to_five_keeps_the_bound() {
    const CAPACITY: f64 = 100.0;
    const RATE: f64 = 150.0;
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let plan = format!("capacity = {CAPACITY}\nrefill_per_sec = {RATE}");
    let cfg = config(&redis.url(), &up, 0.25, &plan, "");
    let mut gws: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&cfg)).collect();
    gws.iter().for_each(wait_usable);
    let mut joined = false;
    let (i, share, n) = hot_key(&up, &mut gws, CAPACITY, RATE, 14, |gws, targets, at| {
        if !joined && at >= Duration::from_secs(4) {
            joined = true;
            for _ in 0..2 {
                let g = GatewayGuard::start(&cfg);
                targets.write().expect("targets").push(g.addr);
                gws.push(g);
            }
        }
    });
    let on_shares = share_decisions(&gws);
    let counted: Vec<f64> = gws
        .iter()
        .map(|g| g.metric("gateway_limiter_replicas"))
        .collect();
    println!(
        "FIGURES scale-out 3 -> 5 on shares: {n} admitted, {:.1}% of capacity + rate x span; worst interval {:+.1} by arrival times, {:+.1} with transit; decided on shares per replica {on_shares:?}; replicas counted {counted:?}",
        100.0 * share,
        i.worst_plain,
        i.worst
    );
    assert!(
        i.worst <= 0.0,
        "an interval saw {:.1} over the bound",
        i.worst
    );
    assert!(
        counted.iter().all(|&c| c == 5.0),
        "every replica counts five: {counted:?}"
    );
    assert!(
        on_shares[3] > 0.0 && on_shares[4] > 0.0,
        "the joiners use their shares: {on_shares:?}"
    );
}

/// A crowd of 10,000 clients (X-Forwarded-For from a trusted proxy), each
/// with a per-IP bucket of 20 at 20/s cut by 0.8 (each replica 5, the pool
/// 4), each sending a burst of 24 over the three replicas in turn: no client
/// is admitted past 20 + 20/s × its burst's span, and most of the crowd is
/// decided on shares.
#[test]
fn a_crowd_over_three_replicas_stays_within_every_clients_bound() {
    const CLIENTS: u64 = 10_000;
    const CAPACITY: f64 = 20.0;
    const RATE: f64 = 20.0;
    const SENT: u64 = 24;
    const THREADS: u64 = 12;
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let ip = format!(
        "[tiers.ip]\nalgorithm = \"token_bucket\"\ncapacity = {CAPACITY}\nrefill_per_sec = {RATE}"
    );
    let plan = "capacity = 1000000\nrefill_per_sec = 1000000";
    let gws: Vec<GatewayGuard> = (0..3)
        .map(|_| GatewayGuard::start(&config(&redis.url(), &up, 0.8, plan, &ip)))
        .collect();
    gws.iter().for_each(wait_usable);
    // The shares start empty and fill in capacity / rate = 1 s.
    std::thread::sleep(Duration::from_millis(1200));
    let addrs: Vec<SocketAddr> = gws.iter().map(|g| g.addr).collect();
    let calls_before = redis.calls("evalsha");
    let (admitted, over, worst) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(std::sync::Mutex::new(f64::MIN)),
    );
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (addrs, admitted, over, worst) =
                (addrs.clone(), admitted.clone(), over.clone(), worst.clone());
            std::thread::spawn(move || {
                let mut conns: Vec<Client> = addrs
                    .iter()
                    .map(|a| Client::connect(*a).expect("connect"))
                    .collect();
                for c in (t..CLIENTS).step_by(THREADS as usize) {
                    let xff = format!("100.64.{}.{}", c / 256, c % 256);
                    let started = Instant::now();
                    let mut ok = 0u64;
                    for i in 0..SENT {
                        let k = (i as usize + c as usize) % conns.len();
                        let r = conns[k]
                            .request(
                                "GET",
                                "/r",
                                &[("x-api-key", "hot-secret"), ("x-forwarded-for", &xff)],
                                b"",
                            )
                            .expect("request");
                        match r.status {
                            200 => ok += 1,
                            429 => {}
                            s => panic!("client {xff}: status {s}"),
                        }
                    }
                    let bound = CAPACITY + RATE * started.elapsed().as_secs_f64();
                    admitted.fetch_add(ok, Ordering::Relaxed);
                    if ok as f64 > bound.floor() {
                        over.fetch_add(1, Ordering::Relaxed);
                    }
                    let mut w = worst.lock().expect("worst");
                    *w = w.max(ok as f64 - bound);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("crowd thread");
    }
    let calls = redis.calls("evalsha") - calls_before;
    let on_shares: f64 = share_decisions(&gws).iter().sum();
    let admitted = admitted.load(Ordering::Relaxed);
    let sent = CLIENTS * SENT;
    let worst = *worst.lock().expect("worst");
    println!(
        "FIGURES crowd on shares: {CLIENTS} clients x {SENT} requests over 3 replicas: {admitted} admitted ({:.2} per client, limit {CAPACITY}); clients past their bound: {}; the most a client got against its bound: {worst:+.2}; decided wholly on shares {on_shares} of {sent} ({:.1}%); script calls {calls} ({:.3} per request)",
        admitted as f64 / CLIENTS as f64,
        over.load(Ordering::Relaxed),
        100.0 * on_shares / sent as f64,
        calls as f64 / sent as f64
    );
    assert_eq!(
        over.load(Ordering::Relaxed),
        0,
        "no client past its bound (worst {worst:+.2})"
    );
    assert_eq!(
        up.count("/r"),
        admitted,
        "the upstream saw what was admitted"
    );
    assert!(
        admitted as f64 >= 0.9 * CAPACITY * CLIENTS as f64,
        "the crowd got most of its limit: {admitted}"
    );
    assert!(
        on_shares >= 0.5 * sent as f64,
        "most of the crowd decided on shares: {on_shares}"
    );
}

/// What an operator sees of a cut bucket: a replica's `/limits` gives the
/// bucket's own limit and what the pool and this replica's share hold;
/// `gateway limits show` (no replica) gives the pool alone and says so.
/// A plan of 1000 at 1000/s cut by a quarter among `instances = 3`: the
/// pool 750, each share 83.
#[test]
fn limits_show_the_pool_and_the_share() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let plan = "capacity = 1000\nrefill_per_sec = 1000";
    let gw = GatewayGuard::start(&config(&redis.url(), &up, 0.25, plan, ""));
    wait_usable(&gw);
    // The share fills from empty in capacity / rate = 1 s.
    support::wait_for(
        "a request decided on the share",
        Duration::from_secs(10),
        || {
            let r = gw
                .client()
                .request("GET", "/r", &[("x-api-key", "hot-secret")], b"")
                .expect("request");
            assert_eq!(r.status, 200);
            (gw.metric("gateway_limiter_decisions_total{path=\"share\"}") > 0.0).then_some(())
        },
    );
    let v = gw.admin_get("/limits?key=hot").json();
    let key = v["buckets"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["tier"] == "key"))
        .unwrap_or_else(|| panic!("a key bucket: {v}"))
        .clone();
    let remaining = key["remaining"].as_u64().expect("remaining");
    assert_eq!(key["limit"].as_u64(), Some(1000), "{v}");
    assert!(
        (700..=833).contains(&remaining),
        "the pool's 750 and the share's 83, nearly: {v}"
    );
    let (code, out, err) = support::gateway_cli(
        &["limits", "show", "--key", "hot", "--json"],
        &gw.config_path,
    );
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let key = v["buckets"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["tier"] == "key"))
        .unwrap_or_else(|| panic!("a key bucket: {out}"))
        .clone();
    let pool = key["remaining"].as_u64().expect("remaining");
    assert_eq!(key["limit"].as_u64(), Some(1000), "{out}");
    assert!((650..=750).contains(&pool), "the pool alone: {out}");
    assert!(
        key["shares"]
            .as_str()
            .is_some_and(|s| s.contains("pool only")),
        "{out}"
    );
}
