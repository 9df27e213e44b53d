//! `[auth.jwt]`: the issuers whose verified tokens name a client (the key
//! tier's identity and plan, and claims a route limit can key on).

use std::collections::BTreeMap;
use std::ops::Range;

use jsonwebtoken::Algorithm as Alg;
use toml::de::DeTable;

use super::model::{JwksUrl, JwtIssuer, JwtKeys, JwtSettings};
use super::reader::{opt, req, Reader, Value};

pub const AUTH_KEYS: &[&str] = &["jwt"];
pub const JWT_KEYS: &[&str] = &["issuers", "cache_max_entries"];
pub const ISSUER_KEYS: &[&str] = &[
    "issuer",
    "jwks_url",
    "key_files",
    "audiences",
    "algorithms",
    "leeway_secs",
    "id_claim",
    "plan_claim",
    "plan_map",
    "default_plan",
    "jwks_refresh_secs",
    "jwks_min_refetch_secs",
    "jwks_timeout_ms",
    "jwks_max_stale_secs",
    "jwks_ca_file",
];

const ALGORITHMS: &str =
    "RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA, HS256, HS384, HS512";

/// `[auth]`; `Some(None)` when there is no `[auth.jwt]`.
pub(super) fn read(
    r: &mut Reader<'_>,
    t: Option<&DeTable<'_>>,
    plan_names: &[String],
) -> Option<Option<JwtSettings>> {
    let Some(t) = t else { return Some(None) };
    r.only_keys("auth", t, AUTH_KEYS);
    let Some(v) = t.get("jwt") else {
        return Some(None);
    };
    let jwt = r.table("auth.jwt", v)?;
    let p = "auth.jwt";
    r.only_keys(p, jwt, JWT_KEYS);
    let cache = opt(r, jwt, p, "cache_max_entries", 100_000, |r, path, v| {
        r.int(path, v, 1, 10_000_000).map(|n| n as usize)
    });
    let issuers = req(r, jwt, p, Some(&v.span()), "issuers", |r, path, v| {
        let items = r.array(path, v)?;
        if items.is_empty() {
            r.error(path, Some(&v.span()), "expected at least one issuer");
            return None;
        }
        let mut out = Vec::new();
        let mut ok = true;
        for (i, item) in items.iter().enumerate() {
            let at = format!("{path}[{i}]");
            match r
                .table(&at, item)
                .and_then(|t| issuer(r, &at, t, &item.span(), plan_names))
            {
                Some(x) => out.push(x),
                None => ok = false,
            }
        }
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, x) in out.iter().enumerate() {
            if let Some(first) = seen.insert(&x.issuer, i) {
                let at = format!("{path}[{i}].issuer");
                let span = r.spans.get(&at).cloned();
                r.error(
                    &at,
                    span.as_ref(),
                    format!("issuer \"{}\" is already {path}[{first}]", x.issuer),
                );
                ok = false;
            }
        }
        ok.then_some(out)
    });
    Some(Some(JwtSettings {
        issuers: issuers?,
        cache_max_entries: cache?,
    }))
}

fn issuer(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
    plan_names: &[String],
) -> Option<JwtIssuer> {
    r.only_keys(p, t, ISSUER_KEYS);
    let iss = req(r, t, p, Some(span), "issuer", |r, path, v| {
        let s = r.string(path, v)?;
        if s.is_empty() {
            r.error(path, Some(&v.span()), "expected the `iss` its tokens carry");
            return None;
        }
        Some(s)
    });
    let audiences = opt(r, t, p, "audiences", vec![], |r, path, v| {
        let items = r.strings(path, v)?;
        let mut ok = true;
        for (i, (s, span)) in items.iter().enumerate() {
            if s.is_empty() {
                r.error(&format!("{path}[{i}]"), Some(span), "an empty audience");
                ok = false;
            }
        }
        ok.then(|| items.into_iter().map(|(s, _)| s).collect())
    });
    let algorithms = req(r, t, p, Some(span), "algorithms", algorithms);
    let leeway = opt(r, t, p, "leeway_secs", 30, |r, path, v| {
        r.int(path, v, 0, 3600)
    });
    let claim = |r: &mut Reader<'_>, path: &str, v: &Value<'_>| {
        let s = r.string(path, v)?;
        if s.is_empty() {
            r.error(path, Some(&v.span()), "expected a claim name");
            return None;
        }
        Some(s)
    };
    let id_claim = opt(r, t, p, "id_claim", "sub".to_string(), claim);
    let plan_claim = opt(r, t, p, "plan_claim", None, |r, path, v| {
        claim(r, path, v).map(Some)
    });
    let plan = |r: &mut Reader<'_>, path: &str, v: &Value<'_>| {
        let s = r.string(path, v)?;
        if plan_names.contains(&s) {
            return Some(s);
        }
        r.error(
            path,
            Some(&v.span()),
            format!(
                "unknown plan \"{s}\"; [plans] has: {}",
                plan_names.join(", ")
            ),
        );
        None
    };
    let default_plan = req(r, t, p, Some(span), "default_plan", plan);
    let plan_map = opt(r, t, p, "plan_map", BTreeMap::new(), |r, path, v| {
        let m = r.table(path, v)?;
        let mut out = BTreeMap::new();
        let mut ok = true;
        for (k, v) in m.iter() {
            match plan(r, &format!("{path}.{}", k.get_ref()), v) {
                Some(name) => {
                    out.insert(k.get_ref().to_string(), name);
                }
                None => ok = false,
            }
        }
        ok.then_some(out)
    });
    let keys = keys(r, p, t, span);
    Some(JwtIssuer {
        issuer: iss?,
        keys: keys?,
        audiences: audiences?,
        algorithms: algorithms?,
        leeway_secs: leeway?,
        id_claim: id_claim?,
        plan_claim: plan_claim?,
        plan_map: plan_map?,
        default_plan: default_plan?,
    })
}

