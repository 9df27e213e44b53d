//! The limiter the proxy talks to: Redis while it is healthy, and a circuit
//! breaker that moves to `limiter.on_redis_failure` when it is not.
//!
//! After one failed or late call the breaker opens: no request waits on Redis
//! again until the background probe has seen it answer (and the script load)
//! several times in a row. While open, with `on_redis_failure = "local"`, each
//! replica enforces 1/`instances` of every tier locally, so N replicas together
//! stay within the shared limit.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::deny_cache::DenyCache;
use super::{Backend, Check, Decision, LimiterError, LocalBackend, RedisBackend, Verdict};
use crate::config::{Algorithm, OnRedisFailure};
use crate::metrics;

/// Consecutive good probes before traffic goes back to Redis.
const PROBES_TO_FAIL_BACK: u32 = 3;

/// Which backend decided a request (also the `backend` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackState {
    Redis,
    Local,
}

impl FallbackState {
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackState::Redis => "redis",
            FallbackState::Local => "local",
        }
    }
}

/// How a request's tiers were settled.
#[derive(Debug)]
pub enum Outcome {
    Decided {
        verdict: Verdict,
        backend: FallbackState,
        /// The checks as they were enforced (scaled down when local fallback).
        checks: Arc<[Check]>,
    },
    /// Redis failed and `on_redis_failure = "allow"`.
    FailOpen,
    /// Redis failed and `on_redis_failure = "deny"`.
    FailClosed,
}

pub struct Fallback {
    redis: Option<RedisBackend>,
    local: LocalBackend,
    on_failure: OnRedisFailure,
    instances: u32,
    redis_up: AtomicBool,
    good_probes: AtomicU32,
    /// Written by the probe: proves Redis takes writes.
    probe_key: String,
    /// Buckets Redis said no for, until when: answered without a call.
    denied: DenyCache,
}

impl Fallback {
    /// `redis = None`: the local backend is the limiter (no failover).
    pub fn new(
        redis: Option<RedisBackend>,
        local: LocalBackend,
        on_failure: OnRedisFailure,
        instances: u32,
        key_prefix: &str,
    ) -> Arc<Self> {
        let f = Arc::new(Fallback {
            redis,
            local,
            on_failure,
            instances: instances.max(1),
            // Start failed over: never block start-up on Redis; the probe
            // promotes Redis as soon as it answers.
            redis_up: AtomicBool::new(false),
            good_probes: AtomicU32::new(0),
            probe_key: format!("{key_prefix}:probe"),
            denied: DenyCache::new(100_000),
        });
        metrics::set_backend(FallbackState::Local);
        f
    }

    pub fn state(&self) -> FallbackState {
        if self.redis.is_some() && self.redis_up.load(Ordering::Relaxed) {
            FallbackState::Redis
        } else {
            FallbackState::Local
        }
    }

    /// Buckets the local backend holds now (bounded by `local_max_entries`).
    pub fn local_entries(&self) -> usize {
        self.local.len()
    }

    pub fn has_redis(&self) -> bool {
        self.redis.is_some()
    }

    pub async fn decide(&self, checks: &Arc<[Check]>) -> Outcome {
        let Some(redis) = &self.redis else {
            return self.local_outcome(checks.clone()).await;
        };
        if self.redis_up.load(Ordering::Relaxed) {
            let started = std::time::Instant::now();
            if let Some(outcome) = self.remembered_denial(checks, started) {
                return outcome;
            }
            let result = redis.decide_shared(checks.clone()).await;
            metrics::redis_call(started.elapsed());
            match result {
                Ok(verdict) => {
                    let received = std::time::Instant::now();
                    for (c, d) in checks.iter().zip(&verdict.decisions) {
                        if !d.allowed && !c.shadow {
                            self.denied.remember(
                                &c.key,
                                received + Duration::from_micros(d.retry_after_us),
                            );
                        }
                    }
                    return Outcome::Decided {
                        verdict,
                        backend: FallbackState::Redis,
                        checks: checks.clone(),
                    };
                }
                Err(e) => {
                    self.trip(&e);
                    if matches!(e, LimiterError::CrossSlot) {
                        // A key-layout bug must never become allow-all (or deny-all).
                        return self.local_outcome(self.shares(checks)).await;
                    }
                }
            }
        }
        match self.on_failure {
            OnRedisFailure::Local => self.local_outcome(self.shares(checks)).await,
            OnRedisFailure::Allow => Outcome::FailOpen,
            OnRedisFailure::Deny => Outcome::FailClosed,
        }
    }

