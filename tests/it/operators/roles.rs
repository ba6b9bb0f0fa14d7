//! The PostgreSQL roles docs/operations.md recommends, run for real with the binary: the schema's owner
//! applies migrations with `idemproxy migrate`, and the proxy serves as a role that may only read and
//! write rows (the grants below are the ones the guide and `deploy/compose/initdb.sh` give).

use url::Url;

use crate::support::cli::idemproxy;
use crate::support::pg::base_url;
use crate::support::{ProxyConfig, ProxyProcess, Reply, TestDb, Upstream, keyed_post, settled};

/// Two login roles named after the test's database, dropped (after the database) when the test ends.
struct Roles {
    owner: String,
    serving: String,
}

impl Roles {
    async fn create(db: &TestDb) -> Roles {
        let database = db.name();
        let roles = Roles {
            owner: format!("{database}_owner"),
            serving: format!("{database}_serving"),
        };
        let Roles { owner, serving } = &roles;
        db.client()
            .await
            .batch_execute(&format!(
                "CREATE ROLE \"{owner}\" LOGIN;
                 CREATE ROLE \"{serving}\" LOGIN;
                 GRANT CONNECT ON DATABASE \"{database}\" TO \"{owner}\", \"{serving}\";
                 GRANT CREATE ON DATABASE \"{database}\" TO \"{owner}\";
                 CREATE SCHEMA idemproxy AUTHORIZATION \"{owner}\";
                 GRANT USAGE ON SCHEMA idemproxy TO \"{serving}\";
                 ALTER DEFAULT PRIVILEGES FOR ROLE \"{owner}\" IN SCHEMA idemproxy
                     GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO \"{serving}\";"
            ))
            .await
            .expect("create the owner and serving roles");
        roles
    }

    async fn drop_after(self, db: TestDb) {
        drop(db);
        let admin = base_url();
        let (client, connection) = tokio_postgres::connect(admin.as_str(), tokio_postgres::NoTls)
            .await
            .expect("connect to drop the roles");
        tokio::spawn(connection);
        let sql = format!("DROP ROLE IF EXISTS \"{}\", \"{}\"", self.owner, self.serving);
        client.batch_execute(&sql).await.expect("drop the roles");
    }
}

fn as_role(db: &TestDb, role: &str) -> String {
    let mut url = Url::parse(&db.url()).expect("test database URL");
    url.set_username(role).expect("a postgres URL takes a user");
    url.to_string()
}

#[tokio::test]
async fn the_owner_migrates_and_a_role_with_row_rights_only_serves_and_replays() {
    let db = TestDb::create().await;
    let roles = Roles::create(&db).await;

    let migrated = idemproxy(&["migrate", "--store", &as_role(&db, &roles.owner)], &[]).await;
    assert!(
        migrated.status.success(),
        "migrate as the owner failed: {}",
        String::from_utf8_lossy(&migrated.stderr)
    );

    let upstream = Upstream::start().await;
    let config = ProxyConfig::new(&as_role(&db, &roles.serving), &upstream.url()).set("store.migrate", false);
    let proxy = ProxyProcess::spawn(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/payments", "pay-1", r#"{"amount":100}"#)).await;
    assert_eq!(first.status, 201, "first request: {}", first.text());
    let retry = settled(|| keyed_post(&proxy.url, "/payments", "pay-1", r#"{"amount":100}"#)).await;
    assert!(
        retry.is_replay(),
        "the retry was not replayed: {} {}",
        retry.status,
        retry.text()
    );
    assert_eq!(upstream.executions_for_key("pay-1"), 1);
    drop(proxy);

    let serving = {
        let url = as_role(&db, &roles.serving);
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect as the serving role");
        tokio::spawn(connection);
        client
    };
    let dropped = serving.batch_execute("DROP TABLE idemproxy.records").await;
    let error = dropped.expect_err("the serving role dropped the key table");
    assert_eq!(
        error.code(),
        Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE),
        "unexpected error: {error:?}"
    );
    roles.drop_after(db).await;
}

#[tokio::test]
async fn a_role_with_row_rights_only_cannot_migrate_and_serve_says_so() {
    let db = TestDb::create().await;
    let roles = Roles::create(&db).await;
    let upstream = Upstream::start().await;
    let url = as_role(&db, &roles.serving);

    let served = idemproxy(
        &[
            "serve",
            "--store",
            &url,
            "--upstream",
            &upstream.url(),
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        &[],
    )
    .await;
    let stderr = String::from_utf8_lossy(&served.stderr);
    assert!(
        !served.status.success(),
        "serve with migrations as the serving role started"
    );
    assert!(
        stderr.contains("permission denied"),
        "the failure does not say why: {stderr}"
    );
    roles.drop_after(db).await;
}
