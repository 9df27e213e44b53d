//! Admission: from a request's facts to its fate, without touching a socket.
//!
//! `classify` (this file) runs everything that needs no limiter: deny list,
//! path, route, CORS preflight, API key or verified JWT. It either refuses
//! the request or returns a `Plan` with the tier checks to decide.
//! `token_cost` says what a bearer JWT's signature check costs its client
//! address first (the per-IP tier's token), asked before the token is.
//! `conclude` turns the limiter's outcome into the response the client
//! sees: admitted (with headers and perhaps a shaping delay), 429, or 503
//! when Redis is down and the operator chose "deny". `policy` is what both
//! read, built once per config load; `buckets` names a client's buckets for
//! operators.

mod buckets;
mod conclude;
mod policy;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::calendar::{self, Period, Span};
use crate::clock::{Clock, SystemClock};
use crate::config::{Algorithm, Attribute, Config, HeaderStyle, LimitKey, Missing, Quota, Scope};
use crate::cors::{self, CorsError, CorsRules};
use crate::identity::apikeys::runtime::{RuntimeKey, RuntimeKeys};
use crate::identity::apikeys::{KeyRef, KeySet};
use crate::identity::attributes::{self, AttributeError};
use crate::identity::jwt::{TokenError, Verified};
use crate::identity::Credentials;
use crate::identity::{self, ClientAddr, KeyError};
use crate::limiter::algorithms::quota;
use crate::limiter::keys::{bucket_key, bucket_name, rule_prefix};
use crate::limiter::{Check, Decision, LimitKind, Micros, Outcome, Tier};
use crate::metrics::DecisionLabel;
use crate::path::{normalize_path, PathError};
use crate::routing::{RouteMatch, RouteTable};

pub use buckets::{add_used, buckets, Bucket, BucketsError, Subject};
pub use conclude::{backend_of, conclude, tier_labels, Conclusion};
pub use policy::Policy;
use policy::RouteRule;

/// What admission needs to know about a request.
#[derive(Debug, Clone)]
pub struct RequestView<'a> {
    pub method: &'a str,
    /// The path as sent, without the query.
    pub path: &'a str,
    pub peer: IpAddr,
    /// `X-Forwarded-For` values, in order.
    pub xff: Vec<&'a str>,
    /// Values of the configured API-key header.
    pub api_key: Vec<&'a [u8]>,
    pub authorization: Vec<&'a [u8]>,
    /// The host the request names (`Host`, or HTTP/2's `:authority`), as sent.
    pub host: Option<&'a str>,
    /// `Content-Length`, when the request declares one.
    pub content_length: Option<u64>,
    /// The query string, for limits keyed on a query parameter.
    pub query: Option<&'a str>,
    /// Every header, for limits keyed on a header.
    pub headers: &'a http::HeaderMap,
    /// The bearer JWT's verdict, when it carries one and `[auth.jwt]` is
    /// set (its `Authorization` is then not in `authorization`).
    pub jwt: Option<&'a Result<Arc<Verified>, TokenError>>,
}

/// A host as routes match it: lower-case, without its port.
fn host_of(raw: &str) -> String {
    let h = if raw.starts_with('[') {
        raw.split_once(']')
            .map_or(raw, |(h, _)| h)
            .trim_start_matches('[')
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, _)| h)
    };
    h.trim_end_matches('.').to_ascii_lowercase()
}

/// A request answered before any limiter work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    BadPath(PathError),
    Forbidden,
    NotFound,
    MethodNotAllowed(Vec<String>),
    UnknownKey,
    KeyRequired,
    ConflictingKeys,
    /// The declared body is larger than the route takes (the limit).
    PayloadTooLarge(u64),
    /// The route's limit keys on this attribute, and the request's cannot
    /// name a bucket (`missing = "reject"`, or sent twice, unreadable, too long).
    BadAttribute(Attribute, AttributeError),
    /// A CORS preflight the route's policy does not allow.
    Cors(CorsError),
    /// A bearer JWT that failed verification (or cannot be checked now).
    InvalidToken(TokenError),
}

