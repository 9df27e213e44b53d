//! `POST …/chat/completions`: an LLM API's shape, for `charge` routes.
//!
//! The request body's `max_tokens` (default 256) bounds a random number of
//! tokens (`x-mock-tokens: N` fixes it); `"stream": true` answers in
//! server-sent events, one per content piece, then (unless
//! `stream_options.include_usage` is false) the usage event, then
//! `[DONE]`; otherwise one JSON body with `usage` at its end. Usage is
//! `{"prompt_tokens", "completion_tokens", "total_tokens"}`.
//!
//! Request headers shape the answer:
//! - `x-mock-fault`: `cut` (the body breaks off half-way), `no_usage`,
//!   `not_json` (an HTML page), `negative` (`total_tokens: -5`), `huge`
//!   (`1e30`), `status_500`, `header` (the usage only in an
//!   `x-usage-tokens` response header);
//! - `x-mock-pad-bytes: N`: N bytes of content before the usage, generated
//!   as they are sent (a 100 MB answer holds no 100 MB here);
//! - `x-mock-chunk-ms: N`: a pause before each piece;
//! - `x-mock-client: NAME`: whose tokens these are in `/stats/llm`.
//!
//! `GET /stats/llm` lists every usage it reported whole (not cut, not
//! garbage, not a 500): `[microseconds since start, tokens, client]`, and
//! their sum.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame};
use hyper::Response;
use parking_lot::Mutex;

use super::{boxed, full, BoxBody};

/// Reports kept (all clients together).
const MAX_REPORTS: usize = 1_000_000;

/// Padding is sent in pieces of this size.
const PAD_PIECE: usize = 64 * 1024;
static PAD: [u8; PAD_PIECE] = [b'x'; PAD_PIECE];

#[derive(Default)]
pub struct Llm {
    reports: Mutex<Vec<(u64, u64, u32)>>,
    clients: Mutex<Vec<String>>,
    total: AtomicU64,
    seed: AtomicU64,
}

impl Llm {
    pub fn stats_json(&self) -> String {
        let clients = self.clients.lock().clone();
        let reports: Vec<(u64, u64, &str)> = self
            .reports
            .lock()
            .iter()
            .map(|&(t, n, c)| (t, n, clients[c as usize].as_str()))
            .collect();
        serde_json::json!({
            "reported_total": self.total.load(Ordering::Relaxed),
            "reports": reports,
        })
        .to_string()
    }

    pub fn reset(&self) {
        self.reports.lock().clear();
        self.total.store(0, Ordering::Relaxed);
    }

    fn report(&self, started: Instant, tokens: u64, client: &str) {
        self.total.fetch_add(tokens, Ordering::Relaxed);
        let c = {
            let mut names = self.clients.lock();
            match names.iter().position(|n| n == client) {
                Some(i) => i,
                None => {
                    names.push(client.to_string());
                    names.len() - 1
                }
            }
        };
        let mut r = self.reports.lock();
        if r.len() < MAX_REPORTS {
            r.push((started.elapsed().as_micros() as u64, tokens, c as u32));
        }
    }

