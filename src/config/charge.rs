//! A route's `charge`: where the cost of a request is read once the
//! upstream has answered, what is taken at admission meanwhile, and its
//! cap. Limits with `cost = "response"` count in these units.

use std::ops::Range;
use std::sync::Arc;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::reader::{join, opt, req, Reader};

pub const CHARGE_KEYS: &[&str] = &[
    "response",
    "estimate",
    "default_estimate",
    "max",
    "charge_failed",
    "remaining_header",
];

/// The most one request may be charged (and a `max`'s largest value).
pub const MOST: u64 = 1 << 40;

#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    /// Where the cost is read, in order: the first that holds it.
    pub response: Vec<CostSource>,
    pub estimate: Estimate,
    /// Taken when `estimate`'s field is not in the request body; None: such
    /// a request is refused (400).
    pub default_estimate: Option<u64>,
    /// The most one request is charged.
    pub max: u64,
    /// Whether an answer the upstream failed (5xx, reset, timeout) is
    /// charged its estimate; false: refunded.
    pub charge_failed: bool,
    /// A response header telling the client the units it has left on the
    /// route's charged tiers (OpenAI's `x-ratelimit-remaining-tokens`);
    /// lower-case; None: only the `RateLimit` headers.
    pub remaining_header: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostSource {
    /// A response header (lower-case name).
    Header(String),
    /// A field of a JSON body, by object keys (`usage.total_tokens`).
    Json(JsonPath),
    /// That field in the last server-sent event holding it.
    Sse(JsonPath),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Estimate {
    /// A field of the request's JSON body (`max_tokens`).
    Json(JsonPath),
    Fixed(u64),
}

/// Object keys from a JSON document's root (`usage.total_tokens`), split
/// once when the config is read: a request's scanners share them rather
/// than splitting the text again before the first byte goes on.
#[derive(Clone, PartialEq, Eq)]
pub struct JsonPath {
    text: Box<str>,
    keys: Arc<[Box<[u8]>]>,
}

impl JsonPath {
    pub fn keys(&self) -> &Arc<[Box<[u8]>]> {
        &self.keys
    }
}

impl From<&str> for JsonPath {
    fn from(text: &str) -> Self {
        JsonPath {
            text: text.into(),
            keys: text.split('.').map(|k| k.as_bytes().into()).collect(),
        }
    }
}

impl std::fmt::Display for JsonPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::fmt::Debug for JsonPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

pub(super) fn read(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
) -> Option<Charge> {
    r.only_keys(p, t, CHARGE_KEYS);
    let response = req(r, t, p, Some(span), "response", |r, path, v| {
        let items = r.strings(path, v)?;
        if items.is_empty() {
            r.error(path, Some(&v.span()), "expected at least one source");
            return None;
        }
        let mut out = Vec::new();
        for (i, (s, at)) in items.iter().enumerate() {
            match source(s) {
                Ok(src) => out.push(src),
                Err(e) => r.error(&format!("{path}[{i}]"), Some(at), e),
            }
        }
        (out.len() == items.len()).then_some(out)
    });
    let max = req(r, t, p, Some(span), "max", |r, path, v| {
        r.int(path, v, 1, MOST)
    });
    let estimate = req(r, t, p, Some(span), "estimate", |r, path, v| {
        match v.get_ref() {
            DeValue::Integer(_) => r.int(path, v, 0, MOST).map(Estimate::Fixed),
            _ => {
                let s = r.string(path, v)?;
                match s.strip_prefix("json:").map(json_path) {
                    Some(Ok(path)) => Some(Estimate::Json(path)),
                    Some(Err(e)) => {
                        r.error(path, Some(&v.span()), e);
                        None
                    }
                    None => {
                        r.error(
                        path,
                        Some(&v.span()),
                        format!("expected \"json:PATH\" (a field of the request body) or a number, found \"{s}\""),
                    );
                        None
                    }
                }
            }
        }
    });
    let default_estimate = opt(r, t, p, "default_estimate", None, |r, path, v| {
        r.int(path, v, 0, MOST).map(Some)
    });
    let charge_failed = opt(r, t, p, "charge_failed", false, |r, path, v| {
        r.boolean(path, v)
    });
    let remaining_header = opt(r, t, p, "remaining_header", None, |r, path, v| {
        let s = r.string(path, v)?;
        match http::HeaderName::from_bytes(s.as_bytes()) {
            Ok(h) => Some(Some(h.as_str().to_string())),
            Err(_) => {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected a header name, found \"{s}\""),
                );
                None
            }
        }
    });
    let (response, max, estimate, default_estimate, charge_failed, remaining_header) = (
        response?,
        max?,
        estimate?,
        default_estimate?,
        charge_failed?,
        remaining_header?,
    );
    let over = |n: u64, key: &str, r: &mut Reader<'_>| {
        if n > max {
            let path = join(p, key);
            let at = t.get(key).map(Spanned::span);
            r.error(
                &path,
                at.as_ref(),
                format!("{n} is more than `max` ({max}): one request is never charged more"),
            );
        }
    };
    if let Estimate::Fixed(n) = estimate {
        over(n, "estimate", r);
    }
    if let Some(n) = default_estimate {
        over(n, "default_estimate", r);
    }
    Some(Charge {
        response,
        estimate,
        default_estimate,
        max,
        charge_failed,
        remaining_header,
    })
}

