//! Every metric the gateway exports, registered in one place.
//!
//! Labels come only from closed sets: route names from the config, the tier
//! enum, decisions, backends, status codes. Never a client address, a path as
//! sent, or an API key.
//!
//! This is the floor: every room records here, and this file names no other
//! room's types. A label comes in as a `&'static str` (or `TierLabel`), from
//! the room that owns its closed set.

use std::sync::OnceLock;

use metrics::{Counter, Gauge, Histogram};
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

const BATCH_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Installs the Prometheus recorder (once per process).
pub fn install() {
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_duration_seconds".into()), LATENCY_BUCKETS)
            .ok()?
            .set_buckets_for_metric(Matcher::Full("gateway_redis_batch_size".into()), BATCH_BUCKETS)
            .ok()?
            .install_recorder()
            .ok()?;
        describe_counter!(
            "gateway_trace_spans_total",
            "Spans of [tracing]: result exported, or dropped with a reason (queue_full: more than the export queue holds while the collector is slow; export_failed: the collector refused or did not answer the batch; stopped)"
        );
        describe_counter!(
            "gateway_requests_total",
            "Requests answered, by route and status"
        );
        describe_counter!(
            "gateway_ratelimit_decisions_total",
            "Rate-limit decisions by limit (tier: ip, key (the key's burst bucket), route, or a key's quota by period: quota-minute, quota-hour, quota-day, quota-week, quota-month), route and decision (allowed, rejected, shadow_rejected, not_asked: another limit's remembered denial answered first); each request counted once per limit"
        );
        describe_gauge!(
            "gateway_requests_in_flight",
            "Requests read and not yet finished (counted in every other series once finished)"
        );
        describe_gauge!(
            "gateway_limiter_backend",
            "1 for the limiter backend in use (redis or local)"
        );
        describe_counter!(
            "gateway_downstream_handshake_failures_total",
            "Client TLS or HTTP/2 handshakes that failed, by reason (client_alert, protocol, closed, timeout, h2, other); logged at debug"
        );
        describe_counter!(
            "gateway_upstream_pool_reuse_races_total",
            "Pooled upstream connections still held by the pool's idle watcher, so a new one was opened; logged at debug"
        );
        describe_counter!(
            "gateway_fallback_transitions_total",
            "Limiter backend transitions, by destination"
        );
        describe_histogram!(
            "gateway_redis_call_duration_seconds",
            "A request's wait for its Redis decision (the batch in flight ahead of it included)"
        );
        describe_histogram!(
            "gateway_redis_batch_size",
            "Requests decided by one Redis call (the ones that arrived while the last was in flight)"
        );
        describe_histogram!(
            "gateway_upstream_duration_seconds",
            "Time from sending upstream to the response header"
        );
        describe_gauge!(
            "gateway_limiter_local_entries",
            "Buckets held by the in-process limiter"
        );
        describe_counter!(
            "gateway_config_reloads_total",
            "Config reloads by result (ok, error); a change to clients.api_keys_file is one"
        );
        describe_gauge!(
            "gateway_api_keys",
            "API keys accepted: [[api_keys]] and clients.api_keys_file together"
        );
        describe_gauge!(
            "gateway_runtime_api_keys",
            "API keys issued at runtime (kept in Redis) this replica has read"
        );
        describe_counter!(
            "gateway_redis_errors_total",
            "Failed Redis calls and probes, by reason: timeout, unavailable, protocol; auth, permission, database, config and tls mean Redis refuses this gateway's settings (or its certificate is not trusted)"
        );
        describe_counter!(
            "gateway_redis_late_calls_total",
            "Watchdog checks after a Redis call went unanswered past redis.timeout_ms, by verdict: redis (Redis did not answer a PING within the budget: the breaker opened) or gateway (Redis answered: this replica was too busy to read its answer in time, and its requests kept waiting)"
        );
        describe_gauge!(
            "gateway_limiter_replicas",
            "Replicas sharing every limit: the live count read from Redis, else limiter.instances"
        );
        describe_counter!(
            "gateway_fallback_debts_charged_total",
            "Buckets whose local admissions during an outage were charged to Redis on failback"
        );
        describe_counter!(
            "gateway_shares_pulled_tokens_total",
            "Tokens the pull round asked of pools for standing shares that ran dry (asked), and got (granted)"
        );
        describe_counter!(
            "gateway_charged_requests_total",
            "Requests on charge routes settled once their answer ended, by how their cost was found (reason: read, capped, missing, not_json, not_a_number, negative, out_of_range, cut, failed)"
        );
        describe_counter!(
            "gateway_charged_units_total",
            "Units charge routes were charged in the end, as the upstream reported them (or the estimate, or max, as the reason says)"
        );
        describe_counter!(
            "gateway_settled_tokens_total",
            "Tokens settled with Redis after charged answers: owed beyond their estimates (debt) and given back (refund)"
        );
        describe_counter!(
            "gateway_redis_lost_answers_total",
            "Redis calls whose answers were lost, settled at failback, by whether they had run (yes, no)"
        );
        describe_counter!(
            "gateway_redis_probes_total",
            "Failback probes sent while on the fallback, by result (ok, failed)"
        );
        describe_gauge!(
            "gateway_fallback_seconds",
            "Seconds this replica has been on its fallback without Redis (0 while Redis decides)"
        );
        for result in ["ok", "failed"] {
            counter!("gateway_redis_probes_total", "result" => result).absolute(0);
        }
        gauge!("gateway_fallback_seconds").set(0.0);
        // Every series with a closed label set exists from start-up, at 0,
        // so an alert on it can be written before it first fires.
        for to in ["redis", "local"] {
            counter!("gateway_fallback_transitions_total", "to" => to).absolute(0);
        }
        for result in ["ok", "error"] {
            counter!("gateway_config_reloads_total", "result" => result).absolute(0);
        }
        for reason in REDIS_ERROR_REASONS {
            counter!("gateway_redis_errors_total", "reason" => *reason).absolute(0);
        }
        for verdict in ["redis", "gateway"] {
            counter!("gateway_redis_late_calls_total", "verdict" => verdict).absolute(0);
        }
        counter!("gateway_fallback_debts_charged_total").absolute(0);
        describe_counter!(
            "gateway_limiter_decisions_total",
            "Requests that reached the limiter, by how they were decided: lease (from tokens Redis debited ahead, no round trip), redis (a Redis call), denied_cache (a refusal Redis gave, remembered until its retry time), fallback (this replica's local share), fail_open, fail_closed (on_redis_failure allow or deny), local (limiter.backend = \"local\")"
        );
        for path in DecidedBy::ALL {
            counter!("gateway_limiter_decisions_total", "path" => path.as_str()).absolute(0);
        }
        describe_counter!(
            "gateway_lease_tokens_total",
            "Leased tokens by event: granted (debited by Redis for this replica), spent (admitted from a lease), returned (unspent, taken back by the shared bucket), lost (unspent and not taken back: Redis takes back only what leaves the bucket exactly as if never leased, a reset cancels the leases of the bucket it made whole, and a return whose call may have run is never sent again; the shared limit under-admits by them), refunded (a charged request's estimate less its answer's cost, given back to the lease it was spent from or decided above). granted + refunded = spent + returned + lost + gateway_lease_tokens_held"
        );
        for event in ["granted", "spent", "returned", "lost"] {
            counter!("gateway_lease_tokens_total", "event" => event).absolute(0);
        }
        describe_gauge!(
            "gateway_lease_tokens_held",
            "Leased tokens this replica holds: live, owed back to Redis (sent within a quarter lease period), or taken by a request still being decided"
        );
        gauge!("gateway_lease_tokens_held").set(0.0);
        describe_gauge!(
            "gateway_shares_usable",
            "1 while this replica decides big buckets on its standing shares ([limiter.shares]), else 0"
        );
        describe_gauge!(
            "gateway_shares_entries",
            "standing shares this replica holds (bounded by limiter.local_max_entries)"
        );
        gauge!("gateway_shares_usable").set(0.0);
        gauge!("gateway_shares_entries").set(0.0);
        gauge!("gateway_requests_in_flight").set(0.0);
        describe_gauge!(
            "gateway_in_flight",
            "Requests holding a slot under an in-flight cap, by kind (upstream, route) and name, as of the scrape"
        );
        describe_gauge!(
            "gateway_in_flight_limit",
            "An in-flight cap now: max_in_flight, this replica's share of pool_max_in_flight, or the adaptive limit"
        );
        describe_gauge!(
            "gateway_in_flight_queued",
            "Requests waiting for a slot under an in-flight cap"
        );
        describe_gauge!(
            "gateway_adaptive_rtt_seconds",
            "An adaptive upstream's round trips: estimate=min (the unloaded one it learnt), sample (the last interval's mean)"
        );
        describe_counter!(
            "gateway_in_flight_refusals_total",
            "Requests the rate tiers admitted and an in-flight cap refused, by kind, name and reason: queue_full, queue_timeout, displaced (a higher-priority plan took its place in the queue) answered 503; per_client (max_in_flight_per_client) answered 429; client_left (its client left while it waited: dropped, never sent upstream). Every reason of every cap is present at 0 from the first scrape"
        );
        describe_counter!(
            "gateway_access_log_left_out_total",
            "Access lines of refusals (the gateway's own 429 and 503) not written: over [log] refusals_per_sec in their second. The next refusal line written says how many were left out before it (left_out=N)"
        );
        describe_counter!(
            "gateway_refunds_total",
            "Admissions given back to the rate tiers (every tier that admitted the request): an in-flight cap refused it, or its client left while it waited, so it never reached the upstream and is not charged"
        );
        describe_counter!(
            "gateway_in_flight_held_total",
            "Requests whose client left after they were sent and before the upstream answered: their slot stayed taken until the upstream would have answered (the longest recent round trip, at most the read timeout), so the upstream never holds more than the cap"
        );
        describe_counter!(
            "gateway_tls_certificate_reloads_total",
            "TLS certificate files re-read after a change, by result (ok, error: the certificates in use were kept)"
        );
        for result in ["ok", "error"] {
            counter!("gateway_tls_certificate_reloads_total", "result" => result).absolute(0);
        }
        describe_counter!(
            "gateway_jwt_refusals_total",
            "Bearer JWTs refused, by reason (malformed, algorithm, issuer, key, signature, expired, not_yet_valid, audience, claim, crit: answered 401; keys_unavailable: the issuer's keys were never fetched or are older than jwks_max_stale_secs, answered 503)"
        );
        describe_counter!(
            "gateway_jwks_fetches_total",
            "JWKS fetches by issuer and result (ok, error: the last keys serve until jwks_max_stale_secs)"
        );
        describe_gauge!(
            "gateway_jwks_keys",
            "Signing keys held for an issuer's JWKS endpoint"
        );
        describe_counter!(
            "gateway_jwt_signature_checks_total",
            "Signatures of bearer JWTs checked against a key (tokens not verified before; each paid for by its client address's ip tier first)"
        );
        counter!("gateway_jwt_signature_checks_total").absolute(0);
        describe_gauge!(
            "gateway_jwt_verified_cached",
            "Verified tokens remembered (each until its exp), so a returning client pays no signature check"
        );
        Some(handle)
    });
}

