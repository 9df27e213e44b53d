//! The keys an issuer signs with, read from a JWKS document (its
//! `jwks_url`, or a key file holding one) or from PEM public keys, and the
//! choice of the key a token names.
//!
//! A token is checked only against a key of its algorithm's family that
//! does not name another algorithm: an HS256 token whose "secret" is an RSA
//! public key finds no HMAC key (algorithm confusion), whatever the issuer
//! accepts.

use jsonwebtoken::jwk::{Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};

/// One verification key.
pub struct Key {
    /// The JWK's `kid`; a PEM key has none.
    pub kid: Option<String>,
    /// The JWK's `alg`, when it pins one.
    pub alg: Option<Algorithm>,
    pub key: DecodingKey,
}

/// Every key of one issuer (a handful: a linear scan is the fastest).
#[derive(Default)]
pub struct KeySet {
    keys: Vec<Key>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kids: Vec<Option<&str>> = self.kids().collect();
        write!(f, "KeySet({kids:?})")
    }
}

/// Why no key can check a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Missing {
    /// The token names a `kid` the set lacks (a rotation not yet fetched).
    Kid,
    /// The named key is of another algorithm than the token's.
    Mismatch,
    /// No key of the token's algorithm (and the token names no `kid`).
    NoKey,
}

impl KeySet {
    pub fn new(keys: Vec<Key>) -> Self {
        KeySet { keys }
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn kids(&self) -> impl Iterator<Item = Option<&str>> + '_ {
        self.keys.iter().map(|k| k.kid.as_deref())
    }

    pub fn has_kid(&self, kid: Option<&str>) -> bool {
        self.keys.iter().any(|k| k.kid.as_deref() == kid)
    }

    /// The keys that may check a token of `alg` naming `kid`: the key of
    /// that `kid`, else the keys without a `kid` (PEM files) of the
    /// algorithm's family; for a token naming none, every key of the family.
    pub fn candidates(&self, kid: Option<&str>, alg: Algorithm) -> Result<Vec<&Key>, Missing> {
        let fits = |k: &Key| k.key.family() == alg.family() && k.alg.is_none_or(|a| a == alg);
        if let Some(kid) = kid {
            if let Some(k) = self.keys.iter().find(|k| k.kid.as_deref() == Some(kid)) {
                return if fits(k) {
                    Ok(vec![k])
                } else {
                    Err(Missing::Mismatch)
                };
            }
        }
        let unnamed: Vec<&Key> = self
            .keys
            .iter()
            .filter(|k| (kid.is_none() || k.kid.is_none()) && fits(k))
            .collect();
        match (unnamed.is_empty(), kid) {
            (false, _) => Ok(unnamed),
            (true, Some(_)) => Err(Missing::Kid),
            (true, None) => Err(Missing::NoKey),
        }
    }

    /// The keys of a JWKS document (`{"keys": [...]}`). A key this gateway
    /// cannot use (an encryption key, an unknown `kty`, a bad value) is
    /// left out and said why, so that one odd key does not take its
    /// issuer's others with it; a document that is not a JWKS is an error.
    pub fn from_jwks(json: &[u8]) -> Result<(KeySet, Vec<String>), String> {
        #[derive(serde::Deserialize)]
        struct Doc {
            keys: Vec<serde_json::Value>,
        }
        let doc: Doc = serde_json::from_slice(json)
            .map_err(|e| format!("not a JWKS document ({{\"keys\": [...]}}): {e}"))?;
        let mut keys = Vec::with_capacity(doc.keys.len());
        let mut skipped = Vec::new();
        for (i, v) in doc.keys.into_iter().enumerate() {
            match key_of(v) {
                Ok(Some(k)) => keys.push(k),
                Ok(None) => {}
                Err(e) => skipped.push(format!("keys[{i}]: {e}")),
            }
        }
        Ok((KeySet { keys }, skipped))
    }

    /// The key of a PEM file: an RSA (`PUBLIC KEY` or `RSA PUBLIC KEY`),
    /// EC or Ed25519 public key. A JWK file is read by `from_jwks`.
    pub fn from_pem(pem: &[u8]) -> Result<KeySet, String> {
        let key = DecodingKey::from_rsa_pem(pem)
            .or_else(|_| DecodingKey::from_ec_pem(pem))
            .or_else(|_| DecodingKey::from_ed_pem(pem))
            .map_err(|_| "not a PEM RSA, EC or Ed25519 public key".to_string())?;
        Ok(KeySet::new(vec![Key {
            kid: None,
            alg: None,
            key,
        }]))
    }

