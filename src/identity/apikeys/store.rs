//! API keys issued at runtime, kept in Redis: one hash of records by id and
//! a stream naming each id that changed, both under one hash tag, so every
//! change is one script (the record and its announcement together, on a
//! Redis Cluster too). Every replica reads the whole hash once, then the
//! stream: a change reaches all of them within a poll (`runtime`). A record
//! holds the key's digest, never its secret.
//!
//! The calls go over the limiter's Redis backend (`RedisBackend::admin`):
//! one set of connections, credentials and budgets for the whole process.

use crate::limiter::{LimiterError, RedisBackend};

/// Stream entries kept: a replica cut off for longer than it takes to
/// write this many changes reads the whole hash again.
const CHANGES_KEPT: usize = 100_000;

/// Sets `ARGV[1]`'s record to `ARGV[2]` (mode "create": only if absent;
/// "update": only if present) or deletes it (mode "delete"), and announces
/// the id on the stream; 1 if it did, 0 if not.
const WRITE: &str = r#"
local mode, id = ARGV[3], ARGV[1]
local exists = redis.call('HEXISTS', KEYS[1], id) == 1
if (mode == 'create' and exists) or (mode ~= 'create' and not exists) then
  return 0
end
if mode == 'delete' then
  redis.call('HDEL', KEYS[1], id)
else
  redis.call('HSET', KEYS[1], id, ARGV[2])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'id', id)
return 1
"#;

/// The hash and the stream of `key_prefix`'s runtime keys.
pub fn api_key_names(key_prefix: &str) -> (String, String) {
    let tag = format!("{{{key_prefix}:apikeys}}");
    (tag.clone(), format!("{tag}:changes"))
}

/// How a write changes a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyWrite {
    Create,
    Update,
    Delete,
}

/// Writes `id`'s record as `mode` says; whether it did (a create of an
/// id that exists, or an update or delete of one that does not, does
/// nothing).
pub async fn write(
    redis: &RedisBackend,
    key_prefix: &str,
    id: &str,
    record: &str,
    mode: KeyWrite,
) -> Result<bool, LimiterError> {
    let (hash, stream) = api_key_names(key_prefix);
    let mode = match mode {
        KeyWrite::Create => "create",
        KeyWrite::Update => "update",
        KeyWrite::Delete => "delete",
    };
    let work = async {
        let mut conn = redis.admin().await?;
        let done: i64 = conn
            .query(
                redis::cmd("EVAL")
                    .arg(WRITE)
                    .arg(2)
                    .arg(&hash)
                    .arg(&stream)
                    .arg(id)
                    .arg(record)
                    .arg(mode)
                    .arg(CHANGES_KEPT),
            )
            .await?;
        Ok(done == 1)
    };
    redis.upkeep(work).await
}

/// The records of `ids`, in order (`None`: no such key).
pub async fn records(
    redis: &RedisBackend,
    key_prefix: &str,
    ids: &[String],
) -> Result<Vec<Option<String>>, LimiterError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let (hash, _) = api_key_names(key_prefix);
    let work = async {
        let mut conn = redis.admin().await?;
        conn.query(redis::cmd("HMGET").arg(&hash).arg(ids)).await
    };
    redis.upkeep(work).await
}

/// One page of every record (HSCAN from `cursor`; 0 starts and ends).
pub async fn page(
    redis: &RedisBackend,
    key_prefix: &str,
    cursor: u64,
    count: usize,
) -> Result<(u64, Vec<(String, String)>), LimiterError> {
    let (hash, _) = api_key_names(key_prefix);
    let work = async {
        let mut conn = redis.admin().await?;
        conn.query(
            redis::cmd("HSCAN")
                .arg(&hash)
                .arg(cursor)
                .arg("COUNT")
                .arg(count),
        )
        .await
    };
    redis.upkeep(work).await
}

/// The newest change's stream id ("0-0" for none): where a reader that
/// has just read the whole hash starts.
pub async fn newest_change(redis: &RedisBackend, key_prefix: &str) -> Result<String, LimiterError> {
    let (_, stream) = api_key_names(key_prefix);
    let work = async {
        let mut conn = redis.admin().await?;
        conn.newest_entry(&stream).await
    };
    redis.upkeep(work).await
}

/// The ids changed after stream entry `after` (at most `count`), the
/// entry to read from next, and whether entries were trimmed away
/// unread (the reader must read the whole hash again).
pub async fn changes(
    redis: &RedisBackend,
    key_prefix: &str,
    after: &str,
    count: usize,
) -> Result<(Vec<String>, String, bool), LimiterError> {
    let (_, stream) = api_key_names(key_prefix);
    let work = async {
        let mut conn = redis.admin().await?;
        let entries: Vec<(String, Vec<(String, String)>)> = conn
            .query(
                redis::cmd("XRANGE")
                    .arg(&stream)
                    .arg(format!("({after}"))
                    .arg("+")
                    .arg("COUNT")
                    .arg(count),
            )
            .await?;
        // Trimmed unread: the oldest entry kept is newer than `after`
        // and is not the one written right after it.
        let gap = match entries.first() {
            Some(_) if after != "0-0" => {
                let oldest: Vec<(String, Vec<(String, String)>)> = conn
                    .query(
                        redis::cmd("XRANGE")
                            .arg(&stream)
                            .arg("-")
                            .arg("+")
                            .arg("COUNT")
                            .arg(1),
                    )
                    .await?;
                oldest
                    .first()
                    .is_some_and(|(id, _)| stream_id(id) > stream_id(after))
            }
            _ => false,
        };
        let last = entries
            .last()
            .map_or(after.to_string(), |(id, _)| id.clone());
        let ids = entries
            .into_iter()
            .flat_map(|(_, fields)| fields.into_iter().map(|(_, id)| id))
            .collect();
        Ok((ids, last, gap))
    };
    redis.upkeep(work).await
}

/// A stream id as numbers, for ordering.
fn stream_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}
