//! Encryption at rest, around any backend: [`EncryptedStore`] seals a response's body and header values with
//! AES-256-GCM on `complete` and opens them when `claim` finds a completed record. Status, header names and
//! everything the claim decides on stay in clear. Each sealed value is bound to its record (scope, key,
//! status, and for a header value its position and name) as associated data, so a value moved to another row
//! or another header does not open. A record that does not open is refused, never replayed.
//!
//! Sealed layout: `MAGIC` | version | key id length | key id | 96-bit random nonce | ciphertext and tag.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aes_gcm::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;

use super::{
    ClaimRequest, ClaimResult, Existing, RecordId, RecordInfo, RecordStats, Store, StoreError, StoredResponse,
};
use crate::config::{ConfigError, RawEncryption};
use crate::metrics::Metrics;

/// Opens every sealed value; chosen so that text bodies stored in clear never start with it.
const MAGIC: &[u8; 4] = b"\0IPE";
const VERSION: u8 = 1;
const NONCE_LEN: usize = 12;
const KEY_LEN: usize = 32;
/// Longest key id; ids are stored in every sealed value.
const MAX_KEY_ID: usize = 64;

/// The configured keys: which one seals new records, and every one that may open old ones.
pub struct Keyring {
    active: Option<String>,
    keys: BTreeMap<String, Aes256Gcm>,
    accept_plaintext: bool,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("active", &self.active)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .finish()
    }
}

impl Keyring {
    /// Validates `[encryption]`; `None` when no keys are configured (encryption off).
    pub fn from_config(raw: &RawEncryption) -> Result<Option<Keyring>, ConfigError> {
        if raw.keys.is_empty() {
            if raw.active_key.is_some() {
                return Err(ConfigError::new(
                    "encryption.active_key",
                    "names a key but encryption.keys is empty",
                ));
            }
            return Ok(None);
        }
        let mut keys = BTreeMap::new();
        for (id, secret) in &raw.keys {
            keys.insert(id.clone(), cipher(id, secret)?);
        }
        if let Some(active) = &raw.active_key
            && !keys.contains_key(active)
        {
            return Err(ConfigError::new(
                "encryption.active_key",
                format!("{active:?} is not a key id in encryption.keys"),
            ));
        }
        Ok(Some(Keyring {
            active: raw.active_key.clone(),
            keys,
            // Without an active key new records are stored in clear, so they must replay.
            accept_plaintext: raw.accept_plaintext || raw.active_key.is_none(),
        }))
    }

