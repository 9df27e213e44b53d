//! What a call to Redis carries for the leases: per bucket, a top-up when
//! its lease runs low, the owed tokens of ended leases, and a quota's
//! spending, numbered (`asks` for a call deciding requests, `returns` for
//! one that only gives back); and the grants a call made, taken out of
//! what its verdicts say each bucket holds (`debit`).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Owed;
use super::{running_low, Leases, MIN_GRANT};
use crate::config::Algorithm;
use crate::limiter::algorithms::lease::Grant;
use crate::limiter::{Check, Verdict};

/// A lease request for one bucket, sent with a call.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The bucket (its key and rule).
    pub check: Check,
    /// Tokens asked for (0: only giving back).
    pub want: u64,
    /// Unspent tokens of an expired lease, given back.
    pub ret: u64,
    /// What that lease's grant answered (`Grant::until`).
    pub until: i64,
    /// A quota's leased tokens spent since this replica last said so: Redis
    /// takes back itself what a dead holder did not spend (`Ledger`).
    pub spent: u64,
    /// A quota's report (`spent`, `ret`) number: counted once however
    /// often it is told (0: nothing to report, or not a quota).
    pub report: u64,
}

impl Ask {
    /// Owed tokens given back, nothing asked for.
    fn back(c: &Check, o: Owed) -> Self {
        Ask {
            check: c.clone(),
            want: 0,
            ret: o.tokens,
            until: o.until,
            spent: 0,
            report: 0,
        }
    }
}

/// What a call asks for: the leases, and how to size them.
#[derive(Debug, Clone, Default)]
pub struct Asks {
    pub asks: Vec<Ask>,
    /// The replicas sharing every limit (a grant is at most a share of what
    /// is left).
    pub replicas: u64,
    pub min: u64,
    /// This replica's id in quota ledgers, and how long after a grant Redis
    /// takes the unspent tokens of a holder that stopped reporting.
    pub holder: std::sync::Arc<str>,
    pub hold_us: u64,
    /// How many of the last asks are standing shares' top-ups
    /// (`limiter::pulls`), not leases.
    pub pulls: usize,
}

impl Asks {
    pub fn is_empty(&self) -> bool {
        self.asks.is_empty()
    }
}

/// Takes the leases a call granted out of what its verdicts say each
/// bucket holds: Redis granted them after deciding the call's requests, so
/// a verdict's `remaining` (and a token bucket's time to full) is as it
/// stood before. What the fallback starts from (`Fallback::seed`) and what
/// later requests on a lease report must not count those tokens twice.
pub fn debit(requests: &[&[Check]], verdicts: &mut [Verdict], asks: &Asks, grants: &[Grant]) {
    for (a, g) in asks.asks.iter().zip(grants) {
        if g.tokens == 0 {
            continue;
        }
        let more_us = match a.check.algorithm {
            Algorithm::TokenBucket { refill_per_sec, .. } => {
                (g.tokens as f64 * 1e6 / refill_per_sec).ceil() as u64
            }
            _ => 0,
        };
        for (r, v) in requests.iter().zip(verdicts.iter_mut()) {
            for (c, d) in r.iter().zip(v.decisions.iter_mut()) {
                if c.key == a.check.key && d.allowed {
                    d.remaining = d.remaining.saturating_sub(g.tokens);
                    d.reset_after_us += more_us;
                }
            }
        }
    }
}

impl Leases {
    /// The leases a call deciding `requests` asks for: its buckets whose
    /// lease is low, those queued by `spend`, and every bucket with owed
    /// tokens.
    pub fn asks(&self, requests: &[&[Check]], now: Instant) -> Asks {
        let mut asks = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for c in requests.iter().flat_map(|r| r.iter()) {
            if c.leased() && seen.insert(c.key.as_str()) {
                self.ask_for(c, now, &mut asks);
            }
        }
        let queued = std::mem::take(&mut *self.renewals.lock());
        for c in &queued {
            if seen.insert(c.key.as_str()) {
                self.ask_for(c, now, &mut asks);
            }
        }
        // Every bucket taken from `owing` is asked for, seen or not: one
        // asked for above may have been queued again since, by spending
        // that came after it (a second ask then carries only that).
        for c in &self.take_owing() {
            self.ask_for(c, now, &mut asks);
        }
        self.sized(asks)
    }

