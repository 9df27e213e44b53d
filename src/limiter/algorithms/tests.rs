//! The algorithms on a fake clock: worked scenarios, then properties over
//! random parameters and request times. Every assert prints the clock.

use proptest::prelude::*;

use super::*;
use crate::config::Algorithm;

const S: i64 = 1_000_000;
/// An arbitrary epoch-aligned start, far from zero like real time.
const T0: i64 = 1_700_000_000 * S;

/// A bucket under test: state plus the algorithm.
struct Bucket {
    alg: Algorithm,
    state: Option<State>,
}

impl Bucket {
    fn new(alg: Algorithm) -> Self {
        Bucket { alg, state: None }
    }
    /// One request at `now`: decide and, if admitted, commit.
    fn hit(&mut self, now: i64) -> Decision {
        let e = check(&self.alg, self.state.as_ref(), now, 1);
        if e.decision.allowed {
            commit(&mut self.state, &e.update);
        }
        e.decision
    }
    fn peek(&self, now: i64) -> Decision {
        check(&self.alg, self.state.as_ref(), now, 1).decision
    }
}

fn tb(capacity: u64, rate: f64) -> Algorithm {
    Algorithm::TokenBucket {
        capacity,
        refill_per_sec: rate,
    }
}

#[test]
fn token_bucket_bursts_to_capacity_then_refills_at_rate() {
    let mut b = Bucket::new(tb(20, 10.0));
    for i in 0..20 {
        let d = b.hit(T0);
        assert!(d.allowed, "request {i} at t0");
        assert_eq!(d.remaining, 19 - i, "remaining after request {i} at t0");
    }
    let d = b.hit(T0);
    assert!(!d.allowed, "21st request at t0");
    assert_eq!(d.retry_after_us, 100_000, "one token every 100 ms");
    assert!(!b.hit(T0 + 99_999).allowed, "at t0+99.999ms");
    assert!(b.hit(T0 + 100_000).allowed, "at t0+100ms");
    // Idle for the full refill: the bucket is whole again, and not more.
    let later = T0 + 10 * S;
    for i in 0..20 {
        assert!(b.hit(later).allowed, "request {i} at t0+10s");
    }
    assert!(!b.hit(later).allowed, "21st at t0+10s");
}

#[test]
fn token_bucket_reports_time_until_full() {
    let mut b = Bucket::new(tb(10, 5.0));
    let d = b.hit(T0);
    assert_eq!(
        d.reset_after_us, 200_000,
        "one token spent refills in 200 ms"
    );
    assert_eq!(d.limit, 10);
}

#[test]
fn leaky_bucket_delays_to_a_constant_rate_then_rejects() {
    let alg = Algorithm::LeakyBucket {
        rate_per_sec: 10.0,
        max_delay_ms: 250,
    };
    let mut b = Bucket::new(alg);
    let delays: Vec<u64> = (0..3).map(|_| b.hit(T0).delay_us).collect();
    assert_eq!(
        delays,
        vec![0, 100_000, 200_000],
        "slots 100 ms apart at t0"
    );
    let d = b.hit(T0);
    assert!(!d.allowed, "a 300 ms wait exceeds max_delay_ms = 250");
    assert_eq!(
        d.retry_after_us, 50_000,
        "at t0+50ms the wait is back to 250 ms"
    );
    let d = b.hit(T0 + 50_000);
    assert!(d.allowed, "at t0+50ms");
    assert_eq!(
        d.delay_us, 250_000,
        "at t0+50ms it waits for the slot at t0+300ms"
    );
    assert_eq!(d.limit, 3, "burst = floor(250/100) + 1");
}

