//! A global limit split into sub-buckets (`shards`), through real gateways:
//! on one Redis shared by three replicas, and on a Redis Cluster, where the
//! sub-buckets sit on different masters. Every count is against the exact
//! bound: the sub-buckets together hold the limit, never more.

use crate::support;

use support::topology::ClusterGuard;
use support::{GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

/// `instances` replicas on `redis`, the route `/match` limited globally to
/// `capacity` in `shards`; `more` goes in before the upstream (a tier).
fn config(
    redis: &str,
    instances: u32,
    up: &UpstreamGuard,
    capacity: u64,
    shards: u64,
    more: &str,
) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
instances = {instances}
retry_after_jitter_ms = 0

[redis]
{redis}
timeout_ms = 200
probe_interval_ms = 100

{more}

[[upstreams]]
name = "up"
servers = ["{addr}"]

[[routes]]
name = "match"
path_prefix = "/match"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = {capacity}, refill_per_sec = 0.001, scope = "global", shards = {shards} }}
"#,
        addr = up.addr
    )
}

/// Sends `per_gateway` requests through each gateway in turn (one from each,
/// then again); returns the statuses and the last admitted response's
/// X-RateLimit-Limit.
fn flood(gws: &[GatewayGuard], per_gateway: usize) -> (Vec<u16>, Option<String>) {
    let mut clients: Vec<_> = gws.iter().map(|g| g.client()).collect();
    let mut statuses = Vec::new();
    let mut limit = None;
    for _ in 0..per_gateway {
        for c in clients.iter_mut() {
            let r = c.get("/match").expect("request");
            if r.status == 200 {
                limit = r.header("x-ratelimit-limit").map(str::to_string);
            } else {
                assert_eq!(r.status, 429, "{:?}", r.text());
                assert!(r.header("retry-after").is_some());
            }
            statuses.push(r.status);
        }
    }
    (statuses, limit)
}

#[test]
fn three_replicas_on_one_redis_admit_exactly_a_split_limit() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let url = format!("urls = [\"{}\"]", redis.url());
    let gws: Vec<GatewayGuard> = (0..3)
        .map(|_| GatewayGuard::start(&config(&url, 3, &up, 12, 4, "")))
        .collect();
    // 24 requests, 8 per replica, each replica dealing its own to the 4
    // sub-buckets of 3 in turn: every sub-bucket is offered 6 and admits 3.
    let (statuses, limit) = flood(&gws, 8);
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    println!("split limit of 12 in 4 sub-buckets, 3 replicas, 24 requests: {admitted} admitted (bound 12)");
    assert_eq!(admitted, 12);
    assert_eq!(up.count("/match"), 12, "the upstream saw only the admitted");
    assert_eq!(
        limit.as_deref(),
        Some("12"),
        "a sub-bucket speaks for the whole limit"
    );
    let keys = redis.cmd(&["KEYS", "rl:route:match:*"]);
    assert_eq!(keys.lines().count(), 4, "{keys}");
    // An operator sees each sub-bucket (its share, spent) and resets them all.
    let limits = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
            .arg("limits")
            .args(args)
            .args(["--ip", "127.0.0.1", "--route", "match", "--config"])
            .arg(&gws[0].config_path)
            .output()
            .expect("gateway limits");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let shown = limits(&["show"]);
    for i in 1..=4 {
        assert!(
            shown.contains(&format!("match ({i} of 4)")),
            "sub-bucket {i} listed:\n{shown}"
        );
    }
    let spent = shown
        .lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.windows(3).any(|w| w == ["token_bucket", "3", "0"])
        })
        .count();
    assert_eq!(spent, 4, "each holds 3, all spent:\n{shown}");
    limits(&["reset"]);
    assert_eq!(redis.cmd(&["KEYS", "rl:route:match:*"]).trim(), "");
}

#[test]
fn on_a_cluster_each_sub_bucket_lives_on_its_own_master() {
    let cluster = ClusterGuard::start();
    let up = UpstreamGuard::start();
    let redis = cluster.redis_section();
    let gws = [GatewayGuard::start(&config(&redis, 1, &up, 12, 3, ""))];
    let (statuses, _) = flood(&gws, 16);
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    println!("split limit of 12 in 3 sub-buckets on a 3-master cluster, 16 requests: {admitted} admitted (bound 12)");
    assert_eq!(admitted, 12);
    assert_eq!(up.count("/match"), 12);
    let per_master: Vec<usize> = cluster
        .masters()
        .iter()
        .map(|&i| {
            let node = cluster.nodes[i].as_ref().expect("live master");
            node.cmd(&["KEYS", "rl:route:match:*"]).lines().count()
        })
        .collect();
    assert_eq!(per_master, [1, 1, 1], "one sub-bucket per master");
}

/// Requests another tier rejects spend nothing on the split limit and give
/// their turn back: client A, over its IP limit, sends between client B's
/// requests, and B still gets everything the limit has left (dealt without
/// giving turns back, B's requests would all meet the same sub-bucket and
/// stop at half).
#[test]
fn rejections_by_another_tier_do_not_unbalance_the_sub_buckets() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let url = format!("urls = [\"{}\"]", redis.url());
    let ip_tier = "[clients]\ntrusted_proxies = [\"127.0.0.1/32\"]\n\n\
                   [tiers.ip]\nalgorithm = \"token_bucket\"\ncapacity = 1\nrefill_per_sec = 0.001";
    let gw = GatewayGuard::start(&config(&url, 1, &up, 8, 2, ip_tier));
    let mut c = gw.client();
    let mut send = |client: &str| {
        c.request("GET", "/match", &[("x-forwarded-for", client)], b"")
            .expect("request")
            .status
    };
    // A's first request spends its one IP token (and one of the 8).
    assert_eq!(send("10.0.0.1"), 200);
    let mut b_admitted = 0;
    for i in 0..20 {
        assert_eq!(send("10.0.0.1"), 429, "A is over its IP limit");
        // B's IP bucket holds 1: each B request comes from its own address.
        if send(&format!("10.0.1.{i}")) == 200 {
            b_admitted += 1;
        }
    }
    println!("split limit of 8 in 2 sub-buckets, A rejected by its IP tier between B's requests: B admitted {b_admitted} (bound 7)");
    assert_eq!(b_admitted, 7, "everything the limit had left after A's one");
    assert_eq!(up.count("/match"), 8);
}
