//! How the store reaches PostgreSQL: `store.url` with our connection defaults, the TLS connector its
//! `sslmode` asks for, and the pool. Runs at start-up (`PostgresStore::connect`) and for each migration
//! run; touches no database (the pool opens connections lazily, migrations open their own).

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::NoTls;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::StoreConfig;
use crate::store::StoreError;

/// The pool of `store.pool_size` connections; none is opened until one is asked for, so this succeeds
/// while the database is down.
pub(super) fn pool(config: &StoreConfig) -> Result<Pool, StoreError> {
    let pg = pg_config(config)?;
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let manager = match tls_connector(config)? {
        Some(tls) => Manager::from_config(pg, tls, manager_config),
        None => Manager::from_config(pg, NoTls, manager_config),
    };
    Pool::builder(manager)
        .max_size(config.pool_size)
        .build()
        .map_err(|e| StoreError::Backend(e.to_string()))
}

/// `store.url`, with what it leaves unset: a connect timeout of `store.timeout` and the application
/// name `idemproxy`; TCP keepalives always on.
pub(super) fn pg_config(config: &StoreConfig) -> Result<tokio_postgres::Config, StoreError> {
    let mut pg: tokio_postgres::Config = config
        .url
        .parse()
        .map_err(|e: tokio_postgres::Error| StoreError::Backend(e.to_string()))?;
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(config.timeout);
    }
    if pg.get_application_name().is_none() {
        pg.application_name("idemproxy");
    }
    pg.keepalives(true).keepalives_idle(Duration::from_secs(30));
    Ok(pg)
}

/// The TLS connector when the URL says `sslmode=require`: rustls, verifying the server's certificate and
/// name against the system's CA certificates plus `store.tls_ca_file`. `sslmode=disable` or none connects in
/// clear text; config validation refuses every other mode.
pub(super) fn tls_connector(config: &StoreConfig) -> Result<Option<MakeRustlsConnect>, StoreError> {
    if !config.tls {
        return Ok(None);
    }
    let client = crate::tls::client_config(config.tls_ca_file.as_deref())
        .map_err(|e| StoreError::Backend(format!("store TLS: {e}")))?;
    Ok(Some(MakeRustlsConnect::new(client)))
}
