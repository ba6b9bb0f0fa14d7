//! The store comes back: the pool reconnects by itself after PostgreSQL restarts, writes that failed
//! while the store was away are tried again until it answers, readiness follows, and every failure is
//! counted by operation.

use crate::support::cluster::Cluster;
use crate::support::{
    InProcessProxy, ProxyConfig, Relay, Reply, TestEnv, Upstream, http, keyed_post, metric, metric_reaches,
    poll_until, settled,
};

async fn readyz(proxy: &InProcessProxy) -> u16 {
    http::readyz(&proxy.admin_url).await.status.as_u16()
}

async fn store_errors(proxy: &InProcessProxy, op: &str) -> f64 {
    metric(&proxy.admin_url, "idemproxy_store_errors_total", &[("op", op)]).await
}

#[tokio::test]
async fn pool_reconnects_after_postgres_stops_and_starts_again() {
    let cluster = Cluster::start().await;
    let upstream = Upstream::start().await;
    let proxy = InProcessProxy::start(&ProxyConfig::new(&cluster.url(), &upstream.url())).await;
    let before = Reply::of(keyed_post(&proxy.url, "/orders", "before", "{}")).await;
    assert_eq!(before.status, 201, "{}", before.text());

    cluster.stop().await;
    let down = Reply::of(keyed_post(&proxy.url, "/orders", "during", "{}")).await;
    down.assert_problem(503, "store-unavailable");
    assert_eq!(readyz(&proxy).await, 503, "not ready while the database is down");
    assert!(store_errors(&proxy, "claim").await >= 1.0);
    assert!(store_errors(&proxy, "ping").await >= 1.0);

    cluster.start_again().await;
    poll_until("/readyz to recover", || async {
        (readyz(&proxy).await == 200).then_some(())
    })
    .await;
    let after = Reply::of(keyed_post(&proxy.url, "/orders", "during", "{}")).await;
    assert_eq!(
        after.status,
        201,
        "the pool must reconnect by itself: {}",
        after.text()
    );
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "before", "{}")).await;
    assert!(replay.is_replay(), "the record from before the restart is kept");
    assert_eq!(upstream.executions_for_key("before"), 1);
    assert_eq!(upstream.executions_for_key("during"), 1);
}

#[tokio::test]
async fn pool_drops_connections_a_crashed_postgres_closed() {
    let cluster = Cluster::start().await;
    let upstream = Upstream::start().await;
    let config = ProxyConfig::new(&cluster.url(), &upstream.url()).set("store.pool_size", 2);
    let proxy = InProcessProxy::start(&config).await;
    for key in ["a", "b", "c"] {
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
        assert_eq!(reply.status, 201, "{}", reply.text());
    }

    cluster.crash_restart().await;
    // Every pooled connection died with the server; none of them may be handed out again, so the
    // first request after the restart already gets a live connection.
    let after = Reply::of(keyed_post(&proxy.url, "/orders", "after", "{}")).await;
    assert_eq!(after.status, 201, "{}", after.text());
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "a", "{}")).await;
    assert!(replay.is_replay(), "records survive the crash");
    assert_eq!(readyz(&proxy).await, 200);
    assert_eq!(upstream.executions(), 4);
}

#[tokio::test]
async fn completion_that_meets_a_cut_store_is_retried_until_it_lands() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let proxy = InProcessProxy::start(&env.config().set("store.url", env.db().url_via(relay.addr()))).await;

    let original = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;
    relay.cut();
    env.upstream.release("slow");
    let original = original.await.expect("client task");
    assert_eq!(
        original.text(),
        "slow done 1",
        "the client is answered while the store is away"
    );
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_store_errors_total",
        &[("op", "complete")],
        2.0,
    )
    .await;

    relay.restore();
    let replay = settled(|| keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    assert!(
        replay.is_replay(),
        "the completion was retried and stored: {}",
        replay.text()
    );
    assert_eq!(replay.text(), "slow done 1");
    assert_eq!(env.upstream.executions_for_key("k"), 1);
}

#[tokio::test]
async fn release_that_meets_a_cut_store_is_retried_so_the_key_runs_again() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let proxy = InProcessProxy::start(&env.config().set("store.url", env.db().url_via(relay.addr()))).await;
    let failing = || keyed_post(&proxy.url, "/status/503", "k", "{}").header("x-gate", "r");

    let original = tokio::spawn(Reply::of(failing()));
    env.upstream.wait_for_key("k", 1).await;
    relay.cut();
    env.upstream.release("r");
    assert_eq!(original.await.expect("client task").status, 503);
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_store_errors_total",
        &[("op", "release")],
        2.0,
    )
    .await;

    relay.restore();
    let again = settled(failing).await;
    assert_eq!(again.status, 503, "{}", again.text());
    assert!(!again.is_replay());
    assert_eq!(
        env.upstream.executions_for_key("k"),
        2,
        "the release landed, so the retry executed"
    );
}

/// A cut store makes every kind of store operation fail, and each is counted under its own `op`.
#[tokio::test]
async fn every_store_operation_counts_its_failures() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env
        .config()
        .set("store.url", env.db().url_via(relay.addr()))
        .set("idempotency.lock_timeout", "1500ms");
    let proxy = InProcessProxy::start(&config).await;
    for op in ["claim", "heartbeat", "complete", "release", "ping"] {
        assert_eq!(store_errors(&proxy, op).await, 0.0, "{op} before any fault");
    }
    let completing = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "c", "{}")));
    let releasing = keyed_post(&proxy.url, "/status/500", "r", "{}").header("x-gate", "r");
    let releasing = tokio::spawn(Reply::of(releasing));
    env.upstream.wait_for_key("c", 1).await;
    env.upstream.wait_for_key("r", 1).await;

    relay.cut();
    let errors = "idemproxy_store_errors_total";
    metric_reaches(&proxy.admin_url, errors, &[("op", "heartbeat")], 1.0).await;
    Reply::of(keyed_post(&proxy.url, "/orders", "new", "{}"))
        .await
        .assert_problem(503, "store-unavailable");
    assert_eq!(readyz(&proxy).await, 503);
    env.upstream.release("slow");
    env.upstream.release("r");
    completing.await.expect("client task");
    releasing.await.expect("client task");
    for op in ["claim", "heartbeat", "complete", "release", "ping"] {
        metric_reaches(&proxy.admin_url, errors, &[("op", op)], 1.0).await;
    }
    relay.restore();
}
