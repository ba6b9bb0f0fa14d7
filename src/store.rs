//! The key table behind every decision: the [`Store`] trait, the types that cross it, and [`StoreHandle`],
//! which times and counts every operation. Backends live in `store/`; they decide claims atomically in the
//! database and never by a read followed by a write. `store/open.rs` opens them (`serve`'s store waits
//! out a server that cannot be reached yet; the handle answers [`StoreError::NotOpen`] until then).

mod blob;
mod coalesce;
pub mod encrypted;
mod handle;
mod list;
pub(crate) mod listen;
mod open;
pub mod postgres;
pub mod redis;
pub mod sqlite;
pub mod sweeper;
pub mod wake;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use uuid::Uuid;

use crate::config::RedisTarget;

pub use handle::StoreHandle;
pub use list::{ListPage, ListQuery, ScopeFilter};
pub(crate) use list::{bad_cursor, page, sql_start};
pub use open::{Purpose, Serving, migrate, open, serve};

/// A store failure. Whatever the cause, the request path treats it as "the store is unavailable".
#[derive(Debug, Clone, thiserror::Error)]
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
    /// The embedded store's file is being served by another running proxy.
    #[error(
        "the SQLite store {} is in use by another running idemproxy; the embedded store serves a single \
         instance, so several replicas need PostgreSQL (store.url = \"postgres://...\")",
        .0.display()
    )]
    InUse(PathBuf),
    /// `serve` has not opened the store yet: its server could not be reached, or its migrations are not
    /// applied yet (`store/open.rs` keeps trying and logs why).
    #[error("the store is not open yet")]
    NotOpen,
}

/// What the configured store does beside claims, returned with it by [`serve`] (and known from the
/// configuration before it opens), so that nothing above `store/` asks which backend it is.
#[derive(Debug, Clone)]
pub struct Capabilities {
    /// Several replicas share it (PostgreSQL, Redis): settlements on wait routes are announced to the
    /// others, and a listener hears theirs.
    pub shared: bool,
    /// It deletes expired records itself (Redis, by each record's TTL): no sweeper runs.
    pub self_expiring: bool,
    /// How this process hears the other replicas' settlements: `None` on a store no other replica
    /// shares.
    pub listener: Option<WaitListener>,
}

/// The wait listener of a shared store: [`WaitListener::run`] hears other replicas' announcements and
/// wakes this process's waiters (`store/listen.rs` keeps it listening).
#[derive(Debug, Clone)]
pub struct WaitListener(Listens);

/// Which backend's listener it is.
#[derive(Debug, Clone)]
enum Listens {
    /// LISTEN on PostgreSQL.
    Postgres,
    /// SUBSCRIBE on a Redis server or cluster.
    Redis(RedisTarget),
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

impl RecordId {
    /// The record's name in logs: [`key_hash`] of its scope and key. Keys never appear in a log line.
    pub fn key_hash(&self) -> String {
        key_hash(&self.scope, &self.key)
    }
}

/// A short name for a record in logs and the access log: the first 8 bytes of a SHA-256 over its scope
/// and key (each with its length first), in hex. Lines about one key can be matched up without the key
/// itself (which may be guessable or carry data) ever being written.
pub fn key_hash(scope: &str, key: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    for field in [scope, key] {
        hash.update((field.len() as u64).to_be_bytes());
        hash.update(field.as_bytes());
    }
    hex::encode(&hash.finalize()[..8])
}

/// How a winning claim came about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
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
        /// Time until the record expires as this claim left it, by the store's clock, measured when the
        /// claim was decided and rounded up to the millisecond at most: a new key's `ttl`; for a retry
        /// or a takeover, the expiry the record already had, moved to the new lease's end if that is
        /// later (a running key never expires).
        expires_in: Duration,
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
        /// The token of the claim that completed it: the record's epoch, which changes with every
        /// claim, so a stored response can be bound to the one completion that wrote it.
        token: Uuid,
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
    /// Held (`on_unknown_outcome = "hold"`): its request may have been executed; never forwarded again
    /// until an operator releases it.
    Unknown {
        /// Whether the stored fingerprint equals the request's.
        same_fingerprint: bool,
    },
}

/// The name prefix of a stored entry that is a trailer (the rest of the name), sent after the body. No
/// HTTP field name has a `:`, so no header is taken for one; a build from before trailers were stored
/// leaves such entries out of its replays, as it does any name that is not HTTP.
pub const TRAILER_PREFIX: &str = ":trailer:";
/// A response as stored for replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code.
    pub status: u16,
    /// End-to-end headers in order, names lower-case; then the trailers, if the response had any, each
    /// name prefixed with [`TRAILER_PREFIX`].
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, or `None` when it was over `max_stored_response` and not retained.
    pub body: Option<Bytes>,
}

