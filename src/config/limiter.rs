//! `[limiter]`: which backend holds the buckets, what happens when Redis
//! fails, the replica count, headers and the in-process cap.

use toml::de::DeTable;

use super::model::{
    Backend, HeaderStyle, LeaseSettings, LimiterSettings, OnRedisFailure, SharesSettings, Spelled,
};
use super::reader::opt;
use super::reader::Reader;

pub const LIMITER_KEYS: &[&str] = &[
    "backend",
    "on_redis_failure",
    "instances",
    "headers",
    "retry_after_jitter_ms",
    "local_max_entries",
    "leases",
    "shares",
    "quota_time_zone",
    "quota_retention_days",
];
pub const LEASES_KEYS: &[&str] = &["enabled", "period_ms"];
pub const SHARES_KEYS: &[&str] = &["enabled", "fraction", "charged"];

pub(super) fn read(
    r: &mut Reader<'_>,
    t: Option<&DeTable<'_>>,
    has_redis: bool,
) -> Option<LimiterSettings> {
    let p = "limiter";
    let empty = DeTable::new();
    let t = t.unwrap_or(&empty);
    r.only_keys(p, t, LIMITER_KEYS);
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
    let leases = match t.get("leases") {
        Some(v) => r.table("limiter.leases", v).and_then(|l| leases(r, l)),
        None => Some(LeaseSettings::default()),
    };
    let shares = match t.get("shares") {
        Some(v) => r.table("limiter.shares", v).and_then(|s| shares(r, s)),
        None => Some(SharesSettings::default()),
    };
    let zone = opt(r, t, p, "quota_time_zone", chrono_tz::UTC, |r, path, v| {
        let name = r.string(path, v)?;
        match name.parse::<chrono_tz::Tz>() {
            Ok(tz) => Some(tz),
            Err(_) => {
                r.error(
                    path,
                    Some(&v.span()),
                    format!("\"{name}\" is not an IANA time zone; expected a name like \"UTC\", \"Europe/Paris\" or \"America/New_York\""),
                );
                None
            }
        }
    });
    // Up to ten years of invoices; 0: a period's counts go a minute after
    // it ends (the grace a replica whose clock is behind needs).
    let retention = opt(r, t, p, "quota_retention_days", 0, |r, path, v| {
        r.int(path, v, 0, 3660).map(|n| n as u32)
    });
    Some(LimiterSettings {
        backend: backend?,
        on_redis_failure: on_failure?,
        instances: instances?,
        headers: headers?,
        retry_after_jitter_ms: jitter?,
        local_max_entries: max_entries?,
        leases: leases?,
        shares: shares?,
        quota_time_zone: zone?,
        quota_retention_days: retention?,
    })
}

fn leases(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<LeaseSettings> {
    let p = "limiter.leases";
    r.only_keys(p, t, LEASES_KEYS);
    let d = LeaseSettings::default();
    let enabled = opt(r, t, p, "enabled", d.enabled, |r, path, v| {
        r.boolean(path, v)
    });
    // At least 10 ms: shorter leases save no round trip; at most a minute:
    // a lease's tokens are stranded on a replica for up to a period.
    let period_ms = opt(r, t, p, "period_ms", d.period_ms, |r, path, v| {
        r.int(path, v, 10, 60_000)
    });
    Some(LeaseSettings {
        enabled: enabled?,
        period_ms: period_ms?,
    })
}

fn shares(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<SharesSettings> {
    let p = "limiter.shares";
    r.only_keys(p, t, SHARES_KEYS);
    let d = SharesSettings::default();
    let enabled = opt(r, t, p, "enabled", d.enabled, |r, path, v| {
        r.boolean(path, v)
    });
    // Past 0.9 the pool is too small to carry a replica that is joining (it
    // uses no share for a few seconds) or the traffic of one client on one
    // replica; under 0.01 a share serves nobody.
    let fraction = opt(r, t, p, "fraction", d.fraction, |r, path, v| {
        let f = r.positive_number(path, v)?;
        if !(0.01..=0.9).contains(&f) {
            r.error(
                path,
                Some(&v.span()),
                format!("expected a number from 0.01 to 0.9, found {f}"),
            );
            return None;
        }
        Some(f)
    });
    let charged = opt(r, t, p, "charged", d.charged, |r, path, v| {
        r.boolean(path, v)
    });
    Some(SharesSettings {
        enabled: enabled?,
        fraction: fraction?,
        charged: charged?,
    })
}
