//! Expired keys disappear without operator action: the sweeper inside `serve`, its metrics, and its
//! place in graceful shutdown.

use std::time::{Duration, Instant};

use rstest::rstest;

use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, metric, metric_reaches, settled};

#[rstest]
#[tokio::test]
async fn expired_keys_disappear_without_operator_action(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("idempotency.ttl", "1s")
        .set("idempotency.lock_timeout", "500ms")
        .set("sweeper.interval", "100ms");
    let proxy = InProcessProxy::start(&config).await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "short-lived", "{}")).await;
    assert_eq!(first.status, 201);
    let store = env.store.open().await;
    assert_eq!(store.find("short-lived", None).await.unwrap().len(), 1);

    metric_reaches(&proxy.admin_url, "idemproxy_expired_keys_deleted_total", &[], 1.0).await;
    assert!(
        store.find("short-lived", None).await.unwrap().is_empty(),
        "the record is gone"
    );
    let again = Reply::of(keyed_post(&proxy.url, "/orders", "short-lived", "{}")).await;
    assert_eq!(again.status, 201);
    assert!(!again.is_replay(), "a swept key is a new key");
}

#[rstest]
#[tokio::test]
async fn records_are_counted_by_state(#[values(Backend::Postgres, Backend::Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&env.config().set("sweeper.interval", "100ms")).await;
    for key in ["a", "b"] {
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
        assert_eq!(reply.status, 201);
        assert!(
            settled(|| keyed_post(&proxy.url, "/orders", key, "{}"))
                .await
                .is_replay()
        );
    }
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_records",
        &[("status", "completed")],
        2.0,
    )
    .await;
    let processing = metric(&proxy.admin_url, "idemproxy_records", &[("status", "processing")]).await;
    assert_eq!(processing, 0.0);
}

/// The sweeper sleeps for an hour here; shutdown must not wait for it (the drain bound is a minute).
#[rstest]
#[tokio::test]
async fn shutdown_stops_a_sleeping_sweeper(#[values(Backend::Postgres, Backend::Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("sweeper.interval", "1h")
        .set("server.shutdown_grace", "60s");
    let proxy = InProcessProxy::start(&config).await;
    let first_count = [("op", "stats")];
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_store_duration_seconds_count",
        &first_count,
        1.0,
    )
    .await;
    let stopping = Instant::now();
    proxy.stop().await.expect("clean stop");
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "shutdown waited {:?} for the sweeper",
        stopping.elapsed()
    );
}
