//! The embedded key table: one SQLite file serving a single instance, the default store. Runs where the
//! PostgreSQL store does (claim on the request path; heartbeat, complete, release in the forwarding task;
//! sweep in the sweeper), but every call goes to a blocking thread, never to the async runtime's workers.
//! One connection behind a mutex serves the process. A claim is one `BEGIN IMMEDIATE` transaction, which
//! holds SQLite's single write lock, so it is atomic against this process and against any other program
//! on the same file (such as `idemproxy keys`). Claims that arrive while the connection is busy share the
//! next transaction, one after another inside it, and so share its commit (completions likewise): the
//! commit's fsync is what a claim costs. The clock is the host's, read once per operation.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rusqlite::{Connection, OpenFlags, OptionalExtension, Row, TransactionBehavior, params};
use tokio::time::timeout;
use uuid::Uuid;

use super::blob::{decode_headers, encode_headers};
use super::coalesce::{BatchFuture, Coalescer, unanswered};
use super::{
    ClaimKind, ClaimRequest, ClaimResult, Existing, ListPage, ListQuery, RecordId, RecordInfo, RecordStats,
    RecordStatus, ScopeFilter, Store, StoreError, StoredResponse, epoch_ms, page, sql_start,
};

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

/// Where refinery records applied migrations.
const MIGRATION_TABLE: &str = "idemproxy_schema_history";

/// The claim, decided by the primary key: a new key is inserted; an existing one is taken only when it is
/// claimable (expired and not running under a live lease; or, for the same fingerprint, released or past
/// its lease), all in one statement. A takeover or retry keeps the expiry at least as late as its lease.
/// `RETURNING` yields a row only when this claim won. `?5` is now, `?6` the lease end, `?7` the expiry.
const CLAIM: &str = "INSERT INTO records AS r
        (scope, key, fingerprint, status, token, attempt, claim_kind,
         locked_until, created_at, expires_at, updated_at)
    VALUES (?1, ?2, ?3, 'processing', ?4, 1, 'new', ?6, ?5, ?7, ?5)
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = excluded.fingerprint,
        status = 'processing',
        token = excluded.token,
        attempt = CASE WHEN r.expires_at <= ?5 THEN 1 ELSE r.attempt + 1 END,
        claim_kind = CASE WHEN r.expires_at <= ?5 THEN 'new'
                          WHEN r.status = 'failed' THEN 'retry'
                          ELSE 'takeover' END,
        locked_until = excluded.locked_until,
        created_at = CASE WHEN r.expires_at <= ?5 THEN ?5 ELSE r.created_at END,
        expires_at = CASE WHEN r.expires_at <= ?5 THEN excluded.expires_at
                          ELSE max(r.expires_at, excluded.locked_until) END,
        updated_at = ?5,
        response_status = NULL,
        response_headers = NULL,
        response_body = NULL,
        body_retained = NULL
    WHERE (r.expires_at <= ?5 AND NOT (r.status = 'processing' AND r.locked_until > ?5))
       OR (r.fingerprint = excluded.fingerprint
           AND (r.status = 'failed' OR (r.status = 'processing' AND r.locked_until <= ?5)))
    RETURNING attempt, claim_kind";

/// The record a claim did not win, read in the claim's own transaction.
const HOLDER: &str = "SELECT status, fingerprint, token, locked_until, expires_at,
        response_status, response_headers, response_body, body_retained
    FROM records WHERE scope = ?1 AND key = ?2";

/// Extends the lease, and the expiry with it so a running key never expires. Fenced: only the holder of
/// the current token can.
const HEARTBEAT: &str = "UPDATE records
    SET locked_until = ?4, expires_at = max(expires_at, ?4), updated_at = ?5
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND status = 'processing'";

/// Stores the response. Fenced: a slow original whose claim was taken over matches no row.
const COMPLETE: &str = "UPDATE records
    SET status = 'completed', locked_until = ?4, updated_at = ?4, response_status = ?5,
        response_headers = ?6, response_body = ?7, body_retained = ?8
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

/// What a store is opened for; only `Serve` claims the file for this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The proxy: creates the file if needed and holds the instance lock while it runs.
    Serve,
    /// `migrate`: creates the file if needed.
    Migrate,
    /// Operator tools (`keys`): the file must exist; runs beside a serving proxy.
    Tool,
}

