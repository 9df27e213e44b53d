//! Standing shares: the part of a big token bucket each replica owns without
//! asking Redis, so a crowd of clients far below their limits costs Redis
//! nothing while the sum over replicas stays exact. Pure functions of
//! (parameters, state, now); the store is `limiter::standing`.
//!
//! A token bucket of capacity C refilling at r is cut once, by `fraction` f:
//!
//! ```text
//! pool (Redis, as any bucket)    capacity C - ⌊fC⌋         rate (1 - f) r
//! share (each of n replicas)     capacity ⌊⌊fC⌋ / n⌋       rate f r / n
//! ```
//!
//! A request a replica's share cannot cover goes to the pool. Capacities
//! add up to at most C and rates to r, and no share's level ever rises but
//! by its own refill, so over any interval admitted ≤ C + r·T whatever the
//! traffic's spread:
//! - a replica joining (or rejoining after it lost touch with Redis) uses no
//!   share until every other replica has either heard it counted or stopped
//!   using its own (`JOIN_WAIT`: an announcement's life), and then starts
//!   every share empty, filling at its rate (`fresh`). Starting full would
//!   add a share's capacity the others may have spent just before they
//!   shrank;
//! - the replica count changing rescales a share keeping its level, clamped
//!   to the new capacity (`rescale`): shrinking never adds tokens, and
//!   growing (a replica left) does not hand its unspent tokens to the rest;
//! - a replica stops using its shares once its announcement may have
//!   expired in Redis (`Membership::usable`), before the others can count
//!   it gone and grow.
//!
//! What it costs: a client whose requests all reach one replica gets that
//! replica's share and the pool, f/n + (1 - f) of its limit; spread over
//! the replicas (round robin) it gets all of it. Only big buckets are cut
//! (`MIN_SPLIT`): a share of a few tokens would serve nobody.

use crate::config::Algorithm;

use super::{gcra, Evaluation, Micros, Update};

/// The least ⌊fC⌋ a bucket is cut for: sixteen replicas still own a token
/// each.
pub const MIN_SPLIT: u64 = 16;

/// The pool's rule, when `alg` is cut: what Redis decides.
pub fn pool(alg: &Algorithm, fraction: f64) -> Option<Algorithm> {
    let (capacity, rate) = cut(alg, fraction)?;
    Some(Algorithm::TokenBucket {
        capacity: capacity - shared(capacity, fraction),
        refill_per_sec: rate * (1.0 - fraction),
    })
}

/// One replica's share of `alg` among `n`: capacity and rate. None when the
/// bucket is not cut, or a share would hold no whole token.
pub fn share(alg: &Algorithm, fraction: f64, n: u32) -> Option<(u64, f64)> {
    let (capacity, rate) = cut(alg, fraction)?;
    let n = n.max(1) as u64;
    let cap = shared(capacity, fraction) / n;
    (cap >= 1).then_some((cap, rate * fraction / n as f64))
}

fn cut(alg: &Algorithm, fraction: f64) -> Option<(u64, f64)> {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } if fraction > 0.0
            && fraction < 1.0
            && shared(capacity, fraction) >= MIN_SPLIT
            && refill_per_sec > 0.0 =>
        {
            Some((capacity, refill_per_sec))
        }
        _ => None,
    }
}

/// ⌊fC⌋: the capacity every share together holds.
fn shared(capacity: u64, fraction: f64) -> u64 {
    (capacity as f64 * fraction).floor() as u64
}

/// One share on one replica: a GCRA bucket with the parameters its TAT
/// was computed under (they change with the replica count).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share {
    pub tat: f64,
    pub cap: u64,
    pub rate: f64,
    /// When it was last written: a rescale refills the time since at the
    /// slower of the two rates (the count may have changed any time in it).
    pub at: Micros,
}

impl Share {
    /// A share first seen at `now`, by a replica whose shares started
    /// filling at `ramp_from` (empty then).
    pub fn fresh(cap: u64, rate: f64, now: Micros, ramp_from: Micros) -> Self {
        let t = 1e6 / rate;
        Share {
            tat: (now as f64).max(ramp_from as f64 + cap as f64 * t),
            cap,
            rate,
            at: now,
        }
    }

    /// A share this replica holds no entry for (never seen, or dropped when
    /// full): full, but after the count fell (`grew`: when, and the
    /// capacity before) no fuller than that capacity then plus its refill
    /// since, so a replica leaving hands out nothing.
    pub fn absent(
        cap: u64,
        rate: f64,
        now: Micros,
        ramp_from: Micros,
        grew: Option<(Micros, u64)>,
    ) -> Self {
        let s = Share::fresh(cap, rate, now, ramp_from);
        match grew {
            Some((when, before)) if before < cap => {
                let level =
                    (before as f64 + rate * (now - when).max(0) as f64 / 1e6).min(cap as f64);
                s.with_level(level.min(s.level(now)), now)
            }
            _ => s,
        }
    }

