//! The request path's steps, called from the phases in `mod.rs`: the
//! gateway's own answers (`reply`, `send`), a bearer JWT's verdict and what
//! its client address pays for it (`verify_token`), admission through the
//! limiter (`admit`), the in-flight slots a request takes (`take_slots`, and
//! noticing a client that left while it queued), what the context says
//! (its route, CORS rules and metric handles), and the request's id.

use super::*;

impl Gateway {
    /// Writes the gateway's own answer, with the CORS headers that let
    /// browser code read it.
    pub(super) async fn reply(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        mut reply: Reply,
    ) -> Result<bool> {
        reply.headers.extend(Self::cors_headers(session, ctx));
        self.send(session, ctx, reply).await
    }

    pub(super) async fn send(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        reply: Reply,
    ) -> Result<bool> {
        ctx.replied = Some(reply.status);
        responses::send(session, reply, &ctx.request_id).await?;
        Ok(true)
    }

    /// A bearer JWT's verdict (`None`: its address is deny-listed, so the
    /// request is refused whatever the token says and it is not looked at).
    ///
    /// A token verified before, or refused on its face, costs nothing
    /// here. One whose signature is still to be checked is checked only
    /// once its client address has paid one token of the per-IP tier
    /// (`admission::token_cost`); with the tier spent, the answer is its 429
    /// (`Err`) and nothing is checked, so a flood of forged tokens costs at
    /// most the tier's rate in checks. The token is given back when the
    /// signature holds: the request is then decided on every tier together,
    /// like any other. A refused token keeps it: a 401 after a signature
    /// check costs its address one token of the IP tier.
    pub(super) async fn verify_token(
        &self,
        ctx: &mut Ctx,
        policy: &Policy,
        view: &RequestView<'_>,
        verifier: &crate::identity::jwt::Verifier,
        token: &[u8],
    ) -> std::result::Result<Option<TokenVerdict>, Reply> {
        use crate::identity::jwt::{self, Verdict};
        let cost = admission::token_cost(policy, view);
        if cost == admission::TokenCost::Refused {
            return Ok(None);
        }
        let verdict = match jwt::verdict(verifier, token).await {
            Verdict::Known(known) => known,
            Verdict::Unchecked(unchecked) => {
                let paid = match cost {
                    admission::TokenCost::Ip(check) => {
                        Some(self.pay_ip_tier(ctx, policy, view, check).await?)
                    }
                    _ => None,
                };
                let verdict = unchecked.check();
                match (&verdict, paid) {
                    (Ok(_), Some(paid)) => self.limiter.refund(&paid),
                    (Err(_), Some(paid)) => ctx.tiers = admission::tier_labels(&paid),
                    (_, None) => {}
                }
                verdict
            }
        };
        if let Err(e) = &verdict {
            ctx.token_refusal = Some(e.label());
        }
        Ok(Some(verdict))
    }

    /// The per-IP tier's token for a signature check: the limiter's
    /// outcome when the tier admits, else the answer (429, or 503 when
    /// Redis is down and the operator chose "deny").
    async fn pay_ip_tier(
        &self,
        ctx: &mut Ctx,
        policy: &Policy,
        view: &RequestView<'_>,
        check: crate::limiter::Check,
    ) -> std::result::Result<crate::limiter::Outcome, Reply> {
        let cfg = &policy.config;
        let outcome = self.limiter.decide(&Arc::from([check])).await;
        let refused = match admission::conclude(&outcome, cfg.limiter.headers, jitter_us(cfg)) {
            Conclusion::Admit { .. } => return Ok(outcome),
            Conclusion::Reject {
                headers,
                retry_after_ms,
                violated,
            } => responses::too_many_requests(headers, retry_after_ms, &violated),
            Conclusion::Unavailable => responses::reduced_capacity(),
        };
        let counted = admission::refused(policy, view);
        ctx.refused_route = counted.route;
        ctx.refused_client = Some(counted.client.to_string());
        ctx.backend = admission::backend_of(&outcome);
        ctx.tiers = admission::tier_labels(&outcome);
        Err(refused)
    }

    /// A request the rate tiers admitted goes upstream once it holds its
    /// in-flight slots (`Ok(false)`), or is answered their refusal; a
    /// request whose client left while it waited for a slot is dropped
    /// (never sent).
    /// Either way it never reaches the upstream, so what the rate tiers
    /// charged it (`charged`) is given back, as a rejection by another tier
    /// charges none.
    pub(super) async fn admit(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        charged: Option<&crate::limiter::Outcome>,
    ) -> Result<bool> {
        let slots = self.take_slots(session, ctx).await;
        if let (false, Some(outcome)) = (matches!(slots, Slots::Taken), charged) {
            self.limiter.refund(outcome);
        }
        match slots {
            Slots::Taken => Ok(false),
            Slots::Refused(refused) => self.reply(session, ctx, refused).await,
            Slots::ClientLeft => Err(Error::explain(
                ErrorType::ConnectionClosed,
                "the client left while its request waited for an in-flight slot",
            )
            .into_down()),
        }
    }

