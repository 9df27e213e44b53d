//! A quota's calendar period: at most `limit` admissions in `[start, end)`
//! (the planner picks the period from the request's time, in the configured
//! time zone: `crate::calendar`). Each period is a bucket of its own, so
//! the state is a count, tagged with the period's end as a fixed window's
//! is with its index (`limiter.lua` is told the end alone: kind 6, p1 the
//! limit, p2 the end). A request costing n counts n.

use super::{Evaluation, Micros, Update};

/// How long past its end a period's count is kept: a replica whose clock
/// is a little behind still finds it (its requests land in the period its
/// own clock names).
pub const GRACE_US: u64 = 60_000_000;

pub fn check(
    limit: u64,
    start: Micros,
    end: Micros,
    state: Option<(i64, u64)>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    debug_assert!(start < end);
    let count = match state {
        Some((tag, count)) if tag == end => count,
        _ => 0,
    };
    let until_end = (end - now).max(0) as u64;
    if count + cost <= limit {
        let update = Update::Window {
            window: end,
            count: count + cost,
        };
        Evaluation::admitted(
            limit,
            limit - count - cost,
            until_end,
            update,
            until_end + GRACE_US,
        )
    } else {
        // Nothing comes back before the period ends: the retry is then.
        Evaluation::rejected(limit, until_end, until_end + GRACE_US)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_within_its_period_and_retries_at_its_end() {
        let (start, end) = (1_000_000_000, 1_086_400_000_000);
        let now = start + 5;
        let mut state = None;
        for left in (0..5).rev() {
            let e = check(5, start, end, state, now, 1);
            assert!(e.decision.allowed);
            assert_eq!(e.decision.remaining, left);
            assert_eq!(e.decision.reset_after_us, (end - now) as u64);
            if let Update::Window { window, count } = e.update {
                state = Some((window, count));
            }
        }
        let refused = check(5, start, end, state, now, 1);
        assert!(!refused.decision.allowed);
        assert_eq!(refused.decision.retry_after_us, (end - now) as u64);
        // The last microsecond is still the period; a count of another
        // period is not this one's.
        assert!(!check(5, start, end, state, end - 1, 1).decision.allowed);
        assert!(check(5, end, end + 10, state, end, 1).decision.allowed);
        // Cost: 2 of the 5, then 3 more, then nothing.
        let e = check(5, start, end, Some((end, 2)), now, 3);
        assert_eq!((e.decision.allowed, e.decision.remaining), (true, 0));
        assert!(
            !check(5, start, end, Some((end, 3)), now, 3)
                .decision
                .allowed
        );
    }
}