    fn with_level(&self, level: f64, now: Micros) -> Self {
        Share {
            tat: now as f64 + (self.cap as f64 - level) * 1e6 / self.rate,
            at: now,
            ..*self
        }
    }

    /// Tokens held at `now` (fractional).
    pub fn level(&self, now: Micros) -> f64 {
        let t = 1e6 / self.rate;
        (self.cap as f64 - (self.tat - now as f64).max(0.0) / t).clamp(0.0, self.cap as f64)
    }

    /// Full: forgetting it loses nothing (an absent share is a full one).
    pub fn full(&self, now: Micros) -> bool {
        self.tat <= now as f64
    }

    /// The same share under new parameters: its level when last written,
    /// refilled since at the slower of the two rates (the count changed at
    /// some moment in between, unknown here), clamped to the new capacity.
    /// Shrinking adds nothing; growing hands out nothing.
    pub fn rescale(&self, cap: u64, rate: f64, now: Micros) -> Self {
        if cap == self.cap && rate == self.rate {
            return *self;
        }
        let then = self.level(self.at);
        let refill = rate.min(self.rate) * (now - self.at).max(0) as f64 / 1e6;
        let level = (then + refill).min(self.level(now)).min(cap as f64);
        Share {
            tat: now as f64 + (cap as f64 - level) * 1e6 / rate,
            cap,
            rate,
            at: now,
        }
    }

    /// A request of `cost` tokens: the decision, and the share after it
    /// when admitted.
    pub fn take(&self, cost: u64, now: Micros) -> (Evaluation, Option<Share>) {
        let e = gcra::token_bucket(self.cap, self.rate, Some(self.tat), now, cost);
        let next = match (&e.update, e.decision.allowed) {
            (Update::Gcra { tat }, true) => Some(Share {
                tat: *tat,
                at: now,
                ..*self
            }),
            _ => None,
        };
        (e, next)
    }

    /// `n` more tokens owed by a request already admitted (its answer cost
    /// more than it was admitted on): may go below empty.
    pub fn owe(&self, n: u64, now: Micros) -> Self {
        Share {
            tat: self.tat.max(now as f64) + n as f64 * 1e6 / self.rate,
            at: now.max(self.at),
            ..*self
        }
    }

    /// `cost` tokens a request took given back (another tier refused it,
    /// or it never reached the upstream): never past full.
    pub fn give_back(&self, cost: u64, now: Micros) -> Self {
        Share {
            tat: (self.tat - cost as f64 * 1e6 / self.rate).max(now as f64),
            at: now.max(self.at),
            ..*self
        }
    }
}

/// This replica's standing in the replica set, from its heartbeats:
/// whether it may use its shares, and among how many replicas.
#[derive(Debug, Clone, Default)]
pub struct Membership {
    /// The send time of the first heartbeat of this membership, and until
    /// when the last one answered keeps it counted (its send time plus the
    /// announcement's life: Redis expires it no sooner).
    joined: Option<(Micros, Micros)>,
    n: u32,
}

/// What a heartbeat's answer changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heard {
    /// The same membership: counted all along.
    Kept,
    /// A new one (the first, or after the last had lapsed): every share
    /// this replica held is forgotten, and starts empty at `ramp_from`.
    New { ramp_from: Micros },
}

impl Membership {
    /// A heartbeat sent at `sent` and answered at `answered` counted `n`
    /// live replicas; announcements live `ttl` and a joiner waits
    /// `join_wait` (at least `ttl`) before it uses a share.
    pub fn heard(
        &mut self,
        sent: Micros,
        answered: Micros,
        n: u32,
        ttl: Micros,
        join_wait: Micros,
    ) -> Heard {
        self.n = n.max(1);
        match self.joined {
            // Answered while the last announcement still lived: Redis
            // never dropped this replica in between.
            Some((since, until)) if answered < until => {
                self.joined = Some((since, until.max(sent + ttl)));
                Heard::Kept
            }
            // Counted from when Redis ran it (at the latest, its answer):
            // every other replica has heard it or stopped an announcement's
            // life after that.
            _ => {
                self.joined = Some((answered, sent + ttl));
                Heard::New {
                    ramp_from: answered + join_wait,
                }
            }
        }
    }

