//! The runtime key set on this machine's disk (`clients.runtime_keys_snapshot`):
//! what a replica restarted while Redis does not answer serves until it does.
//!
//! The file holds what Redis holds, record for record: each key's id, plan,
//! own limits and the SHA-256 of its secret, never the secret. It opens with
//! a line naming the Redis it mirrors (a digest of the key prefix and the
//! addresses, without their credentials): a file of another Redis is not
//! read. It is written whole to a file beside it (mode 0600) and renamed
//! over the old one, so a reader sees one set or the other, never half.
//!
//! What it costs: one write of about 109 bytes a key (a million keys: about
//! 110 MB) at most once every `EVERY` while the set changes, and a revoked
//! key that lives on in the file until the replica next reads Redis. A
//! replica cut off from Redis serves a key revoked meanwhile for as long as
//! it stays cut off, restarted or not; the first read of Redis drops it.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest as _, Sha256};

use super::file::{parse_record, record, Checked};
use crate::config::{Config, KeySnapshot};

/// The shortest time between two writes while the set keeps changing (a
/// bulk issue of thousands of keys writes a few files, not thousands).
pub const EVERY: Duration = Duration::from_secs(1);

/// Where this config's replicas keep the snapshot, and what Redis it is of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub path: PathBuf,
    /// The Redis it mirrors: the key prefix and the addresses, digested.
    source: String,
}

impl Snapshot {
    /// `None`: the config turns it off, or has no Redis.
    pub fn of(config: &Config) -> Option<Snapshot> {
        let redis = config.redis.as_ref()?;
        let mut h = Sha256::new();
        h.update(redis.key_prefix.as_bytes());
        if let Some(m) = &redis.sentinel_master {
            h.update(b"\nsentinel ");
            h.update(m.as_bytes());
        }
        for url in &redis.urls {
            h.update(b"\n");
            h.update(without_credentials(url).as_bytes());
        }
        let source = hex::encode(&h.finalize()[..8]);
        let path = match &config.clients.runtime_keys_snapshot {
            KeySnapshot::Off => return None,
            KeySnapshot::At(p) => p.clone(),
            KeySnapshot::Auto => {
                std::env::temp_dir().join(format!("gateway-runtime-keys-{source}.jsonl"))
            }
        };
        Some(Snapshot { path, source })
    }

    /// The name of the file a write goes to first (one per process: the
    /// replicas of one machine may share the snapshot).
    fn fresh(&self, pid: u32) -> PathBuf {
        self.path
            .with_file_name(format!(".{}.{pid}.tmp", self.name()))
    }

    fn name(&self) -> String {
        self.path
            .file_name()
            .map_or("snapshot".into(), |n| n.to_string_lossy().into_owned())
    }

    /// Removes the files a process that died mid-write left beside the
    /// snapshot (one whose id `/proc` does not list any more).
    pub fn clear_leftovers(&self) {
        let proc = Path::new("/proc");
        if !proc.join("self").exists() {
            return;
        }
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        let (head, tail) = (format!(".{}.", self.name()), ".tmp");
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let pid = name
                .strip_prefix(&head)
                .and_then(|r| r.strip_suffix(tail))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(pid) = pid {
                if pid != std::process::id() && !proc.join(pid.to_string()).exists() {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    /// Writes `keys` in place of the file's set.
    pub fn write(&self, keys: &[Checked]) -> std::io::Result<()> {
        let written = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut text = serde_json::json!({
            "runtime_keys_snapshot": 1,
            "source": self.source,
            "written_at": written,
            "keys": keys.len(),
        })
        .to_string();
        text.push('\n');
        for k in keys {
            text.push_str(&record(k));
            text.push('\n');
        }
        let fresh = self.fresh(std::process::id());
        let result = write_private(&fresh, text.as_bytes())
            .and_then(|()| std::fs::rename(&fresh, &self.path));
        if result.is_err() {
            let _ = std::fs::remove_file(&fresh);
        }
        result
    }

    /// The set the file holds, and when it was written (seconds since the
    /// epoch). A file of another Redis, or one that cannot be read whole,
    /// is an error saying so; a missing one is `Ok(None)`.
    pub fn read(&self) -> Result<Option<(Vec<Checked>, u64)>, String> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let mut lines = text.lines();
        let head: serde_json::Value = lines
            .next()
            .and_then(|l| serde_json::from_str(l).ok())
            .ok_or("its first line is not a snapshot's")?;
        if head["runtime_keys_snapshot"] != 1 {
            return Err("its first line is not a snapshot's".into());
        }
        if head["source"] != self.source.as_str() {
            return Err("it is of another Redis (redis.urls or redis.key_prefix differ)".into());
        }
        let keys = lines
            .enumerate()
            .map(|(i, l)| parse_record(l, None).map_err(|e| format!("line {}: {e}", i + 2)))
            .collect::<Result<Vec<_>, _>>()?;
        if head["keys"].as_u64() != Some(keys.len() as u64) {
            return Err(format!(
                "it names {} keys and holds {}",
                head["keys"],
                keys.len()
            ));
        }
        Ok(Some((keys, head["written_at"].as_u64().unwrap_or(0))))
    }
}

/// `bytes` in a new file only its owner can read, on disk before it is
/// renamed into place.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut f = match options.open(path) {
        // Left by a process of this id that died mid-write.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            std::fs::remove_file(path)?;
            options.open(path)?
        }
        other => other?,
    };
    f.write_all(bytes)?;
    f.sync_all()
}

