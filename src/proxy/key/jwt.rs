//! Who a client is by its bearer token (`scope_jwt`): the token in `Authorization: Bearer` is verified
//! against the route's key set (`jwks.rs`) — its signature by a public key of the set (RS, PS, ES or
//! EdDSA; never `none`, never an HMAC), `exp` and `nbf` within the leeway, `iss` among the issuers and
//! `aud` among the audiences where the route names them — and the verified values of the route's claims
//! (`iss` and `sub` by default) name the client. A token refreshed for the same subject names the same
//! client, so its retry is a replay. Runs for keyed requests only, before anything is claimed; a request
//! with no bearer token is left to the scope check (`intake.rs`). Touches the key set only (a `kid` it
//! lacks has it read again, at most once per `min_refetch`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::HeaderMap;
use http::header::AUTHORIZATION;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::config::JwtRules;
use crate::error::ProxyError;
use crate::jwks::{KeySet, Keys};

/// The verified claims that name a client, hashed: what `scope_jwt` adds to the scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subject(pub [u8; 32]);

/// Whether the request carries a bearer token (verified or not): on a `scope_jwt` route, it names a
/// client for the scope check, and verification decides whether it names one truly.
pub fn has_bearer(headers: &HeaderMap) -> bool {
    headers
        .get_all(AUTHORIZATION)
        .iter()
        .any(|v| bearer(v.as_bytes()).is_some())
}

/// Tokens verified lately, each with the client it names, so that a client's next request with the same
/// token is not verified again (one verification costs 25 to 55 µs, more than a replay's own work). An
/// entry stands while its token is valid (`exp` and the leeway) and the key set it was verified with is
/// still the set's current one: a set read again (every `refresh`, a rotation, a key removed) verifies
/// every token anew. Keyed by the route and the token, since routes sharing a set may take different
/// issuers, audiences and claims. Bounded: emptied when full.
#[derive(Default)]
pub struct Verified(Mutex<HashMap<[u8; 32], Remembered>>);

/// One verified token.
struct Remembered {
    subject: Subject,
    /// The last second the token is taken in (its `exp` plus the leeway), since the Unix epoch.
    until: u64,
    /// The set it was verified with.
    keys: Arc<Keys>,
}

/// The most tokens [`Verified`] holds.
pub const MAX_VERIFIED: usize = 10_000;

impl Verified {
    fn recall(&self, digest: &[u8; 32], keys: &Arc<Keys>, now: u64) -> Option<Subject> {
        let entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.get(digest)?;
        (now <= entry.until && Arc::ptr_eq(&entry.keys, keys)).then_some(entry.subject)
    }

    fn remember(&self, digest: [u8; 32], entry: Remembered) {
        let mut entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= MAX_VERIFIED {
            entries.clear();
        }
        entries.insert(digest, entry);
    }
}

/// The client the request's bearer token names, verified (or found verified in `verified` for this
/// `route`); `None` when it carries none.
pub async fn subject(
    (rules, set, verified): (&JwtRules, &KeySet, &Verified),
    route: &str,
    headers: &HeaderMap,
) -> Result<Option<Subject>, ProxyError> {
    let Some(token) =
        one_bearer(headers).map_err(|()| invalid("the request carries more than one bearer token"))?
    else {
        return Ok(None);
    };
    let token = std::str::from_utf8(token).map_err(|_| invalid("the token is not a JWT"))?;
    let digest: [u8; 32] = Sha256::new()
        .chain_update(route.as_bytes())
        .chain_update([0])
        .chain_update(token.as_bytes())
        .finalize()
        .into();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    if let Some(keys) = set.current()
        && let Some(subject) = verified.recall(&digest, &keys, now)
    {
        return Ok(Some(subject));
    }
    let (claims, keys) = verify(rules, set, token).await?;
    let subject = subject_of(rules, &claims)?;
    // `exp` is verified present and a number; one that is not a whole number of seconds is not kept.
    if let Some(exp) = claims.get("exp").and_then(Value::as_u64) {
        let until = exp.saturating_add(rules.leeway);
        verified.remember(digest, Remembered { subject, until, keys });
    }
    Ok(Some(subject))
}

