use bytes::Bytes;
use http::HeaderMap;

use super::*;
use crate::config::{Charge, CostSource, Estimate};

fn charge() -> Charge {
    Charge {
        response: vec![
            CostSource::Sse("usage.total_tokens".into()),
            CostSource::Json("usage.total_tokens".into()),
            CostSource::Header("x-usage-tokens".into()),
        ],
        estimate: Estimate::Json("max_tokens".into()),
        default_estimate: Some(1024),
        max: 32768,
        charge_failed: false,
        remaining_header: None,
    }
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    h
}

/// The answer's body in pieces of every size, then how it ended: what is
/// charged on an estimate of 100.
fn charged_for(content_type: &str, extra: &[(&str, &str)], body: &str, ended: Ended) -> (u64, Why) {
    let c = charge();
    let mut h = vec![("content-type", content_type)];
    h.extend_from_slice(extra);
    let mut out = None;
    for piece in [1, 7, body.len().max(1)] {
        let mut m = Meter::start(&c, &headers(&h));
        for chunk in body.as_bytes().chunks(piece) {
            m.body(&Bytes::copy_from_slice(chunk));
        }
        let got = charged(&c, 100, ended, m.reading(&c, ended));
        assert!(
            out.is_none_or(|o| o == got),
            "pieces of {piece}: {got:?} vs {out:?}"
        );
        out = Some(got);
    }
    out.unwrap()
}

const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";

#[test]
fn the_faults_table() {
    let ok = Ended::Whole(200);
    let usage =
        |n: &str| format!(r#"{{"id":"c1","usage":{{"prompt_tokens":1,"total_tokens":{n}}}}}"#);
    // Read, rounded up, capped.
    assert_eq!(charged_for(JSON, &[], &usage("42"), ok), (42, Why::Read));
    assert_eq!(charged_for(JSON, &[], &usage("41.2"), ok), (42, Why::Read));
    assert_eq!(
        charged_for(JSON, &[], &usage("40000"), ok),
        (32768, Why::Capped)
    );
    // No reading: the estimate, with why.
    assert_eq!(
        charged_for(JSON, &[], r#"{"id":"c1"}"#, ok),
        (100, Why::Missing)
    );
    assert_eq!(
        charged_for(JSON, &[], "<html>oops</html>", ok),
        (100, Why::NotJson)
    );
    assert_eq!(
        charged_for("text/plain", &[], "oops", ok),
        (100, Why::NotJson)
    );
    assert_eq!(
        charged_for(JSON, &[], &usage("\"42\""), ok),
        (100, Why::NotNumber)
    );
    assert_eq!(
        charged_for(JSON, &[], &usage("-3"), ok),
        (100, Why::Negative)
    );
    assert_eq!(
        charged_for(JSON, &[], &usage("1e30"), ok),
        (100, Why::OutOfRange)
    );
    // A JSON body cut short by a client that left: the estimate.
    let cut = &usage("42")[..20];
    assert_eq!(
        charged_for(JSON, &[], cut, Ended::ClientLeft),
        (100, Why::Cut)
    );
    // Failed by the upstream: refunded (charge_failed = false).
    assert_eq!(
        charged_for(JSON, &[], cut, Ended::UpstreamFailed),
        (0, Why::Failed)
    );
    assert_eq!(
        charged_for(JSON, &[], &usage("42"), Ended::Whole(503)),
        (0, Why::Failed)
    );
    // A 4xx answer with its usage is charged what it says.
    assert_eq!(
        charged_for(JSON, &[], &usage("7"), Ended::Whole(400)),
        (7, Why::Read)
    );
}

#[test]
fn streams_and_headers() {
    let ok = Ended::Whole(200);
    let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
                  data: {\"choices\":[],\"usage\":{\"total_tokens\":77}}\n\ndata: [DONE]\n\n";
    assert_eq!(charged_for(SSE, &[], stream, ok), (77, Why::Read));
    // Cut before the usage event: the estimate, as a cut.
    let cut = &stream[..60];
    assert_eq!(
        charged_for(SSE, &[], cut, Ended::ClientLeft),
        (100, Why::Cut)
    );
    assert_eq!(
        charged_for(SSE, &[], cut, Ended::UpstreamFailed),
        (0, Why::Failed)
    );
    // A stream that never says: missing; the header after it in the list.
    let quiet = "data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
    assert_eq!(charged_for(SSE, &[], quiet, ok), (100, Why::Missing));
    assert_eq!(
        charged_for(SSE, &[("x-usage-tokens", "12")], quiet, ok),
        (12, Why::Read)
    );
    // The body's reading comes first in the list, the header after.
    assert_eq!(
        charged_for(
            JSON,
            &[("x-usage-tokens", "12")],
            r#"{"usage":{"total_tokens":5}}"#,
            ok
        ),
        (5, Why::Read)
    );
    assert_eq!(
        charged_for(JSON, &[("x-usage-tokens", "lots")], "{}", ok),
        (100, Why::NotNumber)
    );
}

#[test]
fn failures_charged_where_the_route_says() {
    let mut c = charge();
    c.charge_failed = true;
    let m =
        Meter::start(&c, &headers(&[("content-type", JSON)])).reading(&c, Ended::UpstreamFailed);
    assert_eq!(
        charged(&c, 100, Ended::UpstreamFailed, m),
        (100, Why::Failed)
    );
}

#[test]
fn estimates() {
    let c = charge();
    assert_eq!(
        estimate(&c, Some(br#"{"model":"m","max_tokens":300}"#)),
        Ok(300)
    );
    assert_eq!(
        estimate(&c, Some(br#"{"max_tokens":99999}"#)),
        Ok(32768),
        "at most max"
    );
    assert_eq!(
        estimate(&c, Some(br#"{"model":"m"}"#)),
        Ok(1024),
        "the default"
    );
    assert_eq!(estimate(&c, None), Ok(1024));
    let mut strict = charge();
    strict.default_estimate = None;
    assert_eq!(
        estimate(&strict, Some(br#"{"model":"m"}"#)),
        Err("the request body has no `max_tokens`".into())
    );
    assert_eq!(
        estimate(&strict, Some(br#"{"max_tokens":"ten"}"#)),
        Err("`max_tokens` in the request body is not a count".into())
    );
    assert_eq!(
        estimate(&strict, Some(b"max_tokens=3")),
        Err("the request body is not JSON".into())
    );
    strict.estimate = Estimate::Fixed(50);
    assert_eq!(estimate(&strict, None), Ok(50));
}
