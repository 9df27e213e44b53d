//! A charged request's settlement (its answer said what it cost) where its
//! tier is a leased counting window (a token bucket counting charged units
//! is never leased: `Check::leased`): the difference goes through this
//! replica's lease, with no call of its own.
//!
//! - Decided on a lease (`Mark`): a refund goes back to the lease it was
//!   spent from while that lives, else it is owed with that lease's return;
//!   a debt is spent from that lease as far as it holds, and the rest is
//!   the caller's to send to Redis.
//! - Decided by a call to Redis in the window of this replica's live lease
//!   (`credit`): the refund joins the lease, spent here or given back with
//!   it. A window's count holds every token a return or refund takes back
//!   (each counted in it first), so no order of them over-admits.
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

/// Whether a charged tier settles through its lease: a counting window. A
/// quota's leased spending is reported to its ledger as it happens: its
/// settlement goes to Redis (`charge.lua`), which settles the ledger too.
fn settles_here(alg: &Algorithm) -> bool {
    matches!(
        alg,
        Algorithm::FixedWindow { .. } | Algorithm::SlidingWindow { .. }
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

    /// A refund of `tokens` for a tier a call to Redis decided at `at_us`:
    /// taken into this replica's live lease on the bucket when that lease
    /// counts in the same window (the refund then comes back with it, or is
    /// spent here). Whether it was; if not, the caller sends it to Redis.
    pub fn credit(&self, c: &Check, tokens: u64, at_us: Micros, now: Instant) -> bool {
        let (Algorithm::FixedWindow { window_secs, .. }
        | Algorithm::SlidingWindow { window_secs, .. }) = c.algorithm
        else {
            return false;
        };
        if !c.leased() || tokens == 0 || self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let mut shard = self.shard(&c.key);
        let Some(e) = shard.get_mut(&c.key) else {
            return false;
        };
        let window = at_us.div_euclid(window_secs as i64 * 1_000_000);
        if now >= e.expires || e.until != window {
            return false;
        }
        e.tokens += tokens;
        drop(shard);
        self.leased.lock().insert(c.key.clone(), c.clone());
        self.book(LeaseEvent::Refunded, tokens);
        true
    }
}
