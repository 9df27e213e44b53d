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
    let mut changed = Vec::new();
    let (a, b) = (&old.server, &new.server);
    if a.listen != b.listen {
        changed.push("server.listen");
    }
    if a.admin_listen != b.admin_listen {
        changed.push("server.admin_listen");
    }
    if a.threads != b.threads {
        changed.push("server.threads");
    }
    if a.grace_period_secs != b.grace_period_secs {
        changed.push("server.grace_period_secs");
    }
    if a.header_read_timeout_ms != b.header_read_timeout_ms {
        changed.push("server.header_read_timeout_ms");
    }
    let (a, b) = (&old.limiter, &new.limiter);
    if a.backend != b.backend {
        changed.push("limiter.backend");
    }
    if a.on_redis_failure != b.on_redis_failure {
        changed.push("limiter.on_redis_failure");
    }
    if a.instances != b.instances {
        changed.push("limiter.instances");
    }
    if a.local_max_entries != b.local_max_entries {
        changed.push("limiter.local_max_entries");
    }
    if old.redis != new.redis {
        changed.push("redis");
    }
    changed
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
