//! A proxy started while its store cannot be had (nothing listening, connections cut, "too many
//! connections", another replica's migration lock): the real binary starts and stays up, `/healthz` is
//! 200 and `/readyz` 503, unkeyed requests are forwarded, keyed ones follow `store.on_error`, and the
//! proxy keeps trying; once the store answers it migrates, turns ready and protects keys. The operator
//! commands still fail at once.

use std::time::Duration;

use url::Url;

use crate::support::cli::idemproxy;
use crate::support::http::client;
use crate::support::pg::base_url;
use crate::support::redis::{RedisCluster, RedisServer, free_port};
use crate::support::{
    ProxyConfig, ProxyProcess, Relay, Reply, TestDb, TestEnv, Upstream, keyed_post, metric, poll_until,
    settled,
};

/// Said once per failed attempt to open the store.
const NOT_OPEN: &str = "store not open yet";

/// The session advisory lock migrations take (`src/store/postgres/migrations.rs`).
const MIGRATION_LOCK_ID: i64 = 0x1de3_7072_6f78_7901;

/// Bound on an operator command that must fail at once.
const COMMAND_BOUND: Duration = Duration::from_secs(30);

async fn get(url: String) -> Reply {
    Reply::of(client().get(url)).await
}

/// `/healthz` and `/readyz`: the status of each and the readiness body.
async fn probes(proxy: &ProxyProcess) -> (u16, u16, String) {
    let health = get(format!("{}/healthz", proxy.admin_url)).await;
    let ready = get(format!("{}/readyz", proxy.admin_url)).await;
    (health.status.as_u16(), ready.status.as_u16(), ready.text())
}

/// Waits until the proxy has logged `needle` on at least `times` lines of its stderr.
async fn logged(proxy: &ProxyProcess, needle: &str, times: usize) {
    poll_until(&format!("{times} log lines saying {needle:?}"), || async {
        (proxy.stderr().matches(needle).count() >= times).then_some(())
    })
    .await;
}

async fn wait_ready(proxy: &ProxyProcess) {
    poll_until("/readyz to answer 200", || async {
        let ready = get(format!("{}/readyz", proxy.admin_url)).await;
        (ready.status == 200).then_some(())
    })
    .await;
}

async fn store_opened(proxy: &ProxyProcess) -> f64 {
    metric(&proxy.admin_url, "idemproxy_store_opened", &[]).await
}

/// While the store is away: the process is up, healthy and not ready, an unkeyed request reaches the
/// upstream, and a keyed one is refused with 503 `store-unavailable` (fail_closed) without reaching it.
async fn serves_unprotected_and_refuses_keys(proxy: &mut ProxyProcess, upstream: &Upstream, readiness: &str) {
    assert!(proxy.is_running(), "the proxy exited:\n{}", proxy.stderr());
    let (health, ready, why) = probes(proxy).await;
    assert_eq!((health, ready), (200, 503), "/healthz, /readyz");
    assert_eq!(why.trim(), readiness);

    let unkeyed = Reply::of(client().post(format!("{}/orders", proxy.url)).body("{}")).await;
    assert_eq!(unkeyed.status, 201, "unkeyed: {}", unkeyed.text());
    let keyed = Reply::of(keyed_post(&proxy.url, "/orders", "while-down", "{}")).await;
    keyed.assert_problem(503, "store-unavailable");
    assert!(keyed.retry_after() >= 1);
    assert_eq!(upstream.executions_for_key("while-down"), 0, "never forwarded");
    assert_eq!(
        upstream.executions(),
        1,
        "only the unkeyed request reached the upstream"
    );
}

/// Once the store answers: ready, and a keyed request executes once and its retry is replayed.
async fn protects_keys_once_open(proxy: &ProxyProcess, upstream: &Upstream, key: &str) {
    wait_ready(proxy).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.is_replay());
    let retry = settled(|| keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert!(retry.is_replay(), "the retry was not replayed: {}", retry.text());
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.executions_for_key(key), 1);
}

