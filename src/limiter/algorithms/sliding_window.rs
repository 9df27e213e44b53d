//! Sliding window counter: the current window's count plus the previous
//! window's, weighted by how much of it still overlaps the sliding window.
//!
//! Admit iff `prev * (1 - elapsed/W) + cur + n <= limit` (n: the request's cost). Solved for time, that
//! is a threshold `allow_at`; the decision compares `now` against it and the
//! retry time is read from it, so the two can never disagree.

use super::{ceil_us, Decision, Evaluation, Micros, Update};

pub fn check(
    limit: u64,
    window_secs: u64,
    state: Option<(i64, u64, u64)>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    let w = window_secs as i64 * 1_000_000;
    let n = super::window_index(now, w, state.map(|(win, _, _)| win));
    let (prev, cur) = match state {
        Some((win, prev, cur)) if win == n => (prev, cur),
        Some((win, _, cur)) if win == n - 1 => (cur, 0),
        _ => (0, 0),
    };
    let ws = n * w;
    let allow_at = allow_at(limit, w, ws, prev, cur, cost);
    let now_f = now as f64;
    let (wf, wsf) = (w as f64, ws as f64);
    if now_f >= allow_at {
        let cur1 = cur + cost;
        let remaining =
            (limit as f64 - cur1 as f64 - prev as f64 * (wsf + wf - now_f) / wf).floor();
        let until_end = ceil_us(wsf + wf - now_f);
        Evaluation {
            decision: Decision {
                allowed: true,
                limit,
                remaining: if remaining > 0.0 { remaining as u64 } else { 0 },
                retry_after_us: 0,
                reset_after_us: until_end,
                delay_us: 0,
            },
            update: Update::Sliding {
                window: n,
                prev,
                cur: cur1,
            },
            ttl_us: ceil_us(wsf + 2.0 * wf - now_f),
        }
    } else {
        let retry = ceil_us(allow_at.ceil() - now_f);
        Evaluation::rejected(limit, retry, ceil_us(wsf + 2.0 * wf - now_f))
    }
}

/// The first moment a request is admitted, given the window starting at `ws`.
fn allow_at(limit: u64, w: i64, ws: i64, prev: u64, cur: u64, cost: u64) -> f64 {
    let (wf, wsf) = (w as f64, ws as f64);
    let need = limit as f64 - cost as f64 - cur as f64;
    if need >= 0.0 {
        let prev = prev as f64;
        if prev <= need {
            wsf
        } else {
            wsf + wf * (prev - need) / prev
        }
    } else {
        // Not in this window: in the next one `cur` becomes the previous count.
        let (ws2, need2, prev2) = (wsf + wf, limit as f64 - cost as f64, cur as f64);
        if prev2 <= need2 {
            ws2
        } else {
            ws2 + wf * (prev2 - need2) / prev2
        }
    }
}
