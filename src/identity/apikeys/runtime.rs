//! API keys issued at runtime (`/keys` on the admin listener, `gateway
//! keys`): kept in Redis (`limiter::redis::apikeys`), mirrored in every
//! replica by `sync`, and looked up after the config's keys.
//!
//! Each replica reads the whole hash once, then the changes' stream every
//! `POLL`: a key issued or revoked through any replica is in force on all
//! of them within that. While Redis cannot be read, a replica keeps the
//! last set it read; it keeps that set on disk too (`snapshot`), and a
//! replica that starts while Redis does not answer serves the set the file
//! holds until Redis does, when the whole hash replaces it.
//! A record's plan is checked when a request uses it, against the config
//! in force then: a key whose plan a reload removed is refused, never
//! served unlimited.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use super::file::{parse_record, Checked};
use super::snapshot::{self, Snapshot};
use super::store;
use super::KeyRef;
use crate::limiter::RedisBackend;

/// How often a replica reads the changes.
pub const POLL: Duration = Duration::from_millis(200);

/// Records read per page of the whole hash, and changes per read.
const PAGE: usize = 5_000;

/// One key issued at runtime.
#[derive(Debug)]
pub struct RuntimeKey(pub Checked);

impl RuntimeKey {
    pub fn view(&self) -> KeyRef<'_> {
        let k = &self.0;
        KeyRef {
            id: &k.id,
            plan: &k.plan,
            quotas: k.quotas.as_deref(),
            burst: k.burst,
        }
    }
}

#[derive(Default)]
struct State {
    by_digest: HashMap<[u8; 32], Arc<RuntimeKey>>,
    by_id: HashMap<String, [u8; 32]>,
}

impl State {
    fn remove(&mut self, id: &str) {
        if let Some(d) = self.by_id.remove(id) {
            self.by_digest.remove(&d);
        }
    }

    fn put(&mut self, k: Checked) {
        self.remove(&k.id);
        self.by_id.insert(k.id.clone(), k.digest);
        self.by_digest.insert(k.digest, Arc::new(RuntimeKey(k)));
    }
}

/// This replica's copy of the runtime keys.
#[derive(Default)]
pub struct RuntimeKeys {
    state: RwLock<State>,
    /// Counts the changes, so the snapshot is written only after one.
    changes: std::sync::atomic::AtomicU64,
}

impl RuntimeKeys {
    pub fn get(&self, digest: &[u8; 32]) -> Option<Arc<RuntimeKey>> {
        self.state.read().by_digest.get(digest).cloned()
    }

    pub fn by_id(&self, id: &str) -> Option<Arc<RuntimeKey>> {
        let s = self.state.read();
        s.by_digest.get(s.by_id.get(id)?).cloned()
    }

