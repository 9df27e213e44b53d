//! OpenTelemetry traces (`[tracing]`) through the real gateway, measured by
//! a real OTLP/HTTP receiver that decodes what it is sent: a sampled
//! parent is continued and the upstream is told the gateway's span as its
//! parent; a refusal's span names the tier; a Redis call the request
//! waited on is a child span; a collector that is down costs requests
//! nothing and its lost spans are counted.

use std::time::Duration;

use crate::support::otlp::{Receiver, Seen};
use crate::support::*;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// A route of two requests per client (no refill to speak of) on Redis,
/// traced at `ratio` to `receiver`.
fn config(up: &UpstreamGuard, redis: &RedisGuard, receiver: &Receiver, ratio: &str) -> String {
    format!(
        r#"
{SERVER}

[tracing]
otlp_endpoint = "{otlp}"
sample_ratio = {ratio}
service_name = "gateway-under-test"

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["{redis}"]
timeout_ms = 250

[[upstreams]]
name = "up"
servers = ["{up}"]

[[routes]]
name = "ride"
path_prefix = "/ride"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.001, scope = "client" }}

[[routes]]
name = "open"
path_prefix = "/open"
upstream = "up"
"#,
        otlp = receiver.url(),
        redis = redis.url(),
        up = up.addr,
    )
}

