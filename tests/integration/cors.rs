//! CORS through the real gateway, as a browser speaks it: preflights are
//! answered by the gateway (never the upstream) and spend no tokens unless
//! the policy says so; the gateway's own refusals (429, 401, 404) carry the
//! headers that let browser code read them, Retry-After exposed; an origin
//! the policy does not name gets nothing to read.

use crate::support;

use support::http::Response;
use support::{GatewayGuard, UpstreamGuard, SERVER};

const APP: &str = "https://app.example.com";

fn config(up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "local"
retry_after_jitter_ms = 0

[plans.web]
capacity = 1000
refill_per_sec = 1

[[api_keys]]
id = "web"
key = "web-secret-key-1"
plan = "web"

[[upstreams]]
name = "up"
servers = ["{addr}"]

# Every route without a policy of its own.
[cors]
allow_origins = ["https://*.example.org"]

# POST only, 2 per client: the preflight (OPTIONS) is the gateway's.
[[routes]]
name = "rides"
path_prefix = "/api/rides/request"
methods = ["POST"]
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.001 }}
cors = {{ allow_origins = ["{APP}"], allow_headers = ["x-api-key", "content-type"], allow_credentials = true, max_age_secs = 600 }}

# Preflights charged: they spend the 2 tokens like requests.
[[routes]]
name = "charged"
path_prefix = "/api/charged"
upstream = "up"
limit = {{ algorithm = "fixed_window", limit = 2, window_secs = 3600 }}
cors = {{ allow_origins = ["*"], charge_preflight = true }}

# A key is required, but never of a preflight (browsers send none).
[[routes]]
name = "keyed"
path_prefix = "/api/keyed"
upstream = "up"
require_api_key = true
cors = {{ allow_origins = ["{APP}"], allow_headers = ["x-api-key"], expose_headers = ["x-trace-id"] }}

[[routes]]
name = "open"
path_prefix = "/open"
upstream = "up"
"#,
        addr = up.addr
    )
}

fn send(gw: &GatewayGuard, method: &str, path: &str, headers: &[(&str, &str)]) -> Response {
    gw.client()
        .request(method, path, headers, b"")
        .expect("request")
}

fn preflight(gw: &GatewayGuard, path: &str, origin: &str, method: &str, headers: &str) -> Response {
    let mut h = vec![
        ("origin", origin),
        ("access-control-request-method", method),
    ];
    if !headers.is_empty() {
        h.push(("access-control-request-headers", headers));
    }
    send(gw, "OPTIONS", path, &h)
}

fn exposed(r: &Response) -> Vec<String> {
    r.header("access-control-expose-headers")
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .collect()
}

