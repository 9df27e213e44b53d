//! Admission: from a request's facts to its fate, without touching a socket.
//!
//! `classify` runs everything that needs no limiter: deny list, path, route,
//! CORS preflight, API key or verified JWT. It either refuses the request or returns a `Plan` with the tier
//! checks to decide. `conclude` turns the limiter's outcome into the response
//! the client sees: admitted (with headers and perhaps a shaping delay), 429,
//! or 503 when Redis is down and the operator chose "deny".

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;

use crate::apikeys::runtime::{RuntimeKey, RuntimeKeys};
use crate::apikeys::KeyRef;
use crate::attributes::{self, AttributeError};
use crate::calendar::{self, Period, Span};
use crate::clock::{Clock, SystemClock};
use crate::config::{Algorithm, Attribute, Config, HeaderStyle, LimitKey, Missing, Quota, Scope};
use crate::cors::{self, CorsError, CorsRules};
use crate::identity::{self, ClientAddr, KeyError};
use crate::jwt::{TokenError, Verified};
use crate::limiter::algorithms::quota;
use crate::limiter::keys::{bucket_key, bucket_name, rule_prefix};
use crate::limiter::{Check, Decision, LimitKind, Micros, Outcome, Tier};
use crate::metrics::DecisionLabel;
use crate::path::{normalize_path, PathError};
use crate::routing::{RouteMatch, RouteTable};

/// A config snapshot with the lookups the request path needs, built once per load.
pub struct Policy {
    pub config: Arc<Config>,
    routes: RouteTable,
    /// The tiers' rules, ready to name buckets: the ip tier's, each plan's
    /// (by name) and each route's limit (indexed like the config's routes).
    ip_rule: Option<Rule>,
    plan_rules: BTreeMap<String, Rule>,
    /// The keys with a burst bucket of their own, by id.
    key_rules: BTreeMap<String, Rule>,
    route_rules: Vec<Option<RouteRule>>,
    /// Each route's `limit_by_plan`: a plan's own rule, by plan name.
    plan_route_rules: Vec<BTreeMap<String, RouteRule>>,
    /// Each route's CORS rules (its own policy, else `[cors]`'s), and
    /// `[cors]`'s for a request that matched no route.
    route_cors: Vec<Option<CorsRules>>,
    global_cors: Option<CorsRules>,
    /// Bucket names start with it (`redis.key_prefix`).
    key_prefix: String,
    /// Each quota period's current span (`span`), by `Period::ALL` order.
    spans: parking_lot::Mutex<[Option<Span>; 5]>,
    /// Keys issued at runtime (kept in Redis), after the config's.
    pub runtime: Arc<RuntimeKeys>,
    /// `[auth.jwt]`'s issuers, when there are any.
    pub jwt: Option<crate::jwt::Verifier>,
}

/// A route's limit: its rule, and what names a request's bucket under it.
struct RouteRule {
    rule: Rule,
    scope: Scope,
    key: LimitKey,
    missing: Missing,
    /// A global limit's sub-buckets (`shards`), by name; empty if not split.
    shards: Vec<String>,
    /// Which sub-bucket the next request takes: each replica deals its
    /// requests out in turn, so the sub-buckets fill evenly. Kept across
    /// reloads that keep the rule (`dealer`).
    next_shard: Arc<AtomicUsize>,
}

impl RouteRule {
    fn new(key_prefix: &str, name: &str, l: &crate::config::Limit) -> Self {
        let k = l.shards.max(1);
        // Each sub-bucket holds exactly 1/k (`config::limits` checked that
        // k divides the quota, and that a request fits in one).
        let mut rule = Rule::new(
            key_prefix,
            Tier::Route,
            name,
            crate::limiter::share(&l.algorithm, k as u32),
            l.shadow,
        );
        rule.cost = l.cost;
        rule.shards = k;
        let (shards, next_shard) = if k > 1 {
            let names = (0..k).map(|i| shard_name(&rule.prefix, i, k)).collect();
            (names, dealer(&rule.prefix))
        } else {
            (Vec::new(), Arc::default())
        };
        RouteRule {
            rule,
            scope: l.scope,
            key: l.key.clone(),
            missing: l.missing,
            shards,
            next_shard,
        }
    }

    /// The check of a request whose bucket is `identity`'s; for a split
    /// global limit, the next sub-bucket in turn.
    fn check(&self, identity: &str) -> Check {
        if self.shards.is_empty() {
            return self.rule.check(identity);
        }
        let i = self.next_shard.fetch_add(1, Ordering::Relaxed) % self.shards.len();
        self.rule.check_named(self.shards[i].clone())
    }