    /// Seals `plain` for `context` with the key `id`. Fails only beyond GCM's message limit (64 GiB).
    fn seal(&self, id: &str, plain: &[u8], context: &[u8]) -> Result<Vec<u8>, String> {
        let cipher = self.keys.get(id).ok_or("the active key is not configured")?;
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let payload = Payload {
            msg: plain,
            aad: context,
        };
        let sealed = cipher
            .encrypt(&nonce, payload)
            .map_err(|_| "too large to encrypt".to_owned())?;
        let mut out = Vec::with_capacity(MAGIC.len() + 2 + id.len() + NONCE_LEN + sealed.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(id.len() as u8);
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// Opens a value sealed for `context`; a value in clear passes only while plaintext is accepted.
    fn open(&self, stored: &[u8], context: &[u8]) -> Result<Vec<u8>, String> {
        let Some(rest) = stored.strip_prefix(MAGIC.as_slice()) else {
            return match self.accept_plaintext {
                true => Ok(stored.to_vec()),
                false => Err("stored in clear while encryption.accept_plaintext is off".into()),
            };
        };
        let (&version, rest) = rest.split_first().ok_or("truncated")?;
        if version != VERSION {
            return Err(format!("unknown format version {version}"));
        }
        let (&id_len, rest) = rest.split_first().ok_or("truncated")?;
        let id_len = usize::from(id_len);
        if rest.len() < id_len + NONCE_LEN {
            return Err("truncated".into());
        }
        let (id, rest) = rest.split_at(id_len);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let id = String::from_utf8_lossy(id);
        let cipher = self
            .keys
            .get(id.as_ref())
            .ok_or_else(|| format!("sealed with key id {id:?}, which is not configured"))?;
        let payload = Payload {
            msg: sealed,
            aad: context,
        };
        cipher
            .decrypt(Nonce::from_slice(nonce), payload)
            .map_err(|_| format!("does not open with key {id:?}: tampered, or moved from another record"))
    }

    /// The response sealed with the active key; `Ok(None)` when no key is active (stored in clear).
    fn seal_response(
        &self,
        id: &RecordId,
        response: &StoredResponse,
    ) -> Result<Option<StoredResponse>, String> {
        let Some(active) = &self.active else {
            return Ok(None);
        };
        let record = record_context(id, response.status);
        let mut headers = Vec::with_capacity(response.headers.len());
        for (index, (name, value)) in response.headers.iter().enumerate() {
            let sealed = self.seal(active, value, &header_context(&record, index, name))?;
            headers.push((name.clone(), sealed));
        }
        let body = match &response.body {
            Some(body) => Some(Bytes::from(self.seal(active, body, &body_context(&record))?)),
            None => None,
        };
        Ok(Some(StoredResponse {
            status: response.status,
            headers,
            body,
        }))
    }

    fn open_response(&self, id: &RecordId, stored: StoredResponse) -> Result<StoredResponse, String> {
        let record = record_context(id, stored.status);
        let mut headers = Vec::with_capacity(stored.headers.len());
        for (index, (name, value)) in stored.headers.into_iter().enumerate() {
            let value = self
                .open(&value, &header_context(&record, index, &name))
                .map_err(|why| format!("header {name}: {why}"))?;
            headers.push((name, value));
        }
        let body = match stored.body {
            Some(body) => Some(Bytes::from(
                self.open(&body, &body_context(&record))
                    .map_err(|why| format!("body: {why}"))?,
            )),
            None => None,
        };
        Ok(StoredResponse {
            status: stored.status,
            headers,
            body,
        })
    }
}

fn cipher(id: &str, secret: &str) -> Result<Aes256Gcm, ConfigError> {
    let key = format!("encryption.keys.{id}");
    let valid_id = !id.is_empty()
        && id.len() <= MAX_KEY_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !valid_id {
        return Err(ConfigError::new(
            &key,
            format!("a key id is 1 to {MAX_KEY_ID} of A-Z a-z 0-9 - _"),
        ));
    }
    let bytes = BASE64
        .decode(secret.trim())
        .map_err(|_| ConfigError::new(&key, "is not base64"))?;
    if bytes.len() != KEY_LEN {
        return Err(ConfigError::new(
            &key,
            format!(
                "must be {KEY_LEN} bytes after base64 decoding, is {} (make one with: openssl rand -base64 32)",
                bytes.len()
            ),
        ));
    }
    Ok(Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(&bytes)))
}

/// What binds every sealed value to its record.
fn record_context(id: &RecordId, status: u16) -> Vec<u8> {
    let mut context = b"idemproxy-record-v1".to_vec();
    for field in [id.scope.as_bytes(), id.key.as_bytes()] {
        context.extend_from_slice(&(field.len() as u64).to_be_bytes());
        context.extend_from_slice(field);
    }
    context.extend_from_slice(&status.to_be_bytes());
    context
}

fn body_context(record: &[u8]) -> Vec<u8> {
    [record, b"body"].concat()
}

fn header_context(record: &[u8], index: usize, name: &str) -> Vec<u8> {
    let mut context = [record, b"header"].concat();
    context.extend_from_slice(&(index as u64).to_be_bytes());
    context.extend_from_slice(name.as_bytes());
    context
}

/// A backend whose stored responses are sealed with the [`Keyring`]; everything else passes through.
pub struct EncryptedStore {
    inner: Arc<dyn Store>,
    keyring: Arc<Keyring>,
    metrics: Metrics,
}

impl EncryptedStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Store>, keyring: Arc<Keyring>, metrics: Metrics) -> EncryptedStore {
        EncryptedStore {
            inner,
            keyring,
            metrics,
        }
    }

    /// `inner` wrapped when a keyring is configured, else `inner` itself.
    pub fn wrap(inner: Arc<dyn Store>, keyring: Option<Arc<Keyring>>, metrics: &Metrics) -> Arc<dyn Store> {
        match keyring {
            Some(keyring) => Arc::new(EncryptedStore::new(inner, keyring, metrics.clone())),
            None => inner,
        }
    }

    fn open_claim(&self, id: &RecordId, result: ClaimResult) -> Result<ClaimResult, StoreError> {
        let ClaimResult::Held(Existing::Completed {
            same_fingerprint,
            response,
            expires_in,
            token,
        }) = result
        else {
            return Ok(result);
        };
        match self.keyring.open_response(id, response) {
            Ok(response) => Ok(ClaimResult::Held(Existing::Completed {
                same_fingerprint,
                response,
                expires_in,
                token,
            })),
            Err(why) => {
                self.metrics.undecryptable.inc();
                tracing::error!(key = %id.key, reason = %why, "stored response cannot be decrypted");
                Err(StoreError::Undecryptable(why))
            }
        }
    }
}

