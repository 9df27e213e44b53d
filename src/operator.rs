//! `gateway limits show|reset`: the admin `/limits` endpoint for operators
//! at a shell. With `limiter.backend = "redis"` it reads and resets the
//! shared buckets in Redis itself (every replica hears of a reset within a
//! second); with the local backend the buckets live in a gateway's memory,
//! so it asks that gateway's admin listener. `gateway usage` reads a quota
//! period's counts from Redis (`usage`); `gateway top` asks the replicas'
//! admin listeners who they refuse most, and merges (`top`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};

use crate::admission::{self, Policy, Subject};
use crate::config::{Backend, Config};
use crate::identity::Credentials;
use crate::limiter::RedisBackend;

/// `gateway usage`: the period's report, rendered; on failure the exit
/// code (2: the question is wrong, 1: Redis could not answer) and why.
pub fn usage(
    config: &Config,
    credentials: &Credentials,
    period: &str,
    at: Option<&str>,
    format: &str,
) -> Result<String, (u8, String)> {
    let q = crate::usage::Question::parse(period, at, format, config.limiter.quota_time_zone)
        .map_err(|e| (2, e))?;
    let settings = match (config.limiter.backend, &config.redis) {
        (Backend::Redis, Some(s)) => s,
        _ => {
            return Err((
                2,
                "usage is read from Redis, and limiter.backend is \"local\" (a single instance's counts live in its memory: GET /limits?key=ID&quota=PERIOD on its admin port)".into(),
            ))
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| (1, e.to_string()))?;
    let redis = RedisBackend::from_settings(settings, None).map_err(|e| (1, e.to_string()))?;
    let report = rt
        .block_on(crate::usage::collect(&redis, config, &credentials.keys, &q))
        .map_err(|e| (1, format!("cannot read Redis: {e}")))?;
    Ok(crate::usage::render(&report, q.format))
}

/// What to show or reset.
pub struct Ask {
    pub subject: Subject,
    pub route: Option<String>,
    pub value: Option<String>,
    /// One quota of the key, by period.
    pub quota: Option<String>,
    pub reset: bool,
}

/// Runs the command; the answer is the same JSON `/limits` gives.
pub fn run(config: Config, credentials: &Credentials, ask: &Ask) -> Result<Value, String> {
    match (config.limiter.backend, &config.redis) {
        (Backend::Redis, Some(settings)) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            let unreachable = |e: String| {
                format!(
                    "cannot reach Redis ({e}); while it is down the gateways decide on their local fallback: ask one's admin port, GET /limits{}",
                    query(ask)
                )
            };
            let redis = RedisBackend::from_settings(settings, None)
                .map_err(|e| unreachable(e.to_string()))?;
            let redact = |e: String| redis.redact(&e);
            let mut policy = Policy::new(std::sync::Arc::new(config.clone()), credentials);
            // An id the config does not hold may be a key issued at runtime:
            // read it from Redis, as a replica's synced copy would hold it.
            if let Subject::Key(id) = &ask.subject {
                if credentials.keys.by_id(id).is_none() {
                    let found = rt
                        .block_on(crate::identity::apikeys::runtime::fetch(
                            &redis,
                            config.key_prefix(),
                            id,
                        ))
                        .map_err(|e| unreachable(redact(e)))?;
                    if let Some(key) = found {
                        let store = std::sync::Arc::new(
                            crate::identity::apikeys::runtime::RuntimeKeys::default(),
                        );
                        store.apply(id, Some(key));
                        policy = policy.with_runtime_keys(store);
                    }
                }
            }
            let buckets = admission::buckets(
                &policy,
                &ask.subject,
                ask.route.as_deref(),
                ask.value.as_deref(),
                ask.quota.as_deref(),
            )
            .map_err(|e| e.to_string())?;
            let checks: Vec<_> = buckets.iter().map(|b| b.check.clone()).collect();
            let describe = |i: usize| buckets[i].describe();
            rt.block_on(async {
                if ask.reset {
                    let keys: Vec<&str> = checks.iter().map(|c| c.key.as_str()).collect();
                    let stream = format!("{}:resets", settings.key_prefix);
                    let n = redis
                        .reset(&keys, &stream)
                        .await
                        .map_err(|e| unreachable(redact(e.to_string())))?;
                    Ok(json!({
                        "reset": (0..buckets.len()).map(describe).collect::<Vec<_>>(),
                        "backend": "redis",
                        "redis_buckets_deleted": n,
                    }))
                } else {
                    // With standing shares a cut bucket's key holds its pool;
                    // each replica's share lives in that replica.
                    // Cut as for `limiter.instances` replicas (a charged
                    // bucket's cut depends on the live count, unknown here).
                    let (shares, n) = (config.limiter.shares, config.limiter.instances);
                    let cut = |c: &crate::limiter::Check| {
                        crate::limiter::standing::cuts(c, &shares, n)
                    };
                    let peeked: Vec<_> = match shares.used() {
                        true => checks
                            .iter()
                            .map(|c| crate::limiter::standing::pool_check(c, &shares, n))
                            .collect(),
                        false => checks.clone(),
                    };
                    let (snapshots, _) = redis
                        .peek(&peeked)
                        .await
                        .map_err(|e| unreachable(redact(e.to_string())))?;
                    let list: Vec<Value> = snapshots
                        .iter()
                        .enumerate()
                        .map(|(i, s)| {
                            let mut b = describe(i);
                            b["limit"] = s.limit.into();
                            b["remaining"] = s.remaining.into();
                            b["reset_ms"] = s.reset_after_us.div_ceil(1000).into();
                            b["backend"] = "redis".into();
                            if cut(&checks[i]) {
                                b["limit"] =
                                    crate::limiter::algorithms::quota(&checks[i].algorithm).into();
                                b["shares"] = "the pool only: each replica's standing share is in its GET /limits".into();
                            }
                            b
                        })
                        .collect();
                    let mut answer = json!({ "buckets": list });
                    add_leases(&config, ask, &mut answer);
                    if let Some(list) = answer["buckets"].as_array_mut() {
                        list.iter_mut().for_each(admission::add_used);
                    }
                    Ok(answer)
                }
            })
        }
        _ => ask_admin(&config, ask),
    }
}