#[test]
fn fixed_window_counts_per_aligned_window() {
    let alg = Algorithm::FixedWindow {
        limit: 3,
        window_secs: 60,
    };
    let mut b = Bucket::new(alg);
    let start = (T0 / (60 * S)) * 60 * S; // a window boundary
    for i in 0..3 {
        assert!(b.hit(start + 59 * S).allowed, "request {i} at second 59");
    }
    let d = b.hit(start + 59 * S);
    assert!(!d.allowed);
    assert_eq!(d.retry_after_us, S as u64, "the window ends a second later");
    assert!(b.hit(start + 60 * S).allowed, "a new window at second 60");
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let alg = Algorithm::SlidingWindow {
        limit: 10,
        window_secs: 10,
    };
    let mut b = Bucket::new(alg);
    let start = (T0 / (10 * S)) * 10 * S;
    for i in 0..10 {
        assert!(b.hit(start + i * S / 2).allowed, "request {i} in window 0");
    }
    // At the start of window 1 the previous window still weighs 10 * 1.0.
    let d = b.hit(start + 10 * S);
    assert!(!d.allowed, "at window 1 start");
    assert_eq!(
        d.retry_after_us, S as u64,
        "10 * (1 - f) + 1 <= 10 once f >= 0.1"
    );
    assert!(b.hit(start + 11 * S).allowed, "at 11 s");
    assert!(
        !b.hit(start + 11 * S).allowed,
        "estimate 9 + 1 + 1 > 10 at 11 s"
    );
}

#[test]
fn sliding_log_is_exact() {
    let alg = Algorithm::SlidingLog {
        limit: 3,
        window_secs: 10,
    };
    let mut b = Bucket::new(alg);
    for t in [0, S, 2 * S] {
        assert!(b.hit(T0 + t).allowed, "at +{t}us");
    }
    let d = b.hit(T0 + 5 * S);
    assert!(!d.allowed);
    assert_eq!(
        d.retry_after_us,
        5 * S as u64,
        "the first entry expires at +10 s"
    );
    assert!(!b.hit(T0 + 10 * S - 1).allowed, "one microsecond before");
    assert!(b.hit(T0 + 10 * S).allowed, "at +10 s");
    assert!(
        !b.hit(T0 + 10 * S).allowed,
        "still three in the window at +10 s"
    );
}

#[test]
fn a_clock_stepping_back_never_mints_quota() {
    for alg in all_algorithms(5, 1.0, 10) {
        let mut b = Bucket::new(alg);
        let now = T0 + 20 * S;
        let drained = (0..100).take_while(|_| b.hit(now).allowed).count();
        assert!(drained < 100, "{alg}: drained at {now}");
        for back in 1..5 {
            let earlier = now - back * S;
            assert!(
                !b.hit(earlier).allowed,
                "{alg}: admitted at {earlier} after draining at {now}"
            );
        }
    }
}

fn all_algorithms(limit: u64, rate: f64, window_secs: u64) -> Vec<Algorithm> {
    vec![
        tb(limit, rate),
        Algorithm::LeakyBucket {
            rate_per_sec: rate,
            max_delay_ms: 1000,
        },
        Algorithm::FixedWindow { limit, window_secs },
        Algorithm::SlidingWindow { limit, window_secs },
        Algorithm::SlidingLog { limit, window_secs },
    ]
}

