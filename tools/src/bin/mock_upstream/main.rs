//! `mock-upstream`: the stand-in for the services the gateway protects.
//!
//! Up to `--capacity-rps` it answers at once. Past it, requests queue for a
//! slot the way a saturated service's do: latency climbs, and a request that
//! would wait longer than `--max-queue-ms` waits that long and then fails with
//! 503, like a service timing out under load. It counts every request it
//! receives per path and serves the counts at `GET /stats`.
//!
//! Special paths (not counted): `GET /healthz`, `GET /stats`, `POST /stats/reset`,
//! and `GET /stats/times?path=P`: the arrival times of the requests for `P`
//! (microseconds since start, the first `MAX_TIMES` requests), so a test can
//! check a rate over every interval from the upstream's own clock.
//! `GET /stats/arrivals?path=P` gives the same times with each request's
//! `x-mock-seq` header (a client's number for it, `null` if none), so a
//! client can match an arrival to its own send and answer times.
//! A request header `x-mock-delay-ms: N` adds N ms before answering.
//!
//! With `--workers N` it is a server of N workers: a request waits for a free
//! worker (its own queue, unbounded, like a thread pool's), then is served
//! for the service time. `/stats` reports how many requests it holds now and
//! at most (`in_flight`, `max_in_flight`) and how many wait for a worker
//! (`waiting`, `max_waiting`). `POST /control?service_ms=N` changes the
//! service time while it runs (a service that slows down), and
//! `POST /control?workers=M` the workers (a server that loses some: each
//! leaves once it finishes what it holds). With
//! `--finish-abandoned` a request whose client closed the connection is
//! still served whole (it keeps its worker and its place in `in_flight`),
//! as a threaded server's is; without it the work ends with the connection.
//!
//! `POST …/chat/completions` answers as an LLM API does (`llm`): tokens
//! used, in the JSON body or the last server-sent event, with faults on
//! request; `GET /stats/llm` lists the usage it reported.

mod llm;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};

/// Every answer's body: whole, or made as it is sent (`llm`).
pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

pub fn boxed<B>(body: B) -> BoxBody
where
    B: http_body::Body<Data = Bytes, Error = std::io::Error> + Send + Sync + 'static,
{
    body.boxed()
}

/// A whole body.
pub fn full(b: Bytes) -> BoxBody {
    boxed(Full::new(b).map_err(|never: Infallible| match never {}))
}
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(
    name = "mock-upstream",
    version,
    about = "A capacity-limited test upstream that counts what it receives"
)]
struct Args {
    /// Address to listen on, e.g. 127.0.0.1:9001.
    #[arg(long)]
    listen: SocketAddr,
    /// Requests per second served before queueing starts (0: unlimited).
    #[arg(long, default_value_t = 0.0)]
    capacity_rps: f64,
    /// Longest a request queues for a slot before it fails with 503.
    #[arg(long, default_value_t = 2000)]
    max_queue_ms: u64,
    /// Base service time of every request.
    #[arg(long, default_value_t = 0)]
    service_ms: u64,
    /// Worker threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Requests served at once; more wait for a worker (0: no limit).
    #[arg(long, default_value_t = 0)]
    workers: usize,
    /// Go on working on a request whose client closed the connection, as a
    /// threaded server does (its worker stays busy for the whole service
    /// time); without it the work stops with the connection.
    #[arg(long)]
    finish_abandoned: bool,
}

/// Distinct paths tracked before the rest are counted as "(other)".
const MAX_PATHS: usize = 10_000;

/// Arrival times kept (all paths together).
const MAX_TIMES: usize = 2_000_000;

/// An arrival without an `x-mock-seq` header.
const NO_SEQ: u64 = u64::MAX;

struct Stats {
    started: Instant,
    total: AtomicU64,
    ok: AtomicU64,
    failed: AtomicU64,
    paths: Mutex<HashMap<String, u64>>,
    /// Arrival times, with the path's index in `time_paths` and the
    /// request's `x-mock-seq` (`NO_SEQ` if none).
    times: Mutex<Vec<(u32, u64, u64)>>,
    time_paths: Mutex<Vec<String>>,
}