/// Leases live in each replica's memory, not in Redis: the replica at
/// `server.admin_listen` is asked for its own (`/limits` reports them), and
/// each bucket read from Redis gets that replica's `lease` (null: none).
/// If that replica cannot be asked, `leases` says why and no bucket
/// claims a lease it may or may not hold.
fn add_leases(config: &Config, ask: &Ask, answer: &mut Value) {
    if config.server.admin_listen.is_none() {
        answer["leases"] =
            "unknown: server.admin_listen is not set, so no replica can be asked for its own"
                .into();
        return;
    }
    let from = match ask_admin(config, ask) {
        Ok(replica) => replica,
        Err(e) => {
            answer["leases"] = format!("unknown: {e}").into();
            return;
        }
    };
    let id = |b: &Value| {
        (
            b["tier"].clone(),
            b["route"].clone(),
            b["sub_bucket"].clone(),
        )
    };
    let theirs: Vec<&Value> = from["buckets"].as_array().into_iter().flatten().collect();
    if let Some(list) = answer["buckets"].as_array_mut() {
        for b in list {
            b["lease"] = theirs
                .iter()
                .find(|t| id(t) == id(b))
                .map_or(Value::Null, |t| t["lease"].clone());
        }
    }
    answer["leases"] = format!(
        "of the replica at {} (server.admin_listen)",
        config.server.admin_listen.as_deref().unwrap_or("?")
    )
    .into();
}

/// `/limits`'s query for `ask`, percent-encoded.
/// A query parameter's value, percent-encoded.
pub fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn query(ask: &Ask) -> String {
    let enc = encode;
    let mut q = match &ask.subject {
        Subject::Key(id) => format!("?key={}", enc(id)),
        Subject::Ip(ip) => format!("?ip={}", enc(&ip.to_string())),
        Subject::Jwt { id, issuer, plan } => {
            let mut q = format!("?sub={}", enc(id));
            for (name, v) in [("iss", issuer), ("plan", plan)] {
                if let Some(v) = v {
                    q.push_str(&format!("&{name}={}", enc(v)));
                }
            }
            q
        }
        Subject::Nobody => "?".to_string(),
    };
    for (name, v) in [
        ("route", &ask.route),
        ("value", &ask.value),
        ("quota", &ask.quota),
    ] {
        if let Some(v) = v {
            if !q.ends_with('?') {
                q.push('&');
            }
            q.push_str(&format!("{name}={}", enc(v)));
        }
    }
    q
}

/// One request to the gateway's admin listener (HTTP/1.1, closed after).
fn ask_admin(config: &Config, ask: &Ask) -> Result<Value, String> {
    let listen = config
        .server
        .admin_listen
        .as_deref()
        .ok_or("the local backend's buckets live in the gateway: set server.admin_listen")?;
    let method = if ask.reset { "DELETE" } else { "GET" };
    let token = config.admin.token.as_ref().map(|t| t.expose());
    admin_request(listen, method, &format!("/limits{}", query(ask)), token)
        .map_err(|e| e.replace("{where}", "server.admin_listen"))
}

