//! The writes a claim's holder makes besides completing it (heartbeat, release, hold), and an operator's
//! release of a stuck claim (`idemproxy keys release`). Runs in the forwarding task, and in the operator
//! tool; touches the one record named by scope and key, and only while it still carries the token of the
//! claim the writer holds or inspected: every statement here, and COMPLETE, is fenced by that token.

use std::sync::Arc;
use std::time::Duration;

use rusqlite::params;

use super::bridge::{Shared, backend, millis};
use crate::store::{RecordId, StoreError};

/// Extends the lease, and the expiry with it so a running key never expires. Fenced: only the holder of
/// the current token can.
const HEARTBEAT: &str = "UPDATE records
    SET locked_until = ?4, expires_at = max(expires_at, ?4), updated_at = ?5
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND status = 'processing'";

/// Gives the key back so the next retry executes. Fenced like COMPLETE.
const RELEASE: &str = "UPDATE records SET status = 'failed', locked_until = ?4, updated_at = ?4
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND status = 'processing'";

/// Holds a claim whose outcome is unknown: no claim takes it again until an operator releases it.
/// Fenced like COMPLETE.
const HOLD: &str = "UPDATE records SET status = 'unknown', locked_until = ?4, updated_at = ?4
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND status = 'processing'";

/// An operator's release of a stuck claim: fenced, and only once its lease has run out; or of a held
/// record, which has no holder.
const RELEASE_STALE: &str = "UPDATE records SET status = 'failed', locked_until = ?4, updated_at = ?4
    WHERE scope = ?1 AND key = ?2 AND token = ?3
      AND (status = 'unknown' OR (status = 'processing' AND locked_until <= ?4))";

pub(super) async fn heartbeat(
    conn: &Arc<Shared>,
    id: &RecordId,
    lease: Duration,
) -> Result<bool, StoreError> {
    fenced(conn, HEARTBEAT, id, Extra::Lease(millis(lease))).await
}

pub(super) async fn release(conn: &Arc<Shared>, id: &RecordId) -> Result<bool, StoreError> {
    fenced(conn, RELEASE, id, Extra::None).await
}

pub(super) async fn hold(conn: &Arc<Shared>, id: &RecordId) -> Result<bool, StoreError> {
    fenced(conn, HOLD, id, Extra::None).await
}

pub(super) async fn release_stale(conn: &Arc<Shared>, id: &RecordId) -> Result<bool, StoreError> {
    fenced(conn, RELEASE_STALE, id, Extra::None).await
}

/// The parameters a fenced update takes after the claim's identity and the time.
enum Extra {
    None,
    /// A lease, in milliseconds.
    Lease(i64),
}

/// A fenced single-row update: `?1..?3` identify the claim, `?4` is now, then `extra`.
async fn fenced(
    conn: &Arc<Shared>,
    sql: &'static str,
    id: &RecordId,
    extra: Extra,
) -> Result<bool, StoreError> {
    let (scope, key, token) = (id.scope.clone(), id.key.clone(), id.token);
    conn.call(move |db, now| {
        let mut statement = db.prepare_cached(sql).map_err(backend)?;
        let token = token.as_bytes().as_slice();
        let changed = match extra {
            Extra::None => statement.execute(params![scope, key, token, now]),
            Extra::Lease(lease) => {
                statement.execute(params![scope, key, token, now.saturating_add(lease), now])
            }
        };
        Ok(changed.map_err(backend)? == 1)
    })
    .await
}
