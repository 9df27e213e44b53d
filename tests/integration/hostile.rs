//! Every known way around a rate-limiting gateway, through the real binary:
//! each must end in a limit that holds, a clean 4xx, and a gateway still
//! serving.

use crate::support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use support::{raw_exchange, wait_for, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS};

fn config(backend: &str, up: &UpstreamGuard, extra: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}
header_read_timeout_ms = 1000
max_request_headers = 50

[limiter]
retry_after_jitter_ms = 0
local_max_entries = 1000
{backend}

[clients]
trusted_proxies = ["127.0.0.1/32"]

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "login"
path_prefix = "/api/login"
upstream = "up"
limit = {{ algorithm = "sliding_log", limit = 2, window_secs = 3600, scope = "client" }}

[[routes]]
name = "smuggled"
path_prefix = "/smuggled"
upstream = "up"
limit = {{ algorithm = "fixed_window", limit = 1, window_secs = 3600, scope = "global" }}

[[routes]]
name = "rest"
path_prefix = "/"
upstream = "up"

{extra}
"#,
        up.addr
    )
}

const LOCAL: &str = "backend = \"local\"";

#[test]
fn spoofed_addresses_buy_nothing() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    let mut c = gw.client();
    let variants: Vec<Vec<(&str, &str)>> = vec![
        vec![("forwarded", "for=198.51.100.1")],
        vec![
            ("forwarded", "for=198.51.100.2"),
            ("x-forwarded-for", "garbage"),
        ],
        vec![("x-forwarded-for", "fe80::1%eth0")],
        vec![("x-forwarded-for", "127.0.0.1")], // itself trusted: the leftmost hop
        vec![("x-forwarded-for", "unknown, , ,")],
    ];
    let mut statuses = Vec::new();
    for v in &variants {
        statuses.push(
            c.request("GET", "/api/login", v, b"")
                .expect("request")
                .status,
        );
    }
    // All of these are the peer itself (127.0.0.1): one bucket of 2.
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    // Several XFF headers are one list: the rightmost untrusted entry wins.
    let two = [
        ("x-forwarded-for", "203.0.113.250"),
        ("x-forwarded-for", "198.51.100.9"),
    ];
    let got: Vec<u16> = (0..3)
        .map(|_| c.request("GET", "/api/login", &two, b"").expect("r").status)
        .collect();
    assert_eq!(got, [200, 200, 429]);
    let mapped = [("x-forwarded-for", "::ffff:198.51.100.9")];
    assert_eq!(
        c.request("GET", "/api/login", &mapped, b"")
            .expect("r")
            .status,
        429,
        "mapped = IPv4"
    );
}

#[test]
fn path_tricks_count_against_the_same_route_or_get_400() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    let mut c = gw.client();
    assert_eq!(c.get("/api/login").expect("r").status, 200);
    assert_eq!(c.get("/api/login").expect("r").status, 200);
    for trick in [
        "/api/login",
        "//api/login",
        "/api/./login",
        "/api/x/../login",
        "/./api//login/",
        "/api/%6Cogin",
        "/%61pi/login",
        "/api/login;jsessionid=1",
        "/api/login?x=1",
        "/api/login/../login",
        "/api/login%20",
        "/api/loginx",
    ] {
        let r = c.get(trick).expect("request");
        assert_eq!(
            r.status,
            429,
            "{trick} must count against the login route: {}",
            r.text()
        );
    }
    for refused in [
        "/api%2Flogin",
        "/api%2flogin",
        "/api/%2e%2e%2flogin",
        "/api\\login",
        "/api/login%00",
        "/api/%",
    ] {
        let r = c.get(refused).expect("request");
        assert_eq!(r.status, 400, "{refused}");
    }
    // Case differs: a different path for the router and for the upstream alike.
    let r = c.get("/API/login").expect("request");
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["path"],
        "/API/login",
        "the upstream sees exactly what was routed"
    );
    let stats = up.stats();
    let paths = stats["paths"].as_object().expect("paths");
    let login_like: u64 = paths
        .iter()
        .filter(|(p, _)| p.to_ascii_lowercase().contains("login") && p.as_str() != "/API/login")
        .map(|(_, n)| n.as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        login_like, 2,
        "only the two admitted login requests reached the upstream: {stats}"
    );
}

