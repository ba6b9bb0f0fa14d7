//! Configuration, loaded once at start-up: figment layers defaults < TOML file < `IDEMPROXY_` env < flags
//! into the raw serde structs, then `validate()` turns them into the typed [`Config`] the proxy runs with.
//! Nothing here is read again after start; the typed config is passed down, never global.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytesize::ByteSize;
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use http::{HeaderName, Method, Uri};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Serialize};

/// A configuration error: one line naming the key and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("config error: {key}: {message}")]
pub struct ConfigError {
    /// Dotted path of the offending key (`idempotency.ttl`), or `config` when the file itself is unreadable.
    pub key: String,
    /// What is wrong, in one line.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(key: &str, message: impl std::fmt::Display) -> Self {
        ConfigError {
            key: key.to_owned(),
            message: message.to_string().replace('\n', " "),
        }
    }

    fn from_figment(err: figment::Error) -> Self {
        let key = if err.path.is_empty() {
            "config".to_owned()
        } else {
            err.path.join(".")
        };
        let source = err
            .metadata
            .as_ref()
            .map(|m| format!(" (from {})", m.name))
            .unwrap_or_default();
        ConfigError::new(&key, format!("{}{source}", err.kind))
    }
}

// ---------------------------------------------------------------------------------------------
// Raw layer: exactly what the TOML file, the environment and the flags may say.
// ---------------------------------------------------------------------------------------------

/// The configuration as written, before validation. Every key has a default.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    /// Listeners and shutdown.
    pub server: RawServer,
    /// The protected service.
    pub upstream: RawUpstream,
    /// Where claims and stored responses live.
    pub store: RawStore,
    /// Which requests are protected and how.
    pub idempotency: RawIdempotency,
    /// Deleting expired records.
    pub sweeper: RawSweeper,
    /// Log output.
    pub log: RawLog,
    /// In-process copies of completed records, for replays without a store round trip.
    pub replay_cache: RawReplayCache,
    /// Encryption at rest of stored responses.
    pub encryption: RawEncryption,
}

/// `[server]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    /// Proxy listener address.
    pub listen: String,
    /// Admin listener address (`/metrics`, `/healthz`, `/readyz`).
    pub admin_listen: String,
    /// How long in-flight requests may run to completion after a shutdown signal.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// TLS on the proxy listener; absent means cleartext (HTTP/1.1 and h2c).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<RawServerTls>,
    /// Bound on receiving a request's head (HTTP/1.1); the connection is closed when it runs out.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Bound on receiving a keyed request's whole body, and on the silence between two chunks of a
    /// passthrough request's body; 408 when it runs out.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// Largest request head (request line and headers; the header list on HTTP/2); larger gets 431.
    pub max_header_size: ByteSize,
    /// Most header lines in one HTTP/1.1 request head; more gets 431.
    pub max_headers: usize,
    /// Most client connections open at once on the proxy listener; further ones wait to be accepted.
    pub max_connections: usize,
    /// Memory for keyed request bodies held at once, in all; a body that does not fit waits for room, then
    /// gets 503.
    pub max_buffered_bodies: ByteSize,
    /// Threads serving client connections, each with its own runtime and upstream connections; absent
    /// means one per available core.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<usize>,
    /// How long a client may accept no bytes of its response before the proxy lets it go (its
    /// connection ends; a keyed response is still read to the end and stored).
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// Most keyed requests being executed at once (their work outlives their clients); more get 503.
    /// Absent means `max_connections`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keyed_in_flight: Option<usize>,
    /// Memory for keyed responses captured for storage at once, in all; a capture that finds no room is
    /// not retained.
    pub max_buffered_responses: ByteSize,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "0.0.0.0:8080".into(),
            admin_listen: "127.0.0.1:9090".into(),
            shutdown_grace: Duration::from_secs(30),
            tls: None,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_header_size: ByteSize::kib(64),
            max_headers: 100,
            max_connections: 1024,
            max_buffered_bodies: ByteSize::mib(256),
            workers: None,
            write_timeout: Duration::from_secs(30),
            max_keyed_in_flight: None,
            max_buffered_responses: ByteSize::mib(256),
        }
    }
}

/// `[server.tls]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// `[upstream]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawUpstream {
    /// Base URL of the protected service (`http://host:port`).
    pub url: String,
    /// Bound on establishing a TCP connection to the upstream.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bound on waiting for the response head, and on the gap between two body chunks.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Most connections each worker holds open to the upstream (in use or idle); a request that finds
    /// none free waits up to `connect_timeout`, then gets 503. Absent means `server.max_connections`
    /// divided among the workers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            url: "http://127.0.0.1:3000".into(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(60),
            max_connections: None,
        }
    }
}

/// The embedded store in the working directory: zero setup for a single instance.
pub const DEFAULT_STORE_URL: &str = "sqlite://idemproxy.db";

/// The largest `store.max_batch`: past a few hundred, a batch only adds latency.
const MAX_BATCH_LIMIT: usize = 1000;

/// `[store]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStore {
    /// `sqlite://path/to/file.db` (embedded, single instance) or
    /// `postgres://user:password@host:port/database`.
    pub url: String,
    /// Maximum connections in the pool.
    pub pool_size: usize,
    /// Most claims (and, apart, completions) sent to PostgreSQL in one statement when they arrive
    /// together; 1 sends each on its own.
    pub max_batch: usize,
    /// Bound on any one store operation, including waiting for a pooled connection.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// What keyed requests get while the store is unreachable.
    pub on_error: OnStoreError,
    /// Apply pending migrations when `serve` starts.
    pub migrate: bool,
    /// PEM file of CA certificates trusted for the store's TLS (with `sslmode=require` in the URL), in
    /// addition to the system's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            url: DEFAULT_STORE_URL.into(),
            pool_size: 16,
            max_batch: 64,
            timeout: Duration::from_secs(5),
            on_error: OnStoreError::FailClosed,
            migrate: true,
            tls_ca_file: None,
        }
    }
}

/// `[sweeper]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSweeper {
    /// Run the background sweeper in `serve`.
    pub enabled: bool,
    /// Pause between sweeps.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Most records deleted by one statement (one short transaction).
    pub batch_size: u32,
}

impl Default for RawSweeper {
    fn default() -> Self {
        RawSweeper {
            enabled: true,
            interval: Duration::from_secs(60),
            batch_size: 1000,
        }
    }
}

