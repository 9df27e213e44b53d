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
//!   on Redis's clock. Its unspent tokens are then *owed*: they go back with
//!   the next call, which the limiter's sweeper sends within a quarter
//!   period if no request does (`due`), so a quota's `used` is exact within
//!   a period of the last request whether or not this bucket is named
//!   again. Tokens a request took and then had to give back go to the lease
//!   they came from while it lives, else they are owed too: no token leaves
//!   a lease but spent, returned or lost. Redis takes returns back only
//!   where that is exact (`algorithms::lease`); tokens it refuses are lost:
//!   the shared limit under-admits by them, never over-admits.
//! - A graceful stop and a reload release every lease (`release`): no
//!   request spends them after that, and they are owed at once.
//! - A quota's spending and returns are money: each report of them is
//!   numbered, and one whose call failed is told again with its number
//!   (`failed`), ran or not: Redis counts a number once
//!   (`algorithms::lease::told_before`). So a call that ran and whose
//!   answer was lost (a Redis stalled between running it and answering)
//!   bills nothing twice, and one that never ran loses nothing. Numbers
//!   count in order, so a bucket has at most one call carrying its reports
//!   out at a time (`Entry::reporting`); spending meanwhile waits for it.
//! - The books balance: granted = spent + returned + lost + held, where
//!   held (a gauge) is what this replica still has, live, owed or taken by
//!   a request in flight.
//! - Entries are bounded by `local_max_entries`: a full table first drops
//!   entries idle for two periods, then takes no new bucket (it is decided by
//!   Redis, as without leases).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::algorithms::lease::{leasable, Grant};
use super::algorithms::quota;
use super::{Check, Decision, Micros, Verdict};
use crate::config::Algorithm;
use crate::metrics::{self, LeaseEvent};
use crate::shard_map::{Locked, Room, ShardMap, StillFull};

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

/// How long a quota's reports wait for the call carrying earlier ones
/// before they go anyway. A call is always answered or failed well within
/// this (`Settle`); past it, a report of that call told later than newer
/// ones would not count (numbers count in order).
const REPORT_WAIT: Duration = Duration::from_secs(10);

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
    /// A quota's leased tokens spent since this replica last said so: Redis
    /// takes back itself what a dead holder did not spend (`Ledger`).
    pub spent: u64,
    /// A quota's report (`spent`, `ret`) number: counted once however
    /// often it is told (0: nothing to report, or not a quota).
    pub report: u64,
}

impl Ask {
    /// Owed tokens given back, nothing asked for.
    fn back(c: &Check, o: Owed) -> Self {
        Ask {
            check: c.clone(),
            want: 0,
            ret: o.tokens,
            until: o.until,
            spent: 0,
            report: 0,
        }
    }
}

/// What a request took from this replica's leases (`Leases::spend`).
#[derive(Debug)]
pub struct Taken {
    /// Per tier: its decision when its lease covered it.
    pub decisions: Vec<Option<Decision>>,
    /// Per covered tier: the lease it was taken from, and what a return
    /// of its tokens names.
    generations: Vec<(u64, i64)>,
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
    /// This replica's id in quota ledgers, and how long after a grant Redis
    /// takes the unspent tokens of a holder that stopped reporting.
    pub holder: std::sync::Arc<str>,
    pub hold_us: u64,
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
    /// Bumped when a lease ends (it expired, was released or replaced, or
    /// a reset cancelled it): a request that took tokens and then had to
    /// give them back gives them to the lease it took them from, or one
    /// merged into it; else they are owed.
    generation: u64,
    /// Leases before this one were cancelled by a reset: their tokens were
    /// taken from a bucket made whole since, and are not given back.
    reset_generation: u64,
    /// Unspent tokens of ended leases, to give back with the next call.
    owed: Vec<Owed>,
    /// A quota's leased tokens spent and not yet reported (`Ask::spent`).
    unreported: u64,
    /// A quota's reports whose call failed: told again first, with their
    /// numbers, by the next call that reports this bucket.
    doubts: Vec<Ask>,
    /// When the call carrying this quota's reports left (cleared by its
    /// answer or failure): the next reports wait for it (`REPORT_WAIT`).
    reporting: Option<Instant>,
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

/// Tokens of an ended lease, owed back to the shared bucket.
#[derive(Debug, Clone, Copy)]
struct Owed {
    tokens: u64,
    until: i64,
}

impl Entry {
    /// Owes `tokens` of a lease whose grant answered `until`. Returns of one
    /// window are one return; a token bucket's are merged under the
    /// earliest `until` (a return must hold for the oldest grant).
    fn owe(&mut self, tokens: u64, until: i64) {
        if tokens == 0 {
            return;
        }
        let windowed = !matches!(self.algorithm, Algorithm::TokenBucket { .. });
        match self.owed.iter_mut().find(|o| !windowed || o.until == until) {
            Some(o) => {
                o.tokens += tokens;
                o.until = o.until.min(until);
            }
            None => self.owed.push(Owed { tokens, until }),
        }
    }

