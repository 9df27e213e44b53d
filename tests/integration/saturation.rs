//! A CPU-saturated replica on a healthy Redis must not fail over and must
//! not over-reject: one single-threaded gateway is driven by 48 keep-alive
//! clients while two threads spin as a noisy neighbour. On a limit that never
//! empties nothing may be rejected; on a limit the load exceeds, the admitted
//! count must sit inside the exact bounds a shared token bucket allows over
//! the measured span. In both, the breaker must never open but when the
//! watchdog found Redis itself late (its PING unanswered within the budget:
//! a host this busy can starve Redis too); the replica's own lateness must
//! never open it.
//!
//! Its own test binary: the CPU hogging would disturb any test beside it.

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::{Client, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

const CLIENTS: usize = 48;
const HOGS: usize = 2;
const RUN: Duration = Duration::from_secs(4);

/// Phase B's plan: a small burst and a refill far below what the load offers,
/// so the bucket is empty nearly all the run and the bounds are tight. (The
/// load offers what the host lets it: 140-600 a second through the debug
/// build on 2 busy cores. A refill of 500 was not exceeded on a loaded host,
/// and then no bound was tested.)
const B_CAPACITY: f64 = 100.0;
const B_REFILL: f64 = 50.0;

const TO_LOCAL: &str = "gateway_fallback_transitions_total{to=\"local\"}";
const TO_REDIS: &str = "gateway_fallback_transitions_total{to=\"redis\"}";
const LATE_GATEWAY: &str = "gateway_redis_late_calls_total{verdict=\"gateway\"}";
const LATE_REDIS: &str = "gateway_redis_late_calls_total{verdict=\"redis\"}";

fn config(redis: &RedisGuard, up: &UpstreamGuard) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
on_redis_failure = "local"
instances = 3
retry_after_jitter_ms = 0

[redis]
urls = ["{}"]
timeout_ms = 15
probe_interval_ms = 100

[plans.open]
capacity = 1000
refill_per_sec = 1000000

[plans.tight]
capacity = {B_CAPACITY}
refill_per_sec = {B_REFILL}

[[api_keys]]
id = "k"
key = "secret-k"
plan = "open"

[[api_keys]]
id = "t"
key = "secret-t"
plan = "tight"

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
"#,
        redis.url(),
        up.addr
    )
}

/// One request as a client saw it, in seconds since the phase began.
#[derive(Clone, Copy)]
struct Sample {
    sent: f64,
    recv: f64,
    /// 0: no response (connection error).
    status: u16,
}

impl Sample {
    fn latency(&self) -> f64 {
        self.recv - self.sent
    }
}

/// Drives `path` with `key` from `CLIENTS` keep-alive clients, one request at
/// a time each, for `RUN`, while `HOGS` threads spin. Every thread stops by
/// itself at the deadline; a stuck request is bounded by the client's read
/// timeout.
fn drive(addr: SocketAddr, key: &'static str, path: &'static str) -> Vec<Sample> {
    let epoch = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..HOGS)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = i as u64 + 1;
                // The deadline too, so a client panic cannot leave a hog spinning.
                while !stop.load(Ordering::Relaxed) && epoch.elapsed() < RUN * 3 {
                    for _ in 0..10_000 {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                }
                x
            })
        })
        .collect();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            std::thread::spawn(move || {
                let mut out = Vec::new();
                let mut conn: Option<Client> = None;
                while epoch.elapsed() < RUN {
                    let sent = epoch.elapsed().as_secs_f64();
                    if conn.is_none() {
                        conn = Client::connect(addr).ok();
                    }
                    let status = match conn
                        .as_mut()
                        .map(|c| c.request("GET", path, &[("x-api-key", key)], b""))
                    {
                        Some(Ok(r)) => r.status,
                        _ => {
                            conn = None;
                            0
                        }
                    };
                    let recv = epoch.elapsed().as_secs_f64();
                    out.push(Sample { sent, recv, status });
                }
                out
            })
        })
        .collect();
    let mut samples = Vec::new();
    for c in clients {
        samples.extend(c.join().expect("client thread"));
    }
    stop.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().expect("hog thread");
    }
    samples
}

struct Figures {
    sent: usize,
    ok: usize,
    rejected: usize,
    errors: usize,
    other: usize,
    /// First request sent to last response received.
    span: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_latency: f64,
}

