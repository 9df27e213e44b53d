//! Simulated upstreams the controller's tests drive it against: a fluid
//! server (each round trip its concurrency's share of the workers' time),
//! the same with scattered answers or slowed once, and an event-driven
//! server of workers whose requests come back in waves, with service times
//! that change and workers that join. Each returns what the controller
//! chose.

use super::{Gradient, Probe};
use crate::clock::Micros;

/// A server of `workers` workers, each request `service_us` long: the
/// round trip of a request sent with `c` in flight (FIFO, fluid).
pub(super) fn rtt(workers: u32, service_us: u64, c: u32) -> u64 {
    service_us * (c.max(workers) as u64) / workers as u64
}

/// Drives the controller for `secs` with demand that always fills its
/// limit (a sample every 12.5 ms); returns (when, limit) of each change
/// of interval.
pub(super) fn run(
    g: &mut Gradient,
    t: &mut Micros,
    secs: i64,
    workers: u32,
    service_us: u64,
) -> Vec<(Micros, u32)> {
    let (mut out, end) = (Vec::new(), *t + secs * 1_000_000);
    while *t < end {
        *t += 12_500;
        let (c, rtt) = fluid_step(g, *t, workers, service_us);
        if let Some(e) = g.sample(*t, rtt, c) {
            out.push((*t, e.limit));
        }
    }
    out
}

/// A request of the fluid model: sent at the limit, or past it as a
/// probe's, expected to wait a mean gap between answers (what one
/// past the workers waits by Little's law); its (in flight, round
/// trip).
pub(super) fn fluid_step(g: &mut Gradient, t: Micros, workers: u32, service_us: u64) -> (u32, u64) {
    let (min_rtt, c) = (g.estimate().min_rtt_us as i64, g.limit());
    let oldest = t - min_rtt + min_rtt / c.max(1) as i64;
    // As many as may be out at once, sent together.
    let probes: Vec<Probe> = std::iter::from_fn(|| g.take_probe(t, oldest)).collect();
    let c = c + probes.len() as u32;
    let rtt = rtt(workers, service_us, c);
    for probe in probes {
        g.probe_answered(probe, rtt);
    }
    (c, rtt)
}

/// A server whose answers scatter: each round trip off by up to
/// `jitter_us` either way (a deterministic pseudo-random sequence).
pub(super) fn run_noisy(
    g: &mut Gradient,
    t: &mut Micros,
    secs: i64,
    workers: u32,
    service_us: u64,
    jitter_us: u64,
) -> Vec<(Micros, u32)> {
    let mut rng = fastrand::Rng::with_seed(7);
    let (mut out, end) = (Vec::new(), *t + secs * 1_000_000);
    // A sample per (service / workers): the rate the server answers at.
    let step = (service_us / workers as u64) as i64;
    while *t < end {
        *t += step.min(12_500);
        let (c, rtt) = fluid_step(g, *t, workers, service_us);
        let noise = rng.u64(0..=2 * jitter_us) as i64 - jitter_us as i64;
        let rtt = (rtt as i64 + noise).max(1) as u64;
        if let Some(e) = g.sample(*t, rtt, c) {
            out.push((*t, e.limit));
        }
    }
    out
}

/// A server of `workers` workers taking `service_us` each (plus up to
/// `jitter_us`), FIFO, as events: requests sent together come back
/// together, so one past the workers waits a whole service time. The
/// client always has a request waiting. Returns each request's (end,
/// round trip) and the limit at each interval's end, after `settle`.
pub(super) fn run_waves(
    g: &mut Gradient,
    secs: i64,
    workers: u32,
    service_us: u64,
    jitter_us: u64,
) -> (Vec<(Micros, u64)>, Vec<u32>) {
    let (rtts, limits) = run_slowing(g, secs, workers, service_us, jitter_us, Micros::MAX);
    (rtts, limits.into_iter().map(|(_, l)| l).collect())
}

/// Each request's (end, round trip); each limit chosen, with when.
pub(super) type Timeline = (Vec<(Micros, u64)>, Vec<(Micros, u32)>);

/// `run_waves`, the service time doubled for requests a worker starts
/// from `slow_from` on; the limits with when each was chosen.
pub(super) fn run_slowing(
    g: &mut Gradient,
    secs: i64,
    workers: u32,
    service_us: u64,
    jitter_us: u64,
    slow_from: Micros,
) -> Timeline {
    let mut rng = fastrand::Rng::with_seed(11);
    let service = move |at: Micros| {
        let s = service_us + rng.u64(0..=jitter_us);
        if at >= slow_from {
            2 * s
        } else {
            s
        }
    };
    run_served(g, secs, workers, &[], service_us + jitter_us / 2, service)
}