/// A record's state as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RecordStatus {
    /// Claimed; the request is executing (or its outcome is not known yet).
    Processing,
    /// The response is stored and replayed to retries.
    Completed,
    /// Released: the next retry executes.
    Failed,
    /// Held: the request may have been executed (the upstream failed before answering in full); retries
    /// are refused until an operator releases it.
    Unknown,
}

impl RecordStatus {
    /// The value stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordStatus::Processing => "processing",
            RecordStatus::Completed => "completed",
            RecordStatus::Failed => "failed",
            RecordStatus::Unknown => "unknown",
        }
    }

    /// Parses a stored `status`.
    pub fn parse(value: &str) -> Option<RecordStatus> {
        match value {
            "processing" => Some(RecordStatus::Processing),
            "completed" => Some(RecordStatus::Completed),
            "failed" => Some(RecordStatus::Failed),
            "unknown" => Some(RecordStatus::Unknown),
            _ => None,
        }
    }
}

/// A record as an operator sees it (`idemproxy keys show`). Holds no request data: credentials only
/// ever reach the store hashed into the scope, and the stored body is described by its size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RecordInfo {
    /// Route scope name plus a hash of the client's credentials.
    pub scope: String,
    /// The client's idempotency key.
    pub key: String,
    /// Where the record is in its lifecycle.
    pub status: RecordStatus,
    /// 1 for a new record, +1 for each retry or takeover.
    pub attempt: i32,
    /// How the current claim came about.
    pub claim_kind: ClaimKind,
    /// Fencing token of the current claim.
    pub token: Uuid,
    /// When the record was created.
    #[serde(with = "humantime_serde")]
    pub created_at: SystemTime,
    /// When the record was last written.
    #[serde(with = "humantime_serde")]
    pub updated_at: SystemTime,
    /// When the record expires and becomes claimable as new.
    #[serde(with = "humantime_serde")]
    pub expires_at: SystemTime,
    /// When the current claim's lease ends (for a processing record).
    #[serde(with = "humantime_serde")]
    pub locked_until: SystemTime,
    /// The store's clock when the record was read; compare the times above with this.
    #[serde(with = "humantime_serde")]
    pub observed_at: SystemTime,
    /// The stored response's status code, once completed.
    pub response_status: Option<u16>,
    /// The stored response body's size in bytes, when it was retained.
    pub response_bytes: Option<u64>,
    /// Whether the response body was kept (false: it was over `max_stored_response`).
    pub body_retained: Option<bool>,
}

impl RecordInfo {
    /// Whether the record has expired (it is claimable as new and the sweeper may delete it).
    pub fn expired(&self) -> bool {
        self.expires_at <= self.observed_at
    }

    /// Where the record is in its lifecycle, expiry first.
    pub fn state(&self) -> RecordState {
        if self.expired() {
            return RecordState::Expired;
        }
        match self.status {
            RecordStatus::Processing if self.lease_remaining().is_some() => RecordState::InFlight,
            RecordStatus::Processing => RecordState::Stale,
            RecordStatus::Completed => RecordState::Completed,
            RecordStatus::Failed => RecordState::Released,
            RecordStatus::Unknown => RecordState::Held,
        }
    }

    /// Time left on the current claim's lease, if it is a processing record whose lease is live.
    pub fn lease_remaining(&self) -> Option<Duration> {
        if self.status != RecordStatus::Processing {
            return None;
        }
        self.locked_until
            .duration_since(self.observed_at)
            .ok()
            .filter(|left| !left.is_zero())
    }
}

/// How many records the table holds, by state. Expired records are counted apart from the others.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecordStats {
    /// Unexpired records being executed.
    pub processing: u64,
    /// Unexpired records with a stored response.
    pub completed: u64,
    /// Unexpired released records.
    pub failed: u64,
    /// Unexpired records held with an unknown outcome.
    pub unknown: u64,
    /// Records past their expiry, waiting for the sweeper.
    pub expired: u64,
}

/// Where a record is in its lifecycle as an operator asks about it (`keys list --state`): its status,
/// with a processing record's lease and every record's expiry read against the store's clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecordState {
    /// Processing under a live lease: a proxy is executing it.
    InFlight,
    /// Processing, its lease run out: its proxy died or lost the store; the next retry takes it over.
    Stale,
    /// Completed: retries replay the stored response.
    Completed,
    /// Released (`failed`): the next retry executes.
    Released,
    /// Held (`unknown`): refused until an operator releases it.
    Held,
    /// Past its expiry, whatever its status: claimable as new, waiting for the sweeper.
    Expired,
}

