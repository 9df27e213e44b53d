//! The admin listener: `/healthz` (alive), `/readyz`, `/metrics` (Prometheus
//! text), `/limits` (a client's buckets: see `limits`), `/usage`, `/keys`
//! (runtime API keys: see `keys`), `/top` (the clients refused most:
//! `crate::top`), and `/ui`, the operator page (`ui/`: it reads the others).
//!
//! `/readyz` answers 503 until the start-up attempt to reach Redis has ended,
//! then 200, in fallback too: a replica on its local share still enforces
//! its part of the limit. The body says which backend decides, how many
//! replicas share the limit, and why Redis is not in use when it is not.

use std::sync::Arc;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use super::{keys, limits, Live};
use crate::admission::Policy;
use crate::limiter::Fallback;
use crate::metrics;

/// The operator page (`/ui`): compiled in, no toolchain, no CDN.
const UI_HTML: &str = include_str!("ui/index.html");
const UI_JS: &str = include_str!("ui/app.js");
const UI_CSS: &str = include_str!("ui/style.css");
const UI_CSP: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

pub struct Admin {
    pub limiter: Arc<Fallback>,
    pub live: Arc<ArcSwap<Live>>,
    pub top: Arc<crate::top::Top>,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_string();
        let mut extra = Vec::new();
        let (status, ctype, body) = match path.as_str() {
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                let h = self.limiter.health();
                let mut body = serde_json::json!({
                    "ready": h.started,
                    "backend": h.backend,
                    "replicas": h.replicas,
                });
                if let Some(e) = &h.redis_error {
                    body["redis_error"] = e.as_str().into();
                }
                if let Some(r) = h.redis_error_reason {
                    body["redis_error_reason"] = r.into();
                }
                if !h.warnings.is_empty() {
                    body["warnings"] = h.warnings.clone().into();
                }
                if let Some(d) = h.fallback_for {
                    // Rounded to the tenth: read by people and alerts alike.
                    body["fallback_secs"] = ((d.as_secs_f64() * 10.0).round() / 10.0).into();
                }
                if !h.started {
                    body["waiting_for"] = "redis (server.startup_redis_wait_ms)".into();
                }
                let status = if h.started { 200 } else { 503 };
                (status, "application/json", body.to_string().into_bytes())
            }
            "/limits" => {
                // One snapshot for the whole request (never held across an await
                // of the config: it is an Arc of its own).
                let live = self.live.load_full();
                let req = session.req_header();
                let a = limits::serve(
                    &self.limiter,
                    &live.policy.config,
                    &live.policy,
                    &req.method,
                    req.uri.query(),
                    req.headers.get("authorization").map(|v| v.as_bytes()),
                )
                .await;
                extra = a.headers;
                (
                    a.status,
                    "application/json",
                    a.body.to_string().into_bytes(),
                )
            }
            p if p == "/keys" || p.starts_with("/keys/") => {
                let a = keys::serve(&self.limiter, &self.live, session).await;
                extra = a.headers;
                (
                    a.status,
                    "application/json",
                    a.body.to_string().into_bytes(),
                )
            }
            "/usage" => {
                let policy = self.live.load_full().policy.clone();
                let query = session.req_header().uri.query().unwrap_or("").to_string();
                match usage(&self.limiter, &policy, &query).await {
                    Ok((ctype, body)) => (200, ctype, body.into_bytes()),
                    Err((status, why)) => (
                        status,
                        "application/json",
                        serde_json::json!({ "error": why }).to_string().into_bytes(),
                    ),
                }
            }
            "/ui" | "/ui/" | "/ui/app.js" | "/ui/style.css" => {
                let (ctype, body) = match path.as_str() {
                    "/ui/app.js" => ("text/javascript; charset=utf-8", UI_JS),
                    "/ui/style.css" => ("text/css; charset=utf-8", UI_CSS),
                    _ => ("text/html; charset=utf-8", UI_HTML),
                };
                // Its own files only: no inline script, nothing from elsewhere.
                extra.push(("content-security-policy", UI_CSP));
                extra.push(("cache-control", "no-cache"));
                (200, ctype, body.as_bytes().to_vec())
            }
            "/top" if !self.top.enabled() => (
                404,
                "application/json",
                serde_json::json!({ "error": "the top-K of refused clients is off ([admin] top = false)" })
                    .to_string()
                    .into_bytes(),
            ),
            "/top" => {
                let query = session.req_header().uri.query().unwrap_or("");
                match crate::top::Ask::parse(query) {
                    Ok(ask) => {
                        let now = crate::clock::Clock::now_us(&crate::clock::SystemClock);
                        let body = self.top.query(&ask, now);
                        (200, "application/json", body.to_string().into_bytes())
                    }
                    Err(why) => (
                        400,
                        "application/json",
                        serde_json::json!({ "error": why }).to_string().into_bytes(),
                    ),
                }
            }
            "/metrics" => (200, "text/plain; version=0.0.4", {
                // As of this scrape, not of the last probe.
                let on_fallback = self.limiter.health().fallback_for;
                metrics::fallback_for(on_fallback.unwrap_or_default());
                self.live.load().gates.scrape();
                metrics::render().into_bytes()
            }),
            _ => (404, "text/plain", b"not found\n".to_vec()),
        };
        let mut response = Response::builder()
            .status(status)
            .header("content-type", ctype)
            .header("content-length", body.len());
        for (name, value) in extra {
            response = response.header(name, value);
        }
        response
            .body(body)
            .unwrap_or_else(|_| Response::new(Vec::new()))
    }
}

/// `GET /usage?period=P[&at=DATE][&format=csv|jsonl]`: `gateway usage` over
/// HTTP (a read, open like `/limits`).
async fn usage(
    limiter: &Fallback,
    policy: &Policy,
    query: &str,
) -> Result<(&'static str, String), (u16, String)> {
    let config = &policy.config;
    let mut period = None;
    let mut at = None;
    let mut format = "csv".to_string();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = crate::identity::attributes::decode(v)
            .map_err(|e| (400, format!("query parameter {k} {e}")))?;
        match k {
            "period" => period = Some(v),
            "at" => at = Some(v),
            "format" => format = v,
            other => {
                return Err((
                    400,
                    format!("unknown parameter \"{other}\": expected period, at, format"),
                ))
            }
        }
    }
    let period = period.ok_or((
        400,
        "name a period: period=minute|hour|day|week|month".to_string(),
    ))?;
    let zone = config.limiter.quota_time_zone;
    let q = crate::usage::Question::parse(&period, at.as_deref(), &format, zone)
        .map_err(|e| (400, e))?;
    let Some(redis) = limiter.redis() else {
        return Err((409, "usage is read from Redis, and limiter.backend is \"local\": GET /limits?key=ID&quota=PERIOD".into()));
    };
    let report = crate::usage::collect(redis, config, &policy.keys, &q)
        .await
        .map_err(|e| (503, format!("cannot read Redis: {e}")))?;
    Ok((
        q.format.content_type(),
        crate::usage::render(&report, q.format),
    ))
}
