//! The Redis Cluster backend held to the local one: a batch is split by hash
//! slot, one call per slot, and must decide what the same requests decided
//! one by one would (exactly, whenever a request's tiers share a slot), and
//! a request rejected in one slot must charge no tier in another.
//! A real 3-master cluster on loopback (`redis-cli --cluster create`).

use crate::support;

use std::sync::Arc;

use ratelimit_gateway::clock::{Clock, ManualClock};
use ratelimit_gateway::config::{Algorithm, RedisMode, RedisSettings};
use ratelimit_gateway::limiter::keys::bucket_key;
use ratelimit_gateway::limiter::{slot, Backend, Check, LocalBackend, RedisBackend, Tier};
use support::topology::ClusterGuard;

const S: i64 = 1_000_000;
const T0: i64 = 1_700_000_000 * S;

struct Pair {
    clock: Arc<ManualClock>,
    local: LocalBackend,
    cluster: RedisBackend,
    nodes: ClusterGuard,
}

impl Pair {
    async fn new() -> Self {
        let nodes = ClusterGuard::start();
        let clock = Arc::new(ManualClock::new(T0));
        let settings = RedisSettings {
            mode: RedisMode::Cluster,
            urls: nodes.urls(),
            sentinel_master: None,
            timeout_ms: 2000,
            probe_interval_ms: 100,
            key_prefix: "cc".into(),
            ca_file: None,
            password: None,
            password_file: None,
        };
        let cluster =
            RedisBackend::from_settings(&settings, Some(clock.clone())).expect("cluster client");
        cluster.probe("cc:probe").await.expect("cluster reachable");
        Pair {
            local: LocalBackend::new(100_000, clock.clone()),
            cluster,
            clock,
            nodes,
        }
    }
}

fn check(tier: Tier, rule: &str, alg: Algorithm, who: &str) -> Check {
    Check {
        tier,
        key: bucket_key("cc", tier.as_str(), rule, &alg, who),
        algorithm: alg,
        shadow: false,
        cost: 1,
        shards: 1,
        pool: false,
        charged: false,
        most: 0,
    }
}

fn tb(capacity: u64, refill_per_sec: f64) -> Algorithm {
    Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    }
}

fn random_algorithm(rng: &mut fastrand::Rng, which: u8) -> Algorithm {
    let limit = rng.u64(1..12);
    let window_secs = rng.u64(1..4);
    match which {
        0 => tb(limit, rng.f64() * 20.0 + 0.1),
        1 => Algorithm::LeakyBucket {
            rate_per_sec: rng.f64() * 50.0 + 0.5,
            max_delay_ms: rng.u64(0..400),
        },
        2 => Algorithm::FixedWindow { limit, window_secs },
        3 => Algorithm::SlidingWindow { limit, window_secs },
        _ => Algorithm::SlidingLog { limit, window_secs },
    }
}

/// Requests whose tiers share a slot (a hash tag per client) are decided
/// in one share each: a batch answers exactly what one by one would, over
/// every algorithm, with costs, shadow tiers and rejections mid-batch, the
/// batch spread over many slots (so over all three masters).
#[tokio::test]
async fn batches_split_by_slot_decide_as_one_by_one() {
    let p = Pair::new().await;
    let mut rng = fastrand::Rng::with_seed(0xc105);
    let (mut decided, mut rejected) = (0, 0);
    let mut slots_seen = std::collections::BTreeSet::new();
    for round in 0..20 {
        let route = random_algorithm(&mut rng, (round % 5) as u8);
        let clients: Vec<Vec<Check>> = (0..6)
            .map(|c| {
                // Every tier of client c in the slot of its tag.
                let tag = format!("{{r{round}c{c}}}");
                let mut v = vec![
                    check(Tier::Ip, "ip", tb(6, 3.0), "x"),
                    check(Tier::Key, "plan", tb(8, 4.0), "x"),
                    check(Tier::Route, &format!("r{round}"), route, "x"),
                ];
                for ch in &mut v {
                    ch.key = format!("{tag}{}", ch.key);
                }
                if c == 5 {
                    v[0].shadow = true;
                }
                v[2].cost = 1 + c as u64 % route.quota().min(3);
                slots_seen.insert(slot(&v[0].key));
                v
            })
            .collect();
        for _ in 0..10 {
            p.clock.advance(rng.i64(0..400_000));
            let batch: Vec<&[Check]> = (0..rng.usize(1..=24))
                .map(|_| clients[rng.usize(0..clients.len())].as_slice())
                .collect();
            let got = p.cluster.decide_many(&batch).await.expect("cluster batch");
            assert_eq!(got.len(), batch.len());
            for (i, (checks, got)) in batch.iter().zip(&got).enumerate() {
                let local = p.local.decide(checks).await.expect("local");
                assert_eq!(
                    local.decisions,
                    got.decisions,
                    "request {i} of a batch of {} (round {round}, t0+{}us) differs from one by one",
                    batch.len(),
                    p.clock.now_us() - T0
                );
                decided += 1;
                rejected += usize::from(!local.admitted(checks));
            }
        }
    }
    assert!(
        decided > 800 && rejected > 150 && slots_seen.len() > 50,
        "{decided} decided, {rejected} rejected, {} slots",
        slots_seen.len()
    );
}

