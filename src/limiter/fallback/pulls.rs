//! The pull round (`limiter::pulls`): every `PULL_EVERY`, while Redis
//! decides, the shares that ran dry are topped up from their pools in one
//! call per `PER_CALL` buckets; a pool that could not give all that was
//! asked is remembered as empty until the next round. A call that sends a
//! missed share's request to its pool carries that share's top-up itself
//! (`MissTopUps`), and its grants land here the same way.

use std::sync::Weak;

use super::*;
use crate::limiter::algorithms::lease::Grant;
use crate::limiter::leases::Asks;
use crate::limiter::pulls::{ask_pulls, Pull, Pulls, TopUps, PER_CALL, PULL_EVERY};

impl Fallback {
    pub(super) async fn pull(&self, redis: &RedisBackend) {
        let Some(standing) = &self.standing else {
            return;
        };
        let holder: Arc<str> = self.replica_id.as_str().into();
        loop {
            tokio::time::sleep(PULL_EVERY).await;
            if !self.redis_up.load(Ordering::Acquire) {
                continue;
            }
            let Some(Pulls { pulls, generation }) = standing.pulls() else {
                continue;
            };
            for chunk in pulls.chunks(PER_CALL) {
                let mut asks = Asks::default();
                ask_pulls(&mut asks, chunk, &holder);
                let call = redis.decide_leasing(&[], &asks);
                // A call that failed or timed out may have granted tokens
                // no share receives: lost, never more than the limit.
                let Ok(Ok((_, grants, _))) = tokio::time::timeout(redis.max_wait(), call).await
                else {
                    break;
                };
                self.pulled(standing, chunk, &grants, generation);
            }
        }
    }

    /// What pools gave for `pulls`, into their shares. A pool that could
    /// not give all that was asked is drained: not asked again before its
    /// next token, and what its share cannot cover meanwhile is refused
    /// from memory, with no call.
    fn pulled(&self, standing: &Standing, pulls: &[Pull], grants: &[Grant], generation: u64) {
        let answered = Instant::now();
        let (mut asked, mut granted) = (0, 0);
        for (p, g) in pulls.iter().zip(grants) {
            asked += p.want;
            granted += g.tokens;
            if g.tokens > 0 {
                standing.credit(&p.check, g.tokens, generation);
            }
            if g.tokens < p.want {
                let next = answered + token_time(&p.pool).max(PULL_EVERY);
                standing.hold_off(&p.check, next);
                self.denied.remember(
                    &p.pool.key,
                    Denial {
                        until: next + 2 * PULL_EVERY,
                        retry_at: next,
                        held: 0,
                    },
                );
            } else {
                self.denied.forget(&p.pool.key);
            }
        }
        metrics::share_pull(asked, granted);
    }
}

/// The top-ups of the calls that decide requests (`limiter::pulls::TopUps`),
/// for the fallback's shares. Weak: the fallback owns the backend that
/// holds this.
pub(super) struct MissTopUps(pub(super) Weak<Fallback>);

impl TopUps for MissTopUps {
    fn asks(&self, requests: &[&[Check]]) -> Option<Pulls> {
        let f = self.0.upgrade()?;
        f.standing.as_ref()?.top_ups(requests)
    }

    fn granted(&self, pulls: &Pulls, grants: &[Grant]) {
        let Some(f) = self.0.upgrade() else {
            return;
        };
        if let Some(standing) = &f.standing {
            f.pulled(standing, &pulls.pulls, grants, pulls.generation);
        }
    }
}

/// How long a pool takes to refill one token.
fn token_time(pool: &Check) -> Duration {
    match pool.algorithm {
        crate::config::Algorithm::TokenBucket { refill_per_sec, .. } if refill_per_sec > 0.0 => {
            Duration::from_secs_f64((1.0 / refill_per_sec).min(60.0))
        }
        _ => PULL_EVERY,
    }
}
