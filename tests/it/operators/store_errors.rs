//! What an operator reads when the store refuses the proxy after start and in every `keys` command, run
//! for real with the binary against PostgreSQL: the server's own reason (not the pool's "error occurred
//! while creating a new object"), and the command that mends it where one exists.

use url::Url;

use crate::support::TestDb;
use crate::support::cli::idemproxy;
use crate::support::pg::base_url;

/// `idemproxy keys stats --store url`'s failure: its stderr, which must hold every one of `expected`.
async fn keys_stats_says(url: &str, expected: &[&str]) {
    let out = idemproxy(&["keys", "stats", "--store", url], &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "keys stats against {url} succeeded");
    for text in expected {
        assert!(
            stderr.contains(text),
            "keys stats against {url} said:\n{stderr}\nwithout {text:?}"
        );
    }
    assert!(
        !stderr.contains("Error occurred while creating a new object"),
        "the pool's summary, not the server's reason:\n{stderr}"
    );
}

/// `url` with `user` in place of its user, and `database` in place of its database.
fn with(url: &str, user: Option<&str>, database: &str) -> String {
    let mut url = Url::parse(url).expect("test database URL");
    if let Some(user) = user {
        url.set_username(user).expect("a postgres URL takes a user");
    }
    url.set_path(database);
    url.to_string()
}

#[tokio::test]
async fn a_missing_database_names_the_createdb_that_makes_it() {
    let db = TestDb::create().await;
    let missing = format!("{}_missing", db.name());
    let url = with(&db.url(), None, &missing);
    keys_stats_says(
        &url,
        &[&format!("database \"{missing}\" does not exist"), "createdb "],
    )
    .await;
}

#[tokio::test]
async fn an_unmigrated_database_names_idemproxy_migrate() {
    let db = TestDb::create().await;
    keys_stats_says(
        &db.url(),
        &["idemproxy.records", "does not exist", "`idemproxy migrate`"],
    )
    .await;
    let migrated = idemproxy(&["migrate", "--store", &db.url()], &[]).await;
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let stats = idemproxy(&["keys", "stats", "--store", &db.url()], &[]).await;
    assert!(
        stats.status.success(),
        "{}",
        String::from_utf8_lossy(&stats.stderr)
    );
}

/// A login revoked (`NOLOGIN`), and a login without rights on the schema: the server's reason, and the
/// URL or the `GRANT` to mend it.
#[tokio::test]
async fn a_revoked_login_and_a_login_without_rights_say_so_and_what_mends_them() {
    let db = TestDb::create().await;
    let migrated = idemproxy(&["migrate", "--store", &db.url()], &[]).await;
    assert!(
        migrated.status.success(),
        "{}",
        String::from_utf8_lossy(&migrated.stderr)
    );
    let (revoked, rightless) = (
        format!("{}_revoked", db.name()),
        format!("{}_rightless", db.name()),
    );
    let admin = base_url();
    let (client, connection) = tokio_postgres::connect(admin.as_str(), tokio_postgres::NoTls)
        .await
        .expect("connect to make the roles");
    tokio::spawn(connection);
    client
        .batch_execute(&format!(
            "CREATE ROLE \"{revoked}\" NOLOGIN; CREATE ROLE \"{rightless}\" LOGIN;"
        ))
        .await
        .expect("create the roles");

    keys_stats_says(
        &with(&db.url(), Some(&revoked), db.name()),
        &[
            "is not permitted to log in",
            "check the user and password in store.url",
        ],
    )
    .await;
    keys_stats_says(
        &with(&db.url(), Some(&rightless), db.name()),
        &[
            "permission denied for schema idemproxy",
            &format!("GRANT USAGE ON SCHEMA idemproxy TO {rightless}"),
        ],
    )
    .await;

    drop(db);
    client
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{revoked}\", \"{rightless}\""))
        .await
        .expect("drop the roles");
}