fn arb_algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        (1u64..50, 0.1f64..500.0).prop_map(|(c, r)| tb(c, r)),
        (0.1f64..500.0, 0u64..3000).prop_map(|(r, d)| Algorithm::LeakyBucket {
            rate_per_sec: r,
            max_delay_ms: d
        }),
        (1u64..50, 1u64..120)
            .prop_map(|(limit, window_secs)| Algorithm::FixedWindow { limit, window_secs }),
        (1u64..50, 1u64..120)
            .prop_map(|(limit, window_secs)| Algorithm::SlidingWindow { limit, window_secs }),
        (1u64..50, 1u64..120)
            .prop_map(|(limit, window_secs)| Algorithm::SlidingLog { limit, window_secs }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// An admitted request leaves fewer than `limit` remaining, whatever the
    /// rate: up to ten billion a second, far below the quarter-microsecond
    /// grid of a double holding epoch microseconds.
    #[test]
    fn remaining_stays_below_the_limit(cap in 1u64..2_000_000_000, exp in -1.0f64..10.0, delay in 0u64..5000, gaps in prop::collection::vec(0i64..1000, 1..20)) {
        let rate = 10f64.powf(exp);
        for alg in [tb(cap, rate), Algorithm::LeakyBucket { rate_per_sec: rate, max_delay_ms: delay }] {
            let mut b = Bucket::new(alg);
            let mut now = T0;
            for gap in &gaps {
                now += gap;
                let d = b.hit(now);
                prop_assert!(!d.allowed || d.remaining < d.limit, "{alg} at {now}: remaining {} of {}", d.remaining, d.limit);
            }
        }
    }

    /// The reported retry time is exact: rejected one microsecond before it,
    /// admitted at it.
    #[test]
    fn retry_time_is_exact(alg in arb_algorithm(), gaps in prop::collection::vec(0i64..300_000, 1..120)) {
        let mut b = Bucket::new(alg);
        let mut now = T0;
        for gap in gaps {
            now += gap;
            let d = b.hit(now);
            if !d.allowed {
                let at = now + d.retry_after_us as i64;
                prop_assert!(d.retry_after_us > 0, "{alg} at {now}: rejected with no wait");
                prop_assert!(!b.peek(at - 1).allowed, "{alg}: rejected at {now}, retry {at}, but admitted at {}", at - 1);
                prop_assert!(b.peek(at).allowed, "{alg}: rejected at {now}, but still rejected at the retry time {at}");
            }
        }
    }

    /// A token bucket never admits more than capacity + rate x elapsed.
    #[test]
    fn token_bucket_never_exceeds_its_bound(cap in 1u64..40, rate in 0.5f64..200.0, gaps in prop::collection::vec(0i64..50_000, 1..300)) {
        let mut b = Bucket::new(tb(cap, rate));
        let mut now = T0;
        let mut admitted = 0u64;
        for gap in gaps {
            now += gap;
            admitted += u64::from(b.hit(now).allowed);
            let bound = cap as f64 + rate * (now - T0) as f64 / 1e6;
            prop_assert!(admitted as f64 <= bound + 1e-6, "at {now}: {admitted} admitted > bound {bound}");
        }
    }

    /// Remaining never exceeds the limit and is zero on rejection.
    #[test]
    fn remaining_is_sane(alg in arb_algorithm(), gaps in prop::collection::vec(0i64..100_000, 1..60)) {
        let mut b = Bucket::new(alg);
        let mut now = T0;
        for gap in gaps {
            now += gap;
            let d = b.hit(now);
            prop_assert!(d.remaining < d.limit.max(1), "{alg} at {now}: remaining {} limit {}", d.remaining, d.limit);
            if !d.allowed {
                prop_assert_eq!(d.remaining, 0);
            }
        }
    }

    /// A request costing n is n requests at one instant: admitted iff all n
    /// would be, leaving the state they would, and saying the same remaining.
    /// GCRA moves TAT by nT in one addition where n requests add T n times,
    /// so there the two may differ by rounding: TAT by under a microsecond,
    /// and the decision only at a microsecond's distance from the boundary.
    #[test]
    fn cost_n_is_n_requests_at_once(alg in arb_algorithm(), steps in prop::collection::vec((0i64..300_000, 1u64..6), 1..80)) {
        let gcra = matches!(alg, Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. });
        let mut b = Bucket::new(alg);
        let mut now = T0;
        for (gap, n) in steps {
            now += gap;
            let n = n.min(quota(&alg));
            let e = check(&alg, b.state.as_ref(), now, n);
            // The n unit requests, on a copy: all admitted, or none counts.
            let mut copy = Bucket { alg, state: b.state.clone() };
            let units: Vec<Decision> = (0..n).map(|_| copy.hit(now)).collect();
            let all = units.iter().all(|d| d.allowed);
            if e.decision.allowed != all {
                // Whichever rejected was a microsecond from admitting.
                let at_boundary = if e.decision.allowed {
                    units.iter().all(|d| d.allowed || d.retry_after_us <= 1)
                } else {
                    e.decision.retry_after_us <= 1
                };
                prop_assert!(gcra && at_boundary, "{} at {}: cost {} admitted {} but units {:?}", alg, now, n, e.decision.allowed, units);
                continue;
            }
            if all {
                commit(&mut b.state, &e.update);
                match (&b.state, &copy.state) {
                    (Some(State::Gcra { tat: a }), Some(State::Gcra { tat: u })) => {
                        prop_assert!((a - u).abs() < 1.0, "{} at {}: cost {}: tat {} vs {}", alg, now, n, a, u);
                    }
                    (one, units) => prop_assert_eq!(one, units, "{} at {}: cost {}", alg, now, n),
                }
                let (r, u) = (e.decision.remaining, units[units.len() - 1].remaining);
                prop_assert!(r == u || (gcra && r.abs_diff(u) <= 1), "{} at {}: cost {}: remaining {} vs {}", alg, now, n, r, u);
            } else {
                // Exact retry: rejected a microsecond before, admitted at it.
                let at = now + e.decision.retry_after_us as i64;
                prop_assert!(!check(&alg, b.state.as_ref(), at - 1, n).decision.allowed, "{} cost {}: rejected at {}, admitted at {}", alg, n, now, at - 1);
                prop_assert!(check(&alg, b.state.as_ref(), at, n).decision.allowed, "{} cost {}: rejected at {}, still at its retry time {}", alg, n, now, at);
            }
        }
    }
}

