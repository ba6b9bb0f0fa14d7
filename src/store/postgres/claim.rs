//! The claim: which request executes a key. Runs on the request path, once per keyed request, alone or
//! coalesced with others (`store.max_batch`); touches only the records of the keys being claimed. A claim
//! takes one or more rounds of CLAIM then TAKE on one connection; a coalesced claim's first round is
//! CLAIM_BATCH, shared with every claim in its batch, and a request that round leaves undecided goes on
//! to claim alone. Each round's row is settled here: won, held by a record that cannot be taken, or
//! undecided (the record looked claimable, so the next statement must decide).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio::time::timeout;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::rows::{Seen, View, corrupt, decode, decode_batched};
use super::runner::{Db, backend, retry_serialization};
use crate::store::{ClaimRequest, ClaimResult, Existing, StoreError};

/// Columns describing a record `r` as seen by the statement (with `same_fingerprint`, which each
/// statement words for its own parameters).
macro_rules! view_columns {
    () => {
        "r.status, ceil(extract(epoch FROM (r.locked_until - now())) * 1000)::bigint AS lease_ms, \
         r.expires_at <= now() AS expired, \
         ceil(extract(epoch FROM (r.expires_at - now())) * 1000)::bigint AS ttl_ms, r.response_status, \
         r.response_header_names, r.response_header_values, r.response_body, r.body_retained, \
         r.token AS record_token"
    };
}

/// The shape of CLAIM's and TAKE's answer: one row saying whether this request won the key, and if not,
/// the record as of the statement's snapshot. `$1`, `$2`: scope and key; the CTE is named `won`.
macro_rules! won_or_record {
    () => {
        concat!(
            "SELECT true AS won, w.attempt, w.claim_kind, NULL::boolean AS same_fingerprint, \
                    NULL::text AS status, NULL::bigint AS lease_ms, NULL::boolean AS expired, \
                    NULL::bigint AS ttl_ms, NULL::smallint AS response_status, NULL::text[] AS response_header_names, \
                    NULL::bytea[] AS response_header_values, NULL::bytea AS response_body, \
                    NULL::boolean AS body_retained, NULL::uuid AS record_token
             FROM won w
             UNION ALL
             SELECT false, r.attempt, r.claim_kind, r.fingerprint = $3 AS same_fingerprint, ",
            view_columns!(),
            " FROM idemproxy.records r
             WHERE r.scope = $1 AND r.key = $2 AND NOT EXISTS (SELECT 1 FROM won)"
        )
    };
}

/// Which existing records a claim may take: expired ones, unless a live claim still runs on them (a key
/// retried at the end of its TTL while its original runs must not execute twice); and for the same
/// request, released ones and those whose lease ran out. Evaluated by the database clock.
macro_rules! claimable {
    () => {
        "((r.expires_at <= now() AND NOT (r.status = 'processing' AND r.locked_until > now()))
          OR (r.fingerprint = $3
              AND (r.status = 'failed' OR (r.status = 'processing' AND r.locked_until <= now()))))"
    };
}

/// The claim's first round trip. A new key is won by the INSERT, decided by the primary key. An existing
/// key is left untouched (DO NOTHING takes no row lock and writes nothing, so replays of one hot key never
/// queue behind each other) and reported as of the statement's snapshot. That snapshot may predate a
/// concurrent commit: the row is then invisible, or looks claimable when it no longer is. Both cases, and
/// a row that really is claimable, go on to TAKE.
const CLAIM: &str = concat!(
    "WITH won AS (
        INSERT INTO idemproxy.records AS r
            (scope, key, fingerprint, status, token, attempt, claim_kind,
             locked_until, created_at, expires_at, updated_at)
        VALUES ($1, $2, $3, 'processing', $4, 1, 'new',
                now() + make_interval(secs => $5), now(), now() + make_interval(secs => $6), now())
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING r.attempt, r.claim_kind
    ) ",
    won_or_record!()
);