/// The closed label set of `gateway_redis_errors_total` (`LimiterError::reason`).
pub const REDIS_ERROR_REASONS: &[&str] = &[
    "timeout",
    "unavailable",
    "protocol",
    "auth",
    "permission",
    "database",
    "config",
    "tls",
];

/// The Prometheus text exposition.
pub fn render() -> String {
    match HANDLE.get() {
        Some(Some(h)) => {
            h.run_upkeep();
            h.render()
        }
        _ => String::new(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionLabel {
    Allowed,
    Rejected,
    ShadowRejected,
    /// Another tier's remembered denial refused the request first: this
    /// tier was not asked (every tier of a request is counted once).
    NotAsked,
}

impl DecisionLabel {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Allowed => "allowed",
            DecisionLabel::Rejected => "rejected",
            DecisionLabel::ShadowRejected => "shadow_rejected",
            DecisionLabel::NotAsked => "not_asked",
        }
    }
}

/// Every reason `gateway_jwt_refusals_total` counts, at 0 before its first.
pub fn jwt_refusal_reasons(reasons: &[&'static str]) {
    for reason in reasons {
        counter!("gateway_jwt_refusals_total", "reason" => *reason).absolute(0);
    }
}

/// Which backend decides: "redis" or "local".
pub fn set_backend(backend: &'static str) {
    for b in ["redis", "local"] {
        let on = if b == backend { 1.0 } else { 0.0 };
        gauge!("gateway_limiter_backend", "backend" => b).set(on);
    }
}

pub fn fallback_transition(to: &'static str) {
    counter!("gateway_fallback_transitions_total", "to" => to).increment(1);
    set_backend(to);
}

/// One failback probe's result.
pub fn redis_probe(ok: bool) {
    let result = if ok { "ok" } else { "failed" };
    counter!("gateway_redis_probes_total", "result" => result).increment(1);
}

/// A refusal's access line left out (`[log] refusals_per_sec`).
pub fn access_line_left_out() {
    counter!("gateway_access_log_left_out_total").increment(1);
}

/// An admission given back (`Fallback::refund`).
pub fn refunded() {
    counter!("gateway_refunds_total").increment(1);
}

/// A request an in-flight cap refused (`proxy::take_slots`).
pub fn in_flight_refused(kind: &'static str, name: &str, reason: &'static str) {
    counter!(
        "gateway_in_flight_refusals_total",
        "kind" => kind,
        "name" => name.to_string(),
        "reason" => reason
    )
    .increment(1);
}

/// One in-flight gate as of a scrape: its load, the slots it has given,
/// every reason it refuses for (at 0 before its first), and an adaptive
/// gate's round-trip estimates (`min`, `sample`, in microseconds).
pub struct GateScrape<'a> {
    pub kind: &'static str,
    pub name: &'a str,
    pub held: u32,
    pub queued: usize,
    pub limit: u32,
    pub held_total: u64,
    pub refusal_reasons: &'static [&'static str],
    pub rtt_us: Option<(u64, u64)>,
}

