//! A quota is money: with leases on and more than one replica, every
//! token Redis debits for a lease ends up spent or given back, so a key gets
//! exactly its quota and `used` bills exactly what was admitted. Real
//! gateway replicas on one real Redis with an AOF; every figure is a count
//! against the exact bound (the hung-Redis test also bounds a request's wait
//! by the budget it is promised).

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{
    wait_for, AnswerHold, Client, ForwarderGuard, GatewayGuard, RedisGuard, UpstreamGuard,
    SERVER_2_THREADS,
};

/// Two replicas' config: keys m1..m4 on a monthly quota of 50 under a burst
/// far above it; keys f1..f5 on a burst of 20 at 10/s with a daily quota of
/// 50 and a monthly one of 200.
fn config(redis_url: &str, up: &UpstreamGuard, period_ms: u64, redis_extra: &str) -> String {
    let key = |id: &str, plan: &str| {
        format!("[[api_keys]]\nid = \"{id}\"\nkey = \"{id}-secret\"\nplan = \"{plan}\"\n\n")
    };
    let keys: String = ["m1", "m2", "m3", "m4"]
        .iter()
        .map(|k| key(k, "metered"))
        .chain(std::iter::once(key("b1", "big")))
        .chain(
            ["f1", "f2", "f3", "f4", "f5"]
                .iter()
                .map(|k| key(k, "free")),
        )
        .collect();
    format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"
on_redis_failure = "local"
instances = 2
retry_after_jitter_ms = 0

[limiter.leases]
enabled = true
period_ms = {period_ms}

[redis]
urls = ["{redis_url}"]
timeout_ms = 200
probe_interval_ms = 50
{redis_extra}

[plans.metered]
capacity = 10000
refill_per_sec = 1000
quotas = [{{ limit = 50, period = "month" }}]

[plans.big]
capacity = 10000
refill_per_sec = 1000
quotas = [{{ limit = 1000000, period = "month" }}]

[plans.free]
capacity = 20
refill_per_sec = 10
quotas = [{{ limit = 50, period = "day" }}, {{ limit = 200, period = "month" }}]

{keys}
[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "api"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    )
}

/// A Redis that writes every change to its append-only file.
fn aof_redis() -> RedisGuard {
    RedisGuard::start_with(&["--appendonly", "yes", "--appendfsync", "everysec"])
}

fn send(c: &mut Client, key: &str) -> u16 {
    c.request(
        "GET",
        "/api",
        &[("x-api-key", &format!("{key}-secret"))],
        b"",
    )
    .expect("request")
    .status
}

/// `n` requests at once, each on its own connection: how many were admitted.
fn at_once(gw: &GatewayGuard, key: &str, n: usize) -> u64 {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|_| s.spawn(|| (send(&mut gw.client(), key) == 200) as u64))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    })
}

/// One request after another until the first refusal: how many were admitted.
fn until_refused(gw: &GatewayGuard, key: &str) -> u64 {
    let mut c = gw.client();
    let mut admitted = 0;
    for _ in 0..1000 {
        match send(&mut c, key) {
            200 => admitted += 1,
            429 => return admitted,
            other => panic!("unexpected status {other}"),
        }
    }
    panic!("no refusal after 1000 requests");
}

fn held(gw: &GatewayGuard) -> f64 {
    gw.metric("gateway_lease_tokens_held")
}

/// granted, spent, returned, lost.
fn books(gw: &GatewayGuard) -> [f64; 4] {
    ["granted", "spent", "returned", "lost"]
        .map(|e| gw.metric(&format!("gateway_lease_tokens_total{{event=\"{e}\"}}")))
}

/// 10 at once through A, and more one by one until A holds leased tokens
/// (a lease is granted once the bucket is hot); the requests A admitted.
fn lease_on(a: &GatewayGuard, key: &str) -> u64 {
    let mut admitted = at_once(a, key, 10);
    let mut c = a.client();
    wait_for("a lease on replica A", Duration::from_secs(10), || {
        if held(a) > 0.0 {
            return Some(());
        }
        admitted += (send(&mut c, key) == 200) as u64;
        None
    });
    admitted
}