struct Upstream {
    args: Args,
    stats: Stats,
    /// Microseconds since start at which the next slot is free.
    next_free_us: Mutex<f64>,
    /// The service time now (`--service-ms`, changed by `/control`).
    service_ms: AtomicU64,
    workers: Option<tokio::sync::Semaphore>,
    /// The workers now (`--workers`, changed by `/control`).
    worker_count: AtomicU64,
    held: Gauge,
    waiting: Gauge,
    llm: llm::Llm,
}

/// A count of requests now, and the most there were.
#[derive(Default)]
struct Gauge {
    now: AtomicU64,
    max: AtomicU64,
}

impl Gauge {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.max.fetch_max(n, Ordering::Relaxed);
    }

    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Leaves its gauge however the request ends (a client gone included).
struct Held<'a>(&'a Gauge);

impl<'a> Held<'a> {
    fn new(g: &'a Gauge) -> Self {
        g.enter();
        Held(g)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Upstream {
    fn count(&self, path: &str, seq: u64) {
        let at = self.stats.started.elapsed().as_micros() as u64;
        self.stats.total.fetch_add(1, Ordering::Relaxed);
        {
            let mut names = self.stats.time_paths.lock();
            let i = match names.iter().position(|p| p == path) {
                Some(i) => Some(i),
                None if names.len() < 64 => {
                    names.push(path.to_string());
                    Some(names.len() - 1)
                }
                None => None,
            };
            let mut times = self.stats.times.lock();
            if let (Some(i), true) = (i, times.len() < MAX_TIMES) {
                times.push((i as u32, at, seq));
            }
        }
        let mut paths = self.stats.paths.lock();
        if let Some(n) = paths.get_mut(path) {
            *n += 1;
        } else if paths.len() < MAX_PATHS {
            paths.insert(path.to_string(), 1);
        } else {
            *paths.entry("(other)".to_string()).or_insert(0) += 1;
        }
    }

    /// How long this request waits for its slot, or `None` if the queue is
    /// already longer than `max_queue_ms` (the request will fail).
    fn reserve(&self) -> Option<Duration> {
        if self.args.capacity_rps <= 0.0 {
            return Some(Duration::ZERO);
        }
        let now = self.stats.started.elapsed().as_secs_f64() * 1e6;
        let interval = 1e6 / self.args.capacity_rps;
        let mut next = self.next_free_us.lock();
        let slot = next.max(now);
        let wait = slot - now;
        if wait > self.args.max_queue_ms as f64 * 1000.0 {
            return None;
        }
        *next = slot + interval;
        Some(Duration::from_micros(wait as u64))
    }

    fn stats_json(&self) -> String {
        let paths = self.stats.paths.lock().clone();
        serde_json::json!({
            "total": self.stats.total.load(Ordering::Relaxed),
            "ok": self.stats.ok.load(Ordering::Relaxed),
            "failed": self.stats.failed.load(Ordering::Relaxed),
            "paths": paths,
            "capacity_rps": self.args.capacity_rps,
            "workers": self.worker_count.load(Ordering::Relaxed),
            "service_ms": self.service_ms.load(Ordering::Relaxed),
            "in_flight": self.held.now.load(Ordering::Relaxed),
            "max_in_flight": self.held.max.load(Ordering::Relaxed),
            "waiting": self.waiting.now.load(Ordering::Relaxed),
            "max_waiting": self.waiting.max.load(Ordering::Relaxed),
            "uptime_secs": self.stats.started.elapsed().as_secs_f64(),
        })
        .to_string()
    }

    fn reset(&self) {
        self.stats.total.store(0, Ordering::Relaxed);
        self.stats.ok.store(0, Ordering::Relaxed);
        self.stats.failed.store(0, Ordering::Relaxed);
        self.stats.paths.lock().clear();
        self.stats.times.lock().clear();
        self.held
            .max
            .store(self.held.now.load(Ordering::Relaxed), Ordering::Relaxed);
        self.waiting
            .max
            .store(self.waiting.now.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Arrivals of `path` as (time, seq), in order of time.
    fn arrivals(&self, path: &str) -> Vec<(u64, u64)> {
        let Some(i) = self.stats.time_paths.lock().iter().position(|p| p == path) else {
            return Vec::new();
        };
        let mut t: Vec<(u64, u64)> = self
            .stats
            .times
            .lock()
            .iter()
            .filter(|(p, _, _)| *p as usize == i)
            .map(|&(_, t, seq)| (t, seq))
            .collect();
        t.sort_unstable();
        t
    }

    /// Arrival times of `path`, in order.
    fn times_json(&self, path: &str) -> String {
        let t: Vec<u64> = self.arrivals(path).into_iter().map(|(t, _)| t).collect();
        serde_json::to_string(&t).unwrap_or_default()
    }

    /// Arrivals of `path` as `[time, seq or null]`, in order of time.
    fn arrivals_json(&self, path: &str) -> String {
        let t: Vec<(u64, Option<u64>)> = self
            .arrivals(path)
            .into_iter()
            .map(|(t, seq)| (t, (seq != NO_SEQ).then_some(seq)))
            .collect();
        serde_json::to_string(&t).unwrap_or_default()
    }
}

fn respond(status: u16, body: String) -> Response<BoxBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(full(Bytes::new())))
}

async fn handle(
    up: Arc<Upstream>,
    req: Request<Incoming>,
) -> Result<Response<BoxBody>, Infallible> {
    let path = req.uri().path().to_string();
    match (req.method().as_str(), path.as_str()) {
        ("GET", "/healthz") => return Ok(respond(200, r#"{"ok":true}"#.into())),
        ("GET", "/stats") => return Ok(respond(200, up.stats_json())),
        ("GET", "/stats/times") => {
            let query = req.uri().query().unwrap_or("");
            let path = query.strip_prefix("path=").unwrap_or("");
            return Ok(respond(200, up.times_json(path)));
        }
        ("GET", "/stats/arrivals") => {
            let query = req.uri().query().unwrap_or("");
            let path = query.strip_prefix("path=").unwrap_or("");
            return Ok(respond(200, up.arrivals_json(path)));
        }
        ("GET", "/stats/llm") => return Ok(respond(200, up.llm.stats_json())),
        ("POST", "/stats/reset") => {
            up.reset();
            up.llm.reset();
            return Ok(respond(200, r#"{"reset":true}"#.into()));
        }
        ("POST", "/control") => {
            return Ok(control(&up, req.uri().query().unwrap_or("")));
        }
        _ => {}
    }
    if up.args.finish_abandoned {
        // The work runs on a task of its own: dropping this handler (the
        // client left) does not end it.
        let work = tokio::spawn(serve_one(up, req, path));
        return Ok(work.await.unwrap_or_else(|_| respond(500, "{}".into())));
    }
    Ok(serve_one(up, req, path).await)
}

/// `POST /control?service_ms=N&workers=M` (either or both): a service that
/// slows down, or a server that loses or gains workers while it runs.
fn control(up: &Arc<Upstream>, query: &str) -> Response<BoxBody> {
    let (mut service_ms, mut workers) = (None, None);
    let mut bad = query.is_empty();
    for pair in query.split('&') {
        let ok = match pair.split_once('=') {
            Some(("service_ms", v)) => v.parse::<u64>().map(|ms| service_ms = Some(ms)).is_ok(),
            Some(("workers", v)) => v.parse::<u64>().map(|n| workers = Some(n)).is_ok(),
            _ => false,
        };
        bad |= !ok || workers == Some(0);
    }
    if bad || (workers.is_some() && up.workers.is_none()) {
        return respond(
            400,
            r#"{"error":"expected ?service_ms=N and/or workers=M (M >= 1, only with --workers)"}"#
                .into(),
        );
    }
    if let Some(ms) = service_ms {
        up.service_ms.store(ms, Ordering::Relaxed);
    }
    if let (Some(n), Some(sem)) = (workers, &up.workers) {
        let was = up.worker_count.swap(n, Ordering::Relaxed);
        if n > was {
            sem.add_permits((n - was) as usize);
        } else if n < was {
            // Workers leave as they finish what they hold, as a drained
            // pod does: their permits are taken as they come free, and
            // never given back.
            let (up, gone) = (up.clone(), (was - n) as u32);
            tokio::spawn(async move {
                if let Some(sem) = &up.workers {
                    if let Ok(p) = sem.acquire_many(gone).await {
                        p.forget();
                    }
                }
            });
        }
    }
    respond(
        200,
        format!(
            r#"{{"service_ms":{},"workers":{}}}"#,
            up.service_ms.load(Ordering::Relaxed),
            up.worker_count.load(Ordering::Relaxed)
        ),
    )
}

/// One counted request: held, given a worker, served for its service time.
async fn serve_one(up: Arc<Upstream>, req: Request<Incoming>, path: String) -> Response<BoxBody> {
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    up.count(&path, header("x-mock-seq").parse().unwrap_or(NO_SEQ));
    let _held = Held::new(&up.held);
    let extra_ms: u64 = header("x-mock-delay-ms").parse().unwrap_or(0);
    let echo = serde_json::json!({
        "method": req.method().as_str(),
        "path": path,
        "query": req.uri().query().unwrap_or(""),
        "x_forwarded_for": header("x-forwarded-for"),
        "x_request_id": header("x-request-id"),
        "host": header("host"),
        // Every header as received, for a test of what the gateway sends on.
        "headers": req.headers().keys().map(|name| {
            let values: Vec<&str> = req.headers().get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
            (name.as_str().to_string(), serde_json::Value::from(values.join(", ")))
        }).collect::<serde_json::Map<_, _>>(),
    })
    .to_string();
    let llm = req.method() == hyper::Method::POST && path.ends_with("/chat/completions");
    let headers = req.headers().clone();
    // Read the whole body, as a real service would.
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();

    let service = Duration::from_millis(up.service_ms.load(Ordering::Relaxed) + extra_ms);
    let _worker = match &up.workers {
        Some(w) => {
            let _waiting = Held::new(&up.waiting);
            w.acquire().await.ok()
        }
        None => None,
    };
    match up.reserve() {
        Some(wait) => {
            if !(wait + service).is_zero() {
                tokio::time::sleep(wait + service).await;
            }
            up.stats.ok.fetch_add(1, Ordering::Relaxed);
            if llm {
                return up.llm.answer(up.stats.started, &headers, &body);
            }
            respond(200, echo)
        }
        None => {
            // Saturated: the caller waits the full queue time, then fails.
            tokio::time::sleep(Duration::from_millis(up.args.max_queue_ms) + service).await;
            up.stats.failed.fetch_add(1, Ordering::Relaxed);
            respond(503, r#"{"error":"overloaded"}"#.into())
        }
    }
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("mock-upstream: cannot start runtime: {e}");
            std::process::exit(1)
        });
    runtime.block_on(serve(args));
}

async fn serve(args: Args) {
    let listener = match TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("mock-upstream: cannot listen on {}: {e}", args.listen);
            std::process::exit(1);
        }
    };
    eprintln!(
        "mock-upstream listening on {} (capacity {} rps, max queue {} ms)",
        args.listen, args.capacity_rps, args.max_queue_ms
    );
    let up = Arc::new(Upstream {
        stats: Stats {
            started: Instant::now(),
            total: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            paths: Mutex::new(HashMap::new()),
            times: Mutex::new(Vec::new()),
            time_paths: Mutex::new(Vec::new()),
        },
        next_free_us: Mutex::new(0.0),
        service_ms: AtomicU64::new(args.service_ms),
        workers: (args.workers > 0).then(|| tokio::sync::Semaphore::new(args.workers)),
        worker_count: AtomicU64::new(args.workers as u64),
        held: Gauge::default(),
        waiting: Gauge::default(),
        llm: llm::Llm::default(),
        args,
    });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let up = up.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(up.clone(), req));
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}
