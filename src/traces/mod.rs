//! OpenTelemetry traces (`[tracing]`): one server span per sampled request, and a
//! child span for each Redis call the request waited on (none when a lease
//! or a share decided it). The W3C `traceparent` and `tracestate` a client
//! sent are continued (a sampled parent is always followed, an unsampled one
//! never); the upstream receives the gateway's span as its parent.
//! Requests without a parent are sampled at `sample_ratio`. A request not
//! sampled has no span at all, and its headers go on untouched.
//!
//! Here: the tracer (`Traces`, built once at start-up) and a request's
//! span (`span`). Spans leave the request path in `ship`: a bounded queue
//! and a thread that exports batches over OTLP/HTTP; a collector that is
//! down costs requests nothing, and what it loses is counted.
//!
//! The limiter's decision goes under `ratelimit.*` (there is no semantic
//! convention for rate limiting yet: open-telemetry/semantic-conventions
//! #3361); the table is in docs/operator/traces.md.

mod ship;
mod span;

use std::time::{Duration, Instant, SystemTime};

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

use crate::config::TracingResolved;
pub use span::{Finish, RequestSpan};

pub struct Traces {
    /// Kept alive with the tracer (spans are shipped through it).
    _provider: SdkTracerProvider,
    shipper: ship::Shipper,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
    pub settings: TracingResolved,
}

impl Traces {
    /// The tracer, its export thread started. An endpoint that cannot be
    /// used is an error naming it (the collector need not be up).
    pub fn start(settings: TracingResolved) -> Result<Traces, String> {
        let resource = Resource::builder()
            .with_service_name(settings.service_name.clone())
            .build();
        let shipper = ship::Shipper::start(&settings.traces_url, resource.clone())?;
        // The provider owns one handle to the queue; this one flushes it.
        let queue = shipper.clone();
        let provider = SdkTracerProvider::builder()
            // Sampled before a span is built (`request`): every span made
            // is kept.
            .with_sampler(Sampler::AlwaysOn)
            .with_resource(resource)
            .with_span_processor(shipper)
            .build();
        let tracer = provider.tracer("ratelimit-gateway");
        Ok(Traces {
            _provider: provider,
            shipper: queue,
            tracer,
            propagator: TraceContextPropagator::new(),
            settings,
        })
    }

    /// A sampled request's server span, started `elapsed` ago, continuing
    /// the trace its headers carry; None for a request not sampled. The
    /// decision comes before any span is made: a request not sampled costs
    /// a header lookup and a random number, and its headers pass through
    /// untouched (measured: a non-recording span and its `traceparent` for
    /// every request cost 5–19 % of a request's CPU at ratio 0.01).
    /// `method` names the span until its route is known.
    pub fn request(
        &self,
        headers: &http::HeaderMap,
        method: &str,
        elapsed: Duration,
        attributes: impl FnOnce() -> Vec<KeyValue>,
    ) -> Option<RequestSpan> {
        let parent = match headers.contains_key("traceparent") {
            true => self
                .propagator
                .extract(&opentelemetry_http::HeaderExtractor(headers)),
            false => Context::new(),
        };
        let sampled = match parent.span().span_context() {
            sc if sc.is_valid() => sc.is_sampled(),
            _ => fastrand::f64() < self.settings.sample_ratio,
        };
        if !sampled {
            return None;
        }
        let start = SystemTime::now() - elapsed;
        let at = Instant::now() - elapsed;
        let builder = self
            .tracer
            .span_builder(method.to_string())
            .with_kind(SpanKind::Server)
            .with_start_time(start)
            .with_attributes(attributes());
        let span = self.tracer.build_with_context(builder, &parent);
        Some(RequestSpan::new(parent.with_span(span), start, at))
    }

    /// Sends the spans queued now, waiting at most `within` (a graceful stop).
    pub fn flush(&self, within: Duration) {
        self.shipper.flush(within);
    }

    fn inject(&self, cx: &Context, out: &mut Vec<(&'static str, String)>) {
        struct Out<'a>(&'a mut Vec<(&'static str, String)>);
        impl opentelemetry::propagation::Injector for Out<'_> {
            fn set(&mut self, key: &str, value: String) {
                let name = match key {
                    "traceparent" => "traceparent",
                    "tracestate" => "tracestate",
                    _ => return,
                };
                if !value.is_empty() {
                    self.0.push((name, value));
                }
            }
        }
        self.propagator.inject_context(cx, &mut Out(out));
    }
}