    /// The replica count to cut shares by at `now`, when this replica may
    /// use them: joined at least `join_wait` ago, and still counted (or
    /// cut off from Redis, `frozen`: see `limiter::standing`).
    pub fn usable(&self, now: Micros, join_wait: Micros, frozen: bool) -> Option<u32> {
        let (since, until) = self.joined?;
        (now >= since + join_wait && (now < until || frozen)).then_some(self.n)
    }

    /// Since when this membership counts, and until when its last answered
    /// heartbeat keeps it counted; None when there is none.
    pub fn window(&self) -> Option<(Micros, Micros)> {
        self.joined
    }

    /// Forgets the membership (a replica that stops).
    pub fn leave(&mut self) {
        self.joined = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Micros = 1_000_000;

    fn tb(capacity: u64, refill_per_sec: f64) -> Algorithm {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        }
    }

    #[test]
    fn cut_adds_up_to_the_bucket() {
        for (c, f, n) in [
            (100u64, 0.25, 3u32),
            (1000, 0.5, 5),
            (64, 0.25, 16),
            (1_000_000, 0.1, 7),
        ] {
            let Some(Algorithm::TokenBucket {
                capacity: pc,
                refill_per_sec: pr,
            }) = pool(&tb(c, 50.0), f)
            else {
                panic!("{c} {f}: not cut")
            };
            let (sc, sr) = share(&tb(c, 50.0), f, n).expect("share");
            assert!(pc + n as u64 * sc <= c, "{c} {f} {n}: {pc} + {n} x {sc}");
            assert!(
                pr + n as f64 * sr <= 50.0 * (1.0 + 1e-12),
                "{c} {f} {n}: {pr} + {n} x {sr}"
            );
        }
    }

    #[test]
    fn small_buckets_and_other_rules_are_not_cut() {
        assert_eq!(pool(&tb(63, 10.0), 0.25), None);
        assert!(pool(&tb(64, 10.0), 0.25).is_some());
        assert_eq!(
            share(&tb(64, 10.0), 0.25, 17),
            None,
            "a share under a token"
        );
        let fw = Algorithm::FixedWindow {
            limit: 1000,
            window_secs: 1,
        };
        assert_eq!(pool(&fw, 0.25), None);
        assert_eq!(pool(&tb(1000, 10.0), 0.0), None);
        assert_eq!(pool(&tb(1000, 10.0), 1.0), None);
    }

    #[test]
    fn a_fresh_share_fills_from_its_ramp() {
        let s = Share::fresh(10, 5.0, 100 * S, 100 * S);
        assert_eq!(s.level(100 * S), 0.0);
        assert!((s.level(101 * S) - 5.0).abs() < 1e-9);
        assert_eq!(s.level(102 * S), 10.0);
        let later = Share::fresh(10, 5.0, 200 * S, 100 * S);
        assert!(later.full(200 * S));
    }

    #[test]
    fn rescaling_keeps_the_level_clamped() {
        let now = 10 * S;
        let s = Share {
            tat: now as f64,
            cap: 30,
            rate: 10.0,
            at: now,
        }; // full: 30
        let smaller = s.rescale(20, 7.5, now);
        assert!((smaller.level(now) - 20.0).abs() < 1e-9);
        let bigger = smaller.rescale(40, 15.0, now);
        assert!(
            (bigger.level(now) - 20.0).abs() < 1e-9,
            "a replica leaving hands out nothing"
        );
        assert!((bigger.level(now + S) - 35.0).abs() < 1e-6);
    }

    /// A share spent to nothing, then left untouched while a replica joined
    /// (n 3 -> 4 for a bucket of 1000 at 5/s cut by half): 150 s later it
    /// has refilled at the new, slower rate, not the old one (125, where
    /// the sum over replicas would pass the bound by 89: the review's case).
    #[test]
    fn an_untouched_share_refills_at_the_slower_rate_across_a_join() {
        let alg = tb(1000, 5.0);
        let (cap3, rate3) = share(&alg, 0.5, 3).expect("share");
        let (cap4, rate4) = share(&alg, 0.5, 4).expect("share");
        let t0 = 1000 * S;
        let spent = Share {
            tat: t0 as f64 + cap3 as f64 * 1e6 / rate3,
            cap: cap3,
            rate: rate3,
            at: t0,
        };
        assert!(spent.level(t0) < 1e-9);
        let later = spent.rescale(cap4, rate4, t0 + 150 * S);
        assert!(
            later.level(t0 + 150 * S) <= rate4 * 150.0 + 1e-6,
            "{} over 150 s at {rate4}/s",
            later.level(t0 + 150 * S)
        );
    }