    /// Only the owed tokens, with no new lease asked for: what the sweeper
    /// and a release send (a bucket nobody sends requests for any more
    /// must not be leased again on its old demand).
    pub fn returns(&self, now: Instant) -> Asks {
        let mut asks = Vec::new();
        for c in self.take_owing() {
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                continue;
            };
            e.settle(now);
            if e.reports_out(now) {
                // Sent when that call's answer comes (`reported`).
                continue;
            }
            let start = asks.len();
            asks.append(&mut e.doubts);
            let first = asks.len();
            asks.extend(e.owed.drain(..).map(|o| Ask::back(&c, o)));
            let spent = std::mem::take(&mut e.unreported);
            match asks.get_mut(first) {
                Some(a) => a.spent = spent,
                None if spent > 0 => asks.push(Ask {
                    spent,
                    ..Ask::back(
                        &c,
                        Owed {
                            tokens: 0,
                            until: 0,
                        },
                    )
                }),
                None => {}
            }
            e.number(&mut asks[start..], &self.reports, now);
        }
        self.sized(asks)
    }

    /// The buckets with owed tokens, taken: the call being made carries
    /// them (a failed one owes them again: `failed`).
    fn take_owing(&self) -> Vec<Check> {
        std::mem::take(&mut *self.owing.lock())
            .into_values()
            .collect()
    }

    /// A call's asks, with how grants are sized now.
    fn sized(&self, asks: Vec<Ask>) -> Asks {
        Asks {
            asks,
            replicas: self.replicas.load(Ordering::Relaxed) as u64,
            min: MIN_GRANT,
            holder: self.holder.clone(),
            // A holder returns what it did not spend within a period and a
            // quarter of its grant (the sweeper); Redis waits two.
            hold_us: 2 * self.period.as_micros() as u64,
            pulls: 0,
        }
    }

    /// One bucket's asks: a top-up when its lease runs low, and one
    /// return per owed `until`.
    fn ask_for(&self, c: &Check, now: Instant, out: &mut Vec<Ask>) {
        let mut shard = self.shard(&c.key);
        let Some(e) = shard.get_mut(&c.key) else {
            return;
        };
        e.renew_queued = false;
        e.settle(now);
        let owed = std::mem::take(&mut e.owed);
        // Topped up to a period's demand: a lease then runs low within the
        // period it lives, so it is renewed before it expires, never after
        // (asking for a whole period on top of what is held would leave
        // tokens to expire, and the requests after them to wait for Redis).
        let want = e.want(now, self.period).saturating_sub(e.tokens);
        // Less than the smallest grant is never granted: not worth asking.
        let asking = want >= MIN_GRANT
            && !self.closed.load(Ordering::Acquire)
            && running_low(e.tokens, e.tokens + want)
            && !e.asked_recently(now, self.period);
        if asking {
            e.asking = Some(now);
        }
        if e.tokens == 0 {
            self.leased.lock().remove(&c.key);
        }
        if e.reports_out(now) {
            // A quota's reports wait for the call carrying earlier ones
            // (`reported` asks for them again); a top-up does not.
            e.owed = owed;
            if asking {
                out.push(Ask {
                    check: c.clone(),
                    want,
                    ret: 0,
                    until: e.until,
                    spent: 0,
                    report: 0,
                });
            }
            return;
        }
        let start = out.len();
        out.append(&mut e.doubts);
        let first = owed.first().copied();
        let spent = std::mem::take(&mut e.unreported);
        if asking || first.is_some() || spent > 0 {
            out.push(Ask {
                check: c.clone(),
                want: if asking { want } else { 0 },
                ret: first.map_or(0, |o| o.tokens),
                until: first.map_or(e.until, |o| o.until),
                spent,
                report: 0,
            });
        }
        out.extend(owed.iter().skip(1).map(|o| Ask::back(c, *o)));
        e.number(&mut out[start..], &self.reports, now);
    }
}
