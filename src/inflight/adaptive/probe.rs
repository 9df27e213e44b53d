//! Probes past the level the controller knows calm: when one starts and
//! how far it goes; a large limit's, an interval run at a higher limit; a
//! small limit's, requests sent past it (`Requests`), each a `Probe` a gate
//! sends as a request arrives, timed to wait at most half a round trip if
//! no worker is free, and its answer or loss; how a probe ends and is
//! judged (`Judged`); and what room found teaches (the level known calm,
//! how far and how soon the next probe goes).

use super::limit::{Mark, Streak};
use super::stats::Unloaded;
use super::{Gradient, Reading, MIN_RTT_WINDOW_US, PROBE_ROUNDS, QUEUE_TOLERATED, SMALL_LEVEL};
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

/// What the interval that ended found, if it was a probe.
#[derive(Debug, Clone, Copy)]
pub(super) struct Judged {
    /// Where it started, and the level it tested (a probe of requests:
    /// as far past as it had out at once).
    pub(super) probing: Option<Probing>,
    pub(super) of_requests: bool,
    /// Whether it found a queue; none when it was no probe, or told
    /// nothing.
    verdict: Option<bool>,
}

impl Judged {
    /// The limit the probe started from.
    pub(super) fn from(&self) -> Option<f64> {
        self.probing.map(|p| p.from)
    }

    pub(super) fn found_queue(&self) -> bool {
        self.verdict == Some(true)
    }

    /// The probe, if it found room.
    pub(super) fn found_room(&self) -> Option<Probing> {
        self.probing.filter(|_| self.verdict == Some(false))
    }
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

    /// Calm at the level known calm: past it only by probes, once every
    /// `probe_every` calm intervals at full use; else the limit stays.
    pub(super) fn probe_or_stay(&mut self, now: Micros, r: &Reading) -> f64 {
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
        if self.calm >= self.probe_every && r.full && at < self.max as f64 {
            self.calm = 0;
            self.start_probe_past(now, at, &r.unloaded)
        } else {
            self.limit
        }
    }

    /// A probe past `at` begins: the limit it runs the next interval at.
    fn start_probe_past(&mut self, now: Micros, at: f64, unloaded: &Unloaded) -> f64 {
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
        if at <= SMALL_LEVEL && 16.0 * unloaded.sd <= unloaded.rtt_us as f64 {
            self.start_requests((to - at) as u32);
            self.limit
        } else {
            to
        }
    }

    /// A probe of requests `past` the limit begins, named afresh.
    fn start_requests(&mut self, past: u32) {
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

    /// The probe the interval was, if it was one, ends and is judged.
    pub(super) fn judge_probe(&mut self, unloaded: &Unloaded) -> Judged {
        // The limit this interval probed from, if it was a probe. A probe
        // is judged by its own requests (those sent past where it started):
        // in waves, one that found no free worker waited a whole service
        // time for the next wave, while the interval's mean moved by 1/N
        // (at 32 workers, within the noise).
        let (probing, requests) = self.end_probe();
        // A probe of requests tested as far past as it had out at once.
        let probing = match (probing, requests) {
            (Some(Probing { from, .. }), Some(r)) => Some(Probing {
                from,
                to: from.floor() + r.most_out as f64,
            }),
            (p, _) => p,
        };
        // One request past N workers is a standing queue of one: by Little's
        // law every round trip then waits 1/N of one on average. Half that
        // is tolerated (at 4 workers a probe's 1.25x mean once passed for
        // room, and the limit sat at 5 half the time: a p99 of 2.2x).
        // A probe of requests: a queue if over a third of its requests
        // found one (probing two past, one of the two waits if there was
        // room for one).
        // One none of whose requests came back (its client left, the
        // upstream failed it, no moment came to send it) tells nothing.
        let verdict = probing.map(|p| p.from).and_then(|from| {
            if let Some(r) = requests {
                return (r.votes.judged > 0).then_some(r.votes.queued * 3 > r.votes.judged);
            }
            let (sum, n) = self
                .samples
                .iter()
                .filter(|s| s.in_flight as f64 > from.floor())
                .fold((0u64, 0u64), |(sum, n), s| (sum + s.rtt_us, n + 1));
            let queue_of_half = QUEUE_TOLERATED / from.floor().max(1.0);
            (n > 0).then(|| {
                sum as f64 / n as f64
                    > unloaded.rtt_us as f64 * (1.0 + queue_of_half) + unloaded.noise
            })
        });
        Judged {
            probing,
            of_requests: requests.is_some(),
            verdict,
        }
    }

    /// A probe found room past what it knew. The next probe comes in half
    /// the wait, to this level again until it found room here twice (once
    /// may be luck: a server's workers that free up out of step take one
    /// more without a queue for a while), then twice as far: the level is
    /// known calm.
    pub(super) fn probe_found_room(&mut self, now: Micros, Probing { from, to }: Probing) {
        let at = to.floor();
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
    }
}
