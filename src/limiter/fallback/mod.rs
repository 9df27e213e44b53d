//! The limiter the proxy talks to: Redis while it is healthy, a circuit
//! breaker that moves to `limiter.on_redis_failure` when it is not, and in
//! front of Redis what this replica decides without a call.
//!
//! A request's tiers, decided together (`decide`):
//! - Standing shares (`[limiter.shares]`): a big bucket's tier is taken
//!   from this replica's share when the share covers it; the others go on,
//!   a cut bucket's on its pool.
//! - A refusal Redis gave is remembered until it ends: the request is
//!   refused with no call (`remembered_denial`), unless this replica holds
//!   leased tokens of that bucket.
//! - Leases: a tier whose lease holds enough is spent here; a request with
//!   every tier covered makes no call.
//! - Redis decides the rest (a call that reached it late is sent once
//!   more). Its answer seeds the local buckets a failover starts from
//!   (`seed`), tells the client what its lease still holds, and its
//!   refusals are remembered.
//! - What shares or leases covered and what decided the rest make one
//!   outcome (`merge`): all or nothing, the local tokens given back when
//!   any tier refuses.
//! - `refund` gives an admission back where it was decided (Redis, the
//!   local buckets and the ledger, or the shares) when its request never
//!   reached the upstream.
//!
//! Around it:
//! - Start-up: before the first request is decided, one bounded attempt to
//!   reach Redis (`start`); if it works, the first request is decided by Redis.
//! - The breaker opens on Redis's errors, and on Redis's own latency: a call
//!   past its budget makes the watchdog PING Redis from the probe's thread, and
//!   only a PING unanswered within the budget opens it. A replica too busy to
//!   read its answers in time keeps waiting for them instead.
//! - While open, with `on_redis_failure = "local"`, each replica enforces its
//!   share (1/live replicas) of every tier locally, starting from what Redis
//!   last said of each bucket, and keeps a ledger of what it admitted.
//! - Failback, after several good probes in a row: the ledger is charged to
//!   the shared buckets first, then traffic returns to Redis.
//!
//! Here: the request path, the breaker's opening (`trip`) and the failure
//! log, the refunds, and what `/readyz` reads (`health`). Beside it:
//! `upkeep` (start-up, the watchdog, heartbeats, resets, the lease sweeper
//! and release), `failback` (probes, the charge of debts), `operator`
//! (inspect, reset), `shares` (a replica's share of a rule) and `merge`
//! (one outcome from what shares or leases covered and what decided the
//! rest).

mod failback;
mod merge;
mod operator;
mod pulls;
mod refund;
mod settle;
mod shares;
mod upkeep;

pub use shares::share;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use super::algorithms::{outage, Snapshot};
use super::deny_cache::{Denial, DenyCache};
use super::leases::{Leases, Mark};
use super::ledger::{Doubt, Ledger};
use super::redis::Persistence;
use super::standing::Standing;
use super::trail;
use super::{
    Backend, Check, Decision, LimiterError, LocalBackend, Lost, Micros, RedisBackend, Sent, Verdict,
};
use crate::clock::{Clock, SystemClock};
use crate::config::OnRedisFailure;
use crate::metrics::{self, DecidedBy};
use merge::{Covered, DecidedOn};

/// Consecutive good probes before traffic goes back to Redis.
const PROBES_TO_FAIL_BACK: u32 = 3;

/// How often a replica announces itself while Redis is up; an announcement
/// lasts three of these.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
const _: () = assert!(Fallback::ANNOUNCEMENT_LIFE.as_secs() == 3 * HEARTBEAT_EVERY.as_secs());

/// A sliding log's seed is renewed at most this often (microseconds).
const LOG_SEED_EVERY_US: i64 = 1_000_000;

/// Between start-up attempts to reach Redis.
const STARTUP_RETRY: Duration = Duration::from_millis(50);

/// How much longer than `startup_redis_wait_ms` a request waits for the
/// start-up attempt to say it has ended (it always does; this is a bound).
const STARTUP_SLACK: Duration = Duration::from_secs(2);

