//! Verified JWTs as the client's identity (`[auth.jwt]`).
//!
//! A bearer token shaped like a JWS (`header.payload.signature`) is checked
//! against the issuer its `iss` names: the algorithm must be one the issuer
//! accepts and fit the key its `kid` names; the signature, `exp` and `nbf`
//! (with the leeway), `iss` and `aud` are checked by `jsonwebtoken`. The
//! verified claims then name the key tier's client (`id_claim`), its plan
//! (`plan_claim`, through `plan_map`, else `default_plan`) and the values
//! route limits key on (`key = "claim:NAME"`).
//!
//! A header with `crit` is refused before anything else (`header`): the
//! gateway understands no JWS extension.
//!
//! Signature checks are the expensive part, so a verified token is kept by
//! its hash until it expires (`cache`), and one that needs a check comes
//! back `Unchecked` for the caller to check when it will pay for it (the
//! request path charges the client's address first). Keys come from files
//! read with the config, or from a JWKS endpoint kept fresh by `source`.

mod cache;
mod check;
pub mod fetch;
mod header;
pub mod keys;
pub mod source;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use jsonwebtoken::Validation;
use serde_json::{Map, Value};
use sha2::{Digest as _, Sha256};

use crate::clock::Clock as _;
use crate::config::{JwtIssuer, JwtKeys, JwtSettings};
use crate::identity::value::{AttributeError, MAX_VALUE_BYTES};
use cache::Cache;
pub use check::Unchecked;
use keys::{KeySet, Missing};
use source::{Source, Unusable};

/// A token the gateway verified: who it names and what routes read of it.
#[derive(Debug)]
pub struct Verified {
    /// The key tier's bucket identity: `j:` + a tag of the issuer + the id,
    /// so two issuers' `sub`s never share a bucket.
    pub identity: String,
    /// The `id_claim`'s value (logs show it as `jwt:ID`).
    pub id: String,
    pub plan: String,
    /// The values of the claims route limits key on, read once.
    claims: Vec<(String, Result<String, AttributeError>)>,
    exp: u64,
    leeway: u64,
    issuer: usize,
    kid: Option<String>,
}

impl Verified {
    /// A route's `claim:NAME`: its value as text (a string, or a number or
    /// boolean as JSON writes it).
    pub fn claim(&self, name: &str) -> Result<String, AttributeError> {
        self.claims
            .iter()
            .find(|(n, _)| n == name)
            .map_or(Err(AttributeError::Missing), |(_, v)| v.clone())
    }

    fn usable_at(&self, now_secs: u64) -> bool {
        now_secs <= self.exp.saturating_add(self.leeway)
    }
}

/// Why a token is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    Malformed(&'static str),
    /// An algorithm the issuer does not accept (or `none`).
    Algorithm(String),
    NoIssuer,
    UnknownIssuer,
    /// No key of the issuer has this `kid` (after a refetch).
    UnknownKid,
    /// The named key is of another algorithm than the token's.
    KeyMismatch,
    BadSignature,
    Expired,
    NotYetValid,
    Audience,
    Issuer,
    MissingClaim(String),
    /// The header lists critical extensions (`crit`), which the gateway
    /// never understands; the text says which rule of RFC 7515 §4.1.11
    /// the list broke.
    Critical(&'static str),
    /// The issuer's keys are not there to check with (never fetched, or
    /// older than `jwks_max_stale_secs`): the token is not known bad.
    KeysUnavailable,
}

impl TokenError {
    /// 401, except when the gateway cannot tell (503).
    pub fn status(&self) -> u16 {
        match self {
            TokenError::KeysUnavailable => 503,
            _ => 401,
        }
    }

    /// A short label for metrics and the access log.
    pub fn label(&self) -> &'static str {
        match self {
            TokenError::Malformed(_) => "malformed",
            TokenError::Algorithm(_) => "algorithm",
            TokenError::NoIssuer | TokenError::UnknownIssuer | TokenError::Issuer => "issuer",
            TokenError::UnknownKid | TokenError::KeyMismatch => "key",
            TokenError::BadSignature => "signature",
            TokenError::Expired => "expired",
            TokenError::NotYetValid => "not_yet_valid",
            TokenError::Audience => "audience",
            TokenError::MissingClaim(_) => "claim",
            TokenError::Critical(_) => "crit",
            TokenError::KeysUnavailable => "keys_unavailable",
        }
    }

    pub const LABELS: &'static [&'static str] = &[
        "malformed",
        "algorithm",
        "issuer",
        "key",
        "signature",
        "expired",
        "not_yet_valid",
        "audience",
        "claim",
        "crit",
        "keys_unavailable",
    ];
}

