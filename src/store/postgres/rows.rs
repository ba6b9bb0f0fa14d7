//! What a row means: the rows of CLAIM and TAKE (`claim.rs`) and of the sharded claim (`shard_claim.rs`),
//! WRITE_BATCH (`write.rs`) and FIND and STATS (`maintenance.rs`), decoded into the store's types by the
//! columns those statements select, and what a claim round's row decides. Runs after each of those
//! statements; touches nothing but the row.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio_postgres::Row;
use uuid::Uuid;

use super::address::Tid;
use super::db::backend;
use crate::store::{
    ClaimKind, ClaimResult, Existing, RecordId, RecordInfo, RecordStats, RecordStatus, StoreError,
    StoredResponse, epoch_ms,
};

/// One row of CLAIM or TAKE.
pub(super) enum Seen {
    Won {
        attempt: i32,
        kind: ClaimKind,
        expires_in: Duration,
    },
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
        let expires_in = Duration::from_millis(row.try_get::<_, i64>("ttl_ms")?.max(0) as u64);
        return Ok(Seen::Won {
            attempt,
            kind,
            expires_in,
        });
    }
    Ok(Seen::Record(view(row)?))
}

fn view(row: &Row) -> Result<View, tokio_postgres::Error> {
    Ok(View {
        status: row.try_get("status")?,
        same_fingerprint: row.try_get("same_fingerprint")?,
        lease_ms: row.try_get("lease_ms")?,
        expired: row.try_get("expired")?,
        ttl_ms: row.try_get("ttl_ms")?,
        token: row.try_get("record_token")?,
        response: decode_response(row)?,
    })
}

/// How many claim rounds to try before answering "in flight" to a key that changes under every read.
pub(super) const CLAIM_ROUNDS: usize = 3;

/// What a claim round's row decides: the claim's result, or `None` when the record was not seen or looked
/// claimable, so the next round must decide.
pub(super) fn settle(seen: Option<Seen>) -> Option<ClaimResult> {
    match seen? {
        Seen::Won {
            attempt,
            kind,
            expires_in,
        } => Some(ClaimResult::Won {
            attempt,
            kind,
            expires_in,
        }),
        Seen::Record(view) if !claimable(&view) => Some(ClaimResult::Held(view.into_existing())),
        Seen::Record(_) => None,
    }
}

/// Whether TAKE's WHERE (`claimable!`) would take this version of the row. A version that looks
/// claimable but was not taken is from an older snapshot than the row lock saw.
pub(super) fn claimable(view: &View) -> bool {
    let running = view.status == "processing" && view.lease_ms > 0;
    (view.expired && !running)
        || (view.same_fingerprint
            && (view.status == "failed" || (view.status == "processing" && view.lease_ms <= 0)))
}

/// The answer to a claim whose key changed under every round: in flight, to be retried in a second.
pub(super) fn changed_under_every_round(id: &RecordId) -> ClaimResult {
    tracing::warn!(key_hash = %id.key_hash(), "key changed under every claim round; answering in flight");
    ClaimResult::Held(Existing::Processing {
        same_fingerprint: true,
        lease_remaining: Duration::from_secs(1),
    })
}

/// One row of WRITE_BATCH.
pub(super) enum BatchRow {
    /// A claim that inserted its new key, by its token, with the address of the row it inserted.
    Won(Uuid, Tid),
    /// A completion that stored its response, by its claim's token.
    Completed(Uuid),
    /// The record a claim input saw (by its 1-based position in the sorted claims).
    Seen(i64, View),
}

