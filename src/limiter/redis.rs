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

use super::algorithms::outage::Debt;
use super::algorithms::quota;
use super::batch::{Batcher, Decider};
use super::{Backend, Check, Decision, LimiterError, Verdict};
use crate::clock::Clock;
use crate::config::{Algorithm, RedisMode, RedisSettings};

static LIMITER_LUA: &str = include_str!("limiter.lua");
static REFUND_LUA: &str = include_str!("refund.lua");
static CHARGE_LUA: &str = include_str!("charge.lua");
static HEARTBEAT_LUA: &str = include_str!("heartbeat.lua");

/// Cluster: how many times a batch refused as misplaced (a slot on the
/// move) is decided again before it fails (and falls back).
const MISPLACED_RETRIES: u32 = 3;

/// Buckets per `charge.lua` call: keeps one call's run short.
const CHARGE_BATCH: usize = 200;

mod admin;
mod slots;

pub use slots::slot;
use slots::SlotMap;

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

struct Connected {
    conn: Conn,
    /// The master's address (sentinel mode), to notice a failover.
    master: Option<String>,
}

enum Topology {
    Standalone(redis::Client),
    Sentinel {
        sentinels: Vec<redis::Client>,
        master: String,
        /// The sentinel URLs are `rediss://`: the master is reached over TLS
        /// too, verified with this CA (`None`: the system roots).
        tls: Option<Option<Vec<u8>>>,
    },
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        /// The same, never retrying a call: for refunds.
        refund_client: Box<redis::cluster::ClusterClient>,
        /// For the request path's own connection to each master.
        nodes: NodeAccess,
    },
}

/// What a connection to one node of a cluster needs besides its address:
/// the seed URLs' credentials and database, and TLS with its CA when the
/// seeds use it.
struct NodeAccess {
    settings: redis::RedisConnectionInfo,
    tls: Option<Option<Vec<u8>>>,
}

/// A client for the node at `addr` (`host:port`), with `settings`'
/// credentials and database, over TLS (verified with the CA, else the
/// system roots) when `tls` says so.
fn node_client(
    addr: &str,
    settings: &redis::RedisConnectionInfo,
    tls: Option<&Option<Vec<u8>>>,
) -> Result<redis::Client, LimiterError> {
    use redis::IntoConnectionInfo;
    let scheme = if tls.is_some() { "rediss" } else { "redis" };
    let info = format!("{scheme}://{addr}")
        .into_connection_info()
        .map_err(redis_err)?
        .set_redis_settings(settings.clone());
    open(info, tls.and_then(Option::as_ref))
}

/// A client for `url`: over TLS for `rediss://`, verified against `ca`
/// (PEM) when given, else the system roots; `password` (from
/// `redis.password` or its file) replaces the URL's.
fn client(
    url: &str,
    ca: Option<&Vec<u8>>,
    password: Option<&str>,
) -> Result<redis::Client, LimiterError> {
    use redis::IntoConnectionInfo;
    let mut info = url.into_connection_info().map_err(redis_err)?;
    if let Some(pw) = password {
        let settings = info.redis_settings().clone().set_password(pw);
        info = info.set_redis_settings(settings);
    }
    open(info, ca.filter(|_| url.starts_with("rediss://")))
}

/// A client for `info`, verifying a TLS server against `ca` (PEM) when
/// given; without it, a `rediss://` address uses the system roots.
fn open(info: redis::ConnectionInfo, ca: Option<&Vec<u8>>) -> Result<redis::Client, LimiterError> {
    match ca {
        Some(pem) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            },
        ),
        None => redis::Client::open(info),
    }
    .map_err(redis_err)
}

/// The password `redis.password_file` (when set) or `redis.password` gives;
/// empty counts as none (`${REDIS_PASSWORD:-}` with the variable unset).
/// The file wins when both are set (`check` says so).
fn read_password(s: &RedisSettings) -> Result<Option<String>, LimiterError> {
    let password = match (&s.password_file, &s.password) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| LimiterError::Refused {
                    reason: "config",
                    detail: format!("redis.password_file: cannot read {}: {e}", path.display()),
                })?
                // A mounted secret often ends with a newline.
                .trim_end_matches(['\n', '\r'])
                .to_string(),
        ),
        (None, Some(p)) => Some(p.expose().to_string()),
        (None, None) => None,
    };
    Ok(password.filter(|p| !p.is_empty()))
}

