//! This replica's leases: tokens Redis debited ahead for a hot bucket, spent
//! here with no round trip.
//!
//! - Every request that reaches the limiter notes its demand on each of its
//!   buckets (`spend`). A request whose tiers all hold enough leased tokens
//!   is admitted from them at once; if any tier is short it goes to Redis as
//!   before. An empty lease means "ask Redis", never "reject".
//! - The calls to Redis carry lease requests (`asks`): for a bucket of the
//!   call whose lease is at most a quarter of this replica's demand over the
//!   last period, what tops it up to that demand. `limiter.lua` grants the smaller of it and a fair
//!   share of what the bucket holds, debited as a request of that cost.
//!   When a request spends a lease that low, the bucket is queued for the
//!   next call and one is started if none would come (`renew`): a steady
//!   client never waits for Redis.
//! - A lease lives one period from when its call was sent (never past the
//!   end of the window it was counted in), so it expires here no later than
//!   on Redis's clock. Its unspent tokens go back with the next call that
//!   carries an ask for the bucket, or any call a period later; Redis takes
//!   them back only where that is exact (`algorithms::lease`), and tokens it
//!   refuses are lost: the shared limit under-admits by them, never
//!   over-admits.
//! - Entries are bounded by `local_max_entries`: a full table first drops
//!   entries idle for two periods, then takes no new bucket (it is decided by
//!   Redis, as without leases).

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::algorithms::lease::{leasable, Grant};
use super::algorithms::quota;
use super::{Check, Decision, Micros, Verdict};
use crate::config::Algorithm;
use crate::metrics::{self, LeaseEvent};

const SHARDS: usize = 16;

/// The smallest lease worth granting: a fair share smaller than this many
/// tokens grants nothing, so a bucket's last tokens are decided one request
/// at a time, by Redis.
pub const MIN_GRANT: u64 = 4;

/// A lease holding a quarter of a period's demand or less is renewed: a
/// quarter period is ample for a round trip, and the top-up to the whole
/// demand (`ask_for`) then lasts three quarters of the lease's life. (At a
/// tenth, renewals are a sixth fewer, but on a loaded machine a tenth of a
/// period was not always enough: 1.4 % of a hot client's requests found
/// their lease empty and went to Redis, against 0.3 % at a quarter, and
/// they cost Redis more than the renewals saved: BENCHMARKS.md.)
fn running_low(tokens: u64, demand: u64) -> bool {
    tokens <= demand / 4
}

/// A lease request for one bucket, sent with a call.
#[derive(Debug, Clone)]
pub struct Ask {
    /// The bucket (its key and rule).
    pub check: Check,
    /// Tokens asked for (0: only giving back).
    pub want: u64,
    /// Unspent tokens of an expired lease, given back.
    pub ret: u64,
    /// What that lease's grant answered (`Grant::until`).
    pub until: i64,
}

/// What a request took from this replica's leases (`Leases::spend`).
#[derive(Debug)]
pub struct Taken {
    /// Per tier: its decision when its lease covered it.
    pub decisions: Vec<Option<Decision>>,
    /// Per covered tier: the lease it was taken from.
    generations: Vec<u64>,
    /// A lease ran low and was queued for the next call (the caller makes
    /// sure one is sent).
    pub renew: bool,
}

impl Taken {
    /// Every tier is covered: the request is admitted here.
    pub fn all(&self) -> bool {
        !self.decisions.is_empty() && self.decisions.iter().all(Option::is_some)
    }

    pub fn any(&self) -> bool {
        self.decisions.iter().any(Option::is_some)
    }
}

/// What a call asks for: the leases, and how to size them.
#[derive(Debug, Clone, Default)]
pub struct Asks {
    pub asks: Vec<Ask>,
    /// The replicas sharing every limit (a grant is at most a share of what
    /// is left).
    pub replicas: u64,
    pub min: u64,
}

impl Asks {
    pub fn is_empty(&self) -> bool {
        self.asks.is_empty()
    }
}

