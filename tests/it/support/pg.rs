//! A fresh PostgreSQL database per test, dropped when the test ends.
//!
//! The server is found through `DATABASE_URL`, else `postgres://postgres@localhost:5432/postgres`.

use std::sync::atomic::{AtomicUsize, Ordering};

use url::Url;

const DEFAULT_URL: &str = "postgres://postgres@localhost:5432/postgres";
const HOW_TO: &str = "integration tests need PostgreSQL: \
    set DATABASE_URL=postgres://user@host:port/db or start PostgreSQL on localhost:5432";

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A database that exists for one test. Dropping it drops the database (WITH (FORCE)).
pub struct TestDb {
    name: String,
    admin_url: Url,
}

/// Inserts `key`'s record (processing, for the test credential's scope) in a transaction left open, so
/// that a claim of the key waits on the row until the transaction ends.
pub async fn hold_key_row<'a>(
    client: &'a mut tokio_postgres::Client,
    key: &str,
) -> tokio_postgres::Transaction<'a> {
    let scope = super::history::scope_of(super::http::TEST_CREDENTIAL);
    let blocking = client.transaction().await.expect("begin");
    blocking
        .execute(
            "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                 locked_until, created_at, expires_at, updated_at)
             VALUES ($1, $2, '\\x00', 'processing', gen_random_uuid(), 1, 'new', now(), now(),
                 now() + interval '1 day', now())",
            &[&scope, &key],
        )
        .await
        .expect("insert the held row");
    blocking
}

impl TestDb {
    /// Creates a database with a unique name on the server named by `DATABASE_URL`.
    pub async fn create() -> TestDb {
        let admin_url = base_url();
        let name = unique_name();
        let client = connect(&admin_url).await;
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name} failed: {e}"));
        TestDb { name, admin_url }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL of this test's database.
    pub fn url(&self) -> String {
        let mut url = self.admin_url.clone();
        url.set_path(&self.name);
        url.to_string()
    }

    /// The URL of this test's database, reached through `addr` (a relay) instead of the server itself.
    pub fn url_via(&self, addr: std::net::SocketAddr) -> String {
        let mut url = self.admin_url.clone();
        url.set_path(&self.name);
        url.set_host(Some(&addr.ip().to_string()))
            .expect("a postgres URL takes a host");
        url.set_port(Some(addr.port()))
            .expect("a postgres URL takes a port");
        url.to_string()
    }

    /// A client connected to this test's database, for setting up races by hand.
    pub async fn client(&self) -> tokio_postgres::Client {
        let url = Url::parse(&self.url()).expect("test database URL");
        connect(&url).await
    }

    /// Waits until some session on this database is blocked on a lock (a statement queued behind a
    /// transaction the test holds open).
    pub async fn wait_for_a_lock_waiter(&self) {
        let observer = self.client().await;
        for _ in 0..1000 {
            let row = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    &[],
                )
                .await
                .expect("read pg_stat_activity");
            if row.get::<_, i64>(0) > 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("no session on {} ever waited on a lock", self.name);
    }

    /// `host:port` of the PostgreSQL server, for a relay to forward to.
    pub fn server_addr(&self) -> String {
        let host = self.admin_url.host_str().unwrap_or("localhost");
        let port = self.admin_url.port().unwrap_or(5432);
        format!("{host}:{port}")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = std::mem::take(&mut self.name);
        // Drop cannot await: drop the database from a thread with its own runtime.
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for dropping the test database");
            runtime.block_on(drop_database(&admin_url, &name));
        });
        let _ = dropper.join();
    }
}

async fn drop_database(admin_url: &Url, name: &str) {
    let Ok((client, connection)) = tokio_postgres::connect(admin_url.as_str(), tokio_postgres::NoTls).await
    else {
        return;
    };
    tokio::spawn(connection);
    let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    if let Err(e) = client.batch_execute(&sql).await {
        eprintln!("could not drop test database {name}: {e}");
    }
}

/// The server's URL as the tests find it (`DATABASE_URL`, else localhost), naming its admin database.
pub fn base_url() -> Url {
    let text = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_string());
    Url::parse(&text).unwrap_or_else(|e| panic!("DATABASE_URL is not a URL ({e}); {HOW_TO}"))
}

fn unique_name() -> String {
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    let random = &uuid::Uuid::new_v4().simple().to_string()[..8];
    format!("idemproxy_t_{}_{counter}_{random}", std::process::id())
}

pub async fn connect(url: &Url) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url.as_str(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| {
            let server = format!("{}:{}", url.host_str().unwrap_or("?"), url.port().unwrap_or(5432));
            panic!(
                "cannot connect to PostgreSQL at {server} ({}); {HOW_TO}",
                error_chain(&e)
            )
        });
    tokio::spawn(connection);
    client
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}
