//! A cap on requests in flight, with a bounded queue served by priority.
//!
//! A request takes a slot if one is free and nobody waits; otherwise it
//! waits in the queue. A slot that comes free goes to the highest priority
//! waiting; within it, under a static cap to the oldest, under an adaptive
//! limit to the newest (adaptive LIFO: with demand above capacity the queue
//! never empties, and serving the newest keeps an admitted request's wait
//! near none). When the queue is full, a newcomer of higher priority than
//! the lowest waiting takes that one's place (of the lowest priority, the
//! newest is refused); otherwise the newcomer is refused. A waiter is
//! refused after the queue timeout, which under an adaptive limit is at
//! most half the upstream's unloaded round trip (a millisecond at least)
//! once that is known. Under an adaptive limit a request that arrives with
//! every slot taken may instead go past the limit at once, as a probe's
//! (`adaptive`), unless one waiting is of higher priority.
//!
//! A slot is the upstream's, not the client's: a `Permit`, given back when
//! it is dropped, unless the upstream is still working on its request.
//! A client that leaves while waiting takes no slot. One that leaves after
//! its request was sent and before the upstream answered leaves the
//! upstream working on it (Pingora closes that connection; the server
//! goes on): the slot stays taken until the upstream would have answered,
//! the longest of its recent round trips after the request was sent (the
//! upstream's read timeout when none is known yet, and never longer), so
//! the upstream never holds more than the cap.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::adaptive::{Estimate, Gradient, Probe};

/// Why a request was not given a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shed {
    /// The queue was full of requests of no lower priority.
    QueueFull,
    /// It waited the whole queue timeout.
    Timeout,
    /// A request of higher priority took its place in the queue.
    Displaced,
}

impl Shed {
    /// Every reason a gate's request ends without its slot: the sheds, and
    /// a client that left while it waited.
    pub const REASONS: [&'static str; 4] =
        ["queue_full", "queue_timeout", "displaced", "client_left"];

    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::Timeout => "queue_timeout",
            Shed::Displaced => "displaced",
        }
    }
}

/// How a gate admits: its cap (or, adaptive, where its limit starts and
/// its bounds), its queue and how long a request may wait there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Settings {
    pub limit: u32,
    pub queue: usize,
    pub queue_timeout: Duration,
    /// `[min, max]` of an adaptive limit (which starts at `min`).
    pub adaptive: Option<(u32, u32)>,
}

/// Waiters by (priority, highest first; arrival, oldest first).
type Key = (Reverse<i64>, u64);

/// A slot given: the requests in flight then (itself included), and when
/// (µs from `Gate::started`), if the gate keeps track (adaptive).
type Slot = (u32, Option<i64>);

/// Round trips remembered for how long an abandoned request keeps its slot.
const RECENT_RTTS: usize = 64;

struct Inner {
    settings: Settings,
    /// The latest answered round trips (µs), newest last.
    recent: std::collections::VecDeque<u64>,
    /// The limit now: `settings.limit`, or the adaptive controller's.
    limit: u32,
    in_flight: u32,
    waiting: BTreeMap<Key, oneshot::Sender<Result<Slot, Shed>>>,
    next: u64,
    gradient: Option<Gradient>,
    /// Slots kept after their request ended (the client left first).
    held: u64,
    /// When the requests in flight were sent (µs from `Gate::started`;
    /// given their slot, until sent), and how many at each time: the
    /// oldest tells an adaptive probe when a worker comes free. Kept only
    /// under an adaptive limit (a static cap has no probes: no cost on its
    /// path).
    given: BTreeMap<i64, u32>,
}

impl Inner {
    fn take_slot(&mut self, now: i64) -> Slot {
        self.in_flight += 1;
        let given = self.gradient.is_some().then(|| self.remember(now));
        (self.in_flight, given)
    }

    fn give_back(&mut self, given: Option<i64>) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if let Some(given) = given {
            self.forget(given);
        }
    }

    fn remember(&mut self, at: i64) -> i64 {
        *self.given.entry(at).or_default() += 1;
        at
    }

    fn forget(&mut self, given: i64) {
        if let Some(n) = self.given.get_mut(&given) {
            *n -= 1;
            if *n == 0 {
                self.given.remove(&given);
            }
        }
    }

    /// The send time `places` from the oldest in flight.
    fn nth_sent(&self, places: u32) -> Option<i64> {
        let mut seen = 0;
        for (at, n) in &self.given {
            seen += n;
            if seen > places {
                return Some(*at);
            }
        }
        None
    }
}

