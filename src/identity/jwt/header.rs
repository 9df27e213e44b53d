//! A token's JOSE header read before `jsonwebtoken` reads it: what it asks
//! of the gateway (`crit`), and the name of an algorithm it cannot read.
//!
//! `crit` (RFC 7515 §4.1.11) lists header extensions the recipient must
//! understand and process, or refuse the token. The gateway understands
//! no extension, so a header carrying `crit` at all is refused, and the
//! reason says which rule it broke: a `crit` that is not a list of names,
//! an empty one, or one naming a parameter JWS itself defines are invalid
//! whatever the recipient understands; any other names an extension.
//! `jsonwebtoken` keeps `crit` without acting on it, so without this check
//! such a token would verify.

use base64::Engine as _;
use serde_json::{Map, Value};

use super::TokenError;

/// The header parameters RFC 7515 §4.1 defines: never extensions, so never
/// in `crit`.
const REGISTERED: &[&str] = &[
    "alg", "jku", "jwk", "kid", "x5u", "x5c", "x5t", "x5t#S256", "typ", "cty", "crit",
];

/// The token's header as a JSON object, if it is one.
fn object(token: &[u8]) -> Option<Map<String, Value>> {
    let encoded = token.split(|b| *b == b'.').next()?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .ok()?;
    serde_json::from_slice(&json).ok()
}

/// Refuses a header that carries `crit` (module doc). A header that is not
/// a JSON object is left to `jsonwebtoken`, which says it is malformed.
pub(super) fn critical(token: &[u8]) -> Result<(), TokenError> {
    let Some(crit) = object(token).and_then(|mut h| h.remove("crit")) else {
        return Ok(());
    };
    let names: Option<Vec<&str>> = match &crit {
        Value::Array(items) => items.iter().map(Value::as_str).collect(),
        _ => None,
    };
    Err(TokenError::Critical(match names {
        None => "is not a list of header names",
        Some(names) if names.is_empty() => "is empty",
        Some(names) if names.iter().any(|n| REGISTERED.contains(n)) => {
            "names a header parameter JWS itself defines"
        }
        Some(_) => "names an extension",
    }))
}

/// A header `jsonwebtoken` would not read: say `none` (or another unknown
/// algorithm) by name, else that the token is malformed.
pub(super) fn bad_header(token: &[u8]) -> TokenError {
    let alg = object(token).and_then(|h| h.get("alg")?.as_str().map(str::to_string));
    match alg {
        // Named back only if it reads as an algorithm: never echo a header.
        Some(a) if a.len() <= 12 && a.bytes().all(|b| b.is_ascii_alphanumeric()) => {
            TokenError::Algorithm(a)
        }
        Some(_) => TokenError::Algorithm("(unreadable)".into()),
        None => TokenError::Malformed("the header is not a JOSE header"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_header(header: &str) -> String {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.c2ln", b(header), b(r#"{"sub":"x"}"#))
    }

    #[test]
    fn any_crit_is_refused_for_the_rule_it_breaks() {
        let crit = |h: &str| critical(with_header(h).as_bytes());
        assert_eq!(crit(r#"{"alg":"RS256","kid":"k"}"#), Ok(()));
        assert_eq!(crit("not json"), Ok(()), "left to jsonwebtoken");
        let cases = [
            (
                r#"{"alg":"RS256","crit":["exp2"],"exp2":1}"#,
                "names an extension",
            ),
            (r#"{"alg":"RS256","crit":["exp2"]}"#, "names an extension"),
            (r#"{"alg":"RS256","crit":[]}"#, "is empty"),
            (
                r#"{"alg":"RS256","crit":["kid"],"kid":"k"}"#,
                "names a header parameter JWS itself defines",
            ),
            (
                r#"{"alg":"RS256","crit":["exp2","alg"]}"#,
                "names a header parameter JWS itself defines",
            ),
            (
                r#"{"alg":"RS256","crit":"exp2"}"#,
                "is not a list of header names",
            ),
            (
                r#"{"alg":"RS256","crit":[1]}"#,
                "is not a list of header names",
            ),
            (
                r#"{"alg":"RS256","crit":null}"#,
                "is not a list of header names",
            ),
        ];
        for (header, why) in cases {
            assert_eq!(crit(header), Err(TokenError::Critical(why)), "{header}");
        }
    }

    #[test]
    fn an_unreadable_header_names_its_algorithm_only_if_it_reads_as_one() {
        let bad = |h: &str| bad_header(with_header(h).as_bytes());
        assert_eq!(
            bad(r#"{"alg":"none"}"#),
            TokenError::Algorithm("none".into())
        );
        assert_eq!(
            bad(r#"{"alg":"<script>"}"#),
            TokenError::Algorithm("(unreadable)".into())
        );
        assert!(matches!(bad("[]"), TokenError::Malformed(_)));
    }
}
