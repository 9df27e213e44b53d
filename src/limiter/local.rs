//! The in-process backend: the same algorithms over a bounded, sharded map.
//!
//! Used alone (`limiter.backend = "local"`) and as the Redis fallback. Memory
//! is capped at `local_max_entries`: a full shard evicts the entry that expires
//! soonest among a random sample, preferring expired ones. An entry past its
//! TTL is full again anyway, so eviction never hands a busy client a fresh
//! bucket it had not already earned back.

use std::sync::Arc;

use async_trait::async_trait;
use indexmap::IndexMap;
use parking_lot::Mutex;

use super::algorithms::outage::{self, Debt};
use super::algorithms::{self, Snapshot, State};
use super::{Backend, Check, LimiterError, Verdict};
use crate::clock::Clock;

const MAX_SHARDS: usize = 64;
const EVICTION_SAMPLE: usize = 8;

struct Entry {
    state: Option<State>,
    expires_at: i64,
}

type Shard = IndexMap<String, Entry, std::hash::RandomState>;

pub struct LocalBackend {
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
    clock: Arc<dyn Clock>,
    hasher: std::hash::RandomState,
}

impl LocalBackend {
    pub fn new(max_entries: usize, clock: Arc<dyn Clock>) -> Self {
        // shards x per_shard <= max_entries: the cap holds exactly.
        let shards = MAX_SHARDS.min(max_entries).max(1);
        LocalBackend {
            shards: (0..shards)
                .map(|_| Mutex::new(IndexMap::default()))
                .collect(),
            per_shard: (max_entries / shards).max(1),
            clock,
            hasher: std::hash::RandomState::new(),
        }
    }

    fn shard_of(&self, key: &str) -> usize {
        use std::hash::BuildHasher;
        (self.hasher.hash_one(key) as usize) % self.shards.len()
    }

    /// Entries currently held, expired or not.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
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
            let mut shard = self.shards[self.shard_of(&c.key)].lock();
            all &= match shard.get_mut(&c.key) {
                Some(e) => algorithms::refund(&c.algorithm, &mut e.state, at, c.cost),
                None => false,
            };
        }
        all
    }

    /// Decides at an explicit time (the conformance suite drives this).
    pub fn decide_at(&self, checks: &[Check], now: i64) -> Verdict {
        // Lock every shard involved, in index order, so concurrent requests
        // touching the same buckets cannot deadlock.
        let mut idx: Vec<usize> = checks.iter().map(|c| self.shard_of(&c.key)).collect();
        let mut order = idx.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, parking_lot::MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let slot = |guards: &[(usize, parking_lot::MutexGuard<'_, Shard>)], i: usize| {
            guards.iter().position(|(s, _)| *s == i).unwrap_or(0)
        };
        for i in idx.iter_mut() {
            *i = slot(&guards, *i);
        }

        let evals: Vec<_> = checks
            .iter()
            .zip(&idx)
            .map(|(c, &g)| {
                let state = guards[g]
                    .1
                    .get(&c.key)
                    .filter(|e| e.expires_at > now)
                    .and_then(|e| e.state.as_ref());
                algorithms::check(&c.algorithm, state, now, c.cost)
            })
            .collect();
        let verdict = Verdict {
            decisions: evals.iter().map(|e| e.decision).collect(),
            now_us: now,
        };
        if verdict.admitted(checks) {
            for ((c, &g), e) in checks.iter().zip(&idx).zip(&evals) {
                if !e.decision.allowed {
                    continue; // a shadow tier that would have rejected
                }
                let shard = &mut guards[g].1;
                let expires_at = now + e.ttl_us as i64;
                if let Some(entry) = shard.get_mut(&c.key) {
                    if entry.expires_at <= now {
                        entry.state = None;
                    }
                    algorithms::commit(&mut entry.state, &e.update);
                    entry.expires_at = entry.expires_at.max(expires_at);
                    continue;
                }
                if shard.len() >= self.per_shard {
                    evict_one(shard, now);
                }
                let mut state = None;
                algorithms::commit(&mut state, &e.update);
                shard.insert(c.key.clone(), Entry { state, expires_at });
            }
        }
        verdict
    }
}

