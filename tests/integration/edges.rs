//! The shared limit at its edges, through real gateway processes on one real
//! Redis: start-up, a Redis stall on one and three replicas, more replicas
//! running than configured, and a Redis that refuses the gateway. Each test
//! asserts admitted requests against the exact bound (counts, not timings)
//! and prints a `FIGURES` line for the record.

use crate::support;

use std::time::{Duration, Instant};

use support::topology::{quoted, SentinelGuard, MASTER_NAME};
use support::{wait_for, Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

/// A gateway on `redis_url` with a key plan, an IP tier and a route limit
/// (each `None`: off). `extra_limiter` goes into `[limiter]`.
struct Setup<'a> {
    /// The `redis.urls` list's items, quoted.
    redis_urls: String,
    up: &'a UpstreamGuard,
    instances: u32,
    ip: Option<&'a str>,
    plan: Option<(u64, f64)>,
    route: Option<&'a str>,
    server_extra: &'a str,
    redis_extra: &'a str,
}

impl Setup<'_> {
    fn config(&self) -> String {
        let ip = self
            .ip
            .map_or(String::new(), |t| format!("[tiers.ip]\n{t}\n"));
        let plan = self.plan.map_or(String::new(), |(c, r)| {
            format!(
                "[plans.p]\ncapacity = {c}\nrefill_per_sec = {r:?}\n\n\
                 [[api_keys]]\nid = \"client-a\"\nkey = \"secret-a\"\nplan = \"p\"\n"
            )
        });
        let route = self
            .route
            .map_or(String::new(), |l| format!("limit = {l}\n"));
        format!(
            r#"
{SERVER}
{server_extra}

[limiter]
backend = "redis"
on_redis_failure = "local"
instances = {instances}
retry_after_jitter_ms = 0

[redis]
urls = [{urls}]
timeout_ms = 50
probe_interval_ms = 100
{redis_extra}

[clients]
trusted_proxies = []

{ip}
{plan}

[[upstreams]]
name = "up"
servers = ["{addr}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
{route}
"#,
            server_extra = self.server_extra,
            instances = self.instances,
            urls = self.redis_urls,
            redis_extra = self.redis_extra,
            addr = self.up.addr,
        )
    }
}

fn setup<'a>(redis_url: String, up: &'a UpstreamGuard) -> Setup<'a> {
    Setup {
        redis_urls: format!("\"{redis_url}\""),
        up,
        instances: 1,
        ip: None,
        plan: None,
        route: None,
        server_extra: "",
        redis_extra: "",
    }
}

const KEY: (&str, &str) = ("x-api-key", "secret-a");

fn send(c: &mut Client, headers: &[(&str, &str)]) -> u16 {
    c.request("GET", "/r", headers, b"")
        .map(|r| r.status)
        .unwrap_or(0)
}

/// Connects as soon as the listener accepts (before `/readyz` says ready).
fn first_connection(gw: &GatewayGuard) -> Client {
    wait_for("the listener", Duration::from_secs(20), || {
        Client::connect(gw.addr).ok()
    })
}

/// Requests sent right after the port opens are decided by Redis: an IP
/// bucket of 5 admits 5 of 8, and a key plan of 5 with `instances = 3`
/// admits 5, not its local share (before: 7, then 1).
#[test]
fn startup_decides_on_redis_from_the_first_request() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let mut ip = setup(redis.url(), &up);
    ip.ip = Some(
        r#"algorithm = "token_bucket"
capacity = 5
refill_per_sec = 0.001"#,
    );
    let gw = GatewayGuard::launch(&ip.config());
    let mut c = first_connection(&gw);
    let ip_admitted = (0..8).filter(|_| send(&mut c, &[]) == 200).count();

    let mut key = setup(redis.url(), &up);
    key.instances = 3;
    key.plan = Some((5, 0.001));
    let gw3 = GatewayGuard::launch(&key.config());
    let mut c = first_connection(&gw3);
    let key_admitted = (0..8).filter(|_| send(&mut c, &[KEY]) == 200).count();
    eprintln!(
        "FIGURES startup: ip bucket 5: admitted {ip_admitted} of 8 (bound 5); \
         key plan 5 with instances=3: admitted {key_admitted} of 8 (bound 5)"
    );
    assert_eq!(ip_admitted, 5, "the IP bucket of 5, decided by Redis");
    assert_eq!(key_admitted, 5, "the key plan of 5, not a third of it");
    assert_eq!(
        gw.metric("gateway_fallback_transitions_total{to=\"local\"}"),
        0.0
    );
}

