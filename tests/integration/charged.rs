//! Routes charged by the answer (`charge`), through the real gateway and
//! a mock LLM upstream (`mock-upstream`'s `/chat/completions`): each
//! request admitted on its estimate, then charged exactly what the
//! upstream reported, streamed or not; the faults table (a cut stream, no
//! usage, not JSON, a negative count, 1e30, a 5xx) charged as the README
//! says and counted; a request with no estimate refused before any bucket
//! is touched.

use crate::support;

use std::time::Duration;

use support::http::Client;
use support::{
    wait_for, AnswerHold, ForwarderGuard, GatewayGuard, RedisGuard, UpstreamGuard, SERVER,
};

const CHAT: &str = "/v1/chat/completions";

fn config(up: &UpstreamGuard, redis: &RedisGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["{redis}"]

[plans.llm]
capacity = 1000
refill_per_sec = 100
quotas = [{{ limit = 10000, period = "day" }}, {{ limit = 5000000, period = "month", cost = "response" }}]

[[api_keys]]
id = "tenant-a"
key = "tenant-a-secret"
plan = "llm"

[[upstreams]]
name = "llm"
servers = ["{up}"]

[[routes]]
name = "chat"
path_prefix = "{CHAT}"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["sse:usage.total_tokens", "json:usage.total_tokens", "header:x-usage-tokens"], estimate = "json:max_tokens", max = 32768, charge_failed = false, remaining_header = "x-ratelimit-remaining-tokens" }}
limit = {{ algorithm = "token_bucket", capacity = 200000, refill_per_sec = 3333, scope = "client", cost = "response" }}

[[routes]]
name = "chat-default"
path_prefix = "/v2/chat/completions"
methods = ["POST"]
upstream = "llm"
require_api_key = true
charge = {{ response = ["json:usage.total_tokens"], estimate = "json:max_tokens", default_estimate = 64, max = 1000 }}
"#,
        up = up.addr,
        redis = redis.url(),
    )
}

/// Three replicas' config: leases and shares on, one key on a plan with a
/// month's quota of units (`plan`: its bucket), the chat route with `route`
/// (its `charge` and `limit` lines).
fn replicas_config(up: &UpstreamGuard, redis: &RedisGuard, plan: &str, route: &str) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
instances = 3
retry_after_jitter_ms = 0

[limiter.leases]
enabled = true
period_ms = 100

[limiter.shares]
enabled = true
fraction = 0.25

# A loaded test host must not open the breaker on a healthy Redis: the
# test is about three replicas that Redis decides for (an answer ending
# after failback is settled on its local bucket only).
[redis]
urls = ["{redis}"]
timeout_ms = 250

[plans.llm]
{plan}
quotas = [{{ limit = 100000000, period = "month", cost = "response" }}]

[[api_keys]]
id = "tenant-a"
key = "tenant-a-secret"
plan = "llm"

[[upstreams]]
name = "llm"
servers = ["{up}"]

[[routes]]
name = "chat"
path_prefix = "{CHAT}"
methods = ["POST"]
upstream = "llm"
require_api_key = true
{route}
"#,
        up = up.addr,
        redis = redis.url(),
    )
}

fn chat(c: &mut Client, path: &str, body: &str, headers: &[(&str, &str)]) -> u16 {
    let mut h = vec![
        ("x-api-key", "tenant-a-secret"),
        ("content-type", "application/json"),
    ];
    h.extend_from_slice(headers);
    c.request("POST", path, &h, body.as_bytes())
        .map(|r| r.status)
        .unwrap_or(0)
}

/// The month's charged units as `/limits` tells them, once they stop
/// moving (settlements are sent every 100 ms).
fn settled_used(g: &GatewayGuard, want: u64) -> u64 {
    let mut last = 0;
    wait_for(
        "the settlements to reach Redis",
        Duration::from_secs(10),
        || {
            last = g.quota_used("tenant-a", "quota-month-units");
            (last == want).then_some(())
        },
    );
    last
}

