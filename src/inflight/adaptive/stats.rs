//! The round-trip statistics: an interval's samples and what they come to
//! (`Measured`: the mean round trip, the concurrency its requests were sent
//! at, their scatter); the interval means remembered, and when one is
//! forgotten, toward the unloaded round trip (`Unloaded`); and the
//! intervals gone by that a server that became slower is told from a queue
//! by (`slower`).

use super::{Gradient, MAX_MEANS, MIN_RTT_WINDOW_US, MIN_SAMPLES};
use crate::clock::Micros;

/// One request's round trip (µs), and the requests in flight when it was
/// sent (itself included).
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    pub(super) rtt_us: u64,
    pub(super) in_flight: u32,
}

/// An interval's mean round trip, remembered toward the unloaded one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mean {
    /// When the interval ended.
    at: Micros,
    pub(super) rtt_us: u64,
    /// The most requests in flight while its round trips ran.
    busiest: u32,
    /// The standard error of the mean, and the standard deviation of the
    /// round trips, in µs.
    se: f64,
    sd: f64,
}

/// An interval gone by, which a slower server is told from a queue by.
#[derive(Debug, Clone, Copy)]
pub(super) struct PastInterval {
    /// The mean concurrency its requests were sent at.
    pub(super) sent_at: f64,
    /// Its mean round trip (µs).
    pub(super) rtt_us: u64,
    /// Whether it ran at a higher limit than the one before it.
    pub(super) grew: bool,
}

/// What an interval's round trips came to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Measured {
    /// The mean round trip (µs), and the mean concurrency its requests
    /// were sent at.
    pub(super) rtt_us: u64,
    pub(super) sent_at: f64,
    /// The standard deviation of the round trips, and the standard error
    /// of their mean, in µs.
    sd: f64,
    se: f64,
    /// Some were still sent under an earlier, higher limit.
    pub(super) mixed: bool,
}

impl Measured {
    pub(super) fn mean(&self, at: Micros, busiest: u32) -> Mean {
        Mean {
            at,
            rtt_us: self.rtt_us,
            busiest,
            se: self.se,
            sd: self.sd,
        }
    }
}

/// The unloaded round trip: the least of the means remembered.
#[derive(Debug, Clone, Copy)]
pub(super) struct Unloaded {
    pub(super) rtt_us: u64,
    /// What an interval's mean may exceed it by with no queue, besides the
    /// queue tolerated: two standard errors of the mean that set it.
    pub(super) noise: f64,
    /// The standard deviation of the round trips that set it.
    pub(super) sd: f64,
}

impl Gradient {
    /// The interval's round trips, less those sent under a higher limit:
    /// their mean, their scatter and the concurrency they were sent at.
    pub(super) fn measure_interval(&mut self) -> Measured {
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
        let rtt_us = self.samples.iter().map(|s| s.rtt_us).sum::<u64>() / self.samples.len() as u64;
        let sent_at = self.samples.iter().map(|s| s.in_flight as f64).sum::<f64>() / n;
        let var = self
            .samples
            .iter()
            .map(|s| (s.rtt_us as f64 - rtt_us as f64).powi(2))
            .sum::<f64>()
            / (n - 1.0).max(1.0);
        Measured {
            rtt_us,
            sent_at,
            sd: var.sqrt(),
            se: (var / n).sqrt(),
            mixed,
        }
    }

    /// The interval's mean joins those the unloaded round trip is the
    /// least of; old ones go.
    pub(super) fn remember_mean(&mut self, now: Micros, m: &Measured) {
        // At its floor no queue forms (`min` is at most the server's
        // workers): what is measured there is the unloaded round trip, the
        // quickest way to learn a server that became slower for good.
        if self.busiest <= self.min {
            self.means.clear();
        }
        self.means.push_back(m.mean(now, self.busiest));
        // Old means go once one measured no busier came after them.
        while let Some(&Mean { at, busiest, .. }) = self.means.front() {
            let stale = now - at > MIN_RTT_WINDOW_US
                && self.means.iter().skip(1).any(|m| m.busiest <= busiest);
            if !stale && self.means.len() <= MAX_MEANS {
                break;
            }
            self.means.pop_front();
        }
    }

    /// The interval becomes the previous one; returns the one before it.
    pub(super) fn remember_interval(&mut self, m: &Measured) -> Option<PastInterval> {
        let grew = self.limit > self.ran_at;
        self.ran_at = self.limit;
        self.prev.replace(PastInterval {
            sent_at: m.sent_at,
            rtt_us: m.rtt_us,
            grew,
        })
    }

    /// The least of the means remembered (this interval's if none is).
    pub(super) fn unloaded_round_trip(&mut self, m: &Measured) -> Unloaded {
        let (rtt_us, se, sd) = self
            .means
            .iter()
            .min_by_key(|m| m.rtt_us)
            .map_or((m.rtt_us, m.se, m.sd), |m| (m.rtt_us, m.se, m.sd));
        self.min_sd = sd;
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
        Unloaded {
            rtt_us,
            noise: 2.0 * se,
            sd,
        }
    }

    /// A run of queued intervals (a slide) is measured from the interval
    /// before it began.
    pub(super) fn track_slide(&mut self, queued: bool, prev: Option<PastInterval>) {
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
    }
}
