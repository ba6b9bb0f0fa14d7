//! Statements off the request path, over many records: the sweeper's deletion of expired records (SWEEP)
//! and the operator tools' reads and deletions (FIND, LIST, STATS and FORGET, for `idemproxy keys`).
//! Touches the whole key table, a bounded batch, one page or one key's records at a time.

use std::sync::Arc;

use rusqlite::params;

use super::bridge::{Shared, backend};
use super::rows::{record_info, record_stats};
use crate::store::{
    ListPage, ListQuery, RecordId, RecordInfo, RecordStats, ScopeFilter, StoreError, page, sql_start,
};

/// One bounded batch of expired records; a processing one only once its lease has run out too.
const SWEEP: &str = "DELETE FROM records WHERE rowid IN (
        SELECT rowid FROM records
        WHERE expires_at <= ?1 AND (status <> 'processing' OR locked_until <= ?1)
        ORDER BY expires_at
        LIMIT ?2)";

/// The columns of an operator's view of a record, followed by the statement's condition.
macro_rules! described {
    ($condition:literal) => {
        concat!(
            "SELECT scope, key, status, attempt, claim_kind, token, created_at, updated_at,
                expires_at, locked_until, response_status, length(response_body) AS body_bytes,
                body_retained
            FROM records ",
            $condition
        )
    };
}

/// An operator's view of the records holding a key.
const FIND: &str = described!("WHERE key = ?1 AND (?2 IS NULL OR scope = ?2) ORDER BY scope");

/// A page of `keys list`: the primary key's order from the row value after the cursor, so each page is
/// one bounded range read of the primary key however large the table.
const LIST: &str = described!("WHERE (scope, key) > (?1, ?2) ORDER BY scope, key LIMIT ?3");

/// A page of `keys list` within one scope: the primary key's range of that scope.
const LIST_IN_SCOPE: &str = described!("WHERE scope = ?1 AND key > ?2 ORDER BY key LIMIT ?3");

/// `keys forget`: fenced by the token the operator was shown, so a record claimed again since is kept.
const FORGET: &str = "DELETE FROM records WHERE scope = ?1 AND key = ?2 AND token = ?3";

/// Records by state, expired ones apart.
const STATS: &str = "SELECT
        coalesce(sum(expires_at > ?1 AND status = 'processing'), 0),
        coalesce(sum(expires_at > ?1 AND status = 'completed'), 0),
        coalesce(sum(expires_at > ?1 AND status = 'failed'), 0),
        coalesce(sum(expires_at > ?1 AND status = 'unknown'), 0),
        coalesce(sum(expires_at <= ?1), 0)
    FROM records";

pub(super) async fn sweep(conn: &Arc<Shared>, batch: u32) -> Result<u64, StoreError> {
    conn.call(move |db, now| {
        let mut statement = db.prepare_cached(SWEEP).map_err(backend)?;
        let deleted = statement
            .execute(params![now, i64::from(batch)])
            .map_err(backend)?;
        Ok(deleted as u64)
    })
    .await
}

pub(super) async fn find(
    conn: &Arc<Shared>,
    key: &str,
    scope: Option<&str>,
) -> Result<Vec<RecordInfo>, StoreError> {
    let (key, scope) = (key.to_owned(), scope.map(str::to_owned));
    conn.call(move |db, now| {
        let mut statement = db.prepare_cached(FIND).map_err(backend)?;
        let rows = statement
            .query_map(params![key, scope], |row| record_info(row, now))
            .map_err(backend)?;
        rows.map(|row| row.map_err(backend)).collect()
    })
    .await
}

pub(super) async fn list(conn: &Arc<Shared>, query: &ListQuery) -> Result<ListPage, StoreError> {
    let (from_scope, from_key) = sql_start(query)?;
    let sql = match query.scope {
        ScopeFilter::Exact(_) => LIST_IN_SCOPE,
        ScopeFilter::All | ScopeFilter::Named(_) => LIST,
    };
    let examine = i64::from(query.examine);
    let records = conn
        .call(move |db, now| {
            let mut statement = db.prepare_cached(sql).map_err(backend)?;
            let rows = statement
                .query_map(params![from_scope, from_key, examine], |row| {
                    record_info(row, now)
                })
                .map_err(backend)?;
            rows.map(|row| row.map_err(backend))
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
    Ok(page(records, query))
}

pub(super) async fn forget(conn: &Arc<Shared>, id: &RecordId) -> Result<bool, StoreError> {
    let (scope, key, token) = (id.scope.clone(), id.key.clone(), id.token);
    conn.call(move |db, _| {
        let mut statement = db.prepare_cached(FORGET).map_err(backend)?;
        let deleted = statement
            .execute(params![scope, key, token.as_bytes().as_slice()])
            .map_err(backend)?;
        Ok(deleted == 1)
    })
    .await
}

pub(super) async fn stats(conn: &Arc<Shared>) -> Result<RecordStats, StoreError> {
    conn.call(|db, now| db.query_row(STATS, params![now], record_stats).map_err(backend))
        .await
}
