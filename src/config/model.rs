//! The validated configuration: what the rest of the gateway reads.
//!
//! Everything here has passed validation: references resolve, ranges hold,
//! CIDRs parse. Nothing downstream re-checks these invariants.

use std::collections::BTreeMap;
use std::fmt;

use ipnet::IpNet;

/// The file's spelling of each value of an enum-valued key: what the reader
/// accepts and what `check` prints, from one table.
pub trait Spelled: Copy + PartialEq + 'static {
    const SPELLINGS: &'static [(&'static str, Self)];

    fn spelling(self) -> &'static str {
        Self::SPELLINGS
            .iter()
            .find(|(_, v)| *v == self)
            .map_or("?", |(n, _)| n)
    }
}

macro_rules! spelled {
    ($t:ty: $($name:literal => $v:expr),+ $(,)?) => {
        impl Spelled for $t {
            const SPELLINGS: &'static [(&'static str, Self)] = &[$(($name, $v)),+];
        }
    };
}

spelled!(Backend: "redis" => Backend::Redis, "local" => Backend::Local);
spelled!(OnRedisFailure:
    "local" => OnRedisFailure::Local,
    "allow" => OnRedisFailure::Allow,
    "deny" => OnRedisFailure::Deny,
);
spelled!(HeaderStyle:
    "x-ratelimit" => HeaderStyle::XRateLimit,
    "ietf" => HeaderStyle::Ietf,
    "both" => HeaderStyle::Both,
    "none" => HeaderStyle::None,
);
spelled!(RedisMode:
    "standalone" => RedisMode::Standalone,
    "sentinel" => RedisMode::Sentinel,
    "cluster" => RedisMode::Cluster,
);
spelled!(UpstreamProtocol:
    "http1" => UpstreamProtocol::Http1,
    "h2" => UpstreamProtocol::H2,
    "h2c" => UpstreamProtocol::H2c,
);
spelled!(Scope: "client" => Scope::Client, "global" => Scope::Global);
spelled!(Missing: "reject" => Missing::Reject, "client" => Missing::Client);

#[derive(Debug, Clone)]
pub struct Config {
    pub server: Server,
    pub admin: AdminSettings,
    pub limiter: LimiterSettings,
    pub redis: Option<RedisSettings>,
    pub clients: Clients,
    /// Tier 1, per client IP (or IPv6 prefix). `None`: the tier is off.
    pub ip_tier: Option<Limit>,
    /// Tier 2 plans by name; each is a token bucket.
    pub plans: BTreeMap<String, Plan>,
    /// `[[api_keys]]` as written.
    pub api_keys: Vec<ApiKey>,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// `[cors]`: the policy of every route without a `cors` of its own.
    pub cors: Option<Cors>,
    pub log: LogSettings,
    /// `[auth.jwt]`: verified JWTs as the key tier's identity.
    pub jwt: Option<JwtSettings>,
    /// `[tracing]`: OpenTelemetry traces. `None`: none.
    pub tracing: Option<TracingSettings>,
    /// Each key's line, by dotted path: for problems found in the files the
    /// config names, once they are read (`Config::error_at`).
    pub lines: std::sync::Arc<std::collections::HashMap<String, usize>>,
}

/// `[tracing]`: where spans go and how many requests make one.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    /// OTLP over HTTP/protobuf: the collector's base URL (`/v1/traces` is added).
    pub otlp_endpoint: String,
    /// Of requests without a sampled parent; a sampled W3C `traceparent`
    /// is always followed.
    pub sample_ratio: f64,
    pub service_name: String,
}

impl Default for TracingSettings {
    fn default() -> Self {
        TracingSettings {
            otlp_endpoint: "http://127.0.0.1:4318".into(),
            sample_ratio: 0.01,
            service_name: "ratelimit-gateway".into(),
        }
    }
}

/// `[auth.jwt]`: the issuers whose tokens name a client, and how many
/// verified tokens are remembered (so a hot client pays one signature check).
#[derive(Debug, Clone)]
pub struct JwtSettings {
    pub issuers: Vec<JwtIssuer>,
    pub cache_max_entries: usize,
}

