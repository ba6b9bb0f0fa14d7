//! The admin port: metrics that move with what happened, liveness and readiness.

use rstest::rstest;

use crate::support::{
    Backend, InProcessProxy, Relay, Reply, TestEnv, http::client, keyed_post, metric, metric_reaches,
    poll_until,
};

#[rstest]
#[tokio::test]
async fn metrics_count_replays_conflicts_and_mismatches(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    Reply::of(keyed_post(&proxy.url, "/orders", "r", "{}")).await;
    // The record is written just after the client's stream ends; a retry before that would be a 409.
    let completions = [("op", "complete")];
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_store_duration_seconds_count",
        &completions,
        1.0,
    )
    .await;
    let replay = Reply::of(keyed_post(&proxy.url, "/orders", "r", "{}")).await;
    assert!(replay.is_replay());
    let mismatch = Reply::of(keyed_post(&proxy.url, "/orders", "r", r#"{"other":1}"#)).await;
    assert_eq!(mismatch.status, 422);
    let slow = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "s", "{}")));
    env.upstream.wait_for_key("s", 1).await;
    let conflict = Reply::of(keyed_post(&proxy.url, "/slow", "s", "{}")).await;
    assert_eq!(conflict.status, 409);
    env.upstream.release("slow");
    slow.await.expect("slow request task");

    let admin = &proxy.admin_url;
    assert_eq!(metric(admin, "idemproxy_replays_total", &[]).await, 1.0);
    assert_eq!(metric(admin, "idemproxy_conflicts_total", &[]).await, 1.0);
    assert_eq!(metric(admin, "idemproxy_mismatches_total", &[]).await, 1.0);
    let requests = "idemproxy_requests_total";
    for outcome in ["replayed", "conflict", "mismatch"] {
        let value = metric(admin, requests, &[("outcome", outcome)]).await;
        assert_eq!(value, 1.0, "outcome {outcome}");
    }
    let executed = metric_reaches(admin, requests, &[("outcome", "executed")], 2.0).await;
    assert_eq!(executed, 2.0);
}

#[tokio::test]
async fn healthz_is_200_and_readyz_follows_the_store() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env.config().set("store.url", env.db().url_via(relay.addr()));
    let proxy = InProcessProxy::start(&config).await;
    let get = |path: &str| Reply::of(client().get(format!("{}{path}", proxy.admin_url)));

    assert_eq!(get("/healthz").await.status, 200);
    assert_eq!(get("/readyz").await.status, 200);

    relay.cut();
    // The last ping's "ready" stands for up to a second while nothing else has seen the store fail.
    poll_until("/readyz to see the store gone", || async {
        (get("/readyz").await.status == 503).then_some(())
    })
    .await;
    assert_eq!(
        get("/healthz").await.status,
        200,
        "liveness does not depend on the store"
    );

    relay.restore();
    poll_until("/readyz to recover", || async {
        (get("/readyz").await.status == 200).then_some(())
    })
    .await;
}
