//! The PostgreSQL key table. Runs on the request path (claim) and in the forwarding task (heartbeat,
//! complete, release); touches only the `idemproxy` schema. Every statement is a named constant, prepared
//! once per pooled connection, except the coalesced batches, which are planned for each call; every
//! operation is bounded by `store.timeout`, and a connection that timed out is dropped instead of going
//! back to the pool. The database clock (`now()`) is the only clock.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio::time::{error::Elapsed, timeout};
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{NoTls, Row, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;
use uuid::Uuid;

use super::coalesce::{BatchFuture, Coalescer, unanswered};
use super::{
    ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, RecordInfo, RecordStats, RecordStatus, Store,
    StoreError, StoredResponse, epoch_ms,
};
use crate::config::StoreConfig;
use crate::error_chain::error_chain;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// Where refinery records applied migrations; it lives in our schema so a database can be shared.
const MIGRATION_TABLE: &str = "idemproxy.schema_history";

/// Serialises concurrent `migrate` runs of several replicas starting at once. Taken only by migration,
/// never on the request path.
const MIGRATION_LOCK_ID: i64 = 0x1de3_7072_6f78_7901;

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

/// Extends the lease of a live claim, and the record's expiry with it so a running key never expires.
/// Fenced: only the holder of the current token can.
const HEARTBEAT: &str = "UPDATE idemproxy.records
    SET locked_until = now() + make_interval(secs => $4),
        expires_at = greatest(expires_at, now() + make_interval(secs => $4)), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Stores the response. Fenced: a slow original whose claim was taken over matches no row.
const COMPLETE: &str = "UPDATE idemproxy.records
    SET status = 'completed', locked_until = now(), updated_at = now(),
        response_status = $4, response_header_names = $5, response_header_values = $6,
        response_body = $7, body_retained = $8
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// COMPLETE for many records at once (coalesced), fenced per record exactly like COMPLETE. Header lists
/// travel flattened in `$5`/`$6`; each record's are the slice `first_header..=last_header` (1-based, empty
/// when `first_header > last_header`). Returns the token of every record it completed.
const COMPLETE_BATCH: &str = "UPDATE idemproxy.records AS r
    SET status = 'completed', locked_until = now(), updated_at = now(),
        response_status = c.status,
        response_header_names = ($5::text[])[c.first_header:c.last_header],
        response_header_values = ($6::bytea[])[c.first_header:c.last_header],
        response_body = c.body, body_retained = c.retained
    FROM unnest($1::text[], $2::text[], $3::uuid[], $4::int2[], $7::int4[], $8::int4[], $9::bytea[],
                $10::bool[]) AS c(scope, key, token, status, first_header, last_header, body, retained)
    WHERE r.scope = c.scope AND r.key = c.key AND r.token = c.token AND r.status = 'processing'
    RETURNING r.token";

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

/// Deletes one bounded batch of expired records. SKIP LOCKED lets sweepers on many replicas split the
/// work instead of queueing on each other's rows, and leaves alone a row a claim is taking right now;
/// the outer WHERE re-checks each row under its lock, so a record re-claimed since the inner read stays.
/// A processing record goes only once its lease has run out too: its holder may still complete it.
const SWEEP: &str = "DELETE FROM idemproxy.records AS r
    WHERE (r.scope, r.key) IN (
        SELECT scope, key FROM idemproxy.records
        WHERE expires_at <= now() AND (status <> 'processing' OR locked_until <= now())
        ORDER BY expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED)
      AND r.expires_at <= now() AND (r.status <> 'processing' OR r.locked_until <= now())";

/// An operator's view of the records holding a key. Without a scope this scans the table: it serves the
/// runbook, never the request path.
const FIND: &str = "SELECT scope, key, status, attempt, claim_kind, token,
        (extract(epoch FROM created_at) * 1000)::bigint AS created_ms,
        (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms,
        (extract(epoch FROM expires_at) * 1000)::bigint AS expires_ms,
        (extract(epoch FROM locked_until) * 1000)::bigint AS locked_ms,
        (extract(epoch FROM now()) * 1000)::bigint AS now_ms,
        response_status, octet_length(response_body)::bigint AS body_bytes, body_retained
    FROM idemproxy.records
    WHERE key = $1 AND ($2::text IS NULL OR scope = $2)
    ORDER BY scope";

/// Records by state, expired ones apart. Portable aggregate (no FILTER clause).
const STATS: &str = "SELECT
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'processing' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'completed' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'failed' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at > now() AND status = 'unknown' THEN 1 ELSE 0 END), 0)::bigint,
        coalesce(sum(CASE WHEN expires_at <= now() THEN 1 ELSE 0 END), 0)::bigint
    FROM idemproxy.records";

