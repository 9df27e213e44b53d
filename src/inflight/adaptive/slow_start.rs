//! The slow start: from `min`, and again whenever the limit falls back to
//! it, the limit doubles each interval until the first queue shows (TCP's
//! slow start), up to the last limit that showed no queue (`good`, TCP's
//! ssthresh: a server that slowed down has the same workers). This file
//! owns when a slow start holds, ends or begins again, its doubling, and
//! the limit it stops at.

use super::Gradient;

impl Gradient {
    /// A slow start ends at the first queue, or holds the limit for an
    /// interval at its first small one; returns whether it holds.
    pub(super) fn end_or_hold_slow_start(&mut self, gradient: f64) -> bool {
        // A slow start ends at the first queue; one under a tenth of the
        // round trip, the first time, holds the limit for an interval
        // instead: the first loaded interval on a busy host can run a few
        // per cent slow (the load's own start), and a slow start ended at
        // 4 of 32 workers climbed back by probes for seconds. A doubling
        // past the workers shows more (a quarter at 5 -> 10 over 8).
        let hold = self.slow_start && (0.9..1.0).contains(&gradient) && !self.slow_held;
        self.slow_held |= hold;
        self.slow_start &= gradient >= 1.0 || hold;
        hold
    }

    /// A limit that showed no queue, out of a slow start, is where the
    /// next slow start stops.
    pub(super) fn remember_good_limit(&mut self, queued: bool) {
        if !queued && !self.slow_start {
            self.good = self.limit;
        }
    }

    /// The limit doubled, but not past the last one that showed no queue
    /// (the slow start ends there).
    pub(super) fn double(&mut self) -> f64 {
        if self.limit * 2.0 >= self.good {
            self.slow_start = false;
        }
        (self.limit * 2.0).min(self.good.max(self.limit))
    }

    /// A slow start begins again, and may hold once more.
    pub(super) fn restart_slow_start(&mut self) {
        (self.slow_start, self.slow_held) = (true, false);
    }
}