    /// Ends the live lease: its unspent tokens are owed.
    fn end_lease(&mut self) {
        let tokens = std::mem::take(&mut self.tokens);
        self.owe(tokens, self.until);
        self.generation += 1;
    }

    /// An expired lease's tokens become owed.
    fn settle(&mut self, now: Instant) {
        if self.tokens > 0 && now >= self.expires {
            self.end_lease();
        }
    }

    fn holds_any(&self) -> bool {
        self.tokens > 0
            || !self.owed.is_empty()
            || self.unreported > 0
            || !self.doubts.is_empty()
            || self.reporting.is_some()
    }

    /// A quota's reports are out on a call not yet answered.
    fn reports_out(&self, now: Instant) -> bool {
        self.reporting
            .is_some_and(|t| now.saturating_duration_since(t) < REPORT_WAIT)
    }

    /// Numbers the quota reports a call takes (`asks`, this bucket's, the
    /// doubts told again already numbered); the bucket's next reports then
    /// wait for that call.
    fn number(&mut self, asks: &mut [Ask], reports: &AtomicU64, now: Instant) {
        if !matches!(self.algorithm, Algorithm::Calendar { .. }) {
            return;
        }
        for a in asks.iter_mut() {
            if a.report == 0 && (a.spent > 0 || a.ret > 0) {
                a.report = reports.fetch_add(1, Ordering::Relaxed);
            }
        }
        if asks.iter().any(|a| a.report > 0) {
            self.reporting = Some(now);
        }
    }

    /// Whether anything waits to be told with the next call.
    fn pending(&self) -> bool {
        self.unreported > 0 || !self.owed.is_empty() || !self.doubts.is_empty()
    }

    fn new(algorithm: Algorithm, now: Instant) -> Self {
        Entry {
            algorithm,
            tokens: 0,
            expires: now,
            until: 0,
            generation: 0,
            reset_generation: 0,
            owed: Vec::new(),
            unreported: 0,
            doubts: Vec::new(),
            reporting: None,
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

/// A call's asks until its answer or failure is applied. Dropped unsettled
/// (its caller gave up on it: a clustered batch abandoned when the breaker
/// opened), the call counts as failed after it may have run, so a quota's
/// reports it carried are told again (`Leases::failed`).
pub struct Settle<'a> {
    leases: &'a Leases,
    asks: &'a Asks,
    done: bool,
}

impl Settle<'_> {
    pub fn granted(mut self, grants: &[Grant], sent: Instant, now_us: Micros) {
        self.done = true;
        self.leases.granted(self.asks, grants, sent, now_us);
    }

    pub fn failed(mut self, ran: bool) {
        self.done = true;
        self.leases.failed(self.asks, ran);
    }
}

impl Drop for Settle<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.leases.failed(self.asks, true);
        }
    }
}

