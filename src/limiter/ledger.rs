//! What this replica admitted on its local fallback, per shared bucket, until
//! failback charges it to Redis (`charge.lua`).
//!
//! Bounded like the local backend: at most `cap` buckets. A full shard drops
//! one debt from a small random sample (preferring one whose own arrival time
//! has passed); a dropped debt only means a client is charged less than it
//! spent. Debts put back after a failed charge are merged with what was
//! recorded since, never dropped for room.

use super::algorithms::outage::{self, Debt};
use super::algorithms::{Decision, Micros};
use super::Check;
use crate::shard_map::{Room, ShardMap};

const SHARDS: usize = 16;

pub struct Ledger {
    /// Bucket name -> the shared rule's check and what was admitted against it.
    debts: ShardMap<String, (Check, Option<Debt>)>,
}

impl Ledger {
    pub fn new(cap: usize) -> Self {
        Ledger {
            debts: ShardMap::new(SHARDS, cap),
        }
    }

    /// Records one admission of every tier that admitted it. `shared` are the
    /// request's checks under the shared rules, `local` under this replica's
    /// share, and `decisions` the share's answers (a bucket's first debt
    /// starts where its seeded share stood: `outage::open`).
    pub fn record(&self, shared: &[Check], local: &[Check], decisions: &[Decision], now: Micros) {
        // A full shard drops one debt of its sample: one whose own arrival
        // time has passed (it adds least), else the first sampled.
        let passed = |(_, debt): &(Check, Option<Debt>)| match debt {
            Some(Debt::Gcra { tat, .. }) if *tat <= now as f64 => 0,
            _ => 1,
        };
        for ((c, l), d) in shared.iter().zip(local).zip(decisions) {
            if !d.allowed {
                continue;
            }
            let mut shard = self.debts.lock(c.key.as_str());
            if let Some((_, debt)) = shard.get_mut(c.key.as_str()) {
                outage::record(&c.algorithm, debt, now, c.cost);
                continue;
            }
            let debt = outage::open(&c.algorithm, &l.algorithm, d, now, c.cost);
            shard.insert(c.key.clone(), (c.clone(), debt), &Room::Evict(&passed));
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
            let key = c.key.as_str();
            if let Some((shared, debt)) = self.debts.lock(key).get_mut(key) {
                outage::unrecord(&shared.algorithm, debt, now, c.cost);
            }
        }
    }

    /// Drops a bucket's debt (it was reset: nothing is owed to it).
    pub fn forget(&self, key: &str) {
        self.debts.lock(key).remove(key);
    }

    /// Every debt, leaving the ledger empty.
    pub fn take(&self) -> Vec<(Check, Debt)> {
        self.debts
            .drain()
            .into_iter()
            .filter_map(|(_, (c, d))| d.map(|d| (c, d)))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.debts.is_empty()
    }

    /// Puts back debts whose charge failed, merged with anything recorded
    /// for the same bucket since (which came after them).
    pub fn restore(&self, debts: Vec<(Check, Debt)>) {
        for (c, earlier) in debts {
            let mut shard = self.debts.lock(c.key.as_str());
            match shard.get_mut(c.key.as_str()) {
                Some((_, slot @ Some(_))) => {
                    if let Some(later) = slot.take() {
                        *slot = Some(outage::merge(&c.algorithm, earlier, later));
                    }
                }
                _ => {
                    shard.force_insert(c.key.clone(), (c, Some(earlier)));
                }
            }
        }
    }
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
            pool: false,
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