    /// A request dealt a sub-bucket that spent nothing there gives its turn
    /// back: another tier rejected it (the sub-bucket admitted, or was never
    /// asked, as when a remembered denial answered first). The sub-buckets
    /// then take turns by what they admit, not by what they are offered. A
    /// sub-bucket that rejected keeps the turn spent: the next one is tried.
    fn settle(&self, checks: &[Check], outcome: &Outcome) {
        let spent_or_empty = match outcome {
            Outcome::Decided {
                verdict,
                checks: decided,
                ..
            } => {
                verdict.admitted(decided)
                    || decided
                        .iter()
                        .zip(&verdict.decisions)
                        .any(|(c, d)| c.tier == Tier::Route && !d.allowed)
            }
            // Only the denying tier was asked: the turn is kept only if
            // that was the sub-bucket itself.
            Outcome::Remembered { checks, tier, .. } => checks[*tier].tier == Tier::Route,
            // Allowed or denied without Redis: nothing was spent anywhere.
            Outcome::FailOpen | Outcome::FailClosed => false,
        };
        if !spent_or_empty && checks.iter().any(|c| c.tier == Tier::Route) {
            self.next_shard.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The turn counter of a split rule, by its buckets' names' head (which
/// carries its parameters): a reload that keeps the rule keeps dealing where
/// it was, rather than starting again at the first sub-bucket.
fn dealer(rule_prefix: &str) -> Arc<AtomicUsize> {
    static DEALERS: std::sync::OnceLock<
        parking_lot::Mutex<std::collections::HashMap<String, Arc<AtomicUsize>>>,
    > = std::sync::OnceLock::new();
    DEALERS
        .get_or_init(Default::default)
        .lock()
        .entry(rule_prefix.to_string())
        .or_default()
        .clone()
}

/// The name of sub-bucket `i` of `k`: `global/I{TAG}`, where the hash tag is
/// the first whose Redis Cluster slot lies inside the i-th k-th of the slot
/// space, a slot clear of its ends (`redis-cli --cluster create` rounds its
/// masters' boundaries, which may fall one slot off a k-th's). Masters serve
/// contiguous slot ranges, so sub-buckets spread over them evenly (k a
/// multiple of the masters: the same number on each), where names hashed as
/// they come could put several on one master.
fn shard_name(rule_prefix: &str, i: u64, k: u64) -> String {
    let (lo, hi) = (i * 16384 / k + 2, (i + 1) * 16384 / k - 2);
    let tag = (0u64..)
        .map(|n| format!("{{s{i}.{n}}}"))
        .find(|t| (lo..hi).contains(&(crate::limiter::slot(t) as u64)))
        .expect("every slot range is hit by some tag");
    format!("{rule_prefix}global/{i}{tag}")
}

/// One rule of one tier, with the constant head of its buckets' names
/// (`keys::rule_prefix`), built once per config load, not once per request.
#[derive(Clone)]
struct Rule {
    tier: Tier,
    algorithm: Algorithm,
    shadow: bool,
    cost: u64,
    /// How many sub-buckets share the rule (`algorithm` is one's share).
    shards: u64,
    prefix: String,
}

impl Rule {
    fn new(key_prefix: &str, tier: Tier, name: &str, algorithm: Algorithm, shadow: bool) -> Self {
        Rule {
            prefix: rule_prefix(key_prefix, tier.as_str(), name, &algorithm),
            tier,
            algorithm,
            shadow,
            cost: 1,
            shards: 1,
        }
    }

    /// The check of `identity`'s bucket under this rule.
    fn check(&self, identity: &str) -> Check {
        self.check_named(bucket_name(&self.prefix, identity))
    }

    fn check_named(&self, key: String) -> Check {
        Check {
            tier: self.tier,
            key,
            algorithm: self.algorithm,
            shadow: self.shadow,
            cost: self.cost,
            shards: self.shards,
        }
    }
}

impl Policy {
    pub fn new(config: Arc<Config>) -> Self {
        let p = config.key_prefix();
        let ip_rule = config
            .ip_tier
            .as_ref()
            .map(|t| Rule::new(p, Tier::Ip, "ip", t.algorithm, t.shadow));
        let plan_rules = config
            .plans
            .iter()
            .map(|(name, plan)| {
                let algorithm = Algorithm::TokenBucket {
                    capacity: plan.capacity,
                    refill_per_sec: plan.refill_per_sec,
                };
                (
                    name.clone(),
                    Rule::new(p, Tier::Key, name, algorithm, false),
                )
            })
            .collect();
        // A key's own rule is named `@id`: `@` is in no plan's name.
        let key_rules = config
            .keys
            .with_own_limits()
            .filter_map(|k| {
                let b = k.burst?;
                let algorithm = Algorithm::TokenBucket {
                    capacity: b.capacity,
                    refill_per_sec: b.refill_per_sec,
                };
                let rule = Rule::new(p, Tier::Key, &format!("@{}", k.id), algorithm, false);
                Some((k.id.to_string(), rule))
            })
            .collect();
        let route_rules = config
            .routes
            .iter()
            .map(|r| r.limit.as_ref().map(|l| RouteRule::new(p, &r.name, l)))
            .collect();
        // A plan's rule is named `route.plan`: its buckets are its own.
        let plan_route_rules = config
            .routes
            .iter()
            .map(|r| {
                r.limit_by_plan
                    .iter()
                    .map(|(plan, l)| {
                        (
                            plan.clone(),
                            RouteRule::new(p, &format!("{}.{plan}", r.name), l),
                        )
                    })
                    .collect()
            })
            .collect();
        let style = config.limiter.headers;
        let route_cors = config
            .routes
            .iter()
            .map(|r| {
                let cors = r.cors.as_ref().or(config.cors.as_ref())?;
                Some(CorsRules::new(cors, r.methods.as_deref(), style))
            })
            .collect();
        let global_cors = config.cors.as_ref().map(|c| CorsRules::new(c, None, style));
        Policy {
            route_cors,
            global_cors,
            routes: RouteTable::new(&config.routes),
            ip_rule,
            plan_rules,
            key_rules,
            route_rules,
            plan_route_rules,
            key_prefix: p.to_string(),
            spans: parking_lot::Mutex::new([None; 5]),
            jwt: config
                .jwt
                .as_ref()
                .map(|j| crate::jwt::Verifier::new(j, route_claims(&config), config.plans.keys())),
            config,
            runtime: Arc::default(),
        }
    }

    /// This policy, looking up runtime keys in `keys` (one copy a process,
    /// kept across reloads).
    pub fn with_runtime_keys(mut self, keys: Arc<RuntimeKeys>) -> Self {
        self.runtime = keys;
        self
    }

    /// The key with this id: the config's, else a runtime one (held in
    /// `hold` for the borrow).
    fn key_by_id<'a>(
        &'a self,
        id: &str,
        hold: &'a mut Option<Arc<RuntimeKey>>,
    ) -> Option<KeyRef<'a>> {
        if let Some(k) = self.config.keys.by_id(id) {
            return Some(k);
        }
        *hold = self.runtime.by_id(id);
        hold.as_deref().map(RuntimeKey::view)
    }

    /// The burst bucket `key` is held to: its own, else its plan's.
    fn key_rule(&self, key: &KeyRef<'_>) -> Option<Cow<'_, Rule>> {
        match key.burst {
            // A runtime key's own rule is made when it is used.
            Some(b) => Some(match self.key_rules.get(key.id) {
                Some(r) => Cow::Borrowed(r),
                None => Cow::Owned(Rule::new(
                    &self.key_prefix,
                    Tier::Key,
                    &format!("@{}", key.id),
                    Algorithm::TokenBucket {
                        capacity: b.capacity,
                        refill_per_sec: b.refill_per_sec,
                    },
                    false,
                )),
            }),
            None => self.plan_rules.get(key.plan).map(Cow::Borrowed),
        }
    }

    /// The quotas `key` counts against: its own, else its plan's.
    fn quotas_of<'a>(&'a self, key: &KeyRef<'a>) -> &'a [Quota] {
        match key.quotas {
            Some(own) => own,
            None => self
                .config
                .plans
                .get(key.plan)
                .map_or(&[][..], |p| p.quotas.as_slice()),
        }
    }

    /// One check per quota of `key`, on the period `now` falls in. Each
    /// period is a bucket of its own, named by the key's id alone (not its
    /// plan, nor the limit): a key moved to another plan, or a plan whose
    /// quota changed, keeps what it used this period.
    fn quota_checks(&self, key: &KeyRef<'_>, identity: &str, now: Micros, out: &mut Vec<Check>) {
        for q in self.quotas_of(key) {
            let span = self.span(q.period, now);
            let algorithm = Algorithm::Calendar {
                limit: q.limit,
                period: q.period,
                start: span.start,
                end: span.end,
            };
            out.push(Check {
                tier: Tier::Quota,
                key: bucket_key(
                    &self.key_prefix,
                    "quota",
                    q.period.as_str(),
                    &algorithm,
                    identity,
                ),
                algorithm,
                shadow: false,
                cost: 1,
                shards: 1,
            });
        }
    }

    /// The period of `now`, remembered while it lasts (a calendar in a time
    /// zone is not free to work out on every request).
    fn span(&self, period: Period, now: Micros) -> Span {
        let i = Period::ALL
            .iter()
            .position(|(_, p)| *p == period)
            .unwrap_or(0);
        let mut spans = self.spans.lock();
        match spans[i] {
            Some(s) if s.contains(now) => s,
            _ => {
                let s = calendar::span(period, self.config.limiter.quota_time_zone, now);
                spans[i] = Some(s);
                s
            }
        }
    }

    /// The route limit a key of plan `key_plan` (none: no key) is held to:
    /// its plan's own (`limit_by_plan`), else the route's `limit`.
    fn route_rule(&self, route: usize, key_plan: Option<&str>) -> Option<&RouteRule> {
        key_plan
            .and_then(|p| self.plan_route_rules[route].get(p))
            .or(self.route_rules[route].as_ref())
    }

    /// After a request's decision: a split global limit's turn goes back
    /// if the request spent nothing on it (`RouteRule::settle`).
    pub fn settle(&self, plan: &Plan, outcome: &Outcome) {
        if let Some(rr) = self.route_rule(plan.route, plan.route_plan.as_deref()) {
            if !rr.shards.is_empty() {
                rr.settle(&plan.checks, outcome);
            }
        }
    }

    /// The CORS rules of a route, or (`None`) of requests that matched none.
    pub fn cors(&self, route: Option<usize>) -> Option<&CorsRules> {
        match route {
            Some(i) => self.route_cors[i].as_ref(),
            None => self.global_cors.as_ref(),
        }
    }
}

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
            let digest = crate::apikeys::digest_of(secret);
            match cfg.keys.lookup_digest(&digest) {
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
    let ip_identity = format!("ip:{client}");
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
    if charged && !cfg.clients.allow.iter().any(|n| n.contains(&client_ip)) {
        if let Some(rule) = &policy.ip_rule {
            checks.push(rule.check(&ip_identity));
        }
        if let (Some(k), Some(identity)) = (key, &key_identity) {
            if let Some(rule) = policy.key_rule(&k) {
                checks.push(rule.check(identity));
            }
            policy.quota_checks(&k, identity, SystemClock.now_us(), &mut checks);
        }
        if let (Some(rr), Some(identity)) = (route_rule, &route_identity) {
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

/// Whose buckets an operator asks about (`/limits`, `gateway limits`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// An API key, by its id (never its secret).
    Key(String),
    /// A client address (IPv6 grouped by `clients.ipv6_prefix_len`).
    Ip(IpAddr),
    /// No client: only with a route keyed on an attribute, and its value.
    Nobody,
}

/// One bucket an operator can see or reset, and the route it limits.
#[derive(Debug, Clone)]
pub struct Bucket {
    pub check: Check,
    pub route: Option<String>,
    /// Which sub-bucket of a split global limit (from 0), if it is one.
    pub shard: Option<u64>,
}

impl Bucket {
    /// What an operator is shown of the bucket: its tier, route and
    /// algorithm, and for a sub-bucket `"2 of 4"` (its limit is its share).
    pub fn describe(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "tier": self.check.tier.as_str(),
            "route": self.route,
            "algorithm": self.check.algorithm.name(),
        });
        if let Some(i) = self.shard {
            v["sub_bucket"] = format!("{} of {}", i + 1, self.check.shards).into();
        }
        if let Algorithm::Calendar { period, end, .. } = self.check.algorithm {
            v["tier"] = self.check.policy_name().into();
            v["period"] = period.as_str().into();
            v["period_ends"] = (end.div_euclid(1_000_000)).into();
        }
        v
    }
}

/// Why `buckets` has none to name.
#[derive(Debug, Clone, PartialEq)]
pub enum BucketsError {
    /// A key id or route the config does not have.
    Unknown(String),
    /// The question lacks what would name a bucket (a client, a value).
    Missing(String),
    /// The question asks for what cannot be (a route's quota).
    Invalid(String),
}

impl std::fmt::Display for BucketsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BucketsError::Unknown(m) | BucketsError::Missing(m) | BucketsError::Invalid(m) => {
                f.write_str(m)
            }
        }
    }
}

