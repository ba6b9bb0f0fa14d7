//! How the store reaches its file: creating it for its owner alone, the instance lock that keeps a second
//! proxy off it, the connection's settings, and the schema from `migrations/sqlite`. Runs at start-up
//! (`SqliteStore::open`, on a blocking thread), for `migrate` and for each operator tool; touches the
//! database file, its `-wal` and `-shm` files and `<file>.lock`.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

use super::bridge::backend;
use crate::store::StoreError;

mod embedded {
    refinery::embed_migrations!("migrations/sqlite");
}

/// Where refinery records applied migrations.
const MIGRATION_TABLE: &str = "idemproxy_schema_history";

/// What a store is opened for; only `Serve` claims the file for this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The proxy: creates the file if needed and holds the instance lock while it runs.
    Serve,
    /// `migrate`: creates the file if needed.
    Migrate,
    /// Operator tools (`keys`): the file must exist; runs beside a serving proxy.
    Tool,
}

/// Opens the file at `path` for `access`, and for `Serve` the instance lock held while the returned file
/// is open. Blocking.
pub(super) fn open(
    path: &Path,
    timeout: Duration,
    access: Access,
) -> Result<(Connection, Option<File>), StoreError> {
    let instance = match access {
        Access::Serve => Some(lock_instance(path)?),
        Access::Migrate | Access::Tool => None,
    };
    if access == Access::Tool && !path.exists() {
        return Err(StoreError::Backend(format!(
            "no SQLite store at {}: check store.url (or --store), or start the proxy once to create it",
            path.display()
        )));
    }
    let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    if access != Access::Tool {
        create_private(path).map_err(|e| {
            StoreError::Backend(format!("cannot create SQLite store {}: {e}", path.display()))
        })?;
        flags |= OpenFlags::SQLITE_OPEN_CREATE;
    }
    let db = Connection::open_with_flags(path, flags)
        .map_err(|e| StoreError::Backend(format!("cannot open SQLite store {}: {e}", path.display())))?;
    configure(&db, timeout).map_err(backend)?;
    Ok((db, instance))
}

/// Applies pending migrations and reports how many were applied. Blocking.
pub(super) fn migrate(db: &mut Connection) -> Result<usize, StoreError> {
    let report = embedded::migrations::runner()
        .set_migration_table_name(MIGRATION_TABLE)
        .run(db)
        .map_err(|e| StoreError::Migration(e.to_string()))?;
    Ok(report.applied_migrations().len())
}

/// Creates the database file for its owner alone (mode 0600 on Unix), since stored responses may hold
/// personal data; SQLite gives the `-wal` and `-shm` files it creates beside it the same mode. A file
/// that exists keeps the mode its operator gave it.
fn create_private(path: &Path) -> std::io::Result<()> {
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    match owner_only(&mut options).open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Files these options create are readable and writable by their owner only.
#[cfg(unix)]
fn owner_only(options: &mut OpenOptions) -> &mut OpenOptions {
    std::os::unix::fs::OpenOptionsExt::mode(options, 0o600)
}

/// Elsewhere, files get the platform's default permissions.
#[cfg(not(unix))]
fn owner_only(options: &mut OpenOptions) -> &mut OpenOptions {
    options
}

/// WAL lets operator tools read while the proxy writes; `synchronous = FULL` makes every committed claim
/// and completion durable before it is acted on, even across power loss.
fn configure(db: &Connection, timeout: Duration) -> rusqlite::Result<()> {
    db.busy_timeout(timeout)?;
    db.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))?;
    db.pragma_update(None, "synchronous", "FULL")?;
    Ok(())
}

/// Takes an exclusive lock on `<file>.lock` for as long as the returned file is open. The operating
/// system drops it when the process ends, however it ends, so a crashed proxy never blocks its restart.
fn lock_instance(path: &Path) -> Result<File, StoreError> {
    let lock_path = lock_path(path);
    let file = owner_only(OpenOptions::new().create(true).truncate(false).write(true))
        .open(&lock_path)
        .map_err(|e| StoreError::Backend(format!("cannot open lock file {}: {e}", lock_path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::InUse(path.to_path_buf())),
        Err(TryLockError::Error(e)) => Err(StoreError::Backend(format!(
            "cannot lock {}: {e}",
            lock_path.display()
        ))),
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_file_sits_beside_the_database() {
        assert_eq!(
            lock_path(Path::new("/var/lib/k.db")),
            Path::new("/var/lib/k.db.lock")
        );
    }
}
