//! In-flight caps through the real gateway, against mock upstreams
//! that count their own concurrency: a cap with its queue and timeout, no
//! slot leaked whichever way requests end, plan priority when the queue is
//! full, a cap per client, and an adaptive limit that follows an upstream
//! whose service time doubles. Every figure is a count; the one timeline
//! (the adaptive limit over time) is printed, not asserted against a clock.

use crate::support;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use support::{wait_for, Client, GatewayGuard, UpstreamGuard, SERVER_2_THREADS};

/// `n` requests at once (each on its own connection, released together):
/// their statuses and bodies, in order.
fn at_once(gw: SocketAddr, n: usize, path: &str, headers: &[(&str, &str)]) -> Vec<(u16, String)> {
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let barrier = barrier.clone();
            let path = path.to_string();
            let headers: Vec<(String, String)> = headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            std::thread::spawn(move || {
                let mut c = Client::connect(gw).expect("connect");
                barrier.wait();
                let h: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                c.request("GET", &path, &h, b"")
                    .map_or((0, String::new()), |r| (r.status, r.text()))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

fn count(got: &[(u16, String)], status: u16, reason: &str) -> usize {
    got.iter()
        .filter(|(s, b)| *s == status && b.contains(reason))
        .count()
}

/// A gauge of one cap, read at once (requests may be held open on purpose).
fn gauge(gw: &GatewayGuard, name: &str, kind: &str, of: &str) -> f64 {
    let series = format!("{name}{{kind=\"{kind}\",name=\"{of}\"}}");
    support::series(&gw.raw_metrics(), &series).map_or(0.0, |v| v.parse().unwrap_or(0.0))
}

/// Acceptance 1: a cap of 4 with a queue of 2 on a 200 ms upstream, 20 at
/// once: the upstream never holds more than 4; the 14 past the queue get
/// 503 at once; with a queue timeout shorter than the service time the 2
/// queued get 503 too.
#[test]
fn a_cap_queues_its_overflow_and_refuses_the_rest() {
    let patient = UpstreamGuard::start_with(&["--service-ms", "200", "--threads", "2"]);
    let hasty = UpstreamGuard::start_with(&["--service-ms", "200", "--threads", "2"]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "patient"
servers = ["{}"]
max_in_flight = 4
queue = 2
queue_timeout_ms = 5000

[[upstreams]]
name = "hasty"
servers = ["{}"]
max_in_flight = 4
queue = 2
queue_timeout_ms = 50

[[routes]]
name = "p"
path_prefix = "/p"
upstream = "patient"

[[routes]]
name = "h"
path_prefix = "/h"
upstream = "hasty"
"#,
        patient.addr, hasty.addr
    ));
    let got = at_once(gw.addr, 20, "/p", &[]);
    let ok = count(&got, 200, "");
    let full = count(&got, 503, "queue_full");
    let seen = patient.stats()["max_in_flight"].as_u64().unwrap();
    println!("FIGURES in-flight cap 4 + queue 2, 20 at once: {ok} served, {full} refused 503 (queue full), upstream at most {seen} at once");
    assert!(seen <= 4, "the upstream saw {seen} at once");
    assert_eq!((ok, full), (6, 14), "{got:?}");
    let r = &got.iter().find(|(s, _)| *s == 503).unwrap().1;
    assert!(
        r.contains("upstream \\\"patient\\\"") || r.contains("upstream \"patient\""),
        "{r}"
    );

    let got = at_once(gw.addr, 20, "/h", &[]);
    let (ok, full, timeout) = (
        count(&got, 200, ""),
        count(&got, 503, "queue_full"),
        count(&got, 503, "queue_timeout"),
    );
    println!("FIGURES queue timeout 50 ms under a 200 ms service: {ok} served, {full} queue full, {timeout} timed out in the queue");
    assert!(hasty.stats()["max_in_flight"].as_u64().unwrap() <= 4);
    assert_eq!((ok, full, timeout), (4, 14, 2), "{got:?}");
    assert_eq!(
        hasty.stats()["total"].as_u64().unwrap(),
        4,
        "refused requests never reached the upstream"
    );
    let text = gw.metrics();
    assert!(
        text.contains("gateway_in_flight_refusals_total{kind=\"upstream\",name=\"hasty\",reason=\"queue_timeout\"} 2"),
        "{text}"
    );
}

/// Acceptance 2: 1,000 requests, some timing out upstream, some abandoned
/// by their clients, some sent to a dead server first and retried: after
/// them nothing is in flight or queued, and 20 at once get the whole cap
/// (4 served at once, 8 queued) again.
#[test]
fn no_slot_leaks_whichever_way_requests_end() {
    let up = UpstreamGuard::start_with(&["--service-ms", "5", "--threads", "2"]);
    let dead = support::free_port();
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "up"
servers = ["{}", "127.0.0.1:{dead}"]
connect_timeout_ms = 200
max_in_flight = 4
queue = 8
queue_timeout_ms = 2000

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
timeout_ms = 60
retries = 1

[[routes]]
name = "hold"
path_prefix = "/hold"
upstream = "up"
timeout_ms = 2000
retries = 1
"#,
        up.addr
    ));
    let started = Instant::now();
    let (mut by_status, mut abandoned) = (std::collections::BTreeMap::new(), 0);
    let threads: Vec<_> = (0..10)
        .map(|t| {
            let addr = gw.addr;
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut gone = 0;
                for i in 0..100 {
                    match (t * 100 + i) % 10 {
                        // Abandoned: sent, then the connection closed.
                        0 | 1 => {
                            if let Ok(mut s) = TcpStream::connect(addr) {
                                let _ = s.write_all(
                                    b"GET /slow HTTP/1.1\r\nHost: x\r\nx-mock-delay-ms: 30\r\n\r\n",
                                );
                            }
                            gone += 1;
                        }
                        // Longer than the route's 60 ms: 504.
                        2 | 3 => seen.push(
                            Client::connect(addr)
                                .and_then(|mut c| {
                                    c.request("GET", "/late", &[("x-mock-delay-ms", "150")], b"")
                                })
                                .map_or(0, |r| r.status),
                        ),
                        _ => seen.push(
                            Client::connect(addr)
                                .and_then(|mut c| c.request("GET", "/ok", &[], b""))
                                .map_or(0, |r| r.status),
                        ),
                    }
                }
                (seen, gone)
            })
        })
        .collect();
    for t in threads {
        let (seen, gone) = t.join().unwrap();
        abandoned += gone;
        for s in seen {
            *by_status.entry(s).or_insert(0) += 1;
        }
    }
    let total: usize = by_status.values().sum::<usize>() + abandoned;
    assert_eq!(total, 1000);
    // Every request ended: nothing held, nothing waiting.
    wait_for("every slot given back", Duration::from_secs(10), || {
        let held = gauge(&gw, "gateway_in_flight", "upstream", "up");
        let queued = gauge(&gw, "gateway_in_flight_queued", "upstream", "up");
        (held == 0.0 && queued == 0.0).then_some(())
    });
    println!(
        "FIGURES no leak: 1000 requests in {:.1} s (statuses {by_status:?}, {abandoned} abandoned by their clients), in flight after: 0, queued: 0",
        started.elapsed().as_secs_f64()
    );
    // Some of each: served (half of them after a dead server first),
    // timed out upstream, refused by the cap or dropped in its queue when
    // their clients left, and held past their end for an upstream still
    // working on them.
    for status in [200, 504] {
        assert!(
            by_status.get(&status).copied().unwrap_or(0) >= 20,
            "{by_status:?}"
        );
    }
    // One ending the mix reaches only by chance (one run in ten had none),
    // made sure of: a client that leaves while the upstream still works on
    // its request (500 ms, after one such round trip taught the gateway
    // how long they take). Its slot is held past its end, then given back.
    let warm = Client::connect(gw.addr)
        .and_then(|mut c| c.request("GET", "/hold/warm", &[("x-mock-delay-ms", "500")], b""));
    assert_eq!(warm.map(|r| r.status).ok(), Some(200));
    let held_total = || support::family_sum(&gw.raw_metrics(), "gateway_in_flight_held_total");
    let before = held_total();
    let mut gone = TcpStream::connect(gw.addr).expect("connect");
    gone.write_all(b"GET /hold/gone HTTP/1.1\r\nHost: x\r\nx-mock-delay-ms: 500\r\n\r\n")
        .expect("send");
    wait_for("the upstream to hold it", Duration::from_secs(5), || {
        (up.count("/hold/gone") >= 1).then_some(())
    });
    drop(gone);
    wait_for("its slot held past its end", Duration::from_secs(5), || {
        (held_total() > before).then_some(())
    });
    wait_for(
        "every slot given back again",
        Duration::from_secs(10),
        || (gauge(&gw, "gateway_in_flight", "upstream", "up") == 0.0).then_some(()),
    );
    let metrics = gw.raw_metrics();
    let refused = support::family_sum(&metrics, "gateway_in_flight_refusals_total");
    let held = support::family_sum(&metrics, "gateway_in_flight_held_total");
    println!("FIGURES no leak: {refused} refused or dropped by the cap (503s and clients gone from the queue), {held} slots held past their request's end");
    assert!(
        refused >= 20.0 && held >= 1.0,
        "{refused} refused, {held} held"
    );
    // (The upstream itself may hold more: a request the gateway gave up on
    // at its timeout still runs there.)

    // The whole cap again: 4 at once upstream, 8 queued, the rest refused.
    let got = at_once(gw.addr, 20, "/burst", &[("x-mock-delay-ms", "40")]);
    let ok = count(&got, 200, "");
    let full = count(&got, 503, "queue_full");
    println!("FIGURES after them, 20 at once: {ok} served, {full} refused (cap 4 + queue 8)");
    assert_eq!((ok, full), (12, 8), "the whole cap and queue: {got:?}");
}