/// The series every scrape shows at 0 before their first event.
pub fn in_flight_scrape_start(per_client_routes: impl Iterator<Item = impl ToString>) {
    counter!("gateway_refunds_total").increment(0);
    counter!("gateway_access_log_left_out_total").increment(0);
    for route in per_client_routes {
        counter!(
            "gateway_in_flight_refusals_total",
            "kind" => "route",
            "name" => route.to_string(),
            "reason" => "per_client"
        )
        .increment(0);
    }
}

pub fn in_flight_gate(g: GateScrape<'_>) {
    let labels = [("kind", g.kind.to_string()), ("name", g.name.to_string())];
    gauge!("gateway_in_flight", &labels).set(g.held as f64);
    gauge!("gateway_in_flight_queued", &labels).set(g.queued as f64);
    gauge!("gateway_in_flight_limit", &labels).set(g.limit as f64);
    counter!("gateway_in_flight_held_total", &labels).absolute(g.held_total);
    for reason in g.refusal_reasons {
        let labels = [
            ("kind", g.kind.to_string()),
            ("name", g.name.to_string()),
            ("reason", reason.to_string()),
        ];
        counter!("gateway_in_flight_refusals_total", &labels).increment(0);
    }
    if let Some((min, sample)) = g.rtt_us {
        for (estimate, us) in [("min", min), ("sample", sample)] {
            gauge!("gateway_adaptive_rtt_seconds", "upstream" => g.name.to_string(), "estimate" => estimate)
                .set(us as f64 / 1e6);
        }
    }
}

