//! The five algorithms as pure functions of (parameters, state, now).
//!
//! Each algorithm is split in two steps so several tiers can be decided all or
//! nothing: `check` reads the state and says what would happen, `commit` writes
//! the update only once every tier has admitted. Time is microseconds since the
//! Unix epoch, handed in by the caller; nothing here reads a clock.
//!
//! `limiter.lua` implements the same arithmetic, operation for operation, in
//! IEEE doubles, so both backends reach the same decisions (the conformance
//! suite in `tests/integration/limiter_conformance.rs` holds them to it).

pub(crate) mod calendar;
mod fixed_window;
mod gcra;
mod inspect;
pub mod lease;
pub mod outage;
mod sliding_log;
mod sliding_window;
pub mod standing;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use crate::config::Algorithm;

pub use inspect::{inspect, Snapshot};

pub use crate::clock::Micros;

/// What a backend keeps per bucket.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    /// Token and leaky bucket: the theoretical arrival time of the next request.
    Gcra {
        tat: f64,
    },
    Window {
        window: i64,
        count: u64,
    },
    Sliding {
        window: i64,
        prev: u64,
        cur: u64,
    },
    /// Admission times, oldest first.
    Log(VecDeque<Micros>),
}

/// One tier's verdict, as the client will be told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The quota a client sees (capacity, limit, or the leaky bucket's burst).
    pub limit: u64,
    pub remaining: u64,
    /// When rejected: how long until the same request would be admitted.
    pub retry_after_us: u64,
    /// When the quota is whole again (admitted) or the retry time (rejected).
    pub reset_after_us: u64,
    /// Leaky bucket: how long the admitted request waits for its slot.
    pub delay_us: u64,
}

impl Decision {
    /// This admission given back (a refund): the bucket holds `cost` more
    /// than the decision said, and a GCRA bucket (whose refund moves its TAT
    /// back, `refund.lua`) is whole again that much sooner.
    pub fn refunded(mut self, cost: u64, algorithm: &Algorithm) -> Self {
        self.remaining = (self.remaining + cost).min(self.limit);
        if let Some(t) = gcra_interval(algorithm) {
            self.reset_after_us = self.reset_after_us.saturating_sub((cost as f64 * t) as u64);
        }
        self
    }
}

/// A rule's GCRA emission interval (us per request): token and leaky
/// buckets; none for the counting rules.
pub(crate) fn gcra_interval(alg: &Algorithm) -> Option<f64> {
    match *alg {
        Algorithm::TokenBucket { refill_per_sec, .. } => Some(1e6 / refill_per_sec),
        Algorithm::LeakyBucket { rate_per_sec, .. } => Some(1e6 / rate_per_sec),
        _ => None,
    }
}

/// The state change a `check` prepared, applied by `commit` if all tiers admit.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    Gcra {
        tat: f64,
    },
    Window {
        window: i64,
        count: u64,
    },
    Sliding {
        window: i64,
        prev: u64,
        cur: u64,
    },
    /// `n` entries at `at` (the request's cost).
    LogPush {
        at: Micros,
        window_us: Micros,
        n: u64,
    },
    None,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    pub decision: Decision,
    pub update: Update,
    /// How long the state must be kept to remember this decision (until full).
    pub ttl_us: u64,
}

impl Evaluation {
    /// An admission of a counting rule: `remaining` left, whole again after
    /// `reset_us`, `update` to commit, kept `ttl_us`.
    fn admitted(limit: u64, remaining: u64, reset_us: u64, update: Update, ttl_us: u64) -> Self {
        Evaluation {
            decision: Decision {
                allowed: true,
                limit,
                remaining,
                retry_after_us: 0,
                reset_after_us: reset_us,
                delay_us: 0,
            },
            update,
            ttl_us,
        }
    }

    /// A rejection: nothing to commit, retry (and reset) after `retry_us`.
    fn rejected(limit: u64, retry_us: u64, ttl_us: u64) -> Self {
        Evaluation {
            decision: Decision {
                allowed: false,
                limit,
                remaining: 0,
                retry_after_us: retry_us,
                reset_after_us: retry_us,
                delay_us: 0,
            },
            update: Update::None,
            ttl_us,
        }
    }
}

/// The quota a client is shown for a rule (`Algorithm::quota`).
pub fn quota(alg: &Algorithm) -> u64 {
    alg.quota()
}

