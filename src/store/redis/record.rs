//! A record as Redis holds it: one hash per record, named `<prefix>:{<scope>:<key>}`, and the scripts'
//! answers read back into the store's types. Scope and key are percent-encoded in the name (all but
//! ASCII letters, digits and `-_.~`), so neither can end the hash tag early, add a separator or act as a
//! `SCAN` pattern character: the whole name is one hash tag, and so one slot, whatever the client sent.

use std::time::Duration;

use bytes::Bytes;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use redis::Value;
use uuid::Uuid;

use crate::store::blob::decode_headers;
use crate::store::{
    ClaimKind, ClaimResult, Existing, RecordInfo, RecordStatus, ScopeFilter, StoreError, StoredResponse,
    epoch_ms,
};

/// What stays readable in a record's name.
const ENCODED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// The Redis key of the record `(scope, key)`.
pub(super) fn name(prefix: &str, scope: &str, key: &str) -> String {
    // Built in place, sized for the common case of nothing to encode: it is made for every operation.
    let mut name = String::with_capacity(prefix.len() + scope.len() + key.len() + 8);
    name.push_str(prefix);
    name.push_str(":{");
    name.extend(utf8_percent_encode(scope, ENCODED));
    name.push(':');
    name.extend(utf8_percent_encode(key, ENCODED));
    name.push('}');
    name
}

/// The `SCAN` pattern of every record, or of the records holding `key` in any scope.
pub(super) fn pattern(prefix: &str, key: Option<&str>) -> String {
    match key {
        Some(key) => format!("{prefix}:{{*:{}}}", utf8_percent_encode(key, ENCODED)),
        None => format!("{prefix}:{{*}}"),
    }
}

/// The `SCAN` pattern of the records a page of `keys list` walks.
pub(super) fn list_pattern(prefix: &str, scope: &ScopeFilter) -> String {
    match scope {
        ScopeFilter::All => pattern(prefix, None),
        // A scope's own `:` is encoded in the name; the one after it separates the key.
        ScopeFilter::Named(name) => format!("{prefix}:{{{}%3A*}}", utf8_percent_encode(name, ENCODED)),
        ScopeFilter::Exact(scope) => format!("{prefix}:{{{}:*}}", utf8_percent_encode(scope, ENCODED)),
    }
}

/// The scope and key a record's name stands for; `None` for a name that is not a record's.
pub(super) fn parse_name(prefix: &str, name: &[u8]) -> Option<(String, String)> {
    let name = std::str::from_utf8(name).ok()?;
    let tag = name.strip_prefix(prefix)?.strip_prefix(":{")?.strip_suffix('}')?;
    let (scope, key) = tag.split_once(':')?;
    let decode = |part: &str| {
        percent_decode_str(part)
            .decode_utf8()
            .ok()
            .map(|s| s.into_owned())
    };
    Some((decode(scope)?, decode(key)?))
}

/// The claim script's answer.
pub(super) fn claim_result(value: Value) -> Result<ClaimResult, StoreError> {
    let fields = array(value)?;
    if int(&fields, 0)? == 1 {
        return Ok(ClaimResult::Won {
            attempt: i32::try_from(int(&fields, 1)?).map_err(|_| malformed("attempt"))?,
            kind: ClaimKind::parse(&text(&fields, 2)?).ok_or_else(|| malformed("claim kind"))?,
            expires_in: Duration::from_millis(int(&fields, 3)?.max(0) as u64),
        });
    }
    let same_fingerprint = int(&fields, 2)? == 1;
    let left = |i: usize| -> Result<Duration, StoreError> {
        Ok(Duration::from_millis(int(&fields, i)?.max(0) as u64))
    };
    let existing = match text(&fields, 1)?.as_str() {
        "completed" => match response(&fields, 6)? {
            Some(response) => Existing::Completed {
                same_fingerprint,
                response,
                expires_in: left(5)?,
                token: token(&fields, 3)?,
            },
            None => Existing::Processing {
                same_fingerprint,
                lease_remaining: left(4)?,
            },
        },
        "failed" => Existing::Failed,
        "unknown" => Existing::Unknown { same_fingerprint },
        _ => Existing::Processing {
            same_fingerprint,
            lease_remaining: left(4)?,
        },
    };
    Ok(ClaimResult::Held(existing))
}

/// A fenced script's answer: 1 when it wrote.
pub(super) fn written(value: Value) -> Result<bool, StoreError> {
    match value {
        Value::Int(n) => Ok(n == 1),
        other => Err(StoreError::Backend(format!(
            "unexpected answer from Redis: {other:?}"
        ))),
    }
}

/// The read script's answer for the record `(scope, key)`; `None` when there is none.
pub(super) fn record_info(
    scope: String,
    key: String,
    value: Value,
) -> Result<Option<RecordInfo>, StoreError> {
    let fields = array(value)?;
    let now = int(&fields, 0)?;
    if fields.len() == 1 {
        return Ok(None);
    }
    let retained = optional_int(&fields, 10)?.map(|b| b == 1);
    Ok(Some(RecordInfo {
        scope,
        key,
        status: RecordStatus::parse(&text(&fields, 1)?).ok_or_else(|| malformed("status"))?,
        attempt: i32::try_from(int(&fields, 2)?).map_err(|_| malformed("attempt"))?,
        claim_kind: ClaimKind::parse(&text(&fields, 3)?).ok_or_else(|| malformed("claim kind"))?,
        token: token(&fields, 4)?,
        created_at: epoch_ms(int(&fields, 5)?),
        updated_at: epoch_ms(int(&fields, 6)?),
        expires_at: epoch_ms(int(&fields, 7)?),
        locked_until: epoch_ms(int(&fields, 8)?),
        observed_at: epoch_ms(now),
        response_status: optional_int(&fields, 9)?.and_then(|s| u16::try_from(s).ok()),
        response_bytes: retained
            .filter(|kept| *kept)
            .map(|_| int(&fields, 11).map(|n| n.max(0) as u64))
            .transpose()?,
        body_retained: retained,
    }))
}

