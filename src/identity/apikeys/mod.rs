//! The API keys a request's secret is looked up in: `[[api_keys]]` and
//! `clients.api_keys_file` together, in one table compact enough for a
//! million keys.
//!
//! A key costs about 110 bytes: a hash-table slot (its SHA-256 digest and a
//! 12-byte entry), and its id in one shared string. Plans are named by an
//! index, and the rare key with quotas or a burst bucket of its own points
//! into a side list. Nothing per key is a heap allocation of its own, so a
//! set of a million builds in about a second and drops at once.
//!
//! The table and the ids live on the system allocator, not the process's
//! mimalloc: they are a few large blocks that glibc maps and unmaps whole,
//! so a set a reload replaced goes back to the system when it is dropped.
//! (mimalloc kept them: three reloads of a million keys left 500 MB
//! resident where one set needs 110.)
//!
//! `file` reads the keys file (JSON lines or CSV); `Builder` checks what
//! the two sources give together (one id, one secret per key).

pub mod admin;
pub mod file;
pub mod runtime;
pub mod snapshot;
pub mod store;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use allocator_api2::alloc::System;
use allocator_api2::vec::Vec as SysVec;

use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{ApiKey, Burst, Quota};

/// A SHA-256 digest as a table key. Its hash is its first 8 bytes: a digest
/// is already uniform, and an attacker controls only the secret hashed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Digest(pub(crate) [u8; 32]);

impl Hash for Digest {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let mut word = [0u8; 8];
        word.copy_from_slice(&self.0[..8]);
        state.write_u64(u64::from_le_bytes(word));
    }
}

/// Passes `Digest`'s word through.
#[derive(Default)]
pub(crate) struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is called by `Digest`; fold anything else in.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const NONE: u32 = u32::MAX;

/// One key, in 12 bytes: its id's place in `ids`, its plan's index, and
/// its own limits' index in `overrides` (`NONE`: its plan's).
#[derive(Clone, Copy)]
struct Entry {
    id_start: u32,
    id_len: u8,
    plan: u16,
    own: u32,
}

/// A key's own quotas or burst bucket, in place of its plan's (and its
/// entry, so that these few keys are listed without a scan of the table).
struct Own {
    entry: Entry,
    quotas: Option<Vec<Quota>>,
    burst: Option<Burst>,
}

/// One key, as a request sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyRef<'a> {
    pub id: &'a str,
    pub plan: &'a str,
    /// Its own quotas, in place of its plan's.
    pub quotas: Option<&'a [Quota]>,
    /// Its own burst bucket, in place of its plan's.
    pub burst: Option<Burst>,
}

type Table = hashbrown::HashMap<Digest, Entry, BuildHasherDefault<DigestHasher>, System>;

/// Every key the gateway accepts.
pub struct KeySet {
    by_digest: Table,
    /// Every id, one after another (checked ASCII).
    ids: SysVec<u8, System>,
    plans: Vec<String>,
    own: Vec<Own>,
    /// How many came from `[[api_keys]]` (the rest from the keys file).
    inline: usize,
}

impl Default for KeySet {
    fn default() -> Self {
        KeySet {
            by_digest: Table::with_hasher_in(Default::default(), System),
            ids: SysVec::new_in(System),
            plans: Vec::new(),
            own: Vec::new(),
            inline: 0,
        }
    }
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySet")
            .field("keys", &self.len())
            .finish_non_exhaustive()
    }
}

impl KeySet {
    /// The keys of `[[api_keys]]` alone (they were checked as they were read).
    pub fn inline(keys: &[ApiKey]) -> Self {
        let b = Builder::with_inline(keys, 0);
        let mut set = b.finish().unwrap_or_default();
        set.inline = keys.len();
        set
    }

    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// How many came from the keys file.
    pub fn from_file(&self) -> usize {
        self.len() - self.inline
    }

