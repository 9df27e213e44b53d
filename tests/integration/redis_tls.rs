//! Redis over TLS: a `redis-server` serving only TLS, with a certificate the
//! test makes; the gateway reaches it through `rediss://` verified against
//! `redis.ca_file` and decides on it, and refuses (loudly, on the fallback)
//! one whose certificate its CA did not sign.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::pki::Pki;
use support::{
    command_calls, family_sum, free_port, wait_for, GatewayGuard, UpstreamGuard, SERVER,
};

/// A TLS-only `redis-server`, stopped by PID on drop.
struct TlsRedis {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    fn start(pki: &Pki, leaf: &str, ca: &str) -> Self {
        Self::start_with(pki, leaf, ca, &[])
    }

    fn start_with(pki: &Pki, leaf: &str, ca: &str, extra: &[&str]) -> Self {
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
            .args(extra)
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
    let redis = format!("urls = [\"rediss://127.0.0.1:{port}\"]");
    config_on(&redis, ca_file, up)
}

fn config_on(redis: &str, ca_file: &str, up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
{redis}
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

/// A Redis Cluster of three TLS-only masters (the cluster bus over TLS too):
/// the gateway reads the slot map through the cluster client and then sends
/// each batch's calls on its own connection to each master, over TLS with
/// the same CA, and never needs its fallback.
#[test]
fn rediss_cluster_with_a_ca_file() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "redis", &["localhost", "IP:127.0.0.1"]);
    let nodes: Vec<TlsRedis> = (0..3)
        .map(|_| {
            TlsRedis::start_with(
                &pki,
                "redis",
                "ca",
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--tls-cluster",
                    "yes",
                ],
            )
        })
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let out = Command::new("redis-cli")
        .arg("--tls")
        .arg("--cacert")
        .arg(pki.path("ca.crt"))
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli --cluster create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    wait_for("cluster_state:ok", Duration::from_secs(30), || {
        nodes
            .iter()
            .all(|n| {
                n.cli(&pki, "ca", &["CLUSTER", "INFO"])
                    .contains("cluster_state:ok")
            })
            .then_some(())
    });
    let up = UpstreamGuard::start();
    let ca = pki.path("ca.crt").display().to_string();
    let urls: Vec<String> = addrs.iter().map(|a| format!("\"rediss://{a}\"")).collect();
    let redis = format!("mode = \"cluster\"\nurls = [{}]", urls.join(", "));
    let gw = GatewayGuard::start(&config_on(&redis, &ca, &up));
    let mut c = gw.client();
    // The first calls go through the cluster client while the slot map is
    // read; the rest on the masters' own connections.
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(c.get("/").map(|r| r.status).unwrap_or(0));
        std::thread::sleep(Duration::from_millis(100));
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    let evalsha: u64 = nodes
        .iter()
        .map(|n| command_calls(&n.cli(&pki, "ca", &["INFO", "commandstats"]), "evalsha"))
        .sum();
    let metrics = gw.metrics();
    let errors = family_sum(&metrics, "gateway_redis_errors_total");
    eprintln!(
        "FIGURES rediss cluster: statuses {statuses:?}, admitted {admitted} of 5 (bound 3), \
         {evalsha} EVALSHA over the 3 masters, {errors} Redis errors"
    );
    assert_eq!(
        admitted, 3,
        "the shared bucket of 3, decided on the TLS cluster"
    );
    assert!(
        evalsha >= 5,
        "every request decided on the cluster: {evalsha}"
    );
    assert_eq!(errors, 0.0, "no Redis error, so no fallback: {metrics}");
}
