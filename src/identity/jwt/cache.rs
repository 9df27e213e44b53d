//! Verified tokens by their SHA-256, so a client sending the same token
//! again pays a hash and a lookup, not a signature check. An entry serves
//! until its token's `exp` (plus the leeway), and only while the key that
//! signed it is still its issuer's (a key dropped from the JWKS takes its
//! tokens with it: `Verifier::verify` checks).
//!
//! Bounded: sixteen shards, each holding at most its share of
//! `cache_max_entries`. A full shard first drops its expired entries, then
//! everything: the next requests verify again, which is all a miss costs.

use std::hash::BuildHasherDefault;
use std::sync::Arc;
use std::time::Duration;

use super::Verified;
// A digest is its own hash (its first 8 bytes), as the API keys' table has it.
pub(crate) use crate::identity::apikeys::Digest;
use crate::identity::apikeys::DigestHasher;
use crate::shard_map::{Room, ShardMap, StillFull};

const SHARDS: usize = 16;

pub struct Cache {
    tokens: ShardMap<Digest, Arc<Verified>, BuildHasherDefault<DigestHasher>>,
}

impl Cache {
    pub fn new(max_entries: usize) -> Self {
        Cache {
            tokens: ShardMap::with_hasher(SHARDS, max_entries, BuildHasherDefault::default()),
        }
    }

    pub fn get(&self, d: &Digest) -> Option<Arc<Verified>> {
        self.tokens.lock(d).get(d).cloned()
    }

    pub fn insert(&self, d: Digest, v: Arc<Verified>, now_secs: u64) {
        let expired = |v: &Arc<Verified>| !v.usable_at(now_secs);
        let room = Room::Sweep {
            stale: &expired,
            every: Duration::ZERO,
            then: StillFull::Clear,
        };
        self.tokens.lock(&d).insert(d, v, &room);
    }

    pub fn remove(&self, d: &Digest) {
        self.tokens.lock(d).remove(d);
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }
}