/// The `traceparent` the upstream received (its echo of the headers).
fn upstream_traceparent(r: &Response) -> String {
    r.json()["headers"]["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("no traceparent reached the upstream: {}", r.text()))
        .to_string()
}

fn spans_of(receiver: &Receiver, trace: &str, n: usize) -> Vec<Seen> {
    wait_for("the spans to be exported", Duration::from_secs(10), || {
        let spans: Vec<Seen> = receiver
            .spans()
            .into_iter()
            .filter(|s| s.trace_id == trace)
            .collect();
        (spans.len() >= n).then_some(spans)
    })
}

#[test]
fn a_sampled_parent_is_continued_and_a_refusal_names_its_tier() {
    let receiver = Receiver::start();
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    // Ratio 0: only a sampled parent makes a span.
    let gw = GatewayGuard::start(&config(&up, &redis, &receiver, "0"));
    let mut c = gw.client();
    let parent = |trace: &str| format!("00-{trace}-{PARENT}-01");

    // Admitted, decided by a Redis call (the bucket's first request).
    let r = c
        .request("GET", "/ride/1", &[("traceparent", &parent(TRACE))], b"")
        .expect("answer");
    assert_eq!(r.status, 200);
    let sent = upstream_traceparent(&r);
    let spans = spans_of(&receiver, TRACE, 1);
    let server = spans.iter().find(|s| s.kind == 2).expect("a server span");
    assert_eq!(
        server.parent_span_id, PARENT,
        "the client's span is its parent"
    );
    assert_eq!(
        sent,
        format!("00-{TRACE}-{}-01", server.span_id),
        "the upstream's parent is the gateway's span"
    );
    assert_eq!(server.service, "gateway-under-test");
    assert_eq!(server.name, "GET /ride");
    for (k, v) in [
        ("http.request.method", "GET"),
        ("http.route", "/ride"),
        ("http.response.status_code", "200"),
        ("url.path", "/ride/1"),
        ("client.address", "127.0.0.1"),
        ("ratelimit.decision", "admitted"),
        ("ratelimit.backend", "redis"),
        ("ratelimit.route", "ride"),
    ] {
        assert_eq!(server.attr(k), Some(v), "{k} in {:?}", server.attributes);
    }
    // A child span for each Redis call it waited on; none when a lease
    // decided it.
    let calls: Vec<&Seen> = spans
        .iter()
        .filter(|s| s.name == "EVALSHA" && s.parent_span_id == server.span_id)
        .collect();
    match server.attr("ratelimit.decided_by") {
        Some("redis") => {
            assert!(!calls.is_empty(), "a Redis call's span: {spans:?}");
            for call in &calls {
                assert_eq!(call.kind, 3);
                assert_eq!(call.attr("db.system.name"), Some("redis"));
                assert!(call.start_ns >= server.start_ns && call.end_ns <= server.end_ns);
            }
        }
        other => panic!("the bucket's first request decided by {other:?}"),
    }

    // The second spends the bucket; the third is refused by the route's
    // limit: an Ok span (not an error) naming the tier.
    let traces = ["a".repeat(32), "b".repeat(32)];
    let statuses: Vec<u16> = traces
        .iter()
        .map(|t| {
            c.request("GET", "/ride/2", &[("traceparent", &parent(t))], b"")
                .expect("answer")
                .status
        })
        .collect();
    assert_eq!(statuses, [200, 429]);
    let refused = spans_of(&receiver, &traces[1], 1);
    let refused = refused.iter().find(|s| s.kind == 2).expect("its span");
    assert_eq!(refused.attr("ratelimit.decision"), Some("refused"));
    assert_eq!(refused.attr("ratelimit.refused_by"), Some("route"));
    assert_eq!(refused.attr("http.response.status_code"), Some("429"));
    assert_ne!(refused.status, 2, "a refusal is not an error");
    let second = spans_of(&receiver, &traces[0], 1);
    let second = second.iter().find(|s| s.kind == 2).expect("its span");
    let children = receiver
        .spans()
        .into_iter()
        .filter(|s| s.parent_span_id == second.span_id)
        .count();
    match second.attr("ratelimit.decided_by") {
        Some("redis") => assert!(children > 0),
        Some(_) => assert_eq!(
            children, 0,
            "no Redis span when a lease or share decided it"
        ),
        None => panic!("no decided_by: {:?}", second.attributes),
    }

    // Not sampled (no parent at ratio 0, or an unsampled parent): no span,
    // and the headers go on untouched.
    let r = c.request("GET", "/open", &[], b"").expect("answer");
    assert!(r.json()["headers"]["traceparent"].is_null(), "{}", r.text());
    let unsampled = format!("00-{}-{PARENT}-00", "c".repeat(32));
    let r = c
        .request("GET", "/open", &[("traceparent", &unsampled)], b"")
        .expect("answer");
    assert_eq!(
        upstream_traceparent(&r),
        unsampled,
        "passed through untouched"
    );
    std::thread::sleep(Duration::from_millis(1200));
    let stray: Vec<Seen> = receiver
        .spans()
        .into_iter()
        .filter(|s| ![TRACE, &traces[0], &traces[1]].contains(&s.trace_id.as_str()))
        .collect();
    assert!(
        stray.is_empty(),
        "unsampled requests exported spans: {stray:?}"
    );
    println!(
        "FIGURES traces: {} spans received for 3 sampled requests; the upstream's parent is the gateway's span",
        receiver.spans().len()
    );
}

#[test]
fn a_collector_that_is_down_costs_requests_nothing_and_is_counted() {
    let mut receiver = Receiver::start();
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&up, &redis, &receiver, "1.0"));
    let mut c = gw.client();
    let n = 50;
    for _ in 0..n {
        assert_eq!(c.get("/open").expect("answer").status, 200);
    }
    let exported = |gw: &GatewayGuard| gw.metric("gateway_trace_spans_total{result=\"exported\"}");
    wait_for("the spans exported", Duration::from_secs(10), || {
        (exported(&gw) >= n as f64).then_some(())
    });
    assert!(receiver.spans().len() >= n);
    // The collector goes away: every request is still answered, and what
    // it would have received is counted as dropped.
    receiver.stop();
    let before = exported(&gw);
    for _ in 0..200 {
        assert_eq!(c.get("/open").expect("answer").status, 200);
    }
    let dropped = |gw: &GatewayGuard| {
        gw.metric("gateway_trace_spans_total{result=\"dropped\",reason=\"export_failed\"}")
    };
    wait_for("the lost spans counted", Duration::from_secs(10), || {
        (dropped(&gw) >= 200.0).then_some(())
    });
    assert_eq!(exported(&gw), before, "nothing exported while it is down");
    println!(
        "FIGURES traces collector down: 200 requests answered 200, {} spans counted dropped (export_failed)",
        dropped(&gw)
    );
}
