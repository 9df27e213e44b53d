//! TLS termination and HTTP/2 through the real gateway, with certificates the
//! test makes itself (`openssl`) and a real client (`curl`): ALPN h2 and
//! HTTP/1.1 on the TLS listener, certificates chosen by SNI, h2c on the
//! plaintext one, limits and headers alike on every protocol, certificates
//! rotated by symlink swap while a client keeps connecting, and bad files
//! refused with their key path and line.

use crate::support;

use std::fs;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::pki::Pki;
use support::{free_port, wait_for, GatewayGuard, UpstreamGuard, SERVER, SERVER_2_THREADS};

struct Setup {
    pki: Pki,
    tls_port: u16,
    gw: GatewayGuard,
    _up: UpstreamGuard,
}

/// A gateway with a plaintext (h2c) listener and a TLS one serving
/// `certs` (file stems in the PKI dir, the first the default); one route
/// limited to 3 requests.
fn start(pki: Pki, certs: &[&str]) -> Setup {
    let up = UpstreamGuard::start();
    let tls_port = free_port();
    let list: Vec<String> = certs
        .iter()
        .map(|c| {
            format!(
                "{{ cert_file = \"{}\", key_file = \"{}\" }}",
                pki.path(&format!("{c}.crt")).display(),
                pki.path(&format!("{c}.key")).display()
            )
        })
        .collect();
    let cfg = format!(
        r#"
{SERVER_2_THREADS}
h2c = true

[server.tls]
listen = ["127.0.0.1:{tls_port}"]
certificates = [{}]

[limiter]
backend = "local"
retry_after_jitter_ms = 0

[[upstreams]]
name = "up"
servers = ["{}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
limit = {{ algorithm = "token_bucket", capacity = 3, refill_per_sec = 0.001, scope = "global" }}

[[routes]]
name = "open"
path_prefix = "/"
upstream = "up"
"#,
        list.join(", "),
        up.addr
    );
    let gw = GatewayGuard::start(&cfg);
    Setup {
        pki,
        tls_port,
        gw,
        _up: up,
    }
}

/// `curl` with `args`; returns (exit code, stdout).
fn curl(args: &[&str]) -> (i32, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "5"])
        .args(args)
        .output()
        .expect("curl");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
    )
}

impl Setup {
    /// An HTTPS request to `name` (resolved to loopback), trusting `ca`.
    fn https(&self, name: &str, ca: &str, path: &str, extra: &[&str]) -> (i32, String) {
        let resolve = format!("{name}:{}:127.0.0.1", self.tls_port);
        let url = format!("https://{name}:{}{path}", self.tls_port);
        let ca = self.pki.path(&format!("{ca}.crt"));
        let mut args = vec!["--resolve", &resolve, "--cacert"];
        let ca = ca.to_string_lossy().to_string();
        args.push(&ca);
        args.extend_from_slice(extra);
        args.push(&url);
        curl(&args)
    }
}

const WRITE_OUT: &[&str] = &["-o", "/dev/null", "-w", "%{http_version} %{http_code}"];

#[test]
fn tls_with_alpn_h2_sni_and_h2c() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "a", &["a.test"]);
    pki.leaf("ca", "b", &["b.test", "*.wild.test"]);
    let s = start(pki, &["a", "b"]);

    // ALPN: HTTP/2 when offered, HTTP/1.1 when asked for.
    assert_eq!(s.https("a.test", "ca", "/", WRITE_OUT).1, "2 200");
    let mut h1 = vec!["--http1.1"];
    h1.extend_from_slice(WRITE_OUT);
    assert_eq!(s.https("a.test", "ca", "/", &h1).1, "1.1 200");
    // SNI: curl verifies the name, so these pass only if the right
    // certificate was chosen; a name no certificate holds gets the default.
    assert_eq!(s.https("b.test", "ca", "/", WRITE_OUT).1, "2 200");
    assert_eq!(s.https("x.wild.test", "ca", "/", WRITE_OUT).1, "2 200");
    let (code, _) = s.https("other.test", "ca", "/", WRITE_OUT);
    assert_eq!(code, 60, "other.test gets the default (a.test) certificate");
    // h2c: prior knowledge on the plaintext listener; HTTP/1.1 still served.
    let plain = format!("http://{}/", s.gw.addr);
    let mut h2c = vec!["--http2-prior-knowledge"];
    h2c.extend_from_slice(WRITE_OUT);
    h2c.push(&plain);
    assert_eq!(curl(&h2c).1, "2 200");
    let mut plain1 = WRITE_OUT.to_vec();
    plain1.push(&plain);
    assert_eq!(curl(&plain1).1, "1.1 200");
    // TLS 1.1 is refused.
    let (code, _) = s.https("a.test", "ca", "/", &["--tls-max", "1.1"]);
    assert_ne!(code, 0, "TLS 1.1 refused");

    // One limit whatever the protocol: h2, HTTP/1.1 over TLS, h2c, then the
    // fourth is a 429 with its headers on HTTP/2.
    assert_eq!(s.https("a.test", "ca", "/r", WRITE_OUT).1, "2 200");
    assert_eq!(s.https("a.test", "ca", "/r", &h1).1, "1.1 200");
    let r_plain = format!("http://{}/r", s.gw.addr);
    let mut h2c_r = vec!["--http2-prior-knowledge"];
    h2c_r.extend_from_slice(WRITE_OUT);
    h2c_r.push(&r_plain);
    assert_eq!(curl(&h2c_r).1, "2 200");
    let (_, head) = s.https("a.test", "ca", "/r", &["-i"]);
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/2 429"), "{head}");
    for h in [
        "retry-after:",
        "x-ratelimit-limit: 3",
        "x-ratelimit-remaining: 0",
        "ratelimit-policy:",
    ] {
        assert!(head.contains(h), "{h} missing on HTTP/2:\n{head}");
    }
    let m = s.gw.metrics();
    assert!(
        m.contains("gateway_requests_total{route=\"r\",status=\"429\"} 1"),
        "counted as on HTTP/1.1"
    );
}