impl RecordState {
    /// Every state, in the order `keys list --help` names them.
    pub const ALL: [RecordState; 6] = [
        RecordState::InFlight,
        RecordState::Stale,
        RecordState::Completed,
        RecordState::Released,
        RecordState::Held,
        RecordState::Expired,
    ];

    /// The name `keys list` prints and `--state` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InFlight => "in-flight",
            RecordState::Stale => "stale",
            RecordState::Completed => "completed",
            RecordState::Released => "released",
            RecordState::Held => "held",
            RecordState::Expired => "expired",
        }
    }
}

/// What the request path asks of the key table: claim a record, keep its lease, and settle it.
#[async_trait::async_trait]
pub trait Lifecycle: Send + Sync + 'static {
    /// Atomically claims `request.id` or reports the record that holds it.
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError>;
    /// Extends the lease; `false` when the claim was taken over (fenced out).
    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError>;
    /// Stores the response and marks the record completed; `false` when fenced out.
    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError>;
    /// Marks the record failed so the next retry executes; `false` when fenced out.
    async fn release(&self, id: &RecordId) -> Result<bool, StoreError>;
    /// Marks the record `unknown` (its request may have been executed; retries are refused until an
    /// operator releases it); `false` when fenced out.
    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError>;
    /// Succeeds while the store answers.
    async fn ping(&self) -> Result<(), StoreError>;
    /// Tells the other processes on this store that a record settled, so their waiting requests
    /// re-check it (`store/wake.rs` makes the announcement). A store served by one process has no one
    /// to tell: its waiters are woken in-process, and this does nothing.
    async fn announce(&self, _announcement: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// The same store over connections of one worker thread's own, made for a store whose connection
    /// costs nothing to have once per thread and shares no work between its users (no commit to share),
    /// so that a request's store round trips stay on its thread; `None` (the default): share this one.
    fn for_worker(&self) -> Option<Arc<dyn Store>> {
        None
    }
}

/// What the operator's tools (`idemproxy keys`) and the sweeper ask of the key table: look records up,
/// count, page through, release or forget them, delete the expired.
#[async_trait::async_trait]
pub trait Upkeep: Send + Sync + 'static {
    /// Releases a processing claim whose lease has run out, or a held (`unknown`) record, fenced by its
    /// token: `false` when the record was completed, taken over, or its lease was extended meanwhile.
    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError>;
    /// Deletes at most `batch` expired records (processing ones only once their lease has run out too)
    /// in one short transaction and returns how many this call deleted. Safe to run from many replicas at
    /// once: each record is deleted and counted by exactly one of them.
    async fn sweep(&self, batch: u32) -> Result<u64, StoreError>;
    /// The records holding `key`, in every scope or in the given one.
    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError>;
    /// Counts the records by state.
    async fn stats(&self) -> Result<RecordStats, StoreError>;
    /// One page of records in the store's order, bounded by [`ListQuery::examine`] (`keys list`).
    async fn list(&self, _query: &ListQuery) -> Result<ListPage, StoreError> {
        Err(StoreError::Backend("this store cannot list its records".into()))
    }
    /// Deletes the record `id` names, fenced by its token: `false` when there is no such record or it was
    /// claimed again since it was read (`keys forget`). The next request with its key executes as new.
    async fn forget(&self, _id: &RecordId) -> Result<bool, StoreError> {
        Err(StoreError::Backend("this store cannot forget records".into()))
    }
}

/// A database-backed key table: every backend serves both callers, the request path ([`Lifecycle`]) and
/// the operator ([`Upkeep`]).
pub trait Store: Lifecycle + Upkeep {}

impl<T: Lifecycle + Upkeep> Store for T {}

/// Milliseconds since the Unix epoch as a point in time, as stores report their clock.
pub(crate) fn epoch_ms(ms: i64) -> SystemTime {
    let offset = Duration::from_millis(ms.unsigned_abs());
    if ms >= 0 {
        SystemTime::UNIX_EPOCH + offset
    } else {
        SystemTime::UNIX_EPOCH - offset
    }
}

/// A scripted store for the unit tests of what uses one.
#[cfg(test)]
pub(crate) mod stub;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_hash_is_short_stable_and_separates_scope_from_key() {
        let hash = key_hash("default:aa", "order-1");
        assert_eq!(hash.len(), 16);
        assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(hash, key_hash("default:aa", "order-1"));
        assert_ne!(hash, key_hash("default:ab", "order-1"));
        assert_ne!(key_hash("a", "bc"), key_hash("ab", "c"));
    }
}
