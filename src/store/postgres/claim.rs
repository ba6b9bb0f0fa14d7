//! The claim: which request executes a key. Runs on the request path, once per keyed request, alone or
//! coalesced with others (`store.max_batch`); touches only the records of the keys being claimed. A claim
//! takes one or more rounds of CLAIM then TAKE on one connection; a coalesced claim's first round is
//! WRITE_BATCH (`write.rs`), shared with every claim and completion in its batch, and a request that
//! round leaves undecided goes on to claim alone. Each round's row is settled here: won, held by a
//! record that cannot be taken, or undecided (the record looked claimable, so the next statement must
//! decide).

use std::collections::{HashMap, HashSet};

use deadpool_postgres::Object;
use tokio::time::timeout;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::db::{Db, retry_serialization};
use super::rows::{CLAIM_ROUNDS, Seen, View, changed_under_every_round, corrupt, decode, settle};
use super::shard_claim;
use crate::store::{ClaimKind, ClaimRequest, ClaimResult, RecordId, StoreError};

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

/// The record of `$1`, `$2` as a claim sees it, with whether it holds the fingerprint `$3`.
macro_rules! seen_record {
    () => {
        concat!(
            "SELECT false AS won, r.attempt, r.claim_kind, r.fingerprint = $3 AS same_fingerprint, ",
            view_columns!(),
            " FROM idemproxy.records r WHERE r.scope = $1 AND r.key = $2"
        )
    };
}

/// What a claim that won reports of the record it wrote `r`: its attempt, its kind and its time to expiry
/// in milliseconds, rounded up. Measured from the `updated_at` the same statement wrote, which is its
/// `now()`: the store's clock, and no function of a column (Citus refuses a stable function applied
/// to a column in a distributed UPDATE, and sends this arithmetic to the shard as it is).
macro_rules! won_columns {
    () => {
        "r.attempt, r.claim_kind, \
         ceil(extract(epoch FROM (r.expires_at - r.updated_at)) * 1000)::bigint AS ttl_ms"
    };
}

/// The shape of CLAIM's and TAKE's answer: one row saying whether this request won the key, and if not,
/// the record as of the statement's snapshot. `$1`, `$2`: scope and key; the CTE is named `won`.
macro_rules! won_or_record {
    () => {
        concat!(
            "SELECT true AS won, w.attempt, w.claim_kind, NULL::boolean AS same_fingerprint, \
                    NULL::text AS status, NULL::bigint AS lease_ms, NULL::boolean AS expired, \
                    w.ttl_ms, NULL::smallint AS response_status, NULL::text[] AS response_header_names, \
                    NULL::bytea[] AS response_header_values, NULL::bytea AS response_body, \
                    NULL::boolean AS body_retained, NULL::uuid AS record_token
             FROM won w
             UNION ALL ",
            seen_record!(),
            " AND NOT EXISTS (SELECT 1 FROM won)"
        )
    };
}

/// An expired record, unless a live claim still runs on it: claimable by any request, as a new key.
macro_rules! expired_unless_running {
    () => {
        "r.expires_at <= now() AND NOT (r.status = 'processing' AND r.locked_until > now())"
    };
}

/// A record of the same request (`$3`) released, or whose lease ran out: claimable again by it.
macro_rules! same_request_again {
    () => {
        "r.fingerprint = $3
              AND (r.status = 'failed' OR (r.status = 'processing' AND r.locked_until <= now()))"
    };
}

/// Which existing records a claim may take: expired ones, unless a live claim still runs on them (a key
/// retried at the end of its TTL while its original runs must not execute twice); and for the same
/// request, released ones and those whose lease ran out. Evaluated by the database clock.
macro_rules! claimable {
    () => {
        concat!(
            "((",
            expired_unless_running!(),
            ") OR (",
            same_request_again!(),
            "))"
        )
    };
}

