//! Duplicates that overlap: one execution, and everyone else told to wait or given the replay.

use rstest::rstest;

use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use crate::support::Backend::{self, Citus, Postgres, Redis, RedisCluster, Sqlite};
use crate::support::http::stream_until_first_chunk;
use crate::support::upstream::{FIRST_CHUNK, REST_CHUNK};
use crate::support::{
    InProcessProxy, ProxyProcess, Reply, TestEnv, http::raw_keyed_post, keyed_post, metric_reaches, settled,
    unless_skipped,
};

/// Asserts every reply is the one execution (201), its replay, or a 409 conflict, and that exactly
/// one of them is the execution itself.
fn assert_one_execution_among(replies: &[Reply]) {
    for reply in replies {
        match reply.status.as_u16() {
            201 => {}
            409 => reply.assert_problem(409, "key-in-flight"),
            other => panic!("unexpected status {other}: {}", reply.text()),
        }
    }
    let originals = replies
        .iter()
        .filter(|r| r.status == 201 && !r.is_replay())
        .count();
    assert_eq!(originals, 1, "exactly one client gets the execution itself");
}

#[rstest]
#[tokio::test]
async fn fifty_concurrent_duplicates_execute_once(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    unless_skipped!(backend);
    let env = TestEnv::on(backend).await;
    let config = env.config().set("store.timeout", "10s");
    let proxy = InProcessProxy::start(&config).await;

    let requests = (0..50).map(|_| Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")));
    let replies = join_all(requests).await;

    assert_one_execution_among(&replies);
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn in_flight_duplicate_is_409_with_retry_after(
    #[values(Postgres, Sqlite, Redis, RedisCluster)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let original = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;

    let duplicate = Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    duplicate.assert_problem(409, "key-in-flight");
    assert!(duplicate.retry_after() >= 1);

    env.upstream.release("slow");
    let original = original.await.expect("original request task");
    assert_eq!(original.status, 201);
    let replay = settled(|| keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn client_disconnect_does_not_cancel_the_execution(
    #[values(Postgres, Sqlite, Redis, RedisCluster)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let connection = raw_keyed_post(&proxy.url, "/slow", "k", "{}").await;
    env.upstream.wait_for_key("k", 1).await;
    drop(connection);

    let while_held = Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    while_held.assert_problem(409, "key-in-flight");
    env.upstream.release("slow");

    let retry = settled(|| keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.is_replay(), "the retry must get the stored response");
    assert_eq!(retry.text(), "slow done 1");
    assert_eq!(env.upstream.executions(), 1);
    let executed = [("outcome", "executed")];
    metric_reaches(&proxy.admin_url, "idemproxy_requests_total", &executed, 1.0).await;
}

/// The client reads the response head and the first chunk, then hangs up while the upstream is still
/// sending: the relay reads the rest and stores the whole response.
#[rstest]
#[tokio::test]
async fn client_disconnect_after_the_head_still_stores_the_whole_response(
    #[values(Postgres, Sqlite, Redis, RedisCluster)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    drop(stream_until_first_chunk(&proxy.url, "k").await);
    env.upstream.release("stream");

    let replay = settled(|| keyed_post(&proxy.url, "/stream", "k", "{}")).await;
    assert!(replay.is_replay(), "{}", replay.text());
    assert_eq!(replay.body, [FIRST_CHUNK, REST_CHUNK].concat());
    assert_eq!(env.upstream.executions_for_key("k"), 1);
}

/// The client hangs up while its claim statement is waiting in the database (queued behind a
/// transaction the test holds on the same key). The claim still wins once it runs, so the request must
/// still execute and be stored, not be left claimed until its lease runs out.
#[tokio::test]
async fn client_disconnect_during_the_claim_does_not_strand_the_key() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let mut holder = env.db().client().await;
    let blocking = crate::support::pg::hold_key_row(&mut holder, "k").await;

    let connection = raw_keyed_post(&proxy.url, "/orders", "k", "{}").await;
    env.db().wait_for_a_lock_waiter().await;
    drop(connection);
    blocking.rollback().await.unwrap();

    env.upstream.wait_for_key("k", 1).await;
    let retry = settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.is_replay(), "the retry must get the stored response");
    assert_eq!(env.upstream.executions_for_key("k"), 1);
    let executed = [("outcome", "executed")];
    metric_reaches(&proxy.admin_url, "idemproxy_requests_total", &executed, 1.0).await;
}

/// Replicas share PostgreSQL; the embedded store refuses a second proxy (see `store::sqlite`).
#[tokio::test]
async fn two_proxy_processes_on_one_database_execute_once() {
    let env = TestEnv::new().await;
    let config = env.config().set("store.timeout", "10s");
    let (one, two) = tokio::join!(ProxyProcess::spawn(&config), ProxyProcess::spawn(&config));

    let requests = (0..40).map(|i| {
        let base = if i % 2 == 0 { &one.url } else { &two.url };
        Reply::of(keyed_post(base, "/orders", "k", "{}"))
    });
    let replies = join_all(requests).await;

    assert_one_execution_among(&replies);
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn heartbeat_keeps_a_live_claim_past_its_lease(
    #[values(Postgres, Sqlite, Redis, RedisCluster)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("idempotency.lock_timeout", "1s");
    let proxy = InProcessProxy::start(&config).await;

    let original = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;
    // Three leases long, a duplicate must keep meeting the live claim. Were it to take the claim
    // over, its own upstream call would answer at once (gate `dup` is open) and fail the test.
    env.upstream.release("dup");
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let duplicate = keyed_post(&proxy.url, "/slow", "k", "{}").header("x-gate", "dup");
        let duplicate = Reply::of(duplicate).await;
        duplicate.assert_problem(409, "key-in-flight");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    env.upstream.release("slow");
    let original = original.await.expect("original request task");
    assert_eq!(original.status, 201);
    assert_eq!(env.upstream.executions_for_key("k"), 1);
}