/// `url` with `user` and `password` in it.
fn with_user(url: &str, user: &str, password: &str) -> String {
    let mut url = Url::parse(url).expect("test database URL");
    url.set_username(user).expect("a postgres URL takes a user");
    url.set_password(Some(password))
        .expect("a postgres URL takes a password");
    url.to_string()
}

#[tokio::test]
async fn postgres_cut_at_start_is_waited_for_then_migrated_and_protects_keys() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    relay.cut();
    // The server trusts every local connection; the password is there to be kept out of the log.
    let url = with_user(&env.db().url_via(relay.addr()), "postgres", "pw-never-logged");
    let mut proxy = ProxyProcess::spawn_serving(&env.config().set("store.url", url)).await;
    logged(&proxy, NOT_OPEN, 2).await;

    serves_unprotected_and_refuses_keys(&mut proxy, &env.upstream, "store not open yet").await;
    assert_eq!(store_opened(&proxy).await, 0.0);
    assert!(
        metric(
            &proxy.admin_url,
            "idemproxy_store_errors_total",
            &[("op", "claim")]
        )
        .await
            >= 1.0,
        "a claim on the unopened store counts as a failed claim"
    );

    relay.restore();
    protects_keys_once_open(&proxy, &env.upstream, "after-open").await;
    assert_eq!(store_opened(&proxy).await, 1.0);
    let stderr = proxy.stderr();
    assert!(
        stderr.contains("keyed requests are protected from now on"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("pw-never-logged"),
        "the password was logged:\n{stderr}"
    );
}

/// A role allowed no connections: every attempt is turned away with `FATAL: too many connections for
/// role` (SQLSTATE 53300, as a full server's "too many clients"), until the limit is lifted.
#[tokio::test]
async fn postgres_out_of_connections_at_start_forwards_keys_unprotected_under_fail_open() {
    let env = TestEnv::new().await;
    let role = format!("{}_full", env.db().name());
    let admin = env.db().client().await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN CONNECTION LIMIT 0;
             GRANT CONNECT, CREATE ON DATABASE \"{db}\" TO \"{role}\";",
            db = env.db().name()
        ))
        .await
        .expect("create the role");
    let url = with_user(&env.db().url(), &role, "unused");
    let config = env
        .config()
        .set("store.url", url)
        .set("store.on_error", "fail_open");
    let mut proxy = ProxyProcess::spawn_serving(&config).await;
    logged(&proxy, "too many connections for role", 2).await;

    assert!(proxy.is_running(), "the proxy exited:\n{}", proxy.stderr());
    let (health, ready, _) = probes(&proxy).await;
    assert_eq!((health, ready), (200, 503), "/healthz, /readyz");
    let unkeyed = Reply::of(client().post(format!("{}/orders", proxy.url)).body("{}")).await;
    assert_eq!(unkeyed.status, 201);
    let keyed = Reply::of(keyed_post(&proxy.url, "/orders", "unprotected", "{}")).await;
    assert_eq!(keyed.status, 201, "fail_open forwards: {}", keyed.text());
    assert_eq!(env.upstream.executions_for_key("unprotected"), 1);
    let unprotected = metric(&proxy.admin_url, "idemproxy_unprotected_requests_total", &[]).await;
    assert_eq!(unprotected, 1.0);

    admin
        .batch_execute(&format!("ALTER ROLE \"{role}\" CONNECTION LIMIT -1"))
        .await
        .expect("lift the limit");
    protects_keys_once_open(&proxy, &env.upstream, "after-open").await;
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_unprotected_requests_total", &[]).await,
        1.0,
        "nothing forwarded unprotected once the store opened"
    );

    drop(proxy);
    drop(admin);
    drop(env);
    let server = crate::support::pg::connect(&base_url()).await;
    server
        .batch_execute(&format!("DROP ROLE IF EXISTS \"{role}\""))
        .await
        .expect("drop the role");
}