/// While on the fallback, a WARN line at least this often (how long, and
/// the last probe's error): a replica stuck there must not be silent.
const LOUD_EVERY: Duration = Duration::from_secs(10);

/// Failed charges of the ledger before failing back anyway (the debts stay
/// in the ledger and are charged once Redis takes them).
const SETTLE_TRIES: u32 = 3;

/// Which backend decided a request (also the `backend` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackState {
    Redis,
    Local,
}

impl FallbackState {
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackState::Redis => "redis",
            FallbackState::Local => "local",
        }
    }
}

/// How a request's tiers were settled.
#[derive(Debug)]
pub enum Outcome {
    Decided {
        verdict: Verdict,
        backend: FallbackState,
        /// The checks as they were enforced (scaled down when local
        /// fallback; a cut bucket's pool when Redis decided it).
        checks: Arc<[Check]>,
        /// The tiers decided on this replica's standing shares
        /// (`checks[i]` is then the bucket's own rule).
        standing: OnShares,
        /// Per tier, the lease it was spent from (a charged request's
        /// settlement goes through it); None when no tier was.
        leased: Option<Arc<[Option<Mark>]>>,
    },
    /// A denial remembered from Redis's answer (the denied-until cache)
    /// refused it at once: `checks[tier]` decided it, with `decision`; the
    /// other tiers were not asked.
    Remembered {
        checks: Arc<[Check]>,
        tier: usize,
        decision: Decision,
        now_us: Micros,
    },
    /// Redis failed and `on_redis_failure = "allow"`.
    FailOpen,
    /// Redis failed and `on_redis_failure = "deny"`.
    FailClosed,
}

/// Which tiers of a request its standing shares decided (bit i: tier i),
/// and the membership those shares belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnShares {
    pub tiers: u64,
    pub generation: u64,
}

impl OnShares {
    pub const NONE: OnShares = OnShares {
        tiers: 0,
        generation: 0,
    };
}

/// What a reset did.
#[derive(Debug, Clone, Copy)]
pub struct Reset {
    pub backend: FallbackState,
    /// Shared buckets deleted that held state (`None`: Redis does not decide now).
    pub redis_buckets: Option<usize>,
    /// This replica's buckets dropped that held state.
    pub local_buckets: usize,
}

/// What `/readyz` says about Redis.
#[derive(Debug, Clone)]
pub struct Health {
    /// The start-up attempt has ended (requests are being decided).
    pub started: bool,
    pub backend: &'static str,
    /// Replicas sharing the limit: the live count last seen in Redis, else
    /// `limiter.instances`.
    pub replicas: u32,
    /// Why Redis is not in use, when it is not (never a secret).
    pub redis_error: Option<String>,
    /// What an operator should know while serving (ready all the same).
    pub warnings: Vec<String>,
    /// The error's class: `auth`, `permission`, `database`, `config` and
    /// `tls` mean Redis refuses this gateway's settings (or is not trusted).
    pub redis_error_reason: Option<&'static str>,
    /// How long this replica has been on its fallback, when it is.
    pub fallback_for: Option<Duration>,
}

