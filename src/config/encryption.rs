//! `[encryption]`: the keys that seal stored responses at rest. Validated once at load into
//! [`EncryptionConfig`] — every key id well-formed, every key base64 of exactly [`KEY_LEN`] bytes, the
//! active key among them — from which `store/encrypted.rs` builds its ciphers without anything left to
//! check. Touches no store and no cipher. Two forms, because the keys are written as base64 and used as
//! bytes, and an `[encryption]` without keys means encryption is off.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Length of an encryption key, in bytes.
pub const KEY_LEN: usize = 32;
/// Longest key id; ids are stored in every sealed value.
pub const MAX_KEY_ID: usize = 64;

/// `[encryption]` as written: AES-256-GCM of stored response bodies and header values.
#[derive(Clone, Serialize, Deserialize, Default)]
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
}

impl std::fmt::Debug for RawEncryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawEncryption")
            .field("active_key", &self.active_key)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
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
        }))
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
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;

    use super::{RawEncryption, is_key_id};
    use crate::config::Config;

    fn raw(active: Option<&str>, keys: &[(&str, &str)], accept_plaintext: bool) -> RawEncryption {
        RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            accept_plaintext,
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