/// While the start-up attempt waits for a Redis that does not answer,
/// `/readyz` is 503 and requests wait; when the wait is over, the gateway
/// is ready on the fallback and the waiting requests are answered.
#[test]
fn readyz_waits_for_the_startup_attempt() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    redis.signal("STOP");
    let mut s = setup(redis.url(), &up);
    s.server_extra = "startup_redis_wait_ms = 3000";
    s.route = Some(
        r#"{ algorithm = "token_bucket", capacity = 100, refill_per_sec = 1.0, scope = "global" }"#,
    );
    let started = Instant::now();
    let gw = GatewayGuard::launch(&s.config());
    let first = wait_for("the admin listener", Duration::from_secs(20), || {
        Client::connect(gw.admin).ok()?.get("/readyz").ok()
    });
    assert_eq!(
        first.status,
        503,
        "not ready during the attempt: {}",
        first.text()
    );
    assert!(first.text().contains("waiting_for"), "{}", first.text());
    let mut c = first_connection(&gw);
    let status = send(&mut c, &[]);
    let answered = started.elapsed();
    gw.wait_ready(false);
    let ready = gw.admin_get("/readyz");
    redis.signal("CONT");
    eprintln!(
        "FIGURES startup-wait: first /readyz {} ; a request sent during the wait answered {status} \
         after {answered:?} (startup_redis_wait_ms 3000); then {}",
        first.status,
        ready.text()
    );
    assert_eq!(status, 200, "the request waiting for the attempt is served");
    assert_eq!(
        gw.metric(
            "gateway_ratelimit_decisions_total{tier=\"route\",route=\"r\",decision=\"allowed\"}"
        ),
        1.0,
        "decided by the limiter once the attempt ended"
    );
    assert!(ready.text().contains("\"local\""), "{}", ready.text());
}

/// Spends `n` of the client's key plan through Redis, spread over `gws`.
fn spend(conns: &mut [Client], n: usize) -> usize {
    let k = conns.len();
    (0..n)
        .filter(|i| send(&mut conns[i % k], &[KEY]) == 200)
        .count()
}

/// A Redis stall (SIGSTOP) on `replicas` gateways sharing a key plan of 10
/// at 0.2/s: the client spends 9 through Redis, sprays every replica during
/// the stall and after the failback. Admitted in all is at most the exact
/// bound: 10 plus the refill over the whole run.
fn stall_bound(replicas: usize) -> (usize, f64) {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let mut s = setup(redis.url(), &up);
    s.instances = replicas as u32;
    s.plan = Some((10, 0.2));
    let gws: Vec<GatewayGuard> = (0..replicas)
        .map(|_| GatewayGuard::start(&s.config()))
        .collect();
    for g in &gws {
        wait_for("every replica counted", Duration::from_secs(10), || {
            g.admin_get("/readyz")
                .text()
                .contains(&format!("\"replicas\":{replicas}"))
                .then_some(())
        });
    }
    let mut conns: Vec<Client> = gws.iter().map(|g| g.client()).collect();
    let t0 = Instant::now();
    let mut admitted = spend(&mut conns, 9);
    assert_eq!(admitted, 9, "9 of 10 through Redis");
    redis.signal("STOP");
    // The first requests wait for the breaker, then every replica decides locally.
    admitted += spend(&mut conns, 3 * replicas);
    for g in &gws {
        g.wait_backend("local", Duration::from_secs(10));
    }
    admitted += spend(&mut conns, 20);
    std::thread::sleep(Duration::from_millis(500));
    admitted += spend(&mut conns, 20);
    redis.signal("CONT");
    for g in &gws {
        g.wait_backend("redis", Duration::from_secs(15));
    }
    admitted += spend(&mut conns, 20);
    let elapsed = t0.elapsed().as_secs_f64();
    let charged: f64 = gws
        .iter()
        .map(|g| g.metric("gateway_fallback_debts_charged_total"))
        .sum();
    let bound = (10.0 + 0.2 * elapsed).floor();
    eprintln!(
        "FIGURES stall-{replicas}-replicas: admitted {admitted} over {elapsed:.2} s, \
         exact bound {bound} (10 + 0.2/s x {elapsed:.2} s); debts charged on failback: {charged} \
         (before this change: 9 + 10 fresh local + a fresh shared bucket)"
    );
    assert!(
        admitted as f64 <= bound,
        "{replicas} replicas: admitted {admitted} > bound {bound}"
    );
    (admitted, bound)
}

