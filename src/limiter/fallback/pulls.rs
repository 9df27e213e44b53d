//! The pull round (`limiter::pulls`): every `PULL_EVERY`, while Redis
//! decides, the shares that ran dry are topped up from their pools in one
//! call per `PER_CALL` buckets; a pool that could not give all that was
//! asked is remembered as empty until the next round.

use super::*;
use crate::limiter::leases::{Ask, Asks};
use crate::limiter::pulls::{PER_CALL, PULL_EVERY};

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
            let Some((pulls, generation)) = standing.pulls() else {
                continue;
            };
            for chunk in pulls.chunks(PER_CALL) {
                let asks = Asks {
                    asks: chunk
                        .iter()
                        .map(|p| Ask {
                            check: p.pool.clone(),
                            want: p.want,
                            ret: 0,
                            until: 0,
                            spent: 0,
                            report: 0,
                        })
                        .collect(),
                    // Each asks for its own share of what the pool holds:
                    // one token is worth moving.
                    replicas: 1,
                    min: 1,
                    holder: holder.clone(),
                    hold_us: 0,
                };
                let call = redis.decide_leasing(&[], &asks);
                // A call that failed or timed out may have granted tokens
                // no share receives: lost, never more than the limit.
                let Ok(Ok((_, grants, _))) = tokio::time::timeout(redis.max_wait(), call).await
                else {
                    break;
                };
                let answered = Instant::now();
                let (mut asked, mut granted) = (0, 0);
                for (p, g) in chunk.iter().zip(&grants) {
                    asked += p.want;
                    granted += g.tokens;
                    if g.tokens > 0 {
                        standing.credit(&p.check, g.tokens, generation);
                    }
                    if g.tokens < p.want {
                        // Drained: not asked again before its next token,
                        // and what the share cannot cover meanwhile is
                        // refused from memory, with no call.
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
