//! Settling a request charged by its answer (a route's `charge`): it was
//! admitted on an estimate, and once the answer says what it cost the
//! difference goes where each tier was decided. A share's difference is
//! settled on the share at once; a local bucket's on the local bucket and
//! in the debt failback charges (`Ledger::settle_charge`); a leased tier's
//! through its lease (`leases::settle`: a refund back to the
//! lease, a debt spent from it), so no refund moves a bucket under a
//! lease's floor. What is left (a debt its lease could not cover, a refund
//! of a tier a call decided before this replica's lease, a quota's) is owed
//! to Redis, added up per bucket and sent every `SETTLE_EVERY` in
//! `charge.lua`'s batches, debts (a bucket may go below empty: its client
//! waits longer) and refunds together. No request waits for a call.

use std::collections::HashMap;

use super::*;

/// How often what is owed to Redis is sent (what a killed replica can
/// lose: the settlements of its last round).
pub const SETTLE_EVERY: Duration = Duration::from_millis(100);

/// Buckets owed something past which each new one is counted
/// (`gateway_settle_backlog_full_total`: Redis is slow to take them); it is
/// still kept, never dropped.
const MOST_PENDING: usize = 100_000;

/// One bucket's settlement: its check, tokens (positive: a debt), and when
/// the first settlement's request was admitted.
type Settlement = (Check, i64, Micros);

/// What this replica owes Redis per bucket: tokens (positive: a debt) and
/// when the first settlement's request was admitted (a refund counts in
/// the window it was taken in).
#[derive(Default)]
pub(super) struct Owed {
    by_key: Mutex<HashMap<String, Settlement>>,
    /// A batch whose call may have run (its answer was lost), with its
    /// marker: sent again as it was before anything new, so it is
    /// settled once (`RedisBackend::settle`).
    in_doubt: Mutex<Option<(String, Vec<Settlement>)>>,
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

    /// Whether anything is owed.
    pub(super) fn any(&self) -> bool {
        !self.by_key.lock().is_empty() || self.in_doubt.lock().is_some()
    }

    /// What is owed, taken to be sent.
    fn take(&self) -> Vec<Settlement> {
        std::mem::take(&mut *self.by_key.lock())
            .into_values()
            .filter(|(_, d, _)| *d != 0)
            .collect()
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
            standing: covered,
            ..
        } = outcome
        else {
            return;
        };
        let now = SystemClock.now_us();
        let leases = self.redis.as_ref().and_then(|r| r.leases());
        let here = Instant::now();
        for (i, c, on) in outcome.admitted_tiers() {
            let delta = cost as i64 - c.cost as i64;
            if charged & (1 << i) == 0 || c.shadow || delta == 0 {
                continue;
            }
            match (on, backend) {
                (DecidedOn::Share, _) => {
                    if let Some(standing) = &self.standing {
                        match delta {
                            d if d < 0 => standing.credit(c, d.unsigned_abs(), covered.generation),
                            d => standing.owe(c, d as u64, covered.generation),
                        }
                    }
                }
                (on, FallbackState::Redis) => {
                    let left = match (leases, on) {
                        (Some(leases), DecidedOn::Lease(mark)) => {
                            leases.settle_on(c, mark, delta, here) as i64
                        }
                        (Some(leases), _)
                            if delta < 0
                                && leases.credit(c, delta.unsigned_abs(), verdict.now_us, here) =>
                        {
                            0
                        }
                        _ => delta,
                    };
                    if left != 0 {
                        self.owed.add(c, left, verdict.now_us);
                    }
                }
                (_, FallbackState::Local) => {
                    // Decided on this replica's part of the bucket: settled
                    // there, and in the debt failback charges to Redis (if
                    // failback has not charged it yet).
                    self.local.settle_at(c, delta, verdict.now_us, now);
                    if self.redis.is_some()
                        && !self
                            .ledger
                            .settle_charge(&c.key, delta, verdict.now_us, now)
                    {
                        metrics::settle_after_failback();
                    }
                }
            }
        }
    }

    /// Sends what is owed to Redis every `SETTLE_EVERY` while Redis
    /// decides: one `charge.lua` call a round for all buckets (a few hundred
    /// a call), only when something is owed.
    pub(super) async fn send_settlements(&self, redis: &RedisBackend) {
        loop {
            tokio::time::sleep(SETTLE_EVERY).await;
            if self.redis_up.load(Ordering::Acquire) {
                self.send_owed(redis).await;
            }
        }
    }

    /// What is owed to Redis now, sent in `charge.lua`'s batches. A call
    /// that fails before it runs leaves what it did not write owed; one
    /// that may have run (its answer lost) leaves its whole batch in doubt,
    /// sent again under the same marker next time: the calls that ran
    /// write nothing then (settled once), the others write. Without a
    /// marker (a cluster), what was not written is owed again, and a call
    /// that ran is settled twice.
    pub(super) async fn send_owed(&self, redis: &RedisBackend) {
        let again = self.owed.in_doubt.lock().take();
        let (marker, owed) = match again {
            Some((marker, owed)) => (Some(marker), owed),
            None => {
                let owed = self.owed.take();
                if owed.is_empty() {
                    return;
                }
                (redis.settle_marker(), owed)
            }
        };
        match redis
            .settle(&owed, &self.replica_id, marker.as_deref())
            .await
        {
            Ok(_) => {
                let debt = owed.iter().filter(|o| o.1 > 0).map(|o| o.1 as u64).sum();
                let back = owed
                    .iter()
                    .filter(|o| o.1 < 0)
                    .map(|o| o.1.unsigned_abs())
                    .sum();
                metrics::settled(debt, back);
            }
            Err((_, e)) if e.may_have_run() && marker.is_some() => {
                metrics::settle_in_doubt();
                *self.owed.in_doubt.lock() = marker.map(|m| (m, owed));
            }
            Err((written, _)) => {
                for (c, n, at) in owed.into_iter().skip(written) {
                    self.owed.add(&c, n, at);
                }
            }
        }
    }
}