pub fn fallback_for(d: Duration) {
    gauge!("gateway_fallback_seconds").set(d.as_secs_f64());
}

/// A client's TLS (or HTTP/2) handshake that failed: the client's
/// business, counted rather than logged as an error (`logging`).
pub fn downstream_handshake_failure(reason: &'static str) {
    counter!("gateway_downstream_handshake_failures_total", "reason" => reason).increment(1);
}

/// Pingora found a pooled upstream connection still held by its idle
/// watcher and opened a new one (`logging`).
pub fn upstream_pool_reuse_race() {
    counter!("gateway_upstream_pool_reuse_races_total").increment(1);
}

pub fn redis_error(reason: &'static str) {
    counter!("gateway_redis_errors_total", "reason" => reason).increment(1);
}

/// The watchdog's verdict on a late call: `redis_stalled` when Redis did not
/// answer its PING within the budget.
pub fn late_call_verdict(redis_stalled: bool) {
    let verdict = if redis_stalled { "redis" } else { "gateway" };
    counter!("gateway_redis_late_calls_total", "verdict" => verdict).increment(1);
}

/// How a request that reached the limiter was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecidedBy {
    /// Every tier on this replica's standing shares (`[limiter.shares]`).
    Share,
    Lease,
    Redis,
    DeniedCache,
    Fallback,
    FailOpen,
    FailClosed,
    /// `limiter.backend = "local"`: no Redis.
    Local,
}