/// `[replay_cache]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawReplayCache {
    /// Bytes of stored responses (plus per-entry overhead) kept in memory; 0 turns the cache off.
    pub max_size: ByteSize,
    /// Longest time an entry is served without asking the store again; 0 turns the cache off.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
}

impl Default for RawReplayCache {
    fn default() -> Self {
        RawReplayCache {
            max_size: ByteSize::mib(8),
            max_age: Duration::from_secs(60),
        }
    }
}

/// Behaviour of keyed requests while the store is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Answer 503 and never forward.
    FailClosed,
    /// Forward without protection, and count it.
    FailOpen,
}

/// `[idempotency]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawIdempotency {
    /// Request header carrying the key.
    pub header: String,
    /// Methods that are protected; others pass through.
    pub methods: Vec<String>,
    /// Reject protected methods without a key (400) instead of passing them through.
    pub required: bool,
    /// How long a key lives after its first claim.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long a claim holds without a heartbeat before another request may take it over.
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// Longest accepted key, in characters.
    pub max_key_length: usize,
    /// Largest request body of a keyed request (it is read whole to fingerprint it).
    pub max_request_body: ByteSize,
    /// Largest response body kept for replay; larger responses are forwarded but not retained.
    pub max_stored_response: ByteSize,
    /// Request headers whose values separate clients (hashed, never stored raw).
    pub scope_headers: Vec<String>,
    /// Request headers that, besides method, path and body, make two requests the same.
    pub fingerprint_headers: Vec<String>,
    /// Upstream statuses that release the claim instead of being stored (`"5xx"` or a code).
    pub release_statuses: Vec<String>,
    /// What a keyed request without any of `scope_headers` gets: refused, or one scope shared by all
    /// such requests.
    pub unscoped: Unscoped,
    /// The `Retry-After` of a 409 for a key in flight (never more than the lease left).
    #[serde(with = "humantime_serde")]
    pub in_flight_retry_after: Duration,
    /// What happens to a key whose request may have reached the upstream but got no full answer.
    pub on_unknown_outcome: OnUnknownOutcome,
    /// Response headers relayed to the first client but neither stored nor replayed.
    pub never_store_headers: Vec<String>,
}

/// What a keyed request that carries none of the scope headers gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Unscoped {
    /// 400 `missing-scope`, not forwarded.
    Reject,
    /// Served in one scope shared by every such request.
    Shared,
}

/// What happens to a key whose request may have reached the upstream without a full answer coming back
/// (a timeout, or a connection reset mid-response).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnUnknownOutcome {
    /// The claim is left to its lease; a retry after it executes again (a stale takeover).
    Retry,
    /// The record is marked `unknown`: retries get 502 until `idemproxy keys release`.
    Hold,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        RawIdempotency {
            header: "Idempotency-Key".into(),
            methods: vec!["POST".into(), "PATCH".into()],
            required: false,
            ttl: Duration::from_secs(24 * 3600),
            lock_timeout: Duration::from_secs(30),
            max_key_length: 255,
            max_request_body: ByteSize::mib(10),
            max_stored_response: ByteSize::mib(4),
            scope_headers: vec!["authorization".into()],
            fingerprint_headers: vec!["content-type".into()],
            release_statuses: vec!["5xx".into(), "408".into(), "425".into(), "429".into()],
            unscoped: Unscoped::Reject,
            in_flight_retry_after: Duration::from_secs(1),
            on_unknown_outcome: OnUnknownOutcome::Retry,
            never_store_headers: vec!["set-cookie".into()],
        }
    }
}

/// `[log]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLog {
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
    /// Filter in `RUST_LOG` syntax; the `RUST_LOG` variable overrides it.
    pub filter: String,
}

impl Default for RawLog {
    fn default() -> Self {
        RawLog {
            format: LogFormat::Text,
            filter: "info".into(),
        }
    }
}

/// Length of an encryption key, in bytes.
pub const KEY_LEN: usize = 32;
/// Longest key id; ids are stored in every sealed value.
pub const MAX_KEY_ID: usize = 64;

/// `[encryption]`: AES-256-GCM of stored response bodies and header values.
#[derive(Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RawEncryption {
    /// Id (in `keys`) of the key new records are encrypted with; unset means new records are stored in
    /// clear.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_key: Option<String>,
    /// Key id → base64 of 32 random bytes. Every key that encrypted a record still alive must stay here.
    pub keys: BTreeMap<String, String>,
    /// Replay records stored in clear (from before encryption was turned on) while a key is active.
    pub accept_plaintext: bool,
}

impl std::fmt::Debug for RawEncryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawEncryption")
            .field("active_key", &self.active_key)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .finish()
    }
}

/// Validated `[encryption]`, with at least one key. Built only by [`RawEncryption::validate`], so
/// whoever holds one may trust it: every id is a valid key id, every key is [`KEY_LEN`] bytes, and the
/// active key, when there is one, is among the keys.
#[derive(Clone)]
pub struct EncryptionConfig {
    active_key: Option<String>,
    keys: BTreeMap<String, EncryptionKey>,
    accept_plaintext: bool,
}

/// The bytes of one configured key; its `Debug` shows none of them.
#[derive(Clone)]
pub struct EncryptionKey([u8; KEY_LEN]);

impl EncryptionKey {
    /// The key's bytes.
    pub fn bytes(&self) -> &[u8; KEY_LEN] {
        &self.0
    }
}

impl std::fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EncryptionKey(***)")
    }
}

impl std::fmt::Debug for EncryptionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncryptionConfig")
            .field("active_key", &self.active_key)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .field("accept_plaintext", &self.accept_plaintext)
            .finish()
    }
}

impl EncryptionConfig {
    /// Id of the key that seals new records; `None` stores new records in clear. Always one of
    /// [`keys`](Self::keys).
    pub fn active_key(&self) -> Option<&str> {
        self.active_key.as_deref()
    }

    /// Every configured key by id: the active one and those that may still open older records.
    pub fn keys(&self) -> impl Iterator<Item = (&str, &EncryptionKey)> {
        self.keys.iter().map(|(id, key)| (id.as_str(), key))
    }

    /// Whether records stored in clear are replayed: as `accept_plaintext` says, and always while no key
    /// is active, since new records are then stored in clear themselves.
    pub fn accept_plaintext(&self) -> bool {
        self.accept_plaintext
    }
}

