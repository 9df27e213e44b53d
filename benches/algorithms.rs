//! The algorithms on the fake clock: cost of one decision (check + commit)
//! per algorithm, and of one three-tier request on the local backend. Run
//! `cargo bench --bench algorithms`; compare rows within one run.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use ratelimit_gateway::clock::ManualClock;
use ratelimit_gateway::config::Algorithm;
use ratelimit_gateway::limiter::algorithms::outage;
use ratelimit_gateway::limiter::algorithms::{check, commit, Decision, State};
use ratelimit_gateway::limiter::keys::bucket_key;
use ratelimit_gateway::limiter::{Check, LocalBackend, Tier};

const T0: i64 = 1_700_000_000_000_000;

fn algorithms() -> Vec<Algorithm> {
    vec![
        Algorithm::TokenBucket {
            capacity: 20,
            refill_per_sec: 10.0,
        },
        Algorithm::LeakyBucket {
            rate_per_sec: 3000.0,
            max_delay_ms: 1500,
        },
        Algorithm::FixedWindow {
            limit: 100,
            window_secs: 60,
        },
        Algorithm::SlidingWindow {
            limit: 100,
            window_secs: 60,
        },
        Algorithm::SlidingLog {
            limit: 100,
            window_secs: 60,
        },
    ]
}

fn decide_once(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    for alg in algorithms() {
        let mut state: Option<State> = None;
        let mut now = T0;
        group.bench_function(alg.name(), |b| {
            b.iter(|| {
                // 1 ms apart: a busy client hovering around its limit.
                now += 1_000;
                let e = check(black_box(&alg), state.as_ref(), now, 1);
                if e.decision.allowed {
                    commit(&mut state, &e.update);
                }
                black_box(e.decision)
            })
        });
    }
    group.finish();
}

fn local_three_tiers(c: &mut Criterion) {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = LocalBackend::new(1_000_000, clock.clone());
    let tb = |capacity, refill_per_sec| Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    };
    let mut i = 0u64;
    c.bench_function("local backend: three tiers, 10k clients", |b| {
        b.iter(|| {
            i += 1;
            clock.advance(10);
            let who = format!("ip:10.0.{}.{}", (i % 10_000) / 256, i % 256);
            let checks = [
                Check {
                    tier: Tier::Ip,
                    key: bucket_key("rl", "ip", "ip", &tb(400, 100.0), &who),
                    algorithm: tb(400, 100.0),
                    shadow: false,
                    cost: 1,
                    shards: 1,
                    pool: false,
                    charged: false,
                    most: 0,
                },
                Check {
                    tier: Tier::Key,
                    key: bucket_key("rl", "key", "free", &tb(20, 10.0), "k:demo"),
                    algorithm: tb(20, 10.0),
                    shadow: false,
                    cost: 1,
                    shards: 1,
                    pool: false,
                    charged: false,
                    most: 0,
                },
                Check {
                    tier: Tier::Route,
                    key: bucket_key("rl", "route", "r", &tb(20, 10.0), &who),
                    algorithm: tb(20, 10.0),
                    shadow: false,
                    cost: 1,
                    shards: 1,
                    pool: false,
                    charged: false,
                    most: 0,
                },
            ];
            black_box(backend.decide_at(&checks, ratelimit_gateway::clock::Clock::now_us(&*clock)))
        })
    });
}

/// What a Redis-decided request adds to keep the fallback's starting point:
/// each tier's answer turned into its local share's state and written to the
/// local backend (10k clients, as above; compare with the row above).
fn seed_three_tiers(c: &mut Criterion) {
    let clock = Arc::new(ManualClock::new(T0));
    let backend = LocalBackend::new(1_000_000, clock.clone());
    let tb = |capacity, refill_per_sec| Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    };
    let tiers = [
        (tb(400, 100.0), tb(133, 100.0 / 3.0)),
        (tb(20, 10.0), tb(6, 10.0 / 3.0)),
        (tb(20, 10.0), tb(6, 10.0 / 3.0)),
    ];
    let answer = |limit| Decision {
        allowed: true,
        limit,
        remaining: limit - 3,
        retry_after_us: 0,
        reset_after_us: 300_000,
        delay_us: 0,
    };
    let mut i = 0u64;
    c.bench_function("seeding the fallback: three tiers, 10k clients", |b| {
        b.iter(|| {
            i += 1;
            clock.advance(10);
            let now = ratelimit_gateway::clock::Clock::now_us(&*clock);
            let who = format!("ip:10.0.{}.{}", (i % 10_000) / 256, i % 256);
            let keys = [
                bucket_key("rl", "ip", "ip", &tiers[0].0, &who),
                bucket_key("rl", "key", "free", &tiers[1].0, "k:demo"),
                bucket_key("rl", "route", "r", &tiers[2].0, &who),
            ];
            for ((shared, local), key) in tiers.iter().zip(&keys) {
                let d = answer(ratelimit_gateway::limiter::algorithms::quota(shared));
                if let Some((state, ttl)) = outage::seed(shared, local, &d, now) {
                    backend.seed(key, state, ttl, now);
                }
            }
            black_box(&keys);
        })
    });
}

