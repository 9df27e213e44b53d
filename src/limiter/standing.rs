//! This replica's standing shares (`[limiter.shares]`): the part of every
//! big token bucket it owns without asking Redis (`algorithms::standing`
//! has the rules and why they are exact).
//!
//! - A request's tiers are tried on their shares first (`take`); a tier its
//!   share covers needs no call. The others go to Redis as before, a cut
//!   bucket's on its pool (`pool_check`): a share that cannot cover a
//!   request means "ask the pool", never "reject". An operator's inspection
//!   reads the pools of a request's buckets (`pool_view`).
//! - Shares are used only while this replica is counted in the replica set
//!   (`heard`, from the heartbeats) and has been for an announcement's life.
//!   Cut off from Redis, it keeps the count it last heard (`frozen`): the
//!   others keep its slot while they count at least `limiter.instances`.
//!   Rejoining it drops every share (others may have grown into them).
//! - A request refused elsewhere, or never sent upstream, gives its tokens
//!   back to its shares (`give_back`); a reset forgets them (`forget`);
//!   `level` tells an inspection what a share holds now.
//! - Entries are bounded by `local_max_entries`; only full shares are
//!   dropped (an absent share is a full one; a full shard looks for them
//!   at most once a second), so a full table sends new buckets to the pool
//!   rather than forget what a share spent.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;

use super::algorithms::standing::{pool, share, Heard, Membership, Share};
use super::pulls::{Pull, Pulls, Wanting};
use super::{Check, Decision, Micros, Tier};
use crate::clock::{Clock, SystemClock};
use crate::config::{Algorithm, SharesSettings};
use crate::shard_map::{Room, ShardMap, StillFull};

const SHARDS: usize = 16;

/// A full shard is swept for full shares at most this often.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Past an announcement's life, for clocks that run at slightly different
/// rates over a few seconds.
const JOIN_MARGIN: Duration = Duration::from_millis(100);

pub struct Standing {
    /// `[limiter.shares]`: which buckets are cut, and by how much.
    settings: SharesSettings,
    /// Shares are cut for at least this many replicas (`limiter.instances`).
    instances: u32,
    /// Monotonic time origin for the membership's clock.
    base: Instant,
    ttl: Duration,
    join_wait: Duration,
    /// The membership, when this membership's shares began to fill, and
    /// the last time the count fell (with the largest count before it):
    /// shares this replica holds no entry for are no fuller than then.
    /// Times are µs since `base`: shares never read the wall clock, which
    /// a step forward would refill.
    membership: Mutex<Members>,
    /// What a request reads of the membership, published whole by each
    /// heartbeat: the request path takes no lock shared by every request.
    view: ArcSwapOption<View>,
    /// The shares held; each shard's own state is the membership its
    /// shares belong to (`Members::generation`): a request that read an
    /// older one (a rejoin cleared the table meanwhile) inserts nothing.
    shares: ShardMap<Box<str>, Share, std::hash::RandomState, u64>,
    /// Shares that could not cover a request lately, topped up from their
    /// pools each round (`pulls`).
    wanting: Wanting,
}

/// The membership as a request reads it (µs since `base`).
#[derive(Debug, Clone, Copy)]
struct View {
    /// Shares are usable from `from` and, unless frozen, before `until`.
    from: Micros,
    until: Micros,
    n: u32,
    ramp_from: Micros,
    grew: Option<(Micros, u32)>,
    generation: u64,
    /// The wall clock minus the membership's clock when the view was
    /// published: a request reads one clock, not two.
    wall_offset: Micros,
}

#[derive(Default)]
struct Members {
    m: Membership,
    ramp_from: Micros,
    /// The count shares were last cut by, and (when it fell, the largest
    /// count before).
    n: u32,
    grew: Option<(Micros, u32)>,
    /// Bumped by each new membership (every share dropped).
    generation: u64,
}

