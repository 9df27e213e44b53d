//! Configuration: the file (`file`, read through `reader`) and the validated
//! model (`model`). The live snapshot the proxy reads per request, and its
//! reload, live in `proxy` (`Live`, `reload`): a reload swaps the policy, the
//! upstream pools and the metric handles together.

mod admin;
mod auth;
mod clients;
mod cors;
mod file;
mod inflight;
pub mod keys;
mod limiter;
mod limits;
mod log;
pub mod model;
mod reader;
mod redis;
mod routes;
pub mod rules;
mod server;
mod tls;
mod upstreams;

use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

pub use model::*;

/// One problem in a config file: where it is and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Dotted key path, e.g. `routes[2].limit.capacity`.
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{} (line {}): {}", self.path, line, self.message),
            None => write!(f, "{}: {}", self.path, self.message),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} has {} problem(s):\n{}", path.display(), errors.len(), list(errors))]
    Invalid {
        path: PathBuf,
        errors: Vec<ConfigError>,
    },
}

fn list(errors: &[ConfigError]) -> String {
    errors.iter().fold(String::new(), |mut s, e| {
        let _ = writeln!(s, "  {e}");
        s
    })
}

/// Reads and validates a config file.
pub fn load(path: &Path) -> Result<Config, LoadError> {
    let src = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse(&src).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })
}

/// `; quotas: 1000/day, 30000/month` (empty without any).
fn quotas(q: &[Quota]) -> String {
    if q.is_empty() {
        return String::new();
    }
    let list: Vec<String> = q
        .iter()
        .map(|q| format!("{}/{}", q.limit, q.period.as_str()))
        .collect();
    format!("; quotas: {}", list.join(", "))
}

/// Validates config text; every problem is returned at once, ordered by line.
pub fn parse(src: &str) -> Result<Config, Vec<ConfigError>> {
    file::parse(src, None)
}

/// A check of what the file names rather than of its text (the TLS
/// certificates: `crate::certs::problems`), run while the file is read so
/// that its problems are listed with the file's own, in one format.
pub type FileCheck<'a> = &'a dyn Fn(&TlsListeners) -> Vec<ConfigError>;

/// `load`, with `check` run on `[server.tls]` when that section is valid.
pub fn load_checked(path: &Path, check: FileCheck<'_>) -> Result<Config, LoadError> {
    let src = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    file::parse(&src, Some(check)).map_err(|errors| LoadError::Invalid {
        path: path.to_path_buf(),
        errors,
    })
}

impl Config {
    /// Whether any plan or key counts calendar quotas.
    pub fn has_quotas(&self) -> bool {
        self.plans.values().any(|p| !p.quotas.is_empty()) || self.keys.has_own_quotas()
    }

    /// This config with no keys: what is kept to compare a reload with,
    /// without holding a million keys for the life of the process.
    pub fn without_keys(&self) -> Config {
        Config {
            keys: Default::default(),
            ..self.clone()
        }
    }

    /// What Redis keys and bucket names start with: `redis.key_prefix`,
    /// "rl" without a `[redis]` section.
    pub fn key_prefix(&self) -> &str {
        self.redis.as_ref().map_or("rl", |r| r.key_prefix.as_str())
    }

