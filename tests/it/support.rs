//! Test harness: a database, a stub upstream and the proxy, wired together per test.

pub mod certs;
pub mod citus;
pub mod cli;
pub mod cluster;
pub mod encryption;
pub mod history;
pub mod http;
pub mod pg;
pub mod proxy;
pub mod raw;
pub mod raw_h2;
pub mod recorder;
pub mod redis;
pub mod relay;
mod selftest;
pub mod signatures;
pub mod store;
pub mod takeover;
pub mod tools;
pub mod upstream;

pub use http::{Reply, keyed_post, metric, settled};
pub use pg::TestDb;
pub use proxy::{InProcessProxy, ProxyConfig, ProxyProcess};
pub use relay::Relay;
pub use store::{Backend, TestStore};
pub use upstream::Upstream;

/// Returns from the test at once where `backend` is skipped here (Citus without a coordinator; said on
/// stderr).
macro_rules! unless_skipped {
    ($backend:expr) => {
        if $backend.skipped() {
            return;
        }
    };
}
pub(crate) use unless_skipped;

/// One test's world: its own store and its own stub upstream.
pub struct TestEnv {
    pub store: TestStore,
    pub upstream: Upstream,
}

impl TestEnv {
    /// A world on PostgreSQL, for tests that reach into the database or the connection to it.
    pub async fn new() -> TestEnv {
        TestEnv::on(Backend::Postgres).await
    }

    /// A world on the given backend.
    pub async fn on(backend: Backend) -> TestEnv {
        TestEnv {
            store: TestStore::create(backend).await,
            upstream: Upstream::start().await,
        }
    }

    /// This world's PostgreSQL database.
    pub fn db(&self) -> &TestDb {
        self.store.pg()
    }

    /// A world on PostgreSQL and an in-process proxy serving it, with `toml` (`[[routes]]`, `[idempotency]`
    /// settings) laid over the test defaults: the common start of a test.
    pub async fn with_routes(toml: &str) -> (TestEnv, InProcessProxy) {
        TestEnv::with_routes_on(Backend::Postgres, toml).await
    }

    /// [`TestEnv::with_routes`] on the given backend.
    pub async fn with_routes_on(backend: Backend, toml: &str) -> (TestEnv, InProcessProxy) {
        let env = TestEnv::on(backend).await;
        let proxy = InProcessProxy::start(&env.config().with_toml(toml)).await;
        (env, proxy)
    }

    /// Test defaults pointing at this env's store and upstream.
    pub fn config(&self) -> ProxyConfig {
        ProxyConfig::on(&self.store, &self.upstream.url())
    }

    /// An in-process proxy with the test defaults.
    pub async fn proxy(&self) -> InProcessProxy {
        InProcessProxy::start(&self.config()).await
    }
}

/// Bound on waiting for a state that has no signal to await (a lease or a TTL running out).
const POLL_BOUND: std::time::Duration = std::time::Duration::from_secs(30);
const POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// Calls `attempt` until it returns `Some`, every 50 ms, for at most 30 s; panics naming `what`.
pub async fn poll_until<T, F, Fut>(what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let polling = async {
        loop {
            if let Some(done) = attempt().await {
                return done;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    };
    tokio::time::timeout(POLL_BOUND, polling)
        .await
        .unwrap_or_else(|_| panic!("gave up after {POLL_BOUND:?} waiting for {what}"))
}

/// Waits until the counter reaches at least `at_least` and returns its value.
pub async fn metric_reaches(admin_url: &str, name: &str, labels: &[(&str, &str)], at_least: f64) -> f64 {
    poll_until(&format!("{name}{labels:?} >= {at_least}"), || async {
        let value = metric(admin_url, name, labels).await;
        (value >= at_least).then_some(value)
    })
    .await
}