/// The SQLite-backed [`Store`].
pub struct SqliteStore {
    conn: Arc<Shared>,
    claims: Coalescer<ClaimRequest, Result<ClaimResult, StoreError>>,
    completions: Coalescer<(RecordId, EncodedResponse), Result<bool, StoreError>>,
    /// Held while serving: a second proxy on the same file is refused instead of sharing it.
    _instance: Option<File>,
}

/// The connection and the bound on every operation, shared with the batch tasks.
struct Shared {
    db: Mutex<Connection>,
    timeout: Duration,
}

impl Shared {
    /// Runs `op` with the connection and the current time (ms since the epoch) on a blocking thread.
    /// An operation whose caller stopped waiting (`store.timeout`) before it got the connection is not
    /// run at all: a claim nobody waits for would hold its key for a lease, executed by no one.
    async fn call<T, F>(self: &Arc<Self>, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, i64) -> Result<T, StoreError> + Send + 'static,
    {
        self.call_watched(move |db, now, _| op(db, now)).await
    }

    /// [`Shared::call`], with `op` told whether its caller has stopped waiting, so that an operation
    /// that waited for another program's write lock can give up instead of committing for no one.
    async fn call_watched<T, F>(self: &Arc<Self>, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, i64, &AtomicBool) -> Result<T, StoreError> + Send + 'static,
    {
        let shared = Arc::clone(self);
        let abandoned = Arc::new(AtomicBool::new(false));
        let given_up = Arc::clone(&abandoned);
        let task = blocking(move || {
            let mut db = shared.db.lock().unwrap_or_else(PoisonError::into_inner);
            if given_up.load(Ordering::Acquire) {
                return Err(StoreError::Timeout(shared.timeout));
            }
            op(&mut db, now_ms(), &given_up)
        });
        match timeout(self.timeout, task).await {
            Ok(result) => result?,
            Err(_) => {
                abandoned.store(true, Ordering::Release);
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }
}

/// Operations of one kind coalesced into one transaction each time the connection comes free: `run`
/// does every item's work in order inside the transaction that the batch commits.
fn batched<I, O, F>(conn: &Arc<Shared>, max_batch: usize, run: F) -> Coalescer<I, Result<O, StoreError>>
where
    I: Send + 'static,
    O: Send + 'static,
    F: Fn(&Connection, i64, &I) -> rusqlite::Result<O> + Copy + Send + Sync + 'static,
{
    let conn = Arc::clone(conn);
    Coalescer::new(max_batch, 1, move |items: Vec<I>| {
        let conn = Arc::clone(&conn);
        Box::pin(async move {
            let n = items.len();
            let timeout = StoreError::Timeout(conn.timeout);
            let done = conn
                .call_watched(move |db, _, given_up| {
                    in_one_transaction(db, &items, given_up, run)?.ok_or(timeout)
                })
                .await;
            match done {
                Ok(outputs) => outputs.into_iter().map(Ok).collect(),
                Err(error) => (0..n).map(|_| Err(error.clone())).collect(),
            }
        }) as BatchFuture<_>
    })
}

/// Runs every item in one transaction, once the write lock is had; `None` (nothing done) when the caller
/// stopped waiting meanwhile. The time is read once the lock is had, so leases and expiries start when
/// the claims are decided, not before a wait for another program's lock.
fn in_one_transaction<I, O>(
    db: &mut Connection,
    items: &[I],
    given_up: &AtomicBool,
    run: impl Fn(&Connection, i64, &I) -> rusqlite::Result<O>,
) -> Result<Option<Vec<O>>, StoreError> {
    let tx = db
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(backend)?;
    if given_up.load(Ordering::Acquire) {
        return Ok(None);
    }
    let now = now_ms();
    let outputs = items
        .iter()
        .map(|item| run(&tx, now, item))
        .collect::<rusqlite::Result<_>>()
        .map_err(backend)?;
    tx.commit().map_err(backend)?;
    Ok(Some(outputs))
}

impl SqliteStore {
    /// Opens (and for `Serve` and `Migrate`, creates) the database file. `timeout` bounds every operation,
    /// including waiting for another program's write lock on the file.
    /// Claims (and, apart, completions) that queue for the connection are committed together, up to
    /// `max_batch` at a time.
    pub async fn open(
        path: &Path,
        timeout: Duration,
        max_batch: usize,
        access: Access,
    ) -> Result<SqliteStore, StoreError> {
        let path = path.to_path_buf();
        let (db, instance) = blocking(move || open_blocking(&path, timeout, access)).await??;
        let conn = Arc::new(Shared {
            db: Mutex::new(db),
            timeout,
        });
        Ok(SqliteStore {
            claims: batched(&conn, max_batch, claim_in),
            completions: batched(&conn, max_batch, complete_in),
            conn,
            _instance: instance,
        })
    }

    /// Applies pending migrations and reports how many were applied.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        self.call(|db, _| {
            let report = embedded::migrations::runner()
                .set_migration_table_name(MIGRATION_TABLE)
                .run(db)
                .map_err(|e| StoreError::Migration(e.to_string()))?;
            Ok(report.applied_migrations().len())
        })
        .await
    }

    async fn call<T, F>(&self, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection, i64) -> Result<T, StoreError> + Send + 'static,
    {
        self.conn.call(op).await
    }

    /// A fenced single-row update: `?1..?3` identify the claim, `?4` is now, then `extra`.
    async fn fenced(&self, sql: &'static str, id: &RecordId, extra: Extra) -> Result<bool, StoreError> {
        let (scope, key, token) = (id.scope.clone(), id.key.clone(), id.token);
        self.call(move |db, now| {
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
}

/// The parameters a fenced update takes after the claim's identity and the time.
enum Extra {
    None,
    /// A lease, in milliseconds.
    Lease(i64),
}

/// A response in the columns' form.
struct EncodedResponse {
    status: i64,
    headers: Vec<u8>,
    body: Option<Vec<u8>>,
    retained: bool,
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        self.claims
            .submit(request.clone())
            .await
            .unwrap_or_else(|| Err(unanswered()))
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.fenced(HEARTBEAT, id, Extra::Lease(millis(lease))).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let encoded = EncodedResponse {
            status: i64::from(response.status),
            headers: encode_headers(&response.headers),
            body: response.body.as_ref().map(|body| body.to_vec()),
            retained: response.body.is_some(),
        };
        self.completions
            .submit((id.clone(), encoded))
            .await
            .unwrap_or_else(|| Err(unanswered()))
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.fenced(RELEASE, id, Extra::None).await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.fenced(HOLD, id, Extra::None).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(|db, _| db.query_row("SELECT 1", [], |_| Ok(())).map_err(backend))
            .await
    }

    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.fenced(RELEASE_STALE, id, Extra::None).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.call(move |db, now| {
            let mut statement = db.prepare_cached(SWEEP).map_err(backend)?;
            let deleted = statement
                .execute(params![now, i64::from(batch)])
                .map_err(backend)?;
            Ok(deleted as u64)
        })
        .await
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        let (key, scope) = (key.to_owned(), scope.map(str::to_owned));
        self.call(move |db, now| {
            let mut statement = db.prepare_cached(FIND).map_err(backend)?;
            let rows = statement
                .query_map(params![key, scope], |row| record_info(row, now))
                .map_err(backend)?;
            rows.map(|row| row.map_err(backend)).collect()
        })
        .await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let (from_scope, from_key) = sql_start(query)?;
        let sql = match query.scope {
            ScopeFilter::Exact(_) => LIST_IN_SCOPE,
            ScopeFilter::All | ScopeFilter::Named(_) => LIST,
        };
        let examine = i64::from(query.examine);
        let records = self
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

    async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        let (scope, key, token) = (id.scope.clone(), id.key.clone(), id.token);
        self.call(move |db, _| {
            let mut statement = db.prepare_cached(FORGET).map_err(backend)?;
            let deleted = statement
                .execute(params![scope, key, token.as_bytes().as_slice()])
                .map_err(backend)?;
            Ok(deleted == 1)
        })
        .await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.call(|db, now| {
            let count =
                |row: &Row, i: usize| -> rusqlite::Result<u64> { Ok(row.get::<_, i64>(i)?.max(0) as u64) };
            db.query_row(STATS, params![now], |row| {
                Ok(RecordStats {
                    processing: count(row, 0)?,
                    completed: count(row, 1)?,
                    failed: count(row, 2)?,
                    unknown: count(row, 3)?,
                    expired: count(row, 4)?,
                })
            })
            .map_err(backend)
        })
        .await
    }
}

