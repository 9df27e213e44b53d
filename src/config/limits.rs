//! The limits: a tier's or route's `limit` table (algorithm and parameters),
//! the key plans (`[plans.NAME]`) and the API keys that name them.

use std::collections::BTreeMap;
use std::ops::Range;

use toml::de::{DeTable, DeValue};

use super::model::*;
use super::reader::{join, Reader, Value};
use super::reader::{name, opt, req};
use super::rules;

/// Every limit table's keys (`tiers.ip`, a route's `limit` and `limit_by_plan`).
pub const LIMIT_KEYS: &[&str] = &["algorithm", "shadow"];
/// A route limit's keys beside those (a tier has no scope or key of its own).
pub const ROUTE_LIMIT_KEYS: &[&str] = &["scope", "key", "missing", "cost", "shards"];
pub const TOKEN_BUCKET_KEYS: &[&str] = &["capacity", "refill_per_sec"];
pub const LEAKY_BUCKET_KEYS: &[&str] = &["rate_per_sec", "max_delay_ms"];
/// `fixed_window`, `sliding_window` and `sliding_log`.
pub const WINDOW_KEYS: &[&str] = &["limit", "window_secs"];
pub const PLAN_KEYS: &[&str] = &["capacity", "refill_per_sec", "quotas", "priority"];
pub const QUOTA_KEYS: &[&str] = &["limit", "period", "cost"];
pub const API_KEY_KEYS: &[&str] = &[
    "id",
    "key",
    "sha256",
    "plan",
    "quotas",
    "capacity",
    "refill_per_sec",
];

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
    let mut keys = LIMIT_KEYS.to_vec();
    if with_scope {
        keys.extend_from_slice(ROUTE_LIMIT_KEYS);
    }
    keys.extend_from_slice(match kind {
        Kind::Token => TOKEN_BUCKET_KEYS,
        Kind::Leaky => LEAKY_BUCKET_KEYS,
        Kind::Fixed | Kind::Sliding | Kind::Log => WINDOW_KEYS,
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
            r.choice(path, v, Scope::SPELLINGS)
        })?
    } else {
        Scope::Client
    };
    let shadow = opt(r, t, p, "shadow", false, |r, path, v| r.boolean(path, v))?;
    let key = opt(r, t, p, "key", LimitKey::Client, limit_key)?;
    let missing = opt(r, t, p, "missing", Missing::Reject, |r, path, v| {
        r.choice(path, v, Missing::SPELLINGS)
    })?;
    let most = algorithm.quota();
    // `cost = "response"`: charged what the answer says (the route's
    // `charge`); each request is admitted on its estimate.
    let charged =
        matches!(t.get("cost").map(|v| v.get_ref()), Some(DeValue::String(s)) if s == "response");
    let cost = opt(r, t, p, "cost", 1, |r, path, v| {
        if charged {
            return Some(1);
        }
        if let DeValue::String(s) = v.get_ref() {
            r.error(
                path,
                Some(&v.span()),
                format!("expected a number of tokens or \"response\", found \"{s}\""),
            );
            return None;
        }
        let n = r.int(path, v, 1, 1 << 40)?;
        if n > most {
            // Such a request could never be admitted: say so now, not as 429s.
            r.error(
                path,
                Some(&v.span()),
                format!(
                    "a request costing {n} could never be admitted: the rule holds at most {most}"
                ),
            );
            return None;
        }
        Some(n)
    })?;
    if charged && matches!(algorithm, Algorithm::SlidingLog { .. }) {
        r.error(
            &join(p, "cost"),
            Some(span),
            "cost = \"response\" charges units a log of requests cannot hold: use token_bucket, leaky_bucket, fixed_window or sliding_window",
        );
        return None;
    }
    if scope == Scope::Global && key != LimitKey::Client {
        r.error(
            &join(p, "key"),
            Some(span),
            "a global limit has one bucket for everyone: `key` needs scope = \"client\"",
        );
        return None;
    }
    let shards = match t.get("shards").filter(|_| with_scope) {
        Some(v) => shards(r, &join(p, "shards"), v, scope, &algorithm, cost)?,
        None => 1,
    };
    if key == LimitKey::Client && t.get("missing").is_some() {
        r.error(
            &join(p, "missing"),
            Some(span),
            "`missing` applies to a key on a header or query parameter; this limit keys on the client",
        );
        return None;
    }
    Some(Limit {
        algorithm,
        scope,
        shadow,
        key,
        missing,
        cost,
        charged,
        shards,
    })
}