/// How shares are cut at one moment (`now`, µs since `base`).
struct Cut {
    n: u32,
    ramp_from: Micros,
    grew: Option<(Micros, u32)>,
    now: Micros,
    generation: u64,
    wall_offset: Micros,
}

/// What a request took from its shares.
#[derive(Debug)]
pub struct Taken {
    /// Per tier: its decision when its share covered it.
    pub decisions: Vec<Option<Decision>>,
    pub now_us: Micros,
    /// The membership the shares belong to: a give-back after a rejoin
    /// (which empties every share) gives nothing to the new ones.
    pub generation: u64,
}

impl Taken {
    pub fn any(&self) -> bool {
        self.decisions.iter().any(Option::is_some)
    }
}

/// Whether `shares` cut this check's bucket into a pool and shares among
/// `n` replicas: a big token bucket (with only `charged`, one counting
/// charged units), not a quota, a global limit's sub-bucket or a shadow,
/// whose requests' cost fits in the pool. A cost the pool cannot hold (nor,
/// then, any share) would never be admitted once the bucket is cut: such a
/// bucket is decided whole, as without shares.
///
/// A charged bucket is cut by what its route allows, never by one
/// request's estimate, so every request of it decides it the same way: cut
/// while a share holds the route's largest request (`Check::most`), whole
/// otherwise (shares that no request fits would leave their part of the
/// limit unused). Cut, a request takes at most the pool's capacity
/// (`pool_check`); the rest is settled as a debt.
pub fn cuts(c: &Check, shares: &SharesSettings, n: u32) -> bool {
    let fits = |capacity: u64| match c.charged {
        true => share(&c.algorithm, shares.fraction, n).is_some_and(|(cap, _)| cap >= c.most),
        false => c.cost <= capacity,
    };
    (shares.enabled || (shares.charged && c.charged))
        && !c.shadow
        && c.shards == 1
        && c.tier != Tier::Quota
        && matches!(pool(&c.algorithm, shares.fraction), Some(Algorithm::TokenBucket { capacity, .. }) if fits(capacity))
}

/// The check as Redis decides it among `n` replicas: a cut bucket's pool
/// (same key).
pub fn pool_check(c: &Check, shares: &SharesSettings, n: u32) -> Check {
    match cuts(c, shares, n)
        .then(|| pool(&c.algorithm, shares.fraction))
        .flatten()
    {
        Some(algorithm) => Check {
            algorithm,
            pool: true,
            cost: c.cost.min(super::algorithms::quota(&algorithm).max(1)),
            charged: false,
            ..c.clone()
        },
        None => c.clone(),
    }
}

impl Standing {
    /// `ttl`: how long a heartbeat's announcement lives in Redis.
    pub fn new(
        settings: SharesSettings,
        instances: u32,
        max_entries: usize,
        ttl: Duration,
    ) -> Self {
        Standing {
            settings,
            instances: instances.max(1),
            base: Instant::now(),
            ttl,
            join_wait: ttl + JOIN_MARGIN,
            membership: Mutex::new(Members::default()),
            view: ArcSwapOption::empty(),
            shares: ShardMap::new(SHARDS, max_entries),
            wanting: Wanting::default(),
        }
    }

    /// Publishes what requests read of the membership (under its lock).
    fn publish(&self, m: &Members) {
        let view = m.m.window().map(|(since, until)| {
            let now = Instant::now();
            View {
                from: since + self.join_wait.as_micros() as Micros,
                until,
                n: m.n,
                ramp_from: m.ramp_from,
                grew: m.grew,
                generation: m.generation,
                wall_offset: SystemClock.now_us() - self.mono(now),
            }
        });
        self.view.store(view.map(Arc::new));
    }

    fn mono(&self, t: Instant) -> Micros {
        t.saturating_duration_since(self.base).as_micros() as Micros
    }

    /// Whether this check's bucket is cut into a pool and shares.
    pub fn cuts(&self, c: &Check) -> bool {
        cuts(c, &self.settings, self.replicas_for(c))
    }