pub struct Gate {
    inner: Mutex<Inner>,
    started: Instant,
}

impl Gate {
    pub fn new(settings: Settings) -> Arc<Self> {
        let gate = Arc::new(Gate {
            inner: Mutex::new(Inner {
                settings,
                recent: std::collections::VecDeque::with_capacity(RECENT_RTTS),
                limit: settings.limit,
                in_flight: 0,
                waiting: BTreeMap::new(),
                next: 0,
                gradient: None,
                held: 0,
                given: BTreeMap::new(),
            }),
            started: Instant::now(),
        });
        gate.configure(settings);
        gate
    }

    fn now_us(&self) -> i64 {
        self.started.elapsed().as_micros() as i64
    }

    /// New settings (a reload): requests in flight and waiting keep their
    /// places; an adaptive limit keeps what it learnt.
    pub fn configure(&self, settings: Settings) {
        let now = self.now_us();
        let mut g = self.inner.lock();
        g.gradient = match (settings.adaptive, g.gradient.take()) {
            (Some(bounds), Some(old)) if g.settings.adaptive == Some(bounds) => Some(old),
            (Some((min, max)), _) => Some(Gradient::new(min, max, now)),
            (None, _) => None,
        };
        g.settings = settings;
        g.limit = g.gradient.as_ref().map_or(settings.limit, Gradient::limit);
        // A smaller queue: the lowest waiting go.
        while g.waiting.len() > settings.queue {
            if let Some((_, tx)) = g.waiting.pop_last() {
                let _ = tx.send(Err(Shed::QueueFull));
            }
        }
        Self::hand_out(&mut g, now);
    }

    /// A static limit set from outside (a pool-wide figure over the live
    /// replicas); ignored while adaptive.
    pub fn set_limit(&self, limit: u32) {
        let now = self.now_us();
        let mut g = self.inner.lock();
        if g.gradient.is_none() && g.limit != limit {
            g.limit = limit.max(1);
            Self::hand_out(&mut g, now);
        }
    }

    /// (in flight, waiting, limit).
    pub fn load(&self) -> (u32, usize, u32) {
        let g = self.inner.lock();
        (g.in_flight, g.waiting.len(), g.limit)
    }

    /// How long a request may wait in the queue (its refusal's Retry-After).
    pub fn queue_timeout(&self) -> Duration {
        Self::wait_bound(&self.inner.lock())
    }

    /// A queued request's longest wait: `queue_timeout_ms`, and under an
    /// adaptive limit at most half the upstream's unloaded round trip once
    /// it is known (CoDel's idea: a queue is for absorbing a burst, not for
    /// holding an overload). Requests sent together come back together, so
    /// a whole limit's worth of slots can come free at once; with demand at
    /// twice the capacity, half a round trip of arrivals is a limit's worth
    /// of fresh waiters (a quarter left half the wave's slots idle until
    /// new requests came: 87% of a server of 8 workers at 20 ms). An
    /// admitted request waits at most that before its round trip, so the
    /// queue keeps the upstream busy without adding a round trip to every
    /// answer, whatever `queue_timeout_ms` says.
    fn wait_bound(g: &Inner) -> Duration {
        let configured = g.settings.queue_timeout;
        match g.gradient.as_ref().map(Gradient::estimate) {
            Some(e) if e.min_rtt_us > 0 => {
                configured.min(Duration::from_micros((e.min_rtt_us / 2).max(1_000)))
            }
            _ => configured,
        }
    }

    pub fn estimate(&self) -> Option<Estimate> {
        self.inner.lock().gradient.as_ref().map(Gradient::estimate)
    }