#[test]
fn charged_units_are_what_the_upstream_reported_and_faults_as_the_table_says() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &redis));
    let mut c = g.client();

    // Streamed and not, tokens up to max_tokens (random), estimates of
    // every size: charged what the upstream said, not the estimates.
    let mut sent = 0;
    for i in 0..60u64 {
        let max = 1 + (i * 37) % 900;
        let stream = i % 2 == 0;
        let body = format!(r#"{{"model":"m","max_tokens":{max},"stream":{stream}}}"#);
        assert_eq!(chat(&mut c, CHAT, &body, &[]), 200, "request {i}");
        sent += 1;
    }
    let reported = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    assert!(reported > 0 && reported < sent * 900, "reported {reported}");
    assert_eq!(
        settled_used(&g, reported),
        reported,
        "used is what the upstream reported"
    );

    // The faults table, each on an estimate of 100.
    let body = r#"{"max_tokens":100,"stream":true}"#;
    let json_body = r#"{"max_tokens":100}"#;
    let before = reported;
    for (fault, body, status) in [
        ("cut", body, 200),
        ("no_usage", json_body, 200),
        ("not_json", json_body, 200),
        ("negative", json_body, 200),
        ("huge", json_body, 200),
        ("status_500", json_body, 500),
        ("header", json_body, 200),
    ] {
        let mut c = g.client();
        let got = chat(
            &mut c,
            CHAT,
            body,
            &[("x-mock-fault", fault), ("x-mock-tokens", "7")],
        );
        // A cut stream reaches the client cut: no whole answer.
        if fault != "cut" {
            assert_eq!(got, status, "{fault}");
        }
    }
    let reported = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    assert_eq!(reported, before + 7, "only the header case reports usage");
    // cut: refunded (an upstream failure); no usage, not JSON, negative,
    // 1e30: the estimate; a 5xx: refunded; the header: its 7.
    let want = before + 4 * 100 + 7;
    assert_eq!(settled_used(&g, want), want);
    let m = g.metrics();
    for (reason, n) in [
        ("read", 61.0),
        ("failed", 2.0),
        ("missing", 1.0),
        ("not_json", 1.0),
        ("negative", 1.0),
        ("out_of_range", 1.0),
    ] {
        let name = format!("gateway_charged_requests_total{{reason=\"{reason}\"}}");
        assert_eq!(
            support::series(&m, &name).and_then(|v| v.parse::<f64>().ok()),
            Some(n),
            "{name}"
        );
    }
    // Logged, at most a line a second (the faults came within one).
    let lines = g.log().matches("the answer's cost was not read").count();
    assert!((1..=2).contains(&lines), "{lines} lines about unread costs");
    // The gateway kept serving through every fault.
    assert_eq!(chat(&mut g.client(), CHAT, json_body, &[]), 200);
}

#[test]
fn a_request_with_no_estimate_is_refused_before_any_bucket() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &redis));
    let mut c = g.client();
    let r = c
        .request(
            "POST",
            CHAT,
            &[("x-api-key", "tenant-a-secret")],
            br#"{"model":"m"}"#,
        )
        .expect("answer");
    assert_eq!(r.status, 400);
    assert!(
        r.text().contains("max_tokens"),
        "the 400 names the field: {}",
        r.text()
    );
    assert_eq!(up.count(CHAT), 0, "the upstream saw nothing");
    // Admitted: told what it has left in tokens (the route's bucket of
    // 200,000 and the month's 5,000,000, less this estimate). The route's
    // bucket is cut into standing shares (`[limiter.shares] charged`, on
    // by default: a share of 50,000 holds its `max`); before the shares
    // are usable the request is decided on the pool, which reports its own
    // 150,000; after, on the share, its 50,000 (docs/design/standing-shares.md).
    let r = c
        .request(
            "POST",
            CHAT,
            &[("x-api-key", "tenant-a-secret"), ("x-mock-tokens", "5")],
            br#"{"max_tokens":700}"#,
        )
        .expect("answer");
    assert_eq!(r.status, 200);
    let left: u64 = r
        .header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no remaining tokens: {:?}", r.headers));
    assert!(
        (149_299..=149_300).contains(&left) || (49_299..=49_300).contains(&left),
        "{left}"
    );
    // With a default estimate the same request is admitted on it.
    assert_eq!(
        chat(&mut c, "/v2/chat/completions", r#"{"model":"m"}"#, &[]),
        200
    );
    assert_eq!(
        g.quota_used("tenant-a", "quota-day"),
        2,
        "requests still count one each"
    );
}