    /// What loads but may not do what its author meant: `check` prints
    /// each as a warning, `run` logs it.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let caps = self
            .upstreams
            .iter()
            .filter_map(|u| Some((format!("upstreams.{}", u.name), u.in_flight?)));
        for (at, f) in caps {
            if let (Some((lo, hi)), Some((elo, ehi))) = (f.adaptive, f.adaptive_capped()) {
                out.push(format!(
                    "{at}.adaptive: min..max {lo}..={hi} is above max_in_flight: the limit moves within {elo}..={ehi}"
                ));
            }
        }
        let plans = self
            .plans
            .iter()
            .map(|(n, p)| (format!("plans.{n}"), p.quotas.as_slice()));
        // Every key of the file too, which may hold a million.
        let keys = self
            .keys
            .with_own_limits()
            .filter_map(|k| Some((format!("api_keys \"{}\"", k.id), k.quotas?)));
        let mut never_bind = 0;
        for (at, quotas) in plans.chain(keys) {
            for short in quotas.iter() {
                for long in quotas.iter() {
                    if short.period.as_secs_at_most() < long.period.as_secs_at_least()
                        && short.limit >= long.limit
                    {
                        never_bind += 1;
                        if never_bind > 20 {
                            continue;
                        }
                        out.push(format!(
                            "{at}.quotas: {} a {} can never bind under {} a {}",
                            short.limit,
                            short.period.as_str(),
                            long.limit,
                            long.period.as_str()
                        ));
                    }
                }
            }
        }
        if never_bind > 20 {
            out.push(format!(
                "and {} more quotas that can never bind",
                never_bind - 20
            ));
        }
        let issuers = self.jwt.iter().flat_map(|j| j.issuers.iter().enumerate());
        for (i, issuer) in issuers {
            let JwtKeys::Url(u) = &issuer.keys else {
                continue;
            };
            let loopback = crate::jwt::fetch::Target::parse(&u.url).is_ok_and(|t| {
                t.host == "localhost"
                    || t.host
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            });
            if u.url.starts_with("http://") && !loopback {
                out.push(format!(
                    "auth.jwt.issuers[{i}].jwks_url: keys fetched over plain http can be replaced on the way; use https"
                ));
            }
        }
        out
    }

    /// What `gateway check` prints: the effective values, never a secret.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let srv = &self.server;
        let _ = writeln!(s, "listeners: {}", srv.listen.join(", "));
        let _ = writeln!(
            s,
            "admin: {}",
            srv.admin_listen.as_deref().unwrap_or("(disabled)")
        );
        let _ = writeln!(
            s,
            "server: threads={} grace_period_secs={} max_request_header_bytes={} max_request_headers={} header_read_timeout_ms={} startup_redis_wait_ms={} h2c={}",
            srv.threads,
            srv.grace_period_secs,
            srv.max_request_header_bytes,
            srv.max_request_headers,
            srv.header_read_timeout_ms,
            srv.startup_redis_wait_ms,
            srv.h2c
        );
        if let Some(tls) = &srv.tls {
            let _ = writeln!(
                s,
                "tls: listeners: {} certificates={} (HTTP/2 and HTTP/1.1 by ALPN, TLS 1.2 and 1.3)",
                tls.listen.join(", "),
                tls.certificates.len()
            );
        }
        if srv.admin_listen.is_some() {
            let admin = match (&self.admin.token, admin_loopback_only(srv)) {
                (Some(_), _) => "token=(set): a reset (DELETE /limits) needs it; reading is open",
                (None, true) => {
                    "no token: reading /limits open, resets served (the admin listener is loopback-only)"
                }
                (None, false) => {
                    "no token: reading /limits open, resets refused (set [admin] token: the admin listener is not loopback-only)"
                }
            };
            let _ = writeln!(s, "admin: {admin}");
        }
        let _ = writeln!(
            s,
            "log: access={} refusals_per_sec={} (errors and 5xx always)",
            self.log.access, self.log.refusals_per_sec
        );
        // The file's own spellings, so a value can be copied back into it.
        let l = &self.limiter;
        let (backend, on_failure, headers) = (
            l.backend.spelling(),
            l.on_redis_failure.spelling(),
            l.headers.spelling(),
        );
        let _ = writeln!(
            s,
            "limiter: backend={backend} on_redis_failure={on_failure} instances={} headers={headers} retry_after_jitter_ms={} local_max_entries={} leases.enabled={} leases.period_ms={} quota_time_zone={} quota_retention_days={}",
            l.instances,
            l.retry_after_jitter_ms,
            l.local_max_entries,
            l.leases.enabled,
            l.leases.period_ms,
            l.quota_time_zone.name(),
            l.quota_retention_days
        );
        match &self.redis {
            Some(r) => {
                let mode = r.mode.spelling();
                let password = match (&r.password, &r.password_file) {
                    (Some(_), Some(f)) => format!(
                        " password_file={} (used; redis.password is also set and not used)",
                        f.display()
                    ),
                    (Some(_), None) => " password=(set)".to_string(),
                    (None, Some(f)) => format!(" password_file={}", f.display()),
                    (None, None) => String::new(),
                };
                let _ = writeln!(
                    s,
                    "redis: mode={mode} urls={} timeout_ms={} probe_interval_ms={} key_prefix={}{password}",
                    r.urls.len(),
                    r.timeout_ms,
                    r.probe_interval_ms,
                    r.key_prefix
                );
            }
            None => {
                let _ = writeln!(s, "redis: (none)");
            }
        }
        let c = &self.clients;
        let _ = writeln!(
            s,
            "clients: trusted_proxies={} allow={} deny={} ipv6_prefix_len={} api_key_header={}",
            c.trusted_proxies.len(),
            c.allow.len(),
            c.deny.len(),
            c.ipv6_prefix_len,
            c.api_key_header
        );
        if let Some(path) = &c.api_keys_file {
            let _ = writeln!(
                s,
                "clients: api_keys_file={} ({} key(s), watched)",
                path.display(),
                self.keys.from_file()
            );
        }
        for issuer in self.jwt.iter().flat_map(|j| j.issuers.iter()) {
            let keys = match &issuer.keys {
                JwtKeys::Url(u) => format!(
                    "jwks_url={} (refresh {} s, refetch at most every {} s, keys serve {} s past their fetch)",
                    u.url, u.refresh_secs, u.min_refetch_secs, u.max_stale_secs
                ),
                JwtKeys::Files { paths, keys } => {
                    format!("key_files={} ({} key(s))", paths.len(), keys.len())
                }
            };
            let algs: Vec<String> = issuer.algorithms.iter().map(|a| format!("{a:?}")).collect();
            let _ = writeln!(
                s,
                "jwt issuer {}: {keys} algorithms={} audiences={} leeway_secs={} id_claim={} plan_claim={} default_plan={}",
                issuer.issuer,
                algs.join(","),
                if issuer.audiences.is_empty() { "(not checked)".to_string() } else { issuer.audiences.join(",") },
                issuer.leeway_secs,
                issuer.id_claim,
                issuer.plan_claim.as_deref().unwrap_or("-"),
                issuer.default_plan
            );
        }
        let _ = writeln!(s, "tiers:");
        match &self.ip_tier {
            Some(t) => {
                let _ = writeln!(s, "  ip: {}{}", t.algorithm, shadow(t));
            }
            None => {
                let _ = writeln!(s, "  ip: (off)");
            }
        }
        let per_plan: std::collections::HashMap<&str, usize> = self
            .keys
            .plans()
            .iter()
            .map(String::as_str)
            .zip(self.keys.per_plan())
            .collect();
        for (name, p) in &self.plans {
            let keys = per_plan.get(name.as_str()).copied().unwrap_or(0);
            let _ = writeln!(
                s,
                "  key plan {name}: token_bucket capacity={} refill_per_sec={}{} ({keys} key(s); priority {})",
                p.capacity,
                p.refill_per_sec,
                quotas(&p.quotas),
                p.priority
            );
        }
        let _ = writeln!(
            s,
            "api keys: {} ({} in the config, {} in the keys file)",
            self.keys.len(),
            self.api_keys.len(),
            self.keys.from_file()
        );
        // Keys with limits of their own: those of the config, and the
        // first 20 of the file (it may hold a million).
        let file_own: Vec<ApiKey> = self
            .keys
            .with_own_limits()
            .filter(|k| !self.api_keys.iter().any(|a| a.id == k.id))
            .take(20)
            .map(|k| ApiKey {
                id: k.id.to_string(),
                digest: [0; 32],
                plan: k.plan.to_string(),
                quotas: k.quotas.map(<[Quota]>::to_vec),
                burst: k.burst,
            })
            .collect();
        for k in self.api_keys.iter().chain(&file_own) {
            let burst = k.burst.map(|b| {
                format!(
                    " token_bucket capacity={} refill_per_sec={}",
                    b.capacity, b.refill_per_sec
                )
            });
            let own = k.quotas.as_deref().map(|q| match q {
                [] => "; quotas: none".to_string(),
                q => quotas(q),
            });
            if burst.is_some() || own.is_some() {
                let _ = writeln!(
                    s,
                    "  key {}: its own{}{}",
                    k.id,
                    burst.unwrap_or_default(),
                    own.unwrap_or_default()
                );
            }
        }
        let _ = writeln!(s, "upstreams:");
        for u in &self.upstreams {
            let protocol = u.protocol.spelling();
            let tls = if u.tls {
                format!(
                    "tls sni={} ca={} verify={}",
                    u.sni.as_deref().unwrap_or("(server host)"),
                    u.ca_file
                        .as_ref()
                        .map_or("(system roots)".to_string(), |p| p.display().to_string()),
                    u.verify
                )
            } else {
                "plaintext".to_string()
            };
            let _ = writeln!(
                s,
                "  {}: {} ({protocol}, {tls}; health check: {}; connect {} ms, read {} ms)",
                u.name,
                u.servers.join(", "),
                u.health_check_path.as_deref().unwrap_or("off"),
                u.connect_timeout_ms,
                u.read_timeout_ms
            );
            if let Some(f) = &u.in_flight {
                let _ = writeln!(s, "    in flight: {f}");
            }
        }
        if let Some(c) = &self.cors {
            let _ = writeln!(s, "cors (routes without their own): {}", c);
        }
        let _ = writeln!(s, "routes:");
        for r in &self.routes {
            let methods = r.methods.as_ref().map_or("*".to_string(), |m| m.join(","));
            let limit = match &r.limit {
                Some(l) => {
                    let mut text = format!("{} scope={}", l.algorithm, l.scope.spelling());
                    if l.key != LimitKey::Client {
                        let _ = write!(
                            text,
                            " key={} missing={}",
                            l.key.spelling(),
                            l.missing.spelling()
                        );
                    }
                    if l.cost != 1 {
                        let _ = write!(text, " cost={}", l.cost);
                    }
                    if l.shards != 1 {
                        let _ = write!(text, " shards={}", l.shards);
                    }
                    text + shadow(l)
                }
                None => "no route limit".to_string(),
            };
            let host = r.host.as_ref().map_or(String::new(), |h| h.to_string());
            let mut extras = Vec::new();
            if r.require_api_key {
                extras.push("api key required".to_string());
            }
            if r.strip_prefix {
                extras.push("prefix stripped".to_string());
            }
            if let Some(ms) = r.timeout_ms {
                extras.push(format!("timeout {ms} ms"));
            }
            if r.retries > 0 {
                extras.push(format!("retries {}", r.retries));
            }
            if let Some(b) = r.max_request_body_bytes {
                extras.push(format!("body <= {b} bytes"));
            }
            if let Some(c) = &r.cors {
                extras.push(format!("cors: {c}"));
            }
            if let Some(f) = &r.in_flight {
                extras.push(format!("in flight: {f}"));
            }
            if let Some(n) = r.max_in_flight_per_client {
                extras.push(format!("{n} in flight per client"));
            }
            let extras = match extras.is_empty() {
                true => String::new(),
                false => format!(" ({})", extras.join(", ")),
            };
            let _ = writeln!(
                s,
                "  {} {} {host}{} -> {}{extras}: {}",
                r.name, methods, r.path_prefix, r.upstream, limit
            );
            for (plan, l) in &r.limit_by_plan {
                let _ = writeln!(
                    s,
                    "    plan {plan}: {} scope={}",
                    l.algorithm,
                    l.scope.spelling()
                );
            }
        }
        s
    }
}

fn shadow(l: &Limit) -> &'static str {
    if l.shadow {
        " shadow"
    } else {
        ""
    }
}

/// Whether the admin listener only takes loopback connections.
pub fn admin_loopback_only(srv: &Server) -> bool {
    srv.admin_listen
        .as_deref()
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .is_some_and(|a| a.ip().is_loopback())
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    const DEMO: &str = include_str!("../../gateway.toml");

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Arbitrary text: an error list or a config, never a panic.
        #[test]
        fn any_text_is_answered(src in any::<String>()) {
            if let Err(errors) = super::parse(&src) {
                prop_assert!(!errors.is_empty());
            }
        }

        /// The demo config with one line replaced by something else: every
        /// error names a key path (or the syntax), never a panic.
        #[test]
        fn mutated_demo_configs_are_answered(line in 0usize..140, junk in "[a-z_\\[\\]=\" 0-9.{},-]{0,30}") {
            let mut lines: Vec<&str> = DEMO.lines().collect();
            let i = line % lines.len();
            lines[i] = &junk;
            let src = lines.join("\n");
            if let Err(errors) = super::parse(&src) {
                for e in errors {
                    prop_assert!(!e.path.is_empty() && !e.message.is_empty(), "{e}");
                }
            }
        }
    }
}
