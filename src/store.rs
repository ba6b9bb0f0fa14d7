//! The key table behind every decision: the [`Store`] trait, the types that cross it, and [`StoreHandle`],
//! which times and counts every operation. Backends live in `store/`; they decide claims atomically in the
//! database and never by a read followed by a write. `serve` opens its store through `store/opening.rs`,
//! which waits out a store that cannot be reached yet; the handle answers [`StoreError::NotOpen`] until then.

mod blob;
mod coalesce;
pub mod encrypted;
mod listener;
pub mod notify;
mod opening;
pub mod postgres;
pub mod redis;
pub mod sqlite;
pub mod sweeper;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use uuid::Uuid;

use crate::config::{StoreBackend, StoreConfig};
use crate::metrics::{Metrics, StoreOp};
use postgres::PostgresStore;
use sqlite::SqliteStore;

pub use opening::serve;

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
    /// applied yet (`store/opening.rs` keeps trying and logs why).
    #[error("the store is not open yet")]
    NotOpen,
}

/// What a store is opened for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// The proxy; applies pending migrations first when `store.migrate` is on.
    Serve,
    /// Operator tools: the schema must exist already.
    Tool,
}

/// Opens the configured store. With `Purpose::Serve` and `store.migrate`, pending migrations are applied
/// first; `serve` itself opens through [`serve`], which waits for a PostgreSQL server that does not answer
/// yet instead of failing.
pub async fn open(config: &StoreConfig, purpose: Purpose) -> Result<Arc<dyn Store>, StoreError> {
    let Built { store, migrate } = build(config, purpose).await?;
    if migrate {
        let applied = PostgresStore::migrate(config).await?;
        tracing::info!(applied, "store schema is up to date");
    }
    Ok(store)
}

/// A store built without waiting for its server, and whether its shared schema must still be migrated
/// before it is used (PostgreSQL, opened for `serve` with `store.migrate`).
struct Built {
    store: Arc<dyn Store>,
    migrate: bool,
}

/// Builds the configured store. A shared store's connections open at first use, so this needs no server
/// and fails only on what no wait can mend; the embedded store's file is opened (and migrated) here.
async fn build(config: &StoreConfig, purpose: Purpose) -> Result<Built, StoreError> {
    let migrate = purpose == Purpose::Serve && config.migrate;
    let store: Arc<dyn Store> = match &config.backend {
        StoreBackend::Postgres => {
            return Ok(Built {
                store: Arc::new(PostgresStore::connect(config)?),
                migrate,
            });
        }
        StoreBackend::Redis(target) => Arc::new(redis::RedisStore::connect(config, target)),
        StoreBackend::Sqlite { path } => {
            let access = match purpose {
                Purpose::Serve => sqlite::Access::Serve,
                Purpose::Tool => sqlite::Access::Tool,
            };
            let store = SqliteStore::open(path, config.timeout, config.max_batch, access).await?;
            if migrate {
                let applied = store.migrate().await?;
                tracing::info!(applied, "store schema is up to date");
            }
            if purpose == Purpose::Serve {
                tracing::warn!(
                    path = %path.display(),
                    "using the embedded SQLite store: it serves this single instance only; \
                     run several replicas on PostgreSQL (store.url = postgres://...)"
                );
            }
            Arc::new(store)
        }
    };
    Ok(Built {
        store,
        migrate: false,
    })
}

/// What the configured store does beside claims, known from the configuration before it opens, so that
/// nothing above `store/` asks which backend it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Several replicas share it (PostgreSQL, Redis): settlements on wait routes are announced to the
    /// others, and a listener hears theirs.
    pub shared: bool,
    /// It deletes expired records itself (Redis, by each record's TTL): no sweeper runs.
    pub self_expiring: bool,
}

