//! Schema migrations: the SQL files in `migrations/postgres`, embedded at build time and applied by
//! refinery. Runs at `serve` start (`store.migrate`) and for `idemproxy migrate`, never on the request
//! path; touches the `idemproxy` schema, refinery's history table in it and one session advisory lock, over
//! a dedicated connection of its own (not the pool's).

use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{NoTls, Socket};

use super::connect::{pg_config, tls_connector};
use super::runner::backend;
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

/// Applies pending migrations over a connection of their own; how many were applied.
pub(super) async fn run(config: &StoreConfig) -> Result<usize, StoreError> {
    let pg = pg_config(config)?;
    match tls_connector(config)? {
        Some(tls) => migrate_over(pg, tls).await,
        None => migrate_over(pg, NoTls).await,
    }
}

async fn migrate_over<T>(pg: tokio_postgres::Config, tls: T) -> Result<usize, StoreError>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (mut client, connection) = pg.connect(tls).await.map_err(backend)?;
    let driver = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::warn!(%error, "migration connection ended");
        }
    });
    let applied = migrate_locked(&mut client).await;
    drop(client);
    let _ = driver.await;
    applied
}

async fn migrate_locked(client: &mut tokio_postgres::Client) -> Result<usize, StoreError> {
    let migration = |e: tokio_postgres::Error| StoreError::Migration(error_chain(&e));
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(migration)?;
    client
        .batch_execute("CREATE SCHEMA IF NOT EXISTS idemproxy")
        .await
        .map_err(migration)?;
    let report = embedded::migrations::runner()
        .set_migration_table_name(MIGRATION_TABLE)
        .run_async(client)
        .await
        .map_err(|e| StoreError::Migration(e.to_string()));
    client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .map_err(migration)?;
    Ok(report?.applied_migrations().len())
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