/// Whether `id` could be a configured key id: 1 to [`MAX_KEY_ID`] of `A-Z a-z 0-9 - _`. Also what a
/// key id read back from a sealed value must be before it is logged.
pub fn is_key_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_KEY_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl RawEncryption {
    /// Checks the section; `None` when no keys are configured (encryption off). The first problem found
    /// is returned, naming the key id but never the key.
    pub fn validate(&self) -> Result<Option<EncryptionConfig>, ConfigError> {
        if self.keys.is_empty() {
            if self.active_key.is_some() {
                return Err(ConfigError::new(
                    "encryption.active_key",
                    "names a key but encryption.keys is empty",
                ));
            }
            return Ok(None);
        }
        let mut keys = BTreeMap::new();
        for (id, secret) in &self.keys {
            keys.insert(id.clone(), decode_key(id, secret)?);
        }
        if let Some(active) = &self.active_key
            && !keys.contains_key(active)
        {
            return Err(ConfigError::new(
                "encryption.active_key",
                format!("{active:?} is not a key id in encryption.keys"),
            ));
        }
        Ok(Some(EncryptionConfig {
            active_key: self.active_key.clone(),
            keys,
            accept_plaintext: self.accept_plaintext || self.active_key.is_none(),
        }))
    }
}

fn decode_key(id: &str, secret: &str) -> Result<EncryptionKey, ConfigError> {
    let key = format!("encryption.keys.{id}");
    if !is_key_id(id) {
        return Err(ConfigError::new(
            &key,
            format!("a key id is 1 to {MAX_KEY_ID} of A-Z a-z 0-9 - _"),
        ));
    }
    let bytes = BASE64
        .decode(secret.trim())
        .map_err(|_| ConfigError::new(&key, "is not base64"))?;
    let bytes = <[u8; KEY_LEN]>::try_from(bytes.as_slice()).map_err(|_| {
        ConfigError::new(
            &key,
            format!(
                "must be {KEY_LEN} bytes after base64 decoding, is {} (make one with: openssl rand -base64 32)",
                bytes.len()
            ),
        )
    })?;
    Ok(EncryptionKey(bytes))
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

// ---------------------------------------------------------------------------------------------
// Typed layer: what the proxy runs with.
// ---------------------------------------------------------------------------------------------

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Listeners and shutdown.
    pub server: ServerConfig,
    /// The protected service.
    pub upstream: UpstreamConfig,
    /// The store.
    pub store: StoreConfig,
    /// The idempotency policy.
    pub idempotency: IdempotencyConfig,
    /// The expiry sweeper.
    pub sweeper: SweeperConfig,
    /// Logging.
    pub log: RawLog,
    /// The replay cache.
    pub replay_cache: ReplayCacheConfig,
    /// Encryption at rest; `None` when no keys are configured.
    pub encryption: Option<EncryptionConfig>,
    raw: RawConfig,
}

/// Validated `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Proxy listener address.
    pub listen: SocketAddr,
    /// Admin listener address.
    pub admin_listen: SocketAddr,
    /// Drain bound after a shutdown signal.
    pub shutdown_grace: Duration,
    /// The listener's TLS settings, when TLS is on.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Request head bound (HTTP/1.1).
    pub header_read_timeout: Duration,
    /// Request body bound.
    pub body_read_timeout: Duration,
    /// Largest request head, bytes.
    pub max_header_size: usize,
    /// Most header lines in an HTTP/1.1 request head.
    pub max_headers: usize,
    /// Most open client connections.
    pub max_connections: usize,
    /// Bytes of keyed request bodies held at once, in all.
    pub max_buffered_bodies: usize,
    /// Threads serving client connections.
    pub workers: usize,
    /// Longest a client may accept no response bytes.
    pub write_timeout: Duration,
    /// Most keyed requests executing at once.
    pub max_keyed_in_flight: usize,
    /// Bytes of keyed responses captured for storage at once, in all.
    pub max_buffered_responses: usize,
}

/// Validated `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Scheme and authority of the upstream; requests keep their own path and query.
    pub base: Uri,
    /// TCP connect bound.
    pub connect_timeout: Duration,
    /// Response head bound and body idle bound.
    pub timeout: Duration,
    /// Most upstream connections per worker.
    pub max_connections: usize,
}

/// Validated `[sweeper]`.
#[derive(Debug, Clone)]
pub struct SweeperConfig {
    /// Whether `serve` runs the sweeper.
    pub enabled: bool,
    /// Pause between sweeps.
    pub interval: Duration,
    /// Most records deleted per statement.
    pub batch_size: u32,
}

/// Which database backs the key table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// A PostgreSQL server (`url`), shared by any number of replicas.
    Postgres,
    /// An embedded SQLite file, for a single instance.
    Sqlite {
        /// The database file.
        path: PathBuf,
    },
}

/// Validated `[store]`.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Which database, from the URL's scheme.
    pub backend: StoreBackend,
    /// Connection settings parsed from the URL.
    pub url: String,
    /// Maximum pooled connections.
    pub pool_size: usize,
    /// Most operations of one kind coalesced into one statement (PostgreSQL); 1 turns coalescing off.
    pub max_batch: usize,
    /// Bound on one store operation.
    pub timeout: Duration,
    /// Behaviour while the store is down.
    pub on_error: OnStoreError,
    /// Migrate at `serve` start.
    pub migrate: bool,
    /// Whether the URL asks for TLS (`sslmode=require`).
    pub tls: bool,
    /// Extra trusted CA certificates for the store's TLS.
    pub tls_ca_file: Option<PathBuf>,
}

/// Validated `[idempotency]`.
#[derive(Debug, Clone)]
pub struct IdempotencyConfig {
    /// Key header name.
    pub header: HeaderName,
    /// Protected methods.
    pub methods: Vec<Method>,
    /// Whether protected methods must carry a key.
    pub required: bool,
    /// Key lifetime.
    pub ttl: Duration,
    /// Claim lease.
    pub lock_timeout: Duration,
    /// Longest key.
    pub max_key_length: usize,
    /// Largest keyed request body, bytes.
    pub max_request_body: u64,
    /// Largest stored response body, bytes.
    pub max_stored_response: u64,
    /// Scope headers, lower-case.
    pub scope_headers: Vec<HeaderName>,
    /// Fingerprint headers, lower-case.
    pub fingerprint_headers: Vec<HeaderName>,
    /// Statuses that release the claim.
    pub release: ReleasePolicy,
    /// Keyed requests without a scope header: refused or shared.
    pub unscoped: Unscoped,
    /// `Retry-After` of a 409 for a key in flight.
    pub in_flight_retry_after: Duration,
    /// Unknown outcomes: retried after the lease, or held.
    pub on_unknown_outcome: OnUnknownOutcome,
    /// Response headers never stored, lower-case.
    pub never_store_headers: Vec<HeaderName>,
}