/// Sends one request on a connection of its own and closes the connection
/// after `leave_after`, answered or not; whether an answer came first.
fn leaving(addr: SocketAddr, path: &str, leave_after: Duration) -> std::thread::JoinHandle<bool> {
    let path = path.to_string();
    std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .expect("send");
        s.set_read_timeout(Some(leave_after)).expect("timeout");
        let mut buf = [0u8; 64];
        matches!(std::io::Read::read(&mut s, &mut buf), Ok(n) if n > 0)
    })
}

/// Clients who leave: a cap of 4 with a queue of 4 before a 400 ms upstream
/// that goes on working on a request whose client left (as a threaded
/// server does). Four clients leave 0.2 s after they were sent upstream,
/// four more leave 0.1 s into their wait in the queue, and four patient
/// ones come after: the upstream never holds more than 4, and no request
/// whose client left while queued reaches it. Twice: before the gateway
/// knows the upstream's round trip (a slot is then held up to the read
/// timeout), and after (up to the longest recent round trip).
#[test]
fn clients_that_leave_never_push_the_upstream_past_its_cap() {
    let up = UpstreamGuard::start_with(&[
        "--service-ms",
        "400",
        "--workers",
        "64",
        "--threads",
        "2",
        "--finish-abandoned",
    ]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "up"
servers = ["{}"]
read_timeout_ms = 1500
max_in_flight = 4
queue = 4
queue_timeout_ms = 10000

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    ));
    for round in ["first", "second"] {
        let before = up.total();
        let hasty: Vec<_> = (0..4)
            .map(|i| {
                leaving(
                    gw.addr,
                    &format!("/hasty/{round}/{i}"),
                    Duration::from_millis(200),
                )
            })
            .collect();
        wait_for("4 in flight", Duration::from_secs(5), || {
            (gauge(&gw, "gateway_in_flight", "upstream", "up") == 4.0).then_some(())
        });
        let queued: Vec<_> = (0..4)
            .map(|i| {
                leaving(
                    gw.addr,
                    &format!("/queued/{round}/{i}"),
                    Duration::from_millis(100),
                )
            })
            .collect();
        for q in queued {
            assert!(!q.join().unwrap(), "a queued request was not answered");
        }
        for h in hasty {
            assert!(!h.join().unwrap(), "400 ms: not answered within 200 ms");
        }
        let patient = at_once(gw.addr, 4, &format!("/patient/{round}"), &[]);
        assert_eq!(count(&patient, 200, ""), 4, "{patient:?}");
        wait_for("every slot given back", Duration::from_secs(5), || {
            (gauge(&gw, "gateway_in_flight", "upstream", "up") == 0.0).then_some(())
        });
        let stats = up.stats();
        let most = stats["max_in_flight"].as_u64().unwrap();
        let paths = stats["paths"].as_object().unwrap();
        let reached = |prefix: &str| {
            paths
                .iter()
                .filter(|(p, _)| p.starts_with(&format!("/{prefix}/{round}")))
                .map(|(_, n)| n.as_u64().unwrap())
                .sum::<u64>()
        };
        let metrics = gw.raw_metrics();
        let left = support::series(
            &metrics,
            "gateway_in_flight_refusals_total{kind=\"upstream\",name=\"up\",reason=\"client_left\"}",
        )
        .unwrap_or("0")
        .to_string();
        println!(
            "FIGURES clients leaving ({round} round): upstream held at most {most} (cap 4); hasty sent {}, queued-then-gone sent {}, patient sent {}; client_left refusals so far {left}; upstream received {} this round",
            reached("hasty"),
            reached("queued"),
            reached("patient"),
            up.total() - before
        );
        assert!(most <= 4, "the upstream held {most} at once");
        assert_eq!(
            reached("queued"),
            0,
            "a request whose client left while queued was sent"
        );
        assert_eq!((reached("hasty"), reached("patient")), (4, 4));
    }
    let log = gw.log();
    assert!(
        log.contains("rejected_by=\"in_flight:client_left\""),
        "the access log names why"
    );
}