/// Acceptance 1: A holds a lease that outlives the test (a minute), then
/// stops gracefully; B alone gets the rest: 50 in all.
#[test]
fn a_graceful_stop_gives_its_lease_back() {
    let redis = aof_redis();
    let up = UpstreamGuard::start();
    let cfg = config(&redis.url(), &up, 60_000, "");
    let mut a = GatewayGuard::start(&cfg);
    let b = GatewayGuard::start(&cfg);
    let through_a = lease_on(&a, "m1");
    let a_held = held(&a);
    let (status, _) = a.terminate(Duration::from_secs(15));
    assert!(status.is_some_and(|s| s.success()), "A exits: {status:?}");
    let through_b = until_refused(&b, "m1");
    println!(
        "FIGURES quota-stop: monthly quota 50, two replicas: {through_a} through A (holding {a_held} leased tokens at SIGTERM), {through_b} through B after: {} (bound 50); upstream saw {}",
        through_a + through_b,
        up.total()
    );
    assert_eq!(
        through_a + through_b,
        50,
        "the whole quota, nothing stranded"
    );
    assert_eq!(up.total(), 50);
    assert_eq!(b.quota_used("m1", "quota-month"), 50);
}

/// Acceptance 1, with a reload of A in place of the stop.
#[test]
fn a_reload_gives_its_lease_back() {
    let redis = aof_redis();
    let up = UpstreamGuard::start();
    let cfg = config(&redis.url(), &up, 60_000, "");
    let a = GatewayGuard::start(&cfg);
    let b = GatewayGuard::start(&cfg);
    let through_a = lease_on(&a, "m2");
    let a_held = held(&a);
    a.signal("HUP");
    wait_for("A gives its lease back", Duration::from_secs(10), || {
        (held(&a) == 0.0).then_some(())
    });
    let through_b = until_refused(&b, "m2");
    let [granted, spent, returned, lost] = books(&a);
    println!(
        "FIGURES quota-reload: {through_a} through A (holding {a_held} at SIGHUP), {through_b} through B: {} (bound 50); A's books: granted {granted} = spent {spent} + returned {returned} + lost {lost}",
        through_a + through_b
    );
    assert_eq!(through_a + through_b, 50);
    assert_eq!(granted, spent + returned + lost, "A's books balance");
    // (A token bucket's unspent lease is refused back once the bucket
    // could have refilled without it: lost, and refilled. The quota's is
    // always taken back: B got the rest.)
    assert_eq!(b.quota_used("m2", "quota-month"), 50);
}

/// Acceptance 2: A holds a lease and goes idle (it stays up, and is never
/// asked for the key again). One lease period and a second later, B's
/// `used` is what was admitted, and B admits the rest.
#[test]
fn an_idle_replicas_lease_goes_back_within_a_period() {
    let redis = aof_redis();
    let up = UpstreamGuard::start();
    let period_ms = 1000;
    let cfg = config(&redis.url(), &up, period_ms, "");
    let a = GatewayGuard::start(&cfg);
    let b = GatewayGuard::start(&cfg);
    let through_a = lease_on(&a, "m3");
    let a_held = held(&a);
    let first = until_refused(&b, "m3");
    std::thread::sleep(Duration::from_millis(period_ms + 1000));
    let billed = b.quota_used("m3", "quota-month");
    let rest = until_refused(&b, "m3");
    println!(
        "FIGURES quota-idle: {through_a} through A (then idle, holding {a_held}), {first} through B until refused; a period and a second later used = {billed} (admitted {}); then {rest} more: {} (bound 50)",
        through_a + first,
        through_a + first + rest
    );
    assert!(a_held > 0.0, "A held a lease");
    assert_eq!(billed, through_a + first, "used is what was admitted");
    assert_eq!(through_a + first + rest, 50);
}