    /// A slot for a request of `priority`, waiting in the queue if need be.
    pub async fn acquire(self: &Arc<Self>, priority: i64) -> Result<Permit, Shed> {
        let (key, rx, timeout) = {
            let now = self.now_us();
            let mut g = self.inner.lock();
            if g.in_flight < g.limit && g.waiting.is_empty() {
                let slot = g.take_slot(now);
                return Ok(self.permit(slot, None));
            }
            // An adaptive limit's probe goes past it with a request as it
            // arrives (the newest, as adaptive LIFO would serve anyway),
            // unless one waiting outranks it: the probe's slot is the next
            // to come free. It is timed by the request in flight that
            // frees it: as many places from the oldest as probes are out.
            let outranked = g
                .waiting
                .first_key_value()
                .is_some_and(|((Reverse(top), _), _)| *top > priority);
            let probes_out = g.gradient.as_ref().map(Gradient::probes_out);
            let probe = match probes_out {
                Some(out) if g.in_flight >= g.limit && !outranked => {
                    let next_free = g.nth_sent(out).unwrap_or(now);
                    g.gradient
                        .as_mut()
                        .and_then(|gr| gr.take_probe(now, next_free))
                }
                _ => None,
            };
            if probe.is_some() {
                let slot = g.take_slot(now);
                return Ok(self.permit(slot, probe));
            }
            if g.waiting.len() >= g.settings.queue {
                // Full: this one goes in only in place of a lower priority.
                match g.waiting.last_key_value() {
                    Some(((Reverse(lowest), _), _)) if *lowest < priority => {
                        if let Some((_, tx)) = g.waiting.pop_last() {
                            let _ = tx.send(Err(Shed::Displaced));
                        }
                    }
                    _ => return Err(Shed::QueueFull),
                }
            }
            let key = (Reverse(priority), g.next);
            g.next += 1;
            let (tx, rx) = oneshot::channel();
            g.waiting.insert(key, tx);
            (key, rx, Self::wait_bound(&g))
        };
        let mut wait = Waiting {
            gate: self.clone(),
            key,
            rx: Some(rx),
        };
        let answer = tokio::time::timeout(timeout, wait.rx.as_mut().expect("set")).await;
        let answer = match answer {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => Err(Shed::QueueFull),
            Err(_) => {
                // Timed out, unless it was answered in the meantime.
                let mut g = self.inner.lock();
                match g.waiting.remove(&key) {
                    Some(_) => Err(Shed::Timeout),
                    None => {
                        drop(g);
                        wait.rx
                            .as_mut()
                            .and_then(|rx| rx.try_recv().ok())
                            .unwrap_or(Err(Shed::Timeout))
                    }
                }
            }
        };
        wait.rx = None; // answered: nothing for its drop to undo
        answer.map(|slot| self.permit(slot, None))
    }

    fn permit(self: &Arc<Self>, (in_flight, given): Slot, probe: Option<Probe>) -> Permit {
        Permit {
            gate: self.clone(),
            in_flight,
            given,
            probe,
            sent: None,
            rtt: None,
            failed: false,
            upstream_ended: false,
            timeout: None,
        }
    }

    /// The longest of the latest round trips, if any.
    fn longest_recent(&self) -> Option<Duration> {
        let g = self.inner.lock();
        g.recent.iter().max().map(|us| Duration::from_micros(*us))
    }

    /// Requests that took a slot and were given it back later than their
    /// end, for an upstream still working on them.
    pub fn held(&self) -> u64 {
        self.inner.lock().held
    }

    /// Gives the free slots to the waiters, highest priority first.
    fn hand_out(g: &mut Inner, now: i64) {
        while g.in_flight < g.limit {
            let Some((_, tx)) = Self::next_waiter(g) else {
                return;
            };
            let slot = g.take_slot(now);
            if tx.send(Ok(slot)).is_err() {
                g.give_back(slot.1); // its waiter is gone
            }
        }
    }

    /// The waiter a free slot goes to: the highest priority first; within
    /// it the oldest, or under an adaptive limit the newest (adaptive LIFO,
    /// as Facebook's servers do under overload: with demand above capacity
    /// the queue never empties, and serving the newest keeps an admitted
    /// request's wait near none, while the oldest run out their short
    /// wait and are refused).
    fn next_waiter(g: &mut Inner) -> Option<(Key, oneshot::Sender<Result<Slot, Shed>>)> {
        if g.gradient.is_none() {
            return g.waiting.pop_first();
        }
        let (Reverse(top), _) = *g.waiting.first_key_value()?.0;
        let newest = *g
            .waiting
            .range((Reverse(top), 0)..=(Reverse(top), u64::MAX))
            .next_back()?
            .0;
        g.waiting.remove_entry(&newest)
    }

