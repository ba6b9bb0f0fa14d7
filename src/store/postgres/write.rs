//! The coalesced write: claims and completions that arrive together, whichever the kind, go to the
//! database as one WRITE_BATCH statement and one commit (`store.max_batch`). Runs in the write batch's
//! task, for every keyed request's claim and completion that found a batch running; touches only the
//! records of the keys being claimed and completed. A batch of one runs alone (CLAIM and TAKE, or
//! COMPLETE), so a request that finds the store idle never waits for another.
//!
//! Claims and completions share batches because a keyed request needs both, one after the other: with a
//! batch of each kind running side by side, every request paid for two commits' share; with one lane,
//! the claims of new requests ride in the same commit as the completions of finished ones.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::address::Addresses;
use super::claim::{self, ClaimBatch, FirstRound};
use super::complete::{self, CompleteBatch, Completion};
use super::db::Db;
use super::rows::{BatchRow, corrupt, decode_batch_row};
use crate::store::{ClaimRequest, ClaimResult, StoreError};

/// Claims (`$1` to `$6`, sorted by scope and key) and completions (`$7` to `$17`) in one statement.
///
/// - A new key is won by the INSERT, decided by the primary key, exactly as CLAIM decides it; the
///   statement returns the winners' tokens and their rows' addresses. Inputs go in (scope, key) order,
///   so concurrent batches insert in one order and never deadlock each other.
/// - Every claim input the INSERT did not win is also looked up by its key (one index lookup each:
///   LATERAL with OFFSET 0 keeps it a per-input lookup) and reported as of the statement's snapshot,
///   which predates the statement's own insert and update: a request whose key another request of the
///   batch inserted sees no record and goes on to claim alone, as one whose record looks claimable does.
///   A winner needs no lookup: its answer is its token among those the INSERT returned.
/// - A completion stores its response fenced by its claim's token, exactly as COMPLETE does: only a
///   record still `processing` under that token changes; the statement returns the tokens of the records
///   it completed. The UPDATE reaches each record by its row's address (a TID scan): the address its
///   claim's INSERT returned, when the claim was won in a batch (`$17`, kept by the store per token),
///   else the one a lookup by key finds (a subquery, one index lookup). The UPDATE joins the key table
///   on nothing but that address and the token, neither of them indexed, so the planner has no index
///   to scan the table through whole, however small the table when the plan was made; and no
///   completion ever inserts a row. A row changed since the snapshot is re-checked as UPDATE always
///   does, but PostgreSQL refuses, on that re-check, a version at another address than the one asked
///   for; so a completion the statement did not confirm is tried once more alone (`batch`), and a record
///   rewritten under the batch (its own claim's heartbeat) is never left `processing`, whatever the
///   address. Header lists travel flattened in `$11` and `$12`, each completion's the slice
///   `first_header..=last_header`.
///
/// No request can be in one batch with the completion its claim would replay: a response is handed to
/// its client only once its completion has committed, so a retry's claim reaches a later statement.
const WRITE_BATCH: &str = concat!(
    "WITH claim AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $5::float8[], $6::float8[])
            WITH ORDINALITY AS u(scope, key, fingerprint, token, lease, ttl, n)
    ), won AS (
        INSERT INTO idemproxy.records AS r
            (scope, key, fingerprint, status, token, attempt, claim_kind,
             locked_until, created_at, expires_at, updated_at)
        SELECT scope, key, fingerprint, 'processing', token, 1, 'new',
               now() + make_interval(secs => lease), now(), now() + make_interval(secs => ttl), now()
        FROM claim ORDER BY n
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING r.token, r.ctid
    ), completed AS (
        UPDATE idemproxy.records AS r
        SET status = 'completed', locked_until = now(), updated_at = now(), response_status = f.status,
            response_header_names = ($11::text[])[f.first_header:f.last_header],
            response_header_values = ($12::bytea[])[f.first_header:f.last_header],
            response_body = f.body, body_retained = f.retained
        FROM (
            SELECT coalesce(c.address, (
                       SELECT x.ctid FROM idemproxy.records x
                       WHERE x.scope = c.scope AND x.key = c.key AND x.token = c.token
                         AND x.status = 'processing'
                   )) AS tid, c.*
            FROM unnest($7::text[], $8::text[], $9::uuid[], $10::int2[], $13::int4[], $14::int4[],
                        $15::bytea[], $16::bool[], $17::tid[])
                AS c(scope, key, token, status, first_header, last_header, body, retained, address)
        ) f
        WHERE r.ctid = f.tid AND r.token = f.token AND r.status = 'processing'
        RETURNING r.token
    )
    SELECT 'won' AS outcome, NULL::bigint AS n, w.token, w.ctid AS address, NULL::boolean AS same_fingerprint,
           NULL::text AS status, NULL::bigint AS lease_ms, NULL::boolean AS expired,
           NULL::bigint AS ttl_ms, NULL::smallint AS response_status, NULL::text[] AS response_header_names,
           NULL::bytea[] AS response_header_values, NULL::bytea AS response_body,
           NULL::boolean AS body_retained, NULL::uuid AS record_token
    FROM won w
    UNION ALL
    SELECT 'completed', NULL, c.token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
    FROM completed c
    UNION ALL
    SELECT 'seen', i.n, NULL, NULL, r.fingerprint = i.fingerprint, ",
    view_columns!(),
    " FROM claim i
    CROSS JOIN LATERAL (
        SELECT * FROM idemproxy.records x WHERE x.scope = i.scope AND x.key = i.key OFFSET 0
    ) r
    WHERE i.token <> ALL (ARRAY(SELECT token FROM won))"
);

