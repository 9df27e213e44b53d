//! What an operator asks of the limiter (`/limits`, `gateway limits`): a
//! bucket's state as this replica sees it, its lease, and resets.

use super::*;

impl Fallback {
    /// This replica's memory of the buckets, dropped; how many local
    /// buckets held state. `reset_us`: when another replica reset them
    /// (Redis's clock); a lease granted since is of the new bucket and is
    /// kept (this replica hears of a reset up to a heartbeat late).
    pub(super) fn forget(&self, keys: &[&str], reset_us: Option<Micros>) -> usize {
        for k in keys {
            self.denied.forget(k);
            self.ledger.forget(k);
        }
        if let Some(leases) = self.redis.as_ref().and_then(RedisBackend::leases) {
            leases.cancel(keys, reset_us);
        }
        if let Some(standing) = &self.standing {
            standing.forget(keys);
        }
        self.local.remove(keys)
    }

    /// What each check's bucket holds, spending nothing, from the backend
    /// that decides now: Redis, or (on the fallback, or with
    /// `backend = "local"`) this replica's own buckets, whose limits are
    /// then its share.
    pub async fn inspect(
        &self,
        checks: &[Check],
    ) -> Result<(FallbackState, Vec<Snapshot>), LimiterError> {
        if let (Some(redis), FallbackState::Redis) = (&self.redis, self.state()) {
            let Some(pool) = self.standing.as_ref().and_then(|s| s.pool_view(checks)) else {
                let (snapshots, _) = redis.peek(checks).await?;
                return Ok((FallbackState::Redis, snapshots));
            };
            // A cut bucket: its pool in Redis and this replica's share.
            let (mut snapshots, _) = redis.peek(&pool).await?;
            let standing = self.standing.as_ref().expect("a pool view has shares");
            for (c, s) in checks.iter().zip(snapshots.iter_mut()) {
                if standing.cuts(c) {
                    s.limit = super::super::algorithms::quota(&c.algorithm);
                    if let Some((tokens, _)) = standing.level(c, false) {
                        s.remaining += tokens;
                    }
                }
            }
            return Ok((FallbackState::Redis, snapshots));
        }
        let mut snapshots = self.local.peek(&self.local_view(checks));
        // On the fallback a cut bucket is enforced as this replica's part
        // of the pool plus its standing share (`decide`): both are shown.
        let shares = self.standing.as_ref();
        if let Some(standing) = shares.filter(|_| self.on_failure == OnRedisFailure::Local) {
            for (c, s) in checks.iter().zip(snapshots.iter_mut()) {
                if let Some((tokens, cap)) = standing.level(c, true) {
                    s.remaining += tokens;
                    s.limit += cap;
                }
            }
        }
        Ok((FallbackState::Local, snapshots))
    }

    /// This replica's unspent lease on a bucket, and its time left.
    pub fn lease_of(&self, key: &str) -> Option<(u64, Duration)> {
        self.redis
            .as_ref()
            .and_then(RedisBackend::leases)
            .and_then(|l| l.outstanding(key, Instant::now()))
    }

    /// The checks as the local backend enforces them now: on the fallback,
    /// this replica's part of each bucket (of a cut bucket, of its pool).
    pub(super) fn local_view(&self, checks: &[Check]) -> Vec<Check> {
        let n = if self.redis.is_some() {
            self.fallback_replicas()
        } else {
            1
        };
        let pool = |c: &Check| match &self.standing {
            Some(s) if self.on_failure == OnRedisFailure::Local => s.pool_check(c),
            _ => c.clone(),
        };
        checks
            .iter()
            .map(pool)
            .map(|c| Check {
                algorithm: share(&c.algorithm, n),
                ..c
            })
            .collect()
    }

    /// Makes the buckets whole again: in Redis when it decides (every
    /// replica hears of it within a second), and in this replica's memory.
    pub async fn reset(&self, checks: &[Check]) -> Result<Reset, LimiterError> {
        let keys: Vec<&str> = checks.iter().map(|c| c.key.as_str()).collect();
        let redis = match (&self.redis, self.state()) {
            (Some(redis), FallbackState::Redis) => {
                Some(redis.reset(&keys, &self.resets_key).await?)
            }
            _ => None,
        };
        let local = self.forget(&keys, None);
        Ok(Reset {
            backend: self.state(),
            redis_buckets: redis,
            local_buckets: local,
        })
    }
}
