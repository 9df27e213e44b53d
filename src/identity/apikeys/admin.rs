//! Issuing, changing, revoking and listing runtime API keys: what `/keys`
//! on the admin listener and `gateway keys` both do, on Redis.
//!
//! A key is created by the gateway: it draws the secret (24 random bytes
//! from the operating system, `gk_` and 48 hex digits), answers it once,
//! and stores only its SHA-256. Every change is logged (target `audit`:
//! the action, the id, the plan, who asked), never a secret or a digest.

use serde_json::{json, Map, Value};

use super::file::{parse_record, record, Checked};
use super::runtime::RuntimeKeys;
use super::store::{self, KeyWrite};
use super::KeySet;
use crate::config::Config;
use crate::limiter::RedisBackend;

/// Why a change was refused, with the HTTP status it answers.
#[derive(Debug)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

fn refuse(status: u16, message: impl Into<String>) -> Refusal {
    Refusal {
        status,
        message: message.into(),
    }
}

/// Where the changes go and who asks.
pub struct KeyAdmin<'a> {
    pub redis: &'a RedisBackend,
    pub config: &'a Config,
    /// The config's keys: a runtime key takes none of their ids.
    pub config_keys: &'a KeySet,
    /// This replica's copy, updated at once (the others follow the stream).
    pub runtime: Option<&'a RuntimeKeys>,
    /// Who asked, for the audit log (an address, `cli`, a header's value).
    pub by: &'a str,
}

/// The fields a request may set; `id` only on creation.
const SETTABLE: [&str; 4] = ["plan", "quotas", "capacity", "refill_per_sec"];

fn object(body: &[u8]) -> Result<Map<String, Value>, Refusal> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(refuse(400, "expected a JSON object")),
        Err(e) => Err(refuse(400, format!("not JSON: {e}"))),
    }
}

/// A key's public fields (never its digest).
fn public(k: &Checked) -> Value {
    let mut v: Value = serde_json::from_str(&record(k)).unwrap_or_default();
    if let Some(m) = v.as_object_mut() {
        m.remove("sha256");
    }
    v
}

fn unavailable(e: impl std::fmt::Display) -> Refusal {
    refuse(503, format!("Redis cannot be written or read: {e}"))
}

/// What a write left in Redis, as read back after it failed.
enum Outcome {
    /// The write landed (its answer was lost).
    Landed,
    /// It did not: try again.
    Absent,
    /// Something else is there (another writer's).
    Other,
}