impl std::fmt::Display for Charge {
    /// As `gateway check` prints it: `response=sse:usage.total_tokens,...
    /// estimate=json:max_tokens default=1024 max=32768 failed=refunded`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sources: Vec<String> = self
            .response
            .iter()
            .map(|s| match s {
                CostSource::Header(n) => format!("header:{n}"),
                CostSource::Json(p) => format!("json:{p}"),
                CostSource::Sse(p) => format!("sse:{p}"),
            })
            .collect();
        write!(f, "response={}", sources.join(","))?;
        match &self.estimate {
            Estimate::Json(p) => write!(f, " estimate=json:{p}")?,
            Estimate::Fixed(n) => write!(f, " estimate={n}")?,
        }
        match self.default_estimate {
            Some(n) => write!(f, " default={n}")?,
            None => write!(f, " default=none (400)")?,
        }
        let failed = if self.charge_failed {
            "charged"
        } else {
            "refunded"
        };
        write!(f, " max={} failed={failed}", self.max)?;
        match &self.remaining_header {
            Some(h) => write!(f, " remaining_header={h}"),
            None => Ok(()),
        }
    }
}

fn source(s: &str) -> Result<CostSource, String> {
    let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
    match kind {
        "header" => {
            let ok = !rest.is_empty()
                && rest
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
            if ok {
                Ok(CostSource::Header(rest.to_ascii_lowercase()))
            } else {
                Err(format!(
                    "expected \"header:NAME\" with a header name, found \"{s}\""
                ))
            }
        }
        "json" => json_path(rest).map(CostSource::Json),
        "sse" => json_path(rest).map(CostSource::Sse),
        _ => Err(format!(
            "expected \"header:NAME\", \"json:PATH\" or \"sse:PATH\", found \"{s}\""
        )),
    }
}

/// Object keys joined by dots: `usage.total_tokens`.
fn json_path(s: &str) -> Result<JsonPath, String> {
    if !s.is_empty()
        && s.split('.')
            .all(|k| !k.is_empty() && !k.contains(['"', '\\']))
    {
        Ok(JsonPath::from(s))
    } else {
        Err(format!(
            "expected a path of object keys joined by dots (usage.total_tokens), found \"{s}\""
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_read_or_named_wrong() {
        assert_eq!(
            source("header:X-Usage-Tokens"),
            Ok(CostSource::Header("x-usage-tokens".into()))
        );
        assert_eq!(
            source("json:usage.total_tokens"),
            Ok(CostSource::Json("usage.total_tokens".into()))
        );
        assert_eq!(
            source("sse:usage.total_tokens"),
            Ok(CostSource::Sse("usage.total_tokens".into()))
        );
        for bad in [
            "header:",
            "header:a b",
            "body:x",
            "json:",
            "sse:a..b",
            "usage",
        ] {
            assert!(source(bad).is_err(), "{bad}");
        }
    }
}
