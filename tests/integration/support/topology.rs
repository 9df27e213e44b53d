//! Real Redis topologies for the failover tests: a 3-master + 3-replica
//! Redis Cluster made with `redis-cli --cluster create`, and a Sentinel setup
//! (one master, one replica, three sentinels). Every process is owned by a
//! guard and stopped by PID.

use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tempfile::TempDir;

use super::{free_port, signal, wait_for, RedisGuard};

/// URLs as the items of a TOML list: `"a", "b"`.
pub fn quoted(urls: &[String]) -> String {
    urls.iter()
        .map(|u| format!("\"{u}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

pub struct ClusterGuard {
    /// Indexed by position; `None` once killed.
    pub nodes: Vec<Option<RedisGuard>>,
}

impl ClusterGuard {
    pub fn start() -> Self {
        Self::start_as(None)
    }

    /// Every node with `requirepass` (and `masterauth`) set to `password`.
    #[allow(dead_code)]
    pub fn start_with_password(password: &str) -> Self {
        Self::start_as(Some(password))
    }

    fn start_as(password: Option<&str>) -> Self {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
            // A replica may fail over whatever its data's age (tests are short).
            "--cluster-replica-validity-factor",
            "0",
        ];
        let nodes: Vec<Option<RedisGuard>> = (0..6)
            .map(|_| {
                Some(match password {
                    Some(p) => RedisGuard::start_with_password(&args, p),
                    None => RedisGuard::start_with(&args),
                })
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .flatten()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let mut cli = Command::new("redis-cli");
        if let Some(p) = password {
            cli.args(["-a", p, "--no-auth-warning"]);
        }
        let out = cli
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            out.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let g = ClusterGuard { nodes };
        g.wait_ok();
        // Replicas must be in sync before a master is killed, or none can take over.
        wait_for("every replica in sync", Duration::from_secs(30), || {
            g.nodes
                .iter()
                .flatten()
                .filter(|n| n.cmd(&["ROLE"]).starts_with("slave"))
                .all(|n| {
                    n.cmd(&["INFO", "replication"])
                        .contains("master_link_status:up")
                })
                .then_some(())
        });
        g
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().flatten().map(|n| n.url()).collect()
    }

    /// The `[redis]` lines of a gateway on this cluster: its mode and seeds.
    pub fn redis_section(&self) -> String {
        format!("mode = \"cluster\"\nurls = [{}]", quoted(&self.urls()))
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        let states = || {
            self.nodes
                .iter()
                .flatten()
                .map(|n| {
                    format!(
                        "{}: {}",
                        n.port,
                        n.cmd(&["CLUSTER", "INFO"]).lines().next().unwrap_or("")
                    )
                })
                .collect::<Vec<_>>()
        };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.poll_ok()));
        if ok.is_err() {
            let nodes = self
                .nodes
                .iter()
                .flatten()
                .next()
                .map(|n| n.cmd(&["CLUSTER", "NODES"]));
            panic!(
                "cluster not ok: {:?}\n{}",
                states(),
                nodes.unwrap_or_default()
            );
        }
    }

    fn poll_ok(&self) {
        wait_for(
            "cluster_state:ok on every node",
            Duration::from_secs(30),
            || {
                self.nodes
                    .iter()
                    .flatten()
                    .all(|n| n.cmd(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                    .then_some(())
            },
        );
    }

    /// Positions of the nodes that are masters now.
    pub fn masters(&self) -> Vec<usize> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                let n = n.as_ref()?;
                n.cmd(&["ROLE"]).starts_with("master").then_some(i)
            })
            .collect()
    }

    /// Sum of EVALSHA calls over the live nodes.
    pub fn evalsha_calls(&self) -> u64 {
        self.nodes
            .iter()
            .flatten()
            .map(|n| n.calls("evalsha"))
            .sum()
    }

    pub fn kill(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// The master serving `slot`: the one whose own line of CLUSTER NODES
    /// lists it.
    #[allow(dead_code)]
    pub fn owner(&self, slot: u16) -> usize {
        *self
            .masters()
            .iter()
            .find(|&&i| {
                let n = self.nodes[i].as_ref().expect("live master");
                n.cmd(&["CLUSTER", "NODES"]).lines().any(|l| {
                    l.contains("myself") && l.split(' ').skip(8).any(|r| in_range(r, slot))
                })
            })
            .expect("an owner")
    }

    /// Moves `slot` from its master to master `to` as `redis-cli --cluster
    /// reshard` does, key by key: IMPORTING/MIGRATING, MIGRATE, then the new
    /// owner announced to every master. `pause` is spent in each of the
    /// three states (keys on the source; some moved, reached by ASK; done).
    #[allow(dead_code)]
    pub fn migrate_slot(&self, slot: u16, to: usize, pause: Duration) {
        let from = self.owner(slot);
        assert_ne!(from, to, "slot {slot} already on node {to}");
        let (src, dst) = (
            self.nodes[from].as_ref().expect("source"),
            self.nodes[to].as_ref().expect("target"),
        );
        let id = |n: &RedisGuard| n.cmd(&["CLUSTER", "MYID"]).trim().to_string();
        let (src_id, dst_id) = (id(src), id(dst));
        let s = slot.to_string();
        assert!(dst
            .cmd(&["CLUSTER", "SETSLOT", &s, "IMPORTING", &src_id])
            .contains("OK"));
        assert!(src
            .cmd(&["CLUSTER", "SETSLOT", &s, "MIGRATING", &dst_id])
            .contains("OK"));
        std::thread::sleep(pause);
        let port = dst.port.to_string();
        loop {
            let keys: Vec<String> = src
                .cmd(&["CLUSTER", "GETKEYSINSLOT", &s, "100"])
                .lines()
                .map(str::to_string)
                .filter(|k| !k.is_empty())
                .collect();
            if keys.is_empty() {
                break;
            }
            let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
            args.extend(keys.iter().map(String::as_str));
            let out = src.cmd(&args);
            assert!(
                out.contains("OK") || out.contains("NOKEY"),
                "MIGRATE: {out}"
            );
        }
        std::thread::sleep(pause);
        for i in self.masters() {
            let n = self.nodes[i].as_ref().expect("master");
            n.cmd(&["CLUSTER", "SETSLOT", &s, "NODE", &dst_id]);
        }
        std::thread::sleep(pause);
    }
}

/// Whether a CLUSTER NODES slot field (`5`, `0-5460`) holds `slot`.
fn in_range(field: &str, slot: u16) -> bool {
    let (a, b) = field.split_once('-').unwrap_or((field, field));
    match (a.parse::<u16>(), b.parse::<u16>()) {
        (Ok(a), Ok(b)) => (a..=b).contains(&slot),
        _ => false,
    }
}

/// A sentinel process.
struct Sentinel {
    child: Child,
    _dir: TempDir,
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        signal(self.child.id(), "KILL");
        let _ = self.child.wait();
    }
}

pub struct SentinelGuard {
    pub master: Option<RedisGuard>,
    pub replica: Option<RedisGuard>,
    sentinels: Vec<Sentinel>,
    pub sentinel_ports: Vec<u16>,
    password: Option<String>,
}

pub const MASTER_NAME: &str = "limits";

impl SentinelGuard {
    pub fn start() -> Self {
        Self::start_with(None)
    }

    /// With `password`, the master, its replica and the sentinels all
    /// require it (the sentinels also use it to reach the master).
    pub fn start_with(password: Option<&str>) -> Self {
        let master = match password {
            Some(p) => RedisGuard::start_with_password(&[], p),
            None => RedisGuard::start(),
        };
        let replica_of = ["--replicaof", "127.0.0.1", &master.port.to_string()];
        let replica = match password {
            Some(p) => RedisGuard::start_with_password(&replica_of, p),
            None => RedisGuard::start_with(&replica_of),
        };
        wait_for("replica in sync", Duration::from_secs(20), || {
            replica
                .cmd(&["INFO", "replication"])
                .contains("master_link_status:up")
                .then_some(())
        });
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("temp dir");
            let port = free_port();
            let conf = dir.path().join("sentinel.conf");
            let auth = password.map_or(String::new(), |p| {
                format!("requirepass {p}\nsentinel auth-pass {MASTER_NAME} {p}\n")
            });
            fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {}\nlogfile {}\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 500\n\
                     sentinel failover-timeout {MASTER_NAME} 3000\n\
                     sentinel parallel-syncs {MASTER_NAME} 1\n{auth}",
                    dir.path().display(),
                    dir.path().join("sentinel.log").display(),
                    master.port
                ),
            )
            .expect("sentinel.conf");
            let child = Command::new("redis-server")
                .arg(&conf)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start sentinel");
            sentinels.push(Sentinel { child, _dir: dir });
            sentinel_ports.push(port);
        }
        let g = SentinelGuard {
            master: Some(master),
            replica: Some(replica),
            sentinels,
            sentinel_ports,
            password: password.map(str::to_string),
        };
        for &p in &g.sentinel_ports {
            wait_for(
                "sentinel sees the master and its replica",
                Duration::from_secs(20),
                || {
                    let mut cli = Command::new("redis-cli");
                    cli.args(["-p", &p.to_string()]);
                    if let Some(pw) = password {
                        cli.args(["-a", pw, "--no-auth-warning"]);
                    }
                    let out = cli
                        .args(["SENTINEL", "replicas", MASTER_NAME])
                        .output()
                        .ok()?;
                    let text = String::from_utf8_lossy(&out.stdout).to_string();
                    text.contains("slave").then_some(())
                },
            );
        }
        g
    }

    /// The sentinels' URLs, with the password when there is one.
    pub fn urls(&self) -> Vec<String> {
        let auth = self
            .password
            .as_ref()
            .map_or(String::new(), |p| format!(":{p}@"));
        self.sentinel_ports
            .iter()
            .map(|p| format!("redis://{auth}127.0.0.1:{p}"))
            .collect()
    }

    /// The port the sentinels name as master now.
    pub fn master_port(&self) -> Option<u16> {
        let mut cli = Command::new("redis-cli");
        if let Some(pw) = &self.password {
            cli.args(["-a", pw, "--no-auth-warning"]);
        }
        let out = cli
            .args([
                "-p",
                &self.sentinel_ports[0].to_string(),
                "SENTINEL",
                "get-master-addr-by-name",
                MASTER_NAME,
            ])
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .nth(1)?
            .trim()
            .parse()
            .ok()
    }

    pub fn sentinel_count(&self) -> usize {
        self.sentinels.len()
    }
}
