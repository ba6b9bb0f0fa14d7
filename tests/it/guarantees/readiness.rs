//! Readiness probes are cheap for the store and honest about shutdown: probes that come together, or
//! within about a second of each other, share one store ping; `/readyz` answers 503 from the moment
//! shutdown begins, whatever the last ping said, and a "ready" is not reused once a store operation
//! has failed since.

use futures_util::future::join_all;

use crate::support::http::readyz;
use crate::support::{Backend, InProcessProxy, Relay, Reply, TestEnv, keyed_post, metric};

async fn pings(admin_url: &str) -> f64 {
    metric(
        admin_url,
        "idemproxy_store_duration_seconds_count",
        &[("op", "ping")],
    )
    .await
}

#[tokio::test]
async fn a_burst_of_readiness_probes_costs_the_store_a_ping_or_two() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let before = pings(&proxy.admin_url).await;
    let replies = join_all((0..40).map(|_| readyz(&proxy.admin_url))).await;
    for reply in &replies {
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    let spent = pings(&proxy.admin_url).await - before;
    // One ping, or two if the answer cached while the proxy started ran out during the burst.
    assert!(spent <= 2.0, "40 probes cost {spent} store pings");
}

#[tokio::test]
async fn readiness_turns_503_as_soon_as_shutdown_begins() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    // A request held upstream keeps the proxy draining, and so its admin listener serving.
    let held = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "drain", "{}")));
    env.upstream.wait_for_key("drain", 1).await;
    assert_eq!(readyz(&proxy.admin_url).await.status, 200);

    proxy.shutdown.cancel();
    let reply = readyz(&proxy.admin_url).await;
    assert_eq!(reply.status, 503, "a fresh 200 outlived the shutdown");
    assert_eq!(reply.text(), "shutting down\n");

    env.upstream.release("slow");
    assert_eq!(held.await.expect("held request task").status, 201);
    proxy.stop().await.expect("the proxy drains and stops");
}

#[tokio::test]
async fn a_ready_answer_is_not_reused_once_the_store_has_failed_a_request() {
    let env = TestEnv::on(Backend::Postgres).await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env.config().set("store.url", env.db().url_via(relay.addr()));
    let proxy = InProcessProxy::start(&config).await;
    assert_eq!(readyz(&proxy.admin_url).await.status, 200);

    relay.cut();
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "cut", "{}")).await;
    refused.assert_problem(503, "store-unavailable");
    let reply = readyz(&proxy.admin_url).await;
    assert_eq!(reply.status, 503, "{}", reply.text());
}