/// Tiers in different slots (as the gateway names them): a request the key
/// tier rejects charges neither the ip nor the route tier, in a batch or
/// alone; what is admitted never exceeds a bucket's bound, and when nothing
/// is rejected a batch equals one by one.
#[tokio::test]
async fn a_rejection_in_one_slot_charges_no_tier_in_another() {
    let p = Pair::new().await;
    let ip = check(Tier::Ip, "ip", tb(100, 0.001), "ip:9.9.9.9");
    let key = check(Tier::Key, "free", tb(4, 0.001), "k:a");
    let route = check(
        Tier::Route,
        "r",
        Algorithm::SlidingLog {
            limit: 50,
            window_secs: 600,
        },
        "k:a",
    );
    let slots: std::collections::BTreeSet<u16> =
        [&ip, &key, &route].iter().map(|c| slot(&c.key)).collect();
    assert_eq!(slots.len(), 3, "the tiers must span slots for this test");
    let all = [ip.clone(), key.clone(), route.clone()];
    // A batch of 10 on a key bucket of 4: 4 admitted, 6 rejected by the key tier.
    let batch: Vec<&[Check]> = (0..10).map(|_| &all[..]).collect();
    let got = p.cluster.decide_many(&batch).await.expect("batch");
    let admitted = got.iter().filter(|v| v.admitted(&all)).count();
    assert_eq!(admitted, 4, "bound 4 on the key tier");
    for v in &got[4..] {
        assert!(!v.decisions[1].allowed, "{v:?}");
    }
    // Alone, five more: all rejected by the key tier.
    for _ in 0..5 {
        let v = p.cluster.decide(&all).await.expect("alone");
        assert!(!v.admitted(&all));
    }
    // The ip and route tiers were charged for the 4 admissions only: the
    // refunds of the 11 rejected requests' shares gave everything back.
    let ip_left = p.cluster.decide(&[ip]).await.expect("ip").decisions[0].remaining;
    let route_left = p.cluster.decide(&[route]).await.expect("route").decisions[0].remaining;
    assert_eq!((ip_left, route_left), (95, 45), "100-4-1 and 50-4-1");
    println!(
        "FIGURES cluster-conformance: 4 of 10 admitted in one batch (bound 4), 0 of 5 alone; ip tier 95 left (100 - 4 - this read), route 45 (50 - 4 - this read)"
    );

    // No rejection: a batch across slots equals one by one.
    let fresh: Vec<Vec<Check>> = (0..3)
        .map(|c| {
            vec![
                check(Tier::Ip, "ip", tb(100, 1.0), &format!("ip:10.0.0.{c}")),
                check(Tier::Key, "pro", tb(100, 1.0), &format!("k:{c}")),
                check(Tier::Route, "open", tb(100, 1.0), "global"),
            ]
        })
        .collect();
    let batch: Vec<&[Check]> = (0..30).map(|i| fresh[i % 3].as_slice()).collect();
    let got = p.cluster.decide_many(&batch).await.expect("batch");
    for (checks, got) in batch.iter().zip(&got) {
        let local = p.local.decide(checks).await.expect("local");
        assert_eq!(local.decisions, got.decisions);
    }
}

/// Once the slot map is read, a batch costs one call per node however many
/// slots its buckets hash to: 30 requests over 9 buckets in 9 slots, on a
/// 3-master cluster, are at most 3 script calls (not 9, and not 90).
#[tokio::test]
async fn a_batch_is_one_call_per_node() {
    let p = Pair::new().await;
    let clients: Vec<Vec<Check>> = (0..3)
        .map(|c| {
            vec![
                check(
                    Tier::Ip,
                    "ip",
                    tb(1_000_000, 1.0),
                    &format!("ip:10.1.0.{c}"),
                ),
                check(Tier::Key, "pro", tb(1_000_000, 1.0), &format!("k:{c}")),
                check(
                    Tier::Route,
                    "log",
                    Algorithm::SlidingLog {
                        limit: 1_000_000,
                        window_secs: 60,
                    },
                    &format!("k:{c}"),
                ),
            ]
        })
        .collect();
    let slots: std::collections::BTreeSet<u16> =
        clients.iter().flatten().map(|c| slot(&c.key)).collect();
    assert_eq!(slots.len(), 9, "nine buckets in nine slots");
    let batch: Vec<&[Check]> = (0..30).map(|i| clients[i % 3].as_slice()).collect();
    let mut calls = Vec::new();
    let mut used = u64::MAX;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // The first batches may go slot by slot, until the map has been read.
    while used > 3 && std::time::Instant::now() < deadline {
        let before = p.nodes.evalsha_calls();
        let got = p.cluster.decide_many(&batch).await.expect("batch");
        assert!(got.iter().zip(&batch).all(|(v, c)| v.admitted(c)));
        used = p.nodes.evalsha_calls() - before;
        calls.push(used);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(used <= 3, "script calls per batch: {calls:?}");
    println!("FIGURES cluster-batch: 30 requests over 9 slots: script calls per batch {calls:?} (3 masters)");
}
