//! What reading an answer's cost (`ratelimit_gateway::metering`) takes per
//! answer, beside copying the same bytes, in one run: the mock LLM
//! upstream's streamed answer (20 events and the usage, one chunk each, as
//! the charge bench's SSE target gets them) and its JSON answer. Compare
//! rows within one run: `cargo bench --bench metering`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use ratelimit_gateway::config::JsonPath;
use ratelimit_gateway::metering::json_scan::JsonScan;
use ratelimit_gateway::metering::sse::SseScan;

fn sse_chunks() -> Vec<Vec<u8>> {
    let mut chunks: Vec<Vec<u8>> = (0..20)
        .map(|i| {
            format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}],\"usage\":null}}\n\n"
            )
            .into_bytes()
        })
        .collect();
    chunks.push(
        br#"data: {"choices":[],"usage":{"prompt_tokens":0,"completion_tokens":20,"total_tokens":20}}

"#
        .to_vec(),
    );
    chunks.push(b"data: [DONE]\n\n".to_vec());
    chunks
}

fn json_body() -> Vec<u8> {
    let mut b = br#"{"id":"chatcmpl-mock","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":""#.to_vec();
    b.extend(std::iter::repeat_n(b'x', 200));
    b.extend_from_slice(br#""},"finish_reason":"stop"}],"usage":{"prompt_tokens":0,"completion_tokens":20,"total_tokens":20}}"#);
    b
}

fn bench(c: &mut Criterion) {
    let path = JsonPath::from("usage.total_tokens");
    let chunks = sse_chunks();
    let mut g = c.benchmark_group("metering");
    g.bench_function("sse: copy the chunks (baseline)", |b| {
        b.iter(|| {
            let mut n = 0;
            for ch in &chunks {
                n += black_box(ch.clone()).len();
            }
            n
        })
    });
    g.bench_function("sse: scan the chunks", |b| {
        b.iter(|| {
            let mut s = SseScan::new(&path);
            for ch in &chunks {
                s.feed(black_box(ch));
            }
            s.found()
        })
    });
    let body = json_body();
    g.bench_function("json: scan the body", |b| {
        b.iter(|| {
            let mut s = JsonScan::new(&path);
            s.feed(black_box(&body));
            s.finish();
            s.found()
        })
    });
    // A request's estimate, read before its first byte goes on: the charge
    // bench's request body.
    let estimate = JsonPath::from("max_tokens");
    let request = br#"{"model":"mock","max_tokens":256,"stream":false}"#;
    g.bench_function("estimate: scan the request body", |b| {
        b.iter(|| {
            let mut s = JsonScan::new(&estimate);
            s.feed(black_box(request));
            s.finish();
            s.found()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
