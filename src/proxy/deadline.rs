//! A whole-header deadline (slowloris): a connection whose next request
//! header is not complete within `server.header_read_timeout_ms` is closed.
//!
//! Pingora only times out each read, so a client trickling one byte at a time
//! would hold a connection forever. This wraps the proxy app: each request's
//! processing runs with a task-local flag that `early_request_filter` sets the
//! moment the header has been read; if the deadline passes first, the
//! connection is dropped. Once the header is in, the request runs unbounded
//! by this deadline (bodies and upstreams have their own timeouts).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;

use super::Gateway;

tokio::task_local! {
    static HEADER_READ: Arc<AtomicBool>;
}

/// Called when a request header is complete (from `early_request_filter`).
pub fn header_read() {
    let _ = HEADER_READ.try_with(|f| f.store(true, Ordering::Release));
}

pub struct HeaderDeadline {
    pub inner: Arc<HttpProxy<Gateway>>,
    pub deadline: Duration,
}

#[async_trait]
impl HttpServerApp for HeaderDeadline {
    async fn process_new_http(
        self: &Arc<Self>,
        session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        let flag = Arc::new(AtomicBool::new(false));
        let work = HEADER_READ.scope(flag.clone(), self.inner.process_new_http(session, shutdown));
        tokio::pin!(work);
        tokio::select! {
            reused = &mut work => return reused,
            _ = tokio::time::sleep(self.deadline) => {}
        }
        if flag.load(Ordering::Acquire) {
            work.await
        } else {
            tracing::debug!(
                deadline_ms = self.deadline.as_millis() as u64,
                "request header not complete in time; closing"
            );
            None
        }
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        self.inner.server_options()
    }

    async fn http_cleanup(&self) {
        self.inner.http_cleanup().await
    }

    async fn process_custom_session(
        self: Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        self.inner
            .clone()
            .process_custom_session(stream, shutdown)
            .await
    }
}