impl DecidedBy {
    pub const ALL: [DecidedBy; 8] = [
        DecidedBy::Share,
        DecidedBy::Lease,
        DecidedBy::Redis,
        DecidedBy::DeniedCache,
        DecidedBy::Fallback,
        DecidedBy::FailOpen,
        DecidedBy::FailClosed,
        DecidedBy::Local,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecidedBy::Share => "share",
            DecidedBy::Lease => "lease",
            DecidedBy::Redis => "redis",
            DecidedBy::DeniedCache => "denied_cache",
            DecidedBy::Fallback => "fallback",
            DecidedBy::FailOpen => "fail_open",
            DecidedBy::FailClosed => "fail_closed",
            DecidedBy::Local => "local",
        }
    }
}

/// Counts one request's decision path (handles cached: this is per request).
pub fn decided_by(path: DecidedBy) {
    static C: OnceLock<[Counter; 8]> = OnceLock::new();
    C.get_or_init(|| {
        DecidedBy::ALL.map(|p| counter!("gateway_limiter_decisions_total", "path" => p.as_str()))
    })[path as usize]
        .increment(1);
}

/// `[limiter.shares]`: whether this replica uses its standing shares, and
/// how many it holds.
pub fn shares(usable: bool, entries: usize) {
    gauge!("gateway_shares_usable").set(if usable { 1.0 } else { 0.0 });
    gauge!("gateway_shares_entries").set(entries as f64);
}

/// Leased tokens granted, spent, returned or lost; and refunded: spent,
/// then given back to a lease by a charged request's answer.
pub fn lease_tokens(event: LeaseEvent, n: u64) {
    static C: OnceLock<[Counter; 5]> = OnceLock::new();
    if n > 0 {
        C.get_or_init(|| {
            ["granted", "spent", "returned", "lost", "refunded"]
                .map(|e| counter!("gateway_lease_tokens_total", "event" => e))
        })[event as usize]
            .increment(n);
    }
}

/// Leased tokens this replica holds: live, owed back, or taken by a
/// request still being decided (granted and refunded, less spent,
/// returned and lost).
pub fn lease_tokens_held(n: i64) {
    gauge!("gateway_lease_tokens_held").set(n as f64);
}

#[derive(Debug, Clone, Copy)]
pub enum LeaseEvent {
    Granted,
    Spent,
    Returned,
    Lost,
    Refunded,
}

pub fn replicas(n: u32) {
    gauge!("gateway_limiter_replicas").set(n as f64);
}

/// One pull call: tokens asked of the pools for dry shares, and granted.
pub fn share_pull(asked: u64, granted: u64) {
    counter!("gateway_shares_pulled_tokens_total", "result" => "asked").increment(asked);
    counter!("gateway_shares_pulled_tokens_total", "result" => "granted").increment(granted);
}

/// Spans of `[tracing]`: exported, or dropped (the queue was full, the
/// collector failed the batch, or the exporter had stopped).
pub fn trace_spans(dropped: Option<&'static str>, n: u64) {
    match dropped {
        None => counter!("gateway_trace_spans_total", "result" => "exported").increment(n),
        Some(reason) => {
            counter!("gateway_trace_spans_total", "result" => "dropped", "reason" => reason)
                .increment(n)
        }
    }
}

