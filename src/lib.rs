//! idemproxy: an idempotency sidecar. A reverse proxy that executes each keyed request at most once and
//! replays the stored response to every retry.
//!
//! The request's path, one file per step (`docs/LIFECYCLE.md` walks it in full):
//!
//! - `server.rs` accepts connections and hands each to a worker thread (`server.workers`), serving
//!   HTTP/1.1 and HTTP/2, cleartext or TLS (as `config/server.rs` loaded it), and drains them at
//!   shutdown; `server/socket.rs` is the TCP or unix socket it accepts from, `server/cert_reload.rs`
//!   swaps in a changed TLS certificate, `server/slots.rs` caps the connections,
//!   `server/write_deadline.rs` lets go of clients that stop reading;
//! - `proxy.rs` is the spine: it routes each request, once `proxy/path.rs` has brought its path to its
//!   one spelling (or refused it), and composes the stages, each a struct in its own file holding only
//!   what it uses, which call one another in one order (spine → wait → claim → execute, forward,
//!   intake → settle): a request the proxy does not protect goes to `proxy/passthrough.rs` (`Forward`);
//!   a keyed one to `proxy/intake.rs` (`Intake`: scope check, the body read whole, key, scope and
//!   fingerprint by `proxy/key.rs`, the claim with its lease; on a route with a `signature`,
//!   `proxy/signature.rs` verifies the sender's webhook signature first) → `proxy/cache.rs` (retries
//!   answered from memory) → on the request's own task `proxy/wait.rs` (`Waits`) → `proxy/claim.rs`
//!   (`Claims`: the claim statement and the decision table) → either `proxy/replay.rs`, or
//!   `proxy/execute.rs` (`Executor`): the won claim's execution, with its heartbeat, the upstream call
//!   (`proxy/upstream.rs`, its pool and `proxy/upstream/connect.rs`: TCP, TLS or a unix socket), the
//!   relay and capture, and the fenced completion, after which `proxy/settle.rs` (`Settle`) wakes
//!   whoever waits for the record; on a route that waits, a key in flight stays in `proxy/wait.rs`,
//!   which waits for the original and claims again;
//! - `store.rs` is the store contract (`store/handle.rs` times every call to it); `store/postgres.rs` (replicas; its claim, completion, statement
//!   runner, TLS and migrations each in a file under `store/postgres/`), `store/redis.rs` (a Redis server or
//!   cluster, its scripts under `store/redis/lua/`) or `store/sqlite.rs` (embedded, the default; its
//!   file, blocking bridge and statements under `store/sqlite/`) holds the key table,
//!   `store/coalesce.rs` batches what arrives together, `store/encrypted.rs` seals stored responses
//!   around any backend, `store/open.rs` opens it (at start waiting out a server that cannot be had yet)
//!   and says what it can do, `store/list.rs` pages through records, `store/sweeper.rs` deletes expired
//!   records in the background, `store/wake.rs` wakes waiting requests in this process, and
//!   `store/listen.rs` announces settlements to the other replicas and listens for theirs (PostgreSQL's
//!   `NOTIFY` in `store/postgres/listen.rs`, Redis's `PUBLISH` in `store/redis/listen.rs`);
//! - `error.rs` turns failures into problem+json; `body.rs`, `headers.rs` and `error_chain.rs` are what
//!   every layer may use (the body type, the header names the proxy writes, an error on one line);
//! - `admin.rs` serves `/metrics` (every name in `metrics.rs`, which depends on nothing else here),
//!   `/healthz`, `/readyz`; `cmd/health.rs` is `idemproxy health`, the probe of those two for a container;
//! - `access.rs` writes the access log (`log.access`): one line per request, with the time it spent in
//!   the store and upstream; `proxy/trace_context.rs` reads the caller's W3C `traceparent`; `otlp.rs`
//!   makes the request's trace spans and `otlp/export.rs` sends them over OTLP (`traces.enabled`);
//! - `config.rs` loads the configuration, one file per section under `config/` (`config/tls.rs` reads
//!   every PEM file); `cmd.rs` is the command line, with the operator's commands beside it;
//!   `shutdown.rs` turns signals into cancellation (and hands SIGHUP to `reload.rs`, which reads the
//!   configuration again, as `POST /-/reload` and `cmd/reload.rs` ask it to, and gives every worker a
//!   new generation of the request path through `server/generations.rs`); `logging.rs` sets up the log lines; `cmd/keys.rs` is the operator's runbook
//!   (`idemproxy keys ...`: `cmd/keys/client.rs` finds a client's scope from its credential,
//!   `cmd/keys/list.rs` pages through records, `cmd/keys/forget.rs` deletes one); `demo.rs` is
//!   `idemproxy demo-upstream`, a service to try the proxy on.

