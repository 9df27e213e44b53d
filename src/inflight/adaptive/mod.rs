//! The concurrency an upstream can take, found from its latency: a gradient
//! controller that probes past what it knows, as a pure function of
//! round-trip samples and their times.
//!
//! The idea is Envoy's adaptive concurrency filter (its gradient
//! controller) and Netflix's concurrency-limits (Gradient2): by Little's law
//! a server's concurrency past its capacity only queues, and queueing shows
//! as round trips longer than the server's unloaded one. Round trips are
//! taken in intervals (`INTERVAL_US` and two round trips, once they hold
//! `MIN_SAMPLES`; `MAX_INTERVAL_US` at most), and each interval ends with
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
//! it settles at the server's workers, or one past. (Envoy adds a headroom
//! of √limit every step, which for a server of 8 workers is a standing
//! queue of a third.)
//!
//! Past that level it goes only by probes. After `PROBE_EVERY` calm
//! intervals there, at full use, it probes one request further; a level a probe
//! found room at twice is known calm, and the next probe goes twice as
//! far, never to where the last queue showed within a window nor past
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
//! workers it knew. At `min` no queue forms, so what is measured there is
//! the unloaded round trip too. And, from Gradient2, the limit does not
//! grow while the upstream is given less than half of it (the traffic, not
//! the server, is what limits then): an idle night does not leave a limit
//! of `max` for the morning's surge.
//!
//! An interval in which more than a tenth of the requests failed (5xx,
//! timeouts) shrinks the limit by a tenth and ends a slow start: a failing
//! server answers fast, and it is overloaded or broken, which more
//! concurrency will not help.

mod probe;
#[cfg(test)]
mod servers;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;

use crate::clock::Micros;

pub use probe::Probe;
use probe::{Probing, Requests};

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

#[derive(Debug, Clone)]
pub struct Gradient {
    limit: f64,
    min: u32,
    max: u32,
    /// This interval's round trips, and the most requests in flight while
    /// they ran.
    samples: Vec<Sample>,
    busiest: u32,
    /// Requests of this interval that failed (5xx, timeouts).
    failures: usize,
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
    /// Intervals in a row that showed no queue.
    calm: u32,
    /// The interval before a run of queued ones began.
    slide: Option<PastInterval>,
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
    /// The next step of a climb above where the last queue showed.
    climb: f64,
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

/// One request's round trip (µs), and the requests in flight when it was
/// sent (itself included).
#[derive(Debug, Clone, Copy)]
struct Sample {
    rtt_us: u64,
    in_flight: u32,
}

/// An interval's mean round trip, remembered toward the unloaded one.
#[derive(Debug, Clone, Copy)]
struct Mean {
    /// When the interval ended.
    at: Micros,
    rtt_us: u64,
    /// The most requests in flight while its round trips ran.
    busiest: u32,
    /// The standard error of the mean, and the standard deviation of the
    /// round trips, in µs.
    se: f64,
    sd: f64,
}

/// An interval gone by, which a slower server is told from a queue by.
#[derive(Debug, Clone, Copy)]
struct PastInterval {
    /// The mean concurrency its requests were sent at.
    sent_at: f64,
    /// Its mean round trip (µs).
    rtt_us: u64,
    /// Whether it ran at a higher limit than the one before it.
    grew: bool,
}

/// A level of concurrency, and when it was seen.
#[derive(Debug, Clone, Copy)]
struct Mark {
    level: f64,
    when: Micros,
}

/// A level, and how many times in a row it was found so.
#[derive(Debug, Clone, Copy, Default)]
struct Streak {
    level: f64,
    count: u32,
}

impl Streak {
    /// Once more at `level` (the first time, if the last was another
    /// level); how many times in a row now.
    fn add(&mut self, level: f64) -> u32 {
        if self.level == level {
            self.count += 1;
        } else {
            *self = Streak { level, count: 1 };
        }
        self.count
    }
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
        self.samples.clear();
        self.failures = 0;
        self.busiest = 0;
        self.started = now;
        self.last.limit = self.limit as u32;
        self.last
    }

