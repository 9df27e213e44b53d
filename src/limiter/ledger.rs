//! What this replica admitted on its local fallback, per shared bucket, until
//! failback charges it to Redis (`charge.lua`).
//!
//! Bounded like the local backend: at most `cap` buckets. A full shard drops
//! one debt from a small random sample (preferring one whose own arrival time
//! has passed); a dropped debt only means a client is charged less than it
//! spent. Debts put back after a failed charge are merged with what was
//! recorded since, never dropped for room.
//!
//! Beside the debts, the doubts: admissions of requests whose Redis call
//! failed in a way that may have run it (its answer was lost). Redis may
//! have charged them already; failback asks the call's marker and takes
//! back from the debts what Redis did charge (`Fallback::settle_doubts`).

use std::sync::Arc;

use parking_lot::Mutex;

use super::algorithms::outage::{self, Debt};
use super::algorithms::{Decision, Micros};
use super::{Check, Sent};
use crate::shard_map::{Room, ShardMap};

const SHARDS: usize = 16;

/// The most doubts kept: one outage leaves the requests of the calls in
/// flight when it struck (a batch each, at most 64). Past it a doubt is
/// not kept, and its request may be charged twice (never over a limit).
const DOUBTS_CAP: usize = 4096;

/// An admission recorded in the debts whose Redis call may also have
/// charged it: the tiers that call decided, with the fallback's answers.
#[derive(Debug, Clone)]
pub struct Doubt {
    pub sent: Sent,
    pub checks: Vec<Check>,
    pub decisions: Vec<Decision>,
    pub now: Micros,
}

pub struct Ledger {
    /// Bucket name -> the shared rule's check and what was admitted against it.
    debts: ShardMap<String, (Check, Option<Debt>)>,
    doubts: Mutex<Vec<Doubt>>,
}

impl Ledger {
    pub fn new(cap: usize) -> Self {
        Ledger {
            debts: ShardMap::new(SHARDS, cap),
            doubts: Mutex::new(Vec::new()),
        }
    }

    /// Keeps a doubt about an admission `record` recorded.
    pub fn doubt(&self, doubt: Doubt) {
        let mut doubts = self.doubts.lock();
        if doubts.len() < DOUBTS_CAP {
            doubts.push(doubt);
        }
    }

    pub fn take_doubts(&self) -> Vec<Doubt> {
        std::mem::take(&mut *self.doubts.lock())
    }

    pub fn restore_doubts(&self, mut back: Vec<Doubt>) {
        let mut doubts = self.doubts.lock();
        back.append(&mut doubts);
        *doubts = back;
    }

    /// Redis ran the doubt's call and said `said` of its request ('1':
    /// admitted, every tier charged; '2': admitted, a shadow tier not):
    /// what Redis charged is taken off the debts.
    pub fn settle(&self, doubt: &Doubt, said: u8) {
        // `unrecord` passes over what the fallback did not admit.
        let (checks, decisions): (Vec<Check>, Vec<Decision>) = doubt
            .checks
            .iter()
            .zip(&doubt.decisions)
            .filter(|(c, _)| said == b'1' || (said == b'2' && !c.shadow))
            .map(|(c, d)| (c.clone(), *d))
            .unzip();
        self.unrecord(&checks, &decisions, doubt.now);
    }

