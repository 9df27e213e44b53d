//! What one request's decision went through, for its trace: how it was
//! decided (the `gateway_limiter_decisions_total` path) and each Redis call
//! it waited on. Recorded only inside `traced` (a task-local the proxy
//! sets for a sampled request), so an untraced request pays one failed
//! lookup per note and nothing else.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::metrics::{self, DecidedBy};

tokio::task_local! {
    static TRAIL: Arc<Mutex<Trail>>;
}

/// A request's decision, as its trace tells it.
#[derive(Debug, Clone, Default)]
pub struct Trail {
    /// The last path that decided it (a request decided twice, as a
    /// `Late` call sent again, keeps the last).
    pub decided_by: Option<DecidedBy>,
    /// The Redis calls it waited on, in order.
    pub redis: Vec<RedisWait>,
}

#[derive(Debug, Clone, Copy)]
pub struct RedisWait {
    pub start: Instant,
    pub end: Instant,
    /// Answered (false: failed, timed out or abandoned).
    pub ok: bool,
}

/// Runs `decision` recording its trail.
pub async fn traced<F: Future>(decision: F) -> (F::Output, Trail) {
    let trail = Arc::new(Mutex::new(Trail::default()));
    let out = TRAIL.scope(trail.clone(), decision).await;
    let trail = trail.lock().clone();
    (out, trail)
}

/// Counts how a request was decided, and notes it in its trail.
pub(super) fn decided(path: DecidedBy) {
    metrics::decided_by(path);
    let _ = TRAIL.try_with(|t| t.lock().decided_by = Some(path));
}

/// The request waited on a Redis call from `start` to now.
pub(super) fn waited_on_redis(start: Instant, ok: bool) {
    let _ = TRAIL.try_with(|t| {
        t.lock().redis.push(RedisWait {
            start,
            end: Instant::now(),
            ok,
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_trail_is_kept_only_where_it_is_asked_for() {
        // Outside `traced`: counted, not kept, no panic.
        decided(DecidedBy::Redis);
        let start = Instant::now();
        let ((), trail) = traced(async {
            waited_on_redis(start, true);
            decided(DecidedBy::Lease);
            decided(DecidedBy::Redis);
        })
        .await;
        assert_eq!(trail.decided_by, Some(DecidedBy::Redis));
        assert_eq!(trail.redis.len(), 1);
        assert!(trail.redis[0].ok && trail.redis[0].end >= start);
    }
}