impl fmt::Display for TokenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenError::Malformed(what) => write!(f, "malformed token: {what}"),
            TokenError::Algorithm(a) => write!(f, "algorithm {a} is not accepted"),
            TokenError::NoIssuer => f.write_str("the token has no iss"),
            TokenError::UnknownIssuer => f.write_str("the token's issuer is not trusted"),
            TokenError::UnknownKid => f.write_str("no key of the issuer signed it"),
            TokenError::KeyMismatch => f.write_str("the algorithm does not fit the key"),
            TokenError::BadSignature => f.write_str("bad signature"),
            TokenError::Expired => f.write_str("the token has expired"),
            TokenError::NotYetValid => f.write_str("the token is not valid yet"),
            TokenError::Audience => f.write_str("the token is not meant for this audience"),
            TokenError::Issuer => f.write_str("the token's iss does not match"),
            TokenError::MissingClaim(c) => write!(f, "the token has no usable {c} claim"),
            TokenError::Critical(what) => write!(
                f,
                "the header's crit {what}: the gateway understands no JWS extension"
            ),
            TokenError::KeysUnavailable => {
                f.write_str("the issuer's keys are unavailable; the token cannot be checked")
            }
        }
    }
}

/// What `verify` came to.
pub enum Outcome<'a> {
    Verified(Arc<Verified>),
    Refused(TokenError),
    /// The issuer's keys lack what the token needs: fetch them
    /// (`Source::refetch`), then verify again with `fetched = true`.
    Fetch(Arc<Source>),
    /// Everything but the signature holds up so far: `Unchecked::check`.
    Unchecked(Unchecked<'a>),
}

/// Where an issuer's keys are.
enum Keys {
    Files(Arc<KeySet>),
    Fetched(Arc<Source>),
}

struct Issuer {
    settings: JwtIssuer,
    tag: String,
    /// One per accepted algorithm: `jsonwebtoken` wants every algorithm
    /// of a validation to be of the key's family.
    validations: Vec<(jsonwebtoken::Algorithm, Validation)>,
    keys: Keys,
}

fn validation(settings: &JwtIssuer, alg: jsonwebtoken::Algorithm) -> Validation {
    let mut v = Validation::new(alg);
    v.leeway = settings.leeway_secs;
    v.validate_nbf = true;
    v.set_issuer(&[&settings.issuer]);
    let mut required = vec!["exp", "iss"];
    if settings.audiences.is_empty() {
        v.validate_aud = false;
    } else {
        v.set_audience(&settings.audiences);
        required.push("aud");
    }
    v.set_required_spec_claims(&required);
    v
}

impl Issuer {
    /// `files`: the keys read from its `key_files` (`Credentials`).
    fn new(settings: &JwtIssuer, files: Option<Arc<KeySet>>) -> Issuer {
        Issuer {
            tag: issuer_tag(&settings.issuer),
            validations: settings
                .algorithms
                .iter()
                .map(|a| (*a, validation(settings, *a)))
                .collect(),
            keys: match &settings.keys {
                JwtKeys::Files { .. } => Keys::Files(files.unwrap_or_default()),
                JwtKeys::Url(url) => Keys::Fetched(source::source_for(url, &settings.issuer)),
            },
            settings: settings.clone(),
        }
    }

    fn keys(&self, now: Instant) -> Result<Arc<KeySet>, Unusable> {
        match &self.keys {
            Keys::Files(k) => Ok(k.clone()),
            Keys::Fetched(s) => s.keys(now),
        }
    }
}

/// The issuers of one config, and the tokens they signed that were seen.
pub struct Verifier {
    issuers: Vec<Issuer>,
    by_iss: HashMap<String, usize>,
    /// The claims route limits key on.
    route_claims: Vec<String>,
    /// The config's plans: a plan claim may name one directly.
    plans: std::collections::HashSet<String>,
    cache: Cache,
}

