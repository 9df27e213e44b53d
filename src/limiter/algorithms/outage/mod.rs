//! What a bucket carries across a Redis outage, as pure functions.
//!
//! - `seed`: while Redis decides, each answer says how full the shared bucket
//!   is; turned into the state of this replica's local share, the fallback
//!   starts from what the replica last knew instead of a full bucket.
//! - `Debt`: while the fallback decides, every local admission is recorded
//!   against the *shared* rule; on failback `charge` adds it to the shared
//!   bucket, so a client cannot spend its local shares and then a full shared
//!   bucket on top.
//!
//! `charge.lua` mirrors `charge` operation for operation (the conformance
//! suite holds them equal).

use std::collections::VecDeque;

use super::{ceil_us, gcra_interval, Decision, Micros, State};
use crate::config::Algorithm;

/// Requests a decision says were spent, scaled from the shared `limit` to the
/// local share's `local_limit`, rounded up (the fallback errs on the strict side).
fn scaled_used(d: &Decision, local_limit: u64) -> u64 {
    let used = if d.allowed {
        d.limit.saturating_sub(d.remaining)
    } else {
        d.limit
    };
    if d.limit == 0 {
        return local_limit;
    }
    (used as u128 * local_limit as u128).div_ceil(d.limit as u128) as u64
}

/// The local share's starting state from the shared bucket's last answer `d`
/// (decided under `shared`), for a local share ruled by `local`, at local time
/// `now`. `None`: the answer says nothing was spent. The second value is how
/// long the state matters (its TTL).
///
/// GCRA (token and leaky bucket): the theoretical arrival time carries over
/// unchanged: a share holds 1/n of the capacity refilled at 1/n of the rate,
/// so the time until it is full again is the shared bucket's. Windows: the
/// count spent, scaled to the share, in the current window (a sliding window's
/// weighted count is put in the current window, a log's entries at `now`:
/// both forget it no sooner than the shared bucket would).
pub fn seed(
    shared: &Algorithm,
    local: &Algorithm,
    d: &Decision,
    now: Micros,
) -> Option<(State, u64)> {
    match *shared {
        Algorithm::TokenBucket { capacity, .. } => {
            let t = gcra_interval(shared)?;
            let ahead = if d.allowed {
                d.reset_after_us as f64
            } else {
                d.retry_after_us as f64 + t * (capacity as f64 - 1.0)
            };
            gcra_seed(ahead, now)
        }
        Algorithm::LeakyBucket { max_delay_ms, .. } => {
            let ahead = if d.allowed {
                d.reset_after_us as f64
            } else {
                d.retry_after_us as f64 + max_delay_ms as f64 * 1000.0
            };
            gcra_seed(ahead, now)
        }
        Algorithm::Calendar { end, .. } => {
            let used = scaled_used(d, super::quota(local));
            (used > 0).then(|| {
                let ttl = (end - now).max(0) as u64 + super::calendar::GRACE_US;
                (
                    State::Window {
                        window: end,
                        count: used,
                    },
                    ttl,
                )
            })
        }
        Algorithm::FixedWindow { window_secs, .. }
        | Algorithm::SlidingWindow { window_secs, .. }
        | Algorithm::SlidingLog { window_secs, .. } => {
            let used = scaled_used(d, super::quota(local));
            if used == 0 {
                return None;
            }
            let w = window_secs as i64 * 1_000_000;
            let n = now.div_euclid(w);
            Some(match shared {
                Algorithm::FixedWindow { .. } => (
                    State::Window {
                        window: n,
                        count: used,
                    },
                    ((n + 1) * w - now).max(0) as u64,
                ),
                Algorithm::SlidingWindow { .. } => (
                    State::Sliding {
                        window: n,
                        prev: 0,
                        cur: used,
                    },
                    ((n + 2) * w - now).max(0) as u64,
                ),
                _ => (State::Log((0..used).map(|_| now).collect()), w as u64),
            })
        }
    }
}