    /// The replicas shares are cut for now, as `cuts` needs them for `c`:
    /// the membership's count (never fewer than `limiter.instances`) for a
    /// charged bucket, whose cut depends on it; no read of the membership
    /// for any other (on every request's path).
    fn replicas_for(&self, c: &Check) -> u32 {
        match c.charged {
            true => self
                .view
                .load()
                .as_deref()
                .map_or(self.instances, |v| v.n.max(self.instances)),
            false => self.instances,
        }
    }

    /// The checks as Redis decides them: a cut bucket's pool in its place
    /// (same key). None when no tier is cut.
    pub fn pool_view(&self, checks: &[Check]) -> Option<Arc<[Check]>> {
        if !checks.iter().any(|c| self.cuts(c)) {
            return None;
        }
        Some(checks.iter().map(|c| self.pool_check(c)).collect())
    }

    pub fn pool_check(&self, c: &Check) -> Check {
        pool_check(c, &self.settings, self.replicas_for(c))
    }

    /// A heartbeat sent at `sent` and answered at `answered` counted
    /// `count` live replicas.
    pub fn heard(&self, sent: Instant, answered: Instant, count: u32) {
        let (ttl, wait) = (
            self.ttl.as_micros() as Micros,
            self.join_wait.as_micros() as Micros,
        );
        let mut m = self.membership.lock();
        let heard =
            m.m.heard(self.mono(sent), self.mono(answered), count, ttl, wait);
        let n = count.max(self.instances);
        if n < m.n {
            let before = m.grew.map_or(m.n, |(_, b)| b.max(m.n));
            m.grew = Some((self.mono(Instant::now()), before));
        }
        m.n = n;
        if let Heard::New { ramp_from } = heard {
            m.ramp_from = ramp_from;
            m.generation += 1;
            let generation = m.generation;
            // Others may have grown into what these shares held. Emptied
            // before the new membership is published: a request that reads
            // it finds its shard already of that generation.
            for mut s in self.shares.lock_each() {
                s.clear();
                *s.meta_mut() = generation;
            }
            tracing::info!(replicas = count, "limiter: standing shares rejoin the replica set; they fill from empty once it has counted this replica");
        }
        self.publish(&m);
    }

    /// A replica that stops uses no share again.
    pub fn leave(&self) {
        let mut m = self.membership.lock();
        m.m.leave();
        self.publish(&m);
    }

    /// How shares are cut now, if this replica may use them: one read of
    /// the published membership and one of the clock.
    fn usable(&self, frozen: bool) -> Option<Cut> {
        let guard = self.view.load();
        let v = guard.as_deref()?;
        let now = self.mono(Instant::now());
        let usable = now >= v.from && (now < v.until || frozen);
        usable.then_some(Cut {
            n: v.n.max(self.instances),
            ramp_from: v.ramp_from,
            grew: v.grew,
            now,
            generation: v.generation,
            wall_offset: v.wall_offset,
        })
    }

    /// A share as it stands now under `cut`: the one held, rescaled, or
    /// one this replica holds no entry for.
    fn current(&self, held: Option<Share>, c: &Check, cap: u64, rate: f64, cut: &Cut) -> Share {
        if let Some(s) = held {
            return s.rescale(cap, rate, cut.now);
        }
        let grew = cut.grew.and_then(|(when, before)| {
            share(&c.algorithm, self.settings.fraction, before).map(|(cap, _)| (when, cap))
        });
        Share::absent(cap, rate, cut.now, cut.ramp_from, grew)
    }

    pub fn is_usable(&self, frozen: bool) -> bool {
        self.usable(frozen).is_some()
    }

