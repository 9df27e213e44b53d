//! Which buckets an operator can see or reset (`/limits`, `gateway
//! limits`): a subject's own tier bucket, each route's bucket it would be
//! charged to, a key's (or a token's plan's) quotas, and what a quota has
//! used. A JWT's client is named as its tokens name it (issuer, id claim)
//! and limited as `classify` limits a request carrying one.

use super::*;

/// Whose buckets an operator asks about (`/limits`, `gateway limits`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// An API key, by its id (never its secret).
    Key(String),
    /// A client address (IPv6 grouped by `clients.ipv6_prefix_len`).
    Ip(IpAddr),
    /// The client a verified JWT names: its id claim's value (`sub` by
    /// default), its `iss` (needed only when more than one issuer is
    /// configured), and the plan its plan claim names (mapped through
    /// `plan_map`; without one, the issuer's `default_plan`).
    Jwt {
        id: String,
        issuer: Option<String>,
        plan: Option<String>,
    },
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
    let cfg = &policy.config;
    // The key (or token's client) named, looked up once: its plan's rules
    // and its quotas.
    let mut hold = None;
    let token = match subject {
        Subject::Jwt { id, issuer, plan } => Some(token_client(
            policy,
            id,
            issuer.as_deref(),
            plan.as_deref(),
        )?),
        _ => None,
    };
    let key = match subject {
        Subject::Key(id) => Some(
            policy
                .key_by_id(id, &mut hold)
                .ok_or_else(|| BucketsError::Unknown(format!("no API key has id \"{id}\"")))?,
        ),
        _ => token.as_ref().map(TokenClient::key),
    };
    // Its own bucket identity, as `classify` names it.
    let own = match (subject, &token) {
        (Subject::Key(id), _) => Some(format!("k:{id}")),
        (_, Some(t)) => Some(t.identity.clone()),
        _ => None,
    };
    if let Some(period) = quota {
        return quota_bucket(policy, subject, key.zip(own.as_deref()), route, period)
            .map(|b| vec![b]);
    }
    let client = match (subject, own) {
        (_, Some(identity)) => Some((identity, key.and_then(|k| policy.key_rule(&k)))),
        (Subject::Ip(ip), _) => {
            let addr = ClientAddr::new(*ip, cfg.clients.ipv6_prefix_len);
            Some((
                format!("ip:{addr}"),
                policy.ip_rule.as_ref().map(Cow::Borrowed),
            ))
        }
        _ if route.is_some() && value.is_some() => None,
        _ => return Err(BucketsError::Missing(
            "name a client: key=ID or ip=ADDRESS, or a JWT's sub=ID (or route=NAME with value=V)"
                .into(),
        )),
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
        policy.quota_checks(&key, identity, SystemClock.now_us(), true, &mut checks);
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

/// One quota of a key or a token's client (`quota=PERIOD`): the count of
/// the period under way.
fn quota_bucket(
    policy: &Policy,
    subject: &Subject,
    client: Option<(KeyRef<'_>, &str)>,
    route: Option<&str>,
    period: &str,
) -> Result<Bucket, BucketsError> {
    let Some((key, identity)) = client else {
        return Err(BucketsError::Missing(
            "a quota is an API key's or a JWT client's: name it, key=ID or sub=ID (from the shell, --key ID or --sub ID)".into(),
        ));
    };
    if route.is_some() {
        return Err(BucketsError::Invalid(
            "a quota is the client's on every route: give quota or route, not both".into(),
        ));
    }
    let mut checks = Vec::new();
    policy.quota_checks(&key, identity, SystemClock.now_us(), true, &mut checks);
    let periods: Vec<&str> = checks
        .iter()
        .filter_map(|c| match c.algorithm {
            Algorithm::Calendar { period, .. } => Some(period.as_str()),
            _ => None,
        })
        .collect();
    let Some(i) = periods.iter().position(|p| *p == period) else {
        let whose = match subject {
            Subject::Jwt { .. } => format!("JWT client \"{}\" (plan {})", key.id, key.plan),
            _ => format!("API key \"{}\"", key.id),
        };
        return Err(BucketsError::Unknown(format!(
            "{whose} has no {period} quota; its quotas: [{}]",
            periods.join(", ")
        )));
    };
    Ok(Bucket {
        check: checks.swap_remove(i),
        route: None,
        shard: None,
    })
}

/// A JWT's client as a request carrying its token is limited: its bucket
/// identity, its id and its plan.
struct TokenClient {
    identity: String,
    id: String,
    plan: String,
}

impl TokenClient {
    /// The key its requests are charged as (`classify` makes the same).
    fn key(&self) -> KeyRef<'_> {
        KeyRef {
            id: &self.id,
            plan: &self.plan,
            quotas: None,
            burst: None,
        }
    }
}

/// The client `id` of `issuer` (the only one configured, if not named),
/// on the plan a token whose plan claim says `plan` would have.
fn token_client(
    policy: &Policy,
    id: &str,
    issuer: Option<&str>,
    plan: Option<&str>,
) -> Result<TokenClient, BucketsError> {
    let cfg = &policy.config;
    let issuers = cfg.jwt.as_ref().map_or(&[][..], |j| &j.issuers[..]);
    let named: Vec<&str> = issuers.iter().map(|i| i.issuer.as_str()).collect();
    let settings = match issuer {
        Some(iss) => issuers.iter().find(|i| i.issuer == iss).ok_or_else(|| {
            BucketsError::Unknown(format!(
                "no [[auth.jwt.issuers]] has issuer \"{iss}\"; configured: [{}]",
                named.join(", ")
            ))
        })?,
        None => match issuers {
            [only] => only,
            [] => {
                return Err(BucketsError::Unknown(
                    "no JWT issuer is configured ([[auth.jwt.issuers]])".into(),
                ))
            }
            _ => {
                return Err(BucketsError::Missing(format!(
                    "more than one JWT issuer is configured: name it, iss=ISSUER (from the shell, --issuer ISSUER); configured: [{}]",
                    named.join(", ")
                )))
            }
        },
    };
    let plan = match plan {
        None => settings.default_plan.clone(),
        Some(p) => crate::identity::jwt::plan_named(settings, p, |p| cfg.plans.contains_key(p))
            .ok_or_else(|| {
                BucketsError::Unknown(format!(
                    "plan \"{p}\" is neither a plan of the config nor in issuer \"{}\"'s plan_map (a token naming it has default_plan \"{}\": ask without plan)",
                    settings.issuer, settings.default_plan
                ))
            })?,
    };
    Ok(TokenClient {
        identity: crate::identity::jwt::client_identity(&settings.issuer, id),
        id: id.to_string(),
        plan,
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
