//! One table of scenarios run against both backends with the same injected
//! clock: the local backend (Rust) and the Redis backend (`limiter.lua` on a
//! real redis-server). Every decision must match exactly, and the scenarios
//! also pin the expected values, so agreeing on a wrong answer fails too.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use ratelimit_gateway::calendar::{self, Period};
use ratelimit_gateway::clock::ManualClock;
use ratelimit_gateway::config::Algorithm;
use ratelimit_gateway::limiter::algorithms::lease::{self, Grant};
use ratelimit_gateway::limiter::algorithms::{self, outage, State};
use ratelimit_gateway::limiter::keys::bucket_key;
use ratelimit_gateway::limiter::leases::{Ask, Asks};
use ratelimit_gateway::limiter::{
    Backend, Check, Decision, LimiterError, LocalBackend, RedisBackend, Tier, Verdict,
};
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
            redis: redis_backend(&server, &clock, Duration::from_secs(2)),
            clock,
            _server: server,
        }
    }

    fn now(&self) -> i64 {
        ratelimit_gateway::clock::Clock::now_us(&*self.clock)
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

/// A Redis backend on `server`, deciding at `clock`'s time, with this budget per call.
fn redis_backend(server: &RedisGuard, clock: &Arc<ManualClock>, budget: Duration) -> RedisBackend {
    RedisBackend::new(&server.url(), budget, Some(clock.clone())).expect("client")
}

fn check(tier: Tier, rule: &str, alg: Algorithm, who: &str) -> Check {
    Check {
        tier,
        key: bucket_key("ct", tier.as_str(), rule, &alg, who),
        algorithm: alg,
        shadow: false,
        cost: 1,
        shards: 1,
        pool: false,
        charged: false,
        most: 0,
    }
}

/// A random cost a request under `alg` can take: 1 to the quota, at most 4.
fn random_cost(rng: &mut fastrand::Rng, alg: &Algorithm) -> u64 {
    rng.u64(1..=alg.quota().min(4))
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

/// Rates so high that T is below a double's resolution at epoch microseconds:
/// both backends still report fewer remaining than the bucket holds.
#[tokio::test]
async fn huge_rates_never_report_more_than_the_limit() {
    let p = Pair::new();
    let huge = [
        tb(1_000_000_000, 1e9),
        tb(5, 4e6),
        Algorithm::LeakyBucket {
            rate_per_sec: 1e9,
            max_delay_ms: 1000,
        },
    ];
    for (i, alg) in huge.into_iter().enumerate() {
        let c = [check(Tier::Ip, &format!("huge{i}"), alg, "ip:1")];
        for n in 0..3 {
            let d = p.decide(&c).await;
            assert!(d[0].allowed, "{alg}: request {n}");
            assert!(
                d[0].remaining < d[0].limit,
                "{alg}: request {n} reports {} remaining of {}",
                d[0].remaining,
                d[0].limit
            );
        }
        p.clock.advance(1);
    }
}

#[tokio::test]
async fn leaky_bucket_shapes() {
    let p = Pair::new();
    // Seconds, not milliseconds: a key's time to live runs on Redis's own
    // clock while the test's stands still (limiter.lua keeps such keys a
    // minute; seconds keep this test clear of that too).
    let alg = Algorithm::LeakyBucket {
        rate_per_sec: 3.0,
        max_delay_ms: 2000,
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
    // 333,333.33 us apart (TAT is an f64 near 1.7e15 us, a quarter-microsecond
    // grid, hence 1,333,333); the 8th would wait 2.33 s > 2 s.
    assert_eq!(
        delays,
        [0, 333_334, 666_667, 1_000_000, 1_333_333, 1_666_667, 2_000_000, -333_333]
    );
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
/// A rule of algorithm `which` (0..5) with random parameters: limits and
/// capacities below `max_limit`, windows below `max_window` seconds.
fn random_algorithm(
    rng: &mut fastrand::Rng,
    which: u8,
    max_limit: u64,
    max_window: u64,
) -> Algorithm {
    let limit = rng.u64(1..max_limit);
    let window_secs = rng.u64(1..max_window);
    match which {
        0 => tb(limit, rng.f64() * 50.0 + 0.1),
        1 => Algorithm::LeakyBucket {
            rate_per_sec: rng.f64() * 100.0 + 0.5,
            max_delay_ms: rng.u64(0..500),
        },
        2 => Algorithm::FixedWindow { limit, window_secs },
        3 => Algorithm::SlidingWindow { limit, window_secs },
        _ => Algorithm::SlidingLog { limit, window_secs },
    }
}

#[tokio::test]
async fn random_sequences_agree() {
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let mut decisions = 0;
    for round in 0..40 {
        let which = rng.u8(0..5);
        let alg = random_algorithm(&mut rng, which, 30, 5);
        let mut c = [
            check(Tier::Ip, "ip", tb(50, 20.0), &format!("ip:{round}")),
            check(Tier::Route, &format!("r{round}"), alg, "global"),
        ];
        for _ in 0..60 {
            p.clock.advance(rng.i64(0..200_000));
            // Each request its own cost: one bucket sees a mix.
            c[1].cost = random_cost(&mut rng, &alg);
            p.decide(&c).await;
            decisions += 1;
        }
    }
    assert_eq!(decisions, 2400);
}

/// A batch decided in one call answers exactly what its requests get one by
/// one at the same instant: each request sees what the ones before it took,
/// even when they share buckets, a rejection mid-batch charges nothing, and a
/// sliding log counts the entries the same batch added.
#[tokio::test]
async fn batches_decide_as_one_by_one() {
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0xba7c4);
    let mut decided = 0;
    let mut rejected = 0;
    for round in 0..30 {
        let route = random_algorithm(&mut rng, (round % 5) as u8, 12, 3);
        // Four clients on two keys' plans, one shared route bucket; one client
        // carries a shadow tier.
        let clients: Vec<Vec<Check>> = (0..4)
            .map(|c| {
                let mut v = vec![
                    check(Tier::Ip, "ip", tb(6, 3.0), &format!("ip:{round}:{c}")),
                    check(
                        Tier::Key,
                        "plan",
                        tb(8, 4.0),
                        &format!("k:{round}:{}", c % 2),
                    ),
                    check(Tier::Route, &format!("r{round}"), route, "global"),
                ];
                if c == 3 {
                    v[0].shadow = true;
                }
                // Clients differ in cost on the one route bucket.
                v[2].cost = 1 + c as u64 % route.quota().min(3);
                v
            })
            .collect();
        for _ in 0..12 {
            p.clock.advance(rng.i64(0..400_000));
            let batch: Vec<&[Check]> = (0..rng.usize(1..=20))
                .map(|_| clients[rng.usize(0..clients.len())].as_slice())
                .collect();
            let redis = p.redis.decide_many(&batch).await.expect("redis batch");
            assert_eq!(redis.len(), batch.len());
            for (i, (checks, got)) in batch.iter().zip(&redis).enumerate() {
                let local = p.local.decide(checks).await.expect("local");
                assert_eq!(
                    local.decisions,
                    got.decisions,
                    "request {i} of a batch of {} (round {round}) differs from one by one",
                    batch.len()
                );
                decided += 1;
                if !local.admitted(checks) {
                    rejected += 1;
                }
            }
        }
    }
    // The rounds must exercise both answers, or agreeing proves little.
    assert!(
        decided > 1000 && rejected > 200,
        "{decided} decided, {rejected} rejected"
    );
}

/// Requests arriving together share calls: 200 concurrent requests on one
/// bucket of 50 are decided in batches (of at most 64), and admit exactly 50.
#[tokio::test]
async fn concurrent_requests_are_batched_and_exact() {
    let server = RedisGuard::start();
    let clock = Arc::new(ManualClock::new(T0));
    let redis = Arc::new(redis_backend(&server, &clock, Duration::from_secs(2)));
    let c = vec![check(Tier::Route, "burst", tb(50, 0.001), "global")];
    // The first call loads the script (NOSCRIPT, then a second EVALSHA).
    let warm = [check(Tier::Route, "warm", tb(5, 1.0), "global")];
    redis.decide(&warm).await.expect("warm-up");
    let before = server.calls("evalsha");
    // A current-thread runtime: all 200 queue before the batching task runs.
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (redis, c) = (redis.clone(), c.clone());
            tokio::spawn(async move { redis.decide(&c).await.expect("decide").admitted(&c) })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("task") as u32;
    }
    assert_eq!(admitted, 50);
    assert_eq!(
        server.calls("evalsha") - before,
        4,
        "200 requests in batches of 64"
    );
}

/// A call past its budget is not blamed on Redis by itself: without the
/// breaker's word its requests keep waiting and get Redis's own answer (a
/// saturated worker reads late; an exact answer late beats a guess).
#[tokio::test]
async fn a_late_call_is_still_answered_exactly() {
    let server = RedisGuard::start();
    let clock = Arc::new(ManualClock::new(T0));
    let redis = Arc::new(redis_backend(&server, &clock, Duration::from_millis(50)));
    let c = vec![check(Tier::Route, "late", tb(10, 0.001), "global")];
    assert_eq!(
        redis.decide(&c).await.expect("first").decisions[0].remaining,
        9
    );
    // Redis holds every write for 300 ms: six budgets.
    server.cmd(&["CLIENT", "PAUSE", "300", "WRITE"]);
    let spawn = |redis: &Arc<RedisBackend>| {
        let (redis, c) = (redis.clone(), c.clone());
        tokio::spawn(async move { redis.decide(&c).await })
    };
    let held = spawn(&redis);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let queued: Vec<_> = (0..3).map(|_| spawn(&redis)).collect();
    let mut remaining =
        vec![held.await.expect("task").expect("late, answered").decisions[0].remaining];
    for q in queued {
        remaining.push(q.await.expect("task").expect("queued, answered").decisions[0].remaining);
    }
    remaining.sort_unstable();
    assert_eq!(
        remaining,
        [5, 6, 7, 8],
        "each request charged once, in order"
    );
}

/// When the breaker opens (`abandon`), the call in flight and the requests
/// queued behind it fail at once (they are decided by the fallback); the
/// queued ones are never sent, so only the request whose call had already
/// left can be charged as well.
#[tokio::test]
async fn abandoned_calls_fail_at_once_and_queued_requests_are_not_charged() {
    let server = RedisGuard::start();
    let clock = Arc::new(ManualClock::new(T0));
    let redis = Arc::new(redis_backend(&server, &clock, Duration::from_millis(50)));
    let c = vec![check(Tier::Route, "held", tb(10, 0.001), "global")];
    let fresh = redis.decide(&c).await.expect("first decision");
    assert_eq!(fresh.decisions[0].remaining, 9);
    server.cmd(&["CLIENT", "PAUSE", "600", "WRITE"]);
    let spawn = |redis: &Arc<RedisBackend>| {
        let (redis, c) = (redis.clone(), c.clone());
        tokio::spawn(async move { redis.decide(&c).await })
    };
    let held = spawn(&redis);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued: Vec<_> = (0..3).map(|_| spawn(&redis)).collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    redis.abandon();
    for q in queued {
        let e = q
            .await
            .expect("task")
            .expect_err("queued behind an abandoned call");
        assert!(matches!(e, LimiterError::Abandoned), "{e:?}");
    }
    let e = held.await.expect("task").expect_err("abandoned");
    assert!(matches!(e, LimiterError::Abandoned), "{e:?}");
    // After the pause: the held call ran (too late: its request was decided
    // elsewhere, so it is charged twice, as documented); the three queued
    // behind it never reached Redis.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let after = redis.decide(&c).await.expect("after the pause");
    assert_eq!(
        after.decisions[0].remaining, 7,
        "10 - fresh - held - this one"
    );
}

/// What a replica admitted locally during an outage, charged on failback:
/// `charge.lua` writes what `outage::charge` computes, and both backends
/// decide the same afterwards. Random rules of every algorithm, random
/// shared state before, random debts.
#[tokio::test]
async fn charged_debts_agree() {
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0xdeb7);
    let mut charged = 0;
    for round in 0..50 {
        let which = (round % 5) as u8;
        let alg = random_algorithm(&mut rng, which, 30, 5);
        let c = [check(Tier::Route, &format!("d{round}"), alg, "global")];
        for _ in 0..rng.usize(0..12) {
            p.clock.advance(rng.i64(0..300_000));
            p.decide(&c).await;
        }
        let mut debt = None;
        for _ in 0..rng.usize(1..20) {
            p.clock.advance(rng.i64(0..150_000));
            outage::record(&alg, &mut debt, p.now(), random_cost(&mut rng, &alg));
        }
        p.clock.advance(rng.i64(0..400_000));
        let debts = vec![(c[0].clone(), debt.expect("recorded"))];
        let local = p.local.charge_at(&debts, p.now());
        let redis = p.redis.charge(&debts, "r1").await.expect("charge.lua");
        assert_eq!(local, redis, "round {round}: buckets written for {alg:?}");
        charged += local;
        for _ in 0..8 {
            p.clock.advance(rng.i64(0..200_000));
            p.decide(&c).await;
        }
    }
    assert!(
        charged >= 25,
        "most debts still counted when charged ({charged})"
    );
}

/// A sliding log's debt names its entries by time, replica and rank, so a
/// charge sent again (after a call that timed out but ran) adds nothing;
/// another replica's entries of the same times are its own.
#[tokio::test]
async fn a_log_charge_sent_twice_counts_once() {
    let p = Pair::new();
    let alg = Algorithm::SlidingLog {
        limit: 10,
        window_secs: 60,
    };
    let c = [check(Tier::Route, "login", alg, "ip:10.0.0.1")];
    let mut debt = None;
    for _ in 0..3 {
        outage::record(&alg, &mut debt, p.now(), 1);
    }
    let debts = vec![(c[0].clone(), debt.expect("recorded"))];
    p.redis.charge(&debts, "r1").await.expect("first");
    p.redis.charge(&debts, "r1").await.expect("again");
    p.redis.charge(&debts, "r2").await.expect("another replica");
    let mut left = 0;
    for _ in 0..10 {
        if p.redis.decide(&c).await.expect("redis").decisions[0].allowed {
            left += 1;
        }
    }
    assert_eq!(left, 4, "10 - 3 (r1, once) - 3 (r2)");
}

/// A debt is charged exactly as a replay: 4 local admissions onto a token
/// bucket that had 6 of 10 left leave 2.
#[tokio::test]
async fn a_charged_debt_leaves_what_a_replay_would() {
    let p = Pair::new();
    let alg = tb(10, 0.001);
    let c = [check(Tier::Key, "free", alg, "k:a")];
    assert_eq!(run(&p, &c, 4).await, [true; 4]);
    let mut debt = None;
    for _ in 0..4 {
        outage::record(&alg, &mut debt, p.now(), 1);
    }
    let debts = vec![(c[0].clone(), debt.expect("recorded"))];
    assert_eq!(p.local.charge_at(&debts, p.now()), 1);
    assert_eq!(p.redis.charge(&debts, "r1").await.expect("charge.lua"), 1);
    assert_eq!(
        run(&p, &c, 3).await,
        [true, true, false],
        "10 - 4 - 4 = 2 left"
    );
}

/// The script checks its arguments whole before it reads or writes: a
/// malformed call is an error naming the problem and changes nothing.
#[test]
fn malformed_calls_change_nothing() {
    let server = RedisGuard::start();
    let script = include_str!("../../src/limiter/limiter.lua");
    // Two requests of one shape; two buckets (a token bucket of 10 at 5/s, a
    // sliding log of 10 per 60 s); the shape names both; each request names
    // the shape. Valid, then broken one way at a time.
    let good = [
        "2", "1", "0", // requests, shapes, buckets named beyond KEYS
        "1", "10", "5", "5", "10", "60", // the buckets
        "2", "1", "1", "2", "3", // the shape: two tiers, bucket 1 costing 1 and 2 costing 3
        "1", "1", // the requests
    ];
    let eval = |args: &[&str]| {
        let mut argv = vec!["EVAL", script, "2", "rl:t:a", "rl:t:b", "1700000000000000"];
        argv.extend_from_slice(args);
        server.cmd(&argv)
    };
    let ok = eval(&good);
    assert!(!ok.contains("limiter.lua"), "the valid call: {ok}");
    assert_eq!(server.dbsize(), 2, "the valid call wrote both buckets");
    server.cmd(&["FLUSHALL"]);
    let broken: &[(&str, usize, &str)] = &[
        ("kind 3.5", 3, "3.5"),
        ("capacity NaN", 4, "nan"),
        ("negative shape length", 9, "-1"),
        ("shape names bucket 3 of 2", 10, "3"),
        ("cost 0", 11, "0"),
        ("cost 2.5", 13, "2.5"),
        ("request names shape 2 of 1", 15, "2"),
        ("requests counted as 1.5", 0, "1.5"),
        ("more names beyond KEYS than arguments", 2, "99"),
        ("names beyond KEYS counted as -1", 2, "-1"),
    ];
    for (what, at, value) in broken {
        let mut args = good.to_vec();
        args[*at] = value;
        let out = eval(&args);
        assert!(out.contains("limiter.lua:"), "{what}: {out}");
        assert_eq!(server.dbsize(), 0, "{what} wrote something");
    }
}

/// The Rust model of one `limiter.lua` call with leases: quota ledgers
/// read where they can matter (expired holdings reclaimed), spending
/// reported, returns, then the requests in order (all or nothing each),
/// then the grants.
fn model_call(
    state: &mut std::collections::HashMap<String, Option<State>>,
    ledgers: &mut std::collections::HashMap<String, lease::Ledger>,
    reclaimed: &mut u64,
    now: i64,
    requests: &[&[Check]],
    asks: &Asks,
) -> (Vec<Vec<Decision>>, Vec<Grant>) {
    let mut buckets: Vec<&Check> = requests.iter().flat_map(|r| r.iter()).collect();
    buckets.extend(asks.asks.iter().map(|a| &a.check));
    let mut seen = std::collections::HashSet::new();
    for c in buckets {
        if !seen.insert(c.key.clone()) {
            continue;
        }
        let cost: u64 = requests
            .iter()
            .flat_map(|r| r.iter())
            .filter(|t| t.key == c.key)
            .map(|t| t.cost)
            .sum();
        let leased = asks.asks.iter().any(|a| a.check.key == c.key);
        let s = state.entry(c.key.clone()).or_default();
        if lease::reads_ledger(&c.algorithm, s.as_ref(), cost, leased) {
            let l = ledgers.entry(c.key.clone()).or_default();
            *reclaimed += lease::reclaim(&c.algorithm, l, s, now, Some(&asks.holder));
        }
    }
    // Reports counted before are skipped; the others booked as counted.
    let told: Vec<bool> = asks
        .asks
        .iter()
        .map(|a| {
            if !matches!(a.check.algorithm, Algorithm::Calendar { .. }) {
                return false;
            }
            let l = ledgers.entry(a.check.key.clone()).or_default();
            let told = lease::told_before(l, &asks.holder, a.report);
            if !told {
                lease::mark_told(l, &asks.holder, a.report, now, asks.hold_us);
            }
            told
        })
        .collect();
    for (a, _) in asks.asks.iter().zip(&told).filter(|(_, t)| !**t) {
        let l = ledgers.entry(a.check.key.clone()).or_default();
        let s = state.entry(a.check.key.clone()).or_default();
        lease::report_spent(&a.check.algorithm, l, s, &asks.holder, a.spent);
    }
    let back: Vec<u64> = asks
        .asks
        .iter()
        .zip(&told)
        .map(|(a, told)| {
            if *told {
                return 0;
            }
            let s = state.entry(a.check.key.clone()).or_default();
            if !matches!(a.check.algorithm, Algorithm::Calendar { .. }) {
                return lease::give_back(&a.check.algorithm, s, now, a.ret, a.until).0;
            }
            let l = ledgers.entry(a.check.key.clone()).or_default();
            let ret = lease::returnable(l, &asks.holder, a.ret);
            let back = lease::give_back(&a.check.algorithm, s, now, ret, a.until).0;
            lease::settle_return(l, &asks.holder, back);
            back
        })
        .collect();
    let mut verdicts = Vec::new();
    for r in requests {
        let evals: Vec<_> = r
            .iter()
            .map(|c| {
                let s = state.entry(c.key.clone()).or_default();
                algorithms::check(&c.algorithm, s.as_ref(), now, c.cost)
            })
            .collect();
        let admit = r
            .iter()
            .zip(&evals)
            .all(|(c, e)| e.decision.allowed || c.shadow);
        if admit {
            for (c, e) in r.iter().zip(&evals) {
                if e.decision.allowed {
                    algorithms::commit(state.get_mut(&c.key).unwrap(), &e.update);
                }
            }
        }
        verdicts.push(evals.iter().map(|e| e.decision).collect());
    }
    let grants = asks
        .asks
        .iter()
        .zip(back.into_iter().zip(told))
        .enumerate()
        .map(|(i, (a, (taken_back, told)))| {
            let s = state.entry(a.check.key.clone()).or_default();
            // A share's top-up: all the bucket holds, up to what it wants.
            let (replicas, min) = match i >= asks.asks.len() - asks.pulls {
                true => (1, 1),
                false => (asks.replicas, asks.min),
            };
            let g = lease::grant(&a.check.algorithm, s, now, a.want, replicas, min).0;
            if matches!(a.check.algorithm, Algorithm::Calendar { .. }) {
                let l = ledgers.entry(a.check.key.clone()).or_default();
                lease::hold(l, &asks.holder, g.tokens, now, asks.hold_us);
            }
            Grant {
                taken_back,
                told,
                ..g
            }
        })
        .collect();
    (verdicts, grants)
}

/// Leases: over random sequences of batches carrying lease requests and
/// returns (of the last grant, naming its `until` or, stale, another), on
/// every algorithm that leases, `limiter.lua` grants, takes back and
/// decides exactly what the Rust model (`algorithms::lease`) does.
#[tokio::test]
async fn lease_grants_and_returns_agree_with_the_model() {
    let server = RedisGuard::start();
    let clock = Arc::new(ManualClock::new(T0));
    let redis = redis_backend(&server, &clock, Duration::from_secs(2));
    let mut model = std::collections::HashMap::new();
    let mut ledgers = std::collections::HashMap::new();
    let mut reclaimed = 0;
    let mut rng = fastrand::Rng::with_seed(0x1ea5e);
    let (mut granted, mut back, mut refused_back, mut nothing, mut rejected) = (0u64, 0, 0, 0, 0);
    // A quota's own: granted, taken back, refused back (another minute's).
    let mut quota = [0u64; 3];
    // Reports told again (their numbers already counted) and skipped.
    let (mut reports, mut retold, mut skipped) = (std::collections::HashMap::new(), 0, 0);
    // Tokens granted to top-ups (the plan's ask, when it is one).
    let mut pulled = 0;
    for round in 0..60 {
        // A token bucket, the two windows, and a quota (a minute's count:
        // its rounds run long enough to cross into the next minute).
        let which = [0, 2, 3, 6][round % 4];
        let alg = random_algorithm(&mut rng, which, 200, 3);
        let quota_limit = rng.u64(1..200);
        let plan = check(Tier::Key, "plan", tb(40, 30.0), &format!("k{round}"));
        let mut last = Grant::default();
        for _ in 0..40 {
            clock.advance(match which {
                6 => rng.i64(0..3_000_000),
                _ => rng.i64(0..150_000),
            });
            let now = ratelimit_gateway::clock::Clock::now_us(&*clock);
            let route = if which == 6 {
                let span = calendar::span(Period::Minute, chrono_tz::UTC, now);
                let alg = Algorithm::Calendar {
                    limit: quota_limit,
                    period: Period::Minute,
                    start: span.start,
                    end: span.end,
                };
                check(Tier::Quota, "minute", alg, &format!("k:lr{round}"))
            } else {
                check(Tier::Route, &format!("lr{round}"), alg, "global")
            };
            let alg = route.algorithm;
            let mut requests: Vec<Vec<Check>> = Vec::new();
            for _ in 0..rng.usize(0..4) {
                let mut r = vec![plan.clone(), route.clone()];
                r[1].cost = random_cost(&mut rng, &alg);
                requests.push(r);
            }
            let refs: Vec<&[Check]> = requests.iter().map(Vec::as_slice).collect();
            // Ask for the route's bucket and sometimes the plan's; give back
            // part of the last grant, naming its `until` or another.
            // (Sometimes more than was granted: Redis must refuse what it
            // cannot take back exactly.)
            let ret = rng.u64(0..=last.tokens + 20);
            let mut asks = Asks {
                asks: vec![Ask {
                    check: route.clone(),
                    want: rng.u64(0..80),
                    ret,
                    until: last.until - rng.i64(0..2) * rng.i64(1..3),
                    // Spending reported, sometimes more than is held.
                    spent: rng.u64(0..=last.tokens / 2 + 2) * (which == 6) as u64,
                    report: 0,
                }],
                replicas: rng.u64(1..5),
                min: rng.u64(1..6),
                // Two holders: a return names only what its own holds; a
                // holding that outlives `hold` is reclaimed.
                holder: ["conformance", "other"][rng.usize(0..2)].into(),
                hold_us: 2_000_000,
                pulls: 0,
            };
            if rng.bool() {
                asks.asks.push(Ask {
                    check: plan.clone(),
                    want: rng.u64(0..30),
                    ret: 0,
                    until: 0,
                    spent: 0,
                    report: 0,
                });
                // Sometimes a standing share's top-up (`limiter::pulls`).
                asks.pulls = rng.bool() as usize;
            }
            // A quota's report is numbered by its holder: a new number, or
            // the last one told again (its answer lost), counted once.
            let first = &mut asks.asks[0];
            if which == 6 && (first.spent > 0 || first.ret > 0) {
                let n = reports.entry(asks.holder.to_string()).or_insert(0u64);
                if *n == 0 || rng.u8(0..3) > 0 {
                    *n += 1;
                } else {
                    retold += 1;
                }
                first.report = *n;
            }
            let (verdicts, grants, at) = redis.decide_leasing(&refs, &asks).await.expect("redis");
            assert_eq!(at, now);
            let (expected, model_grants) =
                model_call(&mut model, &mut ledgers, &mut reclaimed, now, &refs, &asks);
            let got: Vec<Vec<Decision>> = verdicts.into_iter().map(|v| v.decisions).collect();
            assert_eq!(got, expected, "round {round}: decisions differ ({alg:?})");
            assert_eq!(
                grants, model_grants,
                "round {round}: grants differ ({alg:?}, {asks:?})"
            );
            granted += grants.iter().map(|g| g.tokens).sum::<u64>();
            back += grants[0].taken_back;
            refused_back += (ret > 0 && grants[0].taken_back == 0) as usize;
            if which == 6 {
                quota[0] += grants[0].tokens;
                quota[1] += grants[0].taken_back;
                quota[2] += (ret > 0 && grants[0].taken_back == 0) as u64;
            }
            skipped += grants.iter().filter(|g| g.told).count();
            if asks.pulls == 1 {
                pulled += grants[1].tokens;
            }
            last = grants[0];
            nothing += grants.iter().filter(|g| g.tokens == 0).count();
            rejected += expected.iter().flatten().filter(|d| !d.allowed).count();
        }
    }
    // Every branch exercised: grants, returns taken back and refused,
    // refusals to grant, rejections.
    assert!(
        granted > 1000 && back > 100 && refused_back > 20 && nothing > 100 && rejected > 100,
        "granted {granted}, taken back {back}, returns refused {refused_back}, nothing {nothing}, rejected {rejected}"
    );
    assert!(
        retold > 10 && skipped > 5,
        "reports told again {retold}, skipped as counted {skipped}"
    );
    assert!(pulled > 100, "top-ups granted {pulled}");
    assert!(
        quota[0] > 100 && quota[1] > 20 && quota[2] > 5 && reclaimed > 20,
        "quotas: granted {}, taken back {}, returns refused {}, reclaimed {reclaimed}",
        quota[0],
        quota[1],
        quota[2]
    );
}

/// A holder's own call never takes its quota holding back, however long
/// past `hold`: it is alive and reports what it spent, and a request of
/// its own decided first would be admitted against tokens already spent
/// (a replica back from a silent outage once admitted one over its quota
/// so). Another holder's call does take it back, and the late report is
/// charged again.
#[tokio::test]
async fn a_holders_own_call_never_takes_its_holding_back() {
    let server = RedisGuard::start();
    let clock = Arc::new(ManualClock::new(T0));
    let redis = redis_backend(&server, &clock, Duration::from_secs(2));
    let now = ratelimit_gateway::clock::Clock::now_us(&*clock);
    let span = calendar::span(Period::Day, chrono_tz::UTC, now);
    let alg = Algorithm::Calendar {
        limit: 10,
        period: Period::Day,
        start: span.start,
        end: span.end,
    };
    let quota = check(Tier::Quota, "day", alg, "k:own");
    let asks = |holder: &str, asks: Vec<Ask>| Asks {
        asks,
        replicas: 1,
        min: 4,
        holder: holder.into(),
        hold_us: 200_000,
        pulls: 0,
    };
    let one = [quota.clone()];
    let admitted = |v: &[Verdict]| v.iter().filter(|v| v.decisions[0].allowed).count();
    // Four requests, then a lease of the six left.
    let four: Vec<&[Check]> = vec![&one; 4];
    let lease = Ask {
        check: quota.clone(),
        want: 6,
        ret: 0,
        until: 0,
        spent: 0,
        report: 0,
    };
    let (v, g, _) = redis
        .decide_leasing(&four, &asks("x", vec![lease]))
        .await
        .unwrap();
    assert_eq!((admitted(&v), g[0].tokens), (4, 6));
    // X spends all six and is cut off past its hold, unreported.
    clock.advance(1_000_000);
    let req: Vec<&[Check]> = vec![&one];
    let (v, _, _) = redis
        .decide_leasing(&req, &asks("x", vec![]))
        .await
        .unwrap();
    assert_eq!(admitted(&v), 0, "X's own call took its holding back");
    // Another holder's call does, and X's late report is charged again.
    let (v, _, _) = redis
        .decide_leasing(&req, &asks("y", vec![]))
        .await
        .unwrap();
    assert_eq!(admitted(&v), 1, "a dead holder's holding comes back");
    let report = Ask {
        check: quota.clone(),
        want: 0,
        ret: 0,
        until: span.end,
        spent: 6,
        report: 1,
    };
    redis
        .decide_leasing(&[], &asks("x", vec![report]))
        .await
        .unwrap();
    let (v, _, _) = redis
        .decide_leasing(&req, &asks("x", vec![]))
        .await
        .unwrap();
    assert_eq!(admitted(&v), 0, "11 counted: the late report charged again");
}

/// A lease section that names a bucket that cannot be leased, or does not
/// add up, is refused before anything is written.
#[test]
fn malformed_leases_change_nothing() {
    let server = RedisGuard::start();
    let script = include_str!("../../src/limiter/limiter.lua");
    // One request on a token bucket (1) and a sliding log (2); then leases.
    let base = [
        "1", "1", "0", "1", "10", "5", "5", "10", "60", "2", "1", "1", "2", "1", "1",
    ];
    let eval = |leases: &[&str]| {
        let mut argv = vec!["EVAL", script, "2", "rl:t:a", "rl:t:b", "1700000000000000"];
        argv.extend_from_slice(&base);
        argv.extend_from_slice(leases);
        server.cmd(&argv)
    };
    let ok = eval(&["1", "2", "1", "h1", "1000", "1", "5", "0", "0", "0", "0"]);
    assert!(!ok.contains("limiter.lua"), "the valid call: {ok}");
    server.cmd(&["FLUSHALL"]);
    for (what, leases) in [
        (
            "a lease on a sliding log",
            &["1", "2", "1", "h1", "1000", "2", "5", "0", "0", "0", "0"][..],
        ),
        (
            "two leases announced, one sent",
            &["2", "2", "1", "h1", "1000", "1", "5", "0", "0", "0", "0"],
        ),
        (
            "no replicas",
            &["1", "0", "1", "h1", "1000", "1", "5", "0", "0", "0", "0"],
        ),
        (
            "a fractional return",
            &["1", "2", "1", "h1", "1000", "1", "5", "0.5", "0", "0", "0"],
        ),
        ("a lease section cut short", &["1", "2"]),
        (
            "a holder that is not [0-9a-z]",
            &["1", "2", "1", "h:1", "1000", "1", "5", "0", "0", "0", "0"],
        ),
        (
            "a fractional report number",
            &["1", "2", "1", "h1", "1000", "1", "5", "0", "0", "0", "1.5"],
        ),
        (
            "a negative spent",
            &["1", "2", "1", "h1", "1000", "1", "5", "0", "0", "-1", "0"],
        ),
    ] {
        let out = eval(leases);
        assert!(out.contains("limiter.lua:"), "{what}: {out}");
        assert_eq!(server.dbsize(), 0, "{what} wrote something");
    }
}

/// Calendar quotas across the boundaries that matter, as the planner
/// makes them (the period `calendar::span` names, a bucket per period): both
/// backends agree on every decision, and each period admits exactly its
/// limit however the requests straddle its end. The last microsecond of a
/// day, month ends of 28, 29, 30 and 31 days, both DST changes of a zone
/// that has them, and a week.
#[tokio::test]
async fn calendar_quotas_agree_across_boundaries() {
    use chrono::TimeZone;
    let p = Pair::new();
    let at = |tz: chrono_tz::Tz, y, mo, d, h| {
        tz.with_ymd_and_hms(y, mo, d, h, 0, 0)
            .earliest()
            .expect("a local time")
            .timestamp_micros()
    };
    let utc = chrono_tz::UTC;
    let ny: chrono_tz::Tz = "America/New_York".parse().unwrap();
    let paris: chrono_tz::Tz = "Europe/Paris".parse().unwrap();
    // (zone, period, a boundary to straddle)
    let cases = [
        (utc, Period::Day, at(utc, 2026, 11, 27, 0)),
        (paris, Period::Month, at(paris, 2026, 3, 1, 0)), // after 28 days
        (paris, Period::Month, at(paris, 2028, 3, 1, 0)), // after 29
        (paris, Period::Month, at(paris, 2026, 5, 1, 0)), // after 30
        (paris, Period::Month, at(paris, 2027, 1, 1, 0)), // after 31, a year's end
        (ny, Period::Day, at(ny, 2026, 3, 9, 0)),         // after a 23-hour day
        (ny, Period::Day, at(ny, 2026, 11, 2, 0)),        // after a 25-hour day
        (ny, Period::Hour, at(ny, 2026, 3, 8, 1) + 3_600 * S), // 01:00 EST -> 03:00 EDT
        (utc, Period::Week, at(utc, 2026, 11, 30, 0)),    // Sunday -> Monday
    ];
    let limit = 3;
    for (n, (tz, period, boundary)) in cases.into_iter().enumerate() {
        // 5 requests a microsecond apart ending on the period's last
        // microsecond, then 5 from its first: 3 and 3.
        let mut admitted = [0, 0];
        for i in 0..10i64 {
            let now = if i < 5 {
                boundary - 5 + i
            } else {
                boundary + (i - 5)
            };
            p.clock.set(now);
            let span = calendar::span(period, tz, now);
            let alg = Algorithm::Calendar {
                limit,
                period,
                start: span.start,
                end: span.end,
            };
            let c = [check(
                Tier::Quota,
                period.as_str(),
                alg,
                &format!("k:case{n}"),
            )];
            let d = p.decide(&c).await;
            if d[0].allowed {
                admitted[(i >= 5) as usize] += 1;
            } else {
                // Refused until the period ends: exactly then.
                assert_eq!(d[0].retry_after_us as i64, span.end - now, "case {n}");
            }
        }
        assert_eq!(admitted, [3, 3], "case {n}: {tz} {period:?} at {boundary}");
    }
    // The period's state reads back through /limits's arithmetic too.
    let now = p.now();
    let span = calendar::span(Period::Day, utc, now);
    let alg = Algorithm::Calendar {
        limit: 5,
        period: Period::Day,
        start: span.start,
        end: span.end,
    };
    let c = [check(Tier::Quota, "day", alg, "k:inspect")];
    p.decide(&c).await;
    p.decide(&c).await;
    let (redis, _) = p.redis.peek(&c).await.expect("peek");
    assert_eq!(redis[0].remaining, 3);
    assert_eq!(redis[0].reset_after_us as i64, span.end - now);
}

/// A quota's debt (admitted on the fallback) is charged by `charge.lua`
/// as `outage::charge` computes it, and both backends decide the same
/// afterwards; a debt of a period whose count has gone adds nothing.
#[tokio::test]
async fn charged_quota_debts_agree() {
    use ratelimit_gateway::calendar::Period;
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0x9a07a);
    for round in 0..20 {
        let start = p.now() - rng.i64(0..5 * S);
        let alg = Algorithm::Calendar {
            limit: rng.u64(5..30),
            period: Period::Hour,
            start,
            end: start + 10 * S,
        };
        let c = [check(Tier::Quota, "hour", alg, &format!("k:q{round}"))];
        for _ in 0..rng.usize(0..8) {
            p.decide(&c).await;
        }
        let mut debt = None;
        for _ in 0..rng.usize(1..10) {
            outage::record(&alg, &mut debt, p.now(), 1);
        }
        let debts = vec![(c[0].clone(), debt.expect("recorded"))];
        let local = p.local.charge_at(&debts, p.now());
        let redis = p.redis.charge(&debts, "r1").await.expect("charge.lua");
        assert_eq!((local, redis), (1, 1), "round {round}");
        for _ in 0..(alg.quota() + 2) {
            p.decide(&c).await;
        }
        p.clock.advance(S);
    }
    // Long after its period (past the minute its count is kept): nothing.
    let now = p.now();
    let alg = Algorithm::Calendar {
        limit: 5,
        period: Period::Minute,
        start: now - 200 * S,
        end: now - 120 * S,
    };
    let c = check(Tier::Quota, "minute", alg, "k:late");
    let mut debt = None;
    outage::record(&alg, &mut debt, now - 130 * S, 1);
    let debts = vec![(c, debt.unwrap())];
    assert_eq!(p.local.charge_at(&debts, now), 0);
    assert_eq!(p.redis.charge(&debts, "r1").await.expect("charge.lua"), 0);
}

