//! Operators' calls on the shared buckets: read them without spending
//! (`peek`), reset them (`reset`), for `/limits` and `gateway limits`, and
//! page through them (`scan_values`, for `gateway usage`).
//!
//! A reset deletes the buckets and appends their names to a stream
//! (`{prefix}:resets`) that every replica reads with its heartbeat, so each
//! forgets what it remembered of them (denials, fallback shares) within a
//! second. Names only: a bucket's name never holds a secret.

use std::collections::VecDeque;
use std::time::Instant;

use redis::aio::ConnectionManager;

use super::{query, redis_err, Conn, RedisBackend, SlotMap};
use crate::config::Algorithm;
use crate::limiter::algorithms::{self, lease, Micros, Snapshot, State};
use crate::limiter::keys::ledger_key;
use crate::limiter::{Check, LimiterError};

/// Stream entries kept: far more than a second of resets.
const RESETS_KEPT: usize = 10_000;

impl RedisBackend {
    /// What each check's bucket holds now (Redis's clock), spending nothing.
    pub async fn peek(&self, checks: &[Check]) -> Result<(Vec<Snapshot>, Micros), LimiterError> {
        let work = async {
            let mut conn = self.admin_connection().await?;
            let now = match &self.inner.clock {
                Some(clock) => clock.now_us(),
                None => {
                    let (s, us): (i64, i64) = query(&mut conn, &redis::cmd("TIME"))
                        .await
                        .map_err(redis_err)?;
                    s * 1_000_000 + us
                }
            };
            let mut out = Vec::with_capacity(checks.len());
            for c in checks {
                let state = read_state(&mut conn, c, now).await?;
                out.push(algorithms::inspect(&c.algorithm, state.as_ref(), now));
            }
            Ok((out, now))
        };
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
    }

