//! The shared backend: every tier of a request decided by one `EVALSHA` of
//! `limiter.lua`, so N replicas enforce one limit.
//!
//! Three topologies:
//! - standalone: one multiplexed, auto-reconnecting connection for all requests;
//! - sentinel: the master is discovered from the sentinels, and re-discovered
//!   by the failback probe after a failure, so a failover is followed;
//! - cluster: requests are batched as in standalone, then each batch is
//!   split by the master serving each bucket (the slot map, `slots`): one
//!   call per master decides every request's tiers there, all masters at
//!   once, each on the request path's own connection to that master
//!   (`decide_clustered`). A call the map sent to the wrong master is
//!   refused before it runs (MOVED, ASK, a key not served there), and the
//!   batch is decided again slot by slot, each call following its own
//!   redirection, then through the cluster client, which follows them
//!   itself. A request's tiers usually live on different
//!   masters; if an enforcing tier rejects, the shares that admitted are
//!   refunded (`refund.lua`), so a rejection still charges no tier.
//!   Between the two round trips the reserved quota is held: concurrent
//!   requests can see less quota, never more. A refund that fails leaves the
//!   client charged.
//!
//! The files: `connection` (topologies, connections, errors), `script`
//! (limiter.lua's arguments and replies), `cluster` (routing a batch over
//! the masters, redirections, refunds), `watchdog` (probes, budgets, late
//! calls), `slots` (the slot map), `admin` (inspect and reset, the resets'
//! stream); this file holds the backend the limiter calls and the state
//! they share (`Inner`).
//!
//! Every call has a budget, `redis.timeout_ms`, counted from when the call is
//! sent. A call still unanswered past it is *late*: it is reported to the
//! breaker's watchdog (`late_call`), which asks Redis itself, on the probe's
//! own connection and thread, whether it answers within the budget. Only then
//! is Redis blamed and the call abandoned (`abandon`); a late call whose
//! Redis answers the watchdog was late on this replica's side (a saturated
//! worker reads its socket late), and its requests keep waiting for Redis's
//! answer, at most `max_wait`. Abandoned calls are never retried: they may
//! have run.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;

use super::algorithms::lease::Grant;
use super::algorithms::outage::Debt;
use super::algorithms::quota;
use super::batch::{Batcher, Decider, Failed, Lost};
use super::leases::{debit, Asks, Leases};
use super::pulls::{ask_pulls, TopUps};
use super::{Backend, Check, Decision, LimiterError, Micros, Verdict};
use crate::clock::Clock;
use crate::config::{Algorithm, RedisMode, RedisSettings};

static LIMITER_LUA: &str = include_str!("../limiter.lua");
static REFUND_LUA: &str = include_str!("../refund.lua");
static CHARGE_LUA: &str = include_str!("../charge.lua");
static HEARTBEAT_LUA: &str = include_str!("../heartbeat.lua");

/// How long past its period's end a quota's count is kept, in microseconds.
pub fn quota_keep_us(days: u32) -> u64 {
    (days as u64 * 86_400_000_000).max(super::algorithms::calendar::GRACE_US)
}

/// A script's source with its quota retention (`QUOTA_KEEP_US`) set.
fn with_quota_keep(source: &str, keep_us: u64) -> String {
    let default = "local QUOTA_KEEP_US = 60000000";
    debug_assert!(source.contains(default));
    source.replacen(default, &format!("local QUOTA_KEEP_US = {keep_us}"), 1)
}

/// Cluster: how many times a batch refused as misplaced (a slot on the
/// move) is decided again before it fails (and falls back).
const MISPLACED_RETRIES: u32 = 3;

/// Buckets per `charge.lua` call: keeps one call's run short.
const CHARGE_BATCH: usize = 200;

mod admin;
mod cluster;
mod connection;
mod script;
mod slots;
mod watchdog;

use connection::*;
use script::*;

pub use admin::{AdminConnection, Persistence};
pub use slots::slot;
use slots::SlotMap;

/// What `reload_password` needs: the section (naming the file) and the
/// password in use.
struct Rotation {
    settings: RedisSettings,
    password: Option<String>,
}

