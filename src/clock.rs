//! Time as the limiter sees it: microseconds since the Unix epoch, injected.
//!
//! Algorithms never read a clock; backends are handed one. Tests use
//! `ManualClock` and move it by hand instead of sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch.
pub type Micros = i64;

pub trait Clock: Send + Sync {
    fn now_us(&self) -> i64;
}

/// The wall clock. Wall time (not a monotonic instant) because windows are
/// aligned to the epoch and every replica must agree where one ends.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64)
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    pub fn new(now_us: i64) -> Self {
        ManualClock(AtomicI64::new(now_us))
    }
    pub fn set(&self, now_us: i64) {
        self.0.store(now_us, Ordering::SeqCst);
    }
    pub fn advance(&self, us: i64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}