impl LocalBackend {
    /// Overwrites a bucket's state (what Redis last said of it, as this
    /// replica's share) until `ttl_us` from `now`.
    pub fn seed(&self, key: &str, state: State, ttl_us: u64, now: i64) {
        let mut shard = self.shards[self.shard_of(key)].lock();
        let expires_at = now + ttl_us as i64;
        if let Some(entry) = shard.get_mut(key) {
            entry.state = Some(state);
            entry.expires_at = expires_at;
            return;
        }
        if shard.len() >= self.per_shard {
            evict_one(&mut shard, now);
        }
        shard.insert(
            key.to_string(),
            Entry {
                state: Some(state),
                expires_at,
            },
        );
    }

    /// What each check's bucket holds at `now`, spending nothing.
    pub fn peek_at(&self, checks: &[Check], now: i64) -> Vec<Snapshot> {
        checks
            .iter()
            .map(|c| {
                let shard = self.shards[self.shard_of(&c.key)].lock();
                let state = shard
                    .get(&c.key)
                    .filter(|e| e.expires_at > now)
                    .and_then(|e| e.state.as_ref());
                algorithms::inspect(&c.algorithm, state, now)
            })
            .collect()
    }

    pub fn peek(&self, checks: &[Check]) -> Vec<Snapshot> {
        self.peek_at(checks, self.clock.now_us())
    }

    /// Forgets these buckets (they are whole again); returns how many held state.
    pub fn remove(&self, keys: &[&str]) -> usize {
        keys.iter()
            .filter(|k| {
                self.shards[self.shard_of(k)]
                    .lock()
                    .swap_remove(**k)
                    .is_some()
            })
            .count()
    }

    /// Whether a sliding log's state was written less than `within_us` ago
    /// (its entries live `window_us`, and every write renews that).
    pub fn log_written_within(&self, key: &str, window_us: i64, within_us: i64, now: i64) -> bool {
        let shard = self.shards[self.shard_of(key)].lock();
        shard.get(key).is_some_and(|e| {
            matches!(e.state, Some(State::Log(_))) && e.expires_at - window_us > now - within_us
        })
    }

    /// Adds debts to buckets (`outage::charge`); returns how many were written.
    /// The Redis backend's `charge` does the same with `charge.lua`.
    pub fn charge_at(&self, debts: &[(Check, Debt)], now: i64) -> usize {
        let mut written = 0;
        for (c, debt) in debts {
            let shard = self.shards[self.shard_of(&c.key)].lock();
            let current = shard
                .get(&c.key)
                .filter(|e| e.expires_at > now)
                .and_then(|e| e.state.clone());
            let Some((state, ttl)) = outage::charge(&c.algorithm, current.as_ref(), debt, now)
            else {
                continue;
            };
            drop(shard);
            self.seed(&c.key, state, ttl, now);
            written += 1;
        }
        written
    }
}

/// Removes the soonest-expiring of a random sample (an expired one if seen).
fn evict_one(shard: &mut Shard, now: i64) {
    let n = shard.len();
    if n == 0 {
        return;
    }
    let mut victim = fastrand::usize(..n);
    let mut soonest = shard[victim].expires_at;
    for _ in 1..EVICTION_SAMPLE.min(n) {
        let i = fastrand::usize(..n);
        if shard[i].expires_at < soonest {
            victim = i;
            soonest = shard[i].expires_at;
        }
        if soonest <= now {
            break;
        }
    }
    shard.swap_remove_index(victim);
}

#[async_trait]
impl Backend for LocalBackend {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError> {
        Ok(self.decide_at(checks, self.clock.now_us()))
    }
}