    /// After a replica left (n 4 -> 3), a share this replica held no entry
    /// for is no fuller than the old share then plus the new rate's refill
    /// since: the leaver's unspent tokens are not handed out.
    #[test]
    fn an_absent_share_after_a_leave_is_no_fuller_than_before_it() {
        let alg = tb(1000, 5.0);
        let (cap4, _) = share(&alg, 0.5, 4).expect("share");
        let (cap3, rate3) = share(&alg, 0.5, 3).expect("share");
        let t = 1000 * S;
        let s = Share::absent(cap3, rate3, t + S, 0, Some((t, cap4)));
        assert!(
            (s.level(t + S) - (cap4 as f64 + rate3)).abs() < 1e-6,
            "{}",
            s.level(t + S)
        );
        let long_after = Share::absent(cap3, rate3, t + 1000 * S, 0, Some((t, cap4)));
        assert!(long_after.full(t + 1000 * S));
        assert!(Share::absent(cap3, rate3, t, 0, None).full(t));
    }

    #[test]
    fn take_and_give_back() {
        let now = 10 * S;
        let mut s = Share {
            tat: now as f64,
            cap: 3,
            rate: 1.0,
            at: now,
        };
        for i in 0..3 {
            let (e, next) = s.take(1, now);
            assert!(e.decision.allowed, "request {i}");
            s = next.unwrap();
        }
        let (e, next) = s.take(1, now);
        assert!(!e.decision.allowed && next.is_none());
        assert_eq!(e.decision.retry_after_us, S as u64);
        s = s.give_back(1, now);
        assert!((s.level(now) - 1.0).abs() < 1e-9);
        assert!(s.give_back(10, now).full(now), "never past full");
    }

    #[test]
    fn membership_waits_then_lapses() {
        let (ttl, wait) = (3 * S, 3 * S + S / 10);
        let mut m = Membership::default();
        assert_eq!(
            m.heard(0, 1000, 3, ttl, wait),
            Heard::New {
                ramp_from: 1000 + wait
            }
        );
        assert_eq!(m.usable(S, wait, false), None, "joining");
        assert_eq!(m.heard(S, S + 1000, 3, ttl, wait), Heard::Kept);
        assert_eq!(m.usable(wait + 1000, wait, false), Some(3));
        assert_eq!(m.heard(2 * S, 2 * S + 1000, 4, ttl, wait), Heard::Kept);
        assert_eq!(m.usable(4 * S, wait, false), Some(4));
        // No answer for a whole life: not counted any more.
        assert_eq!(m.usable(5 * S, wait, false), None);
        assert_eq!(m.usable(5 * S, wait, true), Some(4), "cut off: frozen");
        assert_eq!(
            m.heard(6 * S, 6 * S + 10, 4, ttl, wait),
            Heard::New {
                ramp_from: 6 * S + 10 + wait
            }
        );
        // An answer that came back after the last announcement expired:
        // Redis may have dropped it meanwhile.
        let mut m = Membership::default();
        m.heard(0, 10, 2, ttl, wait);
        assert!(matches!(m.heard(S, 3 * S, 2, ttl, wait), Heard::New { .. }));
    }