/// A body that arrives in pieces (the field's name cut between two of
/// them) is read whole for its estimate, and reaches the upstream whole.
#[test]
fn a_body_in_pieces_is_read_whole_for_its_estimate() {
    use std::io::{Read, Write};
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let g = GatewayGuard::start(&config(&up, &redis));
    // `max_tokens` 1: the mock answers one token only if it read it too.
    let body = br#"{"model":"m","max_tokens":1}"#;
    let mut s = std::net::TcpStream::connect(g.addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-api-key: tenant-a-secret\r\n\
         content-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("head");
    for piece in [&body[..20], &body[20..]] {
        std::thread::sleep(Duration::from_millis(100));
        s.write_all(piece).expect("piece");
    }
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("x-ratelimit-remaining-tokens"),
        "admitted on its estimate: {answer}"
    );
    assert!(
        answer.contains(r#""total_tokens":1}"#),
        "the upstream read the body whole: {answer}"
    );
    assert_eq!(up.count(CHAT), 1, "the upstream saw it once");
}

/// Three replicas on one Redis, leases and shares on: one client with a
/// budget of 20,000 tokens a minute (a token bucket of 20,000 refilling
/// 333.33/s) and a monthly quota of tokens sends streamed and unstreamed
/// requests of random sizes to all three for over two minutes, a fifth of
/// them on a short estimate (no `max_tokens`: the default 256, while the
/// upstream reports up to 1,000). Over every 60 s the tokens the upstream
/// reported stay within the bucket's C + r·60 plus, for each request of the
/// window whose estimate was short, what it cost beyond it (the README's
/// bound); the month's `used` is what the upstream reported, exactly.
#[test]
fn three_replicas_hold_a_token_budget_and_count_every_reported_token() {
    const SECS: u64 = 125;
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let config = replicas_config(
        &up,
        &redis,
        "capacity = 1000\nrefill_per_sec = 100",
        r#"charge = { response = ["sse:usage.total_tokens", "json:usage.total_tokens"], estimate = "json:max_tokens", default_estimate = 256, max = 4096 }
limit = { algorithm = "token_bucket", capacity = 20000, refill_per_sec = 333.333333, scope = "client", cost = "response" }"#,
    );
    let gs: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&config)).collect();
    wait_for("three replicas counted", Duration::from_secs(15), || {
        gs.iter()
            .all(|g| g.metric("gateway_limiter_replicas") == 3.0)
            .then_some(())
    });
    let mut clients: Vec<Client> = gs.iter().map(|g| g.client()).collect();
    let mut rng = fastrand::Rng::with_seed(51);
    // Per request sent: when (µs on the upstream's clock, matched by
    // x-mock-seq), and how much its cost exceeded its estimate.
    let mut excess: std::collections::HashMap<u64, u64> = Default::default();
    let (mut admitted, mut refused) = (0u64, 0u64);
    let start = std::time::Instant::now();
    let mut seq = 0u64;
    while start.elapsed() < Duration::from_secs(SECS) {
        seq += 1;
        let short = rng.u8(0..5) == 0;
        let stream = rng.bool();
        let (body, tokens) = if short {
            let t = rng.u64(1..=1000);
            (format!(r#"{{"stream":{stream}}}"#), Some(t))
        } else {
            (
                format!(
                    r#"{{"max_tokens":{},"stream":{stream}}}"#,
                    rng.u64(1..=2000)
                ),
                None,
            )
        };
        let seq_s = seq.to_string();
        let tokens_s = tokens.map(|t| t.to_string()).unwrap_or_default();
        let mut headers = vec![("x-mock-seq", seq_s.as_str())];
        if tokens.is_some() {
            headers.push(("x-mock-tokens", tokens_s.as_str()));
        }
        let i = (seq % 3) as usize;
        match chat(&mut clients[i], CHAT, &body, &headers) {
            200 => {
                admitted += 1;
                if let Some(t) = tokens {
                    excess.insert(seq, t.saturating_sub(256));
                }
            }
            429 => refused += 1,
            other => panic!("request {seq}: status {other}"),
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    // What the upstream reported, with when (arrival order matches seq).
    let llm = up.stats_at("/stats/llm");
    let reports: Vec<(u64, u64)> = llm["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap()))
        .collect();
    let arrivals = up.arrivals(CHAT);
    assert_eq!(
        reports.len() as u64,
        admitted,
        "every admitted request reported"
    );
    assert_eq!(arrivals.len(), reports.len());
    // Reports are made in arrival order: the i-th report is the i-th arrival.
    let by_seq: Vec<(u64, u64, u64)> = arrivals
        .iter()
        .zip(&reports)
        .map(|((t, seq), (_, n))| (*t, *n, excess.get(&seq.expect("seq")).copied().unwrap_or(0)))
        .collect();
    let (cap, rate) = (20_000.0, 333.333333);
    let mut worst = f64::MIN;
    let mut most = 0;
    for (i, (t0, ..)) in by_seq.iter().enumerate() {
        let window: Vec<&(u64, u64, u64)> = by_seq[i..]
            .iter()
            .take_while(|(t, ..)| *t < t0 + 60_000_000)
            .collect();
        let tokens: u64 = window.iter().map(|w| w.1).sum();
        let slack: u64 = window.iter().map(|w| w.2).sum();
        let bound = cap + rate * 60.0 + slack as f64;
        worst = worst.max(tokens as f64 - bound);
        most = most.max(tokens);
    }
    let reported = llm["reported_total"].as_u64().expect("total");
    println!(
        "FIGURES charged three replicas: {admitted} admitted, {refused} refused over {SECS} s; \
         {reported} tokens reported; the most in any 60 s {most}; worst window against its bound {worst:+.0}"
    );
    assert!(worst <= 0.0, "a 60 s window over its bound by {worst}");
    assert!(
        refused > 0 && most as f64 > cap,
        "the budget was reached: most {most}, refused {refused}"
    );
    // Every reported token in the month's count, exactly, once the
    // settlements and leases are in.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut used = gs[0].quota_used("tenant-a", "quota-month-units");
    while used != reported && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        used = gs[0].quota_used("tenant-a", "quota-month-units");
    }
    assert_eq!(
        used, reported,
        "the month's used against what the upstream reported"
    );
}

/// The gateway's peak resident memory (VmHWM), in KiB.
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// A 100 MB answer, streamed and as one JSON body, through a `charge`
/// route: the gateway's peak memory stays within a few MB of what the same
/// answers through a plain route took (the cost is read as it passes,
/// never held), and it is charged what it reported.
#[test]
fn a_hundred_megabyte_answer_is_read_as_it_passes() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let plain = "\n[[routes]]\nname = \"plain\"\npath_prefix = \"/plain\"\nmethods = [\"POST\"]\nupstream = \"llm\"\n";
    let g = GatewayGuard::start(&(config(&up, &redis) + plain));
    let hundred_mb = (100u64 << 20).to_string();
    let pad = [
        ("x-mock-pad-bytes", hundred_mb.as_str()),
        ("x-mock-tokens", "9"),
    ];
    // Warm both paths first (connections, buffers), then the plain route's
    // peak, then the charged route's on top of it.
    assert_eq!(
        chat(
            &mut g.client(),
            "/plain/v1/chat/completions",
            r#"{"max_tokens":10}"#,
            &[]
        ),
        200
    );
    assert_eq!(
        chat(&mut g.client(), CHAT, r#"{"max_tokens":10}"#, &[]),
        200
    );
    let mut peaks = Vec::new();
    for path in ["/plain/v1/chat/completions", CHAT] {
        for stream in [true, false] {
            let body = format!(r#"{{"max_tokens":10,"stream":{stream}}}"#);
            assert_eq!(chat(&mut g.client(), path, &body, &pad), 200, "{path}");
        }
        peaks.push(peak_kib(g.pid()));
    }
    let (plain_kib, charged_kib) = (peaks[0], peaks[1]);
    println!(
        "FIGURES charged 100 MB answers: gateway peak RSS {plain_kib} KiB after the plain route, {charged_kib} KiB after the charge route (+{} KiB)",
        charged_kib.saturating_sub(plain_kib)
    );
    assert!(
        charged_kib <= plain_kib + 8 * 1024,
        "the charge route held more: {plain_kib} KiB then {charged_kib} KiB"
    );
    // Both 100 MB answers charged their 9 tokens (and the warm-up its own).
    let reported = up.stats_at("/stats/llm")["reports"]
        .as_array()
        .expect("reports")
        .iter()
        .filter(|r| r[1] == 9)
        .count();
    assert_eq!(reported, 4, "four padded answers reported 9 each");
    let m = g.metrics();
    assert_eq!(
        support::series(&m, "gateway_charged_requests_total{reason=\"read\"}"),
        Some("3"),
        "the warm-up and both 100 MB answers read: {m}"
    );
}

/// A month's quota of tokens on three replicas (leases and shares on)
/// through a SIGTERM of one and a SIGKILL of another: the graceful stop
/// sends what it owed first, so `used` stays exact through it; the kill
/// loses at most the settlements of the killed replica's last requests (its
/// request in flight and those of its last settlement round), so `used`
/// differs from what the upstream reported by at most what those requests'
/// answers differed from their estimates.
#[test]
fn a_month_of_tokens_through_a_sigterm_and_a_sigkill() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let config = replicas_config(
        &up,
        &redis,
        "capacity = 100000\nrefill_per_sec = 10000",
        r#"charge = { response = ["sse:usage.total_tokens", "json:usage.total_tokens"], estimate = "json:max_tokens", max = 4096 }"#,
    );
    let mut gs: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&config)).collect();
    wait_for("three replicas counted", Duration::from_secs(15), || {
        gs.iter()
            .all(|g| g.metric("gateway_limiter_replicas") == 3.0)
            .then_some(())
    });
    let mut rng = fastrand::Rng::with_seed(0x5167);
    let mut live = [true; 3];
    let mut clients: Vec<Option<Client>> = gs.iter().map(|g| Some(g.client())).collect();
    // Per request: the replica, when it was sent, its estimate and cost.
    let mut sent: Vec<(usize, std::time::Instant, u64, u64)> = Vec::new();
    let start = std::time::Instant::now();
    let (mut termed, mut killed_at) = (false, None);
    let mut seq = 0usize;
    while start.elapsed() < Duration::from_secs(24) {
        if !termed && start.elapsed() > Duration::from_secs(8) {
            clients[0] = None;
            live[0] = false;
            let (status, took) = gs[0].terminate(Duration::from_secs(15));
            assert!(status.is_some(), "replica 0 stopped ({took:?})");
            termed = true;
        }
        if killed_at.is_none() && start.elapsed() > Duration::from_secs(16) {
            clients[1] = None;
            live[1] = false;
            killed_at = Some(std::time::Instant::now());
            gs[1].kill();
        }
        seq += 1;
        let i = (0..3)
            .map(|k| (seq + k) % 3)
            .find(|k| live[*k])
            .expect("a live replica");
        let max = rng.u64(1..=2000);
        let cost = rng.u64(1..=max);
        let body = format!(r#"{{"max_tokens":{max},"stream":{}}}"#, rng.bool());
        let cost_s = cost.to_string();
        let at = std::time::Instant::now();
        let c = clients[i].as_mut().expect("client");
        assert_eq!(
            chat(c, CHAT, &body, &[("x-mock-tokens", &cost_s)]),
            200,
            "request {seq}"
        );
        sent.push((i, at, max, cost));
        std::thread::sleep(Duration::from_millis(30));
    }
    let killed_at = killed_at.expect("killed");
    let reported = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    assert_eq!(
        reported,
        sent.iter().map(|s| s.3).sum::<u64>(),
        "every request reported"
    );
    // What the kill may have lost: the settlements of replica 1's requests
    // answered within its last settlement round (100 ms, taken as 300).
    let lost_bound: u64 = sent
        .iter()
        .filter(|(i, at, ..)| *i == 1 && killed_at.duration_since(*at) < Duration::from_millis(300))
        .map(|(_, _, est, cost)| est - cost)
        .sum();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut used = gs[2].quota_used("tenant-a", "quota-month-units");
    while used.abs_diff(reported) > lost_bound && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        used = gs[2].quota_used("tenant-a", "quota-month-units");
    }
    // Leases the killed replica held come back when Redis takes them.
    std::thread::sleep(Duration::from_millis(500));
    used = gs[2].quota_used("tenant-a", "quota-month-units");
    println!(
        "FIGURES charged SIGTERM and SIGKILL: {} requests, {reported} tokens reported, used {used} ({:+}), bound of the kill {lost_bound}",
        sent.len(),
        used as i64 - reported as i64
    );
    assert!(
        used >= reported && used - reported <= lost_bound,
        "used {used} against reported {reported}: more apart than the kill's {lost_bound}"
    );
}

/// Leases on (the default), 40 answers of 10 tokens on estimates of 2,000,
/// back to back and again after a pause (leases granted, refunded into,
/// expired and given back): the route's bucket ends short of what it held
/// by exactly what the upstream reported. A counting window is leased, and
/// its refunds go back through its leases; a token bucket counting charged
/// units is never leased (its refunds go to Redis: sent straight to a
/// leased bucket, they moved its TAT under a lease's floor, the lease's
/// return was refused, and the bucket lost what the lease held: 20,000
/// fell to 1,991 after two requests costing 10 each).
#[test]
fn refunds_stay_in_the_bucket_with_leases_on() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let run = |limit: &str, n: u64, gap: Duration| {
        let config = config(&up, &redis)
            .replace(
                r#"algorithm = "token_bucket", capacity = 200000, refill_per_sec = 3333"#,
                limit,
            )
            .replace(
                "retry_after_jitter_ms = 0\n",
                "retry_after_jitter_ms = 0\n\n[limiter.leases]\nenabled = true\nperiod_ms = 100\n\n\
                 [limiter.shares]\ncharged = false\n",
            );
        let g = GatewayGuard::start(&config);
        let mut c = g.client();
        for i in 0..n {
            let body = format!(r#"{{"max_tokens":2000,"stream":{}}}"#, i % 2 == 0);
            assert_eq!(
                chat(&mut c, CHAT, &body, &[("x-mock-tokens", "10")]),
                200,
                "request {i}"
            );
            if i == n / 2 {
                std::thread::sleep(Duration::from_millis(350));
            }
            std::thread::sleep(gap);
        }
        let route = || {
            let v = g.admin_get("/limits?key=tenant-a").json();
            v["buckets"]
                .as_array()
                .and_then(|l| l.iter().find(|b| b["tier"] == "route"))
                .and_then(|b| b["remaining"].as_u64())
                .unwrap_or_else(|| panic!("no route bucket in {v}"))
        };
        // Every lease back (a period, and the sweeper's quarter), and the
        // settlements sent.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut left = route();
        while (left < 20_000 - 10 * n || g.metric("gateway_lease_tokens_held") != 0.0)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
            left = route();
        }
        let books: Vec<f64> = ["granted", "refunded", "spent", "returned", "lost"]
            .iter()
            .map(|e| g.metric(&format!("gateway_lease_tokens_total{{event=\"{e}\"}}")))
            .chain([g.metric("gateway_lease_tokens_held")])
            .collect();
        println!(
            "FIGURES charged leases, {limit}: route bucket {left} of 20,000 after {} reported; \
             lease books (every bucket): granted {} + refunded {} = spent {} + returned {} + \
             lost {} + held {}",
            10 * n,
            books[0],
            books[1],
            books[2],
            books[3],
            books[4],
            books[5]
        );
        assert_eq!(
            books[0] + books[1],
            books[2] + books[3] + books[4] + books[5],
            "the books balance"
        );
        assert_eq!(books[5], 0.0, "every lease back");
        (left, books[1])
    };
    // An hour's window (a minute's could roll over mid-test), 40 requests
    // back to back: exact.
    let n = 40;
    let (left, refunded) = run(
        r#"algorithm = "fixed_window", limit = 20000, window_secs = 3600"#,
        n,
        Duration::ZERO,
    );
    assert!(refunded > 0.0, "the window was leased and refunded into");
    assert_eq!(
        left,
        20_000 - 10 * n,
        "the window holds all but what was reported"
    );
    // A token bucket refilling a token a second, not cut into shares
    // (`charged = false`): never leased, exact. Its refunds reach Redis
    // within 100 ms: requests 150 ms apart (ten estimates of 2,000 back to
    // back would empty it first).
    let n = 16;
    let (left, refunded) = run(
        r#"algorithm = "token_bucket", capacity = 20000, refill_per_sec = 1"#,
        n,
        Duration::from_millis(150),
    );
    assert_eq!(refunded, 0.0, "a charged token bucket is never leased");
    assert!(
        (20_000 - 10 * n..=20_000 - 10 * n + 8).contains(&left),
        "the bucket holds {left}: 20,000 less the {} reported (and a few refilled)",
        10 * n
    );
}

