//! A real OTLP/HTTP receiver: `POST /v1/traces` bodies decoded with the
//! protocol's own messages (`opentelemetry-proto`), the spans kept for the
//! test to read. `stop` closes the port (a collector that is down).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

/// One span as the receiver got it (ids in lowercase hex).
#[derive(Debug, Clone)]
pub struct Seen {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    /// 2: server, 3: client (the protocol's SpanKind).
    pub kind: i32,
    pub attributes: HashMap<String, String>,
    pub start_ns: u64,
    pub end_ns: u64,
    /// 0: unset, 1: ok, 2: error.
    pub status: i32,
}

impl Seen {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

pub struct Receiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn text(kv: &[KeyValue]) -> HashMap<String, String> {
    kv.iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn serve_one(conn: std::net::TcpStream, spans: &Mutex<Vec<Seen>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(n) if n > 2 => {
                if let Some((name, value)) = h.split_once(':') {
                    if name.eq_ignore_ascii_case("content-length") {
                        length = value.trim().parse().unwrap_or(0);
                    }
                }
            }
            _ => break,
        }
    }
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let status = match (
        line.starts_with("POST /v1/traces "),
        ExportTraceServiceRequest::decode(&body[..]),
    ) {
        (true, Ok(req)) => {
            let mut out = spans.lock().unwrap();
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .map(|r| text(&r.attributes))
                    .and_then(|a| a.get("service.name").cloned())
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for s in ss.spans {
                        out.push(Seen {
                            service: service.clone(),
                            trace_id: hex::encode(&s.trace_id),
                            span_id: hex::encode(&s.span_id),
                            parent_span_id: hex::encode(&s.parent_span_id),
                            name: s.name,
                            kind: s.kind,
                            attributes: text(&s.attributes),
                            start_ns: s.start_time_unix_nano,
                            end_ns: s.end_time_unix_nano,
                            status: s.status.map_or(0, |st| st.code),
                        });
                    }
                }
            }
            "200 OK"
        }
        _ => "400 Bad Request",
    };
    let conn = reader.get_mut();
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    let _ = conn.flush();
}

impl Receiver {
    pub fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        listener.set_nonblocking(true).expect("nonblocking");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (spans.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let _ = conn.set_nonblocking(false);
                        serve_one(conn, &s);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Receiver {
            addr,
            spans,
            stop,
            thread: Some(thread),
        }
    }

    /// The base URL a gateway's `otlp_endpoint` names.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Seen> {
        self.spans.lock().unwrap().clone()
    }

    /// Stops serving: the port refuses connections from now on.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}
