//! `/limits` on the admin listener: an operator's view of a client's
//! buckets (`GET`) and their reset (`DELETE`), on whichever backend decides.
//!
//! `GET /limits?key=ID`, `?sub=ID` (a JWT's client: its id claim's value,
//! with `&iss=ISSUER` when more than one issuer is configured and
//! `&plan=P` when its token's plan claim names one) or `?ip=ADDRESS`,
//! optionally `&route=NAME` (only that route's bucket) and `&value=V` (a
//! route keyed on a header, query parameter or claim: the bucket of that
//! value), or `&quota=PERIOD` (only that quota of the key or JWT client). `DELETE` with the same query resets exactly the buckets
//! `GET` shows. A quota's entry says what was `used` of it this period.
//!
//! Reading changes nothing and is open, like `/metrics`. A reset changes
//! state: with `[admin] token` set it needs `Authorization: Bearer TOKEN`
//! (the scheme in any case, RFC 9110 §11.1) on any listener; without one it
//! is served only when the admin listener is loopback-only: anyone who can
//! reach a wider one could reset limits.

use std::net::IpAddr;

use http::Method;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::admission::{self, Subject};
use crate::config::{admin_loopback_only, Config};
use crate::identity::attributes;
use crate::limiter::Fallback;

/// Status, JSON body, and the headers the status calls for.
pub struct Answer {
    pub status: u16,
    pub body: Value,
    pub headers: Vec<(&'static str, &'static str)>,
}

fn answer(status: u16, body: Value) -> Answer {
    Answer {
        status,
        body,
        headers: Vec::new(),
    }
}

/// What a `/limits` request asks.
#[derive(Debug, PartialEq)]
struct Ask {
    subject: Subject,
    route: Option<String>,
    value: Option<String>,
    /// One quota of the key, by period.
    quota: Option<String>,
}

pub(super) fn error(status: u16, message: impl Into<String>) -> Answer {
    answer(status, json!({ "error": message.into() }))
}

pub async fn serve(
    limiter: &Fallback,
    config: &Config,
    policy: &admission::Policy,
    method: &Method,
    query: Option<&str>,
    authorization: Option<&[u8]>,
) -> Answer {
    let deleting = match *method {
        Method::GET => false,
        Method::DELETE => true,
        _ => {
            let mut a = error(405, "use GET to see buckets, DELETE to reset them");
            a.headers.push(("allow", "GET, DELETE"));
            return a;
        }
    };
    if let Err(refused) = authorize(config, deleting, authorization) {
        return refused;
    }
    let ask = match parse(query.unwrap_or("")) {
        Ok(a) => a,
        Err(e) => return error(400, e),
    };
    let buckets = match admission::buckets(
        policy,
        &ask.subject,
        ask.route.as_deref(),
        ask.value.as_deref(),
        ask.quota.as_deref(),
    ) {
        Ok(b) => b,
        Err(admission::BucketsError::Unknown(e)) => return error(404, e),
        Err(admission::BucketsError::Invalid(e)) => return error(400, e),
        Err(admission::BucketsError::Missing(e)) => {
            return error(400, format!("missing query parameter: {e}"))
        }
    };
    let checks: Vec<_> = buckets.iter().map(|b| b.check.clone()).collect();
    let describe = |i: usize| buckets[i].describe();
    if deleting {
        return match limiter.reset(&checks).await {
            Ok(done) => {
                tracing::info!(subject = ?ask.subject, route = ?ask.route, buckets = checks.len(), backend = done.backend.as_str(), "admin: buckets reset");
                answer(
                    200,
                    json!({
                        "reset": (0..buckets.len()).map(describe).collect::<Vec<_>>(),
                        "backend": done.backend.as_str(),
                        "redis_buckets_deleted": done.redis_buckets,
                        "local_buckets_deleted": done.local_buckets,
                    }),
                )
            }
            Err(e) => error(
                503,
                format!(
                    "reset failed, nothing is known to be reset: {}",
                    limiter.redact(&e.to_string())
                ),
            ),
        };
    }
    match limiter.inspect(&checks).await {
        Ok((backend, snapshots)) => {
            let list: Vec<Value> = snapshots
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let mut b = describe(i);
                    b["limit"] = s.limit.into();
                    b["remaining"] = s.remaining.into();
                    b["reset_ms"] = s.reset_after_us.div_ceil(1000).into();
                    b["backend"] = backend.as_str().into();
                    // Tokens Redis debited ahead for this replica, not yet
                    // spent (counted out of `remaining` already).
                    b["lease"] = match limiter.lease_of(&checks[i].key) {
                        Some((tokens, left)) => json!({
                            "tokens": tokens,
                            "expires_ms": left.as_millis() as u64,
                        }),
                        None => Value::Null,
                    };
                    admission::add_used(&mut b);
                    b
                })
                .collect();
            answer(200, json!({ "buckets": list }))
        }
        Err(e) => error(
            503,
            format!(
                "cannot read the buckets: {}",
                limiter.redact(&e.to_string())
            ),
        ),
    }
}