/// Acceptance 3: with the queue full of free-plan requests, a pro request
/// is queued (in place of the newest free one) and served first; another
/// free one is refused. A request without a key comes after every plan.
#[test]
fn a_full_queue_makes_room_for_a_higher_priority_plan() {
    let up = UpstreamGuard::start_with(&["--service-ms", "300", "--threads", "2"]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[plans.free]
capacity = 1000
refill_per_sec = 100

[plans.pro]
capacity = 1000
refill_per_sec = 100
priority = 10

[[api_keys]]
id = "f"
key = "free-secret-1"
plan = "free"

[[api_keys]]
id = "p"
key = "pro-secret-1"
plan = "pro"

[[upstreams]]
name = "up"
servers = ["{}"]
max_in_flight = 1
queue = 2
queue_timeout_ms = 10000

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    ));
    let send = |path: &'static str, key: &'static str| {
        let addr = gw.addr;
        std::thread::spawn(move || {
            let headers: Vec<(&str, &str)> = if key.is_empty() {
                vec![]
            } else {
                vec![("x-api-key", key)]
            };
            Client::connect(addr)
                .and_then(|mut c| c.request("GET", path, &headers, b""))
                .map_or((0, String::new()), |r| (r.status, r.text()))
        })
    };
    let queued = |n: f64| {
        wait_for("the queue to fill", Duration::from_secs(5), || {
            (gauge(&gw, "gateway_in_flight_queued", "upstream", "up") == n).then_some(())
        })
    };
    let holder = send("/free0", "free-secret-1");
    wait_for("the slot taken", Duration::from_secs(5), || {
        (gauge(&gw, "gateway_in_flight", "upstream", "up") == 1.0).then_some(())
    });
    let free1 = send("/free1", "free-secret-1");
    queued(1.0);
    let anonymous = send("/anon", "");
    queued(2.0);
    // Full: the pro request takes the anonymous one's place...
    let pro = send("/pro", "pro-secret-1");
    let (s, body) = anonymous.join().unwrap();
    assert_eq!(s, 503, "{body}");
    assert!(body.contains("displaced"), "{body}");
    queued(2.0);
    // ...and another free one, no higher than any waiting, is refused.
    let (s, body) = send("/free2", "free-secret-1").join().unwrap();
    assert_eq!(s, 503);
    assert!(body.contains("queue_full"), "{body}");
    for t in [holder, free1, pro] {
        assert_eq!(t.join().unwrap().0, 200);
    }
    let times = |p: &str| up.times(p)[0];
    assert!(
        times("/pro") < times("/free1"),
        "the pro request, queued last, was served before the free one"
    );
    println!("FIGURES priority: queue of 2 full (free, no key); pro queued in place of the keyless one (503 displaced), another free refused (503 queue_full); pro served before the free one queued ahead of it");
}

