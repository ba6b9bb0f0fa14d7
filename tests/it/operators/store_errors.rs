//! What an operator reads when the store refuses the proxy after start, in every `keys` command and in
//! `idemproxy migrate`, run for real with the binary against PostgreSQL and a Redis server of the test's
//! own: the server's own reason (not the pool's "error occurred while creating a new object"), and the
//! command that mends it where one exists.

use url::Url;

use crate::support::cli::idemproxy;
use crate::support::pg::base_url;
use crate::support::redis::{RedisServer, free_port, unique_prefix};
use crate::support::{
    InProcessProxy, ProxyConfig, ProxyProcess, Reply, TestDb, TestEnv, TestStore, Upstream, keyed_post,
    poll_until, settled,
};

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
    migrates(&db.url()).await;
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
    migrates(&db.url()).await;
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

/// A role whose name SQL folds or cannot read unquoted (`App-User`): the `GRANT` named quotes it, so
/// running it as printed gives the rights (unquoted, it did not parse).
#[tokio::test]
async fn the_grant_named_for_a_role_with_capitals_or_a_hyphen_quotes_it_and_works() {
    let db = TestDb::create().await;
    migrates(&db.url()).await;
    let role = format!("{}-App", db.name());
    let admin = Url::parse(&with(base_url().as_str(), None, db.name())).expect("admin URL");
    let (client, connection) = tokio_postgres::connect(admin.as_str(), tokio_postgres::NoTls)
        .await
        .expect("connect to make the role");
    tokio::spawn(connection);
    client
        .batch_execute(&format!("CREATE ROLE \"{role}\" LOGIN"))
        .await
        .expect("create the role");
    let url = with(&db.url(), Some(&role), db.name());
    let grant = format!(
        "GRANT USAGE ON SCHEMA idemproxy TO \"{role}\"; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL \
         TABLES IN SCHEMA idemproxy TO \"{role}\""
    );
    keys_stats_says(&url, &["permission denied for schema idemproxy", &grant]).await;
    client
        .batch_execute(&grant)
        .await
        .expect("the GRANT as printed runs");
    let out = idemproxy(&["keys", "stats", "--store", &url], &[]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    client
        .batch_execute(&format!(
            "REVOKE ALL ON ALL TABLES IN SCHEMA idemproxy FROM \"{role}\"; \
             REVOKE ALL ON SCHEMA idemproxy FROM \"{role}\""
        ))
        .await
        .expect("revoke");
    drop(client);
    drop(db);
    let (client, connection) = tokio_postgres::connect(base_url().as_str(), tokio_postgres::NoTls)
        .await
        .expect("connect to drop the role");
    tokio::spawn(connection);
    client
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{role}\""))
        .await
        .expect("drop the role");
}

/// `idemproxy migrate --store url`'s failure: its stderr, which must hold every one of `expected`.
async fn migrate_says(url: &str, expected: &[&str]) {
    let out = idemproxy(&["migrate", "--store", url], &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "migrate against {url}:\n{stderr}");
    for text in expected {
        assert!(
            stderr.contains(text),
            "migrate against {url} said:\n{stderr}\nwithout {text:?}"
        );
    }
}

/// `idemproxy migrate --store url` succeeds.
async fn migrates(url: &str) {
    let out = idemproxy(&["migrate", "--store", url], &[]).await;
    assert!(
        out.status.success(),
        "migrate against {url}:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `idemproxy migrate` as a login refused, as a login without `CREATE` on the database, and as one
/// that may create schemas but finds the key table's schema another's: PostgreSQL's reason, and the
/// `GRANT` or the role that mends it; the `GRANT` it names does.
#[tokio::test]
async fn migrate_without_the_login_or_the_rights_says_the_server_reason_and_the_fix() {
    let db = TestDb::create().await;
    let (revoked, newcomer) = (
        format!("{}_revoked", db.name()),
        format!("{}_newcomer", db.name()),
    );
    let admin = crate::support::pg::connect(&base_url()).await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{revoked}\" NOLOGIN; CREATE ROLE \"{newcomer}\" LOGIN;"
        ))
        .await
        .expect("create the roles");

    migrate_says(
        &with(&db.url(), Some(&revoked), db.name()),
        &[
            "is not permitted to log in",
            &format!("the server refused the login of {revoked}"),
            "check the user and password in store.url",
        ],
    )
    .await;
    let grant = format!("GRANT CREATE ON DATABASE {} TO {newcomer}", db.name());
    let as_newcomer = with(&db.url(), Some(&newcomer), db.name());
    migrate_says(
        &as_newcomer,
        &[
            &format!("permission denied for database {}", db.name()),
            &format!("`{grant}`"),
        ],
    )
    .await;

    migrates(&db.url()).await;
    admin.batch_execute(&grant).await.expect("the GRANT it named");
    migrate_says(
        &as_newcomer,
        &[
            "permission denied for schema idemproxy",
            "run `idemproxy migrate` as the schema's owner",
        ],
    )
    .await;
    let db_client = db.client().await;
    db_client
        .batch_execute(&format!(
            "ALTER SCHEMA idemproxy OWNER TO \"{newcomer}\"; \
             ALTER TABLE idemproxy.records OWNER TO \"{newcomer}\"; \
             ALTER TABLE idemproxy.schema_history OWNER TO \"{newcomer}\";"
        ))
        .await
        .expect("give the schema to the newcomer");
    migrates(&as_newcomer).await;

    drop(db_client);
    drop(db);
    admin
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{revoked}\", \"{newcomer}\""))
        .await
        .expect("drop the roles");
}