/// How many claim rounds to try before answering "in flight" to a key that changes under every read.
const CLAIM_ROUNDS: usize = 3;

/// How often a statement hit by a serialization failure or deadlock is retried.
const SERIALIZATION_RETRIES: usize = 3;

/// The PostgreSQL-backed [`Store`]. Claims and completions that arrive together are coalesced into one
/// statement each (`store.max_batch`); everything else runs one statement per operation.
pub struct PostgresStore {
    db: Arc<Db>,
    claims: Option<Coalescer<ClaimRequest, FirstRound>>,
    completions: Option<Coalescer<Completion, Result<bool, StoreError>>>,
}

/// The pool and the bound on every operation, shared with the batch tasks.
struct Db {
    pool: Pool,
    timeout: Duration,
}

/// A coalesced claim's answer: decided, or `None` when the request must go on to claim alone.
type FirstRound = Result<Option<ClaimResult>, StoreError>;

/// A completion waiting for its batch.
struct Completion {
    id: RecordId,
    response: StoredResponse,
}

impl PostgresStore {
    /// Builds the pool; connections open lazily, so this succeeds while the database is down.
    pub fn connect(config: &StoreConfig) -> Result<PostgresStore, StoreError> {
        let pg = pg_config(config)?;
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls_connector(config)? {
            Some(tls) => Manager::from_config(pg, tls, manager_config),
            None => Manager::from_config(pg, NoTls, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(config.pool_size)
            .build()
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        let db = Arc::new(Db {
            pool,
            timeout: config.timeout,
        });
        let (claims, completions) = if config.max_batch > 1 {
            let in_flight = batches_in_flight(config.pool_size);
            let claims = Coalescer::new(config.max_batch, in_flight, {
                let db = Arc::clone(&db);
                move |requests| Box::pin(Arc::clone(&db).claim_batch(requests)) as BatchFuture<_>
            });
            let completions = Coalescer::new(config.max_batch, in_flight, {
                let db = Arc::clone(&db);
                move |items| Box::pin(Arc::clone(&db).complete_batch(items)) as BatchFuture<_>
            });
            (Some(claims), Some(completions))
        } else {
            (None, None)
        };
        Ok(PostgresStore {
            db,
            claims,
            completions,
        })
    }

    /// Applies pending migrations. Several replicas may call this at once: a session advisory lock on a
    /// dedicated connection serialises them, and each applies only what is still missing.
    pub async fn migrate(config: &StoreConfig) -> Result<usize, StoreError> {
        let pg = pg_config(config)?;
        match tls_connector(config)? {
            Some(tls) => migrate_over(pg, tls).await,
            None => migrate_over(pg, NoTls).await,
        }
    }
}

/// Most batches of each kind (claims, completions) running at once: a quarter of the pool, so coalesced
/// statements leave connections for everything else (heartbeats, requests that claim alone). More than
/// one runs only while a full batch waits (see `coalesce`).
fn batches_in_flight(pool_size: usize) -> usize {
    (pool_size / 4).max(1)
}

/// Completions with a body over this size are stored alone, so one statement never carries many large
/// bodies at once.
const BATCHED_BODY_LIMIT: usize = 64 * 1024;

impl Db {
    async fn client(&self) -> Result<Object, StoreError> {
        match timeout(self.timeout, self.pool.get()).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => Err(StoreError::Backend(e.to_string())),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// Maps a bounded operation's result; a connection whose operation timed out may still have a
    /// statement in flight, so it is detached from the pool rather than reused.
    fn finish<T>(
        &self,
        client: Object,
        result: Result<Result<T, tokio_postgres::Error>, Elapsed>,
    ) -> Result<T, StoreError> {
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(backend(e)),
            Err(_) => {
                drop(Object::take(client));
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// Runs one statement within `store.timeout` and returns its rows.
    async fn query(&self, sql: &'static str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(sql).await?;
            retry_serialization(|| client.query(&statement, params)).await
        })
        .await;
        self.finish(client, result)
    }

    /// Runs a batch statement within `store.timeout`, unprepared: the database plans it for this call's
    /// own arguments and the table as it is now. A prepared statement's generic plan, once chosen while
    /// the table was small, would go on scanning the whole table for every batch as the table grows.
    async fn query_planned(
        &self,
        sql: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let result = timeout(
            self.timeout,
            retry_serialization(|| client.query_typed(sql, params)),
        )
        .await;
        self.finish(client, result)
    }

    /// Runs one statement within `store.timeout` and returns how many rows it changed.
    async fn execute(&self, sql: &'static str, params: &[&(dyn ToSql + Sync)]) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(sql).await?;
            retry_serialization(|| client.execute(&statement, params)).await
        })
        .await;
        self.finish(client, result)
    }

    async fn execute_fenced(
        &self,
        sql: &'static str,
        id: &RecordId,
        extra: &[&(dyn ToSql + Sync)],
    ) -> Result<bool, StoreError> {
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&id.scope, &id.key, &id.token];
        params.extend_from_slice(extra);
        Ok(self.execute(sql, &params).await? == 1)
    }