/// The second round trip, for an existing record that may be claimable: an atomic conditional UPDATE.
/// PostgreSQL re-checks the WHERE against the latest committed version of the row under its row lock, so
/// of several concurrent takers exactly one wins, and a row changed since this statement's snapshot is
/// judged as it is now. If nothing was taken, the record is reported as for CLAIM.
const TAKE: &str = concat!(
    "WITH won AS (
        UPDATE idemproxy.records AS r SET
            fingerprint = $3,
            status = 'processing',
            token = $4,
            attempt = CASE WHEN r.expires_at <= now() THEN 1 ELSE r.attempt + 1 END,
            claim_kind = CASE WHEN r.expires_at <= now() THEN 'new'
                              WHEN r.status = 'failed' THEN 'retry'
                              ELSE 'takeover' END,
            locked_until = now() + make_interval(secs => $5),
            created_at = CASE WHEN r.expires_at <= now() THEN now() ELSE r.created_at END,
            expires_at = CASE WHEN r.expires_at <= now() THEN now() + make_interval(secs => $6)
                              ELSE greatest(r.expires_at, now() + make_interval(secs => $5)) END,
            updated_at = now(),
            response_status = NULL,
            response_header_names = NULL,
            response_header_values = NULL,
            response_body = NULL,
            body_retained = NULL
        WHERE r.scope = $1 AND r.key = $2 AND ",
    claimable!(),
    "
        RETURNING r.attempt, r.claim_kind
    ) ",
    won_or_record!()
);

/// CLAIM's first round for many requests at once (coalesced): one statement and one commit for all of
/// them. Each new key is won by the INSERT, as in CLAIM; every other request gets its record as of the
/// statement's snapshot. The inputs come sorted by (scope, key), so concurrent batches insert in one
/// order and never deadlock each other. Of two requests for one key in the same batch, one wins and the
/// other sees no record (the snapshot predates the statement's own insert); like a request whose CLAIM
/// saw no record, it goes on to claim alone. One row per input; `n` is its 1-based position.
const CLAIM_BATCH: &str = concat!(
    "WITH input AS (
        SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::uuid[], $5::float8[], $6::float8[])
            WITH ORDINALITY AS u(scope, key, fingerprint, token, lease, ttl, n)
    ), won AS (
        INSERT INTO idemproxy.records AS r
            (scope, key, fingerprint, status, token, attempt, claim_kind,
             locked_until, created_at, expires_at, updated_at)
        SELECT scope, key, fingerprint, 'processing', token, 1, 'new',
               now() + make_interval(secs => lease), now(), now() + make_interval(secs => ttl), now()
        FROM input ORDER BY n
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING r.token, r.attempt, r.claim_kind
    )
    SELECT i.n, w.token IS NOT NULL AS won, r.scope IS NOT NULL AS seen,
           coalesce(w.attempt, r.attempt) AS attempt, coalesce(w.claim_kind, r.claim_kind) AS claim_kind,
           r.fingerprint = i.fingerprint AS same_fingerprint, ",
    view_columns!(),
    " FROM input i
    LEFT JOIN won w ON w.token = i.token
    LEFT JOIN idemproxy.records r ON w.token IS NULL AND r.scope = i.scope AND r.key = i.key
    ORDER BY i.n"
);

/// How many claim rounds to try before answering "in flight" to a key that changes under every read.
const CLAIM_ROUNDS: usize = 3;

/// A coalesced claim's answer: decided, or `None` when the request must go on to claim alone.
pub(super) type FirstRound = Result<Option<ClaimResult>, StoreError>;

/// The claim with rounds of CLAIM and TAKE on one connection.
pub(super) async fn alone(db: &Db, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
    let client = db.client().await?;
    let result = timeout(db.timeout(), rounds(&client, request)).await;
    db.finish(client, result)
}

/// A batch of claims: one alone runs the whole claim; more run CLAIM_BATCH.
pub(super) async fn batch(db: Arc<Db>, requests: Vec<ClaimRequest>) -> Vec<FirstRound> {
    if let [request] = requests.as_slice() {
        return vec![alone(&db, request).await.map(Some)];
    }
    match together(&db, &requests).await {
        Ok(decided) => decided.into_iter().map(Ok).collect(),
        Err(error) => requests.iter().map(|_| Err(error.clone())).collect(),
    }
}

