//! `bare_proxy`: the smallest Pingora reverse proxy, the benchmark's
//! `pingora_bare` baseline (loadtest/bench.sh).
//!
//! ```text
//! bare_proxy --listen 127.0.0.1:PORT --upstream 127.0.0.1:PORT --threads N
//! ```
//!
//! One [`ProxyHttp`] whose `upstream_peer` returns the same plain-HTTP
//! [`HttpPeer`] for every request; every other hook is Pingora's default. No
//! header rewriting, no logging (no logger is installed), no metrics, no
//! config file. Pingora's default settings throughout, and deliberately the
//! system allocator (no mimalloc, unlike the gateway): this is what Pingora
//! itself costs per request, the floor under the gateway's `gateway_off`.
//!
//! The only settings changed from `ServerConf::default()`: `threads` (from
//! `--threads`), and a short graceful shutdown so that SIGTERM ends the
//! process within about a second (SIGINT: at once).
//!
//! Build: `cargo build --release --example bare_proxy`
//! (target/release/examples/bare_proxy).

use std::net::SocketAddr;
use std::process::ExitCode;

use async_trait::async_trait;
use pingora::prelude::{HttpPeer, Opt, ProxyHttp, Result, Server, Session};
use pingora::server::configuration::ServerConf;

const USAGE: &str =
    "usage: bare_proxy --listen 127.0.0.1:PORT --upstream 127.0.0.1:PORT --threads N";

/// Proxies every request to one upstream, plain HTTP.
struct Bare {
    upstream: SocketAddr,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) -> Self::CTX {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(self.upstream, false, String::new())))
    }
}

struct Args {
    listen: SocketAddr,
    upstream: SocketAddr,
    threads: usize,
}

fn parse_args(mut argv: impl Iterator<Item = String>) -> std::result::Result<Args, String> {
    let (mut listen, mut upstream, mut threads) = (None, None, None);
    while let Some(flag) = argv.next() {
        let mut value = || {
            argv.next()
                .ok_or_else(|| format!("{flag}: a value is missing"))
        };
        match flag.as_str() {
            "--listen" => listen = Some(addr(&flag, value()?)?),
            "--upstream" => upstream = Some(addr(&flag, value()?)?),
            "--threads" => {
                let v = value()?;
                match v.parse::<usize>() {
                    Ok(n) if n > 0 => threads = Some(n),
                    _ => return Err(format!("--threads {v}: not a positive number")),
                }
            }
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(Args {
        listen: listen.ok_or("--listen is missing")?,
        upstream: upstream.ok_or("--upstream is missing")?,
        threads: threads.ok_or("--threads is missing")?,
    })
}

fn addr(flag: &str, value: String) -> std::result::Result<SocketAddr, String> {
    value
        .parse()
        .map_err(|_| format!("{flag} {value}: not an IP:PORT address"))
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let args = match parse_args(argv.into_iter()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bare_proxy: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };

    let conf = ServerConf {
        threads: args.threads,
        // SIGTERM: no grace period, then at most a second for the runtimes.
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    // Opt::default(): no command line or config file of Pingora's own.
    let mut server = Server::new_with_opt_and_conf(Opt::default(), conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstream: args.upstream,
        },
    );
    proxy.add_tcp(&args.listen.to_string());
    server.add_service(proxy);
    server.run_forever();
}