/// The buckets a subject's requests are charged to: its own tier bucket
/// (ip or key), then, for each route (or only `route`), the route's bucket
/// it would use: its client bucket, the route's global bucket, or with
/// `value` the bucket of that header or query value. Attribute-keyed
/// buckets are named only with `value` (their values cannot be listed).
pub fn buckets(
    policy: &Policy,
    subject: &Subject,
    route: Option<&str>,
    value: Option<&str>,
    quota: Option<&str>,
) -> Result<Vec<Bucket>, BucketsError> {
    if let Some(period) = quota {
        return quota_bucket(policy, subject, route, period).map(|b| vec![b]);
    }
    let cfg = &policy.config;
    // The key named, looked up once: its plan's rules and its quotas.
    let mut hold = None;
    let key = match subject {
        Subject::Key(id) => Some(
            policy
                .key_by_id(id, &mut hold)
                .ok_or_else(|| BucketsError::Unknown(format!("no API key has id \"{id}\"")))?,
        ),
        _ => None,
    };
    let client = match subject {
        Subject::Key(id) => Some((format!("k:{id}"), key.and_then(|k| policy.key_rule(&k)))),
        Subject::Ip(ip) => {
            let addr = ClientAddr::new(*ip, cfg.clients.ipv6_prefix_len);
            Some((
                format!("ip:{addr}"),
                policy.ip_rule.as_ref().map(Cow::Borrowed),
            ))
        }
        Subject::Nobody if route.is_some() && value.is_some() => None,
        Subject::Nobody => {
            return Err(BucketsError::Missing(
                "name a client: key=ID or ip=ADDRESS (or route=NAME with value=V)".into(),
            ))
        }
    };
    let routes: Vec<usize> = match route {
        Some(name) => vec![cfg
            .routes
            .iter()
            .position(|r| r.name == name)
            .ok_or_else(|| BucketsError::Unknown(format!("no route is named \"{name}\"")))?],
        None => (0..cfg.routes.len()).collect(),
    };
    let mut out = Vec::new();
    if let (Some((identity, Some(rule))), None) = (&client, route) {
        out.push(Bucket {
            check: rule.check(identity),
            route: None,
            shard: None,
        });
    }
    // A key's quotas, on the periods under way.
    if let (Some(key), Some((identity, _)), None) = (key, &client, route) {
        let mut checks = Vec::new();
        policy.quota_checks(&key, identity, SystemClock.now_us(), &mut checks);
        out.extend(checks.into_iter().map(|check| Bucket {
            check,
            route: None,
            shard: None,
        }));
    }
    let key_plan = key.map(|k| k.plan);
    for i in routes {
        let Some(rr) = policy.route_rule(i, key_plan) else {
            continue;
        };
        let own = client.as_ref().map(|(identity, _)| identity.as_str());
        let identity = match (rr.scope, &rr.key, value, own) {
            (Scope::Global, _, _, _) => Some("global".to_string()),
            (_, LimitKey::Client, _, own) => own.map(str::to_string),
            (_, LimitKey::Attribute(a), Some(v), _) => Some(format!("{}:{v}", tag(a))),
            (_, LimitKey::ClientAnd(a), Some(v), Some(own)) => {
                Some(format!("{own}/{}:{v}", tag(a)))
            }
            // Without a value: the bucket requests lacking the attribute use.
            (_, _, None, own) if rr.missing == Missing::Client => own.map(str::to_string),
            // A route asked for by name whose buckets are its values': say
            // how to name one rather than answer an empty list.
            (_, LimitKey::Attribute(a) | LimitKey::ClientAnd(a), None, _) if route.is_some() => {
                return Err(BucketsError::Missing(format!(
                    "route \"{}\" is keyed on {}: name the value too (value=V; from the shell, --value V)",
                    cfg.routes[i].name,
                    a.spelling()
                )))
            }
            _ => None,
        };
        let route_name = || Some(cfg.routes[i].name.clone());
        if !rr.shards.is_empty() {
            out.extend(rr.shards.iter().zip(0..).map(|(name, i)| Bucket {
                check: rr.rule.check_named(name.clone()),
                route: route_name(),
                shard: Some(i),
            }));
        } else if let Some(identity) = identity {
            out.push(Bucket {
                check: rr.rule.check(&identity),
                route: route_name(),
                shard: None,
            });
        }
    }
    Ok(out)
}