/// Acceptance 4: A holds a lease and is SIGKILLed. While the lease lives,
/// at most its unspent tokens are missing; two lease periods after its
/// grant Redis takes them back itself (A's spending was reported by its
/// sweeper, every quarter period), and B admits the rest: 50 in all.
#[test]
fn a_killed_replicas_lease_comes_back_when_it_expires() {
    let redis = aof_redis();
    let up = UpstreamGuard::start();
    let period_ms = 1000;
    let cfg = config(&redis.url(), &up, period_ms, "");
    let mut a = GatewayGuard::start(&cfg);
    let b = GatewayGuard::start(&cfg);
    let through_a = lease_on(&a, "m1");
    // (Its spending is reported every quarter period: by now, all of it.)
    std::thread::sleep(Duration::from_millis(period_ms / 2));
    a.kill();
    let during = until_refused(&b, "m1");
    // What B could not have: A's unspent quota lease (the gauge counts the
    // plan's burst lease too).
    let missing = 50 - through_a - during;
    std::thread::sleep(Duration::from_millis(2 * period_ms + 500));
    // Before any request reads the ledger again, `used` and the usage
    // export already leave the expired lease out.
    let billed = b.quota_used("m1", "quota-month");
    let exported = b.admin_get("/usage?period=month&format=jsonl").text();
    let after = until_refused(&b, "m1");
    println!(
        "FIGURES quota-kill: {through_a} through A, then SIGKILL; {during} through B while A's lease lived ({missing} missing), used {billed} once it expired; {after} more after: {} (bound 50); upstream saw {}",
        through_a + during + after,
        up.total()
    );
    assert_eq!(billed, through_a + during, "used: what was admitted");
    let row: serde_json::Value = exported
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .find(|v: &serde_json::Value| v["key"] == "m1")
        .unwrap_or_else(|| panic!("no row for m1: {exported}"));
    assert_eq!(row["used"], billed, "usage export: {row}");
    assert!(missing > 0, "A held a quota lease when killed");
    assert_eq!(after, missing, "Redis gives it back whole");
    assert_eq!(up.total(), 50);
    assert_eq!(b.quota_used("m1", "quota-month"), 50);
}

/// Found by the chaos soak's quota check: a Redis stall bills nothing
/// twice. The calls queued while Redis was stopped run when it resumes,
/// after the replica decided their requests on its fallback (whose
/// admissions it charges at failback), and so does a charge it gave up on
/// and retried: they carry a deadline and write nothing; a quota's lease
/// spending reported in a call the stall swallowed is told again. Four
/// clients on a key whose quota never binds, Redis stopped (SIGSTOP) for
/// 1.5 s three times, with leases and without: `used` is what the upstream
/// received. (Within 2: a call that ran in time and whose answer was lost
/// is the one case left, when the stop strikes between a call's run and its
/// answer. Its lease reports are numbered, and told again with their number
/// count once: `a_lost_answer_tells_no_lease_spending_twice`; one loaded run
/// had billed them twice, +17. Its requests, if it decided any, are charged
/// once: `a_lost_answer_charges_its_requests_once`.)
#[test]
fn a_redis_stall_bills_nothing_twice() {
    for leases in [false, true] {
        let redis = RedisGuard::start();
        let up = UpstreamGuard::start();
        let mut cfg = config(&redis.url(), &up, 100, "");
        if !leases {
            cfg = cfg.replace("enabled = true", "enabled = false");
        }
        let gw = GatewayGuard::start(&cfg);
        let (served, billed) = bill_through_three(&gw, &up, || {
            redis.signal("STOP");
            std::thread::sleep(Duration::from_millis(1500));
            redis.signal("CONT");
        });
        println!(
            "FIGURES quota-stall (leases {leases}): three 1.5 s Redis stalls under 4 clients: upstream received {served}, used {billed} ({:+})",
            billed as i64 - served as i64
        );
        assert!(served > 100, "traffic flowed: {served}");
        assert!(
            billed.abs_diff(served) <= 2,
            "billed once for each request served: {billed} for {served}"
        );
    }
}

