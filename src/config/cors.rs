//! `cors` (a route's) and `[cors]` (every other route's): the cross-origin
//! policy a browser-facing route answers preflights with.

use std::ops::Range;

use toml::de::DeTable;

use super::model::{AllowHeaders, Cors, OriginPattern};
use super::reader::{opt, req};
use super::reader::{Reader, Value};

pub const CORS_KEYS: &[&str] = &[
    "allow_origins",
    "allow_methods",
    "allow_headers",
    "expose_headers",
    "allow_credentials",
    "max_age_secs",
    "charge_preflight",
];

/// Reads a policy at `p`; `route_methods` are its route's (a route's own
/// policy may not allow a method the route refuses).
pub(super) fn read(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    route_methods: Option<&[String]>,
) -> Option<Cors> {
    r.only_keys(p, t, CORS_KEYS);
    let origins = req(r, t, p, Some(span), "allow_origins", origins);
    let methods = opt(r, t, p, "allow_methods", None, |r, path, v| {
        let items = r.strings(path, v)?;
        let mut ok = true;
        let mut out = Vec::new();
        for (i, (m, s)) in items.iter().enumerate() {
            let known = super::routes::METHODS.contains(&m.as_str());
            let taken = route_methods.is_none_or(|ms| ms.contains(m));
            if !known {
                r.error(
                    &format!("{path}[{i}]"),
                    Some(s),
                    format!("expected an upper-case HTTP method, found \"{m}\""),
                );
            } else if !taken {
                r.error(
                    &format!("{path}[{i}]"),
                    Some(s),
                    format!(
                        "the route does not take {m} (its methods: {})",
                        route_methods.unwrap_or_default().join(", ")
                    ),
                );
            }
            ok &= known && taken;
            out.push(m.clone());
        }
        ok.then_some(Some(out))
    });
    let headers = opt(
        r,
        t,
        p,
        "allow_headers",
        AllowHeaders::List(Vec::new()),
        |r, path, v| {
            let names = header_names(r, path, v, true)?;
            Some(match names.iter().any(|n| n == "*") {
                true => AllowHeaders::Any,
                false => AllowHeaders::List(names),
            })
        },
    );
    let expose = opt(r, t, p, "expose_headers", Vec::new(), |r, path, v| {
        header_names(r, path, v, false)
    });
    let credentials = opt(r, t, p, "allow_credentials", false, |r, path, v| {
        r.boolean(path, v)
    });
    let max_age = opt(r, t, p, "max_age_secs", None, |r, path, v| {
        r.int(path, v, 0, 86_400).map(Some)
    });
    let charge = opt(r, t, p, "charge_preflight", false, |r, path, v| {
        r.boolean(path, v)
    });
    let cors = Cors {
        allow_origins: origins?,
        allow_methods: methods?,
        allow_headers: headers?,
        expose_headers: expose?,
        allow_credentials: credentials?,
        max_age_secs: max_age?,
        charge_preflight: charge?,
    };
    // Browsers refuse a credentialed answer that says "*": a policy that
    // could only ever fail is a config error, not a runtime surprise.
    if cors.allow_credentials {
        let line = r.spans.get(&format!("{p}.allow_credentials")).cloned();
        if cors.allow_origins.contains(&OriginPattern::Any) {
            r.error(
                &format!("{p}.allow_origins"),
                line.as_ref(),
                "\"*\" cannot be combined with allow_credentials = true (browsers refuse it): list the origins",
            );
            return None;
        }
        if cors.allow_headers == AllowHeaders::Any {
            r.error(
                &format!("{p}.allow_headers"),
                line.as_ref(),
                "\"*\" cannot be combined with allow_credentials = true (browsers read it as a header named \"*\"): list the headers",
            );
            return None;
        }
    }
    Some(cors)
}