    /// A probe's request that will teach nothing.
    fn probe_lost(&self, probe: Probe) {
        if let Some(gr) = self.inner.lock().gradient.as_mut() {
            gr.probe_lost(probe);
        }
    }

    /// A request given its slot at `given` was sent `at`: when it is back
    /// is counted from then (a connect can take a while).
    fn sent_at(&self, given: i64, at: Instant) -> i64 {
        let at = at.saturating_duration_since(self.started).as_micros() as i64;
        let mut g = self.inner.lock();
        g.forget(given);
        g.remember(at)
    }

    fn release(&self, sample: Option<Sample>, given: Option<i64>, probe: Option<Probe>) {
        let now = self.now_us();
        let mut g = self.inner.lock();
        g.give_back(given);
        if let Some(Sample::Answered { rtt, .. }) = sample {
            if g.recent.len() == RECENT_RTTS {
                g.recent.pop_front();
            }
            g.recent.push_back(rtt.as_micros() as u64);
        }
        if let (Some(sample), Some(gr)) = (sample, g.gradient.as_mut()) {
            let e = match sample {
                Sample::Answered { rtt, in_flight } => {
                    let rtt = rtt.as_micros() as u64;
                    if let Some(probe) = probe {
                        gr.probe_answered(probe, rtt);
                    }
                    gr.sample(now, rtt, in_flight)
                }
                Sample::Failed { in_flight } => gr.failure(now, in_flight),
            };
            if let Some(e) = e {
                g.limit = e.limit;
            }
        }
        Self::hand_out(&mut g, now);
    }
}

/// A request waiting for a slot; if it is dropped before its answer was
/// read (the client left), it leaves the queue, and a slot it was given in
/// the meantime goes back.
struct Waiting {
    gate: Arc<Gate>,
    key: Key,
    rx: Option<oneshot::Receiver<Result<Slot, Shed>>>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let now = self.gate.now_us();
        let mut g = self.gate.inner.lock();
        if g.waiting.remove(&self.key).is_some() {
            return;
        }
        if let Ok(Ok((_, given))) = rx.try_recv() {
            g.give_back(given);
            Gate::hand_out(&mut g, now);
        }
    }
}

/// What a request taught the adaptive limit when its slot was given back.
#[derive(Debug, Clone, Copy)]
enum Sample {
    /// A round trip, with the requests in flight when it was sent.
    Answered { rtt: Duration, in_flight: u32 },
    /// A 5xx or a timeout: a signal of its own, never a quick round trip
    /// (a failing server answers fast).
    Failed { in_flight: u32 },
}

/// A slot in flight; given back when dropped (or later: the module's doc).
/// `sent` then `answered` give the adaptive limit the upstream's round trip.
pub struct Permit {
    gate: Arc<Gate>,
    /// Requests in flight when it was given (itself included), and when
    /// (sent, once it was), if its gate keeps track.
    in_flight: u32,
    given: Option<i64>,
    /// An adaptive probe's request.
    probe: Option<Probe>,
    sent: Option<Instant>,
    rtt: Option<Duration>,
    /// The answer was a 5xx, or the upstream timed out.
    failed: bool,
    /// The upstream ended the exchange itself (it closed or reset the
    /// connection): it is not working on the request any more.
    upstream_ended: bool,
    /// The upstream's read timeout for this request: the longest it can
    /// be working on it as far as the gateway knows.
    timeout: Option<Duration>,
}

impl Permit {
    /// The request went to the upstream now (a retry's round trip is
    /// measured from the first attempt).
    pub fn sent(&mut self, at: Instant) {
        if self.sent.is_none() {
            self.sent = Some(at);
            if let Some(given) = self.given {
                self.given = Some(self.gate.sent_at(given, at));
            }
        }
    }