    /// The whole scheme over simulated replicas that join, leave, lose
    /// touch with Redis and come back, under random traffic: over every
    /// interval the pool and the shares together admit at most capacity +
    /// rate × its length. (With more live replicas than `instances`, a
    /// replica cut off from Redis has no slot kept: the bound is held with
    /// cut-offs only up to `instances` replicas, as docs/design/standing-shares.md says.)
    #[test]
    fn pool_and_shares_never_pass_the_bound_as_replicas_come_and_go() {
        const MS: Micros = 1000;
        let (ttl, wait, instances) = (3 * S, 3 * S + 100 * MS, 3u32);
        for seed in 0..64u64 {
            // A bucket full again in 2 s, and one in 200 s: a joiner that
            // started its shares full would pass the second's bound.
            let (capacity, rate, fraction) = match seed % 4 {
                0 | 1 => (100u64, 50.0, 0.25),
                _ => (1000, 5.0, 0.5),
            };
            let alg = tb(capacity, rate);
            let Some(Algorithm::TokenBucket {
                capacity: pool_cap,
                refill_per_sec: pool_rate,
            }) = pool(&alg, fraction)
            else {
                panic!("cut")
            };
            let mut rng = fastrand::Rng::with_seed(seed);
            // Scale-out past `instances` in half the runs, cut-offs in the rest.
            let (most, cutoffs) = if seed % 2 == 0 { (6, false) } else { (3, true) };
            struct Replica {
                m: Membership,
                ramp: Micros,
                share: Option<Share>,
                up: bool,
                cut: bool,
                next_beat: Micros,
                busy: f64,
                /// Quiet for a while: its share untouched as the count changes.
                quiet: bool,
                /// The count it last cut by, and when it fell (the largest before).
                n: u32,
                grew: Option<(Micros, u32)>,
            }
            let mut reps: Vec<Replica> = Vec::new();
            // The replica set: (replica, expires at).
            let mut set: Vec<(usize, Micros)> = Vec::new();
            let mut pool_tat: Option<f64> = None;
            let mut admitted: Vec<Micros> = Vec::new();
            let (mut on_shares, mut on_pool) = (0u64, 0u64);
            let mut now: Micros = 1_700_000_000 * S;
            let end = now + 120 * S;
            while now < end {
                // Membership changes, now and then.
                if rng.f64() < 0.0004 {
                    let live = reps.iter().filter(|r| r.up).count();
                    if live < most && (live == 0 || rng.bool()) {
                        reps.push(Replica {
                            m: Membership::default(),
                            ramp: 0,
                            share: None,
                            up: true,
                            cut: false,
                            next_beat: now,
                            busy: rng.f64(),
                            quiet: false,
                            n: 0,
                            grew: None,
                        });
                    } else if let Some(r) = reps
                        .iter_mut()
                        .filter(|r| r.up)
                        .nth(rng.usize(..live.max(1)))
                    {
                        if cutoffs && rng.bool() {
                            r.cut = !r.cut;
                        } else {
                            r.up = false;
                            r.m.leave();
                        }
                    }
                }
                for (i, r) in reps.iter_mut().enumerate() {
                    if !r.up {
                        continue;
                    }
                    if now >= r.next_beat {
                        r.next_beat = now + S;
                        if !r.cut {
                            let d = rng.i64(0..5 * MS);
                            let exec = now + d;
                            set.retain(|&(j, until)| until > exec && j != i);
                            set.push((i, exec + ttl));
                            let n = set.len() as u32;
                            if let Heard::New { ramp_from } = r.m.heard(now, exec + d, n, ttl, wait)
                            {
                                r.ramp = ramp_from;
                                r.share = None;
                            }
                            let n = n.max(instances);
                            if n < r.n {
                                r.grew = Some((now, r.grew.map_or(r.n, |g| g.1.max(r.n))));
                            }
                            r.n = n;
                        }
                    }
                    // A full share may be dropped (the table's sweep).
                    if r.share.is_some_and(|s| s.full(now)) && rng.f64() < 0.01 {
                        r.share = None;
                    }
                    if rng.f64() < 0.00005 {
                        r.quiet = !r.quiet;
                    }
                    if r.quiet || rng.f64() >= r.busy * 0.5 {
                        continue;
                    }
                    let cut_share =
                        r.m.usable(now, wait, r.cut)
                            .and_then(|n| share(&alg, fraction, n.max(instances)));
                    if let Some((cap, srate)) = cut_share {
                        let grew = r.grew.and_then(|(when, before)| {
                            share(&alg, fraction, before).map(|s| (when, s.0))
                        });
                        let s = match r.share {
                            Some(s) => s.rescale(cap, srate, now),
                            None => Share::absent(cap, srate, now, r.ramp, grew),
                        };
                        if let (_, Some(next)) = s.take(1, now) {
                            r.share = Some(next);
                            admitted.push(now);
                            on_shares += 1;
                            continue;
                        }
                        r.share = Some(s);
                    }
                    if r.cut {
                        continue; // the fallback is another story
                    }
                    let e = gcra::token_bucket(pool_cap, pool_rate, pool_tat, now, 1);
                    if let Update::Gcra { tat } = e.update {
                        if e.decision.allowed {
                            pool_tat = Some(tat);
                            admitted.push(now);
                            on_pool += 1;
                        }
                    }
                }
                now += MS;
            }
            // Over every interval [t_i, t_j]: j - i + 1 <= C + r (t_j - t_i).
            let (mut low, mut worst) = (f64::MAX, f64::MIN);
            for (j, &t) in admitted.iter().enumerate() {
                let f = j as f64 - rate * t as f64 / 1e6;
                low = low.min(f);
                worst = worst.max(f - low + 1.0 - capacity as f64);
            }
            assert!(
                worst <= 1e-6,
                "seed {seed}: an interval saw {worst:.3} over the bound ({on_shares} on shares, {on_pool} on the pool)"
            );
            assert!(
                on_shares > 0 && on_pool > 0,
                "seed {seed}: {on_shares} on shares, {on_pool} on the pool"
            );
        }
    }
}