/// Requests admitted on the fallback (Redis cut off in silence) and
/// settled there reach Redis at failback at what their answers cost, not
/// their estimates: the month's units `used` equals what the upstream
/// reported, before, during and after the outage. (Before, failback
/// charged each such request its estimate.)
#[test]
fn what_the_fallback_admitted_reaches_redis_at_its_settled_cost() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let link = ForwarderGuard::start(&redis.url().replace("redis://", ""));
    let config = config(&up, &redis)
        .replace(
            &format!("urls = [\"{}\"]", redis.url()),
            &format!(
                "urls = [\"{}\"]\ntimeout_ms = 200\nprobe_interval_ms = 100",
                link.url()
            ),
        )
        .replace(
            "retry_after_jitter_ms = 0\n",
            "retry_after_jitter_ms = 0\non_redis_failure = \"local\"\n\n\
             [limiter.leases]\nenabled = false\n",
        );
    let g = GatewayGuard::start(&config);
    let send = |n: u64| {
        for i in 0..n {
            let body = format!(r#"{{"max_tokens":500,"stream":{}}}"#, i % 2 == 0);
            assert_eq!(chat(&mut g.client(), CHAT, &body, &[]), 200, "request {i}");
        }
    };
    let reported = || {
        up.stats_at("/stats/llm")["reported_total"]
            .as_u64()
            .expect("total")
    };
    send(5);
    assert_eq!(settled_used(&g, reported()), reported(), "before");
    link.stop();
    send(10);
    assert_ne!(
        g.admin_get("/readyz").json()["backend"],
        "redis",
        "decided on the fallback"
    );
    link.resume();
    g.wait_backend("redis", Duration::from_secs(15));
    send(5);
    let want = reported();
    let used = settled_used(&g, want);
    println!(
        "FIGURES charged fallback: month's units used {used} against {want} reported \
         (20 requests, 10 on the fallback, estimates of 500 each)"
    );
    assert_eq!(used, want, "used is what the upstream reported");
    assert_eq!(g.metric("gateway_settle_after_failback_total"), 0.0);
}

