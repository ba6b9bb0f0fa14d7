//! The blocking bridge every SQLite store operation goes through: the one connection behind a mutex, run
//! on tokio's blocking pool (never on the runtime's workers) within `store.timeout`, and the coalescing of
//! the writes (claims and completions) that queue for it into one transaction, sharing its commit.
//! Also the host clock, read once per operation, and the mapping of driver errors to [`StoreError`].
//! Runs on every store operation; touches the connection.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rusqlite::{Connection, TransactionBehavior};
use tokio::time::timeout;

use crate::store::StoreError;
use crate::store::coalesce::{BatchFuture, Coalescer};

/// The connection and the bound on every operation, shared with the batch tasks.
pub(super) struct Shared {
    db: Mutex<Connection>,
    timeout: Duration,
}

impl Shared {
    pub(super) fn new(db: Connection, timeout: Duration) -> Arc<Shared> {
        Arc::new(Shared {
            db: Mutex::new(db),
            timeout,
        })
    }

    /// Runs `op` with the connection and the current time (ms since the epoch) on a blocking thread.
    /// An operation whose caller stopped waiting (`store.timeout`) before it got the connection is not
    /// run at all: a claim nobody waits for would hold its key for a lease, executed by no one.
    pub(super) async fn call<T, F>(self: &Arc<Self>, op: F) -> Result<T, StoreError>
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

/// Operations coalesced into one transaction each time the connection comes free: `run`
/// does every item's work in order inside the transaction that the batch commits.
pub(super) fn batched<I, O, F>(
    conn: &Arc<Shared>,
    max_batch: usize,
    run: F,
) -> Coalescer<I, Result<O, StoreError>>
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

/// Runs blocking work on tokio's blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, StoreError> {
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

/// `duration` in whole milliseconds, the unit of every time column.
pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

pub(super) fn backend(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(crate::error_chain::error_chain(&e))
}
