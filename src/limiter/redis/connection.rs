//! Connections to Redis: the topology a `[redis]` section describes
//! (standalone, sentinel, cluster) with its TLS and credentials; the request
//! path's connection (made on the proxy's runtime) and the probe's own
//! (made on the probe's thread); a sentinel's master found and followed; a
//! cluster's per-master connections; redis-rs errors classified.

use super::*;

#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

pub(super) struct Connected {
    conn: Conn,
    /// The master's address (sentinel mode), to notice a failover.
    master: Option<String>,
}

pub(super) enum Topology {
    Standalone(redis::Client),
    Sentinel {
        sentinels: Vec<redis::Client>,
        master: String,
        /// The sentinel URLs are `rediss://`: the master is reached over TLS
        /// too, verified with this CA (`None`: the system roots).
        tls: Option<Option<Vec<u8>>>,
    },
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        /// The same, never retrying a call: for refunds.
        refund_client: Box<redis::cluster::ClusterClient>,
        /// For the request path's own connection to each master.
        nodes: NodeAccess,
    },
}

/// What a connection to one node of a cluster needs besides its address:
/// the seed URLs' credentials and database, and TLS with its CA when the
/// seeds use it.
pub(super) struct NodeAccess {
    settings: redis::RedisConnectionInfo,
    tls: Option<Option<Vec<u8>>>,
}

/// A client for the node at `addr` (`host:port`), with `settings`'
/// credentials and database, over TLS (verified with the CA, else the
/// system roots) when `tls` says so.
pub(super) fn node_client(
    addr: &str,
    settings: &redis::RedisConnectionInfo,
    tls: Option<&Option<Vec<u8>>>,
) -> Result<redis::Client, LimiterError> {
    use redis::IntoConnectionInfo;
    let scheme = if tls.is_some() { "rediss" } else { "redis" };
    let info = format!("{scheme}://{addr}")
        .into_connection_info()
        .map_err(redis_err)?
        .set_redis_settings(settings.clone());
    open(info, tls.and_then(Option::as_ref))
}

/// A client for `url`: over TLS for `rediss://`, verified against `ca`
/// (PEM) when given, else the system roots; `password` (from
/// `redis.password` or its file) replaces the URL's.
pub(super) fn client(
    url: &str,
    ca: Option<&Vec<u8>>,
    password: Option<&str>,
) -> Result<redis::Client, LimiterError> {
    use redis::IntoConnectionInfo;
    let mut info = url.into_connection_info().map_err(redis_err)?;
    if let Some(pw) = password {
        let settings = info.redis_settings().clone().set_password(pw);
        info = info.set_redis_settings(settings);
    }
    open(info, ca.filter(|_| url.starts_with("rediss://")))
}

/// A client for `info`, verifying a TLS server against `ca` (PEM) when
/// given; without it, a `rediss://` address uses the system roots.
pub(super) fn open(
    info: redis::ConnectionInfo,
    ca: Option<&Vec<u8>>,
) -> Result<redis::Client, LimiterError> {
    match ca {
        Some(pem) => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem.clone()),
            },
        ),
        None => redis::Client::open(info),
    }
    .map_err(redis_err)
}

/// The password `redis.password_file` (when set) or `redis.password` gives;
/// empty counts as none (`${REDIS_PASSWORD:-}` with the variable unset).
/// The file wins when both are set (`check` says so).
pub(super) fn read_password(s: &RedisSettings) -> Result<Option<String>, LimiterError> {
    let password = match (&s.password_file, &s.password) {
        (Some(path), _) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| LimiterError::Refused {
                    reason: "config",
                    detail: format!("redis.password_file: cannot read {}: {e}", path.display()),
                })?
                // A mounted secret often ends with a newline.
                .trim_end_matches(['\n', '\r'])
                .to_string(),
        ),
        (None, Some(p)) => Some(p.expose().to_string()),
        (None, None) => None,
    };
    Ok(password.filter(|p| !p.is_empty()))
}

