//! The configured keys of encryption at rest, and what every stored format shares: the magic that starts
//! a sealed value, why one does not open or cannot be sealed, and a key id read back from one. The
//! formats (`sealed.rs`, `v1.rs`) take their ciphers from the [`Keyring`]; `encrypted.rs` picks the
//! format.

use std::collections::BTreeMap;
use std::time::Duration;

use aes_gcm::aead::KeyInit as _;
use aes_gcm::{Aes256Gcm, Key};
use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::KeyInit as _;

use crate::config::{EncryptionConfig, EncryptionKey, RecordLifetimes, is_key_id};

/// Starts every sealed value of every format; chosen so that text bodies stored in clear never start
/// with it. The byte after it is the format version.
pub(super) const MAGIC: &[u8; 4] = b"\0IPE";

/// Why a stored response does not open. Names no stored bytes beyond a well-formed key id: it is
/// logged, and the record is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum Unreadable {
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
    #[error("sealed as format {version}, which encryption.min_format {min} refuses")]
    FormatRefused { version: u8, min: u8 },
    #[error("sealed for a record whose life ended {0}s ago: a row put back from an earlier use of the key")]
    LifeOver(u64),
    #[error("header {index}: {why}")]
    Header { index: usize, why: Box<Unreadable> },
    #[error("body: {0}")]
    Body(Box<Unreadable>),
}

/// Why a response could not be sealed; the response is then not stored.
#[derive(Debug, thiserror::Error)]
pub(super) enum SealError {
    #[error("the active key {0:?} is not configured")]
    MissingKey(String),
    #[error("the response is too large to seal")]
    TooLarge,
    #[error("the system's random number generator failed")]
    Random,
}

/// One configured key, as the cipher of each format: AES-256-GCM for format 1, XChaCha20-Poly1305 for
/// the blob formats.
pub(super) struct KeyCiphers {
    pub(super) aes: Aes256Gcm,
    pub(super) chacha: XChaCha20Poly1305,
}

/// The configured keys: which one seals new records, and every one that may open old ones; which formats
/// open, and how long each scope's records live.
pub struct Keyring {
    pub(super) active: Option<String>,
    pub(super) keys: BTreeMap<String, KeyCiphers>,
    pub(super) accept_plaintext: bool,
    pub(super) min_format: u8,
    pub(super) max_clock_skew: Duration,
    pub(super) lifetimes: RecordLifetimes,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("active", &self.active)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .field("min_format", &self.min_format)
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
            min_format: config.min_format(),
            max_clock_skew: config.max_clock_skew(),
            lifetimes: config.lifetimes().clone(),
        }
    }

    /// No keys: records are stored in clear, and a sealed one (written by a replica that has keys) is
    /// refused rather than replayed as its ciphertext.
    pub(super) fn none() -> Keyring {
        Keyring {
            active: None,
            keys: BTreeMap::new(),
            accept_plaintext: true,
            min_format: 1,
            max_clock_skew: Duration::ZERO,
            lifetimes: RecordLifetimes::default(),
        }
    }

    pub(super) fn cipher(&self, id: &str) -> Result<&KeyCiphers, Unreadable> {
        self.keys
            .get(id)
            .ok_or_else(|| Unreadable::UnknownKey(id.to_owned()))
    }
}

/// A key id read from a sealed value; refused unless it could have been configured, so that what gets
/// logged is never arbitrary stored bytes.
pub(super) fn key_id_of(stored: &[u8]) -> Result<&str, Unreadable> {
    std::str::from_utf8(stored)
        .ok()
        .filter(|id| is_key_id(id))
        .ok_or(Unreadable::MalformedKeyId)
}

impl KeyCiphers {
    /// Both formats' ciphers of one key; AES and ChaCha20 share no structure, so the key serves both.
    fn new(key: &EncryptionKey) -> KeyCiphers {
        KeyCiphers {
            aes: Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(key.bytes())),
            chacha: XChaCha20Poly1305::new(&(*key.bytes()).into()),
        }
    }
}
