//! CORS proven with a real browser: headless Chromium loads a page from one
//! loopback origin and, from its script, POSTs to the gateway on another
//! (a custom header and a JSON body, so the browser sends a real preflight
//! first). The route admits N; the page reads the N+1th answer, a 429, with
//! its Retry-After and X-RateLimit-Remaining, as browser code can only when
//! the gateway's CORS headers allow it. A route whose policy does not name
//! the page's origin makes the browser's fetch throw.
//!
//! Chromium is Debian's `chromium` package, installed by scripts/setup.sh;
//! without it this test fails (it does not skip).

use crate::support;

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{GatewayGuard, UpstreamGuard, SERVER};
use tempfile::TempDir;

/// Requests the route admits (its token bucket's capacity).
const N: usize = 3;
const API_KEY: &str = "browser-secret-key-1";
const RIDES: &str = "/api/rides/request";
const PAGE: &str = include_str!("../browser/cors_429.html");
/// How long Chromium may take to load the page, run it and dump the DOM.
const BROWSER_TIMEOUT: Duration = Duration::from_secs(90);
const NO_CHROMIUM: &str = "chromium is not installed (no `chromium` on PATH): run \
    scripts/setup.sh, which installs Debian's chromium package (scripts/test.sh runs it first)";

fn config(up: &UpstreamGuard, page_origin: &str) -> String {
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
id = "browser"
key = "{API_KEY}"
plan = "web"

[[upstreams]]
name = "up"
servers = ["{addr}"]

# N per client, next to no refill: the N+1th POST is a 429.
[[routes]]
name = "rides"
path_prefix = "{RIDES}"
methods = ["POST"]
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = {N}, refill_per_sec = 0.001 }}
cors = {{ allow_origins = ["{page_origin}"], allow_headers = ["x-api-key", "content-type"], max_age_secs = 600 }}

# A policy that does not name the page's origin.
[[routes]]
name = "private"
path_prefix = "/api/private"
upstream = "up"
cors = {{ allow_origins = ["https://partner.example.com"], allow_headers = ["x-api-key", "content-type"] }}
"#,
        addr = up.addr
    )
}

/// A static HTTP server on a loopback port of its own (the page's origin):
/// `GET /` is the page, anything else 404. Records the request lines.
struct PageServer {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PageServer {
    fn start(listener: TcpListener, page: String) -> Self {
        let addr = listener.local_addr().expect("page server address");
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (requests, stop) = (requests.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(stream) = stream {
                        serve(stream, &page, &requests);
                    }
                }
            })
        };
        PageServer {
            addr,
            requests,
            stop,
            thread: Some(thread),
        }
    }

    fn origin(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

fn serve(mut stream: TcpStream, page: &str, requests: &Mutex<Vec<String>>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut buf = [0u8; 2048];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head);
    let line = head.lines().next().unwrap_or_default().to_string();
    let (status, body) = match line.split(' ').nth(1) {
        Some("/") | Some("/index.html") => ("200 OK", page),
        _ => ("404 Not Found", "not found\n"),
    };
    requests.lock().unwrap().push(line);
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/html; charset=utf-8\r\n\
         content-length: {}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes());
}

