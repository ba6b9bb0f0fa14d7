//! The one-blob formats: 3, what every seal writes, and 2, read only. One XChaCha20-Poly1305 blob per
//! record, holding the status, every header and the body. Runs on `complete` (seal) and when `claim` finds
//! a completed record (open); touches only the bytes handed to it.
//!
//! Envelope, stored in the body column (integers big-endian):
//! `MAGIC` (4) | version | key id length (1) | key id | header count (u32) | [format 3: not after (u64,
//! milliseconds since the Unix epoch)] | nonce (24) | ciphertext | tag (16).
//!
//! Plaintext: status (u16) | header count (u32) | per header: name length (u32), name, value length (u32),
//! value | body length (u64), body. Every field is length-prefixed and nothing may follow the body, so a
//! blob parses one way only and a cut one is refused even before the tag would refuse it.
//!
//! Associated data: the format's label | scope and key, each with a u64 length | the record's epoch (the
//! token of the claim that completed it, 16 bytes) | the status column | every clear byte of the envelope
//! before the nonce (which carries the header count, the key id and, in format 3, the end of the record's
//! life). A blob therefore opens only in its own row, for its own completion, with the status and header
//! count it was sealed with; a format 3 blob also says, unalterably, until when its record can be alive,
//! which `encrypted.rs` checks against the clock: a whole row put back after its record's life ended (with
//! its expiry rewritten so the store replays it) is refused.

use std::ops::Range;

use bytes::Bytes;
use chacha20poly1305::aead::{AeadInOut, Generate};
use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};
use uuid::Uuid;

use super::keyring::{Keyring, MAGIC, SealError, Unreadable, key_id_of};
use crate::store::StoredResponse;

/// The format bound to its record and completion, read only.
pub(super) const V2: u8 = 2;
/// The format every seal writes: format 2 plus the end of the record's life.
pub(super) const V3: u8 = 3;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;

/// What a blob says in clear besides its key id: how many headers it holds, and (format 3) until when
/// its record can be alive, in milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sealed {
    pub header_count: u32,
    pub not_after: Option<u64>,
}

fn label(version: u8) -> &'static [u8] {
    match version {
        V2 => b"idemproxy-record-v2",
        _ => b"idemproxy-record-v3",
    }
}

/// What a blob is bound to besides its own envelope.
pub(super) struct Binding<'a> {
    /// The record's scope.
    pub scope: &'a str,
    /// The record's key.
    pub key: &'a str,
    /// The token of the claim that completed the record.
    pub epoch: Uuid,
    /// The status as stored in clear.
    pub status: u16,
}

