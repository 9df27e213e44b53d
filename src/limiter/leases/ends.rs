//! Where leases end: expired ones found by the sweeper (`due`), every one
//! at a reload or a stop (`release`), their unspent tokens then owed back;
//! and those a reset cancelled, whose tokens are lost (`cancel`).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Leases;
use crate::limiter::{Check, Micros};
use crate::metrics::LeaseEvent;

impl Leases {
    /// Drops the leases on these buckets (a reset): their tokens, taken
    /// from the bucket before it was made whole, are not spent, nor given
    /// back to the new bucket.
    pub fn cancel(&self, keys: &[&str], granted_before: Option<Micros>) {
        for &k in keys {
            let mut shard = self.shard(k);
            let Some(e) = shard.get_mut(k) else { continue };
            if granted_before.is_some_and(|t| e.granted_us >= t) {
                continue; // granted by the bucket as it is since
            }
            let lost =
                std::mem::take(&mut e.tokens) + e.owed.drain(..).map(|o| o.tokens).sum::<u64>();
            // The reset took the bucket's ledger with it.
            e.unreported = 0;
            e.generation += 1;
            e.reset_generation = e.generation;
            drop(shard);
            self.book(LeaseEvent::Lost, lost);
        }
    }

    /// Ends every live lease whose time is up; whether any tokens are owed
    /// (the caller then sends a call to carry them back). The sweeper asks
    /// this every quarter period, so an idle bucket's lease goes back
    /// within a period and a quarter of its grant.
    pub fn due(&self, now: Instant) -> bool {
        self.end_leases(Some(now))
    }

    /// Ends every lease now (a reload: the old rules' leases go back
    /// before they go; `stop`: a graceful stop, after which nothing is
    /// leased or spent). Returns whether any tokens are owed.
    pub fn release(&self, stop: bool) -> bool {
        if stop {
            self.closed.store(true, Ordering::Release);
        }
        self.end_leases(None)
    }

    /// Ends the live leases that expired by `now` (all of them: `None`),
    /// owing their tokens; a bucket left with no live lease leaves
    /// `leased`.
    fn end_leases(&self, now: Option<Instant>) -> bool {
        let leased: Vec<Check> = self.leased.lock().values().cloned().collect();
        for c in leased {
            let mut shard = self.shard(&c.key);
            let (owes, live) = match shard.get_mut(&c.key) {
                Some(e) => {
                    match now {
                        Some(now) => e.settle(now),
                        None if e.tokens > 0 => e.end_lease(),
                        None => {}
                    }
                    (!e.owed.is_empty(), e.tokens > 0)
                }
                None => (false, false),
            };
            drop(shard);
            if owes {
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
            if !live {
                self.leased.lock().remove(&c.key);
            }
        }
        self.owing()
    }
}
