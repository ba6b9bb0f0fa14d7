//! The real binary: a proxy that dies mid-request, and one that is asked to stop.

use rstest::rstest;

use std::time::Duration;

use tokio::net::TcpStream;

use crate::support::takeover::{assert_taken_over, kill_mid_request};
use crate::support::{Backend, InProcessProxy, ProxyProcess, Reply, TestEnv, keyed_post, poll_until};

#[tokio::test]
async fn killed_proxy_claim_is_taken_over_after_its_lease() {
    let env = TestEnv::new().await;
    let config = env.config().set("idempotency.lock_timeout", "2s");
    let mut dying = ProxyProcess::spawn(&config).await;
    // The successor starts first so it can probe while the dead proxy's lease still holds.
    let successor = ProxyProcess::spawn(&config).await;

    kill_mid_request(&env, &mut dying).await;

    let blocked = Reply::of(keyed_post(&successor.url, "/slow", "k", "{}")).await;
    blocked.assert_problem(409, "key-in-flight");
    assert!(blocked.retry_after() >= 1);

    env.upstream.release("slow");
    assert_taken_over(&env, &successor).await;
}

#[rstest]
#[tokio::test]
async fn sigterm_drains_an_in_flight_request(#[values(Backend::Postgres, Backend::Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let mut proxy = ProxyProcess::spawn(&env.config()).await;

    let in_flight = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;
    proxy.terminate();
    stops_accepting(&proxy.url).await;

    env.upstream.release("slow");
    let reply = tokio::time::timeout(Duration::from_secs(30), in_flight)
        .await
        .expect("the in-flight request finishes")
        .expect("request task");
    assert_eq!(reply.status, 201);
    assert_eq!(reply.text(), "slow done 1");
    let status = proxy.wait().await;
    assert!(
        status.success(),
        "exit status {status}; stderr:\n{}",
        proxy.stderr()
    );

    let fresh = env.proxy().await;
    let replay = Reply::of(keyed_post(&fresh.url, "/slow", "k", "{}")).await;
    assert!(
        replay.is_replay(),
        "the drained response was not stored: {}",
        replay.text()
    );
    assert_eq!(replay.text(), "slow done 1");
}

#[rstest]
#[tokio::test]
async fn cancelled_run_drains_an_in_flight_request(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let mut proxy = env.proxy().await;

    let in_flight = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;
    proxy.shutdown.cancel();
    stops_accepting(&proxy.url).await;
    let readiness = crate::support::http::client()
        .get(format!("{}/readyz", proxy.admin_url))
        .send()
        .await
        .expect("the admin listener serves while draining");
    assert_eq!(readiness.status(), 503, "not ready once shutdown has begun");
    // Draining: while the request is held upstream, `run` must not return.
    let run = proxy.task.as_mut().expect("run task");
    let early = tokio::time::timeout(Duration::from_millis(500), run).await;
    assert!(early.is_err(), "run returned with a request in flight: {early:?}");
    env.upstream.release("slow");

    let reply = in_flight.await.expect("request task");
    assert_eq!(reply.text(), "slow done 1");
    proxy.stop().await.expect("run returns Ok after draining");

    let fresh = InProcessProxy::start(&env.config()).await;
    let replay = Reply::of(keyed_post(&fresh.url, "/slow", "k", "{}")).await;
    assert!(
        replay.is_replay(),
        "the drained response was not stored: {}",
        replay.text()
    );
}

/// Waits until the proxy listener refuses connections: shutdown has begun.
async fn stops_accepting(proxy_url: &str) {
    let addr = proxy_url.strip_prefix("http://").expect("http URL");
    poll_until("the proxy to stop accepting connections", || async {
        TcpStream::connect(addr).await.is_err().then_some(())
    })
    .await;
}

/// `run` dropped without a shutdown (its task aborted) still stops the worker threads, and with them
/// what they hold: here the upstream connection kept idle in a worker's pool.
#[tokio::test]
async fn a_dropped_run_stops_its_workers() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let mut proxy = env.proxy().await;
    let reply = Reply::of(crate::support::http::client().get(format!("{}/things", proxy.url))).await;
    assert_eq!(reply.status, 201);
    assert_eq!(env.upstream.open_connections(), 1, "kept idle in the pool");

    proxy.task.take().expect("run task").abort();
    poll_until("the workers to close their upstream connections", || async {
        (env.upstream.open_connections() == 0).then_some(())
    })
    .await;
}