    /// The claim with rounds of CLAIM and TAKE on one connection.
    async fn claim_alone(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, claim_on(&client, request)).await;
        self.finish(client, result)
    }

    async fn complete_alone(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let names: Vec<&str> = response.headers.iter().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&[u8]> = response.headers.iter().map(|(_, v)| v.as_slice()).collect();
        let status = response.status as i16;
        let retained = response.body.is_some();
        let body: Option<&[u8]> = response.body.as_deref();
        self.execute_fenced(COMPLETE, id, &[&status, &names, &values, &body, &retained])
            .await
    }

    /// A batch of claims: one alone runs the whole claim; more run CLAIM_BATCH.
    async fn claim_batch(self: Arc<Self>, requests: Vec<ClaimRequest>) -> Vec<FirstRound> {
        if let [request] = requests.as_slice() {
            return vec![self.claim_alone(request).await.map(Some)];
        }
        match self.claim_together(&requests).await {
            Ok(decided) => decided.into_iter().map(Ok).collect(),
            Err(error) => requests.iter().map(|_| Err(error.clone())).collect(),
        }
    }

    async fn claim_together(
        &self,
        requests: &[ClaimRequest],
    ) -> Result<Vec<Option<ClaimResult>>, StoreError> {
        let mut order: Vec<&ClaimRequest> = requests.iter().collect();
        order.sort_by(|a, b| (&a.id.scope, &a.id.key).cmp(&(&b.id.scope, &b.id.key)));
        let scopes: Vec<&str> = order.iter().map(|r| r.id.scope.as_str()).collect();
        let keys: Vec<&str> = order.iter().map(|r| r.id.key.as_str()).collect();
        let fingerprints: Vec<&[u8]> = order.iter().map(|r| r.fingerprint.as_slice()).collect();
        let tokens: Vec<Uuid> = order.iter().map(|r| r.id.token).collect();
        let leases: Vec<f64> = order.iter().map(|r| r.lease.as_secs_f64()).collect();
        let ttls: Vec<f64> = order.iter().map(|r| r.ttl.as_secs_f64()).collect();
        let params: [(&(dyn ToSql + Sync), Type); 6] = [
            (&scopes, Type::TEXT_ARRAY),
            (&keys, Type::TEXT_ARRAY),
            (&fingerprints, Type::BYTEA_ARRAY),
            (&tokens, Type::UUID_ARRAY),
            (&leases, Type::FLOAT8_ARRAY),
            (&ttls, Type::FLOAT8_ARRAY),
        ];
        let rows = self.query_planned(CLAIM_BATCH, &params).await?;
        let mut decided: HashMap<Uuid, ClaimResult> = HashMap::with_capacity(rows.len());
        for row in &rows {
            let (n, seen) = decode_batched(row).map_err(backend)?;
            let request = usize::try_from(n - 1)
                .ok()
                .and_then(|i| order.get(i))
                .ok_or_else(corrupt)?;
            if let Some(result) = settle(seen) {
                decided.insert(request.id.token, result);
            }
        }
        Ok(requests.iter().map(|r| decided.remove(&r.id.token)).collect())
    }

    /// A batch of completions: one alone runs COMPLETE; more run COMPLETE_BATCH.
    async fn complete_batch(self: Arc<Self>, items: Vec<Completion>) -> Vec<Result<bool, StoreError>> {
        if let [item] = items.as_slice() {
            return vec![self.complete_alone(&item.id, &item.response).await];
        }
        match self.complete_together(&items).await {
            Ok(completed) => items
                .iter()
                .map(|c| Ok(completed.contains(&c.id.token)))
                .collect(),
            Err(error) => items.iter().map(|_| Err(error.clone())).collect(),
        }
    }

    async fn complete_together(&self, items: &[Completion]) -> Result<HashSet<Uuid>, StoreError> {
        let scopes: Vec<&str> = items.iter().map(|c| c.id.scope.as_str()).collect();
        let keys: Vec<&str> = items.iter().map(|c| c.id.key.as_str()).collect();
        let tokens: Vec<Uuid> = items.iter().map(|c| c.id.token).collect();
        let statuses: Vec<i16> = items.iter().map(|c| c.response.status as i16).collect();
        let headers = items.iter().flat_map(|c| &c.response.headers);
        let names: Vec<&str> = headers.clone().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&[u8]> = headers.map(|(_, v)| v.as_slice()).collect();
        let (mut firsts, mut lasts) = (Vec::with_capacity(items.len()), Vec::with_capacity(items.len()));
        let mut next = 1i32;
        for item in items {
            let count = i32::try_from(item.response.headers.len()).map_err(|_| corrupt())?;
            firsts.push(next);
            lasts.push(next + count - 1);
            next += count;
        }
        let bodies: Vec<Option<&[u8]>> = items.iter().map(|c| c.response.body.as_deref()).collect();
        let retained: Vec<bool> = items.iter().map(|c| c.response.body.is_some()).collect();
        let params: [(&(dyn ToSql + Sync), Type); 10] = [
            (&scopes, Type::TEXT_ARRAY),
            (&keys, Type::TEXT_ARRAY),
            (&tokens, Type::UUID_ARRAY),
            (&statuses, Type::INT2_ARRAY),
            (&names, Type::TEXT_ARRAY),
            (&values, Type::BYTEA_ARRAY),
            (&firsts, Type::INT4_ARRAY),
            (&lasts, Type::INT4_ARRAY),
            (&bodies, Type::BYTEA_ARRAY),
            (&retained, Type::BOOL_ARRAY),
        ];
        let rows = self.query_planned(COMPLETE_BATCH, &params).await?;
        rows.iter()
            .map(|row| row.try_get::<_, Uuid>(0).map_err(backend))
            .collect()
    }
}