    /// Once the rate tiers admitted: the route's cap per client, then a slot
    /// under the route's and the upstream's in-flight caps (waiting in
    /// their queues if need be, by the plan's priority, while the client
    /// is watched: one that leaves gives its place to the next).
    pub(super) async fn take_slots(&self, session: &mut Session, ctx: &mut Ctx) -> Slots {
        let Some(live) = ctx.live.clone() else {
            return Slots::Taken;
        };
        let Some(plan) = ctx.plan.as_ref() else {
            return Slots::Taken;
        };
        let (i, priority) = (plan.route, plan.priority);
        let route = &live.policy.config.routes[i];
        let gates = &live.gates;
        if let Some(per_client) = gates.per_client(i) {
            match per_client.enter(&plan.client_identity) {
                Some(slot) => ctx.client_slot = Some(slot),
                None => {
                    crate::metrics::in_flight_refused("route", &route.name, "per_client");
                    ctx.in_flight_refusal = Some("per_client");
                    let max = route.max_in_flight_per_client.unwrap_or(0);
                    return Slots::Refused(responses::too_many_in_flight(&route.name, max));
                }
            }
        }
        // The longest the upstream can be working on the request, as far
        // as the gateway knows: a slot whose client left is held no longer.
        // Looked up only for a slot taken (most routes have no cap).
        let read_timeout = || {
            route.timeout_ms.map(Duration::from_millis).or_else(|| {
                live.policy
                    .config
                    .upstreams
                    .iter()
                    .find(|u| u.name == route.upstream)
                    .map(|u| Duration::from_millis(u.read_timeout_ms))
            })
        };
        gates.set_replicas(self.limiter.replicas());
        let caps = [
            ("route", route.name.as_str(), gates.route(i)),
            (
                "upstream",
                route.upstream.as_str(),
                gates.upstream(&route.upstream),
            ),
        ];
        let queued = Instant::now();
        for (kind, name, gate) in caps {
            let Some(gate) = gate else { continue };
            let acquired = tokio::select! {
                biased;
                slot = gate.acquire(priority) => Some(slot),
                () = client_gone(session) => None,
            };
            match acquired {
                Some(Ok(mut slot)) => {
                    if let Some(t) = read_timeout() {
                        slot.set_timeout(t);
                    }
                    match kind {
                        "route" => ctx.route_slot = Some(slot),
                        _ => ctx.upstream_slot = Some(slot),
                    }
                    ctx.queue_wait = Some(queued.elapsed());
                }
                Some(Err(shed)) => {
                    crate::metrics::in_flight_refused(kind, name, shed.as_str());
                    ctx.in_flight_refusal = Some(shed.as_str());
                    let wait_ms = gate.queue_timeout().as_millis() as u64;
                    return Slots::Refused(responses::over_capacity(kind, name, shed, wait_ms));
                }
                None => {
                    crate::metrics::in_flight_refused(kind, name, "client_left");
                    ctx.in_flight_refusal = Some("client_left");
                    return Slots::ClientLeft;
                }
            }
        }
        Slots::Taken
    }

    /// The request's in-flight slots (the route's, then the upstream's).
    pub(super) fn slots(ctx: &mut Ctx) -> impl Iterator<Item = &mut Permit> {
        ctx.route_slot
            .iter_mut()
            .chain(ctx.upstream_slot.iter_mut())
    }