/// Validated `[replay_cache]`.
#[derive(Debug, Clone)]
pub struct ReplayCacheConfig {
    /// Byte bound; 0 is off.
    pub max_size: u64,
    /// Age bound of one entry; zero is off.
    pub max_age: Duration,
}

/// Which upstream statuses mean "not processed, run it again" and so release the claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleasePolicy {
    /// Release every 5xx.
    pub server_errors: bool,
    /// Individual codes to release.
    pub codes: Vec<u16>,
}

impl ReleasePolicy {
    /// Whether a response with this status releases the claim rather than being stored.
    pub fn releases(&self, status: http::StatusCode) -> bool {
        (self.server_errors && status.is_server_error()) || self.codes.contains(&status.as_u16())
    }
}

/// Command-line overrides, the top layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    /// `--listen`
    pub listen: Option<String>,
    /// `--admin-listen`
    pub admin_listen: Option<String>,
    /// `--upstream`
    pub upstream: Option<String>,
    /// `--store`
    pub store: Option<String>,
    /// `--no-migrate`
    pub no_migrate: bool,
}

impl Config {
    /// Defaults < the given TOML text. No environment, no flags: for tests and embedding.
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        let figment = Figment::from(Serialized::defaults(RawConfig::default())).merge(Toml::string(toml));
        Self::from_figment(figment)
    }

    /// Defaults < TOML file (if given) < `IDEMPROXY_…` environment < command-line overrides.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig::default()));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::new(
                    "config",
                    format!("cannot read file {}", path.display()),
                ));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        figment = figment
            .merge(Env::prefixed("IDEMPROXY_").split("__").lowercase(true))
            .merge(overrides.figment());
        Self::from_figment(figment)
    }

    fn from_figment(figment: Figment) -> Result<Config, ConfigError> {
        let raw: RawConfig = figment.extract().map_err(ConfigError::from_figment)?;
        raw.validate()
    }

    /// The effective configuration as TOML, with secrets masked.
    pub fn to_masked_toml(&self) -> String {
        let mut raw = self.raw.clone();
        raw.store.url = mask_url_password(&raw.store.url);
        for secret in raw.encryption.keys.values_mut() {
            *secret = "***".into();
        }
        toml::to_string_pretty(&raw).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}

impl Overrides {
    fn figment(&self) -> Figment {
        let mut figment = Figment::new();
        let mut set = |key: &str, value: &Option<String>| {
            if let Some(value) = value {
                figment = std::mem::take(&mut figment).merge(Serialized::default(key, value));
            }
        };
        set("server.listen", &self.listen);
        set("server.admin_listen", &self.admin_listen);
        set("upstream.url", &self.upstream);
        set("store.url", &self.store);
        if self.no_migrate {
            figment = figment.merge(Serialized::default("store.migrate", false));
        }
        figment
    }
}

impl RawConfig {
    /// Checks every value and converts it to its typed form; the first problem found is returned.
    pub fn validate(self) -> Result<Config, ConfigError> {
        if self.server.max_buffered_bodies < self.idempotency.max_request_body {
            return Err(ConfigError::new(
                "server.max_buffered_bodies",
                "must be at least idempotency.max_request_body",
            ));
        }
        if self.server.max_buffered_responses < self.idempotency.max_stored_response {
            return Err(ConfigError::new(
                "server.max_buffered_responses",
                "must be at least idempotency.max_stored_response",
            ));
        }
        let server = self.server.validate()?;
        let upstream = self.upstream.validate(&server)?;
        Ok(Config {
            server,
            upstream,
            store: self.store.validate()?,
            idempotency: self.idempotency.validate()?,
            sweeper: self.sweeper.validate()?,
            log: self.log.clone(),
            replay_cache: ReplayCacheConfig {
                max_size: self.replay_cache.max_size.as_u64(),
                max_age: self.replay_cache.max_age,
            },
            encryption: self.encryption.validate()?,
            raw: self,
        })
    }
}

impl RawServer {
    fn validate(&self) -> Result<ServerConfig, ConfigError> {
        Ok(ServerConfig {
            listen: parse_addr("server.listen", &self.listen)?,
            admin_listen: parse_addr("server.admin_listen", &self.admin_listen)?,
            shutdown_grace: self.shutdown_grace,
            tls: self.tls.as_ref().map(RawServerTls::validate).transpose()?,
            header_read_timeout: positive("server.header_read_timeout", self.header_read_timeout)?,
            body_read_timeout: positive("server.body_read_timeout", self.body_read_timeout)?,
            max_header_size: self.max_header_size()?,
            max_headers: within("server.max_headers", self.max_headers, 1..=10_000)?,
            max_connections: within("server.max_connections", self.max_connections, 1..=1_000_000)?,
            max_buffered_bodies: usize::try_from(self.max_buffered_bodies.as_u64()).unwrap_or(usize::MAX),
            workers: self.workers()?,
            write_timeout: positive("server.write_timeout", self.write_timeout)?,
            max_keyed_in_flight: match self.max_keyed_in_flight {
                Some(n) => within("server.max_keyed_in_flight", n, 1..=1_000_000)?,
                None => self.max_connections,
            },
            max_buffered_responses: usize::try_from(self.max_buffered_responses.as_u64())
                .unwrap_or(usize::MAX),
        })
    }

    fn workers(&self) -> Result<usize, ConfigError> {
        match self.workers {
            Some(workers) => within("server.workers", workers, 1..=1024),
            None => Ok(std::thread::available_parallelism().map_or(1, usize::from)),
        }
    }

    fn max_header_size(&self) -> Result<usize, ConfigError> {
        let bytes = self.max_header_size.as_u64();
        if !(8 * 1024..=16 * 1024 * 1024).contains(&bytes) {
            return Err(ConfigError::new(
                "server.max_header_size",
                "must be between 8KiB and 16MiB",
            ));
        }
        Ok(bytes as usize)
    }
}

impl RawServerTls {
    fn validate(&self) -> Result<Arc<rustls::ServerConfig>, ConfigError> {
        for (key, path) in [
            ("server.tls.cert_file", &self.cert_file),
            ("server.tls.key_file", &self.key_file),
        ] {
            if !path.is_file() {
                return Err(ConfigError::new(
                    key,
                    format!("cannot read file {}", path.display()),
                ));
            }
        }
        listener_tls(&self.cert_file, &self.key_file).map_err(|e| ConfigError::new("server.tls", e))
    }
}

