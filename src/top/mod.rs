//! Who is being limited right now: per route and tier, the clients refused
//! most over the last minute, in memory bounded whatever the number of
//! clients (`GET /top` on the admin listener, `gateway top`).
//!
//! Each (route, tier) that has refused anyone keeps a ring of `SLOTS`
//! Space-Saving summaries (`summary`) of `K` counters, one per `SLOT_SECS`
//! of time; a query merges the slots its window covers. A client is named
//! as its bucket is: the per-IP tier by its address (an IPv6 client by its
//! prefix), the others by the API key's id or the verified token's subject
//! (`jwt:...`), never a secret. Memory: at most routes × tiers × `SLOTS` ×
//! `K` counters (about 200 bytes each with its name), allocated only for
//! a (route, tier) that refuses; a request when nothing was refused in the
//! last window costs one atomic load.
//!
//! Each replica counts what it decided. The fleet's view is the sum of the
//! replicas' (`gateway top --admin A,B,...` asks each and merges): a
//! client spread over N replicas is counted once per replica it reached.

pub mod summary;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde_json::{json, Value};

use summary::{Counter, Summary};

/// Counters per summary: any client refused more than 1/K of a slot's
/// refusals on its route and tier is held.
pub const K: usize = 64;
/// One summary per this many seconds.
pub const SLOT_SECS: i64 = 5;
/// Slots kept: the longest window a query can ask for is `SLOTS ×
/// SLOT_SECS` (a minute).
pub const SLOTS: usize = 12;
/// The limit kinds a request can be refused by (`LimitKind`'s).
const KINDS: usize = crate::limiter::LimitKind::COUNT;

/// What one request was told on one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Refused,
    Admitted,
}

/// A (route, tier)'s ring of summaries.
struct Ring {
    slots: Vec<(i64, Summary)>,
}

impl Ring {
    fn new() -> Self {
        Ring {
            slots: (0..SLOTS).map(|_| (i64::MIN, Summary::new(K))).collect(),
        }
    }

    /// The summary of the slot `now_us` falls in, emptied if it held an
    /// older slot's.
    fn slot(&mut self, now_us: i64) -> &mut Summary {
        let id = slot_of(now_us);
        let (held, s) = &mut self.slots[id.rem_euclid(SLOTS as i64) as usize];
        if *held != id {
            *held = id;
            s.clear();
        }
        s
    }

    /// The counters of the slots within `secs` of `now_us`, summed per
    /// client.
    fn merged(&self, now_us: i64, secs: i64) -> Vec<Counter> {
        let now = slot_of(now_us);
        let oldest = now - (secs + SLOT_SECS - 1) / SLOT_SECS + 1;
        let mut by: HashMap<&str, Counter> = HashMap::new();
        for (id, s) in &self.slots {
            if *id < oldest || *id > now {
                continue;
            }
            for c in s.counters() {
                by.entry(c.key.as_str())
                    .and_modify(|m| {
                        m.refused += c.refused;
                        m.error += c.error;
                        m.admitted += c.admitted;
                        m.first_us = m.first_us.min(c.first_us);
                        m.last_us = m.last_us.max(c.last_us);
                    })
                    .or_insert_with(|| c.clone());
            }
        }
        by.into_values().collect()
    }
}

/// One tier's verdict for `client`, into the ring's current slot.
fn count(ring: &mut Ring, seen: Seen, client: &str, now_us: i64) {
    let s = ring.slot(now_us);
    match seen {
        Seen::Refused => s.refused(client, now_us),
        Seen::Admitted => {
            s.admitted(client, now_us);
        }
    }
}

fn slot_of(now_us: i64) -> i64 {
    now_us.div_euclid(SLOT_SECS * 1_000_000)
}

/// A route's rings, one per limit kind (once it refused someone).
type Rings = [Option<Arc<Mutex<Ring>>>; KINDS];

/// One replica's top-K of limited clients.
pub struct Top {
    /// Per route name: its rings.
    rings: RwLock<HashMap<String, Rings>>,
    /// The slot of the last refusal: a request after a quiet window skips
    /// everything.
    last_refusal: AtomicI64,
    /// `[admin] top`: off, nothing is counted and `/top` says so.
    enabled: bool,
}

impl Default for Top {
    fn default() -> Self {
        Top::new(true)
    }
}

