//! What only the embedded store has to prove: one file serves one proxy, a proxy that died leaves the
//! file to its successor, and waiting on SQLite's lock never stalls the async runtime.

use std::time::Duration;

use idemproxy::store::{ClaimResult, StoreError};
use idemproxy::{Listeners, RunError};
use rusqlite::Connection;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::store::suite::{DAY, LONG, request, response};
use crate::support::takeover::{assert_taken_over, kill_mid_request};
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
    let output =
        crate::support::cli::idemproxy(&["serve", "--config", config.path().to_str().unwrap()], &[]).await;
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

/// The commits in a write-ahead log written since it was last truncated: frames whose header gives the
/// database's size after a commit (nonzero) end a transaction.
fn wal_commits(path: &std::path::Path) -> usize {
    let wal = std::fs::read(path).unwrap();
    if wal.len() < 32 {
        return 0;
    }
    let page_size = u32::from_be_bytes(wal[8..12].try_into().unwrap()) as usize;
    wal[32..]
        .chunks(24 + page_size)
        .filter(|frame| frame.len() == 24 + page_size && frame[4..8] != [0; 4])
        .count()
}

/// Claims and completions that queue for the connection together go in one transaction and one commit:
/// a new key's claim rides with the completions of requests that finished meanwhile. 25 completions and
/// 25 new claims queued behind another program's write lock: the first write to arrive goes alone,
/// and the other 49 share the next commit (a lane per kind would take four).
#[tokio::test]
async fn claims_and_completions_queued_together_share_one_commit() {
    let test_store = TestStore::create(Backend::Sqlite).await;
    let store = test_store.open().await;
    let finishing: Vec<_> = (0..25)
        .map(|i| request(&format!("done-{i}"), 1, LONG, DAY))
        .collect();
    for claim in &finishing {
        let won = store.claim(claim).await.unwrap();
        assert!(matches!(won, ClaimResult::Won { .. }), "{won:?}");
    }
    let new: Vec<_> = (0..25)
        .map(|i| request(&format!("new-{i}"), 1, LONG, DAY))
        .collect();
    let other_program = Connection::open(test_store.sqlite_path()).unwrap();
    other_program
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .unwrap();
    let wal = std::path::PathBuf::from(format!("{}-wal", test_store.sqlite_path().display()));
    assert_eq!(wal_commits(&wal), 0, "the log starts empty");
    other_program.execute_batch("BEGIN IMMEDIATE").unwrap();

    let stored = response(b"done");
    let completions = finishing.iter().map(|c| store.complete(&c.id, &stored));
    let claims = new.iter().map(|c| store.claim(c));
    let mut both = std::pin::pin!(async {
        futures_util::future::join(
            futures_util::future::join_all(completions),
            futures_util::future::join_all(claims),
        )
        .await
    });
    assert!(
        futures_util::poll!(&mut both).is_pending(),
        "the write lock is held"
    );
    other_program.execute_batch("COMMIT").unwrap();
    let (completed, claimed) = both.await;

    assert!(completed.iter().all(|c| matches!(c, Ok(true))), "{completed:?}");
    assert!(
        claimed.iter().all(|c| matches!(c, Ok(ClaimResult::Won { .. }))),
        "{claimed:?}"
    );
    let commits = wal_commits(&wal);
    assert_eq!(
        commits, 2,
        "the first write alone, then the other 49 in one transaction: {commits} commits"
    );
}