/// The listener's TLS: the certificate chain and private key from PEM files, rustls with the ring
/// provider, ALPN offering `h2` then `http/1.1`.
fn listener_tls(cert_file: &Path, key_file: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let chain = CertificateDer::pem_file_iter(cert_file)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read certificates from {}: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!("no certificate in {}", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| format!("no usable private key in {}: {e}", key_file.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("certificate and key do not fit together: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

impl RawUpstream {
    fn validate(&self, server: &ServerConfig) -> Result<UpstreamConfig, ConfigError> {
        let key = "upstream.url";
        let uri: Uri = self
            .url
            .parse()
            .map_err(|e| ConfigError::new(key, format!("not a URL: {e}")))?;
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return Err(ConfigError::new(key, "must be an http:// URL"));
        }
        if uri.authority().is_none() {
            return Err(ConfigError::new(key, "must name a host"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(ConfigError::new(
                key,
                "must not carry a path or query; requests keep their own",
            ));
        }
        positive("upstream.connect_timeout", self.connect_timeout)?;
        positive("upstream.timeout", self.timeout)?;
        let max_connections = match self.max_connections {
            Some(n) => within("upstream.max_connections", n, 1..=1_000_000)?,
            None => server.max_connections.div_ceil(server.workers),
        };
        Ok(UpstreamConfig {
            base: uri,
            connect_timeout: self.connect_timeout,
            timeout: self.timeout,
            max_connections,
        })
    }
}

impl RawSweeper {
    fn validate(&self) -> Result<SweeperConfig, ConfigError> {
        positive("sweeper.interval", self.interval)?;
        if self.batch_size == 0 {
            return Err(ConfigError::new("sweeper.batch_size", "must be at least 1"));
        }
        Ok(SweeperConfig {
            enabled: self.enabled,
            interval: self.interval,
            batch_size: self.batch_size,
        })
    }
}

impl RawStore {
    fn validate(&self) -> Result<StoreConfig, ConfigError> {
        if let Some(path) = self.url.strip_prefix("sqlite://") {
            return self.validate_sqlite(path);
        }
        let key = "store.url";
        let url = url::Url::parse(&self.url).map_err(|e| ConfigError::new(key, format!("not a URL: {e}")))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(ConfigError::new(
                key,
                format!(
                    "unsupported scheme {:?}; use sqlite://path/to/file.db or \
                     postgres://user@host:port/database",
                    url.scheme()
                ),
            ));
        }
        // tokio-postgres reads a URL without sslmode as `prefer`, so what the URL wrote is read here.
        let tls = store_tls(&url)?;
        self.url
            .parse::<tokio_postgres::Config>()
            .map_err(|e| ConfigError::new(key, format!("invalid PostgreSQL URL: {e}")))?;
        if let Some(path) = &self.tls_ca_file {
            if !tls {
                return Err(ConfigError::new(
                    "store.tls_ca_file",
                    "only used with TLS: add sslmode=require to store.url",
                ));
            }
            if !path.is_file() {
                return Err(ConfigError::new(
                    "store.tls_ca_file",
                    format!("cannot read file {}", path.display()),
                ));
            }
        }
        if self.pool_size == 0 {
            return Err(ConfigError::new("store.pool_size", "must be at least 1"));
        }
        positive("store.timeout", self.timeout)?;
        Ok(StoreConfig {
            backend: StoreBackend::Postgres,
            url: self.url.clone(),
            pool_size: self.pool_size,
            max_batch: self.max_batch()?,
            timeout: self.timeout,
            on_error: self.on_error,
            migrate: self.migrate,
            tls,
            tls_ca_file: self.tls_ca_file.clone(),
        })
    }

    fn max_batch(&self) -> Result<usize, ConfigError> {
        if !(1..=MAX_BATCH_LIMIT).contains(&self.max_batch) {
            return Err(ConfigError::new(
                "store.max_batch",
                format!("must be from 1 (no coalescing) to {MAX_BATCH_LIMIT}"),
            ));
        }
        Ok(self.max_batch)
    }

    /// `sqlite://idemproxy.db` is relative to the working directory, `sqlite:///var/lib/x.db` absolute.
    fn validate_sqlite(&self, path: &str) -> Result<StoreConfig, ConfigError> {
        let key = "store.url";
        if path.is_empty() || path.ends_with('/') {
            return Err(ConfigError::new(
                key,
                "sqlite:// needs a file path, e.g. sqlite://idemproxy.db or sqlite:///var/lib/idemproxy/keys.db",
            ));
        }
        if path.contains('?') || path.contains('#') {
            return Err(ConfigError::new(
                key,
                "sqlite:// takes a plain file path, without query or fragment",
            ));
        }
        if self.tls_ca_file.is_some() {
            return Err(ConfigError::new(
                "store.tls_ca_file",
                "only used with a PostgreSQL store over TLS",
            ));
        }
        positive("store.timeout", self.timeout)?;
        Ok(StoreConfig {
            backend: StoreBackend::Sqlite {
                path: PathBuf::from(path),
            },
            url: self.url.clone(),
            pool_size: 1,
            max_batch: self.max_batch()?,
            timeout: self.timeout,
            on_error: self.on_error,
            migrate: self.migrate,
            tls: false,
            tls_ca_file: None,
        })
    }
}

/// Whether a PostgreSQL `store.url` asks for TLS, by the `sslmode` it writes (the last one, as the driver
/// reads it): `require` does, `disable` or none does not. Other modes are refused rather than read as
/// they are in libpq: `prefer` and `allow` would connect in clear text whenever the server does not offer
/// TLS, which an attacker on the path can arrange; `verify-ca` and `verify-full` are what `require`
/// already does here.
fn store_tls(url: &url::Url) -> Result<bool, ConfigError> {
    let mut tls = false;
    for (_, mode) in url.query_pairs().filter(|(name, _)| name == "sslmode") {
        tls = match mode.as_ref() {
            "disable" => false,
            "require" => true,
            "verify-ca" | "verify-full" => {
                return Err(ConfigError::new(
                    "store.url",
                    format!(
                        "sslmode={mode} is not read by idemproxy; write sslmode=require, which verifies \
                         the server's certificate and host name (against the system's CA certificates and \
                         store.tls_ca_file) as libpq's verify-full does"
                    ),
                ));
            }
            _ => {
                return Err(ConfigError::new(
                    "store.url",
                    format!(
                        "sslmode={mode} is not supported: it would connect in clear text whenever the \
                         server does not offer TLS; write sslmode=require for TLS (certificate and host \
                         name verified) or sslmode=disable for clear text"
                    ),
                ));
            }
        };
    }
    Ok(tls)
}

impl RawIdempotency {
    fn validate(&self) -> Result<IdempotencyConfig, ConfigError> {
        positive("idempotency.lock_timeout", self.lock_timeout)?;
        if self.ttl <= self.lock_timeout {
            return Err(ConfigError::new(
                "idempotency.ttl",
                "must be longer than idempotency.lock_timeout",
            ));
        }
        if self.scope_headers.is_empty() && self.unscoped == Unscoped::Reject {
            return Err(ConfigError::new(
                "idempotency.scope_headers",
                "is empty while idempotency.unscoped = \"reject\", so every keyed request would be refused; \
                 name the header that identifies the client (e.g. [\"authorization\"]), or set \
                 idempotency.unscoped = \"shared\" to let all clients share one scope",
            ));
        }
        if !(1..=4096).contains(&self.max_key_length) {
            return Err(ConfigError::new(
                "idempotency.max_key_length",
                "must be between 1 and 4096",
            ));
        }
        Ok(IdempotencyConfig {
            header: parse_header("idempotency.header", &self.header)?,
            methods: self.methods()?,
            required: self.required,
            ttl: self.ttl,
            lock_timeout: self.lock_timeout,
            max_key_length: self.max_key_length,
            max_request_body: self.max_request_body.as_u64(),
            max_stored_response: self.max_stored_response.as_u64(),
            scope_headers: parse_headers("idempotency.scope_headers", &self.scope_headers)?,
            fingerprint_headers: parse_headers("idempotency.fingerprint_headers", &self.fingerprint_headers)?,
            release: self.release()?,
            unscoped: self.unscoped,
            in_flight_retry_after: self.in_flight_retry_after()?,
            on_unknown_outcome: self.on_unknown_outcome,
            never_store_headers: parse_headers("idempotency.never_store_headers", &self.never_store_headers)?,
        })
    }

    fn in_flight_retry_after(&self) -> Result<Duration, ConfigError> {
        let value = self.in_flight_retry_after;
        if value < Duration::from_secs(1) || value > self.lock_timeout.max(Duration::from_secs(1)) {
            return Err(ConfigError::new(
                "idempotency.in_flight_retry_after",
                "must be from 1s (Retry-After counts whole seconds) to idempotency.lock_timeout",
            ));
        }
        Ok(value)
    }

    fn methods(&self) -> Result<Vec<Method>, ConfigError> {
        let key = "idempotency.methods";
        self.methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| ConfigError::new(key, format!("{m:?} is not an HTTP method")))
            })
            .collect()
    }

    fn release(&self) -> Result<ReleasePolicy, ConfigError> {
        let key = "idempotency.release_statuses";
        let mut policy = ReleasePolicy {
            server_errors: false,
            codes: Vec::new(),
        };
        for entry in &self.release_statuses {
            if entry.eq_ignore_ascii_case("5xx") {
                policy.server_errors = true;
                continue;
            }
            match entry.parse::<u16>() {
                Ok(code) if (100..=599).contains(&code) => policy.codes.push(code),
                _ => {
                    return Err(ConfigError::new(
                        key,
                        format!("{entry:?} is neither \"5xx\" nor a status code"),
                    ));
                }
            }
        }
        Ok(policy)
    }
}

fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| ConfigError::new(key, format!("{value:?} is not an address like 0.0.0.0:8080")))
}

