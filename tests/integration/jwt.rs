//! Verified JWTs as the client's identity, against an issuer of the test's
//! own (keys made with `openssl`, a JWKS endpoint on a loopback port that
//! rotates its keys and can be stopped) and real gateways on a real Redis:
//! a new `kid` is accepted after one fetch, every kind of bad token is
//! refused with 401 and names no bucket, a limit on `sub` holds exactly
//! across three replicas, and tokens keep working while the endpoint is
//! down for the time the config states.

use crate::support;

use std::time::{Duration, Instant};

use jsonwebtoken::{Algorithm, EncodingKey};
use serde_json::{json, Value};
use support::issuer::{claims, jwks, now, JwksServer, SigningKey};
use support::{wait_for, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

const ISS: &str = "https://issuer.test/";
const AUD: &str = "api.test";

/// A gateway config with one JWKS issuer (and, if given, a key-file issuer
/// for HS256), plans free (3 a burst) and pro (50), and route `/r`
/// (`require_api_key`, so a token is needed) plus route `/s` limited per
/// `sub` claim to `per_sub` a day; the JWKS fetched every `refresh_secs`.
fn config(
    redis: &RedisGuard,
    up: &UpstreamGuard,
    jwks_url: &str,
    extra: &str,
    per_sub: u64,
    refresh_secs: u64,
) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "redis"
retry_after_jitter_ms = 0

[redis]
urls = ["{redis}"]
timeout_ms = 500
probe_interval_ms = 100

[plans.free]
capacity = 3
refill_per_sec = 0.001

[plans.pro]
capacity = 50000
refill_per_sec = 50000

[[auth.jwt.issuers]]
issuer = "{ISS}"
jwks_url = "{jwks_url}"
audiences = ["{AUD}"]
algorithms = ["RS256", "ES256", "EdDSA"]
leeway_secs = 5
plan_claim = "plan"
plan_map = {{ gold = "pro" }}
default_plan = "free"
jwks_refresh_secs = {refresh_secs}
jwks_min_refetch_secs = 2
{extra}

[[upstreams]]
name = "up"
servers = ["{up}"]

[[routes]]
name = "r"
path_prefix = "/r"
upstream = "up"
require_api_key = true

[[routes]]
name = "s"
path_prefix = "/s"
upstream = "up"
require_api_key = true
limit = {{ algorithm = "fixed_window", limit = {per_sub}, window_secs = 86400, key = "claim:sub" }}
"#,
        redis = redis.url(),
        up = up.addr,
    )
}

fn get(g: &GatewayGuard, path: &str, token: &str) -> support::Response {
    g.client()
        .request(
            "GET",
            path,
            &[("authorization", &format!("Bearer {token}"))],
            b"",
        )
        .expect("request")
}

/// A token signed with `key` by hand: `header` and `claims` as given.
fn forge(header: &Value, claims: &Value, sign: impl Fn(&[u8]) -> Vec<u8>) -> String {
    use base64::Engine as _;
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let msg = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig = sign(msg.as_bytes());
    format!("{msg}.{}", b64(&sig))
}

