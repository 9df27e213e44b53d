//! A map split into shards, each behind its own lock and each holding at
//! most its part of a bound on entries: the one table under every bounded
//! in-process store (the limiter's local buckets, ledger, denial memory,
//! leases and standing shares, and the verified-token cache).
//!
//! - A key's shard is picked by its hash, so requests on different keys
//!   rarely wait for each other. `shards × per shard ≤ max_entries`: the
//!   bound holds exactly (a bound below the shard count makes fewer shards).
//! - What a full shard does for a new key is the caller's policy, given with
//!   each insertion (`Room`): evict one entry of a small random sample (the
//!   one least worth keeping), or sweep out the entries that may go and then
//!   clear the shard or refuse the key. A key already held never needs room.
//!   An entry that must not be lost goes in past the bound (`force_insert`).
//! - Each shard keeps a little of the caller's own state under its lock
//!   (`meta`), and the shards of several keys can be locked together, always
//!   in one order (`lock_many`), for a change that holds for all or none.
//!
//! It imports nothing from the crate, so any room may use it.

use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indexmap::{Equivalent, IndexMap};
use parking_lot::{Mutex, MutexGuard};

/// Entries drawn when a full shard evicts one (`Room::Evict`).
const EVICTION_SAMPLE: usize = 8;

pub struct ShardMap<K, V, S = RandomState, M = ()> {
    shards: Box<[ShardLock<K, V, S, M>]>,
    per_shard: usize,
    hasher: S,
    /// Entries in every shard: read without taking a lock.
    len: AtomicUsize,
}

type ShardLock<K, V, S, M> = Mutex<Shard<K, V, S, M>>;

struct Shard<K, V, S, M> {
    // Kept in insertion order with a dense index, so an eviction can draw
    // entries at random in O(1).
    map: IndexMap<K, V, S>,
    meta: M,
    /// When a throttled sweep last ran (`Room::Sweep::every`).
    swept: Option<Instant>,
}

/// What a full shard does to take a new key.
pub enum Room<'a, V> {
    /// Evicts one entry of a small random sample: the lowest ranked, or the
    /// first ranked at or below zero (worth nothing already). Always makes
    /// room.
    Evict(&'a dyn Fn(&V) -> i64),
    /// Drops every entry `stale` holds for, at most once per `every` in a
    /// shard (`Duration::ZERO`: each time); if the shard is still full,
    /// `then`.
    Sweep {
        stale: &'a dyn Fn(&V) -> bool,
        every: Duration,
        then: StillFull,
    },
}

/// What a sweep that freed no room does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StillFull {
    /// Drops every entry: for a cache, where what is forgotten costs only a
    /// miss to learn again.
    Clear,
    /// Takes no new key: what the entries hold must not be lost.
    Refuse,
}

impl<K: Hash + Eq, V, M: Default> ShardMap<K, V, RandomState, M> {
    /// At most `max_entries` in up to `shards` shards.
    pub fn new(shards: usize, max_entries: usize) -> Self {
        Self::with_hasher(shards, max_entries, RandomState::new())
    }
}

impl<K: Hash + Eq, V, S: BuildHasher + Clone, M: Default> ShardMap<K, V, S, M> {
    /// As `new`, with keys hashed by `hasher` (for the shard and in it).
    pub fn with_hasher(shards: usize, max_entries: usize, hasher: S) -> Self {
        let n = shards.min(max_entries).max(1);
        ShardMap {
            shards: (0..n)
                .map(|_| {
                    Mutex::new(Shard {
                        map: IndexMap::with_hasher(hasher.clone()),
                        meta: M::default(),
                        swept: None,
                    })
                })
                .collect(),
            per_shard: (max_entries / n).max(1),
            hasher,
            len: AtomicUsize::new(0),
        }
    }
}

impl<K: Hash + Eq, V, S: BuildHasher, M> ShardMap<K, V, S, M> {
    fn index<Q: Hash + ?Sized>(&self, key: &Q) -> usize {
        // The hash's upper half: a shard's own table places keys by the low
        // bits (and tags them with the top seven), so keys that share a
        // shard still spread over its table.
        ((self.hasher.hash_one(key) >> 32) % self.shards.len() as u64) as usize
    }