/// Everything a call needs, shared with the batching task.
struct Inner {
    /// Swapped whole when the password file changes (`reload_password`).
    topology: ArcSwap<Topology>,
    connected: ArcSwapOption<Connected>,
    /// Standalone: the request path's connection, created on first use and
    /// renewed at each failback (`renew_request_connection`).
    single: ArcSwapOption<ConnectionManager>,
    /// Standalone: the probe's connection.
    probe_single: ArcSwapOption<ConnectionManager>,
    /// Sentinel: the request path's connection to the current master.
    request_conn: ArcSwapOption<Connected>,
    script: redis::Script,
    refund: redis::Script,
    charge: redis::Script,
    heartbeat: redis::Script,
    budget: Duration,
    /// The longest a call may stay unanswered while the watchdog finds
    /// Redis healthy; past it the call fails (a stuck connection).
    max_wait: Duration,
    /// Told when a call passes its budget unanswered.
    late: tokio::sync::Notify,
    /// The deadline limiter.lua calls carry (`Fence`).
    fence: script::Fence,
    /// Bumped when the breaker opens: calls in flight are abandoned.
    abandon: tokio::sync::watch::Sender<u64>,
    /// `None`: Redis's own TIME. Tests inject a clock to compare backends.
    clock: Option<Arc<dyn Clock>>,
    /// Passwords of the configured URLs, removed from any error text.
    secrets: ArcSwap<Vec<String>>,
    /// Set when the password comes from a file that may be rotated.
    rotation: parking_lot::Mutex<Option<Rotation>>,
    /// Cluster: which master serves each slot (`None`: not known yet, or
    /// found wrong: batches are then decided slot by slot).
    slot_map: Arc<ArcSwapOption<SlotMap>>,
    /// Cluster: a read of the slot map is under way.
    slot_map_reading: Arc<std::sync::atomic::AtomicBool>,
    /// Cluster: bumped when the map is found wrong, so a read begun before
    /// that does not store the old map again.
    slot_map_epoch: Arc<std::sync::atomic::AtomicU64>,
    /// Cluster: the request path's connection to each master, by address
    /// (those the slot map no longer names are dropped when it is read).
    node_conns: Arc<parking_lot::Mutex<HashMap<String, ConnectionManager>>>,
    /// Cluster: the refunds' own cluster connection (`refund_client`).
    refund_conn: ArcSwapOption<ClusterConnection>,
    /// This replica's leases (`None`: disabled).
    leases: Option<Leases>,
    /// Names the calls that decide requests (`None`: they carry none).
    marks: Option<Marks>,
    /// The standing shares' top-ups a call deciding requests carries, and
    /// this replica's id to ask them by (`limiter::pulls`).
    top_ups: std::sync::OnceLock<(Arc<dyn TopUps>, Arc<str>)>,
}

/// Call markers (`limiter.lua`'s ARGV[1]): `<prefix>:ran:<random>:<n>`,
/// n counting this replica's calls. A call deciding requests leaves under
/// its marker, for a minute, which of them it admitted, so that a replica
/// whose answer was lost charges at failback only what Redis did not.
struct Marks {
    name: String,
    next: std::sync::atomic::AtomicU64,
}

impl Marks {
    /// The next call's marker, `<name>:<kind><n>` (`kind` "" for a call
    /// deciding requests, "settled:" for a batch of settlements).
    fn next(&self, kind: &str) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("{}:{kind}{n}", self.name)
    }
}

/// How long a call's marker lives: a lost answer is settled by the
/// failback after it, if Redis answers within this long; after that its
/// requests are charged twice (the old way, never over a limit).
const MARK_LIFE_MS: u64 = 60_000;

/// Reads a call's marker, or voids it (the call, should it run later,
/// writes nothing): '' or "void" when the call did not run.
static WHAT_RAN_LUA: &str = "local v = redis.call('GET', KEYS[1]) \
if v then return v end \
redis.call('SET', KEYS[1], 'void', 'PX', ARGV[1]) \
return ''";

pub struct RedisBackend {
    inner: Arc<Inner>,
    batcher: Batcher,
}