/// One operation for the write batch.
pub(super) enum Write {
    Claim(ClaimRequest),
    Complete(Completion),
}

/// A write's answer: a claim's first round, or whether a completion stored its response.
pub(super) enum Written {
    Claim(FirstRound),
    Complete(Result<bool, StoreError>),
}

/// A batch of writes: one alone runs alone; more run WRITE_BATCH. One answer per write, in order. A
/// completion WRITE_BATCH did not confirm runs once more alone, as COMPLETE: the batch finds each record
/// as of its snapshot, and one rewritten since by another transaction that kept it `processing` under
/// the same token (a heartbeat) may be passed over; COMPLETE judges the record as it is now. A completion
/// fenced out for real (a takeover) costs that one more statement. The addresses of the rows the batch's
/// claims inserted go to `addresses`, for their completions.
pub(super) async fn batch(db: Arc<Db>, addresses: Arc<Addresses>, writes: Vec<Write>) -> Vec<Written> {
    if let [write] = writes.as_slice() {
        return vec![match write {
            Write::Claim(request) => Written::Claim(claim::alone(&db, request).await.map(Some)),
            Write::Complete(c) => Written::Complete(complete::alone(&db, &c.id, &c.response).await),
        }];
    }
    let claims = writes.iter().filter_map(|w| match w {
        Write::Claim(request) => Some(request),
        Write::Complete(_) => None,
    });
    let completions = writes.iter().filter_map(|w| match w {
        Write::Complete(completion) => Some(completion),
        Write::Claim(_) => None,
    });
    match together(&db, &addresses, claims, completions).await {
        Ok((claimed, completed)) => {
            let mut claimed = claimed.into_iter();
            let mut answers = Vec::with_capacity(writes.len());
            for write in &writes {
                answers.push(match write {
                    Write::Claim(_) => Written::Claim(Ok(claimed.next().flatten())),
                    Write::Complete(c) if completed.contains(&c.id.token) => Written::Complete(Ok(true)),
                    Write::Complete(c) => Written::Complete(complete::alone(&db, &c.id, &c.response).await),
                });
            }
            answers
        }
        Err(error) => writes
            .iter()
            .map(|w| match w {
                Write::Claim(_) => Written::Claim(Err(error.clone())),
                Write::Complete(_) => Written::Complete(Err(error.clone())),
            })
            .collect(),
    }
}

/// Runs WRITE_BATCH: every claim's first-round answer in the claims' order, and the tokens of the
/// records completed; keeps the addresses of the rows inserted.
async fn together<'a>(
    db: &Db,
    addresses: &Addresses,
    claims: impl Iterator<Item = &'a ClaimRequest>,
    completions: impl Iterator<Item = &'a Completion>,
) -> Result<(Vec<Option<ClaimResult>>, HashSet<Uuid>), StoreError> {
    let claim_batch = ClaimBatch::new(claims);
    let complete_batch = CompleteBatch::new(completions)?;
    let rows = db
        .query_batch(WRITE_BATCH, &params(&claim_batch, &complete_batch))
        .await?;
    let (mut won, mut completed) = (HashSet::new(), HashSet::new());
    let (mut inserted, mut seen) = (Vec::new(), HashMap::new());
    for row in &rows {
        let first = match decode_batch_row(row)? {
            BatchRow::Won(token, address) => {
                inserted.push((token, address));
                won.insert(token)
            }
            BatchRow::Completed(token) => completed.insert(token),
            BatchRow::Seen(n, view) => seen.insert(n, view).is_none(),
        };
        if !first {
            return Err(corrupt());
        }
    }
    let answers = claim_batch.answers(&won, seen)?;
    addresses.remember(inserted);
    Ok((answers, completed))
}

/// `$1` to `$17`: the claims' then the completions' arguments.
fn params<'b>(
    claims: &'b ClaimBatch<'_>,
    completions: &'b CompleteBatch<'_>,
) -> Vec<(&'b (dyn ToSql + Sync), Type)> {
    claims.params().into_iter().chain(completions.params()).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;

    use super::super::db::assert_typed_params;
    use super::*;
    use crate::store::{RecordId, StoredResponse};

    fn id(key: &str, token: u128) -> RecordId {
        RecordId {
            scope: "s".into(),
            key: key.into(),
            token: Uuid::from_u128(token),
        }
    }

    #[test]
    fn batch_arguments_fit_the_statements_casts() {
        let claims = [ClaimRequest {
            id: id("new", 1),
            fingerprint: [1; 32],
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        }];
        let completions = [Completion {
            id: id("done", 2),
            response: StoredResponse {
                status: 201,
                headers: vec![("a".into(), b"1".to_vec())],
                body: Some(Bytes::from_static(b"x")),
            },
            address: None,
        }];
        let claim_batch = ClaimBatch::new(claims.iter());
        let complete_batch = CompleteBatch::new(completions.iter()).unwrap();
        assert_typed_params(WRITE_BATCH, &params(&claim_batch, &complete_batch));
    }

    #[test]
    fn completions_are_fenced_by_the_claims_token_when_found_and_when_written() {
        assert!(WRITE_BATCH.contains(
            "WHERE x.scope = c.scope AND x.key = c.key AND x.token = c.token
                         AND x.status = 'processing'"
        ));
        assert!(
            WRITE_BATCH.contains("WHERE r.ctid = f.tid AND r.token = f.token AND r.status = 'processing'")
        );
    }
}
