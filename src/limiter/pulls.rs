//! Pulls: a share that ran dry is topped up from its bucket's pool by a
//! call made every `PULL_EVERY` for all such buckets together, instead of
//! a call per request beyond the share.
//!
//! A crowd near its limits has a head over them: each of its clients empties
//! its share and then claims the pool's tokens one call at a time, as they
//! refill (a crowd of a hundred such clients at 10/s: hundreds of calls a
//! second). So a share that could not cover a request is remembered here
//! (`Wanting::missed`); each round, one call (up to `PER_CALL` buckets)
//! asks each of their pools for the share's room, taken exactly as a
//! request of that cost would be (`limiter.lua`'s grants, never given
//! back). The tokens move from the pool
//! into the share, so capacities and rates still add up to the bucket's:
//! what the replicas admit stays within C + r·T.
//!
//! A request sent to the pool because its share missed carries its
//! share's top-up in that same call (`TopUps`, asked by the batch): the
//! share is full again when the answer comes, so the client's next requests
//! are decided here instead of each going to the pool until the round. The
//! round is left with what a call did not carry (a drained pool's share, a
//! bucket the call's top-up could not fill).
//!
//! A pool that could not give all that was asked is drained: it is not
//! asked again before its next token (or the next round, if later), and
//! until then the requests its share cannot cover are refused from memory
//! (`Fallback::pull`), with no call. So a token the pool refills waits at
//! most a token's time and two rounds before a share serves it: at the end
//! of a burst, about a token is left unspent in the pool.
//!
//! What it costs in accuracy (never over the limit): tokens pulled into a
//! share that then goes idle make the share full before the pool is, and
//! the share's own refill is lost until the pool fills too. The worst case,
//! a client near its limit that stops right after a full top-up, leaves the
//! bucket short of full for a while by up to f²C / (n²(1 - f)) tokens (a
//! share's capacity times its rate over the pool's): C/12 on one replica at
//! f = 0.25, C/48 on two.

use std::time::{Duration, Instant};

use std::sync::Arc;

use super::algorithms::lease::Grant;
use super::leases::{Ask, Asks};
use super::Check;
use crate::shard_map::{Room, ShardMap, StillFull};

/// How often the shares that ran dry are topped up.
pub const PULL_EVERY: Duration = Duration::from_millis(50);

/// Buckets asked for in one call (one script run blocks Redis).
pub const PER_CALL: usize = 64;

/// Buckets remembered at most; past it a dry share's requests go to the
/// pool one by one, as without pulls.
const CAP: usize = 4096;

/// A bucket that missed nothing for this long is forgotten.
const QUIET: Duration = Duration::from_secs(1);

const SHARDS: usize = 16;

/// A top-up to ask a pool for: the request's check (the bucket's rule),
/// its pool's, and the tokens wanted.
pub struct Pull {
    pub check: Check,
    pub pool: Check,
    pub want: u64,
}

/// Top-ups for the shares of a membership (`generation`).
pub struct Pulls {
    pub pulls: Vec<Pull>,
    pub generation: u64,
}

/// What a call deciding requests asks for the shares whose misses sent
/// them to their pools, and where their grants go (the fallback's shares
/// and refusals remembered). Redis Cluster calls carry none.
pub trait TopUps: Send + Sync + 'static {
    /// The top-ups for the pools `requests` ask; None: none due.
    fn asks(&self, requests: &[&[Check]]) -> Option<Pulls>;
    /// What their pools gave, one grant per pull, in order.
    fn granted(&self, pulls: &Pulls, grants: &[Grant]);
}

/// `pulls` appended to a call's `asks` as top-ups (`limiter.lua`: a
/// negative want; granted from all the pool holds). `holder` names this
/// replica when the call carries no lease of its own.
pub fn ask_pulls(asks: &mut Asks, pulls: &[Pull], holder: &Arc<str>) {
    if pulls.is_empty() {
        return;
    }
    if asks.asks.is_empty() {
        // What the script requires of a call with leases; top-ups use
        // neither the fair share nor the smallest grant.
        asks.replicas = 1;
        asks.min = 1;
        asks.holder = holder.clone();
        asks.hold_us = 0;
    }
    asks.asks.extend(pulls.iter().map(|p| Ask {
        check: p.pool.clone(),
        want: p.want,
        ret: 0,
        until: 0,
        spent: 0,
        report: 0,
    }));
    asks.pulls += pulls.len();
}