#[test]
fn random_keys_create_no_state_anywhere() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let extra = r#"
[plans.free]
capacity = 10
refill_per_sec = 1

[[api_keys]]
id = "real"
key = "real-key-0000"
plan = "free"
"#;
    let cfg = config(
        &format!(
            "backend = \"redis\"\n\n[redis]\nurls = [\"{}\"]",
            redis.url()
        ),
        &up,
        extra,
    );
    let gw = GatewayGuard::start(&cfg);
    let before = redis.keys();
    let mut c = gw.client();
    for i in 0..500 {
        let near = format!("real-key-000{}", i % 10); // near misses and a far one
        let key = if i % 2 == 0 {
            near
        } else {
            format!("{i:x}-far-away")
        };
        let key = if key == "real-key-0000" {
            "real-key-000x".to_string()
        } else {
            key
        };
        let r = c
            .request("GET", "/x", &[("x-api-key", &key)], b"")
            .expect("request");
        assert_eq!(r.status, 401);
    }
    let after = redis.keys();
    assert!(
        after.is_subset(&before),
        "no Redis key for unknown API keys: {after:?} vs {before:?}"
    );
    assert_eq!(up.total(), 0);
}

#[test]
fn a_flood_of_addresses_stays_under_the_cap_without_freeing_busy_clients() {
    let up = UpstreamGuard::start();
    let extra = r#"
[tiers.ip]
algorithm = "token_bucket"
capacity = 3
refill_per_sec = 0.001
"#;
    let gw = GatewayGuard::start(&config(LOCAL, &up, extra));
    let mut c = gw.client();
    let busy = [("x-forwarded-for", "198.51.100.200")];
    let drained: Vec<u16> = (0..4)
        .map(|_| c.request("GET", "/x", &busy, b"").expect("r").status)
        .collect();
    assert_eq!(drained, [200, 200, 200, 429]);
    for i in 0..5000u32 {
        let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
        let r = c
            .request("GET", "/x", &[("x-forwarded-for", &ip)], b"")
            .expect("request");
        assert_eq!(r.status, 200);
        if i % 1000 == 0 {
            // The busy client is still drained: eviction takes idle state first.
            assert_eq!(
                c.request("GET", "/x", &busy, b"").expect("r").status,
                429,
                "after {i} addresses"
            );
        }
    }
    wait_for("the entries gauge", Duration::from_secs(5), || {
        let n = gw.metric("gateway_limiter_local_entries");
        (n > 0.0).then_some(n)
    });
    let n = gw.metric("gateway_limiter_local_entries");
    assert!(n <= 1000.0, "local_max_entries = 1000 holds: {n}");
    eprintln!("FIGURES cardinality: 5001 addresses, local entries {n} (cap 1000)");
}

#[test]
fn redis_keys_always_expire() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let extra = r#"
[tiers.ip]
algorithm = "sliding_window"
limit = 100
window_secs = 60
"#;
    let cfg = config(
        &format!(
            "backend = \"redis\"\n\n[redis]\nurls = [\"{}\"]",
            redis.url()
        ),
        &up,
        extra,
    );
    let gw = GatewayGuard::start(&cfg);
    let mut c = gw.client();
    for i in 0..300 {
        let ip = format!("10.9.{}.{}", i / 256, i % 256);
        c.request("POST", "/api/login", &[("x-forwarded-for", &ip)], b"{}")
            .expect("request");
    }
    let keys = redis.dbsize();
    assert!(keys >= 600, "ip + login buckets: {keys}");
    let script = "local n = 0 for _, k in ipairs(redis.call('KEYS', '*')) do if redis.call('PTTL', k) < 0 then n = n + 1 end end return n";
    assert_eq!(
        redis.cmd(&["EVAL", script, "0"]).trim(),
        "0",
        "every key has a TTL"
    );
}