fn open_blocking(
    path: &Path,
    timeout: Duration,
    access: Access,
) -> Result<(Connection, Option<File>), StoreError> {
    let instance = match access {
        Access::Serve => Some(lock_instance(path)?),
        Access::Migrate | Access::Tool => None,
    };
    if access == Access::Tool && !path.exists() {
        return Err(StoreError::Backend(format!(
            "no SQLite store at {}: check store.url (or --store), or start the proxy once to create it",
            path.display()
        )));
    }
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if access != Access::Tool {
        create_private(path).map_err(|e| {
            StoreError::Backend(format!("cannot create SQLite store {}: {e}", path.display()))
        })?;
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let db = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::Backend(format!("cannot open SQLite store {}: {e}", path.display())))?;
    configure(&db, timeout).map_err(backend)?;
    Ok((db, instance))
}

/// Creates the database file for its owner alone (mode 0600 on Unix), since stored responses may hold
/// personal data; SQLite gives the `-wal` and `-shm` files it creates beside it the same mode. A file
/// that exists keeps the mode its operator gave it.
fn create_private(path: &Path) -> std::io::Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    match owner_only(&mut options).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Files these options create are readable and writable by their owner only.
#[cfg(unix)]
fn owner_only(options: &mut OpenOptions) -> &mut OpenOptions {
    std::os::unix::fs::OpenOptionsExt::mode(options, 0o600)
}