struct Entry {
    algorithm: Algorithm,
    /// Leased and unspent.
    tokens: u64,
    /// The lease's end on this replica's clock.
    expires: Instant,
    /// What the lease's grant answered (`Grant::until`): a return names it.
    until: i64,
    /// Bumped when a lease replaces an expired one (or a reset cancels
    /// it): a request that took tokens and then had to give them back gives
    /// them only to the lease it took them from, or one merged into it.
    generation: u64,
    /// Tokens requests wanted in this period and in the previous one.
    demand: u64,
    demand_prev: u64,
    period_start: Instant,
    /// Requests seen (saturating): one is not a hot bucket.
    requests: u32,
    /// Redis's time in the call that granted the latest tokens.
    granted_us: Micros,
    /// A call carrying an ask for this bucket left then (cleared by its grant).
    asking: Option<Instant>,
    /// Queued for the next call (`renewals`).
    renew_queued: bool,
    /// What Redis held at its last answer (leases granted in that call
    /// already taken out: `debit`), for the headers of requests decided
    /// here: remaining, and when the bucket is whole again.
    redis_remaining: u64,
    reset_at: Instant,
    last_seen: Instant,
}

impl Entry {
    fn new(algorithm: Algorithm, now: Instant) -> Self {
        Entry {
            algorithm,
            tokens: 0,
            expires: now,
            until: 0,
            generation: 0,
            demand: 0,
            demand_prev: 0,
            period_start: now,
            requests: 0,
            granted_us: 0,
            asking: None,
            renew_queued: false,
            redis_remaining: 0,
            reset_at: now,
            last_seen: now,
        }
    }

    fn note_demand(&mut self, cost: u64, now: Instant, period: Duration) {
        let since = now.saturating_duration_since(self.period_start);
        if since >= period {
            self.demand_prev = if since < 2 * period { self.demand } else { 0 };
            self.demand = 0;
            self.period_start = now;
        }
        self.demand += cost;
        self.requests = self.requests.saturating_add(1);
        self.last_seen = now;
    }

    /// The lease this replica would like: its demand over a period, the
    /// current period's extrapolated from what has passed of it (at least
    /// a tenth of it), so a bucket that just became hot is seen at once.
    /// Demand is read as of `now`: a bucket no request has named for a
    /// period or two has none, however hot it was.
    fn want(&self, now: Instant, period: Duration) -> u64 {
        let since = now.saturating_duration_since(self.period_start);
        let (current, previous, passed) = if since >= 2 * period {
            (0, 0, since)
        } else if since >= period {
            (0, self.demand, since - period)
        } else {
            (self.demand, self.demand_prev, since)
        };
        // One request is not a hot bucket (however much it costs), nor is
        // one seen now and then (the long tail of a crowd of clients): a
        // lease for it would come back, or be lost, nearly whole.
        if self.requests < 2 || current + previous < MIN_GRANT {
            return 0;
        }
        let passed = passed.max(period / 10);
        let extrapolated = (current as f64 * period.as_secs_f64() / passed.as_secs_f64()) as u64;
        extrapolated.max(previous)
    }

    fn asked_recently(&self, now: Instant, period: Duration) -> bool {
        self.asking
            .is_some_and(|t| now.saturating_duration_since(t) < period)
    }

    /// A request admitted here, as its headers describe it: what Redis held
    /// at its last answer plus what this replica still holds of its lease
    /// (other replicas' spending since is not seen); a token bucket is whole
    /// again when Redis's TAT, less the unspent lease, is reached.
    fn decision(&self, now: Instant) -> Decision {
        let limit = quota(&self.algorithm);
        let mut reset = self.reset_at.saturating_duration_since(now).as_micros() as u64;
        if let Algorithm::TokenBucket { refill_per_sec, .. } = self.algorithm {
            reset = reset.saturating_sub((self.tokens as f64 * 1e6 / refill_per_sec) as u64);
        }
        Decision {
            allowed: true,
            limit,
            remaining: (self.redis_remaining + self.tokens).min(limit),
            retry_after_us: 0,
            reset_after_us: reset,
            delay_us: 0,
        }
    }
}

