//! What a row means: the rows of CLAIM, TAKE and CLAIM_BATCH (`claim.rs`) and of FIND and STATS
//! (`maintenance.rs`), decoded into the store's types by the columns those statements select. Runs after
//! each of those statements; touches nothing but the row.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio_postgres::Row;
use uuid::Uuid;

use super::runner::backend;
use crate::store::{
    ClaimKind, Existing, RecordInfo, RecordStats, RecordStatus, StoreError, StoredResponse, epoch_ms,
};

/// One row of CLAIM or TAKE.
pub(super) enum Seen {
    Won { attempt: i32, kind: ClaimKind },
    Record(View),
}

/// A record as one statement saw it.
pub(super) struct View {
    pub(super) status: String,
    pub(super) same_fingerprint: bool,
    pub(super) lease_ms: i64,
    pub(super) expired: bool,
    pub(super) ttl_ms: i64,
    pub(super) token: Uuid,
    pub(super) response: Option<StoredResponse>,
}

impl View {
    pub(super) fn into_existing(self) -> Existing {
        match (self.status.as_str(), self.response) {
            ("completed", Some(response)) => Existing::Completed {
                same_fingerprint: self.same_fingerprint,
                response,
                expires_in: Duration::from_millis(self.ttl_ms.max(0) as u64),
                token: self.token,
            },
            ("failed", _) => Existing::Failed,
            ("unknown", _) => Existing::Unknown {
                same_fingerprint: self.same_fingerprint,
            },
            _ => Existing::Processing {
                same_fingerprint: self.same_fingerprint,
                lease_remaining: Duration::from_millis(self.lease_ms.max(0) as u64),
            },
        }
    }
}

pub(super) fn decode(row: &Row) -> Result<Seen, tokio_postgres::Error> {
    if row.try_get::<_, bool>("won")? {
        let kind = ClaimKind::parse(row.try_get("claim_kind")?).unwrap_or(ClaimKind::New);
        let attempt = row.try_get("attempt")?;
        return Ok(Seen::Won { attempt, kind });
    }
    Ok(Seen::Record(View {
        status: row.try_get("status")?,
        same_fingerprint: row.try_get("same_fingerprint")?,
        lease_ms: row.try_get("lease_ms")?,
        expired: row.try_get("expired")?,
        ttl_ms: row.try_get("ttl_ms")?,
        token: row.try_get("record_token")?,
        response: decode_response(row)?,
    }))
}

/// One row of CLAIM_BATCH: the input's position, and what its request saw (`None`: no record).
pub(super) fn decode_batched(row: &Row) -> Result<(i64, Option<Seen>), tokio_postgres::Error> {
    let n = row.try_get("n")?;
    if !row.try_get::<_, bool>("won")? && !row.try_get::<_, bool>("seen")? {
        return Ok((n, None));
    }
    Ok((n, Some(decode(row)?)))
}

fn decode_response(row: &Row) -> Result<Option<StoredResponse>, tokio_postgres::Error> {
    let Some(status) = row.try_get::<_, Option<i16>>("response_status")? else {
        return Ok(None);
    };
    let names: Vec<String> = row
        .try_get::<_, Option<_>>("response_header_names")?
        .unwrap_or_default();
    let values: Vec<Vec<u8>> = row
        .try_get::<_, Option<_>>("response_header_values")?
        .unwrap_or_default();
    let retained = row.try_get::<_, Option<bool>>("body_retained")?.unwrap_or(false);
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    Ok(Some(stored_response(status, names, values, retained, body)))
}

/// A completed record's response columns as a response: headers pair up by position, and the body is
/// there only when it was retained.
fn stored_response(
    status: i16,
    names: Vec<String>,
    values: Vec<Vec<u8>>,
    retained: bool,
    body: Option<Vec<u8>>,
) -> StoredResponse {
    StoredResponse {
        status: status as u16,
        headers: names.into_iter().zip(values).collect(),
        body: if retained {
            Some(Bytes::from(body.unwrap_or_default()))
        } else {
            None
        },
    }
}

/// One row of FIND, or `None` when a column holds a value this version does not know.
pub(super) fn record_info(row: &Row) -> Result<Option<RecordInfo>, tokio_postgres::Error> {
    let status = RecordStatus::parse(row.try_get("status")?);
    let claim_kind = ClaimKind::parse(row.try_get("claim_kind")?);
    let (Some(status), Some(claim_kind)) = (status, claim_kind) else {
        return Ok(None);
    };
    let at =
        |column: &str| -> Result<SystemTime, tokio_postgres::Error> { Ok(epoch_ms(row.try_get(column)?)) };
    Ok(Some(RecordInfo {
        scope: row.try_get("scope")?,
        key: row.try_get("key")?,
        status,
        attempt: row.try_get("attempt")?,
        claim_kind,
        token: row.try_get("token")?,
        created_at: at("created_ms")?,
        updated_at: at("updated_ms")?,
        expires_at: at("expires_ms")?,
        locked_until: at("locked_ms")?,
        observed_at: at("now_ms")?,
        response_status: row
            .try_get::<_, Option<i16>>("response_status")?
            .map(|s| s as u16),
        response_bytes: row
            .try_get::<_, Option<i64>>("body_bytes")?
            .map(|n| n.max(0) as u64),
        body_retained: row.try_get("body_retained")?,
    }))
}

/// The row of STATS, whose columns are counts in the order of [`RecordStats`]'s fields.
pub(super) fn record_stats(row: &Row) -> Result<RecordStats, StoreError> {
    let count = |i: usize| -> Result<u64, StoreError> {
        let n: i64 = row.try_get(i).map_err(backend)?;
        Ok(n.max(0) as u64)
    };
    Ok(RecordStats {
        processing: count(0)?,
        completed: count(1)?,
        failed: count(2)?,
        unknown: count(3)?,
        expired: count(4)?,
    })
}

pub(super) fn corrupt() -> StoreError {
    StoreError::Backend("a record holds a status or claim kind this version does not know".into())
}
