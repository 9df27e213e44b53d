//! The request path's steps for a route with `charge` (`metering`): the
//! estimate a request is admitted on, read from its body before admission
//! (`estimate`); the answer's cost read as it passes to the client, never
//! held (`meter_start`, `meter_body`); and the difference settled once it
//! has ended (`settle`), with no call on the request's path.

use super::*;
use crate::config::{Charge, Estimate};
use crate::metering::{self, Ended, Meter};
use bytes::{Bytes, BytesMut};

/// The most body Pingora keeps to send on after it was read here (its
/// retry buffer): a larger or chunked body is not read for its estimate.
const READ_AT_MOST: u64 = 64 * 1024;

/// A charged request on its way: what to settle once its answer ends.
pub(super) struct Metered {
    outcome: crate::limiter::Outcome,
    /// The tiers counting charged units (`Plan::units`).
    units: u64,
    estimate: u64,
    meter: Option<Meter>,
    /// The upstream's answer ended whole.
    done: bool,
    status: u16,
    /// What the charged tiers had left after admission (the least).
    remaining: Option<u64>,
}

impl Gateway {
    /// The estimate a request on a `charge` route is admitted on; a
    /// request with none is answered 400, saying why.
    pub(super) async fn estimate(
        &self,
        session: &mut Session,
        charge: &Charge,
    ) -> std::result::Result<u64, Reply> {
        let body = match &charge.estimate {
            Estimate::Fixed(_) => None,
            Estimate::Json(_) => read_small_body(session).await?,
        };
        metering::estimate(charge, body.as_deref()).map_err(|why| responses::no_estimate(&why))
    }

    /// An admitted request goes upstream: what its answer settles.
    pub(super) fn metered(
        ctx: &mut Ctx,
        outcome: crate::limiter::Outcome,
        units: u64,
        estimate: u64,
    ) {
        let remaining = match &outcome {
            crate::limiter::Outcome::Decided { verdict, .. } => verdict
                .decisions
                .iter()
                .enumerate()
                .filter(|(i, _)| units & (1 << i) != 0)
                .map(|(_, d)| d.remaining)
                .min(),
            _ => None,
        };
        ctx.metered = Some(Metered {
            remaining,
            outcome,
            units,
            estimate,
            meter: None,
            done: false,
            status: 0,
        });
    }

    /// The upstream's response header: the meter starts, and the client
    /// is told what it has left in charged units where the route asks.
    pub(super) fn meter_start(ctx: &mut Ctx, resp: &mut ResponseHeader) -> Result<()> {
        let Some(charge) = Self::charge_of(ctx) else {
            return Ok(());
        };
        let meter = Meter::start(&charge, &resp.headers);
        if let Some(m) = &mut ctx.metered {
            m.meter = Some(meter);
            m.status = resp.status.as_u16();
            if let (Some(name), Some(left)) = (&charge.remaining_header, m.remaining) {
                resp.insert_header(name.clone(), left.to_string())?;
            }
        }
        Ok(())
    }

    /// A piece of the upstream's body, read as it passes.
    pub(super) fn meter_body(ctx: &mut Ctx, body: &Option<bytes::Bytes>, end: bool) {
        if let Some(m) = &mut ctx.metered {
            if let (Some(meter), Some(chunk)) = (&mut m.meter, body) {
                meter.body(chunk);
            }
            m.done |= end;
        }
    }

    /// The answer ended (or the request did): what it cost, charged.
    pub(super) fn settle(&self, ctx: &mut Ctx, e: Option<&Error>) {
        let Some(mut m) = ctx.metered.take() else {
            return;
        };
        let Some(charge) = Self::charge_of(ctx) else {
            return;
        };
        let client_left = e.is_some_and(|e| e.esource() == &ErrorSource::Downstream);
        let ended = match (&m.meter, m.done) {
            (Some(_), true) if e.is_none() || client_left => Ended::Whole(m.status),
            _ if client_left => Ended::ClientLeft,
            _ => Ended::UpstreamFailed,
        };
        let reading = match &mut m.meter {
            Some(meter) => meter.reading(&charge, ended),
            // No answer began: the client left first, or the upstream failed.
            None if ended == Ended::ClientLeft => Err(metering::Why::Cut),
            None => Err(metering::Why::Missing),
        };
        let (cost, why) = metering::charged(&charge, m.estimate, ended, reading);
        crate::metrics::charged(why.as_str(), cost);
        ctx.charged = Some((cost, why.as_str()));
        if !matches!(why, metering::Why::Read | metering::Why::Failed) {
            if let Some(left_out) = unread_line() {
                tracing::warn!(
                    request_id = %ctx.request_id,
                    route = Self::route_name(ctx),
                    reason = why.as_str(),
                    charged = cost,
                    estimate = m.estimate,
                    left_out,
                    "charge: the answer's cost was not read; charged as the faults table says"
                );
            }
        }
        self.limiter.settle(&m.outcome, m.units, cost);
    }

    fn charge_of(ctx: &Ctx) -> Option<Arc<Charge>> {
        let (live, plan) = (ctx.live.as_ref()?, ctx.plan.as_ref()?);
        live.policy.config.routes[plan.route].charge.clone()
    }
}

/// The request body, when it has a length Pingora's retry buffer keeps
/// (then sent on to the upstream from there); None otherwise. A body read
/// in one piece (the usual small request) is that piece, not a copy.
async fn read_small_body(session: &mut Session) -> std::result::Result<Option<Bytes>, Reply> {
    let len = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
    let Some(len) = len.filter(|n| *n <= READ_AT_MOST) else {
        return Ok(None);
    };
    session.enable_retry_buffering();
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    loop {
        let read = match session.read_request_body().await {
            Ok(Some(chunk)) => match &mut joined {
                None if first.is_empty() => {
                    first = chunk;
                    first.len()
                }
                None => {
                    let j = joined.insert(BytesMut::with_capacity(len as usize));
                    j.extend_from_slice(&first);
                    j.extend_from_slice(&chunk);
                    j.len()
                }
                Some(j) => {
                    j.extend_from_slice(&chunk);
                    j.len()
                }
            },
            Ok(None) => break,
            Err(_) => return Err(responses::no_estimate("the request body could not be read")),
        };
        if read as u64 > len {
            return Err(responses::no_estimate(
                "the request body is longer than its Content-Length",
            ));
        }
    }
    Ok(Some(joined.map_or(first, BytesMut::freeze)))
}

/// A line about an answer whose cost was not read, at most one a second
/// (a broken upstream sends many): `Some` with how many were left out
/// since the last one written, every one counted in the metric anyway.
fn unread_line() -> Option<u64> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SECOND: AtomicU64 = AtomicU64::new(0);
    static LEFT_OUT: AtomicU64 = AtomicU64::new(0);
    let now = crate::clock::Clock::now_us(&crate::clock::SystemClock) as u64 / 1_000_000;
    let last = SECOND.load(Ordering::Relaxed);
    if last != now
        && SECOND
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        return Some(LEFT_OUT.swap(0, Ordering::Relaxed));
    }
    LEFT_OUT.fetch_add(1, Ordering::Relaxed);
    None
}
