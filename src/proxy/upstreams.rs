//! Upstream pools: round-robin over each upstream's servers, with active
//! health checks where `health_check_path` is set. Pools are rebuilt when a
//! reload changes the upstreams; one background loop checks whichever pools
//! are current.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use pingora::lb::health_check::HttpHealthCheck;
use pingora::lb::selection::RoundRobin;
use pingora::lb::LoadBalancer;
use pingora::prelude::HttpPeer;
use pingora::protocols::ALPN;
use pingora::utils::tls::{parse_x509, WrappedX509};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use crate::config::{Upstream, UpstreamProtocol};

/// How to speak to one upstream's servers.
struct Transport {
    protocol: UpstreamProtocol,
    tls: bool,
    sni: Option<String>,
    /// Each server's host as configured (its SNI when `sni` is not set).
    hosts: HashMap<SocketAddr, String>,
    ca: Option<Arc<[WrappedX509]>>,
    verify: bool,
    /// Pingora pools connections by a peer's hash, which covers SNI and
    /// `verify` but not the CA: without this, a connection verified against
    /// one upstream's `ca_file` would serve another upstream that does not
    /// trust that CA. `trust_group` keeps each trust store's connections apart.
    group_key: u64,
    connect_timeout: Duration,
    read_timeout: Duration,
}

pub struct Pools {
    /// The upstreams these pools were built from (to tell whether a reload changed them).
    pub source: Vec<Upstream>,
    by_name: Vec<(String, Arc<LoadBalancer<RoundRobin>>, bool, Transport)>,
}

/// The certificates of a PEM CA file, as Pingora's connector takes them.
fn load_ca(u: &Upstream, path: &std::path::Path) -> Result<Arc<[WrappedX509]>, String> {
    let at = format!("upstreams \"{}\".ca_file", u.name);
    let pem =
        std::fs::read(path).map_err(|e| format!("{at}: cannot read {}: {e}", path.display()))?;
    let ders: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{at}: {} is not PEM ({e})", path.display()))?;
    if ders.is_empty() {
        return Err(format!("{at}: no certificate in {}", path.display()));
    }
    let mut out = Vec::with_capacity(ders.len());
    for der in ders {
        // Pingora's parser panics on what it cannot parse: check first.
        x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| {
            format!(
                "{at}: {} holds a certificate that does not parse ({e})",
                path.display()
            )
        })?;
        out.push(WrappedX509::new(der.as_ref().to_vec(), parse_x509));
    }
    Ok(out.into())
}

impl Transport {
    fn of(u: &Upstream) -> Result<Self, String> {
        let mut hosts = HashMap::new();
        for server in &u.servers {
            let host = server.rsplit_once(':').map_or(server.as_str(), |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if let Ok(addrs) = server.to_socket_addrs() {
                for a in addrs {
                    hosts.insert(a, host.to_string());
                }
            }
        }
        let ca = match (&u.ca_file, u.tls) {
            (Some(path), true) => Some(load_ca(u, path)?),
            _ => None,
        };
        Ok(Transport {
            protocol: u.protocol,
            tls: u.tls,
            sni: u.sni.clone(),
            hosts,
            group_key: trust_group(ca.as_deref(), u.verify),
            ca,
            verify: u.verify,
            connect_timeout: Duration::from_millis(u.connect_timeout_ms),
            read_timeout: Duration::from_millis(u.read_timeout_ms),
        })
    }

    fn peer(&self, addr: SocketAddr) -> HttpPeer {
        let sni = match (&self.sni, self.tls) {
            (Some(s), true) => s.clone(),
            (None, true) => self.hosts.get(&addr).cloned().unwrap_or_default(),
            (_, false) => String::new(),
        };
        let mut peer = HttpPeer::new(addr, self.tls, sni);
        let o = &mut peer.options;
        o.connection_timeout = Some(self.connect_timeout);
        o.read_timeout = Some(self.read_timeout);
        o.idle_timeout = Some(Duration::from_secs(60));
        o.alpn = match self.protocol {
            UpstreamProtocol::Http1 => ALPN::H1,
            UpstreamProtocol::H2 | UpstreamProtocol::H2c => ALPN::H2,
        };
        o.verify_cert = self.verify;
        o.verify_hostname = self.verify;
        o.ca = self.ca.clone();
        peer.group_key = self.group_key;
        peer
    }
}

/// What decides whether a server is trusted, as a pool key: the CA
/// certificates (none: the system roots) and whether they are checked at
/// all. Upstreams that trust the same CAs may share connections; others
/// never do. SHA-256, not a seeded hash, so it is the same across reloads.
fn trust_group(ca: Option<&[WrappedX509]>, verify: bool) -> u64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update([u8::from(verify)]);
    match ca {
        None => h.update(b"system roots"),
        Some(certs) => {
            for c in certs {
                let der = c.borrow_raw_cert();
                h.update((der.len() as u64).to_be_bytes());
                h.update(der);
            }
        }
    }
    let digest: [u8; 32] = h.finalize().into();
    u64::from_be_bytes(digest[..8].try_into().expect("8 of 32 bytes"))
}

