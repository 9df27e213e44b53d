//! Hot reload: on SIGHUP and when the config file's content changes (polled,
//! so it also sees Kubernetes' symlink swaps), load, validate and swap.
//!
//! An invalid file changes nothing: the running snapshot keeps serving and the
//! error is logged with its key paths and counted. Requests in flight keep the
//! snapshot they started with. Keys that only take effect at start-up are
//! named in a warning when they change.
//!
//! `redis.password_file` is watched the same way (and re-read on SIGHUP): a
//! rotated secret reaches the next Redis connections without a restart.
//!
//! `[auth.jwt]` key files are watched too (by their digest): a change
//! reloads the config, and with it the issuers' keys.
//! `clients.api_keys_file` is part of the config: a change to it reloads
//! the config, and a bad line refuses the reload like any bad key. It may
//! hold a million keys, so it is watched by its metadata (size, times,
//! inode), not its digest, and every load runs on a thread of its own at
//! idle priority: serving keeps the cores while a second of parsing goes
//! on beside it. The key set replaced is dropped here, not on a
//! request's thread.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use sha2::{Digest, Sha256};
use tokio::signal::unix::{signal, SignalKind};

use super::upstreams::Pools;
use super::Live;
use crate::admission::Policy;
use crate::config::Config;
use crate::identity::apikeys::KeySet;
use crate::identity::credentials::{self, Credentials};
use crate::inflight::Gates;
use crate::limiter::Fallback;
use crate::metrics;

const POLL: Duration = Duration::from_millis(500);

pub struct Reloader {
    pub path: PathBuf,
    pub live: Arc<ArcSwap<Live>>,
    /// The config the process started with: what restart-only keys are compared to.
    pub started_with: Arc<Config>,
    pub limiter: Arc<Fallback>,
    /// Key sets replaced, freed once no request holds them.
    pub retired: parking_lot::Mutex<Vec<Arc<KeySet>>>,
    pub loader: Loader,
}

/// A small file's identity: its content's digest.
fn digest(path: &PathBuf) -> std::io::Result<[u8; 32]> {
    std::fs::read(path).map(|b| Sha256::digest(&b).into())
}

/// A large file's identity: its metadata (following a symlink swap).
fn metadata(path: &PathBuf) -> std::io::Result<[u8; 32]> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    let mut h = Sha256::new();
    for n in [
        m.dev(),
        m.ino(),
        m.len(),
        m.mtime() as u64,
        m.mtime_nsec() as u64,
    ] {
        h.update(n.to_le_bytes());
    }
    h.update((m.ctime() as u64).to_le_bytes());
    h.update((m.ctime_nsec() as u64).to_le_bytes());
    Ok(h.finalize().into())
}

/// A load for the loading thread: the config's path, and where to answer.
type Job = (
    PathBuf,
    tokio::sync::oneshot::Sender<Result<(Config, Credentials), String>>,
);

/// One thread for every reload, at idle priority (Linux's scheduling is
/// per thread): serving keeps the cores while a million keys are parsed
/// beside it.
pub struct Loader(std::sync::mpsc::Sender<Job>);

impl Loader {
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("config-load".into())
            .spawn(move || {
                // SCHED_IDLE: it runs only on a core nothing else wants,
                // and a request's thread preempts it at once. Best effort:
                // a failure leaves it at the default priority.
                use thread_priority::unix::*;
                if let Err(e) = set_thread_priority_and_policy(
                    thread_native_id(),
                    thread_priority::ThreadPriority::Min,
                    ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
                ) {
                    tracing::warn!(error = ?e, "the config-load thread keeps the default priority");
                }
                for (path, reply) in rx {
                    let _ = reply.send(
                        credentials::load(&path, None, credentials::Files::Required)
                            .map_err(|e| e.to_string()),
                    );
                }
            })?;
        Ok(Loader(tx))
    }

    async fn load(&self, path: PathBuf) -> Result<(Config, Credentials), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0
            .send((path, tx))
            .map_err(|_| "the loading thread has stopped".to_string())?;
        rx.await
            .map_err(|_| "the loading thread ended without an answer".to_string())?
    }
}

impl Reloader {
    /// The password file the running Redis backend reads, if any.
    fn password_file(&self) -> Option<&PathBuf> {
        self.started_with.redis.as_ref()?.password_file.as_ref()
    }

    fn reload_password(&self, why: &str) {
        match self.limiter.reload_redis_password() {
            Ok(true) => tracing::info!(
                trigger = why,
                "redis.password_file changed: new Redis connections use the new password"
            ),
            Ok(false) => {}
            // The error names the file, never its content.
            Err(e) => {
                tracing::error!(trigger = why, error = %e, "redis.password_file reload failed; the old password stays in use")
            }
        }
    }