impl RedisBackend {
    /// A standalone backend on one URL.
    pub fn new(
        url: &str,
        budget: Duration,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, LimiterError> {
        let client = redis::Client::open(url).map_err(redis_err)?;
        Ok(Self::with(
            Topology::Standalone(client),
            budget,
            clock,
            Vec::new(),
        ))
    }

    /// The backend a `[redis]` section describes.
    pub fn from_settings(
        s: &RedisSettings,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<Self, LimiterError> {
        let budget = Duration::from_millis(s.timeout_ms);
        let password = read_password(s)?;
        let (topology, secrets) = topology_of(s, password.as_deref())?;
        let backend = Self::with(topology, budget, clock, secrets);
        if s.password_file.is_some() {
            *backend.inner.rotation.lock() = Some(Rotation {
                settings: s.clone(),
                password,
            });
        }
        Ok(backend)
    }

    /// Re-reads `redis.password_file`; when the password in it changed,
    /// the next calls connect with it (the connections made with the old
    /// one are dropped). Returns whether it changed.
    pub fn reload_password(&self) -> Result<bool, LimiterError> {
        let mut rotation = self.inner.rotation.lock();
        let Some(r) = rotation.as_mut() else {
            return Ok(false);
        };
        let password = read_password(&r.settings)?;
        if password == r.password {
            return Ok(false);
        }
        let (topology, secrets) = topology_of(&r.settings, password.as_deref())?;
        self.inner.topology.store(Arc::new(topology));
        // Old passwords stay redacted: a late error may still quote one.
        self.inner.secrets.rcu(|old| {
            let mut all = (**old).clone();
            all.extend(secrets.iter().cloned());
            all
        });
        self.inner.single.store(None);
        self.inner.probe_single.store(None);
        self.inner.connected.store(None);
        self.inner.request_conn.store(None);
        self.inner.node_conns.lock().clear();
        self.inner.refund_conn.store(None);
        r.password = password;
        Ok(true)
    }

    fn with(
        topology: Topology,
        budget: Duration,
        clock: Option<Arc<dyn Clock>>,
        secrets: Vec<String>,
    ) -> Self {
        let inner = Inner {
            topology: ArcSwap::from_pointee(topology),
            connected: ArcSwapOption::empty(),
            single: ArcSwapOption::empty(),
            probe_single: ArcSwapOption::empty(),
            request_conn: ArcSwapOption::empty(),
            slot_map: Arc::new(ArcSwapOption::empty()),
            slot_map_reading: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            slot_map_epoch: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            node_conns: Arc::default(),
            refund_conn: ArcSwapOption::empty(),
            script: redis::Script::new(LIMITER_LUA),
            refund: redis::Script::new(REFUND_LUA),
            charge: redis::Script::new(CHARGE_LUA),
            heartbeat: redis::Script::new(HEARTBEAT_LUA),
            budget,
            max_wait: (budget * 20).max(Duration::from_secs(1)),
            late: tokio::sync::Notify::new(),
            fence: script::Fence::new(budget),
            abandon: tokio::sync::watch::channel(0).0,
            clock,
            secrets: ArcSwap::from_pointee(secrets),
            rotation: parking_lot::Mutex::new(None),
            leases: None,
            marks: None,
            top_ups: std::sync::OnceLock::new(),
        };
        RedisBackend {
            inner: Arc::new(inner),
            batcher: Batcher::new(),
        }
    }

    /// Keeps a quota period's counts `days` after it ends (at least the
    /// minute's grace): the scripts that write them are built with it.
    /// Before the backend is shared.
    pub fn with_quota_retention(mut self, days: u32) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            let keep = quota_keep_us(days);
            inner.script = redis::Script::new(&with_quota_keep(LIMITER_LUA, keep));
            inner.charge = redis::Script::new(&with_quota_keep(CHARGE_LUA, keep));
        }
        self
    }