/// One quota of a key (`quota=PERIOD`): the count of the period under way.
fn quota_bucket(
    policy: &Policy,
    subject: &Subject,
    route: Option<&str>,
    period: &str,
) -> Result<Bucket, BucketsError> {
    let Subject::Key(id) = subject else {
        return Err(BucketsError::Missing(
            "a quota is an API key's: name it, key=ID (from the shell, --key ID)".into(),
        ));
    };
    if route.is_some() {
        return Err(BucketsError::Invalid(
            "a quota is the key's on every route: give quota or route, not both".into(),
        ));
    }
    let mut hold = None;
    let key = policy
        .key_by_id(id, &mut hold)
        .ok_or_else(|| BucketsError::Unknown(format!("no API key has id \"{id}\"")))?;
    let mut checks = Vec::new();
    policy.quota_checks(&key, &format!("k:{id}"), SystemClock.now_us(), &mut checks);
    let periods: Vec<&str> = checks
        .iter()
        .filter_map(|c| match c.algorithm {
            Algorithm::Calendar { period, .. } => Some(period.as_str()),
            _ => None,
        })
        .collect();
    let Some(i) = periods.iter().position(|p| *p == period) else {
        return Err(BucketsError::Unknown(format!(
            "API key \"{id}\" has no {period} quota; its quotas: [{}]",
            periods.join(", ")
        )));
    };
    Ok(Bucket {
        check: checks.swap_remove(i),
        route: None,
        shard: None,
    })
}

