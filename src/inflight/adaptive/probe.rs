//! Probes past the level the controller knows calm: a large limit's is an
//! interval run at a higher limit; a small limit's is requests sent past
//! it (`Requests`), each a `Probe` timed to wait at most half a round trip
//! if no worker is free and judged by its own round trip. This file owns a
//! probe's start, the requests a gate sends past the limit and what their
//! answers found, and a probe's end.

use super::{Gradient, PROBE_ROUNDS};
use crate::clock::Micros;

/// A probe of requests: at most `past` out at once, `past` + `PROBE_ROUNDS`
/// - 1 in all.
#[derive(Debug, Clone, Copy)]
pub(super) struct Requests {
    id: u32,
    past: u32,
    pub(super) unsent: u32,
    pub(super) out: u32,
    /// The most that were out at once: the level it tested is that far
    /// past the limit.
    pub(super) most_out: u32,
    pub(super) votes: Votes,
}

/// Of a probe's requests that are back: how many found a queue, of how
/// many judged.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Votes {
    pub(super) queued: u32,
    pub(super) judged: u32,
}

/// A probe under way: the limit it started from, and the level it tests.
#[derive(Debug, Clone, Copy)]
pub(super) struct Probing {
    pub(super) from: f64,
    pub(super) to: f64,
}

/// A request sent past the limit as a probe's: which probe, and the wait
/// it would have past the server's workers (µs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Probe {
    id: u32,
    pub expected_us: u64,
}

impl Gradient {
    /// Starts a probe of `past` requests now, the unloaded round trip
    /// taken as `min_rtt_us` (a gate's tests).
    #[cfg(test)]
    pub(crate) fn start_probe(&mut self, past: u32, min_rtt_us: u64) {
        self.last.min_rtt_us = min_rtt_us;
        self.probing = Some(Probing {
            from: self.limit,
            to: self.limit.floor() + past as f64,
        });
        self.start_requests(past);
    }

    /// A probe of requests `past` the limit begins, named afresh.
    pub(super) fn start_requests(&mut self, past: u32) {
        self.probes_started = self.probes_started.wrapping_add(1);
        self.requests = Some(Requests {
            id: self.probes_started,
            past,
            unsent: past + PROBE_ROUNDS - 1,
            out: 0,
            most_out: 0,
            votes: Votes::default(),
        });
    }

    /// A probe's requests out now: a gate times the next one by its
    /// in-flight request this many places from the oldest.
    pub fn probes_out(&self) -> u32 {
        self.requests.map_or(0, |r| r.out)
    }

    /// Whether a request that arrives now, with the limit's slots full,
    /// goes past it as a probe's; if so, with the wait it would have past
    /// the server's workers: until the request in flight sent at `sent`
    /// is back (the oldest, or as many places from it as probes are out).
    /// A small limit probes with requests, not an interval at a higher
    /// limit, which queued a request a wave for two round trips: one
    /// request past the workers waits, and only it. It goes when that
    /// wait is at most half a round trip (it costs its request no more)
    /// and well past the round trips' own scatter (else there is nothing
    /// to tell room from a queue by): a request sent just before a worker
    /// frees waits next to nothing either way.
    pub fn take_probe(&mut self, now: Micros, sent: Micros) -> Option<Probe> {
        let min_rtt = self.last.min_rtt_us as f64;
        let expected = min_rtt - (now - sent) as f64;
        let floor = (4.0 * self.min_sd).max(min_rtt / 20.0).max(1.0);
        let r = self.requests.as_mut()?;
        if r.unsent == 0 || r.out >= r.past || expected > min_rtt / 2.0 || expected < floor {
            return None;
        }
        r.unsent -= 1;
        r.out += 1;
        r.most_out = r.most_out.max(r.out);
        Some(Probe {
            id: r.id,
            expected_us: expected as u64,
        })
    }

    /// A probe's request came back after `rtt_us`: a queue if it waited
    /// over half its expected wait. (Call before its `sample`.) An answer
    /// to an earlier probe counts for nothing.
    pub fn probe_answered(&mut self, probe: Probe, rtt_us: u64) {
        let min_rtt = self.last.min_rtt_us as f64;
        let Some(r) = self.requests.as_mut().filter(|r| r.id == probe.id) else {
            return;
        };
        r.out = r.out.saturating_sub(1);
        r.votes.judged += 1;
        if rtt_us as f64 - min_rtt > probe.expected_us as f64 / 2.0 {
            r.votes.queued += 1;
        }
    }

    /// A probe's request that taught nothing (failed, or its client left).
    pub fn probe_lost(&mut self, probe: Probe) {
        if let Some(r) = self.requests.as_mut().filter(|r| r.id == probe.id) {
            r.out = r.out.saturating_sub(1);
        }
    }

    /// The probe under way ends (judged or not): the limit it started
    /// from and how far it went, and its requests if it was of requests.
    pub(super) fn end_probe(&mut self) -> (Option<Probing>, Option<Requests>) {
        (self.probing.take(), self.requests.take())
    }
}
