//! `[redis]`: where the shared limiter state lives (mode, URLs, TLS CA) and
//! how long a call may take.

use toml::de::DeTable;

use super::model::{RedisMode, RedisSettings, Secret, Spelled};
use super::reader::Reader;
use super::reader::{name, opt, req};

pub const REDIS_KEYS: &[&str] = &[
    "mode",
    "urls",
    "sentinel_master",
    "timeout_ms",
    "probe_interval_ms",
    "key_prefix",
    "ca_file",
    "password",
    "password_file",
];

pub(super) fn read(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<RedisSettings> {
    let p = "redis";
    r.only_keys(p, t, REDIS_KEYS);
    let mode = opt(r, t, p, "mode", RedisMode::Standalone, |r, path, v| {
        r.choice(path, v, RedisMode::SPELLINGS)
    });
    let urls = req(r, t, p, None, "urls", |r, path, v| {
        let items = r.strings(path, v)?;
        let mut ok = !items.is_empty();
        if items.is_empty() {
            r.error(path, Some(&v.span()), "expected at least one Redis URL");
        }
        for (i, (u, span)) in items.iter().enumerate() {
            // Never echo the URL: it may carry a password.
            let problem = if !(u.starts_with("redis://") || u.starts_with("rediss://")) {
                Some("expected a URL starting with redis:// or rediss:// (TLS)")
            } else {
                None
            };
            if let Some(problem) = problem {
                ok = false;
                r.error(&format!("{path}[{i}]"), Some(span), problem);
            }
        }
        ok.then(|| items.into_iter().map(|(u, _)| u).collect::<Vec<_>>())
    });
    let sentinel_master = opt(r, t, p, "sentinel_master", None, |r, path, v| {
        r.string(path, v).map(Some)
    });
    let timeout_ms = opt(r, t, p, "timeout_ms", 15, |r, path, v| {
        r.int(path, v, 1, 60_000)
    });
    let probe = opt(r, t, p, "probe_interval_ms", 250, |r, path, v| {
        r.int(path, v, 10, 600_000)
    });
    let prefix = opt(r, t, p, "key_prefix", "rl".to_string(), name);
    // A secret: never echoed, never in `check`'s summary.
    let password = opt(r, t, p, "password", None, |r, path, v| {
        r.string(path, v).map(|p| Some(Secret(p)))
    });
    let password_file = opt(r, t, p, "password_file", None, |r, path, v| {
        r.file_path(path, v).map(Some)
    });
    // Both set: the file wins (a mounted secret is the deployment's truth;
    // the inline one is often a `${VAR}` left from local runs), and `check`
    // prints which one is used.
    let ca_file = opt(r, t, p, "ca_file", None, |r, path, v| {
        r.file_path(path, v).map(Some)
    });
    let (mode, urls, sentinel_master) = (mode?, urls?, sentinel_master?);
    match mode {
        RedisMode::Standalone if urls.len() != 1 => {
            r.error(
                "redis.urls",
                None,
                format!(
                    "standalone mode takes exactly one URL, found {}",
                    urls.len()
                ),
            );
            return None;
        }
        RedisMode::Sentinel if sentinel_master.is_none() => {
            r.error(
                "redis.sentinel_master",
                None,
                "required when redis.mode = \"sentinel\"",
            );
            return None;
        }
        RedisMode::Standalone | RedisMode::Cluster if sentinel_master.is_some() => {
            r.error(
                "redis.sentinel_master",
                None,
                "only valid when redis.mode = \"sentinel\"",
            );
            return None;
        }
        _ => {}
    }
    Some(RedisSettings {
        mode,
        urls,
        sentinel_master,
        timeout_ms: timeout_ms?,
        probe_interval_ms: probe?,
        key_prefix: prefix?,
        ca_file: ca_file?,
        password: password?,
        password_file: password_file?,
    })
}