/// A charged request settled: why it was charged what it was, and how much.
pub fn charged(reason: &'static str, units: u64) {
    counter!("gateway_charged_requests_total", "reason" => reason).increment(1);
    counter!("gateway_charged_units_total").increment(units);
}

/// Tokens settled with Redis: owed beyond estimates, and given back.
pub fn settled(debt: u64, refund: u64) {
    counter!("gateway_settled_tokens_total", "kind" => "debt").increment(debt);
    counter!("gateway_settled_tokens_total", "kind" => "refund").increment(refund);
}

/// Settlements past `MOST_PENDING` buckets (still kept, never dropped).
pub fn settle_backlog_full() {
    counter!("gateway_settle_backlog_full_total").increment(1);
}

/// A batch of settlements whose call may have run (its answer lost): sent
/// again under its marker, so it is settled once.
pub fn settle_in_doubt() {
    counter!("gateway_settle_in_doubt_total").increment(1);
}

/// A charged answer of a fallback admission whose debt failback had
/// already charged (or dropped for room): settled on the local bucket only.
pub fn settle_after_failback() {
    counter!("gateway_settle_after_failback_total").increment(1);
}

/// A call whose answer was lost, settled at failback: whether it had run.
pub fn lost_answer(ran: bool) {
    counter!("gateway_redis_lost_answers_total", "ran" => if ran { "yes" } else { "no" })
        .increment(1);
}

pub fn debts_charged(buckets: usize) {
    counter!("gateway_fallback_debts_charged_total").increment(buckets as u64);
}

pub fn redis_call(d: Duration) {
    histogram!("gateway_redis_call_duration_seconds").record(d.as_secs_f64());
}

/// The size of one batch sent to Redis.
pub fn redis_batch(requests: usize) {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| histogram!("gateway_redis_batch_size"))
        .record(requests as f64);
}

/// Held by a request from when its header is read until it has been logged
/// and counted: `gateway_requests_in_flight` at 0 means every answered request
/// is in the other series (a client can read its answer before that).
pub struct InFlight(());

impl InFlight {
    fn gauge() -> &'static Gauge {
        static G: OnceLock<Gauge> = OnceLock::new();
        G.get_or_init(|| gauge!("gateway_requests_in_flight"))
    }

    pub fn start() -> Self {
        Self::gauge().increment(1.0);
        InFlight(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        Self::gauge().decrement(1.0);
    }
}

pub fn local_entries(n: usize) {
    gauge!("gateway_limiter_local_entries").set(n as f64);
}

pub fn certificate_reload(ok: bool) {
    let result = if ok { "ok" } else { "error" };
    counter!("gateway_tls_certificate_reloads_total", "result" => result).increment(1);
}

/// The keys the live config accepts.
pub fn api_keys(n: usize) {
    gauge!("gateway_api_keys").set(n as f64);
}

/// The runtime keys this replica has read from Redis.
pub fn runtime_api_keys(n: usize) {
    gauge!("gateway_runtime_api_keys").set(n as f64);
}

pub fn jwt_refused(reason: &'static str) {
    counter!("gateway_jwt_refusals_total", "reason" => reason).increment(1);
}

/// A JWKS fetch for `issuer` (a configured `iss`: a closed set), and the
/// keys held after it.
pub fn jwks_fetched(issuer: &str, ok: bool, keys: usize) {
    let result = if ok { "ok" } else { "error" };
    counter!("gateway_jwks_fetches_total", "issuer" => issuer.to_string(), "result" => result)
        .increment(1);
    gauge!("gateway_jwks_keys", "issuer" => issuer.to_string()).set(keys as f64);
}

pub fn jwt_signature_checked() {
    counter!("gateway_jwt_signature_checks_total").increment(1);
}

pub fn jwt_cached(n: usize) {
    gauge!("gateway_jwt_verified_cached").set(n as f64);
}

pub fn config_reload(ok: bool) {
    counter!("gateway_config_reloads_total", "result" => if ok { "ok" } else { "error" })
        .increment(1);
}

