//! The writes a claim's holder makes besides completing it (heartbeat, release, hold), and an operator's
//! release of a stuck claim (`idemproxy keys release`). Runs in the forwarding task, and in the operator
//! tool; touches the one record named by scope and key, and only while it still carries the token of the
//! claim the writer holds or inspected: every statement here, and COMPLETE, is fenced by that token.

use std::time::Duration;

use tokio_postgres::types::ToSql;

use super::db::Db;
use crate::store::{RecordId, StoreError};

/// Extends the lease of a live claim, and the record's expiry with it so a running key never expires.
/// Fenced: only the holder of the current token can.
const HEARTBEAT: &str = "UPDATE idemproxy.records
    SET locked_until = now() + make_interval(secs => $4),
        expires_at = greatest(expires_at, now() + make_interval(secs => $4)), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Gives the key back so the next retry executes. Fenced like COMPLETE.
const RELEASE: &str = "UPDATE idemproxy.records
    SET status = 'failed', locked_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Holds a claim whose outcome is unknown (`on_unknown_outcome = "hold"`): no claim can take it again
/// until an operator releases it. Fenced like COMPLETE.
const HOLD: &str = "UPDATE idemproxy.records
    SET status = 'unknown', locked_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// An operator's release of a stuck claim (`idemproxy keys release`): fenced by the token the operator
/// inspected, and only once the lease has run out, so it cannot race a live holder's completion; or of a
/// held record, which has no holder.
const RELEASE_STALE: &str = "UPDATE idemproxy.records
    SET status = 'failed', locked_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3
      AND (status = 'unknown' OR (status = 'processing' AND locked_until <= now()))";

pub(super) async fn heartbeat(db: &Db, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
    execute(db, HEARTBEAT, id, &[&lease.as_secs_f64()]).await
}

pub(super) async fn release(db: &Db, id: &RecordId) -> Result<bool, StoreError> {
    execute(db, RELEASE, id, &[]).await
}

pub(super) async fn hold(db: &Db, id: &RecordId) -> Result<bool, StoreError> {
    execute(db, HOLD, id, &[]).await
}

pub(super) async fn release_stale(db: &Db, id: &RecordId) -> Result<bool, StoreError> {
    execute(db, RELEASE_STALE, id, &[]).await
}

/// Runs a statement fenced by `id` (`$1` scope, `$2` key, `$3` token, then `extra` from `$4`): whether
/// it wrote the record.
pub(super) async fn execute(
    db: &Db,
    sql: &'static str,
    id: &RecordId,
    extra: &[&(dyn ToSql + Sync)],
) -> Result<bool, StoreError> {
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&id.scope, &id.key, &id.token];
    params.extend_from_slice(extra);
    Ok(db.execute(sql, &params).await? == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FENCE: &str = "WHERE scope = $1 AND key = $2 AND token = $3";

    #[test]
    fn the_holders_writes_match_only_its_own_live_claim() {
        for sql in [HEARTBEAT, RELEASE, HOLD] {
            assert!(
                sql.contains(&format!("{FENCE} AND status = 'processing'")),
                "{sql}"
            );
        }
    }

    #[test]
    fn an_operators_release_matches_the_inspected_token_once_no_live_holder_can_race_it() {
        assert!(RELEASE_STALE.contains(FENCE));
        assert!(
            RELEASE_STALE
                .contains("AND (status = 'unknown' OR (status = 'processing' AND locked_until <= now()))")
        );
    }
}