    fn locked(&self, i: usize) -> Locked<'_, K, V, S, M> {
        Locked {
            shard: self.shards[i].lock(),
            per_shard: self.per_shard,
            len: &self.len,
        }
    }

    /// Locks the shard `key` belongs in.
    pub fn lock<Q: Hash + ?Sized>(&self, key: &Q) -> Locked<'_, K, V, S, M> {
        self.locked(self.index(key))
    }

    /// Locks the shards of all these keys, each once and in index order, so
    /// two callers locking overlapping sets cannot deadlock.
    pub fn lock_many<'q, Q: Hash + ?Sized + 'q>(
        &self,
        keys: impl IntoIterator<Item = &'q Q>,
    ) -> Many<'_, K, V, S, M> {
        let wanted: Vec<usize> = keys.into_iter().map(|k| self.index(k)).collect();
        let mut order = wanted.clone();
        order.sort_unstable();
        order.dedup();
        let slots = wanted
            .iter()
            .map(|i| order.partition_point(|s| s < i))
            .collect();
        Many {
            guards: order.iter().map(|&i| self.locked(i)).collect(),
            slots,
        }
    }

    /// Every shard in turn, each locked while it is looked at.
    pub fn lock_each(&self) -> impl Iterator<Item = Locked<'_, K, V, S, M>> {
        (0..self.shards.len()).map(|i| self.locked(i))
    }

    /// Entries held now, in every shard.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes every entry out, shard by shard.
    pub fn drain(&self) -> Vec<(K, V)> {
        self.lock_each().flat_map(|mut s| s.drain()).collect()
    }
}

/// One shard, locked.
pub struct Locked<'a, K, V, S = RandomState, M = ()> {
    shard: MutexGuard<'a, Shard<K, V, S, M>>,
    per_shard: usize,
    len: &'a AtomicUsize,
}

impl<K: Hash + Eq, V, S: BuildHasher, M> Locked<'_, K, V, S, M> {
    pub fn get<Q: Hash + Equivalent<K> + ?Sized>(&self, key: &Q) -> Option<&V> {
        self.shard.map.get(key)
    }

    pub fn get_mut<Q: Hash + Equivalent<K> + ?Sized>(&mut self, key: &Q) -> Option<&mut V> {
        self.shard.map.get_mut(key)
    }

    pub fn contains_key<Q: Hash + Equivalent<K> + ?Sized>(&self, key: &Q) -> bool {
        self.shard.map.contains_key(key)
    }

    /// The caller's own state for this shard.
    pub fn meta(&self) -> &M {
        &self.shard.meta
    }

    pub fn meta_mut(&mut self) -> &mut M {
        &mut self.shard.meta
    }

    /// Puts `value` under `key`: in place of what the key holds, else as a
    /// new entry once `room` has made room for it. None (and nothing
    /// changed but what `room` swept) when it refuses.
    pub fn insert(&mut self, key: K, value: V, room: &Room<'_, V>) -> Option<&mut V> {
        if let Some(i) = self.shard.map.get_index_of(&key) {
            let slot = &mut self.shard.map[i];
            *slot = value;
            return Some(slot);
        }
        if !self.make_room(room) {
            return None;
        }
        Some(self.force_insert(key, value))
    }

    /// The entry `key` holds, else a new one made by `new` (its key and
    /// value) if `room` makes room for it.
    pub fn get_or_insert_with<Q: Hash + Equivalent<K> + ?Sized>(
        &mut self,
        key: &Q,
        new: impl FnOnce() -> (K, V),
        room: &Room<'_, V>,
    ) -> Option<&mut V> {
        if let Some(i) = self.shard.map.get_index_of(key) {
            return Some(&mut self.shard.map[i]);
        }
        if !self.make_room(room) {
            return None;
        }
        let (k, v) = new();
        Some(self.force_insert(k, v))
    }

    /// Puts `value` under `key` whether or not the shard is full: for an
    /// entry that must not be lost (the bound yields to it until the
    /// shard's entries go).
    pub fn force_insert(&mut self, key: K, value: V) -> &mut V {
        let (i, old) = self.shard.map.insert_full(key, value);
        if old.is_none() {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
        &mut self.shard.map[i]
    }

    /// Whether the shard can take a new key, once a full one has made room
    /// as `room` says.
    pub fn make_room(&mut self, room: &Room<'_, V>) -> bool {
        let shard = &mut *self.shard;
        if shard.map.len() < self.per_shard {
            return true;
        }
        let before = shard.map.len();
        let room_made = match *room {
            Room::Evict(rank) => {
                let n = shard.map.len();
                let victim = pick(n, || fastrand::usize(..n), |i| rank(&shard.map[i]));
                shard.map.swap_remove_index(victim);
                true
            }
            Room::Sweep { stale, every, then } => {
                let due = every.is_zero() || shard.swept.is_none_or(|t| t.elapsed() >= every);
                if due {
                    if !every.is_zero() {
                        shard.swept = Some(Instant::now());
                    }
                    shard.map.retain(|_, v| !stale(v));
                }
                if shard.map.len() < self.per_shard {
                    true
                } else if then == StillFull::Clear {
                    shard.map.clear();
                    true
                } else {
                    false
                }
            }
        };
        self.len
            .fetch_sub(before - shard.map.len(), Ordering::Relaxed);
        room_made
    }

    pub fn remove<Q: Hash + Equivalent<K> + ?Sized>(&mut self, key: &Q) -> Option<V> {
        let v = self.shard.map.swap_remove(key)?;
        self.len.fetch_sub(1, Ordering::Relaxed);
        Some(v)
    }

    pub fn clear(&mut self) {
        self.len.fetch_sub(self.shard.map.len(), Ordering::Relaxed);
        self.shard.map.clear();
    }

    /// Keeps the entries `keep` says to.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let before = self.shard.map.len();
        self.shard.map.retain(|k, v| keep(k, v));
        self.len
            .fetch_sub(before - self.shard.map.len(), Ordering::Relaxed);
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.shard.map.values_mut()
    }

    /// Takes every entry of this shard out.
    pub fn drain(&mut self) -> Vec<(K, V)> {
        let out: Vec<(K, V)> = self.shard.map.drain(..).collect();
        self.len.fetch_sub(out.len(), Ordering::Relaxed);
        out
    }

    /// Entries in this shard.
    pub fn len(&self) -> usize {
        self.shard.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shard.map.is_empty()
    }
}

