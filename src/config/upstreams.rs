//! `[[upstreams]]`: a pool of servers, how to speak to them (protocol, TLS,
//! SNI, CA, verification), health checks and timeouts.

use std::ops::Range;

use toml::de::DeTable;

use super::model::{Spelled, Upstream, UpstreamProtocol};
use super::reader::{host_port, name, non_empty, opt, req};
use super::reader::{join, Reader};

pub const UPSTREAM_KEYS: &[&str] = &[
    "name",
    "servers",
    "health_check_path",
    "connect_timeout_ms",
    "read_timeout_ms",
    "protocol",
    "tls",
    "sni",
    "ca_file",
    "verify",
    "max_in_flight",
    "queue",
    "queue_timeout_ms",
    "pool_max_in_flight",
    "adaptive",
];

pub(super) fn read(
    r: &mut Reader<'_>,
    p: &str,
    t: &DeTable<'_>,
    span: &Range<usize>,
) -> Option<Upstream> {
    r.only_keys(p, t, UPSTREAM_KEYS);
    let in_flight = super::inflight::read(r, p, t, true);
    let uname = req(r, t, p, Some(span), "name", name);
    let servers = req(r, t, p, Some(span), "servers", |r, path, v| {
        non_empty(r, path, v, "server", host_port)
    });
    let hc = opt(r, t, p, "health_check_path", None, |r, path, v| {
        let s = r.string(path, v)?;
        if s.starts_with('/') {
            Some(Some(s))
        } else {
            r.error(
                path,
                Some(&v.span()),
                format!("expected a path starting with '/', found \"{s}\""),
            );
            None
        }
    });
    let connect = opt(r, t, p, "connect_timeout_ms", 1000, |r, path, v| {
        r.int(path, v, 1, 600_000)
    });
    let read = opt(r, t, p, "read_timeout_ms", 30_000, |r, path, v| {
        r.int(path, v, 1, 3_600_000)
    });
    let protocol = opt(
        r,
        t,
        p,
        "protocol",
        UpstreamProtocol::Http1,
        |r, path, v| r.choice(path, v, UpstreamProtocol::SPELLINGS),
    );
    let tls = opt(r, t, p, "tls", false, |r, path, v| r.boolean(path, v));
    let sni = opt(r, t, p, "sni", None, |r, path, v| {
        let s = r.string(path, v)?;
        if s.is_empty() || s.contains(|c: char| c.is_whitespace() || c == '/') {
            r.error(
                path,
                Some(&v.span()),
                format!("expected a host name, found \"{s}\""),
            );
            return None;
        }
        Some(Some(s))
    });
    let ca_file = opt(r, t, p, "ca_file", None, |r, path, v| {
        r.file_path(path, v).map(Some)
    });
    let verify = opt(r, t, p, "verify", true, |r, path, v| r.boolean(path, v));
    let (protocol, tls) = (protocol?, tls?);
    // sni, ca_file and verify apply with tls = true only (the contract
    // writes them beside tls = false, ready to switch on).
    if !tls && protocol == UpstreamProtocol::H2 {
        r.error(
            &join(p, "protocol"),
            r.spans.get(&join(p, "protocol")).cloned().as_ref(),
            "\"h2\" needs tls = true (for HTTP/2 in plaintext use \"h2c\")",
        );
    } else if tls && protocol == UpstreamProtocol::H2c {
        r.error(
            &join(p, "protocol"),
            r.spans.get(&join(p, "protocol")).cloned().as_ref(),
            "\"h2c\" is HTTP/2 in plaintext; with tls = true use \"h2\"",
        );
    }
    Some(Upstream {
        in_flight: in_flight?,
        name: uname?,
        servers: servers?,
        health_check_path: hc?,
        connect_timeout_ms: connect?,
        read_timeout_ms: read?,
        protocol,
        tls,
        sni: sni?,
        ca_file: ca_file?,
        verify: verify?,
    })
}
