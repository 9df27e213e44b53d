//! Routes charged by the answer (`charge`), through the real gateway and
//! a mock LLM upstream (`mock-upstream`'s `/chat/completions`): each
//! request admitted on its estimate, then charged exactly what the
//! upstream reported, streamed or not; the faults table (a cut stream, no
//! usage, not JSON, a negative count, 1e30, a 5xx) charged as the README
//! says and counted; a request with no estimate refused before any bucket
//! is touched.

use crate::support;

use std::time::Duration;

use support::http::Client;
use support::{wait_for, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

const CHAT: &str = "/v1/chat/completions";

fn config(up: &UpstreamGuard, redis: &RedisGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["{redis}"]

[plans.llm]
capacity = 1000
refill_per_sec = 100
quotas = [{{ limit = 10000, period = "day" }}, {{ limit = 5000000, period = "month", cost = "response" }}]

[[api_keys]]
id = "tenant-a"
key = "tenant-a-secret"
plan = "llm"

[[upstreams]]
name = "llm"
servers = ["{up}"]

[[routes]]
name = "chat"
path_prefix = "{CHAT}"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["sse:usage.total_tokens", "json:usage.total_tokens", "header:x-usage-tokens"], estimate = "json:max_tokens", max = 32768, charge_failed = false }}
limit = {{ algorithm = "token_bucket", capacity = 200000, refill_per_sec = 3333, scope = "client", cost = "response" }}

[[routes]]
name = "chat-default"
path_prefix = "/v2/chat/completions"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["json:usage.total_tokens"], estimate = "json:max_tokens", default_estimate = 64, max = 1000 }}
"#,
        up = up.addr,
        redis = redis.url(),
    )
}

fn chat(c: &mut Client, path: &str, body: &str, headers: &[(&str, &str)]) -> u16 {
    let mut h = vec![
        ("x-api-key", "tenant-a-secret"),
        ("content-type", "application/json"),
    ];
    h.extend_from_slice(headers);
    c.request("POST", path, &h, body.as_bytes())
        .map(|r| r.status)
        .unwrap_or(0)
}

/// The month's charged units as `/limits` tells them, once they stop
/// moving (settlements are sent every 100 ms).
fn settled_used(g: &GatewayGuard, want: u64) -> u64 {
    let mut last = 0;
    wait_for(
        "the settlements to reach Redis",
        Duration::from_secs(10),
        || {
            last = g.quota_used("tenant-a", "quota-month");
            (last == want).then_some(())
        },
    );
    last
}

#[test]
fn charged_units_are_what_the_upstream_reported_and_faults_as_the_table_says() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &redis));
    let mut c = g.client();

    // Streamed and not, tokens up to max_tokens (random), estimates of
    // every size: charged what the upstream said, not the estimates.
    let mut sent = 0;
    for i in 0..60u64 {
        let max = 1 + (i * 37) % 900;
        let stream = i % 2 == 0;
        let body = format!(r#"{{"model":"m","max_tokens":{max},"stream":{stream}}}"#);
        assert_eq!(chat(&mut c, CHAT, &body, &[]), 200, "request {i}");
        sent += 1;
    }
    let reported = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    assert!(reported > 0 && reported < sent * 900, "reported {reported}");
    assert_eq!(
        settled_used(&g, reported),
        reported,
        "used is what the upstream reported"
    );

    // The faults table, each on an estimate of 100.
    let body = r#"{"max_tokens":100,"stream":true}"#;
    let json_body = r#"{"max_tokens":100}"#;
    let before = reported;
    for (fault, body, status) in [
        ("cut", body, 200),
        ("no_usage", json_body, 200),
        ("not_json", json_body, 200),
        ("negative", json_body, 200),
        ("huge", json_body, 200),
        ("status_500", json_body, 500),
        ("header", json_body, 200),
    ] {
        let mut c = g.client();
        let got = chat(
            &mut c,
            CHAT,
            body,
            &[("x-mock-fault", fault), ("x-mock-tokens", "7")],
        );
        // A cut stream reaches the client cut: no whole answer.
        if fault != "cut" {
            assert_eq!(got, status, "{fault}");
        }
    }
    let reported = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    assert_eq!(reported, before + 7, "only the header case reports usage");
    // cut: refunded (an upstream failure); no usage, not JSON, negative,
    // 1e30: the estimate; a 5xx: refunded; the header: its 7.
    let want = before + 4 * 100 + 7;
    assert_eq!(settled_used(&g, want), want);
    let m = g.metrics();
    for (reason, n) in [
        ("read", 61.0),
        ("failed", 2.0),
        ("missing", 1.0),
        ("not_json", 1.0),
        ("negative", 1.0),
        ("out_of_range", 1.0),
    ] {
        let name = format!("gateway_charged_requests_total{{reason=\"{reason}\"}}");
        assert_eq!(
            support::series(&m, &name).and_then(|v| v.parse::<f64>().ok()),
            Some(n),
            "{name}"
        );
    }
    // The gateway kept serving through every fault.
    assert_eq!(chat(&mut g.client(), CHAT, json_body, &[]), 200);
}

#[test]
fn a_request_with_no_estimate_is_refused_before_any_bucket() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &redis));
    let mut c = g.client();
    let r = c
        .request(
            "POST",
            CHAT,
            &[("x-api-key", "tenant-a-secret")],
            br#"{"model":"m"}"#,
        )
        .expect("answer");
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("max_tokens"),
        "the 400 names the field: {}",
        r.text()
    );
    assert_eq!(up.count(CHAT), 0, "the upstream saw nothing");
    // With a default estimate the same request is admitted on it.
    assert_eq!(
        chat(&mut c, "/v2/chat/completions", r#"{"model":"m"}"#, &[]),
        200
    );
    assert_eq!(
        g.quota_used("tenant-a", "quota-day"),
        1,
        "requests still count one each"
    );
}