    /// The CORS policy answering for this request: its route's (or
    /// `[cors]`'s, routeless).
    /// Counts the request's tiers in the top-K of refused clients, each
    /// named as its bucket names the client: the per-IP tier by address,
    /// the others by key id or token subject (by address without one).
    pub(super) fn note_top(&self, ctx: &Ctx, route: &str) {
        use crate::metrics::DecisionLabel;
        use crate::top::Seen;
        if ctx.tiers.is_empty() {
            return;
        }
        let now = crate::clock::Clock::now_us(&crate::clock::SystemClock);
        let refused = ctx.tiers.iter().any(|(_, d)| *d == DecisionLabel::Rejected);
        if !self.top.wants(refused, now) {
            return;
        }
        let seen: Vec<(crate::limiter::LimitKind, Seen)> = ctx
            .tiers
            .iter()
            .filter_map(|(kind, d)| match d {
                DecisionLabel::Allowed => Some((*kind, Seen::Admitted)),
                DecisionLabel::Rejected => Some((*kind, Seen::Refused)),
                DecisionLabel::ShadowRejected | DecisionLabel::NotAsked => None,
            })
            .collect();
        let addr = match (&ctx.plan, &ctx.refused_client) {
            (Some(p), _) => p.client.to_string(),
            (None, Some(c)) => c.clone(),
            (None, None) => return,
        };
        let id = ctx.plan.as_ref().and_then(|p| p.key_id.as_deref());
        let client = |kind: crate::limiter::LimitKind| match id {
            Some(id) if kind != crate::limiter::LimitKind::IP => id,
            _ => addr.as_str(),
        };
        self.top.record(route, &seen, client, now);
    }

    pub(super) fn cors_rules(ctx: &Ctx) -> Option<&crate::cors::CorsRules> {
        ctx.live
            .as_ref()
            .and_then(|l| l.policy.cors(Self::route_index(ctx)))
    }

    /// The CORS headers of an answer to this request: its policy applied to
    /// its `Origin`.
    pub(super) fn cors_headers(session: &Session, ctx: &Ctx) -> crate::cors::Headers {
        let origin = session.req_header().headers.get(http::header::ORIGIN);
        Self::cors_rules(ctx).map_or_else(Vec::new, |rules| rules.response(origin))
    }

    /// The request's route: its plan's, or the one a refusal was counted under.
    pub(super) fn route_index(ctx: &Ctx) -> Option<usize> {
        ctx.plan.as_ref().map(|p| p.route).or(ctx.refused_route)
    }

    pub(super) fn route_metrics(ctx: &Ctx) -> Option<&RouteMetrics> {
        let live = ctx.live.as_ref()?;
        Some(match Self::route_index(ctx) {
            Some(i) => &live.route_metrics[i],
            None => &live.unrouted,
        })
    }

    pub(super) fn route_name(ctx: &Ctx) -> &str {
        match (&ctx.live, Self::route_index(ctx)) {
            (Some(l), Some(i)) => &l.policy.config.routes[i].name,
            _ => "(none)",
        }
    }
}

/// What taking a request's in-flight slots came to.
pub(super) enum Slots {
    Taken,
    Refused(Reply),
    /// The client closed its connection (or reset its HTTP/2 stream) while
    /// the request waited in a queue.
    ClientLeft,
}

/// Resolves when the client is known to have left: its HTTP/1 connection
/// closed once the request was read whole, or its HTTP/2 stream reset.
/// Never resolves where that cannot be seen without reading what the
/// upstream must get (an HTTP/1 request body still to come).
pub(super) async fn client_gone(session: &mut Session) {
    if let Some(idle) = session.downstream_session.watch_h2_stream_close() {
        let _ = idle.await;
        return;
    }
    if session.is_http2() || !session.downstream_session.is_body_done() {
        return std::future::pending().await;
    }
    // Pingora's own idle read: a FIN (or bytes after the request, which
    // Pingora's proxying refuses as well) is an error.
    match session.downstream_session.read_body_or_idle(true).await {
        Err(_) => {}
        Ok(_) => std::future::pending().await,
    }
}

/// A bearer JWT's verdict: who it names, or why it is refused.
pub(super) type TokenVerdict =
    std::result::Result<Arc<crate::identity::jwt::Verified>, crate::identity::jwt::TokenError>;

/// The random spread added to a Retry-After (`retry_after_jitter_ms`).
pub(super) fn jitter_us(cfg: &crate::config::Config) -> u64 {
    match cfg.limiter.retry_after_jitter_ms {
        0 => 0,
        ms => fastrand::u64(..=ms * 1000),
    }
}

pub(super) fn request_id(req: &RequestHeader) -> String {
    // Keep the caller's id only if it is short, printable and unambiguous.
    if let Some(v) = req.headers.get("x-request-id") {
        if let Ok(s) = v.to_str() {
            if !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()) {
                return s.to_string();
            }
        }
    }
    // 128 random bits as 32 hex digits, without the formatting machinery.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut bits = fastrand::u128(..);
    let mut id = String::with_capacity(32);
    for _ in 0..32 {
        id.push(HEX[(bits & 0xf) as usize] as char);
        bits >>= 4;
    }
    id
}

pub(super) fn header_bytes(req: &RequestHeader) -> usize {
    req.headers
        .iter()
        .map(|(n, v)| n.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + req.uri.path_and_query().map_or(0, |p| p.as_str().len())
}