fn gcra_seed(ahead_us: f64, now: Micros) -> Option<(State, u64)> {
    (ahead_us > 0.0).then(|| {
        (
            State::Gcra {
                tat: now as f64 + ahead_us,
            },
            ceil_us(ahead_us),
        )
    })
}

/// What one replica admitted locally for one shared bucket during an outage,
/// kept in the shared rule's terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Debt {
    /// `tat`: the GCRA arrival time of these admissions alone (no limit
    /// applied). Replaying them one by one onto a shared TAT `t0` gives
    /// exactly `max(t0 + count * T, tat)`.
    Gcra {
        count: u64,
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
    /// Admission times within the last window, oldest first.
    Log(VecDeque<Micros>),
}

/// The debt of a bucket's first admission on the fallback (none is recorded
/// for it yet): `record`'s, but for a token or leaky bucket replayed from
/// where the local share stood rather than from a full bucket, so that it
/// still holds what the shared bucket owed when the shared key has expired
/// in Redis by failback (its TAT then survives only here; without this a
/// bucket empty when Redis failed came back full).
///
/// The share was seeded with the shared TAT `S` as Redis last told it, and
/// `d`, its decision on this admission, gives back its TAT before it:
/// `L = max(now + reset - cost * T_share, now)`. With one replica the share
/// is the shared rule and `L` is exactly where the shared bucket stood. With
/// N, each local admission moved `L` by N·T where the shared bucket moves
/// by T, so `L - now` is scaled down by N: `now + (L - now) / N`, which is at
/// most `S + k·T` (the truth after this replica's k earlier admissions) and
/// at least a full bucket's `now`. A debt never charges more than was
/// admitted, also when it opens again after a charge, an eviction or in a
/// second outage.
pub fn open(
    shared: &Algorithm,
    local: &Algorithm,
    d: &Decision,
    now: Micros,
    cost: u64,
) -> Option<Debt> {
    let mut debt = None;
    if let (Some(t), Some(t_share)) = (gcra_interval(shared), gcra_interval(local)) {
        let now_f = now as f64;
        let local_before = (now_f + d.reset_after_us as f64 - cost as f64 * t_share).max(now_f);
        debt = Some(Debt::Gcra {
            count: 0,
            tat: now_f + (local_before - now_f) * (t / t_share).min(1.0),
        });
    }
    record(shared, &mut debt, now, cost);
    debt
}

/// Records one local admission costing `cost` at `now` against the shared
/// rule `shared`: as `cost` admissions at that instant would be.
pub fn record(shared: &Algorithm, debt: &mut Option<Debt>, now: Micros, cost: u64) {
    match *shared {
        Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. } => {
            let t = gcra_interval(shared).unwrap_or(0.0);
            let (count, tat) = match debt {
                Some(Debt::Gcra { count, tat }) => (*count, *tat),
                _ => (0, f64::MIN),
            };
            *debt = Some(Debt::Gcra {
                count: count + cost,
                tat: tat.max(now as f64) + cost as f64 * t,
            });
        }
        Algorithm::Calendar { end, .. } => {
            let count = match debt {
                Some(Debt::Window { window, count }) if *window == end => *count,
                _ => 0,
            };
            *debt = Some(Debt::Window {
                window: end,
                count: count + cost,
            });
        }
        Algorithm::FixedWindow { window_secs, .. } => {
            let n = now.div_euclid(window_secs as i64 * 1_000_000);
            let count = match debt {
                Some(Debt::Window { window, count }) if *window == n => *count,
                _ => 0,
            };
            *debt = Some(Debt::Window {
                window: n,
                count: count + cost,
            });
        }
        Algorithm::SlidingWindow { window_secs, .. } => {
            let n = now.div_euclid(window_secs as i64 * 1_000_000);
            let (prev, cur) = match debt {
                Some(Debt::Sliding { window, prev, cur }) => roll(*window, *prev, *cur, n),
                _ => (0, 0),
            };
            *debt = Some(Debt::Sliding {
                window: n,
                prev,
                cur: cur + cost,
            });
        }
        Algorithm::SlidingLog { window_secs, .. } => {
            if !matches!(debt, Some(Debt::Log(_))) {
                *debt = Some(Debt::Log(VecDeque::new()));
            }
            if let Some(Debt::Log(log)) = debt {
                for _ in 0..cost {
                    super::sliding_log::push(log, now, window_secs as i64 * 1_000_000);
                }
            }
        }
    }
}

