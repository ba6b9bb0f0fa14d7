//! The key table behind every decision: the [`Store`] trait, the types that cross it, and [`StoreHandle`],
//! which times and counts every operation. Backends live in `store/`; they decide claims atomically in the
//! database and never by a read followed by a write.

pub mod encrypted;
pub mod postgres;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use uuid::Uuid;

use crate::metrics::{Metrics, StoreOp};

/// A store failure. Whatever the cause, the request path treats it as "the store is unavailable".
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No connection could be had in time, or an operation took longer than `store.timeout`.
    #[error("store operation timed out after {0:?}")]
    Timeout(Duration),
    /// The database answered with an error or the connection broke.
    #[error("store error: {0}")]
    Backend(String),
    /// Migrations could not be applied.
    #[error("migration failed: {0}")]
    Migration(String),
    /// The store answered, but a stored response cannot be decrypted (unknown key id, tampered, or moved
    /// from another record). The reason names no stored bytes.
    #[error("stored response cannot be decrypted: {0}")]
    Undecryptable(String),
}

/// Everything the claim statement needs.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// Identity of the record.
    pub id: RecordId,
    /// SHA-256 of what makes two requests the same.
    pub fingerprint: [u8; 32],
    /// Lease granted to a winning claim.
    pub lease: Duration,
    /// Lifetime of a newly created record.
    pub ttl: Duration,
}

/// Which record, and which claim on it: every write after the claim is fenced by `token`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordId {
    /// Route scope name plus a hash of the client's credentials.
    pub scope: String,
    /// The client's idempotency key.
    pub key: String,
    /// Fencing token of this claim; a fresh one per attempt.
    pub token: Uuid,
}

/// How a winning claim came about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimKind {
    /// No record, or the old one had expired.
    New,
    /// The previous attempt was released (`failed`).
    Retry,
    /// The previous claim's lease ran out while it was `processing`.
    Takeover,
}

impl ClaimKind {
    /// The value stored in the `claim_kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimKind::New => "new",
            ClaimKind::Retry => "retry",
            ClaimKind::Takeover => "takeover",
        }
    }

    /// Parses a stored `claim_kind`.
    pub fn parse(value: &str) -> Option<ClaimKind> {
        match value {
            "new" => Some(ClaimKind::New),
            "retry" => Some(ClaimKind::Retry),
            "takeover" => Some(ClaimKind::Takeover),
            _ => None,
        }
    }
}

/// What the claim statement found.
#[derive(Debug, Clone)]
pub enum ClaimResult {
    /// This request holds the key now and must execute it.
    Won {
        /// 1 for a new record, +1 for each retry or takeover.
        attempt: i32,
        /// How the claim came about.
        kind: ClaimKind,
    },
    /// Another record holds the key and could not be claimed.
    Held(Existing),
}

/// The state of a record this request could not claim, as of the moment the claim was decided.
#[derive(Debug, Clone)]
pub enum Existing {
    /// Completed: replay it if the fingerprint matches.
    Completed {
        /// Whether the stored fingerprint equals the request's.
        same_fingerprint: bool,
        /// The stored response.
        response: StoredResponse,
        /// Time until the record expires, by the store's clock. A completed record changes only by
        /// expiry, so this bounds how long a copy of it stays true.
        expires_in: Duration,
    },
    /// Claimed by a live request (or by one whose outcome is not known yet).
    Processing {
        /// Whether the stored fingerprint equals the request's.
        same_fingerprint: bool,
        /// Time until the lease ends, by the database clock.
        lease_remaining: Duration,
    },
    /// Released, but for another fingerprint.
    Failed,
}

/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code.
    pub status: u16,
    /// End-to-end headers in order, names lower-case.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, or `None` when it was over `max_stored_response` and not retained.
    pub body: Option<Bytes>,
}

/// A database-backed key table.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `request.id` or reports the record that holds it.
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError>;
    /// Extends the lease; `false` when the claim was taken over (fenced out).
    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError>;
    /// Stores the response and marks the record completed; `false` when fenced out.
    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError>;
    /// Marks the record failed so the next retry executes; `false` when fenced out.
    async fn release(&self, id: &RecordId) -> Result<bool, StoreError>;
    /// Succeeds while the store answers.
    async fn ping(&self) -> Result<(), StoreError>;
}

/// The store as the request path uses it: every call timed and counted by operation.
#[derive(Clone)]
pub struct StoreHandle {
    inner: Arc<dyn Store>,
    metrics: Metrics,
}

impl StoreHandle {
    /// Wraps a backend.
    pub fn new(inner: Arc<dyn Store>, metrics: Metrics) -> StoreHandle {
        StoreHandle { inner, metrics }
    }

    /// See [`Store::claim`].
    pub async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        self.measured(StoreOp::Claim, self.inner.claim(request)).await
    }

    /// See [`Store::heartbeat`].
    pub async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.measured(StoreOp::Heartbeat, self.inner.heartbeat(id, lease))
            .await
    }

    /// See [`Store::complete`].
    pub async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        self.measured(StoreOp::Complete, self.inner.complete(id, response))
            .await
    }

    /// See [`Store::release`].
    pub async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, self.inner.release(id)).await
    }

    /// See [`Store::ping`].
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.measured(StoreOp::Ping, self.inner.ping()).await
    }

    async fn measured<T>(
        &self,
        op: StoreOp,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let result = call.await;
        // An undecryptable record is an answer from a working store, counted where it is found.
        let ok = matches!(&result, Ok(_) | Err(StoreError::Undecryptable(_)));
        self.metrics.store_op(op, started.elapsed().as_secs_f64(), ok);
        if let Err(error) = &result {
            tracing::warn!(op = op.as_str(), %error, "store operation failed");
        }
        result
    }
}
