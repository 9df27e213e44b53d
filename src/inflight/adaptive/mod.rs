//! The concurrency an upstream can take, found from its latency: a gradient
//! controller that probes past what it knows, as a pure function of
//! round-trip samples and their times.
//!
//! The idea is Envoy's adaptive concurrency filter (its gradient
//! controller) and Netflix's concurrency-limits (Gradient2): by Little's law
//! a server's concurrency past its capacity only queues, and queueing shows
//! as round trips longer than the server's unloaded one. Round trips are
//! taken in intervals (the longer of `INTERVAL_US` and two round trips,
//! once they hold `MIN_SAMPLES`, or `MAX_INTERVAL_US`; a probe's, as long
//! as the probe needs), and each interval ends with
//!
//! ```text
//! gradient = clamp((min_rtt × (1 + tolerated) + noise) / sample_rtt, 0.5, 1 + BUFFER)
//! ```
//!
//! where `sample_rtt` is the interval's mean round trip, `min_rtt` the
//! least of the interval means remembered (the unloaded round trip),
//! `tolerated` is `BUFFER` but never more than `QUEUE_TOLERATED` of a
//! request's worth of queue, and `noise` two standard errors of the mean
//! that set `min_rtt`. A gradient under 1 is a queue: the limit becomes the
//! gradient times the mean concurrency the interval's requests were sent
//! at (they left under the previous limit). With no queue the limit climbs
//! back, by a request a step at least, to the level it last knew calm (two
//! intervals in a row at full use that showed no queue), and stays there:
//! it settles at about the server's workers. (Envoy adds a headroom
//! of √limit every step, which for a server of 8 workers is a standing
//! queue of a third.)
//!
//! Past that level it goes only by probes. After `PROBE_EVERY` calm
//! intervals there, at full use, it probes one request further; a level a
//! probe found room at twice is known calm, and the next probe goes twice
//! as far, never to where the last queue showed within a window nor past
//! `max`. A probe that found a queue sends the limit back to where it
//! started and doubles the wait for the next (to `PROBE_EVERY_MAX`); one
//! that found room halves it. A large limit probes with an interval run at
//! the higher limit, judged by the round trips of the requests sent past
//! where it started. A small one (`SMALL_LEVEL` or less, with steady round
//! trips) keeps its limit and sends requests past it as they arrive
//! (`PROBE_ROUNDS` rounds), each timed to wait at most half a round trip
//! if no worker is free and judged by its own round trip: past the workers
//! of a small server one request waits a whole service time, and an
//! interval at a higher limit queued a request a wave for two round trips.
//!
//! It starts at `min`, where the unloaded round trip shows, and doubles the
//! limit each interval until the first queue shows, as TCP's slow start
//! does (a limit started high never sees the unloaded round trip); so again
//! whenever it falls to `min`, then up to the last limit that showed no
//! queue (TCP's ssthresh: a server that slowed down has the same workers).
//! The first small queue of a slow start (under a tenth) holds the limit
//! for an interval instead of ending it.
//!
//! Two choices differ from Envoy's. The unloaded round trip is learnt from
//! the means themselves, not by forcing concurrency down to `min` every
//! few seconds (which refuses traffic on a healthy server to learn what it
//! already shows). A mean is forgotten after `MIN_RTT_WINDOW_US`, but only
//! once a later one was measured with no more requests in flight: a
//! standing queue (every later mean taken busier) cannot pass itself off
//! as the unloaded round trip. A server that became slower for good is
//! told from a queue (its concurrency fell by a quarter and its round trip
//! did not fall with it, or at half the workers it knew its round trip is
//! half again the unloaded one): what is measured then becomes the
//! unloaded round trip at once, and a slow start climbs back to the
//! workers it knew. That verdict is on trial during the climb: a server
//! that lost workers looks the same for an interval taken partly before
//! the loss, and if the round trips sent well above the verdict's
//! concurrency rise at least half as much as a queue's would, the means
//! known before it are the unloaded round trip again. At `min` no queue forms, so what is measured there is
//! the unloaded round trip too. And, from Gradient2, the limit does not
//! grow while the upstream is given less than half of it (the traffic, not
//! the server, is what limits then): an idle night does not leave a limit
//! of `max` for the morning's surge.
//!
//! An interval in which more than a tenth of the requests failed (5xx,
//! timeouts) shrinks the limit by a tenth and ends a slow start: a failing
//! server answers fast, and it is overloaded or broken, which more
//! concurrency will not help.
//!
//! `Gradient::update` lists the steps of an interval's end in order. The
//! round-trip statistics and the unloaded round trip live in `stats`; a
//! server that became slower, told from a queue, in `slower`; the
//! gradient, the levels learnt and the next limit in `limit`; the slow
//! start in `slow_start`; probes in `probe`. `servers` are the simulated
//! upstreams the `tests` drive the controller against.

