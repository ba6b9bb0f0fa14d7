//! One JSON Web Key Set (RFC 7517) as `scope_jwt` verifies tokens with: the set read from its bytes, each
//! key kept with the signature algorithms it may verify. Only public signature keys are kept: RSA
//! (RS256/384/512, PS256/384/512), EC on P-256 (ES256) and P-384 (ES384), and Ed25519 (EdDSA). A
//! symmetric (`oct`) key is never taken, so no token can pass an HMAC made with a public key, and `none`
//! is no algorithm here at all. A key the set marks for encryption, or names an algorithm its type cannot
//! sign with, is left out; so is one this crate cannot read, without failing the rest of the set.
//! Read by `scope_jwt`'s validation (a `jwks_file` is checked at load) and by `jwks.rs` on each read.
//! Touches nothing but the bytes it is given.

use std::collections::HashMap;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, KeyOperations, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// The most keys a set may hold: a token without a `kid` is tried against each key of its algorithm,
/// so the set's size bounds the work one token can cause.
pub const MAX_KEYS: usize = 64;

/// The largest set read, in bytes.
pub const MAX_BYTES: usize = 1024 * 1024;

/// Every RSA signature algorithm, for an RSA key that names none.
const RSA: [Algorithm; 6] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];

/// One usable key.
pub struct Key {
    /// Its `kid`, if it has one.
    pub id: Option<String>,
    /// What verifies with it.
    pub decoding: DecodingKey,
    /// The algorithms a token signed with it may name.
    pub algorithms: Vec<Algorithm>,
}

/// A set's usable keys, and how many the set held that are not.
pub struct Keys {
    keys: Vec<Key>,
    by_id: HashMap<String, Vec<usize>>,
    /// Keys of the set left out, each with why (for the log).
    pub skipped: Vec<String>,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<Option<&str>> = self.keys.iter().map(|key| key.id.as_deref()).collect();
        f.debug_struct("Keys")
            .field("ids", &ids)
            .field("skipped", &self.skipped)
            .finish()
    }
}