#[test]
fn a_rotating_issuer_is_followed_and_every_bad_token_is_refused_with_no_bucket() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let ec = SigningKey::new("ec-1", Algorithm::ES256);
    let ed = SigningKey::new("ed-1", Algorithm::EdDSA);
    let server = JwksServer::start(jwks(&[&rsa, &ec, &ed]));
    // A second issuer whose HMAC key is in a file.
    let dir = tempfile::tempdir().expect("temp dir");
    let hs = SigningKey::new("hs-1", Algorithm::HS256);
    let hs_file = dir.path().join("hs.json");
    std::fs::write(&hs_file, jwks(&[&hs])).expect("write key file");
    let extra = format!(
        r#"
[[auth.jwt.issuers]]
issuer = "internal"
key_files = ["{}"]
algorithms = ["HS256"]
default_plan = "pro"
"#,
        hs_file.display()
    );
    // No periodic refresh within the test: only a token's unknown kid fetches.
    let g = GatewayGuard::start(&config(&redis, &up, &server.url(), &extra, 100, 300));

    // Each algorithm, and the plans the claims name.
    for (key, sub) in [(&rsa, "ann"), (&ec, "bob"), (&ed, "cy")] {
        let r = get(&g, "/r", &key.sign(&claims(ISS, AUD, sub)));
        assert_eq!(r.status, 200, "{:?} token: {}", key.alg, r.text());
        assert_eq!(r.header("x-ratelimit-limit"), Some("3"), "free by default");
    }
    let mut gold = claims(ISS, AUD, "dee");
    gold["plan"] = json!("gold");
    let r = get(&g, "/r", &rsa.sign(&gold));
    assert_eq!(r.header("x-ratelimit-limit"), Some("50000"), "gold is pro");
    let internal = json!({"iss": "internal", "sub": "svc", "exp": now() + 600});
    let r = get(&g, "/r", &hs.sign(&internal));
    assert_eq!(r.status, 200, "HS256 from a key file: {}", r.text());
    // The key tier counts per sub: ann's fourth request is over free's 3.
    let ann = rsa.sign(&claims(ISS, AUD, "ann"));
    let statuses: Vec<u16> = (0..3).map(|_| get(&g, "/r", &ann).status).collect();
    assert_eq!(statuses, [200, 200, 429], "ann had spent 1 of 3");

    // Rotation: a token naming a new kid is accepted after one fetch.
    let rsa2 = SigningKey::new("rsa-2", Algorithm::RS256);
    server.set(jwks(&[&rsa, &rsa2, &ec, &ed]));
    let rotated = rsa2.sign(&claims(ISS, AUD, "eve"));
    std::thread::sleep(Duration::from_millis(2100)); // past jwks_min_refetch_secs
    let before = server.fetches();
    let t0 = Instant::now();
    let r = get(&g, "/r", &rotated);
    assert_eq!(r.status, 200, "new kid: {}", r.text());
    let fetched = server.fetches() - before;
    assert_eq!(fetched, 1, "one fetch for the new kid");
    println!(
        "new kid accepted in {:.1} ms, {fetched} fetch(es)",
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Unknown kids refetch at most once per jwks_min_refetch_secs.
    let stranger = SigningKey::new("nobody", Algorithm::ES256);
    let before = server.fetches();
    for i in 0..20 {
        let r = get(
            &g,
            "/r",
            &stranger.sign(&claims(ISS, AUD, &format!("bad-kid-{i}"))),
        );
        assert_eq!(r.status, 401);
    }
    let refetches = server.fetches() - before;
    assert!(
        refetches <= 2,
        "20 unknown-kid tokens in < 2 s fetched {refetches} times"
    );

    // Every kind of bad token: 401, the challenge, a reason, no bucket.
    let mut expired = claims(ISS, AUD, "bad-expired");
    expired["exp"] = json!(now() - 60);
    let mut early = claims(ISS, AUD, "bad-early");
    early["nbf"] = json!(now() + 60);
    let mut no_exp = claims(ISS, AUD, "bad-noexp");
    no_exp.as_object_mut().unwrap().remove("exp");
    let mut odd_nbf = claims(ISS, AUD, "bad-nbf-text");
    odd_nbf["nbf"] = json!("tomorrow");
    let rsa_public = rsa.public_pem.clone().expect("rsa public pem");
    let confused = forge(
        &json!({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}),
        &claims(ISS, AUD, "bad-confused"),
        |msg| {
            let enc = EncodingKey::from_secret(&rsa_public);
            let sig = jsonwebtoken::crypto::sign(msg, &enc, Algorithm::HS256).expect("sign");
            use base64::Engine as _;
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(sig)
                .expect("b64")
        },
    );
    let none = forge(
        &json!({"alg": "none", "typ": "JWT"}),
        &claims(ISS, AUD, "bad-none"),
        |_| Vec::new(),
    );
    // One character of the signature changed, in its middle (a last
    // character's spare bits would only make it bad base64).
    let mut bad_sig = rsa.sign(&claims(ISS, AUD, "bad-sig")).into_bytes();
    let i = bad_sig.len() - 40;
    bad_sig[i] = if bad_sig[i] == b'A' { b'B' } else { b'A' };
    let bad_sig = String::from_utf8(bad_sig).expect("ascii");
    // ES256 signed by a key that is not the issuer's, naming its kid.
    let impostor = SigningKey::new("ec-1", Algorithm::ES256);
    let cases: Vec<(&str, String, &str)> = vec![
        ("expired", rsa.sign(&expired), "expired"),
        ("not yet valid", rsa.sign(&early), "not valid yet"),
        ("no exp", rsa.sign(&no_exp), "exp"),
        ("nbf not a number", rsa.sign(&odd_nbf), "malformed"),
        (
            "wrong aud",
            rsa.sign(&claims(ISS, "other.api", "bad-aud")),
            "audience",
        ),
        (
            "wrong iss",
            rsa.sign(&claims("https://evil.test/", AUD, "bad-iss")),
            "issuer",
        ),
        ("alg none", none, "none"),
        ("HS256 with the RSA public key", confused, "algorithm"),
        ("bad signature", bad_sig, "bad signature"),
        (
            "another key, same kid",
            impostor.sign(&claims(ISS, AUD, "bad-impostor")),
            "bad signature",
        ),
        (
            "EdDSA from the HS256 issuer",
            ed.sign(&json!({"iss": "internal", "sub": "bad-alg", "exp": now() + 60})),
            "algorithm",
        ),
        ("not base64", "eyJhbGciOi.x!.y".to_string(), ""),
    ];
    let keys_before = redis.keys();
    for (what, token, reason) in &cases {
        let r = get(&g, "/r", token);
        if what == &"not base64" {
            // Not shaped as a JWT: taken as an API key, which is unknown.
            assert_eq!(r.status, 401, "{what}");
            continue;
        }
        assert_eq!(r.status, 401, "{what}: {}", r.text());
        let challenge = r.header("www-authenticate").unwrap_or_default();
        assert!(
            challenge.starts_with("Bearer error=\"invalid_token\", error_description=\""),
            "{what}: {challenge}"
        );
        assert!(
            challenge.contains(reason) || r.text().contains(reason),
            "{what}: the reason names {reason}: {challenge}"
        );
        println!("{what}: 401 {challenge}");
    }
    let made: Vec<String> = redis.keys().difference(&keys_before).cloned().collect();
    assert!(made.is_empty(), "bad tokens made buckets: {made:?}");
    assert!(
        !redis.keys().iter().any(|k| k.contains("bad-")),
        "no bucket names a refused token's sub"
    );
    let m = g.metrics();
    assert!(
        support::family_sum(&m, "gateway_jwt_refusals_total") >= cases.len() as f64 - 1.0,
        "refusals counted"
    );

    // A key dropped from the set takes its tokens with it at the next
    // fetch, cached or not (here a fetch for another unknown kid).
    let ec_token = ec.sign(&claims(ISS, AUD, "fay"));
    assert_eq!(get(&g, "/r", &ec_token).status, 200);
    server.set(jwks(&[&rsa, &rsa2, &ed]));
    std::thread::sleep(Duration::from_millis(2100));
    let before = server.fetches();
    let r = get(&g, "/r", &stranger.sign(&claims(ISS, AUD, "bad-x")));
    assert_eq!(r.status, 401);
    assert_eq!(
        server.fetches() - before,
        1,
        "the unknown kid fetched the set"
    );
    let r = get(&g, "/r", &ec_token);
    assert_eq!(
        r.status,
        401,
        "the dropped key's token, cached before: {}",
        r.text()
    );
    // A key file is watched: a new HMAC key in it is in force within a
    // few polls, and the old key's tokens (cached before) are refused.
    let hs2 = SigningKey::new("hs-2", Algorithm::HS256);
    let aside = dir.path().join("hs.json.tmp");
    std::fs::write(&aside, jwks(&[&hs2])).expect("write key file");
    std::fs::rename(&aside, &hs_file).expect("swap key file");
    wait_for("the new key file in force", Duration::from_secs(10), || {
        (get(&g, "/r", &hs2.sign(&internal)).status == 200).then_some(())
    });
    assert_eq!(
        get(&g, "/r", &hs.sign(&internal)).status,
        401,
        "the old key's token"
    );
    // The log names the refusal's reason, never a token.
    let log = g.log();
    assert!(log.contains("rejected_by=\"token:"), "access lines say why");
    assert!(!log.contains(&ann), "a token in the log");
}