#[test]
fn a_stall_on_one_replica_keeps_the_bound() {
    stall_bound(1);
}

#[test]
fn a_stall_on_three_replicas_keeps_the_bound() {
    stall_bound(3);
}

/// Five replicas configured as `instances = 3`: the live count read from
/// Redis replaces the guess, so with Redis down a client spraying all five
/// gets the shared limit of 30, not 5 x 30/3 = 50.
#[test]
fn the_live_replica_count_replaces_the_configured_one() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let mut s = setup(redis.url(), &up);
    s.instances = 3;
    s.route = Some(
        r#"{ algorithm = "token_bucket", capacity = 30, refill_per_sec = 0.001, scope = "global" }"#,
    );
    let gws: Vec<GatewayGuard> = (0..5).map(|_| GatewayGuard::start(&s.config())).collect();
    for g in &gws {
        wait_for("five replicas counted", Duration::from_secs(10), || {
            g.admin_get("/readyz")
                .text()
                .contains("\"replicas\":5")
                .then_some(())
        });
    }
    assert_eq!(gws[0].metric("gateway_limiter_replicas"), 5.0);
    drop(redis); // SIGKILL
    for g in &gws {
        g.wait_backend("local", Duration::from_secs(15));
    }
    let mut conns: Vec<Client> = gws.iter().map(|g| g.client()).collect();
    let sent = 100;
    let admitted = (0..sent)
        .filter(|i| send(&mut conns[i % 5], &[]) == 200)
        .count();
    eprintln!(
        "FIGURES scale-out: 5 replicas running, instances = 3, Redis down: admitted {admitted} \
         of {sent} (bound 30; with the configured count: 5 x 10 = 50)"
    );
    assert_eq!(admitted, 30, "the shared limit of 30 across five replicas");
}

/// A Redis that refuses the gateway is loud: an error line naming the
/// reason, a counter, and `/readyz` saying why (never the password).
#[test]
fn a_refusing_redis_is_loud() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start_with_password(&[], "right-password");
    // An ACL user that may log in but not run the limiter's commands.
    assert!(redis
        .cmd(&[
            "ACL",
            "SETUSER",
            "limited",
            "on",
            ">user-password",
            "~*",
            "+ping",
            "+get"
        ])
        .contains("OK"));
    let cases = [
        (
            "wrong password",
            format!("redis://:wrong-password@127.0.0.1:{}", redis.port),
            "auth",
        ),
        (
            "database out of range",
            format!("redis://:right-password@127.0.0.1:{}/99", redis.port),
            "database",
        ),
        (
            "ACL without the limiter's commands",
            format!("redis://limited:user-password@127.0.0.1:{}", redis.port),
            "permission",
        ),
    ];
    for (what, url, reason) in cases {
        let gw = GatewayGuard::start_opts(&setup(url, &up).config(), false);
        let series = format!("gateway_redis_errors_total{{reason=\"{reason}\"}}");
        wait_for(&format!("{what}: counted"), Duration::from_secs(10), || {
            (gw.metric(&series) >= 1.0).then_some(())
        });
        let ready = gw.admin_get("/readyz").text();
        let log = gw.log();
        eprintln!("FIGURES refused ({what}): /readyz {ready}");
        assert!(
            ready.contains(&format!("\"redis_error_reason\":\"{reason}\"")),
            "{what}: {ready}"
        );
        assert!(
            log.lines()
                .any(|l| l.contains("ERROR") && l.contains("refuses this gateway")),
            "{what}: an error line in the log"
        );
        for secret in ["wrong-password", "right-password", "user-password"] {
            assert!(!ready.contains(secret), "{what}: /readyz shows a password");
            assert!(!log.contains(secret), "{what}: the log shows a password");
        }
    }
}