/// `method target` on the admin listener at `listen` (an unspecified
/// address means this host): the JSON answer of a 200, else why not (a
/// message naming `{where}`, for the caller to say where the address came
/// from).
fn admin_request(
    listen: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
) -> Result<Value, String> {
    let mut addr: SocketAddr = listen
        .parse()
        .map_err(|_| format!("{{where}} \"{listen}\" is not an address"))?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let mut req = format!("{method} {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    let fail = |e: std::io::Error| format!("cannot ask the gateway at {addr} ({{where}}): {e}");
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(fail)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(fail)?;
    s.write_all(req.as_bytes()).map_err(fail)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).map_err(fail)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or("the gateway's answer has no body")?;
    let status = head.split(' ').nth(1).unwrap_or("?");
    let json: Value = serde_json::from_str(body.trim())
        .map_err(|_| format!("the gateway answered {status}: {body}"))?;
    if status != "200" {
        return Err(format!(
            "the gateway answered {status}: {}",
            json["error"].as_str().unwrap_or(body)
        ));
    }
    Ok(json)
}

/// `gateway top`: each replica's `GET /top?QUERY` at `admins` (the
/// config's `server.admin_listen` when none is named), merged into one
/// fleet view (`top::merge`).
pub fn top(config: &Config, admins: &[String], query: &str) -> Result<Value, String> {
    let own = config.server.admin_listen.clone();
    let (admins, named): (Vec<String>, &str) = match (admins.is_empty(), own) {
        (false, _) => (admins.to_vec(), "--admin"),
        (true, Some(a)) => (vec![a], "server.admin_listen"),
        (true, None) => return Err("name the replicas' admin listeners: --admin HOST:PORT[,...] (or set server.admin_listen)".into()),
    };
    let mut answers = Vec::new();
    for a in &admins {
        let v = admin_request(a, "GET", &format!("/top?{query}"), None)
            .map_err(|e| e.replace("{where}", named))?;
        answers.push(v);
    }
    Ok(crate::top::merge(&answers))
}

/// `gateway top`'s answer as a table.
pub fn top_table(answer: &Value) -> String {
    let mut out = format!(
        "{:<40} {:<20} {:<12} {:>9} {:>9}  {:<24} {}\n",
        "client", "route", "tier", "refused", "admitted", "first seen", "last seen"
    );
    for c in answer["clients"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "{:<40} {:<20} {:<12} {:>9} {:>9}  {:<24} {}\n",
            c["client"].as_str().unwrap_or("?"),
            c["route"].as_str().unwrap_or("?"),
            c["tier"].as_str().unwrap_or("?"),
            c["refused"],
            c["admitted"],
            c["first_seen"].as_str().unwrap_or(""),
            c["last_seen"].as_str().unwrap_or(""),
        ));
    }
    out.push_str(&format!(
        "(the last {} s, {} replica(s))\n",
        answer["window_secs"], answer["replicas"]
    ));
    out
}

/// The answer as a table, for people.
pub fn table(answer: &Value) -> String {
    let mut out = String::new();
    if let Some(list) = answer["buckets"].as_array() {
        out.push_str(&format!(
            "{:<11} {:<20} {:<15} {:>10} {:>10} {:>10}  {:<8} {}\n",
            "tier", "route", "algorithm", "limit", "remaining", "reset_ms", "backend", "lease"
        ));
        // A quota: what was used of it, and when its period ends (UTC).
        let quota = |b: &Value| {
            let ends = b["period_ends"].as_i64()?;
            let ends = chrono::DateTime::from_timestamp(ends, 0)?;
            Some(format!(
                "  used {}, {} ends {}",
                b["used"],
                b["period"].as_str().unwrap_or("period"),
                ends.format("%Y-%m-%dT%H:%M:%SZ")
            ))
        };
        // This replica's unspent lease: tokens, and ms until it expires.
        let lease = |b: &Value| match b.get("lease") {
            None => "?".to_string(),
            Some(Value::Null) => "-".to_string(),
            Some(l) => format!("{} ({} ms)", l["tokens"], l["expires_ms"]),
        };
        // A split global limit's sub-buckets: "route (2 of 4)".
        let route = |b: &Value| {
            let name = b["route"].as_str().unwrap_or("-");
            match b["sub_bucket"].as_str() {
                Some(s) => format!("{name} ({s})"),
                None => name.to_string(),
            }
        };
        for b in list {
            out.push_str(&format!(
                "{:<11} {:<20} {:<15} {:>10} {:>10} {:>10}  {:<8} {}{}\n",
                b["tier"].as_str().unwrap_or("?"),
                route(b),
                b["algorithm"].as_str().unwrap_or("?"),
                // JSON values ignore a width: print them as text first.
                b["limit"].to_string(),
                b["remaining"].to_string(),
                b["reset_ms"].to_string(),
                b["backend"].as_str().unwrap_or("?"),
                lease(b),
                quota(b).unwrap_or_default(),
            ));
        }
        if list.is_empty() {
            out.push_str("(no buckets: this client is not limited by any tier or route)\n");
        }
        if let Some(from) = answer["leases"].as_str() {
            out.push_str(&format!("leases: {from}\n"));
        }
    } else if let Some(list) = answer["reset"].as_array() {
        for b in list {
            out.push_str(&format!(
                "reset {} {}\n",
                b["tier"].as_str().unwrap_or("?"),
                b["route"].as_str().unwrap_or("")
            ));
        }
        out.push_str(&format!(
            "backend: {}\n",
            answer["backend"].as_str().unwrap_or("?")
        ));
    }
    out
}

