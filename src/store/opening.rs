//! `serve`'s store from start until it opens, and what runs beside it from then on. Runs once at start
//! and, while a PostgreSQL server cannot be had for the migrations, as one background task on the task
//! tracker that shutdown ends. Touches the store handle (it installs the opened store), the
//! `idemproxy_store_opened` gauge and the log, and starts the sweeper and the wait listener.
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
use super::notify::Waiters;
use super::postgres::{PostgresStore, Unmigrated};
use super::{Built, Capabilities, Purpose, Store, StoreError, StoreHandle, build};
use crate::config::{Config, OnInFlight, StoreBackend, StoreConfig};
use crate::metrics::Metrics;

/// The step of the first wait before the migrations are tried again; each step doubles up to
/// [`RETRY_MAX`]. A wait is a random point in the upper half of its step, so replicas started together,
/// or turned away together by a full server, come back apart.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A task that runs beside the open store until shutdown.
type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Opens the store for `serve` and returns its handle, open or still opening (see the module's header).
/// `waiters` are woken by the wait listener; background work goes on `tracker` and ends with `shutdown`.
pub async fn serve(
    config: &Config,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> Result<StoreHandle, StoreError> {
    let Built { store, migrate } = build(&config.store, Purpose::Serve).await?;
    let handle = StoreHandle::unopened(metrics.clone());
    let opened = Opened {
        store: EncryptedStore::wrap(store, config.encryption.as_ref(), metrics),
        beside: beside(config, &handle, waiters, metrics, shutdown),
        handle: handle.clone(),
        metrics: metrics.clone(),
        tracker: tracker.clone(),
    };
    if !migrate {
        opened.install();
        return Ok(handle);
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
    Ok(handle)
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
    store: &StoreHandle,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Vec<Task> {
    let mut tasks: Vec<Task> = Vec::new();
    if config.sweeper.enabled && !Capabilities::of(&config.store).self_expiring {
        tasks.push(Box::pin(super::sweeper::run(
            store.clone(),
            config.sweeper.clone(),
            metrics.clone(),
            shutdown.clone(),
        )));
    }
    tasks.extend(wait_listener(config, waiters, metrics, shutdown));
    tasks
}

/// The listener that wakes this process's waiting requests when another replica settles their keys:
/// only on a shared store (an embedded store has no other replica) and only when some route waits.
fn wait_listener(
    config: &Config,
    waiters: &Arc<Waiters>,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Option<Task> {
    let waits = config
        .routes
        .policies()
        .any(|policy| policy.on_in_flight == OnInFlight::Wait);
    if !waits {
        return None;
    }
    let (store, waiters, metrics, shutdown) = (
        config.store.clone(),
        waiters.clone(),
        metrics.clone(),
        shutdown.clone(),
    );
    match &config.store.backend {
        StoreBackend::Postgres => Some(Box::pin(super::postgres::listen(
            store, waiters, metrics, shutdown,
        ))),
        StoreBackend::Redis(target) => Some(Box::pin(super::redis::listen(
            store,
            target.clone(),
            waiters,
            metrics,
            shutdown,
        ))),
        StoreBackend::Sqlite { .. } => None,
    }
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
