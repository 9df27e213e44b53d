//! What one bucket's entry (`Entry`, in mod.rs) does with what it holds:
//! its lease ended and its tokens owed (merged per window), a quota's
//! reports numbered and waited for, the demand a lease is sized by, and
//! the decision a request admitted here reports.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Ask, Entry, Owed, MIN_GRANT, REPORT_WAIT};
use crate::config::Algorithm;
use crate::limiter::algorithms::quota;
use crate::limiter::Decision;

impl Entry {
    /// Owes `tokens` of a lease whose grant answered `until`. Returns of one
    /// window are one return; a token bucket's are merged under the
    /// earliest `until` (a return must hold for the oldest grant).
    pub(super) fn owe(&mut self, tokens: u64, until: i64) {
        if tokens == 0 {
            return;
        }
        let windowed = !matches!(self.algorithm, Algorithm::TokenBucket { .. });
        match self.owed.iter_mut().find(|o| !windowed || o.until == until) {
            Some(o) => {
                o.tokens += tokens;
                o.until = o.until.min(until);
            }
            None => self.owed.push(Owed { tokens, until }),
        }
    }

    /// Ends the live lease: its unspent tokens are owed.
    pub(super) fn end_lease(&mut self) {
        let tokens = std::mem::take(&mut self.tokens);
        self.owe(tokens, self.until);
        self.generation += 1;
    }

    /// An expired lease's tokens become owed.
    pub(super) fn settle(&mut self, now: Instant) {
        if self.tokens > 0 && now >= self.expires {
            self.end_lease();
        }
    }

    pub(super) fn holds_any(&self) -> bool {
        self.tokens > 0
            || !self.owed.is_empty()
            || self.unreported > 0
            || !self.doubts.is_empty()
            || self.reporting.is_some()
    }

    /// A quota's reports are out on a call not yet answered.
    pub(super) fn reports_out(&self, now: Instant) -> bool {
        self.reporting
            .is_some_and(|t| now.saturating_duration_since(t) < REPORT_WAIT)
    }

    /// Numbers the quota reports a call takes (`asks`, this bucket's, the
    /// doubts told again already numbered); the bucket's next reports then
    /// wait for that call.
    pub(super) fn number(&mut self, asks: &mut [Ask], reports: &AtomicU64, now: Instant) {
        if !matches!(self.algorithm, Algorithm::Calendar { .. }) {
            return;
        }
        for a in asks.iter_mut() {
            if a.report == 0 && (a.spent > 0 || a.ret > 0) {
                a.report = reports.fetch_add(1, Ordering::Relaxed);
            }
        }
        if asks.iter().any(|a| a.report > 0) {
            self.reporting = Some(now);
        }
    }

    /// Whether anything waits to be told with the next call.
    pub(super) fn pending(&self) -> bool {
        self.unreported > 0 || !self.owed.is_empty() || !self.doubts.is_empty()
    }

    pub(super) fn new(algorithm: Algorithm, now: Instant) -> Self {
        Entry {
            algorithm,
            tokens: 0,
            expires: now,
            until: 0,
            generation: 0,
            reset_generation: 0,
            owed: Vec::new(),
            unreported: 0,
            doubts: Vec::new(),
            reporting: None,
            demand: 0,
            demand_prev: 0,
            period_start: now,
            requests: 0,
            granted_us: 0,
            asking: None,
            renew_queued: false,
            redis_remaining: 0,
            reset_at: now,
            last_seen: now,
        }
    }

    pub(super) fn note_demand(&mut self, cost: u64, now: Instant, period: Duration) {
        let since = now.saturating_duration_since(self.period_start);
        if since >= period {
            self.demand_prev = if since < 2 * period { self.demand } else { 0 };
            self.demand = 0;
            self.period_start = now;
        }
        self.demand += cost;
        self.requests = self.requests.saturating_add(1);
        self.last_seen = now;
    }

    /// The lease this replica would like: its demand over a period, the
    /// current period's extrapolated from what has passed of it (at least
    /// a tenth of it), so a bucket that just became hot is seen at once.
    /// Demand is read as of `now`: a bucket no request has named for a
    /// period or two has none, however hot it was.
    pub(super) fn want(&self, now: Instant, period: Duration) -> u64 {
        let since = now.saturating_duration_since(self.period_start);
        let (current, previous, passed) = if since >= 2 * period {
            (0, 0, since)
        } else if since >= period {
            (0, self.demand, since - period)
        } else {
            (self.demand, self.demand_prev, since)
        };
        // One request is not a hot bucket (however much it costs), nor is
        // one seen now and then (the long tail of a crowd of clients): a
        // lease for it would come back, or be lost, nearly whole.
        if self.requests < 2 || current + previous < MIN_GRANT {
            return 0;
        }
        let passed = passed.max(period / 10);
        let extrapolated = (current as f64 * period.as_secs_f64() / passed.as_secs_f64()) as u64;
        extrapolated.max(previous)
    }

    pub(super) fn asked_recently(&self, now: Instant, period: Duration) -> bool {
        self.asking
            .is_some_and(|t| now.saturating_duration_since(t) < period)
    }

    /// A request admitted here, as its headers describe it: what Redis held
    /// at its last answer plus what this replica still holds of its lease
    /// (other replicas' spending since is not seen); a token bucket is whole
    /// again when Redis's TAT, less the unspent lease, is reached.
    pub(super) fn decision(&self, now: Instant) -> Decision {
        let limit = quota(&self.algorithm);
        let mut reset = self.reset_at.saturating_duration_since(now).as_micros() as u64;
        if let Algorithm::TokenBucket { refill_per_sec, .. } = self.algorithm {
            reset = reset.saturating_sub((self.tokens as f64 * 1e6 / refill_per_sec) as u64);
        }
        Decision {
            allowed: true,
            limit,
            remaining: (self.redis_remaining + self.tokens).min(limit),
            retry_after_us: 0,
            reset_after_us: reset,
            delay_us: 0,
        }
    }
}