async fn migrate_over<T>(pg: tokio_postgres::Config, tls: T) -> Result<usize, StoreError>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (mut client, connection) = pg.connect(tls).await.map_err(backend)?;
    let driver = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "migration connection ended");
        }
    });
    let applied = migrate_locked(&mut client).await;
    drop(client);
    let _ = driver.await;
    applied
}

/// The TLS connector when the URL says `sslmode=require`: rustls, verifying the server's certificate and
/// name against the system's CA certificates plus `store.tls_ca_file`. `sslmode=disable` or none connects in
/// clear text; config validation refuses every other mode.
fn tls_connector(config: &StoreConfig) -> Result<Option<MakeRustlsConnect>, StoreError> {
    if !config.tls {
        return Ok(None);
    }
    let client = crate::tls::client_config(config.tls_ca_file.as_deref())
        .map_err(|e| StoreError::Backend(format!("store TLS: {e}")))?;
    Ok(Some(MakeRustlsConnect::new(client)))
}

async fn migrate_locked(client: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    let migration = |e: tokio_postgres::Error| StoreError::Migration(error_chain(&e));
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(migration)?;
    client
        .batch_execute("CREATE SCHEMA IF NOT EXISTS idemproxy")
        .await
        .map_err(migration)?;
    let report = embedded::migrations::runner()
        .set_migration_table_name(MIGRATION_TABLE)
        .run_async(client)
        .await
        .map_err(|e| StoreError::Migration(e.to_string()));
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(migration)?;
    Ok(report?.applied_migrations().len())
}

fn pg_config(config: &StoreConfig) -> Result<tokio_postgres::Config, StoreError> {
    let mut pg: tokio_postgres::Config = config
        .url
        .parse()
        .map_err(|e: tokio_postgres::Error| StoreError::Backend(e.to_string()))?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(config.timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("idemproxy");
    }
    pg.keepalives(true).keepalives_idle(Duration::from_secs(30));
    Ok(pg)
}

fn backend(e: tokio_postgres::Error) -> StoreError {
    StoreError::Backend(error_chain(&e))
}

/// Runs a statement again when the database reports a serialization failure or deadlock (40001, 40P01),
/// which distributed Postgres-compatible databases raise under contention.
async fn retry_serialization<T, F, Fut>(mut statement: F) -> Result<T, tokio_postgres::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tokio_postgres::Error>>,
{
    let mut attempt = 0;
    loop {
        match statement().await {
            Err(e) if attempt < SERIALIZATION_RETRIES && is_serialization_failure(&e) => attempt += 1,
            result => return result,
        }
    }
}