/// Takes the leases a call granted out of what its verdicts say each
/// bucket holds: Redis granted them after deciding the call's requests, so
/// a verdict's `remaining` (and a token bucket's time to full) is as it
/// stood before. What the fallback starts from (`Fallback::seed`) and what
/// later requests on a lease report must not count those tokens twice.
pub fn debit(requests: &[&[Check]], verdicts: &mut [Verdict], asks: &Asks, grants: &[Grant]) {
    for (a, g) in asks.asks.iter().zip(grants) {
        if g.tokens == 0 {
            continue;
        }
        let more_us = match a.check.algorithm {
            Algorithm::TokenBucket { refill_per_sec, .. } => {
                (g.tokens as f64 * 1e6 / refill_per_sec).ceil() as u64
            }
            _ => 0,
        };
        for (r, v) in requests.iter().zip(verdicts.iter_mut()) {
            for (c, d) in r.iter().zip(v.decisions.iter_mut()) {
                if c.key == a.check.key && d.allowed {
                    d.remaining = d.remaining.saturating_sub(g.tokens);
                    d.reset_after_us += more_us;
                }
            }
        }
    }
}

pub struct Leases {
    period: Duration,
    per_shard: usize,
    shards: Box<[Mutex<HashMap<String, Entry>>]>,
    /// Buckets whose lease ran low on a request decided here: asked for in
    /// the next call.
    renewals: Mutex<Vec<Check>>,
    /// Buckets holding a lease, and when they were last looked at for one
    /// that expired with tokens to give back.
    leased: Mutex<(HashMap<String, Check>, Option<Instant>)>,
    replicas: AtomicU32,
    hasher: std::collections::hash_map::RandomState,
}

impl Leases {
    pub fn new(period: Duration, max_entries: usize) -> Self {
        Leases {
            period,
            per_shard: max_entries.div_ceil(SHARDS).max(1),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            renewals: Mutex::new(Vec::new()),
            leased: Mutex::new((HashMap::new(), None)),
            replicas: AtomicU32::new(1),
            hasher: Default::default(),
        }
    }

    /// The replicas a grant is shared among.
    pub fn set_replicas(&self, n: u32) {
        self.replicas.store(n.max(1), Ordering::Relaxed);
    }

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, Entry>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Notes a request's demand on each bucket, and takes its cost from
    /// the leases that hold enough. When every tier is covered the request
    /// is admitted here (`Taken::all`); otherwise the other tiers go to
    /// Redis, and if the request is not admitted the tokens taken go back
    /// to their leases (`give_back`).
    pub fn spend(&self, checks: &[Check], now: Instant) -> Taken {
        let mut taken = Taken {
            decisions: vec![None; checks.len()],
            generations: vec![0; checks.len()],
            renew: false,
        };
        for (i, c) in checks.iter().enumerate() {
            if c.shadow || !leasable(&c.algorithm) {
                continue;
            }
            let mut shard = self.shard(&c.key).lock();
            let Some(e) = self.entry(&mut shard, c, now) else {
                continue;
            };
            e.note_demand(c.cost, now, self.period);
            if e.tokens < c.cost || now >= e.expires {
                continue;
            }
            e.tokens -= c.cost;
            taken.generations[i] = e.generation;
            taken.decisions[i] = Some(e.decision(now));
            if running_low(e.tokens, e.want(now, self.period))
                && !e.renew_queued
                && !e.asked_recently(now, self.period)
            {
                e.renew_queued = true;
                self.renewals.lock().push(c.clone());
                taken.renew = true;
            }
        }
        taken
    }

    /// The request was admitted: its leased tokens are spent.
    pub fn confirm(&self, checks: &[Check], taken: &Taken) {
        let spent = checks
            .iter()
            .zip(&taken.decisions)
            .filter(|(_, d)| d.is_some())
            .map(|(c, _)| c.cost)
            .sum();
        metrics::lease_tokens(LeaseEvent::Spent, spent);
    }

