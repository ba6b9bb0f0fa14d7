//! Schema migrations: the SQL files in `migrations/postgres`, embedded at build time and applied by
//! refinery. Runs at `serve` start (`store.migrate`, retried by `store/open.rs` while the server
//! cannot be had) and for `idemproxy migrate`, never on the request path; touches the `idemproxy` schema,
//! refinery's history table in it and one session advisory lock, over a dedicated connection of its own
//! (not the pool's). No lock is waited for longer than `store.timeout` (the session's `lock_timeout`):
//! neither another replica's migration lock nor a table lock a migration's DDL needs, which would
//! otherwise queue every claim on that table behind it.

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{NoTls, Socket};

use super::connect::{connect_failure, pg_config, tls_connector, with_migration_fix};
use crate::config::StoreConfig;
use crate::error_chain::error_chain;
use crate::store::StoreError;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// Where refinery records applied migrations; it lives in our schema so a database can be shared.
const MIGRATION_TABLE: &str = "idemproxy.schema_history";

/// Serialises concurrent `migrate` runs of several replicas starting at once. Taken only by migration,
/// never on the request path.
const MIGRATION_LOCK_ID: i64 = 0x1de3_7072_6f78_7901;

/// Why migrations were not applied.
#[derive(Debug)]
pub(crate) enum Unmigrated {
    /// The server could not be had now: unreachable, refused or timed out, out of connections, starting
    /// up or shutting down, the connection broke, or a lock (another replica's migration) stayed taken
    /// for the whole `lock_timeout`. Trying again later may succeed.
    Unavailable(StoreError),
    /// The server answered and refused (credentials, a missing database, rights, a migration that
    /// fails or differs from the one applied), its TLS certificate is not trusted, or the configuration
    /// cannot connect: waiting mends none of these.
    Refused(StoreError),
}

impl From<Unmigrated> for StoreError {
    fn from(unmigrated: Unmigrated) -> StoreError {
        match unmigrated {
            Unmigrated::Unavailable(error) | Unmigrated::Refused(error) => error,
        }
    }
}

/// Applies pending migrations over a connection of their own; how many were applied.
pub(super) async fn run(config: &StoreConfig) -> Result<usize, Unmigrated> {
    let pg = pg_config(config).map_err(Unmigrated::Refused)?;
    let lock_wait = config.timeout;
    match tls_connector(config).map_err(Unmigrated::Refused)? {
        Some(tls) => migrate_over(pg, tls, lock_wait).await,
        None => migrate_over(pg, NoTls, lock_wait).await,
    }
}

async fn migrate_over<T>(pg: tokio_postgres::Config, tls: T, lock_wait: Duration) -> Result<usize, Unmigrated>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (mut client, connection) = pg.connect(tls).await.map_err(|e| {
        let text = with_migration_fix(connect_failure(&e, &pg), &e, &pg);
        sorted(&e, StoreError::Backend(text))
    })?;
    let driver = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "migration connection ended");
        }
    });
    let applied = migrate_locked(&mut client, lock_wait, &pg).await;
    drop(client);
    let _ = driver.await;
    applied
}

async fn migrate_locked(
    client: &mut tokio_postgres::Client,
    lock_wait: Duration,
    pg: &tokio_postgres::Config,
) -> Result<usize, Unmigrated> {
    let db_failed = |e: tokio_postgres::Error| failed(&e, lock_wait, pg);
    // Set on the session, so it bounds refinery's statements too.
    let lock_timeout = format!("SET lock_timeout = {}", lock_wait.as_millis().max(1));
    client.batch_execute(&lock_timeout).await.map_err(db_failed)?;
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(|e| lock_held(&e, lock_wait).unwrap_or_else(|| db_failed(e)))?;
    client
        .batch_execute("CREATE SCHEMA IF NOT EXISTS idemproxy")
        .await
        .map_err(db_failed)?;
    let report = embedded::migrations::runner()
        .set_migration_table_name(MIGRATION_TABLE)
        .run_async(client)
        .await
        .map_err(|e| failed(&e, lock_wait, pg));
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(db_failed)?;
    Ok(report?.applied_migrations().len())
}