/// The clients a `[redis]` section describes, with `password` replacing
/// the URLs' own; and every password involved, to redact from errors.
fn topology_of(
    s: &RedisSettings,
    password: Option<&str>,
) -> Result<(Topology, Vec<String>), LimiterError> {
    let budget = Duration::from_millis(s.timeout_ms);
    let tls = s.urls.iter().any(|u| u.starts_with("rediss://"));
    let ca = match &s.ca_file {
        Some(path) if tls => Some(std::fs::read(path).map_err(|e| LimiterError::Refused {
            reason: "config",
            detail: format!("redis.ca_file: cannot read {}: {e}", path.display()),
        })?),
        _ => None,
    };
    let mut secrets: Vec<String> = password.iter().map(|p| p.to_string()).collect();
    for u in &s.urls {
        if let Ok(c) = redis::Client::open(u.as_str()) {
            if let Some(p) = c.get_connection_info().redis_settings().password() {
                secrets.push(p.to_string());
            }
        }
    }
    let topology = match s.mode {
        RedisMode::Standalone => Topology::Standalone(client(&s.urls[0], ca.as_ref(), password)?),
        RedisMode::Sentinel => Topology::Sentinel {
            sentinels: s
                .urls
                .iter()
                .map(|u| client(u, ca.as_ref(), password))
                .collect::<Result<_, _>>()?,
            master: s.sentinel_master.clone().unwrap_or_default(),
            tls: s.urls[0].starts_with("rediss://").then(|| ca.clone()),
        },
        RedisMode::Cluster => {
            let cluster_client = |retries: u32| {
                let mut builder =
                    redis::cluster::ClusterClient::builder(s.urls.iter().map(String::as_str))
                        .connection_timeout(Duration::from_millis(500))
                        .response_timeout(budget.max(Duration::from_millis(100)))
                        .retries(retries);
                if let Some(pw) = password {
                    builder = builder.password(pw);
                }
                if let Some(pem) = &ca {
                    builder = builder.certs(redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem.clone()),
                    });
                }
                builder.build().map_err(redis_err).map(Box::new)
            };
            Topology::Cluster {
                client: cluster_client(2)?,
                // A refund must not run twice (it would give back more than
                // was taken): its client never sends a call again, even
                // after a timeout that may have hidden a run.
                refund_client: cluster_client(0)?,
                nodes: NodeAccess {
                    settings: client(&s.urls[0], ca.as_ref(), password)?
                        .get_connection_info()
                        .redis_settings()
                        .clone(),
                    tls: s.urls[0].starts_with("rediss://").then(|| ca.clone()),
                },
            }
        }
    };
    Ok((topology, secrets))
}

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
}

pub struct RedisBackend {
    inner: Arc<Inner>,
    batcher: Batcher,
}

/// Error codes a cluster node answers before running a call.
const CLUSTER_REFUSALS: [&str; 7] = [
    "MOVED",
    "ASK",
    "TRYAGAIN",
    "READONLY",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "LOADING",
];

fn redis_err(e: redis::RedisError) -> LimiterError {
    let text = e.to_string();
    let refused = |reason| LimiterError::Refused {
        reason,
        detail: text.clone(),
    };
    match e.code() {
        Some("CROSSSLOT") => return LimiterError::CrossSlot,
        Some("WRONGPASS" | "NOAUTH") => return refused("auth"),
        Some("NOPERM") => return refused("permission"),
        // From a master's own connection, what the cluster client would
        // follow or wait out itself: refused before the script ran.
        Some(code) => {
            if let Some(&code) = CLUSTER_REFUSALS.iter().find(|c| **c == code) {
                let to = e.redirect_node().map(|(addr, _)| addr.to_string());
                return LimiterError::Misplaced(code, to);
            }
        }
        None => {}
    }
    match e.kind() {
        redis::ErrorKind::AuthenticationFailed => refused("auth"),
        redis::ErrorKind::InvalidClientConfig => refused("config"),
        _ if text.contains("DB index is out of range") || text.contains("invalid DB index") => {
            refused("database")
        }
        _ if text.contains("AUTH") && text.contains("without any password configured") => {
            refused("auth")
        }
        // rustls: a certificate this gateway cannot trust (CA, name, dates).
        _ if text.contains("invalid peer certificate") => refused("tls"),
        _ => LimiterError::Redis(text),
    }
}

/// The request path's connections retry a failed connect twice; the
/// probe's do not (`retries = 0`): a refusal that retrying cannot fix (a
/// certificate, a password) must reach `/readyz` as itself, not as a timeout.
fn manager_config() -> ConnectionManagerConfig {
    manager_config_with(2)
}