    /// Turns leases on (`[limiter.leases]`). Before the backend is shared.
    pub fn with_leases(mut self, period: Duration, max_entries: usize) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.leases = Some(Leases::new(period, max_entries));
        }
        self
    }

    /// Marks each call that decides requests (`Marks`), under `prefix`.
    /// Standalone and Sentinel only: a cluster's calls carry none. Before
    /// the backend is shared.
    pub fn with_call_marks(mut self, prefix: &str) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.marks = Some(Marks {
                name: format!("{prefix}:ran:{:016x}", fastrand::u64(..)),
                next: std::sync::atomic::AtomicU64::new(0),
            });
        }
        self
    }

    /// The top-ups the calls deciding requests carry, asked as `holder`
    /// (set once, by the fallback that owns the shares).
    pub fn set_top_ups(&self, top_ups: Arc<dyn TopUps>, holder: &str) {
        let _ = self.inner.top_ups.set((top_ups, holder.into()));
    }

    /// What a call marked `marker` admitted, by request ('1' or '2':
    /// admitted; '0' refused); `None` if it did not run, and then it never
    /// will (the marker is voided).
    pub async fn what_ran(&self, marker: &str) -> Result<Option<String>, LimiterError> {
        let script = redis::Script::new(WHAT_RAN_LUA);
        let mut inv = script.prepare_invoke();
        inv.key(marker).arg(MARK_LIFE_MS);
        let said: String = self.inner.upkeep_invoke(&inv).await?;
        Ok((!said.is_empty() && said != "void").then_some(said))
    }

    pub fn leases(&self) -> Option<&Leases> {
        self.inner.leases.as_ref()
    }

    /// Makes sure a call leaves soon to carry the renewals `Leases::spend`
    /// queued, when no request would send one.
    pub fn renew(&self) {
        let rx = self
            .batcher
            .submit(&self.inner, Arc::from(Vec::new()), self.epoch());
        // The batch drops requests nobody waits for.
        tokio::spawn(async move {
            let _ = rx.await;
        });
    }

    /// Sends a call carrying only lease asks (owed returns, renewals) and
    /// waits for it: on this task, not the batching task's (at a stop, the
    /// proxy's runtime that task lives on may be going away).
    pub async fn flush(&self) -> Result<(), LimiterError> {
        let Some(leases) = &self.inner.leases else {
            return Ok(());
        };
        let asks = leases.returns(Instant::now());
        if asks.is_empty() {
            return Ok(());
        }
        let mut abandon = self.inner.abandon.subscribe();
        self.inner
            .decide_asking(&[], asks, &mut abandon)
            .await
            .map(|_| ())
            .map_err(|f| f.error)
    }

    /// Decides several requests in one call with lease requests: the
    /// verdicts, one grant per ask, and Redis's time (for the conformance
    /// suite, which holds this to `algorithms::lease`).
    /// Gives back a request's admission on every tier that admitted it
    /// (`refund.lua`, each in a task of its own): the in-flight caps
    /// refused it, or its client left while it was queued. Tiers decided
    /// on a lease are given back to the bucket (Redis debited their tokens
    /// with the lease). A refund not made leaves the client charged.
    pub fn refund(&self, checks: &[Check], verdict: &Verdict) {
        let Ok(conn) = self.inner.connection() else {
            return;
        };
        for (c, d) in checks.iter().zip(&verdict.decisions) {
            if d.allowed {
                // Detached: nobody waits for a refund.
                drop(self.inner.refund_one(&conn, c, verdict.now_us, d.remaining));
            }
        }
    }

    pub async fn decide_leasing(
        &self,
        requests: &[&[Check]],
        asks: &Asks,
    ) -> Result<(Vec<Verdict>, Vec<Grant>, Micros), LimiterError> {
        let mut conn = self.inner.connection()?;
        run_script(&self.inner, &mut conn, requests, asks, false, false, None).await
    }

    /// Checks that Redis takes writes and has the scripts: see `Inner::probe`.
    pub async fn probe(&self, probe_key: &str) -> Result<(), LimiterError> {
        self.inner.probe(probe_key).await
    }

    /// Decides several requests in one call, in order (what the batching task
    /// sends; public so the conformance suite can hold it to one-by-one).
    pub async fn decide_many(&self, requests: &[&[Check]]) -> Result<Vec<Verdict>, LimiterError> {
        let mut abandon = self.inner.abandon.subscribe();
        self.inner
            .decide_batch(requests, &mut abandon)
            .await
            .map_err(|f| f.error)
    }

    /// How many times calls have been abandoned (the breaker opened). A
    /// request reads it *before* it looks at the breaker and hands it to
    /// `decide_shared`: a breaker that opens in between fails the request
    /// instead of sending it to the Redis just given up on.
    pub fn epoch(&self) -> u64 {
        *self.inner.abandon.borrow()
    }

    /// The longest a request waits for Redis while Redis answers
    /// (`max(20 × timeout_ms, 1 s)`).
    pub fn max_wait(&self) -> Duration {
        self.inner.max_wait
    }

    /// `Backend::decide` for checks the caller shares with the batch (no copy).
    /// The request waits for its batch's answer: the budget runs from when
    /// the call is sent, not from when this request queued (a busy worker's
    /// queue is not Redis's latency).
    pub async fn decide_shared(&self, checks: Arc<[Check]>, epoch: u64) -> Result<Verdict, Lost> {
        self.batcher
            .submit(&self.inner, checks, epoch)
            .await
            .unwrap_or_else(|_| Err(LimiterError::Redis("the batching task ended".into()).into()))
    }

    /// Drops the request path's connection, so the next request opens a new
    /// one on the proxy's runtime. At failback: the old one may have died
    /// with the Redis that failed, and nothing used it since; its first use
    /// would fail and open the breaker again.
    pub fn renew_request_connection(&self) {
        self.inner.single.store(None);
        self.inner.request_conn.store(None);
        self.inner.node_conns.lock().clear();
        // A map read before the outage may name a master that failed.
        self.inner.forget_slot_map();
    }

    /// Resolves when a call has passed its budget unanswered.
    pub async fn late_call(&self) {
        self.inner.late.notified().await
    }

    /// Fails every call in flight or queued (the breaker opened).
    pub fn abandon(&self) {
        self.inner.abandon.send_modify(|n| *n += 1);
    }

    /// Does Redis answer a PING within the budget? Asked on the probe's own
    /// connection, from the probe's thread: Redis's latency, not this
    /// replica's workers'.
    pub async fn ping(&self) -> Result<(), LimiterError> {
        let conn = self.inner.probe_connection()?;
        let ping = async {
            match conn {
                Conn::Single(mut c) => redis::cmd("PING").query_async::<()>(&mut c).await,
                Conn::Cluster(mut c) => redis::cmd("PING").query_async::<()>(&mut c).await,
            }
            .map_err(redis_err)
        };
        let budget = self.inner.budget;
        tokio::pin!(ping);
        match tokio::time::timeout(budget, &mut ping).await {
            Ok(r) => r,
            // The answer may be read but not yet handed over: one more look.
            Err(_) => {
                tokio::task::yield_now().await;
                match tokio::time::timeout(Duration::ZERO, &mut ping).await {
                    Ok(r) => r,
                    Err(_) => Err(LimiterError::Timeout(budget.as_millis() as u64)),
                }
            }
        }
    }

    /// Announces this replica (`heartbeat.lua`) and returns how many are live.
    pub async fn heartbeat(&self, key: &str, id: &str, ttl: Duration) -> Result<u32, LimiterError> {
        let mut inv = self.inner.heartbeat.prepare_invoke();
        inv.key(key).arg(id).arg(ttl.as_millis() as u64);
        self.inner.upkeep_invoke(&inv).await
    }

    /// Adds what was admitted locally during an outage to the shared buckets
    /// (`charge.lua`), a few hundred buckets per call (one per call in
    /// cluster mode, where buckets live in different slots). `replica` names
    /// this replica's sliding-log entries, so charging them again after a
    /// call that timed out but ran adds nothing. Returns how many buckets
    /// were written; on failure, how many debts were charged before it (the
    /// caller keeps the rest).
    pub async fn charge(
        &self,
        debts: &[(Check, Debt)],
        replica: &str,
    ) -> Result<usize, (usize, LimiterError)> {
        let items: Vec<(&Check, Vec<String>)> = debts
            .iter()
            .map(|(c, debt)| {
                let values = match debt {
                    Debt::Gcra { count, tat } => vec![count.to_string(), format!("{tat:?}")],
                    Debt::Window { window, count } => vec![window.to_string(), count.to_string()],
                    Debt::Sliding { window, prev, cur } => {
                        vec![window.to_string(), prev.to_string(), cur.to_string()]
                    }
                    Debt::Log(times) => times.iter().map(|t| t.to_string()).collect(),
                };
                (c, values)
            })
            .collect();
        self.charge_values(&items, replica, None).await
    }

    /// A marker for one batch of settlements (`settle`): standalone and
    /// Sentinel only (a cluster's calls carry none, like `Marks`).
    pub fn settle_marker(&self) -> Option<String> {
        self.inner.marks.as_ref().map(|m| m.next("settled:"))
    }

    /// Settles charged answers (`charge`): per bucket, tokens owed beyond
    /// the estimates (positive) or given back (negative; in the window they
    /// were taken in, `at`), in `charge.lua`'s batches. A token or leaky
    /// bucket goes below empty for a debt, and back no further than full for
    /// a refund; a count never below zero. With a `marker`
    /// (`settle_marker`), each batch call writes it, and a batch whose
    /// marker is already there writes nothing: the same settlements sent
    /// again, after a call whose answer was lost, are settled once.
    pub async fn settle(
        &self,
        owed: &[(Check, i64, Micros)],
        replica: &str,
        marker: Option<&str>,
    ) -> Result<usize, (usize, LimiterError)> {
        let now = match &self.inner.clock {
            Some(clock) => clock.now_us(),
            None => crate::clock::SystemClock.now_us(),
        };
        let items: Vec<(&Check, Vec<String>)> = owed
            .iter()
            .filter_map(|(c, delta, at)| Some((c, settle_values(&c.algorithm, *delta, *at, now)?)))
            .collect();
        self.charge_values(&items, replica, marker).await
    }

    async fn charge_values(
        &self,
        items: &[(&Check, Vec<String>)],
        replica: &str,
        marker: Option<&str>,
    ) -> Result<usize, (usize, LimiterError)> {
        let mut conn = self.inner.probe_connection().map_err(|e| (0, e))?;
        let per_call = match conn {
            Conn::Cluster(_) => 1,
            Conn::Single(_) => CHARGE_BATCH,
        };
        let mut written = 0;
        for (i, chunk) in items.chunks(per_call).enumerate() {
            let mut inv = self.inner.charge.prepare_invoke();
            // Fenced as limiter.lua's calls are (`Fence`): a charge that
            // runs after this replica gave up on it would be charged again
            // by the retry.
            let budget = self.inner.upkeep_budget();
            match (
                &self.inner.clock,
                self.inner.fence.deadline_in(budget.as_micros() as i64),
            ) {
                (Some(clock), _) => inv.arg(clock.now_us()),
                (None, Some(deadline)) => inv.arg(format!("d{deadline}")),
                (None, None) => inv.arg(""),
            };
            inv.arg(replica);
            // Each batch call its own marker: a retry of the whole sends
            // the calls that ran again, and they write nothing.
            match marker {
                Some(m) => inv.arg(format!("{m}:{i}")),
                None => inv.arg(""),
            };
            for (c, values) in chunk {
                inv.key(c.key.as_str());
                let (kind, p1, p2) = script_args(&c.algorithm);
                inv.arg(kind).arg(p1).arg(p2);
                inv.arg(values.len());
                for v in values {
                    inv.arg(v);
                }
            }
            let call = invoke::<usize>(&mut conn, &inv);
            written += self
                .inner
                .by(Instant::now() + budget, call)
                .await
                .map_err(|e| (i * per_call, e))?;
        }
        Ok(written)
    }

    /// `text` with every configured password taken out.
    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_string();
        for s in self.inner.secrets.load().iter() {
            if !s.is_empty() {
                out = out.replace(s.as_str(), "***");
            }
        }
        out
    }
}

