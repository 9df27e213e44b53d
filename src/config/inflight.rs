//! In-flight caps (`max_in_flight`, `queue`, `queue_timeout_ms`; on an
//! upstream also `pool_max_in_flight` and `adaptive`), read the same way on
//! `[[upstreams]]` and `[[routes]]`.

use toml::de::DeTable;

use super::model::{Cap, InFlight};
use super::reader::opt;
use super::reader::{join, Reader, Value};

fn count(r: &mut Reader<'_>, path: &str, v: &Value<'_>) -> Option<u32> {
    r.int(path, v, 1, 1 << 20).map(|n| n as u32)
}

/// The caps of an upstream (`upstream`: with `pool_max_in_flight` and
/// `adaptive`, which its caller's `only_keys` allows) or a route.
/// `Some(None)`: no cap configured; `None`: invalid (errors recorded).
pub(super) fn read(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    upstream: bool,
) -> Option<Option<InFlight>> {
    let max = opt(r, t, p, "max_in_flight", None, |r, path, v| {
        count(r, path, v).map(Some)
    });
    let pool = opt(r, t, p, "pool_max_in_flight", None, |r, path, v| {
        count(r, path, v).map(Some)
    });
    let queue = opt(r, t, p, "queue", 0, |r, path, v| {
        r.int(path, v, 0, 1 << 20).map(|n| n as u32)
    });
    let timeout = opt(r, t, p, "queue_timeout_ms", 1000, |r, path, v| {
        r.int(path, v, 1, 600_000)
    });
    let adaptive = match t.get("adaptive") {
        Some(v) if upstream => adaptive(r, &join(p, "adaptive"), v),
        _ => Some(None),
    };
    let (max, pool, queue, timeout, adaptive) = (max?, pool?, queue?, timeout?, adaptive?);
    let at = |r: &Reader<'_>, key: &str| r.spans.get(&join(p, key)).cloned();
    let cap = match (max, pool) {
        (Some(_), Some(_)) => {
            let span = at(r, "pool_max_in_flight");
            r.error(
                &join(p, "pool_max_in_flight"),
                span.as_ref(),
                "give max_in_flight (this replica's) or pool_max_in_flight (shared by the live replicas), not both",
            );
            return None;
        }
        (Some(n), None) => Some(Cap::Replica(n)),
        (None, Some(n)) => Some(Cap::Pool(n)),
        (None, None) => None,
    };
    let cap = match (cap, adaptive) {
        (Some(c), _) => c,
        // Adaptive alone starts at its max.
        (None, Some((_, max))) => Cap::Replica(max),
        (None, None) => {
            for key in ["queue", "queue_timeout_ms"] {
                if let Some(span) = at(r, key) {
                    r.error(
                        &join(p, key),
                        Some(&span),
                        "has no effect without max_in_flight (or pool_max_in_flight, or adaptive)",
                    );
                    return None;
                }
            }
            return Some(None);
        }
    };
    Some(Some(InFlight {
        cap,
        queue,
        queue_timeout_ms: timeout,
        adaptive,
    }))
}

pub const ADAPTIVE_KEYS: &[&str] = &["enabled", "min", "max"];

/// `adaptive = { enabled = true, min = 8, max = 256 }`: `Some(None)` when
/// not enabled.
fn adaptive(r: &mut Reader<'_>, p: &str, v: &Value<'_>) -> Option<Option<(u32, u32)>> {
    let t = r.table(p, v)?;
    r.only_keys(p, t, ADAPTIVE_KEYS);
    let enabled = opt(r, t, p, "enabled", true, |r, path, v| r.boolean(path, v));
    let min = opt(r, t, p, "min", 1, |r, path, v| r.int(path, v, 1, 1 << 20));
    let max = opt(r, t, p, "max", 1000, |r, path, v| {
        r.int(path, v, 1, 1 << 20)
    });
    let (enabled, min, max) = (enabled?, min?, max?);
    if min > max {
        r.error(
            &join(p, "min"),
            Some(&v.span()),
            format!("min = {min} is above max = {max}"),
        );
        return None;
    }
    Some(enabled.then_some((min as u32, max as u32)))
}