async fn rounds(client: &Object, request: &ClaimRequest) -> Result<ClaimResult, tokio_postgres::Error> {
    let claim = client.prepare_cached(CLAIM).await?;
    let take = client.prepare_cached(TAKE).await?;
    let id = &request.id;
    let fingerprint: &[u8] = &request.fingerprint;
    let lease = request.lease.as_secs_f64();
    let ttl = request.ttl.as_secs_f64();
    let params: [&(dyn ToSql + Sync); 6] = [&id.scope, &id.key, &fingerprint, &id.token, &lease, &ttl];
    for _ in 0..CLAIM_ROUNDS {
        for statement in [&claim, &take] {
            let row = retry_serialization(|| client.query_opt(statement, &params)).await?;
            if let Some(decided) = settle(row.as_ref().map(decode).transpose()?) {
                return Ok(decided);
            }
        }
    }
    tracing::warn!(key = %id.key, "key changed under every claim round; answering in flight");
    Ok(ClaimResult::Held(Existing::Processing {
        same_fingerprint: true,
        lease_remaining: Duration::from_secs(1),
    }))
}

async fn together(db: &Db, requests: &[ClaimRequest]) -> Result<Vec<Option<ClaimResult>>, StoreError> {
    let batch = ClaimBatch::new(requests);
    let rows = db.query_planned(CLAIM_BATCH, &batch.params()).await?;
    batch.answers(rows.iter().map(|row| decode_batched(row).map_err(backend)))
}

/// CLAIM_BATCH's arguments: the requests sorted by (scope, key), one array per column.
struct ClaimBatch<'a> {
    requests: &'a [ClaimRequest],
    order: Vec<&'a ClaimRequest>,
    scopes: Vec<&'a str>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a [u8]>,
    tokens: Vec<Uuid>,
    leases: Vec<f64>,
    ttls: Vec<f64>,
}

impl<'a> ClaimBatch<'a> {
    fn new(requests: &'a [ClaimRequest]) -> ClaimBatch<'a> {
        let mut order: Vec<&ClaimRequest> = requests.iter().collect();
        order.sort_by(|a, b| (&a.id.scope, &a.id.key).cmp(&(&b.id.scope, &b.id.key)));
        ClaimBatch {
            requests,
            scopes: order.iter().map(|r| r.id.scope.as_str()).collect(),
            keys: order.iter().map(|r| r.id.key.as_str()).collect(),
            fingerprints: order.iter().map(|r| r.fingerprint.as_slice()).collect(),
            tokens: order.iter().map(|r| r.id.token).collect(),
            leases: order.iter().map(|r| r.lease.as_secs_f64()).collect(),
            ttls: order.iter().map(|r| r.ttl.as_secs_f64()).collect(),
            order,
        }
    }

    /// `$1` to `$6`, typed as CLAIM_BATCH casts them.
    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.scopes, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.fingerprints, Type::BYTEA_ARRAY),
            (&self.tokens, Type::UUID_ARRAY),
            (&self.leases, Type::FLOAT8_ARRAY),
            (&self.ttls, Type::FLOAT8_ARRAY),
        ]
    }

    /// Every request's answer, in the callers' order, from CLAIM_BATCH's rows (each row: the 1-based
    /// position of its input in the sorted order, and what it saw); `None` where the request must go on
    /// to claim alone.
    fn answers(
        &self,
        rows: impl IntoIterator<Item = Result<(i64, Option<Seen>), StoreError>>,
    ) -> Result<Vec<Option<ClaimResult>>, StoreError> {
        let mut decided: HashMap<Uuid, ClaimResult> = HashMap::with_capacity(self.order.len());
        for row in rows {
            let (n, seen) = row?;
            let request = usize::try_from(n - 1)
                .ok()
                .and_then(|i| self.order.get(i))
                .ok_or_else(corrupt)?;
            if let Some(result) = settle(seen) {
                decided.insert(request.id.token, result);
            }
        }
        Ok(self
            .requests
            .iter()
            .map(|r| decided.remove(&r.id.token))
            .collect())
    }
}

/// What a claim round's row decides: the claim's result, or `None` when the record was not seen or looked
/// claimable, so the next round must decide.
fn settle(seen: Option<Seen>) -> Option<ClaimResult> {
    match seen? {
        Seen::Won { attempt, kind } => Some(ClaimResult::Won { attempt, kind }),
        Seen::Record(view) if !claimable(&view) => Some(ClaimResult::Held(view.into_existing())),
        Seen::Record(_) => None,
    }
}

/// Whether TAKE's WHERE (`claimable!`) would take this version of the row. A version that looks
/// claimable but was not taken is from an older snapshot than the row lock saw.
fn claimable(view: &View) -> bool {
    let running = view.status == "processing" && view.lease_ms > 0;
    (view.expired && !running)
        || (view.same_fingerprint
            && (view.status == "failed" || (view.status == "processing" && view.lease_ms <= 0)))
}
