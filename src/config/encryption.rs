//! `[encryption]`: the keys that seal stored responses at rest, which record formats are still opened,
//! and how far apart clocks may be. Validated once at load into [`EncryptionConfig`] — every key id
//! well-formed, every key base64 of exactly [`KEY_LEN`] bytes, the active key among them — from which
//! `store/encrypted.rs` builds its ciphers without anything left to check; `config.rs` adds how long a
//! record of each scope can live ([`RecordLifetimes`], from the routes), which every seal carries. Touches
//! no store and no cipher. Two forms, because the keys are written as base64 and used as bytes, and an
//! `[encryption]` without keys means encryption is off.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Length of an encryption key, in bytes.
pub const KEY_LEN: usize = 32;
/// Longest key id; ids are stored in every sealed value.
pub const MAX_KEY_ID: usize = 64;
/// The record format every seal writes: one blob bound to its record, its completion and its life.
pub const CURRENT_FORMAT: u8 = 3;
/// `encryption.max_clock_skew` unless set.
const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_secs(300);
/// The largest `encryption.max_clock_skew`: past an hour, a clock is broken, not skewed.
const MAX_MAX_CLOCK_SKEW: Duration = Duration::from_secs(3600);

/// `[encryption]` as written: the keys that seal stored responses, and what is opened.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawEncryption {
    /// Id (in `keys`) of the key new records are encrypted with; unset means new records are stored in
    /// clear.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_key: Option<String>,
    /// Key id → base64 of 32 random bytes. Every key that encrypted a record still alive must stay here.
    pub keys: BTreeMap<String, String>,
    /// Replay records stored in clear (from before encryption was turned on) while a key is active.
    pub accept_plaintext: bool,
    /// The oldest record format opened: 1 opens every sealed record; 2 refuses format 1 (sealed apart
    /// per value, bound to no completion); 3 also refuses format 2 (bound to its completion but not to
    /// its life, so a row put back after it expired with a new expiry opens). Raise it one `ttl` after
    /// every replica runs a version that writes the format it names.
    pub min_format: u8,
    /// How far the clocks of the replicas may be apart. A record sealed in format 3 carries the end of
    /// its life by the sealing replica's clock, and is refused once that end is this much in the past.
    #[serde(with = "humantime_serde")]
    pub max_clock_skew: Duration,
}

impl Default for RawEncryption {
    fn default() -> Self {
        RawEncryption {
            active_key: None,
            keys: BTreeMap::new(),
            accept_plaintext: false,
            min_format: 1,
            max_clock_skew: DEFAULT_MAX_CLOCK_SKEW,
        }
    }
}

impl std::fmt::Debug for RawEncryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawEncryption")
            .field("active_key", &self.active_key)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .field("min_format", &self.min_format)
            .field("max_clock_skew", &self.max_clock_skew)
            .finish()
    }
}

/// Validated `[encryption]`, with at least one key. Built only by [`RawEncryption::validate`], so
/// whoever holds one may trust it: every id is a valid key id, every key is [`KEY_LEN`] bytes, and the
/// active key, when there is one, is among the keys.
#[derive(Clone)]
pub struct EncryptionConfig {
    active_key: Option<String>,
    keys: BTreeMap<String, EncryptionKey>,
    accept_plaintext: bool,
    min_format: u8,
    max_clock_skew: Duration,
    lifetimes: RecordLifetimes,
}

/// How long after its completion is sealed a record can still be alive, by scope name: its route's
/// `ttl` (a record expires `ttl` after its creation, which came before), plus its `lock_timeout` and
/// `store.timeout` (a heartbeat that commits after the seal extends the expiry to a lease past it). Routes
/// that share a scope name share the longest; a scope no route names (its route was removed) gets the
/// longest of all. Without routes (a config built by hand) a record's life is unbounded.
///
/// Every clone shares one table, so the store's keyring seals with what a reload makes of it
/// ([`RecordLifetimes::extend`]): a reload that lengthens a route's `ttl` lengthens the life its new
/// records are sealed with (else their replays would be refused as rows put back once the life the
/// proxy started with had passed).
#[derive(Debug, Clone, Default)]
pub struct RecordLifetimes(Arc<RwLock<Lives>>);

/// The lives themselves.
#[derive(Debug)]
struct Lives {
    by_scope: BTreeMap<String, Duration>,
    longest: Duration,
}

