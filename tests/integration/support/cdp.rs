//! Headless Chromium driven over the DevTools protocol (as Playwright and
//! Puppeteer drive it): a page opened, JavaScript evaluated in it, clicks
//! made, and every console error and uncaught exception it reports kept.
//! Chromium is Debian's `chromium` (scripts/setup.sh installs it).

use std::fs;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tempfile::TempDir;
use tungstenite::{Message, WebSocket};

use super::wait_for;

/// Headless Chromium as every browser test runs it: no sandbox (a
/// container's root), no GPU, no QUIC, and nothing fetched in the
/// background.
pub const HEADLESS: [&str; 8] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
];

pub struct Browser {
    child: Child,
    dir: TempDir,
    ws: WebSocket<TcpStream>,
    next: u64,
    /// Every event the page reported (method and params).
    pub events: Vec<Value>,
}

impl Browser {
    /// Starts Chromium with a fresh profile and opens `url` in its page,
    /// once it has loaded.
    pub fn open(url: &str) -> Browser {
        let dir = tempfile::tempdir().expect("profile dir");
        let child = Command::new("chromium")
            .args(HEADLESS)
            .args(["--window-size=1280,900", "--remote-debugging-port=0"])
            .arg(format!("--user-data-dir={}", dir.path().display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.path().join("chromium.log")).expect("log file"))
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start chromium ({e}): run scripts/setup.sh"));
        // The port it chose, in its profile.
        let port_file = dir.path().join("DevToolsActivePort");
        let port: u16 = wait_for("chromium's DevTools port", Duration::from_secs(30), || {
            fs::read_to_string(&port_file)
                .ok()?
                .lines()
                .next()?
                .trim()
                .parse()
                .ok()
        });
        let targets = http_get(port, "/json/list");
        let page = targets
            .as_array()
            .and_then(|t| t.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .unwrap_or_else(|| panic!("no page among {targets}"))
            .to_string();
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("DevTools socket");
        stream
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let (ws, _) = tungstenite::client(page.as_str(), stream).expect("DevTools handshake");
        let mut b = Browser {
            child,
            dir,
            ws,
            next: 1,
            events: Vec::new(),
        };
        for domain in ["Runtime", "Log", "Page"] {
            b.call(&format!("{domain}.enable"), json!({}));
        }
        b.call("Page.navigate", json!({ "url": url }));
        b.wait_event("Page.loadEventFired", Duration::from_secs(30));
        b
    }

    /// One DevTools command; its result.
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next;
        self.next += 1;
        let msg = json!({ "id": id, "method": method, "params": params }).to_string();
        self.ws.send(Message::text(msg)).expect("send to chromium");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(
                Instant::now() < deadline,
                "chromium did not answer {method}\n{}",
                self.log_tail()
            );
            let Some(v) = self.receive() else { continue };
            if v["id"] == id {
                if let Some(e) = v.get("error") {
                    panic!("{method}: {e}");
                }
                return v["result"].clone();
            }
        }
    }

    /// The next message, if one came within the socket's timeout; events
    /// are kept.
    fn receive(&mut self) -> Option<Value> {
        match self.ws.read() {
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(t.as_str()).expect("DevTools JSON");
                if v.get("method").is_some() {
                    self.events.push(v.clone());
                }
                Some(v)
            }
            Ok(_) => None,
            Err(tungstenite::Error::Io(e))
                if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
            {
                None
            }
            Err(e) => panic!("DevTools socket: {e}\n{}", self.log_tail()),
        }
    }

    fn wait_event(&mut self, method: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.events.iter().any(|e| e["method"] == method) {
            assert!(
                Instant::now() < deadline,
                "no {method} within {timeout:?}\n{}",
                self.log_tail()
            );
            self.receive();
        }
    }

    /// Evaluates `js` in the page (a promise is awaited); its value.
    pub fn eval(&mut self, js: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({ "expression": js, "awaitPromise": true, "returnByValue": true }),
        );
        if let Some(e) = r.get("exceptionDetails") {
            panic!("{js}: {e}");
        }
        r["result"]["value"].clone()
    }

    /// Evaluates `js` until it gives something other than null or false,
    /// within `timeout`: that value.
    pub fn wait_until(&mut self, what: &str, timeout: Duration, js: &str) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.eval(js);
            if !v.is_null() && v != false {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?} (last {v})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the page reported as errors: uncaught exceptions, console
    /// errors and failed loads.
    pub fn errors(&mut self) -> Vec<Value> {
        while self.receive().is_some() {}
        self.events
            .iter()
            .filter(|e| match e["method"].as_str() {
                Some("Runtime.exceptionThrown") => true,
                Some("Runtime.consoleAPICalled") => e["params"]["type"] == "error",
                Some("Log.entryAdded") => e["params"]["entry"]["level"] == "error",
                _ => false,
            })
            .cloned()
            .collect()
    }

    /// A PNG of the page as it is now.
    pub fn screenshot(&mut self, path: &Path) {
        use base64::Engine as _;
        let r = self.call("Page.captureScreenshot", json!({ "format": "png" }));
        let png = base64::engine::general_purpose::STANDARD
            .decode(r["data"].as_str().expect("data"))
            .expect("base64");
        fs::write(path, png).expect("write screenshot");
    }

    fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.dir.path().join("chromium.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "----- chromium log (last 30 lines) -----\n{}",
            tail.join("\n")
        )
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Its whole process group (renderers, GPU process), by its own id.
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

/// `GET path` on Chromium's DevTools HTTP port: its JSON (read to its
/// Content-Length: Chromium keeps the connection open).
fn http_get(port: u16, path: &str) -> Value {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("DevTools HTTP");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(usize::MAX);
            if body.len() >= length {
                return serde_json::from_str(&body[..length])
                    .unwrap_or_else(|_| panic!("not JSON from {path}: {text}"));
            }
        }
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) => panic!(
                "DevTools HTTP {path}: {e}; read {}",
                String::from_utf8_lossy(&raw)
            ),
        }
    }
    let text = String::from_utf8_lossy(&raw);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON from {path}: {text}"))
}
