//! An issuer's JWKS endpoint, kept: fetched at start, again every
//! `jwks_refresh_secs`, and on a token naming a `kid` the set lacks (at
//! most once per `jwks_min_refetch_secs`, one fetch for every request that
//! waits on it). While the endpoint cannot be reached the last keys serve,
//! for `jwks_max_stale_secs` after they were fetched.
//!
//! Sources are process-wide (`source_for`): a reload that keeps an issuer's
//! endpoint keeps its keys, with no gap and no second fetch.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use tokio_rustls::TlsConnector;

use super::fetch::{self, Target};
use super::keys::KeySet;
use crate::config::JwksUrl;

pub struct Source {
    pub settings: JwksUrl,
    /// The `iss` of the (first) issuer using it, for logs and metrics.
    pub issuer: String,
    target: Option<Target>,
    keys: ArcSwap<KeySet>,
    state: Mutex<State>,
    /// Held across a fetch: whoever comes next finds it done.
    fetching: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct State {
    /// When the keys in force were fetched (`None`: never).
    fetched_at: Option<Instant>,
    /// When a fetch was last tried, and how many failed in a row since the
    /// last success.
    tried_at: Option<Instant>,
    failures: u32,
}

/// Why an issuer's keys cannot be used now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// Never fetched yet (the gateway just started, or the endpoint has
    /// not answered since).
    NotYet,
    /// Fetched longer ago than `jwks_max_stale_secs`.
    Stale,
}

impl Source {
    fn new(settings: JwksUrl, issuer: &str) -> Source {
        Source {
            target: Target::parse(&settings.url).ok(),
            settings,
            issuer: issuer.to_string(),
            keys: ArcSwap::from_pointee(KeySet::default()),
            state: Mutex::new(State::default()),
            fetching: tokio::sync::Mutex::new(()),
        }
    }

    /// The keys in force, unless too old or never fetched.
    pub fn keys(&self, now: Instant) -> Result<Arc<KeySet>, Unusable> {
        let fetched = self.state.lock().fetched_at.ok_or(Unusable::NotYet)?;
        if now.duration_since(fetched) > Duration::from_secs(self.settings.max_stale_secs) {
            return Err(Unusable::Stale);
        }
        Ok(self.keys.load_full())
    }

    /// Whether the periodic refresh should fetch now: `jwks_refresh_secs`
    /// after the last success, sooner (1 s doubling, up to that) after a
    /// failure.
    pub fn due(&self, now: Instant) -> bool {
        let s = self.state.lock();
        let Some(tried) = s.tried_at else { return true };
        let every = Duration::from_secs(self.settings.refresh_secs);
        let wait = match s.failures {
            0 => every,
            n => Duration::from_secs(1 << n.min(16)).min(every),
        };
        now.duration_since(tried) >= wait
    }

    /// Fetches again because a token named a `kid` the set lacks (or keys
    /// are missing): once per `jwks_min_refetch_secs`. A caller arriving
    /// while a fetch runs (the start-up one, a refresh, another caller's)
    /// waits for it and uses what it brought, rather than starting another
    /// or giving up before it lands.
    pub async fn refetch(&self) {
        let min = Duration::from_secs(self.settings.min_refetch_secs);
        let _turn = self.fetching.lock().await;
        let recent = self
            .state
            .lock()
            .tried_at
            .is_some_and(|t| t.elapsed() < min);
        if !recent {
            self.fetch_now().await;
        }
    }

    /// The periodic refresh's fetch.
    pub async fn refresh(&self) {
        let _turn = self.fetching.lock().await;
        if self.due(Instant::now()) {
            self.fetch_now().await;
        }
    }