/// A request that may proceed once its checks admit it.
#[derive(Debug, Clone)]
pub struct Plan {
    pub route: usize,
    /// The normalised path: what was matched and what the upstream receives.
    pub path: String,
    pub client_ip: IpAddr,
    pub client: ClientAddr,
    /// The client's id as logs show it: an API key's id, `jwt:` and a
    /// verified token's id claim.
    pub key_id: Option<String>,
    /// The client's bucket identity (`k:ID`, `j:ISSUER:ID` or `ip:ADDR`).
    pub client_identity: String,
    /// Shared with the limiter (and its batch) rather than copied.
    pub checks: Arc<[Check]>,
    /// The checks counting the units of the route's `charge` (bit i:
    /// `checks[i]`): admitted on the request's estimate (`estimate`),
    /// settled once its answer says what it cost.
    pub units: u64,
    /// A CORS preflight, answered by the gateway (never the upstream) with
    /// these headers once its checks (none, unless charged) admit it.
    pub preflight: Option<cors::Headers>,
    /// The key's plan, when the route limits it by its own rule
    /// (`limit_by_plan`).
    pub route_plan: Option<String>,
    /// Its place in an upstream's queue: its plan's `priority`; a request
    /// without a key comes after every plan.
    pub priority: i64,
}

impl Plan {
    /// The request's estimate (`metering::estimate`) as the cost of the
    /// checks counting charged units: at least 1 and at most what each
    /// bucket holds (the rest is settled as a debt once the answer is in).
    pub fn estimate(&mut self, estimate: u64) {
        if self.units == 0 {
            return;
        }
        // The plan's own checks (`classify` shares them with nobody yet):
        // changed in place, not copied with their keys.
        let checks = Arc::make_mut(&mut self.checks);
        for (i, c) in checks.iter_mut().enumerate() {
            if self.units & (1 << i) != 0 {
                c.cost = estimate.clamp(1, crate::limiter::algorithms::quota(&c.algorithm).max(1));
                c.charged = true;
            }
        }
    }
}

/// Where a refused request is counted (metrics, access log) and who sent
/// it. Only made for refusals (the cold path).
pub struct Refused {
    /// The route it matched; for a 405 the one its path matched; for a CORS
    /// preflight the route that answered it; `None` when no route matches.
    pub route: Option<usize>,
    pub client: ClientAddr,
}

pub fn refused(policy: &Policy, req: &RequestView<'_>) -> Refused {
    let cfg = &policy.config;
    let client_ip = identity::client_ip(
        req.peer,
        req.xff.iter().copied(),
        &cfg.clients.trusted_proxies,
    );
    let route = normalize_path(req.path).ok().and_then(|path| {
        let host = req.host.map(host_of);
        if let Some((route, _)) = preflight_route(policy, host.as_deref(), &path, req) {
            return Some(route);
        }
        match policy.routes.find(host.as_deref(), &path, req.method) {
            RouteMatch::Found(i) => Some(i),
            RouteMatch::MethodNotAllowed(_) => policy.routes.find_path(host.as_deref(), &path),
            RouteMatch::NotFound => None,
        }
    });
    Refused {
        route,
        client: ClientAddr::new(client_ip, cfg.clients.ipv6_prefix_len),
    }
}

/// What a request's client address pays before its bearer JWT's signature
/// is checked. A check is the expensive part of a token, and the `kid` that
/// buys one is public in the issuer's JWKS: without a price, a flood of
/// forged tokens costs the gateway a check each.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenCost {
    /// A deny-listed address: refused (403) whatever its token says, so
    /// the token is not checked at all.
    Refused,
    /// Nothing: no `[ip_tier]`, or an allow-listed address (which no tier
    /// limits).
    Free,
    /// One token of the per-IP tier, as `classify` names its bucket.
    Ip(Check),
}

pub fn token_cost(policy: &Policy, req: &RequestView<'_>) -> TokenCost {
    let cfg = &policy.config;
    let client_ip = identity::client_ip(
        req.peer,
        req.xff.iter().copied(),
        &cfg.clients.trusted_proxies,
    );
    if cfg.clients.deny.iter().any(|n| n.contains(&client_ip)) {
        return TokenCost::Refused;
    }
    let allowed = cfg.clients.allow.iter().any(|n| n.contains(&client_ip));
    match &policy.ip_rule {
        Some(rule) if !allowed => {
            let client = ClientAddr::new(client_ip, cfg.clients.ipv6_prefix_len);
            TokenCost::Ip(rule.check(&ip_identity_of(&client)))
        }
        _ => TokenCost::Free,
    }
}

/// The per-IP tier's bucket identity of a client address.
fn ip_identity_of(client: &ClientAddr) -> String {
    format!("ip:{client}")
}

