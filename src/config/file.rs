//! Reads `gateway.toml` into the validated model, section by section.
//!
//! Each section lists the keys it knows (anything else is an error), reads them
//! with their types and ranges, and applies the documented default when a key
//! is absent. Cross-references (a route's upstream, a key's plan) are checked
//! once every section has been read.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ops::Range;

use ipnet::IpNet;
use sha2::{Digest, Sha256};
use toml::de::{DeTable, DeValue};

use super::model::*;
use super::reader::{join, Reader, Value};
use super::ConfigError;

/// Parses and validates a whole file; on failure returns every problem found.
pub fn parse(src: &str) -> Result<Config, Vec<ConfigError>> {
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
    r.only_keys(
        "",
        root,
        &[
            "server",
            "limiter",
            "redis",
            "clients",
            "tiers",
            "plans",
            "api_keys",
            "upstreams",
            "routes",
        ],
    );

    let server = section(&mut r, root, "server", true).map(|t| server(&mut r, t));
    let redis = section(&mut r, root, "redis", false).map(|t| super::redis::read(&mut r, t));
    let limiter_t = section(&mut r, root, "limiter", false);
    let limiter = limiter(&mut r, limiter_t, redis.is_some());
    let clients_t = section(&mut r, root, "clients", false);
    let clients = clients(&mut r, clients_t);
    let ip_tier = section(&mut r, root, "tiers", false).and_then(|t| {
        r.only_keys("tiers", t, &["ip"]);
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
    let routes = array_of_tables(&mut r, root, "routes", true, |r, p, t, s| {
        super::routes::route(r, p, t, s, &upstream_names)
    });

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

    if !r.errors.is_empty() {
        let mut errors = r.errors;
        errors.sort_by_key(|e| e.line.unwrap_or(0));
        return Err(errors);
    }
    // Every piece is Some when no error was recorded.
    Ok(Config {
        server: server.flatten().expect("server read without error"),
        limiter: limiter.expect("limiter read without error"),
        redis: redis.flatten(),
        clients: clients.expect("clients read without error"),
        ip_tier,
        plans: plans.expect("plans read without error"),
        api_keys: api_keys.into_iter().map(|(_, k)| k).collect(),
        upstreams: upstreams.into_iter().map(|(_, u)| u).collect(),
        routes: routes.into_iter().map(|(_, r)| r).collect(),
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
        if let Some((first, _)) = out.iter().find(|(_, n)| n == name.as_ref()) {
            r.error(
                &format!("{section}[{i}].{field}"),
                Some(&v.span()),
                format!("duplicate {field} \"{name}\" (first at {section}[{first}])"),
            );
        }
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

/// Reads an optional key with `read`, or returns `default` when it is absent.
/// `None` means the key was present but wrong (already reported).
pub(super) fn opt<T>(
    r: &mut Reader<'_>,
    t: &DeTable<'_>,
    path: &str,
    key: &str,
    default: T,
    read: impl FnOnce(&mut Reader<'_>, &str, &Value<'_>) -> Option<T>,
) -> Option<T> {
    match t.get(key) {
        Some(v) => {
            r.spans.insert(join(path, key), v.span());
            read(r, &join(path, key), v)
        }
        None => Some(default),
    }
}

/// Reads a required key, reporting its absence against the table's line.
pub(super) fn req<T>(
    r: &mut Reader<'_>,
    t: &DeTable<'_>,
    path: &str,
    span: Option<&Range<usize>>,
    key: &str,
    read: impl FnOnce(&mut Reader<'_>, &str, &Value<'_>) -> Option<T>,
) -> Option<T> {
    match t.get(key) {
        Some(v) => {
            r.spans.insert(join(path, key), v.span());
            read(r, &join(path, key), v)
        }
        None => {
            r.error(&join(path, key), span, "missing required key");
            None
        }
    }
}

/// Checks one string of a list (with its span); `None` once reported.
type CheckItem = fn(&mut Reader<'_>, &str, &(String, Range<usize>)) -> Option<String>;

/// A non-empty array of strings, each checked by `item` (every bad one reported).
pub(super) fn non_empty(
    r: &mut Reader<'_>,
    path: &str,
    v: &Value<'_>,
    what: &str,
    item: CheckItem,
) -> Option<Vec<String>> {
    let items = r.strings(path, v)?;
    if items.is_empty() {
        r.error(
            path,
            Some(&v.span()),
            format!("expected at least one {what}"),
        );
        return None;
    }
    let checked: Vec<Option<String>> = items
        .iter()
        .enumerate()
        .map(|(i, x)| item(r, &format!("{path}[{i}]"), x))
        .collect();
    checked.into_iter().collect()
}

pub(super) fn socket_addr(
    r: &mut Reader<'_>,
    path: &str,
    (s, span): &(String, Range<usize>),
) -> Option<String> {
    match s.parse::<SocketAddr>() {
        Ok(_) => Some(s.clone()),
        Err(_) => {
            r.error(
                path,
                Some(span),
                format!("expected an address like \"0.0.0.0:8080\", found \"{s}\""),
            );
            None
        }
    }
}

/// `host:port` where host may be a name (resolved when the gateway starts).
pub(super) fn host_port(
    r: &mut Reader<'_>,
    path: &str,
    (s, span): &(String, Range<usize>),
) -> Option<String> {
    let ok = match s.rsplit_once(':') {
        Some((host, port)) => {
            !host.is_empty()
                && port.parse::<u16>().is_ok_and(|p| p > 0)
                && (s.parse::<SocketAddr>().is_ok()
                    || host
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-'))
        }
        None => false,
    };
    if ok {
        Some(s.clone())
    } else {
        r.error(
            path,
            Some(span),
            format!("expected \"host:port\" (e.g. \"127.0.0.1:9001\"), found \"{s}\""),
        );
        None
    }
}

fn cidrs(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<Vec<IpNet>> {
    let items = r.strings(path, v)?;
    let mut out = Vec::new();
    let mut ok = true;
    for (i, (s, span)) in items.iter().enumerate() {
        // A bare address is a /32 (or /128): what an operator means by it.
        let parsed = s
            .parse::<IpNet>()
            .or_else(|_| s.parse::<std::net::IpAddr>().map(IpNet::from));
        match parsed {
            Ok(n) => out.push(n.trunc()),
            Err(_) => {
                ok = false;
                r.error(
                    &format!("{path}[{i}]"),
                    Some(span),
                    format!("expected a CIDR like \"10.0.0.0/8\" or an IP address, found \"{s}\""),
                );
            }
        }
    }
    ok.then_some(out)
}

/// Names that end up in metric labels and Redis keys: a closed, safe alphabet.
pub(super) fn name(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<String> {
    let s = r.string(path, v)?;
    if !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        Some(s)
    } else {
        r.error(
            path,
            Some(&v.span()),
            format!("expected 1-64 characters of [A-Za-z0-9._-], found \"{s}\""),
        );
        None
    }
}

fn server(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<Server> {
    let p = "server";
    r.only_keys(
        p,
        t,
        &[
            "listen",
            "admin_listen",
            "threads",
            "grace_period_secs",
            "max_request_header_bytes",
            "max_request_headers",
            "header_read_timeout_ms",
            "startup_redis_wait_ms",
            "h2c",
            "tls",
        ],
    );
    let listen = req(r, t, p, None, "listen", |r, path, v| {
        non_empty(r, path, v, "listen address", socket_addr)
    });
    let admin_listen = opt(r, t, p, "admin_listen", None, |r, path, v| {
        let s = r.string(path, v)?;
        socket_addr(r, path, &(s, v.span())).map(Some)
    });
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = opt(r, t, p, "threads", cpus, |r, path, v| {
        r.int(path, v, 1, 1024).map(|n| n as usize)
    });
    let grace = opt(r, t, p, "grace_period_secs", 10, |r, path, v| {
        r.int(path, v, 0, 3600)
    });
    let max_hdr = opt(r, t, p, "max_request_header_bytes", 65536, |r, path, v| {
        r.int(path, v, 1024, 1 << 24).map(|n| n as usize)
    });
    // Pingora's parser refuses more than 256 header lines outright (400).
    let max_headers = opt(r, t, p, "max_request_headers", 100, |r, path, v| {
        r.int(path, v, 1, 256).map(|n| n as usize)
    });
    let hdr_timeout = opt(r, t, p, "header_read_timeout_ms", 10_000, |r, path, v| {
        r.int(path, v, 1, 3_600_000)
    });
    let startup_wait = opt(r, t, p, "startup_redis_wait_ms", 1000, |r, path, v| {
        r.int(path, v, 0, 600_000)
    });
    let h2c = opt(r, t, p, "h2c", false, |r, path, v| r.boolean(path, v));
    let tls = match t.get("tls") {
        Some(v) => r
            .table("server.tls", v)
            .and_then(|tt| super::tls::read(r, tt, &v.span()))
            .map(Some),
        None => Some(None),
    };
    Some(Server {
        listen: listen?,
        admin_listen: admin_listen?,
        threads: threads?,
        grace_period_secs: grace?,
        max_request_header_bytes: max_hdr?,
        max_request_headers: max_headers?,
        header_read_timeout_ms: hdr_timeout?,
        startup_redis_wait_ms: startup_wait?,
        h2c: h2c?,
        tls: tls?,
    })
}

fn limiter(
    r: &mut Reader<'_>,
    t: Option<&DeTable<'_>>,
    has_redis: bool,
) -> Option<LimiterSettings> {
    let p = "limiter";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(
        p,
        t,
        &[
            "backend",
            "on_redis_failure",
            "instances",
            "headers",
            "retry_after_jitter_ms",
            "local_max_entries",
        ],
    );
    // With a [redis] section the operator means Redis; without one, local.
    let default_backend = if has_redis {
        Backend::Redis
    } else {
        Backend::Local
    };
    let backend = opt(r, t, p, "backend", default_backend, |r, path, v| {
        r.choice(
            path,
            v,
            &[("redis", Backend::Redis), ("local", Backend::Local)],
        )
    });
    let on_failure = opt(
        r,
        t,
        p,
        "on_redis_failure",
        OnRedisFailure::Local,
        |r, path, v| {
            r.choice(
                path,
                v,
                &[
                    ("local", OnRedisFailure::Local),
                    ("allow", OnRedisFailure::Allow),
                    ("deny", OnRedisFailure::Deny),
                ],
            )
        },
    );
    let instances = opt(r, t, p, "instances", 1, |r, path, v| {
        r.int(path, v, 1, 10_000).map(|n| n as u32)
    });
    let headers = opt(r, t, p, "headers", HeaderStyle::Both, |r, path, v| {
        r.choice(
            path,
            v,
            &[
                ("x-ratelimit", HeaderStyle::XRateLimit),
                ("ietf", HeaderStyle::Ietf),
                ("both", HeaderStyle::Both),
                ("none", HeaderStyle::None),
            ],
        )
    });
    let jitter = opt(r, t, p, "retry_after_jitter_ms", 0, |r, path, v| {
        r.int(path, v, 0, 60_000)
    });
    let max_entries = opt(r, t, p, "local_max_entries", 1_000_000, |r, path, v| {
        r.int(path, v, 1, 1 << 32).map(|n| n as usize)
    });
    Some(LimiterSettings {
        backend: backend?,
        on_redis_failure: on_failure?,
        instances: instances?,
        headers: headers?,
        retry_after_jitter_ms: jitter?,
        local_max_entries: max_entries?,
    })
}

fn clients(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<Clients> {
    let p = "clients";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(
        p,
        t,
        &[
            "trusted_proxies",
            "ipv6_prefix_len",
            "allow",
            "deny",
            "api_key_header",
        ],
    );
    let trusted = opt(r, t, p, "trusted_proxies", vec![], cidrs);
    let v6 = opt(r, t, p, "ipv6_prefix_len", 64, |r, path, v| {
        r.int(path, v, 1, 128).map(|n| n as u8)
    });
    let allow = opt(r, t, p, "allow", vec![], cidrs);
    let deny = opt(r, t, p, "deny", vec![], cidrs);
    let header = opt(
        r,
        t,
        p,
        "api_key_header",
        "x-api-key".to_string(),
        |r, path, v| {
            let s = r.string(path, v)?;
            if http::HeaderName::from_bytes(s.as_bytes()).is_ok() {
                Some(s.to_ascii_lowercase())
            } else {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected an HTTP header name, found \"{s}\""),
                );
                None
            }
        },
    );
    Some(Clients {
        trusted_proxies: trusted?,
        ipv6_prefix_len: v6?,
        allow: allow?,
        deny: deny?,
        api_key_header: header?,
    })
}

/// An algorithm table: `algorithm` plus its own parameters (others are unknown keys).
pub(super) fn limit(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    with_scope: bool,
) -> Option<Limit> {
    #[derive(Clone, Copy)]
    enum Kind {
        Token,
        Leaky,
        Fixed,
        Sliding,
        Log,
    }
    let kind = req(r, t, p, Some(span), "algorithm", |r, path, v| {
        r.choice(
            path,
            v,
            &[
                ("token_bucket", Kind::Token),
                ("leaky_bucket", Kind::Leaky),
                ("fixed_window", Kind::Fixed),
                ("sliding_window", Kind::Sliding),
                ("sliding_log", Kind::Log),
            ],
        )
    })?;
    let mut keys = vec!["algorithm", "shadow"];
    if with_scope {
        keys.push("scope");
    }
    keys.extend_from_slice(match kind {
        Kind::Token => &["capacity", "refill_per_sec"][..],
        Kind::Leaky => &["rate_per_sec", "max_delay_ms"],
        Kind::Fixed | Kind::Sliding | Kind::Log => &["limit", "window_secs"],
    });
    r.only_keys(p, t, &keys);
    let count = |r: &mut Reader<'_>, path: &str, v: &Value<'_>| r.int(path, v, 1, 1 << 40);
    let window = |r: &mut Reader<'_>, path: &str, v: &Value<'_>| r.int(path, v, 1, 366 * 86_400);
    let algorithm = match kind {
        Kind::Token => {
            let capacity = req(r, t, p, Some(span), "capacity", count);
            let refill = req(r, t, p, Some(span), "refill_per_sec", |r, path, v| {
                r.positive_number(path, v)
            });
            Algorithm::TokenBucket {
                capacity: capacity?,
                refill_per_sec: refill?,
            }
        }
        Kind::Leaky => {
            let rate = req(r, t, p, Some(span), "rate_per_sec", |r, path, v| {
                r.positive_number(path, v)
            });
            let delay = opt(r, t, p, "max_delay_ms", 0, |r, path, v| {
                r.int(path, v, 0, 60_000)
            });
            Algorithm::LeakyBucket {
                rate_per_sec: rate?,
                max_delay_ms: delay?,
            }
        }
        Kind::Fixed | Kind::Sliding | Kind::Log => {
            let limit = req(r, t, p, Some(span), "limit", count);
            let window_secs = req(r, t, p, Some(span), "window_secs", window);
            let (limit, window_secs) = (limit?, window_secs?);
            match kind {
                Kind::Fixed => Algorithm::FixedWindow { limit, window_secs },
                Kind::Sliding => Algorithm::SlidingWindow { limit, window_secs },
                _ => Algorithm::SlidingLog { limit, window_secs },
            }
        }
    };
    if let Algorithm::SlidingLog { limit, .. } = algorithm {
        // One sorted-set member per admitted request: keep the log bounded.
        if limit > 100_000 {
            r.error(
                &join(p, "limit"),
                Some(span),
                format!("sliding_log keeps one entry per request; expected at most 100000, found {limit}"),
            );
            return None;
        }
    }
    let scope = if with_scope {
        opt(r, t, p, "scope", Scope::Client, |r, path, v| {
            r.choice(
                path,
                v,
                &[("client", Scope::Client), ("global", Scope::Global)],
            )
        })?
    } else {
        Scope::Client
    };
    let shadow = opt(r, t, p, "shadow", false, |r, path, v| r.boolean(path, v))?;
    Some(Limit {
        algorithm,
        scope,
        shadow,
    })
}

fn plans(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<BTreeMap<String, Plan>> {
    let mut out = BTreeMap::new();
    let Some(t) = t else {
        return Some(out);
    };
    let mut ok = true;
    for (key, v) in t.iter() {
        let p = format!("plans.{}", key.get_ref());
        let plan_name = key.get_ref().to_string();
        if !plan_name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            r.error(&p, Some(&key.span()), "plan names use [A-Za-z0-9._-] only");
            ok = false;
            continue;
        }
        let Some(pt) = r.table(&p, v) else {
            ok = false;
            continue;
        };
        r.only_keys(&p, pt, &["capacity", "refill_per_sec"]);
        let span = v.span();
        let capacity = req(r, pt, &p, Some(&span), "capacity", |r, path, v| {
            r.int(path, v, 1, 1 << 40)
        });
        let refill = req(r, pt, &p, Some(&span), "refill_per_sec", |r, path, v| {
            r.positive_number(path, v)
        });
        match (capacity, refill) {
            (Some(capacity), Some(refill_per_sec)) => {
                out.insert(
                    plan_name,
                    Plan {
                        capacity,
                        refill_per_sec,
                    },
                );
            }
            _ => ok = false,
        }
    }
    ok.then_some(out)
}

fn api_key(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    plans: &[String],
) -> Option<ApiKey> {
    r.only_keys(p, t, &["id", "key", "sha256", "plan"]);
    let id = req(r, t, p, Some(span), "id", name);
    let plan = req(r, t, p, Some(span), "plan", |r, path, v| {
        let plan = r.string(path, v)?;
        if plans.contains(&plan) {
            Some(plan)
        } else {
            r.error(
                path,
                Some(&v.span()),
                format!(
                    "plan \"{plan}\" is not defined; defined plans: [{}]",
                    plans.join(", ")
                ),
            );
            None
        }
    });
    let digest = match (t.get("key"), t.get("sha256")) {
        (Some(k), None) => {
            let path = join(p, "key");
            let secret = r.string(&path, k)?;
            if secret.is_empty() {
                r.error(&path, Some(&k.span()), "expected a non-empty key");
                None
            } else {
                Some(Sha256::digest(secret.as_bytes()).into())
            }
        }
        (None, Some(h)) => {
            let path = join(p, "sha256");
            let hex_str = r.string(&path, h)?;
            let mut digest = [0u8; 32];
            match hex::decode_to_slice(hex_str.trim(), &mut digest) {
                Ok(()) => Some(digest),
                Err(_) => {
                    // The digest is not the secret, but say only its shape.
                    r.error(
                        &path,
                        Some(&h.span()),
                        format!(
                            "expected 64 hex digits (a SHA-256 digest), found {} characters",
                            hex_str.chars().count()
                        ),
                    );
                    None
                }
            }
        }
        (Some(_), Some(_)) => {
            r.error(p, Some(span), "give either `key` or `sha256`, not both");
            None
        }
        (None, None) => {
            r.error(p, Some(span), "missing `key` or `sha256`");
            None
        }
    };
    Some(ApiKey {
        id: id?,
        digest: digest?,
        plan: plan?,
    })
}