    /// Deletes the buckets and announces it on `stream`; returns how many
    /// held state.
    pub async fn reset(&self, keys: &[&str], stream: &str) -> Result<usize, LimiterError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let work = async {
            let mut conn = self.admin_connection().await?;
            let mut deleted = 0;
            // One key per DEL: in a cluster the buckets live in many slots.
            // A quota's lease ledger goes with it (its bucket's slot): left
            // behind, a dead holder's tokens would be given back to the new
            // count.
            for k in keys {
                deleted += query::<usize>(&mut conn, redis::cmd("DEL").arg(*k))
                    .await
                    .map_err(redis_err)?;
                query::<usize>(&mut conn, redis::cmd("DEL").arg(ledger_key(k)))
                    .await
                    .map_err(redis_err)?;
            }
            let mut xadd = redis::cmd("XADD");
            xadd.arg(stream)
                .arg("MAXLEN")
                .arg("~")
                .arg(RESETS_KEPT)
                .arg("*");
            for k in keys {
                xadd.arg("bucket").arg(*k);
            }
            query::<String>(&mut conn, &xadd).await.map_err(redis_err)?;
            Ok(deleted)
        };
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
    }

    /// The buckets reset since stream entry `after` (`None`: from now on),
    /// and the id to ask from next time.
    pub async fn resets_since(
        &self,
        stream: &str,
        after: Option<&str>,
    ) -> Result<(Vec<(String, Micros)>, Option<String>), LimiterError> {
        let mut conn = self.inner.probe_connection()?;
        let work = async {
            let Some(after) = after else {
                // The newest entry (or "0-0" for none) is where reading starts.
                return Ok((Vec::new(), Some(newest_entry(&mut conn, stream).await?)));
            };
            let entries: Vec<(String, Vec<(String, String)>)> = query(
                &mut conn,
                redis::cmd("XRANGE")
                    .arg(stream)
                    .arg(format!("({after}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(RESETS_KEPT),
            )
            .await
            .map_err(redis_err)?;
            let last = entries
                .last()
                .map(|(id, _)| id.clone())
                .unwrap_or(after.to_string());
            // Each key with its reset's time: the entry's id is Redis's
            // clock in ms when it was added.
            let keys = entries
                .into_iter()
                .flat_map(|(id, fields)| {
                    let ms: i64 = id
                        .split('-')
                        .next()
                        .and_then(|m| m.parse().ok())
                        .unwrap_or(i64::MAX / 1000);
                    fields.into_iter().map(move |(_, k)| (k, ms * 1000))
                })
                .collect();
            Ok((keys, Some(last)))
        };
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
    }

    /// What Redis keeps on disk: an append-only file, snapshots (with
    /// their `save` points), or nothing.
    pub async fn persistence(&self) -> Result<Persistence, LimiterError> {
        let work = async {
            let mut conn = self.admin_connection().await?;
            let info: String = query(&mut conn, redis::cmd("INFO").arg("persistence"))
                .await
                .map_err(redis_err)?;
            if info.lines().any(|l| l.trim() == "aof_enabled:1") {
                return Ok(Persistence::Aof);
            }
            let save: Vec<String> = query(&mut conn, redis::cmd("CONFIG").arg("GET").arg("save"))
                .await
                .map_err(redis_err)?;
            Ok(match save.get(1).map(|v| v.trim()) {
                Some(v) if !v.is_empty() => Persistence::Snapshots(v.to_string()),
                _ => Persistence::Nothing,
            })
        };
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
    }

    /// Every key matching `pattern` with its value, paged with SCAN (never
    /// KEYS: Redis keeps serving between pages), on every master of a
    /// cluster. A key that expired between the pages reads `None`.
    pub async fn scan_values(
        &self,
        pattern: &str,
    ) -> Result<Vec<(String, Option<String>)>, LimiterError> {
        self.scan_values_as(pattern, "GET").await
    }

    /// `scan_values`, each key read with `read` (GET, HGETALL).
    async fn scan_values_as<T: redis::FromRedisValue>(
        &self,
        pattern: &str,
        read: &'static str,
    ) -> Result<Vec<(String, T)>, LimiterError> {
        let mut conn = self.admin_connection().await?;
        let mut out = Vec::new();
        match &mut conn {
            Conn::Single(c) => scan_node(c, pattern, true, read, &mut out).await?,
            Conn::Cluster(c) => {
                let reply: redis::Value = redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async(c)
                    .await
                    .map_err(redis_err)?;
                let map = SlotMap::from_reply(&reply, Instant::now())
                    .ok_or_else(|| LimiterError::BadReply("CLUSTER SLOTS".into()))?;
                let masters: Vec<String> = map.addresses().map(str::to_string).collect();
                for addr in masters {
                    let Conn::Single(mut node) = self.inner.node_connection(&addr)? else {
                        continue;
                    };
                    scan_node(&mut node, pattern, false, read, &mut out).await?;
                }
            }
        }
        Ok(out)
    }

    /// The quota lease ledgers of the buckets `pattern` matches, what each
    /// gives back now (holdings of dead holders whose time is up: the next
    /// call that reads the ledger takes them back), by bucket name.
    pub async fn reclaimable(
        &self,
        pattern: &str,
    ) -> Result<std::collections::HashMap<String, u64>, LimiterError> {
        let found = self.scan_values_as(&ledger_key(pattern), "HGETALL").await?;
        let mut conn = self.admin_connection().await?;
        let (s, us): (i64, i64) = query(&mut conn, &redis::cmd("TIME"))
            .await
            .map_err(redis_err)?;
        let now = s * 1_000_000 + us;
        Ok(found
            .into_iter()
            .filter_map(|(key, fields): (String, Vec<(String, String)>)| {
                let bucket = key.strip_prefix('{')?.strip_suffix("}:leases")?;
                let due = lease::due(&lease::parse_ledger(fields), now);
                (due > 0).then(|| (bucket.to_string(), due))
            })
            .collect())
    }

    /// The probe's connection, made first if this process has no probe
    /// (`gateway limits` talks to Redis straight).
    pub(super) async fn admin_connection(&self) -> Result<Conn, LimiterError> {
        self.inner.ensure_connected().await?;
        self.inner.probe_connection()
    }
}

/// A connection other rooms use for keys of their own (the runtime API
/// key store): the probe's connection, off the request path. Each piece
/// of work runs within the upkeep budget (`RedisBackend::upkeep`).
pub struct AdminConnection(Conn);

impl AdminConnection {
    pub async fn query<T: redis::FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
    ) -> Result<T, LimiterError> {
        query(&mut self.0, cmd).await.map_err(redis_err)
    }

    /// The id of `stream`'s newest entry ("0-0" for none).
    pub async fn newest_entry(&mut self, stream: &str) -> Result<String, LimiterError> {
        newest_entry(&mut self.0, stream).await
    }
}

impl RedisBackend {
    /// A connection for another room's own keys.
    pub async fn admin(&self) -> Result<AdminConnection, LimiterError> {
        self.admin_connection().await.map(AdminConnection)
    }

    /// `work` (calls on an `admin` connection) within the budget of work off
    /// the request path: `redis.timeout_ms`, at least half a second.
    pub async fn upkeep<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, LimiterError>>,
    ) -> Result<T, LimiterError> {
        self.inner
            .by(Instant::now() + self.inner.upkeep_budget(), work)
            .await
    }
}

/// The id of `stream`'s newest entry, "0-0" when it has none: where a
/// reader that wants only what comes next starts.
pub(super) async fn newest_entry(conn: &mut Conn, stream: &str) -> Result<String, LimiterError> {
    let newest: Vec<(String, Vec<(String, String)>)> = query(
        conn,
        redis::cmd("XREVRANGE")
            .arg(stream)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1),
    )
    .await
    .map_err(redis_err)?;
    Ok(newest
        .first()
        .map_or("0-0".to_string(), |(id, _)| id.clone()))
}

