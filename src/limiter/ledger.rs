//! What this replica admitted on its local fallback, per shared bucket, until
//! failback charges it to Redis (`charge.lua`).
//!
//! Bounded like the local backend: at most `cap` buckets. A full shard drops
//! a debt (preferring one whose own arrival time has passed); a dropped debt
//! only means a client is charged less than it spent.

use std::collections::HashMap;
use std::hash::BuildHasher;

use parking_lot::Mutex;

use super::algorithms::outage::{self, Debt};
use super::algorithms::Micros;
use super::Check;

const SHARDS: usize = 16;

/// Bucket name -> the shared rule's check and what was admitted against it.
type Shard = HashMap<String, (Check, Option<Debt>)>;

pub struct Ledger {
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
    hasher: std::hash::RandomState,
}

impl Ledger {
    pub fn new(cap: usize) -> Self {
        Ledger {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: cap.div_ceil(SHARDS).max(1),
            hasher: std::hash::RandomState::new(),
        }
    }

    /// Records one admission of every tier that admitted it. `shared` are the
    /// request's checks under the shared rules (not this replica's share).
    pub fn record(&self, shared: &[Check], admitted: impl Iterator<Item = bool>, now: Micros) {
        for (c, ok) in shared.iter().zip(admitted) {
            if !ok {
                continue;
            }
            let mut shard = self.shards[(self.hasher.hash_one(&c.key) as usize) % SHARDS].lock();
            if let Some((_, debt)) = shard.get_mut(&c.key) {
                outage::record(&c.algorithm, debt, now);
                continue;
            }
            if shard.len() >= self.per_shard {
                evict(&mut shard, now);
            }
            let mut debt = None;
            outage::record(&c.algorithm, &mut debt, now);
            shard.insert(c.key.clone(), (c.clone(), debt));
        }
    }

    /// Every debt, leaving the ledger empty.
    pub fn take(&self) -> Vec<(Check, Debt)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let drained: Vec<_> = shard.lock().drain().collect();
            out.extend(
                drained
                    .into_iter()
                    .filter_map(|(_, (c, d))| d.map(|d| (c, d))),
            );
        }
        out
    }

    /// Puts debts back (a failed charge is tried again at the next failback).
    pub fn restore(&self, debts: Vec<(Check, Debt)>) {
        for (c, d) in debts {
            let mut shard = self.shards[(self.hasher.hash_one(&c.key) as usize) % SHARDS].lock();
            if shard.len() < self.per_shard {
                shard.entry(c.key.clone()).or_insert((c, Some(d)));
            }
        }
    }
}

/// Drops a GCRA debt whose own arrival time has passed (the least it adds),
/// else any one.
fn evict(shard: &mut Shard, now: Micros) {
    let paid = shard
        .iter()
        .find(|(_, (_, d))| matches!(d, Some(Debt::Gcra { tat, .. }) if *tat <= now as f64))
        .map(|(k, _)| k.clone());
    let victim = paid.or_else(|| shard.keys().next().cloned());
    if let Some(k) = victim {
        shard.remove(&k);
    }
}