mod limit;
mod probe;
#[cfg(test)]
mod servers;
mod slow_start;
mod slower;
mod stats;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use crate::clock::Micros;

use limit::{Mark, Streak};
pub use probe::Probe;
use probe::{Judged, Probing, Requests};
use slower::Trial;
use stats::{Mean, Measured, PastInterval, Sample, Unloaded};

/// The queueing delay tolerated, as a share of the unloaded round trip,
/// and the most a limit grows by in an interval.
pub const BUFFER: f64 = 0.05;
/// ... but never more than this many requests' worth of queue.
const QUEUE_TOLERATED: f64 = 0.5;
/// An interval ends after this long once it holds `MIN_SAMPLES`, or after
/// `MAX_INTERVAL_US` with any.
pub const INTERVAL_US: Micros = 100_000;
pub const MIN_SAMPLES: usize = 8;
pub const MAX_INTERVAL_US: Micros = 1_000_000;
/// How long an interval's mean counts toward the unloaded round trip
/// (at least: see the module's doc).
pub const MIN_RTT_WINDOW_US: Micros = 3_000_000;
/// A limit at or past the workers it knew probes one more once in this
/// many intervals that showed no queue; each probe that found a queue
/// doubles the wait, up to `PROBE_EVERY_MAX` (a probe past the workers of
/// a small server costs the request behind it a whole service time).
const PROBE_EVERY: u32 = 4;
/// A probe of requests sends this many rounds of them (the last rounds of
/// one request each, as one is back): a round trip on a busy host can be
/// late by more than a worker's wait, and one late answer taken for a
/// queue stalled a climb from a slow start ended by noise (32 workers of
/// 20 ms, from 3, took 17 s).
const PROBE_ROUNDS: u32 = 3;
const PROBE_EVERY_MAX: u32 = 64;
/// A level where one request past the workers is a tenth or more of the
/// round trip for every request (`queued_at_best`).
const SMALL_LEVEL: f64 = 10.0;
/// Means remembered at most (only those measured less busy than every
/// later one stay past the window: few).
const MAX_MEANS: usize = 4096;