    fn view(&self, e: &Entry) -> KeyRef<'_> {
        let start = e.id_start as usize;
        let own = self.own.get(e.own as usize);
        KeyRef {
            // Only ASCII ids are stored.
            id: std::str::from_utf8(&self.ids[start..start + e.id_len as usize])
                .unwrap_or_default(),
            plan: &self.plans[e.plan as usize],
            quotas: own.and_then(|o| o.quotas.as_deref()),
            burst: own.and_then(|o| o.burst),
        }
    }

    /// The key a presented secret is. The secret is hashed first, so the
    /// table only ever compares digests; the last comparison is constant
    /// time, so a near miss and a far miss cost the same.
    pub fn lookup(&self, secret: &[u8]) -> Option<KeyRef<'_>> {
        self.lookup_digest(&digest_of(secret))
    }

    /// `lookup` of a secret already hashed.
    pub fn lookup_digest(&self, digest: &[u8; 32]) -> Option<KeyRef<'_>> {
        let (found, e) = self.by_digest.get_key_value(&Digest(*digest))?;
        bool::from(found.0.ct_eq(digest)).then(|| self.view(e))
    }

    /// The key with this id (a scan: for the admin API, not for requests).
    pub fn by_id(&self, id: &str) -> Option<KeyRef<'_>> {
        self.iter().find(|k| k.id == id)
    }

    pub fn iter(&self) -> impl Iterator<Item = KeyRef<'_>> {
        self.by_digest.values().map(|e| self.view(e))
    }

    /// The keys with limits of their own (quotas or a burst bucket).
    pub fn with_own_limits(&self) -> impl Iterator<Item = KeyRef<'_>> {
        self.own.iter().map(|o| self.view(&o.entry))
    }

    /// The plans the keys name.
    pub fn plans(&self) -> &[String] {
        &self.plans
    }

    /// Keys per plan, in `plans()` order.
    pub fn per_plan(&self) -> Vec<usize> {
        let mut n = vec![0; self.plans.len()];
        for e in self.by_digest.values() {
            n[e.plan as usize] += 1;
        }
        n
    }

    /// Whether any key counts quotas of its own.
    pub fn has_own_quotas(&self) -> bool {
        self.own
            .iter()
            .any(|o| o.quotas.as_ref().is_some_and(|q| !q.is_empty()))
    }

    /// Bytes held, about (the table's slots, the ids, the side lists).
    pub fn heap_bytes(&self) -> usize {
        let slot = std::mem::size_of::<(Digest, Entry)>() + 1;
        // hashbrown holds 7 items in 8 buckets at most.
        (self.by_digest.capacity() * 8 / 7) * slot
            + self.ids.capacity()
            + self.own.capacity() * std::mem::size_of::<Own>()
    }
}

/// Where a key was given: `api_keys[i]` in the config, or line `n` of the
/// keys file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Inline(usize),
    Line(usize),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Inline(i) => write!(f, "api_keys[{i}] in the config"),
            Origin::Line(n) => write!(f, "line {n}"),
        }
    }
}

/// A key refused while building a set: where, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub at: Origin,
    pub message: String,
}

/// Builds a `KeySet` one key at a time; `finish` checks that no id is
/// given twice.
pub struct Builder {
    set: KeySet,
    plan_index: HashMap<String, u16>,
    /// Each key's id start and origin (`Origin::packed`), in order of
    /// insertion (the ids are appended, so sorted by id start), until
    /// `finish`.
    origins: SysVec<(u32, u32), System>,
}

impl Origin {
    const INLINE: u32 = 1 << 31;

    fn packed(self) -> u32 {
        match self {
            Origin::Inline(i) => Self::INLINE | i as u32,
            Origin::Line(n) => n as u32 & !Self::INLINE,
        }
    }

    fn unpacked(p: u32) -> Self {
        if p & Self::INLINE != 0 {
            Origin::Inline((p & !Self::INLINE) as usize)
        } else {
            Origin::Line(p as usize)
        }
    }
}

impl Builder {
    pub fn new(expected: usize) -> Self {
        let mut set = KeySet::default();
        set.by_digest.reserve(expected);
        Builder {
            set,
            plan_index: HashMap::new(),
            origins: SysVec::with_capacity_in(expected, System),
        }
    }

