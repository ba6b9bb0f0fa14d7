//! Unknown outcomes can be held. With `on_unknown_outcome = "hold"`, a request the upstream may have
//! executed without a full answer coming back (a timeout, a reset mid-response, a 101) marks its key
//! `unknown`: retries get 502 `outcome-unknown` and are not forwarded until `idemproxy keys release`.
//! With the default `"retry"`, a retry meets 409 (a short `Retry-After`) until the lease runs out.

use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::cli::keys;
use crate::support::http::client;
use crate::support::{
    Backend, InProcessProxy, ProxyConfig, Reply, TestEnv, TestStore, keyed_post, metric, metric_reaches,
};

fn holding(env: &TestEnv) -> ProxyConfig {
    env.config()
        .set("idempotency.on_unknown_outcome", "hold")
        .set("replay_cache.max_size", "0")
}

async fn keys_json(store: &TestStore, args: &[&str]) -> serde_json::Value {
    let output = keys(store, args).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[rstest]
#[tokio::test]
async fn a_reset_mid_response_is_held_until_an_operator_releases_the_key(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&holding(&env)).await;
    let broken = match keyed_post(&proxy.url, "/reset-mid-body", "unsure", "{}")
        .send()
        .await
    {
        Ok(response) => response.bytes().await.is_err(),
        Err(_) => true,
    };
    assert!(broken, "the client must not see a complete body");
    let retry = crate::support::poll_until("the key to be held", || async {
        let reply = Reply::of(keyed_post(&proxy.url, "/reset-mid-body", "unsure", "{}")).await;
        (reply.status != 409).then_some(reply)
    })
    .await;
    retry.assert_problem(502, "outcome-unknown");
    let again = Reply::of(keyed_post(&proxy.url, "/reset-mid-body", "unsure", "{}")).await;
    again.assert_problem(502, "outcome-unknown");
    assert_eq!(
        env.upstream.executions_for_key("unsure"),
        1,
        "not forwarded again"
    );
    let other = Reply::of(keyed_post(&proxy.url, "/reset-mid-body", "unsure", "{\"x\":1}")).await;
    other.assert_problem(422, "key-reused");
    let held = [("outcome", "held")];
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_requests_total", &held).await,
        2.0
    );
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_unknown_outcomes_total", &[]).await,
        1.0
    );

    let shown = keys_json(&env.store, &["show", "unsure", "--json"]).await;
    assert_eq!(shown[0]["status"], "unknown", "{shown}");
    let text = keys(&env.store, &["show", "unsure"]).await;
    assert!(String::from_utf8_lossy(&text.stdout).contains("held"), "{text:?}");
    let stats = keys_json(&env.store, &["stats", "--json"]).await;
    assert_eq!(stats["unknown"], 1, "{stats}");

    let released = keys(&env.store, &["release", "unsure"]).await;
    assert!(
        released.status.success(),
        "{}",
        String::from_utf8_lossy(&released.stdout)
    );
    let _ = keyed_post(&proxy.url, "/reset-mid-body", "unsure", "{}")
        .send()
        .await;
    env.upstream.wait_for_key("unsure", 2).await;
}

#[rstest]
#[tokio::test]
async fn an_upstream_timeout_is_held(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&holding(&env).set("upstream.timeout", "1s")).await;
    let first = Reply::of(keyed_post(&proxy.url, "/slow", "late", "{}")).await;
    first.assert_problem(504, "upstream-timeout");
    // Held before the client was answered: the retry right after it is refused as held, not in flight.
    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "late", "{}")).await;
    retry.assert_problem(502, "outcome-unknown");
    env.upstream.release("slow");
    assert_eq!(env.upstream.executions_for_key("late"), 1);
}

#[rstest]
#[tokio::test]
async fn by_default_an_unknown_outcome_waits_for_the_lease_with_a_short_retry_hint(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("upstream.timeout", "1s")
        .set("idempotency.lock_timeout", "3s");
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/slow", "late", "{}")).await;
    first.assert_problem(504, "upstream-timeout");
    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "late", "{}")).await;
    retry.assert_problem(409, "key-in-flight");
    assert_eq!(retry.retry_after(), 1, "a short hint, never the lease left");
    env.upstream.release("slow");
    metric_reaches(&proxy.admin_url, "idemproxy_unknown_outcomes_total", &[], 1.0).await;
    let after_lease = crate::support::settled(|| keyed_post(&proxy.url, "/slow", "late", "{}")).await;
    assert_eq!(
        after_lease.status, 201,
        "after the lease the retry executes (a stale takeover)"
    );
    assert_eq!(env.upstream.executions_for_key("late"), 2);
}

/// An upstream that answers every request with `101 Switching Protocols` and holds the connection.
async fn switching_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let answer = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n";
                let _ = stream.write_all(answer).await;
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest).await;
            });
        }
    });
    url
}

#[rstest]
#[tokio::test]
async fn a_101_from_the_upstream_is_never_relayed_or_stored(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = ProxyConfig::on(&env.store, &switching_upstream().await)
        .set("idempotency.on_unknown_outcome", "hold");
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "switch", "{}")).await;
    first.assert_problem(502, "upstream-invalid-response");
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "switch", "{}")).await;
    retry.assert_problem(502, "outcome-unknown");
    let shown = keys_json(&env.store, &["show", "switch", "--json"]).await;
    assert_eq!(shown[0]["status"], "unknown", "{shown}");
    assert_eq!(
        shown[0]["response_status"],
        serde_json::Value::Null,
        "nothing stored: {shown}"
    );
    let passthrough = Reply::of(client().get(format!("{}/orders", proxy.url))).await;
    passthrough.assert_problem(502, "upstream-invalid-response");
}
