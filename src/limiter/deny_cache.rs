//! Denials remembered until they expire: a bucket that said "no until T" says
//! no to every request until T (rejections change no state, admissions only
//! push T later), so a client flooding past its limit is answered from memory
//! instead of costing a Redis call per request.
//!
//! Bounded: at most `cap` entries; a full shard forgets its expired entries,
//! and if none have expired, forgets them all (a forgotten denial only costs
//! one Redis call to relearn).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Check;

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
    shards: Vec<Mutex<HashMap<String, Denial>>>,
    per_shard: usize,
    hasher: std::hash::RandomState,
}

impl DenyCache {
    pub fn new(cap: usize) -> Self {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: cap.div_ceil(SHARDS).max(1),
            hasher: std::hash::RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Denial>> {
        &self.shards[(self.hasher.hash_one(key) as usize) % SHARDS]
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
            let d = *self.shard(&c.key).lock().get(&c.key)?;
            (d.until > now).then(|| (i, d.retry_at.saturating_duration_since(now), d.held))
        })
    }

    /// Forgets a bucket's denial (it was reset).
    pub fn forget(&self, key: &str) {
        self.shard(key).lock().remove(key);
    }

    pub fn remember(&self, key: &str, denial: Denial) {
        let mut shard = self.shard(key).lock();
        if shard.len() >= self.per_shard && !shard.contains_key(key) {
            let now = Instant::now();
            shard.retain(|_, d| d.until > now);
            if shard.len() >= self.per_shard {
                shard.clear();
            }
        }
        shard.insert(key.to_string(), denial);
    }
}