/// One `[[auth.jwt.issuers]]` entry.
#[derive(Debug, Clone)]
pub struct JwtIssuer {
    /// The `iss` its tokens carry.
    pub issuer: String,
    pub keys: JwtKeys,
    /// One must be in a token's `aud`; empty: `aud` is not checked.
    pub audiences: Vec<String>,
    pub algorithms: Vec<jsonwebtoken::Algorithm>,
    pub leeway_secs: u64,
    pub id_claim: String,
    pub plan_claim: Option<String>,
    /// A claim value to the plan it means; a value not here is a plan's own name.
    pub plan_map: BTreeMap<String, String>,
    pub default_plan: String,
}

/// Where an issuer's keys come from.
#[derive(Debug, Clone)]
pub enum JwtKeys {
    Url(JwksUrl),
    /// Read with the config (at start and every reload) by the `jwt` room.
    Files {
        paths: Vec<std::path::PathBuf>,
    },
}

/// A JWKS endpoint and how it is kept.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JwksUrl {
    pub url: String,
    /// Fetched again this often.
    pub refresh_secs: u64,
    /// A token naming an unknown `kid` fetches the set again, at most this often.
    pub min_refetch_secs: u64,
    pub timeout_ms: u64,
    /// While the endpoint cannot be reached, the last keys fetched serve
    /// this long after they were; then its tokens are refused.
    pub max_stale_secs: u64,
    /// Trusted for an `https` endpoint besides the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
}

/// `[log]`: the access log. Refusals (the gateway's own 429 and 503) are
/// written at most `refusals_per_sec` a second, the rest counted; every
/// other line (admitted requests, errors, 5xx) follows `access`, but errors
/// and 5xx are always written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    pub access: bool,
    pub refusals_per_sec: u32,
}

impl Default for LogSettings {
    fn default() -> Self {
        LogSettings {
            access: true,
            refusals_per_sec: 20,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    pub listen: Vec<String>,
    pub admin_listen: Option<String>,
    pub threads: usize,
    pub grace_period_secs: u64,
    pub max_request_header_bytes: usize,
    /// More request header lines than this: 431.
    pub max_request_headers: usize,
    pub header_read_timeout_ms: u64,
    /// Before serving, how long to wait for Redis (0: start on the fallback).
    pub startup_redis_wait_ms: u64,
    /// Plaintext listeners also accept HTTP/2 with prior knowledge.
    pub h2c: bool,
    /// `[server.tls]`: TLS listeners, HTTP/1.1 and HTTP/2 by ALPN.
    pub tls: Option<TlsListeners>,
}

/// A secret from the file (or its environment): printed as `(secret)` by
/// `Debug`, so no log or panic message of a config can show it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("(secret)")
    }
}

/// `[admin]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdminSettings {
    /// Required by the admin endpoints that change state.
    pub token: Option<Secret>,
    /// Keep the top-K of refused clients (`/top`, `gateway top`, the
    /// page's table); off, no request counts in it.
    pub top: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TlsListeners {
    pub listen: Vec<String>,
    /// The first is the default; the others are chosen by SNI from the names
    /// their certificates carry.
    pub certificates: Vec<CertificateFiles>,
}

/// One certificate chain and its key, as files (re-read when they change).
#[derive(Debug, Clone, PartialEq)]
pub struct CertificateFiles {
    pub cert_file: std::path::PathBuf,
    pub key_file: std::path::PathBuf,
    /// Where it is configured: `server.tls.certificates[i]`, and its line.
    pub key_path: String,
    pub line: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRedisFailure {
    Local,
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    XRateLimit,
    Ietf,
    Both,
    None,
}

impl HeaderStyle {
    pub fn x_ratelimit(self) -> bool {
        matches!(self, HeaderStyle::XRateLimit | HeaderStyle::Both)
    }
    pub fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LimiterSettings {
    pub backend: Backend,
    pub on_redis_failure: OnRedisFailure,
    pub instances: u32,
    pub headers: HeaderStyle,
    pub retry_after_jitter_ms: u64,
    pub local_max_entries: usize,
    pub leases: LeaseSettings,
    pub shares: SharesSettings,
    /// The calendar that bounds quota periods.
    pub quota_time_zone: chrono_tz::Tz,
    /// A quota period's counts are kept this long after it ends (invoices,
    /// `gateway usage`); 0: a minute.
    pub quota_retention_days: u32,
}

/// `[limiter.leases]`: tokens Redis debits ahead for a hot bucket, spent on
/// this replica with no round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    pub enabled: bool,
    /// A lease covers about this much of the replica's demand, and lives at
    /// most this long.
    pub period_ms: u64,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        LeaseSettings {
            enabled: true,
            period_ms: 100,
        }
    }
}