impl Decider for Inner {
    async fn decide_batch(
        &self,
        requests: &[&[Check]],
        abandon: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<Vec<Verdict>, Failed> {
        let asks = match &self.leases {
            Some(leases) => leases.asks(requests, Instant::now()),
            None => Asks::default(),
        };
        self.decide_asking(requests, asks, abandon).await
    }

    fn abandoned(&self) -> tokio::sync::watch::Receiver<u64> {
        self.abandon.subscribe()
    }
}

impl Inner {
    /// A script of the upkeep's (heartbeat, marker reads) on the probe's
    /// connection, within the upkeep's budget.
    async fn upkeep_invoke<T: redis::FromRedisValue>(
        &self,
        inv: &redis::ScriptInvocation<'_>,
    ) -> Result<T, LimiterError> {
        let mut conn = self.probe_connection()?;
        self.by(
            Instant::now() + self.upkeep_budget(),
            invoke(&mut conn, inv),
        )
        .await
    }

    /// A batch's call with these lease asks: grants and returns applied,
    /// then the verdicts.
    async fn decide_asking(
        &self,
        requests: &[&[Check]],
        asks: Asks,
        abandon: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<Vec<Verdict>, Failed> {
        let conn = self.connection();
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                if let Some(leases) = &self.leases {
                    leases.failed(&asks, e.may_have_run());
                }
                return Err(e.into());
            }
        };
        let sent = Instant::now();
        if asks.is_empty() && requests.iter().all(|r| r.is_empty()) {
            // Only renewals, already asked for by another call.
            return Ok(requests.iter().map(|_| Verdict::default()).collect());
        }
        if let Conn::Cluster(_) = conn {
            // Each master's call applies its own grants (`decide_grouped`).
            let call = self.decide_clustered(&conn, requests, &asks);
            return self.answer(call, abandon).await.map_err(Failed::from);
        }
        let marker: Option<Arc<str>> = self
            .marks
            .as_ref()
            .filter(|_| requests.iter().any(|r| !r.is_empty()))
            .map(|m| m.next("").into());
        // A call that may have run hands its marker to its requests.
        let failed = |e: LimiterError| Failed {
            marker: marker.clone().filter(|_| e.may_have_run()),
            error: e,
        };
        // Settled however this call ends (this future may be dropped).
        let settle = self.leases.as_ref().map(|l| l.settle(&asks));
        let leased = asks.asks.len();
        // The shares whose misses sent these requests here are topped up
        // by this same call. Lost with it if it fails (never over a limit).
        let mut with_pulls = None;
        let pulls = self.top_ups.get().and_then(|(top_ups, holder)| {
            let pulls = top_ups.asks(requests)?;
            let mut all = asks.clone();
            ask_pulls(&mut all, &pulls.pulls, holder);
            with_pulls = Some(all);
            Some((top_ups, pulls))
        });
        let asks = with_pulls.as_ref().unwrap_or(&asks);
        let call = run_script(
            self,
            &mut conn,
            requests,
            asks,
            false,
            false,
            marker.as_deref(),
        );
        match self.answer(call, abandon).await {
            Ok((mut verdicts, grants, now_us)) => {
                if let Some(settle) = settle {
                    settle.granted(&grants[..leased], sent, now_us);
                }
                if let Some((top_ups, pulls)) = pulls {
                    top_ups.granted(&pulls, &grants[leased..]);
                }
                debit(requests, &mut verdicts, asks, &grants);
                Ok(verdicts)
            }
            Err(e) => {
                if let Some(settle) = settle {
                    settle.failed(e.may_have_run());
                }
                Err(failed(e))
            }
        }
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError> {
        self.decide_shared(checks.into(), self.epoch())
            .await
            .map_err(|l| l.error)
    }
}

/// `charge.lua`'s values for a settlement of `delta` tokens (`settle`): a
/// debt counts at `now`, a refund in the window of `at`. None for a log.
fn settle_values(alg: &Algorithm, delta: i64, at: Micros, now: Micros) -> Option<Vec<String>> {
    let when = if delta > 0 { now } else { at };
    let window = |secs: u64| when.div_euclid(secs as i64 * 1_000_000).to_string();
    Some(match *alg {
        Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. } => {
            let t = super::algorithms::gcra_interval(alg)?;
            let tat = match delta > 0 {
                true => now as f64 + delta as f64 * t,
                false => now as f64,
            };
            vec![delta.to_string(), format!("{tat:?}")]
        }
        Algorithm::FixedWindow { window_secs, .. } => vec![window(window_secs), delta.to_string()],
        Algorithm::SlidingWindow { window_secs, .. } => {
            vec![window(window_secs), "0".into(), delta.to_string()]
        }
        Algorithm::Calendar { end, .. } => vec![end.to_string(), delta.to_string()],
        Algorithm::SlidingLog { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::slot;

    /// limiter.lua keeps a marker as long as failback may read it.
    #[test]
    fn the_script_keeps_markers_as_long_as_failback_reads_them() {
        let line = format!("local MARK_LIFE_MS = {}\n", super::MARK_LIFE_MS);
        assert!(super::LIMITER_LUA.contains(&line));
    }

    #[test]
    fn cluster_slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("{}foo"), slot("{}foo"));
    }
}
