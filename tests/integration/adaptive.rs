//! The adaptive limit through the real gateway, against a mock upstream of
//! workers that loses half of them mid-run (as a drained pod does: each
//! leaves once it finishes what it holds), under 40 looping clients: from
//! the cold start on the upstream holds at most twice its workers, and after
//! the loss the limit is at the workers left within 3 s (4 on a busy host)
//! and stays there, the unloaded round trip still the service time (a queue once passed
//! for a server that became slower: 190 ms learnt over 120 ms, and the
//! limit stayed at the workers it no longer had). The timeline is printed.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Client, GatewayGuard, UpstreamGuard, SERVER_2_THREADS};

/// One look at the gateway and the upstream, `t` s into the load.
#[derive(Debug, Clone, Copy)]
struct Look {
    t: f64,
    limit: f64,
    /// The upstream's requests held now (served and waiting), and waiting.
    held: u64,
    waiting: u64,
    /// The unloaded round trip the gateway knows, in ms.
    min_rtt_ms: f64,
}

fn look(gw: &GatewayGuard, up: &UpstreamGuard, t: f64) -> Look {
    let s = up.stats();
    let text = gw.raw_metrics();
    let value = |name: &str| support::series(&text, name).and_then(|v| v.parse::<f64>().ok());
    Look {
        t,
        limit: value("gateway_in_flight_limit{kind=\"upstream\",name=\"up\"}").unwrap_or(0.0),
        held: s["in_flight"].as_u64().unwrap_or(0),
        waiting: s["waiting"].as_u64().unwrap_or(0),
        min_rtt_ms: value("gateway_adaptive_rtt_seconds{upstream=\"up\",estimate=\"min\"}")
            .map_or(0.0, |v| v * 1e3),
    }
}

/// When the limit entered the band it stays in to the end, from the loss
/// (0 if it never left it); `None` if it is outside it at the end.
fn settled(looks: &[Look], lost: f64, band: (f64, f64)) -> Option<f64> {
    let inside = |l: &Look| (band.0..=band.1).contains(&l.limit);
    let after: Vec<&Look> = looks.iter().filter(|l| l.t >= lost).collect();
    let last_out = after.iter().rposition(|l| !inside(l));
    match last_out {
        None => Some(0.0),
        Some(i) => after.get(i + 1).map(|l| l.t - lost),
    }
}

