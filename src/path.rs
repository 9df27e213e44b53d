//! Request paths: one normalisation, shared by the router (what a route
//! matches), the config check (a route's prefix must already be normal) and
//! the upstream request (what the upstream receives), so the limiter and the
//! upstream can never disagree about which endpoint a request is for.
//! Anything ambiguous is refused rather than guessed.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathError {
    NotAbsolute,
    /// `%` not followed by two hex digits.
    MalformedEscape,
    /// `%2F`, `%5C` or `%00`: a separator or NUL hidden from the router.
    AmbiguousEscape(&'static str),
    /// A raw backslash or control character.
    ForbiddenByte,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathError::NotAbsolute => write!(f, "the path must start with '/'"),
            PathError::MalformedEscape => write!(f, "malformed percent-encoding in the path"),
            PathError::AmbiguousEscape(e) => {
                write!(f, "ambiguous percent-encoding {e} in the path")
            }
            PathError::ForbiddenByte => {
                write!(f, "backslash or control character in the path")
            }
        }
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Normalises a request path (no query): decodes percent-encoded unreserved
/// characters, upper-cases remaining escapes, collapses `//`, resolves `.` and
/// `..` (never above the root), keeps a trailing slash.
pub fn normalize_path(raw: &str) -> Result<String, PathError> {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    // Pass 1: percent-decoding of unreserved characters only.
    let mut decoded = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            ) else {
                return Err(PathError::MalformedEscape);
            };
            let v = hi * 16 + lo;
            match v {
                b'/' => return Err(PathError::AmbiguousEscape("%2F")),
                b'\\' => return Err(PathError::AmbiguousEscape("%5C")),
                0 => return Err(PathError::AmbiguousEscape("%00")),
                v if is_unreserved(v) => decoded.push(v as char),
                v => {
                    decoded.push('%');
                    decoded.push(char::from(b"0123456789ABCDEF"[(v >> 4) as usize]));
                    decoded.push(char::from(b"0123456789ABCDEF"[(v & 15) as usize]));
                }
            }
            i += 3;
            continue;
        }
        if b == b'\\' || b.is_ascii_control() {
            return Err(PathError::ForbiddenByte);
        }
        // Non-ASCII bytes arrive here only as part of valid UTF-8 (raw is &str).
        let ch_len = utf8_len(b);
        decoded.push_str(&raw[i..i + ch_len]);
        i += ch_len;
    }
    // Pass 2: segments.
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    for seg in decoded.split('/').skip(1) {
        trailing_slash = false;
        match seg {
            "" => trailing_slash = true,
            "." => trailing_slash = true,
            ".." => {
                segments.pop();
                trailing_slash = true;
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if segments.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(out)
}

fn utf8_len(first: u8) -> usize {
    match first {
        0x00..=0x7F => 1,
        0xC0..=0xDF => 2,
        0xE0..=0xEF => 3,
        _ => 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_table() {
        let ok = [
            ("/", "/"),
            ("//", "/"),
            ("/a//b", "/a/b"),
            ("/a/./b", "/a/b"),
            ("/a/../b", "/b"),
            ("/../../a", "/a"),
            ("/a/b/", "/a/b/"),
            ("/a/b/.", "/a/b/"),
            ("/a/b/..", "/a/"),
            ("/%61pi/rides", "/api/rides"),
            ("/api/%72ides", "/api/rides"),
            ("/a/%2e%2e/b", "/b"),
            ("/a%20b", "/a%20b"),
            ("/a%3bb", "/a%3Bb"),
            ("/caf\u{e9}", "/caf\u{e9}"),
        ];
        for (input, want) in ok {
            assert_eq!(
                normalize_path(input).as_deref(),
                Ok(want),
                "input {input:?}"
            );
        }
        let bad = [
            ("a", PathError::NotAbsolute),
            ("", PathError::NotAbsolute),
            ("/a%2Fb", PathError::AmbiguousEscape("%2F")),
            ("/a%2fb", PathError::AmbiguousEscape("%2F")),
            ("/a%5cb", PathError::AmbiguousEscape("%5C")),
            ("/a%00", PathError::AmbiguousEscape("%00")),
            ("/a%", PathError::MalformedEscape),
            ("/a%4", PathError::MalformedEscape),
            ("/a%zz", PathError::MalformedEscape),
            ("/a\\b", PathError::ForbiddenByte),
        ];
        for (input, want) in bad {
            assert_eq!(normalize_path(input), Err(want), "input {input:?}");
        }
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::normalize_path;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Never panics; what it returns is absolute, canonical and stable.
        #[test]
        fn normalised_paths_are_canonical(raw in "/[a-zA-Z0-9./%;~_\\-]{0,40}") {
            if let Ok(n) = normalize_path(&raw) {
                prop_assert!(n.starts_with('/'), "{raw:?} -> {n:?}");
                prop_assert!(!n.contains("//"), "{raw:?} -> {n:?}");
                for seg in n.split('/') {
                    prop_assert!(seg != "." && seg != "..", "{raw:?} -> {n:?}");
                }
                prop_assert!(!n.to_ascii_uppercase().contains("%2F"), "{raw:?} -> {n:?}");
                prop_assert_eq!(normalize_path(&n), Ok(n.clone()), "idempotent for {:?}", raw);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(raw in any::<String>()) {
            let _ = normalize_path(&raw);
        }
    }
}