impl Top {
    pub fn new(enabled: bool) -> Self {
        Top {
            rings: RwLock::new(HashMap::new()),
            last_refusal: AtomicI64::new(i64::MIN),
            enabled,
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }
}

/// A query of `GET /top`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    pub route: Option<String>,
    pub tier: Option<String>,
    pub window_secs: i64,
    pub limit: usize,
}

impl Default for Ask {
    fn default() -> Self {
        Ask {
            route: None,
            tier: None,
            window_secs: SLOTS as i64 * SLOT_SECS,
            limit: 20,
        }
    }
}

impl Ask {
    /// `route=NAME&tier=KIND&window=SECS&limit=N`, each optional.
    pub fn parse(query: &str) -> Result<Ask, String> {
        let mut ask = Ask::default();
        let most = SLOTS as i64 * SLOT_SECS;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = crate::identity::attributes::decode(v)
                .map_err(|e| format!("query parameter {k} {e}"))?;
            match k {
                "route" => ask.route = Some(v),
                "tier" => ask.tier = Some(v),
                "window" => {
                    ask.window_secs = v
                        .parse()
                        .ok()
                        .filter(|s| (1..=most).contains(s))
                        .ok_or(format!("window={v}: expected seconds, 1 to {most}"))?
                }
                "limit" => {
                    ask.limit = v
                        .parse()
                        .ok()
                        .filter(|n| (1..=1000).contains(n))
                        .ok_or(format!("limit={v}: expected 1 to 1000"))?
                }
                other => {
                    return Err(format!(
                        "unknown parameter \"{other}\": expected route, tier, window, limit"
                    ))
                }
            }
        }
        Ok(ask)
    }
}

impl Top {
    /// Whether a request told `refused` (by any tier) at `now_us` is
    /// counted: an admitted one only while someone was refused within the
    /// last window (else it would find no one to count it for).
    pub fn wants(&self, refused: bool, now_us: i64) -> bool {
        self.enabled
            && (refused
                || self.last_refusal.load(Ordering::Relaxed) >= slot_of(now_us) - SLOTS as i64)
    }

    /// Counts one decided request: per tier, its kind and what it was told
    /// there; `client(kind)` names the client as that tier's bucket does.
    pub fn record<'a>(
        &self,
        route: &str,
        tiers: &[(crate::limiter::LimitKind, Seen)],
        client: impl Fn(crate::limiter::LimitKind) -> &'a str,
        now_us: i64,
    ) {
        let refused = tiers.iter().any(|(_, s)| *s == Seen::Refused);
        if !self.wants(refused, now_us) {
            return;
        }
        if refused {
            self.last_refusal
                .fetch_max(slot_of(now_us), Ordering::Relaxed);
        }
        // Every ring the request needs is there but for a first refusal on
        // a route and tier: that one makes its ring, then counts as any.
        if !self.count_each(route, tiers, &client, now_us) {
            for &(kind, seen) in tiers {
                if seen == Seen::Refused {
                    self.make_ring(route, kind.index());
                }
            }
            self.count_each(route, tiers, &client, now_us);
        }
    }

    /// Counts each tier into its ring, under one read of the routes; false
    /// (counting nothing) when a refused tier has no ring yet.
    fn count_each<'a>(
        &self,
        route: &str,
        tiers: &[(crate::limiter::LimitKind, Seen)],
        client: &impl Fn(crate::limiter::LimitKind) -> &'a str,
        now_us: i64,
    ) -> bool {
        let rings = self.rings.read();
        let per = rings.get(route);
        let has = |kind: crate::limiter::LimitKind| per.is_some_and(|p| p[kind.index()].is_some());
        if !tiers
            .iter()
            .all(|&(kind, seen)| seen == Seen::Admitted || has(kind))
        {
            return false;
        }
        for &(kind, seen) in tiers {
            if let Some(ring) = per.and_then(|p| p[kind.index()].as_ref()) {
                count(&mut ring.lock(), seen, client(kind), now_us);
            }
        }
        true
    }

    /// Makes `route`'s ring for `kind` if it has none (the first refusal
    /// there).
    fn make_ring(&self, route: &str, kind: usize) {
        let mut rings = self.rings.write();
        let per = rings
            .entry(route.to_string())
            .or_insert_with(|| std::array::from_fn(|_| None));
        per[kind].get_or_insert_with(|| Arc::new(Mutex::new(Ring::new())));
    }

    /// Forgets everything (a reload may rename routes).
    pub fn clear(&self) {
        self.rings.write().clear();
    }

    /// `GET /top`: the clients refused most within the window, on the
    /// routes and tiers asked, most refused first.
    pub fn query(&self, ask: &Ask, now_us: i64) -> Value {
        let rings: Vec<(String, usize, Arc<Mutex<Ring>>)> = self
            .rings
            .read()
            .iter()
            .filter(|(route, _)| ask.route.as_ref().is_none_or(|r| r == *route))
            .flat_map(|(route, per)| {
                per.iter()
                    .enumerate()
                    .filter_map(move |(kind, r)| r.clone().map(|r| (route.clone(), kind, r)))
            })
            .filter(|(_, kind, _)| {
                ask.tier
                    .as_deref()
                    .is_none_or(|t| t == crate::limiter::LimitKind::from_index(*kind).as_str())
            })
            .collect();
        let mut clients: Vec<Value> = rings
            .into_iter()
            .flat_map(|(route, kind, r)| {
                let merged = r.lock().merged(now_us, ask.window_secs);
                merged.into_iter().map(move |c| (route.clone(), kind, c))
            })
            .filter(|(.., c)| c.refused > 0)
            .map(|(route, kind, c)| {
                json!({
                    "client": c.key,
                    "route": route,
                    "tier": crate::limiter::LimitKind::from_index(kind).as_str(),
                    "refused": c.refused,
                    "refused_at_least": c.refused - c.error,
                    "admitted": c.admitted,
                    "first_seen": rfc3339(c.first_us),
                    "last_seen": rfc3339(c.last_us),
                })
            })
            .collect();
        most_refused_first(&mut clients);
        clients.truncate(ask.limit);
        json!({
            "window_secs": ask.window_secs,
            "counters_per_slot": K,
            "slot_secs": SLOT_SECS,
            "clients": clients,
        })
    }
}