struct Want {
    /// The request's check (the whole bucket's rule).
    check: Check,
    /// Tokens its share could not cover since the last round.
    missed: u64,
    last: Instant,
    /// Its pool was drained: not asked again before its next token.
    not_before: Instant,
}

pub struct Wanting {
    map: ShardMap<Box<str>, Want>,
}

impl Default for Wanting {
    fn default() -> Self {
        Wanting {
            map: ShardMap::new(SHARDS, CAP),
        }
    }
}

impl Wanting {
    /// A share could not cover `c`.
    pub fn missed(&self, c: &Check) {
        let mut shard = self.map.lock(c.key.as_str());
        let room = Room::Sweep {
            stale: &|w: &Want| w.missed == 0,
            every: QUIET,
            then: StillFull::Refuse,
        };
        let want = shard.get_or_insert_with(
            c.key.as_str(),
            || {
                let now = Instant::now();
                let w = Want {
                    check: c.clone(),
                    missed: 0,
                    last: now,
                    not_before: now,
                };
                (c.key.as_str().into(), w)
            },
            &room,
        );
        if let Some(w) = want {
            w.missed += c.cost;
            w.last = Instant::now();
        }
    }

    /// The buckets that missed something since they were last asked for
    /// (and whose pool may hold a token again); their counts start again.
    /// Quiet ones are forgotten.
    pub fn due(&self, now: Instant) -> Vec<Check> {
        let mut out = Vec::new();
        for mut shard in self.map.lock_each() {
            shard.retain(|_, w| now.saturating_duration_since(w.last) < QUIET);
            for w in shard.values_mut() {
                if w.missed > 0 && now >= w.not_before {
                    out.push(w.check.clone());
                    w.missed = 0;
                }
            }
        }
        out
    }

    /// A call is about to carry `key`'s top-up: its check, if its share
    /// missed lately and its pool is not drained; its misses start again.
    pub fn take(&self, key: &str, now: Instant) -> Option<Check> {
        let mut shard = self.map.lock(key);
        let w = shard.get_mut(key)?;
        if w.missed == 0 || now < w.not_before {
            return None;
        }
        w.missed = 0;
        Some(w.check.clone())
    }

    /// `c`'s pool was drained: not asked before `until`.
    pub fn hold_off(&self, c: &Check, until: Instant) {
        if let Some(w) = self.map.lock(c.key.as_str()).get_mut(c.key.as_str()) {
            w.not_before = until;
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;
    use crate::limiter::Tier;

    fn check(key: &str, cost: u64) -> Check {
        Check {
            tier: Tier::Ip,
            key: key.into(),
            algorithm: Algorithm::TokenBucket {
                capacity: 100,
                refill_per_sec: 10.0,
            },
            shadow: false,
            cost,
            shards: 1,
            pool: false,
            charged: false,
            most: 0,
        }
    }

    #[test]
    fn a_bucket_is_due_once_per_miss_and_forgotten_when_quiet() {
        let w = Wanting::default();
        w.missed(&check("a", 1));
        w.missed(&check("a", 2));
        w.missed(&check("b", 1));
        let mut due: Vec<String> = w.due(Instant::now()).into_iter().map(|c| c.key).collect();
        due.sort();
        assert_eq!(due, vec!["a".to_string(), "b".to_string()]);
        // A drained pool is held off until its next token.
        w.missed(&check("a", 1));
        w.hold_off(&check("a", 1), Instant::now() + Duration::from_millis(100));
        assert!(w.due(Instant::now()).is_empty());
        let later = Instant::now() + Duration::from_millis(100);
        assert_eq!(w.due(later).len(), 1);
        // Nothing missed since: nothing due, but still remembered.
        assert!(w.due(Instant::now()).is_empty());
        assert_eq!(w.len(), 2);
        // Quiet for a second: forgotten.
        assert!(w.due(Instant::now() + QUIET).is_empty());
        assert!(w.is_empty());
    }
}