    fn update(&mut self, now: Micros) -> Estimate {
        // The mean, not a percentile: requests sent together to a server
        // of N workers come back in waves, and a queue of fewer than N/2
        // leaves the median where it was.
        //
        // Round trips sent under a higher limit than this interval's (it
        // just fell) tell of the old queue, not of this limit: they are
        // left out, unless they are most of what there is. (Taken for this
        // limit's, they once passed a queue's round trip off as a slower
        // server's, which became the unloaded one: a standing queue of 2
        // over 4 workers.)
        // (A small limit's interval holds few requests: a round of them
        // is enough, else the mix hid a slower server at 4 workers of
        // 200 ms for an interval, and the limit fell to 1.)
        // (A probe's requests went past the limit, as far as it probed.)
        let limit = self.probing.map_or(self.last.limit, |p| p.to as u32).max(1);
        let fresh = self.samples.iter().filter(|s| s.in_flight <= limit).count();
        if fresh >= (limit as usize).clamp(2, MIN_SAMPLES / 2) && fresh < self.samples.len() {
            self.samples.retain(|s| s.in_flight <= limit);
            self.busiest = self.samples.iter().map(|s| s.in_flight).max().unwrap_or(0);
        }
        // Still mixed with the old limit's: no verdict on a slower server.
        let mixed = self.samples.iter().any(|s| s.in_flight > limit);
        let n = self.samples.len() as f64;
        let sample = self.samples.iter().map(|s| s.rtt_us).sum::<u64>() / self.samples.len() as u64;
        let sent_at = self.samples.iter().map(|s| s.in_flight as f64).sum::<f64>() / n;
        let var = self
            .samples
            .iter()
            .map(|s| (s.rtt_us as f64 - sample as f64).powi(2))
            .sum::<f64>()
            / (n - 1.0).max(1.0);
        let se = (var / n).sqrt();
        // At its floor no queue forms (`min` is at most the server's
        // workers): what is measured there is the unloaded round trip, the
        // quickest way to learn a server that became slower for good.
        if self.busiest <= self.min {
            self.means.clear();
        }
        self.means.push_back(Mean {
            at: now,
            rtt_us: sample,
            busiest: self.busiest,
            se,
            sd: var.sqrt(),
        });
        // Old means go once one measured no busier came after them.
        while let Some(&Mean { at, busiest, .. }) = self.means.front() {
            let stale = now - at > MIN_RTT_WINDOW_US
                && self.means.iter().skip(1).any(|m| m.busiest <= busiest);
            if !stale && self.means.len() <= MAX_MEANS {
                break;
            }
            self.means.pop_front();
        }
        // A server that became slower, told from a queue: the concurrency
        // fell by a quarter or more since the last interval and the round
        // trip did not fall by a fifth (a queue's share of it would have:
        // at a third over the workers, a quarter less concurrency takes a
        // quarter off the round trip).
        // What is measured now is the new unloaded round trip: it is learnt
        // at once, and the limit climbs back to the workers it knew, in one
        // or two intervals instead of falling to `min` and starting over.
        // Or: at half the workers it knew, where no queue can form while
        // it keeps them, the round trip is half again the unloaded one.
        let stale_min = self.means.iter().map(|m| m.rtt_us).min().unwrap_or(sample);
        // The same over a slide of several intervals (each shrinking a
        // little: a host whose own CPU is saturated slows every round trip
        // a bit more), from the last interval before it began.
        // Not against an interval that ran at a higher limit than the one
        // before it: much of it was sent under the lower one, so its round
        // trip lags its concurrency (a slow start's 8 -> 16 showed 103 ms
        // over a 100 ms server, the 10 after it 139 ms: read as a slower
        // server, that queue became the unloaded round trip).
        let refuted = |p: PastInterval| {
            !p.grew
                && sent_at <= 0.75 * p.sent_at
                && sample as f64 >= 0.8 * p.rtt_us as f64
                && self.limit < self.good
        };
        let slower = !mixed && (self.prev.is_some_and(refuted) || self.slide.is_some_and(refuted))
            || (self.good < f64::MAX
                && (self.busiest as f64) <= self.good / 2.0
                && sample as f64 >= 1.5 * stale_min as f64);
        if slower {
            self.means.clear();
            self.means.push_back(Mean {
                at: now,
                rtt_us: sample,
                busiest: self.busiest,
                se,
                sd: var.sqrt(),
            });
            self.slow_start = true;
            self.slow_held = false;
            self.slide = None;
        }
        let grew = self.limit > self.ran_at;
        self.ran_at = self.limit;
        let prev = self.prev.replace(PastInterval {
            sent_at,
            rtt_us: sample,
            grew,
        });
        let (min_rtt, min_se, min_sd) = self
            .means
            .iter()
            .min_by_key(|m| m.rtt_us)
            .map_or((sample, se, var.sqrt()), |m| (m.rtt_us, m.se, m.sd));
        self.min_sd = min_sd;
        // What the interval's mean may exceed the unloaded round trip by
        // with no queue: BUFFER, and the noise of such a mean (two standard
        // errors of the mean that set the unloaded round trip: measured
        // with no queue, so it is the server's own scatter, where this
        // interval's would also hold a queue's, which makes round trips
        // scatter and would hide it). The unloaded round trip is the least
        // of noisy means, so it sits below a typical one by about that
        // much: a server whose answers scatter by a few ms (a 20 ms service
        // behind a busy machine) would otherwise look queued at every
        // interval and have its limit worn down toward `min`.
        let noise = 2.0 * min_se;
        // The queue tolerated is BUFFER of the round trip, but never a
        // whole request: requests sent together to a server of N workers
        // come back in waves, and one request past the workers waits a
        // whole service time (twice the round trip) for the next wave,
        // while it adds only 1/N to the mean. At 32 workers a twentieth
        // would be a standing queue of one or two, each a doubled round
        // trip for someone.
        let tolerated = BUFFER.min(QUEUE_TOLERATED / sent_at.max(1.0));
        let gradient =
            ((min_rtt as f64 * (1.0 + tolerated) + noise) / sample as f64).clamp(0.5, 1.0 + BUFFER);
        // A slow start ends at the first queue; one under a tenth of the
        // round trip, the first time, holds the limit for an interval
        // instead: the first loaded interval on a busy host can run a few
        // per cent slow (the load's own start), and a slow start ended at
        // 4 of 32 workers climbed back by probes for seconds. A doubling
        // past the workers shows more (a quarter at 5 -> 10 over 8).
        let hold = self.slow_start && (0.9..1.0).contains(&gradient) && !self.slow_held;
        self.slow_held |= hold;
        self.slow_start &= gradient >= 1.0 || hold;
        // The limit this interval probed from, if it was a probe. A probe
        // is judged by its own requests (those sent past where it started):
        // in waves, one that found no free worker waited a whole service
        // time for the next wave, while the interval's mean moved by 1/N
        // (at 32 workers, within the noise).
        let (probe, requests) = self.end_probe();
        // A probe of requests tested as far past as it had out at once.
        let probe = match (probe, requests) {
            (Some(Probing { from, .. }), Some(r)) => Some(Probing {
                from,
                to: from.floor() + r.most_out as f64,
            }),
            (p, _) => p,
        };
        let probed = probe.map(|p| p.from);
        // One request past N workers is a standing queue of one: by Little's
        // law every round trip then waits 1/N of one on average. Half that
        // is tolerated (at 4 workers a probe's 1.25x mean once passed for
        // room, and the limit sat at 5 half the time: a p99 of 2.2x).
        // A probe of requests: a queue if over a third of its requests
        // found one (probing two past, one of the two waits if there was
        // room for one).
        // One none of whose requests came back (its client left, the
        // upstream failed it, no moment came to send it) tells nothing.
        let verdict = probed.and_then(|from| {
            if let Some(r) = requests {
                return (r.votes.judged > 0).then_some(r.votes.queued * 3 > r.votes.judged);
            }
            let (sum, n) = self
                .samples
                .iter()
                .filter(|s| s.in_flight as f64 > from.floor())
                .fold((0u64, 0u64), |(sum, n), s| (sum + s.rtt_us, n + 1));
            let queue_of_half = QUEUE_TOLERATED / from.floor().max(1.0);
            (n > 0).then(|| sum as f64 / n as f64 > min_rtt as f64 * (1.0 + queue_of_half) + noise)
        });
        let probe_failed = verdict == Some(true);
        let queued = gradient < 1.0 || probe_failed;
        let full = self.busiest as f64 >= self.limit.floor();
        // A slide starts at the interval before the first queue, but never
        // at one that grew (a slow start's last doubling): nothing is
        // refuted against such an interval, and on a host whose CPU the
        // load saturates (32 x 20 ms at 3,200 requests a second on 2 cores)
        // the limit slid from the overshoot's 34 to 14 with the upstream's
        // queue at 0. The interval after it starts the slide instead.
        if !queued {
            self.slide = None;
        } else if self.slide.is_none() && prev.is_some_and(|p| !p.grew) {
            self.slide = prev;
        }
        if queued {
            // Twice queued at the level it knew calm by a queue of a
            // request or so: that level is past the workers, one less is
            // known calm instead (else the limit climbs back to it after
            // every queue: half its intervals). A larger queue is a server
            // that slowed down or traffic that surged, not a wrong level.
            // Only for a level of ten or less, where one request is a tenth
            // of the round trip for everyone: past that a queue of one
            // costs little, and noise on a saturated host (32 workers of
            // 20 ms) wore the level down to 31 and goodput under 90 %.
            let about_one =
                (sample as f64) <= min_rtt as f64 * (1.0 + 1.5 / sent_at.max(1.0)) + noise;
            if about_one
                && probed.is_none()
                && self.best.level > self.min as f64
                && self.best.level <= SMALL_LEVEL
                && self.best.level >= self.best_set
                && sent_at >= self.best.level - 0.5
            {
                self.queued_at_best += 1;
                if self.queued_at_best >= 2 {
                    self.best.level -= 1.0;
                    self.queued_at_best = 0;
                }
            }
            self.calm = 0;
            self.climb = 1.0;
            // (A probe that found it: where it went, not the limit.)
            let at = probe
                .filter(|_| probe_failed && requests.is_some())
                .map_or(sent_at, |p| p.to);
            self.queued_at = Some(Mark {
                level: at,
                when: now,
            });
            self.calm_run = Streak::default();
            self.wins = Streak::default();
            if probed.is_some() {
                self.probe_every = (self.probe_every * 2).clamp(PROBE_EVERY, PROBE_EVERY_MAX);
            }
        } else if full {
            let at = self.limit.floor();
            if let Some(Probing { from, to }) = probe.filter(|_| verdict == Some(false)) {
                let at = to.floor();
                // Room past what it knew. The next probe comes in half the
                // wait, to this level again until it found room here twice
                // (once may be luck: a server's workers that free up out of
                // step take one more without a queue for a while), then
                // twice as far.
                if self.wins.add(at) >= 2 {
                    (self.queued_at_best, self.best_set) = (0, at);
                    self.best = Mark {
                        level: at,
                        when: now,
                    };
                    // (At least twice as far as it went: a probe of
                    // requests goes only as far as arrivals let it.)
                    self.climb = (2.0 * self.climb).max(2.0 * (at - from.floor()));
                    self.wins = Streak::default();
                }
                self.probe_every = (self.probe_every / 2).max(2);
            } else {
                // The most it knew calm: two intervals in a row at that
                // limit, forgotten after a window with none as high (a
                // server that lost workers).
                if self.calm_run.add(at) >= 2
                    && (at >= self.best.level || now - self.best.when > MIN_RTT_WINDOW_US)
                {
                    if at != self.best.level {
                        (self.queued_at_best, self.best_set) = (0, at);
                    }
                    self.best = Mark {
                        level: at,
                        when: now,
                    };
                }
            }
        }
        // Shrinking, the gradient applies to the concurrency its round trips
        // were sent at, not to the limit now: an interval's samples left
        // under the one before, and a limit that just fell would otherwise
        // fall again for the same queue.
        if !queued && !self.slow_start {
            self.good = self.limit;
        }
        let mut next = if hold {
            self.limit
        } else if self.slow_start {
            if self.limit * 2.0 >= self.good {
                self.slow_start = false;
            }
            (self.limit * 2.0).min(self.good.max(self.limit))
        } else if let (true, Some(from)) = (probe_failed, probed) {
            from
        } else if queued {
            sent_at * gradient
        } else if let Some(from) = probed {
            // A probe is an excursion, for two round trips: back to where it
            // started (or to the level it just confirmed).
            from.max(self.best.level)
        } else if self.limit.floor() < self.best.level {
            // Below what it knew calm: back up to it, a request at least a
            // step (a twentieth of a small limit is less than one).
            (self.limit * gradient)
                .max(self.limit.floor() + 1.0)
                .min(self.best.level)
        } else {
            // Past it only by probes, once every `probe_every` calm
            // intervals: one past the workers is a queue of one, and
            // requests come back in waves, so it costs the request behind
            // it a whole service time. A probe that finds a queue doubles
            // the wait for the next; one that finds room is followed in
            // half the wait by one twice as far (1, 2, 4, ... past: beyond the
            // workers by at most the last step), but never as far as where
            // the last queue showed, for a window.
            // (Never past `max`: it is the cap the operator set.)
            self.calm += 1;
            let at = self.limit.floor();
            if self.calm >= self.probe_every && full && at < self.max as f64 {
                self.calm = 0;
                let mut to = at + self.climb;
                if let Some(Mark {
                    level: queued,
                    when,
                }) = self.queued_at
                {
                    if now - when <= MIN_RTT_WINDOW_US {
                        to = to.min(queued.round() - 1.0);
                    }
                }
                let to = to.max(at + 1.0).min(self.max as f64);
                self.probing = Some(Probing {
                    from: self.limit,
                    to,
                });
                // Where one request past the workers is a tenth or more of
                // everyone's round trip: requests, not a limit, if the
                // round trips are steady enough to time them by (under a
                // sixteenth of one in scatter: an exponential service
                // leaves no moment when a worker is known busy).
                if at <= SMALL_LEVEL && 16.0 * min_sd <= min_rtt as f64 {
                    self.start_requests((to - at) as u32);
                    self.limit
                } else {
                    to
                }
            } else {
                self.limit
            }
        };
        // App-limited: the traffic used under half of it; nothing learnt
        // about more.
        if (self.busiest as f64) < self.limit / 2.0 {
            next = next.min(self.limit);
        }
        self.limit = next.clamp(self.min as f64, self.max as f64);
        // At the floor, growing by a twentieth a step would take long:
        // double again until a queue shows.
        if self.limit <= self.min as f64 && !self.slow_start {
            (self.slow_start, self.slow_held) = (true, false);
        }
        self.samples.clear();
        self.failures = 0;
        self.busiest = 0;
        self.started = now;
        self.last = Estimate {
            limit: self.limit as u32,
            min_rtt_us: min_rtt,
            sample_rtt_us: sample,
        };
        self.last
    }
}
