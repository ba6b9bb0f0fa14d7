//! The store as the request path, the sweeper and the operator's tools use it: [`StoreHandle`] times
//! and counts every operation in one place (`idemproxy_store_duration_seconds{op}`), in front of the
//! backend, which it may not have yet while `serve` waits for its server.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::{
    ClaimRequest, ClaimResult, ListPage, ListQuery, RecordId, RecordInfo, RecordStats, Store, StoreError,
    StoredResponse,
};
use crate::metrics::{Metrics, StoreOp};

/// The store as the request path uses it: every call timed and counted by operation. It may start
/// unopened (`serve`, while its store cannot be reached yet): every call then fails at once with
/// [`StoreError::NotOpen`], counted as a failure of its operation, until the store is installed.
#[derive(Clone)]
pub struct StoreHandle {
    inner: Arc<OnceLock<Arc<dyn Store>>>,
    /// A worker thread's handle: its own copy of the store (`Lifecycle::for_worker`), made from the
    /// shared one at the first call after the store is open.
    own: Option<Arc<OnceLock<Arc<dyn Store>>>>,
    metrics: Metrics,
}

impl StoreHandle {
    /// Wraps an open backend.
    pub fn new(inner: Arc<dyn Store>, metrics: Metrics) -> StoreHandle {
        StoreHandle {
            inner: Arc::new(OnceLock::from(inner)),
            own: None,
            metrics,
        }
    }

    /// A handle whose store is not open yet.
    pub(super) fn unopened(metrics: Metrics) -> StoreHandle {
        StoreHandle {
            inner: Arc::new(OnceLock::new()),
            own: None,
            metrics,
        }
    }

    /// Puts the opened store behind every clone of this handle; a handle is opened once.
    pub(super) fn install(&self, store: Arc<dyn Store>) {
        if self.inner.set(store).is_err() {
            tracing::error!("the store was opened twice; the first stays");
        }
    }

    /// The handle for one worker thread: the same store, over that thread's own connections where the
    /// store has them (made at the first call on the thread, so they belong to its runtime).
    pub fn for_worker(&self) -> StoreHandle {
        StoreHandle {
            inner: self.inner.clone(),
            own: Some(Arc::new(OnceLock::new())),
            metrics: self.metrics.clone(),
        }
    }

    /// Whether the store is open (it may still fail to answer).
    pub fn is_open(&self) -> bool {
        self.inner.get().is_some()
    }

    /// See [`Lifecycle::claim`](super::Lifecycle::claim).
    pub async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        self.measured(StoreOp::Claim, async { self.store()?.claim(request).await })
            .await
    }

    /// See [`Lifecycle::heartbeat`](super::Lifecycle::heartbeat).
    pub async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.measured(StoreOp::Heartbeat, async {
            self.store()?.heartbeat(id, lease).await
        })
        .await
    }

    /// See [`Lifecycle::complete`](super::Lifecycle::complete).
    pub async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        self.measured(StoreOp::Complete, async {
            self.store()?.complete(id, response).await
        })
        .await
    }

    /// See [`Lifecycle::release`](super::Lifecycle::release).
    pub async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.release(id).await })
            .await
    }

    /// See [`Lifecycle::hold`](super::Lifecycle::hold).
    pub async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Hold, async { self.store()?.hold(id).await })
            .await
    }

    /// See [`Lifecycle::ping`](super::Lifecycle::ping).
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.measured(StoreOp::Ping, async { self.store()?.ping().await })
            .await
    }

    /// See [`Upkeep::release_stale`](super::Upkeep::release_stale).
    pub async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.release_stale(id).await })
            .await
    }

    /// See [`Upkeep::sweep`](super::Upkeep::sweep).
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.measured(StoreOp::Sweep, async { self.store()?.sweep(batch).await })
            .await
    }

    /// See [`Upkeep::find`](super::Upkeep::find).
    pub async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        self.measured(StoreOp::Find, async { self.store()?.find(key, scope).await })
            .await
    }

    /// See [`Upkeep::stats`](super::Upkeep::stats).
    pub async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.measured(StoreOp::Stats, async { self.store()?.stats().await })
            .await
    }

    /// See [`Upkeep::list`](super::Upkeep::list).
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.measured(StoreOp::Find, async { self.store()?.list(query).await })
            .await
    }

    /// See [`Upkeep::forget`](super::Upkeep::forget).
    pub async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.forget(id).await })
            .await
    }

    /// See [`Lifecycle::announce`](super::Lifecycle::announce).
    pub async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        self.measured(StoreOp::Notify, async {
            self.store()?.announce(announcement).await
        })
        .await
    }

    fn store(&self) -> Result<&Arc<dyn Store>, StoreError> {
        let shared = self.inner.get().ok_or(StoreError::NotOpen)?;
        Ok(match &self.own {
            Some(own) => own.get_or_init(|| shared.for_worker().unwrap_or_else(|| shared.clone())),
            None => shared,
        })
    }

    /// Times and counts `call`. A call on an unopened store is counted as a failure like any other (the
    /// store-unavailable alert reads these counts), but logged only at debug: the task opening the store
    /// logs each attempt's cause once.
    async fn measured<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = call.await;
        let elapsed = started.elapsed();
        crate::access::store_op(elapsed);
        // An undecryptable record is an answer from a working store, counted where it is found.
        let ok = matches!(&result, Ok(_) | Err(StoreError::Undecryptable(_)));
        self.metrics.store_op(op, elapsed.as_secs_f64(), ok);
        match &result {
            Err(StoreError::NotOpen) => tracing::debug!(op = op.as_str(), "store not open yet"),
            Err(error) => tracing::warn!(op = op.as_str(), %error, "store operation failed"),
            Ok(_) => {}
        }
        result
    }
}
