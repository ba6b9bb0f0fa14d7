//! Encryption at rest, around any backend: [`EncryptedStore`] seals a completed response on `complete`
//! and opens it when `claim` finds a completed record. Runs on those two calls only; touches the stored
//! response and nothing else (claims, leases, `find` and `stats` pass through).
//!
//! A retained response is stored as one XChaCha20-Poly1305 blob in the body column (format 3,
//! `encrypted/sealed.rs`): status, every header and the body, bound to the record's scope, key and epoch
//! (the token of the claim that completed it), its status and header count, and the end of the record's
//! life: the seal's time by this replica's clock plus the longest a record of its scope can live
//! ([`RecordLifetimes`]). A blob whose record's life ended more than `encryption.max_clock_skew` ago is
//! refused: that is a row put back from an earlier use of the key, with its expiry rewritten so the store
//! would replay it. The row keeps only the status in clear (operators' `keys show` reads it) and no
//! headers. A response whose body was not retained is replayed as 410 and its headers are never used, so
//! it is stored as its status alone: nothing to seal.
//!
//! Records written by earlier versions stay readable while `encryption.min_format` allows: format 2 (the
//! same blob without the end of life), per-value AES-256-GCM (format 1, `encrypted/v1.rs`) with the same
//! configured keys, and records in clear while `accept_plaintext` allows them. A record that does not open
//! is refused, never replayed and never executed again.
//!
//! The configured 32-byte keys serve every format: format 1 only ever decrypts with them, and AES and
//! ChaCha20 share no structure, so no separate key is derived for the blob formats.

mod keyring;
mod sealed;
mod v1;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use uuid::Uuid;

pub use self::keyring::Keyring;
use self::keyring::{MAGIC, SealError, Unreadable};
use super::{
    ClaimRequest, ClaimResult, Existing, Lifecycle, ListPage, ListQuery, RecordId, RecordInfo, RecordStats,
    Store, StoreError, StoredResponse, Upkeep,
};
use crate::config::EncryptionConfig;
use crate::metrics::Metrics;

impl Keyring {
    /// The response as it is to be stored, sealed at `now` with the active key, or `Ok(None)` when no
    /// key is active (stored in clear).
    fn seal_response(
        &self,
        id: &RecordId,
        response: &StoredResponse,
        now: SystemTime,
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
        let binding = sealed::Binding {
            scope: &id.scope,
            key: &id.key,
            epoch: id.token,
            status: response.status,
        };
        let not_after = millis(now).saturating_add(millis_of(self.lifetimes.of(&id.scope)));
        let blob = sealed::seal(
            &ciphers.chacha,
            active,
            &binding,
            not_after,
            &response.headers,
            body,
        )?;
        Ok(Some(StoredResponse {
            status: response.status,
            headers: Vec::new(),
            body: Some(blob.into()),
        }))
    }

    /// Opens a stored response of any format the config allows, at `now`; `epoch` is the token of the
    /// claim that completed it.
    fn open_response(
        &self,
        id: &RecordId,
        epoch: Uuid,
        stored: StoredResponse,
        now: SystemTime,
    ) -> Result<StoredResponse, Unreadable> {
        match &stored.body {
            Some(blob) => match format_version(blob) {
                Some(version @ (sealed::V2 | sealed::V3)) => {
                    self.open_blob(id, epoch, version, blob, &stored, now)
                }
                _ => v1::open_response(self, id, stored),
            },
            // Kept without its body, under any format: nothing was sealed and nothing will be replayed.
            None if stored.headers.is_empty() => Ok(stored),
            // Format 1 sealed the headers of a response kept without its body; they are never used (it
            // is replayed as 410), so a config that refuses format 1 drops them unopened.
            None if self.min_format > v1::VERSION => Ok(StoredResponse {
                headers: Vec::new(),
                ..stored
            }),
            None => v1::open_response(self, id, stored),
        }
    }

    /// Opens a blob of format 2 or 3, if `min_format` allows it, and refuses a format 3 blob whose
    /// record's life has ended.
    fn open_blob(
        &self,
        id: &RecordId,
        epoch: Uuid,
        version: u8,
        blob: &[u8],
        stored: &StoredResponse,
        now: SystemTime,
    ) -> Result<StoredResponse, Unreadable> {
        if version < self.min_format {
            return Err(Unreadable::FormatRefused {
                version,
                min: self.min_format,
            });
        }
        if !stored.headers.is_empty() {
            return Err(Unreadable::Malformed(
                "header values are stored beside a sealed record",
            ));
        }
        let binding = sealed::Binding {
            scope: &id.scope,
            key: &id.key,
            epoch,
            status: stored.status,
        };
        let (response, clear) = sealed::open(self, &binding, blob)?;
        if let Some(not_after) = clear.not_after {
            let deadline = not_after.saturating_add(millis_of(self.max_clock_skew));
            if millis(now) > deadline {
                return Err(Unreadable::LifeOver((millis(now) - not_after) / 1000));
            }
        }
        Ok(response)
    }
}

