//! The only module that touches Pingora's proxy: the `ProxyHttp` phases, each
//! a few lines calling into admission, the limiter and the upstream pools.
//!
//! A request's life, top to bottom:
//! 1. `request_filter`: one config snapshot; header size; a bearer JWT's
//!    verdict (`verify_token`: a signature is checked only once the client's
//!    address paid the per-IP tier for it); `admission::classify` (deny
//!    list, path, route, API key); the limiter decides every tier at once;
//!    `admission::conclude` says admit (maybe after a shaping delay), 429 or 503;
//!    a CORS preflight is answered here, never upstream; an admitted request
//!    then takes its in-flight slots (`take_slots`: per client 429, the
//!    route's and the upstream's caps, queued by plan priority, else 503).
//! 2. `upstream_peer`: round-robin over the route's healthy servers.
//! 3. `upstream_request_filter`: the normalised path, X-Forwarded-For, X-Request-Id.
//! 4. `response_filter`: the rate-limit and CORS headers on the upstream's
//!    response; its round trip for an adaptive in-flight limit.
//! 5. `logging`: metrics and the access log line. The context is dropped
//!    after it, and with it the request's in-flight slots.
//!
//! The steps the phases call (admit, take slots, the gateway's own
//! answers) are in `steps`; the answers themselves in `responses`.

pub mod admin;
mod charge;
mod deadline;
mod keys;
mod limits;
mod reload;
mod responses;
pub mod server;
mod spans;
mod steps;
pub mod upstreams;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::HttpPeer;
use pingora::proxy::{FailToProxy, ProxyHttp, Session};
use pingora::upstreams::peer::Peer;
use pingora::{Error, ErrorSource, ErrorType, Result};

use crate::admission::{self, Conclusion, Plan, Policy, RequestView};
use crate::identity;
use crate::inflight::{ClientSlot, Gates, Permit};
use crate::limiter::{Fallback, LimitKind};
use crate::metrics::{DecisionLabel, RouteMetrics};
use responses::Reply;
use steps::{header_bytes, request_id};
use upstreams::Pools;

/// What a reload replaces as one: the admission policy, the upstream pools,
/// the in-flight caps and each route's metric handles.
pub struct Live {
    pub policy: Arc<Policy>,
    pub pools: Arc<Pools>,
    pub gates: Arc<Gates>,
    /// Indexed like the config's routes.
    route_metrics: Vec<RouteMetrics>,
    /// Requests that matched no route.
    unrouted: RouteMetrics,
}

impl Live {
    pub fn new(policy: Arc<Policy>, pools: Arc<Pools>, gates: Arc<Gates>) -> Self {
        Live {
            gates,
            route_metrics: policy
                .config
                .routes
                .iter()
                .map(|r| RouteMetrics::new(&r.name, &LimitKind::first_labels()))
                .collect(),
            unrouted: RouteMetrics::new("(none)", &LimitKind::first_labels()),
            policy,
            pools,
        }
    }
}

/// The refusal lines of the access log, capped per second (`[log]`).
static REFUSAL_LINES: crate::logging::Sampler = crate::logging::Sampler::new();

pub struct Gateway {
    pub live: Arc<ArcSwap<Live>>,
    pub limiter: Arc<Fallback>,
    /// Who is being refused (`GET /top`).
    pub top: Arc<crate::top::Top>,
    /// `[tracing]`: a span per request. None: no spans, no `traceparent` added.
    pub traces: Option<Arc<crate::traces::Traces>>,
}