impl Keys {
    /// Reads a set (`{"keys": [...]}`); an error when it is not one, or holds no usable key.
    pub fn parse(bytes: &[u8]) -> Result<Keys, String> {
        if bytes.len() > MAX_BYTES {
            return Err(format!(
                "a JWKS of {} bytes is over the {MAX_BYTES} read",
                bytes.len()
            ));
        }
        #[derive(serde::Deserialize)]
        struct Set {
            keys: Vec<serde_json::Value>,
        }
        let set: Set =
            serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS ({{\"keys\": [...]}}): {e}"))?;
        if set.keys.len() > MAX_KEYS {
            return Err(format!(
                "a JWKS of {} keys is over the {MAX_KEYS} taken",
                set.keys.len()
            ));
        }
        let mut keys = Keys {
            keys: Vec::new(),
            by_id: HashMap::new(),
            skipped: Vec::new(),
        };
        for (index, value) in set.keys.into_iter().enumerate() {
            match usable(value) {
                Ok(key) => {
                    if let Some(id) = &key.id {
                        keys.by_id.entry(id.clone()).or_default().push(keys.keys.len());
                    }
                    keys.keys.push(key);
                }
                Err(why) => keys.skipped.push(format!("key {index}: {why}")),
            }
        }
        if keys.keys.is_empty() {
            let why = if keys.skipped.is_empty() {
                "it holds no key".to_owned()
            } else {
                keys.skipped.join("; ")
            };
            return Err(format!("no usable signature key in the JWKS: {why}"));
        }
        Ok(keys)
    }

    /// How many keys are usable.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is usable (never, for a parsed set).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether the set holds a key by this id.
    pub fn knows(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// The keys a token with this `kid` (or none) and `alg` may be verified with: those of its id, or,
    /// without an id, every key that takes its algorithm.
    pub fn candidates<'a>(&'a self, id: Option<&str>, alg: Algorithm) -> impl Iterator<Item = &'a Key> + 'a {
        let indices: Vec<usize> = match id {
            Some(id) => self.by_id.get(id).cloned().unwrap_or_default(),
            None => (0..self.keys.len()).collect(),
        };
        indices
            .into_iter()
            .map(|i| &self.keys[i])
            .filter(move |key| key.algorithms.contains(&alg))
    }
}

/// One key of the set, if it is a public signature key this proxy verifies with.
fn usable(value: serde_json::Value) -> Result<Key, String> {
    let jwk: Jwk = serde_json::from_value(value).map_err(|e| format!("not a key this proxy reads ({e})"))?;
    if matches!(&jwk.common.public_key_use, Some(use_) if *use_ != PublicKeyUse::Signature) {
        return Err("not a signature key (\"use\" is not \"sig\")".into());
    }
    if matches!(&jwk.common.key_operations, Some(ops) if !ops.contains(&KeyOperations::Verify)) {
        return Err("not a key to verify with (\"key_ops\" lacks \"verify\")".into());
    }
    let named = jwk.common.key_algorithm;
    let algorithms = match &jwk.algorithm {
        AlgorithmParameters::RSA(params) => match named {
            _ if !rsa_size_verifies(&params.n) => {
                // ring refuses every signature by such a key: kept, it would make each of its tokens
                // "a signature that does not verify" with no word of why.
                return Err(format!(
                    "an RSA key whose modulus is not {RSA_BITS:?} bits (ring verifies no other)"
                ));
            }
            None => RSA.to_vec(),
            Some(alg) => vec![
                signing(alg)
                    .filter(|a| RSA.contains(a))
                    .ok_or("an RSA key for another algorithm")?,
            ],
        },
        AlgorithmParameters::EllipticCurve(params) => {
            let alg = match params.curve {
                EllipticCurve::P256 => Algorithm::ES256,
                EllipticCurve::P384 => Algorithm::ES384,
                _ => return Err(format!("curve {:?} is not P-256 or P-384", params.curve)),
            };
            if named.is_some_and(|named| signing(named) != Some(alg)) {
                return Err("an EC key whose \"alg\" does not fit its curve".into());
            }
            vec![alg]
        }
        AlgorithmParameters::OctetKeyPair(params) => {
            if params.curve != EllipticCurve::Ed25519 {
                return Err("an OKP key not on Ed25519".into());
            }
            if named.is_some_and(|named| named != KeyAlgorithm::EdDSA) {
                return Err("an Ed25519 key whose \"alg\" is not EdDSA".into());
            }
            vec![Algorithm::EdDSA]
        }
        AlgorithmParameters::OctetKey(_) => {
            return Err("a symmetric (oct) key: tokens are verified with public keys only".into());
        }
    };
    let decoding = DecodingKey::from_jwk(&jwk).map_err(|e| format!("unreadable key material ({e})"))?;
    Ok(Key {
        id: jwk.common.key_id,
        decoding,
        algorithms,
    })
}

/// The RSA modulus sizes ring verifies signatures with, in bits.
const RSA_BITS: std::ops::RangeInclusive<usize> = 2048..=8192;

/// Whether an RSA key's `n` (base64url, big-endian) is a modulus of a size ring verifies with.
fn rsa_size_verifies(n: &str) -> bool {
    use base64::Engine;
    let Ok(bytes) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(n.trim_end_matches('=')) else {
        return false;
    };
    let bytes = &bytes[bytes.iter().take_while(|b| **b == 0).count()..];
    let bits = bytes.first().map_or(0, |top| {
        (bytes.len() - 1) * 8 + (8 - top.leading_zeros() as usize)
    });
    RSA_BITS.contains(&bits)
}

/// The signature algorithm a key's `alg` names, if it names one (not an encryption algorithm).
fn signing(alg: KeyAlgorithm) -> Option<Algorithm> {
    Some(match alg {
        KeyAlgorithm::ES256 => Algorithm::ES256,
        KeyAlgorithm::ES384 => Algorithm::ES384,
        KeyAlgorithm::RS256 => Algorithm::RS256,
        KeyAlgorithm::RS384 => Algorithm::RS384,
        KeyAlgorithm::RS512 => Algorithm::RS512,
        KeyAlgorithm::PS256 => Algorithm::PS256,
        KeyAlgorithm::PS384 => Algorithm::PS384,
        KeyAlgorithm::PS512 => Algorithm::PS512,
        KeyAlgorithm::EdDSA => Algorithm::EdDSA,
        KeyAlgorithm::HS256
        | KeyAlgorithm::HS384
        | KeyAlgorithm::HS512
        | KeyAlgorithm::RSA1_5
        | KeyAlgorithm::RSA_OAEP
        | KeyAlgorithm::RSA_OAEP_256 => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7517 A.1's RSA key and RFC 8037 A.2's Ed25519 key, and RFC 7517's P-256 key (marked for
    /// encryption there; for signatures here unless a test says otherwise).
    const RSA_KEY: &str = r#"{"kty":"RSA","n":"0vx7agoebGcQSuuPiLJXZptN9nndrQmbXEps2aiAFbWhM78LhWx4cbbfAAtVT86zwu1RK7aPFFxuhDR1L6tSoc_BJECPebWKRXjBZCiFV4n3oknjhMstn64tZ_2W-5JsGY4Hc5n9yBXArwl93lqt7_RN5w6Cf0h4QyQ5v-65YGjQR0_FDW2QvzqY368QQMicAtaSqzs8KJZgnYb9c7d0zgdAZHzu6qMQvRL5hajrn1n91CbOpbISD08qNLyrdkt-bFTWhAI4vMQFh6WeZu0fM4lFd2NcRwr3XPksINHaQ-G_xBniIqbw0Ls1jF44-csFCur-kEgU8awapJzKnqDKgw","e":"AQAB","kid":"rsa"}"#;
    const ED_KEY: &str =
        r#"{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo","kid":"ed"}"#;
    const EC_KEY: &str = r#"{"kty":"EC","crv":"P-256","x":"MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4","y":"4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM","kid":"ec"}"#;

    fn set(keys: &[&str]) -> Result<Keys, String> {
        Keys::parse(format!(r#"{{"keys":[{}]}}"#, keys.join(",")).as_bytes())
    }

    fn with(key: &str, field: &str) -> String {
        format!("{},{field}}}", key.trim_end_matches('}'))
    }

    #[test]
    fn public_signature_keys_are_kept_with_the_algorithms_they_verify() {
        let keys = set(&[RSA_KEY, ED_KEY, EC_KEY]).unwrap();
        assert_eq!(keys.len(), 3);
        let algs = |id: &str, alg| keys.candidates(Some(id), alg).count();
        assert_eq!(algs("rsa", Algorithm::RS256), 1);
        assert_eq!(
            algs("rsa", Algorithm::PS512),
            1,
            "an RSA key naming no alg takes RS and PS"
        );
        assert_eq!(algs("rsa", Algorithm::ES256), 0);
        assert_eq!(algs("ec", Algorithm::ES256), 1);
        assert_eq!(algs("ec", Algorithm::ES384), 0, "a P-256 key is ES256 only");
        assert_eq!(algs("ed", Algorithm::EdDSA), 1);
        assert_eq!(keys.candidates(None, Algorithm::RS256).count(), 1);
        assert_eq!(keys.candidates(Some("nope"), Algorithm::RS256).count(), 0);
        let named = set(&[&with(RSA_KEY, r#""alg":"PS256""#)]).unwrap();
        assert_eq!(
            named.candidates(Some("rsa"), Algorithm::RS256).count(),
            0,
            "its alg only"
        );
        assert_eq!(named.candidates(Some("rsa"), Algorithm::PS256).count(), 1);
    }

    #[test]
    fn symmetric_encryption_and_unreadable_keys_are_left_out_without_failing_the_set() {
        let oct = r#"{"kty":"oct","k":"c2VjcmV0","kid":"hmac"}"#;
        let enc = with(EC_KEY, r#""use":"enc""#).replace(r#""kid":"ec""#, r#""kid":"enc""#);
        let p521 = r#"{"kty":"EC","crv":"P-521","x":"AA","y":"AA","kid":"p521"}"#;
        let oaep = with(RSA_KEY, r#""alg":"RSA-OAEP""#).replace(r#""kid":"rsa""#, r#""kid":"oaep""#);
        let strange = r#"{"kty":"XYZ","kid":"strange"}"#;
        let sign_only = with(ED_KEY, r#""key_ops":["sign"]"#).replace(r#""kid":"ed""#, r#""kid":"signer""#);
        let keys = set(&[oct, &enc, p521, &oaep, strange, &sign_only, ED_KEY]).unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(keys.skipped.len(), 6, "{:?}", keys.skipped);
        for id in ["hmac", "enc", "p521", "oaep", "strange", "signer"] {
            assert!(!keys.knows(id), "{id}");
        }
        assert!(keys.knows("ed"));
        let none = set(&[oct]).unwrap_err();
        assert!(
            none.contains("no usable signature key") && none.contains("symmetric"),
            "{none}"
        );
    }

    #[test]
    fn an_rsa_key_ring_cannot_verify_with_is_left_out() {
        use base64::Engine;
        let modulus = |bytes: usize| {
            let mut n = vec![0xc5u8; bytes];
            n[bytes - 1] = 0x01;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(n)
        };
        let rsa = |kid: &str, n: &str| format!(r#"{{"kty":"RSA","n":"{n}","e":"AQAB","kid":"{kid}"}}"#);
        let keys = set(&[
            &rsa("rsa-1024", &modulus(128)),
            &rsa("rsa-empty", ""),
            &rsa("rsa-16384", &modulus(2048)),
            &rsa("rsa-2048", &modulus(256)),
            &rsa("rsa-4096", &modulus(512)),
        ])
        .unwrap();
        assert!(keys.knows("rsa-2048") && keys.knows("rsa-4096"));
        assert_eq!(keys.skipped.len(), 3, "{:?}", keys.skipped);
        assert!(keys.skipped[0].contains("modulus"), "{:?}", keys.skipped);
        assert!(rsa_size_verifies(&modulus(256)));
        let padded = |bytes: usize| {
            let mut n = vec![0u8; 2];
            n.extend(vec![0xc5u8; bytes]);
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(n)
        };
        assert!(
            !rsa_size_verifies(&padded(255)),
            "leading zeros do not count: 2040 bits"
        );
        assert!(
            rsa_size_verifies(&padded(256)),
            "leading zeros do not count: 2048 bits"
        );
    }

    #[test]
    fn a_set_that_is_not_one_or_too_large_is_refused() {
        assert!(Keys::parse(b"[]").unwrap_err().contains("not a JWKS"));
        assert!(
            Keys::parse(b"{\"keys\":[]}")
                .unwrap_err()
                .contains("holds no key")
        );
        let many = vec![ED_KEY; MAX_KEYS + 1];
        assert!(set(&many).unwrap_err().contains("keys is over"));
        assert!(
            Keys::parse(&vec![b' '; MAX_BYTES + 1])
                .unwrap_err()
                .contains("bytes is over")
        );
    }
}