pub fn classify(policy: &Policy, req: &RequestView<'_>) -> Result<Plan, Refusal> {
    let cfg = &policy.config;
    let client_ip = identity::client_ip(
        req.peer,
        req.xff.iter().copied(),
        &cfg.clients.trusted_proxies,
    );
    if cfg.clients.deny.iter().any(|n| n.contains(&client_ip)) {
        return Err(Refusal::Forbidden);
    }
    let path = normalize_path(req.path).map_err(Refusal::BadPath)?;
    let host = req.host.map(host_of);
    let (route, preflight) = match preflight(policy, host.as_deref(), &path, req) {
        Some((route, answer)) => (route, Some(answer.map_err(Refusal::Cors)?)),
        None => match policy.routes.find(host.as_deref(), &path, req.method) {
            RouteMatch::Found(i) => (i, None),
            RouteMatch::MethodNotAllowed(allowed) => {
                return Err(Refusal::MethodNotAllowed(allowed))
            }
            RouteMatch::NotFound => return Err(Refusal::NotFound),
        },
    };
    let charged = match &preflight {
        Some(_) => policy.cors(Some(route)).is_some_and(|c| c.charge_preflight),
        None => true,
    };
    let r = &cfg.routes[route];
    // Before any limiter work: a body the route will not take spends nothing.
    if let (Some(max), Some(len)) = (r.max_request_body_bytes, req.content_length) {
        if len > max {
            return Err(Refusal::PayloadTooLarge(max));
        }
    }
    let presented = identity::presented_key(
        req.api_key.iter().copied(),
        req.authorization.iter().copied(),
    )
    .map_err(|KeyError::Conflicting| Refusal::ConflictingKeys)?;
    // A bad token is refused before any bucket is named or charged.
    let token = match req.jwt {
        _ if preflight.is_some() => None,
        Some(Err(e)) => return Err(Refusal::InvalidToken(e.clone())),
        Some(Ok(v)) if presented.is_none() => Some(v.as_ref()),
        Some(Ok(_)) => return Err(Refusal::ConflictingKeys),
        None => None,
    };
    // A preflight carries no credentials (browsers never send them on one):
    // it is charged, if at all, as its client address.
    let runtime_key;
    let key = match presented {
        _ if preflight.is_some() => None,
        Some(secret) => {
            let digest = crate::identity::apikeys::digest_of(secret);
            match policy.keys.lookup_digest(&digest) {
                Some(k) => Some(k),
                None => {
                    runtime_key = policy.runtime.get(&digest);
                    let k = runtime_key
                        .as_deref()
                        .map(RuntimeKey::view)
                        .ok_or(Refusal::UnknownKey)?;
                    // A plan a reload removed: refused, never unlimited.
                    if !cfg.plans.contains_key(k.plan) {
                        return Err(Refusal::UnknownKey);
                    }
                    Some(k)
                }
            }
        }
        None => match token {
            Some(t) => Some(KeyRef {
                id: &t.id,
                plan: &t.plan,
                quotas: None,
                burst: None,
            }),
            None if r.require_api_key => return Err(Refusal::KeyRequired),
            None => None,
        },
    };
    let client = ClientAddr::new(client_ip, cfg.clients.ipv6_prefix_len);
    let ip_identity = ip_identity_of(&client);
    let key_identity = match token {
        Some(t) => Some(t.identity.clone()),
        None => key.map(|k| format!("k:{}", k.id)),
    };
    let client_identity = key_identity.as_deref().unwrap_or(&ip_identity);
    // Read even for allow-listed clients: a route that needs the attribute
    // refuses a request without it whoever sends it.
    // A preflight lacks the headers it announces: charged, it falls back to
    // the client's bucket rather than being refused for one it cannot send.
    let key_plan = key.map(|k| k.plan);
    let route_plan = key_plan
        .filter(|p| policy.plan_route_rules[route].contains_key(*p))
        .map(str::to_string);
    let route_rule = policy.route_rule(route, key_plan);
    let route_identity = match route_rule {
        Some(rr) if charged => Some(route_identity(
            rr,
            client_identity,
            req,
            token,
            preflight.is_some(),
        )?),
        _ => None,
    };
    let mut checks = Vec::with_capacity(4);
    // The tiers counting the units a `charge` route reads (bit i: checks[i]).
    let mut units = 0;
    let metered = r.charge.is_some() && preflight.is_none();
    if charged && !cfg.clients.allow.iter().any(|n| n.contains(&client_ip)) {
        if let Some(rule) = &policy.ip_rule {
            checks.push(rule.check(&ip_identity));
        }
        if let (Some(k), Some(identity)) = (key, &key_identity) {
            if let Some(rule) = policy.key_rule(&k) {
                checks.push(rule.check(identity));
            }
            units |= policy.quota_checks(&k, identity, SystemClock.now_us(), metered, &mut checks);
        }
        if let (Some(rr), Some(identity)) = (route_rule, &route_identity) {
            if rr.charged && metered {
                units |= 1 << checks.len();
            }
            checks.push(rr.check(identity));
        }
    }
    Ok(Plan {
        route,
        path,
        client_ip,
        client,
        key_id: match token {
            Some(t) => Some(format!("jwt:{}", t.id)),
            None => key.map(|k| k.id.to_string()),
        },
        client_identity: key_identity.unwrap_or(ip_identity),
        checks: checks.into(),
        units,
        preflight,
        route_plan,
        priority: key
            .and_then(|k| cfg.plans.get(k.plan))
            .map_or(i64::MIN, |p| p.priority),
    })
}

