//! Encryption at rest, around any backend: [`EncryptedStore`] seals a completed response on `complete`
//! and opens it when `claim` finds a completed record. Runs on those two calls only; touches the stored
//! response and nothing else (claims, leases, `find` and `stats` pass through).
//!
//! A retained response is stored as one XChaCha20-Poly1305 blob in the body column (format v2,
//! `encrypted/v2.rs`): status, every header and the body, bound to the record's scope, key and epoch (the
//! token of the claim that completed it), its status and header count. The row keeps only the status in
//! clear (operators' `keys show` reads it) and no headers. A response whose body was not retained is
//! replayed as 410 and its headers are never used, so it is stored as its status alone: nothing to seal.
//!
//! Records written by earlier versions stay readable: per-value AES-256-GCM (format v1,
//! `encrypted/v1.rs`) with the same configured keys, and records in clear while `accept_plaintext` allows
//! them. A record that does not open is refused, never replayed and never executed again.
//!
//! The configured 32-byte keys serve both formats: v1 only ever decrypts with them, and AES and ChaCha20
//! share no structure, so no separate key is derived for v2.

mod v1;
mod v2;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use aes_gcm::aead::KeyInit as _;
use aes_gcm::{Aes256Gcm, Key};
use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::KeyInit as _;
use uuid::Uuid;

use super::{
    ClaimRequest, ClaimResult, Existing, RecordId, RecordInfo, RecordStats, Store, StoreError, StoredResponse,
};
use crate::config::{EncryptionConfig, EncryptionKey, is_key_id};
use crate::metrics::Metrics;

/// Starts every sealed value of every format; chosen so that text bodies stored in clear never start
/// with it. The byte after it is the format version.
const MAGIC: &[u8; 4] = b"\0IPE";

/// Why a stored response does not open. Names no stored bytes beyond a well-formed key id: it is
/// logged, and the record is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
enum Unreadable {
    #[error("stored in clear while encryption.accept_plaintext is off")]
    Plaintext,
    #[error("truncated")]
    Truncated,
    #[error("unknown format version {0}")]
    UnknownVersion(u8),
    #[error("the stored key id is malformed")]
    MalformedKeyId,
    #[error("sealed with key id {0:?}, which is not configured")]
    UnknownKey(String),
    #[error("does not open with key {0:?}: tampered, or moved from another record or completion")]
    DoesNotOpen(String),
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("header {index}: {why}")]
    Header { index: usize, why: Box<Unreadable> },
    #[error("body: {0}")]
    Body(Box<Unreadable>),
}

/// Why a response could not be sealed; the response is then not stored.
#[derive(Debug, thiserror::Error)]
enum SealError {
    #[error("the active key {0:?} is not configured")]
    MissingKey(String),
    #[error("the response is too large to seal")]
    TooLarge,
    #[error("the system's random number generator failed")]
    Random,
}

/// One configured key, as the cipher of each format.
struct KeyCiphers {
    v1: Aes256Gcm,
    v2: XChaCha20Poly1305,
}

/// The configured keys: which one seals new records, and every one that may open old ones.
pub struct Keyring {
    active: Option<String>,
    keys: BTreeMap<String, KeyCiphers>,
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
    /// The ciphers of the validated `[encryption]`. Cannot fail: the config has checked every key id,
    /// every key's length and that the active key is among them.
    pub fn from_config(config: &EncryptionConfig) -> Keyring {
        Keyring {
            active: config.active_key().map(str::to_owned),
            keys: config
                .keys()
                .map(|(id, key)| (id.to_owned(), KeyCiphers::new(key)))
                .collect(),
            accept_plaintext: config.accept_plaintext(),
        }
    }

    /// No keys: records are stored in clear, and a sealed one (written by a replica that has keys) is
    /// refused rather than replayed as its ciphertext.
    fn none() -> Keyring {
        Keyring {
            active: None,
            keys: BTreeMap::new(),
            accept_plaintext: true,
        }
    }

