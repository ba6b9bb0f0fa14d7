//! The embedded key table: one SQLite file serving a single instance, the default store. Runs where the
//! PostgreSQL store does (claim on the request path; heartbeat, complete, release in the forwarding task;
//! sweep in the sweeper), but every call goes to a blocking thread, never to the async runtime's workers.
//! One connection behind a mutex serves the process. A claim is one `BEGIN IMMEDIATE` transaction, which
//! holds SQLite's single write lock, so it is atomic against this process and against any other program
//! on the same file (such as `idemproxy keys`). Claims and completions that arrive while the connection is
//! busy share the next transaction, one after another inside it, and so share its commit: the commit's
//! fsync is what a claim and a completion cost, shared by every write of the batch. The clock is the host's, read once per operation.
//!
//! This file wires the parts into [`SqliteStore`]; each part has one job, its statements beside it:
//! - `open.rs`: the file (created for its owner alone), the instance lock, the connection's settings and
//!   the migrations from `migrations/sqlite`;
//! - `bridge.rs`: the connection on a blocking thread within `store.timeout`, and the coalescing of
//!   writes into one transaction;
//! - `claim.rs`: the claim (CLAIM) and the record that beat it (HOLDER);
//! - `complete.rs`: the completion (COMPLETE);
//! - `fenced.rs`: the holder's other writes and an operator's release, fenced by the claim's token;
//! - `maintenance.rs`: the sweeper's SWEEP and the operator tools' FIND, LIST, STATS and FORGET;
//! - `rows.rs`: what those statements' rows mean in the store's types.

mod bridge;
mod claim;
mod complete;
mod fenced;
mod maintenance;
mod open;
mod rows;

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::coalesce::{Coalescer, unanswered};
use super::{
    ClaimRequest, ClaimResult, Lifecycle, ListPage, ListQuery, RecordId, RecordInfo, RecordStats, StoreError,
    StoredResponse, Upkeep,
};
use bridge::{Shared, backend, batched, blocking};
use complete::EncodedResponse;

pub use open::Access;

/// The SQLite-backed [`Store`].
pub struct SqliteStore {
    conn: Arc<Shared>,
    /// Claims and completions, in one lane: whichever queue together share a transaction and its commit.
    writes: Coalescer<Write, Result<Written, StoreError>>,
    /// Held while serving: a second proxy on the same file is refused instead of sharing it.
    _instance: Option<File>,
}

impl SqliteStore {
    /// Opens (and for `Serve` and `Migrate`, creates) the database file. `timeout` bounds every operation,
    /// including waiting for another program's write lock on the file.
    /// Claims and completions that queue for the connection are committed together, up to `max_batch`
    /// at a time.
    pub async fn open(
        path: &Path,
        timeout: Duration,
        max_batch: usize,
        access: Access,
    ) -> Result<SqliteStore, StoreError> {
        let path = path.to_path_buf();
        let (db, instance) = blocking(move || open::open(&path, timeout, access)).await??;
        let conn = Shared::new(db, timeout);
        Ok(SqliteStore {
            writes: batched(&conn, max_batch, write_in),
            conn,
            _instance: instance,
        })
    }

    async fn write(&self, write: Write) -> Result<Written, StoreError> {
        self.writes
            .submit(write)
            .await
            .unwrap_or_else(|| Err(unanswered()))
    }

    /// Applies pending migrations and reports how many were applied.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        self.conn.call(|db, _| open::migrate(db)).await
    }
}

/// A write for the lane: a keyed request needs a claim and later a completion, so with one lane the
/// claims of new requests share a commit (and its fsync) with the completions of finished ones.
enum Write {
    Claim(ClaimRequest),
    Complete(RecordId, EncodedResponse),
}

/// A write's answer, of its own kind.
enum Written {
    Claim(ClaimResult),
    Complete(bool),
}

/// One write, inside the batch's transaction, in the order the writes queued.
fn write_in(tx: &rusqlite::Connection, now: i64, write: &Write) -> rusqlite::Result<Written> {
    match write {
        Write::Claim(request) => claim::claim_in(tx, now, request).map(Written::Claim),
        Write::Complete(id, response) => complete::complete_in(tx, now, id, response).map(Written::Complete),
    }
}

/// A batch answered a write with the other kind's answer: cannot happen, as `write_in` answers each
/// write in kind.
fn mismatched() -> StoreError {
    StoreError::Backend("the SQLite write lane answered a write with another kind's answer".into())
}

#[async_trait::async_trait]
impl Lifecycle for SqliteStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        match self.write(Write::Claim(request.clone())).await? {
            Written::Claim(result) => Ok(result),
            Written::Complete(_) => Err(mismatched()),
        }
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        fenced::heartbeat(&self.conn, id, lease).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let completion = Write::Complete(id.clone(), EncodedResponse::new(response));
        match self.write(completion).await? {
            Written::Complete(stored) => Ok(stored),
            Written::Claim(_) => Err(mismatched()),
        }
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        fenced::release(&self.conn, id).await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        fenced::hold(&self.conn, id).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.conn
            .call(|db, _| db.query_row("SELECT 1", [], |_| Ok(())).map_err(backend))
            .await
    }
}

#[async_trait::async_trait]
impl Upkeep for SqliteStore {
    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        fenced::release_stale(&self.conn, id).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        maintenance::sweep(&self.conn, batch).await
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        maintenance::find(&self.conn, key, scope).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        maintenance::list(&self.conn, query).await
    }

    async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        maintenance::forget(&self.conn, id).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        maintenance::stats(&self.conn).await
    }
}
