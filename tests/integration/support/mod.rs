//! Real processes for integration tests: a `redis-server`, the mock upstream
//! and the gateway binary, each on free loopback ports, each owned by a guard
//! that stops it by PID and waits for it. A test that panics prints the logs
//! of the processes it started.
#![allow(dead_code)]

pub mod answer_hold;
pub mod cdp;
pub mod http;
pub mod issuer;
pub mod load;
pub mod otlp;
pub mod pki;
pub mod topology;

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

pub use answer_hold::AnswerHold;
pub use http::{Client, Response};

/// Runs the gateway binary's `args` on the config at `config`: its exit
/// code, stdout and stderr.
pub fn gateway_cli(args: &[&str], config: &std::path::Path) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .expect("run the gateway binary");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// A config for the API-key tests: `head` (the `[limiter]`, `[redis]`
/// and `[clients]` a test needs), then plans free (1,000 a second) and
/// tiny (2, no refill), the inline key `inline-secret`, and route `/r`,
/// which needs a key.
pub fn key_test_config(head: &str, up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER}

{head}

[plans.free]
capacity = 1000
refill_per_sec = 1000

[plans.tiny]
capacity = 2
refill_per_sec = 0.001

[[api_keys]]
id = "inline"
key = "inline-secret"
plan = "free"

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
require_api_key = true
"#,
        up.addr
    )
}

/// The status of `GET /r` with `secret` as its API key.
pub fn key_status(g: &GatewayGuard, secret: &str) -> u16 {
    g.client()
        .request("GET", "/r", &[("x-api-key", secret)], b"")
        .expect("request")
        .status
}

/// A port nothing listens on right now, and never handed out before by
/// this test binary: the kernel may give a port just let go to the next
/// bind, so two calls could otherwise name one port for two services.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind an ephemeral loopback port");
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Polls `f` until it returns `Some`, or panics after `timeout` naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub(crate) fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args(["-s", sig, &pid.to_string()])
        .status();
}

/// Waits for a child to exit, up to `timeout`; kills it (SIGKILL) past that.
fn reap(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn print_log(name: &str, path: &PathBuf) {
    if let Ok(log) = fs::read_to_string(path) {
        // The last lines that are not access lines (what the gateway said),
        // then the last few access lines: a busy test's access lines
        // would otherwise hide everything else.
        let said: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains(" access: "))
            .rev()
            .take(60)
            .collect();
        let access: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(" access: "))
            .rev()
            .take(10)
            .collect();
        eprintln!("----- {name} log ({}) -----", path.display());
        for line in said.into_iter().rev().chain(access.into_iter().rev()) {
            eprintln!("{line}");
        }
    }
}

/// The value of one series (exact name and labels) in a Prometheus text.
pub fn series<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(' '))
            .map(str::trim)
    })
}

