//! `[[routes]]`: what a route matches (host, path prefix, methods), where it
//! goes (upstream, prefix stripping, timeout, retries), what it limits, and
//! how large a body it takes.

use std::ops::Range;

use toml::de::DeTable;

use super::limits::limit;
use super::model::{HostPattern, Route};
use super::reader::{join, Reader};
use super::reader::{name, opt, req};
use crate::path::normalize_path;

pub(super) const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT",
];

pub const ROUTE_KEYS: &[&str] = &[
    "name",
    "path_prefix",
    "methods",
    "upstream",
    "require_api_key",
    "limit",
    "limit_by_plan",
    "host",
    "strip_prefix",
    "timeout_ms",
    "retries",
    "max_request_body_bytes",
    "cors",
    "max_in_flight",
    "queue",
    "queue_timeout_ms",
    "pool_max_in_flight",
    "max_in_flight_per_client",
    "charge",
];

pub(super) fn route(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    upstreams: &[String],
    plans: &[String],
) -> Option<Route> {
    r.only_keys(p, t, ROUTE_KEYS);
    let in_flight = super::inflight::read(r, p, t, false);
    let per_client = opt(r, t, p, "max_in_flight_per_client", None, |r, path, v| {
        r.int(path, v, 1, 1 << 20).map(|n| Some(n as u32))
    });
    let rname = req(r, t, p, Some(span), "name", name);
    let prefix = req(r, t, p, Some(span), "path_prefix", |r, path, v| {
        let s = r.string(path, v)?;
        match normalize_path(&s) {
            Ok(n) if n == s => Some(s),
            Ok(n) => {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected a normalised path, found \"{s}\" (write \"{n}\")"),
                );
                None
            }
            Err(e) => {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected a path starting with '/': {e}"),
                );
                None
            }
        }
    });
    let methods = opt(r, t, p, "methods", None, |r, path, v| {
        let items = r.strings(path, v)?;
        let mut ok = !items.is_empty();
        if items.is_empty() {
            r.error(
                path,
                Some(&v.span()),
                "expected at least one method (omit the key for all)",
            );
        }
        let mut out = Vec::new();
        for (i, (m, s)) in items.iter().enumerate() {
            if METHODS.contains(&m.as_str()) {
                out.push(m.clone());
            } else {
                ok = false;
                r.error(
                    &format!("{path}[{i}]"),
                    Some(s),
                    format!(
                        "expected an upper-case HTTP method ({}), found \"{m}\"",
                        METHODS.join(", ")
                    ),
                );
            }
        }
        ok.then_some(Some(out))
    });
    let upstream = req(r, t, p, Some(span), "upstream", |r, path, v| {
        let name = r.string(path, v)?;
        if upstreams.contains(&name) {
            Some(name)
        } else {
            r.error(
                path,
                Some(&v.span()),
                format!(
                    "upstream \"{name}\" is not defined; defined upstreams: [{}]",
                    upstreams.join(", ")
                ),
            );
            None
        }
    });
    let require_key = opt(r, t, p, "require_api_key", false, |r, path, v| {
        r.boolean(path, v)
    });
    let lim = match t.get("limit") {
        Some(v) => {
            let path = join(p, "limit");
            let lt = r.table(&path, v)?;
            Some(limit(r, &path, lt, &v.span(), true)?)
        }
        None => None,
    };
    // A plan's own route limit, in place of `limit` for its keys.
    let by_plan = match t.get("limit_by_plan") {
        Some(v) => {
            let path = join(p, "limit_by_plan");
            let bt = r.table(&path, v)?;
            let mut out = std::collections::BTreeMap::new();
            let mut ok = true;
            for (plan, lv) in bt.iter() {
                let plan = plan.get_ref().to_string();
                let at = join(&path, &plan);
                if !plans.contains(&plan) {
                    r.error(
                        &at,
                        Some(&lv.span()),
                        format!(
                            "plan \"{plan}\" is not defined; defined plans: [{}]",
                            plans.join(", ")
                        ),
                    );
                    ok = false;
                    continue;
                }
                match r
                    .table(&at, lv)
                    .and_then(|lt| limit(r, &at, lt, &lv.span(), true))
                {
                    Some(l) => {
                        out.insert(plan, l);
                    }
                    None => ok = false,
                }
            }
            if !ok {
                return None;
            }
            out
        }
        None => std::collections::BTreeMap::new(),
    };
    let host = opt(r, t, p, "host", None, |r, path, v| {
        let s = r.string(path, v)?;
        match host_pattern(&s) {
            Some(h) => Some(Some(h)),
            None => {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected a host name or \"*.example.com\" (no port), found \"{s}\""),
                );
                None
            }
        }
    });
    let strip = opt(r, t, p, "strip_prefix", false, |r, path, v| {
        r.boolean(path, v)
    });
    let timeout = opt(r, t, p, "timeout_ms", None, |r, path, v| {
        r.int(path, v, 1, 3_600_000).map(Some)
    });
    let retries = opt(r, t, p, "retries", 0, |r, path, v| {
        r.int(path, v, 0, 2).map(|n| n as u32)
    });
    let max_body = opt(r, t, p, "max_request_body_bytes", None, |r, path, v| {
        r.int(path, v, 0, 1 << 40).map(Some)
    });
    let cors = match t.get("cors") {
        Some(v) => {
            let path = join(p, "cors");
            let ct = r.table(&path, v)?;
            let own = methods.as_ref().and_then(|m| m.as_deref());
            Some(super::cors::read(r, &path, ct, &v.span(), own)?)
        }
        None => None,
    };
    let charge = match t.get("charge") {
        Some(v) => {
            let path = join(p, "charge");
            let ct = r.table(&path, v)?;
            Some(std::sync::Arc::new(super::charge::read(
                r,
                &path,
                ct,
                &v.span(),
            )?))
        }
        None => None,
    };
    // A limit counting charged units needs the route to say what they are.
    if charge.is_none() {
        let charged = lim.iter().map(|l| ("limit".to_string(), l)).chain(
            by_plan
                .iter()
                .map(|(plan, l)| (format!("limit_by_plan.{plan}"), l)),
        );
        if let Some((at, _)) = charged.into_iter().find(|(_, l)| l.charged) {
            r.error(
                &join(&join(p, &at), "cost"),
                Some(span),
                "cost = \"response\" counts the units the route's `charge` reads: the route has no `charge`",
            );
            return None;
        }
    }
    Some(Route {
        charge,
        name: rname?,
        host: host?,
        path_prefix: prefix?,
        methods: methods?,
        upstream: upstream?,
        require_api_key: require_key?,
        limit: lim,
        limit_by_plan: by_plan,
        strip_prefix: strip?,
        timeout_ms: timeout?,
        retries: retries?,
        max_request_body_bytes: max_body?,
        cors,
        in_flight: in_flight?,
        max_in_flight_per_client: per_client?,
    })
}

/// A host name (letters, digits, `-`, `.`), or `*.` and one; lower-cased.
fn host_pattern(s: &str) -> Option<HostPattern> {
    let s = s.to_ascii_lowercase();
    let (wild, name) = match s.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, s.as_str()),
    };
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    valid.then(|| {
        if wild {
            HostPattern::Wildcard(format!(".{name}"))
        } else {
            HostPattern::Exact(name.to_string())
        }
    })
}