    /// A request that a remembered denial already decides: the denying tier
    /// alone is reported (the others were not asked).
    fn remembered_denial(&self, checks: &[Check], now: std::time::Instant) -> Option<Outcome> {
        let (i, wait) = self.denied.find(checks, now)?;
        let c = &checks[i];
        let wait_us = wait.as_micros() as u64;
        let wall_now = crate::clock::Clock::now_us(&crate::clock::SystemClock);
        Some(Outcome::Decided {
            verdict: Verdict {
                decisions: vec![Decision {
                    allowed: false,
                    limit: super::algorithms::quota(&c.algorithm),
                    remaining: 0,
                    retry_after_us: wait_us,
                    reset_after_us: wait_us,
                    delay_us: 0,
                }],
                now_us: wall_now,
            },
            backend: FallbackState::Redis,
            checks: Arc::new([c.clone()]),
        })
    }

    async fn local_outcome(&self, checks: Arc<[Check]>) -> Outcome {
        match self.local.decide(&checks).await {
            Ok(verdict) => Outcome::Decided {
                verdict,
                backend: FallbackState::Local,
                checks,
            },
            Err(_) => Outcome::FailOpen, // the local backend has no failure mode
        }
    }

    /// Opens the breaker (once: concurrent failures log one transition).
    fn trip(&self, e: &LimiterError) {
        if self.redis_up.swap(false, Ordering::AcqRel) {
            self.good_probes.store(0, Ordering::Relaxed);
            tracing::warn!(error = %e, on_redis_failure = ?self.on_failure, "limiter: redis failed, failing over");
            metrics::fallback_transition(FallbackState::Local);
        }
    }

    /// One probe round; closes the breaker after enough good probes.
    pub async fn probe_once(&self) {
        let Some(redis) = &self.redis else { return };
        if self.redis_up.load(Ordering::Relaxed) {
            return;
        }
        match redis.probe(&self.probe_key).await {
            Ok(()) => {
                let n = self.good_probes.fetch_add(1, Ordering::AcqRel) + 1;
                if n >= PROBES_TO_FAIL_BACK && !self.redis_up.swap(true, Ordering::AcqRel) {
                    tracing::info!("limiter: redis healthy again, failing back");
                    metrics::fallback_transition(FallbackState::Redis);
                }
            }
            Err(e) => {
                if self.good_probes.swap(0, Ordering::Relaxed) > 0 {
                    tracing::debug!(error = %e, "limiter: probe failed");
                }
            }
        }
    }

    /// Probes Redis every `interval` until the process ends.
    pub async fn probe_loop(self: Arc<Self>, interval: Duration) {
        if self.redis.is_none() {
            return;
        }
        loop {
            self.probe_once().await;
            tokio::time::sleep(interval).await;
        }
    }

    /// This replica's share of every check's rule.
    fn shares(&self, checks: &[Check]) -> Arc<[Check]> {
        checks.iter().map(|c| self.share(c)).collect()
    }

    /// This replica's share of a shared rule: 1/instances of capacity and rate,
    /// never less than one request.
    fn share(&self, c: &Check) -> Check {
        let n = self.instances as u64;
        let nf = n as f64;
        let algorithm = match c.algorithm {
            Algorithm::TokenBucket {
                capacity,
                refill_per_sec,
            } => Algorithm::TokenBucket {
                capacity: (capacity / n).max(1),
                refill_per_sec: refill_per_sec / nf,
            },
            Algorithm::LeakyBucket {
                rate_per_sec,
                max_delay_ms,
            } => Algorithm::LeakyBucket {
                rate_per_sec: rate_per_sec / nf,
                max_delay_ms,
            },
            Algorithm::FixedWindow { limit, window_secs } => Algorithm::FixedWindow {
                limit: (limit / n).max(1),
                window_secs,
            },
            Algorithm::SlidingWindow { limit, window_secs } => Algorithm::SlidingWindow {
                limit: (limit / n).max(1),
                window_secs,
            },
            Algorithm::SlidingLog { limit, window_secs } => Algorithm::SlidingLog {
                limit: (limit / n).max(1),
                window_secs,
            },
        };
        Check {
            algorithm,
            ..c.clone()
        }
    }
}