impl Capabilities {
    /// The capabilities of the store `config` names.
    pub fn of(config: &StoreConfig) -> Capabilities {
        match &config.backend {
            StoreBackend::Postgres => Capabilities {
                shared: true,
                self_expiring: false,
            },
            StoreBackend::Redis(_) => Capabilities {
                shared: true,
                self_expiring: true,
            },
            StoreBackend::Sqlite { .. } => Capabilities {
                shared: false,
                self_expiring: false,
            },
        }
    }
}

/// Applies the configured store's pending migrations and reports how many were applied.
pub async fn migrate(config: &StoreConfig) -> Result<usize, StoreError> {
    match &config.backend {
        StoreBackend::Postgres => PostgresStore::migrate(config).await,
        // A Redis record is a hash the scripts write whole: there is no schema to migrate.
        StoreBackend::Redis(_) => Ok(0),
        StoreBackend::Sqlite { path } => {
            SqliteStore::open(path, config.timeout, config.max_batch, sqlite::Access::Migrate)
                .await?
                .migrate()
                .await
        }
    }
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

/// Which records a page of [`Store::list`] walks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeFilter {
    /// Every record.
    All,
    /// The records of one route's scope name (`<name>:<credential hash>`), whatever the credential.
    Named(String),
    /// The records of one scope (one route's scope name and one client's credential).
    Exact(String),
}

impl ScopeFilter {
    /// Whether a record of `scope` passes.
    pub fn admits(&self, scope: &str) -> bool {
        match self {
            ScopeFilter::All => true,
            ScopeFilter::Named(name) => scope
                .strip_prefix(name.as_str())
                .is_some_and(|rest| rest.starts_with(':')),
            ScopeFilter::Exact(exact) => scope == exact,
        }
    }
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

/// One page of `keys list`: at most `limit` records, found by reading at most `examine` records after
/// `after` in the store's order.
#[derive(Debug, Clone)]
pub struct ListQuery {
    /// The scopes walked.
    pub scope: ScopeFilter,
    /// The states listed; empty lists every state.
    pub states: Vec<RecordState>,
    /// Where the previous page stopped ([`ListPage::next`]); `None` for the first page.
    pub after: Option<String>,
    /// Most records returned. A Redis page is one `SCAN` step, which may return a few more.
    pub limit: u32,
    /// Most records read, whether or not they pass the filters: the page's cost.
    pub examine: u32,
}

impl ListQuery {
    /// Whether `record` passes the query's filters.
    pub fn admits(&self, record: &RecordInfo) -> bool {
        self.scope.admits(&record.scope) && (self.states.is_empty() || self.states.contains(&record.state()))
    }
}

/// What one [`Store::list`] call found.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    /// The records read that pass the query's filters, in the store's order.
    pub records: Vec<RecordInfo>,
    /// How many records were read.
    pub examined: u32,
    /// Where the next page starts (a cursor to pass back as [`ListQuery::after`]); `None` when the walk
    /// reached the end. A page may hold no records and still have a next one.
    pub next: Option<String>,
}

/// The cursor of the SQL stores: the last examined record's scope and key, as `scope/key` (a scope holds
/// no `/`: a scope name is letters, digits, `-_.`, then `:` and a hash).
pub(crate) fn sql_cursor(scope: &str, key: &str) -> String {
    format!("{scope}/{key}")
}

/// Where a SQL store's page starts: after the cursor's scope and key, or before every record. Within one
/// scope, after a key of that scope.
pub(crate) fn sql_start(query: &ListQuery) -> Result<(String, String), StoreError> {
    let after = match &query.after {
        Some(cursor) => cursor
            .split_once('/')
            .map(|(scope, key)| (scope.to_owned(), key.to_owned()))
            .ok_or_else(|| bad_cursor(cursor))?,
        None => (String::new(), String::new()),
    };
    match &query.scope {
        ScopeFilter::Exact(exact) if query.after.is_none() => Ok((exact.clone(), String::new())),
        ScopeFilter::Exact(exact) if &after.0 != exact => {
            Err(bad_cursor(query.after.as_deref().unwrap_or("")))
        }
        _ => Ok(after),
    }
}