/// The API-key lookup costs the same for a near miss (one character off a
/// real key) as for a far one: the secret is hashed before any comparison.
/// A million keys, as a keys file may hold.
fn key_lookup(c: &mut Criterion) {
    use ratelimit_gateway::identity::apikeys::{digest_of, Builder, Origin};
    let n = 1_000_000;
    let mut b = Builder::new(n);
    for i in 0..n {
        let (id, secret) = (format!("rider-{i}"), format!("secret-key-{i:06}"));
        b.insert(
            &id,
            digest_of(&secret),
            "free",
            None,
            None,
            Origin::Line(i + 1),
        )
        .expect("distinct keys");
    }
    let table = b.finish().expect("distinct ids");
    let mut group = c.benchmark_group("api key lookup (1,000,000 keys)");
    group.bench_function("hit", |b| {
        b.iter(|| table.lookup(black_box(b"secret-key-001000")))
    });
    group.bench_function("near miss", |b| {
        b.iter(|| table.lookup(black_box(b"secret-key-001001x")))
    });
    group.bench_function("far miss", |b| {
        b.iter(|| table.lookup(black_box(b"zzzzzzzzzzzzzzzzzz")))
    });
    group.finish();
}

/// The request path's own work around the limiter, for a request that passes
/// all three tiers: `classify` (client, route, key, the tiers' buckets) and
/// `conclude` (the verdict into rate-limit headers, both styles).
fn request_path(c: &mut Criterion) {
    use ratelimit_gateway::admission::{classify, conclude, Policy, RequestView};
    use ratelimit_gateway::config::HeaderStyle;
    use ratelimit_gateway::identity::credentials::parse;
    use ratelimit_gateway::limiter::{Decision, FallbackState, Outcome, Verdict};
    let (config, credentials) = parse(
        r#"
[server]
listen = ["127.0.0.1:8080"]
[limiter]
backend = "local"
[clients]
api_key_header = "x-api-key"
[tiers.ip]
algorithm = "token_bucket"
capacity = 1000
refill_per_sec = 100.5
[plans.pro]
capacity = 500
refill_per_sec = 50
[[api_keys]]
id = "rider-app"
key = "bench-key-0001"
plan = "pro"
[[upstreams]]
name = "app"
servers = ["127.0.0.1:9000"]
[[routes]]
name = "rides"
path_prefix = "/api/rides"
upstream = "app"
limit = { algorithm = "sliding_window", limit = 100, window_secs = 60, scope = "client" }
"#,
    )
    .expect("bench config");
    let policy = Policy::new(Arc::new(config), &credentials);
    let headers = http::HeaderMap::new();
    let view = RequestView {
        method: "GET",
        path: "/api/rides/42",
        peer: "203.0.113.7".parse().unwrap(),
        xff: Vec::new(),
        api_key: vec![b"bench-key-0001"],
        authorization: Vec::new(),
        host: Some("api.example.com"),
        content_length: None,
        query: None,
        headers: &headers,
        jwt: None,
    };
    let mut group = c.benchmark_group("request path");
    group.bench_function("classify", |b| {
        b.iter(|| classify(black_box(&policy), black_box(&view)))
    });
    let plan = classify(&policy, &view).expect("admitted");
    let decision = |remaining| Decision {
        allowed: true,
        limit: 100,
        remaining,
        retry_after_us: 0,
        reset_after_us: 1_500_000,
        delay_us: 0,
    };
    let outcome = Outcome::Decided {
        verdict: Verdict {
            decisions: vec![decision(900), decision(400), decision(60)],
            now_us: T0,
        },
        backend: FallbackState::Local,
        checks: plan.checks.clone(),
        standing: ratelimit_gateway::limiter::OnShares::NONE,
        leased: None,
    };
    group.bench_function("conclude (both header styles)", |b| {
        b.iter(|| conclude(black_box(&outcome), HeaderStyle::Both, 0))
    });
    group.finish();
}

criterion_group!(
    benches,
    decide_once,
    local_three_tiers,
    seed_three_tiers,
    key_lookup,
    request_path
);
criterion_main!(benches);