/// A CORS preflight for a route with a CORS policy: that route and its
/// answer. `None` for anything else, which is routed as the request it is.
fn preflight(
    policy: &Policy,
    host: Option<&str>,
    path: &str,
    req: &RequestView<'_>,
) -> Option<(usize, Result<cors::Headers, CorsError>)> {
    let (route, takes_method) = preflight_route(policy, host, path, req)?;
    let rules = policy.cors(Some(route))?;
    let answer = rules.preflight(req.headers);
    if !takes_method {
        // Its origin checked first: a refused origin is told as such.
        let method = CorsError::Method(announced(req).map(str::to_string));
        return Some((route, answer.and(Err(method))));
    }
    Some((route, answer))
}

fn announced<'a>(req: &RequestView<'a>) -> Option<&'a str> {
    req.headers
        .get(http::header::ACCESS_CONTROL_REQUEST_METHOD)?
        .to_str()
        .ok()
}

/// The route with a CORS policy that answers a preflight, and whether it
/// takes the announced method. The path's own routes (the most specific
/// host and prefix that serve it) come first: the one taking the method
/// answers if it has a policy; if none of them takes it, a policy there
/// refuses it. So a route with a CORS policy answers every preflight for its
/// prefix, and a method it does not take is never passed on to a route
/// behind it (a catch-all) and its upstream. Only a path whose own routes
/// have no policy leaves the preflight to the route the method reaches.
fn preflight_route(
    policy: &Policy,
    host: Option<&str>,
    path: &str,
    req: &RequestView<'_>,
) -> Option<(usize, bool)> {
    if !cors::is_preflight(req.method, req.headers) {
        return None;
    }
    let found = match policy.routes.find(host, path, announced(req)?) {
        RouteMatch::Found(i) => Some(i),
        RouteMatch::MethodNotAllowed(_) => None,
        RouteMatch::NotFound => return None,
    };
    let own = policy.routes.find_path(host, path)?;
    let routes = &policy.config.routes;
    let level = |i: usize| (&routes[i].host, &routes[i].path_prefix);
    let has_policy = |i: usize| policy.cors(Some(i)).is_some();
    match found {
        Some(i) if level(i) == level(own) => has_policy(i).then_some((i, true)),
        _ if has_policy(own) => Some((own, false)),
        _ => found.filter(|&i| has_policy(i)).map(|i| (i, true)),
    }
}

/// The claims the config's route limits key on (`key = "claim:NAME"`).
fn route_claims(config: &Config) -> Vec<String> {
    let mut out: Vec<String> = config
        .routes
        .iter()
        .flat_map(|r| r.limit.iter().chain(r.limit_by_plan.values()))
        .filter_map(|l| match l.key.attribute() {
            Some(Attribute::Claim(c)) => Some(c.clone()),
            _ => None,
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The identity of a request's bucket under its route's limit: everyone's
/// (`global`), the client's (`k:ID` or `ip:ADDR`), the attribute's
/// (`h:VALUE`, `q:VALUE`) or the client's and the attribute's together.
fn route_identity(
    rr: &RouteRule,
    client: &str,
    req: &RequestView<'_>,
    token: Option<&Verified>,
    preflight: bool,
) -> Result<String, Refusal> {
    let attribute = match (&rr.scope, &rr.key) {
        (Scope::Global, _) => return Ok("global".into()),
        (Scope::Client, LimitKey::Client) => return Ok(client.into()),
        (Scope::Client, LimitKey::Attribute(a) | LimitKey::ClientAnd(a)) => a,
    };
    let value = match attributes::value(attribute, req.headers, req.query, token) {
        Ok(v) => v,
        Err(AttributeError::Missing) if rr.missing == Missing::Client || preflight => {
            return Ok(client.into())
        }
        Err(e) => return Err(Refusal::BadAttribute(attribute.clone(), e)),
    };
    let tag = tag(attribute);
    Ok(match rr.key {
        LimitKey::ClientAnd(_) => format!("{client}/{tag}:{value}"),
        _ => format!("{tag}:{value}"),
    })
}

/// The letter an attribute's bucket name carries (`h:`, `q:`, `c:`).
fn tag(a: &Attribute) -> &'static str {
    match a {
        Attribute::Header(_) => "h",
        Attribute::Query(_) => "q",
        Attribute::Claim(_) => "c",
    }
}