#[test]
fn a_limit_on_sub_holds_exactly_across_three_replicas() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    const LIMIT: u64 = 60;
    let cfg = config(&redis, &up, &server.url(), "", LIMIT, 300);
    let gws: Vec<GatewayGuard> = (0..3).map(|_| GatewayGuard::start(&cfg)).collect();
    // Two subjects, each with three tokens (one per device: distinct
    // `jti`, so distinct cache entries), all pro so the key tier is wide.
    let token = |sub: &str, device: u32| {
        let mut c = claims(ISS, AUD, sub);
        c["plan"] = json!("gold");
        c["jti"] = json!(format!("{sub}-{device}"));
        rsa.sign(&c)
    };
    let per_sub = 150; // 2.5x the limit each
    let handles: Vec<_> = ["gina", "hal"]
        .into_iter()
        .flat_map(|sub| (0..3).map(move |d| (sub, d)))
        .map(|(sub, d)| {
            let t = token(sub, d);
            let addr = gws[d as usize].addr;
            std::thread::spawn(move || {
                let mut c = support::Client::connect(addr).expect("connect");
                let mut admitted = 0;
                for _ in 0..per_sub / 3 {
                    let r = c
                        .request(
                            "GET",
                            "/s",
                            &[("authorization", &format!("Bearer {t}"))],
                            b"",
                        )
                        .expect("request");
                    match r.status {
                        200 => admitted += 1,
                        429 => {}
                        s => panic!("unexpected {s}: {}", r.text()),
                    }
                }
                (sub, admitted)
            })
        })
        .collect();
    let mut by_sub = std::collections::BTreeMap::<&str, u64>::new();
    for h in handles {
        let (sub, n) = h.join().expect("sender");
        *by_sub.entry(sub).or_default() += n;
    }
    let sprayed = by_sub.clone();
    for (sub, n) in &by_sub {
        assert!(*n <= LIMIT, "{sub}: admitted {n} over the limit {LIMIT}");
    }
    // Then a slow trickle from every replica for longer than a lease: a
    // token a replica leased and did not spend goes back and is spent
    // here, so the total reaches the limit exactly, and never passes it.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        for sub in ["gina", "hal"] {
            for (d, g) in gws.iter().enumerate() {
                let r = get(g, "/s", &token(sub, d as u32));
                if r.status == 200 {
                    *by_sub.get_mut(sub).unwrap() += 1;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "limit on claim:sub, 3 replicas: admitted {by_sub:?} of {per_sub} sent each ({sprayed:?} during the spray); bound {LIMIT} each"
    );
    for (sub, n) in &by_sub {
        assert_eq!(
            *n, LIMIT,
            "{sub}: admitted {n}, the limit is exactly {LIMIT}"
        );
    }
    assert_eq!(
        up.count("/s"),
        2 * LIMIT,
        "the upstream saw exactly the admitted"
    );
}

