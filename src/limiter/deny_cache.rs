//! Denials remembered until they expire: a bucket that said "no until T" says
//! no to every request until T (rejections change no state, admissions only
//! push T later), so a client flooding past its limit is answered from memory
//! instead of costing a Redis call per request.
//!
//! Bounded: at most `cap` entries; a full shard forgets its expired entries,
//! and if none have expired, forgets them all (a forgotten denial only costs
//! one Redis call to relearn).

use std::time::{Duration, Instant};

use super::{Check, Decision};
use crate::config::Algorithm;
use crate::shard_map::{Room, ShardMap, StillFull};

const SHARDS: usize = 16;

/// A remembered denial: answered from memory until `until`; Redis said a
/// retry could succeed at `retry_at` (later than `until` when the memory
/// is cut short: a leased bucket's), and the bucket held `held` tokens
/// (fewer than the request's cost).
#[derive(Debug, Clone, Copy)]
pub struct Denial {
    pub until: Instant,
    pub retry_at: Instant,
    pub held: u64,
}

/// How long a token bucket that `d` admitted into holds less than `c.cost`
/// (its time to full less the capacity it may lack and still pay it): the
/// next request's refusal, known without asking.
pub fn empty_for(c: &Check, d: &Decision) -> Option<Duration> {
    let Algorithm::TokenBucket {
        capacity,
        refill_per_sec,
    } = c.algorithm
    else {
        return None;
    };
    if d.remaining >= c.cost || refill_per_sec <= 0.0 || c.cost > capacity {
        return None;
    }
    let per_token = 1e6 / refill_per_sec;
    let wait = d.reset_after_us as f64 - (capacity - c.cost) as f64 * per_token;
    // A microsecond over: the script's doubles may put the token a hair
    // past the rounded time.
    (wait > 0.0).then(|| Duration::from_micros(wait.ceil() as u64 + 1))
}

pub struct DenyCache {
    denials: ShardMap<String, Denial>,
}

impl DenyCache {
    pub fn new(cap: usize) -> Self {
        DenyCache {
            denials: ShardMap::new(SHARDS, cap),
        }
    }

    /// The first enforcing check known to deny at `now`, with the time left
    /// until a retry can succeed and what its bucket held; checks for which
    /// `skip` holds are passed.
    pub fn find(
        &self,
        checks: &[Check],
        now: Instant,
        skip: impl Fn(&Check) -> bool,
    ) -> Option<(usize, Duration, u64)> {
        checks.iter().enumerate().find_map(|(i, c)| {
            if c.shadow || skip(c) {
                return None;
            }
            let key = c.key.as_str();
            let d = *self.denials.lock(key).get(key)?;
            (d.until > now).then(|| (i, d.retry_at.saturating_duration_since(now), d.held))
        })
    }

    /// Forgets a bucket's denial (it was reset).
    pub fn forget(&self, key: &str) {
        self.denials.lock(key).remove(key);
    }

    pub fn remember(&self, key: &str, denial: Denial) {
        let now = Instant::now();
        let expired = |d: &Denial| d.until <= now;
        let room = Room::Sweep {
            stale: &expired,
            every: Duration::ZERO,
            then: StillFull::Clear,
        };
        self.denials
            .lock(key)
            .insert(key.to_string(), denial, &room);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::algorithms::{check, commit};
    use crate::limiter::Tier;

    /// Against the algorithm itself: after each admission, `empty_for` is
    /// how long the bucket refuses the next request of that cost, to the
    /// microsecond.
    #[test]
    fn an_emptied_bucket_refuses_until_its_next_token() {
        let alg = Algorithm::TokenBucket {
            capacity: 75,
            refill_per_sec: 7.5,
        };
        for cost in [1u64, 3] {
            let c = Check {
                tier: Tier::Ip,
                key: "k".into(),
                algorithm: alg,
                shadow: false,
                cost,
                shards: 1,
                pool: true,
                charged: false,
                most: 0,
            };
            let (mut state, mut now) = (None, 1_000_000_000i64);
            let mut emptied = 0;
            for _ in 0..200 {
                let e = check(&alg, state.as_ref(), now, cost);
                if !e.decision.allowed {
                    now += 1_000;
                    continue;
                }
                commit(&mut state, &e.update);
                match empty_for(&c, &e.decision) {
                    None => assert!(check(&alg, state.as_ref(), now, cost).decision.allowed),
                    Some(wait) => {
                        emptied += 1;
                        let w = wait.as_micros() as i64;
                        // Within the microseconds its two roundings up add.
                        assert!(
                            !check(&alg, state.as_ref(), now + w - 4, cost)
                                .decision
                                .allowed
                        );
                        let at = check(&alg, state.as_ref(), now + w, cost);
                        assert!(
                            at.decision.allowed,
                            "cost {cost} w {w} {:?} {:?} {:?}",
                            e.decision, at.decision, state
                        );
                        now += w;
                    }
                }
            }
            assert!(emptied > 100, "the bucket ran dry: {emptied}");
        }
    }
}
