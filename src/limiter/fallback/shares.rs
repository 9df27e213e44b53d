//! A replica's share of a shared rule while it decides alone, and the
//! local buckets a failover starts from (`seed`).

use super::{outage, Fallback, LOG_SEED_EVERY_US};
use crate::clock::{Clock, SystemClock};
use crate::config::{Algorithm, OnRedisFailure};
use crate::limiter::{Check, Decision};

impl Fallback {
    /// What Redis just said of each bucket, kept as this replica's share so
    /// a failover starts from it (only when the fallback is local buckets).
    pub(super) fn seed(&self, checks: &[Check], decisions: &[Decision]) {
        if self.on_failure != OnRedisFailure::Local {
            return;
        }
        let n = self.fallback_replicas();
        let now = SystemClock.now_us();
        for (c, d) in checks.iter().zip(decisions) {
            // A log's seed holds one entry per request spent: at most one a
            // second per bucket, so a large log costs no copy per request.
            if let Algorithm::SlidingLog { window_secs, .. } = c.algorithm {
                let w = window_secs as i64 * 1_000_000;
                if self
                    .local
                    .log_written_within(&c.key, w, LOG_SEED_EVERY_US, now)
                {
                    continue;
                }
            }
            let local = share(&c.algorithm, n);
            if let Some((state, ttl)) = outage::seed(&c.algorithm, &local, d, now) {
                self.local.seed(&c.key, state, ttl, now);
            }
        }
    }
}

/// A shared rule's share on one of `n` replicas (or one of a global limit's
/// `n` sub-buckets): 1/n of capacity and rate, never less than one request.
pub fn share(alg: &Algorithm, n: u32) -> Algorithm {
    let n = n.max(1) as u64;
    let nf = n as f64;
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => Algorithm::TokenBucket {
            capacity: (capacity / n).max(1),
            refill_per_sec: refill_per_sec / nf,
        },
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => Algorithm::LeakyBucket {
            rate_per_sec: rate_per_sec / nf,
            max_delay_ms,
        },
        Algorithm::FixedWindow { limit, window_secs } => Algorithm::FixedWindow {
            limit: (limit / n).max(1),
            window_secs,
        },
        Algorithm::SlidingWindow { limit, window_secs } => Algorithm::SlidingWindow {
            limit: (limit / n).max(1),
            window_secs,
        },
        Algorithm::SlidingLog { limit, window_secs } => Algorithm::SlidingLog {
            limit: (limit / n).max(1),
            window_secs,
        },
        Algorithm::Calendar {
            limit,
            period,
            start,
            end,
        } => Algorithm::Calendar {
            limit: (limit / n).max(1),
            period,
            start,
            end,
        },
    }
}