/// Several replicas' `GET /top` answers as one: each client's counts on a
/// route and tier summed, first seen the earliest, last seen the latest,
/// most refused first (`gateway top`).
pub fn merge(answers: &[Value]) -> Value {
    let mut by: Vec<Value> = Vec::new();
    let mut index: HashMap<(String, String, String), usize> = HashMap::new();
    let text = |v: &Value, k: &str| v[k].as_str().unwrap_or_default().to_string();
    for c in answers
        .iter()
        .flat_map(|a| a["clients"].as_array().into_iter().flatten())
    {
        let id = (text(c, "client"), text(c, "route"), text(c, "tier"));
        match index.get(&id) {
            Some(&i) => {
                let m = &mut by[i];
                for k in ["refused", "refused_at_least", "admitted"] {
                    m[k] = (m[k].as_u64().unwrap_or(0) + c[k].as_u64().unwrap_or(0)).into();
                }
                // RFC 3339 in UTC, all of one shape: ordered as text.
                if text(c, "first_seen") < text(m, "first_seen") {
                    m["first_seen"] = c["first_seen"].clone();
                }
                if text(c, "last_seen") > text(m, "last_seen") {
                    m["last_seen"] = c["last_seen"].clone();
                }
            }
            None => {
                index.insert(id, by.len());
                by.push(c.clone());
            }
        }
    }
    most_refused_first(&mut by);
    // As many as one replica was asked for.
    let most = answers
        .iter()
        .map(|a| a["clients"].as_array().map_or(0, Vec::len))
        .max()
        .unwrap_or(0);
    by.truncate(most);
    let first = answers.first().cloned().unwrap_or_default();
    json!({
        "window_secs": first["window_secs"],
        "replicas": answers.len(),
        "clients": by,
    })
}

/// `/top`'s order, one replica's or merged: the most certain refusals
/// first, then the most refusals, then by name.
fn most_refused_first(clients: &mut [Value]) {
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let name = |v: &Value| v["client"].as_str().unwrap_or_default().to_string();
    clients.sort_by(|a, b| {
        (n(b, "refused_at_least"), n(b, "refused"), name(a)).cmp(&(
            n(a, "refused_at_least"),
            n(a, "refused"),
            name(b),
        ))
    });
}

fn rfc3339(us: i64) -> String {
    chrono::DateTime::from_timestamp_micros(us)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