/// The clients a `[redis]` section describes, with `password` replacing
/// the URLs' own; and every password involved, to redact from errors.
pub(super) fn topology_of(
    s: &RedisSettings,
    password: Option<&str>,
) -> Result<(Topology, Vec<String>), LimiterError> {
    let budget = Duration::from_millis(s.timeout_ms);
    let tls = s.urls.iter().any(|u| u.starts_with("rediss://"));
    let ca = match &s.ca_file {
        Some(path) if tls => Some(std::fs::read(path).map_err(|e| LimiterError::Refused {
            reason: "config",
            detail: format!("redis.ca_file: cannot read {}: {e}", path.display()),
        })?),
        _ => None,
    };
    let mut secrets: Vec<String> = password.iter().map(|p| p.to_string()).collect();
    for u in &s.urls {
        if let Ok(c) = redis::Client::open(u.as_str()) {
            if let Some(p) = c.get_connection_info().redis_settings().password() {
                secrets.push(p.to_string());
            }
        }
    }
    let topology = match s.mode {
        RedisMode::Standalone => Topology::Standalone(client(&s.urls[0], ca.as_ref(), password)?),
        RedisMode::Sentinel => Topology::Sentinel {
            sentinels: s
                .urls
                .iter()
                .map(|u| client(u, ca.as_ref(), password))
                .collect::<Result<_, _>>()?,
            master: s.sentinel_master.clone().unwrap_or_default(),
            tls: s.urls[0].starts_with("rediss://").then(|| ca.clone()),
        },
        RedisMode::Cluster => {
            let cluster_client = |retries: u32| {
                let mut builder =
                    redis::cluster::ClusterClient::builder(s.urls.iter().map(String::as_str))
                        .connection_timeout(Duration::from_millis(500))
                        .response_timeout(budget.max(Duration::from_millis(100)))
                        .retries(retries);
                if let Some(pw) = password {
                    builder = builder.password(pw);
                }
                if let Some(pem) = &ca {
                    builder = builder.certs(redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem.clone()),
                    });
                }
                builder.build().map_err(redis_err).map(Box::new)
            };
            Topology::Cluster {
                client: cluster_client(2)?,
                // A refund must not run twice (it would give back more than
                // was taken): its client never sends a call again, even
                // after a timeout that may have hidden a run.
                refund_client: cluster_client(0)?,
                nodes: NodeAccess {
                    settings: client(&s.urls[0], ca.as_ref(), password)?
                        .get_connection_info()
                        .redis_settings()
                        .clone(),
                    tls: s.urls[0].starts_with("rediss://").then(|| ca.clone()),
                },
            }
        }
    };
    Ok((topology, secrets))
}

/// Error codes a cluster node answers before running a call.
pub(super) const CLUSTER_REFUSALS: [&str; 7] = [
    "MOVED",
    "ASK",
    "TRYAGAIN",
    "READONLY",
    "CLUSTERDOWN",
    "MASTERDOWN",
    "LOADING",
];

pub(super) fn redis_err(e: redis::RedisError) -> LimiterError {
    let text = e.to_string();
    // The script's error code and its detail ("limiter.lua:", "late by N
    // us: ..."): redis-rs shows the code quoted, which the whole text's
    // form (kept for older ones) never matched, and every late call then
    // opened the breaker on a healthy Redis.
    let late = match (e.code(), e.detail()) {
        (Some(code), Some(detail)) if code.ends_with(".lua:") => detail.strip_prefix("late by "),
        _ => text.split(".lua: late by ").nth(1),
    };
    if let Some(rest) = late {
        let us = rest.split(' ').next().and_then(|n| n.parse().ok());
        return LimiterError::Late(us.unwrap_or(0));
    }
    let refused = |reason| LimiterError::Refused {
        reason,
        detail: text.clone(),
    };
    match e.code() {
        Some("CROSSSLOT") => return LimiterError::CrossSlot,
        Some("WRONGPASS" | "NOAUTH") => return refused("auth"),
        Some("NOPERM") => return refused("permission"),
        // From a master's own connection, what the cluster client would
        // follow or wait out itself: refused before the script ran.
        Some(code) => {
            if let Some(&code) = CLUSTER_REFUSALS.iter().find(|c| **c == code) {
                let to = e.redirect_node().map(|(addr, _)| addr.to_string());
                return LimiterError::Misplaced(code, to);
            }
        }
        None => {}
    }
    match e.kind() {
        redis::ErrorKind::AuthenticationFailed => refused("auth"),
        redis::ErrorKind::InvalidClientConfig => refused("config"),
        _ if text.contains("DB index is out of range") || text.contains("invalid DB index") => {
            refused("database")
        }
        _ if text.contains("AUTH") && text.contains("without any password configured") => {
            refused("auth")
        }
        // rustls: a certificate this gateway cannot trust (CA, name, dates).
        _ if text.contains("invalid peer certificate") => refused("tls"),
        _ if e.is_timeout() => LimiterError::NoAnswer(text),
        _ => LimiterError::Redis(text),
    }
}

