//! The limiter's background work: the start-up attempt, the watchdog that
//! decides whether Redis is hung, the upkeep beside it (heartbeats, resets
//! from other replicas, the persistence check), the lease sweeper, the
//! shares' pull round, and the release of every lease at a stop or reload.

use super::*;

impl Fallback {
    /// With quotas configured, warns when Redis keeps nothing on disk (no
    /// AOF, no RDB snapshots): a restart would start every quota's period
    /// from zero. Logged once per finding, shown on `/readyz`.
    pub(super) async fn check_persistence(&self, redis: &RedisBackend) {
        if !self.quotas.load(Ordering::Acquire)
            || !self.persistence_due.swap(false, Ordering::AcqRel)
        {
            return;
        }
        let warning = match redis.persistence().await {
            Ok(Persistence::Aof) => None,
            Ok(p @ Persistence::Snapshots(_)) => Some(match (&p, p.snapshot_window()) {
                (Persistence::Snapshots(save), Some((least, most))) => format!(
                    "quotas are configured and Redis persists only by RDB snapshots (save \"{save}\"): a crash loses the counts written since the last snapshot, {least} to {most} s of every customer's usage; run it with appendonly yes"
                ),
                _ => "quotas are configured and Redis persists only by RDB snapshots: a crash loses the counts written since the last snapshot; run it with appendonly yes".to_string(),
            }),
            Ok(Persistence::Nothing) => Some(
                "quotas are configured and Redis persists nothing (no AOF, no RDB snapshots): a Redis restart starts every quota's period from zero; run it with appendonly yes".to_string(),
            ),
            Err(e) => Some(format!(
                "quotas are configured and Redis's persistence cannot be read ({}): make sure it keeps an AOF",
                self.redact(&e.to_string())
            )),
        };
        let mut current = self.persistence_warning.lock();
        if *current != warning {
            if let Some(w) = &warning {
                tracing::warn!("limiter: {w}");
            }
            *current = warning;
        }
    }

