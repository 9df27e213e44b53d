//! Token bucket and leaky bucket, both as GCRA over one number: the
//! theoretical arrival time (TAT) of the next conforming request.
//!
//! With emission interval T = 1/rate and tolerance tau, a request at `now` is
//! admitted iff `now >= tat - tau`; admitting moves TAT to `max(tat, now) + T`.
//! Token bucket: tau = (capacity - 1) * T, the request goes at once (burst).
//! Leaky bucket: tau = max_delay, the request waits until `max(tat, now)`, so
//! the upstream sees requests spaced T apart (shaping). The retry time is
//! derived from the very value the decision compares against, so it is exact:
//! rejected one microsecond before it, admitted at it.
//!
//! A request costing n tokens is n requests at one instant: admitted iff the
//! last of them would be (`now >= tat + (n-1)T - tau`), and it moves TAT by
//! nT. With n = 1 the terms added are exact zeros, so cost 1 is bit for bit
//! the single-request rule.

use crate::config::Algorithm;

use super::{ceil_us, Decision, Evaluation, Micros, Update};

pub fn token_bucket(
    capacity: u64,
    rate: f64,
    tat: Option<f64>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    let t = 1e6 / rate;
    let tau = t * (capacity as f64 - 1.0);
    decide(t, tau, capacity, tat, now, cost, false)
}

pub fn leaky_bucket(
    rate: f64,
    max_delay_ms: u64,
    tat: Option<f64>,
    now: Micros,
    cost: u64,
) -> Evaluation {
    let t = 1e6 / rate;
    let tau = max_delay_ms as f64 * 1000.0;
    decide(t, tau, Algorithm::leaky_burst(t, tau), tat, now, cost, true)
}

fn decide(
    t: f64,
    tau: f64,
    limit: u64,
    tat: Option<f64>,
    now: Micros,
    cost: u64,
    shaping: bool,
) -> Evaluation {
    let now_f = now as f64;
    let n = cost as f64;
    let tat = tat.unwrap_or(now_f);
    let allow_at = tat + (n - 1.0) * t - tau;
    if now_f >= allow_at {
        let slot = tat.max(now_f);
        let new_tat = slot + n * t;
        // Clamped to `limit - n`: at rates near a million a second T nears the
        // resolution of a double holding epoch microseconds, and the quotient
        // can round past the bucket's size.
        let remaining = (((now_f + tau - new_tat) / t).floor() + 1.0).min(limit as f64 - n);
        let reset = ceil_us(new_tat - now_f);
        Evaluation {
            decision: Decision {
                allowed: true,
                limit,
                remaining: if remaining > 0.0 { remaining as u64 } else { 0 },
                retry_after_us: 0,
                reset_after_us: reset,
                delay_us: if shaping { ceil_us(slot - now_f) } else { 0 },
            },
            update: Update::Gcra { tat: new_tat },
            ttl_us: reset,
        }
    } else {
        let retry = ceil_us(allow_at.ceil() - now_f);
        Evaluation::rejected(limit, retry, ceil_us(tat - now_f))
    }
}