    async fn fetch_now(&self) {
        let started = Instant::now();
        self.state.lock().tried_at = Some(started);
        let result = tokio::time::timeout(
            Duration::from_millis(self.settings.timeout_ms),
            self.fetch_keys(),
        )
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", self.settings.timeout_ms)));
        let mut s = self.state.lock();
        match result {
            Ok((set, skipped)) => {
                for why in &skipped {
                    tracing::warn!(issuer = %self.issuer, url = %self.settings.url, "jwks: a key left out: {why}");
                }
                let changed = !same_kids(&self.keys.load(), &set);
                if changed || s.failures > 0 || s.fetched_at.is_none() {
                    tracing::info!(issuer = %self.issuer, url = %self.settings.url, keys = set.len(), "jwks: keys fetched");
                }
                crate::metrics::jwks_fetched(&self.issuer, true, set.len());
                self.keys.store(Arc::new(set));
                s.fetched_at = Some(started);
                s.failures = 0;
            }
            Err(e) => {
                s.failures = s.failures.saturating_add(1);
                let age = s.fetched_at.map(|t| t.elapsed().as_secs());
                crate::metrics::jwks_fetched(&self.issuer, false, self.keys.load().len());
                // Once per failure streak is enough to say it; the metric counts them all.
                if s.failures == 1 {
                    tracing::warn!(
                        issuer = %self.issuer,
                        url = %self.settings.url,
                        keys_age_secs = ?age,
                        max_stale_secs = self.settings.max_stale_secs,
                        "jwks: fetch failed, the last keys serve: {e}"
                    );
                }
            }
        }
    }

    async fn fetch_keys(&self) -> Result<(KeySet, Vec<String>), String> {
        let target = self.target.as_ref().ok_or("not a valid URL")?;
        let tls = match target.https {
            true => Some(connector(self.settings.ca_file.as_deref())?),
            false => None,
        };
        let body = fetch::get(target, tls.as_ref()).await?;
        let (set, skipped) = KeySet::from_jwks(&body)?;
        if set.is_empty() {
            return Err(format!(
                "no signing key in the set ({})",
                skipped.join("; ")
            ));
        }
        Ok((set, skipped))
    }
}

fn same_kids(a: &KeySet, b: &KeySet) -> bool {
    a.len() == b.len() && b.kids().all(|k| a.has_kid(k))
}

/// The TLS settings of an `https` endpoint, made once per CA file.
fn connector(ca: Option<&std::path::Path>) -> Result<TlsConnector, String> {
    static MADE: OnceLock<Mutex<HashMap<Option<std::path::PathBuf>, TlsConnector>>> =
        OnceLock::new();
    let made = MADE.get_or_init(Default::default);
    let key = ca.map(|p| p.to_path_buf());
    if let Some(c) = made.lock().get(&key) {
        return Ok(c.clone());
    }
    let c = fetch::tls_connector(ca)?;
    made.lock().insert(key, c.clone());
    Ok(c)
}

type Registry = Mutex<HashMap<JwksUrl, Weak<Source>>>;

fn registry() -> &'static Registry {
    static SOURCES: OnceLock<Registry> = OnceLock::new();
    SOURCES.get_or_init(Default::default)
}

/// The process's source for these settings: the one already kept (with its
/// keys) if any config still uses it, else a new one.
pub fn source_for(settings: &JwksUrl, issuer: &str) -> Arc<Source> {
    let mut sources = registry().lock();
    sources.retain(|_, s| s.strong_count() > 0);
    if let Some(s) = sources.get(settings).and_then(Weak::upgrade) {
        return s;
    }
    let s = Arc::new(Source::new(settings.clone(), issuer));
    sources.insert(settings.clone(), Arc::downgrade(&s));
    s
}

/// Every source some config uses.
pub fn live_sources() -> Vec<Arc<Source>> {
    registry()
        .lock()
        .values()
        .filter_map(Weak::upgrade)
        .collect()
}

/// Keeps every source fresh until `stop` resolves: a due source is fetched
/// (each on a task of its own, so one slow endpoint delays no other).
pub async fn keep_fresh(stop: impl std::future::Future<Output = ()>) {
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            () = &mut stop => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        for s in live_sources() {
            if s.due(now) && s.fetching.try_lock().is_ok() {
                tokio::spawn(async move { s.refresh().await });
            }
        }
    }
}
