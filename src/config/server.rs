//! `[server]`: listeners (plaintext, h2c, and `[server.tls]` read by `tls`),
//! workers, shutdown, header limits and the start-up wait for Redis.

use toml::de::DeTable;

use super::file::{non_empty, opt, req, socket_addr};
use super::model::Server;
use super::reader::Reader;

pub(super) fn read(r: &mut Reader<'_>, t: &DeTable<'_>) -> Option<Server> {
    let p = "server";
    r.only_keys(
        p,
        t,
        &[
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
        ],
    );
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