fn figures(samples: &[Sample]) -> Figures {
    assert!(!samples.is_empty(), "no request was sent");
    let count = |f: &dyn Fn(u16) -> bool| samples.iter().filter(|s| f(s.status)).count();
    let mut lat: Vec<f64> = samples.iter().map(Sample::latency).collect();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize] * 1000.0;
    let first = samples.iter().map(|s| s.sent).fold(f64::INFINITY, f64::min);
    let last = samples.iter().map(|s| s.recv).fold(0.0, f64::max);
    Figures {
        sent: samples.len(),
        ok: count(&|s| s == 200),
        rejected: count(&|s| s == 429),
        errors: count(&|s| s == 0 || s >= 500),
        other: count(&|s| s != 0 && s != 200 && s != 429 && s < 500),
        span: last - first,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        max_latency: *lat.last().unwrap(),
    }
}

/// The longest the limiter could have gone between two consecutive
/// rejections, judged from the clients' clocks alone. Each rejection was
/// decided within its request's [sent, recv]; if consecutive rejections were
/// decided at a' < b', every 429 request sent after a' was decided at or
/// after b', so b' is at most the earliest `recv` among them.
fn longest_rejection_gap(rejected: &[Sample]) -> f64 {
    let mut by_sent = rejected.to_vec();
    by_sent.sort_by(|a, b| a.sent.total_cmp(&b.sent));
    let mut gap = by_sent.last().map_or(0.0, Sample::latency);
    let mut min_recv_after = f64::INFINITY;
    for k in (1..by_sent.len()).rev() {
        min_recv_after = min_recv_after.min(by_sent[k].recv);
        gap = f64::max(gap, min_recv_after - by_sent[k - 1].sent);
    }
    gap
}

fn ms(s: f64) -> f64 {
    s * 1000.0
}