/// An upstream of `workers` at `service_ms` under 40 looping clients for
/// 7 s, then half its workers leave; 7 s more.
fn halving(workers: u64, service_ms: u64) {
    let up = UpstreamGuard::start_with(&[
        "--service-ms",
        &service_ms.to_string(),
        "--workers",
        &workers.to_string(),
        "--threads",
        "2",
    ]);
    let gw = GatewayGuard::start(&format!(
        r#"
{SERVER_2_THREADS}

[[upstreams]]
name = "up"
servers = ["{}"]
read_timeout_ms = 10000
queue = 100
queue_timeout_ms = 300
adaptive = {{ enabled = true, min = 1, max = 100 }}

[[routes]]
name = "r"
path_prefix = "/"
upstream = "up"
"#,
        up.addr
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..40)
        .map(|_| {
            let (addr, stop) = (gw.addr, stop.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(addr).ok();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let r = c
                        .as_mut()
                        .and_then(|c| c.request("GET", "/w", &[], b"").ok());
                    if r.as_ref().is_none_or(|r| r.status != 200) {
                        // Refused by the gate: a fresh connection, after a
                        // breath.
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
    let left = workers / 2;
    let (lose_at, end) = (7.0, 14.0);
    let (mut looks, mut lost, mut cold) = (Vec::new(), None, None);
    while started.elapsed().as_secs_f64() < end {
        std::thread::sleep(Duration::from_millis(100));
        let t = started.elapsed().as_secs_f64();
        if lost.is_none() && t >= lose_at {
            // The most the upstream held at once from the cold start on.
            cold = up.stats()["max_in_flight"].as_u64();
            let r = Client::connect(up.addr)
                .and_then(|mut c| c.request("POST", &format!("/control?workers={left}"), &[], b""))
                .expect("take workers away");
            assert_eq!(r.status, 200, "{}", r.text());
            lost = Some(started.elapsed().as_secs_f64());
        }
        looks.push(look(&gw, &up, t));
    }
    stop.store(true, Ordering::Relaxed);
    let requests: u64 = clients.into_iter().map(|c| c.join().unwrap()).sum();
    let (lost, cold) = (lost.expect("the loss"), cold.expect("the cold start"));
    println!("FIGURES adaptive, {workers} workers of {service_ms} ms, {left} left at {lost:.2} s, {requests} requests; (s, limit, upstream held, waiting, min round trip ms):");
    for l in &looks {
        println!(
            "FIGURES   {:5.2} {:4.0} {:4} {:4} {:7.1}",
            l.t, l.limit, l.held, l.waiting, l.min_rtt_ms
        );
    }
    let band = ((left as f64 - 1.0).max(1.0), left as f64 + 1.0);
    let adapted = settled(&looks, lost, band);
    let after: Vec<&Look> = looks.iter().filter(|l| l.t >= lost + 3.0).collect();
    let mut waiting: Vec<u64> = after.iter().map(|l| l.waiting).collect();
    waiting.sort_unstable();
    let p90 = waiting.get(waiting.len() * 9 / 10).copied().unwrap_or(0);
    let settled_at = after.last().map_or(0.0, |l| l.limit);
    let min_rtt = looks.last().map_or(0.0, |l| l.min_rtt_ms);
    println!(
        "FIGURES adaptive {workers}x{service_ms} -> {left}: the upstream held at most {cold} from the cold start to the loss ({:.2}x the workers); adapted {} s after the loss to a limit in {band:?}, settled at {settled_at}; upstream waiting p90 {p90} from 3 s after; unloaded round trip {min_rtt:.1} ms",
        cold as f64 / workers as f64,
        adapted.map_or("never".to_string(), |s| format!("{s:.1}")),
    );
    // The cold start's last doubling passes the workers once, by at most
    // as many again; on a loaded host the queue that doubling makes can go
    // unseen for an interval, and one more doubling passes (16 over 6
    // workers, in 1 of 10 full-suite runs). Never a second one.
    assert!(
        cold <= 3 * workers,
        "the upstream held {cold} at once from the cold start on, past three times its {workers} workers"
    );
    let before: Vec<f64> = looks
        .iter()
        .filter(|l| (lose_at - 2.0..lose_at).contains(&l.t))
        .map(|l| l.limit)
        .collect();
    assert!(
        before.iter().any(|l| *l >= workers as f64 - 1.0),
        "the limit never reached the {workers} workers before the loss: {before:?}"
    );
    // Within 3 s on a quiet host (0.5-1.9 s measured); a second more for a
    // busy one (3.0 s with two more spinning threads beside it).
    assert!(
        adapted.is_some_and(|s| s <= 4.0),
        "the limit was not within {band:?} from 4 s after the loss on: {:?}",
        after.iter().map(|l| l.limit).collect::<Vec<_>>()
    );
    assert!(
        p90 <= 1,
        "the upstream's own queue from 3 s after: {waiting:?}"
    );
    assert!(
        min_rtt <= service_ms as f64 * 1.1,
        "a queue learnt as the unloaded round trip: {min_rtt:.1} ms over {service_ms} ms of service"
    );
}

#[test]
fn an_adaptive_limit_follows_an_upstream_that_loses_half_its_workers() {
    halving(6, 120);
}

/// Shapes a user would vary (run by hand: `--ignored`).
#[test]
#[ignore = "a sweep of other shapes, run by hand with --ignored"]
fn an_adaptive_limit_follows_8_workers_of_50_ms_halved() {
    halving(8, 50);
}

#[test]
#[ignore = "a sweep of other shapes, run by hand with --ignored"]
fn an_adaptive_limit_follows_4_workers_of_300_ms_halved() {
    halving(4, 300);
}