/// A variable the URL names but the environment lacks (`${REDIS_PASSWORD}`
/// in a Deployment that forgot the Secret) stops `run` with the key, its
/// line and the variable, instead of running on local buckets forever.
#[test]
fn an_unset_variable_in_the_redis_url_stops_the_start() {
    let up = UpstreamGuard::start();
    let cfg = setup(
        "redis://:${GW_EDGE_UNSET_PASSWORD}@127.0.0.1:6399".into(),
        &up,
    )
    .config()
    .replace("{listen}", "127.0.0.1:0")
    .replace("{admin}", "127.0.0.1:0");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, &cfg).expect("config");
    let line = cfg
        .lines()
        .position(|l| l.starts_with("urls"))
        .expect("urls")
        + 1;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("GW_EDGE_UNSET_PASSWORD")
        .output()
        .expect("gateway");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!(
            "redis.urls[0] (line {line}): environment variable GW_EDGE_UNSET_PASSWORD is not set"
        )),
        "{err}"
    );
}

/// Sentinel in front of a password-protected master: the URL's password
/// reaches the master the sentinels name, and requests are decided there.
#[test]
fn sentinel_passes_credentials_to_the_master() {
    let up = UpstreamGuard::start();
    let sentinels = SentinelGuard::start_with(Some("s3cret-pw"));
    let extra = format!("mode = \"sentinel\"\nsentinel_master = \"{MASTER_NAME}\"");
    let mut s = setup(String::new(), &up);
    s.redis_urls = quoted(&sentinels.urls());
    s.redis_extra = &extra;
    s.route = Some(
        r#"{ algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.001, scope = "global" }"#,
    );
    let route_cfg = s.config();
    let gw = GatewayGuard::start(&route_cfg);
    let mut c = gw.client();
    let admitted = (0..5).filter(|_| send(&mut c, &[]) == 200).count();
    let master = sentinels.master.as_ref().expect("master");
    let evals = master.calls("evalsha");
    eprintln!(
        "FIGURES sentinel-auth: admitted {admitted} of 5 (bound 3); EVALSHA on the master: {evals}"
    );
    assert_eq!(admitted, 3);
    assert!(evals >= 1, "decided on the master");
    assert!(gw.admin_get("/readyz").text().contains("\"redis\""));
}

/// Every counter with a closed label set is exported at 0 from start-up.
#[test]
fn closed_label_counters_start_at_zero() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start();
    let gw = GatewayGuard::start(&setup(redis.url(), &up).config());
    let m = gw.metrics();
    for series in [
        "gateway_config_reloads_total{result=\"ok\"} 0",
        "gateway_config_reloads_total{result=\"error\"} 0",
        "gateway_fallback_transitions_total{to=\"local\"} 0",
        "gateway_fallback_transitions_total{to=\"redis\"} 0",
        "gateway_redis_errors_total{reason=\"auth\"} 0",
        "gateway_redis_late_calls_total{verdict=\"redis\"} 0",
        "gateway_fallback_debts_charged_total 0",
        "gateway_requests_total{route=\"r\",status=\"429\"} 0",
        "gateway_requests_total{route=\"r\",status=\"5xx\"} 0",
        "gateway_ratelimit_decisions_total{tier=\"route\",route=\"r\",decision=\"rejected\"} 0",
    ] {
        assert!(m.lines().any(|l| l == series), "missing: {series}\n{m}");
    }
}

