//! The upstream fails: never reached (safe to run again), or maybe reached (ambiguous: hold the key).

use rstest::rstest;

use crate::support::{Backend, InProcessProxy, ProxyConfig, Reply, TestEnv, keyed_post, metric};

#[rstest]
#[tokio::test]
async fn unreachable_upstream_is_502_and_releases_the_key(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closed_url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let config = ProxyConfig::on(&env.store, &closed_url);
    let proxy = InProcessProxy::start(&config).await;

    for attempt in 1..=2 {
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
        assert_eq!(reply.status, 502, "attempt {attempt}: {}", reply.text());
        reply.assert_problem(502, "upstream-unreachable");
    }
    let errors = metric(
        &proxy.admin_url,
        "idemproxy_requests_total",
        &[("outcome", "upstream_error")],
    )
    .await;
    assert_eq!(errors, 2.0);
}

#[rstest]
#[tokio::test]
async fn upstream_timeout_is_504_and_holds_the_key(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("upstream.timeout", "1s");
    let proxy = InProcessProxy::start(&config).await;

    let reply = Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    reply.assert_problem(504, "upstream-timeout");

    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "k", "{}")).await;
    retry.assert_problem(409, "key-in-flight");
    env.upstream.release("slow");
    assert_eq!(env.upstream.executions_for_key("k"), 1);
}

#[rstest]
#[tokio::test]
async fn upstream_reset_mid_body_is_ambiguous_and_not_executed_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let response = keyed_post(&proxy.url, "/reset-mid-body", "k", "{}").send().await;
    let broken = match response {
        Ok(response) => response.bytes().await.is_err(),
        Err(_) => true,
    };
    assert!(broken, "the client must not see a complete body");

    let retry = Reply::of(keyed_post(&proxy.url, "/reset-mid-body", "k", "{}")).await;
    retry.assert_problem(409, "key-in-flight");
    assert_eq!(env.upstream.executions_for_key("k"), 1);
}