    fn cipher(&self, id: &str) -> Result<&KeyCiphers, Unreadable> {
        self.keys
            .get(id)
            .ok_or_else(|| Unreadable::UnknownKey(id.to_owned()))
    }

    /// The response as it is to be stored: sealed with the active key, or `Ok(None)` when no key is
    /// active (stored in clear).
    fn seal_response(
        &self,
        id: &RecordId,
        response: &StoredResponse,
    ) -> Result<Option<StoredResponse>, SealError> {
        let Some(active) = &self.active else {
            return Ok(None);
        };
        let Some(body) = &response.body else {
            // Replayed as 410 without its headers: keeping them would only keep secrets.
            return Ok(Some(StoredResponse {
                status: response.status,
                headers: Vec::new(),
                body: None,
            }));
        };
        let ciphers = self
            .keys
            .get(active)
            .ok_or_else(|| SealError::MissingKey(active.clone()))?;
        let binding = v2::Binding {
            scope: &id.scope,
            key: &id.key,
            epoch: id.token,
            status: response.status,
        };
        let blob = v2::seal(&ciphers.v2, active, &binding, &response.headers, body)?;
        Ok(Some(StoredResponse {
            status: response.status,
            headers: Vec::new(),
            body: Some(blob.into()),
        }))
    }

    /// Opens a stored response of any format; `epoch` is the token of the claim that completed it.
    fn open_response(
        &self,
        id: &RecordId,
        epoch: Uuid,
        stored: StoredResponse,
    ) -> Result<StoredResponse, Unreadable> {
        match &stored.body {
            Some(blob) if format_version(blob) == Some(v2::VERSION) => {
                if !stored.headers.is_empty() {
                    return Err(Unreadable::Malformed(
                        "header values are stored beside a sealed record",
                    ));
                }
                let binding = v2::Binding {
                    scope: &id.scope,
                    key: &id.key,
                    epoch,
                    status: stored.status,
                };
                v2::open(self, &binding, blob)
            }
            // Kept without its body, under any format: nothing was sealed and nothing will be replayed.
            None if stored.headers.is_empty() => Ok(stored),
            _ => v1::open_response(self, id, stored),
        }
    }
}

/// The format version of a sealed value; `None` for a value in clear.
fn format_version(stored: &[u8]) -> Option<u8> {
    stored.strip_prefix(MAGIC.as_slice())?.first().copied()
}

/// A key id read from a sealed value; refused unless it could have been configured, so that what gets
/// logged is never arbitrary stored bytes.
fn key_id_of(stored: &[u8]) -> Result<&str, Unreadable> {
    std::str::from_utf8(stored)
        .ok()
        .filter(|id| is_key_id(id))
        .ok_or(Unreadable::MalformedKeyId)
}

