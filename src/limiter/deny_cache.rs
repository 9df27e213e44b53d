//! Denials remembered until they expire: a bucket that said "no until T" says
//! no to every request until T (rejections change no state, admissions only
//! push T later), so a client flooding past its limit is answered from memory
//! instead of costing a Redis call per request.
//!
//! Bounded: at most `cap` entries; a full shard forgets its expired entries,
//! and if none have expired, forgets them all (a forgotten denial only costs
//! one Redis call to relearn).

use std::time::{Duration, Instant};

use super::Check;
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