/// A quota's `used`, beside the `limit`, `remaining` and `lease` of a
/// `/limits` entry: what requests have spent this period. Tokens this
/// replica holds on lease are not spent yet; other replicas' leases are
/// not known here and count as used.
pub fn add_used(b: &mut serde_json::Value) {
    if b.get("period").is_none() {
        return;
    }
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let unspent = n(&b["remaining"]) + n(&b["lease"]["tokens"]);
    b["used"] = n(&b["limit"]).saturating_sub(unspent).into();
}

fn tag(a: &Attribute) -> &'static str {
    match a {
        Attribute::Header(_) => "h",
        Attribute::Query(_) => "q",
        Attribute::Claim(_) => "c",
    }
}

/// The fate of a planned request.
#[derive(Debug, Clone, PartialEq)]
pub enum Conclusion {
    Admit {
        headers: Vec<(&'static str, HeaderValue)>,
        /// Leaky-bucket shaping: wait this long, then go upstream.
        delay: Duration,
    },
    Reject {
        headers: Vec<(&'static str, HeaderValue)>,
        /// Exact wait until a retry can succeed, in ms (rounded up).
        retry_after_ms: u64,
        /// The limits that refused, by `Check::policy_name`.
        violated: Vec<&'static str>,
    },
    /// Redis failed and the operator chose to deny.
    Unavailable,
}

/// Per-tier results for metrics and the access log: every tier of a
/// decided request once.
pub fn tier_labels(outcome: &Outcome) -> Vec<(LimitKind, DecisionLabel)> {
    match outcome {
        Outcome::Decided {
            verdict, checks, ..
        } => checks
            .iter()
            .zip(&verdict.decisions)
            .map(|(c, d)| {
                let label = match (d.allowed, c.shadow) {
                    (true, _) => DecisionLabel::Allowed,
                    (false, true) => DecisionLabel::ShadowRejected,
                    (false, false) => DecisionLabel::Rejected,
                };
                (c.kind(), label)
            })
            .collect(),
        Outcome::Remembered { checks, tier, .. } => checks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let label = if i == *tier {
                    DecisionLabel::Rejected
                } else {
                    DecisionLabel::NotAsked
                };
                (c.kind(), label)
            })
            .collect(),
        Outcome::FailOpen | Outcome::FailClosed => Vec::new(),
    }
}