/// A refund is the admission undone: for every algorithm, a bucket that
/// admitted a request and gave it back decides the next request exactly
/// as if it had never come; a window's refund after its window moved on,
/// or a quota's of another period, gives nothing back.
#[test]
fn a_refund_undoes_one_admission() {
    let quota = Algorithm::Calendar {
        limit: 3,
        period: crate::calendar::Period::Hour,
        start: T0,
        end: T0 + 3600 * S,
    };
    let algs = [
        tb(3, 1.0),
        Algorithm::LeakyBucket {
            rate_per_sec: 1.0,
            max_delay_ms: 2000,
        },
        Algorithm::FixedWindow {
            limit: 3,
            window_secs: 60,
        },
        Algorithm::SlidingWindow {
            limit: 3,
            window_secs: 60,
        },
        Algorithm::SlidingLog {
            limit: 3,
            window_secs: 60,
        },
        quota,
    ];
    for alg in algs {
        let mut with = Bucket::new(alg);
        let mut without = Bucket::new(alg);
        with.hit(T0);
        without.hit(T0);
        let refunded = with.hit(T0 + 1);
        assert!(refunded.allowed, "{alg:?}");
        assert!(refund(&alg, &mut with.state, T0 + 1, 1), "{alg:?}");
        for t in [T0 + 2, T0 + 3, T0 + 4, T0 + 5] {
            assert_eq!(with.hit(t), without.hit(t), "{alg:?} at {t}");
        }
    }
    // Windows: not once their window has gone.
    for alg in [algs[2], algs[3]] {
        let mut b = Bucket::new(alg);
        b.hit(T0);
        b.hit(T0 + 61 * S);
        assert!(!refund(&alg, &mut b.state, T0, 1), "{alg:?}");
    }
    let mut b = Bucket::new(quota);
    b.hit(T0);
    let next = Algorithm::Calendar {
        limit: 3,
        period: crate::calendar::Period::Hour,
        start: T0 + 3600 * S,
        end: T0 + 7200 * S,
    };
    assert!(!refund(&next, &mut b.state, T0, 1), "another period's");
    assert!(!refund(&quota, &mut None, T0, 1), "an empty bucket");
}