    /// The markers the doubts wait on, each once.
    pub fn markers(doubts: &[Doubt]) -> Vec<Arc<str>> {
        let mut markers: Vec<Arc<str>> = doubts.iter().map(|d| d.sent.marker.clone()).collect();
        markers.sort();
        markers.dedup();
        markers
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

    /// Settles a charged admission recorded here (`Fallback::settle`):
    /// `delta` more tokens owed at `now`, or `-delta` given back where they
    /// were taken (`at`), so failback charges what the answer cost, not the
    /// estimate. False when the bucket holds no debt here (charged already,
    /// or dropped for room).
    pub fn settle_charge(&self, key: &str, delta: i64, at: Micros, now: Micros) -> bool {
        let mut shard = self.debts.lock(key);
        let Some((shared, debt @ Some(_))) = shard.get_mut(key) else {
            return false;
        };
        match delta {
            d if d > 0 => outage::record(&shared.algorithm, debt, now, d as u64),
            d => outage::unrecord(&shared.algorithm, debt, at, d.unsigned_abs()),
        }
        true
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
        self.debts.is_empty() && self.doubts.lock().is_empty()
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

    /// An admission of cost 1 in a bucket of 100.
    const ADMITTED: Decision = Decision {
        allowed: true,
        limit: 100,
        remaining: 99,
        retry_after_us: 0,
        reset_after_us: 0,
        delay_us: 0,
    };

    /// A charged admission settled before failback: the debt carries what
    /// the answer cost (an estimate of 500 that cost 120, one of 100 that
    /// cost 130), and a bucket already charged takes nothing.
    #[test]
    fn settled_charges_move_the_debt_failback_charges() {
        let c = Check {
            tier: Tier::Quota,
            key: "rl:quota:month:k:a".into(),
            algorithm: Algorithm::Calendar {
                limit: 1_000_000,
                period: crate::calendar::Period::Month,
                start: 0,
                end: 2_000_000_000_000_000,
            },
            shadow: false,
            cost: 500,
            shards: 1,
            pool: false,
            charged: true,
            most: 0,
        };
        let ledger = Ledger::new(16);
        let t0 = 1_700_000_000_000_000;
        let one = std::slice::from_ref(&c);
        ledger.record(one, one, &[ADMITTED], t0);
        assert!(ledger.settle_charge(&c.key, -380, t0, t0 + 5));
        let hundred = Check {
            cost: 100,
            ..c.clone()
        };
        ledger.record(
            std::slice::from_ref(&hundred),
            std::slice::from_ref(&hundred),
            &[ADMITTED],
            t0 + 10,
        );
        assert!(ledger.settle_charge(&c.key, 30, t0 + 10, t0 + 20));
        let out = ledger.take();
        match &out[..] {
            [(_, Debt::Window { count, .. })] => assert_eq!(*count, 120 + 130),
            other => panic!("{other:?}"),
        }
        assert!(
            !ledger.settle_charge(&c.key, -10, t0, t0 + 30),
            "charged already"
        );
    }

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
            charged: false,
            most: 0,
        };
        let ledger = Ledger::new(16);
        let t0 = 1_700_000_000_000_000;
        let one = std::slice::from_ref(&c);
        let full = [ADMITTED];
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

    /// A doubt that Redis admitted is taken off the debts ('1'); a shadow
    /// tier Redis did not charge ('2') stays; a refusal ('0') takes nothing.
    #[test]
    fn settled_doubts_leave_what_redis_did_not_charge() {
        let alg = Algorithm::TokenBucket {
            capacity: 100,
            refill_per_sec: 1.0,
        };
        let check = |key: &str, shadow: bool| Check {
            tier: Tier::Key,
            key: key.into(),
            algorithm: alg,
            shadow,
            cost: 1,
            shards: 1,
            pool: false,
            charged: false,
            most: 0,
        };
        let checks = [check("a", false), check("s", true)];
        let ok = ADMITTED;
        // Room for both keys in any one shard (16 shards of one each would
        // evict one when they hash together).
        let ledger = Ledger::new(16 * 2);
        let t0 = 1_700_000_000_000_000;
        for i in 0..4 {
            ledger.record(&checks, &checks, &[ok, ok], t0 + i);
        }
        let doubt = |index| Doubt {
            sent: Sent {
                marker: "m".into(),
                index,
            },
            checks: checks.to_vec(),
            decisions: vec![ok, ok],
            now: t0,
        };
        ledger.settle(&doubt(0), b'1');
        ledger.settle(&doubt(1), b'2');
        ledger.settle(&doubt(2), b'0');
        let mut counts: Vec<(String, u64)> = ledger
            .take()
            .into_iter()
            .map(|(c, d)| match d {
                Debt::Gcra { count, .. } => (c.key, count),
                other => panic!("{other:?}"),
            })
            .collect();
        counts.sort();
        assert_eq!(counts, vec![("a".into(), 2), ("s".into(), 3)]);
    }
}