/// The most sub-buckets a global limit splits into.
/// (An operator's reset deletes every sub-bucket one round trip at a time,
/// within its time budget.)
pub const MAX_SHARDS: u64 = 128;

/// A global limit's `shards`: K sub-buckets, each holding exactly 1/K of the
/// quota (and of the rate), so together they never admit more than the
/// whole. Token buckets and windows only: a leaky bucket's shaping and a
/// log's per-request entries do not divide.
fn shards(
    r: &mut Reader<'_>,
    path: &str,
    v: &Value<'_>,
    scope: Scope,
    alg: &Algorithm,
    cost: u64,
) -> Option<u64> {
    let k = r.int(path, v, 1, MAX_SHARDS)?;
    let span = Some(v.span());
    let fail = |r: &mut Reader<'_>, msg: String| {
        r.error(path, span.as_ref(), msg);
        None
    };
    if scope != Scope::Global {
        return fail(
            r,
            "`shards` splits a global limit across Redis; a client-scoped limit is already one bucket per client: set scope = \"global\" or remove `shards`".into(),
        );
    }
    let (name, quota) = match *alg {
        Algorithm::TokenBucket { capacity, .. } => ("capacity", capacity),
        Algorithm::FixedWindow { limit, .. } | Algorithm::SlidingWindow { limit, .. } => {
            ("limit", limit)
        }
        _ => {
            return fail(
                r,
                format!(
                "`shards` applies to token_bucket, fixed_window and sliding_window limits, not {}",
                alg.name()
            ),
            )
        }
    };
    if quota % k != 0 {
        return fail(
            r,
            format!(
                "{name} = {quota} does not split into {k} equal shards: expected a multiple of {k}"
            ),
        );
    }
    if cost > quota / k {
        return fail(
            r,
            format!(
                "a request costing {cost} could never be admitted: each of the {k} shards holds {}",
                quota / k
            ),
        );
    }
    Some(k)
}

/// A route limit's `key`: `client`, `header:NAME`, `query:NAME`,
/// `claim:NAME` (of a verified JWT), or `client+` any of those.
fn limit_key(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<LimitKey> {
    const EXPECTED: &str = "expected \"client\", \"header:NAME\", \"query:NAME\", \"claim:NAME\", or one of those after \"client+\"";
    let s = r.string(path, v)?;
    if s == "client" {
        return Some(LimitKey::Client);
    }
    let (with_client, rest) = match s.strip_prefix("client+") {
        Some(rest) => (true, rest),
        None => (false, s.as_str()),
    };
    let attribute = match rest.split_once(':') {
        Some(("header", name)) if http::HeaderName::from_bytes(name.as_bytes()).is_ok() => {
            Attribute::Header(name.to_ascii_lowercase())
        }
        Some(("header", name)) => {
            r.error(
                path,
                Some(&v.span()),
                format!("\"{name}\" is not a valid header name"),
            );
            return None;
        }
        Some(("query", name)) if !name.is_empty() && !name.contains(['&', '=', '#']) => {
            Attribute::Query(name.to_string())
        }
        Some(("query", name)) => {
            r.error(
                path,
                Some(&v.span()),
                format!("\"{name}\" is not a query parameter name"),
            );
            return None;
        }
        Some(("claim", name)) if !name.is_empty() => Attribute::Claim(name.to_string()),
        _ => {
            r.error(path, Some(&v.span()), format!("{EXPECTED}, found \"{s}\""));
            return None;
        }
    };
    Some(if with_client {
        LimitKey::ClientAnd(attribute)
    } else {
        LimitKey::Attribute(attribute)
    })
}

pub(super) fn plans(r: &mut Reader<'_>, t: Option<&DeTable<'_>>) -> Option<BTreeMap<String, Plan>> {
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
        r.only_keys(&p, pt, PLAN_KEYS);
        let priority = opt(r, pt, &p, "priority", 0, |r, path, v| {
            r.int(path, v, 0, 1_000_000).map(|n| n as i64)
        });
        let span = v.span();
        let capacity = req(r, pt, &p, Some(&span), "capacity", |r, path, v| {
            r.int(path, v, 1, 1 << 40)
        });
        let refill = req(r, pt, &p, Some(&span), "refill_per_sec", |r, path, v| {
            r.positive_number(path, v)
        });
        let quotas = opt(r, pt, &p, "quotas", Vec::new(), quotas);
        match (capacity, refill, quotas, priority) {
            (Some(capacity), Some(refill_per_sec), Some(quotas), Some(priority)) => {
                out.insert(
                    plan_name,
                    Plan {
                        priority,
                        capacity,
                        refill_per_sec,
                        quotas,
                    },
                );
            }
            _ => ok = false,
        }
    }
    ok.then_some(out)
}