    /// A builder holding `[[api_keys]]` already, with room for `more`.
    pub fn with_inline(keys: &[ApiKey], more: usize) -> Self {
        let mut b = Builder::new(keys.len() + more);
        for (i, k) in keys.iter().enumerate() {
            // The config reader refused duplicates already.
            let _ = b.insert(
                &k.id,
                k.digest,
                &k.plan,
                k.quotas.clone(),
                k.burst,
                Origin::Inline(i),
            );
        }
        b
    }

    fn origin_of(&self, id_start: u32) -> Origin {
        let i = self.origins.partition_point(|(s, _)| *s < id_start);
        Origin::unpacked(self.origins[i].1)
    }

    /// Adds one key; refuses a secret already given (naming where).
    pub fn insert(
        &mut self,
        id: &str,
        digest: [u8; 32],
        plan: &str,
        quotas: Option<Vec<Quota>>,
        burst: Option<Burst>,
        at: Origin,
    ) -> Result<(), Refused> {
        let refused = |message: String| Refused { at, message };
        if id.is_empty() || id.len() > u8::MAX as usize || !id.is_ascii() {
            return Err(refused(format!(
                "an id is 1-255 ASCII characters, found {} bytes",
                id.len()
            )));
        }
        if let Some(e) = self.set.by_digest.get(&Digest(digest)) {
            return Err(refused(format!(
                "the same key as {} (id \"{}\")",
                self.origin_of(e.id_start),
                self.set.view(e).id
            )));
        }
        let plan = match self.plan_index.get(plan) {
            Some(&i) => i,
            None => {
                let i = u16::try_from(self.set.plans.len())
                    .map_err(|_| refused("more than 65,535 plans".into()))?;
                self.set.plans.push(plan.to_string());
                self.plan_index.insert(plan.to_string(), i);
                i
            }
        };
        let id_start = u32::try_from(self.set.ids.len())
            .map_err(|_| refused("the ids together pass 4 GiB".into()))?;
        let mut entry = Entry {
            id_start,
            id_len: id.len() as u8,
            plan,
            own: NONE,
        };
        if quotas.is_some() || burst.is_some() {
            entry.own = self.set.own.len() as u32;
            self.set.own.push(Own {
                entry,
                quotas,
                burst,
            });
        }
        self.set.ids.extend_from_slice(id.as_bytes());
        self.origins.push((id_start, at.packed()));
        self.set.by_digest.insert(Digest(digest), entry);
        Ok(())
    }

    /// The set, or every id given more than once (each naming the first).
    pub fn finish(mut self) -> Result<KeySet, Vec<Refused>> {
        // Sorted by the id's hash, then by where it was given: equal ids
        // lie together, first given first.
        let hash = |s: &str| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.hash(&mut h);
            h.finish()
        };
        // (hash, start, length): an entry knows where its id lies.
        let mut order: SysVec<(u64, u32, u8), System> =
            SysVec::with_capacity_in(self.set.len(), System);
        order.extend(
            self.set
                .by_digest
                .values()
                .map(|e| (hash(self.set.view(e).id), e.id_start, e.id_len)),
        );
        order.sort_unstable();
        let ids = &self.set.ids;
        let id_at = |start: u32, len: u8| &ids[start as usize..start as usize + len as usize];
        let mut refused = Vec::new();
        let mut first = order.first().map_or((0, 0), |(_, s, l)| (*s, *l));
        for pair in order.windows(2) {
            let ((ha, a, la), (hb, b, lb)) = (pair[0], pair[1]);
            if ha != hb {
                first = (b, lb);
                continue;
            }
            let id = id_at(b, lb);
            // `first`: the earliest of this run of equal hashes (ids that
            // only share a hash are as rare as 64-bit collisions).
            let earliest = if id == id_at(first.0, first.1) {
                first.0
            } else if id == id_at(a, la) {
                a
            } else {
                continue;
            };
            refused.push(Refused {
                at: self.origin_of(b),
                message: format!(
                    "duplicate id \"{}\" (first at {})",
                    String::from_utf8_lossy(id),
                    self.origin_of(earliest)
                ),
            });
        }
        if !refused.is_empty() {
            refused.sort_by_key(|r| match r.at {
                Origin::Inline(i) => (0, i),
                Origin::Line(n) => (1, n),
            });
            return Err(refused);
        }
        self.set.by_digest.shrink_to_fit();
        self.set.ids.shrink_to_fit();
        self.set.own.shrink_to_fit();
        Ok(self.set)
    }
}