/// Takes one admission of `cost` recorded at `at` back out of a debt (the
/// request was refused or dropped before it reached the upstream): it is
/// not charged at failback. Where the debt has moved on (a new window) or
/// does not hold it, nothing changes.
pub fn unrecord(shared: &Algorithm, debt: &mut Option<Debt>, at: Micros, cost: u64) {
    let window_of = |secs: u64| at.div_euclid(secs as i64 * 1_000_000);
    match (*shared, debt.as_mut()) {
        (_, Some(Debt::Gcra { count, tat })) if *count >= cost => {
            *count -= cost;
            *tat -= cost as f64 * gcra_interval(shared).unwrap_or(0.0);
        }
        (Algorithm::Calendar { end, .. }, Some(Debt::Window { window, count }))
            if *window == end && *count >= cost =>
        {
            *count -= cost
        }
        (Algorithm::FixedWindow { window_secs, .. }, Some(Debt::Window { window, count }))
            if *window == window_of(window_secs) && *count >= cost =>
        {
            *count -= cost
        }
        (Algorithm::SlidingWindow { window_secs, .. }, Some(Debt::Sliding { window, cur, .. }))
            if *window == window_of(window_secs) && *cur >= cost =>
        {
            *cur -= cost
        }
        (Algorithm::SlidingLog { .. }, Some(Debt::Log(log))) => {
            for _ in 0..cost {
                match log.iter().rposition(|&t| t == at) {
                    Some(i) => {
                        log.remove(i);
                    }
                    None => break,
                }
            }
        }
        _ => {}
    }
}

/// Two debts of one bucket as one: `earlier`'s admissions all came before
/// `later`'s (a debt put back after a failed charge, and what was admitted
/// since). Exact for GCRA: replaying `later`'s admissions onto `earlier`'s
/// arrival time gives `max(tat_e + n_l * T, tat_l)`.
pub fn merge(shared: &Algorithm, earlier: Debt, later: Debt) -> Debt {
    match (earlier, later) {
        (Debt::Gcra { count: ce, tat: te }, Debt::Gcra { count: cl, tat: tl }) => {
            let t = gcra_interval(shared).unwrap_or(0.0);
            Debt::Gcra {
                count: ce + cl,
                tat: (te + cl as f64 * t).max(tl),
            }
        }
        (
            Debt::Window {
                window: we,
                count: ce,
            },
            Debt::Window {
                window: wl,
                count: cl,
            },
        ) => Debt::Window {
            window: wl,
            count: cl + if we == wl { ce } else { 0 },
        },
        (
            Debt::Sliding {
                window: we,
                prev: pe,
                cur: ce,
            },
            Debt::Sliding {
                window: wl,
                prev: pl,
                cur: cl,
            },
        ) => {
            let (p, c) = roll(we, pe, ce, wl);
            Debt::Sliding {
                window: wl,
                prev: pl + p,
                cur: cl + c,
            }
        }
        (Debt::Log(mut e), Debt::Log(l)) => {
            e.extend(l);
            Debt::Log(e)
        }
        // Kinds differ only if the bucket's name did not carry its algorithm.
        (_, later) => later,
    }
}

/// A sliding window's (prev, cur) counts seen from window `n`.
fn roll(window: i64, prev: u64, cur: u64, n: i64) -> (u64, u64) {
    if window == n {
        (prev, cur)
    } else if window == n - 1 {
        (cur, 0)
    } else {
        (0, 0)
    }
}