/// Settlements of charged answers (`charge`): random admissions, then debts
/// (owed at now) and refunds (given back in the window each admission
/// counted in, some after that window has become the previous one), on
/// both backends: `LocalBackend::settle_at` (`algorithms::owe`, `unowe`)
/// and `RedisBackend::settle` (`charge.lua`, signed counts) leave buckets
/// that decide alike, over every algorithm a charged limit may use.
#[tokio::test]
async fn settlements_agree() {
    let p = Pair::new();
    let mut rng = fastrand::Rng::with_seed(0x5e771e);
    let (mut debts, mut refunds) = (0, 0);
    for round in 0..60 {
        let which = [0, 1, 2, 3][round % 4];
        let alg = random_algorithm(&mut rng, which, 40, 3);
        let c = check(Tier::Route, &format!("s{round}"), alg, "global");
        for _ in 0..rng.usize(1..12) {
            p.clock.advance(rng.i64(0..300_000));
            let mut r = [c.clone()];
            r[0].cost = random_cost(&mut rng, &alg);
            let at = p.now();
            let d = p.decide(&r).await;
            if !d[0].allowed {
                continue;
            }
            // The answer: cost more (a debt) or less (a refund of at most
            // what was taken), settled a while later.
            p.clock.advance(rng.i64(0..1_500_000));
            let delta = match rng.bool() {
                true => rng.i64(1..=20),
                false => -(rng.i64(1..=r[0].cost as i64)),
            };
            if delta > 0 {
                debts += 1;
            } else {
                refunds += 1;
            }
            p.local.settle_at(&c, delta, at, p.now());
            p.redis
                .settle(&[(c.clone(), delta, at)], "r1", None)
                .await
                .expect("charge.lua");
            p.decide(std::slice::from_ref(&c)).await;
        }
    }
    assert!(
        debts > 50 && refunds > 50,
        "debts {debts}, refunds {refunds}"
    );
}