impl KeyCiphers {
    /// Both formats' ciphers of one key; AES and ChaCha20 share no structure, so the key serves both.
    fn new(key: &EncryptionKey) -> KeyCiphers {
        KeyCiphers {
            v1: Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(key.bytes())),
            v2: XChaCha20Poly1305::new(&(*key.bytes()).into()),
        }
    }
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

    /// `inner` wrapped with the keyring of the configured `[encryption]`. Without one it is wrapped all
    /// the same, with no keys: a replica whose `[encryption]` is missing must refuse a record sealed by one
    /// that has it (500 `record-unreadable`), not replay the ciphertext as the response body.
    pub fn wrap(
        inner: Arc<dyn Store>,
        encryption: Option<&EncryptionConfig>,
        metrics: &Metrics,
    ) -> Arc<dyn Store> {
        let keyring = encryption.map_or_else(Keyring::none, Keyring::from_config);
        Arc::new(EncryptedStore::new(inner, Arc::new(keyring), metrics.clone()))
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
        match self.keyring.open_response(id, token, response) {
            Ok(response) => Ok(ClaimResult::Held(Existing::Completed {
                same_fingerprint,
                response,
                expires_in,
                token,
            })),
            Err(why) => {
                self.metrics.undecryptable.inc();
                tracing::error!(key = %id.key, reason = %why, "stored response cannot be decrypted");
                Err(StoreError::Undecryptable(why.to_string()))
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

    /// Describes records without opening them: the size reported for a sealed record is its blob's, which
    /// holds the headers too.
    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner.find(key, scope).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.inner.stats().await
    }

    async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        self.inner.announce(announcement).await
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;
    use bytes::Bytes;

    use super::*;
    use crate::config::RawEncryption;

    const K1: [u8; 32] = [7; 32];
    const K2: [u8; 32] = [9; 32];

    fn keyring(active: Option<&str>, keys: &[(&str, [u8; 32])], accept_plaintext: bool) -> Keyring {
        let raw = RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys
                .iter()
                .map(|(id, key)| (id.to_string(), BASE64.encode(key)))
                .collect(),
            accept_plaintext,
        };
        Keyring::from_config(&raw.validate().unwrap().unwrap())
    }

    fn strict() -> Keyring {
        keyring(Some("k1"), &[("k1", K1)], false)
    }

    fn id(scope: &str, key: &str, token: u128) -> RecordId {
        RecordId {
            scope: scope.into(),
            key: key.into(),
            token: Uuid::from_u128(token),
        }
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-account".into(), b"alice@example.com".to_vec()),
                ("x-account".into(), b"".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"card\":\"4111\"}")),
        }
    }

    /// The response sealed by `ring` for the record `id`, as the backend would store it.
    fn sealed(ring: &Keyring, id: &RecordId) -> StoredResponse {
        ring.seal_response(id, &response()).unwrap().unwrap()
    }

    fn blob(stored: &StoredResponse) -> Vec<u8> {
        stored.body.as_ref().unwrap().to_vec()
    }

    fn with_blob(stored: &StoredResponse, blob: Vec<u8>) -> StoredResponse {
        StoredResponse {
            body: Some(Bytes::from(blob)),
            ..stored.clone()
        }
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn a_record_is_one_blob_that_hides_everything_but_the_status_and_opens_for_its_epoch() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        assert_eq!(stored.status, 201, "the status stays in clear");
        assert!(stored.headers.is_empty(), "headers live in the blob");
        let blob = blob(&stored);
        assert!(blob.starts_with(b"\0IPE\x02\x02k1\0\0\0\x03"), "{blob:?}");
        for secret in [&b"4111"[..], b"alice", b"application/json", b"x-account"] {
            assert!(!contains(&blob, secret), "{secret:?} is in clear");
        }
        assert_eq!(
            ring.open_response(&record, record.token, stored).unwrap(),
            response()
        );
    }

    #[test]
    fn a_response_without_its_body_is_stored_as_its_status_alone() {
        let ring = strict();
        let record = id("s", "a", 1);
        let mut gone = response();
        gone.body = None;
        let stored = ring.seal_response(&record, &gone).unwrap().unwrap();
        let status_only = StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: None,
        };
        assert_eq!(stored, status_only);
        assert_eq!(
            ring.open_response(&record, record.token, stored).unwrap(),
            status_only
        );
    }

    #[test]
    fn every_seal_uses_a_fresh_nonce() {
        let ring = strict();
        let record = id("s", "a", 1);
        let (a, b) = (blob(&sealed(&ring, &record)), blob(&sealed(&ring, &record)));
        let nonce = 4 + 2 + 2 + 4..4 + 2 + 2 + 4 + 24;
        assert_ne!(a[nonce.clone()], b[nonce]);
        assert_ne!(a, b);
    }

    #[test]
    fn a_blob_opens_only_in_its_own_record_and_epoch() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        let refused = |id: &RecordId, epoch: u128, stored: StoredResponse| {
            let why = ring
                .open_response(id, Uuid::from_u128(epoch), stored)
                .unwrap_err();
            assert_eq!(why, Unreadable::DoesNotOpen("k1".into()));
        };
        refused(&id("s", "b", 1), 1, stored.clone());
        refused(&id("t", "a", 1), 1, stored.clone());
        refused(&record, 2, stored.clone());
        refused(&record, 0, stored.clone());
        let mut status = stored.clone();
        status.status = 200;
        refused(&record, 1, status);
    }

    #[test]
    fn a_changed_header_count_or_stray_header_values_are_refused() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        let count_at = 4 + 2 + 2 + 3;
        for count in [0, 2, 4, 255] {
            let mut blob = blob(&stored);
            blob[count_at] = count;
            let why = ring.open_response(&record, record.token, with_blob(&stored, blob));
            assert!(why.is_err(), "header count {count} accepted");
        }
        let mut stray = stored;
        stray.headers.push(("x-injected".into(), b"1".to_vec()));
        assert!(ring.open_response(&record, record.token, stray).is_err());
    }

    #[test]
    fn a_truncated_or_flipped_blob_is_refused_without_panicking() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        let whole = blob(&stored);
        for len in 0..whole.len() {
            let cut = with_blob(&stored, whole[..len].to_vec());
            assert!(
                ring.open_response(&record, record.token, cut).is_err(),
                "a cut at {len} was accepted"
            );
        }
        for at in 0..whole.len() {
            for bit in [0x01, 0x80] {
                let mut flipped = whole.clone();
                flipped[at] ^= bit;
                let opened = ring.open_response(&record, record.token, with_blob(&stored, flipped));
                assert!(opened.is_err(), "flipping {bit:#x} at {at} was accepted");
            }
        }
    }

    #[test]
    fn old_keys_still_open_after_rotation_and_unknown_ids_are_named() {
        let record = id("s", "a", 1);
        let stored = sealed(&strict(), &record);
        let rotated = keyring(Some("k2"), &[("k1", K1), ("k2", K2)], false);
        let opened = rotated.open_response(&record, record.token, stored.clone());
        assert_eq!(opened.unwrap(), response());
        assert!(blob(&sealed(&rotated, &record)).starts_with(b"\0IPE\x02\x02k2"));
        let forgotten = keyring(Some("k2"), &[("k2", K2)], false);
        let why = forgotten
            .open_response(&record, record.token, stored)
            .unwrap_err();
        assert_eq!(
            why.to_string(),
            "sealed with key id \"k1\", which is not configured"
        );
    }

    #[test]
    fn an_unknown_format_version_or_malformed_key_id_is_refused_without_echoing_it() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        let mut future = blob(&stored);
        future[4] = 3;
        let why = ring.open_response(&record, record.token, with_blob(&stored, future));
        assert!(why.unwrap_err().to_string().contains("unknown format version 3"));
        let mut garbled = blob(&stored);
        garbled[6] = b'\n';
        let why = ring.open_response(&record, record.token, with_blob(&stored, garbled));
        assert_eq!(why.unwrap_err(), Unreadable::MalformedKeyId);
    }

    /// Sealed by the format-1 code as it was before the one-blob format (key `[7; 32]` as "k1", scope
    /// "orders:ab12", key "k-1", status 201): header values then the body.
    const V1_FIXTURE: [&str; 3] = [
        "0049504501026b3153199f3b19d093a7ceebc48f577899909a700e6e7653dfdd9ab1f59e9eabc02ced180a3b922aa0b8bce4431e",
        "0049504501026b316a2999aabeb833fe8ea4e7b92fe54c489a58eab9860e6fa525f4d3da50eaddcf4762b9873acdd97b48540c85e8",
        "0049504501026b318b84eec74ac7057c89416ded6b8772212135526020fafddbdb642ae9721631c3f1e4f0cebe20efc84613f7",
    ];

    fn v1_fixture() -> StoredResponse {
        let value = |i: usize| hex::decode(V1_FIXTURE[i]).unwrap();
        StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), value(0)), ("x-account".into(), value(1))],
            body: Some(Bytes::from(value(2))),
        }
    }

    #[test]
    fn a_v1_record_written_before_the_upgrade_still_opens() {
        let record = id("orders:ab12", "k-1", 5);
        let rotated = keyring(Some("k2"), &[("k1", K1), ("k2", K2)], false);
        let opened = rotated.open_response(&record, Uuid::nil(), v1_fixture()).unwrap();
        let expected = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-account".into(), b"alice@example.com".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"card\":\"4111\"}")),
        };
        assert_eq!(opened, expected);
        let elsewhere = rotated.open_response(&id("orders:ab12", "k-2", 5), Uuid::nil(), v1_fixture());
        assert!(elsewhere.is_err(), "v1 values stay bound to their record");
    }

    #[test]
    fn v1_records_with_and_without_a_body_open_and_stay_bound() {
        let ring = strict();
        let record = id("s", "a", 1);
        let v1 = v1::writer::seal_response(&ring, "k1", &record, &response());
        assert_eq!(
            ring.open_response(&record, Uuid::nil(), v1.clone()).unwrap(),
            response()
        );
        let mut gone = response();
        gone.body = None;
        let v1_gone = v1::writer::seal_response(&ring, "k1", &record, &gone);
        assert_eq!(ring.open_response(&record, Uuid::nil(), v1_gone).unwrap(), gone);
        let mut swapped = v1;
        swapped.headers.swap(0, 1);
        assert!(ring.open_response(&record, Uuid::nil(), swapped).is_err());
        let mut flipped = v1::writer::seal_response(&ring, "k1", &record, &response());
        let last = flipped.headers[1].1.len() - 1;
        flipped.headers[1].1[last] ^= 1;
        let why = ring.open_response(&record, Uuid::nil(), flipped).unwrap_err();
        assert!(why.to_string().starts_with("header 1: does not open"), "{why}");
    }

    #[test]
    fn a_truncated_v1_value_is_refused_without_panicking() {
        let ring = strict();
        let record = id("orders:ab12", "k-1", 5);
        let whole = v1_fixture();
        let body = blob(&whole);
        for len in 0..body.len() {
            let cut = with_blob(&whole, body[..len].to_vec());
            assert!(
                ring.open_response(&record, Uuid::nil(), cut).is_err(),
                "cut at {len}"
            );
        }
    }

    #[test]
    fn records_in_clear_open_only_while_plaintext_is_accepted() {
        let record = id("s", "a", 1);
        let clear = response();
        let why = strict().open_response(&record, record.token, clear.clone());
        assert_eq!(
            why.unwrap_err().to_string(),
            "header 0: stored in clear while encryption.accept_plaintext is off"
        );
        let accepting = keyring(Some("k1"), &[("k1", K1)], true);
        assert_eq!(
            accepting
                .open_response(&record, record.token, clear.clone())
                .unwrap(),
            clear
        );
        let reading = keyring(None, &[("k1", K1)], false);
        assert!(
            reading.seal_response(&record, &clear).unwrap().is_none(),
            "no active key: stored in clear"
        );
        assert_eq!(
            reading
                .open_response(&record, record.token, clear.clone())
                .unwrap(),
            clear
        );
        let mut headless = clear;
        headless.headers.clear();
        let why = strict()
            .open_response(&record, record.token, headless)
            .unwrap_err();
        assert_eq!(
            why.to_string(),
            "body: stored in clear while encryption.accept_plaintext is off"
        );
    }

    #[test]
    fn a_status_only_record_opens_whatever_the_plaintext_rule() {
        let record = id("s", "a", 1);
        let status_only = StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: None,
        };
        let opened = strict().open_response(&record, record.token, status_only.clone());
        assert_eq!(
            opened.unwrap(),
            status_only,
            "replayed as 410; nothing in it to protect"
        );
    }
}
