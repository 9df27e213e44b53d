//! Usage for billing: `gateway usage` and `GET /usage` list each
//! key's `used` of a quota period, exact against what the upstream
//! received, for 10,000 keys sprayed at random over three replicas (with
//! leases on, and hot keys that take them); an ended period is read as
//! well as the current one, and is kept `quota_retention_days`.

use crate::support;

use std::collections::HashMap;
use std::time::Duration;

use ratelimit_gateway::calendar::{self, Period};
use support::{wait_for, Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER_2_THREADS};

const KEYS: usize = 10_000;

fn config(redis: &RedisGuard, up: &UpstreamGuard) -> String {
    let mut keys = String::with_capacity(KEYS * 64);
    for i in 0..KEYS {
        keys.push_str(&format!(
            "[[api_keys]]\nid = \"u{i}\"\nkey = \"u{i}-secret\"\nplan = \"billed\"\n"
        ));
    }
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
instances = 3
quota_retention_days = 400

[redis]
urls = ["{}"]
timeout_ms = 200

[plans.billed]
capacity = 100000
refill_per_sec = 100000
quotas = [{{ limit = 1000000, period = "month" }}]

{keys}
[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "all"
path_prefix = "/"
upstream = "up"
"#,
        redis.url(),
        up.addr
    )
}

fn usage_cli(gw: &GatewayGuard, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .arg("usage")
        .arg("--config")
        .arg(&gw.config_path)
        .args(args)
        .output()
        .expect("run gateway usage");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// id -> used, from CSV with a header line.
fn parse_csv(text: &str) -> HashMap<String, u64> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("key,period,start,end,used,limit"));
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 6, "{l}");
            assert_eq!((f[1], f[5]), ("month", "1000000"), "{l}");
            (f[0].to_string(), f[4].parse().expect("used"))
        })
        .collect()
}

#[test]
fn usage_is_exact_for_ten_thousand_keys_over_three_replicas() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let cfg = config(&redis, &up);
    let gws: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&cfg)).collect();

    // 30,000 requests from six threads, each to a random replica: half to
    // random keys of the 10,000, half to ten hot keys (they take leases).
    let addrs: Vec<_> = gws.iter().map(|g| g.addr).collect();
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let addrs = addrs.clone();
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                let mut conns: Vec<Client> = addrs
                    .iter()
                    .map(|a| Client::connect(*a).expect("connect"))
                    .collect();
                for _ in 0..5_000 {
                    let i = if rng.bool() {
                        rng.usize(..10)
                    } else {
                        rng.usize(..KEYS)
                    };
                    let r = conns[rng.usize(..3)]
                        .request(
                            "GET",
                            &format!("/u/u{i}"),
                            &[("x-api-key", &format!("u{i}-secret"))],
                            b"",
                        )
                        .expect("request");
                    assert_eq!(r.status, 200);
                }
            });
        }
    });
    // Leases go back within a period and a quarter of the last request.
    wait_for("every lease back", Duration::from_secs(10), || {
        gws.iter()
            .all(|g| g.metric("gateway_lease_tokens_held") == 0.0)
            .then_some(())
    });
    let leased: f64 = gws
        .iter()
        .map(|g| g.metric("gateway_limiter_decisions_total{path=\"lease\"}"))
        .sum();

    let stats = up.stats();
    let upstream: HashMap<String, u64> = stats["paths"]
        .as_object()
        .expect("paths")
        .iter()
        .filter_map(|(p, n)| Some((p.strip_prefix("/u/")?.to_string(), n.as_u64()?)))
        .collect();
    assert_eq!(upstream.values().sum::<u64>(), 30_000);

    let (ok, csv, err) = usage_cli(&gws[0], &["--period", "month"]);
    assert!(ok, "{err}");
    let billed = parse_csv(&csv);
    let wrong: Vec<_> = upstream
        .iter()
        .filter(|(id, n)| billed.get(*id) != Some(n))
        .take(5)
        .collect();
    println!(
        "FIGURES usage: {} keys with traffic, {} rows billed, {} requests ({leased} decided on a lease); keys whose used differs from the upstream's count: {}",
        upstream.len(),
        billed.len(),
        upstream.values().sum::<u64>(),
        upstream.iter().filter(|(id, n)| billed.get(*id) != Some(n)).count()
    );
    assert!(wrong.is_empty(), "used != upstream count: {wrong:?}");
    assert_eq!(billed.len(), upstream.len(), "a row per key with traffic");

    // The admin endpoint says the same, as JSON lines.
    let r = gws[1].admin_get("/usage?period=month&format=jsonl");
    assert_eq!(r.status, 200, "{}", r.text());
    let lines: HashMap<String, u64> = r
        .text()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            (
                v["key"].as_str().unwrap().to_string(),
                v["used"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(lines, billed);
    let bad = gws[1].admin_get("/usage?period=year");
    assert_eq!(bad.status, 400);
    assert!(bad.text().contains("is not one of"), "{}", bad.text());

    // Kept 400 days past the period's end.
    let hot = redis
        .keys()
        .into_iter()
        .find(|k| k.contains(":quota:month:") && k.ends_with(":k:u3"))
        .expect("u3's count");
    let ttl_days = redis.cmd(&["PTTL", &hot]).trim().parse::<i64>().unwrap() / 86_400_000;
    assert!((400..=432).contains(&ttl_days), "PTTL {ttl_days} days");

    // An ended period reads as the current one: last month's count for
    // u5, as limiter.lua wrote it then.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    let this = calendar::span(Period::Month, chrono_tz::UTC, now);
    let last = calendar::span(Period::Month, chrono_tz::UTC, this.start - 1);
    let name = hot
        .replace(
            &format!("q-month-{}", this.start / 1_000_000),
            &format!("q-month-{}", last.start / 1_000_000),
        )
        .replace(":k:u3", ":k:u5");
    redis.cmd(&["SET", &name, &format!("{} 17", last.end)]);
    let day = chrono::DateTime::from_timestamp_micros(last.start + 86_400_000_000)
        .unwrap()
        .format("%Y-%m-%d")
        .to_string();
    let (ok, csv, err) = usage_cli(&gws[0], &["--period", "month", "--at", &day]);
    assert!(ok, "{err}");
    assert_eq!(parse_csv(&csv), HashMap::from([("u5".to_string(), 17)]));
    let (ok, _, err) = usage_cli(&gws[0], &["--period", "fortnight"]);
    assert!(!ok && err.contains("\"week\""), "{err}");
}
