//! One proxy, one client: execute once, replay, refuse what must be refused, pass the rest through.

use rstest::rstest;

use reqwest::header::HeaderMap;

use crate::support::http::stream_until_first_chunk;
use crate::support::{
    Backend, InProcessProxy, Reply, TestEnv,
    http::client,
    keyed_post, poll_until, settled,
    upstream::{FIRST_CHUNK, REST_CHUNK, big_body},
};

/// Headers that describe one connection's framing, which a replay may legitimately frame anew.
const FRAMING: [&str; 5] = [
    "connection",
    "content-length",
    "date",
    "keep-alive",
    "transfer-encoding",
];

fn end_to_end(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let mut kept: Vec<_> = headers
        .iter()
        .filter(|(name, _)| !FRAMING.contains(&name.as_str()))
        .filter(|(name, _)| name.as_str() != "idempotent-replayed")
        .map(|(name, value)| (name.to_string(), value.as_bytes().to_vec()))
        .collect();
    kept.sort();
    kept
}

#[rstest]
#[tokio::test]
async fn new_key_executes_once_and_retry_replays_identically(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "order-1", r#"{"amount":1}"#)).await;
    assert_eq!(first.status, 201, "body: {}", first.text());
    assert!(!first.is_replay());
    assert_eq!(first.header("x-upstream-exec"), Some("1"));
    assert_eq!(first.header("x-custom"), Some("value"));

    let retry = settled(|| keyed_post(&proxy.url, "/orders", "order-1", r#"{"amount":1}"#)).await;
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body, "replayed body differs");
    assert_eq!(end_to_end(&retry.headers), end_to_end(&first.headers));
    assert_eq!(env.upstream.executions_for_key("order-1"), 1);
}

#[rstest]
#[tokio::test]
async fn same_key_with_another_body_is_422(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "k", r#"{"amount":1}"#)).await;
    assert_eq!(first.status, 201);
    let other = Reply::of(keyed_post(&proxy.url, "/orders", "k", r#"{"amount":2}"#)).await;
    other.assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn server_errors_and_try_later_statuses_are_not_stored(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    for status in [500, 503, 429] {
        let key = format!("status-{status}");
        let path = format!("/status/{status}");
        for attempt in 1..=2 {
            let reply = Reply::of(keyed_post(&proxy.url, &path, &key, "{}")).await;
            assert_eq!(reply.status, status, "attempt {attempt}: {}", reply.text());
            assert!(!reply.is_replay(), "{status} was replayed");
        }
        assert_eq!(env.upstream.executions_for_key(&key), 2, "{status}");
    }
}

#[rstest]
#[tokio::test]
async fn required_key_missing_is_400(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("idempotency.required", true);
    let proxy = InProcessProxy::start(&config).await;

    let reply = Reply::of(client().post(format!("{}/orders", proxy.url)).body("{}")).await;
    reply.assert_problem(400, "missing-key");
    assert_eq!(env.upstream.executions(), 0);

    let get = Reply::of(client().get(format!("{}/orders", proxy.url))).await;
    assert_eq!(get.status, 201, "GET is not a protected method: {}", get.text());
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn another_authorization_is_another_scope(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;
    let post = |who: &str| keyed_post(&proxy.url, "/orders", "shared", "{}").header("authorization", who);

    let alice = Reply::of(post("Bearer alice")).await;
    let bob = Reply::of(post("Bearer bob")).await;
    assert_eq!(alice.status, 201);
    assert_eq!(bob.status, 201);
    assert!(!bob.is_replay(), "bob saw alice's response");
    assert_ne!(alice.body, bob.body);
    assert_eq!(env.upstream.executions_for_key("shared"), 2);

    let alice_again = settled(|| post("Bearer alice")).await;
    assert!(alice_again.is_replay());
    assert_eq!(alice_again.body, alice.body);
}

#[rstest]
#[tokio::test]
async fn body_over_max_request_body_is_413_and_claims_nothing(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("idempotency.max_request_body", "1KiB");
    let proxy = InProcessProxy::start(&config).await;

    let big = "x".repeat(2000);
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "k", &big)).await;
    reply.assert_problem(413, "request-too-large");
    assert_eq!(env.upstream.executions(), 0);

    let small = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert_eq!(small.status, 201, "the refused request must not hold the key");
    assert!(!small.is_replay());
}

#[rstest]
#[tokio::test]
async fn expired_key_executes_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("idempotency.ttl", "2s")
        .set("idempotency.lock_timeout", "1s");
    let proxy = InProcessProxy::start(&config).await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert_eq!(first.status, 201);
    let retry = settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert!(retry.is_replay(), "a retry within the TTL is a replay");

    let after_ttl = poll_until("the key to expire", || async {
        let reply = settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;
        (!reply.is_replay()).then_some(reply)
    })
    .await;
    assert_eq!(after_ttl.status, 201, "body: {}", after_ttl.text());
    assert_eq!(after_ttl.header("x-upstream-exec"), Some("2"));
    assert_eq!(env.upstream.executions_for_key("k"), 2);
}

#[rstest]
#[tokio::test]
async fn first_chunk_reaches_client_before_upstream_finishes(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let mut response = stream_until_first_chunk(&proxy.url, "k").await;

    env.upstream.release("stream");
    let mut rest = Vec::new();
    while let Some(chunk) = response.chunk().await.expect("read the rest") {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, REST_CHUNK);

    let replay = settled(|| keyed_post(&proxy.url, "/stream", "k", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, [FIRST_CHUNK, REST_CHUNK].concat());
}

#[rstest]
#[tokio::test]
async fn response_over_max_stored_response_is_delivered_then_not_retained(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("idempotency.max_stored_response", "64KiB");
    let proxy = InProcessProxy::start(&config).await;

    let first = Reply::of(keyed_post(&proxy.url, "/big?bytes=200000", "k", "{}")).await;
    assert_eq!(first.status, 200);
    assert!(first.body == big_body(200_000), "the client gets every byte");

    let retry = settled(|| keyed_post(&proxy.url, "/big?bytes=200000", "k", "{}")).await;
    retry.assert_problem(410, "response-not-retained");
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn passthrough_forwards_and_strips_hop_by_hop_headers(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let reply = Reply::of(
        client()
            .get(format!("{}/things?x=1", proxy.url))
            .header("connection", "x-hop")
            .header("x-hop", "dropped")
            .header("keep-alive", "timeout=5")
            .header("proxy-authorization", "Basic c2VjcmV0")
            .header("x-end-to-end", "kept"),
    )
    .await;
    assert_eq!(reply.status, 201, "body: {}", reply.text());

    let seen = &env.upstream.requests()[0];
    assert_eq!(seen.method, "GET");
    assert_eq!(seen.path_and_query, "/things?x=1");
    let header = |name: &str| seen.headers.get(name).map(|v| v.to_str().unwrap());
    assert_eq!(header("x-end-to-end"), Some("kept"));
    for hop in ["x-hop", "keep-alive", "proxy-authorization"] {
        assert_eq!(header(hop), None, "{hop} was forwarded");
    }
    assert_eq!(header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(header("x-forwarded-proto"), Some("http"));
    let proxy_host = proxy.url.strip_prefix("http://").unwrap();
    assert_eq!(header("x-forwarded-host"), Some(proxy_host));
}

#[rstest]
#[tokio::test]
async fn hop_by_hop_response_headers_are_neither_forwarded_nor_stored(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let first = Reply::of(keyed_post(&proxy.url, "/hop-by-hop", "k", "{}")).await;
    let replay = settled(|| keyed_post(&proxy.url, "/hop-by-hop", "k", "{}")).await;
    assert!(replay.is_replay());
    for reply in [&first, &replay] {
        assert_eq!(reply.status, 201);
        assert_eq!(reply.header("x-custom"), Some("value"));
        assert_eq!(reply.header("x-upstream-hop"), None);
        assert_eq!(reply.header("proxy-authenticate"), None);
    }
}

#[rstest]
#[tokio::test]
async fn keyed_get_is_not_protected(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    for _ in 0..2 {
        let reply = Reply::of(
            client()
                .get(format!("{}/things", proxy.url))
                .header("idempotency-key", "k"),
        )
        .await;
        assert_eq!(reply.status, 201);
        assert!(!reply.is_replay());
    }
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn each_worker_reuses_its_own_upstream_connection(#[values(1, 2)] workers: i64) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config().set("server.workers", workers);
    let proxy = InProcessProxy::start(&config).await;

    // The test client opens a connection per request; the proxy hands connections to its workers in turn.
    for round in 0..3 {
        let get = Reply::of(client().get(format!("{}/things", proxy.url))).await;
        assert_eq!(get.status, 201, "body: {}", get.text());
        let key = format!("k{round}");
        let post = Reply::of(keyed_post(&proxy.url, "/orders", &key, "{}")).await;
        assert_eq!(post.status, 201, "body: {}", post.text());
    }
    assert_eq!(env.upstream.executions(), 6);
    assert_eq!(env.upstream.connections(), workers as usize);
}

#[tokio::test]
async fn several_workers_serve_concurrent_clients() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config().set("server.workers", 3);
    let proxy = InProcessProxy::start(&config).await;

    let requests = (0..24).map(|i| Reply::of(keyed_post(&proxy.url, "/orders", &format!("k{i}"), "{}")));
    let replies = futures_util::future::join_all(requests).await;
    for reply in &replies {
        assert_eq!(reply.status, 201, "body: {}", reply.text());
    }
    assert_eq!(env.upstream.executions(), 24);
    for i in 0..24 {
        assert_eq!(env.upstream.executions_for_key(&format!("k{i}")), 1);
    }
}