impl Verifier {
    /// `files`: each issuer's keys read from its `key_files`, by index
    /// (`Credentials::jwt_files`).
    pub fn new<'a>(
        settings: &JwtSettings,
        files: &[Option<Arc<KeySet>>],
        route_claims: Vec<String>,
        plans: impl IntoIterator<Item = &'a String>,
    ) -> Verifier {
        let issuers: Vec<Issuer> = settings
            .issuers
            .iter()
            .enumerate()
            .map(|(i, x)| Issuer::new(x, files.get(i).cloned().flatten()))
            .collect();
        Verifier {
            by_iss: issuers
                .iter()
                .enumerate()
                .map(|(i, x)| (x.settings.issuer.clone(), i))
                .collect(),
            issuers,
            route_claims,
            plans: plans.into_iter().cloned().collect(),
            cache: Cache::new(settings.cache_max_entries),
        }
    }

    /// How many verified tokens are kept.
    pub fn cached(&self) -> usize {
        self.cache.len()
    }

    /// Checks `token` at `now_secs` (Unix seconds) as far as it can
    /// without its signature: a token verified before comes from the
    /// cache, one that needs a signature check comes back `Unchecked`.
    /// `fetched`: the issuer's keys were just fetched for it, so a key
    /// still missing is final.
    pub fn verify<'a>(&'a self, token: &'a [u8], now_secs: u64, fetched: bool) -> Outcome<'a> {
        let digest = cache::Digest(Sha256::digest(token).into());
        let now = Instant::now();
        if let Some(v) = self.cache.get(&digest) {
            let issuer = &self.issuers[v.issuer];
            let key_kept = issuer.keys(now).is_ok_and(|k| k.has_kid(v.kid.as_deref()));
            if v.usable_at(now_secs) && key_kept {
                return Outcome::Verified(v);
            }
            self.cache.remove(&digest);
        }
        match self.unchecked(token, digest, now, now_secs, fetched) {
            Ok(u) => Outcome::Unchecked(u),
            Err(Err(source)) => Outcome::Fetch(source),
            Err(Ok(e)) => Outcome::Refused(e),
        }
    }

    /// An uncached token as far as its header goes: its issuer,
    /// algorithm and a key of the issuer's that fits it. `Err(Err(source))`
    /// when its issuer's keys must be fetched first.
    fn unchecked<'a>(
        &'a self,
        token: &'a [u8],
        digest: cache::Digest,
        now: Instant,
        now_secs: u64,
        fetched: bool,
    ) -> Result<Unchecked<'a>, Result<TokenError, Arc<Source>>> {
        header::critical(token).map_err(Ok)?;
        let header =
            jsonwebtoken::decode_header(token).map_err(|_| Ok(header::bad_header(token)))?;
        #[derive(serde::Deserialize)]
        struct Iss {
            iss: Option<Value>,
        }
        let iss = jsonwebtoken::dangerous::insecure_decode_claims::<Iss>(token)
            .map_err(|_| Ok(TokenError::Malformed("the payload is not a JSON object")))?
            .iss;
        let i = match &iss {
            Some(Value::String(s)) => *self.by_iss.get(s).ok_or(Ok(TokenError::UnknownIssuer))?,
            _ => return Err(Ok(TokenError::NoIssuer)),
        };
        let issuer = &self.issuers[i];
        if !issuer.validations.iter().any(|(a, _)| *a == header.alg) {
            return Err(Ok(TokenError::Algorithm(format!("{:?}", header.alg))));
        }
        let fetch = |e: TokenError| match (&issuer.keys, fetched) {
            (Keys::Fetched(s), false) => Err(s.clone()),
            _ => Ok(e),
        };
        let keys = issuer
            .keys(now)
            .map_err(|_| fetch(TokenError::KeysUnavailable))?;
        keys.candidates(header.kid.as_deref(), header.alg)
            .map_err(|m| match m {
                Missing::Kid => fetch(TokenError::UnknownKid),
                Missing::Mismatch => Ok(TokenError::KeyMismatch),
                Missing::NoKey => Ok(TokenError::UnknownKid),
            })?;
        Ok(Unchecked {
            verifier: self,
            token,
            digest,
            issuer: i,
            alg: header.alg,
            kid: header.kid,
            keys,
            now_secs,
        })
    }

    fn verified(
        &self,
        i: usize,
        kid: Option<String>,
        claims: Map<String, Value>,
    ) -> Result<Verified, TokenError> {
        let issuer = &self.issuers[i];
        let s = &issuer.settings;
        let id = claims
            .get(&s.id_claim)
            .and_then(|v| text(v).ok())
            .ok_or_else(|| TokenError::MissingClaim(s.id_claim.clone()))?;
        let named = s
            .plan_claim
            .as_ref()
            .and_then(|c| claims.get(c))
            .and_then(|v| v.as_str());
        let plan = named
            .and_then(|p| plan_named(s, p, |p| self.plans.contains(p)))
            .unwrap_or_else(|| s.default_plan.clone());
        let exp = claims.get("exp").and_then(Value::as_u64).unwrap_or(0);
        Ok(Verified {
            identity: identity(&issuer.tag, &id),
            id,
            plan,
            claims: self
                .route_claims
                .iter()
                .map(|c| {
                    let v = claims.get(c).map_or(Err(AttributeError::Missing), text);
                    (c.clone(), v)
                })
                .collect(),
            exp,
            leeway: s.leeway_secs,
            issuer: i,
            kid,
        })
    }
}

