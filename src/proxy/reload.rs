//! Hot reload: on SIGHUP and when the config file's content changes (polled,
//! so it also sees Kubernetes' symlink swaps), load, validate and swap.
//!
//! An invalid file changes nothing: the running snapshot keeps serving and the
//! error is logged with its key paths and counted. Requests in flight keep the
//! snapshot they started with. Keys that only take effect at start-up are
//! named in a warning when they change.

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
use crate::metrics;

const POLL: Duration = Duration::from_millis(500);

pub struct Reloader {
    pub path: PathBuf,
    pub live: Arc<ArcSwap<Live>>,
    /// The config the process started with: what restart-only keys are compared to.
    pub started_with: Arc<Config>,
}

fn digest(path: &PathBuf) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

impl Reloader {
    fn reload(&self, why: &str) {
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
                            return;
                        }
                    }
                };
                for key in restart_only_changes(&self.started_with, &new) {
                    tracing::warn!(
                        key,
                        "config reload: this key changed but takes effect only after a restart"
                    );
                }
                self.live
                    .store(Arc::new(Live::new(Arc::new(Policy::new(new)), pools)));
                metrics::config_reload(true);
                tracing::info!(trigger = why, path = %self.path.display(), "config reloaded");
            }
            Err(e) => {
                metrics::config_reload(false);
                tracing::error!(
                    trigger = why,
                    "config reload failed; the running config keeps serving: {e}"
                );
            }
        }
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
        ("redis", old.redis != new.redis),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
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
        let mut seen = digest(&self.path);
        let mut pending: Option<[u8; 32]> = None;
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    self.reload("SIGHUP");
                    seen = digest(&self.path);
                    pending = None;
                }
                _ = tokio::time::sleep(POLL) => {
                    // Debounce: act once the new content is stable for one poll.
                    let now = digest(&self.path);
                    match (now, pending) {
                        (Some(d), Some(p)) if d == p && Some(d) != seen => {
                            self.reload("file change");
                            seen = Some(d);
                            pending = None;
                        }
                        (Some(d), _) if Some(d) != seen => pending = Some(d),
                        _ => pending = None,
                    }
                }
            }
        }
    }
}