/// One node's keys matching `pattern`, a thousand a page; their values by
/// MGET where the keys may span slots (`one_node`: not a cluster) and are
/// strings, else by a pipeline of `read`s.
async fn scan_node<T: redis::FromRedisValue>(
    c: &mut ConnectionManager,
    pattern: &str,
    one_node: bool,
    read: &'static str,
    out: &mut Vec<(String, T)>,
) -> Result<(), LimiterError> {
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(c)
            .await
            .map_err(redis_err)?;
        if !keys.is_empty() {
            let values: Vec<T> = if one_node && read == "GET" {
                redis::cmd("MGET").arg(&keys).query_async(c).await
            } else {
                let mut pipe = redis::pipe();
                for k in &keys {
                    pipe.cmd(read).arg(k);
                }
                pipe.query_async(c).await
            }
            .map_err(redis_err)?;
            out.extend(keys.into_iter().zip(values));
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// What a Redis keeps on disk (`RedisBackend::persistence`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Persistence {
    Aof,
    /// RDB snapshots only: Redis's `save` points ("3600 1 300 100").
    Snapshots(String),
    Nothing,
}

impl Persistence {
    /// The seconds of writes a crash can lose with snapshots alone: from
    /// the shortest `save` interval (a busy Redis) to the longest (a quiet
    /// one); `None` for an AOF or nothing on disk.
    pub fn snapshot_window(&self) -> Option<(u64, u64)> {
        let Persistence::Snapshots(save) = self else {
            return None;
        };
        let secs: Vec<u64> = save
            .split_whitespace()
            .step_by(2)
            .filter_map(|s| s.parse().ok())
            .collect();
        Some((*secs.iter().min()?, *secs.iter().max()?))
    }
}

/// A bucket's state as `limiter.lua` stores it: GCRA as its TAT, windows as
/// "window count" or "window prev cur", a log as a sorted set of times.
async fn read_state(
    conn: &mut Conn,
    c: &Check,
    now: Micros,
) -> Result<Option<State>, LimiterError> {
    if let Algorithm::SlidingLog { window_secs, .. } = c.algorithm {
        let lower = now - window_secs as i64 * 1_000_000;
        let entries: Vec<(String, f64)> = query(
            conn,
            redis::cmd("ZRANGEBYSCORE")
                .arg(&c.key)
                .arg(format!("({lower}"))
                .arg("+inf")
                .arg("WITHSCORES"),
        )
        .await
        .map_err(redis_err)?;
        let log: VecDeque<Micros> = entries.into_iter().map(|(_, t)| t as Micros).collect();
        return Ok((!log.is_empty()).then_some(State::Log(log)));
    }
    let raw: Option<String> = query(conn, redis::cmd("GET").arg(&c.key))
        .await
        .map_err(redis_err)?;
    let mut state = raw.and_then(|r| parse_state(&c.algorithm, &r));
    if matches!(c.algorithm, Algorithm::Calendar { .. }) && state.is_some() {
        // A dead holder's lease whose time is up counts as given back, as
        // the next call that reads the ledger will make it.
        let fields: Vec<(String, String)> =
            query(conn, redis::cmd("HGETALL").arg(ledger_key(&c.key)))
                .await
                .map_err(redis_err)?;
        let mut ledger = lease::parse_ledger(fields);
        lease::reclaim(&c.algorithm, &mut ledger, &mut state, now, None);
    }
    Ok(state)
}

fn parse_state(alg: &Algorithm, raw: &str) -> Option<State> {
    let nums: Vec<&str> = raw.split(' ').collect();
    match (alg, nums.as_slice()) {
        (Algorithm::TokenBucket { .. } | Algorithm::LeakyBucket { .. }, [tat]) => {
            Some(State::Gcra {
                tat: tat.parse().ok()?,
            })
        }
        (Algorithm::FixedWindow { .. } | Algorithm::Calendar { .. }, [w, n]) => {
            Some(State::Window {
                window: w.parse().ok()?,
                count: n.parse().ok()?,
            })
        }
        (Algorithm::SlidingWindow { .. }, [w, p, c]) => Some(State::Sliding {
            window: w.parse().ok()?,
            prev: p.parse().ok()?,
            cur: c.parse().ok()?,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_read_as_limiter_lua_writes_them() {
        let tb = Algorithm::TokenBucket {
            capacity: 5,
            refill_per_sec: 3.0,
        };
        assert_eq!(
            parse_state(&tb, "1700000000333333.2"),
            Some(State::Gcra {
                tat: 1700000000333333.2
            })
        );
        assert_eq!(
            parse_state(&tb, "1700000000000000"),
            Some(State::Gcra { tat: 1.7e15 })
        );
        let fw = Algorithm::FixedWindow {
            limit: 5,
            window_secs: 60,
        };
        assert_eq!(
            parse_state(&fw, "28333333 4"),
            Some(State::Window {
                window: 28333333,
                count: 4
            })
        );
        assert_eq!(parse_state(&fw, "28333333"), None);
        let sw = Algorithm::SlidingWindow {
            limit: 5,
            window_secs: 60,
        };
        assert_eq!(
            parse_state(&sw, "28333333 2 1"),
            Some(State::Sliding {
                window: 28333333,
                prev: 2,
                cur: 1
            })
        );
    }
}