/// Milliseconds since the Unix epoch (0 for a clock set before it).
fn millis(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH).map_or(0, millis_of)
}

fn millis_of(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The format version of a sealed value; `None` for a value in clear.
fn format_version(stored: &[u8]) -> Option<u8> {
    stored.strip_prefix(MAGIC.as_slice())?.first().copied()
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
        match self.keyring.open_response(id, token, response, SystemTime::now()) {
            Ok(response) => Ok(ClaimResult::Held(Existing::Completed {
                same_fingerprint,
                response,
                expires_in,
                token,
            })),
            Err(why) => {
                self.metrics.undecryptable.inc();
                tracing::error!(key_hash = %id.key_hash(), reason = %why, "stored response cannot be decrypted");
                Err(StoreError::Undecryptable(why.to_string()))
            }
        }
    }
}

#[async_trait::async_trait]
impl Lifecycle for EncryptedStore {
    fn for_worker(&self) -> Option<Arc<dyn Store>> {
        let inner = self.inner.for_worker()?;
        Some(Arc::new(EncryptedStore::new(
            inner,
            self.keyring.clone(),
            self.metrics.clone(),
        )))
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let result = self.inner.claim(request).await?;
        self.open_claim(&request.id, result)
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.inner.heartbeat(id, lease).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        match self.keyring.seal_response(id, response, SystemTime::now()) {
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

    async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        self.inner.announce(announcement).await
    }
}

#[async_trait::async_trait]
impl Upkeep for EncryptedStore {
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

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }

    async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.inner.forget(id).await
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;
    use bytes::Bytes;