impl Default for Lives {
    fn default() -> Self {
        Lives {
            by_scope: BTreeMap::new(),
            longest: Duration::MAX,
        }
    }
}

impl RecordLifetimes {
    /// The lifetimes of `routes`: each as its scope name and the longest life of one of its records.
    pub fn new<'a>(routes: impl IntoIterator<Item = (&'a str, Duration)>) -> RecordLifetimes {
        let mut by_scope = BTreeMap::<String, Duration>::new();
        for (scope, life) in routes {
            let longest = by_scope.entry(scope.to_owned()).or_default();
            *longest = (*longest).max(life);
        }
        let longest = by_scope.values().copied().max().unwrap_or(Duration::MAX);
        RecordLifetimes(Arc::new(RwLock::new(Lives { by_scope, longest })))
    }

    /// The longest a record of `scope` (`name:hash`, as the store keeps it) can live after its seal.
    pub fn of(&self, scope: &str) -> Duration {
        let name = scope.rsplit_once(':').map_or(scope, |(name, _)| name);
        let lives = self.0.read().unwrap_or_else(|e| e.into_inner());
        lives.by_scope.get(name).copied().unwrap_or(lives.longest)
    }

    /// Takes the lives of a reloaded configuration's routes into this table (and so into every clone's):
    /// each scope's life becomes the longer of the two, as does the longest. Never shortened: a record
    /// claimed under the longer `ttl` before the reload may still be sealed after it.
    pub fn extend(&self, reloaded: &RecordLifetimes) {
        if Arc::ptr_eq(&self.0, &reloaded.0) {
            return;
        }
        let reloaded = reloaded.0.read().unwrap_or_else(|e| e.into_inner());
        let mut lives = self.0.write().unwrap_or_else(|e| e.into_inner());
        for (scope, life) in &reloaded.by_scope {
            let kept = lives.by_scope.entry(scope.clone()).or_default();
            *kept = (*kept).max(*life);
        }
        lives.longest = lives.longest.max(reloaded.longest);
    }
}

/// The bytes of one configured key; its `Debug` shows none of them.
#[derive(Clone)]
pub struct EncryptionKey([u8; KEY_LEN]);

impl EncryptionKey {
    /// The key's bytes.
    pub fn bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }
}

impl std::fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EncryptionKey(***)")
    }
}

impl std::fmt::Debug for EncryptionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptionConfig")
            .field("active_key", &self.active_key)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .field("min_format", &self.min_format)
            .field("max_clock_skew", &self.max_clock_skew)
            .finish()
    }
}

impl EncryptionConfig {
    /// Id of the key that seals new records; `None` stores new records in clear. Always one of
    /// [`keys`](Self::keys).
    pub fn active_key(&self) -> Option<&str> {
        self.active_key.as_deref()
    }

    /// Every configured key by id: the active one and those that may still open older records.
    pub fn keys(&self) -> impl Iterator<Item = (&str, &EncryptionKey)> {
        self.keys.iter().map(|(id, key)| (id.as_str(), key))
    }

    /// Whether records stored in clear are replayed: as `accept_plaintext` says, and always while no key
    /// is active, since new records are then stored in clear themselves.
    pub fn accept_plaintext(&self) -> bool {
        self.accept_plaintext
    }

    /// The oldest record format opened (`min_format`).
    pub fn min_format(&self) -> u8 {
        self.min_format
    }

    /// How far apart the replicas' clocks may be (`max_clock_skew`).
    pub fn max_clock_skew(&self) -> Duration {
        self.max_clock_skew
    }

    /// How long a record of each scope can live after its seal.
    pub fn lifetimes(&self) -> &RecordLifetimes {
        &self.lifetimes
    }

    /// The same config, sealing records with `lifetimes` (the routes').
    pub fn with_lifetimes(self, lifetimes: RecordLifetimes) -> EncryptionConfig {
        EncryptionConfig { lifetimes, ..self }
    }
}