fn origins(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<Vec<OriginPattern>> {
    let items = r.strings(path, v)?;
    if items.is_empty() {
        r.error(
            path,
            Some(&v.span()),
            "expected at least one origin (\"*\" for any)",
        );
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for (i, (s, span)) in items.iter().enumerate() {
        match origin_pattern(s) {
            Ok(o) => out.push(o),
            Err(why) => {
                ok = false;
                r.error(&format!("{path}[{i}]"), Some(span), why);
            }
        }
    }
    ok.then_some(out)
}

/// `*`, `scheme://host[:port]` or `scheme://*.host[:port]`, as a browser
/// serialises an origin: no path, no trailing slash.
fn origin_pattern(s: &str) -> Result<OriginPattern, String> {
    if s == "*" {
        return Ok(OriginPattern::Any);
    }
    let expected = || {
        format!("expected \"*\" or an origin like \"https://app.example.com\" or \"https://*.example.com\" (scheme, host and port only), found \"{s}\"")
    };
    let lower = s.to_ascii_lowercase();
    let (scheme, rest) = lower.split_once("://").ok_or_else(expected)?;
    let scheme_ok = scheme.starts_with(|c: char| c.is_ascii_lowercase())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (h, Some(p)),
        _ => (rest, None),
    };
    let (wild, host) = match host.strip_prefix("*.") {
        Some(h) => (true, h),
        None => (false, host),
    };
    let host_ok = !host.is_empty()
        && (host.starts_with('[') && host.ends_with(']')
            || host.split('.').all(|l| {
                !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            }));
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    if !(scheme_ok && host_ok && port_ok) {
        if rest.contains('/') {
            return Err(format!(
                "an origin has no path (write \"{scheme}://{}\"), found \"{s}\"",
                rest.split('/').next().unwrap_or_default()
            ));
        }
        return Err(expected());
    }
    Ok(if wild {
        OriginPattern::Subdomains {
            scheme: format!("{scheme}://"),
            suffix: lower[scheme.len() + 4..].to_string(),
        }
    } else {
        OriginPattern::Exact(lower)
    })
}

/// Header names (tokens), lower-cased; `*` only where `star` allows it.
fn header_names(r: &mut Reader<'_>, path: &str, v: &Value<'_>, star: bool) -> Option<Vec<String>> {
    let items = r.strings(path, v)?;
    let mut ok = true;
    let mut out = Vec::new();
    for (i, (s, span)) in items.iter().enumerate() {
        let valid = (star && s == "*")
            || http::HeaderName::from_bytes(s.as_bytes()).is_ok() && !s.contains('*');
        if valid {
            out.push(s.to_ascii_lowercase());
        } else {
            ok = false;
            let what = match star {
                true => "a header name or \"*\"",
                false => "a header name",
            };
            r.error(
                &format!("{path}[{i}]"),
                Some(span),
                format!("expected {what}, found \"{s}\""),
            );
        }
    }
    ok.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_read_as_browsers_send_them() {
        assert_eq!(origin_pattern("*"), Ok(OriginPattern::Any));
        assert_eq!(
            origin_pattern("HTTPS://App.Example.com"),
            Ok(OriginPattern::Exact("https://app.example.com".into()))
        );
        assert_eq!(
            origin_pattern("http://localhost:3000"),
            Ok(OriginPattern::Exact("http://localhost:3000".into()))
        );
        assert_eq!(
            origin_pattern("https://*.example.com"),
            Ok(OriginPattern::Subdomains {
                scheme: "https://".into(),
                suffix: ".example.com".into()
            })
        );
        assert_eq!(
            origin_pattern("http://[::1]:8080"),
            Ok(OriginPattern::Exact("http://[::1]:8080".into()))
        );
        let e = origin_pattern("https://app.example.com/").unwrap_err();
        assert!(
            e.contains("has no path (write \"https://app.example.com\")"),
            "{e}"
        );
        for bad in [
            "app.example.com",
            "https://",
            "https://a.com:0",
            "https://a b.com",
            "*.example.com",
        ] {
            assert!(origin_pattern(bad).is_err(), "{bad} accepted");
        }
    }
}
