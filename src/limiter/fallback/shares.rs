//! A replica's share of a shared rule while it decides alone.

use crate::config::Algorithm;

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