/// `quotas = [{ limit = N, period = "day" }, ...]`: one count per calendar
/// period, each period at most once.
fn quotas(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<Vec<Quota>> {
    let items = r.array(path, v)?;
    let mut out: Vec<Quota> = Vec::new();
    let mut ok = true;
    for (i, item) in items.iter().enumerate() {
        let at = format!("{path}[{i}]");
        let Some(qt) = r.table(&at, item) else {
            ok = false;
            continue;
        };
        r.only_keys(&at, qt, QUOTA_KEYS);
        let span = item.span();
        let limit = req(r, qt, &at, Some(&span), "limit", |r, path, v| {
            r.int(path, v, 1, rules::MAX_COUNT)
        });
        let period = req(r, qt, &at, Some(&span), "period", |r, path, v| {
            r.choice(path, v, &crate::calendar::Period::ALL)
        });
        let charged = opt(r, qt, &at, "cost", false, |r, path, v| {
            let s = r.string(path, v)?;
            if s == "response" {
                Some(true)
            } else {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("expected \"response\" (counted in the units of `charge` routes; omit for requests), found \"{s}\""),
                );
                None
            }
        });
        let (Some(limit), Some(period), Some(charged)) = (limit, period, charged) else {
            ok = false;
            continue;
        };
        if let Err(e) = rules::new_period(&out, period, charged) {
            r.error(&join(&at, "period"), Some(&span), e);
            ok = false;
            continue;
        }
        out.push(Quota {
            limit,
            period,
            charged,
        });
    }
    ok.then_some(out)
}

pub(super) fn api_key(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    plans: &[String],
) -> Option<ApiKey> {
    r.only_keys(p, t, API_KEY_KEYS);
    // Read before the rest, reported with it: None inside means invalid.
    let own_quotas = t.get("quotas").map(|v| quotas(r, &join(p, "quotas"), v));
    let own_burst = burst(r, p, t, span);
    let id = req(r, t, p, Some(span), "id", name);
    // The value rules are `rules.rs`'s, shared with the keys file.
    let ruled = |r: &mut Reader<'_>, path: &str, v: &Value<'_>, rule: Result<(), String>| {
        rule.map_err(|e| r.error(path, Some(&v.span()), e)).ok()
    };
    let plan = req(r, t, p, Some(span), "plan", |r, path, v| {
        let plan = r.string(path, v)?;
        let rule = rules::plan(&plan, plans.iter().map(String::as_str));
        ruled(r, path, v, rule).map(|()| plan)
    });
    let digest = match (t.get("key"), t.get("sha256")) {
        (Some(k), None) => {
            let path = join(p, "key");
            let secret = r.string(&path, k)?;
            rules::secret(&secret)
                .map_err(|e| r.error(&path, Some(&k.span()), e))
                .ok()
        }
        (None, Some(h)) => {
            let path = join(p, "sha256");
            let hex_str = r.string(&path, h)?;
            rules::sha256(&hex_str)
                .map_err(|e| r.error(&path, Some(&h.span()), e))
                .ok()
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
    let quotas = match own_quotas {
        Some(q) => Some(q?),
        None => None,
    };
    Some(ApiKey {
        id: id?,
        digest: digest?,
        plan: plan?,
        quotas,
        burst: own_burst?,
    })
}

/// A key's own burst bucket: `capacity` and `refill_per_sec` together, or
/// neither (its plan's). `None` when what is given is invalid.
fn burst(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
) -> Option<Option<Burst>> {
    if t.get("capacity").is_none() && t.get("refill_per_sec").is_none() {
        return Some(None);
    }
    let capacity = req(r, t, p, Some(span), "capacity", |r, path, v| {
        r.int(path, v, 1, 1 << 40)
    });
    let refill = req(r, t, p, Some(span), "refill_per_sec", |r, path, v| {
        r.positive_number(path, v)
    });
    Some(Some(Burst {
        capacity: capacity?,
        refill_per_sec: refill?,
    }))
}