#![forbid(unsafe_code)]
#![deny(clippy::print_stdout)]
#![warn(missing_docs)]

pub mod access;
pub mod admin;
pub mod body;
pub mod cmd;
pub mod config;
pub mod conformance;
pub mod demo;
pub mod error;
pub mod error_chain;
pub mod headers;
pub mod jwks;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod otlp;
pub mod proxy;
pub mod reload;
pub mod server;
pub mod shutdown;
pub mod store;

use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;

use crate::admin::Admin;
use crate::config::ListenAddr;
use crate::jwks::KeySets;
use crate::metrics::Metrics;
use crate::proxy::Grounds;
use crate::reload::Reload;
use crate::server::Generations;
use crate::shutdown::Hangups;
use crate::store::StoreError;
use crate::store::wake::Waiters;

/// The bound sockets `run` serves on; bind them first so callers (and tests) can use port 0.
pub struct Listeners {
    /// The proxy listener: TCP (`TcpListener::into`) or a unix socket.
    pub proxy: server::ProxySocket,
    /// The admin listener (TCP only).
    pub admin: TcpListener,
}

impl Listeners {
    /// Binds both addresses of the configuration. A unix socket's file is made with
    /// `server.socket_mode`, after removing a stale one nothing listens on. A failure names the
    /// listener's key and address and says what to do.
    pub async fn bind(config: &Config) -> Result<Listeners, BindError> {
        let listen = &config.server.listen;
        let proxy = match listen {
            ListenAddr::Tcp(addr) => TcpListener::bind(addr).await.map(Into::into),
            ListenAddr::Unix { path, mode } => server::ProxySocket::bind_unix(path, *mode),
        };
        let proxy = proxy.map_err(|error| BindError::new(Listener::Proxy, listen.to_string(), error))?;
        let admin_addr = config.server.admin_listen;
        let admin = TcpListener::bind(admin_addr)
            .await
            .map_err(|error| BindError::new(Listener::Admin, admin_addr.to_string(), error))?;
        Ok(Listeners { proxy, admin })
    }
}

/// The listeners the proxy binds at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The proxy's own port (`server.listen`).
    Proxy,
    /// `/metrics`, `/healthz`, `/readyz` (`server.admin_listen`).
    Admin,
}

impl Listener {
    /// Its configuration key.
    pub fn key(self) -> &'static str {
        match self {
            Listener::Proxy => "server.listen",
            Listener::Admin => "server.admin_listen",
        }
    }

    /// The ways to set it: flag and variable.
    fn settings(self) -> &'static str {
        match self {
            Listener::Proxy => "--listen or IDEMPROXY_SERVER__LISTEN",
            Listener::Admin => "--admin-listen or IDEMPROXY_SERVER__ADMIN_LISTEN",
        }
    }
}

/// A listener that could not be bound: which one, where, why, and what to do.
#[derive(Debug)]
pub struct BindError {
    /// Which listener.
    pub listener: Listener,
    /// The address it was to listen on, as configured.
    pub address: String,
    /// What the system said.
    pub error: std::io::Error,
}

impl std::fmt::Display for BindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot listen on {} = {} ({}): {}; {}",
            self.listener.key(),
            self.address,
            self.listener_name(),
            self.error,
            self.advice()
        )
    }
}

impl std::error::Error for BindError {}

impl BindError {
    fn new(listener: Listener, address: String, error: std::io::Error) -> BindError {
        BindError {
            listener,
            address,
            error,
        }
    }