/// Per-request state, made by `new_ctx`.
pub struct Ctx {
    started: Instant,
    request_id: String,
    /// The snapshot this request started with; it finishes on it.
    live: Option<Arc<Live>>,
    plan: Option<Plan>,
    /// Rate-limit headers to add to the upstream's response.
    ratelimit_headers: Vec<(&'static str, http::HeaderValue)>,
    tiers: Vec<(LimitKind, DecisionLabel)>,
    backend: &'static str,
    upstream_sent: Option<Instant>,
    /// The status of a reply the gateway wrote itself: what metrics and the
    /// access log count, also when a gRPC client was told it as a
    /// `grpc-status` on an HTTP 200.
    replied: Option<u16>,
    /// The route a refused request is counted under (no plan was made).
    refused_route: Option<usize>,
    /// Who sent a refused request (the access log's `client`).
    refused_client: Option<String>,
    /// Servers that failed this request (a retry goes elsewhere).
    failed: Vec<std::net::SocketAddr>,
    /// Retries spent: the connect retry, and the route's `retries`.
    connect_retried: bool,
    retries_used: u32,
    /// Request body bytes seen (against the route's `max_request_body_bytes`).
    body_bytes: u64,
    /// Its place under the route's `max_in_flight_per_client`, and its
    /// slots under the route's and the upstream's in-flight caps: given
    /// back when the context is dropped, however the request ended.
    client_slot: Option<ClientSlot>,
    route_slot: Option<Permit>,
    upstream_slot: Option<Permit>,
    /// Why the in-flight caps refused it (or dropped it: `client_left`).
    in_flight_refusal: Option<&'static str>,
    /// Why its bearer JWT was refused.
    token_refusal: Option<&'static str>,
    /// A request on a `charge` route: what its answer settles.
    metered: Option<charge::Metered>,
    /// Its settled cost, and why it was charged so (`charge::settle`).
    charged: Option<(u64, &'static str)>,
    /// Its server span (`[tracing]`), and for a sampled one what its
    /// decision went through and how long it queued for an in-flight slot.
    span: Option<crate::traces::RequestSpan>,
    trail: Option<crate::limiter::trail::Trail>,
    queue_wait: Option<Duration>,
    /// Dropped with the context, after `logging` counted the request.
    _in_flight: crate::metrics::InFlight,
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            started: Instant::now(),
            request_id: String::new(),
            live: None,
            plan: None,
            ratelimit_headers: Vec::new(),
            tiers: Vec::new(),
            backend: "none",
            upstream_sent: None,
            replied: None,
            refused_route: None,
            refused_client: None,
            failed: Vec::new(),
            connect_retried: false,
            retries_used: 0,
            body_bytes: 0,
            client_slot: None,
            route_slot: None,
            upstream_slot: None,
            in_flight_refusal: None,
            token_refusal: None,
            metered: None,
            charged: None,
            span: None,
            trail: None,
            queue_wait: None,
            _in_flight: crate::metrics::InFlight::start(),
        }
    }

    /// Runs as soon as the request header is read: ends its read deadline.
    async fn early_request_filter(&self, _session: &mut Session, _ctx: &mut Ctx) -> Result<()> {
        deadline::header_read();
        Ok(())
    }