/// `[limiter.shares]`: standing shares, the part of every big token bucket
/// each replica owns and decides with no call to Redis.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SharesSettings {
    pub enabled: bool,
    /// The part of each cut bucket's capacity and rate the replicas own
    /// between them; Redis keeps the rest (the pool).
    pub fraction: f64,
    /// Token buckets counting charged units (`cost = "response"`) are cut
    /// even when `enabled` is false: such a bucket is never leased (its
    /// settlements would cut other replicas' lease returns), so without a
    /// share it costs a Redis call per request batch. On by default; a
    /// bucket is cut only while a share holds its route's `max`
    /// (`standing::cuts`).
    pub charged: bool,
}

impl Default for SharesSettings {
    fn default() -> Self {
        SharesSettings {
            enabled: false,
            fraction: 0.25,
            charged: true,
        }
    }
}

impl SharesSettings {
    /// Whether any bucket may be cut: every big token bucket, or (only
    /// `charged`) those counting charged units. Not whether the config has
    /// such a bucket now: a reload may add one, and every replica must cut
    /// it alike from its first request.
    pub fn used(&self) -> bool {
        self.enabled || self.charged
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisMode {
    Standalone,
    Sentinel,
    Cluster,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RedisSettings {
    pub mode: RedisMode,
    pub urls: Vec<String>,
    pub sentinel_master: Option<String>,
    pub timeout_ms: u64,
    pub probe_interval_ms: u64,
    pub key_prefix: String,
    /// For `rediss://` URLs: the CA to verify Redis with (`None`: the system roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// Overrides the URLs' password.
    pub password: Option<Secret>,
    /// A file holding the password (a mounted secret): read at start-up and
    /// again when it changes. Wins over `password` when both are set.
    pub password_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Clients {
    pub trusted_proxies: Vec<IpNet>,
    pub ipv6_prefix_len: u8,
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
    /// Lower-cased header name.
    pub api_key_header: String,
    /// More keys, in a file of their own (JSON lines or CSV), watched.
    pub api_keys_file: Option<std::path::PathBuf>,
    /// The API key's header, and an `Authorization: Bearer` that carried
    /// the key, are taken off the request sent upstream.
    pub hide_credentials: bool,
    /// Where a replica keeps the last runtime key set it read from Redis.
    pub runtime_keys_snapshot: super::clients::KeySnapshot,
}

/// One limiting algorithm with its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    TokenBucket {
        capacity: u64,
        refill_per_sec: f64,
    },
    /// GCRA: requests early for their slot wait up to `max_delay_ms`.
    LeakyBucket {
        rate_per_sec: f64,
        max_delay_ms: u64,
    },
    FixedWindow {
        limit: u64,
        window_secs: u64,
    },
    SlidingWindow {
        limit: u64,
        window_secs: u64,
    },
    SlidingLog {
        limit: u64,
        window_secs: u64,
    },
    /// A quota's current calendar period, `[start, end)` in microseconds
    /// since the epoch: at most `limit` in it. Never written in a file: the
    /// planner makes one per request from a `Quota` (its period in the
    /// configured time zone), so the limiter needs no calendar.
    Calendar {
        limit: u64,
        period: crate::calendar::Period,
        start: i64,
        end: i64,
    },
}

impl Algorithm {
    /// The quota a client is shown for a rule: capacity, limit, or for a leaky
    /// bucket the most requests that can be queued at once (one now, one per
    /// emission interval of delay). One formula for both backends, the
    /// headers and the check that a route's `cost` can ever be admitted.
    pub fn quota(&self) -> u64 {
        match *self {
            Algorithm::TokenBucket { capacity, .. } => capacity,
            Algorithm::LeakyBucket {
                rate_per_sec,
                max_delay_ms,
            } => Self::leaky_burst(1e6 / rate_per_sec, max_delay_ms as f64 * 1000.0),
            Algorithm::FixedWindow { limit, .. }
            | Algorithm::SlidingWindow { limit, .. }
            | Algorithm::SlidingLog { limit, .. }
            | Algorithm::Calendar { limit, .. } => limit,
        }
    }

    /// A leaky bucket's burst from its emission interval `t` and tolerance
    /// `tau` (both in microseconds).
    pub fn leaky_burst(t: f64, tau: f64) -> u64 {
        (tau / t).floor() as u64 + 1
    }

    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket { .. } => "token_bucket",
            Algorithm::LeakyBucket { .. } => "leaky_bucket",
            Algorithm::FixedWindow { .. } => "fixed_window",
            Algorithm::SlidingWindow { .. } => "sliding_window",
            Algorithm::SlidingLog { .. } => "sliding_log",
            Algorithm::Calendar { .. } => "quota",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::TokenBucket {
                capacity,
                refill_per_sec,
            } => write!(
                f,
                "token_bucket capacity={capacity} refill_per_sec={refill_per_sec}"
            ),
            Algorithm::LeakyBucket {
                rate_per_sec,
                max_delay_ms,
            } => write!(
                f,
                "leaky_bucket rate_per_sec={rate_per_sec} max_delay_ms={max_delay_ms}"
            ),
            Algorithm::FixedWindow { limit, window_secs } => {
                write!(f, "fixed_window limit={limit} window_secs={window_secs}")
            }
            Algorithm::SlidingWindow { limit, window_secs } => {
                write!(f, "sliding_window limit={limit} window_secs={window_secs}")
            }
            Algorithm::SlidingLog { limit, window_secs } => {
                write!(f, "sliding_log limit={limit} window_secs={window_secs}")
            }
            Algorithm::Calendar { limit, period, .. } => {
                write!(f, "quota limit={limit} period={}", period.as_str())
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// One bucket per client (API key id if present, else IP).
    Client,
    /// One bucket for everyone.
    Global,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    pub algorithm: Algorithm,
    pub scope: Scope,
    /// Decide and report, never reject.
    pub shadow: bool,
    /// What names a client's bucket (routes only; `Client` elsewhere).
    pub key: LimitKey,
    /// A request without the key's attribute (routes only).
    pub missing: Missing,
    /// Tokens each request takes, 1 to the rule's quota.
    pub cost: u64,
    /// `cost = "response"`: the units the route's `charge` reads (`cost` unused).
    pub charged: bool,
    /// A global limit split into this many sub-buckets (1: not split).
    pub shards: u64,
}

/// A route limit's `key`: the client (API key id, else IP), a request
/// attribute, or both together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitKey {
    Client,
    Attribute(Attribute),
    ClientAnd(Attribute),
}

/// A request attribute a limit can key on. Header names are lower-case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribute {
    Header(String),
    Query(String),
    /// A claim of the request's verified JWT (`[auth.jwt]`).
    Claim(String),
}

impl Attribute {
    /// As the file spells it: `header:NAME` or `query:NAME`.
    pub fn spelling(&self) -> String {
        match self {
            Attribute::Header(n) => format!("header:{n}"),
            Attribute::Query(n) => format!("query:{n}"),
            Attribute::Claim(n) => format!("claim:{n}"),
        }
    }
}

impl LimitKey {
    pub fn spelling(&self) -> String {
        match self {
            LimitKey::Client => "client".into(),
            LimitKey::Attribute(a) => a.spelling(),
            LimitKey::ClientAnd(a) => format!("client+{}", a.spelling()),
        }
    }

