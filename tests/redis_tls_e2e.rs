//! Redis over TLS: a `redis-server` serving only TLS, with a certificate the
//! test makes; the gateway reaches it through `rediss://` verified against
//! `redis.ca_file` and decides on it, and refuses (loudly, on the fallback)
//! one whose certificate its CA did not sign.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::pki::Pki;
use support::{free_port, wait_for, GatewayGuard, UpstreamGuard, SERVER};

/// A TLS-only `redis-server`, stopped by PID on drop.
struct TlsRedis {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    fn start(pki: &Pki, leaf: &str, ca: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(pki.path(&format!("{leaf}.crt")))
            .arg("--tls-key-file")
            .arg(pki.path(&format!("{leaf}.key")))
            .arg("--tls-ca-cert-file")
            .arg(pki.path(&format!("{ca}.crt")))
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server with TLS");
        let r = TlsRedis {
            port,
            child,
            _dir: dir,
        };
        wait_for(
            "redis over TLS to answer PING",
            Duration::from_secs(10),
            || (r.cli(pki, ca, &["PING"]).trim() == "PONG").then_some(()),
        );
        r
    }

    fn cli(&self, pki: &Pki, ca: &str, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["--tls", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .arg("--cacert")
            .arg(pki.path(&format!("{ca}.crt")))
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).to_string()
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(port: u16, ca_file: &str, up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["rediss://127.0.0.1:{port}"]
ca_file = "{ca_file}"
timeout_ms = 100
probe_interval_ms = 100

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.001, scope = "global" }}
"#,
        up.addr
    )
}

#[test]
fn rediss_with_a_ca_file() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("other");
    pki.leaf("ca", "redis", &["localhost", "IP:127.0.0.1"]);
    let redis = TlsRedis::start(&pki, "redis", "ca");
    let up = UpstreamGuard::start();

    let ca = pki.path("ca.crt").display().to_string();
    let gw = GatewayGuard::start(&config(redis.port, &ca, &up));
    let mut c = gw.client();
    let admitted = (0..5)
        .filter(|_| c.get("/").map(|r| r.status).unwrap_or(0) == 200)
        .count();
    assert_eq!(admitted, 3, "the shared bucket of 3, decided over TLS");
    let evals = redis.cli(&pki, "ca", &["INFO", "commandstats"]);
    assert!(
        evals.contains("cmdstat_evalsha"),
        "decided on Redis: {evals}"
    );

    // A CA that did not sign Redis's certificate: refused, on the fallback.
    let other = pki.path("other.crt").display().to_string();
    let gw2 = GatewayGuard::start_opts(&config(redis.port, &other, &up), false);
    wait_for("the refusal on /readyz", Duration::from_secs(10), || {
        let r = gw2.admin_get("/readyz").text();
        (r.contains("\"local\"") && r.contains("\"tls\"")).then_some(r)
    });
    let ready = gw2.admin_get("/readyz").text();
    eprintln!("FIGURES rediss: admitted {admitted} of 5 (bound 3); wrong CA: {ready}");
    assert!(
        ready.to_ascii_lowercase().contains("certificate"),
        "{ready}"
    );
}