/// The shards of several keys, locked together (`ShardMap::lock_many`).
pub struct Many<'a, K, V, S = RandomState, M = ()> {
    guards: Vec<Locked<'a, K, V, S, M>>,
    /// Per key, in the order given: which guard holds its shard.
    slots: Vec<usize>,
}

impl<'a, K, V, S, M> Many<'a, K, V, S, M> {
    /// The shard of the `i`-th key given.
    pub fn of(&self, i: usize) -> &Locked<'a, K, V, S, M> {
        &self.guards[self.slots[i]]
    }

    pub fn of_mut(&mut self, i: usize) -> &mut Locked<'a, K, V, S, M> {
        &mut self.guards[self.slots[i]]
    }
}

/// Of up to `EVICTION_SAMPLE` entries drawn (by `draw`, of `n`), the lowest
/// ranked (the earlier drawn on a tie); drawing stops at one ranked at or
/// below zero.
fn pick(n: usize, mut draw: impl FnMut() -> usize, rank: impl Fn(usize) -> i64) -> usize {
    let mut victim = draw();
    let mut lowest = rank(victim);
    for _ in 1..EVICTION_SAMPLE.min(n) {
        if lowest <= 0 {
            break;
        }
        let i = draw();
        let r = rank(i);
        if r < lowest {
            victim = i;
            lowest = r;
        }
    }
    victim
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasherDefault, Hasher};
    use std::sync::Arc;

    /// Hashes a u64 to itself: tests then place keys in chosen shards (the
    /// shard is the hash's upper half, modulo the shard count).
    #[derive(Default, Clone)]
    struct Identity(u64);

    impl Hasher for Identity {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, _: &[u8]) {
            unreachable!("only u64 keys")
        }
        fn write_u64(&mut self, n: u64) {
            self.0 = n;
        }
    }

    type Placed<V, M = ()> = ShardMap<u64, V, BuildHasherDefault<Identity>, M>;

    /// A key in shard `shard`, the `i`-th there.
    fn key(shard: u64, i: u64) -> u64 {
        shard << 32 | i
    }

    fn placed<V, M: Default>(shards: usize, max: usize) -> Placed<V, M> {
        ShardMap::with_hasher(shards, max, BuildHasherDefault::default())
    }

    const EXPIRED_FIRST: Room<'static, i64> = Room::Evict(&|v: &i64| *v);
    const ANY_U32: Room<'static, u32> = Room::Evict(&|_| 1);
    const REFUSE_WHEN_FULL: Room<'static, i64> = Room::Sweep {
        stale: &|v: &i64| *v < 0,
        every: Duration::ZERO,
        then: StillFull::Refuse,
    };

    #[test]
    fn the_bound_holds_exactly() {
        for (shards, max) in [(16, 1000), (64, 100), (16, 5), (1, 1), (16, 16)] {
            let m: ShardMap<String, i64> = ShardMap::new(shards, max);
            for i in 0..10 * max {
                let k = format!("k{i}");
                m.lock(k.as_str()).insert(k.clone(), 1, &EXPIRED_FIRST);
                assert!(m.len() <= max, "{} > {max} at {i}", m.len());
            }
            let counted: usize = m.lock_each().map(|s| s.len()).sum();
            assert_eq!(counted, m.len(), "the count is every shard's");
            assert!(m.len() > max / 2, "{shards} shards of {max}: {}", m.len());
        }
    }

    #[test]
    fn keys_are_found_by_what_they_borrow_as() {
        let m: ShardMap<Box<str>, u32> = ShardMap::new(16, 100);
        m.lock("a").insert("a".into(), 1, &ANY_U32);
        assert_eq!(m.lock("a").get("a"), Some(&1));
        *m.lock("a").get_mut("a").expect("held") += 1;
        assert_eq!(m.lock("a").remove("a"), Some(2));
        assert!(m.is_empty());
    }

    #[test]
    fn an_eviction_takes_the_lowest_ranked_of_its_sample() {
        let ranks = [5, 3, 9, 4, 3, 7, 8, 6, 0];
        let mut draws = 0..;
        // Eight drawn of nine: the first 3 wins over the later one.
        let v = pick(9, || draws.next().unwrap(), |i| ranks[i]);
        assert_eq!(v, 1);
        // One worth nothing stops the draws.
        let ranks = [5, -2, 1, -9];
        let mut drawn = Vec::new();
        let v = pick(
            4,
            || {
                drawn.push(drawn.len());
                drawn.len() - 1
            },
            |i| ranks[i],
        );
        assert_eq!((v, drawn.len()), (1, 2));
    }

    #[test]
    fn a_full_shard_evicts_one_for_a_new_key_and_none_for_a_held_one() {
        let m: Placed<i64> = placed(1, 2);
        m.lock(&key(0, 1)).insert(key(0, 1), 10, &EXPIRED_FIRST);
        m.lock(&key(0, 2)).insert(key(0, 2), -1, &EXPIRED_FIRST);
        // Held: replaced in place.
        m.lock(&key(0, 1)).insert(key(0, 1), 20, &EXPIRED_FIRST);
        assert_eq!(m.len(), 2);
        assert_eq!(m.lock(&key(0, 1)).get(&key(0, 1)), Some(&20));
        // New: one goes (which one is the sample's: `pick`).
        let mut s = m.lock(&key(0, 3));
        assert_eq!(s.insert(key(0, 3), 30, &EXPIRED_FIRST), Some(&mut 30));
        assert_eq!(s.len(), 2);
        drop(s);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn a_sweep_drops_stale_entries_then_clears_or_refuses() {
        let stale = |v: &i64| *v < 0;
        let clear = Room::Sweep {
            stale: &stale,
            every: Duration::ZERO,
            then: StillFull::Clear,
        };
        let m: Placed<i64> = placed(1, 3);
        for (i, v) in [(1, 1), (2, -1), (3, 1)] {
            m.lock(&key(0, i)).insert(key(0, i), v, &clear);
        }
        m.lock(&key(0, 4)).insert(key(0, 4), 1, &clear);
        let s = m.lock(&key(0, 0));
        assert!(!s.contains_key(&key(0, 2)), "the stale one went");
        assert_eq!(s.len(), 3);
        drop(s);
        // Nothing stale: everything goes.
        m.lock(&key(0, 5)).insert(key(0, 5), 1, &clear);
        assert_eq!(m.len(), 1);
        assert_eq!(m.lock(&key(0, 5)).get(&key(0, 5)), Some(&1));

        let m: Placed<i64> = placed(1, 2);
        m.lock(&key(0, 1)).insert(key(0, 1), 1, &REFUSE_WHEN_FULL);
        m.lock(&key(0, 2)).insert(key(0, 2), 1, &REFUSE_WHEN_FULL);
        let mut s = m.lock(&key(0, 3));
        assert!(s.insert(key(0, 3), 1, &REFUSE_WHEN_FULL).is_none());
        assert!(s
            .get_or_insert_with(&key(0, 3), || (key(0, 3), 1), &REFUSE_WHEN_FULL)
            .is_none());
        assert_eq!(s.len(), 2, "refused: nothing changed");
        // Held keys are still written.
        assert_eq!(
            s.get_or_insert_with(&key(0, 1), || unreachable!(), &REFUSE_WHEN_FULL),
            Some(&mut 1)
        );
        *s.get_mut(&key(0, 1)).expect("held") = -1;
        assert!(s.insert(key(0, 3), 1, &REFUSE_WHEN_FULL).is_some());
        assert!(!s.contains_key(&key(0, 1)));
    }

    #[test]
    fn a_throttled_sweep_runs_at_most_once_per_period() {
        let stale = |v: &i64| *v < 0;
        let room = Room::Sweep {
            stale: &stale,
            every: Duration::from_secs(3600),
            then: StillFull::Refuse,
        };
        let m: Placed<i64> = placed(1, 2);
        let mut s = m.lock(&key(0, 0));
        s.force_insert(key(0, 1), 1);
        s.force_insert(key(0, 2), 1);
        assert!(!s.make_room(&room), "swept: nothing stale");
        *s.get_mut(&key(0, 1)).expect("held") = -1;
        assert!(!s.make_room(&room), "not swept again within the hour");
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn a_forced_entry_passes_the_bound_and_is_counted() {
        let m: Placed<i64> = placed(1, 1);
        m.lock(&key(0, 1)).insert(key(0, 1), 1, &REFUSE_WHEN_FULL);
        m.lock(&key(0, 2)).force_insert(key(0, 2), 2);
        assert_eq!(m.len(), 2);
        // An eviction then makes room for one more, and no more.
        m.lock(&key(0, 3)).insert(key(0, 3), 3, &EXPIRED_FIRST);
        assert_eq!(m.len(), 2);
        let mut out = m.drain();
        out.sort();
        assert_eq!(out.len(), 2);
        assert!(m.is_empty());
    }

    #[test]
    fn shards_are_bounded_and_cleared_one_by_one_with_their_own_state() {
        let m: Placed<i64, u64> = placed(4, 8);
        for s in 0..4 {
            for i in 0..2 {
                m.lock(&key(s, i)).insert(key(s, i), 1, &REFUSE_WHEN_FULL);
            }
            assert!(m
                .lock(&key(s, 9))
                .insert(key(s, 9), 1, &REFUSE_WHEN_FULL)
                .is_none());
        }
        assert_eq!(m.len(), 8);
        for (i, mut s) in m.lock_each().enumerate() {
            s.clear();
            *s.meta_mut() = i as u64;
        }
        assert!(m.is_empty());
        assert_eq!(*m.lock(&key(2, 0)).meta(), 2);
        let mut s = m.lock(&key(3, 0));
        s.force_insert(key(3, 0), 1);
        s.remove(&key(3, 0));
        assert!(s.is_empty());
        drop(s);
        assert!(m.is_empty());
    }

    #[test]
    fn many_keys_lock_their_shards_once_each_in_order() {
        let m: Placed<i64> = placed(4, 40);
        let keys = [key(3, 1), key(1, 1), key(3, 2), key(0, 1)];
        let mut many = m.lock_many(&keys);
        assert_eq!(many.guards.len(), 3);
        assert_eq!(many.slots, vec![2, 1, 2, 0]);
        for (i, k) in keys.iter().enumerate() {
            many.of_mut(i).insert(*k, i as i64, &REFUSE_WHEN_FULL);
        }
        assert_eq!(many.of(2).get(&key(3, 1)), Some(&0));
        drop(many);
        assert_eq!(m.len(), 4);

        // Two threads locking the same shards named in opposite orders.
        let m: Arc<ShardMap<String, i64>> = Arc::new(ShardMap::new(16, 1000));
        let names: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
        let threads: Vec<_> = [false, true]
            .into_iter()
            .map(|reverse| {
                let (m, mut names) = (m.clone(), names.clone());
                if reverse {
                    names.reverse();
                }
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        let mut many = m.lock_many(names.iter().map(String::as_str));
                        for (i, k) in names.iter().enumerate() {
                            let s = many.of_mut(i);
                            match s.get_mut(k.as_str()) {
                                Some(v) => *v += 1,
                                None => {
                                    s.insert(k.clone(), 1, &EXPIRED_FIRST);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("no deadlock, no panic");
        }
        for k in &names {
            assert_eq!(m.lock(k.as_str()).get(k.as_str()), Some(&4000));
        }
    }
}