/// An issuer's tag in its clients' bucket identities: the first four bytes
/// of its `iss`'s SHA-256, so two issuers' ids never share a bucket.
fn issuer_tag(iss: &str) -> String {
    hex::encode(&Sha256::digest(iss.as_bytes())[..4])
}

fn identity(tag: &str, id: &str) -> String {
    format!("j:{tag}:{id}")
}

/// The key tier's bucket identity of the client that issuer `iss`'s tokens
/// name `id` (`Verified::identity`): how `/limits` names it.
pub fn client_identity(iss: &str, id: &str) -> String {
    identity(&issuer_tag(iss), id)
}

/// The plan a token whose plan claim says `named` is held to: `plan_map`'s,
/// else the config's plan of that name (`is_plan`); `None` for neither
/// (the token then has the issuer's `default_plan`).
pub fn plan_named(
    settings: &JwtIssuer,
    named: &str,
    is_plan: impl Fn(&str) -> bool,
) -> Option<String> {
    match settings.plan_map.get(named) {
        Some(mapped) => Some(mapped.clone()),
        None => is_plan(named).then(|| named.to_string()),
    }
}

/// A claim's value as a bucket name: a string as it is, a number or a
/// boolean as JSON writes it; never empty, never longer than an
/// attribute may be.
fn text(v: &Value) -> Result<String, AttributeError> {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        _ => return Err(AttributeError::Unreadable),
    };
    match s.len() {
        0 => Err(AttributeError::Missing),
        n if n > MAX_VALUE_BYTES => Err(AttributeError::TooLong),
        _ => Ok(s),
    }
}

/// A bearer token's verdict as far as it goes without a signature check.
pub enum Verdict<'a> {
    /// Verified before (from the cache), or refused on its face.
    Known(Result<Arc<Verified>, TokenError>),
    /// Its signature is still to be checked: `Unchecked::check`.
    Unchecked(Unchecked<'a>),
}

/// The verdict on a bearer token short of a signature check. A token whose
/// issuer's keys lack its `kid` (or were never fetched, or are too old)
/// waits for one fetch of them, shared with every request waiting on the
/// same endpoint.
pub async fn verdict<'a>(verifier: &'a Verifier, token: &'a [u8]) -> Verdict<'a> {
    let now = || (crate::clock::SystemClock.now_us() / 1_000_000).max(0) as u64;
    let outcome = match verifier.verify(token, now(), false) {
        Outcome::Fetch(source) => {
            source.refetch().await;
            verifier.verify(token, now(), true)
        }
        done => done,
    };
    let known = match outcome {
        Outcome::Unchecked(u) => return Verdict::Unchecked(u),
        Outcome::Verified(v) => Ok(v),
        Outcome::Refused(e) => Err(e),
        Outcome::Fetch(_) => Err(TokenError::KeysUnavailable),
    };
    if let Err(e) = &known {
        crate::metrics::jwt_refused(e.label());
    }
    Verdict::Known(known)
}

