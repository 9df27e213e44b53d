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
use crate::config::{self, Config};
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
}

fn digest(path: &PathBuf) -> std::io::Result<[u8; 32]> {
    std::fs::read(path).map(|b| Sha256::digest(&b).into())
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
    fn reload(&self, why: &str) -> bool {
        match config::load(&self.path) {
            Ok(new) => {
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
                self.limiter.set_quotas(new.has_quotas());
                let gates = Gates::build(&new, Some(&current.gates), self.limiter.replicas());
                self.live.store(Arc::new(Live::new(
                    Arc::new(Policy::new(new)),
                    pools,
                    Arc::new(gates),
                )));
                metrics::config_reload(true);
                tracing::info!(trigger = why, path = %self.path.display(), "config reloaded");
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
        (
            "limiter.local_max_entries",
            l0.local_max_entries != l1.local_max_entries,
        ),
        ("limiter.leases", l0.leases != l1.leases),
        (
            "limiter.quota_retention_days",
            l0.quota_retention_days != l1.quota_retention_days,
        ),
        ("redis", old.redis != new.redis),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// One watched file: its content's digest as last acted on, and a change
/// seen once and waiting to be stable.
struct Watch {
    path: Option<PathBuf>,
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
        let path = path.cloned();
        let seen = path.as_ref().and_then(|p| digest(p).ok());
        Watch {
            path,
            seen,
            pending: None,
            unreadable: None,
        }
    }

    fn seen_now(&mut self) {
        self.seen = self.path.as_ref().and_then(|p| digest(p).ok());
        self.pending = None;
    }

    /// Polled: `Changed` once new content has stayed the same for one poll
    /// (debounce: an editor or a symlink swap may write in steps).
    fn poll(&mut self) -> Polled {
        let Some(path) = &self.path else {
            return Polled::Same;
        };
        let d = match digest(path) {
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
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    if self.reload("SIGHUP") {
                        self.reloaded().await;
                    }
                    self.reload_password("SIGHUP");
                    config.seen_now();
                    password.seen_now();
                }
                _ = tokio::time::sleep(POLL) => {
                    match config.poll() {
                        Polled::Changed => {
                            if self.reload("file change") {
                                self.reloaded().await;
                            }
                        }
                        Polled::Unreadable(e) => tracing::warn!(
                            file = %self.path.display(),
                            error = %e,
                            "config file cannot be read; the running config stays in use until it can"
                        ),
                        Polled::Same => {}
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
