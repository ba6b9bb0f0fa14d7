//! Format version 1, read only: opens records written before the one-blob format, when each header value
//! and the body were sealed apart with AES-256-GCM (96-bit random nonce), bound to scope, key and status
//! (and a header's index and name). Runs when `claim` finds such a record; never writes. Also the reader
//! of records stored in clear, which are opened value by value too.
//!
//! Value layout: `MAGIC` | 1 | key id length | key id | nonce (12) | ciphertext and tag (16).
//!
//! v1 values carry no epoch, so an older completion of the same key copied back over a row opens;
//! once every v1 record has expired (one `ttl` after the upgrade) `encryption.min_format = 2` (or 3)
//! refuses them all, whatever is copied in.

use aes_gcm::Nonce;
use aes_gcm::aead::{Aead, Payload};
use bytes::Bytes;

use super::keyring::{Keyring, MAGIC, Unreadable, key_id_of};
use crate::store::{RecordId, StoredResponse};

/// The format version this module reads.
pub(super) const VERSION: u8 = 1;
const NONCE_LEN: usize = 12;

/// Opens a per-value record (or one in clear, while plaintext is accepted).
pub(super) fn open_response(
    keyring: &Keyring,
    id: &RecordId,
    stored: StoredResponse,
) -> Result<StoredResponse, Unreadable> {
    let record = record_context(id, stored.status);
    let mut headers = Vec::with_capacity(stored.headers.len());
    for (index, (name, value)) in stored.headers.into_iter().enumerate() {
        let value = open(keyring, &value, &header_context(&record, index, &name)).map_err(|why| {
            Unreadable::Header {
                index,
                why: Box::new(why),
            }
        })?;
        headers.push((name, value));
    }
    let body = match stored.body {
        Some(body) => Some(Bytes::from(
            open(keyring, &body, &body_context(&record)).map_err(|why| Unreadable::Body(Box::new(why)))?,
        )),
        None => None,
    };
    Ok(StoredResponse {
        status: stored.status,
        headers,
        body,
    })
}

/// Opens one value sealed for `context`; a value in clear passes only while plaintext is accepted.
fn open(keyring: &Keyring, stored: &[u8], context: &[u8]) -> Result<Vec<u8>, Unreadable> {
    let Some(rest) = stored.strip_prefix(MAGIC.as_slice()) else {
        return match keyring.accept_plaintext {
            true => Ok(stored.to_vec()),
            false => Err(Unreadable::Plaintext),
        };
    };
    let (&version, rest) = rest.split_first().ok_or(Unreadable::Truncated)?;
    if version != VERSION {
        return Err(Unreadable::UnknownVersion(version));
    }
    if keyring.min_format > VERSION {
        return Err(Unreadable::FormatRefused {
            version,
            min: keyring.min_format,
        });
    }
    let (&id_len, rest) = rest.split_first().ok_or(Unreadable::Truncated)?;
    let (id, rest) = rest
        .split_at_checked(usize::from(id_len))
        .ok_or(Unreadable::Truncated)?;
    let (nonce, sealed) = rest.split_at_checked(NONCE_LEN).ok_or(Unreadable::Truncated)?;
    let id = key_id_of(id)?;
    let cipher = &keyring.cipher(id)?.aes;
    let payload = Payload {
        msg: sealed,
        aad: context,
    };
    cipher
        .decrypt(Nonce::from_slice(nonce), payload)
        .map_err(|_| Unreadable::DoesNotOpen(id.to_owned()))
}

/// What bound every v1 value to its record.
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

/// The v1 writer as it was, kept only to make fixtures: production code never writes v1.
#[cfg(test)]
pub(super) mod writer {
    use aes_gcm::Aes256Gcm;
    use aes_gcm::aead::{Aead, AeadCore, OsRng, Payload};
    use bytes::Bytes;

    use super::{MAGIC, NONCE_LEN, VERSION, body_context, header_context, record_context};
    use crate::store::encrypted::Keyring;
    use crate::store::{RecordId, StoredResponse};

    /// `response` sealed value by value with key `key_id`, exactly as format version 1 stored it.
    pub fn seal_response(
        keyring: &Keyring,
        key_id: &str,
        id: &RecordId,
        response: &StoredResponse,
    ) -> StoredResponse {
        let record = record_context(id, response.status);
        let headers = response
            .headers
            .iter()
            .enumerate()
            .map(|(index, (name, value))| {
                let sealed = seal(keyring, key_id, value, &header_context(&record, index, name));
                (name.clone(), sealed)
            })
            .collect();
        let body = response
            .body
            .as_ref()
            .map(|body| Bytes::from(seal(keyring, key_id, body, &body_context(&record))));
        StoredResponse {
            status: response.status,
            headers,
            body,
        }
    }

    fn seal(keyring: &Keyring, key_id: &str, plain: &[u8], context: &[u8]) -> Vec<u8> {
        let cipher = &keyring.cipher(key_id).expect("a configured key").aes;
        let nonce = Aes256Gcm::generate_nonce(&mut OsRng);
        let payload = Payload {
            msg: plain,
            aad: context,
        };
        let sealed = cipher.encrypt(&nonce, payload).expect("small test values");
        let mut out = Vec::with_capacity(MAGIC.len() + 2 + key_id.len() + NONCE_LEN + sealed.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(key_id.len() as u8);
        out.extend_from_slice(key_id.as_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }
}
