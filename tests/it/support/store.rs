//! The store under test, either backend: a fresh PostgreSQL database or a fresh SQLite file per test.

use std::path::PathBuf;
use std::sync::Arc;

use idemproxy::Config;
use idemproxy::store::{self, Purpose, Store};

use super::pg::TestDb;

/// Which backend a test runs on; tests that hold for both take it as an `rstest` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

/// A store that exists for one test.
pub enum TestStore {
    Postgres(TestDb),
    Sqlite(tempfile::TempDir),
}

impl TestStore {
    pub async fn create(backend: Backend) -> TestStore {
        match backend {
            Backend::Postgres => TestStore::Postgres(TestDb::create().await),
            Backend::Sqlite => TestStore::Sqlite(tempfile::tempdir().expect("temporary directory")),
        }
    }

    /// The `store.url` for this store.
    pub fn url(&self) -> String {
        match self {
            TestStore::Postgres(db) => db.url(),
            TestStore::Sqlite(_) => format!("sqlite://{}", self.sqlite_path().display()),
        }
    }

    /// The SQLite database file.
    pub fn sqlite_path(&self) -> PathBuf {
        match self {
            TestStore::Sqlite(dir) => dir.path().join("idemproxy.db"),
            TestStore::Postgres(_) => panic!("not a SQLite store"),
        }
    }

    /// The PostgreSQL database, for tests that only make sense there (relays, held transactions).
    pub fn pg(&self) -> &TestDb {
        match self {
            TestStore::Postgres(db) => db,
            TestStore::Sqlite(_) => panic!("this test needs the PostgreSQL store"),
        }
    }

    /// The store's config section, with a 5 s operation bound.
    pub fn config(&self) -> Config {
        Config::from_toml_str(&format!("[store]\nurl = \"{}\"\ntimeout = \"5s\"\n", self.url()))
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