/// The client the request's bearer token names, read without verifying the token: for `idemproxy keys`,
/// whose operator holds a token the proxy verified when it came (perhaps since expired) and asks which
/// record is its client's. Never for a request.
pub fn unverified_subject(rules: &JwtRules, headers: &HeaderMap) -> Result<Option<Subject>, String> {
    // The proxy refuses a request with two: it names no one client, so it has no record to find.
    let Some(token) = one_bearer(headers)
        .map_err(|()| "the headers carry more than one bearer token; name one".to_owned())?
    else {
        return Ok(None);
    };
    let token = std::str::from_utf8(token).map_err(|_| "the bearer token is not a JWT".to_owned())?;
    let header = jsonwebtoken::decode_header(token).map_err(|e| why(e.kind()))?;
    let mut validation = Validation::new(header.alg);
    validation.insecure_disable_signature_validation();
    validation.validate_exp = false;
    validation.validate_aud = false;
    validation.required_spec_claims.clear();
    let key = jsonwebtoken::DecodingKey::from_secret(&[]);
    let data =
        jsonwebtoken::decode::<Map<String, Value>>(token, &key, &validation).map_err(|e| why(e.kind()))?;
    subject_of(rules, &data.claims)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// The route's claims of a token, hashed: each claim's name and value framed by their lengths, the value
/// as JSON (serde_json's map keeps its keys sorted, so a structured claim has one spelling).
fn subject_of(rules: &JwtRules, claims: &Map<String, Value>) -> Result<Subject, ProxyError> {
    let mut hash = Sha256::new();
    for name in &rules.claims {
        let value = claims.get(name).ok_or_else(|| {
            invalid(&format!(
                "the token has no {name:?} claim, which names its client here"
            ))
        })?;
        if value.is_null() || value.as_str() == Some("") {
            // Every such token would name one client: their keys would answer each other.
            return Err(invalid(&format!(
                "the token's {name:?} claim is empty, so it names no client"
            )));
        }
        if holds_inexact_number(value) {
            // serde_json reads such a number as an f64: 123456789012345678901234567890 and ...891 are
            // one value, so two subjects would be one client. No issuer names its clients so.
            return Err(invalid(&format!(
                "the token's {name:?} claim holds a number that is not an integer of at most 64 bits"
            )));
        }
        let text = value.to_string();
        hash.update((name.len() as u64).to_be_bytes());
        hash.update(name.as_bytes());
        hash.update((text.len() as u64).to_be_bytes());
        hash.update(text.as_bytes());
    }
    Ok(Subject(hash.finalize().into()))
}

/// Whether a claim's value holds a number read as a float (a fraction, an exponent, or an integer past
/// 64 bits), whose spelling the value no longer keeps.
fn holds_inexact_number(value: &Value) -> bool {
    match value {
        Value::Number(n) => n.is_f64(),
        Value::Array(items) => items.iter().any(holds_inexact_number),
        Value::Object(members) => members.values().any(holds_inexact_number),
        Value::Null | Value::Bool(_) | Value::String(_) => false,
    }
}

/// The token's claims, once a key of the set verifies it and its times, issuer and audience hold.
async fn verify(
    rules: &JwtRules,
    set: &KeySet,
    token: &str,
) -> Result<(Map<String, Value>, Arc<Keys>), ProxyError> {
    let header = jsonwebtoken::decode_header(token).map_err(|e| {
        invalid(&match e.kind() {
            ErrorKind::Json(_) => "the token's header is not one this proxy verifies (its alg is not \
                                   RS, PS, ES or EdDSA, or a member is of the wrong type or named twice)"
                .to_owned(),
            kind => why(kind),
        })
    })?;
    if matches!(header.alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512) {
        return Err(invalid(
            "an HMAC-signed token is not taken: tokens are verified with public keys",
        ));
    }
    if names_critical_extensions(token) {
        // RFC 7515 §4.1.11: a token whose `crit` names extensions is refused by a recipient that does
        // not understand them, as the app behind may; this proxy understands none.
        return Err(invalid(
            "the token's header names critical extensions (crit), which this proxy does not take",
        ));
    }
    let keys = match set.current() {
        Some(keys) if header.kid.as_deref().is_none_or(|kid| keys.knows(kid)) => keys,
        // A key rotation, or a set not read yet: read it again (at most once per min_refetch).
        _ => {
            let keys = set.refetch().await.ok_or(ProxyError::KeysUnavailable)?;
            // The set could not be read again: whether it now holds the token's key is not known, so
            // the token is not refused for lacking one (a client would drop a good token on a 401).
            if header.kid.as_deref().is_some_and(|kid| !keys.knows(kid)) && set.failing() {
                return Err(ProxyError::KeysUnavailable);
            }
            keys
        }
    };
    let validation = validation(rules, header.alg);
    let mut tried = false;
    for key in keys.candidates(header.kid.as_deref(), header.alg) {
        tried = true;
        match jsonwebtoken::decode::<Map<String, Value>>(token, &key.decoding, &validation) {
            Ok(data) => return check_claim_types(data.claims).map(|claims| (claims, keys.clone())),
            // Another key of the algorithm (without a kid, or under the same kid: a set may hold two
            // keys under one kid while one rotates out) may be the one.
            Err(e) if *e.kind() == ErrorKind::InvalidSignature => continue,
            // Signed, but its claims do not read as a JWT's (a sub, iss, aud, exp or nbf of the wrong
            // type, or one named twice).
            Err(e) if matches!(e.kind(), ErrorKind::Json(_)) => {
                return Err(invalid(
                    "the token's claims are not a JWT's (a registered claim of the wrong type, or a claim \
                     named twice)",
                ));
            }
            Err(e) => return Err(invalid(&why(e.kind()))),
        }
    }
    Err(invalid(&match (tried, header.kid) {
        (true, _) => why(&ErrorKind::InvalidSignature),
        (false, Some(kid)) => format!("no key {kid:?} for {:?} in the key set", header.alg),
        (false, None) => format!("no {:?} key in the key set", header.alg),
    }))
}

/// Whether the token's header has a `crit` member (the header is read again: jsonwebtoken's leaves it out).
fn names_critical_extensions(token: &str) -> bool {
    use base64::Engine;
    let Some(encoded) = token.split('.').next() else {
        return false;
    };
    let Ok(bytes) = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded) else {
        return false;
    };
    serde_json::from_slice::<Map<String, Value>>(&bytes).is_ok_and(|header| header.contains_key("crit"))
}