fn parse_header(key: &str, value: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(value.as_bytes())
        .map_err(|_| ConfigError::new(key, format!("{value:?} is not a header name")))
}

fn parse_headers(key: &str, values: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    values.iter().map(|v| parse_header(key, v)).collect()
}

fn positive(key: &str, value: Duration) -> Result<Duration, ConfigError> {
    if value.is_zero() {
        return Err(ConfigError::new(key, "must be greater than zero"));
    }
    Ok(value)
}

fn within(key: &str, value: usize, range: std::ops::RangeInclusive<usize>) -> Result<usize, ConfigError> {
    if !range.contains(&value) {
        return Err(ConfigError::new(
            key,
            format!("must be between {} and {}", range.start(), range.end()),
        ));
    }
    Ok(value)
}

/// Replaces the password of a URL with `***`; leaves anything unparsable alone.
pub fn mask_url_password(raw: &str) -> String {
    match url::Url::parse(raw) {
        Ok(mut url) if url.password().is_some() => {
            let _ = url.set_password(Some("***"));
            url.to_string()
        }
        _ => raw.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD as BASE64;

    use super::*;

    #[test]
    fn defaults_validate() {
        let config = Config::from_toml_str("").expect("defaults are valid");
        assert_eq!(config.idempotency.lock_timeout, Duration::from_secs(30));
        assert_eq!(config.idempotency.max_request_body, 10 * 1024 * 1024);
        assert_eq!(config.idempotency.methods, vec![Method::POST, Method::PATCH]);
    }

    #[test]
    fn durations_and_sizes_parse() {
        let config = Config::from_toml_str(
            "[idempotency]\nttl = \"2h\"\nlock_timeout = \"5s\"\nmax_stored_response = \"1MiB\"\n",
        )
        .unwrap();
        assert_eq!(config.idempotency.ttl, Duration::from_secs(7200));
        assert_eq!(config.idempotency.max_stored_response, 1024 * 1024);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml_str("[store]\npool = 3\n").unwrap_err();
        assert!(err.to_string().contains("pool"), "{err}");
    }

    #[test]
    fn bad_duration_names_the_key() {
        let err = Config::from_toml_str("[idempotency]\nttl = \"forever\"\n").unwrap_err();
        assert_eq!(err.key, "idempotency.ttl");
    }

    #[test]
    fn bad_upstream_names_the_key() {
        let err = Config::from_toml_str("[upstream]\nurl = \"ftp://x\"\n").unwrap_err();
        assert_eq!(err.key, "upstream.url");
    }

    #[test]
    fn ttl_must_exceed_lease() {
        let err = Config::from_toml_str("[idempotency]\nttl = \"1s\"\nlock_timeout = \"2s\"\n").unwrap_err();
        assert_eq!(err.key, "idempotency.ttl");
    }

    #[test]
    fn release_policy_parses_classes_and_codes() {
        let config = Config::from_toml_str("[idempotency]\nrelease_statuses = [\"5xx\", \"409\"]\n").unwrap();
        let policy = &config.idempotency.release;
        assert!(policy.releases(http::StatusCode::BAD_GATEWAY));
        assert!(policy.releases(http::StatusCode::CONFLICT));
        assert!(!policy.releases(http::StatusCode::TOO_MANY_REQUESTS));
        let err = Config::from_toml_str("[idempotency]\nrelease_statuses = [\"4xx\"]\n").unwrap_err();
        assert_eq!(err.key, "idempotency.release_statuses");
    }

    #[test]
    fn the_embedded_store_is_the_default_and_its_url_is_a_file_path() {
        let default = Config::from_toml_str("").unwrap();
        assert_eq!(
            default.store.backend,
            StoreBackend::Sqlite {
                path: PathBuf::from("idemproxy.db")
            }
        );
        let absolute = Config::from_toml_str("[store]\nurl = \"sqlite:///var/lib/k.db\"\n").unwrap();
        assert_eq!(
            absolute.store.backend,
            StoreBackend::Sqlite {
                path: PathBuf::from("/var/lib/k.db")
            }
        );
        for bad in ["sqlite://", "sqlite://dir/", "sqlite://k.db?mode=ro"] {
            let err = Config::from_toml_str(&format!("[store]\nurl = \"{bad}\"\n")).unwrap_err();
            assert_eq!(err.key, "store.url", "{bad}");
        }
        let err = Config::from_toml_str("[store]\ntls_ca_file = \"/etc/hostname\"\n").unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
        let err = Config::from_toml_str("[sweeper]\nbatch_size = 0\n").unwrap_err();
        assert_eq!(err.key, "sweeper.batch_size");
    }

    #[test]
    fn store_ca_file_needs_tls_and_a_readable_file() {
        let err = Config::from_toml_str("[store]\ntls_ca_file = \"/etc/hostname\"\n").unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
        let err = Config::from_toml_str(
            "[store]\nurl = \"postgres://db/idem?sslmode=require\"\ntls_ca_file = \"/nonexistent.pem\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
        let config =
            Config::from_toml_str("[store]\nurl = \"postgres://db/idem?sslmode=require\"\n").unwrap();
        assert!(config.store.tls);
        assert!(!Config::from_toml_str("").unwrap().store.tls);
    }

    fn store_url(url: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!("[store]\nurl = \"{url}\"\n"))
    }

    #[test]
    fn sslmode_require_is_tls_and_disable_or_none_is_clear_text() {
        assert!(store_url("postgres://db/idem?sslmode=require").unwrap().store.tls);
        assert!(!store_url("postgres://db/idem?sslmode=disable").unwrap().store.tls);
        assert!(!store_url("postgres://db/idem").unwrap().store.tls);
        assert!(
            !store_url("postgres://db/idem?application_name=x")
                .unwrap()
                .store
                .tls
        );
        // The driver reads the last one; so does the check.
        assert!(
            store_url("postgres://db/idem?sslmode=disable&sslmode=require")
                .unwrap()
                .store
                .tls
        );
    }

    #[test]
    fn sslmodes_that_may_fall_back_to_clear_text_are_refused() {
        for mode in ["prefer", "allow", "Require", "bogus"] {
            let err = store_url(&format!("postgres://db/idem?sslmode={mode}")).unwrap_err();
            assert_eq!(err.key, "store.url", "{mode}");
            assert!(err.message.contains("clear text"), "{mode}: {err}");
            assert!(err.message.contains("sslmode=require"), "{mode}: {err}");
        }
        let err = store_url("postgres://db/idem?sslmode=require&sslmode=prefer").unwrap_err();
        assert_eq!(err.key, "store.url");
    }

    #[test]
    fn sslmode_verify_full_and_verify_ca_point_to_require() {
        for mode in ["verify-full", "verify-ca"] {
            let err = store_url(&format!("postgres://db/idem?sslmode={mode}")).unwrap_err();
            assert_eq!(err.key, "store.url", "{mode}");
            assert!(err.message.contains("write sslmode=require"), "{mode}: {err}");
            assert!(err.message.contains("host name"), "{mode}: {err}");
        }
    }

    #[test]
    fn listener_tls_files_are_checked_at_load() {
        let err = Config::from_toml_str(
            "[server.tls]\ncert_file = \"/nonexistent/cert.pem\"\nkey_file = \"/nonexistent/key.pem\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "server.tls.cert_file");
        let err = Config::from_toml_str(
            "[server.tls]\ncert_file = \"/etc/hostname\"\nkey_file = \"/etc/hostname\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "server.tls", "{err}");
        let err = Config::from_toml_str("[server.tls]\ncert_file = \"/etc/hostname\"\n").unwrap_err();
        assert!(err.to_string().contains("key_file"), "{err}");
    }

    #[test]
    fn a_matching_certificate_and_key_turn_tls_on_with_h2_offered_first() {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        let toml = |cert: &std::path::Path, key: &std::path::Path| {
            format!(
                "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
                cert.display().to_string(),
                key.display().to_string()
            )
        };
        let config = Config::from_toml_str(&toml(&cert_file, &key_file)).unwrap();
        let tls = config.server.tls.expect("TLS is on");
        assert_eq!(tls.alpn_protocols, vec![b"h2".to_vec(), b"http/1.1".to_vec()]);
        assert!(Config::from_toml_str("").unwrap().server.tls.is_none());
        let swapped = Config::from_toml_str(&toml(&key_file, &cert_file)).unwrap_err();
        assert_eq!(swapped.key, "server.tls", "{swapped}");
    }

    #[test]
    fn client_bounds_parse_and_bad_ones_name_the_key() {
        let config = Config::from_toml_str(
            "[server]\nheader_read_timeout = \"2s\"\nbody_read_timeout = \"5s\"\n\
             max_header_size = \"32KiB\"\nmax_headers = 20\nmax_connections = 10\n",
        )
        .unwrap();
        assert_eq!(config.server.header_read_timeout, Duration::from_secs(2));
        assert_eq!(config.server.body_read_timeout, Duration::from_secs(5));
        assert_eq!(config.server.max_header_size, 32 * 1024);
        assert_eq!(
            (config.server.max_headers, config.server.max_connections),
            (20, 10)
        );
        for (text, key) in [
            ("header_read_timeout = \"0s\"", "server.header_read_timeout"),
            ("body_read_timeout = \"0s\"", "server.body_read_timeout"),
            ("max_header_size = \"1KiB\"", "server.max_header_size"),
            ("max_headers = 0", "server.max_headers"),
            ("max_connections = 0", "server.max_connections"),
            ("max_buffered_bodies = \"1MiB\"", "server.max_buffered_bodies"),
            ("workers = 0", "server.workers"),
            ("workers = 1025", "server.workers"),
        ] {
            let err = Config::from_toml_str(&format!("[server]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn workers_default_to_the_available_cores() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(Config::from_toml_str("").unwrap().server.workers, cores);
        let config = Config::from_toml_str("[server]\nworkers = 3\n").unwrap();
        assert_eq!(config.server.workers, 3);
    }

    #[test]
    fn an_empty_scope_is_refused_unless_scopes_may_be_shared() {
        let err = Config::from_toml_str("[idempotency]\nscope_headers = []\n").unwrap_err();
        assert_eq!(err.key, "idempotency.scope_headers");
        assert!(err.to_string().contains("unscoped"), "{err}");
        let shared =
            Config::from_toml_str("[idempotency]\nscope_headers = []\nunscoped = \"shared\"\n").unwrap();
        assert_eq!(shared.idempotency.unscoped, Unscoped::Shared);
        assert_eq!(
            Config::from_toml_str("").unwrap().idempotency.unscoped,
            Unscoped::Reject
        );
    }

    #[test]
    fn guarantee_settings_have_safe_defaults_and_named_errors() {
        let config = Config::from_toml_str("[server]\nmax_connections = 100\nworkers = 3\n").unwrap();
        assert_eq!(config.idempotency.in_flight_retry_after, Duration::from_secs(1));
        assert_eq!(config.idempotency.on_unknown_outcome, OnUnknownOutcome::Retry);
        assert_eq!(
            config.idempotency.never_store_headers,
            vec![http::header::SET_COOKIE]
        );
        assert_eq!(config.server.write_timeout, Duration::from_secs(30));
        assert_eq!(config.server.max_keyed_in_flight, 100);
        assert_eq!(
            config.upstream.max_connections, 34,
            "100 connections over 3 workers"
        );
        for (text, key) in [
            (
                "[idempotency]\nin_flight_retry_after = \"500ms\"",
                "idempotency.in_flight_retry_after",
            ),
            (
                "[idempotency]\nin_flight_retry_after = \"40s\"",
                "idempotency.in_flight_retry_after",
            ),
            (
                "[idempotency]\non_unknown_outcome = \"maybe\"",
                "idempotency.on_unknown_outcome",
            ),
            (
                "[idempotency]\nnever_store_headers = [\"a b\"]",
                "idempotency.never_store_headers",
            ),
            ("[server]\nwrite_timeout = \"0s\"", "server.write_timeout"),
            ("[server]\nmax_keyed_in_flight = 0", "server.max_keyed_in_flight"),
            (
                "[server]\nmax_buffered_responses = \"1MiB\"",
                "server.max_buffered_responses",
            ),
            ("[upstream]\nmax_connections = 0", "upstream.max_connections"),
        ] {
            let err = Config::from_toml_str(text).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn password_is_masked() {
        assert_eq!(
            mask_url_password("postgres://app:s3cret@db:5432/idem"),
            "postgres://app:***@db:5432/idem"
        );
        let config = Config::from_toml_str("[store]\nurl = \"postgres://app:s3cret@db/idem\"\n").unwrap();
        assert!(!config.to_masked_toml().contains("s3cret"));
    }

    // `[encryption]`

    fn raw(active: Option<&str>, keys: &[(&str, &str)], accept_plaintext: bool) -> RawEncryption {
        RawEncryption {
            active_key: active.map(str::to_owned),
            keys: keys.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            accept_plaintext,
        }
    }

    #[test]
    fn config_errors_name_the_key() {
        let short = BASE64.encode([0u8; 16]);
        let good = BASE64.encode([0u8; 32]);
        let cases = [
            (raw(Some("k1"), &[("k1", &short)], false), "encryption.keys.k1"),
            (
                raw(Some("k1"), &[("k1", "not base64!")], false),
                "encryption.keys.k1",
            ),
            (raw(Some("k2"), &[("k1", &good)], false), "encryption.active_key"),
            (raw(Some("k1"), &[], false), "encryption.active_key"),
            (raw(None, &[("bad id", &good)], false), "encryption.keys.bad id"),
        ];
        for (raw, key) in cases {
            let err = raw.validate().unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(!err.to_string().contains(&good), "{err}");
        }
        assert!(raw(None, &[], false).validate().unwrap().is_none());
    }

    #[test]
    fn keys_are_decoded_and_plaintext_is_accepted_while_no_key_is_active() {
        let (k1, k2) = (BASE64.encode([7u8; 32]), BASE64.encode([9u8; 32]));
        let padded = format!(" {k1}\n");
        let config = raw(Some("k2"), &[("k1", &padded), ("k2", &k2)], false)
            .validate()
            .unwrap()
            .unwrap();
        assert_eq!(config.active_key(), Some("k2"));
        let keys: Vec<_> = config.keys().map(|(id, key)| (id, *key.bytes())).collect();
        assert_eq!(keys, vec![("k1", [7u8; 32]), ("k2", [9u8; 32])]);
        assert!(!config.accept_plaintext());
        let reading = raw(None, &[("k1", &k1)], false).validate().unwrap().unwrap();
        assert!(
            reading.accept_plaintext(),
            "no active key: new records are in clear"
        );
        assert!(!format!("{config:?}").contains("7, 7"), "{config:?}");
    }

    #[test]
    fn key_ids_are_short_and_plain() {
        assert!(is_key_id("k-1_B"));
        for bad in ["", "a b", "k/1", &"a".repeat(65)] {
            assert!(!is_key_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_section_is_read_from_toml_and_its_keys_are_masked_when_printed() {
        let key = BASE64.encode([1u8; 32]);
        let config = Config::from_toml_str(&format!(
            "[encryption]\nactive_key = \"k1\"\nkeys = {{ k1 = \"{key}\" }}\n"
        ))
        .unwrap();
        assert_eq!(config.encryption.as_ref().unwrap().active_key(), Some("k1"));
        assert!(!config.to_masked_toml().contains(&key));
        assert!(Config::from_toml_str("").unwrap().encryption.is_none());
    }
}
