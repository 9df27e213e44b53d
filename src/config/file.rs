//! Reads `gateway.toml` into the validated model: the file's top level and
//! the checks across sections (a route's upstream, a key's plan, duplicate
//! routes and keys).
//!
//! Each section has a file of its own (`server`, `tls`, `admin`, `log`,
//! `limiter`, `redis`, `clients`, `auth`, `limits`, `upstreams`, `routes`,
//! `cors`),
//! written with the typed helpers of `reader.rs`, that lists the keys it knows
//! (anything else is an error), reads them with their types and ranges, and
//! applies the documented default when a key is absent.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use toml::de::{DeTable, DeValue};

use super::limits::{api_key, limit, plans};
use super::model::*;
use super::reader::Reader;
use super::ConfigError;

pub const ROOT_KEYS: &[&str] = &[
    "server",
    "admin",
    "limiter",
    "redis",
    "clients",
    "tiers",
    "plans",
    "api_keys",
    "upstreams",
    "routes",
    "cors",
    "log",
    "auth",
    "tracing",
];
pub const TIERS_KEYS: &[&str] = &["ip"];

/// Parses and validates a whole file; on failure returns every problem found.
pub fn parse(src: &str, check: Option<super::FileCheck<'_>>) -> Result<Config, Vec<ConfigError>> {
    let root = match DeTable::parse(src) {
        Ok(t) => t,
        Err(e) => {
            let mut r = Reader::new(src);
            let span = e.span();
            r.error("(syntax)", span.as_ref(), e.message().trim().to_string());
            return Err(r.errors);
        }
    };
    let mut r = Reader::new(src);
    let root = root.get_ref();
    r.only_keys("", root, ROOT_KEYS);

    let server = section(&mut r, root, "server", true).map(|t| super::server::read(&mut r, t));
    let admin_t = section(&mut r, root, "admin", false);
    let admin = super::admin::read(&mut r, admin_t);
    let log_t = section(&mut r, root, "log", false);
    let log = super::log::read(&mut r, log_t);
    let tracing = section(&mut r, root, "tracing", false).map(|t| super::traces::read(&mut r, t));
    let redis = section(&mut r, root, "redis", false).map(|t| super::redis::read(&mut r, t));
    let limiter_t = section(&mut r, root, "limiter", false);
    let limiter = super::limiter::read(&mut r, limiter_t, redis.is_some());
    let clients_t = section(&mut r, root, "clients", false);
    let clients = super::clients::read(&mut r, clients_t);
    let ip_tier = section(&mut r, root, "tiers", false).and_then(|t| {
        r.only_keys("tiers", t, TIERS_KEYS);
        let v = t.get("ip")?;
        let ip = r.table("tiers.ip", v)?;
        limit(&mut r, "tiers.ip", ip, &v.span(), false)
    });
    let plans_t = section(&mut r, root, "plans", false);
    let plans = plans(&mut r, plans_t);
    // Names as written, even in entries that have other errors, so that one
    // mistake does not hide (or invent) a reference error elsewhere.
    let plan_names: Vec<String> = plans_t
        .map(|t| t.iter().map(|(k, _)| k.get_ref().to_string()).collect())
        .unwrap_or_default();
    let auth_t = section(&mut r, root, "auth", false);
    let jwt = super::auth::read(&mut r, auth_t, &plan_names);
    let upstream_names: Vec<String> = raw_names(&mut r, root, "upstreams", "name")
        .into_iter()
        .map(|(_, n)| n)
        .collect();
    raw_names(&mut r, root, "routes", "name");
    raw_names(&mut r, root, "api_keys", "id");

    let api_keys = array_of_tables(&mut r, root, "api_keys", false, |r, p, t, s| {
        api_key(r, p, t, s, &plan_names)
    });
    let upstreams = array_of_tables(&mut r, root, "upstreams", true, |r, p, t, s| {
        super::upstreams::read(r, p, t, s)
    });
    let cors = match root.get("cors") {
        Some(v) => r
            .table("cors", v)
            .map(|t| super::cors::read(&mut r, "cors", t, &v.span(), None)),
        None => Some(None),
    };
    let routes = array_of_tables(&mut r, root, "routes", true, |r, p, t, s| {
        super::routes::route(r, p, t, s, &upstream_names, &plan_names)
    });

    if let Some(None) = &jwt {
        for (i, route) in &routes {
            let claim = route
                .limit
                .iter()
                .chain(route.limit_by_plan.values())
                .find_map(|l| match l.key.attribute() {
                    Some(Attribute::Claim(c)) => Some(c.clone()),
                    _ => None,
                });
            if let Some(c) = claim {
                let at = format!("routes[{i}]");
                let span = r.spans.get(&format!("{at}.name")).cloned();
                r.error(
                    &at,
                    span.as_ref(),
                    format!("a limit keyed on claim:{c} needs [[auth.jwt.issuers]] to verify it"),
                );
            }
        }
    }
    if let Some(limiter) = &limiter {
        if limiter.backend == Backend::Redis && redis.is_none() {
            r.error(
                "redis",
                None,
                "limiter.backend = \"redis\" needs a [redis] section",
            );
        }
    }
    let mut digests: HashMap<[u8; 32], usize> = HashMap::new();
    for (i, key) in &api_keys {
        if let Some(first) = digests.insert(key.digest, *i) {
            let span = r.spans.get(&format!("api_keys[{i}].id")).cloned();
            r.error(
                &format!("api_keys[{i}]"),
                span.as_ref(),
                format!("the same key as api_keys[{first}]"),
            );
        }
    }
    for (n, (i, route)) in routes.iter().enumerate() {
        for (j, other) in routes.iter().take(n).map(|(j, o)| (j, o)) {
            if other.path_prefix == route.path_prefix
                && other.host == route.host
                && methods_overlap(&other.methods, &route.methods)
            {
                let path = format!("routes[{i}].path_prefix");
                let span = r.spans.get(&path).cloned();
                r.error(
                    &path,
                    span.as_ref(),
                    format!(
                        "\"{}\" with overlapping methods is already routed by routes[{j}] (\"{}\")",
                        route.path_prefix, other.name
                    ),
                );
            }
        }
    }

    if let (Some(check), Some(Some(srv))) = (check, &server) {
        if let Some(tls) = &srv.tls {
            r.errors.extend(check(tls));
        }
    }
    let api_keys: Vec<ApiKey> = api_keys.into_iter().map(|(_, k)| k).collect();
    if !r.errors.is_empty() {
        let mut errors = r.errors;
        errors.sort_by_key(|e| e.line.unwrap_or(0));
        return Err(errors);
    }
    // Every piece is Some when no error was recorded.
    Ok(Config {
        server: server.flatten().expect("server read without error"),
        admin: admin.expect("admin read without error"),
        log: log.expect("log read without error"),
        limiter: limiter.expect("limiter read without error"),
        redis: redis.flatten(),
        clients: clients.expect("clients read without error"),
        ip_tier,
        plans: plans.expect("plans read without error"),
        api_keys,
        upstreams: upstreams.into_iter().map(|(_, u)| u).collect(),
        routes: routes.into_iter().map(|(_, r)| r).collect(),
        cors: cors.flatten(),
        jwt: jwt.flatten(),
        tracing: tracing.flatten(),
        lines: Arc::new(
            r.spans
                .iter()
                .map(|(path, span)| (path.clone(), r.line_of(span)))
                .collect(),
        ),
    })
}