/// Decides one request costing `cost` tokens (at least 1, at most the rule's
/// `quota`) against one bucket without changing it. `remaining` counts
/// tokens: after an admitted request, what is left; on a rejection, what the
/// bucket holds now, fewer than the request's cost (what `/limits` says).
pub fn check(alg: &Algorithm, state: Option<&State>, now: Micros, cost: u64) -> Evaluation {
    let mut e = decide(alg, state, now, cost);
    if !e.decision.allowed && cost > 1 {
        let one = decide(alg, state, now, 1).decision;
        if one.allowed {
            e.decision.remaining = one.remaining + 1;
        }
    }
    e
}

fn decide(alg: &Algorithm, state: Option<&State>, now: Micros, cost: u64) -> Evaluation {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => gcra::token_bucket(capacity, refill_per_sec, gcra_tat(state), now, cost),
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => gcra::leaky_bucket(rate_per_sec, max_delay_ms, gcra_tat(state), now, cost),
        Algorithm::FixedWindow { limit, window_secs } => {
            let s = match state {
                Some(State::Window { window, count }) => Some((*window, *count)),
                _ => None,
            };
            fixed_window::check(limit, window_secs, s, now, cost)
        }
        Algorithm::SlidingWindow { limit, window_secs } => {
            let s = match state {
                Some(State::Sliding { window, prev, cur }) => Some((*window, *prev, *cur)),
                _ => None,
            };
            sliding_window::check(limit, window_secs, s, now, cost)
        }
        Algorithm::Calendar {
            limit, start, end, ..
        } => {
            let s = match state {
                Some(State::Window { window, count }) => Some((*window, *count)),
                _ => None,
            };
            calendar::check(limit, start, end, s, now, cost)
        }
        Algorithm::SlidingLog { limit, window_secs } => {
            let empty = VecDeque::new();
            let log = match state {
                Some(State::Log(l)) => l,
                _ => &empty,
            };
            sliding_log::check(limit, window_secs, log, now, cost)
        }
    }
}

fn gcra_tat(state: Option<&State>) -> Option<f64> {
    match state {
        Some(State::Gcra { tat }) => Some(*tat),
        _ => None,
    }
}

/// Applies an admitted request's update to the bucket.
pub fn commit(state: &mut Option<State>, update: &Update) {
    match update {
        Update::Gcra { tat } => *state = Some(State::Gcra { tat: *tat }),
        Update::Window { window, count } => {
            *state = Some(State::Window {
                window: *window,
                count: *count,
            })
        }
        Update::Sliding { window, prev, cur } => {
            *state = Some(State::Sliding {
                window: *window,
                prev: *prev,
                cur: *cur,
            })
        }
        Update::LogPush { at, window_us, n } => {
            if !matches!(state, Some(State::Log(_))) {
                *state = Some(State::Log(VecDeque::new()));
            }
            if let Some(State::Log(log)) = state {
                for _ in 0..*n {
                    sliding_log::push(log, *at, *window_us);
                }
            }
        }
        Update::None => {}
    }
}

/// The window of `w` microseconds that `now` falls in, never before the
/// stored one: time never moves a bucket backwards (a stale clock stays in
/// the newer window). `limiter.lua`'s `window_index`.
/// Gives back one admission of `cost` decided at `at` (a request admitted
/// and then refused or dropped before it reached the upstream): what
/// `refund.lua` does in Redis. A token or leaky bucket's TAT moves back; a
/// window's count is taken back only in the window it counted in (a
/// quota's: its period), and only from a count that holds it; a log loses
/// entries stamped `at`. Returns whether anything was given back.
pub fn refund(alg: &Algorithm, state: &mut Option<State>, at: Micros, cost: u64) -> bool {
    let Some(s) = state.as_mut() else {
        return false;
    };
    match (*alg, s) {
        (Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. }, State::Gcra { tat }) => {
            *tat -= cost as f64 * gcra_interval(alg).unwrap_or(0.0);
            true
        }
        (Algorithm::FixedWindow { window_secs, .. }, State::Window { window, count })
            if *window == at.div_euclid(window_secs as i64 * 1_000_000) && *count >= cost =>
        {
            *count -= cost;
            true
        }
        (Algorithm::Calendar { end, .. }, State::Window { window, count })
            if *window == end && *count >= cost =>
        {
            *count -= cost;
            true
        }
        (Algorithm::SlidingWindow { window_secs, .. }, State::Sliding { window, cur, .. })
            if *window == at.div_euclid(window_secs as i64 * 1_000_000) && *cur >= cost =>
        {
            *cur -= cost;
            true
        }
        (Algorithm::SlidingLog { .. }, State::Log(log)) => {
            let before = log.len();
            let mut left = cost;
            log.retain(|&t| {
                let drop = t == at && left > 0;
                left -= drop as u64;
                !drop
            });
            log.len() < before
        }
        _ => false,
    }
}

