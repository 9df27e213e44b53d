//! Every response the gateway writes itself, built in one place: small JSON
//! (problem+json for limits) bodies that name what was wrong, never echoing a
//! secret or the raw request. To a gRPC request (`content-type:
//! application/grpc*`) the same refusal is a gRPC status a client library
//! understands: HTTP 200, a trailers-only response carrying `grpc-status` and
//! `grpc-message` (429 is RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms`).

use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::protocols::http::HttpTask;
use pingora::proxy::Session;
use pingora::Result;

use crate::admission::Refusal;

pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    pub headers: Vec<(&'static str, HeaderValue)>,
    /// One line saying what was wrong (`grpc-message` to a gRPC client).
    pub message: String,
    /// When to come back, for a gRPC client's `grpc-retry-pushback-ms`.
    pub retry_after_ms: Option<u64>,
}

pub fn json(status: u16, error: &str, message: &str) -> Reply {
    Reply {
        status,
        content_type: "application/json",
        body: serde_json::json!({ "error": error, "message": message }).to_string(),
        headers: Vec::new(),
        message: message.to_string(),
        retry_after_ms: None,
    }
}

/// The gRPC status for a refusal of this HTTP status.
fn grpc_status(http_status: u16) -> u8 {
    match http_status {
        400 => 3,             // INVALID_ARGUMENT
        401 => 16,            // UNAUTHENTICATED
        403 => 7,             // PERMISSION_DENIED
        404 | 405 => 12,      // UNIMPLEMENTED
        413 | 429 | 431 => 8, // RESOURCE_EXHAUSTED
        500 => 13,            // INTERNAL
        502 | 503 => 14,      // UNAVAILABLE
        504 => 4,             // DEADLINE_EXCEEDED
        _ => 2,               // UNKNOWN
    }
}