/// A new key's row, won by the primary key; nothing where a record exists. `$1` to `$6`: scope, key,
/// fingerprint, token, lease and TTL (seconds).
macro_rules! insert_new {
    () => {
        "INSERT INTO idemproxy.records AS r
            (scope, key, fingerprint, status, token, attempt, claim_kind,
             locked_until, created_at, expires_at, updated_at)
        VALUES ($1, $2, $3, 'processing', $4, 1, 'new',
                now() + make_interval(secs => $5), now(), now() + make_interval(secs => $6), now())
        ON CONFLICT (scope, key) DO NOTHING"
    };
}

/// The claim's first round trip. A new key is won by the INSERT, decided by the primary key. An existing
/// key is left untouched (DO NOTHING takes no row lock and writes nothing, so replays of one hot key never
/// queue behind each other) and reported as of the statement's snapshot. That snapshot may predate a
/// concurrent commit: the row is then invisible, or looks claimable when it no longer is. Both cases, and
/// a row that really is claimable, go on to TAKE.
const CLAIM: &str = concat!(
    "WITH won AS (",
    insert_new!(),
    " RETURNING ",
    won_columns!(),
    ") ",
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
        RETURNING ",
    won_columns!(),
    "
    ) ",
    won_or_record!()
);

/// A coalesced claim's answer: decided, or `None` when the request must go on to claim alone.
pub(super) type FirstRound = Result<Option<ClaimResult>, StoreError>;

/// The claim alone, on a connection of its own: rounds of CLAIM and TAKE, or on a key table distributed
/// by Citus the sharded claim's statements (`shard_claim.rs`). Both take the same arguments, `$1` to `$6`:
/// scope, key, fingerprint, token, lease and TTL (seconds).
pub(super) async fn alone(db: &Db, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
    let distributed = db.distributed().await?;
    let id = &request.id;
    let fingerprint: &[u8] = &request.fingerprint;
    let lease = request.lease.as_secs_f64();
    let ttl = request.ttl.as_secs_f64();
    let params: [&(dyn ToSql + Sync); 6] = [&id.scope, &id.key, &fingerprint, &id.token, &lease, &ttl];
    let client = db.client().await?;
    let result = if distributed {
        timeout(db.timeout(), shard_claim::rounds(&client, id, &params)).await
    } else {
        timeout(db.timeout(), rounds(&client, id, &params)).await
    };
    db.finish(client, result)
}

/// Rounds of CLAIM and TAKE on `client` until one decides, within the caller's bound.
async fn rounds(
    client: &Object,
    id: &RecordId,
    params: &[&(dyn ToSql + Sync); 6],
) -> Result<ClaimResult, tokio_postgres::Error> {
    let claim = client.prepare_cached(CLAIM).await?;
    let take = client.prepare_cached(TAKE).await?;
    for _ in 0..CLAIM_ROUNDS {
        for statement in [&claim, &take] {
            let row = retry_serialization(|| client.query_opt(statement, params)).await?;
            if let Some(decided) = settle(row.as_ref().map(decode).transpose()?) {
                return Ok(decided);
            }
        }
    }
    Ok(changed_under_every_round(id))
}

/// WRITE_BATCH's claim arguments: the requests sorted by (scope, key), one array per column, so that
/// concurrent batches insert new keys in one order and never deadlock each other.
pub(super) struct ClaimBatch<'a> {
    requests: Vec<&'a ClaimRequest>,
    order: Vec<&'a ClaimRequest>,
    scopes: Vec<&'a str>,
    keys: Vec<&'a str>,
    fingerprints: Vec<&'a [u8]>,
    tokens: Vec<Uuid>,
    leases: Vec<f64>,
    ttls: Vec<f64>,
}

