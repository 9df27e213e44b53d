//! Every metric the gateway exports, registered in one place.
//!
//! Labels come only from closed sets: route names from the config, the tier
//! enum, decisions, backends, status codes. Never a client address, a path as
//! sent, or an API key.

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::limiter::{FallbackState, Tier};

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Installs the Prometheus recorder (once per process).
pub fn install() {
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_duration_seconds".into()), LATENCY_BUCKETS)
            .ok()?
            .install_recorder()
            .ok()?;
        describe_counter!(
            "gateway_requests_total",
            "Requests answered, by route and status"
        );
        describe_counter!(
            "gateway_ratelimit_decisions_total",
            "Rate-limit decisions by tier, route and decision (allowed, rejected, shadow_rejected)"
        );
        describe_gauge!(
            "gateway_limiter_backend",
            "1 for the limiter backend in use (redis or local)"
        );
        describe_counter!(
            "gateway_fallback_transitions_total",
            "Limiter backend transitions, by destination"
        );
        describe_histogram!(
            "gateway_redis_call_duration_seconds",
            "Duration of one limiter call to Redis"
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
            "Config reloads by result (ok, error)"
        );
        Some(handle)
    });
}

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

pub fn request(route: &str, status: u16) {
    counter!("gateway_requests_total", "route" => route.to_string(), "status" => status_label(status))
        .increment(1);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionLabel {
    Allowed,
    Rejected,
    ShadowRejected,
}

impl DecisionLabel {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Allowed => "allowed",
            DecisionLabel::Rejected => "rejected",
            DecisionLabel::ShadowRejected => "shadow_rejected",
        }
    }
}

pub fn decision(tier: Tier, route: &str, decision: DecisionLabel) {
    counter!(
        "gateway_ratelimit_decisions_total",
        "tier" => tier.as_str(),
        "route" => route.to_string(),
        "decision" => decision.as_str()
    )
    .increment(1);
}

pub fn set_backend(state: FallbackState) {
    let (redis, local) = match state {
        FallbackState::Redis => (1.0, 0.0),
        FallbackState::Local => (0.0, 1.0),
    };
    gauge!("gateway_limiter_backend", "backend" => "redis").set(redis);
    gauge!("gateway_limiter_backend", "backend" => "local").set(local);
}

pub fn fallback_transition(to: FallbackState) {
    counter!("gateway_fallback_transitions_total", "to" => to.as_str()).increment(1);
    set_backend(to);
}

pub fn redis_call(d: Duration) {
    histogram!("gateway_redis_call_duration_seconds").record(d.as_secs_f64());
}

pub fn upstream(route: &str, d: Duration) {
    histogram!("gateway_upstream_duration_seconds", "route" => route.to_string())
        .record(d.as_secs_f64());
}

pub fn local_entries(n: usize) {
    gauge!("gateway_limiter_local_entries").set(n as f64);
}

pub fn config_reload(ok: bool) {
    counter!("gateway_config_reloads_total", "result" => if ok { "ok" } else { "error" })
        .increment(1);
}

fn status_label(status: u16) -> &'static str {
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
    if let Some((_, label)) = NAMED.iter().find(|(code, _)| *code == status) {
        return label;
    }
    match status {
        100..=199 => "1xx",
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}
