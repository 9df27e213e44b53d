//! Natural batching of Redis decisions.
//!
//! Requests hand their checks to one task per backend. The task sends what
//! has queued as one `EVALSHA` and, while that call is in flight, the next
//! requests queue up: at low load every request goes alone and at once; under
//! load a batch holds what arrived during one round trip, and the task first
//! lets the requests already runnable reach their Redis step (a few yields,
//! while that brings more). A batch costs Redis
//! one call, one `TIME`, one `MGET` and one `SET` per bucket however many of
//! its requests touched that bucket, and `limiter.lua` decides the requests in
//! order, so the answers are the ones they would get one by one.
//!
//! A request waits for its batch's answer; the call's budget runs from when
//! it is sent (`Inner::answer`), so time a request spends queued behind a
//! busy worker is never blamed on Redis. When a call fails (an error, or the
//! breaker opened while it was out) the requests queued behind it fail with
//! it at once, and fall back together. A request that stopped waiting before
//! its batch left is dropped from it. A request whose own call left and
//! then failed may have been charged by it; its place in that call (`Sent`)
//! goes with the error, so the fallback charges it once (`Ledger::doubt`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use tokio::sync::{mpsc, oneshot, watch};

use super::{Check, LimiterError, Verdict};

/// The most requests one call decides: keeps one script's run (which blocks
/// Redis) to a few hundred microseconds.
pub const MAX_BATCH: usize = 64;

/// How many times the task lets other tasks run before it sends a batch.
const MAX_YIELDS: usize = 4;

/// After this long the task starts no new round of gathering.
const MAX_GATHER: Duration = Duration::from_micros(200);

/// A call that failed, and the marker it carried when it may still have
/// run (`limiter.lua`'s ARGV[1]): where Redis says, for a minute, which of
/// its requests it admitted.
#[derive(Debug, Clone)]
pub struct Failed {
    pub error: LimiterError,
    pub marker: Option<Arc<str>>,
}

impl From<LimiterError> for Failed {
    fn from(error: LimiterError) -> Self {
        Failed {
            error,
            marker: None,
        }
    }
}

/// A request whose call failed, and where it was in that call when the
/// call may have run (the fallback then charges it once: `Ledger::doubt`).
#[derive(Debug, Clone)]
pub struct Lost {
    pub error: LimiterError,
    pub sent: Option<Sent>,
}

/// A request's place in a call that carried a marker.
#[derive(Debug, Clone)]
pub struct Sent {
    pub marker: Arc<str>,
    pub index: usize,
}

impl From<LimiterError> for Lost {
    fn from(error: LimiterError) -> Self {
        Lost { error, sent: None }
    }
}

/// Decides a batch: one verdict per request, in order, or an error (at the
/// latest when `abandon` changes).
pub trait Decider: Send + Sync + 'static {
    fn decide_batch(
        &self,
        requests: &[&[Check]],
        abandon: &mut watch::Receiver<u64>,
    ) -> impl std::future::Future<Output = Result<Vec<Verdict>, Failed>> + Send;

    /// Changes whenever calls are to be abandoned (the breaker opened); its
    /// value counts the times.
    fn abandoned(&self) -> watch::Receiver<u64>;
}

struct Pending {
    /// The abandon count when the request queued: a request that queued
    /// before the breaker opened is not sent to the Redis it gave up on.
    epoch: u64,
    checks: Arc<[Check]>,
    reply: oneshot::Sender<Result<Verdict, Lost>>,
}

pub struct Batcher {
    queue: ArcSwapOption<mpsc::UnboundedSender<Pending>>,
}

impl Batcher {
    pub fn new() -> Self {
        Batcher {
            queue: ArcSwapOption::empty(),
        }
    }

    /// Queues one request's checks, read by the request at abandon count
    /// `epoch`; the reply arrives when its batch returns.
    /// The first call (or the first after the task's runtime ended) starts the
    /// task on the caller's runtime: the proxy's. (On a thread of its own, with
    /// its own connection, the task measured worse: one more thread to wake per
    /// batch, on a machine whose cores the proxy's threads already keep busy.)
    pub fn submit<D: Decider>(
        &self,
        decider: &Arc<D>,
        checks: Arc<[Check]>,
        epoch: u64,
    ) -> oneshot::Receiver<Result<Verdict, Lost>> {
        let (reply, rx) = oneshot::channel();
        let mut pending = Pending {
            epoch,
            checks,
            reply,
        };
        if let Some(queue) = self.queue.load().as_ref() {
            match queue.send(pending) {
                Ok(()) => return rx,
                Err(mpsc::error::SendError(p)) => pending = p,
            }
        }
        let (tx, queue) = mpsc::unbounded_channel();
        tokio::spawn(run(decider.clone(), queue));
        // Fails only if the runtime is shutting down: the request then gets
        // an error and falls back.
        let _ = tx.send(pending);
        self.queue.store(Some(Arc::new(tx)));
        rx
    }
}

impl Default for Batcher {
    fn default() -> Self {
        Self::new()
    }
}

async fn run<D: Decider>(decider: Arc<D>, mut queue: mpsc::UnboundedReceiver<Pending>) {
    let mut batch: Vec<Pending> = Vec::with_capacity(MAX_BATCH);
    let mut abandon = decider.abandoned();
    while let Some(first) = queue.recv().await {
        batch.push(first);
        // Let the requests already runnable on this runtime reach their Redis
        // step first, for as long as that brings more (a few rounds at most):
        // under load the batch grows several times over, when idle the first
        // round brings nothing and the call leaves at once.
        let mut queued = queue.len();
        let gather_until = Instant::now() + MAX_GATHER;
        for _ in 0..MAX_YIELDS {
            // A saturated worker may take a while to come back to a yielded
            // task: no new round once this long has passed (one round may
            // itself last a scheduler pass).
            if Instant::now() >= gather_until {
                break;
            }
            tokio::task::yield_now().await;
            let now_queued = queue.len();
            if now_queued == queued || now_queued + batch.len() >= MAX_BATCH {
                break;
            }
            queued = now_queued;
        }
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        // Requests that stopped waiting were decided elsewhere: never charge
        // them; those that queued before the breaker opened fall back.
        let epoch = *abandon.borrow_and_update();
        batch.retain(|p| !p.reply.is_closed());
        for p in batch.extract_if(.., |p| p.epoch < epoch) {
            let _ = p.reply.send(Err(LimiterError::Abandoned.into()));
        }
        if batch.is_empty() {
            continue;
        }
        crate::metrics::redis_batch(batch.len());
        let requests: Vec<&[Check]> = batch.iter().map(|p| &*p.checks).collect();
        let result = decider.decide_batch(&requests, &mut abandon).await;
        drop(requests);
        match result {
            Ok(verdicts) => {
                for (p, v) in batch.drain(..).zip(verdicts) {
                    let _ = p.reply.send(Ok(v));
                }
            }
            Err(Failed { error: e, marker }) => {
                for (index, p) in batch.drain(..).enumerate() {
                    let sent = marker.clone().map(|marker| Sent { marker, index });
                    let _ = p.reply.send(Err(Lost {
                        error: e.clone(),
                        sent,
                    }));
                }
                // The requests queued behind a failed call fail with it, at
                // once: they fall back now instead of waiting out their budget,
                // and a Redis that just failed (or is holding calls) is not
                // sent work that could be charged after they gave up.
                while let Ok(p) = queue.try_recv() {
                    let _ = p.reply.send(Err(e.clone().into()));
                }
            }
        }
    }
}
