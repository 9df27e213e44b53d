//! A value that names a bucket: how long it may be, and why a request's
//! attribute or a token's claim cannot be one. Shared by `attributes`
//! (headers, query parameters) and `jwt` (claims).

use std::fmt;

/// The longest attribute value that names a bucket, in bytes.
pub const MAX_VALUE_BYTES: usize = 256;

/// Why a request's attribute cannot name a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttributeError {
    Missing,
    Repeated,
    /// Not visible ASCII (headers) or not UTF-8 once decoded (query).
    Unreadable,
    TooLong,
}

impl fmt::Display for AttributeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttributeError::Missing => "is missing or empty",
            AttributeError::Repeated => "is sent more than once",
            AttributeError::Unreadable => "is not readable text",
            AttributeError::TooLong => "is longer than 256 bytes",
        })
    }
}
