//! The process's log: `tracing` to stderr (text, or JSON with
//! `GATEWAY_LOG_FORMAT=json`, filtered by `GATEWAY_LOG`), with Pingora's own
//! `log` records passed through it.
//!
//! Some of Pingora's ERROR records are not an operator's error, and in a
//! surge or under a scanner they bury the ones that are:
//! - a client's failed or abandoned handshake (a TLS scanner makes hundreds;
//!   nothing on our side failed): counted in
//!   `gateway_downstream_handshake_failures_total{reason}`;
//! - "failed to acquire reusable stream": a pooled upstream connection was
//!   still held by the pool's idle watcher, so a new one was opened (a race
//!   with no effect on the request): counted in
//!   `gateway_upstream_pool_reuse_races_total`.
//!
//! Those are lowered to DEBUG (`GATEWAY_LOG=debug` still shows each), and
//! everything else passes as it is.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use log::{Level, Log, Metadata, Record};
use tracing_log::LogTracer;
use tracing_subscriber::EnvFilter;

use crate::metrics;

/// Installs the subscriber and the `log` bridge. Call once, before serving.
pub fn init() {
    // rustls warns per connection about what clients send (an IP address
    // as SNI, say): the client's business, not the operator's.
    let filter = EnvFilter::try_from_env("GATEWAY_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info,rustls=error"));
    let json = std::env::var("GATEWAY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let installed = if json {
        tracing::subscriber::set_global_default(builder.json().finish())
    } else {
        tracing::subscriber::set_global_default(builder.finish())
    };
    if installed.is_err() {
        return; // one already (a test harness): keep it
    }
    if log::set_boxed_logger(Box::new(Relevel(LogTracer::new()))).is_ok() {
        // As the filter allows: Pingora's hot-path debug! records then cost
        // one comparison at the default level.
        use tracing_log::AsLog;
        log::set_max_level(tracing::level_filters::LevelFilter::current().as_log());
    }
}

/// Pingora's `log` records into `tracing`, the noise lowered (module doc).
struct Relevel(LogTracer);

impl Log for Relevel {
    fn enabled(&self, metadata: &Metadata) -> bool {
        self.0.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if record.level() == Level::Error && record.target().starts_with("pingora") {
            // Only Pingora's ERROR records are formatted here: rare unless
            // they are the noise.
            let text = record.args().to_string();
            if let Some(noise) = classify(&text) {
                match noise {
                    Noise::Handshake(reason) => metrics::downstream_handshake_failure(reason),
                    Noise::PoolRace => metrics::upstream_pool_reuse_race(),
                }
                self.0.log(
                    &Record::builder()
                        .args(*record.args())
                        .level(Level::Debug)
                        .target(record.target())
                        .module_path(record.module_path())
                        .file(record.file())
                        .line(record.line())
                        .build(),
                );
                return;
            }
        }
        self.0.log(record)
    }

    fn flush(&self) {
        self.0.flush()
    }
}