/// A charged token bucket cut while a share holds its route's `max`, and
/// decided whole when the replica count makes shares too small: the cut
/// follows the membership. C = 8,000 at 400/s, `max` 1,000, `fraction`
/// 0.25: two replicas' shares of 1,000 hold `max` (cut), three replicas'
/// of 666 do not (whole). Two replicas, then a third joins for 8 s and
/// stops, while clients on every live replica spend as fast as they may
/// (estimates equal to costs: nothing to settle). Shares are on for every
/// bucket and the plan has no quota (never cut), so a request is counted
/// `share` only while the charged bucket is cut too (the plan's is cut
/// whatever the count). Over every interval the
/// upstream's tokens stay within C + r·T plus the documented once per
/// switch (`fraction` × C); the figure says how much of that was used.
#[test]
fn a_charged_bucket_through_a_change_of_replica_count() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let (cap, rate, fc) = (8000.0, 400.0, 2000.0);
    let config = replicas_config(
        &up,
        &redis,
        "capacity = 1000000000\nrefill_per_sec = 1000000000",
        r#"charge = { response = ["json:usage.total_tokens"], estimate = "json:max_tokens", max = 1000 }
limit = { algorithm = "token_bucket", capacity = 8000, refill_per_sec = 400, scope = "client", cost = "response" }"#,
    )
    .replace("instances = 3\n", "instances = 1\n")
    .replace(
        r#"quotas = [{ limit = 100000000, period = "month", cost = "response" }]"#,
        "",
    );
    let two: Vec<GatewayGuard> = (0..2).map(|_| GatewayGuard::start(&config)).collect();
    let members = |gs: &[&GatewayGuard], n: f64| {
        wait_for(&format!("{n} replicas"), Duration::from_secs(15), || {
            gs.iter()
                .all(|g| {
                    g.metric("gateway_limiter_replicas") == n
                        && g.metric("gateway_shares_usable") == 1.0
                })
                .then_some(())
        });
    };
    members(&[&two[0], &two[1]], 2.0);
    const SHARE: &str = "gateway_limiter_decisions_total{path=\"share\"}";
    let on_shares = || two.iter().map(|g| g.metric(SHARE)).sum::<f64>();
    let mut decided = [0.0; 5];
    let third: std::sync::Mutex<Option<GatewayGuard>> = std::sync::Mutex::new(None);
    let stop = AtomicBool::new(false);
    let spend = |addr: std::net::SocketAddr| {
        let mut c = support::http::Client::connect(addr).expect("connect");
        let body = r#"{"max_tokens":100}"#;
        let headers = [("x-mock-tokens", "100")];
        if chat(&mut c, CHAT, body, &headers) == 0 {
            c = support::http::Client::connect(addr).expect("reconnect");
        }
        drop(c);
        std::thread::sleep(Duration::from_millis(2));
    };
    std::thread::scope(|s| {
        for g in &two {
            let (stop, addr) = (&stop, g.addr);
            s.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    spend(addr);
                }
            });
        }
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let addr = third.lock().unwrap().as_ref().map(|g| g.addr);
                match addr {
                    Some(addr) => spend(addr),
                    None => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        std::thread::sleep(Duration::from_secs(8));
        let cut_before = on_shares();
        let g3 = GatewayGuard::start(&config);
        members(&[&two[0], &two[1], &g3], 3.0);
        let whole_from = on_shares();
        *third.lock().unwrap() = Some(g3);
        std::thread::sleep(Duration::from_secs(8));
        let mut g3 = third.lock().unwrap().take().expect("the third replica");
        let whole_to = on_shares() + g3.metric(SHARE);
        g3.terminate(Duration::from_secs(10));
        members(&[&two[0], &two[1]], 2.0);
        let cut_from = on_shares();
        std::thread::sleep(Duration::from_secs(8));
        stop.store(true, Ordering::Relaxed);
        decided = [cut_before, whole_from, whole_to, cut_from, on_shares()];
    });
    println!(
        "FIGURES charged cut follows replicas: decisions on a share: {} while two replicas, {} \
         while three, {} while two again",
        decided[0],
        decided[2] - decided[1],
        decided[4] - decided[3]
    );
    assert!(decided[0] > 0.0, "cut while two replicas' shares hold max");
    assert_eq!(decided[2], decided[1], "decided whole while three replicas");
    assert!(decided[4] > decided[3], "cut again once the third has left");
    // Every interval of the upstream's arrivals (100 tokens each): the
    // most it got beyond r·T, against C.
    let times = up.times(CHAT);
    let (mut most, mut low) = (f64::MIN, f64::MAX);
    for (j, t) in times.iter().enumerate() {
        let at = |i: usize, t: u64| 100.0 * i as f64 - rate * t as f64 / 1e6;
        low = low.min(at(j, *t));
        most = most.max(at(j + 1, *t) - low);
    }
    let span = (times.last().unwrap_or(&0) - times.first().unwrap_or(&0)) as f64 / 1e6;
    println!(
        "FIGURES charged cut follows replicas: {} requests admitted ({} tokens) over {span:.1} s \
         (C + r·T = {:.0}), two then three then two replicas; the most in any interval beyond \
         r·T {most:.0} against C = {cap} (switches' allowance fC = {fc} each, two switches)",
        times.len(),
        times.len() * 100,
        cap + rate * span
    );
    assert!(times.len() > 100, "traffic flowed: {}", times.len());
    assert!(
        most <= cap + 2.0 * fc,
        "an interval over C + r·T + 2fC: {most} beyond r·T"
    );
}

