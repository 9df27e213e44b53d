//! The request attributes a route limit can key on (`key = "header:NAME"`,
//! `"query:NAME"`, `"claim:NAME"` of a verified JWT): reading one value
//! from a request, or saying why not.
//!
//! A value names a bucket, so it must name exactly one: an attribute sent
//! twice is refused rather than guessed (the upstream may read the other
//! copy), query values are compared decoded (`%61cme` and `acme` are one
//! tenant), and the length is capped so a client cannot grow bucket names.

use http::HeaderMap;

use crate::config::Attribute;
use crate::identity::jwt::Verified;

pub use crate::identity::value::{AttributeError, MAX_VALUE_BYTES};

/// The attribute's value in this request.
pub fn value(
    attribute: &Attribute,
    headers: &HeaderMap,
    query: Option<&str>,
    token: Option<&Verified>,
) -> Result<String, AttributeError> {
    let v = match attribute {
        Attribute::Header(name) => header(headers, name)?,
        Attribute::Query(name) => query_param(query.unwrap_or(""), name)?,
        // Read (and checked) when the token was verified.
        Attribute::Claim(name) => token.ok_or(AttributeError::Missing)?.claim(name)?,
    };
    if v.is_empty() {
        Err(AttributeError::Missing)
    } else if v.len() > MAX_VALUE_BYTES {
        Err(AttributeError::TooLong)
    } else {
        Ok(v)
    }
}

fn header(headers: &HeaderMap, name: &str) -> Result<String, AttributeError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next().ok_or(AttributeError::Missing)?;
    if values.next().is_some() {
        return Err(AttributeError::Repeated);
    }
    let s = first.to_str().map_err(|_| AttributeError::Unreadable)?;
    Ok(s.trim().to_string())
}

fn query_param(query: &str, name: &str) -> Result<String, AttributeError> {
    let mut found = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if decode(k)? != name {
            continue;
        }
        if found.is_some() {
            return Err(AttributeError::Repeated);
        }
        found = Some(decode(v)?);
    }
    found.ok_or(AttributeError::Missing)
}

/// Form decoding, as most upstreams read a query: `+` is a space, `%XX` a byte.
pub fn decode(s: &str) -> Result<String, AttributeError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = b.get(i + 1..i + 3).ok_or(AttributeError::Unreadable)?;
                let hex = std::str::from_utf8(hex).map_err(|_| AttributeError::Unreadable)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| AttributeError::Unreadable)?);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| AttributeError::Unreadable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                http::HeaderValue::from_bytes(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn header_values() {
        let a = Attribute::Header("x-tenant-id".into());
        let v = |h: &HeaderMap| value(&a, h, None, None);
        assert_eq!(
            v(&headers(&[("X-Tenant-Id", b" acme ")])),
            Ok("acme".into())
        );
        assert_eq!(v(&headers(&[])), Err(AttributeError::Missing));
        assert_eq!(
            v(&headers(&[("x-tenant-id", b"")])),
            Err(AttributeError::Missing)
        );
        let twice = headers(&[("x-tenant-id", b"a"), ("x-tenant-id", b"a")]);
        assert_eq!(v(&twice), Err(AttributeError::Repeated));
        let bytes = headers(&[("x-tenant-id", b"caf\xc3\xa9")]);
        assert_eq!(v(&bytes), Err(AttributeError::Unreadable));
        let long = vec![b'a'; MAX_VALUE_BYTES + 1];
        assert_eq!(
            v(&headers(&[("x-tenant-id", &long)])),
            Err(AttributeError::TooLong)
        );
        let exact = vec![b'a'; MAX_VALUE_BYTES];
        assert!(v(&headers(&[("x-tenant-id", &exact)])).is_ok());
    }

    #[test]
    fn query_values_are_decoded_and_unique() {
        let a = Attribute::Query("tenant".into());
        let v = |q: &str| value(&a, &HeaderMap::new(), Some(q), None);
        assert_eq!(v("tenant=acme"), Ok("acme".into()));
        assert_eq!(v("x=1&tenant=%61cme&y"), Ok("acme".into()));
        assert_eq!(v("ten%61nt=a+b%20c"), Ok("a b c".into()));
        assert_eq!(v("tenantx=1&xtenant=2"), Err(AttributeError::Missing));
        assert_eq!(v("tenant"), Err(AttributeError::Missing));
        assert_eq!(v("tenant=a&tenant=b"), Err(AttributeError::Repeated));
        assert_eq!(v("tenant=%zz"), Err(AttributeError::Unreadable));
        assert_eq!(v("tenant=%ff"), Err(AttributeError::Unreadable));
        assert_eq!(v("tenant=%6"), Err(AttributeError::Unreadable));
        assert_eq!(
            value(&a, &HeaderMap::new(), None, None),
            Err(AttributeError::Missing)
        );
    }
}