#[derive(Debug, PartialEq)]
enum Noise {
    Handshake(&'static str),
    PoolRace,
}

/// Which of Pingora's ERROR messages is noise, and why the handshake
/// failed (a closed set of labels).
fn classify(text: &str) -> Option<Noise> {
    if text.starts_with("failed to acquire reusable stream") {
        return Some(Noise::PoolRace);
    }
    if text.starts_with("Downstream handshake timeout") {
        return Some(Noise::Handshake("timeout"));
    }
    if !(text.starts_with("Downstream handshake error") || text.starts_with("H2 handshake error")) {
        return None;
    }
    let t = text.to_ascii_lowercase();
    let reason = if t.contains("alert") {
        // The client refused us (an unknown CA, a protocol it will not speak).
        "client_alert"
    } else if t.contains("eof")
        || t.contains("reset")
        || t.contains("closed")
        || t.contains("broken pipe")
    {
        "closed"
    } else if t.contains("timed out") || t.contains("timeout") {
        "timeout"
    } else if t.contains("incompatible")
        || t.contains("corrupt")
        || t.contains("invalid")
        || t.contains("unexpected message")
        || t.contains("peer misbehaved")
    {
        // Not a TLS client we can talk to: plaintext on the TLS port, an
        // old protocol version, no cipher suite in common.
        "protocol"
    } else if text.starts_with("H2 handshake error") {
        "h2"
    } else {
        "other"
    };
    Some(Noise::Handshake(reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pingoras_noise_is_told_from_errors() {
        let cases = [
            (
                "Downstream handshake error from 127.0.0.1:40112:  TLSHandshakeFailure context: TLS accept() failed: received fatal alert: UnknownCA",
                Some(Noise::Handshake("client_alert")),
            ),
            (
                "Downstream handshake error from 127.0.0.1:40113:  TLSHandshakeFailure context: TLS accept() failed: peer is incompatible: NoCipherSuitesInCommon",
                Some(Noise::Handshake("protocol")),
            ),
            (
                "Downstream handshake error from 127.0.0.1:40114:  TLSHandshakeFailure context: TLS accept() failed: received corrupt message of type InvalidContentType",
                Some(Noise::Handshake("protocol")),
            ),
            (
                "Downstream handshake error from 127.0.0.1:40115:  TLSHandshakeFailure context: TLS accept() failed: tls handshake eof",
                Some(Noise::Handshake("closed")),
            ),
            (
                "Downstream handshake error: Connection reset by peer (os error 104)",
                Some(Noise::Handshake("closed")),
            ),
            ("Downstream handshake timeout", Some(Noise::Handshake("timeout"))),
            ("failed to acquire reusable stream", Some(Noise::PoolRace)),
            ("Accept() failed Too many open files (os error 24)", None),
            ("Fail to proxy: Upstream ConnectRefused", None),
        ];
        for (text, want) in cases {
            assert_eq!(classify(text), want, "{text}");
        }
    }
}

/// Whether the gateway's own answer of `status` is a refusal line, which
/// `Sampler` keeps to a number a second: a 401 (a bad token or API key),
/// a 429 and a 503 are what a flood is answered, so what a flood would
/// write a line for each of. A lone one is still written.
pub fn sampled(status: u16) -> bool {
    matches!(status, 401 | 429 | 503)
}

/// Keeps the access log's refusal lines (the gateway's own 401s, 429s and
/// 503s: `sampled`) to at most a number a second, so a flood of refusals
/// cannot flood the log: the rest are counted (`gateway_access_log_left_out_total`), and the
/// next line written says how many were left out before it. The metrics
/// count every request; the log explains examples.
pub struct Sampler {
    second: AtomicU64,
    written: AtomicU32,
    left_out: AtomicU64,
}

impl Sampler {
    pub const fn new() -> Self {
        Sampler {
            second: AtomicU64::new(0),
            written: AtomicU32::new(0),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether this refusal's line is written (`Some`: with how many were
    /// left out since the last one written) at `now_sec`, under `per_sec`.
    pub fn take(&self, per_sec: u32, now_sec: u64) -> Option<u64> {
        let second = self.second.load(Ordering::Relaxed);
        if second != now_sec
            && self
                .second
                .compare_exchange(second, now_sec, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.written.store(0, Ordering::Relaxed);
        }
        if self.written.fetch_add(1, Ordering::Relaxed) < per_sec {
            return Some(self.left_out.swap(0, Ordering::Relaxed));
        }
        self.left_out.fetch_add(1, Ordering::Relaxed);
        metrics::access_line_left_out();
        None
    }
}

impl Default for Sampler {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod sampler_tests {
    use super::Sampler;

    #[test]
    fn refusal_lines_are_capped_per_second_and_the_rest_counted() {
        let s = Sampler::new();
        let written: Vec<Option<u64>> = (0..5).map(|_| s.take(2, 100)).collect();
        assert_eq!(written, [Some(0), Some(0), None, None, None]);
        // The next second's first line says three were left out.
        assert_eq!(s.take(2, 101), Some(3));
        assert_eq!(s.take(2, 101), Some(0));
        assert_eq!(s.take(2, 101), None);
        // None a second: every refusal counted, none written.
        assert_eq!(s.take(0, 102), None);
    }
}