/// Whether `id` could be a configured key id: 1 to [`MAX_KEY_ID`] of `A-Z a-z 0-9 - _`. Also what a
/// key id read back from a sealed value must be before it is logged.
pub fn is_key_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_KEY_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl RawEncryption {
    /// Checks the section; `None` when no keys are configured (encryption off). The first problem found
    /// is returned, naming the key id but never the key.
    pub fn validate(&self) -> Result<Option<EncryptionConfig>, ConfigError> {
        if self.keys.is_empty() {
            if self.active_key.is_some() {
                return Err(ConfigError::new(
                    "encryption.active_key",
                    "names a key but encryption.keys is empty",
                ));
            }
            return Ok(None);
        }
        let mut keys = BTreeMap::new();
        for (id, secret) in &self.keys {
            keys.insert(id.clone(), decode_key(id, secret)?);
        }
        if let Some(active) = &self.active_key
            && !keys.contains_key(active)
        {
            return Err(ConfigError::new(
                "encryption.active_key",
                format!("{active:?} is not a key id in encryption.keys"),
            ));
        }
        Ok(Some(EncryptionConfig {
            active_key: self.active_key.clone(),
            keys,
            accept_plaintext: self.accept_plaintext || self.active_key.is_none(),
            min_format: self.min_format()?,
            max_clock_skew: self.max_clock_skew()?,
            lifetimes: RecordLifetimes::default(),
        }))
    }

    fn min_format(&self) -> Result<u8, ConfigError> {
        if !(1..=CURRENT_FORMAT).contains(&self.min_format) {
            return Err(ConfigError::new(
                "encryption.min_format",
                format!(
                    "must be 1 (open every format), 2 (refuse format 1) or {CURRENT_FORMAT} (refuse 1 and 2)"
                ),
            ));
        }
        Ok(self.min_format)
    }

    fn max_clock_skew(&self) -> Result<Duration, ConfigError> {
        if self.max_clock_skew > MAX_MAX_CLOCK_SKEW {
            return Err(ConfigError::new(
                "encryption.max_clock_skew",
                "must be at most 1h",
            ));
        }
        Ok(self.max_clock_skew)
    }
}

