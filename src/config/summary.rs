//! What `gateway check` prints of a config: its effective values, section
//! by section, never a secret (`summary`), and what loads but may not do
//! what its author meant (`warnings`). What the named key files hold comes
//! from the room that read them (`KeyFacts`).

use std::fmt::Write as _;

use super::model::*;
use super::{admin_loopback_only, HttpUrl, KeyFacts, KeySnapshot};

impl Config {
    /// What loads but may not do what its author meant: `check` prints
    /// each as a warning, `run` logs it.
    pub fn warnings(&self, facts: &dyn KeyFacts) -> Vec<String> {
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
        let mut never_bind = 0;
        for (n, p) in &self.plans {
            never_binding(&format!("plans.{n}"), &p.quotas, &mut never_bind, &mut out);
        }
        // Every key of the file too, which may hold a million.
        facts.each_with_own_limits(&mut |k| {
            if let Some(q) = k.quotas {
                never_binding(
                    &format!("api_keys \"{}\"", k.id),
                    q,
                    &mut never_bind,
                    &mut out,
                );
            }
            true
        });
        if never_bind > 20 {
            out.push(format!(
                "and {} more quotas that can never bind",
                never_bind - 20
            ));
        }
        // Loaded, not refused: a file that switches between the backends
        // (a laptop's local run of a fleet's config) need not change twice.
        if self.limiter.shares.enabled && self.limiter.backend == Backend::Local {
            out.push(
                "limiter.shares.enabled: standing shares cut Redis's buckets; with limiter.backend = \"local\" they do nothing".to_string(),
            );
        }
        let issuers = self.jwt.iter().flat_map(|j| j.issuers.iter().enumerate());
        for (i, issuer) in issuers {
            let JwtKeys::Url(u) = &issuer.keys else {
                continue;
            };
            let loopback = HttpUrl::parse(&u.url).is_ok_and(|t| {
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
    pub fn summary(&self, facts: &dyn KeyFacts) -> String {
        let mut s = String::new();
        self.server_lines(&mut s);
        self.limiter_lines(&mut s);
        self.client_lines(&mut s, facts);
        self.tier_lines(&mut s, facts);
        self.upstream_lines(&mut s);
        self.route_lines(&mut s);
        s
    }

    /// Listeners, `[server]`, TLS, the admin listener and `[log]`.
    fn server_lines(&self, s: &mut String) {
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
            let top = match self.admin.top {
                true => "top=true (the top-K of refused clients: /top, gateway top)",
                false => "top=false (no top-K: /top answers 404)",
            };
            let _ = writeln!(s, "admin: {top}");
        }
        let _ = writeln!(
            s,
            "log: access={} refusals_per_sec={} (errors and 5xx always)",
            self.log.access, self.log.refusals_per_sec
        );
        // As the process will run it: the standard OTEL_* variables win.
        let _ = match self
            .tracing
            .as_ref()
            .map(|t| t.from_env(|n| std::env::var(n).ok()))
        {
            None => writeln!(s, "tracing: off (no [tracing])"),
            Some(Ok(t)) => writeln!(
                s,
                "tracing: spans to {} (OTLP/HTTP), sample_ratio={} service_name={}",
                t.traces_url, t.sample_ratio, t.service_name
            ),
            Some(Err(e)) => writeln!(s, "tracing: {e}"),
        };
    }

    /// `[limiter]` and `[redis]`.
    fn limiter_lines(&self, s: &mut String) {
        // The file's own spellings, so a value can be copied back into it.
        let l = &self.limiter;
        let (backend, on_failure, headers) = (
            l.backend.spelling(),
            l.on_redis_failure.spelling(),
            l.headers.spelling(),
        );
        let _ = writeln!(
            s,
            "limiter: backend={backend} on_redis_failure={on_failure} instances={} headers={headers} retry_after_jitter_ms={} local_max_entries={} leases.enabled={} leases.period_ms={} shares.enabled={} shares.fraction={} shares.charged={} (cutting: {}) quota_time_zone={} quota_retention_days={}",
            l.instances,
            l.retry_after_jitter_ms,
            l.local_max_entries,
            l.leases.enabled,
            l.leases.period_ms,
            l.shares.enabled,
            l.shares.fraction,
            l.shares.charged,
            match (l.backend, l.shares.used(), l.shares.enabled) {
                (Backend::Local, _, _) | (_, false, _) => "nothing",
                (_, true, true) => "every big token bucket",
                (_, true, false) => "token buckets counting charged units whose route's max fits in a share",
            },
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
    }

    /// `[clients]`, the keys file and `[auth.jwt]`'s issuers.
    fn client_lines(&self, s: &mut String, facts: &dyn KeyFacts) {
        let c = &self.clients;
        let _ = writeln!(
            s,
            "clients: trusted_proxies={} allow={} deny={} ipv6_prefix_len={} api_key_header={} hide_credentials={}",
            c.trusted_proxies.len(),
            c.allow.len(),
            c.deny.len(),
            c.ipv6_prefix_len,
            c.api_key_header,
            c.hide_credentials
        );
        // Runtime keys live in Redis: the snapshot only with it.
        if self.limiter.backend == Backend::Redis {
            let snapshot = match &c.runtime_keys_snapshot {
                KeySnapshot::At(p) => p.display().to_string(),
                KeySnapshot::Off => "false (a replica started while Redis is down serves no runtime key until it answers)".to_string(),
                KeySnapshot::Auto => format!(
                    "true (in {}, named for the Redis it mirrors)",
                    std::env::temp_dir().display()
                ),
            };
            let _ = writeln!(s, "clients: runtime_keys_snapshot={snapshot}");
        }
        if let Some(path) = &c.api_keys_file {
            let _ = writeln!(
                s,
                "clients: api_keys_file={} ({} key(s), watched)",
                path.display(),
                facts.keys_from_file()
            );
        }
        for (i, issuer) in self.jwt.iter().flat_map(|j| j.issuers.iter()).enumerate() {
            let keys = match &issuer.keys {
                JwtKeys::Url(u) => format!(
                    "jwks_url={} (refresh {} s, refetch at most every {} s, keys serve {} s past their fetch)",
                    u.url, u.refresh_secs, u.min_refetch_secs, u.max_stale_secs
                ),
                JwtKeys::Files { paths } => {
                    format!("key_files={} ({} key(s))", paths.len(), facts.jwt_file_keys(i))
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
    }

    /// The tiers: ip, each plan with its keys, the keys with limits of their own.
    fn tier_lines(&self, s: &mut String, facts: &dyn KeyFacts) {
        let _ = writeln!(s, "tiers:");
        match &self.ip_tier {
            Some(t) => {
                let _ = writeln!(s, "  ip: {}{}", t.algorithm, shadow(t));
            }
            None => {
                let _ = writeln!(s, "  ip: (off)");
            }
        }
        let per_plan = facts.keys_per_plan();
        for (name, p) in &self.plans {
            let keys = per_plan.get(name).copied().unwrap_or(0);
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
            facts.keys(),
            self.api_keys.len(),
            facts.keys_from_file()
        );
        // Keys with limits of their own: those of the config, and the
        // first 20 of the file (it may hold a million).
        let mut file_own: Vec<ApiKey> = Vec::new();
        facts.each_with_own_limits(&mut |k| {
            if !self.api_keys.iter().any(|a| a.id == k.id) {
                file_own.push(ApiKey {
                    id: k.id.to_string(),
                    digest: [0; 32],
                    plan: k.plan.to_string(),
                    quotas: k.quotas.map(<[Quota]>::to_vec),
                    burst: k.burst,
                });
            }
            file_own.len() < 20
        });
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
    }

    /// `[[upstreams]]` and `[cors]`.
    fn upstream_lines(&self, s: &mut String) {
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
    }

    /// `[[routes]]`.
    fn route_lines(&self, s: &mut String) {
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
                    if l.charged {
                        text.push_str(" cost=response");
                    } else if l.cost != 1 {
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
            if let Some(c) = &r.charge {
                extras.push(format!("charge: {c}"));
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
                    "    plan {plan}: {} scope={}{}",
                    l.algorithm,
                    l.scope.spelling(),
                    if l.charged { " cost=response" } else { "" }
                );
            }
        }
    }
}

/// Each quota of `quotas` that a longer one never lets bind, as a warning
/// (the first 20 of all; `count` counts them all).
fn never_binding(at: &str, quotas: &[Quota], count: &mut usize, out: &mut Vec<String>) {
    for short in quotas {
        for long in quotas {
            if short.period.as_secs_at_most() < long.period.as_secs_at_least()
                && short.limit >= long.limit
                && short.charged == long.charged
            {
                *count += 1;
                if *count > 20 {
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

/// `; quotas: 1000/day, 30000/month` (empty without any).
fn quotas(q: &[Quota]) -> String {
    if q.is_empty() {
        return String::new();
    }
    let list: Vec<String> = q
        .iter()
        .map(|q| {
            let unit = if q.charged { " units" } else { "" };
            format!("{}{unit}/{}", q.limit, q.period.as_str())
        })
        .collect();
    format!("; quotas: {}", list.join(", "))
}

fn shadow(l: &Limit) -> &'static str {
    if l.shadow {
        " shadow"
    } else {
        ""
    }
}
