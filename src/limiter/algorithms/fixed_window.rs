//! Fixed window: at most `limit` admissions per aligned window of
//! `window_secs` (windows start at multiples of the window since the epoch, so
//! every replica agrees where one ends). A request costing n counts n.

use super::{Evaluation, Micros, Update};

pub fn check(
    limit: u64,
    window_secs: u64,
    state: Option<(i64, u64)>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    let w = window_secs as i64 * 1_000_000;
    let n = super::window_index(now, w, state.map(|(win, _)| win));
    let count = match state {
        Some((win, count)) if win == n => count,
        _ => 0,
    };
    let until_end = ((n + 1) * w - now).max(0) as u64;
    if count + cost <= limit {
        let update = Update::Window {
            window: n,
            count: count + cost,
        };
        Evaluation::admitted(limit, limit - count - cost, until_end, update, until_end)
    } else {
        Evaluation::rejected(limit, until_end, until_end)
    }
}