/// `idemproxy keys <args> --store url`'s failure: its stderr, which must hold every one of `expected`.
async fn keys_says(args: &[&str], url: &str, expected: &[&str]) -> String {
    let mut command = vec!["keys", "--store", url];
    command.extend_from_slice(args);
    let out = idemproxy(&command, &[]).await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "keys {args:?} against {url} succeeded");
    for text in expected {
        assert!(
            stderr.contains(text),
            "keys {args:?} against {url} said:\n{stderr}\nwithout {text:?}"
        );
    }
    stderr
}

/// Redis refusing the `keys` commands: nothing listening, a user without an ACL permission the store
/// needs, a password required and not given, a wrong one: the client's or Redis's own reason and what
/// mends it. The ACL the error names is enough for the user to serve keyed requests; after start, a
/// keyed request on a refused login is answered 503 and the proxy logs the reason and the fix.
#[tokio::test]
async fn redis_refusals_say_the_server_reason_and_the_fix() {
    let nothing = free_port();
    keys_says(
        &["stats"],
        &format!("redis://127.0.0.1:{nothing}"),
        &[
            "Connection refused",
            "nothing accepts connections at store.url's address",
        ],
    )
    .await;

    let dir = tempfile::tempdir().expect("temporary directory");
    let server = RedisServer::start(dir.path(), &[]);
    server
        .cli(&[
            "ACL", "SETUSER", "limited", "on", ">pw", "~*", "&*", "+@all", "-scan",
        ])
        .expect("make a user that may not SCAN");
    let limited = format!("redis://limited:pw@{}", server.address());
    let said = keys_says(
        &["stats"],
        &limited,
        &[
            "no permissions to run the 'scan' command",
            "lacks an ACL permission",
            "`ACL SETUSER <user> ",
        ],
    )
    .await;
    let grant = said
        .split("`ACL SETUSER <user> ")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .expect("the ACL in backquotes");
    let prefix = unique_prefix();
    let grant = grant.replace("<key_prefix>", &prefix);
    let mut acl = vec!["ACL", "SETUSER", "limited", "reset", "on", ">pw"];
    acl.extend(grant.split_whitespace());
    server.cli(&acl).expect("the ACL the error named");
    let env = TestEnv {
        store: TestStore::Redis {
            url: limited.clone(),
            prefix,
        },
        upstream: Upstream::start().await,
    };
    let proxy = InProcessProxy::start(&env.config()).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "acl", "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "acl", "{}")).await;
    assert!(replay.is_replay(), "{}", replay.text());
    drop(proxy);

    server
        .cli(&["CONFIG", "SET", "requirepass", "s3cret"])
        .expect("require a password");
    keys_says(
        &["stats"],
        &format!("redis://{}", server.address()),
        &["NOAUTH", "Redis requires a password"],
    )
    .await;
    let wrong = format!("redis://:wrong@{}", server.address());
    let refused_login = "Redis refused the user and password in store.url";
    keys_says(
        &["stats"],
        &wrong,
        &["Password authentication failed", refused_login],
    )
    .await;

    // At start, before any request, the proxy says the store does not answer, why, and what mends it.
    let proxy = ProxyProcess::spawn_serving(&ProxyConfig::new(&wrong, &env.upstream.url())).await;
    let at_start = poll_until("the line at start with the refused login and its fix", || async {
        proxy
            .stderr()
            .lines()
            .find(|line| line.contains("the store does not answer at start"))
            .map(str::to_owned)
    })
    .await;
    assert!(at_start.contains(refused_login), "{at_start}");
    assert!(!at_start.contains("wrong"), "the password is masked: {at_start}");
    // After start, a keyed request is refused 503 and the proxy's log line says why and what mends it.
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "auth", "{}")).await;
    assert_eq!(refused.status, 503, "{}", refused.text());
    poll_until(
        "the proxy's log line with the refused login and its fix",
        || async { proxy.stderr().contains(refused_login).then_some(()) },
    )
    .await;
    assert!(
        proxy.stderr().contains("Password authentication failed"),
        "{}",
        proxy.stderr()
    );
}