/// The page of the SQL stores from the records one range read returned (at most `query.examine`, in the
/// primary key's order): those the filters admit, up to `query.limit`, and the cursor of the last one
/// kept or read unless the range ended. A scope name's records are filtered here rather than by a range
/// of the index, because which range `name:` covers depends on the database's collation.
pub(crate) fn page(read: Vec<RecordInfo>, query: &ListQuery) -> ListPage {
    let full = read.len() >= query.examine as usize;
    let mut page = ListPage::default();
    let mut last = None;
    for record in read {
        page.examined += 1;
        last = Some(sql_cursor(&record.scope, &record.key));
        if query.admits(&record) {
            page.records.push(record);
            if page.records.len() >= query.limit as usize {
                page.next = last;
                return page;
            }
        }
    }
    page.next = last.filter(|_| full);
    page
}

/// A cursor this store did not print.
pub(crate) fn bad_cursor(cursor: &str) -> StoreError {
    StoreError::Backend(format!(
        "{cursor:?} is not a cursor this store printed: pass --after exactly as the previous page's \
         last line gives it"
    ))
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
    /// Marks the record `unknown` (its request may have been executed; retries are refused until an
    /// operator releases it); `false` when fenced out.
    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError>;
    /// Succeeds while the store answers.
    async fn ping(&self) -> Result<(), StoreError>;
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
    /// Tells the other processes on this store that a record settled, so their waiting requests
    /// re-check it (`store/notify.rs` makes the announcement). A store served by one process has no one
    /// to tell: its waiters are woken in-process, and this does nothing.
    async fn announce(&self, _announcement: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The store as the request path uses it: every call timed and counted by operation. It may start
/// unopened (`serve`, while its store cannot be reached yet): every call then fails at once with
/// [`StoreError::NotOpen`], counted as a failure of its operation, until the store is installed.
#[derive(Clone)]
pub struct StoreHandle {
    inner: Arc<OnceLock<Arc<dyn Store>>>,
    metrics: Metrics,
}

impl StoreHandle {
    /// Wraps an open backend.
    pub fn new(inner: Arc<dyn Store>, metrics: Metrics) -> StoreHandle {
        StoreHandle {
            inner: Arc::new(OnceLock::from(inner)),
            metrics,
        }
    }

    /// A handle whose store is not open yet.
    fn unopened(metrics: Metrics) -> StoreHandle {
        StoreHandle {
            inner: Arc::new(OnceLock::new()),
            metrics,
        }
    }

    /// Puts the opened store behind every clone of this handle; a handle is opened once.
    fn install(&self, store: Arc<dyn Store>) {
        if self.inner.set(store).is_err() {
            tracing::error!("the store was opened twice; the first stays");
        }
    }

    /// Whether the store is open (it may still fail to answer).
    pub fn is_open(&self) -> bool {
        self.inner.get().is_some()
    }

    /// See [`Store::claim`].
    pub async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        self.measured(StoreOp::Claim, async { self.store()?.claim(request).await })
            .await
    }

    /// See [`Store::heartbeat`].
    pub async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.measured(StoreOp::Heartbeat, async {
            self.store()?.heartbeat(id, lease).await
        })
        .await
    }

    /// See [`Store::complete`].
    pub async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        self.measured(StoreOp::Complete, async {
            self.store()?.complete(id, response).await
        })
        .await
    }

    /// See [`Store::release`].
    pub async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.release(id).await })
            .await
    }

    /// See [`Store::hold`].
    pub async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Hold, async { self.store()?.hold(id).await })
            .await
    }

    /// See [`Store::ping`].
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.measured(StoreOp::Ping, async { self.store()?.ping().await })
            .await
    }

    /// See [`Store::release_stale`].
    pub async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.release_stale(id).await })
            .await
    }

    /// See [`Store::sweep`].
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.measured(StoreOp::Sweep, async { self.store()?.sweep(batch).await })
            .await
    }

    /// See [`Store::find`].
    pub async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        self.measured(StoreOp::Find, async { self.store()?.find(key, scope).await })
            .await
    }

    /// See [`Store::stats`].
    pub async fn stats(&self) -> Result<RecordStats, StoreError> {
        self.measured(StoreOp::Stats, async { self.store()?.stats().await })
            .await
    }

    /// See [`Store::list`].
    pub async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.measured(StoreOp::Find, async { self.store()?.list(query).await })
            .await
    }

    /// See [`Store::forget`].
    pub async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.measured(StoreOp::Release, async { self.store()?.forget(id).await })
            .await
    }

    /// See [`Store::announce`].
    pub async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        self.measured(StoreOp::Notify, async {
            self.store()?.announce(announcement).await
        })
        .await
    }

    fn store(&self) -> Result<&Arc<dyn Store>, StoreError> {
        self.inner.get().ok_or(StoreError::NotOpen)
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

/// Milliseconds since the Unix epoch as a point in time, as stores report their clock.
pub(crate) fn epoch_ms(ms: i64) -> SystemTime {
    let offset = Duration::from_millis(ms.unsigned_abs());
    if ms >= 0 {
        SystemTime::UNIX_EPOCH + offset
    } else {
        SystemTime::UNIX_EPOCH - offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(scope: &str, key: &str) -> RecordInfo {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        RecordInfo {
            scope: scope.into(),
            key: key.into(),
            status: RecordStatus::Completed,
            attempt: 1,
            claim_kind: ClaimKind::New,
            token: Uuid::nil(),
            created_at: now,
            updated_at: now,
            expires_at: now + Duration::from_secs(60),
            locked_until: now,
            observed_at: now,
            response_status: Some(201),
            response_bytes: Some(2),
            body_retained: Some(true),
        }
    }

    fn query(scope: ScopeFilter, limit: u32, examine: u32) -> ListQuery {
        ListQuery {
            scope,
            states: Vec::new(),
            after: None,
            limit,
            examine,
        }
    }

    #[test]
    fn a_scope_name_admits_its_own_scopes_only() {
        let orders = ScopeFilter::Named("orders".into());
        assert!(orders.admits("orders:ab"));
        assert!(!orders.admits("orders2:ab") && !orders.admits("orders"));
        assert!(ScopeFilter::Exact("orders:ab".into()).admits("orders:ab"));
        assert!(!ScopeFilter::Exact("orders:ab".into()).admits("orders:abc"));
    }

    #[test]
    fn a_sql_page_stops_at_its_limit_on_the_last_record_kept_and_ends_with_a_short_read() {
        let read = vec![
            info("a:1", "k1"),
            info("b:1", "k2"),
            info("a:1", "k3"),
            info("a:1", "k4"),
        ];
        let named = query(ScopeFilter::Named("a".into()), 2, 4);
        let page = page(read.clone(), &named);
        assert_eq!(page.records.len(), 2);
        assert_eq!(
            page.next.as_deref(),
            Some("a:1/k3"),
            "the next page starts after k3, not after k4"
        );
        assert_eq!(page.examined, 3);

        let page = super::page(read.clone(), &query(ScopeFilter::All, 10, 4));
        assert_eq!(
            page.next.as_deref(),
            Some("a:1/k4"),
            "a full read may have more after it"
        );
        let page = super::page(read, &query(ScopeFilter::All, 10, 5));
        assert_eq!(page.next, None, "a short read reached the end");
    }

    #[test]
    fn a_cursor_is_read_back_and_one_from_another_scope_is_refused() {
        let mut within = query(ScopeFilter::Exact("a:1".into()), 10, 10);
        assert_eq!(sql_start(&within).unwrap(), ("a:1".to_owned(), String::new()));
        within.after = Some(sql_cursor("a:1", "k/9"));
        assert_eq!(sql_start(&within).unwrap(), ("a:1".to_owned(), "k/9".to_owned()));
        within.after = Some(sql_cursor("b:1", "k"));
        assert!(sql_start(&within).is_err());
    }

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
