//! Bucket names: the one place a Redis key (or local map key) is built.
//!
//! Shape: `{prefix}:{tier}:{rule}:{fingerprint}:{identity}`. Every part but the
//! identity comes from validated config names ([A-Za-z0-9._-]); the identity
//! is escaped so it can never add a separator or a cluster hash tag. The
//! fingerprint encodes the algorithm and its parameters: a reload that keeps a
//! rule's parameters keeps its counters, one that changes them starts fresh
//! instead of misreading old state.

use std::fmt::Write;

use crate::config::Algorithm;

pub fn bucket_key(prefix: &str, tier: &str, rule: &str, alg: &Algorithm, identity: &str) -> String {
    bucket_name(&rule_prefix(prefix, tier, rule, alg), identity)
}

/// Everything of a rule's bucket names but the identity: built once per
/// config load (the fingerprint formats floats), not once per request.
pub fn rule_prefix(prefix: &str, tier: &str, rule: &str, alg: &Algorithm) -> String {
    format!("{prefix}:{tier}:{rule}:{}:", fingerprint(alg))
}

/// A bucket's name: its rule's prefix, then the escaped identity.
pub fn bucket_name(rule_prefix: &str, identity: &str) -> String {
    let mut k = String::with_capacity(rule_prefix.len() + identity.len() + 8);
    k.push_str(rule_prefix);
    escape_into(&mut k, identity);
    k
}

/// A quota bucket's lease ledger (`limiter.lua`): its name is the
/// bucket's in a hash tag, so it lives in the bucket's cluster slot (a
/// bucket's name never holds a brace: `escape_into`).
pub fn ledger_key(bucket: &str) -> String {
    format!("{{{bucket}}}:leases")
}

fn fingerprint(alg: &Algorithm) -> String {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => format!("tb-{capacity}-{refill_per_sec}"),
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => format!("lb-{rate_per_sec}-{max_delay_ms}"),
        Algorithm::FixedWindow { limit, window_secs } => format!("fw-{limit}-{window_secs}"),
        Algorithm::SlidingWindow { limit, window_secs } => format!("sw-{limit}-{window_secs}"),
        Algorithm::SlidingLog { limit, window_secs } => format!("sl-{limit}-{window_secs}"),
        // The period, not the limit: a plan changed mid-month keeps its
        // count (a quota is money); each period is a bucket of its own.
        Algorithm::Calendar { period, start, .. } => {
            format!("q-{}-{}", period.as_str(), start.div_euclid(1_000_000))
        }
    }
}

/// Percent-escapes everything outside [A-Za-z0-9._-] except the `:`, `/` and
/// `.` of addresses, which are kept readable; `{`, `}` and `%` are always escaped.
fn escape_into(out: &mut String, identity: &str) {
    for b in identity.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':' | b'/') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

/// An identity as `escape_into` wrote it, read back (`None`: not one it
/// could have written).
pub fn unescape(escaped: &str) -> Option<String> {
    let b = escaped.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_shape_and_escaping() {
        let alg = Algorithm::TokenBucket {
            capacity: 20,
            refill_per_sec: 10.0,
        };
        assert_eq!(
            bucket_key("rl", "ip", "ip", &alg, "ip:2001:db8::/64"),
            "rl:ip:ip:tb-20-10:ip:2001:db8::/64"
        );
        assert_eq!(
            bucket_key("rl", "route", "r", &alg, "k:a{b}%"),
            "rl:route:r:tb-20-10:k:a%7Bb%7D%25"
        );
        for id in ["k:a{b}%", "ip:2001:db8::/64", "k:ünï cødé*?[]"] {
            let mut k = String::new();
            escape_into(&mut k, id);
            assert_eq!(unescape(&k).as_deref(), Some(id));
        }
        assert_eq!(unescape("a%4"), None);
    }
}