/// The stored response from its four fields (status, headers, body, retained) at `at`; `None` when
/// the record holds none.
fn response(fields: &[Value], at: usize) -> Result<Option<StoredResponse>, StoreError> {
    let Some(status) = optional_int(fields, at)? else {
        return Ok(None);
    };
    let headers = decode_headers(&bytes(fields, at + 1)?.unwrap_or_default())
        .ok_or_else(|| malformed("response headers"))?;
    let retained = optional_int(fields, at + 3)? == Some(1);
    let body = bytes(fields, at + 2)?.unwrap_or_default();
    Ok(Some(StoredResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers,
        body: retained.then(|| Bytes::from(body)),
    }))
}

fn array(value: Value) -> Result<Vec<Value>, StoreError> {
    match value {
        Value::Array(fields) => Ok(fields),
        other => Err(StoreError::Backend(format!(
            "unexpected answer from Redis: {other:?}"
        ))),
    }
}

fn optional_int(fields: &[Value], i: usize) -> Result<Option<i64>, StoreError> {
    match fields.get(i) {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Int(n)) => Ok(Some(*n)),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Some)
            .ok_or_else(|| malformed("number")),
        Some(_) => Err(malformed("number")),
    }
}

fn int(fields: &[Value], i: usize) -> Result<i64, StoreError> {
    optional_int(fields, i)?.ok_or_else(|| malformed("number"))
}

fn bytes(fields: &[Value], i: usize) -> Result<Option<Vec<u8>>, StoreError> {
    match fields.get(i) {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::BulkString(b)) => Ok(Some(b.clone())),
        Some(Value::SimpleString(s)) => Ok(Some(s.clone().into_bytes())),
        Some(_) => Err(malformed("field")),
    }
}

fn text(fields: &[Value], i: usize) -> Result<String, StoreError> {
    bytes(fields, i)?
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| malformed("text field"))
}

fn token(fields: &[Value], i: usize) -> Result<Uuid, StoreError> {
    bytes(fields, i)?
        .and_then(|b| Uuid::from_slice(&b).ok())
        .ok_or_else(|| malformed("token"))
}

fn malformed(what: &str) -> StoreError {
    StoreError::Backend(format!("a record in Redis has a malformed {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_the_whole_record_in_one_hash_tag_whatever_the_key() {
        let hostile = name("idemproxy", "default:ab12", "a}{b:*?[x] %");
        assert_eq!(
            hostile,
            "idemproxy:{default%3Aab12:a%7D%7Bb%3A%2A%3F%5Bx%5D%20%25}"
        );
        assert_eq!(hostile.matches('{').count(), 1);
        assert_eq!(hostile.matches('}').count(), 1);
        assert_eq!(
            parse_name("idemproxy", hostile.as_bytes()),
            Some(("default:ab12".into(), "a}{b:*?[x] %".into()))
        );
        assert_eq!(parse_name("idemproxy", b"other:{a:b}"), None);
        assert_eq!(parse_name("idemproxy", b"idemproxy:{ab}"), None);
    }

    #[test]
    fn patterns_match_one_key_in_every_scope_or_every_record() {
        assert_eq!(pattern("p", Some("k:1")), "p:{*:k%3A1}");
        assert_eq!(pattern("p", None), "p:{*}");
    }

    #[test]
    fn a_won_claim_and_a_held_completed_record_read_back() {
        let won = Value::Array(vec![
            Value::Int(1),
            Value::Int(2),
            Value::BulkString(b"retry".to_vec()),
            Value::Int(80_000),
        ]);
        assert!(matches!(
            claim_result(won).unwrap(),
            ClaimResult::Won {
                attempt: 2,
                kind: ClaimKind::Retry,
                expires_in,
            } if expires_in == Duration::from_secs(80)
        ));
        let token = Uuid::new_v4();
        let headers = crate::store::blob::encode_headers(&[("x".into(), b"y".to_vec())]);
        let held = Value::Array(vec![
            Value::Int(0),
            Value::BulkString(b"completed".to_vec()),
            Value::Int(1),
            Value::BulkString(token.as_bytes().to_vec()),
            Value::Int(0),
            Value::Int(5_000),
            Value::BulkString(b"201".to_vec()),
            Value::BulkString(headers),
            Value::BulkString(b"body".to_vec()),
            Value::BulkString(b"1".to_vec()),
        ]);
        match claim_result(held).unwrap() {
            ClaimResult::Held(Existing::Completed {
                same_fingerprint,
                response,
                expires_in,
                token: found,
            }) => {
                assert!(same_fingerprint);
                assert_eq!(response.status, 201);
                assert_eq!(response.body.as_deref(), Some(&b"body"[..]));
                assert_eq!(expires_in, Duration::from_secs(5));
                assert_eq!(found, token);
            }
            other => panic!("{other:?}"),
        }
    }
}