/// Turns the limiter's outcome into what the client sees. `jitter_us` is the
/// random spread added to Retry-After (never making it earlier).
pub fn conclude(outcome: &Outcome, style: HeaderStyle, jitter_us: u64) -> Conclusion {
    let (verdict, checks) = match outcome {
        Outcome::Decided {
            verdict, checks, ..
        } => (verdict, checks),
        Outcome::Remembered {
            checks,
            tier,
            decision,
            now_us,
        } => {
            // The policy names every tier, as on any other answer.
            let wait_us = decision.retry_after_us;
            let mut hs = headers(style, checks, &checks[*tier], decision, wait_us, *now_us);
            hs.push(retry_after(wait_us, jitter_us));
            return Conclusion::Reject {
                headers: hs,
                retry_after_ms: wait_us.div_ceil(1000),
                violated: vec![checks[*tier].policy_name()],
            };
        }
        Outcome::FailOpen => {
            return Conclusion::Admit {
                headers: Vec::new(),
                delay: Duration::ZERO,
            }
        }
        Outcome::FailClosed => return Conclusion::Unavailable,
    };
    let decisions = &verdict.decisions;
    if checks.is_empty() {
        return Conclusion::Admit {
            headers: Vec::new(),
            delay: Duration::ZERO,
        };
    }
    let pairs = || checks.iter().zip(decisions.iter());
    if verdict.admitted(checks) {
        // Most restrictive: least remaining, then the longest until reset.
        let (c, d) = pairs()
            .min_by_key(|(c, d)| (d.remaining * c.shards, std::cmp::Reverse(d.reset_after_us)))
            .expect("checks is not empty");
        let delay = pairs()
            .filter(|(_, d)| d.allowed)
            .map(|(_, d)| d.delay_us)
            .max()
            .unwrap_or(0);
        Conclusion::Admit {
            headers: headers(style, checks, c, d, d.reset_after_us, verdict.now_us),
            delay: Duration::from_micros(delay),
        }
    } else {
        let rejecting = || pairs().filter(|(c, d)| !d.allowed && !c.shadow);
        let (c, d) = rejecting()
            .max_by_key(|(_, d)| d.retry_after_us)
            .expect("a rejected verdict has a rejecting tier");
        let wait_us = d.retry_after_us;
        let mut hs = headers(style, checks, c, d, wait_us, verdict.now_us);
        hs.push(retry_after(wait_us, jitter_us));
        Conclusion::Reject {
            headers: hs,
            retry_after_ms: wait_us.div_ceil(1000),
            violated: rejecting().map(|(c, _)| c.policy_name()).collect(),
        }
    }
}

