//! A token issuer of the tests' own: signing keys made with the `openssl`
//! CLI (RSA, P-256, Ed25519) or random (HMAC), tokens signed with
//! `jsonwebtoken`, and a JWKS endpoint on a loopback port whose set can be
//! rotated, whose fetches are counted, and which can be stopped (the port
//! refuses) and started again on the same port; over plain HTTP or TLS.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

use super::pki::openssl;

/// One signing key and its public JWK.
pub struct SigningKey {
    pub kid: String,
    pub alg: Algorithm,
    pub encoding: EncodingKey,
    pub jwk: Jwk,
    /// The public key as PEM (RSA, EC, Ed25519), for the confusion attack.
    pub public_pem: Option<Vec<u8>>,
}

impl SigningKey {
    /// A new key for `alg` (RS256, ES256, EdDSA or HS256) named `kid`.
    pub fn new(kid: &str, alg: Algorithm) -> SigningKey {
        if alg == Algorithm::HS256 {
            let secret: Vec<u8> = (0..32).map(|_| fastrand::u8(..)).collect();
            let encoding = EncodingKey::from_secret(&secret);
            let mut jwk = Jwk::from_encoding_key(&encoding, alg).expect("oct jwk");
            jwk.common.key_id = Some(kid.to_string());
            return SigningKey {
                kid: kid.into(),
                alg,
                encoding,
                jwk,
                public_pem: None,
            };
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let gen: &[&str] = match alg {
            Algorithm::RS256 => &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048"],
            Algorithm::ES256 => &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"],
            Algorithm::EdDSA => &["-algorithm", "ED25519"],
            other => panic!("no test key for {other:?}"),
        };
        let mut args = vec!["genpkey"];
        args.extend_from_slice(gen);
        args.extend_from_slice(&["-out", "key.pem"]);
        openssl(dir.path(), &args);
        openssl(
            dir.path(),
            &["pkey", "-in", "key.pem", "-pubout", "-out", "pub.pem"],
        );
        let private = std::fs::read(dir.path().join("key.pem")).expect("key.pem");
        let public = std::fs::read(dir.path().join("pub.pem")).expect("pub.pem");
        let encoding = match alg {
            Algorithm::RS256 => EncodingKey::from_rsa_pem(&private),
            Algorithm::ES256 => EncodingKey::from_ec_pem(&private),
            _ => EncodingKey::from_ed_pem(&private),
        }
        .expect("encoding key");
        let mut jwk = Jwk::from_encoding_key(&encoding, alg).expect("public jwk");
        jwk.common.key_id = Some(kid.to_string());
        SigningKey {
            kid: kid.into(),
            alg,
            encoding,
            jwk,
            public_pem: Some(public),
        }
    }

    /// A token with these claims, its header naming this key.
    pub fn sign(&self, claims: &Value) -> String {
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, claims, &self.encoding).expect("sign")
    }
}

/// Unix seconds now.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

/// Claims good for an hour from `iss` for `aud`, naming `sub`.
pub fn claims(iss: &str, aud: &str, sub: &str) -> Value {
    json!({ "iss": iss, "aud": aud, "sub": sub, "iat": now(), "exp": now() + 3600 })
}

/// A JWKS document of these keys.
pub fn jwks(keys: &[&SigningKey]) -> String {
    serde_json::to_string(&JwkSet {
        keys: keys.iter().map(|k| k.jwk.clone()).collect(),
    })
    .expect("jwks json")
}

/// A JWKS endpoint: `GET /jwks` answers the current set, over plain HTTP
/// or (`start_tls`) TLS.
pub struct JwksServer {
    pub addr: SocketAddr,
    body: Arc<Mutex<String>>,
    fetches: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    /// How long each answer waits before it is written.
    delay_ms: Arc<AtomicU64>,
    tls: Option<Arc<rustls::ServerConfig>>,
    thread: Option<JoinHandle<()>>,
}

/// Answers one request on `conn`.
fn answer(conn: impl Read + Write, body: &Mutex<String>, fetches: &AtomicUsize, delay_ms: u64) {
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    // The rest of the request head.
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(n) if n > 2 => continue,
            _ => break,
        }
    }
    let (status, text) = if line.starts_with("GET /jwks ") {
        fetches.fetch_add(1, Ordering::SeqCst);
        ("200 OK", body.lock().unwrap().clone())
    } else {
        ("404 Not Found", String::from("{}"))
    };
    std::thread::sleep(Duration::from_millis(delay_ms));
    let conn = reader.get_mut();
    let _ = write!(
        conn,
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = conn.flush();
}

impl JwksServer {
    pub fn start(body: String) -> JwksServer {
        Self::start_with(body, None)
    }

    /// Over TLS, with the certificate and key (PEM files) given.
    pub fn start_tls(body: String, cert: &std::path::Path, key: &std::path::Path) -> JwksServer {
        use rustls_pki_types::pem::PemObject;
        use rustls_pki_types::{CertificateDer, PrivateKeyDer};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .expect("cert")
            .collect::<Result<_, _>>()
            .expect("certs");
        let key = PrivateKeyDer::from_pem_file(key).expect("key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
        Self::start_with(body, Some(Arc::new(config)))
    }

    fn start_with(body: String, tls: Option<Arc<rustls::ServerConfig>>) -> JwksServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut s = JwksServer {
            addr,
            body: Arc::new(Mutex::new(body)),
            fetches: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            delay_ms: Arc::new(AtomicU64::new(0)),
            tls,
            thread: None,
        };
        s.serve(listener);
        s
    }

    fn serve(&mut self, listener: TcpListener) {
        listener.set_nonblocking(true).expect("nonblocking");
        let (body, fetches, stop) = (self.body.clone(), self.fetches.clone(), self.stop.clone());
        let (tls, delay) = (self.tls.clone(), self.delay_ms.clone());
        self.thread = Some(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let (conn, _) = match listener.accept() {
                    Ok(c) => c,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                let _ = conn.set_nonblocking(false);
                let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                let delay_ms = delay.load(Ordering::SeqCst);
                match &tls {
                    None => answer(conn, &body, &fetches, delay_ms),
                    Some(config) => {
                        let Ok(session) = rustls::ServerConnection::new(config.clone()) else {
                            continue;
                        };
                        let stream = rustls::StreamOwned::new(session, conn);
                        answer(stream, &body, &fetches, delay_ms);
                    }
                }
            }
            // The listener is dropped here: the port refuses from now on.
        }));
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}/jwks", self.addr)
    }

    pub fn set(&self, body: String) {
        *self.body.lock().unwrap() = body;
    }

    /// Each answer from now on waits `ms` before it is written.
    pub fn set_delay(&self, ms: u64) {
        self.delay_ms.store(ms, Ordering::SeqCst);
    }

    pub fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }

    /// Stops serving: connections to the port are refused.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Serves again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.stop.store(false, Ordering::SeqCst);
        let listener = TcpListener::bind(self.addr).expect("bind the same port again");
        self.serve(listener);
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.stop();
    }
}
