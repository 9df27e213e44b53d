//! Routing through the real gateway: hosts (exact and wildcard), method
//! fall-through, prefix stripping, per-route timeouts, retries on another
//! server, and request body limits (413), against real upstream processes.

use crate::support;

use std::io::Write;
use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use support::{free_port, Client, GatewayGuard, UpstreamGuard, SERVER_2_THREADS};

/// `curl` a path on the gateway with a Host header; returns the status.
fn with_host(gw: &GatewayGuard, host: &str, path: &str) -> u16 {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .args(["-H", &format!("Host: {host}")])
        .arg(format!("http://{}{path}", gw.addr))
        .output()
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

fn base(upstreams: &str, routes: &str) -> String {
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "local"
retry_after_jitter_ms = 0

{upstreams}
{routes}
"#
    )
}

#[test]
fn hosts_fall_through_and_strip_prefix() {
    let (a, b, c) = (
        UpstreamGuard::start(),
        UpstreamGuard::start(),
        UpstreamGuard::start(),
    );
    let cfg = base(
        &format!(
            "[[upstreams]]\nname = \"a\"\nservers = [\"{}\"]\n\n[[upstreams]]\nname = \"b\"\nservers = [\"{}\"]\n\n[[upstreams]]\nname = \"c\"\nservers = [\"{}\"]\n",
            a.addr, b.addr, c.addr
        ),
        r#"
[[routes]]
name = "exact"
host = "api.example.com"
path_prefix = "/"
upstream = "a"

[[routes]]
name = "tenants"
host = "*.tenants.example.com"
path_prefix = "/reports"
strip_prefix = true
upstream = "b"

[[routes]]
name = "ride-request"
path_prefix = "/api/rides/request"
methods = ["POST"]
upstream = "c"

[[routes]]
name = "catch-all"
path_prefix = "/"
upstream = "c"
"#,
    );
    let gw = GatewayGuard::start(&cfg);
    assert_eq!(with_host(&gw, "api.example.com", "/h1"), 200);
    assert_eq!(
        with_host(&gw, "API.Example.com:8080", "/h2"),
        200,
        "case and port ignored"
    );
    assert_eq!(
        with_host(&gw, "acme.tenants.example.com", "/reports/q3"),
        200
    );
    assert_eq!(with_host(&gw, "tenants.example.com", "/reports/apex"), 200);
    assert_eq!(with_host(&gw, "other.test", "/h3"), 200);
    assert_eq!((a.count("/h1"), a.count("/h2")), (1, 1), "exact host");
    assert_eq!(b.count("/q3"), 1, "wildcard host, prefix stripped");
    assert_eq!(
        c.count("/reports/apex"),
        1,
        "*.tenants.example.com is not the apex"
    );
    assert_eq!(c.count("/h3"), 1, "any other host");
    // A GET to the POST-only prefix falls through to the catch-all (was 405).
    let mut cl = gw.client();
    let r = cl.get("/api/rides/request").expect("GET");
    assert_eq!(r.status, 200);
    assert_eq!(c.count("/api/rides/request"), 1);
    assert_eq!(
        gw.metric("gateway_requests_total{route=\"catch-all\",status=\"200\"}") as u64,
        3,
        "the apex, the other host and the fall-through"
    );
}

