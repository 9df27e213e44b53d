//! What the top-K of refused clients (`ratelimit_gateway::top`) adds to a
//! request, beside the decision it follows, in one run: a three-tier
//! request on the local backend for a crowd of 10,000 clients whose key
//! tier refuses most requests (as `algorithms`' "three tiers" row), then the
//! same request counted in the top-K as the proxy counts it, and the top-K's
//! check alone on a replica that refused nobody. Compare rows within one
//! run: `cargo bench --bench top`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use ratelimit_gateway::clock::{Clock, ManualClock};
use ratelimit_gateway::config::Algorithm;
use ratelimit_gateway::limiter::keys::bucket_key;
use ratelimit_gateway::limiter::{Check, LocalBackend, Tier};
use ratelimit_gateway::top::{Seen, Top};

const T0: i64 = 1_700_000_000_000_000;

fn checks(who: &str) -> [Check; 3] {
    let tb = |capacity, refill_per_sec| Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    };
    let check = |tier, key: String, algorithm| Check {
        tier,
        key,
        algorithm,
        shadow: false,
        cost: 1,
        shards: 1,
        pool: false,
        charged: false,
        most: 0,
    };
    [
        check(
            Tier::Ip,
            bucket_key("rl", "ip", "ip", &tb(400, 100.0), who),
            tb(400, 100.0),
        ),
        check(
            Tier::Key,
            bucket_key("rl", "key", "free", &tb(20, 10.0), "k:demo"),
            tb(20, 10.0),
        ),
        check(
            Tier::Route,
            bucket_key("rl", "route", "r", &tb(20, 10.0), who),
            tb(20, 10.0),
        ),
    ]
}

fn top_k(c: &mut Criterion) {
    let mut group = c.benchmark_group("a request and the top-K");
    for counted in [false, true] {
        let clock = Arc::new(ManualClock::new(T0));
        let backend = LocalBackend::new(1_000_000, clock.clone());
        let top = Top::default();
        let mut i = 0u64;
        let name = if counted {
            "decision + top-K (most refused)"
        } else {
            "decision alone"
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                i += 1;
                clock.advance(10);
                let who = format!("10.0.{}.{}", (i % 10_000) / 256, i % 256);
                let checks = checks(&format!("ip:{who}"));
                let now = clock.now_us();
                let verdict = backend.decide_at(&checks, now);
                if counted {
                    let refused = verdict.decisions.iter().any(|d| !d.allowed);
                    if top.wants(refused, now) {
                        let seen: Vec<_> = checks
                            .iter()
                            .zip(&verdict.decisions)
                            .map(|(c, d)| {
                                (
                                    c.kind(),
                                    if d.allowed {
                                        Seen::Admitted
                                    } else {
                                        Seen::Refused
                                    },
                                )
                            })
                            .collect();
                        top.record("r", &seen, |_| who.as_str(), now);
                    }
                }
                black_box(verdict)
            })
        });
    }
    let top = Top::default();
    group.bench_function("top-K check alone, nobody refused", |b| {
        b.iter(|| black_box(top.wants(false, T0)))
    });
    group.finish();
}

criterion_group!(benches, top_k);
criterion_main!(benches);