/// What `gateway keys` asks (the JSON fields of `/keys`).
pub enum KeysAsk {
    Create {
        id: String,
        body: serde_json::Map<String, Value>,
    },
    Update {
        id: String,
        body: serde_json::Map<String, Value>,
    },
    Revoke {
        id: String,
    },
    List {
        cursor: String,
        limit: usize,
    },
}

/// What `gateway check` says of the runtime keys in Redis (with the Redis
/// backend): `Ok((count, conflicts))`, or why they could not be read
/// within `budget` (the message redacted). `None` without Redis.
pub fn runtime_key_check(
    config: &Config,
    credentials: &Credentials,
    budget: std::time::Duration,
) -> Option<Result<(usize, Vec<String>), String>> {
    let (Backend::Redis, Some(settings)) = (config.limiter.backend, &config.redis) else {
        return None;
    };
    let redis = match RedisBackend::from_settings(settings, None) {
        Ok(r) => r,
        Err(e) => return Some(Err(e.to_string())),
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return Some(Err(e.to_string())),
    };
    let read = rt.block_on(async {
        tokio::time::timeout(
            budget,
            crate::identity::apikeys::runtime::conflicts(
                &redis,
                config.key_prefix(),
                &credentials.keys,
            ),
        )
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {} ms", budget.as_millis())))
    });
    Some(read.map_err(|e| redis.redact(&e)))
}

/// Who runs `gateway keys`, for the audit log: `cli:` and the login name
/// (`$USER`, else `$LOGNAME`), else the process's uid (a container often
/// sets neither), else `cli` alone.
fn cli_caller() -> String {
    let named = ["USER", "LOGNAME"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find(|n| !n.is_empty());
    if let Some(n) = named {
        return format!("cli:{}", n.chars().take(64).collect::<String>());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        // /proc/self belongs to the user the process runs as.
        if let Ok(m) = std::fs::metadata("/proc/self") {
            return format!("cli:uid={}", m.uid());
        }
    }
    "cli".to_string()
}

/// `gateway keys`: the runtime keys in Redis, as `/keys` changes them (the
/// replicas follow within a second).
pub fn keys(config: &Config, credentials: &Credentials, ask: KeysAsk) -> Result<Value, String> {
    let (Backend::Redis, Some(settings)) = (config.limiter.backend, &config.redis) else {
        return Err("runtime API keys are kept in Redis, and limiter.backend is \"local\": use [[api_keys]] or clients.api_keys_file".into());
    };
    let redis = RedisBackend::from_settings(settings, None).map_err(|e| e.to_string())?;
    let by = cli_caller();
    let admin = crate::identity::apikeys::admin::KeyAdmin {
        redis: &redis,
        config,
        config_keys: &credentials.keys,
        runtime: None,
        by: &by,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let body = |mut m: serde_json::Map<String, Value>, id: Option<String>| {
        if let Some(id) = id {
            m.insert("id".into(), id.into());
        }
        Value::Object(m).to_string().into_bytes()
    };
    rt.block_on(async {
        match ask {
            KeysAsk::Create { id, body: b } => admin.create(&body(b, Some(id))).await,
            KeysAsk::Update { id, body: b } => admin.update(&id, &body(b, None)).await,
            KeysAsk::Revoke { id } => admin.revoke(&id).await,
            KeysAsk::List { cursor, limit } => {
                let cursor =
                    crate::identity::apikeys::admin::Cursor::parse(&cursor).map_err(|e| {
                        crate::identity::apikeys::admin::Refusal {
                            status: 400,
                            message: format!("--cursor: {e}"),
                        }
                    })?;
                if limit == 0 {
                    return Err(crate::identity::apikeys::admin::Refusal {
                        status: 400,
                        message: "--limit: expected a number from 1 to 10000, found 0".into(),
                    });
                }
                admin.list(&cursor, limit).await
            }
        }
    })
    .map_err(|r| redis.redact(&r.message))
}