    pub fn attribute(&self) -> Option<&Attribute> {
        match self {
            LimitKey::Client => None,
            LimitKey::Attribute(a) | LimitKey::ClientAnd(a) => Some(a),
        }
    }
}

/// A route limit's `missing`: what a request without the key's attribute gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// 400, naming the attribute.
    Reject,
    /// The client's own bucket, as with `key = "client"`.
    Client,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Who is served first from a full queue, and refused last (higher
    /// first; requests without a key come after every plan).
    pub priority: i64,
    pub capacity: u64,
    pub refill_per_sec: f64,
    /// Counts per calendar period, beside the burst bucket.
    pub quotas: Vec<Quota>,
}

/// At most `limit` requests per calendar `period` (in
/// `limiter.quota_time_zone`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub period: crate::calendar::Period,
    /// `cost = "response"`: counts `charge` routes' units, not requests.
    pub charged: bool,
}

#[derive(Clone, PartialEq)]
pub struct ApiKey {
    pub id: String,
    /// SHA-256 of the secret; the secret itself is never kept.
    pub digest: [u8; 32],
    pub plan: String,
    /// This key's own quotas, in place of its plan's.
    pub quotas: Option<Vec<Quota>>,
    /// This key's own burst bucket, in place of its plan's.
    pub burst: Option<Burst>,
}