/// The digest a key's secret is stored as.
pub fn digest_of(secret: impl AsRef<[u8]>) -> [u8; 32] {
    Sha256::digest(secret.as_ref()).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::Period;

    fn key(b: &mut Builder, id: &str, secret: &str, plan: &str, at: usize) -> Result<(), Refused> {
        b.insert(id, digest_of(secret), plan, None, None, Origin::Line(at))
    }

    #[test]
    fn looks_up_by_secret_and_by_id() {
        let mut b = Builder::new(3);
        key(&mut b, "a", "sa", "free", 1).unwrap();
        key(&mut b, "bee", "sb", "pro", 2).unwrap();
        let q = vec![Quota {
            limit: 5,
            period: Period::Day,
            charged: false,
        }];
        b.insert(
            "c",
            digest_of("sc"),
            "free",
            Some(q.clone()),
            None,
            Origin::Line(3),
        )
        .unwrap();
        let set = b.finish().unwrap();
        assert_eq!(set.len(), 3);
        let a = set.lookup(b"sa").unwrap();
        assert_eq!((a.id, a.plan, a.quotas, a.burst), ("a", "free", None, None));
        assert_eq!(set.lookup(b"sb").unwrap().id, "bee");
        assert_eq!(set.lookup(b"sc").unwrap().quotas, Some(&q[..]));
        assert!(set.lookup(b"sA").is_none());
        assert!(set.lookup(b"").is_none());
        assert_eq!(set.by_id("bee").unwrap().plan, "pro");
        assert!(set.by_id("be").is_none());
        assert_eq!(set.with_own_limits().count(), 1);
        assert!(set.has_own_quotas());
        let mut per: Vec<(String, usize)> =
            set.plans().iter().cloned().zip(set.per_plan()).collect();
        per.sort();
        assert_eq!(per, vec![("free".into(), 2), ("pro".into(), 1)]);
    }

    #[test]
    fn a_secret_given_twice_names_the_first() {
        let mut b = Builder::new(2);
        key(&mut b, "a", "same", "free", 4).unwrap();
        key(&mut b, "b", "other", "free", 5).unwrap();
        let e = key(&mut b, "c", "same", "free", 9).unwrap_err();
        assert_eq!(e.at, Origin::Line(9));
        assert_eq!(e.message, "the same key as line 4 (id \"a\")");
    }

    #[test]
    fn an_id_given_twice_names_the_first() {
        let mut b = Builder::new(4);
        b.insert("x", digest_of("s0"), "free", None, None, Origin::Inline(0))
            .unwrap();
        for (i, id) in ["y", "x", "z", "x"].iter().enumerate() {
            key(&mut b, id, &format!("s{}", i + 1), "free", i + 1).unwrap();
        }
        let e = b.finish().unwrap_err();
        let said: Vec<String> = e
            .iter()
            .map(|r| format!("{}: {}", r.at, r.message))
            .collect();
        assert_eq!(
            said,
            vec![
                "line 2: duplicate id \"x\" (first at api_keys[0] in the config)",
                "line 4: duplicate id \"x\" (first at api_keys[0] in the config)",
            ]
        );
    }

    #[test]
    fn many_keys_are_each_found_once() {
        let n = 20_000;
        let mut b = Builder::new(n);
        for i in 0..n {
            key(
                &mut b,
                &format!("k{i}"),
                &format!("secret-{i}"),
                ["a", "b", "c"][i % 3],
                i + 1,
            )
            .unwrap();
        }
        let set = b.finish().unwrap();
        assert_eq!(set.len(), n);
        for i in (0..n).step_by(97) {
            assert_eq!(
                set.lookup(format!("secret-{i}").as_bytes()).unwrap().id,
                format!("k{i}")
            );
        }
        // About 110 bytes a key (a table slot of 45, the id, the slack of a
        // power-of-two table).
        let per_key = set.heap_bytes() / n;
        assert!(per_key <= 150, "{per_key} bytes a key");
    }
}
