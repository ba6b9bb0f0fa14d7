//! Opening the store, once for each process: `serve`'s store from start until it opens and what runs
//! beside it from then on ([`serve`]), an operator tool's ([`open`]), and `idemproxy migrate`'s
//! ([`migrate`]). The one place that knows which backend the configuration names: what it can do is
//! handed up as [`Capabilities`], so nothing above `store/` asks which backend it is. `serve`'s opening
//! runs once at start and, while a PostgreSQL server cannot be had for the migrations, as one background
//! task on the task tracker that shutdown ends. Touches the store handle (it installs the opened store),
//! the `idemproxy_store_opened` gauge and the log, and starts the sweeper and the wait listener.
//!
//! A store that cannot be had at start does not stop the proxy. The handle starts unopened: every keyed
//! request is answered as while any store is down (`store.on_error`), unkeyed requests flow, and
//! `/readyz` says the store is not open. The migrations are tried again, with a wait that doubles from
//! [`RETRY_FIRST`] to [`RETRY_MAX`] and is jittered, until they apply; then the store is installed, and
//! the next keyed request is protected. Only what waiting may mend is waited out at start (a server that
//! cannot be reached, is out of connections, is starting or stopping, or another replica's migration lock
//! held past `store.timeout`); a server that answers and refuses (credentials, rights, a failing
//! migration) stops the start as before. Once the proxy serves, it keeps trying whatever the cause.
//!
//! A store with nothing to prepare on its server opens at once: Redis, or PostgreSQL without
//! `store.migrate`, whose connections open at first use. The embedded SQLite store is a local file: it
//! opens (and migrates) at once, or the start fails.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::encrypted::EncryptedStore;
use super::postgres::{PostgresStore, Unmigrated};
use super::redis::RedisStore;
use super::sqlite::{self, SqliteStore};
use super::wake::Waiters;
use super::{Capabilities, Listens, Store, StoreError, StoreHandle, WaitListener};
use crate::config::{Config, StoreBackend, StoreConfig};
use crate::metrics::Metrics;

/// The step of the first wait before the migrations are tried again; each step doubles up to
/// [`RETRY_MAX`]. A wait is a random point in the upper half of its step, so replicas started together,
/// or turned away together by a full server, come back apart.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A task that runs beside the open store until shutdown.
type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

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

/// `serve`'s store as [`serve`] returns it: its handle, open or still opening, and what the store can do.
#[derive(Clone)]
pub struct Serving {
    /// The store as the request path uses it.
    pub store: StoreHandle,
    /// What the store does beside claims.
    pub capabilities: Capabilities,
}