/// A token bucket of a key's own (`capacity`, `refill_per_sec` on an
/// `[[api_keys]]` entry).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Burst {
    pub capacity: u64,
    pub refill_per_sec: f64,
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("id", &self.id)
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

/// A cap on requests in flight, with its queue.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InFlight {
    pub cap: Cap,
    /// Requests that may wait for a slot (0: none wait).
    pub queue: u32,
    pub queue_timeout_ms: u64,
    /// `[min, max]` of a limit found from the upstream's latency; the cap
    /// is where it starts.
    pub adaptive: Option<(u32, u32)>,
}

impl InFlight {
    /// The adaptive bounds in force when `max_in_flight` (this replica's)
    /// is below them: `None` when they are in force as configured.
    pub fn adaptive_capped(&self) -> Option<(u32, u32)> {
        let (lo, hi) = self.adaptive?;
        match self.cap {
            Cap::Replica(n) if hi > n || lo > n => Some((lo.min(n), hi.min(n))),
            _ => None,
        }
    }
}

impl fmt::Display for InFlight {
    /// As `check` prints it: `max 256 (this replica), queue 512 for 1000 ms,
    /// adaptive 8..=256`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.cap {
            Cap::Replica(n) => write!(f, "max {n} (this replica)")?,
            Cap::Pool(n) => write!(f, "max {n} shared by the live replicas")?,
        }
        write!(f, ", queue {} for {} ms", self.queue, self.queue_timeout_ms)?;
        if let Some((lo, hi)) = self.adaptive {
            match self.adaptive_capped() {
                Some((elo, ehi)) => write!(
                    f,
                    ", adaptive {elo}..={ehi} (configured {lo}..={hi}, capped by max_in_flight)"
                )?,
                None => write!(f, ", adaptive {lo}..={hi}")?,
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cap {
    /// This replica's (`max_in_flight`).
    Replica(u32),
    /// The pool's, shared by the live replicas (`pool_max_in_flight`).
    Pool(u32),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Upstream {
    pub name: String,
    /// This replica's requests to the pool at once.
    pub in_flight: Option<InFlight>,
    pub servers: Vec<String>,
    pub health_check_path: Option<String>,
    pub connect_timeout_ms: u64,
    pub read_timeout_ms: u64,
    pub protocol: UpstreamProtocol,
    /// HTTPS to the servers.
    pub tls: bool,
    /// `None`: each server's host.
    pub sni: Option<String>,
    /// `None`: the system roots.
    pub ca_file: Option<std::path::PathBuf>,
    pub verify: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    Http1,
    /// HTTP/2 over TLS (ALPN).
    H2,
    /// HTTP/2 with prior knowledge, in plaintext.
    H2c,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub name: String,
    /// `None`: any host.
    pub host: Option<HostPattern>,
    pub path_prefix: String,
    /// `None`: every method.
    pub methods: Option<Vec<String>>,
    pub upstream: String,
    pub require_api_key: bool,
    pub limit: Option<Limit>,
    /// This replica's requests on the route at once.
    pub in_flight: Option<InFlight>,
    /// One client's requests on the route at once (beyond: 429).
    pub max_in_flight_per_client: Option<u32>,
    /// A plan's own limit on this route, in place of `limit` for its keys.
    pub limit_by_plan: std::collections::BTreeMap<String, Limit>,
    /// The upstream sees the path without `path_prefix`.
    pub strip_prefix: bool,
    /// The upstream read timeout for this route (`None`: the upstream's).
    pub timeout_ms: Option<u64>,
    /// Extra tries on another server for idempotent methods whose upstream
    /// failed (a failed connect is always tried once more).
    pub retries: u32,
    /// Larger request bodies: 413.
    pub max_request_body_bytes: Option<u64>,
    /// This route's CORS policy (`None`: `[cors]`, if any).
    pub cors: Option<Cors>,
    /// The cost read from the answer (`cost = "response"` limits count it).
    pub charge: Option<std::sync::Arc<super::Charge>>,
}

/// A CORS policy: which origins a browser may call from, with what, and
/// what its scripts may read of the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Cors {
    pub allow_origins: Vec<OriginPattern>,
    /// `None`: the route's methods (the common ones when it names none).
    pub allow_methods: Option<Vec<String>>,
    pub allow_headers: AllowHeaders,
    /// Exposed beyond the gateway's own: the rate-limit headers,
    /// Retry-After and X-Request-Id. Lower-case.
    pub expose_headers: Vec<String>,
    pub allow_credentials: bool,
    /// `None`: no `Access-Control-Max-Age` (the browser's default).
    pub max_age_secs: Option<u64>,
    /// Preflights spend tokens like the request they announce.
    pub charge_preflight: bool,
}

impl fmt::Display for Cors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let origins: Vec<String> = self.allow_origins.iter().map(|o| o.to_string()).collect();
        write!(f, "origins={}", origins.join(","))?;
        if let Some(m) = &self.allow_methods {
            write!(f, " methods={}", m.join(","))?;
        }
        match &self.allow_headers {
            AllowHeaders::Any => f.write_str(" headers=*")?,
            AllowHeaders::List(l) if !l.is_empty() => write!(f, " headers={}", l.join(","))?,
            AllowHeaders::List(_) => {}
        }
        if !self.expose_headers.is_empty() {
            write!(f, " expose+={}", self.expose_headers.join(","))?;
        }
        if self.allow_credentials {
            f.write_str(" credentials")?;
        }
        if let Some(age) = self.max_age_secs {
            write!(f, " max_age_secs={age}")?;
        }
        match self.charge_preflight {
            true => f.write_str(" preflights charged"),
            false => f.write_str(" preflights free"),
        }
    }
}