    /// Loads the file and swaps it in; whether it was.
    async fn reload(&self, why: &str) -> bool {
        match self.loader.load(self.path.clone()).await {
            Ok((new, credentials)) => {
                let new = Arc::new(new);
                let current = self.live.load_full();
                // Keep the pools (and their health state) unless the upstreams changed.
                let pools = if current.pools.source == new.upstreams {
                    current.pools.clone()
                } else {
                    match Pools::build(&new.upstreams) {
                        Ok(p) => Arc::new(p),
                        Err(e) => {
                            tracing::error!(trigger = why, error = %e, "config reload failed; the running config keeps serving");
                            metrics::config_reload(false);
                            return false;
                        }
                    }
                };
                for key in restart_only_changes(&self.started_with, &new) {
                    tracing::warn!(
                        key,
                        "config reload: this key changed but takes effect only after a restart"
                    );
                }
                let policy = Policy::new(new.clone(), &credentials)
                    .with_runtime_keys(current.policy.runtime.clone());
                drop(credentials);
                self.limiter.set_quotas(policy.has_quotas());
                self.retired.lock().push(current.policy.keys.clone());
                let keys = policy.keys.len();
                let gates = Gates::build(&new, Some(&current.gates), self.limiter.replicas());
                self.live.store(Arc::new(Live::new(
                    Arc::new(policy),
                    pools,
                    Arc::new(gates),
                )));
                metrics::config_reload(true);
                metrics::api_keys(keys);
                tracing::info!(trigger = why, path = %self.path.display(), keys, "config reloaded");
                true
            }
            Err(e) => {
                metrics::config_reload(false);
                tracing::error!(
                    trigger = why,
                    "config reload failed; the running config keeps serving: {e}"
                );
                false
            }
        }
    }

    /// The keys file the live config reads, if any.
    fn keys_file(&self) -> Option<PathBuf> {
        self.live.load().policy.config.clients.api_keys_file.clone()
    }

    /// The `[auth.jwt]` key files the live config reads, each watched.
    fn jwt_key_files(&self) -> Vec<Watch> {
        let live = self.live.load();
        let issuers = live.policy.config.jwt.iter().flat_map(|j| j.issuers.iter());
        issuers
            .flat_map(|i| match &i.keys {
                crate::config::JwtKeys::Files { paths, .. } => paths.clone(),
                crate::config::JwtKeys::Url(_) => Vec::new(),
            })
            .map(|p| Watch::new(Some(&p)))
            .collect()
    }

    /// Drops the key sets no request holds any more.
    fn drop_retired(&self) {
        let done: Vec<Arc<KeySet>> = {
            let mut r = self.retired.lock();
            let (done, kept) = r.drain(..).partition(|k| Arc::strong_count(k) == 1);
            *r = kept;
            done
        };
        if !done.is_empty() {
            let keys: usize = done.iter().map(|k| k.len()).sum();
            // Here, not on the idle loader: unmapping holds the process's
            // memory map lock, which a thread of idle priority could hold
            // while serving threads wait to fault a page in.
            drop(done);
            tracing::debug!(keys, "the key sets reloads replaced are freed");
        }
    }

    /// After a reload: the leases taken under the old rules go back (a
    /// rule that changed names other buckets, whose leases no request
    /// would spend again).
    async fn reloaded(&self) {
        self.limiter
            .release_leases(false, std::time::Duration::from_secs(1))
            .await;
    }
}