/// The claims jsonwebtoken passes where RFC 7519 says otherwise, refused as an app's library refuses
/// them: an `iss` that is not a string (jsonwebtoken takes an array holding one issuer of the route's)
/// and an `nbf` that is not a number (jsonwebtoken skips one it cannot read).
fn check_claim_types(claims: Map<String, Value>) -> Result<Map<String, Value>, ProxyError> {
    if claims.get("iss").is_some_and(|iss| !iss.is_string()) {
        return Err(invalid("the token's issuer (iss) is not a string"));
    }
    if claims.get("nbf").is_some_and(|nbf| !nbf.is_number()) {
        return Err(invalid("the token's not-before time (nbf) is not a number"));
    }
    Ok(claims)
}

/// What a token must hold beside its signature.
fn validation(rules: &JwtRules, alg: Algorithm) -> Validation {
    let mut validation = Validation::new(alg);
    validation.leeway = rules.leeway;
    validation.validate_nbf = true;
    let mut required = vec!["exp"];
    if !rules.issuers.is_empty() {
        validation.set_issuer(&rules.issuers);
        required.push("iss");
    }
    if rules.audiences.is_empty() {
        // The app decides who may call it; the proxy only asks who is calling.
        validation.validate_aud = false;
    } else {
        validation.set_audience(&rules.audiences);
        required.push("aud");
    }
    validation.set_required_spec_claims(&required);
    validation
}