/// `max_in_flight_per_client`: one client's requests past its cap at once
/// on the route are answered 429.
#[test]
fn a_client_gets_its_own_cap_on_a_route() {
    let up = UpstreamGuard::start_with(&["--service-ms", "300", "--threads", "2"]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
max_in_flight_per_client = 2
"#,
        up.addr
    ));
    // One client (its address): five at once, two served.
    let got = at_once(gw.addr, 5, "/x", &[]);
    assert_eq!(count(&got, 200, ""), 2, "{got:?}");
    assert_eq!(count(&got, 429, "max_in_flight_per_client"), 3, "{got:?}");
    // Not a quota: a problem type of its own.
    assert_eq!(
        count(
            &got,
            429,
            "urn:ratelimit-gateway:problem:too-many-in-flight"
        ),
        3,
        "{got:?}"
    );
    println!("FIGURES per client: cap 2, 5 at once from one client: 2 served, 3 answered 429");
}

/// Acceptance 4: an upstream of 8 workers at 100 ms, 40 clients looping;
/// at the middle its service time doubles. The adaptive limit finds the
/// workers, falls when the upstream slows, and finds them again; the
/// upstream's own queue stays short throughout (a fixed cap of 40 would
/// keep 32 waiting there).
#[test]
fn an_adaptive_limit_follows_an_upstream_that_slows_down() {
    let up =
        UpstreamGuard::start_with(&["--service-ms", "100", "--workers", "8", "--threads", "2"]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "up"
servers = ["{}"]
read_timeout_ms = 5000
queue = 100
queue_timeout_ms = 300
adaptive = {{ enabled = true, min = 2, max = 100 }}

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    ));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> = (0..40)
        .map(|_| {
            let (addr, stop) = (gw.addr, stop.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(addr).ok();
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = c
                        .as_mut()
                        .and_then(|c| c.request("GET", "/w", &[], b"").ok());
                    if r.as_ref().is_none_or(|r| r.status != 200) {
                        // Refused (the gateway closes nothing) or failed:
                        // a fresh connection, after a breath.
                        std::thread::sleep(Duration::from_millis(20));
                        c = Client::connect(addr).ok();
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let started = Instant::now();
    let mut timeline = Vec::new();
    let mut slowed = None;
    while started.elapsed() < Duration::from_secs(16) {
        std::thread::sleep(Duration::from_millis(250));
        let t = started.elapsed().as_secs_f64();
        if slowed.is_none() && t >= 6.0 {
            let r = Client::connect(up.addr)
                .and_then(|mut c| c.request("POST", "/control?service_ms=200", &[], b""))
                .expect("slow the upstream");
            assert_eq!(r.status, 200);
            slowed = Some(t);
        }
        let s = up.stats();
        let text = gw.raw_metrics();
        let rtt = |estimate: &str| {
            let name =
                format!("gateway_adaptive_rtt_seconds{{upstream=\"up\",estimate=\"{estimate}\"}}");
            support::series(&text, &name).map_or(0.0, |v| v.parse::<f64>().unwrap_or(0.0) * 1e3)
        };
        let limit = support::series(
            &text,
            "gateway_in_flight_limit{kind=\"upstream\",name=\"up\"}",
        )
        .map_or(0.0, |v| v.parse().unwrap_or(0.0));
        timeline.push((
            t,
            limit,
            s["in_flight"].as_u64().unwrap(),
            s["waiting"].as_u64().unwrap(),
            rtt("min"),
            rtt("sample"),
        ));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let requests: u64 = clients.into_iter().map(|c| c.join().unwrap()).sum();
    println!("FIGURES adaptive timeline (s, limit, upstream in flight, upstream waiting, min and last mean round trip in ms); service 100 ms -> 200 ms at {slowed:?} s, 8 workers, {requests} requests:");
    for (t, l, f, w, min, median) in &timeline {
        println!("FIGURES   {t:5.2} {l:5.0} {f:4} {w:4} {min:6.1} {median:6.1}");
    }
    let window = |from: f64, to: f64| timeline.iter().filter(move |e| e.0 >= from && e.0 < to);
    // Settled before the slowdown and again at the end: near the 8 workers.
    for (from, to) in [(3.0, 6.0), (13.0, 16.0)] {
        let limits: Vec<f64> = window(from, to).map(|e| e.1).collect();
        let mean = limits.iter().sum::<f64>() / limits.len() as f64;
        assert!(
            (7.0..=11.0).contains(&mean),
            "limit over [{from}, {to}) s: {limits:?}"
        );
    }
    // The upstream's own queue stays short once the limit is found (40
    // clients against 8 workers would keep 32 waiting without it).
    let waiting: Vec<u64> = window(3.0, 16.0).map(|e| e.3).collect();
    let mut sorted = waiting.clone();
    sorted.sort_unstable();
    let p90 = sorted[sorted.len() * 9 / 10];
    println!("FIGURES adaptive: upstream waiting p90 {p90} (of 40 clients, 8 workers)");
    assert!(p90 <= 4, "upstream queue: {waiting:?}");
    let est = gw.metrics();
    assert!(
        est.contains("gateway_adaptive_rtt_seconds{upstream=\"up\",estimate=\"min\"}"),
        "{est}"
    );
}

/// A pool-wide cap (`pool_max_in_flight = 4`) over two replicas on one
/// Redis: each takes half once the heartbeats count both, so 10 at once on
/// one replica get 2 served.
#[test]
fn a_pool_wide_cap_is_shared_by_the_live_replicas() {
    let redis = support::RedisGuard::start();
    let up = UpstreamGuard::start_with(&["--service-ms", "300", "--threads", "2"]);
    let config = format!(
        r#"
{SERVER_2_THREADS}

[limiter]
backend = "redis"

[redis]
urls = ["{}"]

[[upstreams]]
name = "up"
servers = ["{}"]
pool_max_in_flight = 4

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
        redis.url(),
        up.addr
    );
    let a = GatewayGuard::start(&config);
    let b = GatewayGuard::start(&config);
    for gw in [&a, &b] {
        wait_for("two live replicas", Duration::from_secs(15), || {
            (gw.admin_get("/readyz").json()["replicas"] == 2).then_some(())
        });
    }
    let got = at_once(a.addr, 10, "/x", &[]);
    let ok = count(&got, 200, "");
    assert_eq!(gauge(&a, "gateway_in_flight_limit", "upstream", "up"), 2.0);
    println!(
        "FIGURES pool-wide cap 4 over 2 replicas: 10 at once on one: {ok} served (its half: 2)"
    );
    assert_eq!(ok, 2, "{got:?}");
    assert!(up.stats()["max_in_flight"].as_u64().unwrap() <= 2);
}

/// The rate-limit tokens of a request the in-flight caps refuse, or
/// drop because its client left while queued, are given back, as a
/// rejection by another tier is: a key's quota `used` is what reached the
/// upstream. On the local backend and on Redis with leases (where most
/// tiers are decided on a lease).
#[test]
fn a_request_that_never_reaches_the_upstream_is_not_charged() {
    for backend in ["local", "redis"] {
        let redis = support::RedisGuard::start();
        let up = UpstreamGuard::start_with(&["--service-ms", "400", "--threads", "2"]);
        let limiter = match backend {
            "local" => "[limiter]\nbackend = \"local\"".to_string(),
            _ => format!(
                "[limiter]\nbackend = \"redis\"\n\n[redis]\nurls = [\"{}\"]",
                redis.url()
            ),
        };
        let gw = GatewayGuard::start(&format!(
            r#"
{SERVER_2_THREADS}

{limiter}

[plans.metered]
capacity = 1000
refill_per_sec = 1000
quotas = [{{ limit = 1000, period = "month" }}]

[[api_keys]]
id = "k1"
key = "k1-secret"
plan = "metered"

[[upstreams]]
name = "up"
servers = ["{}"]
max_in_flight = 1
queue = 1
queue_timeout_ms = 10000

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
            up.addr
        ));
        let key = [("x-api-key", "k1-secret")];
        // One in flight; one queued whose client leaves; then three at
        // once while the first is still upstream: one queues, two are
        // refused (queue_full). However the timing falls, what is charged
        // must be what the upstream received.
        let first = {
            let addr = gw.addr;
            std::thread::spawn(move || at_once(addr, 1, "/first", &[("x-api-key", "k1-secret")]))
        };
        wait_for("one in flight", Duration::from_secs(5), || {
            (gauge(&gw, "gateway_in_flight", "upstream", "up") == 1.0).then_some(())
        });
        let mut c = std::net::TcpStream::connect(gw.addr).expect("connect");
        c.write_all(b"GET /gone HTTP/1.1\r\nHost: x\r\nx-api-key: k1-secret\r\n\r\n")
            .expect("send");
        std::thread::sleep(Duration::from_millis(100));
        drop(c);
        let burst = at_once(gw.addr, 3, "/burst", &key);
        let first = first.join().unwrap();
        wait_for("every slot given back", Duration::from_secs(5), || {
            (gauge(&gw, "gateway_in_flight", "upstream", "up") == 0.0).then_some(())
        });
        // Leases settle within a period and a quarter (100 ms by default).
        std::thread::sleep(Duration::from_millis(500));
        let used = gw.quota_used("k1", "quota-month");
        let refunds = gw.metric("gateway_refunds_total");
        let refused = count(&burst, 503, "");
        println!(
            "FIGURES refunds ({backend}): first {:?}, burst {:?}; upstream received {}, quota used {used}, refunds {refunds}",
            first.iter().map(|r| r.0).collect::<Vec<_>>(),
            burst.iter().map(|r| r.0).collect::<Vec<_>>(),
            up.total()
        );
        assert!(refused >= 1, "{backend}: some were refused: {burst:?}");
        assert!(refunds >= refused as f64, "{backend}: refunds {refunds}");
        assert_eq!(
            used,
            up.total(),
            "{backend}: charged only what reached the upstream"
        );
    }
}
