//! The limits: a tier's or route's `limit` table (algorithm and parameters),
//! the key plans (`[plans.NAME]`) and the API keys that name them.

use std::collections::BTreeMap;
use std::ops::Range;

use sha2::{Digest, Sha256};
use toml::de::DeTable;

use super::file::{name, opt, req};
use super::model::*;
use super::reader::{join, Reader, Value};

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
            r.choice(path, v, Scope::SPELLINGS)
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

pub(super) fn api_key(
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
