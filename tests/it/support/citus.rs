//! A key table distributed by Citus, for the tests that need one. They run when
//! `IDEMPROXY_TEST_CITUS_URL` names a database on a Citus coordinator (the citus extension created and
//! the workers added, as docs/stores.md sets it up) and are skipped, saying so, otherwise: Citus is
//! not packaged for the machines CI runs on.
//!
//! The tests share that database's `idemproxy` schema, so they run one at a time: each holds its turn
//! while its table exists, and starts from a schema dropped, migrated by the store and distributed anew.

use tokio::sync::{Mutex, MutexGuard};
use url::Url;

use idemproxy::Config;
use idemproxy::store;

use super::pg::connect;

/// Names the coordinator's database, e.g. `postgres://postgres@127.0.0.1:5440/postgres`.
pub const CITUS_URL: &str = "IDEMPROXY_TEST_CITUS_URL";

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

/// The coordinator's URL, or `None` after saying on stderr that the test is skipped.
pub fn url() -> Option<String> {
    match std::env::var(CITUS_URL) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            eprintln!(
                "skipped on Citus: {CITUS_URL} is not set (a Citus coordinator's database, set up as \
                 docs/stores.md says)"
            );
            None
        }
    }
}

/// The key table, distributed on `key`, for one test.
pub struct CitusTable {
    url: String,
    _turn: MutexGuard<'static, ()>,
}

impl CitusTable {
    /// Waits for its turn, then drops the schema, migrates it as `idemproxy migrate` does and distributes
    /// the key table on `key`, as the operator's setup does.
    pub async fn create(url: String) -> CitusTable {
        let turn = ONE_AT_A_TIME.lock().await;
        let table = CitusTable { url, _turn: turn };
        let client = table.client().await;
        client
            .batch_execute("DROP SCHEMA IF EXISTS idemproxy CASCADE")
            .await
            .expect("drop the previous test's schema");
        let config = Config::from_toml_str(&format!("[store]\nurl = \"{}\"\n", table.url))
            .expect("a store config for the coordinator");
        store::migrate(&config.store)
            .await
            .expect("migrations apply on the coordinator");
        client
            .batch_execute("SELECT create_distributed_table('idemproxy.records', 'key')")
            .await
            .unwrap_or_else(|e| {
                panic!("distributing the key table failed (is {CITUS_URL} a coordinator?): {e}")
            });
        table
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// A client on the coordinator, for reading the table's shards.
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&Url::parse(&self.url).expect("IDEMPROXY_TEST_CITUS_URL is a URL")).await
    }
}