/// The migration lock stayed with another session for the whole `lock_wait`.
fn lock_held(error: &tokio_postgres::Error, lock_wait: Duration) -> Option<Unmigrated> {
    (error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE)).then(|| {
        Unmigrated::Unavailable(StoreError::Migration(format!(
            "another process held the migration lock for {lock_wait:?} (store.timeout): it is \
             migrating this database"
        )))
    })
}

/// `error` (a driver error, or refinery's around one), as unavailable or refused, with what mends it
/// where the server's reason names a fix ([`with_migration_fix`]).
fn failed(
    error: &(dyn std::error::Error + 'static),
    lock_wait: Duration,
    pg: &tokio_postgres::Config,
) -> Unmigrated {
    let mut text = error_chain(error);
    let cause = std::iter::successors(Some(error), |e| e.source())
        .find_map(|e| e.downcast_ref::<tokio_postgres::Error>());
    if let Some(cause) = cause {
        if cause.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            text = format!("{text} (a lock stayed taken for {lock_wait:?}, store.timeout)");
        } else {
            text = with_migration_fix(text, cause, pg);
        }
    }
    sorted(error, StoreError::Migration(text))
}

/// `store_error`, reporting `error`, as unavailable or refused by the driver's error in `error`'s chain.
/// A TLS handshake that failed on the server's certificate (or an alert it sent) is refused: the server
/// answered, and it is not the one the configuration trusts.
fn sorted(error: &(dyn std::error::Error + 'static), store_error: StoreError) -> Unmigrated {
    let chain = || std::iter::successors(Some(error), |e| e.source());
    let cause = chain().find_map(|e| e.downcast_ref::<tokio_postgres::Error>());
    match cause {
        Some(cause) if unavailable(cause) && !chain().any(is_tls_failure) => {
            Unmigrated::Unavailable(store_error)
        }
        _ => Unmigrated::Refused(store_error),
    }
}

/// Whether `error` is rustls's, alone or inside an I/O error (whose `source` skips the error it wraps).
fn is_tls_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let inner = error
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
        .map(|inner| inner as &(dyn std::error::Error + 'static));
    [Some(error), inner]
        .into_iter()
        .flatten()
        .any(|e| e.downcast_ref::<rustls::Error>().is_some())
}

/// Whether the server could not be had now, rather than answering and refusing: no answer at all (the
/// connection could not be made, timed out or broke), or an error of the classes that say "not now".
fn unavailable(error: &tokio_postgres::Error) -> bool {
    let Some(code) = error.code() else {
        return true;
    };
    let code = code.code();
    // 08: connection exception; 53: insufficient resources (53300 too many connections, for the server
    // or the role); 57P01..57P03: shutting down, crashed, starting up; 57014: cancelled (by an operator
    // or a timeout); 55P03: a lock not available within lock_timeout; 40001, 40P01: serialization
    // failure, deadlock.
    code.starts_with("08")
        || code.starts_with("53")
        || matches!(
            code,
            "57P01" | "57P02" | "57P03" | "57014" | "55P03" | "40001" | "40P01"
        )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use refinery::Migration;

    use super::*;

    /// Version, name and checksum: what refinery compares with a database's history.
    fn identity(migration: &Migration) -> (String, String, u64) {
        let version = migration.version().to_string();
        (version, migration.name().to_owned(), migration.checksum())
    }

    /// refinery embeds only files named `V{version}__{name}.sql` and skips any other without an error,
    /// so a misnamed migration would silently never be applied.
    #[test]
    fn every_file_in_migrations_postgres_is_embedded_as_written() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/postgres");
        let mut files: Vec<(String, String, u64)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let stem = path.file_stem().unwrap().to_str().unwrap().to_owned();
                let sql = std::fs::read_to_string(&path).unwrap();
                let migration = Migration::unapplied(&stem, &sql)
                    .unwrap_or_else(|e| panic!("{} is not a migration file name: {e}", path.display()));
                identity(&migration)
            })
            .collect();
        let runner = embedded::migrations::runner();
        let mut embedded: Vec<(String, String, u64)> = runner.get_migrations().iter().map(identity).collect();
        files.sort();
        embedded.sort();
        assert!(!files.is_empty());
        assert_eq!(embedded, files);
    }
}