/// Kubernetes updates a mounted secret by pointing a `..data` symlink at a
/// new directory. The gateway picks the new certificate up without a
/// restart while a client keeps connecting, every handshake succeeding with
/// the old or the new one; a broken update keeps the certificate in use.
#[test]
fn certificates_rotate_without_a_restart() {
    let pki = Pki::new();
    pki.ca("ca1");
    pki.ca("ca2");
    pki.leaf("ca1", "old", &["a.test"]);
    pki.leaf("ca2", "new", &["a.test"]);
    // The mounted-secret layout: tls.crt -> ..data/tls.crt -> v1/tls.crt.
    let mount = pki.path("mount");
    let v1 = mount.join("v1");
    fs::create_dir_all(&v1).expect("v1");
    fs::copy(pki.path("old.crt"), v1.join("tls.crt")).expect("copy");
    fs::copy(pki.path("old.key"), v1.join("tls.key")).expect("copy");
    std::os::unix::fs::symlink("v1", mount.join("..data")).expect("..data");
    for f in ["tls.crt", "tls.key"] {
        std::os::unix::fs::symlink(format!("..data/{f}"), mount.join(f)).expect("link");
    }
    let bundle = format!(
        "{}{}",
        fs::read_to_string(pki.path("ca1.crt")).expect("ca1"),
        fs::read_to_string(pki.path("ca2.crt")).expect("ca2")
    );
    fs::write(pki.path("both.crt"), bundle).expect("bundle");
    // The configured files are the mount's symlinks.
    std::os::unix::fs::symlink(mount.join("tls.crt"), pki.path("m.crt")).expect("m.crt");
    std::os::unix::fs::symlink(mount.join("tls.key"), pki.path("m.key")).expect("m.key");
    let s = Arc::new(start(pki, &["m"]));
    assert_eq!(s.https("a.test", "ca1", "/", WRITE_OUT).1, "2 200");

    // A client that keeps connecting (a new TLS handshake each time).
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let client = {
        let (s, stop, ok, failed) = (s.clone(), stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            for _ in 0..400 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                match s.https("a.test", "both", "/", WRITE_OUT).1.as_str() {
                    "2 200" => ok.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    // The swap: a new directory, then the `..data` link replaced atomically.
    let v2 = mount.join("v2");
    fs::create_dir_all(&v2).expect("v2");
    fs::copy(s.pki.path("new.crt"), v2.join("tls.crt")).expect("copy");
    fs::copy(s.pki.path("new.key"), v2.join("tls.key")).expect("copy");
    std::os::unix::fs::symlink("v2", mount.join("..data.tmp")).expect("tmp link");
    fs::rename(mount.join("..data.tmp"), mount.join("..data")).expect("swap");
    wait_for(
        "the new certificate served",
        Duration::from_secs(10),
        || (s.https("a.test", "ca2", "/", WRITE_OUT).1 == "2 200").then_some(()),
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    client.join().expect("client");
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("FIGURES tls-rotation: {ok} handshakes ok, {failed} failed across the swap");
    assert_eq!(failed, 0, "every handshake succeeded across the rotation");
    assert!(ok >= 5, "the client kept connecting ({ok})");
    assert_eq!(
        s.gw.metric("gateway_tls_certificate_reloads_total{result=\"ok\"}"),
        1.0
    );

    // A broken update (a truncated certificate) is refused; the new
    // certificate stays in use.
    fs::write(v2.join("tls.crt"), "-----BEGIN CERTIFICATE-----\nAAAA\n").expect("break");
    wait_for("the broken file refused", Duration::from_secs(10), || {
        (s.gw
            .metric("gateway_tls_certificate_reloads_total{result=\"error\"}")
            >= 1.0)
            .then_some(())
    });
    assert_eq!(s.https("a.test", "ca2", "/", WRITE_OUT).1, "2 200");
    assert!(
        s.gw.log().contains("certificates[0] (line"),
        "the error names the key and line"
    );
}

/// A certificate file that cannot be used stops `run` with its key path and
/// line, and `check` says the same (a missing file is a warning for
/// `check`, which may run on another machine).
#[test]
fn unusable_certificates_are_refused_with_their_key() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "a", &["a.test"]);
    pki.leaf("ca", "b", &["b.test"]);
    let cfg = |cert: &str, key: &str| {
        format!(
            "[server]\nlisten = [\"127.0.0.1:{}\"]\n\n[server.tls]\nlisten = [\"127.0.0.1:{}\"]\n\
             certificates = [\n  {{ cert_file = \"{}\", key_file = \"{}\" }},\n]\n\n\
             [[upstreams]]\nname = \"u\"\nservers = [\"127.0.0.1:9\"]\n\n\
             [[routes]]\nname = \"all\"\npath_prefix = \"/\"\nupstream = \"u\"\n",
            free_port(),
            free_port(),
            pki.path(cert).display(),
            pki.path(key).display()
        )
    };
    let run = |args: &[&str], text: &str| {
        let file = pki.path("gw.toml");
        fs::write(&file, text).expect("config");
        let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
            .args(args)
            .arg(&file)
            .output()
            .expect("gateway");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // The key of another certificate: refused by check and run.
    let mismatched = cfg("a.crt", "b.key");
    let (code, err) = run(&["check", "-c"], &mismatched);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("server.tls.certificates[0] (line 7):")
            && err.contains("does not belong to the certificate"),
        "{err}"
    );
    assert!(err.contains("has 1 problem(s)"), "{err}");
    let (code, err) = run(&["run", "-c"], &mismatched);
    assert_eq!(
        code,
        Some(2),
        "one exit code for every config problem: {err}"
    );
    assert!(
        err.contains("has 1 problem(s)") && err.contains("server.tls.certificates[0] (line 7):"),
        "{err}"
    );
    // With other problems: one run lists them all, in one format.
    let many = format!(
        "{}
[clients]
trusted_proxies = [\"10.0.0.0/33\"]
",
        mismatched.replace("upstream = \"u\"", "upstream = \"nope\"")
    );
    let (code, err) = run(&["check", "-c"], &many);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("has 3 problem(s)"), "{err}");
    for what in [
        "server.tls.certificates[0] (line 7):",
        "routes[0].upstream (line",
        "clients.trusted_proxies[0] (line",
    ] {
        assert!(err.contains(&format!("  {what}")), "{what}: {err}");
    }
    // A missing file: a warning for check, an error for run.
    let missing = cfg("nope.crt", "a.key");
    let (code, err) = run(&["check", "-c"], &missing);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("warning: server.tls.certificates[0] (line 7): cannot read"),
        "{err}"
    );
    let (code, err) = run(&["run", "-c"], &missing);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot read"), "{err}");
}

/// To a gRPC request the gateway's own refusal is a gRPC status: over h2c, a
/// 429 is HTTP 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED) in a
/// trailers-only response, the retry delay in `grpc-retry-pushback-ms`, and
/// the rate-limit headers kept.
#[test]
fn grpc_requests_get_grpc_refusals() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "a", &["a.test"]);
    let s = start(pki, &["a"]);
    let url = format!("http://{}/r/ride.v1.Rides/Request", s.gw.addr);
    let grpc = |extra: &[&str]| {
        let mut args = vec![
            "--http2-prior-knowledge",
            "-i",
            "-X",
            "POST",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "--data-binary",
            "@/dev/null",
        ];
        args.extend_from_slice(extra);
        args.push(&url);
        curl(&args).1.to_ascii_lowercase()
    };
    for _ in 0..3 {
        grpc(&[]); // admitted: the mock upstream answers them as HTTP
    }
    let head = grpc(&[]);
    assert!(head.starts_with("http/2 200"), "{head}");
    for h in [
        "content-type: application/grpc",
        "grpc-status: 8",
        "grpc-message: rate limit exceeded on tier(s): route; retry after",
        "grpc-retry-pushback-ms:",
        "retry-after:",
        "x-ratelimit-remaining: 0",
    ] {
        assert!(head.contains(h), "{h} missing:\n{head}");
    }
    assert_eq!(
        s.gw.metric("gateway_requests_total{route=\"r\",status=\"429\"}"),
        1.0,
        "counted as the 429 it is, though answered 200 on the wire"
    );
}