/// Why a token was refused, in words that never repeat the token.
fn why(kind: &ErrorKind) -> String {
    match kind {
        ErrorKind::ExpiredSignature => "the token has expired (exp)".into(),
        ErrorKind::ImmatureSignature => "the token is not valid yet (nbf)".into(),
        ErrorKind::InvalidIssuer => "the token's issuer (iss) is not one this route takes".into(),
        ErrorKind::InvalidAudience => "the token's audience (aud) is not one this route takes".into(),
        ErrorKind::InvalidSignature => "the token's signature does not verify".into(),
        ErrorKind::InvalidAlgorithm => "the token's algorithm is not its key's".into(),
        ErrorKind::MissingRequiredClaim(claim) => format!("the token has no {claim:?} claim"),
        _ => "the token is not a JWT this proxy verifies (a signed JWS: header.payload.signature)".into(),
    }
}

fn invalid(why: &str) -> ProxyError {
    ProxyError::InvalidToken(why.to_owned())
}

/// The one bearer token of the request's `Authorization` headers, if any; `Err` for more than one.
fn one_bearer(headers: &HeaderMap) -> Result<Option<&[u8]>, ()> {
    let mut tokens = headers
        .get_all(AUTHORIZATION)
        .iter()
        .filter_map(|v| bearer(v.as_bytes()));
    let first = tokens.next();
    match tokens.next() {
        Some(_) => Err(()),
        None => Ok(first),
    }
}

/// The token of a `Bearer` credential (the scheme read without case, RFC 9110 §11.1; one or more spaces
/// after it), if the value is one.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let (scheme, rest) = value.split_at(value.iter().position(|b| *b == b' ' || *b == b'\t')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii_start();
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys() -> Arc<Keys> {
        let set =
            r#"{"keys":[{"kty":"OKP","crv":"Ed25519","x":"11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"}]}"#;
        Arc::new(Keys::parse(set.as_bytes()).unwrap())
    }

    #[test]
    fn a_verified_token_stands_until_its_exp_and_while_its_set_does_and_the_memory_is_bounded() {
        let verified = Verified::default();
        let (set, other) = (keys(), keys());
        let subject = Subject([7; 32]);
        let remembered = |until| Remembered {
            subject,
            until,
            keys: set.clone(),
        };
        verified.remember([1; 32], remembered(100));
        assert_eq!(verified.recall(&[1; 32], &set, 100), Some(subject));
        assert_eq!(
            verified.recall(&[1; 32], &set, 101),
            None,
            "past exp and the leeway"
        );
        assert_eq!(verified.recall(&[1; 32], &other, 50), None, "a set read again");
        assert_eq!(verified.recall(&[2; 32], &set, 50), None);
        for n in 0..MAX_VERIFIED {
            let digest: [u8; 32] = Sha256::digest(n.to_be_bytes()).into();
            verified.remember(digest, remembered(100));
        }
        let held = verified.0.lock().unwrap().len();
        assert!(held <= MAX_VERIFIED, "{held}");
        assert_eq!(
            held, 1,
            "the one before and these make one more than it holds: emptied, then one"
        );
    }

    #[test]
    fn a_bearer_token_is_read_in_any_case_of_its_scheme() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer \t abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"BEARER abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer"), None);
        assert_eq!(bearer(b"Bearer   "), None);
        assert_eq!(bearer(b"Bearerabc"), None);
    }

    #[test]
    fn the_keys_cli_names_no_client_for_two_bearer_tokens_as_the_proxy_names_none() {
        let rules = crate::config::RawScopeJwt {
            jwks_url: Some("https://issuer.example/jwks".into()),
            ..Default::default()
        }
        .validate("r")
        .unwrap();
        // {"alg":"RS256"} . {"iss":"i","sub":"alice"} . (no signature: the CLI does not verify)
        let alice = "Bearer eyJhbGciOiJSUzI1NiJ9.eyJpc3MiOiJpIiwic3ViIjoiYWxpY2UifQ.c2ln";
        let mut headers = HeaderMap::new();
        headers.append(AUTHORIZATION, alice.parse().unwrap());
        assert!(unverified_subject(&rules, &headers).unwrap().is_some());
        headers.append(AUTHORIZATION, alice.parse().unwrap());
        let refused = unverified_subject(&rules, &headers).unwrap_err();
        assert!(refused.contains("more than one bearer token"), "{refused}");
    }
}