#[test]
fn timeouts_retries_and_body_limits() {
    let slow = UpstreamGuard::start_with(&["--service-ms", "400"]);
    let good = UpstreamGuard::start();
    let dead = free_port(); // nothing listens
                            // A server that takes the connection and hangs up without answering.
    let rude = TcpListener::bind("127.0.0.1:0").expect("bind");
    let rude_addr = rude.local_addr().expect("addr");
    let stop = Arc::new(AtomicBool::new(false));
    let rude_thread = {
        let stop = stop.clone();
        rude.set_nonblocking(true).expect("nonblocking");
        std::thread::spawn(move || {
            let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !stop.load(Ordering::Relaxed) && std::time::Instant::now() < until {
                match rude.accept() {
                    Ok((s, _)) => drop(s),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(2)),
                }
            }
        })
    };
    let cfg = base(
        &format!(
            "[[upstreams]]\nname = \"slow\"\nservers = [\"{}\"]\nread_timeout_ms = 5000\n\n\
             [[upstreams]]\nname = \"half-dead\"\nservers = [\"127.0.0.1:{dead}\", \"{}\"]\n\n\
             [[upstreams]]\nname = \"half-rude\"\nservers = [\"{rude_addr}\", \"{}\"]\n",
            slow.addr, good.addr, good.addr
        ),
        r#"
[[routes]]
name = "impatient"
path_prefix = "/impatient"
timeout_ms = 100
upstream = "slow"

[[routes]]
name = "patient"
path_prefix = "/patient"
upstream = "slow"

[[routes]]
name = "connect"
path_prefix = "/connect"
upstream = "half-dead"

[[routes]]
name = "retried"
path_prefix = "/retried"
retries = 1
upstream = "half-rude"

[[routes]]
name = "upload"
path_prefix = "/upload"
max_request_body_bytes = 100
upstream = "half-dead"
limit = { algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.001, scope = "global" }
"#,
    );
    let gw = GatewayGuard::start(&cfg);
    let mut c = gw.client();
    let status = |c: &mut Client, m: &str, p: &str, body: &[u8]| {
        c.request(m, p, &[], body).map(|r| r.status).unwrap_or(0)
    };
    // Per-route timeout: 504 at 100 ms; the upstream's own 5 s elsewhere.
    assert_eq!(status(&mut gw.client(), "GET", "/impatient", b""), 504);
    assert_eq!(status(&mut c, "GET", "/patient", b""), 200);
    // A failed connect is tried again on the other server: no 502 at all.
    let connect: Vec<u16> = (0..10)
        .map(|_| status(&mut gw.client(), "GET", "/connect", b""))
        .collect();
    assert!(connect.iter().all(|&s| s == 200), "{connect:?}");
    // After the request was sent: idempotent methods are retried, POST is not.
    let gets: Vec<u16> = (0..10)
        .map(|_| status(&mut gw.client(), "GET", "/retried", b""))
        .collect();
    assert!(
        gets.iter().all(|&s| s == 200),
        "GET retried on the other server: {gets:?}"
    );
    let posts: Vec<u16> = (0..10)
        .map(|_| status(&mut gw.client(), "POST", "/retried", b"x"))
        .collect();
    assert!(posts.contains(&502), "POST is never retried: {posts:?}");
    assert!(posts.contains(&200), "{posts:?}");
    // Body limits: a declared body over the limit is 413 before any limiter
    // work, and so is a chunked one that grows past it (that one was admitted
    // before its body arrived, so it spends a token of the bucket of 2).
    assert_eq!(
        status(&mut gw.client(), "POST", "/upload", &[b'x'; 200]),
        413
    );
    let chunked = {
        let mut s = std::net::TcpStream::connect(gw.addr).expect("connect");
        let mut req =
            b"POST /upload HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        req.extend_from_slice(b"c8\r\n");
        req.extend_from_slice(&[b'y'; 200]);
        req.extend_from_slice(b"\r\n0\r\n\r\n");
        s.write_all(&req).expect("write");
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .ok();
        let mut buf = [0u8; 256];
        let n = std::io::Read::read(&mut s, &mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    assert!(chunked.starts_with("HTTP/1.1 413"), "{chunked}");
    // A streamed body is cut off once it passes the limit: the upstream may
    // have seen the request start (and then a broken connection), never more.
    let seen = good.count("/upload");
    assert!(
        seen <= 1,
        "only the streamed one can have started upstream ({seen})"
    );
    assert_eq!(status(&mut gw.client(), "POST", "/upload", b"small"), 200);
    assert_eq!(good.count("/upload"), seen + 1);
    assert_eq!(
        status(&mut gw.client(), "POST", "/upload", b"small"),
        429,
        "2 tokens: the streamed one and the small one; the declared 413 spent none"
    );
    stop.store(true, Ordering::Relaxed);
    rude_thread.join().expect("rude server");
}
