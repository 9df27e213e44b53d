//! Settling a request charged by its answer (a route's `charge`): it was
//! admitted on an estimate, and once the answer says what it cost the
//! difference goes where each tier was decided. A share's difference is
//! settled on the share at once; a local bucket's on the local bucket; a
//! tier Redis decided (by a call or on a lease) is owed to Redis, added up
//! per bucket and sent every `SETTLE_EVERY` in batches: debts through
//! `charge.lua` (a bucket may go below empty: its client waits longer),
//! refunds through `refund.lua`. No request waits for a call.

use std::collections::HashMap;

use super::*;
use crate::limiter::algorithms::outage::Debt;

/// How often what is owed to Redis is sent.
pub const SETTLE_EVERY: Duration = Duration::from_millis(100);

/// Buckets owed something at most; past it a settlement is sent alone at
/// the next round (never dropped).
const MOST_PENDING: usize = 100_000;

/// What this replica owes Redis per bucket: tokens (positive: a debt) and
/// when the first settlement's request was admitted (a refund counts in
/// the window it was taken in).
#[derive(Default)]
pub(super) struct Owed {
    by_key: Mutex<HashMap<String, (Check, i64, Micros)>>,
}

impl Owed {
    fn add(&self, c: &Check, delta: i64, at: Micros) {
        let mut m = self.by_key.lock();
        if m.len() >= MOST_PENDING && !m.contains_key(&c.key) {
            metrics::settle_backlog_full();
        }
        let e = m.entry(c.key.clone()).or_insert_with(|| (c.clone(), 0, at));
        e.1 += delta;
    }

    fn take(&self) -> Vec<(Check, i64, Micros)> {
        std::mem::take(&mut *self.by_key.lock())
            .into_values()
            .filter(|(_, d, _)| *d != 0)
            .collect()
    }

    /// A settlement not sent: owed again.
    fn again(&self, c: Check, delta: i64, at: Micros) {
        self.add(&c, delta, at);
    }
}

impl Fallback {
    /// Settles a charged request: `charged` marks its tiers that count
    /// charged units (bit i: tier i), each admitted on its check's cost;
    /// `cost` is what the answer said it cost (`metering::charged`).
    pub fn settle(&self, outcome: &Outcome, charged: u64, cost: u64) {
        let Outcome::Decided {
            verdict,
            backend,
            checks,
            standing: covered,
        } = outcome
        else {
            return;
        };
        let now = SystemClock.now_us();
        for (i, (c, d)) in checks.iter().zip(&verdict.decisions).enumerate() {
            if charged & (1 << i) == 0 || !d.allowed || c.shadow {
                continue;
            }
            let delta = cost as i64 - c.cost as i64;
            if delta == 0 {
                continue;
            }
            if covered.tiers & (1 << i) != 0 {
                if let Some(standing) = &self.standing {
                    match delta {
                        d if d < 0 => standing.credit(c, d.unsigned_abs(), covered.generation),
                        d => standing.owe(c, d as u64, covered.generation),
                    }
                }
                continue;
            }
            match backend {
                FallbackState::Redis => self.owed.add(c, delta, verdict.now_us),
                FallbackState::Local => {
                    // Decided on this replica's part of the bucket: settled
                    // there. (The admission's debt charged at failback is
                    // its estimate: the difference is not carried over.)
                    self.local.settle_at(c, delta, verdict.now_us, now);
                }
            }
        }
    }

    /// Sends what is owed to Redis every `SETTLE_EVERY` while Redis
    /// decides; a call that fails leaves it owed for the next round.
    pub(super) async fn send_settlements(&self, redis: &RedisBackend) {
        loop {
            tokio::time::sleep(SETTLE_EVERY).await;
            if self.redis_up.load(Ordering::Acquire) {
                self.send_owed(redis).await;
            }
        }
    }

    /// What is owed to Redis now, sent: debts in batches (`charge.lua`),
    /// refunds one bucket at a time (`refund.lua`, not waited for).
    pub(super) async fn send_owed(&self, redis: &RedisBackend) {
        let owed = self.owed.take();
        if owed.is_empty() {
            return;
        }
        let now = SystemClock.now_us();
        let (debts, refunds): (Vec<_>, Vec<_>) = owed.into_iter().partition(|o| o.1 > 0);
        let charged: Vec<(Check, Debt)> = debts
            .iter()
            .filter_map(|(c, n, _)| Some((c.clone(), debt(c, *n as u64, now)?)))
            .collect();
        if !charged.is_empty() {
            match redis.charge(&charged, &self.replica_id).await {
                Ok(_) => metrics::settled(debts.iter().map(|d| d.1 as u64).sum(), 0),
                // Those not written are owed again (a call that ran and
                // whose answer was lost is charged twice).
                Err((written, _)) => {
                    for (c, n, at) in debts.into_iter().skip(written) {
                        self.owed.again(c, n, at);
                    }
                }
            }
        }
        let given: u64 = refunds.iter().map(|r| r.1.unsigned_abs()).sum();
        for (c, n, at) in refunds {
            redis.refund_tokens(&c, n.unsigned_abs(), at);
        }
        if given > 0 {
            metrics::settled(0, given);
        }
    }
}

/// A debt of `n` tokens at `now`, as `charge.lua` charges it: the bucket
/// moves on by `n` from where it stands (a full one from `now`).
fn debt(c: &Check, n: u64, now: Micros) -> Option<Debt> {
    use crate::config::Algorithm;
    let w = |secs: u64| now.div_euclid(secs as i64 * 1_000_000);
    Some(match c.algorithm {
        Algorithm::TokenBucket { refill_per_sec, .. } => Debt::Gcra {
            count: n,
            tat: now as f64 + n as f64 * 1e6 / refill_per_sec,
        },
        Algorithm::LeakyBucket { rate_per_sec, .. } => Debt::Gcra {
            count: n,
            tat: now as f64 + n as f64 * 1e6 / rate_per_sec,
        },
        Algorithm::FixedWindow { window_secs, .. } => Debt::Window {
            window: w(window_secs),
            count: n,
        },
        Algorithm::SlidingWindow { window_secs, .. } => Debt::Sliding {
            window: w(window_secs),
            prev: 0,
            cur: n,
        },
        Algorithm::Calendar { end, .. } => Debt::Window {
            window: end,
            count: n,
        },
        Algorithm::SlidingLog { .. } => return None,
    })
}