impl<'a> ClaimBatch<'a> {
    pub(super) fn new(requests: impl Iterator<Item = &'a ClaimRequest>) -> ClaimBatch<'a> {
        let requests: Vec<&'a ClaimRequest> = requests.collect();
        let mut order = requests.clone();
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

    /// WRITE_BATCH's `$1` to `$6`, typed as it casts them.
    pub(super) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.scopes, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.fingerprints, Type::BYTEA_ARRAY),
            (&self.tokens, Type::UUID_ARRAY),
            (&self.leases, Type::FLOAT8_ARRAY),
            (&self.ttls, Type::FLOAT8_ARRAY),
        ]
    }

    /// Every request's answer, in the callers' order: won if its token is among the tokens the batch
    /// inserted, else decided by the record it saw (`seen`: 1-based positions in the sorted order, each
    /// with the record as of the statement's snapshot); `None` where the request must go on to claim
    /// alone (it saw no record, or one that looked claimable).
    pub(super) fn answers(
        &self,
        won: &HashSet<Uuid>,
        seen: impl IntoIterator<Item = (i64, View)>,
    ) -> Result<Vec<Option<ClaimResult>>, StoreError> {
        let mut views: HashMap<Uuid, View> = HashMap::with_capacity(self.order.len());
        for (n, view) in seen {
            let request = usize::try_from(n - 1)
                .ok()
                .and_then(|i| self.order.get(i))
                .ok_or_else(corrupt)?;
            views.insert(request.id.token, view);
        }
        let inserted = self.requests.iter().filter(|r| won.contains(&r.id.token));
        if inserted.count() != won.len() {
            return Err(corrupt());
        }
        Ok(self
            .requests
            .iter()
            .map(|r| {
                if won.contains(&r.id.token) {
                    // Inserted at the statement's `now()` to expire `ttl` after it.
                    Some(ClaimResult::Won {
                        attempt: 1,
                        kind: ClaimKind::New,
                        expires_in: r.ttl,
                    })
                } else {
                    settle(views.remove(&r.id.token).map(Seen::Record))
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::rows::claimable;
    use super::*;
    use crate::store::Existing;

    fn request(scope: &str, key: &str, token: u128) -> ClaimRequest {
        ClaimRequest {
            id: RecordId {
                scope: scope.into(),
                key: key.into(),
                token: Uuid::from_u128(token),
            },
            fingerprint: [token as u8; 32],
            lease: Duration::from_millis(1_500),
            ttl: Duration::from_secs(86_400),
        }
    }

    /// A record as a statement saw it: `status`, whether it expired, its lease left (ms) and whether
    /// the claiming request has the record's fingerprint.
    fn view(status: &str, expired: bool, lease_ms: i64, same_fingerprint: bool) -> View {
        View {
            status: status.into(),
            same_fingerprint,
            lease_ms,
            expired,
            ttl_ms: if expired { 0 } else { 60_000 },
            token: Uuid::from_u128(99),
            response: None,
        }
    }

    #[test]
    fn claimable_is_the_take_statements_where() {
        // (status, expired, lease left in ms, same fingerprint) -> claimable
        let cases = [
            // Expired: anything but a claim still running, whatever the fingerprint.
            (("completed", true, 0, false), true),
            (("unknown", true, 0, false), true),
            (("processing", true, 0, false), true),
            (("processing", true, 500, true), false),
            // Unexpired: only the same request, once released or once its lease ran out.
            (("failed", false, 0, true), true),
            (("failed", false, 0, false), false),
            (("processing", false, -1, true), true),
            (("processing", false, 0, true), true),
            (("processing", false, 1, true), false),
            (("processing", false, -1, false), false),
            (("completed", false, 0, true), false),
            (("unknown", false, 0, true), false),
        ];
        for ((status, expired, lease_ms, same), expected) in cases {
            let seen = view(status, expired, lease_ms, same);
            assert_eq!(
                claimable(&seen),
                expected,
                "{:?}",
                (status, expired, lease_ms, same)
            );
        }
    }

    #[test]
    fn a_round_decides_a_win_or_a_record_it_cannot_take() {
        let won = settle(Some(Seen::Won {
            attempt: 2,
            kind: ClaimKind::Retry,
            expires_in: Duration::from_secs(80),
        }));
        assert!(matches!(
            won,
            Some(ClaimResult::Won {
                attempt: 2,
                kind: ClaimKind::Retry,
                expires_in,
            }) if expires_in == Duration::from_secs(80)
        ));
        let held = settle(Some(Seen::Record(view("processing", false, 900, true))));
        assert!(matches!(
            held,
            Some(ClaimResult::Held(Existing::Processing { lease_remaining, .. }))
                if lease_remaining == Duration::from_millis(900)
        ));
    }

    #[test]
    fn a_round_that_saw_no_record_or_a_claimable_one_leaves_the_claim_to_the_next_statement() {
        assert!(settle(None).is_none());
        assert!(settle(Some(Seen::Record(view("failed", false, 0, true)))).is_none());
    }

    #[test]
    fn batch_inputs_go_in_scope_then_key_order_so_concurrent_batches_insert_alike() {
        let requests = [request("b", "1", 1), request("a", "2", 2), request("a", "1", 3)];
        let batch = ClaimBatch::new(requests.iter());
        assert_eq!(batch.scopes, ["a", "a", "b"]);
        assert_eq!(batch.keys, ["1", "2", "1"]);
        let tokens: Vec<u128> = batch.tokens.iter().map(|t| t.as_u128()).collect();
        assert_eq!(tokens, [3, 2, 1]);
        let fingerprints: Vec<u8> = batch.fingerprints.iter().map(|f| f[0]).collect();
        assert_eq!(fingerprints, [3, 2, 1]);
        assert_eq!(batch.leases, [1.5; 3]);
        assert_eq!(batch.ttls, [86_400.0; 3]);
    }

    #[test]
    fn batch_rows_answer_their_requests_in_the_callers_order() {
        let requests = [request("b", "1", 1), request("a", "1", 2), request("c", "1", 3)];
        let batch = ClaimBatch::new(requests.iter());
        // Sorted: a (token 2), b (token 1), c (token 3). b was inserted by the batch, a saw a record
        // held as unknown, c saw no record.
        let won = HashSet::from([Uuid::from_u128(1)]);
        let seen = [(1, view("unknown", false, 0, true))];
        let answers = batch.answers(&won, seen).unwrap();
        assert!(matches!(
            answers[0],
            Some(ClaimResult::Won {
                attempt: 1,
                kind: ClaimKind::New,
                expires_in,
            }) if expires_in == Duration::from_secs(86_400)
        ));
        assert!(matches!(
            answers[1],
            Some(ClaimResult::Held(Existing::Unknown { .. }))
        ));
        assert!(answers[2].is_none(), "a request that saw no record claims alone");
    }

    #[test]
    fn a_request_that_saw_a_claimable_record_claims_alone() {
        let requests = [request("a", "1", 1), request("a", "2", 2)];
        let batch = ClaimBatch::new(requests.iter());
        let seen = [
            (1, view("failed", false, 0, true)),
            (2, view("processing", false, 900, true)),
        ];
        let answers = batch.answers(&HashSet::new(), seen).unwrap();
        assert!(answers[0].is_none(), "released: TAKE decides");
        assert!(matches!(
            answers[1],
            Some(ClaimResult::Held(Existing::Processing { .. }))
        ));
    }

    #[test]
    fn a_row_for_a_position_or_token_outside_the_batch_is_refused() {
        let requests = [request("a", "1", 1), request("a", "2", 2)];
        let batch = ClaimBatch::new(requests.iter());
        for n in [0, 3, -1] {
            let answers = batch.answers(&HashSet::new(), [(n, view("failed", false, 0, true))]);
            assert!(matches!(answers, Err(StoreError::Backend(_))), "position {n}");
        }
        let stranger = HashSet::from([Uuid::from_u128(7)]);
        let answers = batch.answers(&stranger, []);
        assert!(matches!(answers, Err(StoreError::Backend(_))), "token");
    }
}