/// A Redis URL without its user and password: a rotated password is the
/// same Redis.
fn without_credentials(url: &str) -> &str {
    match url.split_once("://") {
        Some((_, rest)) => {
            let host_end = rest.find('/').unwrap_or(rest.len());
            match rest[..host_end].rfind('@') {
                Some(at) => &rest[at + 1..],
                None => rest,
            }
        }
        None => url,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str, secret: &str) -> Checked {
        Checked {
            id: id.into(),
            digest: super::super::digest_of(secret),
            plan: "free".into(),
            quotas: None,
            burst: None,
        }
    }

    fn at(dir: &Path, source: &str) -> Snapshot {
        Snapshot {
            path: dir.join("keys.jsonl"),
            source: source.into(),
        }
    }

    #[test]
    fn written_private_and_read_back_without_a_secret() {
        let dir = tempfile::tempdir().unwrap();
        let s = at(dir.path(), "a1");
        assert_eq!(s.read(), Ok(None));
        let keys = vec![key("a", "secret-one"), key("b", "secret-two")];
        s.write(&keys).unwrap();
        let (read, _) = s.read().unwrap().unwrap();
        assert_eq!(read, keys);
        let text = std::fs::read_to_string(&s.path).unwrap();
        assert!(!text.contains("secret-one") && !text.contains("secret-two"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&s.path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // Written again: the new set whole, nothing left beside it.
        s.write(&keys[..1]).unwrap();
        assert_eq!(s.read().unwrap().unwrap().0, keys[..1].to_vec());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_dead_writer_s_file_is_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let s = at(dir.path(), "a1");
        // No process has the largest id; this one is alive.
        let dead = s.fresh(u32::MAX);
        let mine = s.fresh(std::process::id());
        std::fs::write(&dead, "half").unwrap();
        std::fs::write(&mine, "mine").unwrap();
        s.clear_leftovers();
        assert!(!dead.exists() && mine.exists());
    }

    #[test]
    fn another_redis_or_a_cut_file_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        at(dir.path(), "a1").write(&[key("a", "s")]).unwrap();
        assert_eq!(
            at(dir.path(), "b2").read(),
            Err("it is of another Redis (redis.urls or redis.key_prefix differ)".into())
        );
        let path = dir.path().join("keys.jsonl");
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, text.lines().next().unwrap()).unwrap();
        assert_eq!(
            at(dir.path(), "a1").read(),
            Err("it names 1 keys and holds 0".into())
        );
    }

    #[test]
    fn credentials_do_not_name_the_redis() {
        assert_eq!(
            without_credentials("redis://:pw@10.0.0.1:6379/0"),
            "10.0.0.1:6379/0"
        );
        assert_eq!(
            without_credentials("rediss://u:p@h:1"),
            without_credentials("rediss://h:1")
        );
        assert_eq!(without_credentials("h:1"), "h:1");
    }
}
