//! The expensive part of a bearer JWT: its signature, checked against the
//! key its header named, once the caller has paid for it (`Unchecked`),
//! and `jsonwebtoken`'s refusals told as the gateway's reasons.

use std::sync::Arc;

use jsonwebtoken::errors::ErrorKind;
use serde_json::{Map, Value};

use super::{cache, KeySet, TokenError, Verified, Verifier};

/// A token whose header names a trusted issuer, an algorithm it accepts
/// and a key it holds, not yet checked against that key: the expensive
/// part, left to the caller so that it can charge for it first.
pub struct Unchecked<'a> {
    pub(super) verifier: &'a Verifier,
    pub(super) token: &'a [u8],
    pub(super) digest: cache::Digest,
    pub(super) issuer: usize,
    pub(super) alg: jsonwebtoken::Algorithm,
    pub(super) kid: Option<String>,
    pub(super) keys: Arc<KeySet>,
    pub(super) now_secs: u64,
}

impl Unchecked<'_> {
    /// The signature (each key tried counts in
    /// `gateway_jwt_signature_checks_total`) and the claims; a verified
    /// token is cached, a refused one counted by its reason.
    pub fn check(self) -> Result<Arc<Verified>, TokenError> {
        let result = self.signed_claims();
        match &result {
            Ok(v) => {
                self.verifier
                    .cache
                    .insert(self.digest, v.clone(), self.now_secs);
                // A miss paid a signature check: counting shards is cheap beside it.
                crate::metrics::jwt_cached(self.verifier.cache.len());
            }
            Err(e) => crate::metrics::jwt_refused(e.label()),
        }
        result
    }

    fn signed_claims(&self) -> Result<Arc<Verified>, TokenError> {
        let v = self.verifier;
        let issuer = &v.issuers[self.issuer];
        let validation = issuer
            .validations
            .iter()
            .find(|(a, _)| *a == self.alg)
            .map(|(_, v)| v)
            .ok_or_else(|| TokenError::Algorithm(format!("{:?}", self.alg)))?;
        let candidates = self
            .keys
            .candidates(self.kid.as_deref(), self.alg)
            .map_err(|_| TokenError::UnknownKid)?;
        let mut last = TokenError::BadSignature;
        for key in candidates {
            crate::metrics::jwt_signature_checked();
            match jsonwebtoken::decode::<Map<String, Value>>(self.token, &key.key, validation) {
                Ok(data) => {
                    return v
                        .verified(self.issuer, key.kid.clone(), data.claims)
                        .map(Arc::new)
                }
                Err(e) => {
                    last = refusal(e.kind());
                    if last != TokenError::BadSignature {
                        break;
                    }
                }
            }
        }
        Err(last)
    }
}

fn refusal(kind: &ErrorKind) -> TokenError {
    match kind {
        ErrorKind::InvalidSignature => TokenError::BadSignature,
        ErrorKind::ExpiredSignature => TokenError::Expired,
        ErrorKind::ImmatureSignature => TokenError::NotYetValid,
        ErrorKind::InvalidAudience => TokenError::Audience,
        ErrorKind::InvalidIssuer => TokenError::Issuer,
        ErrorKind::InvalidAlgorithm => TokenError::KeyMismatch,
        ErrorKind::MissingRequiredClaim(c) if c == "aud" => TokenError::Audience,
        ErrorKind::MissingRequiredClaim(c) => TokenError::MissingClaim(c.clone()),
        ErrorKind::InvalidClaimFormat(_) => TokenError::Malformed("a time claim is not a number"),
        _ => TokenError::Malformed("it cannot be decoded"),
    }
}
