//! `/keys` on the admin listener: runtime API keys (`crate::identity::apikeys::admin`).
//!
//! - `POST /keys` `{"id", "plan", ...}`: issue one; the answer holds its
//!   secret, shown this once (201);
//! - `GET /keys?cursor=C&limit=N`: a page of at most N keys (1 to 10,000;
//!   100 by default; `next`: the cursor of the next page, null on the last);
//! - `GET /keys/ID`, `PATCH /keys/ID` `{"plan": ...}`, `DELETE /keys/ID`.
//!
//! Every method needs the admin token (or, without one, a loopback-only
//! admin listener), as a reset does: a list names every client. The audit
//! log's "by" is the `X-Gateway-Actor` header when given, else the peer.

use std::sync::Arc;

use arc_swap::ArcSwap;
use http::Method;
use pingora::protocols::http::ServerSession;

use super::limits::{authorize_change, error, Answer};
use super::Live;
use crate::identity::apikeys::admin::{Cursor, KeyAdmin};
use crate::limiter::Fallback;

/// The largest body read.
const MAX_BODY: usize = 64 * 1024;

pub async fn serve(
    limiter: &Fallback,
    live: &ArcSwap<Live>,
    session: &mut ServerSession,
) -> Answer {
    let live: Arc<Live> = live.load_full();
    let config = &live.policy.config;
    let req = session.req_header();
    let (method, path) = (req.method.clone(), req.uri.path().to_string());
    let query = req.uri.query().unwrap_or("").to_string();
    if let Err(refused) = authorize_change(
        config,
        req.headers.get("authorization").map(|v| v.as_bytes()),
        "managing API keys",
    ) {
        return refused;
    }
    let actor = req
        .headers
        .get("x-gateway-actor")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.chars().take(64).collect::<String>());
    let by = actor.unwrap_or_else(|| {
        session
            .client_addr()
            .map_or("unknown".into(), |a| a.to_string())
    });
    let Some(redis) = limiter.redis() else {
        return error(
            409,
            "runtime API keys are kept in Redis, and limiter.backend is \"local\": use [[api_keys]] or clients.api_keys_file",
        );
    };
    let body = match read_body(session).await {
        Ok(b) => b,
        Err(a) => return a,
    };
    let admin = KeyAdmin {
        redis,
        config,
        config_keys: &live.policy.keys,
        runtime: Some(&live.policy.runtime),
        by: &by,
    };
    let id = path.strip_prefix("/keys/").filter(|i| !i.is_empty());
    let result = match (&method, id) {
        (&Method::POST, None) => admin.create(&body).await.map(|v| (201, v)),
        (&Method::GET, None) => match page(&query) {
            Ok((cursor, limit)) => admin.list(&cursor, limit).await.map(|v| (200, v)),
            Err(e) => return error(400, e),
        },
        (&Method::GET, Some(id)) => admin.get(id).await.map(|v| (200, v)),
        (&Method::PATCH, Some(id)) => admin.update(id, &body).await.map(|v| (200, v)),
        (&Method::DELETE, Some(id)) => admin.revoke(id).await.map(|v| (200, v)),
        _ => return error(405, "POST /keys, GET /keys, GET|PATCH|DELETE /keys/ID"),
    };
    match result {
        Ok((status, body)) => Answer {
            status,
            body,
            headers: vec![("cache-control", "no-store")],
        },
        Err(r) => error(r.status, r.message),
    }
}

/// `cursor` (the start) and `limit` (100; 1 to `MAX_PAGE`, a larger one
/// is `MAX_PAGE`).
fn page(query: &str) -> Result<(Cursor, usize), String> {
    let (mut cursor, mut limit) = (Cursor::default(), 100);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            // A client may have percent-encoded the `:` of a `next`.
            "cursor" => {
                cursor = Cursor::parse(&v.replace("%3A", ":").replace("%3a", ":"))
                    .map_err(|e| format!("cursor: {e}"))?
            }
            "limit" => {
                limit = match v.parse::<usize>() {
                    Ok(0) => {
                        return Err(format!(
                            "limit: expected a number from 1 to {}, found 0",
                            Cursor::MAX_PAGE
                        ))
                    }
                    Ok(n) => n.min(Cursor::MAX_PAGE),
                    Err(_) => {
                        return Err(format!(
                            "limit: expected a number from 1 to {}, found \"{v}\"",
                            Cursor::MAX_PAGE
                        ))
                    }
                }
            }
            other => {
                return Err(format!(
                    "unknown parameter \"{other}\": expected cursor, limit"
                ))
            }
        }
    }
    Ok((cursor, limit))
}

async fn read_body(session: &mut ServerSession) -> Result<Vec<u8>, Answer> {
    let mut body = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > MAX_BODY {
                    return Err(error(413, format!("a body of at most {MAX_BODY} bytes")));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => return Err(error(400, format!("cannot read the body: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::page;

    use crate::identity::apikeys::admin::Cursor;

    #[test]
    fn pages() {
        assert_eq!(page(""), Ok((Cursor::default(), 100)));
        assert_eq!(
            page("cursor=7&limit=5"),
            Ok((Cursor::parse("7").unwrap(), 5))
        );
        assert_eq!(page("limit=20000").map(|p| p.1), Ok(10_000));
        assert_eq!(
            page("limit=0"),
            Err("limit: expected a number from 1 to 10000, found 0".into())
        );
        assert_eq!(
            page("limit=x"),
            Err("limit: expected a number from 1 to 10000, found \"x\"".into())
        );
        assert!(page("cursor=7:a%20b").is_err());
        assert!(page("colour=red").is_err());
    }
}
