//! Proxying through the real gateway binary: keep-alive, routing answers,
//! path normalisation, upstream failures, health checks, graceful shutdown.

use crate::support;

use std::time::Duration;

use support::{free_port, raw_exchange, wait_for, Client, GatewayGuard, UpstreamGuard};

/// A local-backend config with no limits, one route per upstream.
fn config(servers: &str, extra_upstream: &str, routes: &str) -> String {
    format!(
        r#"
[server]
listen = ["{{listen}}"]
admin_listen = "{{admin}}"
threads = 2
grace_period_secs = 3

[limiter]
backend = "local"

[clients]
trusted_proxies = ["127.0.0.1/32"]

[[upstreams]]
name = "main"
servers = [{servers}]
connect_timeout_ms = 300
read_timeout_ms = 500
{extra_upstream}

{routes}
"#
    )
}

const ROUTES: &str = r#"
[[routes]]
name = "rides"
path_prefix = "/api/rides"
methods = ["POST", "GET"]
upstream = "main"

[[routes]]
name = "ride-request"
path_prefix = "/api/rides/request"
methods = ["POST"]
upstream = "main"
"#;

#[test]
fn proxies_with_keep_alive_and_sets_forwarding_headers() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&format!("\"{}\"", up.addr), "", ROUTES));
    let mut c = gw.client();
    for i in 0..5 {
        let r = c
            .request(
                "GET",
                &format!("/api/rides/list?page={i}"),
                &[("x-request-id", "abc-123")],
                b"",
            )
            .expect("request on the same connection");
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        let echo = r.json();
        assert_eq!(echo["path"], "/api/rides/list");
        assert_eq!(echo["query"], format!("page={i}"));
        assert_eq!(
            echo["x_request_id"], "abc-123",
            "an incoming X-Request-Id is kept"
        );
        assert_eq!(echo["host"], "test.local", "Host is preserved");
        assert_eq!(
            echo["x_forwarded_for"], "127.0.0.1",
            "the peer is appended to X-Forwarded-For"
        );
        assert_eq!(r.header("x-request-id"), Some("abc-123"));
    }
    // A generated request id, and XFF appended after what the client sent.
    let r = c
        .request(
            "GET",
            "/api/rides/x",
            &[("x-forwarded-for", "198.51.100.7")],
            b"",
        )
        .expect("request");
    let echo = r.json();
    assert_eq!(echo["x_forwarded_for"], "198.51.100.7, 127.0.0.1");
    let id = echo["x_request_id"].as_str().expect("request id");
    assert_eq!(id.len(), 32, "generated id {id}");
    assert_eq!(up.count("/api/rides/list"), 5);
}

#[test]
fn answers_404_405_400_without_reaching_the_upstream() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&format!("\"{}\"", up.addr), "", ROUTES));
    let mut c = gw.client();

    let r = c.get("/nothing/here").expect("request");
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"], "not_found");

    let r = c
        .request("DELETE", "/api/rides/request", &[], b"")
        .expect("request");
    assert_eq!(r.status, 405, "{}", r.text());
    assert_eq!(
        r.header("allow"),
        Some("GET, POST"),
        "every method some route of this path takes"
    );

    for bad in [
        "/api/rides/a%2Fb",
        "/api/rides/%5c",
        "/api/rides/%00",
        "/api/rides/%zz",
        "/api/rides/%4",
    ] {
        let r = c.get(bad).expect("request");
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"], "bad_request", "{bad}");
    }
    // The connection survives every refusal.
    let r = c.get("/api/rides/ok").expect("request");
    assert_eq!(r.status, 200);
    // A GET to the POST-only longer prefix falls through to the shorter
    // route that takes GET (it used to be a 405).
    let r = c.get("/api/rides/request").expect("request");
    assert_eq!(r.status, 200);
    let stats = up.stats();
    assert_eq!(
        stats["total"], 2,
        "only the admitted requests reached the upstream: {stats}"
    );
    // Refusals are counted under the route the request matched (the 405
    // under the route its path matched), not "(none)"; 404 has no route.
    assert_eq!(
        gw.metric("gateway_requests_total{route=\"ride-request\",status=\"405\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("gateway_requests_total{route=\"(none)\",status=\"404\"}"),
        1.0
    );
}

#[test]
fn the_upstream_receives_exactly_the_normalised_path() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&format!("\"{}\"", up.addr), "", ROUTES));
    let mut c = gw.client();
    let table = [
        ("/api/rides//list", "/api/rides/list"),
        ("/api/rides/./list", "/api/rides/list"),
        ("/api/x/../rides/list", "/api/rides/list"),
        ("/api/%72ides/list", "/api/rides/list"),
        ("/api/rides/list/", "/api/rides/list/"),
        ("/../../api/rides/list", "/api/rides/list"),
        ("/api/rides/a%20b", "/api/rides/a%20b"),
    ];
    for (sent, seen) in table {
        let r = c.get(sent).expect("request");
        assert_eq!(r.status, 200, "{sent}: {}", r.text());
        assert_eq!(r.json()["path"], seen, "sent {sent}");
    }
    // A path that normalises outside every route is 404, not forwarded.
    let r = c.get("/api/rides/../../etc/passwd").expect("request");
    assert_eq!(r.status, 404);
    assert_eq!(up.count("/etc/passwd"), 0);
}

