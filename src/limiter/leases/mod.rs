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
//! - A charged request's answer settles a leased counting window through
//!   its lease (`settle`): refunds back to it, debts spent from it.
//! - The books balance: granted + refunded = spent + returned + lost + held, where
//!   held (a gauge) is what this replica still has, live, owed or taken by
//!   a request in flight.
//! - Entries are bounded by `local_max_entries`: a full shard first drops
//!   entries idle for two periods that hold nothing, then takes no new
//!   bucket (it is decided by Redis, as without leases).
//!
//! Here: the table (`Leases`: one `Entry` per bucket, bounded, and the
//! buckets waiting for a call), its books (`book`, `held`) and what a
//! request took (`Taken`). Beside it: `entry` (what an entry does with its
//! lease, debts, reports and demand), `spend` (the request path: spend,
//! confirm, give back), `calls` (what a call to Redis asks for and gives
//! back), `answers` (a call's grants or failure applied), `ends` (expiry,
//! release and reset), `settle` (a charged request's answer settled).

mod answers;
mod calls;
mod ends;
mod entry;
mod settle;
mod spend;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Check, Decision, Micros};
use crate::config::Algorithm;
use crate::metrics::{self, LeaseEvent};
use crate::shard_map::{Locked, ShardMap};
pub use answers::Settle;
pub use calls::{debit, Ask, Asks};
pub use settle::Mark;

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
/// they cost Redis more than the renewals saved: docs/benchmarks.md.)
fn running_low(tokens: u64, demand: u64) -> bool {
    tokens <= demand / 4
}

/// How long a quota's reports wait for the call carrying earlier ones
/// before they go anyway. A call is always answered or failed well within
/// this (`Settle`); past it, a report of that call told later than newer
/// ones would not count (numbers count in order).
const REPORT_WAIT: Duration = Duration::from_secs(10);

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
            LeaseEvent::Granted | LeaseEvent::Refunded => n as i64,
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