/// Four clients on key b1 while `disturb` strikes three times, each 0.7 s
/// after the gateway is back on Redis: what the upstream received, and the
/// quota's `used` once leases and debts settled (within a period and a
/// quarter of the last request; failback charged the fallback's admissions).
fn bill_through_three(gw: &GatewayGuard, up: &UpstreamGuard, disturb: impl Fn()) -> (u64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (stop, addr) = (stop.clone(), gw.addr);
            std::thread::spawn(move || {
                let mut c = Client::connect(addr).expect("connect");
                while !stop.load(Ordering::Relaxed) {
                    if c.request("GET", "/api", &[("x-api-key", "b1-secret")], b"")
                        .is_err()
                    {
                        c = Client::connect(addr).expect("reconnect");
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        })
        .collect();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(700));
        disturb();
        gw.wait_backend("redis", Duration::from_secs(15));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    std::thread::sleep(Duration::from_millis(1000));
    (up.total(), gw.quota_used("b1", "quota-month"))
}

/// Whether `bytes` hold a `limiter.lua` call deciding no request and
/// naming a quota bucket: lease reports and asks only (a flush, a
/// renewal). RESP, as the gateway writes it: `*n`, then `$len` strings:
/// EVALSHA sha numkeys keys.. ARGV[1] (the deadline) ARGV[2] (requests).
fn lease_report_only(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let mut lines = text.split("\r\n");
    let mut parts = Vec::new();
    let Some(n) = lines
        .next()
        .and_then(|l| l.strip_prefix('*')?.parse::<usize>().ok())
    else {
        return false;
    };
    for _ in 0..n {
        let (Some(_len), Some(part)) = (lines.next(), lines.next()) else {
            return false;
        };
        parts.push(part);
    }
    let Some(keys) = parts.get(2).and_then(|k| k.parse::<usize>().ok()) else {
        return false;
    };
    parts.first() == Some(&"EVALSHA")
        && parts.get(4 + keys) == Some(&"0")
        && parts.iter().any(|p| p.contains("q-month"))
}

/// Whether `bytes` hold a `limiter.lua` call deciding requests (ARGV[2]
/// is not 0).
fn deciding_requests(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let parts: Vec<&str> = text.split("\r\n").skip(2).step_by(2).collect();
    let Some(keys) = parts.get(2).and_then(|k| k.parse::<usize>().ok()) else {
        return false;
    };
    parts.first() == Some(&"EVALSHA") && parts.get(4 + keys).is_some_and(|m| *m != "0")
}

/// `a_redis_stall_bills_nothing_twice`'s one case left, made certain for a
/// quota's lease reports: the call that carries them is in flight when the
/// stall strikes, has run in Redis in time, and its answer is lost (held
/// 1.5 s, three times; the gateway fails over and back each time). The
/// spending it reported is told again, with its number, and counted once
/// (with the numbers ignored: +52..60, what those calls reported).
#[test]
fn a_lost_answer_tells_no_lease_spending_twice() {
    let redis = RedisGuard::start();
    let relay = AnswerHold::start(redis.port, lease_report_only);
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&relay.url(), &up, 100, ""));
    let (served, billed) = bill_through_three(&gw, &up, || relay.hold_next("a lease call"));
    println!(
        "FIGURES quota-lost-answer: three 1.5 s holds of a lease call's answer under 4 clients: upstream received {served}, used {billed} ({:+})",
        billed as i64 - served as i64
    );
    assert!(served > 100, "traffic flowed: {served}");
    assert!(
        billed.abs_diff(served) <= 2,
        "billed once for each request served: {billed} for {served}"
    );
}

/// A call deciding requests whose answer is lost charges them once. The
/// call runs in Redis in time and its answer is held 1.5 s, three times,
/// with leases off: every request goes to Redis. The gateway decides the
/// call's requests on its fallback too; at failback the call's marker says
/// which of them Redis admitted, and those are not charged again: `used`
/// is exactly what the upstream received.
#[test]
fn a_lost_answer_charges_its_requests_once() {
    let redis = RedisGuard::start();
    let relay = AnswerHold::start(redis.port, deciding_requests);
    let up = UpstreamGuard::start();
    let cfg = config(&relay.url(), &up, 100, "").replace("enabled = true", "enabled = false");
    let gw = GatewayGuard::start(&cfg);
    let (served, billed) = bill_through_three(&gw, &up, || relay.hold_next("a deciding call"));
    let ran = gw.metric("gateway_redis_lost_answers_total{ran=\"yes\"}");
    println!(
        "FIGURES lost-decision-answer: three 1.5 s holds of a deciding call's answer under 4 clients: upstream received {served}, used {billed} ({:+}); lost answers that had run: {ran}",
        billed as i64 - served as i64
    );
    assert!(served > 100, "traffic flowed: {served}");
    assert!(
        ran >= 3.0,
        "each hold lost the answer of a call that ran: {ran}"
    );
    assert_eq!(billed, served, "billed once for each request served");
}

