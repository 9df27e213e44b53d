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
//! Every request still waits at most the call budget, and its batch's call is
//! abandoned when the first of its requests' budgets runs out. A request that
//! gave up (and was decided by the fallback) before its batch left is dropped
//! from it, and when a call fails the requests queued behind it fail with it
//! at once, so a request is charged twice only if its own call left and then
//! ran late (as any abandoned call may still run).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use tokio::sync::{mpsc, oneshot};

use super::{Check, LimiterError, Verdict};

/// The most requests one call decides: keeps one script's run (which blocks
/// Redis) to a few hundred microseconds.
pub const MAX_BATCH: usize = 64;

/// How many times the task lets other tasks run before it sends a batch.
const MAX_YIELDS: usize = 4;

/// After this long the task starts no new round of gathering.
const MAX_GATHER: Duration = Duration::from_micros(200);

/// Decides a batch: one verdict per request, in order, or an error once
/// `until` has passed (the earliest of its requests' deadlines).
pub trait Decider: Send + Sync + 'static {
    fn decide_batch(
        &self,
        requests: &[&[Check]],
        until: Instant,
    ) -> impl std::future::Future<Output = Result<Vec<Verdict>, LimiterError>> + Send;
}

struct Pending {
    /// When the request stops waiting (and is decided by the fallback).
    deadline: Instant,
    checks: Arc<[Check]>,
    reply: oneshot::Sender<Result<Verdict, LimiterError>>,
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

    /// Queues one request's checks, to be answered by `deadline`; the reply
    /// arrives when its batch returns.
    /// The first call (or the first after the task's runtime ended) starts the
    /// task on the caller's runtime: the proxy's. (On a thread of its own, with
    /// its own connection, the task measured worse: one more thread to wake per
    /// batch, on a machine whose cores the proxy's threads already keep busy.)
    pub fn submit<D: Decider>(
        &self,
        decider: &Arc<D>,
        checks: Arc<[Check]>,
        deadline: Instant,
    ) -> oneshot::Receiver<Result<Verdict, LimiterError>> {
        let (reply, rx) = oneshot::channel();
        let mut pending = Pending {
            deadline,
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
        // Requests that stopped waiting were decided elsewhere: never charge them.
        batch.retain(|p| !p.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        crate::metrics::redis_batch(batch.len());
        let requests: Vec<&[Check]> = batch.iter().map(|p| &*p.checks).collect();
        // The call ends when the first of its requests stops waiting: a call
        // abandoned by one of them fails them all (they fall back together),
        // and no request waits on Redis past its own budget.
        let until = batch
            .iter()
            .map(|p| p.deadline)
            .min()
            .unwrap_or_else(Instant::now);
        let result = decider.decide_batch(&requests, until).await;
        drop(requests);
        match result {
            Ok(verdicts) => {
                for (p, v) in batch.drain(..).zip(verdicts) {
                    let _ = p.reply.send(Ok(v));
                }
            }
            Err(e) => {
                for p in batch.drain(..) {
                    let _ = p.reply.send(Err(e.clone()));
                }
                // The requests queued behind a failed call fail with it, at
                // once: they fall back now instead of waiting out their budget,
                // and a Redis that just failed (or is holding calls) is not
                // sent work that could be charged after they gave up.
                while let Ok(p) = queue.try_recv() {
                    let _ = p.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
