//! What a row means: the rows of HOLDER (`claim.rs`) and of FIND, LIST and STATS (`maintenance.rs`),
//! decoded into the store's types by the columns those statements select. Runs after each of those
//! statements; touches nothing but the row.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rusqlite::Row;
use uuid::Uuid;

use crate::store::blob::decode_headers;
use crate::store::{ClaimKind, Existing, RecordInfo, RecordStats, RecordStatus, StoredResponse, epoch_ms};

/// The record that holds a key, as the claim with `fingerprint` sees it at `now`.
pub(super) fn existing(row: &Row, now: i64, fingerprint: &[u8]) -> rusqlite::Result<Existing> {
    let same_fingerprint = row.get::<_, Vec<u8>>("fingerprint")? == fingerprint;
    let status: String = row.get("status")?;
    let remaining = |column: &str| -> rusqlite::Result<Duration> {
        let until: i64 = row.get(column)?;
        Ok(Duration::from_millis(until.saturating_sub(now).max(0) as u64))
    };
    Ok(match (status.as_str(), stored_response(row)?) {
        ("completed", Some(response)) => Existing::Completed {
            same_fingerprint,
            response,
            expires_in: remaining("expires_at")?,
            token: token(row)?,
        },
        ("failed", _) => Existing::Failed,
        ("unknown", _) => Existing::Unknown { same_fingerprint },
        _ => Existing::Processing {
            same_fingerprint,
            lease_remaining: remaining("locked_until")?,
        },
    })
}

fn token(row: &Row) -> rusqlite::Result<Uuid> {
    Uuid::from_slice(&row.get::<_, Vec<u8>>("token")?).map_err(|_| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Blob,
            "a stored token is not 16 bytes".into(),
        )
    })
}

fn stored_response(row: &Row) -> rusqlite::Result<Option<StoredResponse>> {
    let Some(status) = row.get::<_, Option<i64>>("response_status")? else {
        return Ok(None);
    };
    let headers = row
        .get::<_, Option<Vec<u8>>>("response_headers")?
        .unwrap_or_default();
    let headers = decode_headers(&headers).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Blob,
            "stored response headers are malformed".into(),
        )
    })?;
    let retained = row.get::<_, Option<bool>>("body_retained")?.unwrap_or(false);
    let body = row.get::<_, Option<Vec<u8>>>("response_body")?;
    Ok(Some(StoredResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers,
        body: retained.then(|| Bytes::from(body.unwrap_or_default())),
    }))
}

/// An operator's view of one record, observed at `now`.
pub(super) fn record_info(row: &Row, now: i64) -> rusqlite::Result<RecordInfo> {
    let unknown = |what: &str| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Text,
            format!("unknown {what} in the store").into(),
        )
    };
    let status = RecordStatus::parse(&row.get::<_, String>("status")?).ok_or_else(|| unknown("status"))?;
    let claim_kind =
        ClaimKind::parse(&row.get::<_, String>("claim_kind")?).ok_or_else(|| unknown("claim kind"))?;
    let token = Uuid::from_slice(&row.get::<_, Vec<u8>>("token")?).map_err(|_| unknown("token"))?;
    let at = |column: &str| -> rusqlite::Result<SystemTime> { Ok(epoch_ms(row.get(column)?)) };
    Ok(RecordInfo {
        scope: row.get("scope")?,
        key: row.get("key")?,
        status,
        attempt: row.get("attempt")?,
        claim_kind,
        token,
        created_at: at("created_at")?,
        updated_at: at("updated_at")?,
        expires_at: at("expires_at")?,
        locked_until: at("locked_until")?,
        observed_at: epoch_ms(now),
        response_status: row
            .get::<_, Option<i64>>("response_status")?
            .and_then(|s| u16::try_from(s).ok()),
        response_bytes: row.get::<_, Option<i64>>("body_bytes")?.map(|n| n.max(0) as u64),
        body_retained: row.get("body_retained")?,
    })
}

/// The counts of STATS, in its column order.
pub(super) fn record_stats(row: &Row) -> rusqlite::Result<RecordStats> {
    let count = |i: usize| -> rusqlite::Result<u64> { Ok(row.get::<_, i64>(i)?.max(0) as u64) };
    Ok(RecordStats {
        processing: count(0)?,
        completed: count(1)?,
        failed: count(2)?,
        unknown: count(3)?,
        expired: count(4)?,
    })
}