    use super::*;
    use crate::config::RawEncryption;
    use crate::config::RecordLifetimes;

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
            ..RawEncryption::default()
        };
        Keyring::from_config(&raw.validate().unwrap().unwrap())
    }

    impl Keyring {
        fn open_now(
            &self,
            id: &RecordId,
            epoch: Uuid,
            stored: StoredResponse,
        ) -> Result<StoredResponse, Unreadable> {
            self.open_response(id, epoch, stored, SystemTime::now())
        }

        fn seal_now(
            &self,
            id: &RecordId,
            response: &StoredResponse,
        ) -> Result<Option<StoredResponse>, SealError> {
            self.seal_response(id, response, SystemTime::now())
        }
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
        ring.seal_now(id, &response()).unwrap().unwrap()
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
        assert!(blob.starts_with(b"\0IPE\x03\x02k1\0\0\0\x03"), "{blob:?}");
        for secret in [&b"4111"[..], b"alice", b"application/json", b"x-account"] {
            assert!(!contains(&blob, secret), "{secret:?} is in clear");
        }
        assert_eq!(ring.open_now(&record, record.token, stored).unwrap(), response());
    }

    #[test]
    fn a_response_without_its_body_is_stored_as_its_status_alone() {
        let ring = strict();
        let record = id("s", "a", 1);
        let mut gone = response();
        gone.body = None;
        let stored = ring.seal_now(&record, &gone).unwrap().unwrap();
        let status_only = StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: None,
        };
        assert_eq!(stored, status_only);
        assert_eq!(ring.open_now(&record, record.token, stored).unwrap(), status_only);
    }

    #[test]
    fn every_seal_uses_a_fresh_nonce() {
        let ring = strict();
        let record = id("s", "a", 1);
        let (a, b) = (blob(&sealed(&ring, &record)), blob(&sealed(&ring, &record)));
        let nonce = 4 + 2 + 2 + 4 + 8..4 + 2 + 2 + 4 + 8 + 24;
        assert_ne!(a[nonce.clone()], b[nonce]);
        assert_ne!(a, b);
    }

    #[test]
    fn a_blob_opens_only_in_its_own_record_and_epoch() {
        let ring = strict();
        let record = id("s", "a", 1);
        let stored = sealed(&ring, &record);
        let refused = |id: &RecordId, epoch: u128, stored: StoredResponse| {
            let why = ring.open_now(id, Uuid::from_u128(epoch), stored).unwrap_err();
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
            let why = ring.open_now(&record, record.token, with_blob(&stored, blob));
            assert!(why.is_err(), "header count {count} accepted");
        }
        let mut stray = stored;
        stray.headers.push(("x-injected".into(), b"1".to_vec()));
        assert!(ring.open_now(&record, record.token, stray).is_err());
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
                ring.open_now(&record, record.token, cut).is_err(),
                "a cut at {len} was accepted"
            );
        }
        for at in 0..whole.len() {
            for bit in [0x01, 0x80] {
                let mut flipped = whole.clone();
                flipped[at] ^= bit;
                let opened = ring.open_now(&record, record.token, with_blob(&stored, flipped));
                assert!(opened.is_err(), "flipping {bit:#x} at {at} was accepted");
            }
        }
    }

    #[test]
    fn old_keys_still_open_after_rotation_and_unknown_ids_are_named() {
        let record = id("s", "a", 1);
        let stored = sealed(&strict(), &record);
        let rotated = keyring(Some("k2"), &[("k1", K1), ("k2", K2)], false);
        let opened = rotated.open_now(&record, record.token, stored.clone());
        assert_eq!(opened.unwrap(), response());
        assert!(blob(&sealed(&rotated, &record)).starts_with(b"\0IPE\x03\x02k2"));
        let forgotten = keyring(Some("k2"), &[("k2", K2)], false);
        let why = forgotten.open_now(&record, record.token, stored).unwrap_err();
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
        future[4] = 4;
        let why = ring.open_now(&record, record.token, with_blob(&stored, future));
        assert!(why.unwrap_err().to_string().contains("unknown format version 4"));
        let mut garbled = blob(&stored);
        garbled[6] = b'\n';
        let why = ring.open_now(&record, record.token, with_blob(&stored, garbled));
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
        let opened = rotated.open_now(&record, Uuid::nil(), v1_fixture()).unwrap();
        let expected = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-account".into(), b"alice@example.com".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"card\":\"4111\"}")),
        };
        assert_eq!(opened, expected);
        let elsewhere = rotated.open_now(&id("orders:ab12", "k-2", 5), Uuid::nil(), v1_fixture());
        assert!(elsewhere.is_err(), "v1 values stay bound to their record");
    }

    #[test]
    fn v1_records_with_and_without_a_body_open_and_stay_bound() {
        let ring = strict();
        let record = id("s", "a", 1);
        let v1 = v1::writer::seal_response(&ring, "k1", &record, &response());
        assert_eq!(
            ring.open_now(&record, Uuid::nil(), v1.clone()).unwrap(),
            response()
        );
        let mut gone = response();
        gone.body = None;
        let v1_gone = v1::writer::seal_response(&ring, "k1", &record, &gone);
        assert_eq!(ring.open_now(&record, Uuid::nil(), v1_gone).unwrap(), gone);
        let mut swapped = v1;
        swapped.headers.swap(0, 1);
        assert!(ring.open_now(&record, Uuid::nil(), swapped).is_err());
        let mut flipped = v1::writer::seal_response(&ring, "k1", &record, &response());
        let last = flipped.headers[1].1.len() - 1;
        flipped.headers[1].1[last] ^= 1;
        let why = ring.open_now(&record, Uuid::nil(), flipped).unwrap_err();
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
            assert!(ring.open_now(&record, Uuid::nil(), cut).is_err(), "cut at {len}");
        }
    }

    #[test]
    fn records_in_clear_open_only_while_plaintext_is_accepted() {
        let record = id("s", "a", 1);
        let clear = response();
        let why = strict().open_now(&record, record.token, clear.clone());
        assert_eq!(
            why.unwrap_err().to_string(),
            "header 0: stored in clear while encryption.accept_plaintext is off"
        );
        let accepting = keyring(Some("k1"), &[("k1", K1)], true);
        assert_eq!(
            accepting.open_now(&record, record.token, clear.clone()).unwrap(),
            clear
        );
        let reading = keyring(None, &[("k1", K1)], false);
        assert!(
            reading.seal_now(&record, &clear).unwrap().is_none(),
            "no active key: stored in clear"
        );
        assert_eq!(
            reading.open_now(&record, record.token, clear.clone()).unwrap(),
            clear
        );
        let mut headless = clear;
        headless.headers.clear();
        let why = strict().open_now(&record, record.token, headless).unwrap_err();
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
        let opened = strict().open_now(&record, record.token, status_only.clone());
        assert_eq!(
            opened.unwrap(),
            status_only,
            "replayed as 410; nothing in it to protect"
        );
    }

    /// The strict keyring opening from format `min_format` on, whose records of scope "s" live a minute.
    fn from_format(min_format: u8) -> Keyring {
        let raw = RawEncryption {
            active_key: Some("k1".into()),
            keys: [("k1".to_string(), BASE64.encode(K1))].into(),
            min_format,
            ..RawEncryption::default()
        };
        let lifetimes = RecordLifetimes::new([("s", Duration::from_secs(60))]);
        Keyring::from_config(&raw.validate().unwrap().unwrap().with_lifetimes(lifetimes))
    }

    #[test]
    fn a_blob_opens_until_its_record_life_and_the_clock_skew_have_passed() {
        let ring = from_format(1);
        let record = id("s:ab", "a", 1);
        let sealed_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let stored = ring
            .seal_response(&record, &response(), sealed_at)
            .unwrap()
            .unwrap();
        let open_at =
            |later: Duration| ring.open_response(&record, record.token, stored.clone(), sealed_at + later);
        assert_eq!(open_at(Duration::ZERO).unwrap(), response());
        let last = Duration::from_secs(60 + 300);
        assert_eq!(open_at(last).unwrap(), response(), "60 s of life, 300 s of skew");
        let why = open_at(last + Duration::from_secs(2)).unwrap_err();
        assert_eq!(why, Unreadable::LifeOver(302));
        assert!(why.to_string().contains("earlier use of the key"), "{why}");
    }

    #[test]
    fn the_end_of_life_is_authenticated() {
        let ring = from_format(1);
        let record = id("s:ab", "a", 1);
        let stored = sealed(&ring, &record);
        let not_after = 4 + 2 + 2 + 4..4 + 2 + 2 + 4 + 8;
        let mut later = blob(&stored);
        later[not_after].copy_from_slice(&u64::MAX.to_be_bytes());
        let why = ring.open_now(&record, record.token, with_blob(&stored, later));
        assert_eq!(why.unwrap_err(), Unreadable::DoesNotOpen("k1".into()));
    }

    #[test]
    fn a_scope_no_route_names_gets_the_longest_life() {
        let ring = from_format(1);
        let record = id("other:ab", "a", 1);
        let sealed_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let stored = ring
            .seal_response(&record, &response(), sealed_at)
            .unwrap()
            .unwrap();
        let later = sealed_at + Duration::from_secs(60 + 300);
        assert!(
            ring.open_response(&record, record.token, stored.clone(), later)
                .is_ok()
        );
        let too_late = later + Duration::from_secs(1);
        assert!(
            ring.open_response(&record, record.token, stored, too_late)
                .is_err()
        );
    }

    /// The response as format 2 sealed it for `record`: bound to its epoch, with no end of life.
    fn v2_record(ring: &Keyring, record: &RecordId) -> StoredResponse {
        let binding = sealed::Binding {
            scope: &record.scope,
            key: &record.key,
            epoch: record.token,
            status: 201,
        };
        let cipher = &ring.cipher("k1").unwrap().chacha;
        let r = response();
        let blob = sealed::seal_v2(cipher, "k1", &binding, &r.headers, r.body.as_deref().unwrap()).unwrap();
        StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: Some(blob.into()),
        }
    }

    #[test]
    fn min_format_refuses_the_formats_below_it_and_nothing_else() {
        let record = id("s:ab", "a", 1);
        let status_only = StoredResponse {
            status: 201,
            headers: Vec::new(),
            body: None,
        };
        for min_format in 1..=3u8 {
            let ring = from_format(min_format);
            let v1 = v1::writer::seal_response(&ring, "k1", &record, &response());
            let v1_opened = ring.open_now(&record, Uuid::nil(), v1);
            let v2_opened = ring.open_now(&record, record.token, v2_record(&ring, &record));
            let v3_opened = ring.open_now(&record, record.token, sealed(&ring, &record));
            assert_eq!(
                v1_opened.is_ok(),
                min_format <= 1,
                "format 1 under min_format {min_format}"
            );
            assert_eq!(
                v2_opened.is_ok(),
                min_format <= 2,
                "format 2 under min_format {min_format}"
            );
            assert_eq!(v3_opened.unwrap(), response());
            if min_format == 3 {
                let refused = ring.open_now(&record, record.token, v2_record(&ring, &record));
                assert_eq!(
                    refused.unwrap_err().to_string(),
                    "sealed as format 2, which encryption.min_format 3 refuses"
                );
            }
            let mut gone = response();
            gone.body = None;
            let v1_gone = v1::writer::seal_response(&ring, "k1", &record, &gone);
            let opened = ring.open_now(&record, Uuid::nil(), v1_gone).unwrap();
            assert_eq!(
                opened.body, None,
                "still replayed as 410 under min_format {min_format}"
            );
            let kept = ring.open_now(&record, record.token, status_only.clone());
            assert_eq!(kept.unwrap(), status_only);
        }
    }

    #[test]
    fn a_format_2_record_still_opens_only_for_its_epoch() {
        let ring = from_format(1);
        let record = id("s:ab", "a", 1);
        let stored = v2_record(&ring, &record);
        assert_eq!(
            ring.open_now(&record, record.token, stored.clone()).unwrap(),
            response()
        );
        let why = ring.open_now(&record, Uuid::from_u128(2), stored);
        assert_eq!(why.unwrap_err(), Unreadable::DoesNotOpen("k1".into()));
    }
}