/// Charges `n` more tokens at `now` to an admission whose answer cost
/// more than it was admitted on (`charge`): the bucket may go below empty,
/// so its client waits longer. A token or leaky bucket's TAT moves on by
/// `n` intervals from now or later; a window's (a quota's period's) count
/// of `now` grows; a log is never charged by the answer (the config
/// refuses it). What `charge.lua` does with a debt of `n` admissions at
/// `now`.
pub fn owe(alg: &Algorithm, state: &mut Option<State>, now: Micros, n: u64) {
    let stored = match state {
        Some(State::Window { window, .. }) | Some(State::Sliding { window, .. }) => Some(*window),
        _ => None,
    };
    match *alg {
        Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. } => {
            let t = gcra_interval(alg).unwrap_or(0.0);
            let from = match state {
                Some(State::Gcra { tat }) => tat.max(now as f64),
                _ => now as f64,
            };
            *state = Some(State::Gcra {
                tat: from + n as f64 * t,
            });
        }
        Algorithm::FixedWindow { window_secs, .. } => {
            let i = window_index(now, window_secs as i64 * 1_000_000, stored);
            add_to_window(state, i, n);
        }
        Algorithm::Calendar { end, .. } if now < end => add_to_window(state, end, n),
        Algorithm::SlidingWindow { window_secs, .. } => {
            let i = window_index(now, window_secs as i64 * 1_000_000, stored);
            *state = Some(match state.take() {
                Some(State::Sliding { window, prev, cur }) if window == i => State::Sliding {
                    window,
                    prev,
                    cur: cur + n,
                },
                Some(State::Sliding { window, cur, .. }) if window == i - 1 => State::Sliding {
                    window: i,
                    prev: cur,
                    cur: n,
                },
                _ => State::Sliding {
                    window: i,
                    prev: 0,
                    cur: n,
                },
            });
        }
        _ => {}
    }
}

/// Gives back `n` tokens of an admission made at `at` whose answer cost
/// less than its estimate (`charge`), at `now`: what `charge.lua` does with
/// a negative count. A token or leaky bucket's TAT moves back, never past
/// full; a window's count (a quota's period's) drops in the window it
/// counted in, a sliding window's also once that window is the previous
/// one; never below zero.
pub fn unowe(alg: &Algorithm, state: &mut Option<State>, at: Micros, now: Micros, n: u64) {
    let Some(s) = state.as_mut() else {
        return;
    };
    match (*alg, s) {
        (Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. }, State::Gcra { tat })
            if *tat > now as f64 =>
        {
            let t = gcra_interval(alg).unwrap_or(0.0);
            *tat = (*tat - n as f64 * t).max(now as f64);
        }
        (Algorithm::FixedWindow { window_secs, .. }, State::Window { window, count }) => {
            let w = window_secs as i64 * 1_000_000;
            if *window == at.div_euclid(w) && *window == window_index(now, w, Some(*window)) {
                *count = count.saturating_sub(n);
            }
        }
        (Algorithm::Calendar { end, .. }, State::Window { window, count }) if *window == end => {
            *count = count.saturating_sub(n);
        }
        (Algorithm::SlidingWindow { window_secs, .. }, State::Sliding { window, prev, cur }) => {
            let w = window_secs as i64 * 1_000_000;
            let i = window_index(now, w, Some(*window));
            // Rolled to the window of now first, as the script reads it.
            let (p, c) = match i - *window {
                0 => (*prev, *cur),
                1 => (*cur, 0),
                _ => (0, 0),
            };
            let j = at.div_euclid(w);
            let (p, c) = match i - j {
                0 => (p, c.saturating_sub(n)),
                1 => (p.saturating_sub(n), c),
                _ => return,
            };
            (*window, *prev, *cur) = (i, p, c);
        }
        _ => {}
    }
}

fn add_to_window(state: &mut Option<State>, i: i64, n: u64) {
    match state {
        Some(State::Window { window, count }) if *window == i => *count += n,
        _ => {
            *state = Some(State::Window {
                window: i,
                count: n,
            })
        }
    }
}

pub(crate) fn window_index(now: Micros, w: i64, stored: Option<i64>) -> i64 {
    let n = now.div_euclid(w);
    stored.map_or(n, |s| n.max(s))
}

/// Rounds a non-negative microsecond span up to whole microseconds.
pub(crate) fn ceil_us(x: f64) -> u64 {
    if x <= 0.0 {
        0
    } else {
        x.ceil() as u64
    }
}