#[test]
fn smuggling_forms_are_refused_or_framed_unambiguously() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    let attempts: [&[u8]; 5] = [
        // CL + TE: chunked wins (or refused); the smuggled GET is its own, limited request.
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
        // TE + CL, reversed order.
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 40\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
        // Duplicate, conflicting Content-Length.
        b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 37\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
        // Obsolete line folding.
        b"GET /x HTTP/1.1\r\nHost: a\r\nX-Folded: a\r\n b\r\n\r\n",
        // HTTP/1.0 with Transfer-Encoding.
        b"POST /x HTTP/1.0\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    ];
    for (i, a) in attempts.iter().enumerate() {
        for round in 0..3 {
            let out = raw_exchange(gw.addr, a, Duration::from_millis(800));
            if round == 0 {
                let statuses: Vec<&str> = out.lines().filter(|l| l.starts_with("HTTP/")).collect();
                eprintln!("FIGURES smuggling attempt {i}: {statuses:?}");
            }
            assert!(
                out.starts_with("HTTP/1.1 200")
                    || out.starts_with("HTTP/1.1 400")
                    || out.starts_with("HTTP/1.0 200")
                    || out.is_empty(),
                "attempt {i}: {out:?}"
            );
        }
    }
    // Whatever got through went through the limiter: /smuggled admits one request
    // ever, and the upstream saw exactly what the gateway admitted there.
    let admitted = gw.metric("gateway_requests_total{route=\"smuggled\",status=\"200\"}");
    assert!(admitted <= 1.0);
    assert_eq!(
        up.count("/smuggled") as f64,
        admitted,
        "no smuggled request reached the upstream uncounted"
    );
    assert_eq!(
        gw.client().get("/x").expect("request").status,
        200,
        "still serving"
    );
}

#[test]
fn oversized_headers_get_431() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    let mut c = gw.client();
    let big = "a".repeat(70_000);
    let r = c
        .request("GET", "/x", &[("x-big", &big)], b"")
        .expect("request");
    assert_eq!(r.status, 431);
    let many: Vec<(String, String)> = (0..60)
        .map(|i| (format!("x-h{i}"), "v".to_string()))
        .collect();
    let many: Vec<(&str, &str)> = many.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    let r = gw
        .client()
        .request("GET", "/x", &many, b"")
        .expect("request");
    assert_eq!(r.status, 431, "max_request_headers = 50");
    assert_eq!(up.total(), 0);
    assert_eq!(gw.client().get("/x").expect("request").status, 200);
}

#[test]
fn a_slowloris_is_cut_off_while_others_are_served() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    let mut slow = TcpStream::connect(gw.addr).expect("connect");
    slow.set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    slow.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\n")
        .expect("write");
    let started = Instant::now();
    let mut closed_after = None;
    let mut served = 0;
    // Trickle a header byte every 100 ms: each read is quick, the whole header never ends.
    for _ in 0..100 {
        if slow.write_all(b"X").is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        let mut buf = [0u8; 64];
        match slow.read(&mut buf) {
            Ok(0) => {
                closed_after = Some(started.elapsed());
                break;
            }
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => {
                closed_after = Some(started.elapsed());
                break;
            }
        }
        if gw.client().get("/x").expect("others are served").status == 200 {
            served += 1;
        }
    }
    let closed_after = closed_after.expect("the slow connection was closed");
    eprintln!("FIGURES slowloris: closed after {closed_after:?} (deadline 1000 ms); {served} other requests served meanwhile");
    assert!(
        closed_after < Duration::from_secs(5),
        "closed near the 1 s deadline: {closed_after:?}"
    );
    assert!(served > 0);
}

#[test]
fn abrupt_disconnects_leave_the_gateway_serving() {
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(LOCAL, &up, ""));
    for i in 0..50 {
        let mut s = TcpStream::connect(gw.addr).expect("connect");
        let partial: &[u8] = match i % 3 {
            0 => b"GET /x HTTP/1.1\r\nHo",
            1 => b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\npartial body",
            _ => b"GET /x HTTP/1.1\r\nHost: a\r\nx-mock-delay-ms: 200\r\n\r\n",
        };
        let _ = s.write_all(partial);
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    assert_eq!(gw.client().get("/x").expect("request").status, 200);
}
