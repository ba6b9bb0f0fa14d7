//! The PostgreSQL key table. Runs on the request path (claim) and in the forwarding task (heartbeat,
//! complete, release); touches only the `idemproxy` schema. Every statement is a named constant, prepared
//! once per pooled connection; every operation is bounded by `store.timeout`, and a connection that timed
//! out is dropped instead of going back to the pool. The database clock (`now()`) is the only clock.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio::time::{error::Elapsed, timeout};
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{NoTls, Row, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{
    ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, RecordInfo, RecordStats, RecordStatus, Store,
    StoreError, StoredResponse, epoch_ms,
};
use crate::config::StoreConfig;
use crate::error::error_chain;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// Where refinery records applied migrations; it lives in our schema so a database can be shared.
const MIGRATION_TABLE: &str = "idemproxy.schema_history";

/// Serialises concurrent `migrate` runs of several replicas starting at once. Taken only by migration,
/// never on the request path.
const MIGRATION_LOCK_ID: i64 = 0x1de3_7072_6f78_7901;

/// Columns describing a record as seen by the statement; `$3` is the request's fingerprint.
macro_rules! view_columns {
    () => {
        "r.status, r.fingerprint = $3 AS same_fingerprint, \
         ceil(extract(epoch FROM (r.locked_until - now())) * 1000)::bigint AS lease_ms, \
         r.expires_at <= now() AS expired, \
         ceil(extract(epoch FROM (r.expires_at - now())) * 1000)::bigint AS ttl_ms, r.response_status, r.response_header_names, \
         r.response_header_values, r.response_body, r.body_retained"
    };
}

/// The shape of CLAIM's and TAKE's answer: one row saying whether this request won the key, and if not,
/// the record as of the statement's snapshot. `$1`, `$2`: scope and key; the CTE is named `won`.
macro_rules! won_or_record {
    () => {
        concat!(
            "SELECT true AS won, w.attempt, w.claim_kind, NULL::text AS status, \
                    NULL::boolean AS same_fingerprint, NULL::bigint AS lease_ms, NULL::boolean AS expired, \
                    NULL::bigint AS ttl_ms, NULL::smallint AS response_status, NULL::text[] AS response_header_names, \
                    NULL::bytea[] AS response_header_values, NULL::bytea AS response_body, \
                    NULL::boolean AS body_retained
             FROM won w
             UNION ALL
             SELECT false, r.attempt, r.claim_kind, ",
            view_columns!(),
            " FROM idemproxy.records r
             WHERE r.scope = $1 AND r.key = $2 AND NOT EXISTS (SELECT 1 FROM won)"
        )
    };
}

/// Which existing records a claim may take: expired ones, and for the same request, released ones and
/// those whose lease ran out. Evaluated by the database clock.
macro_rules! claimable {
    () => {
        "(r.expires_at <= now()
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
                              ELSE r.expires_at END,
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

/// Extends the lease of a live claim. Fenced: only the holder of the current token can.
const HEARTBEAT: &str = "UPDATE idemproxy.records
    SET locked_until = now() + make_interval(secs => $4), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Stores the response. Fenced: a slow original whose claim was taken over matches no row.
const COMPLETE: &str = "UPDATE idemproxy.records
    SET status = 'completed', locked_until = now(), updated_at = now(),
        response_status = $4, response_header_names = $5, response_header_values = $6,
        response_body = $7, body_retained = $8
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Gives the key back so the next retry executes. Fenced like COMPLETE.
const RELEASE: &str = "UPDATE idemproxy.records
    SET status = 'failed', locked_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// An operator's release of a stuck claim (`idemproxy keys release`): fenced by the token the operator
/// inspected, and only once the lease has run out, so it cannot race a live holder's completion.
const RELEASE_STALE: &str = "UPDATE idemproxy.records
    SET status = 'failed', locked_until = now(), updated_at = now()
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing' AND locked_until <= now()";

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
        coalesce(sum(CASE WHEN expires_at <= now() THEN 1 ELSE 0 END), 0)::bigint
    FROM idemproxy.records";

/// How many claim rounds to try before answering "in flight" to a key that changes under every read.
const CLAIM_ROUNDS: usize = 3;

/// How often a statement hit by a serialization failure or deadlock is retried.
const SERIALIZATION_RETRIES: usize = 3;

/// The PostgreSQL-backed [`Store`].
pub struct PostgresStore {
    pool: Pool,
    timeout: Duration,
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
        Ok(PostgresStore {
            pool,
            timeout: config.timeout,
        })
    }

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

    async fn execute_fenced(
        &self,
        sql: &'static str,
        id: &RecordId,
        extra: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&id.scope, &id.key, &id.token];
        params.extend_from_slice(extra);
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(sql).await?;
            retry_serialization(|| client.execute(&statement, &params)).await
        })
        .await;
        self.finish(client, result).map(|rows| rows == 1)
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
/// name against the system's CA certificates plus `store.tls_ca_file`. Other modes connect in clear text.
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
    response: Option<StoredResponse>,
}