/// The request path's connections retry a failed connect twice; the
/// probe's do not (`retries = 0`): a refusal that retrying cannot fix (a
/// certificate, a password) must reach `/readyz` as itself, not as a timeout.
pub(super) fn manager_config() -> ConnectionManagerConfig {
    manager_config_with(2)
}

pub(super) fn manager_config_with(retries: usize) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(Duration::from_millis(500)))
        .set_number_of_retries(retries)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(500))
}

impl Inner {
    /// The budget of the probe's own calls (probe, heartbeat, charge): off
    /// the request path, so at least half a second however small the
    /// request budget.
    pub(super) fn upkeep_budget(&self) -> Duration {
        self.budget.max(Duration::from_millis(500))
    }

    /// The connection requests use, made in the caller's runtime (the
    /// proxy's), so a Redis call costs no hop to another thread. Sentinel:
    /// to the master the probe last found. Cluster: the probe's connection.
    pub(super) fn connection(&self) -> Result<Conn, LimiterError> {
        match &**self.topology.load() {
            Topology::Standalone(client) => {
                if let Some(c) = self.single.load().as_ref() {
                    return Ok(Conn::Single(ConnectionManager::clone(c)));
                }
                // Two requests racing here make two; the one stored stays.
                let c = ConnectionManager::new_lazy_with_config(client.clone(), manager_config())
                    .map_err(redis_err)?;
                self.single.store(Some(Arc::new(c.clone())));
                Ok(Conn::Single(c))
            }
            Topology::Sentinel { .. } => {
                let target = self.connected.load();
                let master = target
                    .as_ref()
                    .and_then(|c| c.master.clone())
                    .ok_or(LimiterError::NotConnected)?;
                if let Some(rc) = self.request_conn.load().as_ref() {
                    if rc.master.as_deref() == Some(master.as_str()) {
                        return Ok(rc.conn.clone());
                    }
                }
                let client = self.master_client(&master)?;
                let conn = Conn::Single(
                    ConnectionManager::new_lazy_with_config(client, manager_config())
                        .map_err(redis_err)?,
                );
                self.request_conn.store(Some(Arc::new(Connected {
                    conn: conn.clone(),
                    master: Some(master),
                })));
                Ok(conn)
            }
            Topology::Cluster { .. } => self.probe_connection(),
        }
    }

    /// The probe's own connection (made in the probe's runtime).
    pub(super) fn probe_connection(&self) -> Result<Conn, LimiterError> {
        if let Topology::Standalone(client) = &**self.topology.load() {
            if let Some(c) = self.probe_single.load().as_ref() {
                return Ok(Conn::Single(ConnectionManager::clone(c)));
            }
            // Made only on the probe's thread, so never raced.
            let c = ConnectionManager::new_lazy_with_config(client.clone(), manager_config_with(0))
                .map_err(redis_err)?;
            self.probe_single.store(Some(Arc::new(c.clone())));
            return Ok(Conn::Single(c));
        }
        self.connected
            .load()
            .as_ref()
            .map(|c| c.conn.clone())
            .ok_or(LimiterError::NotConnected)
    }

    /// A client for the master the sentinels named, with the credentials and
    /// database of the configured URL (the sentinels only say where it is).
    pub(super) fn master_client(&self, addr: &str) -> Result<redis::Client, LimiterError> {
        let topology = self.topology.load();
        let Topology::Sentinel { sentinels, tls, .. } = &**topology else {
            return Err(LimiterError::NotConnected);
        };
        let settings = sentinels
            .first()
            .map(|s| s.get_connection_info().redis_settings().clone())
            .ok_or(LimiterError::NotConnected)?;
        node_client(addr, &settings, tls.as_ref())
    }

