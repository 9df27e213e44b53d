//! From the limiter's outcome to what the client sees: admitted (with
//! rate-limit headers and perhaps a shaping delay), 429 with Retry-After, or
//! 503 when Redis is down and the operator chose "deny"; and each tier's
//! decision as a metric label.

use super::*;

/// The fate of a planned request.
#[derive(Debug, Clone, PartialEq)]
pub enum Conclusion {
    Admit {
        headers: Vec<(&'static str, HeaderValue)>,
        /// Leaky-bucket shaping: wait this long, then go upstream.
        delay: Duration,
    },
    Reject {
        headers: Vec<(&'static str, HeaderValue)>,
        /// Exact wait until a retry can succeed, in ms (rounded up).
        retry_after_ms: u64,
        /// The limits that refused, by `Check::policy_name`.
        violated: Vec<&'static str>,
    },
    /// Redis failed and the operator chose to deny.
    Unavailable,
}

/// Per-tier results for metrics and the access log: every tier of a
/// decided request once.
pub fn tier_labels(outcome: &Outcome) -> Vec<(LimitKind, DecisionLabel)> {
    match outcome {
        Outcome::Decided {
            verdict, checks, ..
        } => checks
            .iter()
            .zip(&verdict.decisions)
            .map(|(c, d)| {
                let label = match (d.allowed, c.shadow) {
                    (true, _) => DecisionLabel::Allowed,
                    (false, true) => DecisionLabel::ShadowRejected,
                    (false, false) => DecisionLabel::Rejected,
                };
                (c.kind(), label)
            })
            .collect(),
        Outcome::Remembered { checks, tier, .. } => checks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let label = if i == *tier {
                    DecisionLabel::Rejected
                } else {
                    DecisionLabel::NotAsked
                };
                (c.kind(), label)
            })
            .collect(),
        Outcome::FailOpen | Outcome::FailClosed => Vec::new(),
    }
}

/// Turns the limiter's outcome into what the client sees. `jitter_us` is the
/// random spread added to Retry-After (never making it earlier).
pub fn conclude(outcome: &Outcome, style: HeaderStyle, jitter_us: u64) -> Conclusion {
    let (verdict, checks) = match outcome {
        Outcome::Decided {
            verdict, checks, ..
        } => (verdict, checks),
        Outcome::Remembered {
            checks,
            tier,
            decision,
            now_us,
        } => {
            // The policy names every tier, as on any other answer.
            let wait_us = decision.retry_after_us;
            let mut hs = headers(style, checks, &checks[*tier], decision, wait_us, *now_us);
            hs.push(retry_after(wait_us, jitter_us));
            return Conclusion::Reject {
                headers: hs,
                retry_after_ms: wait_us.div_ceil(1000),
                violated: vec![checks[*tier].policy_name()],
            };
        }
        Outcome::FailOpen => {
            return Conclusion::Admit {
                headers: Vec::new(),
                delay: Duration::ZERO,
            }
        }
        Outcome::FailClosed => return Conclusion::Unavailable,
    };
    let decisions = &verdict.decisions;
    if checks.is_empty() {
        return Conclusion::Admit {
            headers: Vec::new(),
            delay: Duration::ZERO,
        };
    }
    let pairs = || checks.iter().zip(decisions.iter());
    if verdict.admitted(checks) {
        // Most restrictive: least remaining, then the longest until reset.
        let (c, d) = pairs()
            .min_by_key(|(c, d)| (d.remaining * c.shards, std::cmp::Reverse(d.reset_after_us)))
            .expect("checks is not empty");
        let delay = pairs()
            .filter(|(_, d)| d.allowed)
            .map(|(_, d)| d.delay_us)
            .max()
            .unwrap_or(0);
        Conclusion::Admit {
            headers: headers(style, checks, c, d, d.reset_after_us, verdict.now_us),
            delay: Duration::from_micros(delay),
        }
    } else {
        let rejecting = || pairs().filter(|(c, d)| !d.allowed && !c.shadow);
        let (c, d) = rejecting()
            .max_by_key(|(_, d)| d.retry_after_us)
            .expect("a rejected verdict has a rejecting tier");
        let wait_us = d.retry_after_us;
        let mut hs = headers(style, checks, c, d, wait_us, verdict.now_us);
        hs.push(retry_after(wait_us, jitter_us));
        Conclusion::Reject {
            headers: hs,
            retry_after_ms: wait_us.div_ceil(1000),
            violated: rejecting().map(|(c, _)| c.policy_name()).collect(),
        }
    }
}

/// Retry-After in whole seconds, never earlier than the true wait.
pub(super) fn retry_after(wait_us: u64, jitter_us: u64) -> (&'static str, HeaderValue) {
    (
        "retry-after",
        HeaderValue::from((wait_us + jitter_us).div_ceil(1_000_000).max(1)),
    )
}

/// The rate-limit headers for the most restrictive tier `(c, d)`.
pub(super) fn headers(
    style: HeaderStyle,
    checks: &[Check],
    c: &Check,
    d: &Decision,
    reset_us: u64,
    now_us: i64,
) -> Vec<(&'static str, HeaderValue)> {
    // Six with Retry-After: one allocation, never regrown.
    let mut out = Vec::with_capacity(6);
    if style.x_ratelimit() {
        let reset_at = (now_us.max(0) as u64 + reset_us).div_ceil(1_000_000);
        // A sub-bucket of a split global limit speaks for the whole: its
        // share times the shards (remaining: an estimate, see docs/operator/limits.md).
        out.push(("x-ratelimit-limit", HeaderValue::from(d.limit * c.shards)));
        out.push((
            "x-ratelimit-remaining",
            HeaderValue::from(d.remaining * c.shards),
        ));
        out.push(("x-ratelimit-reset", HeaderValue::from(reset_at)));
    }
    if style.ietf() {
        let mut policy = String::with_capacity(40 * checks.len());
        for (i, check) in checks.iter().enumerate() {
            if i > 0 {
                policy.push_str(", ");
            }
            let (q, w) = quota_window(&check.algorithm);
            let q = q * check.shards;
            let _ = write!(policy, "\"{}\";q={q};w={w}", check.policy_name());
        }
        let current = format!(
            "\"{}\";r={};t={}",
            c.policy_name(),
            d.remaining * c.shards,
            reset_us.div_ceil(1_000_000)
        );
        // Tier names and digits: always valid header text.
        for (name, text) in [("ratelimit-policy", policy), ("ratelimit", current)] {
            if let Ok(v) = HeaderValue::try_from(text) {
                out.push((name, v));
            }
        }
    }
    out
}

/// A rule as an IETF quota policy: q requests per w seconds.
pub(super) fn quota_window(alg: &Algorithm) -> (u64, u64) {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => (
            capacity,
            ((capacity as f64 / refill_per_sec).ceil() as u64).max(1),
        ),
        Algorithm::LeakyBucket { rate_per_sec, .. } => {
            let burst = quota(alg);
            (burst, ((burst as f64 / rate_per_sec).ceil() as u64).max(1))
        }
        Algorithm::FixedWindow { limit, window_secs }
        | Algorithm::SlidingWindow { limit, window_secs }
        | Algorithm::SlidingLog { limit, window_secs } => (limit, window_secs),
        Algorithm::Calendar { limit, period, .. } => (limit, period.nominal_secs()),
    }
}

/// Which backend decided, for the access log.
pub fn backend_of(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Decided { backend, .. } => backend.as_str(),
        Outcome::Remembered { .. } => crate::limiter::FallbackState::Redis.as_str(),
        Outcome::FailOpen => "fail-open",
        Outcome::FailClosed => "fail-closed",
    }
}
