//! The edges of JWT identity a user found, against real gateways (local
//! backend) and a JWKS endpoint of the test's own: a header carrying `crit`
//! is refused before any signature check; a flood of forged tokens naming
//! a trusted `kid` is bounded by the per-IP tier, its signature checks
//! counted and stopping when the tier refuses; a flood of 401s writes a
//! bounded access log while a lone 401 is written; and `/limits` and
//! `gateway limits` name a token's client by `sub` and report the buckets
//! its requests are charged to.

use crate::support;

use jsonwebtoken::{Algorithm, Header};
use serde_json::{json, Value};
use support::issuer::{claims, jwks, JwksServer, SigningKey};
use support::{wait_for, GatewayGuard, RedisGuard, UpstreamGuard, SERVER};

const ISS: &str = "https://issuer.test/";
const AUD: &str = "api.test";

/// One JWKS issuer (RS256; plan claim `plan`, `gold` mapping to pro,
/// default free: 5 a burst, pro 50), route `/r` needing a credential and
/// route `/s` limited per client to 10 a day; `extra` for more tables.
fn config(jwks_url: &str, up: &UpstreamGuard, extra: &str) -> String {
    format!(
        r#"
{SERVER}

[limiter]
backend = "local"
retry_after_jitter_ms = 0

[plans.free]
capacity = 5
refill_per_sec = 0.001

[plans.pro]
capacity = 50
refill_per_sec = 0.001
quotas = [{{ limit = 1000, period = "day" }}]

[[auth.jwt.issuers]]
issuer = "{ISS}"
jwks_url = "{jwks_url}"
audiences = ["{AUD}"]
algorithms = ["RS256"]
plan_claim = "plan"
plan_map = {{ gold = "pro" }}
default_plan = "free"
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
limit = {{ algorithm = "fixed_window", limit = 10, window_secs = 86400 }}
"#,
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

/// A token signed by `key` whose header is `header` as given (`kid` and
/// `alg` added), which `jsonwebtoken` itself would not write.
fn with_header(key: &SigningKey, mut header: Value, claims: &Value) -> String {
    use base64::Engine as _;
    header["alg"] = json!("RS256");
    header["kid"] = json!(key.kid);
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let msg = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let sig =
        jsonwebtoken::crypto::sign(msg.as_bytes(), &key.encoding, Algorithm::RS256).expect("sign");
    format!("{msg}.{sig}")
}

/// The token with one character of its signature changed, in its middle.
fn tampered(token: &str) -> String {
    let mut b = token.as_bytes().to_vec();
    let i = b.len() - 40;
    b[i] = if b[i] == b'A' { b'B' } else { b'A' };
    String::from_utf8(b).expect("ascii")
}

fn signature_checks(g: &GatewayGuard) -> f64 {
    g.metric("gateway_jwt_signature_checks_total")
}

#[test]
fn a_header_with_crit_is_refused_for_its_reason_before_any_signature_check() {
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    let g = GatewayGuard::start(&config(&server.url(), &up, ""));

    // The same token without crit is good: the header is the only fault.
    let good = with_header(&rsa, json!({"typ": "JWT"}), &claims(ISS, AUD, "ann"));
    assert_eq!(get(&g, "/r", &good).status, 200);
    // jsonwebtoken writes crit when asked: the issue's own token.
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some(rsa.kid.clone());
    h.crit = Some(vec!["exp2".into()]);
    let issue = jsonwebtoken::encode(&h, &claims(ISS, AUD, "ann"), &rsa.encoding).expect("sign");
    let checks_before = signature_checks(&g);
    let cases = [
        ("an unknown extension", issue, "names an extension"),
        (
            "an extension present and listed",
            with_header(
                &rsa,
                json!({"crit": ["exp2"], "exp2": 1}),
                &claims(ISS, AUD, "ann"),
            ),
            "names an extension",
        ),
        (
            "an empty crit",
            with_header(&rsa, json!({"crit": []}), &claims(ISS, AUD, "ann")),
            "is empty",
        ),
        (
            "a registered name",
            with_header(&rsa, json!({"crit": ["kid"]}), &claims(ISS, AUD, "ann")),
            "names a header parameter JWS itself defines",
        ),
        (
            "not an array",
            with_header(&rsa, json!({"crit": "exp2"}), &claims(ISS, AUD, "ann")),
            "is not a list of header names",
        ),
    ];
    for (what, token, why) in &cases {
        let r = get(&g, "/r", token);
        assert_eq!(r.status, 401, "{what}: {}", r.text());
        let challenge = r.header("www-authenticate").unwrap_or_default().to_string();
        assert!(
            challenge.contains(&format!("crit {why}")) && r.text().contains("crit"),
            "{what}: {challenge} / {}",
            r.text()
        );
        println!("{what}: 401 {challenge}");
    }
    assert_eq!(
        g.metric("gateway_jwt_refusals_total{reason=\"crit\"}"),
        cases.len() as f64
    );
    assert_eq!(
        signature_checks(&g),
        checks_before,
        "a crit header is refused before its signature is checked"
    );
    assert!(g.log().contains("rejected_by=\"token:crit\""));
}

#[test]
fn a_flood_of_forged_tokens_is_bounded_by_the_ip_tier() {
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    let ip_tier =
        "[tiers.ip]\nalgorithm = \"token_bucket\"\ncapacity = 10\nrefill_per_sec = 0.001\n";
    let local = config(&server.url(), &up, ip_tier);
    flood(&GatewayGuard::start(&local), &rsa, "local");
    // On Redis (without leases, so /limits's remaining is all of the bucket).
    let redis = RedisGuard::start();
    let on_redis = format!(
        "{ip_tier}\n[redis]\nurls = [\"{}\"]\n\n[limiter.leases]\nenabled = false\n",
        redis.url()
    );
    let on_redis =
        config(&server.url(), &up, &on_redis).replace("backend = \"local\"", "backend = \"redis\"");
    flood(&GatewayGuard::start(&on_redis), &rsa, "redis");
}

/// A good token, then 40 forged ones, from one address under an ip tier of 10.
fn flood(g: &GatewayGuard, rsa: &SigningKey, backend: &str) {
    let ip_remaining = |g: &GatewayGuard| {
        let v = g.admin_get("/limits?ip=127.0.0.1").json();
        v["buckets"][0]["remaining"]
            .as_u64()
            .unwrap_or_else(|| panic!("no ip bucket: {v}"))
    };

    // A good token not seen before: its signature check is paid for and
    // given back, so the request costs the ip tier one token, as any other.
    let good = rsa.sign(&claims(ISS, AUD, "ann"));
    assert_eq!(get(g, "/r", &good).status, 200);
    assert_eq!(ip_remaining(g), 9, "one token for one request");
    assert_eq!(signature_checks(g), 1.0);
    // Cached: no check, one token.
    assert_eq!(get(g, "/r", &good).status, 200);
    assert_eq!((ip_remaining(g), signature_checks(g)), (8, 1.0));

    // Forged tokens naming the trusted kid, each different: a check each
    // while the tier has tokens (each 401 costs one), then its 429.
    let mut statuses = Vec::new();
    let mut checks_seen = Vec::new();
    for i in 0..40 {
        let forged = tampered(&rsa.sign(&claims(ISS, AUD, &format!("flood-{i}"))));
        let r = get(g, "/r", &forged);
        if r.status == 429 {
            assert!(r.text().contains("\"ip\""), "the ip tier: {}", r.text());
        }
        statuses.push(r.status);
        checks_seen.push(signature_checks(g));
    }
    let unauthorized = statuses.iter().filter(|s| **s == 401).count();
    let limited = statuses.iter().filter(|s| **s == 429).count();
    println!(
        "FIGURES flood ({backend}): 40 forged tokens from one address: {unauthorized} x 401, {limited} x 429; signature checks {} (1 before the flood)",
        signature_checks(g)
    );
    assert_eq!(
        &statuses[..8],
        &[401; 8],
        "the ip tier's 8 tokens left: {statuses:?}"
    );
    assert!(statuses[8..].iter().all(|s| *s == 429), "{statuses:?}");
    assert_eq!(signature_checks(g), 9.0, "1 + one per 401");
    assert!(
        checks_seen[8..].iter().all(|c| *c == 9.0),
        "no check once the tier refuses: {checks_seen:?}"
    );
    assert_eq!(
        g.metric("gateway_jwt_refusals_total{reason=\"signature\"}"),
        8.0
    );
    wait_for("the 429 lines", std::time::Duration::from_secs(5), || {
        g.log()
            .lines()
            .any(|l| l.contains("status=429") && l.contains("rejected_by=\"ip\""))
            .then_some(())
    });
    // The good token is of the same address: it waits for the tier too.
    assert_eq!(get(g, "/r", &good).status, 429);
}

#[test]
fn a_flood_of_401s_writes_a_bounded_log_and_a_lone_one_is_written() {
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    let g = GatewayGuard::start(&config(&server.url(), &up, "[log]\nrefusals_per_sec = 5\n"));
    // Tokens of an issuer the gateway does not trust, refused before any
    // signature check: a flood the client can send quickly.
    let stranger = |i: usize| {
        use base64::Engine as _;
        let b64 = |v: Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
        format!(
            "{}.{}.c2ln",
            b64(json!({"alg": "RS256", "kid": "rsa-1"})),
            b64(claims("https://elsewhere.test/", AUD, &format!("x{i}")))
        )
    };
    let lines = |g: &GatewayGuard| {
        g.log()
            .lines()
            .filter(|l| l.contains("request_id=") && l.contains(" status=401"))
            .count() as u64
    };

    // The seconds the lone 401 and the flood touch bound the lines written.
    let started = std::time::Instant::now();
    assert_eq!(get(&g, "/r", &stranger(0)).status, 401);
    wait_for(
        "the lone 401's line",
        std::time::Duration::from_secs(5),
        || (lines(&g) == 1).then_some(()),
    );

    let mut c = g.client();
    let sent = 1000;
    for i in 1..=sent {
        let auth = format!("Bearer {}", stranger(i));
        let r = c
            .request("GET", "/r", &[("authorization", &auth)], b"")
            .expect("request");
        assert_eq!(r.status, 401);
    }
    let secs = started.elapsed().as_secs() + 2;
    let counted =
        |g: &GatewayGuard| g.metric("gateway_requests_total{route=\"r\",status=\"401\"}") as u64;
    wait_for(
        "every 401 counted",
        std::time::Duration::from_secs(5),
        || (counted(&g) == sent as u64 + 1).then_some(()),
    );
    let left_out = g.metric("gateway_access_log_left_out_total") as u64;
    let written = lines(&g);
    println!(
        "FIGURES 401 flood: {} refusals within {secs} clock seconds, {written} lines written, {left_out} left out",
        sent + 1
    );
    assert!(
        written <= 5 * secs && written * 10 < sent as u64,
        "{written} lines for {sent} 401s"
    );
    assert_eq!(written + left_out, sent as u64 + 1, "written + left out");
}

#[test]
fn limits_name_a_tokens_client_by_sub_as_its_requests_are_limited() {
    let up = UpstreamGuard::start();
    let rsa = SigningKey::new("rsa-1", Algorithm::RS256);
    let server = JwksServer::start(jwks(&[&rsa]));
    let g = GatewayGuard::start(&config(&server.url(), &up, ""));
    let ann = rsa.sign(&claims(ISS, AUD, "ann"));
    let mut gold = claims(ISS, AUD, "dee");
    gold["plan"] = json!("gold");
    let dee = rsa.sign(&gold);
    for _ in 0..2 {
        assert_eq!(get(&g, "/s", &ann).status, 200);
    }
    let r = get(&g, "/r", &dee);
    assert_eq!(r.status, 200);
    let dee_left: u64 = r
        .header("x-ratelimit-remaining")
        .and_then(|v| v.parse().ok())
        .expect("remaining");

    let bucket = |v: &Value, tier: &str, route: Value| -> Value {
        v["buckets"]
            .as_array()
            .and_then(|l| l.iter().find(|b| b["tier"] == tier && b["route"] == route))
            .cloned()
            .unwrap_or_else(|| panic!("no {tier} bucket for {route} in {v}"))
    };
    let v = g.admin_get("/limits?sub=ann").json();
    println!("/limits?sub=ann: {v}");
    assert_eq!(bucket(&v, "key", Value::Null)["limit"], 5, "free");
    assert_eq!(bucket(&v, "key", Value::Null)["remaining"], 3);
    assert_eq!(bucket(&v, "route", json!("s"))["remaining"], 8);
    assert_eq!(bucket(&v, "route", json!("s"))["limit"], 10);
    let iss = ISS.replace(':', "%3A").replace('/', "%2F");
    let v2 = g
        .admin_get(&format!("/limits?sub=ann&iss={iss}&route=s"))
        .json();
    assert_eq!(v2["buckets"][0]["remaining"], 8, "{v2}");
    // dee's token names gold: pro's bucket and its quota.
    let v = g.admin_get("/limits?sub=dee&plan=gold").json();
    let key = bucket(&v, "key", Value::Null);
    assert_eq!(
        (key["limit"].as_u64(), key["remaining"].as_u64()),
        (Some(50), Some(dee_left)),
        "as the request was told: {v}"
    );
    let q = g.admin_get("/limits?sub=dee&plan=gold&quota=day").json();
    assert_eq!(q["buckets"][0]["used"], 1, "{q}");
    // Asked without the plan, dee is on the default plan: an unused bucket.
    let v = g.admin_get("/limits?sub=dee").json();
    assert_eq!(bucket(&v, "key", Value::Null)["remaining"], 5);
    // Questions that cannot be answered say why.
    let r = g.admin_get("/limits?sub=ann&iss=https%3A%2F%2Fnope.test%2F");
    assert_eq!(r.status, 404);
    assert!(
        r.text().contains("no [[auth.jwt.issuers]] has issuer"),
        "{}",
        r.text()
    );
    let r = g.admin_get("/limits?sub=ann&plan=platinum");
    assert_eq!(r.status, 404);
    assert!(r.text().contains("plan \\\"platinum\\\""), "{}", r.text());
    assert_eq!(g.admin_get("/limits?iss=x").status, 400);

    // The shell: the same buckets, and a reset that frees ann.
    let (code, out, err) = support::gateway_cli(
        &["limits", "show", "--sub", "ann", "--json"],
        &g.config_path,
    );
    assert_eq!(code, Some(0), "{err}");
    let shown: Value = serde_json::from_str(out.trim()).expect("json");
    assert_eq!(bucket(&shown, "route", json!("s"))["remaining"], 8);
    let (code, _, err) = support::gateway_cli(
        &["limits", "reset", "--sub", "ann", "--route", "s"],
        &g.config_path,
    );
    assert_eq!(code, Some(0), "{err}");
    let v = g.admin_get("/limits?sub=ann&route=s").json();
    assert_eq!(v["buckets"][0]["remaining"], 10, "{v}");
    let (code, _, err) = support::gateway_cli(&["limits", "show", "--issuer", ISS], &g.config_path);
    assert_eq!(code, Some(2), "--issuer needs --sub: {err}");
}