#[async_trait::async_trait]
impl Store for EncryptedStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let result = self.inner.claim(request).await?;
        self.open_claim(&request.id, result)
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.inner.heartbeat(id, lease).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        match self.keyring.seal_response(id, response) {
            Ok(Some(sealed)) => self.inner.complete(id, &sealed).await,
            Ok(None) => self.inner.complete(id, response).await,
            Err(why) => Err(StoreError::Backend(format!("cannot encrypt the response: {why}"))),
        }
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.inner.release(id).await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.inner.hold(id).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.inner.release_stale(id).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.inner.sweep(batch).await
    }

    /// Describes records without opening them: sizes are of the sealed values as stored.
    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner.find(key, scope).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.inner.stats().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring(active: Option<&str>, keys: &[(&str, [u8; 32])]) -> Keyring {
        let raw = RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys
                .iter()
                .map(|(id, key)| (id.to_string(), BASE64.encode(key)))
                .collect(),
            accept_plaintext: false,
        };
        Keyring::from_config(&raw).unwrap().unwrap()
    }

    fn id(scope: &str, key: &str) -> RecordId {
        RecordId {
            scope: scope.into(),
            key: key.into(),
            token: uuid::Uuid::nil(),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-account".into(), b"alice@example.com".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"card\":\"4111\"}")),
        }
    }

    #[test]
    fn sealed_response_hides_values_and_opens_for_its_record() {
        let ring = keyring(Some("k1"), &[("k1", [7; 32])]);
        let sealed = ring.seal_response(&id("s", "a"), &response()).unwrap().unwrap();
        let body = sealed.body.as_ref().unwrap();
        assert!(body.starts_with(MAGIC));
        assert!(!body.windows(4).any(|w| w == b"4111"));
        assert!(sealed.headers[1].1.starts_with(MAGIC));
        assert_eq!(sealed.headers[1].0, "x-account", "names stay in clear");
        assert_eq!(ring.open_response(&id("s", "a"), sealed).unwrap(), response());
    }

    #[test]
    fn every_seal_uses_a_fresh_nonce() {
        let ring = keyring(Some("k1"), &[("k1", [7; 32])]);
        let a = ring.seal("k1", b"same", b"ctx").unwrap();
        let b = ring.seal("k1", b"same", b"ctx").unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn a_value_does_not_open_for_another_record_status_or_header() {
        let ring = keyring(Some("k1"), &[("k1", [7; 32])]);
        let sealed = ring.seal_response(&id("s", "a"), &response()).unwrap().unwrap();
        assert!(ring.open_response(&id("s", "b"), sealed.clone()).is_err());
        assert!(ring.open_response(&id("t", "a"), sealed.clone()).is_err());
        let mut status = sealed.clone();
        status.status = 200;
        assert!(ring.open_response(&id("s", "a"), status).is_err());
        let mut swapped = sealed;
        swapped.headers.swap(0, 1);
        assert!(ring.open_response(&id("s", "a"), swapped).is_err());
    }

    #[test]
    fn old_keys_still_open_after_rotation_and_unknown_ids_are_named() {
        let old = keyring(Some("k1"), &[("k1", [1; 32])]);
        let sealed = old.seal_response(&id("s", "a"), &response()).unwrap().unwrap();
        let rotated = keyring(Some("k2"), &[("k1", [1; 32]), ("k2", [2; 32])]);
        assert_eq!(
            rotated.open_response(&id("s", "a"), sealed.clone()).unwrap(),
            response()
        );
        let resealed = rotated
            .seal_response(&id("s", "a"), &response())
            .unwrap()
            .unwrap();
        assert_eq!(&resealed.body.as_ref().unwrap()[6..8], b"k2");
        let forgotten = keyring(Some("k2"), &[("k2", [2; 32])]);
        let why = forgotten.open_response(&id("s", "a"), sealed).unwrap_err();
        assert!(why.contains("\"k1\""), "{why}");
    }

    #[test]
    fn plaintext_opens_only_when_accepted() {
        let strict = keyring(Some("k1"), &[("k1", [1; 32])]);
        assert!(strict.open(b"clear", b"ctx").is_err());
        let reading = keyring(None, &[("k1", [1; 32])]);
        assert_eq!(reading.open(b"clear", b"ctx").unwrap(), b"clear");
        let cleartext = reading.seal_response(&id("s", "a"), &response()).unwrap();
        assert!(cleartext.is_none(), "no active key: stored in clear");
    }

    #[test]
    fn truncated_or_garbled_envelopes_are_refused_without_panicking() {
        let ring = keyring(Some("k1"), &[("k1", [1; 32])]);
        let sealed = ring.seal("k1", b"payload", b"ctx").unwrap();
        for len in 0..sealed.len() {
            let _ = ring.open(&sealed[..len], b"ctx");
        }
        for at in MAGIC.len()..sealed.len() {
            let mut bad = sealed.clone();
            bad[at] ^= 0x01;
            assert!(ring.open(&bad, b"ctx").is_err(), "flip at {at} was accepted");
        }
    }

    #[test]
    fn config_errors_name_the_key() {
        let raw = |active: Option<&str>, keys: &[(&str, &str)]| RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            accept_plaintext: false,
        };
        let short = BASE64.encode([0u8; 16]);
        let good = BASE64.encode([0u8; 32]);
        let cases = [
            (raw(Some("k1"), &[("k1", &short)]), "encryption.keys.k1"),
            (raw(Some("k1"), &[("k1", "not base64!")]), "encryption.keys.k1"),
            (raw(Some("k2"), &[("k1", &good)]), "encryption.active_key"),
            (raw(Some("k1"), &[]), "encryption.active_key"),
            (raw(None, &[("bad id", &good)]), "encryption.keys.bad id"),
        ];
        for (raw, key) in cases {
            let err = Keyring::from_config(&raw).unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(!err.to_string().contains(&good), "{err}");
        }
        assert!(Keyring::from_config(&raw(None, &[])).unwrap().is_none());
    }
}