    /// Tries each cut tier on its share. `frozen`: Redis is out of reach
    /// (the breaker is open).
    pub fn take(&self, checks: &[Check], frozen: bool) -> Option<Taken> {
        // A request's tiers are a bit mask in its outcome.
        if checks.len() >= 64 {
            return None;
        }
        let cut = self.usable(frozen)?;
        let mut decisions = Vec::with_capacity(checks.len());
        for c in checks {
            let d = if self.cuts(c) {
                let d = self.take_one(c, &cut);
                if d.is_none() && !frozen {
                    self.wanting.missed(c);
                }
                d
            } else {
                None
            };
            decisions.push(d);
        }
        let taken = Taken {
            decisions,
            now_us: cut.now + cut.wall_offset,
            generation: cut.generation,
        };
        taken.any().then_some(taken)
    }

    fn take_one(&self, c: &Check, cut: &Cut) -> Option<Decision> {
        let (cap, rate) = share(&c.algorithm, self.settings.fraction, cut.n)?;
        let now = cut.now;
        let key = c.key.as_str();
        let mut shard = self.shares.lock(key);
        if *shard.meta() != cut.generation {
            return None;
        }
        let decided = |e: super::algorithms::Evaluation| Decision {
            limit: super::algorithms::quota(&c.algorithm),
            ..e.decision
        };
        // A share held is taken from in place (no new key).
        if let Some(held) = shard.get_mut(key) {
            let (e, next) = held.rescale(cap, rate, now).take(c.cost, now);
            *held = next?;
            return Some(decided(e));
        }
        // Only full shares make room (an absent share is a full one), at
        // most once per `SWEEP_EVERY` in a shard; else the tier goes to
        // the pool.
        let full = |s: &Share| s.full(now);
        let room = Room::Sweep {
            stale: &full,
            every: SWEEP_EVERY,
            then: StillFull::Refuse,
        };
        if !shard.make_room(&room) {
            return None;
        }
        let (e, next) = self.current(None, c, cap, rate, cut).take(c.cost, now);
        shard.force_insert(key.into(), next?);
        Some(decided(e))
    }

    /// Tokens the covered tiers took, given back (the request was refused
    /// elsewhere, or never reached the upstream).
    pub fn give_back(&self, checks: &[Check], taken: &Taken) {
        for (c, d) in checks.iter().zip(&taken.decisions) {
            if d.is_some_and(|d| d.allowed) {
                self.give_back_one(c, taken.generation);
            }
        }
    }

    /// `c`'s tokens back to its share, if the share is still of the
    /// membership (`generation`) they were taken in: a rejoin since has
    /// emptied it, and the new share owes them nothing.
    pub fn give_back_one(&self, c: &Check, generation: u64) {
        self.credit(c, c.cost, generation);
    }

    /// This round's top-ups (`pulls`): each share that missed tokens since
    /// the last round, filled to full; and the membership they are for.
    /// None while the shares are not usable.
    pub fn pulls(&self) -> Option<Pulls> {
        let cut = self.usable(false)?;
        let due = self.wanting.due(Instant::now());
        let pulls = due.into_iter().filter_map(|c| self.pull(c, &cut)).collect();
        Some(Pulls {
            pulls,
            generation: cut.generation,
        })
    }

    /// The top-ups a call deciding `requests` carries: one for each pool
    /// they ask whose share missed (and whose pool is not drained).
    pub fn top_ups(&self, requests: &[&[Check]]) -> Option<Pulls> {
        let mut pools = requests.iter().flat_map(|r| r.iter()).filter(|c| c.pool);
        let first = pools.next()?;
        let cut = self.usable(false)?;
        let now = Instant::now();
        let mut pulls: Vec<Pull> = Vec::new();
        for p in std::iter::once(first).chain(pools) {
            if pulls.iter().any(|q| q.pool.key == p.key) {
                continue;
            }
            if let Some(pull) = self
                .wanting
                .take(&p.key, now)
                .and_then(|c| self.pull(c, &cut))
            {
                pulls.push(pull);
            }
        }
        (!pulls.is_empty()).then_some(Pulls {
            pulls,
            generation: cut.generation,
        })
    }

