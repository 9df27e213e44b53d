//! One table of scenarios run against both backends with the same injected
//! clock: the local backend (Rust) and the Redis backend (`limiter.lua` on a
//! real redis-server). Every decision must match exactly, and the scenarios
//! also pin the expected values, so agreeing on a wrong answer fails too.

mod support;

use std::sync::Arc;
use std::time::Duration;

use ratelimit_gateway::clock::ManualClock;
use ratelimit_gateway::config::Algorithm;
use ratelimit_gateway::limiter::keys::bucket_key;
use ratelimit_gateway::limiter::{Backend, Check, Decision, LocalBackend, RedisBackend, Tier};
use support::RedisGuard;

const S: i64 = 1_000_000;
const T0: i64 = 1_700_000_000 * S;

struct Pair {
    clock: Arc<ManualClock>,
    local: LocalBackend,
    redis: RedisBackend,
    _server: RedisGuard,
}

impl Pair {
    fn new() -> Self {
        let server = RedisGuard::start();
        let clock = Arc::new(ManualClock::new(T0));
        Pair {
            local: LocalBackend::new(100_000, clock.clone()),
            redis: RedisBackend::new(&server.url(), Duration::from_secs(2), Some(clock.clone()))
                .expect("client"),
            clock,
            _server: server,
        }
    }

    /// Decides on both backends at the clock's time; they must agree.
    async fn decide(&self, checks: &[Check]) -> Vec<Decision> {
        let now = ratelimit_gateway::clock::Clock::now_us(&*self.clock);
        let local = self.local.decide(checks).await.expect("local").decisions;
        let redis = self.redis.decide(checks).await.expect("redis").decisions;
        assert_eq!(
            local,
            redis,
            "backends disagree at t0+{}us for {checks:?}",
            now - T0
        );
        local
    }
}

fn check(tier: Tier, rule: &str, alg: Algorithm, who: &str) -> Check {
    Check {
        tier,
        key: bucket_key("ct", tier.as_str(), rule, &alg, who),
        algorithm: alg,
        shadow: false,
    }
}

fn tb(capacity: u64, refill_per_sec: f64) -> Algorithm {
    Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    }
}

/// Admitted flags of a run of `n` identical requests at the current time.
async fn run(p: &Pair, checks: &[Check], n: usize) -> Vec<bool> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(p.decide(checks).await.iter().all(|d| d.allowed));
    }
    out
}

#[tokio::test]
async fn bursts_and_refills() {
    let p = Pair::new();
    let c = [check(Tier::Key, "free", tb(5, 2.5), "k:a")];
    assert_eq!(run(&p, &c, 6).await, [true, true, true, true, true, false]);
    let d = p.decide(&c).await;
    assert_eq!(
        d[0].retry_after_us, 400_000,
        "2.5 tokens/s: one every 400 ms"
    );
    p.clock.advance(399_999);
    assert_eq!(run(&p, &c, 1).await, [false]);
    p.clock.advance(1);
    assert_eq!(run(&p, &c, 2).await, [true, false]);
    p.clock.advance(10 * S);
    assert_eq!(run(&p, &c, 6).await, [true, true, true, true, true, false]);
}

#[tokio::test]
async fn leaky_bucket_shapes() {
    let p = Pair::new();
    let alg = Algorithm::LeakyBucket {
        rate_per_sec: 3000.0,
        max_delay_ms: 2,
    };
    let c = [check(Tier::Route, "loc", alg, "global")];
    let mut delays = Vec::new();
    for _ in 0..8 {
        let d = p.decide(&c).await;
        delays.push(if d[0].allowed {
            d[0].delay_us as i64
        } else {
            -(d[0].retry_after_us as i64)
        });
    }
    // 333.33 us apart (TAT is an f64 near 1.7e15 us, a quarter-microsecond
    // grid, hence 1333); the 8th would wait 2333 us > 2 ms.
    assert_eq!(delays, [0, 334, 667, 1000, 1333, 1667, 2000, -333]);
}