#[test]
fn preflights_are_answered_free_and_refusals_are_readable_by_the_page() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&up));
    let path = "/api/rides/request";

    // The preflight a page's fetch(POST, x-api-key, JSON) sends: 204 from
    // the gateway, saying what the page may do; asked five times, free.
    for _ in 0..5 {
        let r = preflight(&gw, path, APP, "POST", "X-API-Key, Content-Type");
        assert_eq!(r.status, 204, "{:?} {}", r.headers, r.text());
        assert_eq!(r.header("access-control-allow-origin"), Some(APP));
        assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
        assert_eq!(r.header("access-control-allow-methods"), Some("POST"));
        assert_eq!(
            r.header("access-control-allow-headers"),
            Some("x-api-key, content-type")
        );
        assert_eq!(r.header("access-control-max-age"), Some("600"));
        assert!(r.header("vary").unwrap_or_default().contains("origin"));
        assert_eq!(r.header("content-length"), None, "a 204 has no body");
    }
    assert_eq!(up.total(), 0, "no preflight reached the upstream");

    // Then the requests: 2 admitted of a bucket of 2 (preflights spent
    // nothing), the third a 429 the page can read, Retry-After and all.
    let post = |gw: &GatewayGuard| send(gw, "POST", path, &[("origin", APP)]);
    for i in 0..2 {
        let r = post(&gw);
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        assert_eq!(r.header("access-control-allow-origin"), Some(APP));
        assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
        assert!(exposed(&r).contains(&"x-ratelimit-remaining".to_string()));
    }
    let r = post(&gw);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("access-control-allow-origin"), Some(APP));
    assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
    let e = exposed(&r);
    for h in [
        "retry-after",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit-policy",
        "ratelimit",
        "x-request-id",
    ] {
        assert!(e.contains(&h.to_string()), "{h} not exposed: {e:?}");
    }
    assert_eq!(up.count(path), 2, "the upstream saw exactly the admitted");
    println!("FIGURES cors: 5 preflights answered by the gateway (upstream 0); then 2 of 3 POSTs admitted on a bucket of 2 (bound 2), the 429 readable (ACAO, Retry-After exposed)");

    // An origin the policy does not name: nothing to read (the browser
    // blocks it), and still no token spent by its preflight.
    let r = preflight(&gw, path, "https://evil.example", "POST", "");
    assert_eq!(r.status, 403);
    assert_eq!(r.header("access-control-allow-origin"), None);
    assert!(r.text().contains("cors_rejected"), "{}", r.text());
    let r = send(&gw, "POST", path, &[("origin", "https://evil.example")]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("access-control-allow-origin"), None);
    assert_eq!(
        r.header("vary"),
        Some("origin"),
        "caches keep origins apart"
    );
    // A method the route does not take, a header the policy does not list.
    let r = preflight(&gw, path, APP, "DELETE", "");
    assert_eq!(r.status, 403);
    assert_eq!(
        r.header("access-control-allow-origin"),
        None,
        "a refused preflight lets the browser read nothing"
    );
    assert!(
        r.text().contains("method DELETE is not allowed"),
        "{}",
        r.text()
    );
    let r = preflight(&gw, path, APP, "POST", "x-secret-thing");
    assert_eq!(r.status, 403);
    assert!(
        r.text().contains("allowed: x-api-key, content-type"),
        "{}",
        r.text()
    );
    // OPTIONS that is not a preflight is the request it is: 405 here.
    let r = send(&gw, "OPTIONS", path, &[("origin", APP)]);
    assert_eq!(r.status, 405);

    // Charged preflights spend the route's tokens: 2 pass, the third and
    // the request after it are refused; none reached the upstream.
    let charged: Vec<u16> = (0..3)
        .map(|_| preflight(&gw, "/api/charged", "https://any.example", "GET", "").status)
        .collect();
    assert_eq!(charged, [204, 204, 429]);
    let r = send(
        &gw,
        "GET",
        "/api/charged",
        &[("origin", "https://any.example")],
    );
    assert_eq!(r.status, 429);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));
    assert!(exposed(&r).contains(&"retry-after".to_string()));
    assert_eq!(up.count("/api/charged"), 0);
    // A "*" answer is the same with no Origin at all (a cache may serve it to a page).
    let r = send(&gw, "GET", "/api/charged", &[]);
    assert_eq!(r.header("access-control-allow-origin"), Some("*"));

    // A key-required route: the preflight needs none; the 401 of a wrong
    // key is readable; the policy's extra exposed header is added.
    let r = preflight(&gw, "/api/keyed/x", APP, "GET", "x-api-key");
    assert_eq!(r.status, 204, "{}", r.text());
    let r = send(
        &gw,
        "GET",
        "/api/keyed/x",
        &[("origin", APP), ("x-api-key", "wrong-key")],
    );
    assert_eq!(r.status, 401);
    assert_eq!(r.header("access-control-allow-origin"), Some(APP));
    assert!(exposed(&r).contains(&"x-trace-id".to_string()));
    let r = send(
        &gw,
        "GET",
        "/api/keyed/x",
        &[("origin", APP), ("x-api-key", "web-secret-key-1")],
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), Some(APP));

    // [cors] serves the routes without their own, and the refusals of
    // requests that matched no route.
    let sub = "https://shop.example.org";
    let r = send(&gw, "GET", "/open", &[("origin", sub)]);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("access-control-allow-origin"), Some(sub));
    let r = preflight(&gw, "/open", sub, "PUT", "");
    assert_eq!(r.status, 204);
    assert_eq!(
        r.header("access-control-allow-methods"),
        Some("GET, HEAD, POST, PUT, PATCH, DELETE")
    );
    let r = send(&gw, "GET", "/nowhere", &[("origin", sub)]);
    assert_eq!(r.status, 404);
    assert_eq!(r.header("access-control-allow-origin"), Some(sub));
    let r = send(&gw, "GET", "/open", &[("origin", "https://example.org")]);
    assert_eq!(r.header("access-control-allow-origin"), None, "apex");

    // Preflights are counted as what they were answered: 204 under the route.
    let m = gw.metrics();
    assert!(
        m.lines().any(|l| l.starts_with("gateway_requests_total")
            && l.contains("route=\"rides\"")
            && l.contains("status=\"204\"")
            && l.ends_with(" 5")),
        "{m}"
    );
}

/// A route with a CORS policy answers every preflight for its prefix:
/// one from an origin it does not name, or announcing a method it does not
/// take, is refused there and counted under it (with its client), never
/// passed to the catch-all behind it and its upstream.
#[test]
fn a_cors_route_answers_every_preflight_for_its_prefix() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER}

[limiter]
backend = "local"

[[upstreams]]
name = "up"
servers = ["{addr}"]

[[routes]]
name = "tenant"
path_prefix = "/tenant"
methods = ["GET", "POST"]
upstream = "up"
cors = {{ allow_origins = ["{APP}"] }}

[[routes]]
name = "everything-else"
path_prefix = "/"
upstream = "up"
"#,
        addr = up.addr
    ));
    let counted = |route: &str, status: u16| {
        gw.metric(&format!(
            "gateway_requests_total{{route=\"{route}\",status=\"{status}\"}}"
        ))
    };
    let r = preflight(&gw, "/tenant/a", "https://evil.example", "GET", "");
    assert_eq!(r.status, 403, "{}", r.text());
    // DELETE is the catch-all's, but /tenant's policy answers for /tenant.
    let r = preflight(&gw, "/tenant/a", APP, "DELETE", "");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(
        r.text().contains("method DELETE is not allowed"),
        "{}",
        r.text()
    );
    assert_eq!(r.header("access-control-allow-origin"), None);
    assert_eq!(preflight(&gw, "/tenant/a", APP, "POST", "").status, 204);
    assert_eq!(up.total(), 0, "no preflight reached the upstream");
    assert_eq!(counted("tenant", 403), 2.0);
    assert_eq!(counted("tenant", 204), 1.0);
    assert_eq!(counted("everything-else", 403), 0.0);
    let log = gw.log();
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("status=403")).collect();
    assert_eq!(refused.len(), 2, "{log}");
    for line in refused {
        assert!(
            line.contains("route=\"tenant\"") && line.contains("client=127.0.0.1"),
            "{line}"
        );
    }
    // A path whose own route has no policy: the preflight is the request
    // it is, for the catch-all's upstream.
    assert_eq!(preflight(&gw, "/other", APP, "DELETE", "").status, 200);
    assert_eq!(up.count("/other"), 1);
}