/// One route's series, registered (at 0) when the route is loaded and then
/// reused: the request path increments a handle instead of looking labels up
/// in the registry, and an alert on a route's 429s or 5xx can be written
/// before the first one.
pub struct RouteMetrics {
    route: String,
    requests: [OnceLock<Counter>; STATUS_LABELS],
    decisions: [[OnceLock<Counter>; 4]; TIER_SLOTS],
    upstream: OnceLock<Histogram>,
}

/// How many kinds of limit a route's series can tell apart.
pub const TIER_SLOTS: usize = 16;

/// A kind of limit as a label (a tier, a quota's with its period): its
/// slot in a route's series (below `TIER_SLOTS`) and its name. The limiter
/// owns the closed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierLabel {
    pub slot: usize,
    pub name: &'static str,
}

const STATUS_LABELS: usize = NAMED.len() + 6;

impl RouteMetrics {
    /// `first`: the kinds every route reports from the start.
    pub fn new(route: &str, first: &[TierLabel]) -> Self {
        let m = RouteMetrics {
            route: route.to_string(),
            requests: std::array::from_fn(|_| OnceLock::new()),
            decisions: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
            upstream: OnceLock::new(),
        };
        // One status per label: the named codes, then one of each class.
        let statuses = NAMED.iter().map(|(code, _)| *code);
        for status in statuses.chain([100, 299, 399, 499, 599, 0]) {
            m.requests_counter(status).increment(0);
        }
        for &tier in first {
            for d in [
                DecisionLabel::Allowed,
                DecisionLabel::Rejected,
                DecisionLabel::ShadowRejected,
                DecisionLabel::NotAsked,
            ] {
                m.decisions_counter(tier, d).increment(0);
            }
        }
        m
    }

    fn requests_counter(&self, status: u16) -> &Counter {
        let (i, label) = status_label_indexed(status);
        self.requests[i].get_or_init(
            || counter!("gateway_requests_total", "route" => self.route.clone(), "status" => label),
        )
    }

    fn decisions_counter(&self, tier: TierLabel, decision: DecisionLabel) -> &Counter {
        self.decisions[tier.slot][decision as usize].get_or_init(|| {
            counter!(
                "gateway_ratelimit_decisions_total",
                "tier" => tier.name,
                "route" => self.route.clone(),
                "decision" => decision.as_str()
            )
        })
    }

    pub fn request(&self, status: u16) {
        self.requests_counter(status).increment(1);
    }

    pub fn decision(&self, tier: TierLabel, decision: DecisionLabel) {
        self.decisions_counter(tier, decision).increment(1);
    }

    pub fn upstream(&self, d: Duration) {
        self.upstream
            .get_or_init(
                || histogram!("gateway_upstream_duration_seconds", "route" => self.route.clone()),
            )
            .record(d.as_secs_f64());
    }
}

// Common codes by name; anything else by class, so the label set stays closed.
const NAMED: &[(u16, &str)] = &[
    (200, "200"),
    (201, "201"),
    (204, "204"),
    (301, "301"),
    (302, "302"),
    (304, "304"),
    (400, "400"),
    (401, "401"),
    (403, "403"),
    (404, "404"),
    (405, "405"),
    (408, "408"),
    (429, "429"),
    (431, "431"),
    (500, "500"),
    (502, "502"),
    (503, "503"),
    (504, "504"),
];

/// A status as the access log writes it: its number, or `aborted` (no
/// response was written: the client left first), the word the metrics use.
pub fn status_word(status: u16) -> std::borrow::Cow<'static, str> {
    match status {
        0 => "aborted".into(),
        n => n.to_string().into(),
    }
}

fn status_label_indexed(status: u16) -> (usize, &'static str) {
    if let Some(i) = NAMED.iter().position(|(code, _)| *code == status) {
        return (i, NAMED[i].1);
    }
    let n = NAMED.len();
    match status {
        // No response was written: the client went away first (nginx's 499).
        0 => (n + 5, "aborted"),
        100..=199 => (n, "1xx"),
        200..=299 => (n + 1, "2xx"),
        300..=399 => (n + 2, "3xx"),
        400..=499 => (n + 3, "4xx"),
        _ => (n + 4, "5xx"),
    }
}