/// A server of `workers` workers whose request started at `at` takes
/// `service(at)`, with a client that always has a request waiting
/// (closed loop at the limit), and new ones arriving at random at twice
/// the capacity for a probe to go with (`mean_us`: the mean service).
/// More workers join at the times in `joining`.
pub(super) fn run_served(
    g: &mut Gradient,
    secs: i64,
    workers: u32,
    joining: &[Micros],
    mean_us: u64,
    service: impl FnMut(Micros) -> u64,
) -> Timeline {
    run_changing(g, secs, workers, (joining, &[]), mean_us, service)
}

/// `run_served`, with workers that join at the times in `changes.0` and
/// leave at those in `changes.1` (each as soon as it is free from then on:
/// a pod that is drained finishes what it holds).
pub(super) fn run_changing(
    g: &mut Gradient,
    secs: i64,
    workers: u32,
    (joining, leaving): (&[Micros], &[Micros]),
    mean_us: u64,
    mut service: impl FnMut(Micros) -> u64,
) -> Timeline {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    const ARRIVAL: Micros = -1;
    let mut rng = fastrand::Rng::with_seed(3);
    let gap = (mean_us / (2 * workers as u64)).max(1);
    let mut free: BinaryHeap<Reverse<Micros>> = (0..workers)
        .map(|_| Reverse(0))
        .chain(joining.iter().map(|at| Reverse(*at)))
        .collect();
    // Events: (when, sent, in flight when sent, a probe's), or an
    // arrival (when, ARRIVAL, ..).
    type Event = (Micros, Micros, u32, Option<Probe>);
    let mut events: BinaryHeap<Reverse<Event>> = BinaryHeap::new();
    let (mut rtts, mut limits, mut in_flight) = (Vec::new(), Vec::new(), 0u32);
    let mut leaving: Vec<Micros> = leaving.to_vec();
    leaving.sort_unstable_by(|a, b| b.cmp(a));
    let mut send = |t: Micros, in_flight: &mut u32, events: &mut BinaryHeap<_>, probe| {
        let mut at = free.pop().unwrap().0;
        // A worker free after a time one leaves at is the one that leaves.
        while leaving.last().is_some_and(|l| *l <= t.max(at)) && !free.is_empty() {
            leaving.pop();
            at = free.pop().unwrap().0;
        }
        let end = t.max(at) + service(t.max(at)) as Micros;
        free.push(Reverse(end));
        *in_flight += 1;
        events.push(Reverse((end, t, *in_flight, probe)));
    };
    while in_flight < g.limit() {
        send(0, &mut in_flight, &mut events, None);
    }
    events.push(Reverse((rng.u64(1..=2 * gap) as Micros, ARRIVAL, 0, None)));
    while let Some(Reverse((t, sent, c, probe))) = events.pop() {
        if t > secs * 1_000_000 {
            break;
        }
        if sent == ARRIVAL {
            // The in-flight request as many places from the oldest as
            // probes are out.
            let mut sent: Vec<Micros> = events
                .iter()
                .map(|Reverse((_, sent, ..))| *sent)
                .filter(|s| *s != ARRIVAL)
                .collect();
            sent.sort_unstable();
            let nth = sent.get(g.probes_out() as usize).copied();
            if in_flight >= g.limit() {
                if let Some(probe) = g.take_probe(t, nth.unwrap_or(t)) {
                    send(t, &mut in_flight, &mut events, Some(probe));
                }
            }
            events.push(Reverse((
                t + rng.u64(1..=2 * gap) as Micros,
                ARRIVAL,
                0,
                None,
            )));
            continue;
        }
        in_flight -= 1;
        let rtt = (t - sent) as u64;
        rtts.push((t, rtt));
        if let Some(probe) = probe {
            g.probe_answered(probe, rtt);
        }
        if let Some(e) = g.sample(t, rtt, c) {
            limits.push((t, e.limit));
        }
        while in_flight < g.limit() {
            send(t, &mut in_flight, &mut events, None);
        }
    }
    (rtts, limits)
}

/// A sample every 2 ms at the limit, round trips `percent` % of the
/// fluid model's for `span_us` once the limit reaches `level`; until
/// that span is over, or `until` if later.
pub(super) fn slowed_once(
    g: &mut Gradient,
    t: &mut Micros,
    (workers, service): (u32, u64),
    level: u32,
    span_us: Micros,
    percent: u64,
    until: Micros,
) {
    let mut slow_from = None;
    loop {
        *t += 2_000;
        let c = g.limit();
        if c >= level && slow_from.is_none() {
            slow_from = Some(*t);
        }
        let slow = slow_from.is_some_and(|from| *t - from < span_us);
        let pct = if slow { percent } else { 100 };
        g.sample(*t, rtt(workers, service, c) * pct / 100, c);
        if slow_from.is_some() && !slow && *t >= until {
            return;
        }
    }
}