/// A batch of settlements sent again under its marker (its first call ran
/// and its answer was lost: `RedisBackend::settle_marker`) is settled once;
/// under another marker, it is settled again. Checked against the local
/// backend settling each once: both then decide alike.
#[tokio::test]
async fn a_settlement_sent_again_under_its_marker_is_settled_once() {
    let p = Pair::new();
    let alg = Algorithm::FixedWindow {
        limit: 100,
        window_secs: 3600,
    };
    let mut c = check(Tier::Route, "marked", alg, "global");
    c.cost = 50;
    let at = p.now();
    assert!(p.decide(std::slice::from_ref(&c)).await[0].allowed);
    let owed = [(c.clone(), 30, at)];
    for marker in ["ct:settled:1", "ct:settled:1", "ct:settled:1"] {
        p.redis
            .settle(&owed, "r1", Some(marker))
            .await
            .expect("charge.lua");
    }
    p.local.settle_at(&c, 30, at, p.now());
    c.cost = 1;
    let d = p.decide(std::slice::from_ref(&c)).await;
    assert_eq!(d[0].remaining, 100 - 50 - 30 - 1, "settled once: {d:?}");
    let refund = [(c.clone(), -20, at)];
    for marker in ["ct:settled:2", "ct:settled:2"] {
        p.redis
            .settle(&refund, "r1", Some(marker))
            .await
            .expect("charge.lua");
    }
    p.local.settle_at(&c, -20, at, p.now());
    let d = p.decide(std::slice::from_ref(&c)).await;
    assert_eq!(d[0].remaining, 100 - 50 - 30 - 1 + 20 - 1, "{d:?}");
}