/// The shared bucket's state once `debt` is added to `state` at `now`, with
/// its TTL; `None` when nothing of the debt still counts (the bucket would be
/// full, or the window is over).
pub fn charge(
    shared: &Algorithm,
    state: Option<&State>,
    debt: &Debt,
    now: Micros,
) -> Option<(State, u64)> {
    match (*shared, debt) {
        (
            Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. },
            Debt::Gcra { count, tat },
        ) => {
            let t = gcra_interval(shared)?;
            let now_f = now as f64;
            // A TAT that has passed is a full bucket (Redis has let the key
            // expire by then): the debt alone counts.
            let replayed = match state {
                Some(State::Gcra { tat: t0 }) if *t0 > now_f => (t0 + *count as f64 * t).max(*tat),
                _ => *tat,
            };
            (replayed > now_f).then(|| (State::Gcra { tat: replayed }, ceil_us(replayed - now_f)))
        }
        (Algorithm::FixedWindow { window_secs, .. }, Debt::Window { window, count }) => {
            let w = window_secs as i64 * 1_000_000;
            let stored = match state {
                Some(State::Window { window: sw, .. }) => Some(*sw),
                _ => None,
            };
            let n = super::window_index(now, w, stored);
            if *window != n {
                return None;
            }
            let base = match state {
                Some(State::Window {
                    window: sw,
                    count: c,
                }) if *sw == n => *c,
                _ => 0,
            };
            let ttl = ((n + 1) * w - now).max(0) as u64;
            Some((
                State::Window {
                    window: n,
                    count: base + count,
                },
                ttl,
            ))
        }
        // A period's count: the debt adds to the count of the same period
        // (the key is the period's own; a later period owes nothing).
        (Algorithm::Calendar { end, .. }, Debt::Window { window, count }) => {
            if *window != end || now >= end + super::calendar::GRACE_US as i64 {
                return None;
            }
            let base = match state {
                Some(State::Window {
                    window: sw,
                    count: c,
                }) if *sw == end => *c,
                _ => 0,
            };
            let ttl = (end - now).max(0) as u64 + super::calendar::GRACE_US;
            Some((
                State::Window {
                    window: end,
                    count: base + count,
                },
                ttl,
            ))
        }
        (Algorithm::SlidingWindow { window_secs, .. }, Debt::Sliding { window, prev, cur }) => {
            let w = window_secs as i64 * 1_000_000;
            let mut n = now.div_euclid(w);
            if let Some(State::Sliding { window: sw, .. }) = state {
                n = n.max(*sw);
            }
            let (sp, sc) = match state {
                Some(State::Sliding {
                    window: sw,
                    prev: p,
                    cur: c,
                }) => roll(*sw, *p, *c, n),
                _ => (0, 0),
            };
            let (dp, dc) = roll(*window, *prev, *cur, n);
            if dp == 0 && dc == 0 {
                return None;
            }
            let ttl = ((n + 2) * w - now).max(0) as u64;
            Some((
                State::Sliding {
                    window: n,
                    prev: sp + dp,
                    cur: sc + dc,
                },
                ttl,
            ))
        }
        (Algorithm::SlidingLog { window_secs, .. }, Debt::Log(times)) => {
            let w = window_secs as i64 * 1_000_000;
            let live: Vec<Micros> = times.iter().copied().filter(|&t| t > now - w).collect();
            if live.is_empty() {
                return None;
            }
            let mut log = match state {
                Some(State::Log(l)) => l.clone(),
                _ => VecDeque::new(),
            };
            for t in live {
                super::sliding_log::push(&mut log, t, w);
            }
            Some((State::Log(log), w as u64))
        }
        // A debt recorded under another algorithm: the bucket's name carries
        // its algorithm, so this cannot meet a real bucket.
        _ => None,
    }
}

#[cfg(test)]
mod tests;
