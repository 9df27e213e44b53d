//! gRPC end to end through the real gateway, with a real gRPC client and
//! server (Python `grpcio`, `tests/grpc/`), every process on loopback:
//! client --h2c--> gateway (`server.h2c = true`) --`protocol = "h2c"`-->
//! server. It proves that unary and server-streaming calls pass intact (and
//! through a TLS listener by ALPN h2), that the access log records them as
//! `proto=h2` on their route, and that the route's rate limit reaches a real
//! gRPC client as RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms`, refused
//! calls never reaching the server, streaming calls included.
//!
//! Needs `.venv` with `grpcio` in the repo root: `scripts/setup.sh` makes it.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::pki::Pki;
use support::{free_port, wait_for, GatewayGuard, SERVER_2_THREADS};

/// The repo's virtualenv interpreter, checked to have `grpc`: without it
/// every test here would fail in a confusing way, so say how to fix it.
fn python() -> PathBuf {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let ok = Command::new(&py)
        .args(["-c", "import grpc"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "{} cannot import grpc: run scripts/setup.sh (it makes .venv and installs grpcio)",
        py.display()
    );
    py
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/grpc")
        .join(name)
}

/// `tests/grpc/echo_server.py` on a free loopback port, stopped by PID
/// (SIGTERM, then SIGKILL if it lingers) and waited for on drop.
struct EchoServer {
    port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl EchoServer {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let child = Command::new(python())
            .arg(script("echo_server.py"))
            .args(["--port", &port.to_string()])
            .stdout(fs::File::create(dir.path().join("stdout.log")).expect("log"))
            .stderr(fs::File::create(dir.path().join("stderr.log")).expect("log"))
            .spawn()
            .expect("start echo_server.py");
        let mut server = EchoServer {
            port,
            child: Some(child),
            dir,
        };
        // READY is printed once the port is bound; an early exit (e.g. the
        // port taken meanwhile) fails at once rather than at the deadline.
        let stdout = server.dir.path().join("stdout.log");
        wait_for("echo_server.py READY", Duration::from_secs(20), || {
            if let Some(Ok(Some(status))) = server.child.as_mut().map(|c| c.try_wait()) {
                panic!(
                    "echo_server.py exited ({status}): {}",
                    fs::read_to_string(server.dir.path().join("stderr.log")).unwrap_or_default()
                );
            }
            fs::read_to_string(&stdout)
                .ok()
                .filter(|s| s.contains("READY"))
        });
        server
    }

    fn target(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Calls the server handled per method, asked of it directly (not
    /// through the gateway).
    fn stats(&self) -> Value {
        let r = grpc_client(&self.target(), &["--call", "stats"]);
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!(r[0]["ok"], true, "Stats call failed: {r:?}");
        r[0]["reply"].clone()
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if std::thread::panicking() {
            for f in ["stdout.log", "stderr.log"] {
                let log = fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
                eprintln!("----- echo_server.py {f} -----\n{log}");
            }
        }
        let pid = child.id().to_string();
        let _ = Command::new("kill").args(["-s", "TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !matches!(child.try_wait(), Ok(Some(_))) {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Runs `tests/grpc/client.py` against `target`; one JSON object per call.
/// Each call has a deadline in the client, so this cannot hang.
fn grpc_client(target: &str, args: &[&str]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(script("client.py"))
        .args(["--target", target, "--timeout", "5"])
        .args(args)
        .output()
        .expect("run client.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "client.py {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A gateway in front of `server`: h2c on its plaintext listener, the
/// upstream spoken to over h2c, one route `echo` for the service with
/// `limit` (a TOML inline table, or none), and `extra` server settings (a
/// `[server.tls]` table).
fn gateway(server: &EchoServer, limit: Option<&str>, extra: &str) -> GatewayGuard {
    let limit = limit.map(|l| format!("limit = {l}")).unwrap_or_default();
    GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}
h2c = true
{extra}

[limiter]
backend = "local"
retry_after_jitter_ms = 0

[[upstreams]]
name = "echo"
servers = ["{}"]
protocol = "h2c"
connect_timeout_ms = 1000
read_timeout_ms = 5000

[[routes]]
name = "echo"
path_prefix = "/echo.Echo/"
upstream = "echo"
{limit}
"#,
        server.target()
    ))
}

/// The access log lines (`target: access`) as key=value maps, quotes off.
fn access_lines(gw: &GatewayGuard) -> Vec<std::collections::HashMap<String, String>> {
    gw.log()
        .lines()
        .filter(|l| l.contains("request_id=") && l.contains("proto="))
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
                .collect()
        })
        .collect()
}

/// Waits until the gateway has logged `n` access lines (a line is written
/// when the response ends, which may be just after the client has it).
fn wait_access_lines(
    gw: &GatewayGuard,
    n: usize,
) -> Vec<std::collections::HashMap<String, String>> {
    wait_for(
        &format!("{n} access log lines"),
        Duration::from_secs(10),
        || {
            let lines = access_lines(gw);
            (lines.len() >= n).then_some(lines)
        },
    )
}

#[test]
fn unary_and_streaming_calls_pass_over_h2c() {
    let server = EchoServer::start();
    let gw = gateway(&server, None, "");
    let target = gw.addr.to_string();

    let said = grpc_client(&target, &["--call", "say", "--data", "hi there"]);
    assert_eq!(said.len(), 1);
    assert_eq!(said[0]["ok"], true, "{said:?}");
    assert_eq!(said[0]["reply"], "hi there");

    // A server stream of 50 messages arrives whole and in order.
    let counted = grpc_client(&target, &["--call", "count", "--n", "50"]);
    assert_eq!(counted[0]["ok"], true, "{counted:?}");
    let expected: Vec<Value> = (0..50).map(|i| Value::from(i.to_string())).collect();
    assert_eq!(counted[0]["reply"], Value::from(expected), "{counted:?}");
    assert_eq!(
        server.stats(),
        serde_json::json!({"Say": 1, "Count": 1}),
        "each call reached the server once"
    );

    let lines = wait_access_lines(&gw, 2);
    assert_eq!(lines.len(), 2, "{lines:?}");
    for l in &lines {
        assert_eq!(l.get("proto").map(String::as_str), Some("h2"), "{l:?}");
        assert_eq!(l.get("route").map(String::as_str), Some("echo"), "{l:?}");
        assert_eq!(l.get("status").map(String::as_str), Some("200"), "{l:?}");
        assert_eq!(l.get("method").map(String::as_str), Some("POST"), "{l:?}");
    }
    eprintln!("FIGURES grpc-h2c: unary ok, stream of 50 ok; access log: {lines:?}");
}

#[test]
fn the_rate_limit_is_resource_exhausted_to_a_grpc_client() {
    let server = EchoServer::start();
    let gw = gateway(
        &server,
        Some(
            r#"{ algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.001, scope = "global" }"#,
        ),
        "",
    );
    let target = gw.addr.to_string();

    // Five calls on one channel (one HTTP/2 connection): the bucket holds 3.
    let calls = grpc_client(&target, &["--call", "say", "--times", "5"]);
    assert_eq!(calls.len(), 5, "{calls:?}");
    let ok: Vec<&Value> = calls.iter().filter(|c| c["ok"] == true).collect();
    let refused: Vec<&Value> = calls.iter().filter(|c| c["ok"] == false).collect();
    assert_eq!(ok.len(), 3, "{calls:?}");
    for c in &ok {
        assert_eq!(c["reply"], "hello");
    }
    assert_eq!(refused.len(), 2, "{calls:?}");
    for c in &refused {
        assert_eq!(c["code"], "RESOURCE_EXHAUSTED", "{c}");
        let details = c["details"].as_str().unwrap_or_default();
        assert!(details.contains("rate limit exceeded"), "{c}");
        // The pushback is the retry delay in milliseconds: a number > 0
        // (the bucket refills one token in 1000 s).
        let pushback = c["trailing"]["grpc-retry-pushback-ms"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("grpc-retry-pushback-ms missing or not a number: {c}"));
        assert!(pushback > 0, "{c}");
    }
    // The refused calls never reached the server.
    assert_eq!(server.stats()["Say"], 3, "the server saw exactly 3 calls");

    // A server-streaming call once the bucket is empty is refused the same way.
    let stream = grpc_client(&target, &["--call", "count", "--n", "5"]);
    assert_eq!(stream.len(), 1);
    assert_eq!(stream[0]["ok"], false, "{stream:?}");
    assert_eq!(stream[0]["code"], "RESOURCE_EXHAUSTED", "{stream:?}");
    assert!(
        stream[0]["trailing"]["grpc-retry-pushback-ms"].is_string(),
        "{stream:?}"
    );
    assert_eq!(
        server.stats(),
        serde_json::json!({"Say": 3, "Count": 0}),
        "the refused stream never reached the server"
    );

    // Metrics and the access log count the refusals as the 429s they are.
    assert_eq!(
        gw.metric("gateway_requests_total{route=\"echo\",status=\"429\"}"),
        3.0
    );
    let lines = wait_access_lines(&gw, 6);
    // Sorted: a line is written as its response ends, so two calls in a
    // row may log in either order.
    let mut statuses: Vec<&str> = lines
        .iter()
        .map(|l| l.get("status").map_or("", String::as_str))
        .collect();
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        ["200", "200", "200", "429", "429", "429"],
        "{lines:?}"
    );
    assert!(lines
        .iter()
        .all(|l| l.get("proto").map(String::as_str) == Some("h2")));
    eprintln!(
        "FIGURES grpc-limit: 5 unary -> 3 ok, 2 RESOURCE_EXHAUSTED (pushback {} ms); \
         stream after exhaustion -> {}; server saw {}",
        refused[0]["trailing"]["grpc-retry-pushback-ms"],
        stream[0]["code"],
        server.stats()
    );
}

#[test]
fn unary_call_over_a_tls_listener_with_alpn_h2() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "leaf", &["grpc.test"]);
    let server = EchoServer::start();
    let tls_port = free_port();
    let gw = gateway(
        &server,
        None,
        &format!(
            "\n[server.tls]\nlisten = [\"127.0.0.1:{tls_port}\"]\n\
             certificates = [{{ cert_file = \"{}\", key_file = \"{}\" }}]\n",
            pki.path("leaf.crt").display(),
            pki.path("leaf.key").display()
        ),
    );
    // gRPC over TLS insists on ALPN h2; the client verifies the certificate
    // against our CA under the name it was made for.
    let ca = pki.path("ca.crt").display().to_string();
    let said = grpc_client(
        &format!("127.0.0.1:{tls_port}"),
        &[
            "--call",
            "say",
            "--data",
            "over tls",
            "--ca",
            &ca,
            "--server-name",
            "grpc.test",
        ],
    );
    assert_eq!(said.len(), 1);
    assert_eq!(said[0]["ok"], true, "{said:?}");
    assert_eq!(said[0]["reply"], "over tls");
    assert_eq!(server.stats()["Say"], 1);
    let lines = wait_access_lines(&gw, 1);
    assert_eq!(
        lines[0].get("proto").map(String::as_str),
        Some("h2"),
        "{lines:?}"
    );
    assert_eq!(
        lines[0].get("route").map(String::as_str),
        Some("echo"),
        "{lines:?}"
    );
}
