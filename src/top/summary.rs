//! Space-Saving (Metwally, Agrawal and El Abbadi, 2005): the heaviest keys
//! of a stream in `k` counters, whatever the number of distinct keys.
//!
//! A refusal of a key already counted adds one to its counter. A new key
//! takes a free counter, or else the smallest one: it inherits that count
//! plus one and remembers the inherited part as its `error`. So a counter
//! never undercounts (`refused - error <= true count <= refused`), and any
//! key refused more than `n / k` times of `n` is held. Admissions are
//! counted only for keys already held: the summary ranks by refusals, and
//! an admission never displaces anyone.
//!
//! Pure: time is the caller's (`now_us`), so tests need no clock.

use std::hash::{BuildHasher, RandomState};

/// One key's counts while it is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    pub key: String,
    /// Refusals counted, `error` of them inherited from the key it took
    /// the place of.
    pub refused: u64,
    pub error: u64,
    /// Admissions since the key was taken in.
    pub admitted: u64,
    pub first_us: i64,
    pub last_us: i64,
}

/// The counters and, beside them, each key's hash: a lookup hashes the key
/// once and scans `k` numbers (no map to keep in step, one allocation for
/// a key taken in).
#[derive(Debug)]
pub struct Summary {
    k: usize,
    hasher: RandomState,
    hashes: Vec<u64>,
    counters: Vec<Counter>,
}

impl Summary {
    pub fn new(k: usize) -> Self {
        let k = k.max(1);
        Summary {
            k,
            hasher: RandomState::new(),
            hashes: Vec::with_capacity(k),
            counters: Vec::with_capacity(k),
        }
    }

    /// The counter holding `key`, whose hash is `h`.
    fn find(&self, h: u64, key: &str) -> Option<usize> {
        self.hashes
            .iter()
            .enumerate()
            .filter(|(_, x)| **x == h)
            .map(|(i, _)| i)
            .find(|&i| self.counters[i].key == key)
    }

    /// Counts a refusal of `key`.
    pub fn refused(&mut self, key: &str, now_us: i64) {
        let h = self.hasher.hash_one(key);
        if let Some(i) = self.find(h, key) {
            let c = &mut self.counters[i];
            c.refused += 1;
            c.last_us = now_us;
            return;
        }
        let fresh = |refused, error| Counter {
            key: key.to_string(),
            refused,
            error,
            admitted: 0,
            first_us: now_us,
            last_us: now_us,
        };
        if self.counters.len() < self.k {
            self.hashes.push(h);
            self.counters.push(fresh(1, 0));
            return;
        }
        // The smallest counter gives its place (the oldest of equals: the
        // key seen longest ago is the likeliest gone).
        let (i, least) = self
            .counters
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| (c.refused, c.last_us))
            .map(|(i, c)| (i, c.refused))
            .unwrap_or((0, 0));
        self.hashes[i] = h;
        self.counters[i] = fresh(least + 1, least);
    }

    /// Counts an admission of `key` if it is held; whether it was.
    pub fn admitted(&mut self, key: &str, now_us: i64) -> bool {
        let h = self.hasher.hash_one(key);
        match self.find(h, key) {
            Some(i) => {
                let c = &mut self.counters[i];
                c.admitted += 1;
                c.last_us = now_us;
                true
            }
            None => false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.counters.is_empty()
    }

    pub fn counters(&self) -> &[Counter] {
        &self.counters
    }

    pub fn clear(&mut self) {
        self.hashes.clear();
        self.counters.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_heavy_keys_stay_whatever_the_crowd() {
        let mut s = Summary::new(16);
        // 3 heavy keys refused 200 times each, interleaved with 1,000 keys
        // refused once each: 1,600 refusals, so any key over 1,600 / 16 =
        // 100 is held, with a guaranteed count of at most its true one.
        let mut t = 0;
        for i in 0..1_000 {
            t += 1;
            s.refused(&format!("crowd-{i}"), t);
            if i % 5 == 0 {
                for h in ["a", "b", "c"] {
                    s.refused(h, t);
                }
            }
        }
        let mut top: Vec<&Counter> = s.counters().iter().collect();
        top.sort_by_key(|c| std::cmp::Reverse(c.refused - c.error));
        let names: Vec<&str> = top[..3].iter().map(|c| c.key.as_str()).collect();
        assert!(
            ["a", "b", "c"].iter().all(|h| names.contains(h)),
            "top 3 by guaranteed count: {names:?} of {top:?}"
        );
        for c in &top[..3] {
            assert!(c.refused >= 200 && c.refused - c.error <= 200, "{c:?}");
        }
        assert_eq!(s.counters().len(), 16, "k counters, never more");
    }

    #[test]
    fn a_counter_never_undercounts_and_its_error_bounds_the_overcount() {
        let mut s = Summary::new(2);
        for (t, key) in ["x", "y", "x", "z", "z", "z"].iter().enumerate() {
            s.refused(key, t as i64);
        }
        // z took y's place (1) and was refused 3 times: counted 4, error 1.
        let z = s.counters().iter().find(|c| c.key == "z").expect("z held");
        assert_eq!((z.refused, z.error, z.first_us, z.last_us), (4, 1, 3, 5));
        let x = s.counters().iter().find(|c| c.key == "x").expect("x held");
        assert_eq!((x.refused, x.error), (2, 0));
        assert!(s.counters().iter().all(|c| c.key != "y"));
    }

    #[test]
    fn admissions_count_only_for_keys_held() {
        let mut s = Summary::new(2);
        assert!(
            !s.admitted("a", 1),
            "not held: nothing counted, nothing taken in"
        );
        assert!(s.is_empty());
        s.refused("a", 2);
        assert!(s.admitted("a", 3));
        let a = &s.counters()[0];
        assert_eq!((a.refused, a.admitted, a.first_us, a.last_us), (1, 1, 2, 3));
        s.clear();
        assert!(s.is_empty() && !s.admitted("a", 4));
    }
}