/// One upstream's (or route's) adaptive limit: see the module's doc.
#[derive(Debug, Clone)]
pub struct Gradient {
    /// The limit now (fractional: a step may grow it by less than a
    /// request), and its bounds.
    limit: f64,
    min: u32,
    max: u32,
    /// This interval's round trips, and the most requests in flight while
    /// they ran.
    samples: Vec<Sample>,
    busiest: u32,
    /// Requests of this interval that failed (5xx, timeouts).
    failures: usize,
    /// When this interval began.
    started: Micros,
    /// Interval means remembered, oldest first.
    means: VecDeque<Mean>,
    /// The standard deviation of the round trips that set the unloaded one.
    min_sd: f64,
    /// Doubling each interval until the first queue shows; whether this
    /// slow start held once for a small one.
    slow_start: bool,
    slow_held: bool,
    /// The last limit that showed no queue: a slow start from `min` stops
    /// there (TCP's ssthresh), the server's workers being what it was.
    good: f64,
    /// The previous interval.
    prev: Option<PastInterval>,
    /// The limit the last interval ran at.
    ran_at: f64,
    /// Calm intervals at the level known calm since the last queue, or
    /// since the last probe began.
    calm: u32,
    /// The interval before a run of queued ones began.
    slide: Option<PastInterval>,
    /// The last slower-server verdict, until the climb back judges it.
    trial: Option<Trial>,
    /// Calm intervals needed before the next probe past what it knew;
    /// the probe the current interval is, if it is one.
    probe_every: u32,
    probing: Option<Probing>,
    /// A probe of requests, under way (a small limit's: the limit stays
    /// and requests go past it), and the count that names each.
    requests: Option<Requests>,
    probes_started: u32,
    /// The level probes last found room at, and how many times in a row.
    wins: Streak,
    /// The concurrency the last queue showed at, and when; the most
    /// requests in flight that last showed no queue at full use, and when.
    queued_at: Option<Mark>,
    best: Mark,
    /// Queues shown at `best` (not probing) since it was last set: two
    /// refute it (it was a pair of calm intervals by luck, or a probe's),
    /// and it is one less, once: the level set is known good or one past.
    queued_at_best: u32,
    best_set: f64,
    /// The limit of the last intervals that showed no queue at full use,
    /// and how many in a row.
    calm_run: Streak,
    /// How far the next probe goes past the level known calm: 1 after a
    /// queue, at least doubled each time probes make a level known calm.
    climb: f64,
    /// What the last interval concluded; its limit is the one in force.
    last: Estimate,
}

/// What the controller last concluded.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Estimate {
    pub limit: u32,
    /// The unloaded round trip and the last interval's, in µs.
    pub min_rtt_us: u64,
    pub sample_rtt_us: u64,
}

/// What an interval showed, as the steps after its measuring read it.
struct Reading {
    measured: Measured,
    unloaded: Unloaded,
    /// What the limit is multiplied by: under 1 is a queue.
    gradient: f64,
    /// A slow start holds the limit this interval.
    hold: bool,
    /// The probe it was, if it was one.
    probe: Judged,
    /// A queue showed (the gradient, or a probe's verdict).
    queued: bool,
    /// The traffic used the whole limit.
    full: bool,
}

impl Gradient {
    /// Starts at `min`, where the unloaded round trip shows, and doubles
    /// each interval until a queue shows (TCP's slow start), within
    /// `[min, max]`.
    pub fn new(min: u32, max: u32, now: Micros) -> Self {
        let limit = min.min(max);
        Gradient {
            limit: limit as f64,
            min,
            max,
            samples: Vec::with_capacity(64),
            busiest: 0,
            failures: 0,
            started: now,
            means: VecDeque::new(),
            min_sd: 0.0,
            slow_start: true,
            slow_held: false,
            good: f64::MAX,
            prev: None,
            ran_at: limit as f64,
            calm: 0,
            slide: None,
            trial: None,
            probe_every: PROBE_EVERY,
            probing: None,
            requests: None,
            probes_started: 0,
            wins: Streak::default(),
            queued_at: None,
            best: Mark {
                level: 0.0,
                when: now,
            },
            queued_at_best: 0,
            best_set: 0.0,
            calm_run: Streak::default(),
            climb: 1.0,
            last: Estimate {
                limit,
                ..Estimate::default()
            },
        }
    }

    pub fn limit(&self) -> u32 {
        self.last.limit
    }

    pub fn estimate(&self) -> Estimate {
        self.last
    }

    /// One request's round trip, with the requests in flight when it was
    /// sent (itself included). Returns the new estimate when this sample
    /// closed an interval.
    pub fn sample(&mut self, now: Micros, rtt_us: u64, in_flight: u32) -> Option<Estimate> {
        self.samples.push(Sample {
            rtt_us: rtt_us.max(1),
            in_flight,
        });
        self.busiest = self.busiest.max(in_flight);
        self.close_if_due(now)
    }

