//! Steady load for fault tests: client threads sending requests through the
//! gateway until told to stop, recording every outcome and its latency, while
//! a watcher polls `/readyz` to time the backend's transitions.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Client;

#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Since the load started.
    pub at: Duration,
    /// 0: no response (connection error).
    pub status: u16,
    pub latency: Duration,
}

pub struct Load {
    pub started: Instant,
    stop: Arc<AtomicBool>,
    /// Requests answered (any status) so far.
    answered: Arc<AtomicUsize>,
    samples: Arc<Mutex<Vec<Sample>>>,
    backends: Arc<Mutex<Vec<(Duration, String)>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    /// `clients` threads, each sending `path` over keep-alive connections to
    /// `targets` in turn, one request at a time, at most `max_secs` long.
    pub fn start(
        targets: Vec<SocketAddr>,
        admin: SocketAddr,
        path: &'static str,
        clients: usize,
        max_secs: u64,
    ) -> Self {
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let backends = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for i in 0..clients {
            let (stop, samples, targets) = (stop.clone(), samples.clone(), targets.clone());
            let answered = answered.clone();
            threads.push(std::thread::spawn(move || {
                let mut conns: Vec<Option<Client>> = targets.iter().map(|_| None).collect();
                let mut n = i;
                while !stop.load(Ordering::Relaxed)
                    && started.elapsed() < Duration::from_secs(max_secs)
                {
                    let k = n % targets.len();
                    n += 1;
                    let t = Instant::now();
                    if conns[k].is_none() {
                        conns[k] = Client::connect(targets[k]).ok();
                    }
                    let status = match conns[k].as_mut().map(|c| c.get(path)) {
                        Some(Ok(r)) => r.status,
                        _ => {
                            conns[k] = None;
                            0
                        }
                    };
                    let s = Sample {
                        at: t - started,
                        status,
                        latency: t.elapsed(),
                    };
                    samples.lock().expect("samples").push(s);
                    if status != 0 {
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    // ~500 requests/s per client: steady, not a flood.
                    std::thread::sleep(Duration::from_millis(2));
                }
            }));
        }
        {
            let (stop, backends) = (stop.clone(), backends.clone());
            threads.push(std::thread::spawn(move || {
                let mut last = String::new();
                while !stop.load(Ordering::Relaxed)
                    && started.elapsed() < Duration::from_secs(max_secs)
                {
                    if let Ok(r) = Client::connect(admin).and_then(|mut c| c.get("/readyz")) {
                        let b = r.json()["backend"].as_str().unwrap_or("").to_string();
                        if b != last {
                            backends
                                .lock()
                                .expect("backends")
                                .push((started.elapsed(), b.clone()));
                            last = b;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        Load {
            started,
            stop,
            answered,
            samples,
            backends,
            threads,
        }
    }

    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Waits until `n` more requests have been answered: a window of load
    /// counted in requests, not in time, so a busy machine (fewer requests
    /// a second) still puts as many through the state under test.
    pub fn wait_answers(&self, n: usize) {
        let from = self.answered.load(Ordering::Relaxed);
        super::wait_for(
            &format!("{n} more requests answered under load"),
            Duration::from_secs(60),
            || (self.answered.load(Ordering::Relaxed) >= from + n).then_some(()),
        );
    }

    pub fn stop(mut self) -> Report {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join().expect("load thread");
        }
        Report {
            samples: self.samples.lock().expect("samples").clone(),
            backends: self.backends.lock().expect("backends").clone(),
        }
    }
}

pub struct Report {
    pub samples: Vec<Sample>,
    /// (when, backend) each time `/readyz` reported a different backend.
    pub backends: Vec<(Duration, String)>,
}

impl Report {
    pub fn count(&self, f: impl Fn(&Sample) -> bool) -> usize {
        self.samples.iter().filter(|s| f(s)).count()
    }

    /// From the first request's start to the last one's end: every decision
    /// of the run fell inside it.
    pub fn span(&self) -> (Duration, Duration) {
        let first = self.samples.iter().map(|s| s.at).min().unwrap_or_default();
        let last = self
            .samples
            .iter()
            .map(|s| s.at + s.latency)
            .max()
            .unwrap_or_default();
        (first, last)
    }

    pub fn server_errors(&self) -> usize {
        self.count(|s| s.status >= 500 || s.status == 0)
    }

    /// The slowest request that started within [from, to).
    pub fn slowest(&self, from: Duration, to: Duration) -> Duration {
        self.samples
            .iter()
            .filter(|s| s.at >= from && s.at < to)
            .map(|s| s.latency)
            .max()
            .unwrap_or_default()
    }

    /// When `/readyz` first showed `backend` at or after `after`.
    pub fn backend_at(&self, backend: &str, after: Duration) -> Option<Duration> {
        self.backends
            .iter()
            .find(|(t, b)| *t >= after && b == backend)
            .map(|(t, _)| *t)
    }
}

impl Report {
    /// Prints the figures of a fault test: 5xx, the slowest request during
    /// the fault and once the breaker was open, time to fall back (from
    /// `fault`) and to fail back (from `recover`).
    pub fn print_figures(&self, name: &str, fault: Duration, recover: Duration) {
        let fallback = self
            .backend_at("local", fault)
            .map(|t| (t - fault).as_millis());
        let failback = self
            .backend_at("redis", recover)
            .map(|t| (t - recover).as_millis());
        let open_from =
            self.backend_at("local", fault).unwrap_or(fault) + Duration::from_millis(20);
        eprintln!(
            "FIGURES {name}: requests={} 5xx={} slowest_during_fault_ms={:.1} slowest_once_open_ms={:.1} fallback_ms={fallback:?} failback_ms={failback:?} fault_to_recovery_ms={}",
            self.samples.len(),
            self.server_errors(),
            self.slowest(fault, recover).as_secs_f64() * 1000.0,
            self.slowest(open_from, recover).as_secs_f64() * 1000.0,
            (recover - fault).as_millis()
        );
    }
}