    pub fn len(&self) -> usize {
        self.state.read().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `id` as Redis now holds it (`None`: revoked).
    pub fn apply(&self, id: &str, record: Option<Checked>) {
        let mut s = self.state.write();
        match record {
            Some(k) => s.put(k),
            None => s.remove(id),
        }
        self.changed();
    }

    fn replace_all(&self, keys: Vec<Checked>) {
        let mut fresh = State::default();
        for k in keys {
            fresh.put(k);
        }
        *self.state.write() = fresh;
        self.changed();
    }

    fn changed(&self) {
        self.changes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn change_count(&self) -> u64 {
        self.changes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every key, sorted by id.
    fn all(&self) -> Vec<Checked> {
        let mut keys: Vec<Checked> = self
            .state
            .read()
            .by_digest
            .values()
            .map(|k| k.0.clone())
            .collect();
        keys.sort_by(|a, b| a.id.cmp(&b.id));
        keys
    }
}

/// Keeps `store`'s set in the snapshot file: written after a change, at
/// most once every `snapshot::EVERY`.
struct Keeper {
    snapshot: Option<Snapshot>,
    /// The change count the file holds.
    written: u64,
    last: Option<std::time::Instant>,
    failing: bool,
}

impl Keeper {
    /// At start: if Redis does not answer, the file's set.
    fn load(&mut self, store: &RuntimeKeys) {
        let Some(snap) = &self.snapshot else { return };
        match snap.read() {
            Ok(Some((keys, written_at))) => {
                let age = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs())
                    .saturating_sub(written_at);
                let n = keys.len();
                store.replace_all(keys);
                self.written = store.change_count();
                tracing::warn!(keys = n, age_secs = age, file = %snap.path.display(), "runtime API keys read from this replica's snapshot: Redis does not answer; keys revoked since it was written are served until it does");
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(file = %snap.path.display(), error = %e, "the runtime API keys' snapshot is not read");
            }
        }
    }

    /// Writes the set if it changed since the file was written (`now`: at
    /// shutdown, however soon after the last write).
    async fn keep(&mut self, store: &RuntimeKeys, now: bool) {
        let Some(snap) = &self.snapshot else { return };
        let count = store.change_count();
        let due = self.last.is_none_or(|t| t.elapsed() >= snapshot::EVERY);
        if count == self.written || !(due || now) {
            return;
        }
        let keys = store.all();
        // No file for a Redis that never had a runtime key.
        if keys.is_empty() && !snap.path.exists() {
            self.written = count;
            return;
        }
        let snap = snap.clone();
        let path = snap.path.clone();
        let first = self.last.is_none();
        let wrote = tokio::task::spawn_blocking(move || {
            if first {
                snap.clear_leftovers();
            }
            snap.write(&keys)
        })
        .await;
        self.last = Some(std::time::Instant::now());
        match wrote {
            Ok(Ok(())) => {
                self.written = count;
                if self.failing {
                    tracing::info!(file = %path.display(), "the runtime API keys' snapshot is written again");
                }
                self.failing = false;
            }
            Ok(Err(e)) => {
                if !self.failing {
                    tracing::warn!(file = %path.display(), error = %e, "the runtime API keys' snapshot cannot be written; a restart while Redis is down would serve none of them (clients.runtime_keys_snapshot)");
                }
                self.failing = true;
            }
            Err(_) => self.failing = true,
        }
    }
}

/// A record read from Redis; a bad one is logged (by id, never its
/// content) and left out.
fn parsed(id: &str, raw: &str) -> Option<Checked> {
    match parse_record(raw, None) {
        Ok(k) if k.id == id => Some(k),
        Ok(_) => {
            tracing::warn!(id, "a runtime API key's record names another id; left out");
            None
        }
        Err(e) => {
            tracing::warn!(id, error = %e, "a runtime API key's record cannot be read; left out");
            None
        }
    }
}

/// What `gateway check` finds of the runtime keys in Redis against the
/// config's (`[[api_keys]]` and the keys file): how many there are, and
/// each id or secret both hold. The API refuses such an id at creation; a
/// keys file can still gain one later, which only a check can see.
pub async fn conflicts(
    redis: &RedisBackend,
    prefix: &str,
    config_keys: &super::KeySet,
) -> Result<(usize, Vec<String>), String> {
    let (_, runtime) = read_all(redis, prefix).await?;
    let ids: std::collections::HashSet<&str> = runtime.iter().map(|k| k.id.as_str()).collect();
    let mut out: Vec<String> = config_keys
        .iter()
        .filter(|k| ids.contains(k.id))
        .map(|k| {
            format!(
                "api key id \"{}\" is in the config and a runtime key in Redis: both secrets would share its buckets (revoke one: gateway keys revoke --id {0})",
                k.id
            )
        })
        .collect();
    for k in &runtime {
        if let Some(c) = config_keys.lookup_digest(&k.digest) {
            if c.id != k.id {
                out.push(format!(
                    "runtime key \"{}\" in Redis has the secret of the config's key \"{}\"",
                    k.id, c.id
                ));
            }
        }
    }
    Ok((runtime.len(), out))
}

/// One runtime key as Redis holds it now, by id (`None`: no such key, or
/// a record that cannot be read, which is logged): for the operator's CLI,
/// which has no synced copy.
pub async fn fetch(
    redis: &RedisBackend,
    prefix: &str,
    id: &str,
) -> Result<Option<Checked>, String> {
    let records = store::records(redis, prefix, &[id.to_string()])
        .await
        .map_err(|e| e.to_string())?;
    Ok(records
        .into_iter()
        .next()
        .flatten()
        .and_then(|raw| parsed(id, &raw)))
}

/// Reads the whole hash: the stream position to follow from, and the keys.
async fn read_all(redis: &RedisBackend, prefix: &str) -> Result<(String, Vec<Checked>), String> {
    // The position first: a change made during the scan is read again
    // from the stream (applying one twice is harmless).
    let after = store::newest_change(redis, prefix)
        .await
        .map_err(|e| e.to_string())?;
    let mut keys = Vec::new();
    let mut cursor = 0;
    loop {
        let (next, page) = store::page(redis, prefix, cursor, PAGE)
            .await
            .map_err(|e| e.to_string())?;
        keys.extend(page.iter().filter_map(|(id, raw)| parsed(id, raw)));
        if next == 0 {
            return Ok((after, keys));
        }
        cursor = next;
    }
}

/// Follows Redis's runtime keys into `store`, and `store` into the
/// `snapshot` file, until `stop` resolves.
pub async fn sync(
    store: Arc<RuntimeKeys>,
    redis: &RedisBackend,
    prefix: String,
    snapshot: Option<Snapshot>,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    let mut after: Option<String> = None;
    let mut failing = false;
    let mut keeper = Keeper {
        snapshot,
        written: 0,
        last: None,
        failing: false,
    };
    // Until Redis first answers: the file's set is read at the first
    // failure, and only then.
    let mut started = false;
    loop {
        let step = async {
            match &after {
                None => {
                    let (pos, keys) = read_all(redis, &prefix).await?;
                    let n = keys.len();
                    store.replace_all(keys);
                    tracing::info!(keys = n, "runtime API keys read from Redis");
                    Ok::<_, String>(Some(pos))
                }
                Some(pos) => {
                    let (ids, last, gap) = store::changes(redis, &prefix, pos, PAGE)
                        .await
                        .map_err(|e| e.to_string())?;
                    if gap {
                        tracing::warn!(
                            "runtime API key changes were trimmed unread; reading them all again"
                        );
                        return Ok(None);
                    }
                    let mut ids = ids;
                    ids.sort();
                    ids.dedup();
                    let records = store::records(redis, &prefix, &ids)
                        .await
                        .map_err(|e| e.to_string())?;
                    for (id, raw) in ids.iter().zip(records) {
                        store.apply(id, raw.and_then(|r| parsed(id, &r)));
                    }
                    Ok(Some(last))
                }
            }
        };
        match step.await {
            Ok(pos) => {
                if failing {
                    tracing::info!("runtime API keys: Redis answers again");
                }
                failing = false;
                after = pos;
                started = true;
                keeper.keep(&store, false).await;
            }
            Err(e) => {
                if !started {
                    keeper.load(&store);
                    started = true;
                }
                if !failing {
                    tracing::warn!(error = %e, keys = store.len(), "runtime API keys cannot be read from Redis; the last set read stays in force");
                }
                failing = true;
            }
        }
        crate::metrics::runtime_api_keys(store.len());
        tokio::select! {
            _ = &mut stop => {
                keeper.keep(&store, true).await;
                return;
            }
            _ = tokio::time::sleep(POLL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, secret: &str, plan: &str) -> Checked {
        Checked {
            id: id.into(),
            digest: super::super::digest_of(secret),
            plan: plan.into(),
            quotas: None,
            burst: None,
        }
    }

    #[test]
    fn issue_change_and_revoke() {
        let s = RuntimeKeys::default();
        s.apply("a", Some(key("a", "s1", "free")));
        let d1 = super::super::digest_of("s1");
        assert_eq!(s.get(&d1).unwrap().view().plan, "free");
        // A new plan and a new secret for the same id: the old secret goes.
        s.apply("a", Some(key("a", "s2", "pro")));
        assert!(s.get(&d1).is_none());
        assert_eq!(s.by_id("a").unwrap().view().plan, "pro");
        s.apply("a", None);
        assert!(s.by_id("a").is_none() && s.is_empty());
        s.replace_all(vec![key("x", "sx", "free"), key("y", "sy", "free")]);
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn records_read_back_as_written() {
        let mut k = key("a", "s1", "free");
        k.burst = Some(crate::config::Burst {
            capacity: 3,
            refill_per_sec: 0.5,
        });
        k.quotas = Some(vec![crate::config::Quota {
            limit: 9,
            period: crate::calendar::Period::Month,
            charged: false,
        }]);
        let raw = super::super::file::record(&k);
        assert!(!raw.contains("s1"));
        assert_eq!(parsed("a", &raw), Some(k));
        assert_eq!(parsed("b", &raw), None);
    }
}
