//! A charged request's settlement (its answer said what it cost) where its
//! tier was leased: the difference goes through this replica's lease, so
//! no settlement of a leased bucket ever moves Redis's state under a
//! lease's floor (`algorithms::lease`).
//!
//! - Decided on a lease (`Mark`): a refund goes back to the lease it was
//!   spent from while that lives, else it is owed with that lease's return;
//!   a debt is spent from that lease as far as it holds, and the rest is
//!   the caller's to send to Redis (a debt only raises a bucket: it never
//!   takes a return's floor away).
//! - Decided by a call to Redis that ran after this replica's live lease
//!   on the bucket was granted (`credit`): Redis debited the request above
//!   that lease's floor, so its refund joins the lease, spent here or given
//!   back with it. Otherwise the caller sends it to Redis.
//!
//! Books: granted + refunded = spent + returned + lost + held.

use std::time::Instant;

use super::{Leases, Taken};
use crate::config::Algorithm;
use crate::limiter::{Check, Micros};
use crate::metrics::LeaseEvent;

/// The lease a tier was spent from: its generation, and what its return
/// names (`until`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    generation: u64,
    until: i64,
}

/// Whether a charged tier settles through its lease: a token bucket or a
/// counting window. A quota's leased spending is reported to its ledger as
/// it happens: its settlement goes to Redis (`charge.lua`), which settles
/// the ledger too.
fn settles_here(alg: &Algorithm) -> bool {
    matches!(
        alg,
        Algorithm::TokenBucket { .. }
            | Algorithm::FixedWindow { .. }
            | Algorithm::SlidingWindow { .. }
    )
}

impl Taken {
    /// Per tier, the lease it was spent from (only those that settle
    /// through it).
    pub fn marks(&self, checks: &[Check]) -> Vec<Option<Mark>> {
        checks
            .iter()
            .zip(&self.decisions)
            .zip(&self.generations)
            .map(|((c, d), &(generation, until))| {
                (d.is_some() && settles_here(&c.algorithm)).then_some(Mark { generation, until })
            })
            .collect()
    }
}

impl Leases {
    /// Settles `delta` tokens (positive: a debt) of a tier spent from the
    /// lease `mark` names. Returns the debt it could not take from that
    /// lease: the caller owes it to Redis.
    pub fn settle_on(&self, c: &Check, mark: Mark, delta: i64, now: Instant) -> u64 {
        let mut shard = self.shard(&c.key);
        let Some(e) = shard.get_mut(&c.key) else {
            drop(shard);
            return match delta {
                // Evicted: it held nothing, so its lease ended and was
                // given back; the refund is lost (never over the limit).
                d if d < 0 => {
                    self.book(LeaseEvent::Refunded, d.unsigned_abs());
                    self.book(LeaseEvent::Lost, d.unsigned_abs());
                    0
                }
                d => d as u64,
            };
        };
        let live = e.generation == mark.generation && now < e.expires;
        if delta > 0 {
            let debt = delta as u64;
            let from_lease = if live { debt.min(e.tokens) } else { 0 };
            e.tokens -= from_lease;
            drop(shard);
            self.book(LeaseEvent::Spent, from_lease);
            return debt - from_lease;
        }
        let back = delta.unsigned_abs();
        let closed = self.closed.load(std::sync::atomic::Ordering::Acquire);
        let lost = if live && !closed {
            e.tokens += back;
            drop(shard);
            self.leased.lock().insert(c.key.clone(), c.clone());
            false
        } else if mark.generation < e.reset_generation {
            // A reset made the bucket whole since.
            true
        } else {
            e.owe(back, mark.until);
            drop(shard);
            self.owing.lock().insert(c.key.clone(), c.clone());
            false
        };
        self.book(LeaseEvent::Refunded, back);
        if lost {
            self.book(LeaseEvent::Lost, back);
        }
        0
    }

    /// A refund of `tokens` for a tier a call to Redis decided at `at_us`
    /// (Redis's time). If this replica's live lease on the bucket was
    /// granted before that call ran (its first grant's time is earlier:
    /// scripts run one at a time, each at its own microsecond), the
    /// request's tokens lie above the lease's floor: the refund joins the
    /// lease, spent here or given back with it (`true`). If the lease was
    /// granted in that call or after it (a call's grants follow its
    /// requests), its floor counted the request's tokens: the refund goes
    /// to Redis (`false`), and the floor is lowered by it, as the bucket
    /// without this lease would hold the refund too; so the lease's return
    /// is not cut by it. (Another replica's lease granted in between still
    /// takes back up to the refund less: under, never over.)
    pub fn credit(&self, c: &Check, tokens: u64, at_us: Micros, now: Instant) -> bool {
        if !settles_here(&c.algorithm) || c.pool || c.shadow || tokens == 0 {
            return false;
        }
        let closed = self.closed.load(std::sync::atomic::Ordering::Acquire);
        let mut shard = self.shard(&c.key);
        let Some(e) = shard.get_mut(&c.key) else {
            return false;
        };
        if now >= e.expires || closed {
            return false;
        }
        match c.algorithm {
            Algorithm::TokenBucket { refill_per_sec, .. } if e.since_us >= at_us => {
                // Lowered by at least the refund's time (rounded up): the
                // return's `now <= until` only gets stricter.
                e.until -= (tokens as f64 * 1e6 / refill_per_sec).ceil() as i64;
                return false;
            }
            // A window's lease takes back only in the window its tokens
            // count in: a refund counts in its request's. A window's count
            // holds every token its refunds take back (no floor to lower).
            Algorithm::FixedWindow { window_secs, .. }
            | Algorithm::SlidingWindow { window_secs, .. }
                if at_us.div_euclid(window_secs as i64 * 1_000_000) != e.until =>
            {
                return false;
            }
            _ if e.since_us >= at_us => return false,
            _ => {}
        }
        e.tokens += tokens;
        drop(shard);
        self.leased.lock().insert(c.key.clone(), c.clone());
        self.book(LeaseEvent::Refunded, tokens);
        true
    }
}