#[test]
fn dead_upstream_is_502_and_slow_upstream_is_504() {
    let dead = format!("127.0.0.1:{}", free_port());
    let slow = UpstreamGuard::start();
    let routes = r#"
[[routes]]
name = "dead"
path_prefix = "/dead"
upstream = "main"

[[routes]]
name = "slow"
path_prefix = "/slow"
upstream = "slow"
"#;
    let extra = format!(
        "\n[[upstreams]]\nname = \"slow\"\nservers = [\"{}\"]\nread_timeout_ms = 300\n",
        slow.addr
    );
    let gw = GatewayGuard::start(&config(&format!("\"{dead}\""), &extra, routes));
    let r = gw.client().get("/dead/x").expect("request");
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(r.json()["error"], "bad_gateway");

    let r = gw
        .client()
        .request("GET", "/slow/x", &[("x-mock-delay-ms", "2000")], b"")
        .expect("request");
    assert_eq!(r.status, 504, "{}", r.text());
    assert_eq!(r.json()["error"], "gateway_timeout");
    let r = gw.client().get("/slow/fast").expect("request");
    assert_eq!(
        r.status, 200,
        "the slow upstream still serves fast requests"
    );
}

#[test]
fn health_checks_eject_a_dead_server() {
    let a = UpstreamGuard::start();
    let mut b = UpstreamGuard::start();
    let routes = "[[routes]]\nname = \"all\"\npath_prefix = \"/\"\nupstream = \"main\"\n";
    let cfg = config(&format!("\"{}\", \"{}\"", a.addr, b.addr), "", routes).replace(
        "read_timeout_ms = 500",
        "read_timeout_ms = 500\nhealth_check_path = \"/healthz\"",
    );
    let gw = GatewayGuard::start(&cfg);
    // Both servers take turns while healthy.
    for _ in 0..10 {
        assert_eq!(gw.client().get("/x").expect("request").status, 200);
    }
    assert!(
        a.count("/x") > 0 && b.count("/x") > 0,
        "round-robin uses both"
    );

    b.kill();
    // Once the health check has noticed, every request succeeds on `a`.
    wait_for(
        "the dead server to be ejected",
        Duration::from_secs(10),
        || {
            let ok = (0..6).all(|_| {
                gw.client()
                    .get("/y")
                    .map(|r| r.status == 200)
                    .unwrap_or(false)
            });
            ok.then_some(())
        },
    );
    let before = a.count("/z");
    for _ in 0..20 {
        let r = gw.client().get("/z").expect("request");
        assert_eq!(r.status, 200, "{}", r.text());
    }
    assert_eq!(a.count("/z") - before, 20);
}

#[test]
fn sigterm_drains_the_request_in_flight() {
    let up = UpstreamGuard::start();
    let mut gw = GatewayGuard::start(&config(&format!("\"{}\"", up.addr), "", ROUTES));
    let addr = gw.addr;
    let in_flight = std::thread::spawn(move || {
        let mut c = Client::connect(addr).expect("connect");
        c.request("GET", "/api/rides/slow", &[("x-mock-delay-ms", "400")], b"")
    });
    wait_for(
        "the request to reach the upstream",
        Duration::from_secs(5),
        || (up.count("/api/rides/slow") == 1).then_some(()),
    );
    let (status, took) = gw.terminate(Duration::from_secs(10));
    let r = in_flight
        .join()
        .expect("thread")
        .expect("in-flight request completes");
    assert_eq!(
        r.status,
        200,
        "the in-flight request finished: {}",
        r.text()
    );
    assert!(status.is_some(), "the gateway exited by itself");
    // grace_period_secs = 3: it exits within it (plus process start-up slack).
    assert!(took < Duration::from_secs(5), "exited after {took:?}");
    // And stopped accepting.
    assert!(Client::connect(addr)
        .and_then(|mut c| c.get("/api/rides/x"))
        .is_err());
}

#[test]
fn malformed_requests_are_refused_and_the_gateway_keeps_serving() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&format!("\"{}\"", up.addr), "", ROUTES));
    let out = raw_exchange(
        gw.addr,
        b"GET /api/rides/x HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        Duration::from_secs(2),
    );
    assert!(
        out.starts_with("HTTP/1.1 400"),
        "duplicate Content-Length: {out:?}"
    );
    let out = raw_exchange(gw.addr, b"NOT-HTTP\r\n\r\n", Duration::from_secs(2));
    assert!(
        out.is_empty() || out.starts_with("HTTP/1.1 400"),
        "garbage: {out:?}"
    );
    assert_eq!(
        gw.client().get("/api/rides/x").expect("request").status,
        200
    );
    assert_eq!(up.total(), 1);
}

/// A listen address already taken is a start-up error naming the key, not a
/// gateway retrying the bind every second.
#[test]
fn a_taken_port_is_a_clear_start_up_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    let cfg = config("\"127.0.0.1:9\"", "", ROUTES)
        .replace("{listen}", &addr.to_string())
        .replace("admin_listen = \"{admin}\"\n", "");
    std::fs::write(&path, cfg).expect("config");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .expect("gateway");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("server.listen: cannot listen on {addr}")),
        "{err}"
    );
}