#[tokio::test]
async fn windows() {
    let p = Pair::new();
    let fixed = Algorithm::FixedWindow {
        limit: 3,
        window_secs: 60,
    };
    let sliding = Algorithm::SlidingWindow {
        limit: 4,
        window_secs: 10,
    };
    let log = Algorithm::SlidingLog {
        limit: 2,
        window_secs: 5,
    };
    let boundary = (T0 / (60 * S) + 1) * 60 * S;
    p.clock.set(boundary - 2 * S);
    let f = [check(Tier::Route, "f", fixed, "global")];
    let s = [check(Tier::Route, "s", sliding, "ip:1.2.3.4")];
    let l = [check(Tier::Route, "l", log, "ip:1.2.3.4")];
    assert_eq!(run(&p, &f, 4).await, [true, true, true, false]);
    assert_eq!(p.decide(&f).await[0].retry_after_us, 2 * S as u64);
    assert_eq!(run(&p, &s, 5).await, [true, true, true, true, false]);
    assert_eq!(run(&p, &l, 3).await, [true, true, false]);
    p.clock.set(boundary);
    assert_eq!(
        run(&p, &f, 4).await,
        [true, true, true, false],
        "a new fixed window"
    );
    let d = p.decide(&s).await;
    assert!(
        !d[0].allowed,
        "the previous sliding window still weighs 4 * 1.0"
    );
    assert_eq!(
        d[0].retry_after_us, 2_500_000,
        "4 * (1 - f) + 1 <= 4 once f >= 0.25 of the 10 s window"
    );
    p.clock.advance(3 * S); // log entries from boundary-2s expire at boundary+3s
    assert_eq!(run(&p, &l, 3).await, [true, true, false]);
}

#[tokio::test]
async fn a_rejection_charges_no_tier() {
    let p = Pair::new();
    let ip = check(Tier::Ip, "ip", tb(100, 1.0), "ip:9.9.9.9");
    let key = check(Tier::Key, "free", tb(2, 1.0), "k:a");
    let route = check(
        Tier::Route,
        "r",
        Algorithm::SlidingLog {
            limit: 10,
            window_secs: 60,
        },
        "k:a",
    );
    let all = [ip.clone(), key, route.clone()];
    assert_eq!(run(&p, &all, 2).await, [true, true]);
    for _ in 0..5 {
        let d = p.decide(&all).await;
        assert_eq!(
            d.iter().map(|d| d.allowed).collect::<Vec<_>>(),
            [true, false, true],
            "only the key tier says no"
        );
    }
    // The ip and route tiers were charged for the two admissions only.
    assert_eq!(p.decide(&[ip]).await[0].remaining, 97);
    assert_eq!(p.decide(&[route]).await[0].remaining, 7);
}

#[tokio::test]
async fn shadow_tiers_report_but_never_block() {
    let p = Pair::new();
    let mut shadow = check(Tier::Route, "r", tb(1, 0.1), "global");
    shadow.shadow = true;
    let key = check(Tier::Key, "free", tb(10, 1.0), "k:a");
    let c = [key, shadow];
    let first = p.decide(&c).await;
    assert!(first[1].allowed);
    for _ in 0..3 {
        let d = p.decide(&c).await;
        assert!(
            d[0].allowed && !d[1].allowed,
            "the shadow tier would reject, the key tier admits"
        );
    }
    assert_eq!(
        p.decide(&c[..1]).await[0].remaining,
        5,
        "the key tier was charged all 5 times"
    );
}

/// Random sequences over every algorithm: both backends stay in lock-step.
#[tokio::test]
async fn random_sequences_agree() {
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut decisions = 0;
    for round in 0..40 {
        let alg = match rng.u8(0..5) {
            0 => tb(rng.u64(1..30), rng.f64() * 50.0 + 0.1),
            1 => Algorithm::LeakyBucket {
                rate_per_sec: rng.f64() * 100.0 + 0.5,
                max_delay_ms: rng.u64(0..500),
            },
            2 => Algorithm::FixedWindow {
                limit: rng.u64(1..30),
                window_secs: rng.u64(1..5),
            },
            3 => Algorithm::SlidingWindow {
                limit: rng.u64(1..30),
                window_secs: rng.u64(1..5),
            },
            _ => Algorithm::SlidingLog {
                limit: rng.u64(1..30),
                window_secs: rng.u64(1..5),
            },
        };
        let c = [
            check(Tier::Ip, "ip", tb(50, 20.0), &format!("ip:{round}")),
            check(Tier::Route, &format!("r{round}"), alg, "global"),
        ];
        for _ in 0..60 {
            p.clock.advance(rng.i64(0..200_000));
            p.decide(&c).await;
            decisions += 1;
        }
    }
    assert_eq!(decisions, 2400);
}
