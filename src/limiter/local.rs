//! The in-process backend: the same algorithms over a bounded, sharded map.
//!
//! Used alone (`limiter.backend = "local"`) and as the Redis fallback. Memory
//! is capped at `local_max_entries`: a full shard evicts the entry that expires
//! soonest among a random sample, preferring expired ones. An entry past its
//! TTL is full again anyway, so eviction never hands a busy client a fresh
//! bucket it had not already earned back.

use std::sync::Arc;

use async_trait::async_trait;

use super::algorithms::outage::{self, Debt};
use super::algorithms::{self, Snapshot, State};
use super::{Backend, Check, LimiterError, Verdict};
use crate::clock::Clock;
use crate::shard_map::{Room, ShardMap};

const MAX_SHARDS: usize = 64;

struct Entry {
    state: Option<State>,
    expires_at: i64,
}

pub struct LocalBackend {
    buckets: ShardMap<String, Entry>,
    clock: Arc<dyn Clock>,
}

/// A bucket's state while its entry lives (past its TTL it is full again).
fn live(entry: Option<&Entry>, now: i64) -> Option<&State> {
    entry
        .filter(|e| e.expires_at > now)
        .and_then(|e| e.state.as_ref())
}

/// A full shard evicts the soonest-expiring entry of its sample (an expired
/// one at once).
fn soonest_expiring(now: i64) -> impl Fn(&Entry) -> i64 {
    move |e| e.expires_at.saturating_sub(now)
}

impl LocalBackend {
    pub fn new(max_entries: usize, clock: Arc<dyn Clock>) -> Self {
        LocalBackend {
            buckets: ShardMap::new(MAX_SHARDS, max_entries),
            clock,
        }
    }

    /// Entries currently held, expired or not.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Gives back the admission `decide_at(checks, at)` made of each tier
    /// that admitted (`algorithms::refund`); whether every one was.
    pub fn refund_at(&self, checks: &[Check], decisions: &[algorithms::Decision], at: i64) -> bool {
        let mut all = true;
        for (c, d) in checks.iter().zip(decisions) {
            if !d.allowed {
                continue;
            }
            let key = c.key.as_str();
            all &= match self.buckets.lock(key).get_mut(key) {
                Some(e) => algorithms::refund(&c.algorithm, &mut e.state, at, c.cost),
                None => false,
            };
        }
        all
    }

    /// Settles a charged tier (`charge`) admitted at `at`: `delta` more
    /// tokens owed at `now` (`algorithms::owe`), or `-delta` given back
    /// where it was taken (`algorithms::unowe`).
    pub fn settle_at(&self, c: &Check, delta: i64, at: i64, now: i64) {
        let key = c.key.as_str();
        let mut shard = self.buckets.lock(key);
        if delta < 0 {
            if let Some(e) = shard.get_mut(key).filter(|e| e.expires_at > now) {
                algorithms::unowe(&c.algorithm, &mut e.state, at, now, delta.unsigned_abs());
            }
            return;
        }
        if shard.get_mut(key).is_none() {
            let e = Entry {
                state: None,
                expires_at: now,
            };
            shard.insert(key.to_string(), e, &Room::Evict(&soonest_expiring(now)));
        }
        let Some(entry) = shard.get_mut(key) else {
            return;
        };
        if entry.expires_at <= now {
            entry.state = None;
        }
        algorithms::owe(&c.algorithm, &mut entry.state, now, delta as u64);
        // Kept until the debt has passed: a TAT's distance, a window's end.
        let until = match (&entry.state, c.algorithm) {
            (Some(State::Gcra { tat }), _) => tat.ceil() as i64,
            (_, crate::config::Algorithm::Calendar { end, .. }) => end,
            (_, alg) => now + 2 * window_us(&alg),
        };
        entry.expires_at = entry.expires_at.max(until);
    }