/// Opens the store for `serve` and returns its handle, open or still opening (see the module's header),
/// with its capabilities. `waiters` are woken by the wait listener; background work goes on `tracker` and
/// ends with `shutdown`.
pub async fn serve(
    config: &Config,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<Serving, StoreError> {
    let Built { store, migrate } = build(&config.store, Purpose::Serve).await?;
    let capabilities = Capabilities::of(&config.store);
    let handle = StoreHandle::unopened(metrics.clone());
    let opened = Opened {
        store: EncryptedStore::wrap(store, config.encryption.as_ref(), metrics),
        beside: beside(config, &capabilities, &handle, waiters, metrics, shutdown),
        handle: handle.clone(),
        metrics: metrics.clone(),
        tracker: tracker.clone(),
    };
    let serving = Serving {
        store: handle,
        capabilities,
    };
    if !migrate {
        opened.install();
        tracker.spawn(answers_at_start(serving.store.clone()));
        return Ok(serving);
    }
    match PostgresStore::try_migrate(&config.store).await {
        Ok(applied) => {
            tracing::info!(applied, "store schema is up to date");
            opened.install();
        }
        Err(Unmigrated::Refused(error)) => return Err(error),
        Err(unavailable) => {
            let mut retries = Backoff::default();
            let wait = retries.next();
            not_open(1, &unavailable, wait);
            let config = config.store.clone();
            tracker.spawn(keep_migrating(config, opened, retries, wait, shutdown.clone()));
        }
    }
    Ok(serving)
}

impl Capabilities {
    /// The capabilities of the store `config` names.
    pub fn of(config: &StoreConfig) -> Capabilities {
        match &config.backend {
            StoreBackend::Postgres => Capabilities {
                shared: true,
                self_expiring: false,
                listener: Some(WaitListener(Listens::Postgres)),
            },
            StoreBackend::Redis(target) => Capabilities {
                shared: true,
                self_expiring: true,
                listener: Some(WaitListener(Listens::Redis(target.clone()))),
            },
            StoreBackend::Sqlite { .. } => Capabilities {
                shared: false,
                self_expiring: false,
                listener: None,
            },
        }
    }
}

impl WaitListener {
    /// Hears other replicas' settlements on the store `config` names and wakes `waiters`, until `shutdown`.
    pub async fn run(
        self,
        config: StoreConfig,
        waiters: Arc<Waiters>,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) {
        match self.0 {
            Listens::Postgres => super::postgres::listen(config, waiters, metrics, shutdown).await,
            Listens::Redis(target) => super::redis::listen(config, target, waiters, metrics, shutdown).await,
        }
    }
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
        StoreBackend::Redis(target) => Arc::new(RedisStore::connect(config, target)),
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

/// The opened store, and what to do once it is there.
struct Opened {
    store: Arc<dyn Store>,
    handle: StoreHandle,
    beside: Vec<Task>,
    metrics: Metrics,
    tracker: TaskTracker,
}

impl Opened {
    /// Puts the store behind the handle, and starts what runs beside it.
    fn install(self) {
        self.handle.install(self.store);
        self.metrics.store_opened.set(1);
        for task in self.beside {
            self.tracker.spawn(task);
        }
    }
}

/// Asks a store with nothing to migrate (Redis, or PostgreSQL with `store.migrate = false`) once at
/// start whether it answers, so that an unreachable server, a refused login or a missing permission is
/// said at start, with the server's reason and the fix, and not first at the first keyed request.
async fn answers_at_start(store: StoreHandle) {
    if let Err(error) = store.ping().await {
        tracing::warn!(
            error = %crate::config::mask_passwords(&error.to_string()),
            "the store does not answer at start; keyed requests follow store.on_error until it does"
        );
    }
}

/// Tries the migrations again after each `wait` until they apply (then installs the store) or shutdown.
async fn keep_migrating(
    config: StoreConfig,
    opened: Opened,
    mut retries: Backoff,
    mut wait: Duration,
    shutdown: CancellationToken,
) {
    for attempt in 2.. {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.cancelled() => return,
        }
        // Cancelled mid-way, the migration's connection closes: its transaction rolls back and the
        // migration lock is let go.
        let tried = tokio::select! {
            tried = PostgresStore::try_migrate(&config) => tried,
            _ = shutdown.cancelled() => return,
        };
        match tried {
            Ok(applied) => {
                tracing::info!(
                    applied,
                    attempt,
                    "store open and its schema up to date: keyed requests are protected from now on"
                );
                opened.install();
                return;
            }
            Err(unmigrated) => {
                wait = retries.next();
                not_open(attempt, &unmigrated, wait);
            }
        }
    }
}

/// Says once per attempt why the store is not open. The cause is the driver's or the server's text,
/// which never holds the URL's password.
fn not_open(attempt: u64, unmigrated: &Unmigrated, retry_in: Duration) {
    match unmigrated {
        Unmigrated::Unavailable(error) => tracing::warn!(
            attempt,
            %error,
            ?retry_in,
            "store not open yet; keyed requests follow store.on_error until it opens"
        ),
        Unmigrated::Refused(error) => tracing::error!(
            attempt,
            %error,
            ?retry_in,
            "store refused its migrations; keyed requests follow store.on_error until they apply"
        ),
    }
}

/// What runs beside the open store: the sweeper, unless the store expires records itself, and the
/// listener for other replicas' settlements, on a shared store when some route waits.
fn beside(
    config: &Config,
    capabilities: &Capabilities,
    store: &StoreHandle,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Vec<Task> {
    let mut tasks: Vec<Task> = Vec::new();
    if config.sweeper.enabled && !capabilities.self_expiring {
        tasks.push(Box::pin(super::sweeper::run(
            store.clone(),
            config.sweeper.clone(),
            metrics.clone(),
            shutdown.clone(),
        )));
    }
    tasks.extend(wait_listener(config, capabilities, waiters, metrics, shutdown));
    tasks
}

/// The listener that wakes this process's waiting requests when another replica settles their keys:
/// only on a shared store (an embedded store has no other replica) and only when some route waits.
fn wait_listener(
    config: &Config,
    capabilities: &Capabilities,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Option<Task> {
    let waits = config
        .routes
        .policies()
        .any(|policy| policy.claim.on_in_flight.waits());
    let listener = capabilities.listener.clone().filter(|_| waits)?;
    Some(Box::pin(listener.run(
        config.store.clone(),
        waiters.clone(),
        metrics.clone(),
        shutdown.clone(),
    )))
}

/// The waits between attempts: capped exponential steps, each wait jittered within its step's upper half.
#[derive(Debug)]
struct Backoff {
    step: Duration,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff { step: RETRY_FIRST }
    }
}

impl Backoff {
    fn next(&mut self) -> Duration {
        let step = self.step;
        self.step = (step * 2).min(RETRY_MAX);
        let half = step / 2;
        half + half.mul_f64(fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_from_the_first_step_to_the_cap_each_in_its_steps_upper_half() {
        let mut retries = Backoff::default();
        let steps_ms = [200, 400, 800, 1600, 3200, 5000, 5000, 5000];
        for step in steps_ms.map(Duration::from_millis) {
            let wait = retries.next();
            assert!(
                wait >= step / 2 && wait <= step,
                "{wait:?} outside the upper half of {step:?}"
            );
        }
    }

    #[test]
    fn waits_are_jittered() {
        let waits: std::collections::BTreeSet<Duration> =
            (0..20).map(|_| Backoff::default().next()).collect();
        assert!(waits.len() > 1, "twenty first waits were all {waits:?}");
    }
}