/// Whether `bytes` hold a `charge.lua` settlement call: its marker names
/// a batch of settlements (`<prefix>:ran:<replica>:settled:<n>:<i>`).
fn settlement_call(bytes: &[u8]) -> bool {
    String::from_utf8_lossy(bytes).contains(":settled:")
}

/// A batch of settlements whose answer is lost is settled once. The call
/// runs in Redis, in time, and its answer is held 1.5 s (three times, the
/// gateway failing over and back each time): the batch is kept whole and
/// sent again under its marker, which Redis already holds, so it writes
/// nothing twice. Refunds of 490 a request (estimates of 500, answers of
/// 10) make a double settlement plain: the month's `used` would fall short
/// of what the upstream reported by 490 for each request in the batch.
#[test]
fn a_lost_settlement_answer_is_settled_once() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let redis = RedisGuard::start();
    let relay = AnswerHold::start(redis.port, settlement_call);
    let up = UpstreamGuard::start();
    let config = config(&up, &redis)
        .replace(&redis.url(), &relay.url())
        .replace(
            "retry_after_jitter_ms = 0\n",
            "retry_after_jitter_ms = 0\non_redis_failure = \"local\"\n",
        );
    let g = GatewayGuard::start(&config);
    let stop = AtomicBool::new(false);
    let (sent, admitted) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut c = g.client();
            while !stop.load(Ordering::Relaxed) {
                let n = sent.fetch_add(1, Ordering::Relaxed);
                let body = format!(r#"{{"max_tokens":500,"stream":{}}}"#, n % 2 == 0);
                match chat(&mut c, CHAT, &body, &[("x-mock-tokens", "10")]) {
                    200 => {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                    0 => c = g.client(),
                    _ => {}
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(700));
            relay.hold_next("a settlement call");
            g.wait_backend("redis", Duration::from_secs(15));
        }
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
    });
    let want = up.stats_at("/stats/llm")["reported_total"]
        .as_u64()
        .expect("total");
    let used = settled_used(&g, want);
    let in_doubt = g.metric("gateway_settle_in_doubt_total");
    println!(
        "FIGURES charged lost settlement answer: {} requests, {} admitted, {want} tokens reported, \
         used {used} ({:+}); settlement batches in doubt {in_doubt}",
        sent.load(Ordering::Relaxed),
        admitted.load(Ordering::Relaxed),
        used as i64 - want as i64
    );
    assert!(
        in_doubt >= 3.0,
        "each hold lost a settlement call's answer: {in_doubt}"
    );
    assert_eq!(used, want, "used is what the upstream reported");
}

