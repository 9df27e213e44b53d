//! The rules a key's values follow wherever the key is written: in
//! `[[api_keys]]` (read with line numbers by `limits.rs`), on a line of
//! `clients.api_keys_file` and in a runtime record in Redis
//! (read by the `identity` room). Pure: each says what is wrong, and its caller
//! says where.

use sha2::{Digest, Sha256};

use crate::calendar::Period;
use crate::config::Quota;

/// The largest quota limit (and the largest key capacity) taken.
pub const MAX_COUNT: u64 = 1 << 40;

/// A key has one quota per calendar period and unit (requests, or the
/// charged units of `cost = "response"`): `period` may join `so_far`.
pub fn new_period(so_far: &[Quota], period: Period, charged: bool) -> Result<(), String> {
    if so_far
        .iter()
        .any(|q| q.period == period && q.charged == charged)
    {
        let unit = if charged { "charged-units " } else { "" };
        return Err(format!(
            "a {unit}{} quota is already given: one quota per period and unit",
            period.as_str()
        ));
    }
    Ok(())
}

/// A name that ends up in metric labels and Redis keys (ids, routes,
/// upstreams): a closed, safe alphabet.
pub fn name(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "expected 1-64 characters of [A-Za-z0-9._-], found \"{s}\""
        ))
    }
}

/// A key's plan must be one of `defined`.
pub fn plan<'a>(plan: &str, mut defined: impl Iterator<Item = &'a str>) -> Result<(), String> {
    let names: Vec<&str> = defined.by_ref().collect();
    if names.contains(&plan) {
        return Ok(());
    }
    Err(format!(
        "plan \"{plan}\" is not defined; defined plans: [{}]",
        names.join(", ")
    ))
}

/// The digest of a plaintext `key`.
pub fn secret(key: &str) -> Result<[u8; 32], String> {
    if key.is_empty() {
        return Err("expected a non-empty key".into());
    }
    Ok(Sha256::digest(key.as_bytes()).into())
}

/// A `sha256` value: 64 hex digits. Only its shape is said back: a digest
/// is not the secret, but it is not for logs either.
pub fn sha256(hex_str: &str) -> Result<[u8; 32], String> {
    let mut d = [0u8; 32];
    hex::decode_to_slice(hex_str.trim(), &mut d).map_err(|_| {
        format!(
            "expected 64 hex digits (a SHA-256 digest), found {} characters",
            hex_str.chars().count()
        )
    })?;
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules() {
        assert!(name("rider-1.a_b").is_ok());
        assert!(name("").is_err() && name("a b").is_err() && name(&"x".repeat(65)).is_err());
        assert!(plan("pro", ["free", "pro"].into_iter()).is_ok());
        assert_eq!(
            plan("gold", ["free", "pro"].into_iter()).unwrap_err(),
            "plan \"gold\" is not defined; defined plans: [free, pro]"
        );
        assert!(secret("").is_err());
        assert_eq!(
            secret("k").unwrap(),
            sha256(&hex::encode(Sha256::digest(b"k"))).unwrap()
        );
        assert!(sha256("abc").unwrap_err().contains("found 3 characters"));
    }
}
