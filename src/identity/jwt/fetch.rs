//! One GET of a JWKS document over HTTP/1.1, plain or TLS. A fetch is rare
//! (minutes apart, or a new `kid`), so it opens a connection of its own and
//! closes it: no pool to keep healthy. The body is capped, and the caller
//! bounds the whole exchange with the issuer's `jwks_timeout_ms`.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// The largest JWKS document read: a set of a few keys is a few KB.
pub const MAX_BYTES: usize = 1 << 20;

pub use crate::config::HttpUrl as Target;

/// What verifies an `https` endpoint: the system's roots and `ca_file`'s.
pub fn tls_connector(ca_file: Option<&Path>) -> Result<TlsConnector, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A root the system holds but rustls cannot parse is skipped.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!("{}: no PEM certificate", path.display()));
        }
        for c in certs {
            roots
                .add(c)
                .map_err(|e| format!("{}: {e}", path.display()))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// The body of a 200 answer to `GET target`; anything else is an error
/// saying what came back.
pub async fn get(target: &Target, tls: Option<&TlsConnector>) -> Result<Vec<u8>, String> {
    let tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    if !target.https {
        return exchange(TokioIo::new(tcp), target).await;
    }
    let tls = tls.ok_or("no TLS settings for an https endpoint")?;
    let name = ServerName::try_from(target.host.clone()).map_err(|e| format!("{e}"))?;
    let stream = tls
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    exchange(TokioIo::new(stream), target).await
}

async fn exchange<S>(io: TokioIo<S>, target: &Target) -> Result<Vec<u8>, String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("HTTP: {e}"))?;
    // The connection is driven beside the request and ends with it.
    let conn = tokio::spawn(conn);
    let req = http::Request::get(&target.path)
        .header(http::header::HOST, &target.authority)
        .header(
            http::header::ACCEPT,
            "application/json, application/jwk-set+json",
        )
        .header(http::header::USER_AGENT, "ratelimit-gateway")
        .header(http::header::CONNECTION, "close")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let result = async {
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| format!("HTTP: {e}"))?;
        if resp.status() != http::StatusCode::OK {
            return Err(format!("answered {}", resp.status()));
        }
        let body = Limited::new(resp.into_body(), MAX_BYTES)
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?;
        Ok(body.to_bytes().to_vec())
    }
    .await;
    conn.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets() {
        let t = Target::parse("https://auth.example.com/.well-known/jwks.json").unwrap();
        assert!(t.https);
        assert_eq!((t.host.as_str(), t.port), ("auth.example.com", 443));
        assert_eq!(t.path, "/.well-known/jwks.json");
        let t = Target::parse("http://127.0.0.1:9000").unwrap();
        assert_eq!(
            (t.port, t.path.as_str(), t.authority.as_str()),
            (9000, "/", "127.0.0.1:9000")
        );
        let t = Target::parse("http://[::1]:9000/k").unwrap();
        assert_eq!(t.host, "::1");
        assert!(Target::parse("ftp://x/").is_err());
        assert!(Target::parse("/jwks.json").is_err());
        assert!(Target::parse("https://user:pw@x/").is_err());
    }
}