/// Leases on (the default) and `[limiter.shares] charged = true` without
/// `enabled`: a token bucket counting charged units is cut, so once this
/// replica's share is usable its requests are decided and settled on it
/// with no call: the bucket's pool is never written in Redis, where the
/// same limit counting requests is leased (a call to start it, and one
/// per renewal). `gateway check` says what is cut.
#[test]
fn a_charged_token_bucket_rides_its_share_with_shares_charged() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let limit =
        r#"algorithm = "token_bucket", capacity = 200000, refill_per_sec = 3333, scope = "client""#;
    let config = config(&up, &redis)
        .replace(
            r#"quotas = [{ limit = 10000, period = "day" }, { limit = 5000000, period = "month", cost = "response" }]"#,
            "",
        )
        .replace(
            "retry_after_jitter_ms = 0\n",
            "retry_after_jitter_ms = 0\n\n[limiter.shares]\ncharged = true\n",
        )
        + &format!(
            r#"
[[routes]]
name = "plain"
path_prefix = "/v3/chat/completions"
methods = ["POST"]
upstream = "llm"
require_api_key = true
limit = {{ {limit} }}
"#
        );
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        config
            .replace("{listen}", &format!("127.0.0.1:{}", support::free_port()))
            .replace("{admin}", &format!("127.0.0.1:{}", support::free_port())),
    )
    .expect("write");
    let (code, out, err) = support::gateway_cli(&["check"], &path);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains(
            "shares.charged=true (cutting: token buckets counting charged units whose route's max fits in a share)"
        ),
        "{out}"
    );
    let g = GatewayGuard::start(&config);
    wait_for("shares usable", Duration::from_secs(10), || {
        (g.metric("gateway_shares_usable") == 1.0).then_some(())
    });
    // The share starts empty and fills at 833 a second: a few estimates' worth.
    std::thread::sleep(Duration::from_millis(500));
    let mut c = g.client();
    let n = 40;
    for i in 0..n {
        let body = format!(r#"{{"max_tokens":100,"stream":{}}}"#, i % 2 == 0);
        assert_eq!(
            chat(&mut c, CHAT, &body, &[("x-mock-tokens", "10")]),
            200,
            "{i}"
        );
    }
    for i in 0..n {
        let body = r#"{"max_tokens":100}"#;
        let path = "/v3/chat/completions";
        assert_eq!(chat(&mut c, path, body, &[]), 200, "plain {i}");
    }
    let route_keys = |route: &str| -> Vec<String> {
        redis
            .keys()
            .into_iter()
            .filter(|k| k.contains(&format!(":route:{route}:")))
            .collect()
    };
    println!(
        "FIGURES charged shares-off: {n} charged requests, then {n} plain: charged route keys \
         in Redis {:?}, plain route keys {:?}",
        route_keys("chat"),
        route_keys("plain")
    );
    assert!(
        route_keys("chat").is_empty(),
        "the charged bucket's pool never reached Redis"
    );
    assert!(
        !route_keys("plain").is_empty(),
        "the plain bucket is Redis's (leased)"
    );
}
