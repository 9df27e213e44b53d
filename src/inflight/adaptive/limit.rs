//! Where the limit goes after an interval: the gradient (the interval's
//! mean round trip against the unloaded one, with the queue tolerated),
//! the levels it learns from a queue or a calm interval (the level known
//! calm, `best`; where the last queue showed), and the next limit: a
//! shrink, a climb back to the level known calm, a slow start's doubling
//! or a probe's start, bounded by `[min, max]` and by the traffic.

use super::stats::{Measured, Unloaded};
use super::{
    Gradient, Reading, BUFFER, MIN_RTT_WINDOW_US, PROBE_EVERY, PROBE_EVERY_MAX, QUEUE_TOLERATED,
    SMALL_LEVEL,
};
use crate::clock::Micros;

/// A level of concurrency, and when it was seen.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mark {
    pub(super) level: f64,
    pub(super) when: Micros,
}

/// A level, and how many times in a row it was found so.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Streak {
    level: f64,
    count: u32,
}

impl Streak {
    /// Once more at `level` (the first time, if the last was another
    /// level); how many times in a row now.
    pub(super) fn add(&mut self, level: f64) -> u32 {
        if self.level == level {
            self.count += 1;
        } else {
            *self = Streak { level, count: 1 };
        }
        self.count
    }
}

/// What the limit is multiplied by: under 1 is a queue.
pub(super) fn gradient(m: &Measured, unloaded: &Unloaded) -> f64 {
    // The queue tolerated is BUFFER of the round trip, but never a
    // whole request: requests sent together to a server of N workers
    // come back in waves, and one request past the workers waits a
    // whole service time (twice the round trip) for the next wave,
    // while it adds only 1/N to the mean. At 32 workers a twentieth
    // would be a standing queue of one or two, each a doubled round
    // trip for someone.
    let tolerated = BUFFER.min(QUEUE_TOLERATED / m.sent_at.max(1.0));
    ((unloaded.rtt_us as f64 * (1.0 + tolerated) + unloaded.noise) / m.rtt_us as f64)
        .clamp(0.5, 1.0 + BUFFER)
}

impl Gradient {
    /// A queue showed: where, and what it says of the level known calm;
    /// a climb and the probes' wins start over.
    pub(super) fn learn_from_queue(&mut self, now: Micros, r: &Reading) {
        self.doubt_the_level_known_calm(r);
        self.calm = 0;
        self.climb = 1.0;
        // (A probe that found it: where it went, not the limit.)
        let at = r
            .probe
            .probing
            .filter(|_| r.probe.found_queue() && r.probe.of_requests)
            .map_or(r.measured.sent_at, |p| p.to);
        self.queued_at = Some(Mark {
            level: at,
            when: now,
        });
        self.calm_run = Streak::default();
        self.wins = Streak::default();
        if r.probe.from().is_some() {
            self.probe_every = (self.probe_every * 2).clamp(PROBE_EVERY, PROBE_EVERY_MAX);
        }
    }

    /// Twice a queue of about one request at a small level known calm:
    /// one less is known calm instead.
    fn doubt_the_level_known_calm(&mut self, r: &Reading) {
        // Twice queued at the level it knew calm by a queue of a
        // request or so: that level is past the workers, one less is
        // known calm instead (else the limit climbs back to it after
        // every queue: half its intervals). A larger queue is a server
        // that slowed down or traffic that surged, not a wrong level.
        // Only for a level of ten or less, where one request is a tenth
        // of the round trip for everyone: past that a queue of one
        // costs little, and noise on a saturated host (32 workers of
        // 20 ms) wore the level down to 31 and goodput under 90 %.
        let (m, unloaded) = (&r.measured, &r.unloaded);
        let about_one = (m.rtt_us as f64)
            <= unloaded.rtt_us as f64 * (1.0 + 1.5 / m.sent_at.max(1.0)) + unloaded.noise;
        if about_one
            && r.probe.from().is_none()
            && self.best.level > self.min as f64
            && self.best.level <= SMALL_LEVEL
            && self.best.level >= self.best_set
            && m.sent_at >= self.best.level - 0.5
        {
            self.queued_at_best += 1;
            if self.queued_at_best >= 2 {
                self.best.level -= 1.0;
                self.queued_at_best = 0;
            }
        }
    }

    /// No queue at full use: a probe found room, or the limit is calm
    /// once more.
    pub(super) fn learn_from_calm(&mut self, now: Micros, r: &Reading) {
        if let Some(probing) = r.probe.found_room() {
            self.probe_found_room(now, probing);
            return;
        }
        // The most it knew calm: two intervals in a row at that
        // limit, forgotten after a window with none as high (a
        // server that lost workers).
        let at = self.limit.floor();
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

    /// The limit the interval asks for, before its bounds.
    pub(super) fn next_limit(&mut self, now: Micros, r: &Reading) -> f64 {
        if r.hold {
            self.limit
        } else if self.slow_start {
            self.double()
        } else if let (true, Some(from)) = (r.probe.found_queue(), r.probe.from()) {
            from
        } else if r.queued {
            // Shrinking, the gradient applies to the concurrency its round
            // trips were sent at, not to the limit now: an interval's
            // samples left under the one before, and a limit that just
            // fell would otherwise fall again for the same queue.
            r.measured.sent_at * r.gradient
        } else if let Some(from) = r.probe.from() {
            // A probe is an excursion, for two round trips: back to where it
            // started (or to the level it just confirmed).
            from.max(self.best.level)
        } else if self.limit.floor() < self.best.level {
            // Below what it knew calm: back up to it, a request at least a
            // step (a twentieth of a small limit is less than one).
            (self.limit * r.gradient)
                .max(self.limit.floor() + 1.0)
                .min(self.best.level)
        } else {
            self.probe_or_stay(now, r)
        }
    }

    /// The limit becomes `next`, within `[min, max]`, and no higher than
    /// it was if the traffic used under half of it.
    pub(super) fn set_limit(&mut self, next: f64) {
        // App-limited: the traffic used under half of it; nothing learnt
        // about more.
        let next = if (self.busiest as f64) < self.limit / 2.0 {
            next.min(self.limit)
        } else {
            next
        };
        self.limit = next.clamp(self.min as f64, self.max as f64);
        // At the floor, growing by a twentieth a step would take long:
        // double again until a queue shows.
        if self.limit <= self.min as f64 && !self.slow_start {
            self.restart_slow_start();
        }
    }
}