fn decode_key(id: &str, secret: &str) -> Result<EncryptionKey, ConfigError> {
    let key = format!("encryption.keys.{id}");
    if !is_key_id(id) {
        return Err(ConfigError::new(
            &key,
            format!("a key id is 1 to {MAX_KEY_ID} of A-Z a-z 0-9 - _"),
        ));
    }
    let bytes = BASE64
        .decode(secret.trim())
        .map_err(|_| ConfigError::new(&key, "is not base64"))?;
    let bytes = <[u8; KEY_LEN]>::try_from(bytes.as_slice()).map_err(|_| {
        ConfigError::new(
            &key,
            format!(
                "must be {KEY_LEN} bytes after base64 decoding, is {} (make one with: openssl rand -base64 32)",
                bytes.len()
            ),
        )
    })?;
    Ok(EncryptionKey(bytes))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;

    use super::{RawEncryption, RecordLifetimes, is_key_id};
    use crate::config::Config;

    fn raw(active: Option<&str>, keys: &[(&str, &str)], accept_plaintext: bool) -> RawEncryption {
        RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            accept_plaintext,
            ..RawEncryption::default()
        }
    }

    #[test]
    fn config_errors_name_the_key() {
        let short = BASE64.encode([0u8; 16]);
        let good = BASE64.encode([0u8; 32]);
        let cases = [
            (raw(Some("k1"), &[("k1", &short)], false), "encryption.keys.k1"),
            (
                raw(Some("k1"), &[("k1", "not base64!")], false),
                "encryption.keys.k1",
            ),
            (raw(Some("k2"), &[("k1", &good)], false), "encryption.active_key"),
            (raw(Some("k1"), &[], false), "encryption.active_key"),
            (raw(None, &[("bad id", &good)], false), "encryption.keys.bad id"),
        ];
        for (raw, key) in cases {
            let err = raw.validate().unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(!err.to_string().contains(&good), "{err}");
        }
        assert!(raw(None, &[], false).validate().unwrap().is_none());
    }

    #[test]
    fn keys_are_decoded_and_plaintext_is_accepted_while_no_key_is_active() {
        let (k1, k2) = (BASE64.encode([7u8; 32]), BASE64.encode([9u8; 32]));
        let padded = format!(" {k1}\n");
        let config = raw(Some("k2"), &[("k1", &padded), ("k2", &k2)], false)
            .validate()
            .unwrap()
            .unwrap();
        assert_eq!(config.active_key(), Some("k2"));
        let keys: Vec<_> = config.keys().map(|(id, key)| (id, *key.bytes())).collect();
        assert_eq!(keys, vec![("k1", [7u8; 32]), ("k2", [9u8; 32])]);
        assert!(!config.accept_plaintext());
        let reading = raw(None, &[("k1", &k1)], false).validate().unwrap().unwrap();
        assert!(
            reading.accept_plaintext(),
            "no active key: new records are in clear"
        );
        assert!(!format!("{config:?}").contains("7, 7"), "{config:?}");
    }

    #[test]
    fn every_format_opens_by_default_and_min_format_refuses_the_older_ones() {
        let key = BASE64.encode([1u8; 32]);
        let with = |extra: &str| {
            Config::from_toml_str(&format!(
                "[encryption]\nactive_key = \"k1\"\nkeys = {{ k1 = \"{key}\" }}\n{extra}"
            ))
        };
        let config = with("").unwrap();
        let encryption = config.encryption.unwrap();
        assert_eq!(encryption.min_format(), 1, "today's records stay readable");
        assert_eq!(encryption.max_clock_skew(), std::time::Duration::from_secs(300));
        let strict = with("min_format = 3\nmax_clock_skew = \"30s\"\n").unwrap();
        assert_eq!(strict.encryption.as_ref().unwrap().min_format(), 3);
        for (extra, key) in [
            ("min_format = 0", "encryption.min_format"),
            ("min_format = 4", "encryption.min_format"),
            ("min_format = \"v2\"", "encryption.min_format"),
            ("max_clock_skew = \"2h\"", "encryption.max_clock_skew"),
            ("max_clock_skew = \"a while\"", "encryption.max_clock_skew"),
        ] {
            let err = with(extra).unwrap_err();
            assert_eq!(err.key, key, "{extra}: {err}");
        }
    }

    #[test]
    fn a_reload_lengthens_the_lives_every_clone_seals_with_and_never_shortens_them() {
        let hours = |h: u64| Duration::from_secs(h * 3600);
        let running = RecordLifetimes::new([("default", hours(1)), ("hooks", hours(48))]);
        let keyring = running.clone();
        running.extend(&RecordLifetimes::new([
            ("default", hours(24)),
            ("hooks", hours(2)),
            ("new", hours(72)),
        ]));
        assert_eq!(
            keyring.of("default:ab"),
            hours(24),
            "lengthened, and seen by the keyring's clone"
        );
        assert_eq!(keyring.of("hooks:ab"), hours(48), "never shortened");
        assert_eq!(keyring.of("new:ab"), hours(72), "a route the reload adds");
        assert_eq!(
            keyring.of("gone:ab"),
            hours(72),
            "an unknown scope gets the longest"
        );
        running.extend(&keyring);
        assert_eq!(keyring.of("default:ab"), hours(24));
    }

    #[test]
    fn a_record_lives_at_most_its_routes_ttl_lease_and_store_timeout_after_its_seal() {
        let key = BASE64.encode([1u8; 32]);
        let config = Config::from_toml_str(&format!(
            "[store]\ntimeout = \"2s\"\n[idempotency]\nttl = \"1h\"\nlock_timeout = \"10s\"\n\
             [encryption]\nkeys = {{ k1 = \"{key}\" }}\n\
             [[routes]]\nname = \"hooks\"\npath_prefix = \"/hooks\"\nttl = \"7d\"\n"
        ))
        .unwrap();
        let lifetimes = config.encryption.unwrap().lifetimes().clone();
        let secs = |scope: &str| lifetimes.of(scope).as_secs();
        assert_eq!(secs("default:ab12"), 3600 + 10 + 2);
        assert_eq!(secs("hooks:ab12"), 7 * 86400 + 10 + 2);
        assert_eq!(
            secs("gone:ab12"),
            7 * 86400 + 10 + 2,
            "an unknown scope gets the longest"
        );
    }

    #[test]
    fn key_ids_are_short_and_plain() {
        assert!(is_key_id("k-1_B"));
        for bad in ["", "a b", "k/1", &"a".repeat(65)] {
            assert!(!is_key_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_section_is_read_from_toml_and_its_keys_are_masked_when_printed() {
        let key = BASE64.encode([1u8; 32]);
        let config = Config::from_toml_str(&format!(
            "[encryption]\nactive_key = \"k1\"\nkeys = {{ k1 = \"{key}\" }}\n"
        ))
        .unwrap();
        assert_eq!(config.encryption.as_ref().unwrap().active_key(), Some("k1"));
        assert!(!config.to_masked_toml().contains(&key));
        assert!(Config::from_toml_str("").unwrap().encryption.is_none());
    }
}