    /// The upstream's answer began (or it timed out): that round trip
    /// counts toward the adaptive limit once the slot is given back. A slot
    /// given back without one (refused, failed to connect, the client gone)
    /// teaches nothing.
    pub fn answered(&mut self) {
        if let (Some(sent), None) = (self.sent, self.rtt) {
            self.rtt = Some(sent.elapsed());
        }
    }

    /// The upstream answered with a server error, or timed out.
    pub fn failed(&mut self) {
        self.answered();
        self.failed = true;
    }

    /// The upstream closed or reset the connection itself.
    pub fn upstream_ended(&mut self) {
        self.upstream_ended = true;
    }

    /// The upstream's read timeout for this request.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
    }

    /// How much longer the upstream may be working on this request once
    /// it ended here: none if it answered or ended the exchange itself, or
    /// was never sent.
    fn still_working(&self) -> Option<Duration> {
        let sent = self.sent?;
        if self.rtt.is_some() || self.upstream_ended {
            return None;
        }
        let timeout = self.timeout.unwrap_or(Duration::from_secs(10));
        let longest = self.gate.longest_recent().unwrap_or(timeout).min(timeout);
        longest.checked_sub(sent.elapsed())
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let sample = match (self.rtt, self.failed) {
            (Some(_), true) => Some(Sample::Failed {
                in_flight: self.in_flight,
            }),
            (Some(rtt), false) => Some(Sample::Answered {
                rtt,
                in_flight: self.in_flight,
            }),
            (None, _) => None,
        };
        let hold = self.still_working();
        let given = self.given;
        let answered = matches!(sample, Some(Sample::Answered { .. }));
        if let (Some(probe), false) = (self.probe, answered) {
            self.gate.probe_lost(probe);
        }
        match (hold, tokio::runtime::Handle::try_current()) {
            (Some(left), Ok(rt)) if !left.is_zero() => {
                let gate = self.gate.clone();
                gate.inner.lock().held += 1;
                rt.spawn(async move {
                    tokio::time::sleep(left).await;
                    gate.release(None, given, None);
                });
            }
            _ => self.gate.release(sample, given, self.probe),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(limit: u32, queue: usize, timeout_ms: u64) -> Arc<Gate> {
        Gate::new(Settings {
            limit,
            queue,
            queue_timeout: Duration::from_millis(timeout_ms),
            adaptive: None,
        })
    }

    #[tokio::test]
    async fn caps_then_queues_then_refuses() {
        let g = gate(2, 1, 10_000);
        let a = g.acquire(0).await.unwrap();
        let _b = g.acquire(0).await.unwrap();
        let waiter = tokio::spawn({
            let g = g.clone();
            async move { g.acquire(0).await.map(|_| ()) }
        });
        tokio::task::yield_now().await;
        while g.load().1 == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(g.acquire(0).await.err(), Some(Shed::QueueFull));
        drop(a);
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(g.load(), (1, 0, 2), "the waiter's permit went with it");
    }

    #[tokio::test]
    async fn an_adaptive_gate_serves_the_newest_waiter_of_the_highest_priority() {
        let g = Gate::new(Settings {
            limit: 1,
            queue: 8,
            queue_timeout: Duration::from_secs(10),
            adaptive: Some((1, 1)),
        });
        let held = g.acquire(0).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for (i, p) in [0, 0, 5, 5].into_iter().enumerate() {
            let (g2, order) = (g.clone(), order.clone());
            let tag = p * 10 + i as i64;
            waiters.push(tokio::spawn(async move {
                let permit = g2.acquire(p).await;
                order.lock().push(tag);
                drop(permit);
            }));
            while g.load().1 < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        for w in waiters {
            w.await.unwrap();
        }
        // The highest priority first, each priority's newest first.
        assert_eq!(*order.lock(), vec![53, 52, 1, 0]);
    }

    #[tokio::test]
    async fn a_waiter_times_out_and_takes_nothing() {
        let g = gate(1, 4, 20);
        let _a = g.acquire(0).await.unwrap();
        assert_eq!(g.acquire(0).await.err(), Some(Shed::Timeout));
        assert_eq!(g.load(), (1, 0, 1));
    }

    #[tokio::test]
    async fn higher_priority_is_served_first_and_displaces_the_lowest() {
        let g = gate(1, 2, 10_000);
        let held = g.acquire(0).await.unwrap();
        let spawn = |p: i64| {
            let g = g.clone();
            tokio::spawn(async move { g.acquire(p).await.map(|_| p) })
        };
        let free1 = spawn(0);
        while g.load().1 < 1 {
            tokio::task::yield_now().await;
        }
        let free2 = spawn(0);
        while g.load().1 < 2 {
            tokio::task::yield_now().await;
        }
        // Full of priority 0: a priority 10 takes the newest one's place,
        // another priority 0 is refused.
        let pro = spawn(10);
        assert_eq!(free2.await.unwrap(), Err(Shed::Displaced));
        assert_eq!(g.acquire(0).await.err(), Some(Shed::QueueFull));
        drop(held);
        assert_eq!(pro.await.unwrap(), Ok(10), "served first");
        assert_eq!(free1.await.unwrap(), Ok(0));
    }

    #[tokio::test]
    async fn a_client_that_leaves_while_waiting_leaves_no_slot_behind() {
        let g = gate(1, 4, 10_000);
        let held = g.acquire(0).await.unwrap();
        let gone = tokio::spawn({
            let g = g.clone();
            async move { g.acquire(0).await.map(|_| ()) }
        });
        while g.load().1 == 0 {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        assert_eq!(g.load(), (1, 0, 1));
        drop(held);
        assert_eq!(g.load(), (0, 0, 1));
        let _again = g.acquire(0).await.unwrap();
    }

    /// The sum of the send times tracked is the requests in flight, however
    /// they end; an arrival goes past an adaptive limit as a probe only
    /// when the probe lets it, and a probe that teaches nothing frees its
    /// place.
    #[tokio::test]
    async fn probes_go_past_the_limit_and_every_slot_is_accounted_for() {
        let g = Gate::new(Settings {
            limit: 2,
            queue: 4,
            queue_timeout: Duration::from_secs(10),
            adaptive: Some((2, 2)),
        });
        let tracked = |g: &Arc<Gate>| {
            let i = g.inner.lock();
            (i.given.values().sum::<u32>(), i.in_flight)
        };
        let mut a = g.acquire(0).await.unwrap();
        let b = g.acquire(0).await.unwrap();
        a.sent(Instant::now());
        assert_eq!(tracked(&g), (2, 2));
        // Full, no probe under way: an arrival waits.
        let waiter = tokio::spawn({
            let g = g.clone();
            async move { g.acquire(0).await.map(drop) }
        });
        while g.load().1 == 0 {
            tokio::task::yield_now().await;
        }
        // A probe of one request, the unloaded round trip 200 ms: it goes
        // once the oldest in flight is half of that old.
        g.inner
            .lock()
            .gradient
            .as_mut()
            .unwrap()
            .start_probe(1, 200_000);
        tokio::time::sleep(Duration::from_millis(120)).await;
        let probe = g.acquire(0).await.unwrap();
        assert!(probe.probe.is_some());
        assert_eq!(tracked(&g), (3, 3), "past the limit of 2");
        let probes_out = || g.inner.lock().gradient.as_ref().unwrap().probes_out();
        assert_eq!(probes_out(), 1);
        // Never answered (the client left before it was sent): it frees
        // its place in the probe.
        drop(probe);
        assert_eq!(probes_out(), 0);
        assert_eq!(tracked(&g), (2, 2));
        a.answered();
        drop(a);
        waiter.await.unwrap().unwrap();
        drop(b);
        assert_eq!(tracked(&g), (0, 0));
        assert!(g.inner.lock().given.is_empty());
    }

    #[tokio::test]
    async fn a_smaller_limit_or_queue_applies_to_what_comes_next() {
        let g = gate(3, 2, 10_000);
        let a = g.acquire(0).await.unwrap();
        let b = g.acquire(0).await.unwrap();
        g.set_limit(1);
        assert_eq!(g.load(), (2, 0, 1));
        drop(a);
        drop(b);
        let _c = g.acquire(0).await.unwrap();
        assert_eq!(g.load(), (1, 0, 1));
    }
}