impl KeyAdmin<'_> {
    /// Writes `id` as `mode` says. A write whose answer is lost (a timeout
    /// on a slow Redis: with `appendfsync always` under load, one in ten
    /// thousand) may have landed or not; the record is read back to tell,
    /// and the write is sent again if it did not, up to three times. A
    /// secret is never answered for a key Redis does not hold, nor lost
    /// for one it does.
    async fn write(&self, id: &str, rec: &str, mode: KeyWrite) -> Result<bool, Refusal> {
        let prefix = self.config.key_prefix();
        let mut last = String::new();
        for attempt in 0..3 {
            match store::write(self.redis, prefix, id, rec, mode).await {
                // A retry refused: maybe because the first attempt landed
                // late. Read on and let what is there decide.
                Ok(false) if attempt > 0 => {}
                Ok(done) => return Ok(done),
                Err(e) => {
                    tracing::warn!(id, error = %e, "an API key write went unanswered; reading the record back to tell whether it landed");
                    last = e.to_string();
                }
            }
            // What is there now? Read it (again, if the read fails too),
            // never write again before knowing.
            let mut now = None;
            for _ in 0..5 {
                if let Ok(mut r) = store::records(self.redis, prefix, &[id.to_string()]).await {
                    now = Some(r.pop().flatten());
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            let Some(now) = now else {
                break;
            };
            let outcome = match (now, mode) {
                (Some(r), KeyWrite::Create | KeyWrite::Update) if r == rec => Outcome::Landed,
                (None, KeyWrite::Delete) => Outcome::Landed,
                (None, KeyWrite::Create) | (Some(_), KeyWrite::Delete | KeyWrite::Update) => {
                    Outcome::Absent
                }
                (Some(_), KeyWrite::Create) | (None, KeyWrite::Update) => Outcome::Other,
            };
            match outcome {
                Outcome::Landed => return Ok(true),
                Outcome::Other => return Ok(false),
                Outcome::Absent => {}
            }
        }
        Err(unavailable(last))
    }

    fn checked(&self, fields: Map<String, Value>) -> Result<Checked, Refusal> {
        parse_record(&Value::Object(fields).to_string(), Some(&self.config.plans))
            .map_err(|e| refuse(400, e))
    }

    /// `{"id", "plan", and optionally "quotas", "capacity",
    /// "refill_per_sec"}`: the key, with its secret (shown this once).
    pub async fn create(&self, body: &[u8]) -> Result<Value, Refusal> {
        let mut fields = object(body)?;
        if let Some(f) = ["key", "sha256"].iter().find(|f| fields.contains_key(**f)) {
            return Err(refuse(
                400,
                format!("`{f}`: the gateway draws the secret of a key it issues"),
            ));
        }
        if let Some(bad) = fields
            .keys()
            .find(|k| *k != "id" && !SETTABLE.contains(&k.as_str()))
        {
            return Err(refuse(
                400,
                format!(
                    "unknown field `{bad}`; a key has id, plan, quotas, capacity, refill_per_sec"
                ),
            ));
        }
        let secret = new_secret()?;
        fields.insert("key".into(), secret.clone().into());
        let k = self.checked(fields)?;
        if let Some(other) = self.config_keys.by_id(&k.id) {
            return Err(refuse(
                409,
                format!(
                    "id \"{}\" is a key of the config ([[api_keys]] or clients.api_keys_file); runtime keys take other ids",
                    other.id
                ),
            ));
        }
        let written = self.write(&k.id, &record(&k), KeyWrite::Create).await?;
        if !written {
            return Err(refuse(409, format!("a key with id \"{}\" exists", k.id)));
        }
        tracing::info!(target: "audit", action = "create", id = %k.id, plan = %k.plan, by = self.by, "API key issued");
        let mut answer = public(&k);
        answer["key"] = secret.into();
        if let Some(r) = self.runtime {
            r.apply(&k.id.clone(), Some(k));
        }
        Ok(answer)
    }

    /// The key's stored record, checked.
    async fn current(&self, id: &str) -> Result<Checked, Refusal> {
        let raw = store::records(self.redis, self.config.key_prefix(), &[id.to_string()])
            .await
            .map_err(unavailable)?
            .pop()
            .flatten()
            .ok_or_else(|| refuse(404, format!("no runtime key has id \"{id}\"")))?;
        parse_record(&raw, None).map_err(|e| refuse(500, format!("the stored record: {e}")))
    }

    pub async fn get(&self, id: &str) -> Result<Value, Refusal> {
        Ok(public(&self.current(id).await?))
    }

    /// Changes some of `plan`, `quotas`, `capacity`, `refill_per_sec`
    /// (`null` removes a key's own limit: its plan's applies again).
    pub async fn update(&self, id: &str, body: &[u8]) -> Result<Value, Refusal> {
        let change = object(body)?;
        if let Some(bad) = change.keys().find(|k| !SETTABLE.contains(&k.as_str())) {
            return Err(refuse(
                400,
                format!("`{bad}` cannot be changed; change plan, quotas, capacity, refill_per_sec (a new secret is a new key)"),
            ));
        }
        let old = self.current(id).await?;
        let mut fields = match serde_json::from_str::<Value>(&record(&old)) {
            Ok(Value::Object(m)) => m,
            _ => return Err(refuse(500, "the stored record is not an object")),
        };
        for (k, v) in change {
            if v.is_null() {
                fields.remove(&k);
            } else {
                fields.insert(k, v);
            }
        }
        let k = self.checked(fields)?;
        let written = self.write(id, &record(&k), KeyWrite::Update).await?;
        if !written {
            return Err(refuse(404, format!("no runtime key has id \"{id}\"")));
        }
        tracing::info!(target: "audit", action = "update", id, plan = %k.plan, was = %old.plan, by = self.by, "API key changed");
        let answer = public(&k);
        if let Some(r) = self.runtime {
            r.apply(id, Some(k));
        }
        Ok(answer)
    }

    pub async fn revoke(&self, id: &str) -> Result<Value, Refusal> {
        let written = self.write(id, "", KeyWrite::Delete).await?;
        if !written {
            return Err(refuse(404, format!("no runtime key has id \"{id}\"")));
        }
        tracing::info!(target: "audit", action = "revoke", id, by = self.by, "API key revoked");
        if let Some(r) = self.runtime {
            r.apply(id, None);
        }
        Ok(json!({ "id": id, "revoked": true }))
    }

    /// A page of at most `limit` keys from `cursor`, sorted by id within
    /// each of Redis's scan steps; `next` is null on the last page.
    ///
    /// HSCAN's COUNT is a hint: a small hash (a listpack) answers all of it
    /// at once, a large one about COUNT records at a time. A step with more
    /// than `limit` records is read again for the next page, which takes the
    /// ids after the last one answered; a key present throughout a listing is
    /// in it at least once, as HSCAN promises.
    pub async fn list(&self, cursor: &Cursor, limit: usize) -> Result<Value, Refusal> {
        let limit = limit.clamp(1, Cursor::MAX_PAGE);
        let (next, page) = store::page(self.redis, self.config.key_prefix(), cursor.scan, limit)
            .await
            .map_err(unavailable)?;
        let mut keys: Vec<Checked> = page
            .iter()
            .filter_map(|(_, raw)| parse_record(raw, None).ok())
            .filter(|k| cursor.after.as_deref().is_none_or(|a| k.id.as_str() > a))
            .collect();
        keys.sort_by(|a, b| a.id.cmp(&b.id));
        let next = if keys.len() > limit {
            keys.truncate(limit);
            Some(Cursor {
                scan: cursor.scan,
                after: keys.last().map(|k| k.id.clone()),
            })
        } else {
            (next != 0).then_some(Cursor {
                scan: next,
                after: None,
            })
        };
        let keys: Vec<Value> = keys.iter().map(public).collect();
        Ok(json!({ "keys": keys, "next": next.map(|c| c.to_string()) }))
    }
}

/// Where a listing of the keys goes on: Redis's scan cursor, and within
/// that scan step the last id already answered. Written `SCAN` or
/// `SCAN:ID` (ids are `[A-Za-z0-9._-]`, so it needs no escaping in a URL).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cursor {
    scan: u64,
    after: Option<String>,
}

impl Cursor {
    /// The most keys a page holds.
    pub const MAX_PAGE: usize = 10_000;

    pub fn parse(s: &str) -> Result<Cursor, String> {
        let expected = || format!("expected a `next` of an earlier page, found \"{s}\"");
        let (scan, after) = match s.split_once(':') {
            Some((scan, id)) => {
                crate::config::rules::name(id).map_err(|_| expected())?;
                (scan, Some(id.to_string()))
            }
            None => (s, None),
        };
        Ok(Cursor {
            scan: scan.parse().map_err(|_| expected())?,
            after,
        })
    }
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.after {
            Some(id) => write!(f, "{}:{id}", self.scan),
            None => write!(f, "{}", self.scan),
        }
    }
}

/// A new key's secret: `gk_` and 24 random bytes in hex.
fn new_secret() -> Result<String, Refusal> {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes)
        .map_err(|e| refuse(500, format!("no randomness from the system: {e}")))?;
    Ok(format!("gk_{}", hex::encode(bytes)))
}
