//! Sliding log: exact. One timestamp per admitted request; a request is
//! admitted iff fewer than `limit` admissions happened in the last window.
//! An entry admitted at `t` stops counting at `t + W`. A request costing n
//! is n entries at one instant.

use std::collections::VecDeque;

use super::{Evaluation, Micros, Update};

pub fn check(
    limit: u64,
    window_secs: u64,
    log: &VecDeque<Micros>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    let w = window_secs as i64 * 1_000_000;
    let lower = now - w;
    // Entries at or before `lower` have expired.
    let first_live = log.partition_point(|&t| t <= lower);
    let count = (log.len() - first_live) as u64;
    if count + cost <= limit {
        let oldest = log.get(first_live).copied().unwrap_or(now);
        let update = Update::LogPush {
            at: now,
            window_us: w,
            n: cost,
        };
        let reset = (oldest + w - now).max(0) as u64;
        Evaluation::admitted(limit, limit - count - cost, reset, update, w as u64)
    } else {
        // Enough entries must expire to leave limit - cost: the
        // (count + cost - limit)th live one (1-based).
        let idx = first_live + (count + cost - limit - 1) as usize;
        let retry = (log[idx] + w - now).max(1) as u64;
        Evaluation::rejected(limit, retry, w as u64)
    }
}

/// Records an admission at `at`, dropping what has expired by then.
pub fn push(log: &mut VecDeque<Micros>, at: Micros, w: Micros) {
    while log.front().is_some_and(|&t| t <= at - w) {
        log.pop_front();
    }
    // Keep the log sorted even if a clock steps back.
    let pos = log.partition_point(|&t| t <= at);
    log.insert(pos, at);
}
