//! The embedded store's files are private: the database, its write-ahead log and shared-memory index,
//! and the instance lock are created readable and writable by their owner alone (stored responses may
//! hold personal data). A database file the operator created keeps the mode they gave it.

#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::support::{Backend, Reply, TestEnv, keyed_post};

fn mode(path: &Path) -> u32 {
    let metadata = std::fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    metadata.permissions().mode() & 0o777
}

/// `<database><suffix>`, as SQLite and the instance lock name the files beside it.
fn beside(database: &Path, suffix: &str) -> PathBuf {
    let mut name = database.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

#[tokio::test]
async fn sqlite_files_are_created_for_their_owner_alone() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "private", "{}")).await;
    assert_eq!(reply.status, 201, "{}", reply.text());

    let database = env.store.sqlite_path();
    for path in [
        database.clone(),
        beside(&database, "-wal"),
        beside(&database, "-shm"),
        beside(&database, ".lock"),
    ] {
        assert_eq!(format!("{:o}", mode(&path)), "600", "{}", path.display());
    }
}

#[tokio::test]
async fn an_existing_sqlite_file_keeps_the_operators_mode() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let database = env.store.sqlite_path();
    std::fs::write(&database, b"").expect("create an empty database file");
    std::fs::set_permissions(&database, std::fs::Permissions::from_mode(0o640)).unwrap();
    let proxy = env.proxy().await;
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "shared", "{}")).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(format!("{:o}", mode(&database)), "640");
}