impl Drop for PageServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr); // wakes the accept
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One headless Chromium, started in a process group of its own (its PID is
/// the group's id) so that the browser and every helper process it forked
/// are stopped together, by that id, when the guard goes.
struct Chromium {
    child: Child,
    dir: TempDir,
}

impl Chromium {
    /// Starts `chromium --headless --dump-dom <url>` with a fresh profile.
    fn dump_dom(url: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let profile = dir.path().join("profile");
        let home = dir.path().join("home");
        fs::create_dir_all(&home).expect("home dir");
        let spawned = Command::new("chromium")
            .args(support::cdp::HEADLESS)
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(["--dump-dom", "--virtual-time-budget=10000", url])
            // Its NSS database and caches go to the temp dir, not ~.
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .stdin(Stdio::null())
            .stdout(fs::File::create(dir.path().join("dom.html")).expect("dom file"))
            .stderr(fs::File::create(dir.path().join("chromium.log")).expect("log file"))
            .process_group(0)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(e) if e.kind() == ErrorKind::NotFound => panic!("{NO_CHROMIUM}"),
            Err(e) => panic!("could not start chromium ({e}); run scripts/setup.sh"),
        };
        Chromium { child, dir }
    }

    /// Waits for the browser to exit (it does once the DOM is dumped) and
    /// returns the DOM; panics with its log after `timeout`.
    fn wait_dom(&mut self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                break status;
            }
            if Instant::now() > deadline {
                panic!(
                    "chromium did not finish within {timeout:?}\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.kill_group(); // any helper process left behind
        let dom = fs::read_to_string(self.dir.path().join("dom.html")).unwrap_or_default();
        assert!(
            status.success() && !dom.is_empty(),
            "chromium exited with {status} and {} bytes of DOM\n{}",
            dom.len(),
            self.log_tail()
        );
        dom
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.dir.path().join("chromium.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(40)..].join("\n");
        format!("----- chromium log (last 40 lines) -----\n{tail}")
    }

    fn kill_group(&self) {
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        self.kill_group();
        let _ = self.child.wait();
    }
}

/// The JSON the page wrote into `#results`, from the dumped DOM.
fn results(dom: &str) -> Value {
    let (Some(start), Some(end)) = (dom.find("BEGIN-RESULTS"), dom.find("END-RESULTS")) else {
        panic!("the page wrote no results (did its script run?); DOM:\n{dom}");
    };
    let text = &dom[start + "BEGIN-RESULTS".len()..end];
    // A text node, serialized: undo the HTML escapes (&amp; last).
    let json = text
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&");
    serde_json::from_str(&json).unwrap_or_else(|e| panic!("results JSON ({e}): {json}"))
}

/// `gateway_requests_total` for a route and status, 0 when absent.
fn requests_total(metrics: &str, route: &str, status: u16) -> u64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("gateway_requests_total{"))
        .filter(|l| l.contains(&format!("route=\"{route}\"")))
        .filter(|l| l.contains(&format!("status=\"{status}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

fn is_type_error(v: &Value) -> bool {
    v["threw"] == true && v["name"] == "TypeError"
}

#[test]
fn a_browser_reads_the_429_and_its_retry_after_after_a_real_preflight() {
    let started = Instant::now();
    // First, before any process is started: no Chromium is a failure.
    let version = chromium_version();
    let up = UpstreamGuard::start();
    // The page's origin is known before the gateway's config is written.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the page's port");
    let page_origin = format!("http://{}", listener.local_addr().expect("addr"));
    let gw = GatewayGuard::start(&config(&up, &page_origin));
    let gateway_origin = format!("http://{}", gw.addr);
    assert_ne!(page_origin, gateway_origin, "two origins");

    let page = PAGE
        .replace("__GATEWAY__", &gateway_origin)
        .replace("__API_KEY__", API_KEY)
        .replace("__ATTEMPTS__", &(N + 1).to_string());
    let server = PageServer::start(listener, page);
    assert_eq!(server.origin(), page_origin);

    let browser_started = Instant::now();
    let mut chromium = Chromium::dump_dom(&format!("{page_origin}/"));
    let dom = chromium.wait_dom(BROWSER_TIMEOUT);
    drop(chromium);
    let browser_secs = browser_started.elapsed().as_secs_f64();
    let r = results(&dom);
    assert!(r.get("fatal").is_none(), "the page's script failed: {r}");
    assert_eq!(r["origin"], page_origin.as_str(), "{r}");
    assert!(
        server.requests().iter().any(|l| l.starts_with("GET / ")),
        "{:?}",
        server.requests()
    );

    // N admitted, then the 429; every answer readable by the page.
    let attempts = r["attempts"].as_array().expect("attempts");
    let statuses: Vec<u64> = attempts
        .iter()
        .map(|a| {
            a["status"]
                .as_u64()
                .unwrap_or_else(|| panic!("a fetch the page could not read: {a}"))
        })
        .collect();
    let mut expected = vec![200; N];
    expected.push(429);
    assert_eq!(statuses, expected, "{r}");
    // X-RateLimit-Remaining is exposed on the admitted answers too.
    let remaining: Vec<&str> = attempts
        .iter()
        .map(|a| a["remaining"].as_str().unwrap_or("(unreadable)"))
        .collect();
    let expected_remaining: Vec<String> = (0..N)
        .map(|i| (N - 1 - i).to_string())
        .chain(["0".to_string()])
        .collect();
    assert_eq!(remaining, expected_remaining, "{r}");

    let refused = &attempts[N];
    let retry_after: u64 = refused["retryAfter"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After unreadable by the page: {refused}"));
    assert!(retry_after > 0, "{refused}");
    assert_eq!(refused["remaining"], "0", "{refused}");
    assert_eq!(refused["limit"], N.to_string().as_str(), "{refused}");
    assert!(
        refused["requestId"].as_str().is_some_and(|s| !s.is_empty()),
        "X-Request-Id unreadable by the page: {refused}"
    );
    let body = &refused["body"];
    assert_eq!(body["status"], 429, "the problem JSON: {refused}");
    let retry_after_ms = body["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert_eq!(
        retry_after,
        retry_after_ms.div_ceil(1000),
        "header and body agree"
    );

    // The origin the policy does not name: the browser kept both answers
    // from the page. The preflighted POST was never sent; the simple GET was
    // sent and answered, but unreadable.
    let blocked = &r["blocked"];
    assert!(is_type_error(&blocked["preflighted"]), "{blocked}");
    assert!(is_type_error(&blocked["simple"]), "{blocked}");

    // The upstream saw exactly the admitted requests, and no preflight.
    assert_eq!(up.count(RIDES), N as u64, "{}", up.stats());
    assert_eq!(up.count("/api/private/preflighted"), 0, "{}", up.stats());
    assert_eq!(up.count("/api/private/simple"), 1, "{}", up.stats());

    // The browser's preflight was the gateway's: 204 under the route, and
    // one for all N+1 POSTs, cached by the browser for Access-Control-Max-Age
    // (a fetch with `cache: "no-store"` would bypass that cache and preflight
    // every time).
    let m = gw.metrics();
    let preflights = requests_total(&m, "rides", 204);
    assert_eq!(
        preflights, 1,
        "one preflight, then the browser's cache: {m}"
    );
    assert_eq!(requests_total(&m, "rides", 200), N as u64, "{m}");
    assert_eq!(requests_total(&m, "rides", 429), 1, "{m}");
    let private_refused = requests_total(&m, "private", 403);
    assert_eq!(private_refused, 1, "the refused preflight: {m}");

    println!(
        "FIGURES browser-cors: {version}: page {page_origin} -> gateway {gateway_origin}; \
         {n} POSTs on a bucket of {N}: statuses {statuses:?}, x-ratelimit-remaining read by JS \
         {remaining:?}, retry-after read by JS {retry_after} s (body retry_after_ms {retry_after_ms}); \
         preflights answered 204 by the gateway: {preflights}; upstream saw {seen} (bound {N}); \
         other origin: preflighted fetch {p} (refused preflights {private_refused}, upstream 0), \
         simple fetch {s} (upstream 1); browser {browser_secs:.1} s, test {total:.1} s",
        n = N + 1,
        seen = up.count(RIDES),
        p = blocked["preflighted"]["name"].as_str().unwrap_or("?"),
        s = blocked["simple"]["name"].as_str().unwrap_or("?"),
        total = started.elapsed().as_secs_f64(),
    );
}

/// `chromium --version`; fails the test, naming scripts/setup.sh, when
/// Chromium is not installed.
fn chromium_version() -> String {
    let out = match Command::new("chromium")
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!("{NO_CHROMIUM}"),
        Err(e) => panic!("could not run chromium --version ({e}); run scripts/setup.sh"),
    };
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && version.contains("Chromium"),
        "chromium --version said {version:?} ({}); run scripts/setup.sh",
        out.status
    );
    version
}