/// Retry-After in whole seconds, never earlier than the true wait.
fn retry_after(wait_us: u64, jitter_us: u64) -> (&'static str, HeaderValue) {
    (
        "retry-after",
        HeaderValue::from((wait_us + jitter_us).div_ceil(1_000_000).max(1)),
    )
}

/// The rate-limit headers for the most restrictive tier `(c, d)`.
fn headers(
    style: HeaderStyle,
    checks: &[Check],
    c: &Check,
    d: &Decision,
    reset_us: u64,
    now_us: i64,
) -> Vec<(&'static str, HeaderValue)> {
    // Six with Retry-After: one allocation, never regrown.
    let mut out = Vec::with_capacity(6);
    if style.x_ratelimit() {
        let reset_at = (now_us.max(0) as u64 + reset_us).div_ceil(1_000_000);
        // A sub-bucket of a split global limit speaks for the whole: its
        // share times the shards (remaining: an estimate, see docs/operator/limits.md).
        out.push(("x-ratelimit-limit", HeaderValue::from(d.limit * c.shards)));
        out.push((
            "x-ratelimit-remaining",
            HeaderValue::from(d.remaining * c.shards),
        ));
        out.push(("x-ratelimit-reset", HeaderValue::from(reset_at)));
    }
    if style.ietf() {
        let mut policy = String::with_capacity(40 * checks.len());
        for (i, check) in checks.iter().enumerate() {
            if i > 0 {
                policy.push_str(", ");
            }
            let (q, w) = quota_window(&check.algorithm);
            let q = q * check.shards;
            let _ = write!(policy, "\"{}\";q={q};w={w}", check.policy_name());
        }
        let current = format!(
            "\"{}\";r={};t={}",
            c.policy_name(),
            d.remaining * c.shards,
            reset_us.div_ceil(1_000_000)
        );
        // Tier names and digits: always valid header text.
        for (name, text) in [("ratelimit-policy", policy), ("ratelimit", current)] {
            if let Ok(v) = HeaderValue::try_from(text) {
                out.push((name, v));
            }
        }
    }
    out
}

/// A rule as an IETF quota policy: q requests per w seconds.
fn quota_window(alg: &Algorithm) -> (u64, u64) {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => (
            capacity,
            ((capacity as f64 / refill_per_sec).ceil() as u64).max(1),
        ),
        Algorithm::LeakyBucket { rate_per_sec, .. } => {
            let burst = quota(alg);
            (burst, ((burst as f64 / rate_per_sec).ceil() as u64).max(1))
        }
        Algorithm::FixedWindow { limit, window_secs }
        | Algorithm::SlidingWindow { limit, window_secs }
        | Algorithm::SlidingLog { limit, window_secs } => (limit, window_secs),
        Algorithm::Calendar { limit, period, .. } => (limit, period.nominal_secs()),
    }
}