pub struct Leases {
    period: Duration,
    entries: ShardMap<String, Entry>,
    /// Buckets whose lease ran low on a request decided here: asked for in
    /// the next call.
    renewals: Mutex<Vec<Check>>,
    /// Buckets holding a live lease: looked at by `due` for one that
    /// expired.
    leased: Mutex<HashMap<String, Check>>,
    /// Buckets with owed tokens or unreported quota spending: every call
    /// carries them (and the sweeper sends them if none does).
    owing: Mutex<HashMap<String, Check>>,
    /// Set by `release` for a stop: nothing is leased or spent after it.
    closed: AtomicBool,
    /// Tokens granted and not yet spent, returned or lost.
    held: AtomicI64,
    replicas: AtomicU32,
    /// This process's id in quota ledgers: random, so a replica restarted
    /// after a SIGKILL never takes over what the killed one held.
    holder: std::sync::Arc<str>,
    /// The next quota report's number (`Ask::report`): increasing, so Redis
    /// keeps only the last one counted per holder and bucket.
    reports: AtomicU64,
}

impl Leases {
    pub fn new(period: Duration, max_entries: usize) -> Self {
        Leases {
            period,
            entries: ShardMap::new(SHARDS, max_entries),
            renewals: Mutex::new(Vec::new()),
            leased: Mutex::new(HashMap::new()),
            owing: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            held: AtomicI64::new(0),
            replicas: AtomicU32::new(1),
            holder: format!("{:016x}", fastrand::u64(..)).into(),
            reports: AtomicU64::new(1),
        }
    }

    /// Settles `asks` once their call is answered, failed, or given up on.
    pub fn settle<'a>(&'a self, asks: &'a Asks) -> Settle<'a> {
        Settle {
            leases: self,
            asks,
            done: false,
        }
    }

    pub fn period(&self) -> Duration {
        self.period
    }

    /// The replicas a grant is shared among.
    pub fn set_replicas(&self, n: u32) {
        self.replicas.store(n.max(1), Ordering::Relaxed);
    }

