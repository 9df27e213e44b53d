//! The admin listener: `/healthz` (alive), `/readyz` (config loaded and
//! listeners bound; ready in fallback too, saying which backend serves),
//! `/metrics` (Prometheus text).

use std::sync::Arc;

use async_trait::async_trait;
use http::Response;
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;

use crate::limiter::Fallback;
use crate::metrics;

pub struct Admin {
    pub limiter: Arc<Fallback>,
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let path = session.req_header().uri.path().to_string();
        let (status, ctype, body) = match path.as_str() {
            "/healthz" => (200, "text/plain", b"ok\n".to_vec()),
            "/readyz" => {
                let body = serde_json::json!({
                    "ready": true,
                    "backend": self.limiter.state().as_str(),
                });
                (200, "application/json", body.to_string().into_bytes())
            }
            "/metrics" => (
                200,
                "text/plain; version=0.0.4",
                metrics::render().into_bytes(),
            ),
            _ => (404, "text/plain", b"not found\n".to_vec()),
        };
        Response::builder()
            .status(status)
            .header("content-type", ctype)
            .header("content-length", body.len())
            .body(body)
            .unwrap_or_else(|_| Response::new(Vec::new()))
    }
}
