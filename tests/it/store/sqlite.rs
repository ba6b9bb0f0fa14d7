//! What only the embedded store has to prove: one file serves one proxy, a proxy that died leaves the
//! file to its successor, and waiting on SQLite's lock never stalls the async runtime.

use std::time::Duration;

use idemproxy::store::{ClaimResult, StoreError};
use idemproxy::{Listeners, RunError};
use rusqlite::Connection;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::processes::{assert_taken_over, kill_mid_request};
use crate::store::suite::{DAY, LONG, request};
use crate::support::{Backend, InProcessProxy, ProxyProcess, Reply, TestEnv, TestStore, keyed_post, settled};

async fn listeners() -> Listeners {
    Listeners {
        proxy: TcpListener::bind("127.0.0.1:0").await.unwrap().into(),
        admin: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    }
}

#[tokio::test]
async fn a_second_proxy_on_the_same_file_is_refused() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let first = InProcessProxy::start(&env.config()).await;

    let config = idemproxy::Config::from_toml_str(&env.config().to_toml()).unwrap();
    let second = idemproxy::run(config, listeners().await, CancellationToken::new());
    match tokio::time::timeout(Duration::from_secs(30), second).await {
        Ok(Err(RunError::Store(StoreError::InUse(path)))) => {
            assert_eq!(path, env.store.sqlite_path());
        }
        other => panic!("expected the second proxy to be refused, got {other:?}"),
    }
    let reply = Reply::of(keyed_post(&first.url, "/orders", "k", "{}")).await;
    assert_eq!(reply.status, 201, "the first proxy keeps serving");

    first.stop().await.expect("clean stop");
    let successor = InProcessProxy::start(&env.config()).await;
    let replay = Reply::of(keyed_post(&successor.url, "/orders", "k", "{}")).await;
    assert!(replay.is_replay(), "the successor serves the same file");
}

#[tokio::test]
async fn the_binary_refuses_a_shared_file_and_names_the_way_out() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let _first = ProxyProcess::spawn(&env.config()).await;
    let mut config = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(&mut config, env.config().to_toml().as_bytes()).unwrap();
    let output = crate::cli::idemproxy(&["serve", "--config", config.path().to_str().unwrap()], &[]).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("in use by another running idemproxy"), "{stderr}");
    assert!(stderr.contains("PostgreSQL"), "{stderr}");
}

#[tokio::test]
async fn a_killed_proxy_leaves_the_file_to_its_successor() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let mut dying = ProxyProcess::spawn(&env.config()).await;
    let first = Reply::of(keyed_post(&dying.url, "/orders", "k", "{}")).await;
    assert_eq!(first.status, 201);
    let stored = settled(|| keyed_post(&dying.url, "/orders", "k", "{}")).await;
    assert!(stored.is_replay(), "the record is completed before the kill");
    dying.kill().await;

    let successor = ProxyProcess::spawn(&env.config()).await;
    let log = successor.stderr();
    assert!(
        log.contains("serves this single instance only"),
        "start log: {log}"
    );
    let replay = Reply::of(keyed_post(&successor.url, "/orders", "k", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
}

/// The test runtime has one thread. While another program holds SQLite's write lock, a claim waits for
/// it; if that wait ran on the runtime's thread, nothing else could run until the claim gave up.
#[tokio::test(flavor = "current_thread")]
async fn waiting_on_the_sqlite_lock_does_not_block_the_runtime() {
    let test_store = TestStore::create(Backend::Sqlite).await;
    let store = test_store.open().await;
    let other_program = Connection::open(test_store.sqlite_path()).unwrap();
    other_program.execute_batch("BEGIN IMMEDIATE").unwrap();

    let mut claim = tokio::spawn(async move { store.claim(&request("k", 1, LONG, DAY)).await });
    let early = tokio::time::timeout(Duration::from_millis(300), &mut claim).await;
    assert!(
        early.is_err(),
        "the claim waits for the lock without holding up the runtime"
    );

    other_program.execute_batch("COMMIT").unwrap();
    let claimed = claim
        .await
        .unwrap()
        .expect("the claim completes once the lock is free");
    assert!(matches!(claimed, ClaimResult::Won { attempt: 1, .. }));
}

#[tokio::test]
async fn a_killed_proxys_claim_is_taken_over_by_its_successor_after_the_lease() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config().set("idempotency.lock_timeout", "2s");
    let mut dying = ProxyProcess::spawn(&config).await;
    kill_mid_request(&env, &mut dying).await;

    let successor = ProxyProcess::spawn(&config).await;
    env.upstream.release("slow");
    assert_taken_over(&env, &successor).await;
}

/// Claims that queue for the connection while another program holds SQLite's write lock are committed
/// together once it lets go. Every commit appends at least one frame to the write-ahead log, so a commit
/// per claim would leave at least 100 frames for 100 new keys.
#[tokio::test]
async fn claims_queued_for_the_connection_share_their_commits() {
    let test_store = TestStore::create(Backend::Sqlite).await;
    let store = test_store.open().await;
    let other_program = Connection::open(test_store.sqlite_path()).unwrap();
    let wal_frames = |db: &Connection, mode: &str| -> i64 {
        db.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |row| row.get(1))
            .unwrap()
    };
    wal_frames(&other_program, "TRUNCATE");
    other_program.execute_batch("BEGIN IMMEDIATE").unwrap();

    // 100 new keys, and the first 10 of them asked for twice.
    let keys: Vec<String> = (0..100).map(|i| format!("key-{i}")).collect();
    let claims: Vec<_> = keys
        .iter()
        .chain(&keys[..10])
        .map(|k| request(k, 1, LONG, DAY))
        .collect();
    let mut all = std::pin::pin!(futures_util::future::join_all(
        claims.iter().map(|c| store.claim(c))
    ));
    assert!(
        futures_util::poll!(&mut all).is_pending(),
        "the write lock is held"
    );
    other_program.execute_batch("COMMIT").unwrap();
    let results = all.await;

    for key in &keys {
        let winners = claims
            .iter()
            .zip(&results)
            .filter(|(c, r)| &c.id.key == key && matches!(r, Ok(ClaimResult::Won { .. })))
            .count();
        assert_eq!(winners, 1, "{key}");
    }
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let frames = wal_frames(&other_program, "PASSIVE");
    assert!(
        frames < 100,
        "{frames} WAL frames for 100 new keys: a commit per claim"
    );
}