    fn shard(&self, key: &str) -> Locked<'_, String, Entry> {
        self.entries.lock(key)
    }

    /// Books one event: the counter, and what this replica holds.
    fn book(&self, event: LeaseEvent, n: u64) {
        if n == 0 {
            return;
        }
        metrics::lease_tokens(event, n);
        let delta = match event {
            LeaseEvent::Granted => n as i64,
            _ => -(n as i64),
        };
        let held = self.held.fetch_add(delta, Ordering::Relaxed) + delta;
        metrics::lease_tokens_held(held);
    }

    /// Tokens granted and not yet spent, returned or lost: live, owed, or
    /// taken by a request still being decided.
    pub fn held(&self) -> i64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Notes a request's demand on each bucket, and takes its cost from
    /// the leases that hold enough. When every tier is covered the request
    /// is admitted here (`Taken::all`); otherwise the other tiers go to
    /// Redis, and if the request is not admitted the tokens taken go back
    /// to their leases (`give_back`).
    pub fn spend(&self, checks: &[Check], now: Instant) -> Taken {
        let mut taken = Taken {
            decisions: vec![None; checks.len()],
            generations: vec![(0, 0); checks.len()],
            renew: false,
        };
        if self.closed.load(Ordering::Acquire) {
            return taken;
        }
        for (i, c) in checks.iter().enumerate() {
            if c.shadow || !leasable(&c.algorithm) {
                continue;
            }
            let mut shard = self.shard(&c.key);
            let Some(e) = self.entry(&mut shard, c, now) else {
                continue;
            };
            e.note_demand(c.cost, now, self.period);
            if e.tokens < c.cost || now >= e.expires {
                continue;
            }
            e.tokens -= c.cost;
            taken.generations[i] = (e.generation, e.until);
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

    /// The request was admitted: its leased tokens are spent. A quota's
    /// spending is reported to Redis with the next call (the sweeper sends
    /// one within a quarter period), so a holder that dies unreported for
    /// at most that long.
    pub fn confirm(&self, checks: &[Check], taken: &Taken) {
        let mut spent = 0;
        for (c, d) in checks.iter().zip(&taken.decisions) {
            if d.is_none() {
                continue;
            }
            spent += c.cost;
            if matches!(c.algorithm, Algorithm::Calendar { .. }) {
                // Queued for a call once, when the bucket first has
                // spending to report (every call that takes it reports
                // all of it): not on every request of a hot key.
                let first = match self.shard(&c.key).get_mut(&c.key) {
                    Some(e) => {
                        e.unreported += c.cost;
                        e.unreported == c.cost
                    }
                    None => false,
                };
                if first {
                    self.owing.lock().insert(c.key.clone(), c.clone());
                }
            }
        }
        self.book(LeaseEvent::Spent, spent);
    }

    /// The request was not admitted: the tokens it took go back to the
    /// lease they came from while it lives, else they are owed (a lease a
    /// reset cancelled since loses them: its bucket was made whole).
    pub fn give_back(&self, checks: &[Check], taken: &Taken) {
        for (i, c) in checks.iter().enumerate() {
            if taken.decisions[i].is_none() {
                continue;
            }
            let (generation, until) = taken.generations[i];
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                drop(shard);
                self.book(LeaseEvent::Lost, c.cost);
                continue;
            };
            if e.generation == generation {
                e.tokens += c.cost;
            } else if generation < e.reset_generation {
                drop(shard);
                self.book(LeaseEvent::Lost, c.cost);
            } else {
                e.owe(c.cost, until);
                drop(shard);
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
        }
    }

    /// The bucket's entry, made if there is room (after dropping idle ones
    /// that hold nothing).
    fn entry<'a>(
        &self,
        shard: &'a mut Locked<'_, String, Entry>,
        c: &Check,
        now: Instant,
    ) -> Option<&'a mut Entry> {
        let idle = 2 * self.period;
        let dropped =
            |e: &Entry| now.saturating_duration_since(e.last_seen) >= idle && !e.holds_any();
        let room = Room::Sweep {
            stale: &dropped,
            every: Duration::ZERO,
            then: StillFull::Refuse,
        };
        shard.get_or_insert_with(
            c.key.as_str(),
            || (c.key.clone(), Entry::new(c.algorithm, now)),
            &room,
        )
    }

    /// The leases a call deciding `requests` asks for: its buckets whose
    /// lease is low, those queued by `spend`, and every bucket with owed
    /// tokens.
    pub fn asks(&self, requests: &[&[Check]], now: Instant) -> Asks {
        let mut asks = Vec::new();
        let mut seen: HashSet<&str> = HashSet::new();
        for c in requests.iter().flat_map(|r| r.iter()) {
            if !c.shadow && leasable(&c.algorithm) && seen.insert(c.key.as_str()) {
                self.ask_for(c, now, &mut asks);
            }
        }
        let queued = std::mem::take(&mut *self.renewals.lock());
        for c in &queued {
            if seen.insert(c.key.as_str()) {
                self.ask_for(c, now, &mut asks);
            }
        }
        // Every bucket taken from `owing` is asked for, seen or not: one
        // asked for above may have been queued again since, by spending
        // that came after it (a second ask then carries only that).
        for c in &self.take_owing() {
            self.ask_for(c, now, &mut asks);
        }
        self.sized(asks)
    }

    /// Only the owed tokens, with no new lease asked for: what the sweeper
    /// and a release send (a bucket nobody sends requests for any more
    /// must not be leased again on its old demand).
    pub fn returns(&self, now: Instant) -> Asks {
        let mut asks = Vec::new();
        for c in self.take_owing() {
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                continue;
            };
            e.settle(now);
            if e.reports_out(now) {
                // Sent when that call's answer comes (`reported`).
                continue;
            }
            let start = asks.len();
            asks.append(&mut e.doubts);
            let first = asks.len();
            asks.extend(e.owed.drain(..).map(|o| Ask::back(&c, o)));
            let spent = std::mem::take(&mut e.unreported);
            match asks.get_mut(first) {
                Some(a) => a.spent = spent,
                None if spent > 0 => asks.push(Ask {
                    spent,
                    ..Ask::back(
                        &c,
                        Owed {
                            tokens: 0,
                            until: 0,
                        },
                    )
                }),
                None => {}
            }
            e.number(&mut asks[start..], &self.reports, now);
        }
        self.sized(asks)
    }

    /// The buckets with owed tokens, taken: the call being made carries
    /// them (a failed one owes them again: `failed`).
    fn take_owing(&self) -> Vec<Check> {
        std::mem::take(&mut *self.owing.lock())
            .into_values()
            .collect()
    }

    /// A call's asks, with how grants are sized now.
    fn sized(&self, asks: Vec<Ask>) -> Asks {
        Asks {
            asks,
            replicas: self.replicas.load(Ordering::Relaxed) as u64,
            min: MIN_GRANT,
            holder: self.holder.clone(),
            // A holder returns what it did not spend within a period and a
            // quarter of its grant (the sweeper); Redis waits two.
            hold_us: 2 * self.period.as_micros() as u64,
        }
    }

    /// One bucket's asks: a top-up when its lease runs low, and one
    /// return per owed `until`.
    fn ask_for(&self, c: &Check, now: Instant, out: &mut Vec<Ask>) {
        let mut shard = self.shard(&c.key);
        let Some(e) = shard.get_mut(&c.key) else {
            return;
        };
        e.renew_queued = false;
        e.settle(now);
        let owed = std::mem::take(&mut e.owed);
        // Topped up to a period's demand: a lease then runs low within the
        // period it lives, so it is renewed before it expires, never after
        // (asking for a whole period on top of what is held would leave
        // tokens to expire, and the requests after them to wait for Redis).
        let want = e.want(now, self.period).saturating_sub(e.tokens);
        // Less than the smallest grant is never granted: not worth asking.
        let asking = want >= MIN_GRANT
            && !self.closed.load(Ordering::Acquire)
            && running_low(e.tokens, e.tokens + want)
            && !e.asked_recently(now, self.period);
        if asking {
            e.asking = Some(now);
        }
        if e.tokens == 0 {
            self.leased.lock().remove(&c.key);
        }
        if e.reports_out(now) {
            // A quota's reports wait for the call carrying earlier ones
            // (`reported` asks for them again); a top-up does not.
            e.owed = owed;
            if asking {
                out.push(Ask {
                    check: c.clone(),
                    want,
                    ret: 0,
                    until: e.until,
                    spent: 0,
                    report: 0,
                });
            }
            return;
        }
        let start = out.len();
        out.append(&mut e.doubts);
        let first = owed.first().copied();
        let spent = std::mem::take(&mut e.unreported);
        if asking || first.is_some() || spent > 0 {
            out.push(Ask {
                check: c.clone(),
                want: if asking { want } else { 0 },
                ret: first.map_or(0, |o| o.tokens),
                until: first.map_or(e.until, |o| o.until),
                spent,
                report: 0,
            });
        }
        out.extend(owed.iter().skip(1).map(|o| Ask::back(c, *o)));
        e.number(&mut out[start..], &self.reports, now);
    }

    /// The call carrying a quota's reports was answered or failed: the
    /// bucket's next reports may go, and go with the next call.
    fn reported(&self, c: &Check) {
        let pending = match self.shard(&c.key).get_mut(&c.key) {
            Some(e) => {
                e.reporting = None;
                e.pending()
            }
            None => false,
        };
        if pending {
            self.owing.lock().insert(c.key.clone(), c.clone());
        }
    }

    /// Applies a call's grants (one per ask, in order). `sent`: when the
    /// call left; `now_us`: Redis's time in it.
    pub fn granted(&self, asks: &Asks, grants: &[Grant], sent: Instant, now_us: Micros) {
        let period_us = self.period.as_micros() as i64;
        for (a, g) in asks.asks.iter().zip(grants) {
            if a.report > 0 {
                self.reported(&a.check);
            }
            if g.told {
                // Told again after its answer was lost: its return was
                // taken back then (a quota's, up to what the ledger held).
                self.book(LeaseEvent::Returned, a.ret);
            } else {
                self.book(LeaseEvent::Returned, g.taken_back);
                self.book(LeaseEvent::Lost, a.ret - g.taken_back.min(a.ret));
            }
            if g.tokens == 0 {
                // Nothing to spare: `asking` stays set, so the bucket is not
                // asked for again for a period.
                continue;
            }
            self.book(LeaseEvent::Granted, g.tokens);
            let c = &a.check;
            let mut shard = self.shard(&c.key);
            let Some(e) = shard.get_mut(&c.key) else {
                // Evicted meanwhile (it held nothing): kept again, so the
                // grant is spent or given back.
                let mut e = Entry::new(c.algorithm, Instant::now());
                e.owe(g.tokens, g.until);
                shard.force_insert(c.key.clone(), e);
                drop(shard);
                self.owing.lock().insert(c.key.clone(), c.clone());
                continue;
            };
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
            let closed = self.closed.load(Ordering::Acquire);
            if !closed && now < e.expires && e.tokens > 0 && (!windowed || e.until == g.until) {
                // Tokens of both leases: a return must hold for the older
                // (a token bucket's `until` only grows).
                e.tokens += g.tokens;
                e.until = e.until.min(g.until);
            } else {
                // A new lease: the old one's tokens are owed (and so are
                // those requests took from it and give back).
                e.end_lease();
                e.tokens = g.tokens;
                e.until = g.until;
            }
            e.expires = expires;
            e.granted_us = now_us;
            if closed {
                // Granted to a call that left before the release.
                e.end_lease();
            }
            let owes = !e.owed.is_empty();
            drop(shard);
            if owes {
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
            if !closed {
                self.leased.lock().insert(c.key.clone(), c.clone());
            }
        }
    }

    /// A call carrying `asks` failed: its buckets may be asked for again.
    /// What it gave back is owed again when the call cannot have run
    /// (`ran`: false), else counted lost: it may have arrived, and a return
    /// is never sent twice. A quota's reports are told again either way,
    /// with their numbers: Redis counts a number once, so a call that ran
    /// and whose answer was lost bills nothing twice, and one that did not
    /// run (or ran late and wrote nothing: `Fence`) loses nothing.
    pub fn failed(&self, asks: &Asks, ran: bool) {
        for a in &asks.asks {
            if a.report > 0 {
                let mut shard = self.shard(&a.check.key);
                let kept = match shard.get_mut(&a.check.key) {
                    Some(e) => {
                        e.asking = None;
                        e.reporting = None;
                        e.doubts.push(Ask {
                            want: 0,
                            ..a.clone()
                        });
                        true
                    }
                    None => false,
                };
                drop(shard);
                if kept {
                    self.owing
                        .lock()
                        .insert(a.check.key.clone(), a.check.clone());
                } else {
                    self.book(LeaseEvent::Lost, a.ret);
                }
                continue;
            }
            let again = !ran;
            let mut shard = self.shard(&a.check.key);
            let (owes, lost) = match shard.get_mut(&a.check.key) {
                Some(e) => {
                    e.asking = None;
                    if again {
                        e.unreported += a.spent;
                        e.owe(a.ret, a.until);
                    }
                    (
                        e.unreported > 0 || !e.owed.is_empty(),
                        if again { 0 } else { a.ret },
                    )
                }
                None => (false, a.ret),
            };
            drop(shard);
            if owes {
                self.owing
                    .lock()
                    .insert(a.check.key.clone(), a.check.clone());
            }
            self.book(LeaseEvent::Lost, lost);
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
            if let Some(e) = self.shard(&c.key).get_mut(&c.key) {
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

    /// Whether this replica holds tokens of `key`'s bucket, live or owed
    /// (then the next call gives them back, and a request in it can be
    /// admitted from them).
    pub fn holds(&self, key: &str) -> bool {
        self.shard(key).get(key).is_some_and(Entry::holds_any)
    }

    /// This replica's unspent lease on a bucket and its time left.
    pub fn outstanding(&self, key: &str, now: Instant) -> Option<(u64, Duration)> {
        let shard = self.shard(key);
        let e = shard.get(key)?;
        (e.tokens > 0 && now < e.expires)
            .then(|| (e.tokens, e.expires.saturating_duration_since(now)))
    }

    /// Drops the leases on these buckets (a reset): their tokens, taken
    /// from the bucket before it was made whole, are not spent, nor given
    /// back to the new bucket.
    pub fn cancel(&self, keys: &[&str], granted_before: Option<Micros>) {
        for &k in keys {
            let mut shard = self.shard(k);
            let Some(e) = shard.get_mut(k) else { continue };
            if granted_before.is_some_and(|t| e.granted_us >= t) {
                continue; // granted by the bucket as it is since
            }
            let lost =
                std::mem::take(&mut e.tokens) + e.owed.drain(..).map(|o| o.tokens).sum::<u64>();
            // The reset took the bucket's ledger with it.
            e.unreported = 0;
            e.generation += 1;
            e.reset_generation = e.generation;
            drop(shard);
            self.book(LeaseEvent::Lost, lost);
        }
    }

    /// Ends every live lease whose time is up; whether any tokens are owed
    /// (the caller then sends a call to carry them back). The sweeper asks
    /// this every quarter period, so an idle bucket's lease goes back
    /// within a period and a quarter of its grant.
    pub fn due(&self, now: Instant) -> bool {
        self.end_leases(Some(now))
    }

    /// Ends every lease now (a reload: the old rules' leases go back
    /// before they go; `stop`: a graceful stop, after which nothing is
    /// leased or spent). Returns whether any tokens are owed.
    pub fn release(&self, stop: bool) -> bool {
        if stop {
            self.closed.store(true, Ordering::Release);
        }
        self.end_leases(None)
    }

    /// Ends the live leases that expired by `now` (all of them: `None`),
    /// owing their tokens; a bucket left with no live lease leaves
    /// `leased`.
    fn end_leases(&self, now: Option<Instant>) -> bool {
        let leased: Vec<Check> = self.leased.lock().values().cloned().collect();
        for c in leased {
            let mut shard = self.shard(&c.key);
            let (owes, live) = match shard.get_mut(&c.key) {
                Some(e) => {
                    match now {
                        Some(now) => e.settle(now),
                        None if e.tokens > 0 => e.end_lease(),
                        None => {}
                    }
                    (!e.owed.is_empty(), e.tokens > 0)
                }
                None => (false, false),
            };
            drop(shard);
            if owes {
                self.owing.lock().insert(c.key.clone(), c.clone());
            }
            if !live {
                self.leased.lock().remove(&c.key);
            }
        }
        self.owing()
    }

    /// Whether tokens are owed and wait for a call.
    pub fn owing(&self) -> bool {
        !self.owing.lock().is_empty()
    }

    /// Buckets with an entry (bounded by `local_max_entries`).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
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
                told: false,
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
        assert!(l.due(later), "the sweeper finds the expired lease");
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
                spent: 0,
                report: 0,
            }],
            replicas: 1,
            min: MIN_GRANT,
            ..Asks::default()
        };
        let grant = Grant {
            tokens: 10,
            until: 0,
            taken_back: 0,
            told: false,
        };
        debit(&[&[c][..]], &mut verdicts, &asks, &[grant]);
        // 10 tokens at 100/s: 100 ms more to refill.
        assert_eq!(verdicts[0].decisions[0].remaining, 40);
        assert_eq!(verdicts[0].decisions[0].reset_after_us, 9_600_000);
    }

    /// Redis's answer to `asks`: every return taken back, `tokens` granted
    /// to the first ask that wants some.
    fn answer(l: &Leases, asks: &Asks, tokens: u64, sent: Instant) {
        let grants: Vec<Grant> = asks
            .asks
            .iter()
            .map(|a| Grant {
                tokens: if a.want > 0 { tokens } else { 0 },
                until: 0,
                taken_back: a.ret,
                told: false,
            })
            .collect();
        l.granted(asks, &grants, sent, 0);
    }

    /// A hot bucket "a" (ten requests of demand) holding a lease of `tokens`.
    fn hot(tokens: u64) -> (Leases, Instant, [Check; 1]) {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let c = [check("a", 1)];
        for _ in 0..10 {
            l.spend(&c, now);
        }
        let _ = grant(&l, &c, tokens, now);
        (l, now, c)
    }

    #[test]
    fn tokens_given_back_after_their_lease_ended_are_owed_not_lost() {
        let (l, now, c) = hot(5);
        // A request takes a token, then waits for Redis on another tier...
        let t = l.spend(&c, now);
        assert!(t.all());
        // ...while the lease expires and a new one replaces it.
        let later = now + Duration::from_millis(120);
        for _ in 0..10 {
            l.spend(&c, later);
        }
        let asks = l.asks(&[&c[..]], later);
        assert_eq!(asks.asks[0].ret, 4, "the expired lease's unspent tokens");
        answer(&l, &asks, 6, later);
        // Refused: its token belongs to the ended lease, and is owed.
        l.give_back(&c, &t);
        assert_eq!(l.outstanding("a", later).map(|o| o.0), Some(6));
        assert!(l.owing());
        let asks = l.asks(&[], later);
        assert_eq!(asks.asks.len(), 1);
        assert_eq!(asks.asks[0].ret, 1);
        answer(&l, &asks, 0, later);
        // granted 11 = returned 5 + held 6: nothing vanished.
        assert_eq!(l.held(), 6);
    }

    #[test]
    fn a_release_owes_every_lease_and_a_stop_spends_none_after_it() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let (a, b) = ([check("a", 1)], [check("b", 2)]);
        for _ in 0..10 {
            l.spend(&a, now);
            l.spend(&b, now);
        }
        let _ = grant(&l, &a, 5, now);
        let _ = grant(&l, &b, 8, now);
        assert!(l.spend(&a, now).all());
        l.confirm(&a, &l.spend(&a, now));
        assert_eq!(l.held(), 13 - 1, "one spent, one taken and undecided");
        assert!(l.release(true));
        assert!(!l.spend(&a, now).any(), "nothing is spent after a stop");
        let asks = l.asks(&[&a[..], &b[..]], now);
        let mut rets: Vec<(u64, u64)> = asks.asks.iter().map(|x| (x.ret, x.want)).collect();
        rets.sort();
        assert_eq!(rets, vec![(3, 0), (8, 0)], "returns only, no new lease");
        answer(&l, &asks, 0, now);
        // The request still being decided holds its token until it is.
        assert_eq!(l.held(), 1);
        assert!(!l.owing());
    }

    #[test]
    fn a_return_whose_call_cannot_have_run_is_owed_again() {
        let (l, now, _) = hot(5);
        let later = now + Duration::from_millis(150);
        assert!(l.due(later));
        let asks = l.asks(&[], later);
        l.failed(&asks, false);
        assert!(l.owing(), "never sent: owed again");
        let asks = l.asks(&[], later);
        assert_eq!(asks.asks[0].ret, 5);
        l.failed(&asks, true);
        assert!(!l.owing(), "may have run: never sent twice");
        assert_eq!(l.held(), 0, "counted lost");
    }

    #[test]
    fn a_quota_report_whose_call_failed_is_told_again_with_its_number() {
        let l = Leases::new(Duration::from_millis(100), 1000);
        let now = Instant::now();
        let q = [Check {
            algorithm: Algorithm::Calendar {
                limit: 1000,
                period: crate::calendar::Period::Month,
                start: 0,
                end: i64::MAX / 2,
            },
            ..check("q", 1)
        }];
        for _ in 0..10 {
            l.spend(&q, now);
        }
        let _ = grant(&l, &q, 20, now);
        let spend = |n| {
            for _ in 0..n {
                let t = l.spend(&q, now);
                assert!(t.all());
                l.confirm(&q, &t);
            }
        };
        spend(3);
        let first = l.returns(now);
        assert_eq!(first.asks.len(), 1);
        let (report, spent) = (first.asks[0].report, first.asks[0].spent);
        assert!(report > 0 && spent == 3, "{first:?}");
        // While that call is out, new spending waits for it.
        spend(2);
        assert!(
            l.returns(now).is_empty(),
            "one call with reports out at a time"
        );
        // It failed, after it may have run: told again first, same number,
        // then the spending since under a new one.
        l.failed(&first, true);
        let again = l.returns(now);
        let told: Vec<(u64, u64)> = again.asks.iter().map(|a| (a.report, a.spent)).collect();
        assert_eq!(told.len(), 2, "{told:?}");
        assert_eq!(told[0], (report, 3));
        assert!(told[1].0 > report && told[1].1 == 2, "{told:?}");
        // Answered (the first counted before): nothing more to tell.
        let grants: Vec<Grant> = again
            .asks
            .iter()
            .enumerate()
            .map(|(i, _)| Grant {
                told: i == 0,
                ..Grant::default()
            })
            .collect();
        l.granted(&again, &grants, now, 0);
        assert!(l.returns(now).is_empty());
        assert_eq!(l.held(), 15, "20 granted, 5 spent");
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
