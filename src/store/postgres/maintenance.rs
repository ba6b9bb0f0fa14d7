//! Statements off the request path, over many records: the sweeper's deletion of expired records
//! (SWEEP, from every replica's sweeper task) and the operator tools' reads (FIND, LIST, STATS
//! and FORGET, for `idemproxy keys`). Touches the whole key table, a bounded batch, one page or one
//! key's records at a time.

use super::citus;
use super::db::{Db, backend};
use super::rows::{corrupt, record_info, record_stats};
use crate::store::{
    ListPage, ListQuery, RecordId, RecordInfo, RecordStats, ScopeFilter, StoreError, page, sql_start,
};

/// Deletes one bounded batch of expired records. SKIP LOCKED lets sweepers on many replicas split the
/// work instead of queueing on each other's rows, and leaves alone a row a claim is taking right now;
/// the outer WHERE re-checks each row under its lock, so a record re-claimed since the inner read stays.
/// A processing record goes only once its lease has run out too: its holder may still complete it.
/// Sent unprepared: how best to join the expired rows to their keys depends on how many there are.
const SWEEP: &str = "DELETE FROM idemproxy.records AS r
    WHERE (r.scope, r.key) IN (
        SELECT scope, key FROM idemproxy.records
        WHERE expires_at <= now() AND (status <> 'processing' OR locked_until <= now())
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED)
      AND r.expires_at <= now() AND (r.status <> 'processing' OR r.locked_until <= now())";

/// An operator's view of records, by the condition (and order) that follows it. It serves the runbook,
/// never the request path.
macro_rules! described {
    ($condition:literal) => {
        concat!(
            "SELECT scope, key, status, attempt, claim_kind, token,
                (extract(epoch FROM created_at) * 1000)::bigint AS created_ms,
                (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms,
                (extract(epoch FROM expires_at) * 1000)::bigint AS expires_ms,
                (extract(epoch FROM locked_until) * 1000)::bigint AS locked_ms,
                (extract(epoch FROM now()) * 1000)::bigint AS now_ms,
                response_status, octet_length(response_body)::bigint AS body_bytes, body_retained
            FROM idemproxy.records
            WHERE ",
            $condition
        )
    };
}

/// A key's record in one scope: one primary-key lookup.
const FIND_IN_SCOPE: &str = described!("key = $1 AND scope = $2 ORDER BY scope");

/// A key's records in every scope: a scan of the primary key, whose second column is the key. Two
/// statements rather than one with an optional scope, because a connection's generic plan
/// (`connect::INDEX_PLANS`) cannot tell whether the scope is given and would scan for both.
const FIND: &str = described!("key = $1 ORDER BY scope");

/// A page of `keys list`: the primary key read in its order from the row value after the cursor, so each
/// page is one bounded range scan of the primary key however large the table (a row-value comparison is
/// an index condition on `(scope, key)`; separate `scope > $1 OR ...` conditions would not be).
const LIST: &str = described!("(scope, key) > ($1, $2) ORDER BY scope, key LIMIT $3");

/// A page of `keys list` within one scope: the primary key's range of that scope.
const LIST_IN_SCOPE: &str = described!("scope = $1 AND key > $2 ORDER BY key LIMIT $3");

/// `keys forget`: fenced by the token the operator was shown, so a record claimed again since then (a
/// new execution under way) is kept.
const FORGET: &str = "DELETE FROM idemproxy.records WHERE scope = $1 AND key = $2 AND token = $3";

/// Records by state, expired ones apart. Portable aggregate (no FILTER clause).
const STATS: &str = "SELECT
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'processing' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'completed' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'failed' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'unknown' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at <= now() THEN 1 ELSE 0 END), 0)::bigint
    FROM idemproxy.records";

/// One batch; on a distributed key table, one batch on each shard, all shards at once (`citus.rs`).
pub(super) async fn sweep(db: &Db, batch: u32) -> Result<u64, StoreError> {
    if db.distributed().await? {
        let command = citus::shard_command(SWEEP, batch);
        return citus::swept(&db.query(citus::SWEEP_SHARDS, &[&command]).await?);
    }
    let limit = i64::from(batch);
    db.execute_unprepared(SWEEP, &[&limit]).await
}

pub(super) async fn find(db: &Db, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
    let rows = match scope {
        Some(scope) => db.query(FIND_IN_SCOPE, &[&key, &scope]).await?,
        None => db.query(FIND, &[&key]).await?,
    };
    rows.iter()
        .map(|row| record_info(row).map_err(backend)?.ok_or_else(corrupt))
        .collect()
}

pub(super) async fn list(db: &Db, query: &ListQuery) -> Result<ListPage, StoreError> {
    let (scope, key) = sql_start(query)?;
    let sql = match query.scope {
        ScopeFilter::Exact(_) => LIST_IN_SCOPE,
        ScopeFilter::All | ScopeFilter::Named(_) => LIST,
    };
    let rows = db.query(sql, &[&scope, &key, &i64::from(query.examine)]).await?;
    let records = rows
        .iter()
        .map(|row| record_info(row).map_err(backend)?.ok_or_else(corrupt))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(records, query))
}

pub(super) async fn forget(db: &Db, id: &RecordId) -> Result<bool, StoreError> {
    Ok(db.execute(FORGET, &[&id.scope, &id.key, &id.token]).await? == 1)
}

pub(super) async fn stats(db: &Db) -> Result<RecordStats, StoreError> {
    let rows = db.query(STATS, &[]).await?;
    record_stats(rows.first().ok_or_else(corrupt)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_counts_in_the_order_record_stats_reads_them() {
        let counted: Vec<&str> = STATS
            .lines()
            .filter(|line| line.contains("CASE WHEN"))
            .map(|line| match line.split('\'').nth(1) {
                Some(status) => status,
                None if line.contains("expires_at <= now()") => "expired",
                None => panic!("an unexpected count: {line}"),
            })
            .collect();
        assert_eq!(
            counted,
            ["processing", "completed", "failed", "unknown", "expired"]
        );
    }

    #[test]
    fn a_swept_row_is_checked_again_under_its_lock() {
        let expired = "expires_at <= now() AND (status <> 'processing' OR locked_until <= now())";
        let locked = "r.expires_at <= now() AND (r.status <> 'processing' OR r.locked_until <= now())";
        let (inner, outer) = SWEEP.split_once("FOR UPDATE SKIP LOCKED").unwrap();
        assert!(inner.contains(expired), "the inner read picks expired records");
        assert!(
            outer.contains(locked),
            "the outer WHERE re-checks them under the row lock"
        );
    }
}
