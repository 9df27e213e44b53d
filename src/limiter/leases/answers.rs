//! A call's answer applied to the leases: its grants become live leases
//! (or owed, past a release), its returns are booked as taken back or
//! lost (`granted`); a failed call's returns are owed again or lost, and a
//! quota's reports told again with their numbers (`failed`). `Settle`
//! makes sure one of the two happens to every call.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Entry;
use super::{Ask, Asks, Leases};
use crate::config::Algorithm;
use crate::limiter::algorithms::lease::Grant;
use crate::limiter::{Check, Micros};
use crate::metrics::LeaseEvent;

/// A call's asks until its answer or failure is applied. Dropped unsettled
/// (its caller gave up on it: a clustered batch abandoned when the breaker
/// opened), the call counts as failed after it may have run, so a quota's
/// reports it carried are told again (`Leases::failed`).
pub struct Settle<'a> {
    leases: &'a Leases,
    asks: &'a Asks,
    done: bool,
}

impl Settle<'_> {
    pub fn granted(mut self, grants: &[Grant], sent: Instant, now_us: Micros) {
        self.done = true;
        self.leases.granted(self.asks, grants, sent, now_us);
    }

    pub fn failed(mut self, ran: bool) {
        self.done = true;
        self.leases.failed(self.asks, ran);
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.leases.failed(self.asks, true);
        }
    }
}

impl Leases {
    /// Settles `asks` once their call is answered, failed, or given up on.
    pub fn settle<'a>(&'a self, asks: &'a Asks) -> Settle<'a> {
        Settle {
            leases: self,
            asks,
            done: false,
        }
    }

    /// The call carrying a quota's reports was answered or failed: the
    /// bucket's next reports may go, and go with the next call.
    fn reported(&self, c: &Check) {
        let pending = match self.shard(&c.key).get_mut(&c.key) {
            Some(e) => {
                e.reporting = None;
                e.pending()
            }
            None => false,
        };
        if pending {
            self.owing.lock().insert(c.key.clone(), c.clone());
        }
    }

    /// Applies a call's grants (one per ask, in order). `sent`: when the
    /// call left; `now_us`: Redis's time in it.
    pub fn granted(&self, asks: &Asks, grants: &[Grant], sent: Instant, now_us: Micros) {
        let period_us = self.period.as_micros() as i64;
        for (a, g) in asks.asks.iter().zip(grants) {
            if a.report > 0 {
                self.reported(&a.check);
            }
            if g.told {
                // Told again after its answer was lost: its return was
                // taken back then (a quota's, up to what the ledger held).
                self.book(LeaseEvent::Returned, a.ret);
            } else {
                self.book(LeaseEvent::Returned, g.taken_back);
                self.book(LeaseEvent::Lost, a.ret - g.taken_back.min(a.ret));
            }
            if g.tokens == 0 {
                // Nothing to spare: `asking` stays set, so the bucket is not
                // asked for again for a period.
                continue;
            }
            self.book(LeaseEvent::Granted, g.tokens);
            let c = &a.check;
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                // Evicted meanwhile (it held nothing): kept again, so the
                // grant is spent or given back.
                let mut e = Entry::new(c.algorithm, Instant::now());
                e.owe(g.tokens, g.until);
                shard.force_insert(c.key.clone(), e);
                drop(shard);
                self.owing.lock().insert(c.key.clone(), c.clone());
                continue;
            };
            e.asking = None;
            // Never past the end of the window the tokens count in: Redis
            // took them from that window only.
            let life_us = match c.algorithm {
                Algorithm::FixedWindow { window_secs, .. }
                | Algorithm::SlidingWindow { window_secs, .. } => {
                    let w = window_secs as i64 * 1_000_000;
                    period_us.min((g.until + 1) * w - now_us).max(0)
                }
                Algorithm::Calendar { end, .. } => period_us.min(end - now_us).max(0),
                _ => period_us,
            };
            // Counted from when the call left: Redis's clock read later, so
            // the lease ends here first.
            let expires = sent + Duration::from_micros(life_us as u64);
            let now = Instant::now();
            let windowed = !matches!(c.algorithm, Algorithm::TokenBucket { .. });
            let closed = self.closed.load(Ordering::Acquire);
            if !closed && now < e.expires && e.tokens > 0 && (!windowed || e.until == g.until) {
                // Tokens of both leases: a return must hold for the older
                // (a token bucket's `until` only grows).
                e.tokens += g.tokens;
                e.until = e.until.min(g.until);
            } else {
                // A new lease: the old one's tokens are owed (and so are
                // those requests took from it and give back).
                e.end_lease();
                e.tokens = g.tokens;
                e.until = g.until;
            }
            e.expires = expires;
            e.granted_us = now_us;
            if closed {
                // Granted to a call that left before the release.
                e.end_lease();
            }
            let owes = !e.owed.is_empty();
            drop(shard);
            if owes {
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
            if !closed {
                self.leased.lock().insert(c.key.clone(), c.clone());
            }
        }
    }

    /// A call carrying `asks` failed: its buckets may be asked for again.
    /// What it gave back is owed again when the call cannot have run
    /// (`ran`: false), else counted lost: it may have arrived, and a return
    /// is never sent twice. A quota's reports are told again either way,
    /// with their numbers: Redis counts a number once, so a call that ran
    /// and whose answer was lost bills nothing twice, and one that did not
    /// run (or ran late and wrote nothing: `Fence`) loses nothing.
    pub fn failed(&self, asks: &Asks, ran: bool) {
        for a in &asks.asks {
            if a.report > 0 {
                let mut shard = self.shard(&a.check.key);
                let kept = match shard.get_mut(&a.check.key) {
                    Some(e) => {
                        e.asking = None;
                        e.reporting = None;
                        e.doubts.push(Ask {
                            want: 0,
                            ..a.clone()
                        });
                        true
                    }
                    None => false,
                };
                drop(shard);
                if kept {
                    self.owing
                        .lock()
                        .insert(a.check.key.clone(), a.check.clone());
                } else {
                    self.book(LeaseEvent::Lost, a.ret);
                }
                continue;
            }
            let again = !ran;
            let mut shard = self.shard(&a.check.key);
            let (owes, lost) = match shard.get_mut(&a.check.key) {
                Some(e) => {
                    e.asking = None;
                    if again {
                        e.unreported += a.spent;
                        e.owe(a.ret, a.until);
                    }
                    (
                        e.unreported > 0 || !e.owed.is_empty(),
                        if again { 0 } else { a.ret },
                    )
                }
                None => (false, a.ret),
            };
            drop(shard);
            if owes {
                self.owing
                    .lock()
                    .insert(a.check.key.clone(), a.check.clone());
            }
            self.book(LeaseEvent::Lost, lost);
        }
    }
}