    /// Admission. Runs once the request header is read; returning `true`
    /// means a response was written and nothing goes upstream.
    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let live = self.live.load_full();
        ctx.request_id = request_id(session.req_header());
        if let Some(traces) = &self.traces {
            let req = session.req_header();
            let elapsed = ctx.started.elapsed();
            ctx.span = traces.request(&req.headers, req.method.as_str(), elapsed, || {
                spans::request_attributes(session)
            });
        }
        ctx.live = Some(live.clone());
        let policy = &live.policy;
        let cfg = &policy.config;
        let max_lines = cfg.server.max_request_headers;
        if session.req_header().headers.len() > max_lines {
            return self
                .reply(session, ctx, responses::too_many_headers(max_lines))
                .await;
        }
        let limit = cfg.server.max_request_header_bytes;
        if header_bytes(session.req_header()) > limit {
            return self
                .reply(session, ctx, responses::headers_too_large(limit))
                .await;
        }

        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |a| a.ip());
        let req = session.req_header();
        let all = |name: &str| {
            req.headers
                .get_all(name)
                .iter()
                .map(|v| v.as_bytes())
                .collect::<Vec<_>>()
        };
        let mut authorization = all("authorization");
        let bearer = policy
            .jwt
            .as_ref()
            .and_then(|v| identity::bearer_jwt(&authorization).map(|(i, token)| (v, i, token)));
        if let Some((_, i, _)) = bearer {
            authorization.remove(i);
        }
        let verdict;
        let mut view = RequestView {
            method: req.method.as_str(),
            path: req.uri.path(),
            peer,
            xff: req
                .headers
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect(),
            api_key: all(&cfg.clients.api_key_header),
            authorization,
            jwt: None,
            // HTTP/2 carries the host in `:authority`, which Pingora keeps in the URI.
            host: req
                .uri
                .authority()
                .map(|a| a.as_str())
                .or_else(|| req.headers.get("host").and_then(|v| v.to_str().ok())),
            content_length: req
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok()?.trim().parse().ok()),
            query: req.uri.query(),
            headers: &req.headers,
        };
        // A bearer JWT's verdict is the client's identity. One not seen
        // before is checked only once its address has paid the per-IP tier
        // for the check: a flood of forged tokens meets that tier's 429.
        if let Some((verifier, _, token)) = bearer {
            verdict = match self.verify_token(ctx, policy, &view, verifier, token).await {
                Ok(v) => v,
                Err(refused) => return self.reply(session, ctx, refused).await,
            };
            view.jwt = verdict.as_ref();
        }
        let mut plan = match admission::classify(policy, &view) {
            Ok(plan) => plan,
            Err(refusal) => {
                let refused = admission::refused(policy, &view);
                ctx.refused_route = refused.route;
                ctx.refused_client = Some(refused.client.to_string());
                let reply = responses::refusal(&refusal);
                // A refused preflight carries no CORS headers: the browser
                // then blocks the request it announced.
                return match refusal {
                    admission::Refusal::Cors(_) => self.send(session, ctx, reply).await,
                    _ => self.reply(session, ctx, reply).await,
                };
            }
        };
        let preflight = plan.preflight.take();
        if plan.checks.is_empty() {
            ctx.plan = Some(plan);
            return match preflight {
                Some(h) => self.send(session, ctx, responses::preflight(h)).await,
                None => self.admit(session, ctx, None).await,
            };
        }
        // A `charge` route: admitted on the request's estimate.
        let mut estimate = 0;
        if let Some(charge) = &cfg.routes[plan.route].charge {
            match self.estimate(session, charge).await {
                Ok(n) => estimate = n,
                Err(reply) => {
                    ctx.plan = Some(plan);
                    return self.reply(session, ctx, reply).await;
                }
            }
            plan.estimate(estimate);
        }
        let units = plan.units;
        // Only a sampled request has a span (`Traces::request`).
        let outcome = match ctx.span.is_some() {
            true => {
                let decision = self.limiter.decide(&plan.checks);
                let (outcome, trail) = crate::limiter::trail::traced(decision).await;
                ctx.trail = Some(trail);
                outcome
            }
            false => self.limiter.decide(&plan.checks).await,
        };
        policy.settle(&plan, &outcome);
        ctx.plan = Some(plan);
        ctx.backend = admission::backend_of(&outcome);
        ctx.tiers = admission::tier_labels(&outcome);
        match admission::conclude(&outcome, cfg.limiter.headers, steps::jitter_us(cfg)) {
            Conclusion::Admit { .. } if preflight.is_some() => {
                let h = preflight.unwrap_or_default();
                self.send(session, ctx, responses::preflight(h)).await
            }
            Conclusion::Admit { headers, delay } => {
                ctx.ratelimit_headers = headers;
                if delay > Duration::ZERO {
                    tokio::time::sleep(delay).await;
                }
                let sent = self.admit(session, ctx, Some(&outcome)).await;
                if units != 0 && matches!(sent, Ok(false)) {
                    Self::metered(ctx, outcome, units, estimate);
                }
                sent
            }
            Conclusion::Reject {
                headers,
                retry_after_ms,
                violated,
            } => {
                let reply = responses::too_many_requests(headers, retry_after_ms, &violated);
                self.reply(session, ctx, reply).await
            }
            Conclusion::Unavailable => {
                self.reply(session, ctx, responses::reduced_capacity())
                    .await
            }
        }
    }

    /// The next healthy server of the route's upstream pool.
    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let (Some(live), Some(plan)) = (&ctx.live, &ctx.plan) else {
            return Err(Error::explain(
                ErrorType::InternalError,
                "no admission plan",
            ));
        };
        let policy = &live.policy;
        let route = &policy.config.routes[plan.route];
        let Some(upstream) = policy
            .config
            .upstreams
            .iter()
            .find(|u| u.name == route.upstream)
        else {
            return Err(Error::explain(
                ErrorType::HTTPStatus(502),
                "route's upstream is not configured",
            ));
        };
        let Some(mut peer) = live.pools.select(&upstream.name, &ctx.failed) else {
            return Err(Error::explain(
                ErrorType::HTTPStatus(502),
                "no healthy upstream server",
            ));
        };
        if let Some(ms) = route.timeout_ms {
            peer.options.read_timeout = Some(Duration::from_millis(ms));
        }
        Ok(Box::new(peer))
    }

    /// A connect that failed sent nothing: one more try, on another server.
    fn fail_to_connect(
        &self,
        _session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(addr) = peer.address().as_inet() {
            ctx.failed.push(*addr);
        }
        if !ctx.connect_retried {
            ctx.connect_retried = true;
            e.set_retry(true);
        }
        e
    }

    /// After the request was sent, only an idempotent one is tried again:
    /// on another server, as many times as the route's `retries` (and, as
    /// Pingora does, once when a reused keep-alive connection turns out dead).
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("route={}", Self::route_name(ctx)));
        let idempotent = matches!(
            session.req_header().method,
            http::Method::GET
                | http::Method::HEAD
                | http::Method::PUT
                | http::Method::DELETE
                | http::Method::OPTIONS
        );
        if !idempotent || session.as_ref().retry_buffer_truncated() {
            e.set_retry(false);
            return e;
        }
        let allowed = match (&ctx.live, &ctx.plan) {
            (Some(l), Some(p)) => l.policy.config.routes[p.route].retries,
            _ => 0,
        };
        if ctx.retries_used < allowed {
            ctx.retries_used += 1;
            if let Some(addr) = peer.address().as_inet() {
                ctx.failed.push(*addr);
            }
            e.set_retry(true);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    /// Counts a body without a declared length against the route's limit.
    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        _end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Some(chunk) = body else { return Ok(()) };
        ctx.body_bytes += chunk.len() as u64;
        let max = match (&ctx.live, &ctx.plan) {
            (Some(l), Some(p)) => l.policy.config.routes[p.route].max_request_body_bytes,
            _ => None,
        };
        match max {
            Some(max) if ctx.body_bytes > max => Err(Error::explain(
                ErrorType::HTTPStatus(413),
                "request body larger than the route takes",
            )),
            _ => Ok(()),
        }
    }

    /// The upstream sees exactly the path that was routed and limited.
    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let (Some(plan), Some(live)) = (&ctx.plan, &ctx.live) {
            let route = &live.policy.config.routes[plan.route];
            // strip_prefix: "/api/reports/x" under "/api/reports" goes up as "/x".
            let path = match route.strip_prefix {
                true => match plan.path[route.path_prefix.len()..].trim_start_matches('/') {
                    "" => "/".to_string(),
                    rest => format!("/{rest}"),
                },
                false => plan.path.clone(),
            };
            let path = match upstream_request.uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path,
            };
            // HTTP/2 carries the host in the URI (`:authority`), with no Host
            // header to fall back on: keep it, or an h2 upstream has none.
            let uri = match (
                upstream_request.uri.scheme_str(),
                upstream_request.uri.authority(),
            ) {
                (Some(scheme), Some(authority)) => format!("{scheme}://{authority}{path}"),
                _ => path,
            };
            let uri = uri.parse::<http::Uri>().map_err(|e| {
                Error::because(ErrorType::InternalError, "normalised path is not a URI", e)
            })?;
            upstream_request.set_uri(uri);
            if live.policy.config.clients.hide_credentials {
                let by_key = plan.client_identity.starts_with("k:");
                hide_credentials(upstream_request, &live.policy.config.clients, by_key)?;
            }
        }
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip().to_string());
        if let Some(peer) = peer {
            let prior: Vec<String> = upstream_request
                .headers
                .get_all("x-forwarded-for")
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_string))
                .collect();
            let xff = if prior.is_empty() {
                peer
            } else {
                format!("{}, {peer}", prior.join(", "))
            };
            upstream_request.insert_header("x-forwarded-for", xff)?;
        }
        upstream_request.insert_header("x-request-id", ctx.request_id.as_str())?;
        // The upstream's span is a child of the gateway's (the client's own
        // `traceparent` is replaced by it).
        if let (Some(span), Some(traces)) = (&ctx.span, &self.traces) {
            for (name, value) in span.headers(traces) {
                upstream_request.insert_header(name, value)?;
            }
        }
        let now = Instant::now();
        ctx.upstream_sent = Some(now);
        for slot in Self::slots(ctx) {
            slot.sent(now);
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if let (Some(sent), Some(m)) = (ctx.upstream_sent, Self::route_metrics(ctx)) {
            m.upstream(sent.elapsed());
        }
        // A server error is a signal of its own to an adaptive limit, not
        // a quick round trip.
        let failed = resp.status.is_server_error();
        for slot in Self::slots(ctx) {
            match failed {
                true => slot.failed(),
                false => slot.answered(),
            }
        }
        Self::meter_start(ctx, resp)?;
        for (name, value) in ctx.ratelimit_headers.drain(..) {
            resp.insert_header(name, value)?;
        }
        // The route's policy answers for CORS, not the upstream: its own
        // Access-Control-* headers are dropped; `Vary` is added to.
        if let Some(rules) = Self::cors_rules(ctx) {
            for name in crate::cors::CorsRules::OWNED {
                resp.remove_header(*name);
            }
            let origin = session.req_header().headers.get(http::header::ORIGIN);
            for (name, value) in rules.response(origin) {
                match name {
                    "vary" => {
                        resp.append_header(name, value)?;
                    }
                    _ => resp.insert_header(name, value)?,
                }
            }
        }
        resp.insert_header("x-request-id", ctx.request_id.as_str())?;
        Ok(())
    }

    /// The answer's body, piece by piece: a `charge` route reads its cost
    /// as it passes (nothing is held).
    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        Self::meter_body(ctx, body, end_of_stream);
        Ok(None)
    }

    /// Upstream failures: 504 for a timeout, 502 for anything else.
    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        let code = match e.etype() {
            ErrorType::HTTPStatus(code) => *code,
            ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout
                if e.esource() == &ErrorSource::Upstream =>
            {
                504
            }
            _ => match e.esource() {
                ErrorSource::Upstream => 502,
                ErrorSource::Downstream => match e.etype() {
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => 0,
                    _ => 400,
                },
                ErrorSource::Internal | ErrorSource::Unset => 500,
            },
        };
        if code > 0 && session.response_written().is_none() {
            let mut reply = match code {
                502 | 504 => responses::upstream_failure(code),
                413 => {
                    let max = match (&ctx.live, &ctx.plan) {
                        (Some(l), Some(p)) => {
                            l.policy.config.routes[p.route].max_request_body_bytes
                        }
                        _ => None,
                    };
                    responses::payload_too_large(max.unwrap_or(0))
                }
                400 => responses::json(400, "bad_request", "malformed request"),
                _ => responses::internal(),
            };
            reply.headers.extend(Self::cors_headers(session, ctx));
            ctx.replied = Some(code);
            if let Err(err) = responses::send(session, reply, &ctx.request_id).await {
                tracing::debug!(error = %err, "could not send error response");
            }
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// A client that hangs up before its answer is its own business (nginx
    /// logs a 499, not an error): the access line and the `aborted` status
    /// label record it; Pingora's ERROR line would only be noise in a surge.
    fn suppress_error_log(&self, _session: &Session, _ctx: &Ctx, error: &Error) -> bool {
        error.esource() == &ErrorSource::Downstream
            && matches!(
                error.etype(),
                ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError
            )
    }

    /// What Pingora's own error logs say about a request: never the raw
    /// path or query (they may carry secrets), only the method and route.
    fn request_summary(&self, session: &Session, ctx: &Ctx) -> String {
        format!(
            "{} route={}",
            session.req_header().method,
            Self::route_name(ctx)
        )
    }

    /// Metrics and one access-log line per request.
    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        self.settle(ctx, e);
        // An upstream that timed out failed, as far as its adaptive limit is
        // concerned; one that closed or reset the connection is no longer
        // working on the request. A client that left first leaves its
        // slots held while the upstream may still be (`Permit`).
        if let Some(e) = e {
            let timed_out = matches!(
                e.etype(),
                ErrorType::ReadTimedout | ErrorType::WriteTimedout
            );
            let upstream = e.esource() == &ErrorSource::Upstream;
            for slot in Self::slots(ctx) {
                if timed_out {
                    slot.failed();
                } else if upstream {
                    slot.upstream_ended();
                }
            }
        }
        let status = ctx
            .replied
            .unwrap_or_else(|| session.response_written().map_or(0, |r| r.status.as_u16()));
        self.finish_span(session, ctx, status);
        let route = Self::route_name(ctx);
        if let Some(m) = Self::route_metrics(ctx) {
            m.request(status);
            for (tier, decision) in &ctx.tiers {
                m.decision(tier.label(), *decision);
            }
        }
        self.note_top(ctx, route);
        // Build the line only if someone reads it (benchmarks run at warn),
        // and `[log]` wants it: errors and 5xx always, the gateway's own
        // refusals at most `refusals_per_sec` a second, the rest if
        // `access` is on.
        if !tracing::enabled!(target: "access", tracing::Level::INFO) {
            return;
        }
        let log = ctx
            .live
            .as_ref()
            .map(|l| l.policy.config.log)
            .unwrap_or_default();
        let refusal = ctx.replied.is_some_and(crate::logging::sampled);
        let failed = !refusal && (e.is_some() || status == 0 || status >= 500);
        let mut left_out = 0;
        if !failed {
            if !log.access {
                return;
            }
            if refusal {
                let now = crate::clock::Clock::now_us(&crate::clock::SystemClock) / 1_000_000;
                match REFUSAL_LINES.take(log.refusals_per_sec, now as u64) {
                    Some(n) => left_out = n,
                    None => return,
                }
            }
        }
        let tiers_with = |label: DecisionLabel| {
            let names: Vec<&str> = ctx
                .tiers
                .iter()
                .filter(|(_, d)| *d == label)
                .map(|(t, _)| t.as_str())
                .collect();
            if names.is_empty() {
                "-".to_string()
            } else {
                names.join(",")
            }
        };
        let rejected_by = Self::refused_by(ctx).unwrap_or_else(|| "-".to_string());
        let shadow_rejected_by = tiers_with(DecisionLabel::ShadowRejected);
        let req = session.req_header();
        tracing::info!(
            target: "access",
            request_id = %ctx.request_id,
            route,
            method = %req.method,
            // As the metrics say it: a request whose client left before
            // any answer was written is `aborted`, not a status.
            status = %crate::metrics::status_word(status),
            client = %ctx.plan.as_ref().map(|p| p.client.to_string()).or_else(|| ctx.refused_client.clone()).unwrap_or_default(),
            key_id = ctx.plan.as_ref().and_then(|p| p.key_id.as_deref()).unwrap_or("-"),
            rejected_by = rejected_by.as_str(),
            shadow_rejected_by = shadow_rejected_by.as_str(),
            backend = ctx.backend,
            proto = if session.is_http2() { "h2" } else { "http/1.1" },
            latency_ms = ctx.started.elapsed().as_secs_f64() * 1000.0,
            left_out,
        );
    }
}

/// `clients.hide_credentials`: the key header never goes upstream, nor an
/// `Authorization: Bearer` of a request an API key named (that bearer was
/// the key: a JWT beside a key is refused). Other schemes go on.
fn hide_credentials(
    req: &mut RequestHeader,
    clients: &crate::config::Clients,
    by_key: bool,
) -> Result<()> {
    req.remove_header(clients.api_key_header.as_str());
    if by_key {
        let kept: Vec<http::HeaderValue> = req
            .headers
            .get_all(http::header::AUTHORIZATION)
            .iter()
            .filter(|v| {
                !v.as_bytes()
                    .get(..7)
                    .is_some_and(|p| p.eq_ignore_ascii_case(b"bearer "))
            })
            .cloned()
            .collect();
        req.remove_header(&http::header::AUTHORIZATION);
        for v in kept {
            req.append_header(http::header::AUTHORIZATION, v)?;
        }
    }
    Ok(())
}