/// A front gateway whose one upstream is described by `upstream` (the keys
/// after `name`); its route `/` has no limit.
fn front(upstream: &str) -> GatewayGuard {
    GatewayGuard::start(&format!(
        r#"
{SERVER}

[limiter]
backend = "local"

[[upstreams]]
name = "back"
{upstream}
connect_timeout_ms = 1000
read_timeout_ms = 5000

[[routes]]
name = "all"
path_prefix = "/"
upstream = "back"
"#
    ))
}

/// The protocols of the requests the back gateway has logged, in order.
fn protos(gw: &GatewayGuard) -> Vec<String> {
    gw.log()
        .lines()
        .filter_map(|l| l.split("proto=").nth(1))
        .map(|r| {
            r.split_whitespace()
                .next()
                .unwrap_or("")
                .trim_matches('"')
                .to_string()
        })
        .collect()
}

/// The protocol of the next request the back gateway logs (its access line
/// is written after the response, so it is polled for).
fn next_proto(gw: &GatewayGuard, before: usize) -> String {
    wait_for(
        "the back gateway's access line",
        Duration::from_secs(5),
        || protos(gw).get(before).cloned(),
    )
}

/// Upstreams over TLS (verified against a CA file, with SNI), over HTTP/2
/// by ALPN, and over h2c; a server whose certificate the CA did not sign is
/// refused (502) unless verification is off. The upstream here is a second
/// gateway terminating TLS in front of the mock upstream.
#[test]
fn upstreams_over_tls_h2_and_h2c() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("other");
    pki.leaf("ca", "b", &["back.internal"]);
    let back = start(pki, &["b"]);
    let ca = back.pki.path("ca.crt").display().to_string();
    let other = back.pki.path("other.crt").display().to_string();
    let tls_addr = format!("127.0.0.1:{}", back.tls_port);
    let get = |gw: &GatewayGuard| gw.client().get("/").map(|r| r.status).unwrap_or(0);
    // The status, and the protocol the back gateway saw the request on.
    let via = |gw: &GatewayGuard| {
        let before = protos(&back.gw).len();
        let status = get(gw);
        (status, next_proto(&back.gw, before))
    };

    let https = front(&format!(
        "servers = [\"{tls_addr}\"]\ntls = true\nsni = \"back.internal\"\nca_file = \"{ca}\""
    ));
    assert_eq!(
        via(&https),
        (200, "http/1.1".into()),
        "HTTPS upstream, verified"
    );

    let h2 = front(&format!(
        "servers = [\"{tls_addr}\"]\nprotocol = \"h2\"\ntls = true\nsni = \"back.internal\"\nca_file = \"{ca}\""
    ));
    assert_eq!(via(&h2), (200, "h2".into()), "HTTP/2 upstream over TLS");

    let h2c = front(&format!(
        "servers = [\"{}\"]\nprotocol = \"h2c\"",
        back.gw.addr
    ));
    assert_eq!(via(&h2c), (200, "h2".into()), "h2c upstream");

    let wrong_ca = front(&format!(
        "servers = [\"{tls_addr}\"]\ntls = true\nsni = \"back.internal\"\nca_file = \"{other}\""
    ));
    assert_eq!(
        get(&wrong_ca),
        502,
        "a certificate the CA did not sign is refused"
    );
    let wrong_name = front(&format!(
        "servers = [\"{tls_addr}\"]\ntls = true\nsni = \"elsewhere.internal\"\nca_file = \"{ca}\""
    ));
    assert_eq!(
        get(&wrong_name),
        502,
        "a certificate for another name is refused"
    );
    let unverified = front(&format!(
        "servers = [\"{tls_addr}\"]\ntls = true\nsni = \"back.internal\"\nca_file = \"{other}\"\nverify = false"
    ));
    assert_eq!(get(&unverified), 200, "verify = false accepts it");
}

