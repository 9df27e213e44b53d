//! The request path: a request's demand noted and its cost taken from the
//! leases that hold enough (`spend`), then spent for good once it is
//! admitted (`confirm`) or given back when it is not (`give_back`); a
//! bucket's entry made on its first request, while the table has room;
//! and Redis's answer for the tiers no lease covered, told to the client
//! with what this replica holds (`answered`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Entry;
use super::{running_low, Leases, Taken};
use crate::config::Algorithm;
use crate::limiter::{Check, Decision};
use crate::metrics::LeaseEvent;
use crate::shard_map::{Locked, Room, StillFull};

impl Leases {
    /// Notes a request's demand on each bucket, and takes its cost from
    /// the leases that hold enough. When every tier is covered the request
    /// is admitted here (`Taken::all`); otherwise the other tiers go to
    /// Redis, and if the request is not admitted the tokens taken go back
    /// to their leases (`give_back`).
    pub fn spend(&self, checks: &[Check], now: Instant) -> Taken {
        let mut taken = Taken {
            decisions: vec![None; checks.len()],
            generations: vec![(0, 0); checks.len()],
            renew: false,
        };
        if self.closed.load(Ordering::Acquire) {
            return taken;
        }
        for (i, c) in checks.iter().enumerate() {
            if !c.leased() {
                continue;
            }
            let mut shard = self.shard(&c.key);
            let Some(e) = self.entry(&mut shard, c, now) else {
                continue;
            };
            e.note_demand(c.cost, now, self.period);
            if e.tokens < c.cost || now >= e.expires {
                continue;
            }
            e.tokens -= c.cost;
            taken.generations[i] = (e.generation, e.until);
            taken.decisions[i] = Some(e.decision(now));
            if running_low(e.tokens, e.want(now, self.period))
                && !e.renew_queued
                && !e.asked_recently(now, self.period)
            {
                e.renew_queued = true;
                self.renewals.lock().push(c.clone());
                taken.renew = true;
            }
        }
        taken
    }

    /// The request was admitted: its leased tokens are spent. A quota's
    /// spending is reported to Redis with the next call (the sweeper sends
    /// one within a quarter period), so a holder that dies unreported for
    /// at most that long.
    pub fn confirm(&self, checks: &[Check], taken: &Taken) {
        let mut spent = 0;
        for (c, d) in checks.iter().zip(&taken.decisions) {
            if d.is_none() {
                continue;
            }
            spent += c.cost;
            if matches!(c.algorithm, Algorithm::Calendar { .. }) {
                // Queued for a call once, when the bucket first has
                // spending to report (every call that takes it reports
                // all of it): not on every request of a hot key.
                let first = match self.shard(&c.key).get_mut(&c.key) {
                    Some(e) => {
                        e.unreported += c.cost;
                        e.unreported == c.cost
                    }
                    None => false,
                };
                if first {
                    self.owing.lock().insert(c.key.clone(), c.clone());
                }
            }
        }
        self.book(LeaseEvent::Spent, spent);
    }

    /// The request was not admitted: the tokens it took go back to the
    /// lease they came from while it lives, else they are owed (a lease a
    /// reset cancelled since loses them: its bucket was made whole).
    pub fn give_back(&self, checks: &[Check], taken: &Taken) {
        for (i, c) in checks.iter().enumerate() {
            if taken.decisions[i].is_none() {
                continue;
            }
            let (generation, until) = taken.generations[i];
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                drop(shard);
                self.book(LeaseEvent::Lost, c.cost);
                continue;
            };
            if e.generation == generation {
                e.tokens += c.cost;
            } else if generation < e.reset_generation {
                drop(shard);
                self.book(LeaseEvent::Lost, c.cost);
            } else {
                e.owe(c.cost, until);
                drop(shard);
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
        }
    }

    /// The bucket's entry, made if there is room (after dropping idle ones
    /// that hold nothing).
    fn entry<'a>(
        &self,
        shard: &'a mut Locked<'_, String, Entry>,
        c: &Check,
        now: Instant,
    ) -> Option<&'a mut Entry> {
        let idle = 2 * self.period;
        let dropped =
            |e: &Entry| now.saturating_duration_since(e.last_seen) >= idle && !e.holds_any();
        let room = Room::Sweep {
            stale: &dropped,
            every: Duration::ZERO,
            then: StillFull::Refuse,
        };
        shard.get_or_insert_with(
            c.key.as_str(),
            || (c.key.clone(), Entry::new(c.algorithm, now)),
            &room,
        )
    }

    /// What Redis said of each bucket of a request it decided (leases
    /// granted in the same call taken out: `debit`): kept as the start of
    /// what requests decided here report, and the request's own decisions
    /// told as those are, with what this replica holds of its lease (a
    /// refusal too: its `remaining` is what the bucket holds for the client,
    /// under the request's cost; its retry time stays Redis's).
    pub fn answered(&self, checks: &[Check], decisions: &mut [Decision], now: Instant) {
        for (c, d) in checks.iter().zip(decisions) {
            if !c.leased() {
                continue;
            }
            if let Some(e) = self.shard(&c.key).get_mut(&c.key) {
                e.redis_remaining = d.remaining;
                e.reset_at = now + Duration::from_micros(d.reset_after_us);
                if e.tokens > 0 && now < e.expires {
                    let told = e.decision(now);
                    d.remaining = told.remaining;
                    if d.allowed {
                        d.reset_after_us = told.reset_after_us;
                    }
                }
            }
        }
    }
}