    /// Decides at an explicit time (the conformance suite drives this).
    pub fn decide_at(&self, checks: &[Check], now: i64) -> Verdict {
        // Every shard involved stays locked from the checks to the commit:
        // a request's tiers are decided together.
        let mut shards = self
            .buckets
            .lock_many(checks.iter().map(|c| c.key.as_str()));
        let evals: Vec<_> = checks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let state = live(shards.of(i).get(c.key.as_str()), now);
                algorithms::check(&c.algorithm, state, now, c.cost)
            })
            .collect();
        let verdict = Verdict {
            decisions: evals.iter().map(|e| e.decision).collect(),
            now_us: now,
        };
        if verdict.admitted(checks) {
            let rank = soonest_expiring(now);
            for (i, (c, e)) in checks.iter().zip(&evals).enumerate() {
                if !e.decision.allowed {
                    continue; // a shadow tier that would have rejected
                }
                let shard = shards.of_mut(i);
                let expires_at = now + e.ttl_us as i64;
                if let Some(entry) = shard.get_mut(c.key.as_str()) {
                    if entry.expires_at <= now {
                        entry.state = None;
                    }
                    algorithms::commit(&mut entry.state, &e.update);
                    entry.expires_at = entry.expires_at.max(expires_at);
                    continue;
                }
                let mut state = None;
                algorithms::commit(&mut state, &e.update);
                shard.insert(
                    c.key.clone(),
                    Entry { state, expires_at },
                    &Room::Evict(&rank),
                );
            }
        }
        verdict
    }
}

impl LocalBackend {
    /// Overwrites a bucket's state (what Redis last said of it, as this
    /// replica's share) until `ttl_us` from `now`.
    pub fn seed(&self, key: &str, state: State, ttl_us: u64, now: i64) {
        let entry = Entry {
            state: Some(state),
            expires_at: now + ttl_us as i64,
        };
        let mut shard = self.buckets.lock(key);
        match shard.get_mut(key) {
            Some(held) => *held = entry,
            None => {
                shard.insert(key.to_string(), entry, &Room::Evict(&soonest_expiring(now)));
            }
        }
    }

    /// What each check's bucket holds at `now`, spending nothing.
    pub fn peek_at(&self, checks: &[Check], now: i64) -> Vec<Snapshot> {
        checks
            .iter()
            .map(|c| {
                let key = c.key.as_str();
                let shard = self.buckets.lock(key);
                algorithms::inspect(&c.algorithm, live(shard.get(key), now), now)
            })
            .collect()
    }

    pub fn peek(&self, checks: &[Check]) -> Vec<Snapshot> {
        self.peek_at(checks, self.clock.now_us())
    }

    /// Forgets these buckets (they are whole again); returns how many held state.
    pub fn remove(&self, keys: &[&str]) -> usize {
        keys.iter()
            .filter(|k| self.buckets.lock(**k).remove(**k).is_some())
            .count()
    }

    /// Whether a sliding log's state was written less than `within_us` ago
    /// (its entries live `window_us`, and every write renews that).
    pub fn log_written_within(&self, key: &str, window_us: i64, within_us: i64, now: i64) -> bool {
        let shard = self.buckets.lock(key);
        shard.get(key).is_some_and(|e| {
            matches!(e.state, Some(State::Log(_))) && e.expires_at - window_us > now - within_us
        })
    }

    /// Adds debts to buckets (`outage::charge`); returns how many were written.
    /// The Redis backend's `charge` does the same with `charge.lua`.
    pub fn charge_at(&self, debts: &[(Check, Debt)], now: i64) -> usize {
        let mut written = 0;
        for (c, debt) in debts {
            let key = c.key.as_str();
            let shard = self.buckets.lock(key);
            let charged = outage::charge(&c.algorithm, live(shard.get(key), now), debt, now);
            drop(shard);
            let Some((state, ttl)) = charged else {
                continue;
            };
            self.seed(key, state, ttl, now);
            written += 1;
        }
        written
    }
}

#[async_trait]
impl Backend for LocalBackend {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError> {
        Ok(self.decide_at(checks, self.clock.now_us()))
    }
}

/// A window's length in µs (0 for a rule without one).
fn window_us(alg: &crate::config::Algorithm) -> i64 {
    use crate::config::Algorithm::*;
    match *alg {
        FixedWindow { window_secs, .. } | SlidingWindow { window_secs, .. } => {
            window_secs as i64 * 1_000_000
        }
        _ => 0,
    }
}