    /// The request was not admitted: the tokens it took go back to the
    /// leases they came from (not to a lease granted since).
    pub fn give_back(&self, checks: &[Check], taken: &Taken) {
        for (i, c) in checks.iter().enumerate() {
            if taken.decisions[i].is_none() {
                continue;
            }
            if let Some(e) = self.shard(&c.key).lock().get_mut(&c.key) {
                if e.generation == taken.generations[i] {
                    e.tokens += c.cost;
                }
            }
        }
    }

    /// The bucket's entry, made if there is room (after dropping idle ones).
    fn entry<'a>(
        &self,
        shard: &'a mut HashMap<String, Entry>,
        c: &Check,
        now: Instant,
    ) -> Option<&'a mut Entry> {
        if !shard.contains_key(&c.key) {
            if shard.len() >= self.per_shard {
                let idle = 2 * self.period;
                let mut lost = 0;
                shard.retain(|_, e| {
                    let keep = now.saturating_duration_since(e.last_seen) < idle
                        || (e.tokens > 0 && now < e.expires);
                    if !keep {
                        lost += e.tokens;
                    }
                    keep
                });
                metrics::lease_tokens(LeaseEvent::Lost, lost);
                if shard.len() >= self.per_shard {
                    return None;
                }
            }
            shard.insert(c.key.clone(), Entry::new(c.algorithm, now));
        }
        shard.get_mut(&c.key)
    }

    /// The leases a call deciding `requests` asks for: its buckets whose
    /// lease is low, and those queued by `spend`.
    pub fn asks(&self, requests: &[&[Check]], now: Instant) -> Asks {
        let mut asks = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for c in requests.iter().flat_map(|r| r.iter()) {
            if !c.shadow && leasable(&c.algorithm) && seen.insert(c.key.as_str()) {
                asks.extend(self.ask_for(c, now));
            }
        }
        let queued = std::mem::take(&mut *self.renewals.lock());
        for c in &queued {
            if seen.insert(c.key.as_str()) {
                asks.extend(self.ask_for(c, now));
            }
        }
        // Once a period, any call carries back what expired on buckets no
        // request has named since.
        let expired: Vec<Check> = {
            let mut leased = self.leased.lock();
            if leased
                .1
                .is_some_and(|t| now.saturating_duration_since(t) < self.period)
            {
                Vec::new()
            } else {
                leased.1 = Some(now);
                leased.0.values().cloned().collect()
            }
        };
        for c in &expired {
            if seen.insert(c.key.as_str()) {
                asks.extend(self.ask_for(c, now));
            }
        }
        Asks {
            asks,
            replicas: self.replicas.load(Ordering::Relaxed) as u64,
            min: MIN_GRANT,
        }
    }

    fn ask_for(&self, c: &Check, now: Instant) -> Option<Ask> {
        let mut shard = self.shard(&c.key).lock();
        let e = shard.get_mut(&c.key)?;
        e.renew_queued = false;
        let ret = if now >= e.expires {
            std::mem::take(&mut e.tokens)
        } else {
            0
        };
        // Topped up to a period's demand: a lease then runs low within the
        // period it lives, so it is renewed before it expires, never after
        // (asking for a whole period on top of what is held would leave
        // tokens to expire, and the requests after them to wait for Redis).
        let want = e.want(now, self.period).saturating_sub(e.tokens);
        // Less than the smallest grant is never granted: not worth asking.
        let asking = want >= MIN_GRANT
            && running_low(e.tokens, e.tokens + want)
            && !e.asked_recently(now, self.period);
        if asking {
            e.asking = Some(now);
        }
        if e.tokens == 0 {
            self.leased.lock().0.remove(&c.key);
        }
        (asking || ret > 0).then(|| Ask {
            check: c.clone(),
            want: if asking { want } else { 0 },
            ret,
            until: e.until,
        })
    }

    /// Applies a call's grants (one per ask, in order). `sent`: when the
    /// call left; `now_us`: Redis's time in it.
    pub fn granted(&self, asks: &Asks, grants: &[Grant], sent: Instant, now_us: Micros) {
        let period_us = self.period.as_micros() as i64;
        for (a, g) in asks.asks.iter().zip(grants) {
            metrics::lease_tokens(LeaseEvent::Returned, g.taken_back);
            metrics::lease_tokens(LeaseEvent::Lost, a.ret - g.taken_back.min(a.ret));
            let c = &a.check;
            let mut shard = self.shard(&c.key).lock();
            let Some(e) = shard.get_mut(&c.key) else {
                metrics::lease_tokens(LeaseEvent::Lost, g.tokens);
                continue;
            };
            if g.tokens == 0 {
                // Nothing to spare: `asking` stays set, so the bucket is not
                // asked for again for a period.
                continue;
            }
            e.asking = None;
            // Never past the end of the window the tokens count in: Redis
            // took them from that window only.
            let life_us = match c.algorithm {
                Algorithm::FixedWindow { window_secs, .. }
                | Algorithm::SlidingWindow { window_secs, .. } => {
                    let w = window_secs as i64 * 1_000_000;
                    period_us.min((g.until + 1) * w - now_us).max(0)
                }
                Algorithm::Calendar { end, .. } => period_us.min(end - now_us).max(0),
                _ => period_us,
            };
            // Counted from when the call left: Redis's clock read later, so
            // the lease ends here first.
            let expires = sent + Duration::from_micros(life_us as u64);
            let now = Instant::now();
            let windowed = !matches!(c.algorithm, Algorithm::TokenBucket { .. });
            if now < e.expires && e.tokens > 0 && (!windowed || e.until == g.until) {
                // Tokens of both leases: a return must hold for the older
                // (a token bucket's `until` only grows).
                e.tokens += g.tokens;
                e.until = e.until.min(g.until);
            } else {
                // A new lease: tokens taken from the old one are not given
                // back to it.
                metrics::lease_tokens(LeaseEvent::Lost, e.tokens);
                e.tokens = g.tokens;
                e.until = g.until;
                e.generation += 1;
            }
            e.expires = expires;
            e.granted_us = now_us;
            drop(shard);
            self.leased.lock().0.insert(c.key.clone(), c.clone());
            metrics::lease_tokens(LeaseEvent::Granted, g.tokens);
        }
    }

    /// A call carrying `asks` failed: its buckets may be asked for again;
    /// what it gave back may or may not have arrived (counted lost: never
    /// sent twice).
    pub fn failed(&self, asks: &Asks) {
        for a in &asks.asks {
            metrics::lease_tokens(LeaseEvent::Lost, a.ret);
            if let Some(e) = self.shard(&a.check.key).lock().get_mut(&a.check.key) {
                e.asking = None;
            }
        }
    }

    /// What Redis said of each bucket of a request it decided (leases
    /// granted in the same call taken out: `debit`): kept as the start of
    /// what requests decided here report, and the request's own decisions
    /// told as those are, with what this replica holds of its lease (a
    /// refusal too: its `remaining` is what the bucket holds for the client,
    /// under the request's cost; its retry time stays Redis's).
    pub fn answered(&self, checks: &[Check], decisions: &mut [Decision], now: Instant) {
        for (c, d) in checks.iter().zip(decisions) {
            if c.shadow || !leasable(&c.algorithm) {
                continue;
            }
            if let Some(e) = self.shard(&c.key).lock().get_mut(&c.key) {
                e.redis_remaining = d.remaining;
                e.reset_at = now + Duration::from_micros(d.reset_after_us);
                if e.tokens > 0 && now < e.expires {
                    let told = e.decision(now);
                    d.remaining = told.remaining;
                    if d.allowed {
                        d.reset_after_us = told.reset_after_us;
                    }
                }
            }
        }
    }

    /// Whether this replica holds tokens of `key`'s bucket, spendable or
    /// expired (then the next call gives them back, and a request in it
    /// can be admitted from them).
    pub fn holds(&self, key: &str) -> bool {
        self.shard(key)
            .lock()
            .get(key)
            .is_some_and(|e| e.tokens > 0)
    }

    /// This replica's unspent lease on a bucket and its time left.
    pub fn outstanding(&self, key: &str, now: Instant) -> Option<(u64, Duration)> {
        let shard = self.shard(key).lock();
        let e = shard.get(key)?;
        (e.tokens > 0 && now < e.expires)
            .then(|| (e.tokens, e.expires.saturating_duration_since(now)))
    }

    /// Drops the leases on these buckets (a reset): their tokens, taken
    /// from the bucket before it was made whole, are not spent.
    pub fn cancel(&self, keys: &[&str], granted_before: Option<Micros>) {
        for &k in keys {
            if let Some(e) = self.shard(k).lock().get_mut(k) {
                if granted_before.is_some_and(|t| e.granted_us >= t) {
                    continue; // granted by the bucket as it is since
                }
                e.tokens = 0;
                e.generation += 1;
            }
        }
    }

    /// Buckets with an entry (bounded by `local_max_entries`).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Tier;

    fn check(key: &str, cost: u64) -> Check {
        Check {
            tier: Tier::Key,
            key: key.into(),
            algorithm: Algorithm::TokenBucket {
                capacity: 1000,
                refill_per_sec: 100.0,
            },
            shadow: false,
            cost,
            shards: 1,
        }
    }

    fn grant(l: &Leases, checks: &[Check], tokens: u64, sent: Instant) -> Asks {
        let refs: Vec<&[Check]> = vec![checks];
        let asks = l.asks(&refs, sent);
        let grants: Vec<Grant> = asks
            .asks
            .iter()
            .map(|_| Grant {
                tokens,
                until: 0,
                taken_back: 0,
            })
            .collect();
        l.granted(&asks, &grants, sent, 0);
        asks
    }

    #[test]
    fn an_empty_lease_asks_redis_and_a_one_off_client_gets_none() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let c = [check("a", 1)];
        assert!(!l.spend(&c, now).any());
        // One request of demand: not worth a lease.
        assert!(grant(&l, &c, 10, now).is_empty());
        assert!(!l.spend(&c, now).any());
    }

    #[test]
    fn a_hot_bucket_is_spent_locally_until_its_lease_is_short() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let c = [check("a", 1)];
        for _ in 0..10 {
            assert!(!l.spend(&c, now).any());
        }
        let asks = grant(&l, &c, 6, now);
        assert_eq!(asks.asks.len(), 1);
        // Ten requests within a tenth of a period: a hundred a period.
        assert_eq!(asks.asks[0].want, 100);
        let mut local = 0;
        while l.spend(&c, now).all() {
            local += 1;
        }
        assert_eq!(local, 6, "exactly the lease");
        // The lease expires: what is left of it is never spent, and goes
        // back with the next call.
        let _ = grant(&l, &c, 3, now);
        assert_eq!(l.outstanding("a", now).map(|o| o.0), Some(3));
        let later = now + Duration::from_millis(150);
        assert!(!l.spend(&c, later).any(), "an expired lease spends nothing");
        assert_eq!(l.outstanding("a", later), None);
        let asks = l.asks(&[&c[..]], later);
        assert_eq!(asks.asks[0].ret, 3);
    }

    #[test]
    fn a_lease_is_renewed_once_it_holds_a_quarter_of_the_demand() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let c = [check("a", 1)];
        for _ in 0..10 {
            assert!(!l.spend(&c, now).any());
        }
        let _ = grant(&l, &c, 100, now);
        // Each request spends a token and adds to the demand (ten a
        // hundredth of a period is a thousand a period): after k requests
        // the lease holds 100 - k of a demand of 10 * (10 + k). A quarter of
        // it is first reached at k = 22.
        let mut first_renewal = None;
        for k in 1..=60u64 {
            let t = l.spend(&c, now);
            assert!(t.all(), "request {k} is covered by the lease");
            if t.renew && first_renewal.is_none() {
                first_renewal = Some(k);
            }
        }
        assert_eq!(first_renewal, Some(22));
        // Queued once: the next call carries the top-up to the demand.
        let asks = l.asks(&[], now);
        assert_eq!(asks.asks.len(), 1);
        assert_eq!(asks.asks[0].want, 10 * 70 - 40);
    }

    #[test]
    fn a_bucket_seen_now_and_then_or_gone_quiet_asks_for_no_lease() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let t0 = Instant::now();
        let c = [check("a", 1)];
        // Three requests a second apart: never hot.
        for i in 0..3 {
            let now = t0 + Duration::from_secs(i);
            assert!(!l.spend(&c, now).any());
            assert!(l.asks(&[&c[..]], now).is_empty(), "request {i}");
        }
        // Four within a period: hot.
        let now = t0 + Duration::from_secs(3);
        for _ in 0..4 {
            assert!(!l.spend(&c, now).any());
        }
        let _ = grant(&l, &c, 5, now);
        assert_eq!(l.outstanding("a", now).map(|o| o.0), Some(5));
        // Then quiet for two periods: its expired lease goes back, and no
        // new one is asked for on the strength of the old demand.
        let later = now + Duration::from_millis(250);
        let asks = l.asks(&[], later);
        assert_eq!(asks.asks.len(), 1);
        assert_eq!((asks.asks[0].ret, asks.asks[0].want), (5, 0));
    }

    #[test]
    fn a_request_short_on_one_tier_takes_the_others_and_can_give_them_back() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let both = [check("a", 1), check("b", 2)];
        for _ in 0..10 {
            let t = l.spend(&both, now);
            l.give_back(&both, &t);
        }
        let _ = grant(&l, &both[..1], 5, now);
        let _ = grant(&l, &both[1..], 3, now);
        assert!(l.spend(&both, now).all());
        // b holds 1, the request needs 2: a covers its tier, b goes to Redis.
        let t = l.spend(&both, now);
        assert!(t.any() && !t.all());
        assert_eq!(l.outstanding("a", now).unwrap().0, 3);
        // Redis refused it: a's token goes back.
        l.give_back(&both, &t);
        assert_eq!(l.outstanding("a", now).unwrap().0, 4);
        assert_eq!(l.outstanding("b", now).unwrap().0, 1);
    }

    #[test]
    fn a_grant_is_taken_out_of_what_its_call_reported() {
        let c = check("a", 1);
        let d = Decision {
            allowed: true,
            limit: 1000,
            remaining: 50,
            retry_after_us: 0,
            reset_after_us: 9_500_000,
            delay_us: 0,
        };
        let mut verdicts = vec![Verdict {
            decisions: vec![d],
            now_us: 0,
        }];
        let asks = Asks {
            asks: vec![Ask {
                check: c.clone(),
                want: 10,
                ret: 0,
                until: 0,
            }],
            replicas: 1,
            min: MIN_GRANT,
        };
        let grant = Grant {
            tokens: 10,
            until: 0,
            taken_back: 0,
        };
        debit(&[&[c][..]], &mut verdicts, &asks, &[grant]);
        // 10 tokens at 100/s: 100 ms more to refill.
        assert_eq!(verdicts[0].decisions[0].remaining, 40);
        assert_eq!(verdicts[0].decisions[0].reset_after_us, 9_600_000);
    }

    #[test]
    fn the_table_is_bounded() {
        let l = Leases::new(Duration::from_millis(100), 32);
        let now = Instant::now();
        for i in 0..1000 {
            l.spend(&[check(&format!("k{i}"), 1)], now);
        }
        assert!(l.len() <= 32, "{}", l.len());
    }
}
