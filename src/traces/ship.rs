//! Spans leave the request path here: `on_end` puts a finished span in a
//! bounded queue (full: it is dropped and counted, never waited for), and
//! a thread of its own sends them to the collector in batches with the
//! OTLP exporter. A collector that is down or slow costs the request path
//! nothing: its batches fail (counted) and the queue drops what overflows.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter as _, SpanProcessor};
use opentelemetry_sdk::Resource;

use crate::metrics;

/// Spans waiting for the exporter; past it a finished span is dropped.
pub const QUEUE: usize = 4096;
/// Spans per export call.
const BATCH: usize = 512;
/// A batch not full is sent this long after its first span at the latest.
const EVERY: Duration = Duration::from_millis(500);
/// One export call's budget: a collector that does not answer within it
/// fails the batch.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);

enum Msg {
    Span(Box<SpanData>),
    /// Send everything queued, then say so.
    Flush(mpsc::Sender<()>),
}

#[derive(Debug, Clone)]
pub struct Shipper {
    tx: SyncSender<Msg>,
}

impl Shipper {
    /// Starts the exporting thread for `traces_url`.
    pub fn start(traces_url: &str, resource: Resource) -> Result<Shipper, String> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let url = traces_url.to_string();
        // Built on the thread, inside the runtime its HTTP client runs on;
        // a build error comes back before the gateway starts.
        let (built, ready) = mpsc::channel();
        std::thread::Builder::new()
            .name("trace-export".into())
            .spawn(move || export_loop(&url, resource, rx, built))
            .map_err(|e| format!("tracing: cannot start the export thread: {e}"))?;
        match ready.recv() {
            Ok(Ok(())) => Ok(Shipper { tx }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("tracing: the export thread ended at start".into()),
        }
    }

    /// Sends what is queued now, waiting at most `within`.
    pub fn flush(&self, within: Duration) -> bool {
        let (ack, done) = mpsc::channel();
        if self.tx.send(Msg::Flush(ack)).is_err() {
            return false;
        }
        done.recv_timeout(within).is_ok()
    }
}

impl SpanProcessor for Shipper {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        match self.tx.try_send(Msg::Span(Box::new(span))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => metrics::trace_spans(Some("queue_full"), 1),
            Err(TrySendError::Disconnected(_)) => metrics::trace_spans(Some("stopped"), 1),
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        match self.flush(EXPORT_TIMEOUT * 2) {
            true => Ok(()),
            false => Err(OTelSdkError::Timeout(EXPORT_TIMEOUT * 2)),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        match self.flush(timeout) {
            true => Ok(()),
            false => Err(OTelSdkError::Timeout(timeout)),
        }
    }
}

fn export_loop(
    url: &str,
    resource: Resource,
    rx: Receiver<Msg>,
    built: mpsc::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = built.send(Err(format!("tracing: no runtime for the exporter: {e}")));
            return;
        }
    };
    let exporter = {
        let _entered = rt.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .with_timeout(EXPORT_TIMEOUT)
            .build()
    };
    let mut exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            let _ = built.send(Err(format!("tracing: otlp_endpoint {url}: {e}")));
            return;
        }
    };
    exporter.set_resource(&resource);
    let _ = built.send(Ok(()));
    let mut batch: Vec<SpanData> = Vec::with_capacity(BATCH);
    let send = |batch: &mut Vec<SpanData>| {
        if batch.is_empty() {
            return;
        }
        let spans = std::mem::replace(batch, Vec::with_capacity(BATCH));
        let n = spans.len() as u64;
        match rt.block_on(exporter.export(spans)) {
            Ok(()) => metrics::trace_spans(None, n),
            Err(e) => {
                metrics::trace_spans(Some("export_failed"), n);
                tracing::debug!(error = %e, spans = n, "tracing: a batch of spans was not exported");
            }
        }
    };
    // When the batch's first span came: it goes `EVERY` after that at the
    // latest, however steadily spans keep arriving.
    let mut first: Option<Instant> = None;
    loop {
        let wait = first.map_or(EVERY, |f| EVERY.saturating_sub(f.elapsed()));
        match rx.recv_timeout(wait) {
            Ok(Msg::Span(s)) => {
                batch.push(*s);
                first.get_or_insert_with(Instant::now);
            }
            Ok(Msg::Flush(ack)) => {
                while let Ok(m) = rx.try_recv() {
                    match m {
                        Msg::Span(s) => batch.push(*s),
                        Msg::Flush(other) => drop(other.send(())),
                    }
                }
                send(&mut batch);
                first = None;
                let _ = ack.send(());
                continue;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                send(&mut batch);
                return;
            }
        }
        if batch.len() >= BATCH || first.is_some_and(|f| f.elapsed() >= EVERY) {
            send(&mut batch);
            first = None;
        }
    }
}