    /// Cluster: the request path's connection to the master at `addr`,
    /// made on first use in the caller's runtime (the proxy's), as
    /// standalone's is: a batch's calls go straight to their masters, with
    /// no hop to the cluster client's task on the probe's thread.
    pub(super) fn node_connection(&self, addr: &str) -> Result<Conn, LimiterError> {
        let mut conns = self.node_conns.lock();
        if let Some(c) = conns.get(addr) {
            return Ok(Conn::Single(c.clone()));
        }
        let topology = self.topology.load();
        let Topology::Cluster { nodes, .. } = &**topology else {
            return Err(LimiterError::NotConnected);
        };
        let client = node_client(addr, &nodes.settings, nodes.tls.as_ref())?;
        let c =
            ConnectionManager::new_lazy_with_config(client, manager_config()).map_err(redis_err)?;
        conns.insert(addr.to_string(), c.clone());
        Ok(Conn::Single(c))
    }

    /// Asks the sentinels, in order, where the master is.
    pub(super) async fn sentinel_master(
        sentinels: &[redis::Client],
        name: &str,
    ) -> Result<String, LimiterError> {
        let mut last = LimiterError::NotConnected;
        for s in sentinels {
            let ask = async {
                let mut c = s.get_multiplexed_async_connection().await?;
                let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(name)
                    .query_async(&mut c)
                    .await?;
                Ok::<_, redis::RedisError>(addr)
            };
            match tokio::time::timeout(Duration::from_millis(300), ask).await {
                Ok(Ok(Some((host, port)))) => return Ok(format!("{host}:{port}")),
                Ok(Ok(None)) => {
                    last = LimiterError::Redis(format!("sentinels do not know master \"{name}\""))
                }
                Ok(Err(e)) => last = redis_err(e),
                Err(_) => last = LimiterError::Timeout(300),
            }
        }
        Err(last)
    }

    /// (Re)connects where the topology says Redis is now.
    pub(super) async fn ensure_connected(&self) -> Result<(), LimiterError> {
        // A snapshot: no guard is held across the awaits below.
        let topology = self.topology.load_full();
        match &*topology {
            Topology::Standalone(_) => Ok(()),
            Topology::Sentinel {
                sentinels, master, ..
            } => {
                let addr = Self::sentinel_master(sentinels, master).await?;
                let current = self.connected.load();
                if current.as_ref().and_then(|c| c.master.as_deref()) == Some(addr.as_str()) {
                    return Ok(());
                }
                let client = self.master_client(&addr)?;
                let conn = ConnectionManager::new_lazy_with_config(client, manager_config_with(0))
                    .map_err(redis_err)?;
                tracing::info!(master = %addr, "limiter: sentinel master discovered");
                self.connected.store(Some(Arc::new(Connected {
                    conn: Conn::Single(conn),
                    master: Some(addr),
                })));
                Ok(())
            }
            Topology::Cluster {
                client,
                refund_client,
                ..
            } => {
                if self.refund_conn.load().is_none() {
                    // Without it a refund is not made (the client stays
                    // charged): a failure here fails nothing else.
                    let connect = refund_client.get_async_connection();
                    if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
                        self.refund_conn.store(Some(Arc::new(c)));
                    }
                }
                if self.connected.load().is_some() {
                    return Ok(());
                }
                let conn =
                    tokio::time::timeout(Duration::from_secs(2), client.get_async_connection())
                        .await
                        .map_err(|_| LimiterError::Timeout(2000))?
                        .map_err(redis_err)?;
                self.connected.store(Some(Arc::new(Connected {
                    conn: Conn::Cluster(conn),
                    master: None,
                })));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script's refusal of a late call, as redis-rs reads it off the
    /// wire, is `Late` with its lateness: read as any Redis error, it had
    /// opened the breaker on a healthy Redis.
    #[test]
    fn a_late_call_reads_as_late() {
        for (wire, us) in [
            (
                &b"-limiter.lua: late by 1765 us: nothing written\r\n"[..],
                1765,
            ),
            (&b"-charge.lua: late by 3 us: nothing written\r\n"[..], 3),
        ] {
            let value = redis::parse_redis_value(wire).expect("an error reply");
            let e = value.extract_error().expect_err("a server error");
            let got = redis_err(e);
            assert!(matches!(got, LimiterError::Late(n) if n == us), "{got:?}");
        }
    }
}
