//! What this replica admitted on its local fallback, per shared bucket, until
//! failback charges it to Redis (`charge.lua`).
//!
//! Bounded like the local backend: at most `cap` buckets. A full shard drops
//! one debt from a small random sample (preferring one whose own arrival time
//! has passed); a dropped debt only means a client is charged less than it
//! spent. Debts put back after a failed charge are merged with what was
//! recorded since, never dropped for room.

use std::hash::BuildHasher;

use indexmap::IndexMap;
use parking_lot::Mutex;

use super::algorithms::outage::{self, Debt};
use super::algorithms::{Decision, Micros};
use super::Check;

const SHARDS: usize = 16;
const EVICTION_SAMPLE: usize = 8;

/// Bucket name -> the shared rule's check and what was admitted against it.
type Shard = IndexMap<String, (Check, Option<Debt>), std::hash::RandomState>;

pub struct Ledger {
    shards: Vec<Mutex<Shard>>,
    per_shard: usize,
    hasher: std::hash::RandomState,
}

impl Ledger {
    pub fn new(cap: usize) -> Self {
        Ledger {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(IndexMap::default()))
                .collect(),
            per_shard: cap.div_ceil(SHARDS).max(1),
            hasher: std::hash::RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
    }

    /// Records one admission of every tier that admitted it. `shared` are the
    /// request's checks under the shared rules, `local` under this replica's
    /// share, and `decisions` the share's answers (a bucket's first debt
    /// starts where its seeded share stood: `outage::open`).
    pub fn record(&self, shared: &[Check], local: &[Check], decisions: &[Decision], now: Micros) {
        for ((c, l), d) in shared.iter().zip(local).zip(decisions) {
            if !d.allowed {
                continue;
            }
            let mut shard = self.shard(&c.key).lock();
            if let Some((_, debt)) = shard.get_mut(&c.key) {
                outage::record(&c.algorithm, debt, now, c.cost);
                continue;
            }
            if shard.len() >= self.per_shard {
                evict(&mut shard, now);
            }
            let debt = outage::open(&c.algorithm, &l.algorithm, d, now, c.cost);
            shard.insert(c.key.clone(), (c.clone(), debt));
        }
    }

    /// Takes back what `record` recorded for a request that was then
    /// refused or dropped before it reached the upstream.
    /// `checks` may be the shares: a debt is kept under its shared rule.
    pub fn unrecord(&self, checks: &[Check], decisions: &[Decision], now: Micros) {
        for (c, d) in checks.iter().zip(decisions) {
            if !d.allowed {
                continue;
            }
            if let Some((shared, debt)) = self.shard(&c.key).lock().get_mut(&c.key) {
                outage::unrecord(&shared.algorithm, debt, now, c.cost);
            }
        }
    }

    /// Drops a bucket's debt (it was reset: nothing is owed to it).
    pub fn forget(&self, key: &str) {
        self.shard(key).lock().swap_remove(key);
    }

    /// Every debt, leaving the ledger empty.
    pub fn take(&self) -> Vec<(Check, Debt)> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let drained: Vec<_> = shard.lock().drain(..).collect();
            out.extend(
                drained
                    .into_iter()
                    .filter_map(|(_, (c, d))| d.map(|d| (c, d))),
            );
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.lock().is_empty())
    }

    /// Puts back debts whose charge failed, merged with anything recorded
    /// for the same bucket since (which came after them).
    pub fn restore(&self, debts: Vec<(Check, Debt)>) {
        for (c, earlier) in debts {
            let mut shard = self.shard(&c.key).lock();
            match shard.get_mut(&c.key) {
                Some((_, slot @ Some(_))) => {
                    if let Some(later) = slot.take() {
                        *slot = Some(outage::merge(&c.algorithm, earlier, later));
                    }
                }
                _ => {
                    shard.insert(c.key.clone(), (c, Some(earlier)));
                }
            }
        }
    }
}

/// Drops one debt of a random sample: one whose own arrival time has passed
/// (it adds least), else the first sampled.
fn evict(shard: &mut Shard, now: Micros) {
    let n = shard.len();
    if n == 0 {
        return;
    }
    let mut victim = fastrand::usize(..n);
    for _ in 0..EVICTION_SAMPLE.min(n) {
        let i = fastrand::usize(..n);
        if matches!(&shard[i].1, Some(Debt::Gcra { tat, .. }) if *tat <= now as f64) {
            victim = i;
            break;
        }
    }
    shard.swap_remove_index(victim);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;
    use crate::limiter::Tier;

    /// A debt put back after a failed charge keeps what was recorded for the
    /// same bucket meanwhile: 50 before the charge + 1 during it = 51.
    #[test]
    fn restored_debts_merge_with_what_came_since() {
        let alg = Algorithm::TokenBucket {
            capacity: 100,
            refill_per_sec: 1.0,
        };
        let c = Check {
            tier: Tier::Key,
            key: "rl:key:p:tb-100-1:k:a".into(),
            algorithm: alg,
            shadow: false,
            cost: 1,
            shards: 1,
        };
        let ledger = Ledger::new(16);
        let t0 = 1_700_000_000_000_000;
        let one = std::slice::from_ref(&c);
        let full = [Decision {
            allowed: true,
            limit: 100,
            remaining: 99,
            retry_after_us: 0,
            reset_after_us: 0,
            delay_us: 0,
        }];
        for i in 0..50 {
            ledger.record(one, one, &full, t0 + i);
        }
        let out = ledger.take();
        ledger.record(one, one, &full, t0 + 100);
        ledger.restore(out);
        let back = ledger.take();
        assert_eq!(back.len(), 1);
        match &back[0].1 {
            Debt::Gcra { count, .. } => assert_eq!(*count, 51),
            other => panic!("{other:?}"),
        }
    }
}
