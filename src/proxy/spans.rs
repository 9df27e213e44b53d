//! The request's server span (`[tracing]`, src/traces/): what it says when
//! it starts (the request as read) and when it is finished in `logging`
//! (the answer and the limiter's decision), read off the context.

use opentelemetry::KeyValue;

use super::*;
use crate::traces::Finish;

/// The span's attributes known once the request is read (only a sampled
/// span asks for them).
pub(super) fn request_attributes(session: &Session) -> Vec<KeyValue> {
    let req = session.req_header();
    let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
    let host = req
        .uri
        .authority()
        .map(|a| a.host())
        .or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .map(|h| h.rsplit_once(':').map_or(h, |(host, _)| host))
        })
        .unwrap_or("");
    let mut a = vec![
        KeyValue::new("http.request.method", req.method.as_str().to_string()),
        KeyValue::new("url.path", req.uri.path().to_string()),
        KeyValue::new("url.scheme", if tls { "https" } else { "http" }),
        KeyValue::new(
            "network.protocol.version",
            if session.is_http2() { "2" } else { "1.1" },
        ),
    ];
    if !host.is_empty() {
        a.push(KeyValue::new("server.address", host.to_string()));
    }
    a
}

impl Gateway {
    /// Why the gateway refused the request: the in-flight cap, its token,
    /// or the tiers that refused it (their policy names). None: it did not.
    pub(super) fn refused_by(ctx: &Ctx) -> Option<String> {
        match (ctx.in_flight_refusal, ctx.token_refusal) {
            (Some(reason), _) => Some(format!("in_flight:{reason}")),
            (None, Some(reason)) => Some(format!("token:{reason}")),
            (None, None) => {
                let names: Vec<&str> = ctx
                    .tiers
                    .iter()
                    .filter(|(_, d)| *d == DecisionLabel::Rejected)
                    .map(|(t, _)| t.as_str())
                    .collect();
                (!names.is_empty()).then(|| names.join(","))
            }
        }
    }

    /// Ends the request's span with its answer and decision, and a child
    /// span for each Redis call it waited on.
    pub(super) fn finish_span(&self, session: &Session, ctx: &mut Ctx, status: u16) {
        let (Some(span), Some(traces)) = (ctx.span.take(), &self.traces) else {
            return;
        };
        let refused_by = Self::refused_by(ctx);
        let decision = match (&refused_by, ctx.backend) {
            (Some(by), _) if by.starts_with("in_flight:") => "refused_in_flight",
            (Some(by), _) if by.starts_with("token:") => "refused_token",
            (Some(_), _) => "refused",
            (None, "fail-closed") => "unavailable",
            (None, _) if ctx.tiers.is_empty() => "not_limited",
            (None, _) => "admitted",
        };
        let route = match (&ctx.live, Self::route_index(ctx)) {
            (Some(l), Some(i)) => {
                let r = &l.policy.config.routes[i];
                Some((r.path_prefix.as_str(), r.name.as_str()))
            }
            _ => None,
        };
        let client = ctx
            .plan
            .as_ref()
            .map(|p| p.client_ip.to_string())
            .or_else(|| ctx.refused_client.clone());
        let trail = ctx.trail.take().unwrap_or_default();
        span.finish(
            traces,
            session.req_header().method.as_str(),
            Finish {
                status,
                route,
                client: client.as_deref(),
                decision,
                refused_by: refused_by.as_deref(),
                backend: ctx.backend,
                decided_by: trail.decided_by.map(|d| d.as_str()),
                key_id: ctx.plan.as_ref().and_then(|p| p.key_id.as_deref()),
                queue_wait: ctx.queue_wait,
                charged: ctx.charged,
                redis: trail.redis.iter().map(|w| (w.start, w.end, w.ok)).collect(),
            },
        );
    }
}