/// An allowed origin, lower-case as browsers send it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OriginPattern {
    /// `*`: any origin.
    Any,
    /// `https://app.example.com[:port]`.
    Exact(String),
    /// `https://*.example.com[:port]`: any name under it (not the apex).
    Subdomains { scheme: String, suffix: String },
}

impl fmt::Display for OriginPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OriginPattern::Any => f.write_str("*"),
            OriginPattern::Exact(o) => f.write_str(o),
            OriginPattern::Subdomains { scheme, suffix } => write!(f, "{scheme}*{suffix}"),
        }
    }
}

/// Request headers a preflight may announce.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowHeaders {
    Any,
    /// Lower-case names.
    List(Vec<String>),
}

/// A route's host: exact, or `*.example.com` for any name under it (not
/// `example.com` itself). Lower-case, no port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    Exact(String),
    /// The suffix with its leading dot: `.example.com`.
    Wildcard(String),
}

impl HostPattern {
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(h) => h == host,
            HostPattern::Wildcard(suffix) => {
                host.len() > suffix.len() && host.ends_with(suffix.as_str())
            }
        }
    }

    /// More specific first: exact, then longer wildcard suffixes.
    pub fn rank(&self) -> (u8, std::cmp::Reverse<usize>) {
        match self {
            HostPattern::Exact(_) => (0, std::cmp::Reverse(0)),
            HostPattern::Wildcard(s) => (1, std::cmp::Reverse(s.len())),
        }
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(h) => f.write_str(h),
            HostPattern::Wildcard(s) => write!(f, "*{s}"),
        }
    }
}