fn methods_overlap(a: &Option<Vec<String>>, b: &Option<Vec<String>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.iter().any(|m| b.contains(m)),
        _ => true,
    }
}

/// The `field` of every entry of an array of tables, as written, reporting
/// duplicates at the duplicate's line.
fn raw_names(
    r: &mut Reader<'_>,
    root: &DeTable<'_>,
    section: &str,
    field: &str,
) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut first: HashMap<String, usize> = HashMap::new();
    let Some(DeValue::Array(items)) = root.get(section).map(|v| v.get_ref()) else {
        return out;
    };
    for (i, item) in items.iter().enumerate() {
        let DeValue::Table(t) = item.get_ref() else {
            continue;
        };
        let Some(v) = t.get(field) else { continue };
        let DeValue::String(name) = v.get_ref() else {
            continue;
        };
        if let Some(first) = first.get(name.as_ref()) {
            r.error(
                &format!("{section}[{i}].{field}"),
                Some(&v.span()),
                format!("duplicate {field} \"{name}\" (first at {section}[{first}])"),
            );
        }
        first.entry(name.to_string()).or_insert(i);
        out.push((i, name.to_string()));
    }
    out
}

/// A top-level table, or an error if it is required and missing or not a table.
fn section<'a, 'i>(
    r: &mut Reader<'_>,
    root: &'a DeTable<'i>,
    key: &str,
    required: bool,
) -> Option<&'a DeTable<'i>> {
    match root.get(key) {
        Some(v) => r.table(key, v),
        None => {
            if required {
                r.error(key, None, format!("missing required section [{key}]"));
            }
            None
        }
    }
}

fn array_of_tables<T>(
    r: &mut Reader<'_>,
    root: &DeTable<'_>,
    key: &str,
    required: bool,
    mut read: impl FnMut(&mut Reader<'_>, &str, &DeTable<'_>, &Range<usize>) -> Option<T>,
) -> Vec<(usize, T)> {
    let mut out = Vec::new();
    let Some(v) = root.get(key) else {
        if required {
            r.error(
                key,
                None,
                format!("at least one [[{key}]] entry is required"),
            );
        }
        return out;
    };
    let Some(items) = r.array(key, v) else {
        return out;
    };
    if required && items.is_empty() {
        r.error(
            key,
            Some(&v.span()),
            format!("at least one [[{key}]] entry is required"),
        );
    }
    for (i, item) in items.iter().enumerate() {
        let path = format!("{key}[{i}]");
        if let Some(t) = r.table(&path, item) {
            if let Some(x) = read(r, &path, t, &item.span()) {
                out.push((i, x));
            }
        }
    }
    out
}
