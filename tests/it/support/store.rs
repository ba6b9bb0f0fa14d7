//! The store under test, any backend: a fresh PostgreSQL database, a fresh SQLite file, a key prefix
//! of its own on the shared Redis server or Redis Cluster, or a key table distributed anew on Citus, per
//! test.

use std::path::PathBuf;
use std::sync::Arc;

use idemproxy::Config;
use idemproxy::store::{self, Purpose, Store};

use super::citus::{self, CitusTable};
use super::pg::TestDb;
use super::redis::{shared_cluster, shared_server, unique_prefix};

/// Which backend a test runs on; tests that hold for both take it as an `rstest` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
    Redis,
    RedisCluster,
    /// PostgreSQL with the key table distributed by Citus, where `IDEMPROXY_TEST_CITUS_URL` names one.
    Citus,
}

impl Backend {
    /// Whether the store deletes expired records itself (Redis's TTL) rather than through the sweeper.
    pub fn self_expiring(self) -> bool {
        matches!(self, Backend::Redis | Backend::RedisCluster)
    }

    /// Whether the tests on this backend are skipped here (Citus without a coordinator), said on stderr.
    pub fn skipped(self) -> bool {
        self == Backend::Citus && citus::url().is_none()
    }
}

/// A store that exists for one test.
pub enum TestStore {
    Postgres(TestDb),
    Citus(CitusTable),
    Sqlite(tempfile::TempDir),
    /// A store URL and the key prefix that keeps this test's records apart.
    Redis {
        url: String,
        prefix: String,
    },
}

impl TestStore {
    pub async fn create(backend: Backend) -> TestStore {
        match backend {
            Backend::Postgres => TestStore::Postgres(TestDb::create().await),
            Backend::Citus => {
                let url = citus::url().expect("a test on Citus checks Backend::skipped first");
                TestStore::Citus(CitusTable::create(url).await)
            }
            Backend::Sqlite => TestStore::Sqlite(tempfile::tempdir().expect("temporary directory")),
            Backend::Redis => TestStore::Redis {
                url: format!("redis://{}", shared_server().address()),
                prefix: unique_prefix(),
            },
            Backend::RedisCluster => TestStore::Redis {
                url: shared_cluster().url(),
                prefix: unique_prefix(),
            },
        }
    }

    /// The `store.url` for this store.
    pub fn url(&self) -> String {
        match self {
            TestStore::Postgres(db) => db.url(),
            TestStore::Citus(table) => table.url().to_owned(),
            TestStore::Sqlite(_) => format!("sqlite://{}", self.sqlite_path().display()),
            TestStore::Redis { url, .. } => url.clone(),
        }
    }

    /// The same settings as `IDEMPROXY_` environment variables, for the binary run with `--store URL`.
    pub fn cli_env(&self) -> Vec<(&'static str, String)> {
        match self {
            TestStore::Redis { prefix, .. } => vec![("IDEMPROXY_STORE__REDIS__KEY_PREFIX", prefix.clone())],
            _ => Vec::new(),
        }
    }

    /// The `[store]` settings beyond the URL that this store needs, as TOML to merge into a config.
    pub fn store_toml(&self) -> String {
        match self {
            TestStore::Redis { prefix, .. } => format!("[store.redis]\nkey_prefix = \"{prefix}\"\n"),
            _ => String::new(),
        }
    }

    /// The SQLite database file.
    pub fn sqlite_path(&self) -> PathBuf {
        match self {
            TestStore::Sqlite(dir) => dir.path().join("idemproxy.db"),
            _ => panic!("not a SQLite store"),
        }
    }

    /// The PostgreSQL database, for tests that only make sense there (relays, held transactions).
    pub fn pg(&self) -> &TestDb {
        match self {
            TestStore::Postgres(db) => db,
            _ => panic!("this test needs the PostgreSQL store"),
        }
    }

    /// The store's config section, with a 5 s operation bound.
    pub fn config(&self) -> Config {
        Config::from_toml_str(&format!(
            "[store]\nurl = \"{}\"\ntimeout = \"5s\"\n{}",
            self.url(),
            self.store_toml()
        ))
        .expect("valid test config")
    }

    /// Migrates, then opens a handle as operator tools do; each call opens its own connections, as
    /// another replica would.
    pub async fn open(&self) -> Arc<dyn Store> {
        let config = self.config();
        store::migrate(&config.store).await.expect("migrations apply");
        store::open(&config.store, Purpose::Tool)
            .await
            .expect("store opens")
    }
}
