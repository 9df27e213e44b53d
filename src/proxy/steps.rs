//! The request path's steps, called from the phases in `mod.rs`: the
//! gateway's own answers (`reply`, `send`), admission through the limiter
//! (`admit`), the in-flight slots a request takes (`take_slots`, and
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