/// The sum of every series of one metric family (any labels) in a
/// Prometheus text.
#[allow(dead_code)]
pub fn family_sum(text: &str, family: &str) -> f64 {
    let prefix = format!("{family}{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Calls of one command (e.g. "evalsha") in an `INFO commandstats` reply.
pub fn command_calls(info: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A test gateway's `[server]` table (for a config written with `format!`):
/// its listeners (the guard fills them in), one worker thread and a grace
/// period of a second, so a stop is quick.
pub const SERVER: &str = "[server]
listen = [\"{listen}\"]
admin_listen = \"{admin}\"
threads = 1
grace_period_secs = 1";

/// `SERVER` with two worker threads.
pub const SERVER_2_THREADS: &str = "[server]
listen = [\"{listen}\"]
admin_listen = \"{admin}\"
threads = 2
grace_period_secs = 1";

/// A `redis-server` of our own.
pub struct RedisGuard {
    pub port: u16,
    child: Child,
    dir: TempDir,
    /// `requirepass`, which `cmd` authenticates with.
    password: Option<String>,
}

impl RedisGuard {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_free(extra, None)
    }

    /// Starts with `requirepass` (and `masterauth`, for replicas) set.
    pub fn start_with_password(extra: &[&str], password: &str) -> Self {
        let mut args = vec!["--requirepass", password, "--masterauth", password];
        args.extend_from_slice(extra);
        Self::start_free(&args, Some(password))
    }

    /// Starts on a given port (to restart a Redis where clients expect it).
    pub fn start_on(port: u16, extra: &[&str]) -> Self {
        Self::start_as(port, extra, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// On a free port, tried again on another if it could not start there:
    /// a cluster node also binds its bus port (port + 10000), which another
    /// test's socket can hold, and then exits at once (one of four
    /// integration runs lost a cluster node so).
    fn start_free(extra: &[&str], password: Option<&str>) -> Self {
        let cluster = extra.contains(&"--cluster-enabled");
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port();
            if cluster
                && (port > u16::MAX - 10_000
                    || TcpListener::bind(("127.0.0.1", port + 10_000)).is_err())
            {
                continue;
            }
            match Self::start_as(port, extra, password) {
                Ok(guard) => return guard,
                Err(e) => last = e,
            }
        }
        panic!("redis-server did not start on five free ports: {last}");
    }

    fn start_as(port: u16, extra: &[&str], password: Option<&str>) -> Result<Self, String> {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("redis.log");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed? scripts/test.sh installs it)");
        let mut guard = RedisGuard {
            port,
            child,
            dir,
            password: password.map(str::to_string),
        };
        // Up, or exited (a port it needs was taken): its log says which.
        let up = wait_for(
            "redis-server to answer PING",
            Duration::from_secs(10),
            || {
                if matches!(guard.child.try_wait(), Ok(Some(_))) {
                    return Some(false);
                }
                (guard.cmd(&["PING"]).trim() == "PONG").then_some(true)
            },
        );
        if up {
            return Ok(guard);
        }
        let log = std::fs::read_to_string(guard.dir.path().join("redis.log")).unwrap_or_default();
        Err(format!(
            "redis-server on port {port} exited at start: {}",
            log.lines().last().unwrap_or("(no log)")
        ))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Changes `requirepass` (and the password `cmd` uses from now on).
    #[allow(dead_code)]
    pub fn rotate_password(&mut self, new: &str) {
        self.cmd(&["CONFIG", "SET", "requirepass", new]);
        self.password = Some(new.to_string());
    }

    /// Runs a command through `redis-cli`, returning its raw output.
    pub fn cmd(&self, args: &[&str]) -> String {
        let mut cli = Command::new("redis-cli");
        cli.args(["-h", "127.0.0.1", "-p", &self.port.to_string()]);
        if let Some(p) = &self.password {
            cli.args(["-a", p, "--no-auth-warning"]);
        }
        let out = cli.args(args).output().expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// Every key name now.
    pub fn keys(&self) -> std::collections::BTreeSet<String> {
        self.cmd(&["KEYS", "*"])
            .lines()
            .map(str::to_string)
            .filter(|k| !k.is_empty())
            .collect()
    }

    pub fn dbsize(&self) -> u64 {
        self.cmd(&["DBSIZE"]).trim().parse().unwrap_or(u64::MAX)
    }

    /// `INFO commandstats` calls of one command (e.g. "evalsha").
    pub fn calls(&self, command: &str) -> u64 {
        command_calls(&self.cmd(&["INFO", "commandstats"]), command)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal ("STOP", "CONT", ...) to this redis-server.
    pub fn signal(&self, sig: &str) {
        signal(self.child.id(), sig);
    }
}

impl Drop for RedisGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log("redis", &self.dir.path().join("redis.log"));
        }
        // Reaped already (it exited): its PID may be another process's now.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        signal(self.child.id(), "CONT"); // a stopped process cannot die until continued
        signal(self.child.id(), "KILL");
        let _ = self.child.wait();
    }
}

/// A binary of the test tools' package (tools/), found next to the gateway
/// binary: cargo names only this package's own binaries to its tests, and
/// builds the other package's only when asked to.
fn tool_binary(name: &str) -> PathBuf {
    let path = std::path::Path::new(env!("CARGO_BIN_EXE_gateway")).with_file_name(name);
    assert!(
        path.is_file(),
        "{} is missing: the test tools are a package of their own, built \
         with `cargo build -p gateway-test-tools` (add `--release` for a \
         release test run; scripts/test.sh builds the whole workspace first)",
        path.display()
    );
    path
}

/// A `tcp-forwarder` of our own between a client and `to`: `stop` it
/// (SIGSTOP) to cut that client off in silence, `resume` (SIGCONT) to heal.
pub struct ForwarderGuard {
    pub addr: SocketAddr,
    child: Child,
}

#[allow(dead_code)]
impl ForwarderGuard {
    pub fn start(to: &str) -> Self {
        let mut child = Command::new(tool_binary("tcp-forwarder"))
            .args(["--listen", "127.0.0.1:0", "--to", to])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tcp-forwarder");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("forwarder stdout");
        std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
            .expect("read the forwarder's address");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("tcp-forwarder said {line:?}"));
        ForwarderGuard { addr, child }
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Blackholes every connection through it: no RST, no bytes.
    pub fn stop(&self) {
        signal(self.child.id(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.child.id(), "CONT");
    }

    /// Every connection open now becomes a black hole for good (a
    /// middlebox that lost its flows); new connections work. Takes effect
    /// once the forwarder runs (after `resume` if it is stopped).
    pub fn forget_flows(&mut self) {
        let stdin = self.child.stdin.as_mut().expect("forwarder stdin");
        std::io::Write::write_all(stdin, b"forget\n").expect("tell the forwarder");
    }
}

impl Drop for ForwarderGuard {
    fn drop(&mut self) {
        signal(self.child.id(), "CONT");
        signal(self.child.id(), "KILL");
        let _ = self.child.wait();
    }
}

/// The mock upstream binary.
pub struct UpstreamGuard {
    pub addr: SocketAddr,
    child: Option<Child>,
    log: PathBuf,
    _dir: TempDir,
}

impl UpstreamGuard {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = dir.path().join("upstream.log");
        let child = Command::new(tool_binary("mock-upstream"))
            .args(["--listen", &addr.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start mock-upstream");
        let guard = UpstreamGuard {
            addr,
            child: Some(child),
            log,
            _dir: dir,
        };
        wait_for("mock-upstream /healthz", Duration::from_secs(10), || {
            Client::connect(addr)
                .ok()?
                .get("/healthz")
                .ok()
                .filter(|r| r.status == 200)
        });
        guard
    }

    pub fn stats(&self) -> serde_json::Value {
        self.stats_at("/stats")
    }

    /// One of the upstream's stats pages (`/stats/llm`: the usage it reported).
    pub fn stats_at(&self, path: &str) -> serde_json::Value {
        let r = Client::connect(self.addr)
            .and_then(|mut c| c.get(path))
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{path} JSON: {e}"))
    }

    /// Requests the upstream received for one path.
    pub fn count(&self, path: &str) -> u64 {
        self.stats()["paths"][path].as_u64().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.stats()["total"].as_u64().unwrap_or(0)
    }

    /// When the upstream received each request for `path` (microseconds
    /// on its own clock, in order).
    pub fn times(&self, path: &str) -> Vec<u64> {
        self.arrivals(path).into_iter().map(|(t, _)| t).collect()
    }

    /// When the upstream received each request for `path`, with the
    /// request's `x-mock-seq` header if it had one (in order of time).
    pub fn arrivals(&self, path: &str) -> Vec<(u64, Option<u64>)> {
        let r = Client::connect(self.addr)
            .and_then(|mut c| c.get(&format!("/stats/arrivals?path={path}")))
            .expect("GET /stats/arrivals");
        serde_json::from_slice(&r.body).expect("arrivals JSON")
    }

    /// Stops it now (a dead upstream).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "KILL");
            let _ = child.wait();
        }
    }
}

impl Drop for UpstreamGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log("mock-upstream", &self.log);
        }
        self.kill();
    }
}

/// The gateway binary running a config.
pub struct GatewayGuard {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    child: Option<Child>,
    pub config_path: PathBuf,
    log: PathBuf,
    _dir: TempDir,
}

/// Ports for a gateway config: fill `{listen}` and `{admin}` in a template.
pub struct GatewayPorts {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
}

impl GatewayPorts {
    pub fn new() -> Self {
        GatewayPorts {
            listen: format!("127.0.0.1:{}", free_port()).parse().expect("addr"),
            admin: format!("127.0.0.1:{}", free_port()).parse().expect("addr"),
        }
    }
}

impl Default for GatewayPorts {
    fn default() -> Self {
        Self::new()
    }
}

impl GatewayGuard {
    /// Starts the gateway with `config` (`{listen}` and `{admin}` are filled
    /// in) and waits until it is ready; with Redis configured, until Redis is
    /// the backend in use.
    pub fn start(config: &str) -> Self {
        Self::start_opts(config, true)
    }

    pub fn start_opts(config: &str, wait_for_redis: bool) -> Self {
        let g = Self::launch(config);
        let wants_redis =
            wait_for_redis && config.contains("[redis]") && !config.contains("backend = \"local\"");
        g.wait_ready(wants_redis);
        g
    }

    /// Starts the gateway and returns at once, before it is ready.
    pub fn launch(config: &str) -> Self {
        let ports = GatewayPorts::new();
        let config = config
            .replace("{listen}", &ports.listen.to_string())
            .replace("{admin}", &ports.admin.to_string());
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("gateway.toml");
        fs::write(&config_path, &config).expect("write config");
        let log = dir.path().join("gateway.log");
        let child = Command::new(env!("CARGO_BIN_EXE_gateway"))
            .args(["run", "--config"])
            .arg(&config_path)
            .env(
                "GATEWAY_LOG",
                std::env::var("TEST_GATEWAY_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdout(fs::File::create(dir.path().join("stdout.log")).expect("log"))
            .stderr(fs::File::create(&log).expect("log"))
            .spawn()
            .expect("start gateway");
        GatewayGuard {
            addr: ports.listen,
            admin: ports.admin,
            child: Some(child),
            config_path,
            log,
            _dir: dir,
        }
    }

    /// Waits until `/readyz` answers 200 (with `wants_redis`, naming Redis
    /// as the backend) and the listener accepts; panics if that does not
    /// happen (the guard then stops the gateway and prints its log).
    pub fn wait_ready(&self, wants_redis: bool) {
        let admin = self.admin;
        let ready = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            wait_for("gateway /readyz", Duration::from_secs(20), || {
                let r = Client::connect(admin).ok()?.get("/readyz").ok()?;
                let body = String::from_utf8_lossy(&r.body).to_string();
                (r.status == 200 && (!wants_redis || body.contains("\"redis\""))).then_some(())
            })
        }));
        if ready.is_err() {
            panic!("gateway did not become ready"); // Drop prints its log
        }
        // The listener is bound by the time admin answers, but be sure.
        wait_for("gateway listener", Duration::from_secs(10), || {
            TcpStream::connect(self.addr).ok()
        });
    }

    pub fn client(&self) -> Client {
        Client::connect(self.addr).expect("connect to gateway")
    }

    pub fn admin_get(&self, path: &str) -> Response {
        Client::connect(self.admin)
            .and_then(|mut c| c.get(path))
            .expect("admin request")
    }

    /// The Prometheus text, once every request the gateway has started is
    /// counted in it: a client can read its answer before the gateway logs
    /// and counts it. (A test that holds requests open on purpose gets the
    /// text after a bounded wait.)
    pub fn metrics(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let text = self.raw_metrics();
            let in_flight = series(&text, "gateway_requests_in_flight")
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            if in_flight == 0.0 || Instant::now() >= deadline {
                return text;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The Prometheus text as it is now, requests in flight or not.
    pub fn raw_metrics(&self) -> String {
        String::from_utf8_lossy(&self.admin_get("/metrics").body).to_string()
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Sends a signal (e.g. "HUP") to the running gateway.
    pub fn signal(&self, sig: &str) {
        if let Some(child) = &self.child {
            signal(child.id(), sig);
        }
    }

    /// Rewrites the gateway's config file in place (filling `{listen}`/`{admin}`).
    pub fn rewrite_config(&self, config: &str) {
        let config = config
            .replace("{listen}", &self.addr.to_string())
            .replace("{admin}", &self.admin.to_string());
        // Write then rename, as editors and Kubernetes do: never a half file.
        let tmp = self.config_path.with_extension("tmp");
        fs::write(&tmp, config).expect("write config");
        fs::rename(&tmp, &self.config_path).expect("replace config");
    }

    /// Waits until `/readyz` names `backend` ("redis" or "local").
    pub fn wait_backend(&self, backend: &str, timeout: Duration) {
        wait_for(&format!("backend {backend}"), timeout, || {
            self.admin_get("/readyz")
                .text()
                .contains(&format!("\"{backend}\""))
                .then_some(())
        });
    }

    /// The value of one Prometheus series (exact name and labels), or 0.
    pub fn metric(&self, name: &str) -> f64 {
        series(&self.metrics(), name)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    /// A key's quota `used` for one limit (`quota-month`, ...), as
    /// `/limits` tells it.
    pub fn quota_used(&self, id: &str, policy: &str) -> u64 {
        let v = self.admin_get(&format!("/limits?key={id}")).json();
        let b = v["buckets"]
            .as_array()
            .and_then(|l| l.iter().find(|b| b["tier"] == policy))
            .unwrap_or_else(|| panic!("no {policy} bucket in {v}"));
        b["used"]
            .as_u64()
            .unwrap_or_else(|| panic!("no used in {b}"))
    }

    /// SIGTERM, then waits for the exit; returns the status and how long it took.
    pub fn terminate(&mut self, timeout: Duration) -> (Option<ExitStatus>, Duration) {
        let started = Instant::now();
        let Some(mut child) = self.child.take() else {
            return (None, Duration::ZERO);
        };
        signal(child.id(), "TERM");
        let status = reap(&mut child, timeout);
        (status, started.elapsed())
    }

    /// SIGKILL: gone at once, with nothing given back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "KILL");
            reap(&mut child, Duration::from_secs(10));
        }
    }

    /// SIGINT (fast shutdown), then waits.
    pub fn stop_now(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "INT");
            reap(&mut child, Duration::from_secs(10));
        }
    }
}

impl Drop for GatewayGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log("gateway", &self.log);
        }
        self.stop_now();
    }
}

/// Sends raw bytes on a fresh connection and returns everything read until
/// the peer closes or `timeout` passes (for malformed-request tests).
pub fn raw_exchange(addr: SocketAddr, bytes: &[u8], timeout: Duration) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(timeout)).expect("timeout");
    s.write_all(bytes).expect("write");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}