/// Whether a bearer credential is a JWT rather than an API key: three
/// base64url parts, the first a JSON object (`eyJ` is `{"`).
pub fn looks_like_jwt(v: &[u8]) -> bool {
    v.starts_with(b"eyJ")
        && v.iter().filter(|b| **b == b'.').count() == 2
        && v.iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'='))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
    use serde_json::json;

    use super::*;
    use crate::config::{JwtIssuer, JwtKeys, JwtSettings};

    const SECRET: &[u8] = b"a-test-secret-of-32-bytes-length";

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    fn verifier(algorithms: Vec<Algorithm>, route_claims: &[&str]) -> Verifier {
        let jwks = format!(
            r#"{{"keys": [{{"kty": "oct", "kid": "h1", "k": "{}"}}]}}"#,
            base64::Engine::encode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, SECRET)
        );
        let (keys, _) = KeySet::from_jwks(jwks.as_bytes()).unwrap();
        let issuer = JwtIssuer {
            issuer: "iss-a".into(),
            keys: JwtKeys::Files { paths: vec![] },
            audiences: vec!["api".into()],
            algorithms,
            leeway_secs: 5,
            id_claim: "sub".into(),
            plan_claim: Some("tier".into()),
            plan_map: BTreeMap::from([("gold".to_string(), "pro".to_string())]),
            default_plan: "free".into(),
        };
        let plans = ["free".to_string(), "pro".to_string(), "team".to_string()];
        Verifier::new(
            &JwtSettings {
                issuers: vec![issuer],
                cache_max_entries: 100,
            },
            &[Some(Arc::new(keys))],
            route_claims.iter().map(|s| s.to_string()).collect(),
            plans.iter(),
        )
    }

    fn token(claims: serde_json::Value, kid: Option<&str>) -> String {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = kid.map(str::to_string);
        encode(&h, &claims, &EncodingKey::from_secret(SECRET)).unwrap()
    }

    fn good(extra: serde_json::Value) -> serde_json::Value {
        let mut c = json!({"iss": "iss-a", "aud": "api", "sub": "u1", "exp": now() + 600});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    /// The token with one character of its signature changed (in the
    /// middle: a last character's spare bits would make it bad base64).
    fn tamper(t: &str) -> String {
        let mut b = t.as_bytes().to_vec();
        let i = t.rfind('.').unwrap() + 5;
        b[i] = if b[i] == b'A' { b'B' } else { b'A' };
        String::from_utf8(b).unwrap()
    }

    /// The verdict, its signature checked if it needs one.
    fn verdict(v: &Verifier, t: &str) -> Result<Arc<Verified>, TokenError> {
        match v.verify(t.as_bytes(), now(), false) {
            Outcome::Verified(x) => Ok(x),
            Outcome::Refused(e) => Err(e),
            Outcome::Unchecked(u) => u.check(),
            Outcome::Fetch(_) => panic!("asked for a fetch"),
        }
    }

    fn refused(v: &Verifier, t: &str) -> TokenError {
        verdict(v, t).map_or_else(|e| e, |x| panic!("verified {x:?}"))
    }

    fn verified(v: &Verifier, t: &str) -> Arc<Verified> {
        verdict(v, t).unwrap_or_else(|e| panic!("refused: {e}"))
    }

    #[test]
    fn claims_name_the_client_its_plan_and_route_values_and_are_cached() {
        let v = verifier(vec![Algorithm::HS256], &["tenant", "n"]);
        let t = token(
            good(json!({"tier": "gold", "tenant": "acme", "n": 7})),
            Some("h1"),
        );
        assert!(
            matches!(v.verify(t.as_bytes(), now(), false), Outcome::Unchecked(_)),
            "a token not seen before waits for its signature check"
        );
        let a = verified(&v, &t);
        assert!(
            a.identity.starts_with("j:") && a.identity.ends_with(":u1"),
            "{}",
            a.identity
        );
        assert_eq!((a.id.as_str(), a.plan.as_str()), ("u1", "pro"));
        assert_eq!(
            a.identity,
            client_identity("iss-a", "u1"),
            "as /limits names it"
        );
        assert_eq!(a.claim("tenant"), Ok("acme".into()));
        assert_eq!(a.claim("n"), Ok("7".into()), "a number as JSON writes it");
        assert_eq!(a.claim("other"), Err(AttributeError::Missing));
        let b = verified(&v, &t);
        assert!(Arc::ptr_eq(&a, &b), "the second time from the cache");
        assert_eq!(v.cached(), 1);
        // Plans: mapped, named directly, unknown (the default), absent.
        for (tier, plan) in [
            (json!("team"), "team"),
            (json!("platinum"), "free"),
            (json!(3), "free"),
        ] {
            let t = token(good(json!({"tier": tier})), None);
            assert_eq!(verified(&v, &t).plan, plan, "{tier}");
        }
        assert_eq!(verified(&v, &token(good(json!({})), None)).plan, "free");
        // A numeric sub is an id too; an object is not.
        assert_eq!(
            verified(&v, &token(good(json!({"sub": 42})), None)).id,
            "42"
        );
        // (jsonwebtoken itself stops at a `sub` that is not text.)
        assert!(matches!(
            refused(&v, &token(good(json!({"sub": {"a": 1}})), None)),
            TokenError::Malformed(_) | TokenError::MissingClaim(_)
        ));
        let long = "x".repeat(300);
        assert_eq!(
            refused(&v, &token(good(json!({"sub": long})), None)),
            TokenError::MissingClaim("sub".into())
        );
    }

    #[test]
    fn every_bad_token_is_refused_for_its_reason() {
        let v = verifier(vec![Algorithm::HS256], &[]);
        assert_eq!(
            refused(&v, &token(good(json!({"exp": now() - 60})), None)),
            TokenError::Expired
        );
        // Within the leeway: still good.
        verified(&v, &token(good(json!({"exp": now() - 2})), None));
        assert_eq!(
            refused(&v, &token(good(json!({"nbf": now() + 60})), None)),
            TokenError::NotYetValid
        );
        assert!(matches!(
            refused(&v, &token(good(json!({"nbf": "soon"})), None)),
            TokenError::Malformed(_)
        ));
        assert_eq!(
            refused(&v, &token(good(json!({"aud": "elsewhere"})), None)),
            TokenError::Audience
        );
        let mut no_aud = good(json!({}));
        no_aud.as_object_mut().unwrap().remove("aud");
        assert_eq!(refused(&v, &token(no_aud, None)), TokenError::Audience);
        let mut no_exp = good(json!({}));
        no_exp.as_object_mut().unwrap().remove("exp");
        assert_eq!(
            refused(&v, &token(no_exp, None)),
            TokenError::MissingClaim("exp".into())
        );
        assert_eq!(
            refused(&v, &token(good(json!({"iss": "iss-b"})), None)),
            TokenError::UnknownIssuer
        );
        assert_eq!(
            refused(&v, &token(good(json!({"iss": 5})), None)),
            TokenError::NoIssuer
        );
        assert_eq!(
            refused(&v, &token(good(json!({})), Some("h2"))),
            TokenError::UnknownKid,
            "a key file has no other keys to fetch"
        );
        assert_eq!(
            refused(&v, &tamper(&token(good(json!({})), None))),
            TokenError::BadSignature
        );
        // alg none, and an algorithm the issuer does not accept.
        let none = {
            use base64::Engine as _;
            let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
            format!(
                "{}.{}.",
                b(r#"{"alg":"none"}"#),
                b(&good(json!({})).to_string())
            )
        };
        assert_eq!(refused(&v, &none), TokenError::Algorithm("none".into()));
        let v384 = verifier(vec![Algorithm::HS384], &[]);
        assert_eq!(
            refused(&v384, &token(good(json!({})), None)),
            TokenError::Algorithm("HS256".into())
        );
        assert!(matches!(refused(&v, "eyJ.e30.x"), TokenError::Malformed(_)));
        // A validly signed token whose header lists a critical extension.
        let mut h = Header::new(Algorithm::HS256);
        h.crit = Some(vec!["exp2".into()]);
        let crit = encode(&h, &good(json!({})), &EncodingKey::from_secret(SECRET)).unwrap();
        assert_eq!(
            refused(&v, &crit),
            TokenError::Critical("names an extension")
        );
        assert_eq!(TokenError::Critical("is empty").label(), "crit");
        // Nothing refused was cached.
        assert_eq!(v.cached(), 1, "only the token within the leeway");
    }

    #[test]
    fn jwts_are_told_from_api_keys() {
        assert!(looks_like_jwt(b"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2ln"));
        assert!(!looks_like_jwt(b"gk_0123456789abcdef"));
        assert!(!looks_like_jwt(b"eyJ.only-one-dot"));
        assert!(!looks_like_jwt(b"eyJa.b.c.d"));
    }
}