/// Seals `headers` and `body` (with the binding's status) under `key_id`, in format 3, for a record
/// alive until `not_after` at the latest.
pub(super) fn seal(
    cipher: &XChaCha20Poly1305,
    key_id: &str,
    binding: &Binding,
    not_after: u64,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Result<Vec<u8>, SealError> {
    seal_as(V3, Some(not_after), cipher, key_id, binding, headers, body)
}

/// `seal` as format 2 wrote it, kept only to make fixtures: production code writes format 3.
#[cfg(test)]
pub(super) fn seal_v2(
    cipher: &XChaCha20Poly1305,
    key_id: &str,
    binding: &Binding,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Result<Vec<u8>, SealError> {
    seal_as(V2, None, cipher, key_id, binding, headers, body)
}

fn seal_as(
    version: u8,
    not_after: Option<u64>,
    cipher: &XChaCha20Poly1305,
    key_id: &str,
    binding: &Binding,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Result<Vec<u8>, SealError> {
    let header_count = u32::try_from(headers.len()).map_err(|_| SealError::TooLarge)?;
    let clear = Sealed {
        header_count,
        not_after,
    };
    let mut blob = envelope_head(version, key_id, clear);
    let aad = associated_data(version, binding, &blob);
    let nonce = XNonce::try_generate().map_err(|_| SealError::Random)?;
    blob.extend_from_slice(&nonce);
    let start = blob.len();
    blob.reserve(plaintext_len(headers, body) + TAG_LEN);
    encode(&mut blob, binding.status, headers, body)?;
    let tag = cipher
        .encrypt_inout_detached(&nonce, &aad, (&mut blob[start..]).into())
        .map_err(|_| SealError::TooLarge)?;
    blob.extend_from_slice(&tag);
    Ok(blob)
}

/// Opens a blob of format 2 or 3 for the record described by `binding`; with the response, what its
/// envelope said in clear, now authenticated.
pub(super) fn open(
    keyring: &Keyring,
    binding: &Binding,
    blob: &[u8],
) -> Result<(StoredResponse, Sealed), Unreadable> {
    let envelope = Envelope::parse(blob)?;
    let cipher = &keyring.cipher(envelope.key_id)?.chacha;
    let aad = associated_data(envelope.version, binding, envelope.head);
    let mut plain = envelope.sealed.to_vec();
    cipher
        .decrypt_inout_detached(&envelope.nonce, &aad, plain.as_mut_slice().into(), &envelope.tag)
        .map_err(|_| Unreadable::DoesNotOpen(envelope.key_id.to_owned()))?;
    let response = decode(Bytes::from(plain), binding.status, envelope.clear.header_count)?;
    Ok((response, envelope.clear))
}

/// Everything before the nonce; authenticated as part of the associated data.
fn envelope_head(version: u8, key_id: &str, clear: Sealed) -> Vec<u8> {
    let mut head = Vec::with_capacity(MAGIC.len() + 2 + key_id.len() + 4 + 8);
    head.extend_from_slice(MAGIC);
    head.push(version);
    // Key ids are validated to at most 64 bytes when the config is loaded.
    head.push(key_id.len() as u8);
    head.extend_from_slice(key_id.as_bytes());
    head.extend_from_slice(&clear.header_count.to_be_bytes());
    if let Some(not_after) = clear.not_after {
        head.extend_from_slice(&not_after.to_be_bytes());
    }
    head
}

fn associated_data(version: u8, binding: &Binding, head: &[u8]) -> Vec<u8> {
    let mut aad = label(version).to_vec();
    for field in [binding.scope.as_bytes(), binding.key.as_bytes()] {
        aad.extend_from_slice(&(field.len() as u64).to_be_bytes());
        aad.extend_from_slice(field);
    }
    aad.extend_from_slice(binding.epoch.as_bytes());
    aad.extend_from_slice(&binding.status.to_be_bytes());
    aad.extend_from_slice(head);
    aad
}

/// A format 2 or 3 envelope split into its parts, before anything is decrypted.
struct Envelope<'a> {
    version: u8,
    head: &'a [u8],
    key_id: &'a str,
    clear: Sealed,
    nonce: XNonce,
    sealed: &'a [u8],
    tag: Tag,
}

impl<'a> Envelope<'a> {
    fn parse(blob: &'a [u8]) -> Result<Envelope<'a>, Unreadable> {
        let mut reader = Reader::new(blob);
        if reader.take(MAGIC.len())? != MAGIC {
            return Err(Unreadable::Malformed("not a sealed record"));
        }
        let version = reader.u8()?;
        if version != V2 && version != V3 {
            return Err(Unreadable::UnknownVersion(version));
        }
        let id_len = usize::from(reader.u8()?);
        let key_id = key_id_of(reader.take(id_len)?)?;
        let header_count = reader.u32()?;
        let not_after = match version {
            V3 => Some(reader.u64()?),
            _ => None,
        };
        let clear = Sealed {
            header_count,
            not_after,
        };
        let head = &blob[..reader.position];
        let nonce = XNonce::try_from(reader.take(NONCE_LEN)?).map_err(|_| Unreadable::Truncated)?;
        let sealed_len = reader
            .remaining()
            .checked_sub(TAG_LEN)
            .ok_or(Unreadable::Truncated)?;
        let sealed = reader.take(sealed_len)?;
        let tag = Tag::try_from(reader.take(TAG_LEN)?).map_err(|_| Unreadable::Truncated)?;
        Ok(Envelope {
            version,
            head,
            key_id,
            clear,
            nonce,
            sealed,
            tag,
        })
    }
}

fn plaintext_len(headers: &[(String, Vec<u8>)], body: &[u8]) -> usize {
    let headers: usize = headers.iter().map(|(n, v)| 8 + n.len() + v.len()).sum();
    2 + 4 + headers + 8 + body.len()
}

fn encode(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
) -> Result<(), SealError> {
    out.extend_from_slice(&status.to_be_bytes());
    let count = u32::try_from(headers.len()).map_err(|_| SealError::TooLarge)?;
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in headers {
        put_field(out, name.as_bytes())?;
        put_field(out, value)?;
    }
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(body);
    Ok(())
}

fn put_field(out: &mut Vec<u8>, field: &[u8]) -> Result<(), SealError> {
    let len = u32::try_from(field.len()).map_err(|_| SealError::TooLarge)?;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(field);
    Ok(())
}

/// The inverse of [`encode`], checked against what the row says in clear. The body is a slice of `plain`,
/// not a copy.
fn decode(plain: Bytes, status: u16, header_count: u32) -> Result<StoredResponse, Unreadable> {
    let mut reader = Reader::new(&plain);
    if reader.u16()? != status {
        return Err(Unreadable::Malformed(
            "the sealed status differs from the stored one",
        ));
    }
    if reader.u32()? != header_count {
        return Err(Unreadable::Malformed(
            "the sealed header count differs from the envelope's",
        ));
    }
    // Each header takes at least 8 bytes, which bounds what a count can make us allocate.
    let mut headers = Vec::with_capacity((header_count as usize).min(reader.remaining() / 8));
    for _ in 0..header_count {
        let name = std::str::from_utf8(reader.field()?)
            .map_err(|_| Unreadable::Malformed("a header name is not UTF-8"))?;
        headers.push((name.to_owned(), reader.field()?.to_vec()));
    }
    let body_len = usize::try_from(reader.u64()?).map_err(|_| Unreadable::Truncated)?;
    let body = reader.take_range(body_len)?;
    if reader.remaining() != 0 {
        return Err(Unreadable::Malformed("bytes follow the body"));
    }
    Ok(StoredResponse {
        status,
        headers,
        body: Some(plain.slice(body)),
    })
}

/// Reads fixed-size and length-prefixed fields; every read past the end is [`Unreadable::Truncated`].
struct Reader<'a> {
    bytes: &'a [u8],
    position: usize,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, position: 0 }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.position
    }

    fn take_range(&mut self, len: usize) -> Result<Range<usize>, Unreadable> {
        if len > self.remaining() {
            return Err(Unreadable::Truncated);
        }
        let range = self.position..self.position + len;
        self.position += len;
        Ok(range)
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], Unreadable> {
        let range = self.take_range(len)?;
        Ok(&self.bytes[range])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Unreadable> {
        self.take(N)?.try_into().map_err(|_| Unreadable::Truncated)
    }

    fn u8(&mut self) -> Result<u8, Unreadable> {
        Ok(u8::from_be_bytes(self.array()?))
    }

    fn u16(&mut self) -> Result<u16, Unreadable> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, Unreadable> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Unreadable> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    /// A u32-length-prefixed field.
    fn field(&mut self) -> Result<&'a [u8], Unreadable> {
        let len = self.u32()? as usize;
        self.take(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plaintext() -> Vec<u8> {
        let headers = vec![
            ("content-type".to_owned(), b"text/plain".to_vec()),
            ("x-empty".to_owned(), Vec::new()),
        ];
        let mut out = Vec::new();
        encode(&mut out, 201, &headers, b"hello").unwrap();
        out
    }

    #[test]
    fn the_serialisation_round_trips() {
        let opened = decode(Bytes::from(plaintext()), 201, 2).unwrap();
        assert_eq!(
            opened.headers[0],
            ("content-type".to_owned(), b"text/plain".to_vec())
        );
        assert_eq!(opened.headers[1], ("x-empty".to_owned(), Vec::new()));
        assert_eq!(opened.body.as_deref(), Some(&b"hello"[..]));
        assert_eq!(plaintext().len(), plaintext_len(&opened.headers, b"hello"));
    }

    #[test]
    fn a_cut_or_extended_serialisation_is_refused() {
        let plain = plaintext();
        for len in 0..plain.len() {
            let cut = Bytes::copy_from_slice(&plain[..len]);
            assert!(decode(cut, 201, 2).is_err(), "accepted a cut at {len}");
        }
        let mut longer = plain.clone();
        longer.push(0);
        assert!(decode(Bytes::from(longer), 201, 2).is_err());
    }

    #[test]
    fn a_serialisation_that_disagrees_with_the_clear_fields_is_refused() {
        assert!(decode(Bytes::from(plaintext()), 200, 2).is_err());
        assert!(decode(Bytes::from(plaintext()), 201, 1).is_err());
        assert!(decode(Bytes::from(plaintext()), 201, 3).is_err());
    }
}