pub struct Fallback {
    /// The config has quotas (`set_quotas`): their counts are money, so a
    /// Redis that would lose them on a restart is said to be one.
    quotas: AtomicBool,
    /// Redis's persistence is to be read again (start-up, failback, a
    /// reload that adds quotas), by the next heartbeat.
    persistence_due: AtomicBool,
    persistence_warning: Mutex<Option<String>>,
    redis: Option<RedisBackend>,
    local: LocalBackend,
    on_failure: OnRedisFailure,
    /// `limiter.instances`: the share before any live count is known.
    instances: u32,
    /// The live replica count last read from Redis (0: none yet).
    replicas: AtomicU32,
    redis_up: AtomicBool,
    good_probes: AtomicU32,
    /// Written by the probe: proves Redis takes writes.
    probe_key: String,
    /// The replica set (`heartbeat.lua`) and this replica's random id in it.
    replicas_key: String,
    /// The stream of reset buckets, and the last entry this replica applied.
    resets_key: String,
    resets_seen: Mutex<Option<String>>,
    replica_id: String,
    /// Buckets Redis said no for, until when: answered without a call.
    denied: DenyCache,
    /// `[limiter.shares]`: the part of big buckets this replica decides
    /// with no call.
    standing: Option<Standing>,
    /// What this replica admitted locally, to charge on failback.
    ledger: Ledger,
    /// What charged requests' answers owe Redis, sent in batches.
    owed: settle::Owed,
    /// True once the start-up attempt has ended.
    started: watch::Sender<bool>,
    startup_wait: Duration,
    /// Failed charges of the ledger in a row.
    failed_settles: AtomicU32,
    started_fast: AtomicBool,
    /// The last reason Redis was not usable, for `/readyz` and the logs.
    last_error: Mutex<Option<LimiterError>>,
    /// When a refusal was last logged at error level (repeated each minute).
    last_refusal_log: Mutex<Option<Instant>>,
    /// Since when Redis has not decided (the breaker opened, or start-up
    /// did not reach it), and when that was last logged.
    fallback_since: Mutex<Option<Instant>>,
    fallback_logged: Mutex<Option<Instant>>,
}

impl Fallback {
    /// How long a replica's announcement lives in the replica set.
    pub const ANNOUNCEMENT_LIFE: Duration = Duration::from_secs(3);