pub(super) fn decode_batch_row(row: &Row) -> Result<BatchRow, StoreError> {
    match row.try_get::<_, &str>("outcome").map_err(backend)? {
        "won" => Ok(BatchRow::Won(
            row.try_get("token").map_err(backend)?,
            row.try_get("address").map_err(backend)?,
        )),
        "completed" => Ok(BatchRow::Completed(row.try_get("token").map_err(backend)?)),
        "seen" => Ok(BatchRow::Seen(
            row.try_get("n").map_err(backend)?,
            view(row).map_err(backend)?,
        )),
        _ => Err(corrupt()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn view(status: &str) -> View {
        View {
            status: status.into(),
            same_fingerprint: true,
            lease_ms: 1_500,
            expired: false,
            ttl_ms: 60_000,
            token: Uuid::from_u128(7),
            response: None,
        }
    }

    fn response() -> StoredResponse {
        stored_response(
            201,
            vec!["etag".into()],
            vec![b"\"v1\"".to_vec()],
            true,
            Some(b"ok".to_vec()),
        )
    }

    #[test]
    fn a_completed_record_carries_its_response_expiry_and_epoch() {
        let completed = View {
            response: Some(response()),
            ..view("completed")
        };
        let Existing::Completed {
            same_fingerprint,
            response: stored,
            expires_in,
            token,
        } = completed.into_existing()
        else {
            panic!("a completed record with a response is replayable");
        };
        assert!(same_fingerprint);
        assert_eq!(stored, response());
        assert_eq!(expires_in, Duration::from_secs(60));
        assert_eq!(token, Uuid::from_u128(7));
    }

    #[test]
    fn a_completed_record_past_its_expiry_expires_in_zero() {
        let completed = View {
            ttl_ms: -250,
            response: Some(response()),
            ..view("completed")
        };
        let Existing::Completed { expires_in, .. } = completed.into_existing() else {
            panic!("still completed");
        };
        assert_eq!(expires_in, Duration::ZERO);
    }

    #[test]
    fn a_completed_status_without_response_columns_reads_as_processing() {
        let existing = view("completed").into_existing();
        assert!(matches!(existing, Existing::Processing { .. }), "{existing:?}");
    }

    #[test]
    fn failed_and_unknown_records_map_to_their_states() {
        assert!(matches!(view("failed").into_existing(), Existing::Failed));
        let unknown = View {
            same_fingerprint: false,
            ..view("unknown")
        };
        assert!(matches!(
            unknown.into_existing(),
            Existing::Unknown {
                same_fingerprint: false
            }
        ));
    }

    #[test]
    fn a_processing_record_reports_its_lease_and_a_lapsed_lease_as_zero() {
        let live = view("processing").into_existing();
        assert!(matches!(
            live,
            Existing::Processing { same_fingerprint: true, lease_remaining }
                if lease_remaining == Duration::from_millis(1_500)
        ));
        let lapsed = View {
            lease_ms: -10,
            ..view("processing")
        };
        assert!(matches!(
            lapsed.into_existing(),
            Existing::Processing { lease_remaining, .. } if lease_remaining.is_zero()
        ));
    }

    #[test]
    fn a_status_this_version_does_not_know_is_treated_as_in_flight() {
        assert!(matches!(
            view("archived").into_existing(),
            Existing::Processing { .. }
        ));
    }

    #[test]
    fn response_headers_pair_up_in_stored_order() {
        let names = vec!["set-cookie".into(), "set-cookie".into(), "x-empty".into()];
        let values = vec![b"a=1".to_vec(), b"b=2".to_vec(), Vec::new()];
        let stored = stored_response(200, names, values, true, Some(Vec::new()));
        let expected: Vec<(String, Vec<u8>)> = vec![
            ("set-cookie".into(), b"a=1".to_vec()),
            ("set-cookie".into(), b"b=2".to_vec()),
            ("x-empty".into(), Vec::new()),
        ];
        assert_eq!(stored.status, 200);
        assert_eq!(stored.headers, expected);
    }

    #[test]
    fn a_body_that_was_not_retained_is_absent_even_if_bytes_are_stored() {
        let stored = stored_response(200, Vec::new(), Vec::new(), false, Some(b"partial".to_vec()));
        assert_eq!(stored.body, None);
    }

    #[test]
    fn a_retained_body_stored_as_null_is_empty() {
        let stored = stored_response(204, Vec::new(), Vec::new(), true, None);
        assert_eq!(stored.body, Some(Bytes::new()));
    }
}