    /// A number in 1..=n (xorshift on a shared counter: no crate for it).
    fn random(&self, n: u64) -> u64 {
        let mut x = self
            .seed
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x2545_F491_4F6C_DD1D);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        1 + x % n.max(1)
    }

    /// The answer to one chat-completion request.
    pub fn answer(
        &self,
        started: Instant,
        headers: &hyper::HeaderMap,
        body: &[u8],
    ) -> Response<BoxBody> {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
        };
        let req: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        let max_tokens = req["max_tokens"].as_u64().unwrap_or(256);
        let stream = req["stream"].as_bool().unwrap_or(false);
        let include_usage = req["stream_options"]["include_usage"]
            .as_bool()
            .unwrap_or(true);
        let tokens = header("x-mock-tokens")
            .parse()
            .unwrap_or_else(|_| self.random(max_tokens));
        let fault = header("x-mock-fault");
        let pad: u64 = header("x-mock-pad-bytes").parse().unwrap_or(0);
        let pause = Duration::from_millis(header("x-mock-chunk-ms").parse().unwrap_or(0));
        let client = match header("x-mock-client") {
            "" => "-",
            c => c,
        };
        let total = match fault {
            "negative" => "-5".to_string(),
            "huge" => "1e30".to_string(),
            _ => tokens.to_string(),
        };
        let usage =
            format!(r#"{{"prompt_tokens":0,"completion_tokens":{total},"total_tokens":{total}}}"#);
        let with_usage = !matches!(fault, "no_usage" | "header" | "status_500" | "not_json")
            && (!stream || include_usage);
        if with_usage && !matches!(fault, "negative" | "huge" | "cut") {
            self.report(started, tokens, client);
        }
        if fault == "header" {
            self.report(started, tokens, client);
        }
        let mut pieces = VecDeque::new();
        let (status, content_type) = match fault {
            "status_500" => {
                pieces.push_back(Piece::Bytes(Bytes::from_static(
                    br#"{"error":{"message":"the model is overloaded"}}"#,
                )));
                (500, "application/json")
            }
            "not_json" => {
                pieces.push_back(Piece::Bytes(Bytes::from_static(
                    b"<html><body>upstream error</body></html>",
                )));
                (200, "text/html")
            }
            _ if stream => {
                let events = tokens.clamp(1, 20);
                for i in 0..events {
                    pieces.push_back(Piece::Bytes(Bytes::from(format!(
                        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}],\"usage\":null}}\n\n"
                    ))));
                }
                if pad > 0 {
                    pieces.push_back(Piece::Bytes(Bytes::from_static(
                        b"data: {\"choices\":[{\"delta\":{\"content\":\"",
                    )));
                    pieces.push_back(Piece::Pad(pad));
                    pieces.push_back(Piece::Bytes(Bytes::from_static(b"\"}}]}\n\n")));
                }
                if with_usage {
                    pieces.push_back(Piece::Bytes(Bytes::from(format!(
                        "data: {{\"choices\":[],\"usage\":{usage}}}\n\n"
                    ))));
                }
                pieces.push_back(Piece::Bytes(Bytes::from_static(b"data: [DONE]\n\n")));
                (200, "text/event-stream")
            }
            _ => {
                pieces.push_back(Piece::Bytes(Bytes::from_static(
                    br#"{"id":"chatcmpl-mock","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":""#,
                )));
                pieces.push_back(Piece::Pad(pad.max(1)));
                let tail = match with_usage {
                    true => format!(r#""}},"finish_reason":"stop"}}],"usage":{usage}}}"#),
                    false => r#""},"finish_reason":"stop"}]}"#.to_string(),
                };
                pieces.push_back(Piece::Bytes(Bytes::from(tail)));
                (200, "application/json")
            }
        };
        if fault == "cut" {
            // Half the pieces, then the connection breaks.
            let keep = pieces.len() / 2;
            pieces.truncate(keep.max(1));
            pieces.push_back(Piece::Cut);
        }
        let mut resp = Response::builder()
            .status(status)
            .header("content-type", content_type);
        if fault == "header" {
            resp = resp.header("x-usage-tokens", tokens.to_string());
        }
        let body = Generated {
            pieces,
            pause,
            sleep: None,
        };
        resp.body(boxed(body))
            .unwrap_or_else(|_| Response::new(full(Bytes::new())))
    }
}

enum Piece {
    Bytes(Bytes),
    /// This many bytes of `x`, sent a piece at a time.
    Pad(u64),
    /// The body breaks off here.
    Cut,
}

/// A body made as it is sent, with a pause before each piece.
struct Generated {
    pieces: VecDeque<Piece>,
    pause: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Body for Generated {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if !self.pause.is_zero() {
            let pause = self.pause;
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(pause)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        let Some(piece) = self.pieces.pop_front() else {
            return Poll::Ready(None);
        };
        Poll::Ready(Some(match piece {
            Piece::Bytes(b) => Ok(Frame::data(b)),
            Piece::Pad(left) => {
                let n = (left as usize).min(PAD_PIECE);
                if left as usize > n {
                    self.pieces.push_front(Piece::Pad(left - n as u64));
                }
                Ok(Frame::data(Bytes::from_static(&PAD[..n])))
            }
            Piece::Cut => Err(std::io::Error::other("cut mid-way (x-mock-fault: cut)")),
        }))
    }
}