/// Elsewhere, files get the platform's default permissions.
#[cfg(not(unix))]
fn owner_only(options: &mut OpenOptions) -> &mut OpenOptions {
    options
}

/// WAL lets operator tools read while the proxy writes; `synchronous = FULL` makes every committed claim
/// and completion durable before it is acted on, even across power loss.
fn configure(db: &Connection, timeout: Duration) -> rusqlite::Result<()> {
    db.busy_timeout(timeout)?;
    db.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
    db.pragma_update(None, "synchronous", "FULL")?;
    Ok(())
}

/// Takes an exclusive lock on `<file>.lock` for as long as the returned file is open. The operating
/// system drops it when the process ends, however it ends, so a crashed proxy never blocks its restart.
fn lock_instance(path: &Path) -> Result<File, StoreError> {
    let lock_path = lock_path(path);
    let file = owner_only(OpenOptions::new().create(true).truncate(false).write(true))
        .open(&lock_path)
        .map_err(|e| StoreError::Backend(format!("cannot open lock file {}: {e}", lock_path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::InUse(path.to_path_buf())),
        Err(TryLockError::Error(e)) => Err(StoreError::Backend(format!(
            "cannot lock {}: {e}",
            lock_path.display()
        ))),
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// One claim, inside the batch's transaction.
fn claim_in(tx: &Connection, now: i64, request: &ClaimRequest) -> rusqlite::Result<ClaimResult> {
    let id = &request.id;
    let won = tx
        .prepare_cached(CLAIM)?
        .query_row(
            params![
                id.scope,
                id.key,
                request.fingerprint.as_slice(),
                id.token.as_bytes().as_slice(),
                now,
                now.saturating_add(millis(request.lease)),
                now.saturating_add(millis(request.ttl)),
            ],
            |row| Ok((row.get::<_, i32>(0)?, row.get::<_, String>(1)?)),
        )
        .optional()?;
    let result = match won {
        Some((attempt, kind)) => ClaimResult::Won {
            attempt,
            kind: ClaimKind::parse(&kind).unwrap_or(ClaimKind::New),
        },
        None => ClaimResult::Held(holder(tx, now, request)?),
    };
    Ok(result)
}

/// One completion, inside the batch's transaction; fenced by the token.
fn complete_in(tx: &Connection, now: i64, (id, r): &(RecordId, EncodedResponse)) -> rusqlite::Result<bool> {
    let token = id.token.as_bytes().as_slice();
    let changed = tx.prepare_cached(COMPLETE)?.execute(params![
        id.scope, id.key, token, now, r.status, r.headers, r.body, r.retained
    ])?;
    Ok(changed == 1)
}

/// The record that holds the key; it exists, or the claim would have inserted it.
fn holder(db: &Connection, now: i64, request: &ClaimRequest) -> rusqlite::Result<Existing> {
    let mut statement = db.prepare_cached(HOLDER)?;
    statement.query_row(params![request.id.scope, request.id.key], |row| {
        let same_fingerprint = row.get::<_, Vec<u8>>("fingerprint")? == request.fingerprint;
        let status: String = row.get("status")?;
        let remaining = |column: &str| -> rusqlite::Result<Duration> {
            let until: i64 = row.get(column)?;
            Ok(Duration::from_millis(until.saturating_sub(now).max(0) as u64))
        };
        Ok(match (status.as_str(), stored_response(row)?) {
            ("completed", Some(response)) => Existing::Completed {
                same_fingerprint,
                response,
                expires_in: remaining("expires_at")?,
                token: token(row)?,
            },
            ("failed", _) => Existing::Failed,
            ("unknown", _) => Existing::Unknown { same_fingerprint },
            _ => Existing::Processing {
                same_fingerprint,
                lease_remaining: remaining("locked_until")?,
            },
        })
    })
}

fn token(row: &Row) -> rusqlite::Result<Uuid> {
    Uuid::from_slice(&row.get::<_, Vec<u8>>("token")?).map_err(|_| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Blob,
            "a stored token is not 16 bytes".into(),
        )
    })
}

fn stored_response(row: &Row) -> rusqlite::Result<Option<StoredResponse>> {
    let Some(status) = row.get::<_, Option<i64>>("response_status")? else {
        return Ok(None);
    };
    let headers = row
        .get::<_, Option<Vec<u8>>>("response_headers")?
        .unwrap_or_default();
    let headers = decode_headers(&headers).ok_or_else(|| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Blob,
            "stored response headers are malformed".into(),
        )
    })?;
    let retained = row.get::<_, Option<bool>>("body_retained")?.unwrap_or(false);
    let body = row.get::<_, Option<Vec<u8>>>("response_body")?;
    Ok(Some(StoredResponse {
        status: u16::try_from(status).unwrap_or(500),
        headers,
        body: retained.then(|| Bytes::from(body.unwrap_or_default())),
    }))
}