/// Keys read once at start-up (listeners, runtime, limiter backend).
fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let (s0, s1) = (&old.server, &new.server);
    let (l0, l1) = (&old.limiter, &new.limiter);
    [
        ("server.listen", s0.listen != s1.listen),
        ("server.admin_listen", s0.admin_listen != s1.admin_listen),
        ("server.threads", s0.threads != s1.threads),
        (
            "server.grace_period_secs",
            s0.grace_period_secs != s1.grace_period_secs,
        ),
        (
            "server.header_read_timeout_ms",
            s0.header_read_timeout_ms != s1.header_read_timeout_ms,
        ),
        ("server.h2c", s0.h2c != s1.h2c),
        // The listeners and which files: the files' contents reload live.
        ("server.tls", s0.tls != s1.tls),
        (
            "server.startup_redis_wait_ms",
            s0.startup_redis_wait_ms != s1.startup_redis_wait_ms,
        ),
        ("limiter.backend", l0.backend != l1.backend),
        (
            "limiter.on_redis_failure",
            l0.on_redis_failure != l1.on_redis_failure,
        ),
        ("limiter.instances", l0.instances != l1.instances),
        ("admin.top", old.admin.top != new.admin.top),
        (
            "limiter.local_max_entries",
            l0.local_max_entries != l1.local_max_entries,
        ),
        ("limiter.leases", l0.leases != l1.leases),
        // Every replica must cut a bucket alike: a fraction changed on one
        // reads the others' pool under another capacity.
        ("limiter.shares", l0.shares != l1.shares),
        (
            "limiter.quota_retention_days",
            l0.quota_retention_days != l1.quota_retention_days,
        ),
        ("redis", old.redis != new.redis),
        (
            "clients.runtime_keys_snapshot",
            old.clients.runtime_keys_snapshot != new.clients.runtime_keys_snapshot,
        ),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// One watched file: its content's digest as last acted on, and a change
/// seen once and waiting to be stable.
struct Watch {
    path: Option<PathBuf>,
    /// How the file is told apart: `digest` or `metadata`.
    identity: fn(&PathBuf) -> std::io::Result<[u8; 32]>,
    seen: Option<[u8; 32]>,
    pending: Option<[u8; 32]>,
    /// Why the file could not be read at the last poll (said once).
    unreadable: Option<String>,
}

/// What a poll found.
enum Polled {
    Same,
    /// New content, stable for one poll.
    Changed,
    /// The file was readable and is not now (deleted, or its permissions
    /// changed): said once, until it is readable again.
    Unreadable(String),
}

impl Watch {
    fn new(path: Option<&PathBuf>) -> Self {
        Self::by(path, digest)
    }

    fn by(path: Option<&PathBuf>, identity: fn(&PathBuf) -> std::io::Result<[u8; 32]>) -> Self {
        let path = path.cloned();
        let seen = path.as_ref().and_then(|p| identity(p).ok());
        Watch {
            path,
            identity,
            seen,
            pending: None,
            unreadable: None,
        }
    }

    fn seen_now(&mut self) {
        self.seen = self.path.as_ref().and_then(|p| (self.identity)(p).ok());
        self.pending = None;
    }

    /// Polled: `Changed` once new content has stayed the same for one poll
    /// (debounce: an editor or a symlink swap may write in steps).
    fn poll(&mut self) -> Polled {
        let Some(path) = &self.path else {
            return Polled::Same;
        };
        let d = match (self.identity)(path) {
            Ok(d) => {
                self.unreadable = None;
                d
            }
            Err(e) => {
                self.pending = None;
                let why = e.to_string();
                if self.unreadable.as_ref() == Some(&why) {
                    return Polled::Same;
                }
                self.unreadable = Some(why.clone());
                return Polled::Unreadable(why);
            }
        };
        match self.pending {
            Some(p) if d == p && Some(d) != self.seen => {
                self.seen = Some(d);
                self.pending = None;
                Polled::Changed
            }
            _ if Some(d) != self.seen => {
                self.pending = Some(d);
                Polled::Same
            }
            _ => {
                self.pending = None;
                Polled::Same
            }
        }
    }
}

#[async_trait]
impl BackgroundService for Reloader {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGHUP; file watching still reloads");
                None
            }
        };
        let mut config = Watch::new(Some(&self.path));
        let mut password = Watch::new(self.password_file());
        let mut keys = Watch::by(self.keys_file().as_ref(), metadata);
        let mut jwt_keys = self.jwt_key_files();
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    if self.reload("SIGHUP").await {
                        self.reloaded().await;
                    }
                    self.reload_password("SIGHUP");
                    config.seen_now();
                    password.seen_now();
                    keys = Watch::by(self.keys_file().as_ref(), metadata);
                    jwt_keys = self.jwt_key_files();
                }
                _ = tokio::time::sleep(POLL) => {
                    self.drop_retired();
                    // Every JWT key file polled (each keeps its own debounce).
                    let mut jwt_changed = false;
                    for w in &mut jwt_keys {
                        jwt_changed |= matches!(w.poll(), Polled::Changed);
                    }
                    let reloaded = match (config.poll(), keys.poll()) {
                        (Polled::Changed, _) => Some(self.reload("file change").await),
                        (_, Polled::Changed) => Some(self.reload("api_keys_file change").await),
                        _ if jwt_changed => Some(self.reload("auth.jwt key file change").await),
                        (c, k) => {
                            if let Polled::Unreadable(e) = c {
                                tracing::warn!(
                                    file = %self.path.display(),
                                    error = %e,
                                    "config file cannot be read; the running config stays in use until it can"
                                );
                            }
                            if let Polled::Unreadable(e) = k {
                                tracing::warn!(
                                    file = %self.keys_file().map_or(String::new(), |p| p.display().to_string()),
                                    error = %e,
                                    "clients.api_keys_file cannot be read; the keys read last stay in use until it can"
                                );
                            }
                            None
                        }
                    };
                    if let Some(ok) = reloaded {
                        if ok {
                            self.reloaded().await;
                        }
                        // The keys files the config now names, as they are now.
                        config.seen_now();
                        keys = Watch::by(self.keys_file().as_ref(), metadata);
                        jwt_keys = self.jwt_key_files();
                    }
                    match password.poll() {
                        Polled::Changed => self.reload_password("file change"),
                        Polled::Unreadable(e) => tracing::warn!(
                            file = %self.password_file().map_or(String::new(), |p| p.display().to_string()),
                            error = %e,
                            "redis.password_file cannot be read; the password read last stays in use until it can"
                        ),
                        Polled::Same => {}
                    }
                }
            }
        }
    }
}
