//! What a bucket holds now, read without spending: what `/limits` and
//! `gateway limits show` report.

use super::{ceil_us, check, Micros, State};
use crate::config::Algorithm;

/// A bucket as an operator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// The quota (capacity, limit, or the leaky bucket's burst).
    pub limit: u64,
    /// Tokens a request could take now: one more than a request's own
    /// `remaining` header would say after it, 0 when one would be refused.
    pub remaining: u64,
    /// Until the bucket is whole again (0: it is).
    pub reset_after_us: u64,
}

pub fn inspect(alg: &Algorithm, state: Option<&State>, now: Micros) -> Snapshot {
    // The decision a request of cost 1 would get: the same arithmetic as the
    // request path, so the two never disagree on what is left.
    let d = check(alg, state, now, 1).decision;
    let remaining = if d.allowed { d.remaining + 1 } else { 0 };
    Snapshot {
        limit: d.limit,
        remaining,
        reset_after_us: until_whole(alg, state, now),
    }
}

fn until_whole(alg: &Algorithm, state: Option<&State>, now: Micros) -> u64 {
    let w = |secs: u64| secs as i64 * 1_000_000;
    match (*alg, state) {
        (
            Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. },
            Some(State::Gcra { tat }),
        ) => ceil_us(tat - now as f64),
        (Algorithm::FixedWindow { window_secs, .. }, Some(State::Window { window, count })) => {
            let w = w(window_secs);
            if *count > 0 && *window >= now.div_euclid(w) {
                ((window + 1) * w - now).max(0) as u64
            } else {
                0
            }
        }
        (
            Algorithm::SlidingWindow { window_secs, .. },
            Some(State::Sliding { window, prev, cur }),
        ) => {
            // The current count stops weighing one window after its own ends.
            let w = w(window_secs);
            let end = if *cur > 0 {
                (window + 2) * w
            } else if *prev > 0 {
                (window + 1) * w
            } else {
                now
            };
            (end - now).max(0) as u64
        }
        // A quota's period is whole again when the next one starts.
        (Algorithm::Calendar { end, .. }, Some(State::Window { window, count }))
            if *window == end && *count > 0 =>
        {
            (end - now).max(0) as u64
        }
        (Algorithm::SlidingLog { window_secs, .. }, Some(State::Log(log))) => log
            .back()
            .map_or(0, |newest| (newest + w(window_secs) - now).max(0) as u64),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::algorithms::commit;

    const T0: i64 = 1_700_000_000_000_000;

    /// After k of n requests, inspect says n - k remain and no request was spent.
    #[test]
    fn reports_what_is_left_without_spending() {
        let algs = [
            Algorithm::TokenBucket {
                capacity: 5,
                refill_per_sec: 1.0,
            },
            Algorithm::LeakyBucket {
                rate_per_sec: 1.0,
                max_delay_ms: 4000,
            },
            Algorithm::FixedWindow {
                limit: 5,
                window_secs: 60,
            },
            Algorithm::SlidingWindow {
                limit: 5,
                window_secs: 60,
            },
            Algorithm::SlidingLog {
                limit: 5,
                window_secs: 60,
            },
        ];
        for alg in algs {
            let mut state = None;
            assert_eq!(
                inspect(&alg, None, T0),
                Snapshot {
                    limit: 5,
                    remaining: 5,
                    reset_after_us: 0
                },
                "{alg}"
            );
            for k in 1..=5u64 {
                let e = check(&alg, state.as_ref(), T0, 1);
                commit(&mut state, &e.update);
                let s = inspect(&alg, state.as_ref(), T0);
                assert_eq!(s.remaining, 5 - k, "{alg}: after {k} at t0");
                assert_eq!(
                    inspect(&alg, state.as_ref(), T0),
                    s,
                    "{alg}: inspecting spent something"
                );
                assert!(s.reset_after_us > 0, "{alg}: after {k}, not yet whole");
            }
        }
    }

    #[test]
    fn reset_is_when_the_bucket_is_whole() {
        let tb = Algorithm::TokenBucket {
            capacity: 5,
            refill_per_sec: 2.0,
        };
        let mut state = None;
        for _ in 0..3 {
            let e = check(&tb, state.as_ref(), T0, 1);
            commit(&mut state, &e.update);
        }
        let s = inspect(&tb, state.as_ref(), T0);
        assert_eq!(s.reset_after_us, 1_500_000, "3 tokens at 2/s");
        assert_eq!(inspect(&tb, state.as_ref(), T0 + 1_500_000).remaining, 5);

        let log = Algorithm::SlidingLog {
            limit: 5,
            window_secs: 10,
        };
        let mut state = None;
        for at in [T0, T0 + 2_000_000] {
            let e = check(&log, state.as_ref(), at, 1);
            commit(&mut state, &e.update);
        }
        let s = inspect(&log, state.as_ref(), T0 + 3_000_000);
        assert_eq!(
            (s.remaining, s.reset_after_us),
            (3, 9_000_000),
            "the newest entry expires at t0+12s"
        );
    }
}
