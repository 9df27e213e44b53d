//! `[limiter]`: which backend holds the buckets, what happens when Redis
//! fails, the replica count, headers and the in-process cap.

use toml::de::DeTable;

use super::file::opt;
use super::model::{Backend, HeaderStyle, LimiterSettings, OnRedisFailure, Spelled};
use super::reader::Reader;

pub(super) fn read(
    r: &mut Reader<'_>,
    t: Option<&DeTable<'_>>,
    has_redis: bool,
) -> Option<LimiterSettings> {
    let p = "limiter";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(
        p,
        t,
        &[
            "backend",
            "on_redis_failure",
            "instances",
            "headers",
            "retry_after_jitter_ms",
            "local_max_entries",
        ],
    );
    // With a [redis] section the operator means Redis; without one, local.
    let default_backend = if has_redis {
        Backend::Redis
    } else {
        Backend::Local
    };
    let backend = opt(r, t, p, "backend", default_backend, |r, path, v| {
        r.choice(path, v, Backend::SPELLINGS)
    });
    let on_failure = opt(
        r,
        t,
        p,
        "on_redis_failure",
        OnRedisFailure::Local,
        |r, path, v| r.choice(path, v, OnRedisFailure::SPELLINGS),
    );
    let instances = opt(r, t, p, "instances", 1, |r, path, v| {
        r.int(path, v, 1, 10_000).map(|n| n as u32)
    });
    let headers = opt(r, t, p, "headers", HeaderStyle::Both, |r, path, v| {
        r.choice(path, v, HeaderStyle::SPELLINGS)
    });
    let jitter = opt(r, t, p, "retry_after_jitter_ms", 0, |r, path, v| {
        r.int(path, v, 0, 60_000)
    });
    let max_entries = opt(r, t, p, "local_max_entries", 1_000_000, |r, path, v| {
        r.int(path, v, 1, 1 << 32).map(|n| n as usize)
    });
    Some(LimiterSettings {
        backend: backend?,
        on_redis_failure: on_failure?,
        instances: instances?,
        headers: headers?,
        retry_after_jitter_ms: jitter?,
        local_max_entries: max_entries?,
    })
}