/// The token rule: see the module's doc.
fn authorize(config: &Config, deleting: bool, authorization: Option<&[u8]>) -> Result<(), Answer> {
    if !deleting {
        return Ok(());
    }
    authorize_change(config, authorization, "resetting buckets")
}

/// What changes state (`what`, for the message) needs `[admin] token`, or
/// without one a loopback-only admin listener.
pub(super) fn authorize_change(
    config: &Config,
    authorization: Option<&[u8]>,
    what: &str,
) -> Result<(), Answer> {
    match &config.admin.token {
        Some(token) => {
            // Compared as digests: the time taken says nothing about the token.
            let same = authorization
                .and_then(bearer)
                .is_some_and(|p| Sha256::digest(p) == Sha256::digest(token.expose().as_bytes()));
            if same {
                Ok(())
            } else {
                let mut a = error(
                    401,
                    format!("{what} needs Authorization: Bearer <[admin] token>"),
                );
                a.headers
                    .push(("www-authenticate", "Bearer realm=\"gateway admin\""));
                Err(a)
            }
        }
        None if !admin_loopback_only(&config.server) => Err(error(
            403,
            format!("{what} needs [admin] token when admin_listen is not loopback-only"),
        )),
        None => Ok(()),
    }
}

/// The credentials of an `Authorization: Bearer <token>` header: the scheme
/// is matched in any case, then one or more spaces (RFC 9110 §11.4).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii()).filter(|t| !t.is_empty())
}