#[test]
fn saturated_replica_on_healthy_redis_keeps_the_exact_limit() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let gw = GatewayGuard::start(&config(&redis, &up));
    let metric = |name: &str| gw.metric(name);

    // Phase A: a bucket that can never empty, so any 429 or 5xx is the
    // gateway failing, and any transition is the breaker blaming Redis for
    // the gateway's own saturation.
    let (late_gw0, late_redis0) = (metric(LATE_GATEWAY), metric(LATE_REDIS));
    let a = drive(gw.addr, "secret-k", "/r/a");
    let fa = figures(&a);
    let (to_local, to_redis) = (metric(TO_LOCAL), metric(TO_REDIS));
    let (late_gw, late_redis) = (metric(LATE_GATEWAY), metric(LATE_REDIS));
    eprintln!(
        "FIGURES saturation-A: sent={} rps={:.0} 200={} 429={} errors={} other={} transitions_to_local={to_local} transitions_to_redis={to_redis} late_calls_gateway={} late_calls_redis={} p50_ms={:.2} p99_ms={:.2} max_ms={:.1}",
        fa.sent,
        fa.sent as f64 / fa.span,
        fa.ok,
        fa.rejected,
        fa.errors,
        fa.other,
        late_gw - late_gw0,
        late_redis - late_redis0,
        fa.p50_ms,
        fa.p99_ms,
        ms(fa.max_latency),
    );
    // Every client had several answers: the load ran. (A count, not a
    // rate: a loaded host lets through a fifth of what an idle one does,
    // and what is asserted below holds for whatever got through.)
    assert!(
        fa.sent >= 4 * CLIENTS,
        "A: the load ran ({} requests from {CLIENTS} clients)",
        fa.sent
    );
    assert_eq!(fa.errors, 0, "A: 5xx or connection errors");
    assert_eq!(fa.rejected, 0, "A: 429s from a bucket that never empties");
    assert_eq!(fa.other, 0, "A: every request reached the upstream");
    // An opening the watchdog confirmed (its PING, on a thread of its own,
    // unanswered within the budget: a host this busy can starve Redis
    // itself) is Redis's latency, as designed; every other is this
    // replica blaming Redis for its own.
    let (opened_a, confirmed_a) = (to_local, late_redis - late_redis0);
    assert!(
        opened_a <= confirmed_a,
        "A: the breaker opened {opened_a} times on a Redis that answered the watchdog (it found Redis late {confirmed_a} times)"
    );

    // Phase B: a bucket the load keeps empty, on its own key so it starts
    // full at its first decision.
    let (late_gw0, late_redis0) = (metric(LATE_GATEWAY), metric(LATE_REDIS));
    let b = drive(gw.addr, "secret-t", "/r/b");
    let fb = figures(&b);
    let (to_local, to_redis) = (metric(TO_LOCAL), metric(TO_REDIS));
    let (late_gw, late_redis) = (metric(LATE_GATEWAY), metric(LATE_REDIS));
    let upstream_saw = up.count("/r/b");

    // Upper bound: the bucket starts full (capacity) at its first decision
    // and refills at the plan's rate until its last; both decisions fall
    // within the clients' span (first sent .. last received), so no correct
    // limiter admits more than capacity + refill * span (+1 for rounding and
    // for Redis's clock against ours).
    let upper = B_CAPACITY + B_REFILL * fb.span;

    // Lower bound: let a be the first rejection's decision and b the
    // decision of the last-sent 429. At a the bucket held < 1 token, so at
    // least `capacity` were admitted before a. Between a and b it refilled
    // refill * (b - a) tokens; everything not admitted is either still in
    // the bucket at b or overflowed a full bucket. At b the bucket held < 1
    // token if Redis decided, and < 1 + refill * max_latency if the
    // gateway's denial memory did (that memory may outlive the denial by the
    // time its answer took to arrive, within one request's latency). A full
    // bucket needs (capacity - 1) / refill seconds without an admission,
    // which cannot fit between two rejections less than that apart, less the
    // same memory overshoot. So if the longest possible gap between
    // rejections is shorter, nothing overflowed and
    //   admitted >= capacity + refill * (b - a) - 1 - refill * max_latency,
    // with b - a >= (last 429 sent) - (first 429 received), from the
    // clients' clocks only. A stall long enough to fill the bucket leaves
    // the lower bound unproven, and it is then only reported.
    let rejected: Vec<Sample> = b.iter().copied().filter(|s| s.status == 429).collect();
    let first_429_recv = rejected
        .iter()
        .map(|s| s.recv)
        .fold(f64::INFINITY, f64::min);
    let last_429_sent = rejected.iter().map(|s| s.sent).fold(0.0, f64::max);
    let window = (last_429_sent - first_429_recv).max(0.0);
    let lower = B_CAPACITY + B_REFILL * (window - fb.max_latency) - 1.0;
    let gap = longest_rejection_gap(&rejected);
    let no_overflow = gap < (B_CAPACITY - 1.0) / B_REFILL - fb.max_latency;
    eprintln!(
        "FIGURES saturation-B: sent={} rps={:.0} admitted={} upper_bound={upper:.1} lower_bound={lower:.1}{} 429={} errors={} other={} span_s={:.3} transitions_to_local={to_local} transitions_to_redis={to_redis} late_calls_gateway={} late_calls_redis={} p50_ms={:.2} p99_ms={:.2} max_ms={:.1} longest_rejection_gap_ms={:.1} upstream_saw={upstream_saw}",
        fb.sent,
        fb.sent as f64 / fb.span,
        fb.ok,
        if no_overflow { "" } else { " (not proven: a stall could overflow the bucket)" },
        fb.rejected,
        fb.errors,
        fb.other,
        fb.span,
        late_gw - late_gw0,
        late_redis - late_redis0,
        fb.p50_ms,
        fb.p99_ms,
        ms(fb.max_latency),
        ms(gap),
    );
    assert_eq!(fb.errors, 0, "B: 5xx or connection errors");
    assert_eq!(fb.other, 0, "B: only 200s and 429s");
    assert!(
        fb.rejected > 0,
        "B: the load never exceeded the limit ({} sent), so the bound was not tested",
        fb.sent
    );
    let (opened_b, confirmed_b) = (to_local - opened_a, late_redis - late_redis0);
    assert!(
        opened_b <= confirmed_b,
        "B: the breaker opened {opened_b} times on a Redis that answered the watchdog (it found Redis late {confirmed_b} times)"
    );
    assert_eq!(
        upstream_saw, fb.ok as u64,
        "B: the upstream saw exactly the admitted requests"
    );
    // (An outage the watchdog confirmed admits no more than the shared
    // limit plus a request of rounding per opening; and less, so the lower
    // bound is only for a run without one.)
    assert!(
        fb.ok as f64 <= upper + 1.0 + opened_b,
        "B: admitted {} > capacity + refill x span = {upper:.1} (openings: {opened_b})",
        fb.ok
    );
    if no_overflow && opened_b == 0.0 {
        assert!(
            fb.ok as f64 >= lower - 1.0,
            "B: admitted {} < {lower:.1}: 429s beyond the exact bound",
            fb.ok
        );
    }
    gw.wait_backend("redis", Duration::from_secs(1));
}
