//! Verified tokens by their SHA-256, so a client sending the same token
//! again pays a hash and a lookup, not a signature check. An entry serves
//! until its token's `exp` (plus the leeway), and only while the key that
//! signed it is still its issuer's (a key dropped from the JWKS takes its
//! tokens with it: `Verifier::verify` checks).
//!
//! Bounded: sixteen shards, each holding at most its share of
//! `cache_max_entries`. A full shard first drops its expired entries, then
//! everything: the next requests verify again, which is all a miss costs.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::sync::Arc;

use parking_lot::Mutex;

use super::Verified;
// A digest is its own hash (its first 8 bytes), as the API keys' table has it.
pub(crate) use crate::identity::apikeys::Digest;
use crate::identity::apikeys::DigestHasher;

const SHARDS: usize = 16;

type Shard = Mutex<HashMap<Digest, Arc<Verified>, BuildHasherDefault<DigestHasher>>>;

pub struct Cache {
    shards: Vec<Shard>,
    per_shard: usize,
}

impl Cache {
    pub fn new(max_entries: usize) -> Self {
        Cache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: max_entries.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, d: &Digest) -> &Shard {
        // The byte past the hash's eight: shards and buckets spread apart.
        &self.shards[d.0[8] as usize % SHARDS]
    }

    pub fn get(&self, d: &Digest) -> Option<Arc<Verified>> {
        self.shard(d).lock().get(d).cloned()
    }

    pub fn insert(&self, d: Digest, v: Arc<Verified>, now_secs: u64) {
        let mut shard = self.shard(&d).lock();
        if shard.len() >= self.per_shard {
            shard.retain(|_, v| v.usable_at(now_secs));
            if shard.len() >= self.per_shard {
                shard.clear();
            }
        }
        shard.insert(d, v);
    }

    pub fn remove(&self, d: &Digest) {
        self.shard(d).lock().remove(d);
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}