impl View {
    /// Whether TAKE's WHERE (`claimable!`) would take this version of the row. A version that looks
    /// claimable but was not taken is from an older snapshot than the row lock saw.
    fn claimable(&self) -> bool {
        self.expired
            || (self.same_fingerprint
                && (self.status == "failed" || (self.status == "processing" && self.lease_ms <= 0)))
    }

    fn into_existing(self) -> Existing {
        match (self.status.as_str(), self.response) {
            ("completed", Some(response)) => Existing::Completed {
                same_fingerprint: self.same_fingerprint,
                response,
                expires_in: Duration::from_millis(self.ttl_ms.max(0) as u64),
            },
            ("failed", _) => Existing::Failed,
            _ => Existing::Processing {
                same_fingerprint: self.same_fingerprint,
                lease_remaining: Duration::from_millis(self.lease_ms.max(0) as u64),
            },
        }
    }
}

fn decode(row: &Row) -> Result<Seen, tokio_postgres::Error> {
    let attempt: i32 = row.try_get("attempt")?;
    let kind: String = row.try_get("claim_kind")?;
    if row.try_get::<_, bool>("won")? {
        let kind = ClaimKind::parse(&kind).unwrap_or(ClaimKind::New);
        return Ok(Seen::Won { attempt, kind });
    }
    Ok(Seen::Record(View {
        status: row.try_get("status")?,
        same_fingerprint: row.try_get("same_fingerprint")?,
        lease_ms: row.try_get("lease_ms")?,
        expired: row.try_get("expired")?,
        ttl_ms: row.try_get("ttl_ms")?,
        response: decode_response(row)?,
    }))
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
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&id.scope, &id.key, &fingerprint, &id.token, &lease, &ttl];
    for _ in 0..CLAIM_ROUNDS {
        for statement in [&claim, &take] {
            let row = retry_serialization(|| client.query_opt(statement, &params)).await?;
            match row.as_ref().map(decode).transpose()? {
                Some(Seen::Won { attempt, kind }) => return Ok(ClaimResult::Won { attempt, kind }),
                Some(Seen::Record(view)) if !view.claimable() => {
                    return Ok(ClaimResult::Held(view.into_existing()));
                }
                _ => {}
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
        let client = self.client().await?;
        let result = timeout(self.timeout, claim_on(&client, request)).await;
        self.finish(client, result)
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.execute_fenced(HEARTBEAT, id, &[&lease.as_secs_f64()]).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let names: Vec<&str> = response.headers.iter().map(|(n, _)| n.as_str()).collect();
        let values: Vec<&[u8]> = response.headers.iter().map(|(_, v)| v.as_slice()).collect();
        let status = response.status as i16;
        let retained = response.body.is_some();
        let body: Option<&[u8]> = response.body.as_deref();
        self.execute_fenced(COMPLETE, id, &[&status, &names, &values, &body, &retained])
            .await
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.execute_fenced(RELEASE, id, &[]).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, client.simple_query("SELECT 1")).await;
        self.finish(client, result).map(drop)
    }

    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.execute_fenced(RELEASE_STALE, id, &[]).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let limit = i64::from(batch);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&limit];
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(SWEEP).await?;
            retry_serialization(|| client.execute(&statement, &params)).await
        })
        .await;
        self.finish(client, result)
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(FIND).await?;
            client.query(&statement, &[&key, &scope]).await
        })
        .await;
        let rows = self.finish(client, result)?;
        rows.iter()
            .map(|row| record_info(row).map_err(backend)?.ok_or_else(corrupt))
            .collect()
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, client.query_one(STATS, &[])).await;
        let row = self.finish(client, result)?;
        let count = |i: usize| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(i).map_err(backend)?;
            Ok(n.max(0) as u64)
        };
        Ok(RecordStats {
            processing: count(0)?,
            completed: count(1)?,
            failed: count(2)?,
            expired: count(3)?,
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