    /// A request that failed (a 5xx, or a timeout): no round trip is
    /// learnt from it (a failing server answers fast), but an interval in
    /// which more than a tenth failed shrinks the limit by a tenth and
    /// never grows it: the server is overloaded or broken, and more
    /// concurrency will not help either.
    pub fn failure(&mut self, now: Micros, in_flight: u32) -> Option<Estimate> {
        self.failures += 1;
        self.busiest = self.busiest.max(in_flight);
        self.close_if_due(now)
    }

    /// Ends the interval if it is due: a back-off if it held mostly
    /// failures, else an update.
    fn close_if_due(&mut self, now: Micros) -> Option<Estimate> {
        // Two round trips at least: the samples that close an interval were
        // sent under the limit it set, not the one before. A probe at a
        // higher limit lasts just that (its queue costs a doubled round
        // trip a wave). A probe of requests lasts until they are back; with
        // none out, twice an interval at most (no moment came to send the
        // rest: the interval is not held up for them); with one out, four
        // round trips or a second at most (it never came back).
        let two_rtts = 2 * self.last.sample_rtt_us as Micros;
        let span = INTERVAL_US.max(two_rtts);
        let age = now - self.started;
        let seen = self.samples.len() + self.failures;
        let due = if let Some(r) = self.requests {
            let enough = seen >= MIN_SAMPLES;
            (r.out == 0 && enough && (r.unsent == 0 && age >= two_rtts || age >= 2 * span))
                || age >= MAX_INTERVAL_US.max(2 * two_rtts)
        } else if self.probing.is_some() {
            (age >= two_rtts && seen >= MIN_SAMPLES) || age >= MAX_INTERVAL_US
        } else {
            (age >= span && seen >= MIN_SAMPLES) || age >= MAX_INTERVAL_US
        };
        if !due {
            return None;
        }
        if self.samples.is_empty() || self.failures * 10 > seen {
            return Some(self.back_off(now));
        }
        Some(self.update(now))
    }

    /// An interval of failures: a tenth less, no slow start.
    fn back_off(&mut self, now: Micros) -> Estimate {
        self.slow_start = false;
        self.end_probe();
        self.limit = (self.limit * 0.9).clamp(self.min as f64, self.max as f64);
        self.start_next_interval(now);
        self.last.limit = self.limit as u32;
        self.last
    }

    /// An interval ends: what it measured, then each thing it teaches, in
    /// order, then the limit it sets.
    fn update(&mut self, now: Micros) -> Estimate {
        let measured = self.measure_interval();
        self.remember_mean(now, &measured);
        if !self.judge_trial(now, &measured) && self.became_slower(&measured) {
            self.learn_slower_server(now, &measured);
        }
        let prev = self.remember_interval(&measured);
        let unloaded = self.unloaded_round_trip(&measured);
        let gradient = limit::gradient(&measured, &unloaded);
        let hold = self.end_or_hold_slow_start(gradient);
        let probe = self.judge_probe(&unloaded);
        let queued = gradient < 1.0 || probe.found_queue();
        let full = self.busiest as f64 >= self.limit.floor();
        self.track_slide(queued, prev);
        let r = Reading {
            measured,
            unloaded,
            gradient,
            hold,
            probe,
            queued,
            full,
        };
        if queued {
            self.learn_from_queue(now, &r);
        } else if full {
            self.learn_from_calm(now, &r);
        }
        self.remember_good_limit(queued);
        let next = self.next_limit(now, &r);
        self.set_limit(next);
        self.start_next_interval(now);
        self.last = Estimate {
            limit: self.limit as u32,
            min_rtt_us: r.unloaded.rtt_us,
            sample_rtt_us: r.measured.rtt_us,
        };
        self.last
    }

    /// The samples and failures counted afresh from `now`.
    fn start_next_interval(&mut self, now: Micros) {
        self.samples.clear();
        self.failures = 0;
        self.busiest = 0;
        self.started = now;
    }
}