    /// A key file: a JWKS document (it starts with `{`) or a PEM key.
    pub fn from_file_contents(bytes: &[u8]) -> Result<(KeySet, Vec<String>), String> {
        match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            Some(b'{') => Self::from_jwks(bytes),
            _ => Self::from_pem(bytes).map(|s| (s, vec![])),
        }
    }

    /// Several sets as one (an issuer's key files).
    pub fn merge(sets: impl IntoIterator<Item = KeySet>) -> KeySet {
        KeySet {
            keys: sets.into_iter().flat_map(|s| s.keys).collect(),
        }
    }

    /// The families of the keys, for a config check ("HS256 accepted but
    /// no HMAC key").
    pub fn families(&self) -> impl Iterator<Item = AlgorithmFamily> + '_ {
        self.keys.iter().map(|k| k.key.family())
    }
}

/// One JWK as a key; `None` for a key meant for encryption.
fn key_of(v: serde_json::Value) -> Result<Option<Key>, String> {
    let jwk: Jwk = serde_json::from_value(v).map_err(|e| e.to_string())?;
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return Ok(None);
    }
    let alg = match jwk.common.key_algorithm {
        None => None,
        Some(a) => Some(
            Algorithm::try_from(a)
                .map_err(|_| format!("\"alg\": {a} is not a signing algorithm"))?,
        ),
    };
    let key = DecodingKey::from_jwk(&jwk).map_err(|e| format!("unusable key: {e}"))?;
    Ok(Some(Key {
        kid: jwk.common.key_id,
        alg,
        key,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const RSA_N: &str = "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw";

    fn jwks(keys: &str) -> Vec<u8> {
        format!("{{\"keys\": [{keys}]}}").into_bytes()
    }

    fn rsa(kid: &str, alg: &str) -> String {
        format!(
            r#"{{"kty":"RSA","kid":"{kid}","alg":"{alg}","use":"sig","n":"{RSA_N}","e":"AQAB"}}"#
        )
    }

    #[test]
    fn a_jwks_keeps_the_keys_it_can_use_and_says_why_not_the_others() {
        let doc = jwks(&format!(
            r#"{},{{"kty":"oct","kid":"h1","k":"c2VjcmV0"}},{{"kty":"XYZ","kid":"odd"}},{{"kty":"RSA","use":"enc","kid":"e","n":"{RSA_N}","e":"AQAB"}}"#,
            rsa("r1", "RS256")
        ));
        let (set, skipped) = KeySet::from_jwks(&doc).unwrap();
        assert_eq!(set.len(), 2, "the RSA and the HMAC key");
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert!(skipped[0].starts_with("keys[2]"), "{skipped:?}");
        assert!(KeySet::from_jwks(b"[1,2]").is_err());
        assert!(KeySet::from_jwks(b"{\"keys\": 3}").is_err());
    }

    #[test]
    fn a_token_is_checked_only_by_a_key_of_its_algorithm() {
        let doc = jwks(&format!(
            r#"{},{{"kty":"oct","kid":"h1","k":"c2VjcmV0"}}"#,
            rsa("r1", "RS256")
        ));
        let (set, _) = KeySet::from_jwks(&doc).unwrap();
        assert_eq!(
            set.candidates(Some("r1"), Algorithm::RS256).unwrap().len(),
            1
        );
        // HS256 naming the RSA key: the confusion attack.
        assert_eq!(
            set.candidates(Some("r1"), Algorithm::HS256).err(),
            Some(Missing::Mismatch)
        );
        // The key pins RS256: an RS512 token naming it is refused too.
        assert_eq!(
            set.candidates(Some("r1"), Algorithm::RS512).err(),
            Some(Missing::Mismatch)
        );
        assert_eq!(
            set.candidates(Some("r9"), Algorithm::RS256).err(),
            Some(Missing::Kid)
        );
        assert_eq!(
            set.candidates(None, Algorithm::RS256).unwrap().len(),
            1,
            "a token naming no kid: every key of its family"
        );
        assert_eq!(
            set.candidates(None, Algorithm::ES256).err(),
            Some(Missing::NoKey)
        );
        let pemless = KeySet::new(vec![Key {
            kid: None,
            alg: None,
            key: DecodingKey::from_secret(b"s"),
        }]);
        assert_eq!(pemless.candidates(None, Algorithm::HS256).unwrap().len(), 1);
        assert_eq!(
            pemless
                .candidates(Some("any"), Algorithm::HS256)
                .unwrap()
                .len(),
            1,
            "a key without kid checks tokens naming any"
        );
        assert_eq!(
            pemless.candidates(None, Algorithm::ES256).err(),
            Some(Missing::NoKey)
        );
    }

    #[test]
    fn key_files_are_jwks_or_pem() {
        assert!(KeySet::from_file_contents(b"  {\"keys\": []}").is_ok());
        let e = KeySet::from_file_contents(b"-----BEGIN NOTHING-----\n").err();
        assert!(e.unwrap().contains("not a PEM"));
    }
}