/// A pooled upstream connection never crosses a trust boundary. Four
/// upstreams name the same server, port and SNI: `ca` trusts the CA that
/// signed its certificate, `roots` the system roots and `other` another CA
/// (neither trusts it), `unverified` checks nothing. Pingora's pool key
/// covers SNI and `verify` but not the CA, so without the gateway's trust
/// group a connection `ca` verified would serve `roots` and `other`. Every
/// upstream goes first on a fresh gateway, then every ordered pair follows.
#[test]
fn pooled_tls_connections_keep_to_their_trust() {
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("other");
    pki.leaf("ca", "b", &["back.internal"]);
    let back = start(pki, &["b"]);
    let ca = back.pki.path("ca.crt").display().to_string();
    let other = back.pki.path("other.crt").display().to_string();
    let tls_addr = format!("127.0.0.1:{}", back.tls_port);
    let upstreams = [
        ("ca", format!("ca_file = \"{ca}\""), 200),
        ("roots", String::new(), 502),
        ("other", format!("ca_file = \"{other}\""), 502),
        (
            "unverified",
            format!("ca_file = \"{other}\"\nverify = false"),
            200,
        ),
    ];
    let mut cfg = format!("{SERVER}\n[limiter]\nbackend = \"local\"\n");
    for (name, trust, _) in &upstreams {
        cfg += &format!(
            "\n[[upstreams]]\nname = \"{name}\"\nservers = [\"{tls_addr}\"]\ntls = true\nsni = \"back.internal\"\n{trust}\nconnect_timeout_ms = 1000\nread_timeout_ms = 5000\n"
        );
        cfg += &format!(
            "\n[[routes]]\nname = \"{name}\"\npath_prefix = \"/{name}/\"\nupstream = \"{name}\"\n"
        );
    }
    let mut checked = 0;
    for first in 0..upstreams.len() {
        let gw = GatewayGuard::start(&cfg);
        let mut expect = |i: usize, after: &str| {
            let (name, _, want) = &upstreams[i];
            let got = gw
                .client()
                .get(&format!("/{name}/x"))
                .map(|r| r.status)
                .unwrap_or(0);
            assert_eq!(got, *want, "{name} after {after}");
            checked += 1;
        };
        expect(first, "nothing");
        for x in 0..upstreams.len() {
            for y in (0..upstreams.len()).filter(|&y| y != x) {
                expect(x, "the previous pair");
                expect(y, upstreams[x].0);
            }
        }
    }
    println!("{checked} requests in every order: each upstream kept to its own trust");
}