fn parse(query: &str) -> Result<Ask, String> {
    let (mut key, mut ip, mut route, mut value, mut quota) = (None, None, None, None, None);
    let (mut sub, mut iss, mut plan) = (None, None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = attributes::decode(v).map_err(|e| format!("query parameter {k} {e}"))?;
        let slot = match k {
            "key" => &mut key,
            "sub" => &mut sub,
            "iss" => &mut iss,
            "plan" => &mut plan,
            "ip" => &mut ip,
            "route" => &mut route,
            "value" => &mut value,
            "quota" => &mut quota,
            other => {
                return Err(format!(
                    "unknown query parameter \"{other}\"; expected key, sub, iss, plan, ip, route, value, quota"
                ))
            }
        };
        if slot.replace(v).is_some() {
            return Err(format!("query parameter {k} is given twice"));
        }
    }
    if sub.is_none() && (iss.is_some() || plan.is_some()) {
        return Err("iss and plan describe a JWT's client: give sub=ID with them".into());
    }
    let subject = match (key, sub, ip) {
        (Some(k), None, None) => Subject::Key(k),
        (None, Some(id), None) => Subject::Jwt {
            id,
            issuer: iss,
            plan,
        },
        (None, None, Some(a)) => Subject::Ip(
            a.parse::<IpAddr>()
                .map_err(|_| format!("ip=\"{a}\" is not an IP address"))?,
        ),
        (None, None, None) => Subject::Nobody,
        _ => return Err("give one of key=ID, sub=ID or ip=ADDRESS, not more".into()),
    };
    Ok(Ask {
        subject,
        route,
        value,
        quota,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(admin_listen: &str, token: Option<&str>) -> Config {
        let admin = token.map_or(String::new(), |t| format!("[admin]\ntoken = \"{t}\"\n"));
        crate::config::parse(&format!(
            "[server]\nlisten = [\"127.0.0.1:8080\"]\nadmin_listen = \"{admin_listen}\"\n{admin}\n\
             [[upstreams]]\nname = \"a\"\nservers = [\"127.0.0.1:1\"]\n\
             [[routes]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"a\"\n"
        ))
        .expect("config")
    }

    #[test]
    fn who_may_read_and_reset() {
        let status = |c: &Config, deleting, auth: Option<&str>| {
            authorize(c, deleting, auth.map(str::as_bytes)).map_or_else(|a| a.status, |()| 200)
        };
        let loopback = config("127.0.0.1:9091", None);
        assert_eq!(status(&loopback, false, None), 200);
        assert_eq!(status(&loopback, true, None), 200);
        let open = config("0.0.0.0:9091", None);
        assert_eq!(status(&open, false, None), 200, "reading is open");
        assert_eq!(
            status(&open, true, None),
            403,
            "a wide listener resets nothing without a token"
        );
        let token = "0123456789abcdef-token";
        for listen in ["0.0.0.0:9091", "127.0.0.1:9091"] {
            let guarded = config(listen, Some(token));
            assert_eq!(status(&guarded, false, None), 200, "reading is open");
            assert_eq!(status(&guarded, true, None), 401, "{listen}");
            assert_eq!(status(&guarded, true, Some("Bearer nope")), 401);
            assert_eq!(
                status(&guarded, true, Some(token)),
                401,
                "the Bearer scheme is required"
            );
            for scheme in ["Bearer", "bearer", "BEARER", "Bearer  "] {
                assert_eq!(
                    status(&guarded, true, Some(&format!("{scheme} {token}"))),
                    200,
                    "{scheme:?}"
                );
            }
            assert_eq!(status(&guarded, true, Some(&format!("Bearer{token}"))), 401);
        }
        let refused = authorize(&config("0.0.0.0:9091", Some(token)), true, None).unwrap_err();
        assert!(refused
            .headers
            .contains(&("www-authenticate", "Bearer realm=\"gateway admin\"")));
    }

    #[test]
    fn queries() {
        assert_eq!(
            parse("key=alice&route=rides"),
            Ok(Ask {
                subject: Subject::Key("alice".into()),
                route: Some("rides".into()),
                value: None,
                quota: None,
            })
        );
        assert_eq!(
            parse("ip=2001%3Adb8%3A%3A1&value=a+b").map(|a| (a.subject, a.value)),
            Ok((
                Subject::Ip("2001:db8::1".parse().unwrap()),
                Some("a b".into())
            ))
        );
        assert!(parse("key=a&ip=1.2.3.4").unwrap_err().contains("not more"));
        assert!(parse("key=a&sub=b").unwrap_err().contains("not more"));
        assert_eq!(
            parse("sub=u%401&iss=https%3A%2F%2Fid.test%2F&plan=gold").map(|a| a.subject),
            Ok(Subject::Jwt {
                id: "u@1".into(),
                issuer: Some("https://id.test/".into()),
                plan: Some("gold".into()),
            })
        );
        assert_eq!(
            parse("sub=u1").map(|a| a.subject),
            Ok(Subject::Jwt {
                id: "u1".into(),
                issuer: None,
                plan: None,
            })
        );
        assert!(parse("iss=x").unwrap_err().contains("give sub=ID"));
        assert!(parse("ip=nope").unwrap_err().contains("not an IP address"));
        assert!(parse("key=a&key=b").unwrap_err().contains("twice"));
        assert!(parse("user=a")
            .unwrap_err()
            .contains("unknown query parameter \"user\""));
    }
}