    /// `c`'s share filled whole: a share that ran dry will again (and a
    /// pool that cannot give it all is drained).
    fn pull(&self, c: Check, cut: &Cut) -> Option<Pull> {
        let (level, cap) = self.level_under(&c, cut)?;
        let want = (cap as f64 - level).floor() as u64;
        (want > 0).then(|| Pull {
            pool: self.pool_check(&c),
            check: c,
            want,
        })
    }

    /// A drained pool is not asked again before `until` (its next token).
    pub fn hold_off(&self, c: &Check, until: Instant) {
        self.wanting.hold_off(c, until);
    }

    /// Tokens a pool gave for `c`'s share, into it (never past full), if
    /// the share is still of the membership (`generation`) they were asked
    /// for: a rejoin since has emptied it, and they are lost (never more).
    /// A share this replica holds no entry for (one still filling after a
    /// join, never taken from) is entered, with the tokens, if there is
    /// room: else they are lost.
    pub fn credit(&self, c: &Check, tokens: u64, generation: u64) {
        self.adjust(c, generation, |s, now| s.give_back(tokens, now));
    }

    /// `tokens` more owed by a request `c`'s share admitted (its answer
    /// cost more than its estimate): the share may go below empty.
    pub fn owe(&self, c: &Check, tokens: u64, generation: u64) {
        self.adjust(c, generation, |s, now| s.owe(tokens, now));
    }

    fn adjust(&self, c: &Check, generation: u64, change: impl Fn(&Share, Micros) -> Share) {
        let now = self.mono(Instant::now());
        let key = c.key.as_str();
        let mut shard = self.shares.lock(key);
        if *shard.meta() != generation {
            return;
        }
        if let Some(s) = shard.get_mut(key) {
            *s = change(s, now);
            return;
        }
        // Frozen or not: the tokens are here either way.
        let Some(cut) = self.usable(true) else {
            return;
        };
        let Some((cap, rate)) = share(&c.algorithm, self.settings.fraction, cut.n) else {
            return;
        };
        let credited = change(&self.current(None, c, cap, rate, &cut), now);
        let full = |s: &Share| s.full(now);
        let room = Room::Sweep {
            stale: &full,
            every: SWEEP_EVERY,
            then: StillFull::Refuse,
        };
        if !credited.full(now) && shard.make_room(&room) {
            shard.force_insert(key.into(), credited);
        }
    }

    /// Buckets reset by an operator: their shares are whole again.
    pub fn forget(&self, keys: &[&str]) -> usize {
        keys.iter()
            .filter(|k| self.shares.lock(**k).remove(**k).is_some())
            .count()
    }

    /// This replica's share of a cut bucket now: (tokens, capacity), if it
    /// may use it.
    pub fn level(&self, c: &Check, frozen: bool) -> Option<(u64, u64)> {
        if !self.cuts(c) {
            return None;
        }
        let cut = self.usable(frozen)?;
        let (level, cap) = self.level_under(c, &cut)?;
        Some((level.floor() as u64, cap))
    }

    /// `c`'s share under `cut`: its tokens (fractional) and capacity. An
    /// absent share is a full one.
    fn level_under(&self, c: &Check, cut: &Cut) -> Option<(f64, u64)> {
        let (cap, rate) = share(&c.algorithm, self.settings.fraction, cut.n)?;
        let key = c.key.as_str();
        let held = self.shares.lock(key).get(key).copied();
        Some((self.current(held, c, cap, rate, cut).level(cut.now), cap))
    }