#[test]
fn tokens_keep_working_while_the_jwks_endpoint_is_down_then_stop_when_stale() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let mut server = JwksServer::start(jwks(&[&rsa]));
    const STALE: u64 = 4;
    let cfg = config(&redis, &up, &server.url(), "", 100_000, 1).replace(
        "jwks_min_refetch_secs = 2",
        &format!("jwks_min_refetch_secs = 2\njwks_max_stale_secs = {STALE}\njwks_timeout_ms = 300"),
    );
    let g = GatewayGuard::start(&cfg);
    let mut gold = claims(ISS, AUD, "ivy");
    gold["plan"] = json!("gold");
    let seen = rsa.sign(&gold);
    assert_eq!(get(&g, "/r", &seen).status, 200);
    // The refresh runs every second: the keys are at most ~1 s old now.
    wait_for("a refresh", Duration::from_secs(5), || {
        (server.fetches() >= 2).then_some(())
    });
    server.stop();
    let stopped = Instant::now();
    // Until the keys are STALE seconds old: a token seen before and one
    // never seen (checked with the cached keys) both pass.
    let mut i = 0;
    let mut last_ok = Duration::ZERO;
    let first_refusal = loop {
        i += 1;
        let mut c = gold.clone();
        c["jti"] = json!(i);
        let fresh = rsa.sign(&c);
        let (a, b) = (get(&g, "/r", &seen), get(&g, "/r", &fresh));
        match (a.status, b.status) {
            (200, 200) => last_ok = stopped.elapsed(),
            // The keys went stale between the two requests: the second is
            // the first refusal (the other way round would be a defect).
            (503 | 200, 503) => {
                let refused = if a.status == 503 { &a } else { &b };
                assert!(
                    refused.header("retry-after").is_some(),
                    "503 says when to retry"
                );
                assert!(
                    refused.text().contains("keys are unavailable"),
                    "{}",
                    refused.text()
                );
                break stopped.elapsed();
            }
            other => panic!(
                "mixed answers {other:?} at {:?}: {} / {}",
                stopped.elapsed(),
                a.text(),
                b.text()
            ),
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(STALE + 5),
            "never went stale"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    println!(
        "endpoint down: tokens served for {:.1} s after it stopped (keys' max age {STALE} s), refused (503) from {:.1} s",
        last_ok.as_secs_f64(),
        first_refusal.as_secs_f64()
    );
    assert!(
        last_ok >= Duration::from_secs(STALE - 2),
        "served while the keys were fresh enough"
    );
    assert!(
        first_refusal <= Duration::from_secs(STALE + 1),
        "not past max_stale"
    );
    assert!(
        g.log().contains("jwks: fetch failed, the last keys serve"),
        "the failure is logged"
    );
    // The endpoint back: tokens pass again within a refresh or a refetch.
    server.restart();
    wait_for("tokens accepted again", Duration::from_secs(5), || {
        (get(&g, "/r", &seen).status == 200).then_some(())
    });
}

#[test]
fn an_https_jwks_endpoint_is_trusted_through_its_ca_file_only() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let pki = support::pki::Pki::new();
    pki.ca("ca");
    pki.leaf("ca", "jwks", &["IP:127.0.0.1", "localhost"]);
    let es = SigningKey::new("es-1", Algorithm::ES256);
    let server = JwksServer::start_tls(jwks(&[&es]), &pki.path("jwks.crt"), &pki.path("jwks.key"));
    assert!(server.url().starts_with("https://127.0.0.1:"));
    let cfg = config(&redis, &up, &server.url(), "", 100, 300);
    let trusted = cfg.replace(
        "jwks_min_refetch_secs = 2",
        &format!(
            "jwks_min_refetch_secs = 2\njwks_ca_file = \"{}\"",
            pki.path("ca.crt").display()
        ),
    );
    let g = GatewayGuard::start(&trusted);
    let token = es.sign(&claims(ISS, AUD, "tls-user"));
    let r = get(&g, "/r", &token);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(server.fetches() >= 1);
    // Without the CA file the endpoint's certificate is not trusted: no
    // keys, so the token cannot be checked (503), and the log says why.
    let g2 = GatewayGuard::start(&cfg);
    let r = get(&g2, "/r", &token);
    assert_eq!(r.status, 503, "{}", r.text());
    let log = g2.log();
    assert!(
        log.contains("jwks: fetch failed") && log.contains("TLS"),
        "{log}"
    );
}

/// The first requests after start-up arrive while the start-up fetch of
/// the JWKS is on its way: they wait for it and are served, rather than
/// being told the keys are unavailable (found by the ten runs: under load
/// the fetch took long enough for a request to give up on it).
#[test]
fn a_request_waits_for_the_fetch_already_on_its_way() {
    let redis = RedisGuard::start();
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    server.set_delay(1500);
    let cfg = config(&redis, &up, &server.url(), "", 100, 300);
    let g = GatewayGuard::start(&cfg);
    let t0 = Instant::now();
    let r = get(&g, "/r", &rsa.sign(&claims(ISS, AUD, "early")));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        server.fetches(),
        1,
        "one fetch: the start-up one, waited for"
    );
    println!(
        "first token while the start-up fetch was on its way: 200 after {:.0} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
}