/// A client's failed handshake is the client's business: counted by
/// reason in a metric, logged at debug, never an ERROR line (two testssl.sh
/// scans made 191 of them).
#[test]
fn failed_handshakes_are_counted_not_logged_as_errors() {
    use std::io::{Read, Write};
    let pki = Pki::new();
    pki.ca("ca");
    pki.ca("other-ca");
    pki.leaf("ca", "a", &["a.test"]);
    let s = start(pki, &["a"]);
    let addr = format!("127.0.0.1:{}", s.tls_port);
    for _ in 0..5 {
        // Plaintext HTTP on the TLS port.
        let mut c = std::net::TcpStream::connect(&addr).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n");
        let _ = c.read(&mut [0u8; 64]);
    }
    for _ in 0..5 {
        // Connected, then gone before a ClientHello.
        drop(std::net::TcpStream::connect(&addr).expect("connect"));
    }
    for _ in 0..3 {
        // A client that does not trust our certificate hangs up with an alert.
        assert_eq!(s.https("a.test", "other-ca", "/", WRITE_OUT).0, 60);
    }
    let counted = |reason: &str| {
        s.gw.metric(&format!(
            "gateway_downstream_handshake_failures_total{{reason=\"{reason}\"}}"
        ))
    };
    wait_for("13 failures counted", Duration::from_secs(10), || {
        let all: f64 = [
            "client_alert",
            "protocol",
            "closed",
            "timeout",
            "h2",
            "other",
        ]
        .iter()
        .map(|r| counted(r))
        .sum();
        (all >= 13.0).then_some(())
    });
    let by_reason = (
        counted("protocol"),
        counted("closed"),
        counted("client_alert"),
    );
    assert_eq!(by_reason, (5.0, 5.0, 3.0), "{}", s.gw.metrics());
    // And a good client is served as ever.
    assert_eq!(s.https("a.test", "ca", "/", WRITE_OUT).1, "2 200");
    let log = s.gw.log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.is_empty(), "ERROR lines: {errors:#?}");
    eprintln!("FIGURES tls-noise: 13 failed handshakes (5 protocol, 5 closed, 3 client_alert) counted, 0 ERROR lines");
}
