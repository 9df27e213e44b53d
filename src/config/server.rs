//! `[server]`: listeners (plaintext, h2c, and `[server.tls]` read by `tls`),
//! workers, shutdown, header limits and the start-up wait for Redis.

use toml::de::DeTable;

use super::model::Server;
use super::reader::Reader;
use super::reader::{non_empty, opt, req, socket_addr};

pub const SERVER_KEYS: &[&str] = &[
    "listen",
    "admin_listen",
    "threads",
    "grace_period_secs",
    "max_request_header_bytes",
    "max_request_headers",
    "header_read_timeout_ms",
    "startup_redis_wait_ms",
    "h2c",
    "tls",
];

pub(super) fn read(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<Server> {
    let p = "server";
    r.only_keys(p, t, SERVER_KEYS);
    let listen = req(r, t, p, None, "listen", |r, path, v| {
        non_empty(r, path, v, "listen address", socket_addr)
    });
    let admin_listen = opt(r, t, p, "admin_listen", None, |r, path, v| {
        let s = r.string(path, v)?;
        socket_addr(r, path, &(s, v.span())).map(Some)
    });
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = opt(r, t, p, "threads", cpus, |r, path, v| {
        r.int(path, v, 1, 1024).map(|n| n as usize)
    });
    let grace = opt(r, t, p, "grace_period_secs", 10, |r, path, v| {
        r.int(path, v, 0, 3600)
    });
    let max_hdr = opt(r, t, p, "max_request_header_bytes", 65536, |r, path, v| {
        r.int(path, v, 1024, 1 << 24).map(|n| n as usize)
    });
    // Pingora's parser refuses more than 256 header lines outright (400).
    let max_headers = opt(r, t, p, "max_request_headers", 100, |r, path, v| {
        r.int(path, v, 1, 256).map(|n| n as usize)
    });
    let hdr_timeout = opt(r, t, p, "header_read_timeout_ms", 10_000, |r, path, v| {
        r.int(path, v, 1, 3_600_000)
    });
    let startup_wait = opt(r, t, p, "startup_redis_wait_ms", 1000, |r, path, v| {
        r.int(path, v, 0, 600_000)
    });
    let h2c = opt(r, t, p, "h2c", false, |r, path, v| r.boolean(path, v));
    let tls = match t.get("tls") {
        Some(v) => r
            .table("server.tls", v)
            .and_then(|tt| super::tls::read(r, tt, &v.span()))
            .map(Some),
        None => Some(None),
    };
    if let (Some(listen), Some(admin), Some(tls)) = (&listen, &admin_listen, &tls) {
        let mut named: Vec<(String, &str)> = listen
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("server.listen[{i}]"), a.as_str()))
            .collect();
        if let Some(tls) = tls {
            named.extend(
                tls.listen
                    .iter()
                    .enumerate()
                    .map(|(i, a)| (format!("server.tls.listen[{i}]"), a.as_str())),
            );
        }
        if let Some(a) = admin {
            named.push(("server.admin_listen".to_string(), a.as_str()));
        }
        one_service_per_address(r, &named);
    }
    Some(Server {
        listen: listen?,
        admin_listen: admin_listen?,
        threads: threads?,
        grace_period_secs: grace?,
        max_request_header_bytes: max_hdr?,
        max_request_headers: max_headers?,
        header_read_timeout_ms: hdr_timeout?,
        startup_redis_wait_ms: startup_wait?,
        h2c: h2c?,
        tls: tls?,
    })
}

/// One address, one service: two listeners on one address (or a wildcard
/// address and another on its port) would each get some of its connections,
/// as the kernel chooses, so a request could reach the admin service as
/// easily as the proxy. Each clash is an error naming both keys.
fn one_service_per_address(r: &mut Reader<'_>, named: &[(String, &str)]) {
    let parsed: Vec<Option<std::net::SocketAddr>> =
        named.iter().map(|(_, a)| a.parse().ok()).collect();
    for (j, (key, addr)) in named.iter().enumerate() {
        let clash = (0..j).find(|&i| match (parsed[i], parsed[j]) {
            (Some(a), Some(b)) => {
                a.port() == b.port()
                    && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
            }
            _ => named[i].1 == *addr,
        });
        if let Some(i) = clash {
            let at = key.split('[').next().unwrap_or(key).to_string();
            let span = r.spans.get(&at).cloned();
            r.error(
                key,
                span.as_ref(),
                format!(
                    "\"{addr}\" clashes with {} (\"{}\"): one address serves one service, or the kernel splits its connections between them",
                    named[i].0, named[i].1
                ),
            );
        }
    }
}
