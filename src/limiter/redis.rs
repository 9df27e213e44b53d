//! The shared backend: every tier of a request decided by one `EVALSHA` of
//! `limiter.lua`, so N replicas enforce one limit.
//!
//! One multiplexed, auto-reconnecting connection serves all requests. Each
//! call has a budget; past it the call is abandoned (never retried: it may have
//! run) and the caller decides the request some other way.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::{Backend, Check, Decision, LimiterError, Verdict};
use crate::clock::Clock;
use crate::config::Algorithm;

static SCRIPT_SRC: &str = include_str!("limiter.lua");

pub struct RedisBackend {
    client: redis::Client,
    conn: OnceLock<ConnectionManager>,
    script: redis::Script,
    budget: Duration,
    /// `None`: Redis's own TIME. Tests inject a clock to compare backends.
    clock: Option<Arc<dyn Clock>>,
}

impl RedisBackend {
    pub fn new(
        url: &str,
        budget: Duration,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, LimiterError> {
        let client = redis::Client::open(url).map_err(|e| LimiterError::Redis(e.to_string()))?;
        Ok(RedisBackend {
            client,
            conn: OnceLock::new(),
            script: redis::Script::new(SCRIPT_SRC),
            budget,
            clock,
        })
    }

    /// The shared connection, created on first use inside the caller's
    /// runtime; it connects and reconnects in the background by itself.
    fn connection(&self) -> Result<ConnectionManager, LimiterError> {
        if let Some(c) = self.conn.get() {
            return Ok(c.clone());
        }
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(500)))
            .set_number_of_retries(2)
            .set_min_delay(Duration::from_millis(50))
            .set_max_delay(Duration::from_millis(500));
        let c = ConnectionManager::new_lazy_with_config(self.client.clone(), config)
            .map_err(|e| LimiterError::Redis(e.to_string()))?;
        Ok(self.conn.get_or_init(|| c).clone())
    }

    /// Checks that Redis takes writes and has the script (loading it if not):
    /// what the failback probe asks before trusting Redis again. The write
    /// catches what a PING would not: a full Redis (OOM) and a demoted master
    /// (READONLY).
    pub async fn probe(&self, probe_key: &str) -> Result<(), LimiterError> {
        let mut conn = self.connection()?;
        let work = async {
            let exists: Vec<bool> = redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(self.script.get_hash())
                .query_async(&mut conn)
                .await?;
            if !exists.first().copied().unwrap_or(false) {
                self.script.load_async(&mut conn).await?;
            }
            redis::cmd("SET")
                .arg(probe_key)
                .arg(1)
                .arg("PX")
                .arg(1000)
                .query_async::<()>(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>(())
        };
        match tokio::time::timeout(self.budget.max(Duration::from_millis(100)), work).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(LimiterError::Redis(e.to_string())),
            Err(_) => Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
        }
    }
}

/// The script's numeric code for an algorithm and its two parameters, written
/// so Lua's `tonumber` reads back exactly the f64 Rust holds.
fn script_args(alg: &Algorithm) -> (u8, String, String) {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => (1, capacity.to_string(), format!("{refill_per_sec:?}")),
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => (2, format!("{rate_per_sec:?}"), max_delay_ms.to_string()),
        Algorithm::FixedWindow { limit, window_secs } => {
            (3, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingWindow { limit, window_secs } => {
            (4, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingLog { limit, window_secs } => {
            (5, limit.to_string(), window_secs.to_string())
        }
    }
}

/// The quota a client is shown for a rule; the script does not return it.
fn shown_limit(alg: &Algorithm) -> u64 {
    match *alg {
        Algorithm::TokenBucket { capacity, .. } => capacity,
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => {
            let t = 1e6 / rate_per_sec;
            ((max_delay_ms as f64 * 1000.0) / t).floor() as u64 + 1
        }
        Algorithm::FixedWindow { limit, .. }
        | Algorithm::SlidingWindow { limit, .. }
        | Algorithm::SlidingLog { limit, .. } => limit,
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError> {
        let mut conn = self.connection()?;
        let mut inv = self.script.prepare_invoke();
        for c in checks {
            inv.key(&c.key);
        }
        let now = self.clock.as_ref().map(|c| c.now_us().to_string());
        inv.arg(now.unwrap_or_default()).arg(checks.len());
        for c in checks {
            let (kind, p1, p2) = script_args(&c.algorithm);
            inv.arg(kind)
                .arg(p1)
                .arg(p2)
                .arg(if c.shadow { "1" } else { "0" });
        }
        let reply: Vec<i64> =
            match tokio::time::timeout(self.budget, inv.invoke_async(&mut conn)).await {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(LimiterError::Redis(e.to_string())),
                Err(_) => return Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
            };
        if reply.len() != checks.len() * 5 + 1 {
            return Err(LimiterError::BadReply(format!(
                "{} integers for {} tiers (expected {})",
                reply.len(),
                checks.len(),
                checks.len() * 5 + 1
            )));
        }
        let decisions = checks
            .iter()
            .zip(reply.chunks_exact(5))
            .map(|(c, r)| Decision {
                allowed: r[0] == 1,
                limit: shown_limit(&c.algorithm),
                remaining: r[1].max(0) as u64,
                retry_after_us: r[2].max(0) as u64,
                reset_after_us: r[3].max(0) as u64,
                delay_us: r[4].max(0) as u64,
            })
            .collect();
        Ok(Verdict {
            decisions,
            now_us: reply[checks.len() * 5],
        })
    }
}