/// Which backend decided, for the access log.
pub fn backend_of(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Decided { backend, .. } => backend.as_str(),
        Outcome::Remembered { .. } => crate::limiter::FallbackState::Redis.as_str(),
        Outcome::FailOpen => "fail-open",
        Outcome::FailClosed => "fail-closed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::slot;

    fn global(capacity: u64, shards: u64) -> crate::config::Limit {
        crate::config::Limit {
            algorithm: Algorithm::TokenBucket {
                capacity,
                refill_per_sec: 4.0,
            },
            scope: Scope::Global,
            shadow: false,
            key: LimitKey::Client,
            missing: Missing::Reject,
            cost: 1,
            shards,
        }
    }

    #[test]
    fn a_split_global_limit_deals_its_sub_buckets_in_turn_each_holding_its_share() {
        let rr = RouteRule::new("rl", "r", &global(12, 4));
        let names: Vec<String> = (0..8).map(|_| rr.check("global").key).collect();
        assert_eq!(names[..4], names[4..], "in turn, then again");
        let distinct: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), 4);
        let c = rr.check("global");
        assert_eq!(c.shards, 4);
        assert_eq!(
            c.algorithm,
            Algorithm::TokenBucket {
                capacity: 3,
                refill_per_sec: 1.0
            }
        );
        assert!(c.key.starts_with("rl:route:r:tb-3-1:global/"), "{}", c.key);
    }

    #[test]
    fn sub_bucket_i_of_k_lies_in_the_i_th_k_th_of_the_cluster_slots() {
        for k in [2u64, 3, 4, 6, 16, 128] {
            for i in 0..k {
                let s = slot(&shard_name("rl:route:r:tb-3-1:", i, k)) as u64;
                // Clear of the ends, where a master's boundary may fall.
                assert!(
                    (i * 16384 / k + 2..(i + 1) * 16384 / k - 2).contains(&s),
                    "shard {i} of {k} in slot {s}"
                );
            }
        }
    }

    #[test]
    fn an_unsplit_limit_keeps_its_one_bucket() {
        let rr = RouteRule::new("rl", "r", &global(12, 1));
        let c = rr.check("global");
        assert_eq!((c.key.as_str(), c.shards), ("rl:route:r:tb-12-4:global", 1));
    }

    fn decided_by(checks: Vec<Check>, allowed: &[bool]) -> Outcome {
        let decisions = allowed
            .iter()
            .map(|&allowed| Decision {
                allowed,
                limit: 3,
                remaining: 0,
                retry_after_us: 0,
                reset_after_us: 0,
                delay_us: 0,
            })
            .collect();
        Outcome::Decided {
            verdict: crate::limiter::Verdict {
                decisions,
                now_us: 0,
            },
            backend: crate::limiter::FallbackState::Redis,
            checks: checks.into(),
            standing: 0,
        }
    }

    #[test]
    fn a_turn_that_spent_nothing_is_given_back() {
        // Its own rule name: the dealer is shared by every rule of the process.
        let rr = RouteRule::new("settle", "r", &global(12, 4));
        let ip = Check {
            tier: Tier::Ip,
            ..rr.rule.check("ip:1.2.3.4")
        };
        let settle = |route: &Check, decided: Vec<Check>, allowed: &[bool]| {
            rr.settle(&[ip.clone(), route.clone()], &decided_by(decided, allowed));
        };
        // Another tier rejected it while its sub-bucket admitted (so it was
        // refunded, or never charged): the next request gets the same one.
        let a = rr.check("global");
        settle(&a, vec![ip.clone(), a.clone()], &[false, true]);
        let b = rr.check("global");
        assert_eq!(b.key, a.key);
        // A remembered denial of another tier answered alone: the same.
        settle(&b, vec![ip.clone()], &[false]);
        let c = rr.check("global");
        assert_eq!(c.key, a.key);
        // The sub-bucket itself was empty: the turn is spent, the next is tried.
        settle(&c, vec![ip.clone(), c.clone()], &[true, false]);
        let d = rr.check("global");
        assert_ne!(d.key, c.key);
        // Admitted: spent.
        settle(&d, vec![ip.clone(), d.clone()], &[true, true]);
        assert_ne!(rr.check("global").key, d.key);
    }
}
