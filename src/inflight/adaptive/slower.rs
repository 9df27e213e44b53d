//! A server that became slower for good, told from a queue (both make
//! round trips longer): the verdict, which relearns the unloaded round trip
//! at once and climbs back to the workers it knew, and its trial. A server
//! that lost workers looks the same for an interval whose round trips were
//! partly taken before the loss: its queue was learnt as the unloaded round
//! trip (6 workers of 120 ms down to 3: 190 ms), and the limit stayed at
//! the workers it no longer had. So the verdict stands only until the climb
//! back shows whether the round trip rises with the concurrency (a queue:
//! the means known before it are restored) or stays (a slower server).

use std::collections::VecDeque;

use super::stats::{Mean, Measured, PastInterval, Sample};
use super::{Gradient, MIN_RTT_WINDOW_US, MIN_SAMPLES};
use crate::clock::Micros;

/// How much higher than the verdict's the concurrency of a round trip
/// must be to judge it by: a queue's round trip rises as much, a slower
/// server's none, and half way between is outside either's noise.
const TRIAL_RISE: f64 = 1.25;

/// Round trips sent at a concurrency in a range: how many, the mean
/// concurrency, the mean round trip and its standard error (µs).
struct Above {
    n: usize,
    sent_at: f64,
    rtt_us: f64,
    se: f64,
}

impl Above {
    fn of(samples: &[Sample], from: f64, to: f64) -> Above {
        let inside = || {
            samples
                .iter()
                .filter(move |s| (from..=to).contains(&(s.in_flight as f64)))
        };
        let n = inside().count();
        let per = |f: &dyn Fn(&Sample) -> f64| inside().map(f).sum::<f64>() / n.max(1) as f64;
        let rtt_us = per(&|s| s.rtt_us as f64);
        let var =
            per(&|s| (s.rtt_us as f64 - rtt_us).powi(2)) * n as f64 / (n as f64 - 1.0).max(1.0);
        Above {
            n,
            sent_at: per(&|s| s.in_flight as f64),
            rtt_us,
            se: (var / n.max(1) as f64).sqrt(),
        }
    }
}

/// A slower-server verdict on trial.
#[derive(Debug, Clone)]
pub(super) struct Trial {
    /// The mean concurrency the verdict's interval was sent at, and its
    /// mean round trip (µs).
    pub(super) sent_at: f64,
    pub(super) rtt_us: u64,
    /// The workers it knew then (`good`): past them a slower server queues
    /// too, so the climb is judged only up to them.
    workers: f64,
    /// The means remembered before the verdict.
    means: VecDeque<Mean>,
    when: Micros,
}

impl Gradient {
    /// Whether the interval shows a server that became slower, not a
    /// queue.
    pub(super) fn became_slower(&self, m: &Measured) -> bool {
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
        let stale_min = self
            .means
            .iter()
            .map(|m| m.rtt_us)
            .min()
            .unwrap_or(m.rtt_us);
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
                && m.sent_at <= 0.75 * p.sent_at
                && m.rtt_us as f64 >= 0.8 * p.rtt_us as f64
                && self.limit < self.good
        };
        !m.mixed && (self.prev.is_some_and(refuted) || self.slide.is_some_and(refuted))
            || (self.good < f64::MAX
                && (self.busiest as f64) <= self.good / 2.0
                && m.rtt_us as f64 >= 1.5 * stale_min as f64)
    }

    /// A server that became slower: the interval's mean is its unloaded
    /// round trip now, and a slow start climbs back to the workers it knew.
    /// The verdict is on trial until that climb has shown whether the round
    /// trip rises with the concurrency (`judge_trial`).
    pub(super) fn learn_slower_server(&mut self, now: Micros, m: &Measured) {
        let mut before = std::mem::take(&mut self.means);
        // (The last is this interval's, just remembered.)
        before.pop_back();
        // On trial only where the unloaded round trips are steady enough to
        // read a rise of the mean by (their scatter under a quarter of
        // them): a server whose own service times have a long tail shows
        // such rises by chance, and it kept fewer of its workers busy.
        let steady = 4.0 * self.min_sd <= self.last.min_rtt_us as f64;
        self.trial = (self.good < f64::MAX && steady).then_some(Trial {
            sent_at: m.sent_at,
            rtt_us: m.rtt_us,
            workers: self.good,
            means: before,
            when: now,
        });
        self.means.push_back(m.mean(now, self.busiest));
        self.restart_slow_start();
        self.slide = None;
    }

    /// A slower-server verdict on trial, judged by the round trips of the
    /// climb back sent well above the verdict's concurrency and at most at
    /// the workers it knew; it stands once they reached those workers.
    /// Returns whether it was refuted, and the means known before it are
    /// the unloaded round trip again.
    pub(super) fn judge_trial(&mut self, now: Micros, m: &Measured) -> bool {
        let Some(t) = &self.trial else {
            return false;
        };
        // A climb that never came (the traffic fell) leaves the verdict.
        if now - t.when > MIN_RTT_WINDOW_US {
            self.trial = None;
            return false;
        }
        // (Those sent above the level a climbing interval started at: its
        // mean mixes the levels, and the first queued interval after the
        // climb falls back before its mean rises far enough.)
        let above = Above::of(&self.samples, t.sent_at * TRIAL_RISE, t.workers);
        if m.mixed || above.n < MIN_SAMPLES / 2 {
            return false;
        }
        // Slower, at most the workers it knew: the round trip stays as the
        // concurrency rises. A queue (it lost workers): the round trip rises
        // with it, by Little's law. Past half way, and past the noise of
        // both means, it is a queue.
        let rise = above.sent_at / t.sent_at;
        let half_way = t.rtt_us as f64 * (1.0 + (rise - 1.0) / 2.0);
        let noise = 2.0 * above.se;
        if above.rtt_us < half_way || above.rtt_us - (t.rtt_us as f64) < noise {
            // It stands once an interval that did not climb ran at the
            // workers it knew with no such rise (a climbing interval's
            // round trips lag its concurrency: it says too little).
            let steady = self.limit <= self.ran_at;
            if steady && above.sent_at >= t.workers.floor() - 0.5 {
                self.trial = None;
            }
            return false;
        }
        let Some(t) = self.trial.take() else {
            return false;
        };
        self.means = t.means;
        self.means.push_back(m.mean(now, self.busiest));
        true
    }
}
