//! idemproxy: an idempotency sidecar. A reverse proxy that executes each keyed request at most once and
//! replays the stored response to every retry.
//!
//! The request's path, one file per step (`docs/LIFECYCLE.md` walks it in full):
//!
//! - `server.rs` accepts connections and hands each to a worker thread (`server.workers`), serving
//!   HTTP/1.1 and HTTP/2, cleartext or TLS (as `config/server.rs` loaded it), and drains them at
//!   shutdown; `server/listener.rs` is the TCP or unix socket it accepts from, `server/cert_reload.rs`
//!   swaps in a changed TLS certificate, `server/slots.rs` caps the connections,
//!   `server/write_deadline.rs` lets go of clients that stop reading;
//! - `proxy.rs` routes each request, once `proxy/path.rs` has brought its path to its one spelling (or
//!   refused it): a request the proxy does not protect goes to `proxy/passthrough.rs`;
//!   a keyed one to `proxy/key.rs` (key, scope, fingerprint) → `proxy/intake.rs` (scope check, the body
//!   read whole, the claim with its lease; on a route with a `signature`, `proxy/signature.rs` verifies
//!   the sender's webhook signature first) → `proxy/cache.rs` (retries answered from memory) →
//!   `proxy/claim.rs` (the claim statement on the request's own task, and the decision table) → either
//!   `proxy/replay.rs`, or `proxy/execute.rs`: the won claim's whole task, with its heartbeat, the
//!   upstream call (`proxy/upstream.rs`, its pool and `proxy/upstream/connect.rs`: TCP, TLS or a unix
//!   socket), the relay and capture, and the fenced completion; on a route that waits, a key in flight
//!   goes to `proxy/wait.rs`, which waits for the original and claims again;
//! - `store.rs` is the store contract; `store/postgres.rs` (replicas; its claim, completion, statement
//!   runner and migrations each in a file under `store/postgres/`), `store/redis_store.rs` (a Redis server or
//!   cluster, its scripts under `store/redis_store/lua/`) or `store/sqlite.rs` (embedded, the default) holds
//!   the key table, `store/coalesce.rs` batches what arrives together,
//!   `store/encrypted.rs` seals stored responses around any backend, `store/opening.rs` opens it at
//!   start (waiting out a server that cannot be had yet), `store/sweeper.rs` deletes
//!   expired records in the background, and `store/notify.rs` wakes waiting requests (fed across
//!   replicas by `store/postgres/listen.rs`);
//! - `error.rs` turns failures into problem+json; `body.rs`, `headers.rs` and `error_chain.rs` are what
//!   every layer may use (the body type, the header names the proxy writes, an error on one line);
//! - `admin.rs` serves `/metrics` (every name in `metrics.rs`, which depends on nothing else here),
//!   `/healthz`, `/readyz`; `health.rs` is `idemproxy health`, the probe of those two for a container;
//! - `access.rs` writes the access log (`log.access`): one line per request, with the time it spent in
//!   the store and upstream; `proxy/trace_context.rs` reads the caller's W3C `traceparent`;
//! - `config.rs` loads the configuration, one file per section under `config/` (`config/tls.rs` reads
//!   every PEM file); `cli.rs` is the command line; `tls.rs` holds the store's TLS client settings;
//!   `shutdown.rs` turns signals into cancellation; `keys.rs` is the operator's runbook
//!   (`idemproxy keys ...`); `demo.rs` is `idemproxy demo-upstream`, a service to try the proxy on.

#![forbid(unsafe_code)]
#![deny(clippy::print_stdout)]
#![warn(missing_docs)]

pub mod access;
pub mod admin;
pub mod body;
pub mod cli;
pub mod config;
pub mod demo;
pub mod error;
pub mod error_chain;
pub mod headers;
pub mod health;
pub mod keys;
pub mod metrics;
pub mod proxy;
pub mod server;
pub mod shutdown;
pub mod store;
pub mod tls;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;

use crate::admin::Admin;
use crate::config::ListenAddr;
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use crate::store::StoreError;
use crate::store::notify::Waiters;

/// The bound sockets `run` serves on; bind them first so callers (and tests) can use port 0.
pub struct Listeners {
    /// The proxy listener: TCP (`TcpListener::into`) or a unix socket.
    pub proxy: server::ProxySocket,
    /// The admin listener (TCP only).
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds both addresses of the configuration. A unix socket's file is made with
    /// `server.socket_mode`, after removing a stale one nothing listens on.
    pub async fn bind(config: &Config) -> std::io::Result<Listeners> {
        let proxy = match &config.server.listen {
            ListenAddr::Tcp(addr) => TcpListener::bind(addr).await?.into(),
            ListenAddr::Unix { path, mode } => server::ProxySocket::bind_unix(path, *mode)?,
        };
        Ok(Listeners {
            proxy,
            admin: TcpListener::bind(config.server.admin_listen).await?,
        })
    }
}

/// Why `run` could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The store could not be set up or migrated.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A listener's address could not be read.
    #[error("listener: {0}")]
    Listener(#[from] std::io::Error),
    /// The worker threads could not be started.
    #[error("cannot start the worker threads: {0}")]
    Workers(std::io::Error),
}

/// Runs the proxy until `shutdown` is cancelled, then drains in-flight work within `server.shutdown_grace`.
/// Applies pending migrations first unless `store.migrate` is off; a PostgreSQL server that cannot be had
/// yet does not stop the start: the proxy serves, keyed requests follow `store.on_error`, and the store
/// opens once it answers (`store/opening.rs`).
pub async fn run(config: Config, listeners: Listeners, shutdown: CancellationToken) -> Result<(), RunError> {
    let metrics = Metrics::new();
    let tracker = TaskTracker::new();
    let waiters = Waiters::new();
    let store = store::serve(&config, &waiters, &metrics, &tracker, &shutdown).await?;
    let proxy = Proxy::new(
        &config,
        store.clone(),
        metrics.clone(),
        tracker,
        waiters,
        shutdown.clone(),
    );
    let admin = Admin::new(metrics, store, shutdown.clone());
    tracing::info!(addr = %listeners.proxy.local_addr()?, upstream = %config.upstream.address, "proxy listening");
    tracing::info!(addr = %listeners.admin.local_addr()?, "admin listening");
    let proxy = server::ProxyListener {
        listener: listeners.proxy,
        tls: config.server.tls.clone(),
        limits: server::Limits::from(&config.server),
        workers: config.server.workers,
        proxy,
    };
    server::serve(
        proxy,
        listeners.admin,
        admin,
        shutdown,
        config.server.shutdown_grace,
    )
    .await
    .map_err(RunError::Workers)
}

/// Applies pending migrations and reports how many were applied.
pub async fn migrate(config: &Config) -> Result<usize, StoreError> {
    store::migrate(&config.store).await
}