    fn listener_name(&self) -> &'static str {
        match self.listener {
            Listener::Proxy => "the proxy listener",
            Listener::Admin => "the admin listener: /metrics, /healthz, /readyz",
        }
    }

    /// What to do about it.
    fn advice(&self) -> String {
        let key = self.listener.key();
        let settings = self.listener.settings();
        match self.error.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                "another process is listening there (another idemproxy, or the app itself?): stop it, or \
                 give {key} a free port ({settings})"
            ),
            std::io::ErrorKind::PermissionDenied => format!(
                "ports below 1024 need privileges: use a port of 1024 or above in {key} ({settings}), or \
                 grant the process CAP_NET_BIND_SERVICE"
            ),
            std::io::ErrorKind::AddrNotAvailable => format!(
                "no network interface of this machine has that address: use 0.0.0.0 (every interface), \
                 127.0.0.1, or one of this machine's addresses in {key} ({settings})"
            ),
            // EMFILE, ENFILE: no address is wrong; the process has no descriptor left for the socket.
            _ if matches!(self.error.raw_os_error(), Some(23 | 24)) => format!(
                "the open files limit (RLIMIT_NOFILE) is used up before {key} could be bound: raise it \
                 (`ulimit -n`, LimitNOFILE= in the systemd unit; docs/operations.md, \"Open files\")"
            ),
            _ => format!("check {key} ({settings})"),
        }
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
/// opens once it answers (`store/open.rs`).
pub async fn run(config: Config, listeners: Listeners, shutdown: CancellationToken) -> Result<(), RunError> {
    serve(config, listeners, shutdown, None).await
}

/// [`run`], and at each SIGHUP meanwhile, `reload` reads the configuration again (`reload.rs`).
pub async fn run_reloading(
    config: Config,
    listeners: Listeners,
    shutdown: CancellationToken,
    reload: Reload,
) -> Result<(), RunError> {
    serve(config, listeners, shutdown, Some(reload)).await
}

async fn serve(
    config: Config,
    listeners: Listeners,
    shutdown: CancellationToken,
    reload: Option<Reload>,
) -> Result<(), RunError> {
    announce_config(&config);
    let metrics = Metrics::new();
    limits::apply(&config, &metrics);
    // Heard from now on, not once the store is open: a SIGHUP meanwhile waits for the reload task.
    let hangups = reload.as_ref().map(|_| Hangups::listen());
    let tracker = TaskTracker::new();
    let waiters = Waiters::new();
    let serving = store::serve(&config, &waiters, &metrics, &tracker, &shutdown).await?;
    let key_sets = KeySets::of(&config);
    key_sets.spawn_refresh(&shutdown);
    let grounds = Grounds::new(
        &config,
        &serving,
        metrics.clone(),
        (tracker, waiters),
        shutdown.clone(),
    );
    let generations = Generations::new(&grounds.proxy(&config, &key_sets), config.server.workers);
    let key_sets = Arc::new(ArcSwap::new(key_sets));
    let certificates = Arc::new(tokio::sync::Notify::new());
    let mut admin =
        Admin::new(metrics.clone(), serving.store, shutdown.clone()).waiting_for_keys(key_sets.clone());
    tracing::info!(addr = %listeners.proxy.local_addr()?, upstream = %config.upstream.address, "proxy listening");
    tracing::info!(addr = %listeners.admin.local_addr()?, "admin listening");
    let proxy = server::ProxyListener {
        listener: listeners.proxy,
        tls: config.server.tls.clone(),
        limits: server::Limits::from(&config.server),
        generations: generations.clone(),
        certificates: certificates.clone(),
    };
    let grace = config.server.shutdown_grace;
    if let (Some(reload), Some(hangups)) = (reload, hangups) {
        let (asks, heard) = admin::reload_channel();
        admin = admin.reloading(asks);
        let running = reload::Running {
            config,
            grounds,
            generations,
            key_sets,
            certificates,
            metrics,
        };
        reload.spawn((hangups, heard), running, shutdown.clone());
    }
    server::serve(proxy, listeners.admin, admin, shutdown, grace)
        .await
        .map_err(RunError::Workers)
}

/// Logs what a reader of the start-up log should know about the configuration: the Kubernetes
/// service-link variables left out of it, and each risky setting `check-config` warns about.
fn announce_config(config: &Config) {
    if !config.service_links.is_empty() {
        tracing::info!(
            variables = %config.service_links.join(","),
            "ignoring Kubernetes service-link variables: a Service named idemproxy makes Kubernetes set \
             them in every pod; they are not configuration (enableServiceLinks: false leaves them out)"
        );
    }
    for warning in config.warnings() {
        tracing::warn!(key = %warning.key, "{}", warning.message);
    }
    for note in config.notes() {
        tracing::info!(key = %note.key, "{}", note.message);
    }
}

/// Applies pending migrations and reports how many were applied.
pub async fn migrate(config: &Config) -> Result<usize, StoreError> {
    store::migrate(&config.store).await
}