/// Another replica holds the migration lock: this one waits for it at most `store.timeout` per attempt,
/// serves meanwhile, and migrates once the lock is let go. `idemproxy migrate` fails instead of hanging.
#[tokio::test]
async fn a_replica_finding_the_migration_lock_held_retries_and_migrates_once_it_is_let_go() {
    let db = TestDb::create().await;
    let upstream = Upstream::start().await;
    let holder = db.client().await;
    holder
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .expect("take the migration lock");

    let migrate = tokio::time::timeout(COMMAND_BOUND, idemproxy(&["migrate", "--store", &db.url()], &[]))
        .await
        .expect("idemproxy migrate waited on the lock without bound");
    let stderr = String::from_utf8_lossy(&migrate.stderr);
    assert_eq!(migrate.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("migration lock"), "{stderr}");

    let config = ProxyConfig::new(&db.url(), &upstream.url());
    let mut proxy = ProxyProcess::spawn_serving(&config).await;
    logged(&proxy, "another process held the migration lock", 2).await;
    serves_unprotected_and_refuses_keys(&mut proxy, &upstream, "store not open yet").await;

    holder
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_ID])
        .await
        .expect("let go of the migration lock");
    protects_keys_once_open(&proxy, &upstream, "after-open").await;
}

#[tokio::test]
async fn migrate_still_fails_at_once_when_postgres_is_unreachable() {
    let nothing = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let port = nothing.local_addr().expect("its address").port();
    drop(nothing);
    let url = format!("postgres://postgres@127.0.0.1:{port}/none");
    let migrate = tokio::time::timeout(COMMAND_BOUND, idemproxy(&["migrate", "--store", &url], &[]))
        .await
        .expect("idemproxy migrate did not give up");
    let stderr = String::from_utf8_lossy(&migrate.stderr);
    assert_eq!(migrate.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("Connection refused"), "{stderr}");
}

/// The first start against a new server fails on a database nobody created: the error says how to create it.
#[tokio::test]
async fn a_missing_database_is_named_with_the_createdb_command_that_creates_it() {
    let name = format!("idemproxy_never_created_{}", std::process::id());
    let mut url = base_url();
    url.set_path(&name);
    let migrate = tokio::time::timeout(
        COMMAND_BOUND,
        idemproxy(&["migrate", "--store", url.as_str()], &[]),
    )
    .await
    .expect("idemproxy migrate did not give up");
    let stderr = String::from_utf8_lossy(&migrate.stderr);
    assert_eq!(migrate.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("does not exist"), "{stderr}");
    assert!(stderr.contains("(create it with `createdb "), "{stderr}");
    assert!(stderr.contains(&format!(" {name}`)")), "{stderr}");
}

#[tokio::test]
async fn redis_server_not_there_at_start_is_used_once_it_starts() {
    let upstream = Upstream::start().await;
    let port = free_port();
    let config = ProxyConfig::new(&format!("redis://127.0.0.1:{port}"), &upstream.url());
    let mut proxy = ProxyProcess::spawn_serving(&config).await;
    serves_unprotected_and_refuses_keys(&mut proxy, &upstream, "store unavailable").await;

    let dir = tempfile::tempdir().expect("temporary directory");
    let _server = tokio::task::spawn_blocking({
        let dir = dir.path().to_owned();
        move || RedisServer::start_at(&dir, port, &[])
    })
    .await
    .expect("start redis-server");
    protects_keys_once_open(&proxy, &upstream, "after-start").await;
}

#[tokio::test]
async fn redis_cluster_down_at_start_is_used_once_its_nodes_are_back() {
    let mut cluster = tokio::task::spawn_blocking(|| {
        let mut cluster = RedisCluster::start();
        for node in &mut cluster.nodes {
            node.kill();
        }
        for node in &cluster.nodes {
            while node.cli(&["PING"]).is_some() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        cluster
    })
    .await
    .expect("start and stop a Redis Cluster");
    let upstream = Upstream::start().await;
    let mut proxy = ProxyProcess::spawn_serving(&ProxyConfig::new(&cluster.url(), &upstream.url())).await;
    serves_unprotected_and_refuses_keys(&mut proxy, &upstream, "store unavailable").await;

    let cluster = tokio::task::spawn_blocking(move || {
        for node in &mut cluster.nodes {
            node.restart();
        }
        cluster.wait_healthy();
        cluster
    })
    .await
    .expect("restart the cluster's nodes");
    protects_keys_once_open(&proxy, &upstream, "after-start").await;
    drop(cluster);
}
