//! One request's server span: started when the request is read, carried
//! in its context, finished once it is logged with the limiter's decision
//! (`Finish`), and a child span for each Redis call it waited on.

use std::time::{Duration, Instant, SystemTime};

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};

use super::Traces;

pub struct RequestSpan {
    cx: Context,
    /// When the request was read, on the wall clock and the monotonic one
    /// (a child span's times are this plus a monotonic offset).
    start: SystemTime,
    at: Instant,
}

/// What a finished request tells its span.
#[derive(Debug, Default)]
pub struct Finish<'a> {
    /// 0: none was written (the client left first).
    pub status: u16,
    /// The route's path prefix (`http.route`) and name.
    pub route: Option<(&'a str, &'a str)>,
    pub client: Option<&'a str>,
    /// `admitted`, `refused`, …: see docs/operator/traces.md.
    pub decision: &'static str,
    /// The tiers that refused it (their policy names), or the in-flight
    /// cap or token check that did.
    pub refused_by: Option<&'a str>,
    pub backend: &'a str,
    /// How the limiter decided it (`share`, `lease`, `redis`, …).
    pub decided_by: Option<&'static str>,
    pub key_id: Option<&'a str>,
    pub queue_wait: Option<Duration>,
    /// A `charge` route's settled cost and why it was charged so.
    pub charged: Option<(u64, &'static str)>,
    /// The Redis calls it waited on: start, end, answered.
    pub redis: Vec<(Instant, Instant, bool)>,
}

impl RequestSpan {
    pub(super) fn new(cx: Context, start: SystemTime, at: Instant) -> Self {
        RequestSpan { cx, start, at }
    }

    /// The headers that make the upstream's span a child of this one.
    pub fn headers(&self, traces: &Traces) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(2);
        traces.inject(&self.cx, &mut out);
        out
    }

    pub fn finish(self, traces: &Traces, method: &str, f: Finish<'_>) {
        let span = self.cx.span();
        if let Some((prefix, _)) = f.route {
            span.update_name(format!("{method} {prefix}"));
        }
        let mut a = Vec::with_capacity(14);
        if f.status > 0 {
            a.push(KeyValue::new("http.response.status_code", f.status as i64));
        }
        if let Some((prefix, name)) = f.route {
            a.push(KeyValue::new("http.route", prefix.to_string()));
            a.push(KeyValue::new("ratelimit.route", name.to_string()));
        }
        if let Some(c) = f.client {
            a.push(KeyValue::new("client.address", c.to_string()));
        }
        a.push(KeyValue::new("ratelimit.decision", f.decision));
        if let Some(by) = f.refused_by {
            a.push(KeyValue::new("ratelimit.refused_by", by.to_string()));
        }
        a.push(KeyValue::new("ratelimit.backend", f.backend.to_string()));
        if let Some(by) = f.decided_by {
            a.push(KeyValue::new("ratelimit.decided_by", by));
        }
        if let Some(k) = f.key_id {
            a.push(KeyValue::new("ratelimit.key_id", k.to_string()));
        }
        if let Some(w) = f.queue_wait {
            a.push(KeyValue::new(
                "ratelimit.queue_wait_ms",
                w.as_secs_f64() * 1000.0,
            ));
        }
        if let Some((cost, why)) = f.charged {
            a.push(KeyValue::new("ratelimit.charged_cost", cost as i64));
            a.push(KeyValue::new("ratelimit.charged_reason", why));
        }
        span.set_attributes(a);
        // A refusal is the gateway working: only a server error is one.
        if f.status >= 500 {
            span.set_status(Status::error(format!("status {}", f.status)));
        }
        let wall = |t: Instant| self.start + t.saturating_duration_since(self.at);
        for (start, end, ok) in f.redis {
            let builder = traces
                .tracer
                .span_builder("EVALSHA")
                .with_kind(SpanKind::Client)
                .with_start_time(wall(start))
                .with_attributes([
                    KeyValue::new("db.system.name", "redis"),
                    KeyValue::new("db.operation.name", "EVALSHA"),
                    KeyValue::new("ratelimit.redis.answered", ok),
                ]);
            let mut child = traces.tracer.build_with_context(builder, &self.cx);
            if !ok {
                opentelemetry::trace::Span::set_status(
                    &mut child,
                    Status::error("no answer within the budget"),
                );
            }
            opentelemetry::trace::Span::end_with_timestamp(&mut child, wall(end));
        }
        span.end();
    }
}