/// The Redis password from a file (a mounted Kubernetes Secret, with its
/// trailing newline): the gateway reaches a password-protected Redis with
/// it, and never prints it.
#[test]
fn the_redis_password_from_a_file() {
    let up = UpstreamGuard::start();
    let redis = RedisGuard::start_with_password(&[], "from-a-file");
    let dir = tempfile::tempdir().expect("temp dir");
    let secret = dir.path().join("redis-password");
    std::fs::write(&secret, "from-a-file\n").expect("secret");
    let mut s = setup(format!("redis://127.0.0.1:{}", redis.port), &up);
    let extra = format!("password_file = \"{}\"", secret.display());
    s.redis_extra = &extra;
    s.route = Some(
        r#"{ algorithm = "token_bucket", capacity = 2, refill_per_sec = 0.001, scope = "global" }"#,
    );
    let gw = GatewayGuard::start(&s.config());
    let mut c = gw.client();
    let admitted = (0..4).filter(|_| send(&mut c, &[]) == 200).count();
    assert_eq!(admitted, 2, "decided on the password-protected Redis");
    assert!(redis.calls("evalsha") >= 1);
    assert!(!gw.log().contains("from-a-file"));
    assert!(!gw.metrics().contains("from-a-file"));
}

/// A rotated password file: Redis's password changes and its clients are
/// dropped, so the gateway, reconnecting with the old one, is refused
/// (`auth`) and decides on its local share; once the mounted file holds the
/// new password (written as Kubernetes does, by a rename) the gateway reads
/// it, reconnects and fails back to Redis. No restart, no password in logs.
#[test]
fn a_rotated_password_file_is_read_again() {
    let up = UpstreamGuard::start();
    let mut redis = RedisGuard::start_with_password(&[], "old-password-1111");
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("redis-password");
    let write = |pw: &str| {
        let tmp = dir.path().join(".tmp-password");
        std::fs::write(&tmp, format!("{pw}\n")).expect("write");
        std::fs::rename(&tmp, &file).expect("rename");
    };
    write("old-password-1111");
    let mut s = setup(redis.url(), &up);
    s.plan = Some((1000, 0.001));
    let extra = format!("password_file = \"{}\"", file.display());
    s.redis_extra = &extra;
    let gw = GatewayGuard::start(&s.config());
    let mut c = gw.client();
    assert_eq!(send(&mut c, &[KEY]), 200);

    redis.rotate_password("new-password-2222");
    redis.cmd(&["CLIENT", "KILL", "TYPE", "normal"]);
    wait_for(
        "refused with the old password",
        Duration::from_secs(10),
        || {
            send(&mut gw.client(), &[KEY]);
            let r = gw.admin_get("/readyz").json();
            (r["backend"] == "local" && r["redis_error_reason"] == "auth").then_some(())
        },
    );
    let before = redis.calls("evalsha");
    write("new-password-2222");
    let t = Instant::now();
    gw.wait_backend("redis", Duration::from_secs(10));
    let took = t.elapsed();
    assert_eq!(send(&mut gw.client(), &[KEY]), 200);
    assert!(redis.calls("evalsha") > before, "decided by Redis again");
    assert!(
        gw.log().contains("redis.password_file changed"),
        "{}",
        gw.log()
    );
    // Deleted while running: said once (the password read last stays in
    // use), and nothing breaks.
    std::fs::remove_file(&file).expect("delete");
    wait_for("the deletion logged", Duration::from_secs(10), || {
        gw.log()
            .contains("redis.password_file cannot be read")
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        gw.log()
            .matches("redis.password_file cannot be read")
            .count(),
        1,
        "said once"
    );
    assert_eq!(send(&mut gw.client(), &[KEY]), 200);
    for secret in ["old-password-1111", "new-password-2222"] {
        assert!(!gw.log().contains(secret), "the log shows a password");
        assert!(!gw.admin_get("/readyz").text().contains(secret));
    }
    println!("FIGURES password-rotation: refused as auth with the old password; back on Redis {took:?} after the file changed");
}