fn algorithms(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<Vec<Alg>> {
    let items = r.strings(path, v)?;
    if items.is_empty() {
        r.error(
            path,
            Some(&v.span()),
            format!("expected one or more of {ALGORITHMS}"),
        );
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for (i, (s, span)) in items.iter().enumerate() {
        let at = format!("{path}[{i}]");
        match s.parse::<Alg>() {
            Ok(a) => out.push(a),
            Err(_) if s.eq_ignore_ascii_case("none") => {
                r.error(
                    &at,
                    Some(span),
                    "\"none\" is never accepted: a token must be signed",
                );
                ok = false;
            }
            Err(_) => {
                r.error(
                    &at,
                    Some(span),
                    format!("expected one of {ALGORITHMS}, found \"{s}\""),
                );
                ok = false;
            }
        }
    }
    ok.then_some(out)
}

/// `jwks_url` (with its `jwks_*` settings) or `key_files`.
fn keys(r: &mut Reader<'_>, p: &str, t: &DeTable<'_>, span: &Range<usize>) -> Option<JwtKeys> {
    let url_settings = ISSUER_KEYS
        .iter()
        .filter(|k| k.starts_with("jwks_") && **k != "jwks_url");
    match (t.get("jwks_url"), t.get("key_files")) {
        (Some(_), Some(files)) => {
            r.error(
                &format!("{p}.key_files"),
                Some(&files.span()),
                "give jwks_url or key_files, not both",
            );
            None
        }
        (None, None) => {
            r.error(
                p,
                Some(span),
                "needs jwks_url or key_files: where its keys come from",
            );
            None
        }
        (None, Some(_)) => {
            let mut ok = true;
            for k in url_settings {
                if let Some(v) = t.get(*k) {
                    r.error(&format!("{p}.{k}"), Some(&v.span()), "only with jwks_url");
                    ok = false;
                }
            }
            let files = req(r, t, p, Some(span), "key_files", key_files)?;
            ok.then_some(files)
        }
        (Some(_), None) => {
            let url = req(r, t, p, Some(span), "jwks_url", |r, path, v| {
                let s = r.string(path, v)?;
                match super::url::HttpUrl::parse(&s) {
                    Ok(_) => Some(s),
                    Err(e) => {
                        r.error(path, Some(&v.span()), e);
                        None
                    }
                }
            });
            let secs = |max: u64| {
                move |r: &mut Reader<'_>, path: &str, v: &Value<'_>| r.int(path, v, 1, max)
            };
            let refresh = opt(r, t, p, "jwks_refresh_secs", 300, secs(86_400));
            let refetch = opt(r, t, p, "jwks_min_refetch_secs", 10, |r, path, v| {
                r.int(path, v, 0, 3600)
            });
            let timeout = opt(r, t, p, "jwks_timeout_ms", 2000, secs(60_000));
            let stale = opt(r, t, p, "jwks_max_stale_secs", 86_400, secs(365 * 86_400));
            let ca = opt(r, t, p, "jwks_ca_file", None, |r, path, v| {
                r.file_path(path, v).map(Some)
            });
            Some(JwtKeys::Url(JwksUrl {
                url: url?,
                refresh_secs: refresh?,
                min_refetch_secs: refetch?,
                timeout_ms: timeout?,
                max_stale_secs: stale?,
                ca_file: ca?,
            }))
        }
    }
}

/// The key files, each named with its line: the `jwt` room reads them
/// (`identity::Credentials`), so a bad one is reported with its key.
fn key_files(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<JwtKeys> {
    let items = r.strings(path, v)?;
    if items.is_empty() {
        r.error(path, Some(&v.span()), "expected at least one key file");
        return None;
    }
    for (i, (_, span)) in items.iter().enumerate() {
        r.spans.insert(format!("{path}[{i}]"), span.clone());
    }
    Some(JwtKeys::Files {
        paths: items.into_iter().map(|(f, _)| f.into()).collect(),
    })
}