fn manager_config_with(retries: usize) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_number_of_retries(retries)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(500))
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
            abandon: tokio::sync::watch::channel(0).0,
            clock,
            secrets: ArcSwap::from_pointee(secrets),
            rotation: parking_lot::Mutex::new(None),
        };
        RedisBackend {
            inner: Arc::new(inner),
            batcher: Batcher::new(),
        }
    }

    /// Checks that Redis takes writes and has the scripts: see `Inner::probe`.
    pub async fn probe(&self, probe_key: &str) -> Result<(), LimiterError> {
        self.inner.probe(probe_key).await
    }

    /// Decides several requests in one call, in order (what the batching task
    /// sends; public so the conformance suite can hold it to one-by-one).
    pub async fn decide_many(&self, requests: &[&[Check]]) -> Result<Vec<Verdict>, LimiterError> {
        let mut abandon = self.inner.abandon.subscribe();
        self.inner.decide_batch(requests, &mut abandon).await
    }

    /// How many times calls have been abandoned (the breaker opened). A
    /// request reads it *before* it looks at the breaker and hands it to
    /// `decide_shared`: a breaker that opens in between fails the request
    /// instead of sending it to the Redis just given up on.
    pub fn epoch(&self) -> u64 {
        *self.inner.abandon.borrow()
    }

    /// `Backend::decide` for checks the caller shares with the batch (no copy).
    /// The request waits for its batch's answer: the budget runs from when
    /// the call is sent, not from when this request queued (a busy worker's
    /// queue is not Redis's latency).
    pub async fn decide_shared(
        &self,
        checks: Arc<[Check]>,
        epoch: u64,
    ) -> Result<Verdict, LimiterError> {
        self.batcher
            .submit(&self.inner, checks, epoch)
            .await
            .unwrap_or_else(|_| Err(LimiterError::Redis("the batching task ended".into())))
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
        let mut conn = self.inner.probe_connection()?;
        let mut inv = self.inner.heartbeat.prepare_invoke();
        inv.key(key).arg(id).arg(ttl.as_millis() as u64);
        let work = async {
            match &mut conn {
                Conn::Single(c) => inv.invoke_async::<u32>(c).await,
                Conn::Cluster(c) => inv.invoke_async::<u32>(c).await,
            }
            .map_err(redis_err)
        };
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
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
        let mut conn = self.inner.probe_connection().map_err(|e| (0, e))?;
        let per_call = match conn {
            Conn::Cluster(_) => 1,
            Conn::Single(_) => CHARGE_BATCH,
        };
        let mut written = 0;
        for (i, chunk) in debts.chunks(per_call).enumerate() {
            let mut inv = self.inner.charge.prepare_invoke();
            match &self.inner.clock {
                Some(clock) => inv.arg(clock.now_us()),
                None => inv.arg(""),
            };
            inv.arg(replica);
            for (c, debt) in chunk {
                inv.key(c.key.as_str());
                let (kind, p1, p2) = script_args(&c.algorithm);
                inv.arg(kind).arg(p1).arg(p2);
                let values: Vec<String> = match debt {
                    Debt::Gcra { count, tat } => vec![count.to_string(), format!("{tat:?}")],
                    Debt::Window { window, count } => vec![window.to_string(), count.to_string()],
                    Debt::Sliding { window, prev, cur } => {
                        vec![window.to_string(), prev.to_string(), cur.to_string()]
                    }
                    Debt::Log(times) => times.iter().map(|t| t.to_string()).collect(),
                };
                inv.arg(values.len());
                for v in values {
                    inv.arg(v);
                }
            }
            let call = async {
                match &mut conn {
                    Conn::Single(c) => inv.invoke_async::<usize>(c).await,
                    Conn::Cluster(c) => inv.invoke_async::<usize>(c).await,
                }
                .map_err(redis_err)
            };
            written += self
                .inner
                .by(Instant::now() + self.inner.upkeep_budget(), call)
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

impl Inner {
    /// The budget of the probe's own calls (probe, heartbeat, charge): off
    /// the request path, so at least half a second however small the
    /// request budget.
    fn upkeep_budget(&self) -> Duration {
        self.budget.max(Duration::from_millis(500))
    }

    /// The connection requests use, made in the caller's runtime (the
    /// proxy's), so a Redis call costs no hop to another thread. Sentinel:
    /// to the master the probe last found. Cluster: the probe's connection.
    fn connection(&self) -> Result<Conn, LimiterError> {
        match &**self.topology.load() {
            Topology::Standalone(client) => {
                if let Some(c) = self.single.load().as_ref() {
                    return Ok(Conn::Single(ConnectionManager::clone(c)));
                }
                // Two requests racing here make two; the one stored stays.
                let c = ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
                    .map_err(redis_err)?;
                self.single.store(Some(Arc::new(c.clone())));
                Ok(Conn::Single(c))
            }
            Topology::Sentinel { .. } => {
                let target = self.connected.load();
                let master = target
                    .as_ref()
                    .and_then(|c| c.master.clone())
                    .ok_or(LimiterError::NotConnected)?;
                if let Some(rc) = self.request_conn.load().as_ref() {
                    if rc.master.as_deref() == Some(master.as_str()) {
                        return Ok(rc.conn.clone());
                    }
                }
                let client = self.master_client(&master)?;
                let conn = Conn::Single(
                    ConnectionManager::new_lazy_with_config(client, manager_config())
                        .map_err(redis_err)?,
                );
                self.request_conn.store(Some(Arc::new(Connected {
                    conn: conn.clone(),
                    master: Some(master),
                })));
                Ok(conn)
            }
            Topology::Cluster { .. } => self.probe_connection(),
        }
    }

    /// The probe's own connection (made in the probe's runtime).
    fn probe_connection(&self) -> Result<Conn, LimiterError> {
        if let Topology::Standalone(client) = &**self.topology.load() {
            if let Some(c) = self.probe_single.load().as_ref() {
                return Ok(Conn::Single(ConnectionManager::clone(c)));
            }
            // Made only on the probe's thread, so never raced.
            let c = ConnectionManager::new_lazy_with_config(client.clone(), manager_config_with(0))
                .map_err(redis_err)?;
            self.probe_single.store(Some(Arc::new(c.clone())));
            return Ok(Conn::Single(c));
        }
        self.connected
            .load()
            .as_ref()
            .map(|c| c.conn.clone())
            .ok_or(LimiterError::NotConnected)
    }

    /// A client for the master the sentinels named, with the credentials and
    /// database of the configured URL (the sentinels only say where it is).
    fn master_client(&self, addr: &str) -> Result<redis::Client, LimiterError> {
        let topology = self.topology.load();
        let Topology::Sentinel { sentinels, tls, .. } = &**topology else {
            return Err(LimiterError::NotConnected);
        };
        let settings = sentinels
            .first()
            .map(|s| s.get_connection_info().redis_settings().clone())
            .ok_or(LimiterError::NotConnected)?;
        node_client(addr, &settings, tls.as_ref())
    }

    /// Cluster: the request path's connection to the master at `addr`,
    /// made on first use in the caller's runtime (the proxy's), as
    /// standalone's is: a batch's calls go straight to their masters, with
    /// no hop to the cluster client's task on the probe's thread.
    fn node_connection(&self, addr: &str) -> Result<Conn, LimiterError> {
        let mut conns = self.node_conns.lock();
        if let Some(c) = conns.get(addr) {
            return Ok(Conn::Single(c.clone()));
        }
        let topology = self.topology.load();
        let Topology::Cluster { nodes, .. } = &**topology else {
            return Err(LimiterError::NotConnected);
        };
        let client = node_client(addr, &nodes.settings, nodes.tls.as_ref())?;
        let c =
            ConnectionManager::new_lazy_with_config(client, manager_config()).map_err(redis_err)?;
        conns.insert(addr.to_string(), c.clone());
        Ok(Conn::Single(c))
    }

    /// Asks the sentinels, in order, where the master is.
    async fn sentinel_master(
        sentinels: &[redis::Client],
        name: &str,
    ) -> Result<String, LimiterError> {
        let mut last = LimiterError::NotConnected;
        for s in sentinels {
            let ask = async {
                let mut c = s.get_multiplexed_async_connection().await?;
                let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(name)
                    .query_async(&mut c)
                    .await?;
                Ok::<_, redis::RedisError>(addr)
            };
            match tokio::time::timeout(Duration::from_millis(300), ask).await {
                Ok(Ok(Some((host, port)))) => return Ok(format!("{host}:{port}")),
                Ok(Ok(None)) => {
                    last = LimiterError::Redis(format!("sentinels do not know master \"{name}\""))
                }
                Ok(Err(e)) => last = redis_err(e),
                Err(_) => last = LimiterError::Timeout(300),
            }
        }
        Err(last)
    }

    /// (Re)connects where the topology says Redis is now.
    async fn ensure_connected(&self) -> Result<(), LimiterError> {
        // A snapshot: no guard is held across the awaits below.
        let topology = self.topology.load_full();
        match &*topology {
            Topology::Standalone(_) => Ok(()),
            Topology::Sentinel {
                sentinels, master, ..
            } => {
                let addr = Self::sentinel_master(sentinels, master).await?;
                let current = self.connected.load();
                if current.as_ref().and_then(|c| c.master.as_deref()) == Some(addr.as_str()) {
                    return Ok(());
                }
                let client = self.master_client(&addr)?;
                let conn = ConnectionManager::new_lazy_with_config(client, manager_config_with(0))
                    .map_err(redis_err)?;
                tracing::info!(master = %addr, "limiter: sentinel master discovered");
                self.connected.store(Some(Arc::new(Connected {
                    conn: Conn::Single(conn),
                    master: Some(addr),
                })));
                Ok(())
            }
            Topology::Cluster {
                client,
                refund_client,
                ..
            } => {
                if self.refund_conn.load().is_none() {
                    // Without it a refund is not made (the client stays
                    // charged): a failure here fails nothing else.
                    let connect = refund_client.get_async_connection();
                    if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
                        self.refund_conn.store(Some(Arc::new(c)));
                    }
                }
                if self.connected.load().is_some() {
                    return Ok(());
                }
                let conn =
                    tokio::time::timeout(Duration::from_secs(2), client.get_async_connection())
                        .await
                        .map_err(|_| LimiterError::Timeout(2000))?
                        .map_err(redis_err)?;
                self.connected.store(Some(Arc::new(Connected {
                    conn: Conn::Cluster(conn),
                    master: None,
                })));
                Ok(())
            }
        }
    }

    /// Checks that Redis takes writes and has the scripts (loading them if
    /// not): what the failback probe asks before trusting Redis again. The
    /// write catches what a PING would not: a full Redis (OOM) and a demoted
    /// master (READONLY). In cluster mode the cluster must also say it is ok.
    pub async fn probe(&self, probe_key: &str) -> Result<(), LimiterError> {
        let work = async {
            self.ensure_connected().await?;
            let conn = self.probe_connection()?;
            match conn {
                Conn::Single(mut c) => self.probe_on(&mut c, probe_key).await,
                Conn::Cluster(mut c) => {
                    let info: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut c)
                        .await
                        .map_err(redis_err)?;
                    if !info.contains("cluster_state:ok") {
                        return Err(LimiterError::Redis("cluster_state is not ok".into()));
                    }
                    self.probe_on(&mut c, probe_key).await
                }
            }
        };
        let result = match tokio::time::timeout(self.upkeep_budget(), work).await {
            Ok(r) => r,
            Err(_) => Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
        };
        if let Err(e) = &result {
            // A connection that stayed silent is not probed again: the next
            // probe opens a new one. A connection can stay silent for good
            // after a partition heals (a NAT or firewall that forgot its
            // flow), and a timeout does not make redis-rs replace it;
            // probing on it would keep this replica on its fallback while
            // Redis is healthy.
            if e.is_silence() {
                self.forget_probe_connection();
            }
        }
        result
    }

    /// Drops the probe's connection; the next probe makes a new one (a
    /// sentinel's master is asked for again, a cluster's map read again).
    fn forget_probe_connection(&self) {
        self.probe_single.store(None);
        if !matches!(&**self.topology.load(), Topology::Standalone(_)) {
            self.connected.store(None);
        }
    }

    async fn probe_on(
        &self,
        c: &mut impl redis::aio::ConnectionLike,
        probe_key: &str,
    ) -> Result<(), LimiterError> {
        for script in [&self.script, &self.refund] {
            let exists: Vec<bool> = redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(script.get_hash())
                .query_async(c)
                .await
                .map_err(redis_err)?;
            if !exists.first().copied().unwrap_or(false) {
                script.load_async(c).await.map_err(redis_err)?;
            }
        }
        redis::cmd("SET")
            .arg(probe_key)
            .arg(1)
            .arg("PX")
            .arg(1000)
            .query_async::<()>(c)
            .await
            .map_err(redis_err)
    }

    /// Cluster mode: a batch split by the node that serves each bucket
    /// (when the slot map is known: each call then goes on that node's own
    /// connection) and otherwise by hash slot (through the cluster client).
    /// Each group's share of every request (its tiers there) goes in one
    /// call, all groups' calls at once (one round trip of wall time); within a call
    /// the shares are decided in order, all or nothing, as `limiter.lua`
    /// does for standalone. A request is admitted when every share admits;
    /// otherwise the shares that admitted are refunded (`refund.lua`), so a
    /// rejected request charges no tier. Between the two round trips the
    /// reserved quota is held: later requests of the batch can see less
    /// quota, never more. A refund that fails leaves the client charged. On
    /// any failed call the whole batch fails, its admitted shares refunded;
    /// when a node refused a call before running it (a stale map, a slot on
    /// the move), the batch is decided again: slot by slot, each call
    /// following its own redirection, then through the cluster client, at
    /// most `MISPLACED_RETRIES` times.
    async fn decide_clustered(
        &self,
        conn: &Conn,
        requests: &[&[Check]],
    ) -> Result<Vec<Verdict>, LimiterError> {
        self.refresh_slot_map(conn, false);
        // A map kept past twice its age (no batch read it again: the
        // breaker was open, or traffic stopped) is not trusted.
        let mut map = self
            .slot_map
            .load_full()
            .filter(|m| m.read_at.elapsed() < 2 * slots::MAX_AGE);
        let mut attempt = 0;
        loop {
            // By master first; once refused, slot by slot (a master's
            // connection still, each call following its own redirection);
            // then through the cluster client.
            let by_slot = attempt > 0;
            let result = self
                .decide_grouped(conn, requests, map.as_deref(), by_slot)
                .await;
            match result {
                // Nothing ran, and the batch's other shares were refunded:
                // decide again. At the instant a slot changes hands even the
                // cluster client can be refused; a few ms later it is settled.
                Err(e) if misplaced(&e) && attempt < MISPLACED_RETRIES => {
                    self.refresh_slot_map(conn, true);
                    if attempt > 0 {
                        map = None;
                        tokio::time::sleep(Duration::from_millis(2 * attempt as u64)).await;
                    }
                    attempt += 1;
                }
                Err(e) => {
                    // A master that failed (killed, failed over) may no
                    // longer be one: until the map is read anew, batches go
                    // through the cluster client.
                    if map.is_some() && !misplaced(&e) {
                        self.forget_slot_map();
                    }
                    self.refresh_slot_map(conn, true);
                    return Err(e);
                }
                ok => return ok,
            }
        }
    }

    /// Drops the slot map (batches go through the cluster client until it
    /// is read again); a read begun before this does not store it back.
    fn forget_slot_map(&self) {
        self.slot_map_epoch
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.slot_map.store(None);
    }

    /// Reads the slot map again when it is missing or old, in a task of
    /// its own (never on a request's path); `force`: now.
    fn refresh_slot_map(&self, conn: &Conn, force: bool) {
        use std::sync::atomic::Ordering;
        let now = Instant::now();
        let fresh = self.slot_map.load().as_ref().is_some_and(|m| m.fresh(now));
        if (fresh && !force) || self.slot_map_reading.swap(true, Ordering::AcqRel) {
            return;
        }
        let (map, reading, epoch, node_conns, mut conn) = (
            self.slot_map.clone(),
            self.slot_map_reading.clone(),
            self.slot_map_epoch.clone(),
            self.node_conns.clone(),
            conn.clone(),
        );
        let began = epoch.load(Ordering::Acquire);
        tokio::spawn(async move {
            let mut cmd = redis::cmd("CLUSTER");
            cmd.arg("SLOTS");
            let reply: redis::RedisResult<redis::Value> = query(&mut conn, &cmd).await;
            let read = reply.ok().and_then(|v| SlotMap::from_reply(&v, now));
            if let Some(m) = &read {
                // A master gone from the map (failed over, removed) keeps no
                // connection.
                let names: Vec<&str> = m.addresses().collect();
                node_conns
                    .lock()
                    .retain(|addr, _| names.contains(&addr.as_str()));
            }
            if epoch.load(Ordering::Acquire) == began {
                map.store(read.map(Arc::new));
            }
            reading.store(false, Ordering::Release);
        });
    }

    /// One round of `decide_clustered`: grouped by node with `map`, else by slot.
    async fn decide_grouped(
        &self,
        conn: &Conn,
        requests: &[&[Check]],
        map: Option<&SlotMap>,
        by_slot: bool,
    ) -> Result<Vec<Verdict>, LimiterError> {
        // A group: a node (or, by slot or unmapped, a slot): its first slot,
        // whether it spans several, and its shares.
        let group_of = |sl: u16| match map.and_then(|m| m.node(sl)).filter(|_| !by_slot) {
            Some(node) => node as u32,
            None => 0x1_0000 | sl as u32,
        };
        let mut groups: Vec<(u32, u16, bool, Vec<Share>)> = Vec::new();
        // Per request and tier: (group, share, position in the share).
        let mut placed: Vec<Vec<(usize, usize, usize)>> = Vec::with_capacity(requests.len());
        for (r, checks) in requests.iter().enumerate() {
            let mut at = Vec::with_capacity(checks.len());
            for c in checks.iter() {
                let sl = slot(&c.key);
                let id = group_of(sl);
                let g = match groups.iter().position(|(x, ..)| *x == id) {
                    Some(g) => g,
                    None => {
                        groups.push((id, sl, false, Vec::new()));
                        groups.len() - 1
                    }
                };
                let (_, first, spans, shares) = &mut groups[g];
                *spans |= *first != sl;
                if shares.last().is_none_or(|(q, _)| *q != r) {
                    shares.push((r, Vec::new()));
                }
                let share = shares.len() - 1;
                shares[share].1.push(c.clone());
                at.push((g, share, shares[share].1.len() - 1));
            }
            placed.push(at);
        }
        // Each group's call goes on its master's own connection when the map
        // says where the master is, else through the cluster client; all at
        // once, from this task.
        let conns: Vec<Result<Conn, LimiterError>> = groups
            .iter()
            .map(
                |(_, first, ..)| match map.and_then(|m| m.address(m.node(*first)?)) {
                    Some(addr) => self.node_connection(addr),
                    None => Ok(conn.clone()),
                },
            )
            .collect();
        let calls = groups.iter().zip(&conns).map(|((_, _, spans, shares), c)| {
            let conn = c.clone();
            async move {
                let parts: Vec<&[Check]> = shares.iter().map(|(_, c)| c.as_slice()).collect();
                let mut conn = conn?;
                let (script, clock) = (&self.script, self.clock.as_ref());
                match run_script(script, clock, &mut conn, &parts, *spans, false).await {
                    // A master's own connection redirected: follow it once,
                    // as the cluster client would (ASK: on the node
                    // importing the slot, this call only).
                    Err(LimiterError::Misplaced(code @ ("ASK" | "MOVED"), Some(to)))
                        if matches!(conn, Conn::Single(_)) =>
                    {
                        let mut there = self.node_connection(&to)?;
                        let asking = code == "ASK";
                        run_script(script, clock, &mut there, &parts, *spans, asking).await
                    }
                    other => other,
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let mut answers: Vec<Option<Vec<Verdict>>> = Vec::with_capacity(results.len());
        // The error the batch fails with: a misplaced call's only if every
        // failed call was misplaced (nothing written: the batch may be
        // decided again); any other (a timeout: the call may have run) wins.
        let mut failed: Option<LimiterError> = None;
        for result in results {
            match result {
                Ok(v) => answers.push(Some(v)),
                Err(e) => {
                    answers.push(None);
                    if failed.as_ref().is_none_or(misplaced) {
                        failed = Some(e);
                    }
                }
            }
        }
        // A share admitted as a whole took its admitting tiers' tokens.
        let share_admitted = |g: usize, share: usize| {
            answers[g].as_ref().is_some_and(|v| {
                let checks = &groups[g].3[share].1;
                v[share].admitted(checks)
            })
        };
        let mut verdicts = Vec::with_capacity(requests.len());
        let mut refunds = Vec::new();
        for (r, checks) in requests.iter().enumerate() {
            let decisions: Option<Vec<Decision>> = placed[r]
                .iter()
                .map(|&(g, share, i)| Some(answers[g].as_ref()?[share].decisions[i]))
                .collect();
            let admitted = failed.is_none()
                && decisions
                    .as_ref()
                    .is_some_and(|d| checks.iter().zip(d).all(|(c, d)| d.allowed || c.shadow));
            if !admitted {
                // Give back what its admitted shares took.
                let mut seen: Vec<(usize, usize)> = Vec::new();
                for &(g, share, _) in &placed[r] {
                    if seen.contains(&(g, share)) || !share_admitted(g, share) {
                        continue;
                    }
                    seen.push((g, share));
                    let v = &answers[g].as_ref().expect("admitted share")[share];
                    for (c, d) in groups[g].3[share].1.iter().zip(&v.decisions) {
                        if d.allowed {
                            // The node that charged it (its call answered, so
                            // its connection was made).
                            let node = conns[g].as_ref().unwrap_or(conn);
                            refunds.push(self.refund_one(node, c, v.now_us, d.remaining));
                        }
                    }
                }
            }
            if let Some(decisions) = decisions {
                let now_us = placed[r]
                    .iter()
                    .filter_map(|&(g, share, _)| Some(answers[g].as_ref()?[share].now_us))
                    .max()
                    .unwrap_or(0);
                verdicts.push(Verdict { decisions, now_us });
            }
        }
        for r in refunds {
            let _ = r.await;
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(verdicts),
        }
    }

    /// Gives back one tier's admission (`refund.lua`), in a task of its own:
    /// on the master's own connection that charged it (never sent twice),
    /// or, when the charge went through the cluster client or the bucket's
    /// slot has moved since (MOVED, ASK), through the refunds' cluster
    /// connection, which never retries. A refund not made leaves the client
    /// charged: less admitted, never more.
    fn refund_one(
        &self,
        node: &Conn,
        c: &Check,
        now_us: i64,
        remaining: u64,
    ) -> tokio::task::JoinHandle<()> {
        let direct = match node {
            Conn::Single(c) => Some(c.clone()),
            Conn::Cluster(_) => None,
        };
        let refunder = self.refund_conn.load().as_deref().cloned();
        let refund = self.refund.clone();
        let (kind, p1, p2) = script_args(&c.algorithm);
        let (key, cost) = (c.key.clone(), c.cost);
        tokio::spawn(async move {
            let mut inv = refund.prepare_invoke();
            inv.key(key)
                .arg(kind)
                .arg(p1)
                .arg(p2)
                .arg(now_us)
                .arg(remaining);
            inv.arg(cost);
            let moved = |e: &redis::RedisError| matches!(e.code(), Some("MOVED" | "ASK"));
            let mut r: Option<Result<i64, redis::RedisError>> = None;
            if let Some(mut c) = direct {
                r = Some(inv.invoke_async(&mut c).await);
            }
            if r.as_ref().is_none_or(|r| r.as_ref().is_err_and(moved)) {
                if let Some(mut c) = refunder {
                    r = Some(inv.invoke_async(&mut c).await);
                }
            }
            match r {
                Some(Ok(_)) => {}
                // The error's class only: its text could name the server.
                Some(Err(e)) => {
                    tracing::warn!(error_kind = ?e.kind(), code = e.code().unwrap_or("-"), "limiter: refund failed; the client stays charged")
                }
                None => {
                    tracing::warn!("limiter: no connection for a refund; the client stays charged")
                }
            }
        })
    }
}

/// A request's tiers on one node (or in one slot): (the request's index in
/// its batch, the tiers).
type Share = (usize, Vec<Check>);

/// Whether a cluster call failed because it reached a node that does not
/// serve one of its keys (a stale slot map, a slot on the move): nothing was
/// written, and the batch can be decided again slot by slot.
fn misplaced(e: &LimiterError) -> bool {
    match e {
        LimiterError::CrossSlot | LimiterError::Misplaced(..) => true,
        LimiterError::Redis(text) => ["non local key", "MOVED", "TRYAGAIN"]
            .iter()
            .any(|m| text.contains(m)),
        _ => false,
    }
}

/// One call of limiter.lua over a batch of requests: EVALSHA, and on NOSCRIPT
/// (after a restart or SCRIPT FLUSH) load the script and send it again.
/// Returns one verdict per request. `across_slots`: the buckets are in
/// several slots of one cluster node (only one is declared as a key).
async fn run_script(
    script: &redis::Script,
    clock: Option<&Arc<dyn Clock>>,
    conn: &mut Conn,
    requests: &[&[Check]],
    across_slots: bool,
    asking: bool,
) -> Result<Vec<Verdict>, LimiterError> {
    // Each bucket is named once, with its rule's parameters (a bucket's name
    // carries them, so they are the same for every tier naming it); tiers
    // refer to it by index, so the script reads and writes it once. Requests
    // with the same tiers (one client on one route) share a shape, and a
    // request is sent as its shape's index.
    let tiers: usize = requests.iter().map(|r| r.len()).sum();
    let mut buckets: Vec<&Check> = Vec::with_capacity(tiers);
    let mut index: HashMap<&str, i64> = HashMap::with_capacity(tiers);
    // Across slots (one cluster node's), the call is routed by the first
    // bucket's slot and declares every bucket of that slot: were that slot
    // on the move and the call sent on with ASK, Redis then refuses it
    // (TRYAGAIN) unless all of them have arrived, where a single declared
    // name would let the others read as empty on the node importing them.
    // The other slots' names are passed as arguments.
    let anchor = requests
        .iter()
        .flat_map(|r| r.iter())
        .next()
        .filter(|_| across_slots)
        .map(|c| slot(&c.key));
    for c in requests.iter().flat_map(|r| r.iter()) {
        if anchor.is_none_or(|a| slot(&c.key) == a) && !index.contains_key(c.key.as_str()) {
            buckets.push(c);
            index.insert(c.key.as_str(), buckets.len() as i64);
        }
    }
    let declared = buckets.len();
    // Per tier two numbers: the bucket's index (negated for a shadow tier)
    // and the request's cost there.
    let refs: Vec<[i64; 2]> = requests
        .iter()
        .flat_map(|r| r.iter())
        .map(|c| {
            let k = *index.entry(c.key.as_str()).or_insert_with(|| {
                buckets.push(c);
                buckets.len() as i64
            });
            [if c.shadow { -k } else { k }, c.cost as i64]
        })
        .collect();
    let mut shapes: Vec<&[[i64; 2]]> = Vec::new();
    let mut shape_of: HashMap<&[[i64; 2]], usize> = HashMap::new();
    let mut rest = refs.as_slice();
    let request_shapes: Vec<usize> = requests
        .iter()
        .map(|r| {
            let (own, after) = rest.split_at(r.len());
            rest = after;
            *shape_of.entry(own).or_insert_with(|| {
                shapes.push(own);
                shapes.len()
            })
        })
        .collect();
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(declared);
    for c in &buckets[..declared] {
        cmd.arg(c.key.as_str());
    }
    match clock {
        Some(clock) => cmd.arg(clock.now_us()),
        None => cmd.arg(""),
    };
    cmd.arg(requests.len())
        .arg(shapes.len())
        .arg(buckets.len() - declared);
    for c in &buckets[declared..] {
        cmd.arg(c.key.as_str());
    }
    for c in &buckets {
        let (kind, p1, p2) = script_args(&c.algorithm);
        cmd.arg(kind).arg(p1).arg(p2);
    }
    for shape in &shapes {
        cmd.arg(shape.len());
        for [k, cost] in shape.iter() {
            cmd.arg(*k).arg(*cost);
        }
    }
    for q in request_shapes {
        cmd.arg(q);
    }
    let reply: Vec<i64> = match send(conn, &cmd, asking).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            match conn {
                Conn::Single(c) => script.load_async(c).await,
                Conn::Cluster(c) => script.load_async(c).await,
            }
            .map_err(redis_err)?;
            send(conn, &cmd, asking).await
        }
        other => other,
    }
    .map_err(redis_err)?;
    // Two integers per tier, three for a leaky bucket (its delay), then `now`.
    let expected = 1 + requests
        .iter()
        .flat_map(|r| r.iter())
        .map(|c| reply_width(&c.algorithm))
        .sum::<usize>();
    if reply.len() != expected {
        return Err(LimiterError::BadReply(format!(
            "{} integers for {} tiers (expected {})",
            reply.len(),
            tiers,
            expected
        )));
    }
    let now_us = reply[expected - 1];
    let mut at = 0;
    Ok(requests
        .iter()
        .map(|r| Verdict {
            decisions: r
                .iter()
                .map(|c| {
                    let w = reply_width(&c.algorithm);
                    let d = decision(c, &reply[at..at + w]);
                    at += w;
                    d
                })
                .collect(),
            now_us,
        })
        .collect())
}

/// `cmd`, after `ASKING` when `asking` (sent together, so nothing else on
/// the multiplexed connection comes between them).
async fn send(conn: &mut Conn, cmd: &redis::Cmd, asking: bool) -> redis::RedisResult<Vec<i64>> {
    if !asking {
        return query(conn, cmd).await;
    }
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").ignore().add_command(cmd.clone());
    let (reply,): (Vec<i64>,) = match conn {
        Conn::Single(c) => pipe.query_async(c).await?,
        Conn::Cluster(c) => pipe.query_async(c).await?,
    };
    Ok(reply)
}

async fn query<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    match conn {
        Conn::Single(c) => cmd.query_async(c).await,
        Conn::Cluster(c) => cmd.query_async(c).await,
    }
}

/// The script's numeric code for an algorithm and its two parameters, written
/// so Lua's `tonumber` reads back exactly the f64 Rust holds.
fn script_args(alg: &Algorithm) -> (u8, String, String) {
    match *alg {
        Algorithm::TokenBucket {
            capacity,
            refill_per_sec,
        } => (1, capacity.to_string(), format!("{refill_per_sec:?}")),
        Algorithm::LeakyBucket {
            rate_per_sec,
            max_delay_ms,
        } => (2, format!("{rate_per_sec:?}"), max_delay_ms.to_string()),
        Algorithm::FixedWindow { limit, window_secs } => {
            (3, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingWindow { limit, window_secs } => {
            (4, limit.to_string(), window_secs.to_string())
        }
        Algorithm::SlidingLog { limit, window_secs } => {
            (5, limit.to_string(), window_secs.to_string())
        }
    }
}

/// How many integers limiter.lua returns for a tier of this algorithm.
fn reply_width(alg: &Algorithm) -> usize {
    if matches!(alg, Algorithm::LeakyBucket { .. }) {
        3
    } else {
        2
    }
}

/// One tier's integers: remaining (-1: rejected), reset_after_us (when
/// rejected, the retry time), and for a leaky bucket delay_us.
fn decision(c: &Check, r: &[i64]) -> Decision {
    let allowed = r[0] >= 0;
    let reset = r[1].max(0) as u64;
    Decision {
        allowed,
        limit: quota(&c.algorithm),
        remaining: r[0].max(0) as u64,
        retry_after_us: if allowed { 0 } else { reset },
        reset_after_us: reset,
        delay_us: r.get(2).map_or(0, |&d| d.max(0) as u64),
    }
}

impl Inner {
    /// Waits for a call sent now: within the budget, its answer; past it the
    /// watchdog is told, and the call is awaited until it answers, the
    /// breaker opens (`abandon`) or `max_wait` has passed.
    async fn answer<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, LimiterError>>,
        abandon: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<T, LimiterError> {
        tokio::pin!(work);
        let sent = Instant::now();
        if let Ok(r) = tokio::time::timeout(self.budget, &mut work).await {
            return r;
        }
        // Late: the watchdog asks Redis again every budget while it stays so
        // (a Redis that stalls right after answering one PING is still caught).
        let give_up = tokio::time::sleep_until((sent + self.max_wait).into());
        tokio::pin!(give_up);
        loop {
            self.late.notify_one();
            tokio::select! {
                r = &mut work => return r,
                _ = abandon.changed() => return Err(LimiterError::Abandoned),
                _ = &mut give_up => {
                    return Err(LimiterError::Timeout(self.max_wait.as_millis() as u64));
                }
                _ = tokio::time::sleep(self.budget) => {}
            }
        }
    }

    /// `work`'s result, or the budget's timeout error once `until` has passed.
    async fn by<T>(
        &self,
        until: Instant,
        work: impl std::future::Future<Output = Result<T, LimiterError>>,
    ) -> Result<T, LimiterError> {
        match tokio::time::timeout_at(until.into(), work).await {
            Ok(r) => r,
            Err(_) => Err(LimiterError::Timeout(self.budget.as_millis() as u64)),
        }
    }
}

impl Decider for Inner {
    async fn decide_batch(
        &self,
        requests: &[&[Check]],
        abandon: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<Vec<Verdict>, LimiterError> {
        let mut conn = self.connection()?;
        if let Conn::Cluster(_) = conn {
            let call = self.decide_clustered(&conn, requests);
            return self.answer(call, abandon).await;
        }
        let call = run_script(
            &self.script,
            self.clock.as_ref(),
            &mut conn,
            requests,
            false,
            false,
        );
        self.answer(call, abandon).await
    }

    fn abandoned(&self) -> tokio::sync::watch::Receiver<u64> {
        self.abandon.subscribe()
    }
}

#[async_trait]
impl Backend for RedisBackend {
    async fn decide(&self, checks: &[Check]) -> Result<Verdict, LimiterError> {
        self.decide_shared(checks.into(), self.epoch()).await
    }
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn cluster_slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("{}foo"), slot("{}foo"));
    }
}