    pub fn len(&self) -> usize {
        self.shares.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;

    fn check(key: String, capacity: u64, refill_per_sec: f64) -> Check {
        Check {
            tier: Tier::Ip,
            key,
            algorithm: Algorithm::TokenBucket {
                capacity,
                refill_per_sec,
            },
            shadow: false,
            cost: 1,
            shards: 1,
            pool: false,
            charged: false,
            most: 0,
        }
    }

    /// A standing replica of one, its shares usable (past the join wait,
    /// polled: the membership's clock is the process's own).
    fn usable(max_entries: usize) -> Standing {
        // Announcements of a second, heard continuously: usable 1.1 s in.
        let s = Standing::new(ON, 1, max_entries, Duration::from_secs(1));
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let t = Instant::now();
            s.heard(t, t, 1);
            if s.is_usable(false) {
                return s;
            }
            assert!(t < deadline, "usable after the join wait");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A million clients through a table of a thousand: it never holds
    /// more; a share that is not full is never dropped to make room (its
    /// client goes to the pool instead).
    #[test]
    fn the_table_stays_within_its_bound() {
        let s = usable(1000);
        // Shares fill from empty at 250/s: a token each within 4 ms, and
        // none full again within the test.
        let probe = check("rl:ip:x:probe".into(), 1_000_000, 1000.0);
        let deadline = Instant::now() + Duration::from_secs(5);
        while s.level(&probe, false).is_none_or(|l| l.0 < 2) {
            assert!(Instant::now() < deadline, "shares fill");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut covered = 0;
        for i in 0..1_000_000u32 {
            let c = check(format!("rl:ip:x:{i}"), 1_000_000, 1000.0);
            if s.take(std::slice::from_ref(&c), false).is_some() {
                covered += 1;
            }
            assert!(s.len() <= 1000, "entries {} at client {i}", s.len());
        }
        assert!(
            covered >= 900,
            "the first thousand or so were covered: {covered}"
        );
        assert!(covered <= 1000, "then none: {covered}");
    }

    /// Shares on for every big bucket, at a quarter.
    const ON: SharesSettings = SharesSettings {
        enabled: true,
        fraction: 0.25,
        charged: true,
    };

    /// A cost the pool cannot hold leaves the bucket whole (decided by
    /// Redis as without shares): cut, it could never be admitted.
    #[test]
    fn a_cost_the_pool_cannot_hold_is_not_cut() {
        // 100 cut by a quarter: a pool of 75.
        let mut c = check("rl:route:x".into(), 100, 10.0);
        for (cost, cut) in [(1, true), (75, true), (76, false), (200, false)] {
            c.cost = cost;
            assert_eq!(cuts(&c, &ON, 1), cut, "cost {cost}");
        }
        assert!(!pool_check(&c, &ON, 1).pool, "a bucket not cut is no pool");
        c.cost = 1;
        assert!(pool_check(&c, &ON, 1).pool);
    }

    /// With `charged` (on by default) and not `enabled`, a token bucket
    /// counting charged units is cut (it is never leased), and no other,
    /// while a share holds its route's largest request (`most`): whatever
    /// a request's estimate, so every request of the bucket decides it the
    /// same way; the pool takes at most its capacity (the rest is settled
    /// as a debt). Shares no request fits in would leave their part unused.
    #[test]
    fn a_charged_bucket_is_cut_while_a_share_holds_its_largest_request() {
        let charged_only = SharesSettings::default();
        assert!(charged_only.charged && !charged_only.enabled);
        // 1,000 cut by a quarter: a pool of 750, shares of 250 / n.
        let mut c = check("rl:route:x".into(), 1000, 10.0);
        assert!(!cuts(&c, &charged_only, 1), "a request bucket is whole");
        c.charged = true;
        c.most = 250;
        for cost in [1, 250, 750, 1000] {
            c.cost = cost;
            assert!(cuts(&c, &charged_only, 1), "estimate {cost}");
            let pool = pool_check(&c, &charged_only, 1);
            assert!(pool.pool && !pool.charged);
            assert_eq!(pool.cost, cost.min(750), "estimate {cost}");
        }
        // Two replicas: shares of 125 hold no request of 250.
        assert!(!cuts(&c, &charged_only, 2));
        assert!(!pool_check(&c, &charged_only, 2).pool);
        c.most = 125;
        assert!(cuts(&c, &charged_only, 2));
        let off = SharesSettings {
            charged: false,
            ..charged_only
        };
        assert!(!cuts(&c, &off, 1), "charged = false: whole");
        c.shadow = true;
        assert!(!cuts(&c, &charged_only, 1), "a shadow tier is never cut");
    }

    /// A give-back that arrives after a rejoin (which emptied every share)
    /// gives nothing to the new, empty share.
    #[test]
    fn a_give_back_after_a_rejoin_gives_nothing() {
        let s = usable(100);
        let big = check("rl:ip:x:big".into(), 1_000_000, 1_000_000.0);
        let taken = s.take(std::slice::from_ref(&big), false).expect("covered");
        // The membership lapses and is heard again: a new generation.
        let t = Instant::now() + Duration::from_secs(10);
        s.heard(t, t, 1);
        assert!(s.is_empty(), "a rejoin drops every share");
        // The new membership's share of that bucket, empty.
        let now = s.mono(Instant::now());
        let empty = Share::fresh(250_000, 250_000.0, now, now + 10_000_000);
        s.shares
            .lock(big.key.as_str())
            .force_insert(big.key.as_str().into(), empty);
        s.give_back(std::slice::from_ref(&big), &taken);
        let held = s
            .shares
            .lock(big.key.as_str())
            .get(big.key.as_str())
            .copied();
        assert_eq!(held, Some(empty), "the old generation's token went nowhere");
    }

    /// A request sent to its pool because its share missed carries that
    /// share's top-up, once per miss, and none while the pool is drained.
    /// Just after the join its share is still filling and held nowhere: the
    /// top-up enters it (tokens pulled into nothing were lost).
    #[test]
    fn a_miss_carries_its_share_top_up() {
        let s = usable(100);
        // A share of 25 (a quarter, one replica) refilling 2.5/s.
        let c = check("rl:ip:x:head".into(), 100, 10.0);
        let one = std::slice::from_ref(&c);
        let mut covered = 0;
        while s.take(one, false).is_some() {
            covered += 1;
            assert!(covered <= 30, "a share of 25 runs dry");
        }
        let pool = s.pool_check(&c);
        let nothing: &[&[Check]] = &[one];
        assert!(s.top_ups(nothing).is_none(), "no pool asked, no top-up");
        let sent: &[&[Check]] = &[std::slice::from_ref(&pool), std::slice::from_ref(&pool)];
        let pulls = s.top_ups(sent).expect("the miss's top-up");
        assert_eq!(pulls.pulls.len(), 1, "one per bucket however many ask");
        let p = &pulls.pulls[0];
        assert!((24..=25).contains(&p.want), "filled whole: {}", p.want);
        assert_eq!((p.pool.key.as_str(), p.check.pool), (c.key.as_str(), false));
        assert!(s.top_ups(sent).is_none(), "asked once per miss");
        s.credit(&c, p.want, pulls.generation);
        assert!(s.take(one, false).is_some(), "the share serves again");
        // Dry again, its pool drained: no top-up until its next token.
        while s.take(one, false).is_some() {}
        s.hold_off(&c, Instant::now() + Duration::from_secs(60));
        assert!(s.top_ups(sent).is_none(), "a drained pool is not asked");
    }

    #[test]
    fn uncut_tiers_are_left_to_redis_and_a_refusal_gives_back() {
        let s = usable(100);
        let small = check("rl:ip:x:small".into(), 10, 1.0);
        assert!(s.take(std::slice::from_ref(&small), false).is_none());
        let big = check("rl:ip:x:big".into(), 1_000_000, 1_000_000.0);
        let taken = s
            .take(&[big.clone(), small.clone()], false)
            .expect("big covered");
        assert!(taken.decisions[0].is_some() && taken.decisions[1].is_none());
        let before = s.level(&big, false).expect("level").0;
        s.give_back(&[big.clone(), small], &taken);
        assert!(s.level(&big, false).expect("level").0 >= before);
        assert_eq!(s.forget(&["rl:ip:x:big"]), 1);
        assert!(s.is_empty());
    }
}