    /// The start-up attempt: Redis is probed (connect, AUTH, scripts, a
    /// write) until it works or `wait` has passed. If it works, requests are
    /// decided by Redis from the first one; if not, by the fallback, and the
    /// probe takes over. Requests arriving meanwhile wait for it.
    pub async fn start(&self, wait: Duration) {
        // Marks the end even if this future is dropped (shutdown) or panics.
        struct Ended<'a>(&'a Fallback);
        impl Drop for Ended<'_> {
            fn drop(&mut self) {
                self.0.started_fast.store(true, Ordering::Release);
                self.0.started.send_replace(true);
            }
        }
        let _ended = Ended(self);
        if let Some(redis) = &self.redis {
            let until = Instant::now() + wait;
            while Instant::now() < until {
                match tokio::time::timeout_at(until.into(), redis.probe(&self.probe_key)).await {
                    Ok(Ok(())) => {
                        self.redis_up.store(true, Ordering::Release);
                        *self.fallback_since.lock() = None;
                        metrics::set_backend(FallbackState::Redis.as_str());
                        tracing::info!("limiter: redis reached at start-up");
                        self.heartbeat().await;
                        self.check_persistence(redis).await;
                        break;
                    }
                    Ok(Err(e)) => self.note_failure(e),
                    Err(_) => {
                        self.note_failure(LimiterError::Timeout(wait.as_millis() as u64));
                        break;
                    }
                }
                tokio::time::sleep(STARTUP_RETRY).await;
            }
            if !self.redis_up.load(Ordering::Acquire) {
                tracing::warn!(
                    wait_ms = wait.as_millis() as u64,
                    "limiter: redis not reached at start-up; serving on the fallback"
                );
            }
        }
        self.started_fast.store(true, Ordering::Release);
        self.started.send_replace(true);
    }

    /// Announces this replica and reads how many there are. A failed
    /// heartbeat (on the probe's thread: Redis's failure, not a busy
    /// worker's) opens the breaker, so an idle replica notices an outage too.
    pub(super) async fn heartbeat(&self) {
        let Some(redis) = &self.redis else { return };
        let sent = Instant::now();
        match redis
            .heartbeat(
                &self.replicas_key,
                &self.replica_id,
                Fallback::ANNOUNCEMENT_LIFE,
            )
            .await
        {
            Ok(n) => {
                let n = n.max(1);
                if let Some(standing) = &self.standing {
                    standing.heard(sent, Instant::now(), n);
                    metrics::shares(standing.is_usable(false), standing.len());
                }
                if self.replicas.swap(n, Ordering::Relaxed) != n {
                    tracing::info!(replicas = n, "limiter: live replica count");
                }
                metrics::replicas(n);
                if let Some(leases) = redis.leases() {
                    leases.set_replicas(self.fallback_replicas());
                }
            }
            Err(e) => return self.trip(e),
        }
        self.apply_resets(redis).await;
        self.check_persistence(redis).await;
    }

    /// Forgets what this replica remembers of buckets another replica (or
    /// `gateway limits reset`) reset: denials, fallback shares, debts.
    pub(super) async fn apply_resets(&self, redis: &RedisBackend) {
        let after = self.resets_seen.lock().clone();
        match redis.resets_since(&self.resets_key, after.as_deref()).await {
            Ok((keys, last)) => {
                for (key, at) in &keys {
                    self.forget(&[key.as_str()], Some(*at));
                }
                *self.resets_seen.lock() = last;
            }
            // Read again next second; a missed reset only keeps a denial
            // this replica would otherwise have dropped.
            Err(e) => {
                tracing::debug!(error = %self.redact(&e.to_string()), "limiter: cannot read resets")
            }
        }
    }

    /// Until the process ends, three loops at once, so that none waits on
    /// another: the watchdog (a late call is confirmed with a PING within
    /// the budget, whatever the upkeep is waiting for: a heartbeat or a
    /// charge on a Redis that hung right after a failback waits up to its
    /// own, longer budget), the upkeep (while Redis is up, heartbeats and
    /// late charges; while it is down, the failback probe every
    /// `interval`), and the lease sweeper.
    pub async fn watch(self: Arc<Self>, interval: Duration) {
        let Some(redis) = &self.redis else { return };
        tokio::join!(
            self.watchdog(redis),
            self.upkeep(redis, interval),
            self.sweep(redis),
            self.pull(redis),
            self.send_settlements(redis)
        );
    }

    pub(super) async fn watchdog(&self, redis: &RedisBackend) {
        loop {
            redis.late_call().await;
            if !self.redis_up.load(Ordering::Acquire) {
                continue;
            }
            match redis.ping().await {
                Ok(()) => metrics::late_call_verdict(false),
                Err(e) => {
                    metrics::late_call_verdict(true);
                    self.trip(e);
                }
            }
        }
    }

    pub(super) async fn upkeep(&self, redis: &RedisBackend, interval: Duration) {
        let mut next_heartbeat = Instant::now() + HEARTBEAT_EVERY;
        loop {
            if !self.redis_up.load(Ordering::Acquire) {
                self.probe_once().await;
                tokio::time::sleep(interval).await;
                continue;
            }
            // Looked at every `interval`: a breaker the watchdog opened
            // starts the probe soon, not at the next heartbeat.
            let now = Instant::now();
            if now < next_heartbeat {
                tokio::time::sleep(interval.min(next_heartbeat - now)).await;
                continue;
            }
            next_heartbeat = now + HEARTBEAT_EVERY;
            if self.redis_up.load(Ordering::Acquire) {
                self.heartbeat().await;
                self.settle_later(redis).await;
            }
        }
    }

    /// Every quarter lease period: expired leases' tokens, and tokens given
    /// back after their lease ended, go back to Redis with a call of their
    /// own when no request has carried them. Nothing waits for its holder
    /// to name the bucket again.
    pub(super) async fn sweep(&self, redis: &RedisBackend) {
        let Some(leases) = redis.leases() else { return };
        let every = (leases.period() / 4).max(Duration::from_millis(1));
        loop {
            tokio::time::sleep(every).await;
            if self.redis_up.load(Ordering::Acquire) && leases.due(Instant::now()) {
                // A failure leaves them owed (or counted lost, if the call
                // may have run); the next sweep sends what is owed.
                let _ = redis.flush().await;
            }
        }
    }

    /// At a stop: sends what charged answers owe as they settle (requests
    /// still in flight end in the grace period), until nothing new was
    /// owed for `QUIET` or `deadline` passes. An answer still streaming
    /// then loses its settlement with the process.
    async fn drain_owed(&self, redis: &RedisBackend, deadline: Instant) {
        const QUIET: Duration = Duration::from_millis(100);
        let mut last = Instant::now();
        while Instant::now() < deadline && last.elapsed() < QUIET {
            if self.owed.any() && self.redis_up.load(Ordering::Acquire) {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = tokio::time::timeout(left, self.send_owed(redis)).await;
                last = Instant::now();
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    /// Gives back every lease this replica holds: before a graceful stop
    /// (`stop`: nothing is leased or spent after it, and tokens requests
    /// still being decided give back are sent too), or at a reload. Waits
    /// at most `within`; with Redis down the tokens stay owed (and are lost
    /// with the process on a stop).
    pub async fn release_leases(&self, stop: bool, within: Duration) {
        let Some(redis) = &self.redis else { return };
        if stop {
            if let Some(standing) = &self.standing {
                standing.leave();
            }
        }
        // What charged answers owe goes first: it is lost with the process.
        let deadline = Instant::now() + within;
        if stop && self.redis_up.load(Ordering::Acquire) {
            redis.renew_request_connection();
            let _ = tokio::time::timeout(within / 2, self.send_owed(redis)).await;
        }
        let Some(leases) = redis.leases() else {
            if stop {
                self.drain_owed(redis, deadline).await;
            }
            return;
        };
        leases.release(stop);
        if stop {
            // Calls go on connections of this task's own: the proxy's
            // runtime, where the request path's were made, is stopping.
            redis.renew_request_connection();
        }
        let mut calls = 0;
        while Instant::now() < deadline {
            let owing = leases.owing();
            if !owing && (!stop || leases.held() <= 0) {
                break;
            }
            if owing && self.redis_up.load(Ordering::Acquire) {
                let left = deadline.saturating_duration_since(Instant::now());
                let _ = tokio::time::timeout(left, redis.flush()).await;
                calls += 1;
            } else {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        if stop {
            // Answers that end in the grace period settle after the first
            // send: sent as they come, until none came for a while.
            self.drain_owed(redis, deadline).await;
        }
        let held = leases.held();
        if held > 0 {
            tracing::warn!(
                held,
                stop,
                "limiter: leased tokens not given back (redis unreachable, or requests still being decided)"
            );
        } else if calls > 0 {
            tracing::info!(stop, calls, "limiter: leases given back");
        }
    }
}