/// `grpc-message` is percent-encoded outside printable ASCII (and `%`).
fn grpc_message(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn is_grpc(session: &Session) -> bool {
    session
        .req_header()
        .headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

pub fn refusal(r: &Refusal) -> Reply {
    match r {
        Refusal::BadPath(e) => json(400, "bad_request", &e.to_string()),
        Refusal::Forbidden => json(403, "forbidden", "client address is denied"),
        Refusal::NotFound => json(404, "not_found", "no route matches this path"),
        Refusal::MethodNotAllowed(allowed) => {
            let mut reply = json(
                405,
                "method_not_allowed",
                "this route does not accept the method",
            );
            // Config validation admits only upper-case method tokens.
            if let Ok(v) = HeaderValue::try_from(allowed.join(", ")) {
                reply.headers.push(("allow", v));
            }
            reply
        }
        Refusal::UnknownKey => json(401, "unauthorized", "API key not recognised"),
        Refusal::KeyRequired => json(401, "unauthorized", "this route requires an API key"),
        Refusal::ConflictingKeys => {
            json(400, "bad_request", "more than one API key in the request")
        }
        Refusal::PayloadTooLarge(max) => payload_too_large(*max),
        Refusal::BadAttribute(a, e) => {
            let what = match a {
                crate::config::Attribute::Header(n) => format!("header {n}"),
                crate::config::Attribute::Query(n) => format!("query parameter {n}"),
                crate::config::Attribute::Claim(n) => format!("token's claim {n}"),
            };
            json(
                400,
                "bad_request",
                &format!("this route limits by the {what}, which {e}"),
            )
        }
        Refusal::Cors(e) => json(403, "cors_rejected", &e.to_string()),
        Refusal::InvalidToken(e) => invalid_token(e),
    }
}

/// A bearer JWT refused: 401 with the RFC 6750 challenge naming why (the
/// reason is the gateway's own words, never the token); 503 with
/// `Retry-After` when the issuer's keys cannot be had to check it.
fn invalid_token(e: &crate::identity::jwt::TokenError) -> Reply {
    let reason = e.to_string();
    if e.status() == 503 {
        let mut reply = json(503, "unavailable", &reason);
        reply
            .headers
            .push(("retry-after", HeaderValue::from_static("5")));
        reply.retry_after_ms = Some(5000);
        return reply;
    }
    let mut reply = json(401, "invalid_token", &reason);
    let challenge = format!(
        "Bearer error=\"invalid_token\", error_description=\"{}\"",
        reason.replace(['"', '\\'], "'")
    );
    if let Ok(v) = HeaderValue::try_from(challenge) {
        reply.headers.push(("www-authenticate", v));
    }
    reply
}

/// The answer to an allowed CORS preflight: 204 with its headers.
pub fn preflight(headers: crate::cors::Headers) -> Reply {
    Reply {
        status: 204,
        content_type: "text/plain",
        body: String::new(),
        headers,
        message: String::new(),
        retry_after_ms: None,
    }
}

/// An RFC 9457 problem+json answer the gateway writes itself: 429 (a
/// limit) or 503 (no capacity), with `fields` added to the standard ones.
fn problem(
    status: u16,
    detail: String,
    fields: serde_json::Value,
    headers: Vec<(&'static str, HeaderValue)>,
    retry_after_ms: u64,
) -> Reply {
    let (kind, title) = match status {
        429 => ("quota-exceeded", "Too Many Requests"),
        _ => ("temporary-reduced-capacity", "Service Unavailable"),
    };
    let type_uri = format!("https://iana.org/assignments/http-problem-types#{kind}");
    typed_problem(
        &type_uri,
        title,
        status,
        detail,
        fields,
        headers,
        retry_after_ms,
    )
}

/// A problem+json reply of a type of its own.
fn typed_problem(
    type_uri: &str,
    title: &str,
    status: u16,
    detail: String,
    fields: serde_json::Value,
    headers: Vec<(&'static str, HeaderValue)>,
    retry_after_ms: u64,
) -> Reply {
    let mut body = serde_json::json!({
        "type": type_uri,
        "title": title,
        "status": status,
        "detail": detail,
    });
    if let (Some(body), serde_json::Value::Object(fields)) = (body.as_object_mut(), fields) {
        body.extend(fields);
    }
    Reply {
        status,
        content_type: "application/problem+json",
        body: body.to_string(),
        headers,
        message: detail,
        retry_after_ms: Some(retry_after_ms),
    }
}

pub fn too_many_requests(
    headers: Vec<(&'static str, HeaderValue)>,
    retry_after_ms: u64,
    violated: &[&str],
) -> Reply {
    let detail = format!("rate limit exceeded on tier(s): {}", violated.join(", "));
    let fields = serde_json::json!({
        "violated-policies": violated,
        "retry_after_ms": retry_after_ms,
    });
    let mut reply = problem(429, detail, fields, headers, retry_after_ms);
    reply.message = format!("{}; retry after {retry_after_ms} ms", reply.message);
    reply
}

pub fn reduced_capacity() -> Reply {
    let detail = "the rate limiter is unavailable and this gateway is configured to deny";
    problem(
        503,
        detail.into(),
        serde_json::Value::Null,
        retry_after_secs(1),
        1000,
    )
}

/// A request the rate tiers admitted but an in-flight cap did not: 503,
/// never sent upstream. Retry-After: the queue's timeout (at least 1 s).
pub fn over_capacity(kind: &str, name: &str, shed: crate::inflight::Shed, wait_ms: u64) -> Reply {
    use crate::inflight::Shed;
    let why = match shed {
        Shed::QueueFull => "its queue is full",
        Shed::Timeout => "no slot came free within the queue timeout",
        Shed::Displaced => "a request of a higher-priority plan took its place in the queue",
    };
    let detail = format!("{kind} \"{name}\" has its requests in flight at its limit and {why}");
    let fields = serde_json::json!({ "reason": shed.as_str() });
    let secs = wait_ms.div_ceil(1000).max(1);
    problem(503, detail, fields, retry_after_secs(secs), secs * 1000)
}

/// The problem type of a client's requests in flight at its cap on a route.
pub const PER_CLIENT_PROBLEM: &str = "urn:ratelimit-gateway:problem:too-many-in-flight";

/// One client's requests in flight on a route at its cap: 429.
pub fn too_many_in_flight(route: &str, max: u32) -> Reply {
    let detail = format!(
        "this client has {max} request(s) in flight on route \"{route}\", its most (max_in_flight_per_client)"
    );
    let fields = serde_json::json!({ "violated-policies": ["in-flight-per-client"] });
    // Not a quota: the client may send again as soon as one of its
    // requests ends, so the problem type says which limit this is.
    typed_problem(
        PER_CLIENT_PROBLEM,
        "Too Many Requests In Flight",
        429,
        detail,
        fields,
        retry_after_secs(1),
        1000,
    )
}

fn retry_after_secs(secs: u64) -> Vec<(&'static str, HeaderValue)> {
    vec![("retry-after", HeaderValue::from(secs))]
}

pub fn headers_too_large(limit: usize) -> Reply {
    json(
        431,
        "request_header_fields_too_large",
        &format!("request headers exceed {limit} bytes"),
    )
}

pub fn too_many_headers(limit: usize) -> Reply {
    json(
        431,
        "request_header_fields_too_large",
        &format!("more than {limit} request header fields"),
    )
}

pub fn upstream_failure(status: u16) -> Reply {
    match status {
        504 => json(
            504,
            "gateway_timeout",
            "the upstream did not answer in time",
        ),
        _ => json(502, "bad_gateway", "the upstream could not be reached"),
    }
}

/// A request body over the route's `max_request_body_bytes`.
pub fn payload_too_large(max: u64) -> Reply {
    json(
        413,
        "payload_too_large",
        &format!("the request body is larger than this route takes ({max} bytes)"),
    )
}

/// A request on a `charge` route with no estimate to admit it on.
pub fn no_estimate(why: &str) -> Reply {
    json(
        400,
        "no_estimate",
        &format!("this route charges by the answer and needs an estimate first: {why}"),
    )
}

pub fn internal() -> Reply {
    json(500, "internal", "internal error")
}

/// Request bodies up to this size are read and dropped before a reply the
/// gateway writes itself, so the connection can serve the next request
/// (Pingora closes a connection answered before its request body was read).
const DRAIN_LIMIT: u64 = 64 * 1024;

/// Writes a reply; the connection stays open for the next request.
pub async fn send(session: &mut Session, reply: Reply, request_id: &str) -> Result<()> {
    if is_grpc(session) {
        return send_grpc(session, reply, request_id).await;
    }
    let small_body = session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .is_some_and(|n| n <= DRAIN_LIMIT);
    if small_body && !session.is_body_done() {
        // A client that announces a body and never sends it only loses its connection.
        let drained = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            session.drain_request_body(),
        )
        .await;
        if !matches!(drained, Ok(Ok(()))) {
            session.set_keepalive(None);
        }
    }
    let mut h = ResponseHeader::build(reply.status, Some(4 + reply.headers.len()))?;
    // A 204 has no body and says so by sending no length (RFC 9110 8.6).
    let no_body = reply.status == 204;
    if !no_body {
        h.insert_header("content-type", reply.content_type)?;
        h.insert_header("content-length", reply.body.len())?;
    }
    h.insert_header("x-request-id", request_id)?;
    for (name, value) in reply.headers {
        h.insert_header(name, value)?;
    }
    let head_only = no_body || session.req_header().method == http::Method::HEAD;
    session
        .write_response_header(Box::new(h), head_only)
        .await?;
    if !head_only {
        session
            .write_response_body(Some(Bytes::from(reply.body)), true)
            .await?;
    }
    Ok(())
}

/// A refusal as a gRPC trailers-only response: the status travels in the
/// headers of a response with no body (HTTP/2: one HEADERS frame that ends
/// the stream); the rate-limit headers and Retry-After are kept.
async fn send_grpc(session: &mut Session, reply: Reply, request_id: &str) -> Result<()> {
    let mut h = ResponseHeader::build(200, Some(6 + reply.headers.len()))?;
    h.insert_header("content-type", "application/grpc")?;
    h.insert_header("grpc-status", grpc_status(reply.status).to_string())?;
    h.insert_header("grpc-message", grpc_message(&reply.message))?;
    if let Some(ms) = reply.retry_after_ms {
        h.insert_header("grpc-retry-pushback-ms", ms.to_string())?;
    }
    h.insert_header("x-request-id", request_id)?;
    for (name, value) in reply.headers {
        h.insert_header(name, value)?;
    }
    if !session.is_http2() {
        h.insert_header("content-length", "0")?;
    }
    // As one task that ends the stream: Pingora's `write_response_header`
    // would send an empty DATA frame after it on HTTP/2, which gRPC clients
    // reject (the status must come in the frame that ends the stream).
    session
        .write_response_tasks(vec![HttpTask::Header(Box::new(h), true)])
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The statuses a gRPC client is told for the gateway's own refusals.
    #[test]
    fn refusals_map_to_grpc_statuses() {
        for (http, grpc) in [
            (429, 8),
            (401, 16),
            (403, 7),
            (503, 14),
            (404, 12),
            (405, 12),
            (400, 3),
            (413, 8),
            (431, 8),
            (502, 14),
            (504, 4),
            (500, 13),
            (418, 2),
        ] {
            assert_eq!(grpc_status(http), grpc, "HTTP {http}");
        }
        assert_eq!(
            grpc_message("retry after 5 ms: 100%"),
            "retry after 5 ms: 100%25"
        );
        assert_eq!(grpc_message("caf\u{e9}"), "caf%C3%A9");
    }
}