impl Pools {
    /// Builds every pool, resolving host names once.
    pub fn build(upstreams: &[Upstream]) -> Result<Self, String> {
        let mut by_name = Vec::new();
        for u in upstreams {
            let mut lb =
                LoadBalancer::<RoundRobin>::try_from_iter(u.servers.iter().map(String::as_str))
                    .map_err(|e| {
                        format!("upstreams \"{}\": cannot resolve its servers: {e}", u.name)
                    })?;
            let transport = Transport::of(u)?;
            let checked = match &u.health_check_path {
                Some(path) => {
                    let host = u
                        .sni
                        .clone()
                        .or_else(|| transport.hosts.values().next().cloned());
                    let mut hc =
                        HttpHealthCheck::new(host.as_deref().unwrap_or("localhost"), u.tls);
                    if u.tls {
                        hc.peer_template.options.verify_cert = u.verify;
                        hc.peer_template.options.verify_hostname = u.verify;
                        hc.peer_template.options.ca = transport.ca.clone();
                        hc.peer_template.group_key = transport.group_key;
                    }
                    let uri = path
                        .parse()
                        .map_err(|e| format!("upstreams \"{}\".health_check_path: {e}", u.name))?;
                    hc.req.set_uri(uri);
                    hc.peer_template.options.connection_timeout =
                        Some(Duration::from_millis(u.connect_timeout_ms));
                    hc.peer_template.options.read_timeout = Some(Duration::from_secs(1));
                    lb.set_health_check(Box::new(hc));
                    true
                }
                None => false,
            };
            by_name.push((u.name.clone(), Arc::new(lb), checked, transport));
        }
        Ok(Pools {
            source: upstreams.to_vec(),
            by_name,
        })
    }

    /// The next healthy server of a pool, round-robin, skipping those that
    /// already failed this request while another remains, as a peer to
    /// connect to with the upstream's protocol, TLS and timeouts.
    pub fn select(&self, upstream: &str, failed: &[SocketAddr]) -> Option<HttpPeer> {
        let (_, lb, _, transport) = self.by_name.iter().find(|(n, ..)| n == upstream)?;
        let mut fallback = None;
        for _ in 0..transport.hosts.len().max(1) {
            let addr = *lb.select(b"", 256)?.addr.as_inet()?;
            if !failed.contains(&addr) {
                return Some(transport.peer(addr));
            }
            fallback.get_or_insert(addr);
        }
        fallback.map(|a| transport.peer(a))
    }

    /// One round of health checks over every checked pool.
    pub async fn check_health(&self) {
        for (_, lb, checked, _) in &self.by_name {
            if *checked {
                lb.backends().run_health_check(true).await;
            }
        }
    }
}