fn is_serialization_failure(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// One row of CLAIM or TAKE.
enum Seen {
    Won { attempt: i32, kind: ClaimKind },
    Record(View),
}

/// A record as one statement saw it.
struct View {
    status: String,
    same_fingerprint: bool,
    lease_ms: i64,
    expired: bool,
    ttl_ms: i64,
    token: Uuid,
    response: Option<StoredResponse>,
}

impl View {
    /// Whether TAKE's WHERE (`claimable!`) would take this version of the row. A version that looks
    /// claimable but was not taken is from an older snapshot than the row lock saw.
    fn claimable(&self) -> bool {
        let running = self.status == "processing" && self.lease_ms > 0;
        (self.expired && !running)
            || (self.same_fingerprint
                && (self.status == "failed" || (self.status == "processing" && self.lease_ms <= 0)))
    }

    fn into_existing(self) -> Existing {
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

fn decode(row: &Row) -> Result<Seen, tokio_postgres::Error> {
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
fn decode_batched(row: &Row) -> Result<(i64, Option<Seen>), tokio_postgres::Error> {
    let n = row.try_get("n")?;
    if !row.try_get::<_, bool>("won")? && !row.try_get::<_, bool>("seen")? {
        return Ok((n, None));
    }
    Ok((n, Some(decode(row)?)))
}

/// What a claim round's row decides: the claim's result, or `None` when the record was not seen or looked
/// claimable, so the next round must decide.
fn settle(seen: Option<Seen>) -> Option<ClaimResult> {
    match seen? {
        Seen::Won { attempt, kind } => Some(ClaimResult::Won { attempt, kind }),
        Seen::Record(view) if !view.claimable() => Some(ClaimResult::Held(view.into_existing())),
        Seen::Record(_) => None,
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
    Ok(Some(StoredResponse {
        status: status as u16,
        headers: names.into_iter().zip(values).collect(),
        body: if retained {
            Some(Bytes::from(body.unwrap_or_default()))
        } else {
            None
        },
    }))
}

async fn claim_on(client: &Object, request: &ClaimRequest) -> Result<ClaimResult, tokio_postgres::Error> {
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

#[async_trait::async_trait]
impl Store for PostgresStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let Some(claims) = &self.claims else {
            return self.db.claim_alone(request).await;
        };
        match timeout(self.db.timeout, claims.submit(request.clone())).await {
            Ok(Some(Ok(Some(decided)))) => Ok(decided),
            Ok(Some(Ok(None))) => self.db.claim_alone(request).await,
            Ok(Some(Err(error))) => Err(error),
            Ok(None) => Err(unanswered()),
            Err(_) => Err(StoreError::Timeout(self.db.timeout)),
        }
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.db
            .execute_fenced(HEARTBEAT, id, &[&lease.as_secs_f64()])
            .await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let Some(completions) = self.completions.as_ref().filter(|_| {
            response
                .body
                .as_ref()
                .is_none_or(|b| b.len() <= BATCHED_BODY_LIMIT)
        }) else {
            return self.db.complete_alone(id, response).await;
        };
        let completion = Completion {
            id: id.clone(),
            response: response.clone(),
        };
        match timeout(self.db.timeout, completions.submit(completion)).await {
            Ok(Some(stored)) => stored,
            Ok(None) => Err(unanswered()),
            Err(_) => Err(StoreError::Timeout(self.db.timeout)),
        }
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.db.execute_fenced(RELEASE, id, &[]).await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.db.execute_fenced(HOLD, id, &[]).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.db.client().await?;
        let result = timeout(self.db.timeout, client.simple_query("SELECT 1")).await;
        self.db.finish(client, result).map(drop)
    }

    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.db.execute_fenced(RELEASE_STALE, id, &[]).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let limit = i64::from(batch);
        self.db.execute(SWEEP, &[&limit]).await
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        let rows = self.db.query(FIND, &[&key, &scope]).await?;
        rows.iter()
            .map(|row| record_info(row).map_err(backend)?.ok_or_else(corrupt))
            .collect()
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        let rows = self.db.query(STATS, &[]).await?;
        let row = rows.first().ok_or_else(corrupt)?;
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
}

fn corrupt() -> StoreError {
    StoreError::Backend("a record holds a status or claim kind this version does not know".into())
}

/// One row of FIND, or `None` when a column holds a value this version does not know.
fn record_info(row: &Row) -> Result<Option<RecordInfo>, tokio_postgres::Error> {
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