fn record_info(row: &Row, now: i64) -> rusqlite::Result<RecordInfo> {
    let unknown = |what: &str| {
        rusqlite::Error::FromSqlConversionFailure(
            0,
            rusqlite::types::Type::Text,
            format!("unknown {what} in the store").into(),
        )
    };
    let status = RecordStatus::parse(&row.get::<_, String>("status")?).ok_or_else(|| unknown("status"))?;
    let claim_kind =
        ClaimKind::parse(&row.get::<_, String>("claim_kind")?).ok_or_else(|| unknown("claim kind"))?;
    let token = Uuid::from_slice(&row.get::<_, Vec<u8>>("token")?).map_err(|_| unknown("token"))?;
    let at = |column: &str| -> rusqlite::Result<SystemTime> { Ok(epoch_ms(row.get(column)?)) };
    Ok(RecordInfo {
        scope: row.get("scope")?,
        key: row.get("key")?,
        status,
        attempt: row.get("attempt")?,
        claim_kind,
        token,
        created_at: at("created_at")?,
        updated_at: at("updated_at")?,
        expires_at: at("expires_at")?,
        locked_until: at("locked_until")?,
        observed_at: epoch_ms(now),
        response_status: row
            .get::<_, Option<i64>>("response_status")?
            .and_then(|s| u16::try_from(s).ok()),
        response_bytes: row.get::<_, Option<i64>>("body_bytes")?.map(|n| n.max(0) as u64),
        body_retained: row.get("body_retained")?,
    })
}

/// Runs blocking work on tokio's blocking pool.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| StoreError::Backend(format!("store task failed: {e}")))
}

fn now_ms() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    millis(since_epoch)
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn backend(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(crate::error_chain::error_chain(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_file_sits_beside_the_database() {
        assert_eq!(
            lock_path(Path::new("/var/lib/k.db")),
            Path::new("/var/lib/k.db.lock")
        );
    }
}