/// Six threads spraying a key over both replicas in turn for `secs`: the
/// requests admitted.
fn spray(gws: &[&GatewayGuard], key: &str, secs: u64) -> u64 {
    let admitted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let addrs: Vec<_> = gws.iter().map(|g| g.addr).collect();
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let (admitted, stop, addrs) = (admitted.clone(), stop.clone(), addrs.clone());
            let key = key.to_string();
            std::thread::spawn(move || {
                let mut conns: Vec<Client> = addrs
                    .iter()
                    .map(|a| Client::connect(*a).expect("connect"))
                    .collect();
                let mut n = i;
                while !stop.load(Ordering::Relaxed) {
                    let k = n % conns.len();
                    n += 1;
                    match send(&mut conns[k], &key) {
                        200 => {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        429 => {}
                        other => panic!("unexpected status {other}"),
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(secs));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().expect("spray thread");
    }
    admitted.load(Ordering::Relaxed)
}

/// Acceptance 3: the burst refuses thousands while the daily quota runs
/// out: exactly 50 each run, the month billed exactly, the books balanced.
#[test]
fn a_spray_past_the_burst_strands_no_quota_token() {
    let redis = aof_redis();
    let up = UpstreamGuard::start();
    let cfg = config(&redis.url(), &up, 100, "");
    let a = GatewayGuard::start(&cfg);
    let b = GatewayGuard::start(&cfg);
    let mut figures = Vec::new();
    for key in ["f1", "f2", "f3", "f4", "f5"] {
        let admitted = spray(&[&a, &b], key, 5);
        wait_for("every lease given back", Duration::from_secs(10), || {
            (held(&a) == 0.0 && held(&b) == 0.0).then_some(())
        });
        let (day, month) = (
            a.quota_used(key, "quota-day"),
            b.quota_used(key, "quota-month"),
        );
        figures.push((key, admitted, day, month));
        assert_eq!(admitted, 50, "{key}: the daily quota exactly");
        assert_eq!((day, month), (50, 50), "{key}: billed what was admitted");
    }
    let [ga, sa, ra, la] = books(&a);
    let [gb, sb, rb, lb] = books(&b);
    println!(
        "FIGURES quota-spray: per run (key, admitted, day used, month used) {figures:?} (bound 50 each); books: A granted {ga} = spent {sa} + returned {ra} + lost {la}; B granted {gb} = spent {sb} + returned {rb} + lost {lb}; upstream saw {}",
        up.total()
    );
    assert_eq!(up.total(), 250);
    assert_eq!(ga, sa + ra + la, "A's books balance");
    assert_eq!(gb, sb + rb + lb, "B's books balance");
}

/// A Redis with only RDB snapshots gets a persistence warning naming the
/// writes a crash can lose.
#[test]
fn snapshots_alone_are_warned_about_with_their_loss_window() {
    let redis = RedisGuard::start_with(&["--save", "3600 1 300 100"]);
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&redis.url(), &up, 100, ""));
    let r = gw.admin_get("/readyz").json();
    let warning = r["warnings"][0].as_str().unwrap_or("").to_string();
    assert!(
        warning.contains("RDB snapshots") && warning.contains("300 to 3600 s"),
        "{r}"
    );
    assert_eq!(r["ready"], true);
}

/// Acceptance 6: Redis hung (SIGSTOP) right after a failback, with a
/// 20 ms budget: the watchdog is never stuck behind the failback's own
/// upkeep, so no request waits for more than the budget and a PING.
#[test]
fn a_redis_hung_right_after_a_failback_holds_no_request_past_its_budget() {
    let redis = RedisGuard::start();
    let link = ForwarderGuard::start(&redis.url().replace("redis://", ""));
    let up = UpstreamGuard::start();
    let cfg = config(&link.url(), &up, 100, "").replace("timeout_ms = 200", "timeout_ms = 20");
    let gw = GatewayGuard::start(&cfg);
    let trials: usize = std::env::var("HUNG_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut worst = Vec::new();
    let mut c = gw.client();
    for _ in 0..trials {
        // An outage in silence, noticed by a request; then a failback.
        link.stop();
        wait_for("the fallback", Duration::from_secs(10), || {
            send(&mut c, "m4");
            gw.admin_get("/readyz")
                .text()
                .contains("\"local\"")
                .then_some(())
        });
        link.resume();
        gw.wait_backend("redis", Duration::from_secs(10));
        // Hung at once: a request every 40 ms for a second.
        redis.signal("STOP");
        let mut slowest = Duration::ZERO;
        for _ in 0..25 {
            let t = Instant::now();
            let status = send(&mut c, "m4");
            slowest = slowest.max(t.elapsed());
            assert!(status == 200 || status == 429, "{status}");
            std::thread::sleep(Duration::from_millis(40));
        }
        redis.signal("CONT");
        gw.wait_backend("redis", Duration::from_secs(10));
        worst.push(slowest.as_millis() as u64);
    }
    worst.sort();
    println!(
        "FIGURES hung-after-failback: {trials} trials, timeout_ms 20: slowest request per trial (sorted, ms) {worst:?}"
    );
    // The bug this guards against held requests for the upkeep's 500 ms
    // budget; a loaded machine can add tens of ms to any request.
    assert!(
        *worst.last().unwrap() < 250,
        "slowest {worst:?} ms: a request waited past the budget and a PING"
    );
}