    /// `redis = None`: the local backend is the limiter (no failover).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        redis: Option<RedisBackend>,
        local: LocalBackend,
        on_failure: OnRedisFailure,
        instances: u32,
        key_prefix: &str,
        ledger_cap: usize,
        startup_wait: Duration,
        standing: Option<Standing>,
    ) -> Arc<Self> {
        let has_redis = redis.is_some();
        let f = Arc::new(Fallback {
            redis,
            local,
            on_failure,
            instances: instances.max(1),
            replicas: AtomicU32::new(0),
            redis_up: AtomicBool::new(false),
            good_probes: AtomicU32::new(0),
            probe_key: format!("{key_prefix}:probe"),
            replicas_key: format!("{key_prefix}:replicas"),
            resets_key: format!("{key_prefix}:resets"),
            resets_seen: Mutex::new(None),
            replica_id: format!("{:016x}", fastrand::u64(..)),
            denied: DenyCache::new(100_000),
            // Shares are Redis's pool's complement: nothing to cut without it.
            standing: standing.filter(|_| has_redis),
            ledger: Ledger::new(ledger_cap),
            owed: settle::Owed::default(),
            // Without Redis there is nothing to wait for.
            started: watch::channel(!has_redis).0,
            startup_wait,
            failed_settles: AtomicU32::new(0),
            started_fast: AtomicBool::new(!has_redis),
            last_error: Mutex::new(None),
            last_refusal_log: Mutex::new(None),
            fallback_since: Mutex::new(has_redis.then(Instant::now)),
            fallback_logged: Mutex::new(None),
            quotas: AtomicBool::new(false),
            persistence_due: AtomicBool::new(true),
            persistence_warning: Mutex::new(None),
        });
        metrics::set_backend(FallbackState::Local.as_str());
        metrics::replicas(f.replicas());
        if let Some(leases) = f.redis.as_ref().and_then(RedisBackend::leases) {
            leases.set_replicas(f.instances);
        }
        if let (Some(redis), Some(_)) = (&f.redis, &f.standing) {
            let top_ups = pulls::MissTopUps(Arc::downgrade(&f));
            redis.set_top_ups(Arc::new(top_ups), &f.replica_id);
        }
        f
    }

    pub fn state(&self) -> FallbackState {
        if self.redis.is_some() && self.redis_up.load(Ordering::Relaxed) {
            FallbackState::Redis
        } else {
            FallbackState::Local
        }
    }

    pub fn health(&self) -> Health {
        let state = self.state();
        let err = match state {
            FallbackState::Redis => None,
            FallbackState::Local => self.last_error.lock().clone(),
        };
        Health {
            started: self.started_fast.load(Ordering::Acquire),
            backend: state.as_str(),
            replicas: self.replicas(),
            redis_error: err.as_ref().map(|e| self.redact(&e.to_string())),
            warnings: self.persistence_warning.lock().iter().cloned().collect(),
            redis_error_reason: err.as_ref().map(LimiterError::reason),
            fallback_for: match state {
                FallbackState::Redis => None,
                FallbackState::Local => self.fallback_since.lock().map(|t| t.elapsed()),
            },
        }
    }

    /// Whether the config has quotas (at start and on every reload): Redis's
    /// persistence is then read again.
    pub fn set_quotas(&self, on: bool) {
        if self.quotas.swap(on, Ordering::AcqRel) != on || on {
            self.persistence_due.store(true, Ordering::Release);
        }
        if !on {
            *self.persistence_warning.lock() = None;
        }
    }

    /// Buckets the local backend holds now (bounded by `local_max_entries`).
    pub fn local_entries(&self) -> usize {
        self.local.len()
    }

    /// The shared backend, when there is one (`gateway usage`'s reads).
    pub fn redis(&self) -> Option<&RedisBackend> {
        self.redis.as_ref()
    }

    pub fn has_redis(&self) -> bool {
        self.redis.is_some()
    }

    /// Re-reads `redis.password_file` (`RedisBackend::reload_password`).
    pub fn reload_redis_password(&self) -> Result<bool, LimiterError> {
        match &self.redis {
            Some(r) => r.reload_password(),
            None => Ok(false),
        }
    }

    /// The number of replicas sharing every limit.
    pub fn replicas(&self) -> u32 {
        match self.replicas.load(Ordering::Relaxed) {
            0 => self.instances,
            n => n,
        }
    }

    /// Decides a request's tiers: a cut bucket's tier on this replica's
    /// standing share when it covers it, every other tier (and a cut one
    /// its share cannot cover, on the bucket's pool) as `decide_shared_tiers`
    /// says. All or nothing: a share's tokens go back when another tier
    /// refuses.
    pub async fn decide(&self, checks: &Arc<[Check]>) -> Outcome {
        let Some(standing) = &self.standing else {
            return self.decide_shared_tiers(checks).await;
        };
        if !checks.iter().any(|c| standing.cuts(c)) {
            return self.decide_shared_tiers(checks).await;
        }
        // Built only when Redis decides a tier: a request its shares cover
        // copies no check.
        let pool = |c: &Check| standing.pool_check(c);
        let frozen = !self.redis_up.load(Ordering::Acquire);
        // Cut off from Redis, shares stand in only for the local fallback:
        // "deny" refuses and "allow" admits everything.
        if frozen && self.on_failure != OnRedisFailure::Local {
            return self
                .decide_shared_tiers(&checks.iter().map(pool).collect())
                .await;
        }
        let Some(taken) = standing.take(checks, frozen) else {
            return self
                .decide_shared_tiers(&checks.iter().map(pool).collect())
                .await;
        };
        let covered = Covered::shares(&taken);
        if let Some(outcome) = covered.whole(checks, taken.now_us) {
            trail::decided(DecidedBy::Share);
            return outcome;
        }
        let rest = covered.rest(checks, pool);
        let outcome = self.decide_shared_tiers(&rest).await;
        let mut outcome = covered.merge(checks, outcome, |admitted| {
            if !admitted {
                standing.give_back(checks, &taken);
            }
        });
        // A pool's decision tells the bucket's own limit.
        if let Outcome::Decided { verdict, .. } = &mut outcome {
            for ((c, d), here) in checks
                .iter()
                .zip(&mut verdict.decisions)
                .zip(&taken.decisions)
            {
                if here.is_none() && standing.cuts(c) {
                    d.limit = super::algorithms::quota(&c.algorithm);
                }
            }
        }
        outcome
    }

    async fn decide_shared_tiers(&self, checks: &Arc<[Check]>) -> Outcome {
        let Some(redis) = &self.redis else {
            trail::decided(DecidedBy::Local);
            return self.local_outcome(checks.clone()).await;
        };
        if !self.started_fast.load(Ordering::Acquire) {
            // The start-up attempt is bounded, and marks its end even if it
            // is cut short; this wait is bounded as well, to be sure.
            let mut rx = self.started.subscribe();
            let _ =
                tokio::time::timeout(self.startup_wait + STARTUP_SLACK, rx.wait_for(|s| *s)).await;
        }
        // Read before the breaker: see `RedisBackend::epoch`.
        let epoch = redis.epoch();
        let up = self.redis_up.load(Ordering::Acquire);
        let started = Instant::now();
        if up {
            if let Some(outcome) = self.remembered_denial(checks, started, redis.leases()) {
                trail::decided(DecidedBy::DeniedCache);
                return outcome;
            }
        }
        // Tokens Redis already debited for this replica are spent first,
        // Redis up or not (a replica cut off spends what it holds, then
        // decides by `on_redis_failure`). Tiers no lease covers go to Redis.
        let leases = redis.leases();
        let taken = leases.map(|l| l.spend(checks, started));
        if let (Some(leases), Some(t)) = (leases, &taken) {
            if t.renew && up {
                redis.renew();
            }
            if t.all() {
                if let Some(outcome) =
                    Covered::marked_leases(t, checks).whole(checks, SystemClock.now_us())
                {
                    leases.confirm(checks, t);
                    trail::decided(DecidedBy::Lease);
                    return outcome;
                }
            }
        }
        let taken = taken.filter(|t| t.any());
        // A call that failed after it may have run in Redis: the request's
        // place in it, and the tiers it asked (`Ledger::doubt`).
        let mut lost_call: Option<(Sent, Arc<[Check]>)> = None;
        if up {
            let asked: Arc<[Check]> = match &taken {
                Some(t) => Covered::leases(&t.decisions).rest(checks, Check::clone),
                None => checks.clone(),
            };
            let mut result = redis.decide_shared(asked.clone(), epoch).await;
            // A call that reached Redis past its deadline wrote nothing, and
            // Redis answered it: the lateness may be this replica's own (a
            // saturated process sends late; on a busy host twice in a row
            // opened the breaker on a healthy Redis). Sent again while Redis
            // answers, up to the longest a request waits for it; the
            // watchdog's PING, not this, tells whether Redis is slow.
            while matches!(
                &result,
                Err(Lost {
                    error: LimiterError::Late(_),
                    ..
                })
            ) && redis.epoch() == epoch
                && self.redis_up.load(Ordering::Acquire)
                && started.elapsed() < redis.max_wait()
            {
                result = redis.decide_shared(asked.clone(), epoch).await;
            }
            metrics::redis_call(started.elapsed());
            trail::waited_on_redis(started, result.is_ok());
            match result {
                Ok(mut verdict) => {
                    trail::decided(DecidedBy::Redis);
                    let received = Instant::now();
                    // An answer that arrives after the breaker opened must
                    // not overwrite what the fallback has admitted since.
                    if self.redis_up.load(Ordering::Acquire) {
                        self.seed(&asked, &verdict.decisions);
                    }
                    // Then the client is told what it has left here: what
                    // Redis holds and this replica's lease.
                    if let Some(leases) = leases {
                        leases.answered(&asked, &mut verdict.decisions, received);
                    }
                    for (c, d) in asked.iter().zip(&verdict.decisions) {
                        // A pool this admission emptied refuses the next
                        // request until its next token: remembered as the
                        // refusal Redis would give it (a head over its
                        // limit then costs one call per token it earns,
                        // not two). Only the refill adds to a pool: it is
                        // never leased.
                        if d.allowed && c.pool && !c.shadow {
                            if let Some(wait) = super::deny_cache::empty_for(c, d) {
                                self.denied.remember(
                                    &c.key,
                                    Denial {
                                        until: received + wait,
                                        retry_at: received + wait,
                                        held: d.remaining,
                                    },
                                );
                            }
                        }
                        if !d.allowed && !c.shadow {
                            let wait = Duration::from_micros(d.retry_after_us);
                            // Another live replica's lease on this bucket
                            // can come back at any moment (returned, or
                            // owed once it expires): a refusal is then
                            // remembered no longer than a lease lives,
                            // though it still tells the client Redis's
                            // retry time. (This replica's own leases pass
                            // the memory: `remembered_denial`.)
                            let others = self.replicas() > 1;
                            let memory = match leases.filter(|_| others && c.leased()) {
                                Some(l) => wait.min(l.period()),
                                None => wait,
                            };
                            self.denied.remember(
                                &c.key,
                                Denial {
                                    until: received + memory,
                                    retry_at: received + wait,
                                    held: d.remaining,
                                },
                            );
                        }
                    }
                    let outcome = Outcome::Decided {
                        verdict,
                        backend: FallbackState::Redis,
                        checks: asked,
                        standing: OnShares::NONE,
                        leased: None,
                    };
                    // The covered tiers' decisions in their places.
                    return match (&taken, leases) {
                        (Some(t), Some(leases)) => {
                            Covered::marked_leases(t, checks).merge(checks, outcome, |admitted| {
                                if admitted {
                                    leases.confirm(checks, t);
                                } else {
                                    leases.give_back(checks, t);
                                }
                            })
                        }
                        _ => outcome,
                    };
                }
                Err(Lost { error: e, sent }) => {
                    lost_call = sent.map(|s| (s, asked));
                    // Abandoned: the breaker has just opened on Redis's account.
                    // A failure of a call from before an earlier opening says
                    // nothing of the Redis failed back to since.
                    if !matches!(e, LimiterError::Abandoned) && redis.epoch() == epoch {
                        self.trip(e.clone());
                    }
                    if matches!(e, LimiterError::CrossSlot) {
                        // A key-layout bug must never become allow-all (or deny-all).
                        if let (Some(t), Some(leases)) = (&taken, leases) {
                            leases.give_back(checks, t);
                        }
                        trail::decided(DecidedBy::Fallback);
                        return self.fallback_outcome(checks, None).await;
                    }
                }
            }
        }
        // The whole request is decided by the fallback: its leased tiers'
        // tokens go back to their leases.
        if let (Some(t), Some(leases)) = (&taken, leases) {
            leases.give_back(checks, t);
        }
        match self.on_failure {
            OnRedisFailure::Local => {
                trail::decided(DecidedBy::Fallback);
                self.fallback_outcome(checks, lost_call).await
            }
            OnRedisFailure::Allow => {
                trail::decided(DecidedBy::FailOpen);
                Outcome::FailOpen
            }
            OnRedisFailure::Deny => {
                trail::decided(DecidedBy::FailClosed);
                Outcome::FailClosed
            }
        }
    }

    /// A request that a remembered denial already decides: the denying tier
    /// alone was asked; the others are reported as not asked. A bucket this
    /// replica holds leased tokens of is not refused from memory: a grant
    /// that arrived after the denial (a call already on its way when
    /// another call was refused) holds tokens Redis debited; they are spent,
    /// or once expired given back by the request's own call and spent
    /// there, not stranded until the denial ends.
    fn remembered_denial(
        &self,
        checks: &Arc<[Check]>,
        now: Instant,
        leases: Option<&Leases>,
    ) -> Option<Outcome> {
        let leased = |c: &Check| leases.is_some_and(|l| l.holds(&c.key));
        let (tier, wait, held) = self.denied.find(checks, now, leased)?;
        let wait_us = wait.as_micros() as u64;
        Some(Outcome::Remembered {
            checks: checks.clone(),
            tier,
            decision: Decision {
                allowed: false,
                limit: super::algorithms::quota(&checks[tier].algorithm),
                // As Redis said when it refused (others may spend meanwhile).
                remaining: held,
                retry_after_us: wait_us,
                reset_after_us: wait_us,
                delay_us: 0,
            },
            now_us: SystemClock.now_us(),
        })
    }

    /// The replicas a share is cut for on the fallback: the larger of the
    /// last live count and `limiter.instances`. Replicas cut off from Redis
    /// cannot announce themselves, so the live count of the others drops
    /// while they stay up; never counting fewer than configured keeps the
    /// shares of replicas on the fallback from adding up to more than the
    /// limit when several fail over.
    fn fallback_replicas(&self) -> u32 {
        self.replicas().max(self.instances)
    }

    /// Redis failed: this replica's share, locally, with the admissions
    /// recorded for failback. `lost_call`: the request's call may have run
    /// in Redis, deciding the tiers it asked; failback settles that doubt.
    async fn fallback_outcome(
        &self,
        checks: &[Check],
        lost_call: Option<(Sent, Arc<[Check]>)>,
    ) -> Outcome {
        let n = self.fallback_replicas();
        let shares: Arc<[Check]> = checks
            .iter()
            .map(|c| Check {
                algorithm: share(&c.algorithm, n),
                ..c.clone()
            })
            .collect();
        let outcome = self.local_outcome(shares).await;
        if let Outcome::Decided {
            verdict, checks: s, ..
        } = &outcome
        {
            if verdict.admitted(s) {
                self.ledger
                    .record(checks, s, &verdict.decisions, verdict.now_us);
                if let Some((sent, asked)) = lost_call {
                    // The asked tiers with the fallback's answers for them.
                    let (asked, decisions) = asked
                        .iter()
                        .filter_map(|a| {
                            let i = checks
                                .iter()
                                .position(|c| c.tier == a.tier && c.key == a.key)?;
                            Some((a.clone(), verdict.decisions[i]))
                        })
                        .unzip();
                    self.ledger.doubt(Doubt {
                        sent,
                        checks: asked,
                        decisions,
                        now: verdict.now_us,
                    });
                }
            }
        }
        outcome
    }

    async fn local_outcome(&self, checks: Arc<[Check]>) -> Outcome {
        match self.local.decide(&checks).await {
            Ok(verdict) => Outcome::Decided {
                verdict,
                backend: FallbackState::Local,
                checks,
                standing: OnShares::NONE,
                leased: None,
            },
            Err(_) => Outcome::FailOpen, // the local backend has no failure mode
        }
    }

    /// Opens the breaker (once: concurrent failures log one transition) and
    /// abandons the calls still out.
    fn trip(&self, e: LimiterError) {
        metrics::redis_error(e.reason());
        if self.redis_up.swap(false, Ordering::AcqRel) {
            self.good_probes.store(0, Ordering::Relaxed);
            *self.fallback_since.lock() = Some(Instant::now());
            *self.fallback_logged.lock() = Some(Instant::now());
            if let Some(r) = &self.redis {
                r.abandon();
            }
            let text = self.redact(&e.to_string());
            if matches!(e, LimiterError::Refused { .. }) {
                tracing::error!(error = %text, reason = e.reason(), on_redis_failure = ?self.on_failure, "limiter: redis refuses this gateway, failing over; check redis.urls (password, user, database)");
            } else {
                tracing::warn!(error = %text, reason = e.reason(), on_redis_failure = ?self.on_failure, "limiter: redis failed, failing over");
            }
            metrics::fallback_transition(FallbackState::Local.as_str());
        }
        *self.last_error.lock() = Some(e);
    }

    pub fn redact(&self, text: &str) -> String {
        match &self.redis {
            Some(r) => r.redact(text),
            None => text.to_string(),
        }
    }

    /// A failed attempt to reach Redis: counted; logged at error level when
    /// Redis refuses this gateway (a configuration problem: again every
    /// minute while it lasts), at warn when the reason changed, else at debug.
    fn note_failure(&self, e: LimiterError) {
        metrics::redis_error(e.reason());
        let mut last = self.last_error.lock();
        let changed = last.as_ref().map(|l| l.to_string()) != Some(e.to_string());
        let text = self.redact(&e.to_string());
        if matches!(e, LimiterError::Refused { .. }) {
            let mut logged = self.last_refusal_log.lock();
            if changed || logged.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                *logged = Some(Instant::now());
                tracing::error!(error = %text, reason = e.reason(), "limiter: redis refuses this gateway; check redis.urls (password, user, database); serving on the fallback until it is fixed");
            }
        } else if changed {
            tracing::warn!(error = %text, reason = e.reason(), "limiter: redis unavailable");
        } else {
            tracing::debug!(error = %text, "limiter: probe failed");
        }
        *last = Some(e);
    }
}
