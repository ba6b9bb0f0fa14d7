//! A client that has the whole response gets the replay: the relay holds back whatever completes the
//! response (the last bytes of a declared length, the end of a chunked or HTTP/2 body, the head of an
//! empty one) until the record is stored. Hundreds of sequential rounds per body kind, each a new key
//! whose retry goes out over a new connection the moment the first response has been read: not one 409.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rstest::rstest;

use crate::support::Backend::{self, Citus, Postgres, Redis, RedisCluster, Sqlite};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::{InProcessProxy, Relay, Reply, TestEnv, keyed_post, metric, unless_skipped};

/// Rounds per body kind and store.
const ROUNDS: usize = 200;

/// How the upstream frames its answer, and how the client speaks to the proxy.
#[derive(Debug, Clone, Copy)]
enum Kind {
    /// HTTP/1.1, `content-length` body.
    Length,
    /// HTTP/1.1, chunked body.
    Chunked,
    /// HTTP/1.1, 204 without a body.
    NoContent,
    /// HTTP/1.1, 200 with `content-length: 0`.
    ZeroLength,
    /// HTTP/2 (h2c), `content-length` body.
    Http2,
    /// HTTP/2 (h2c), a body of unknown length.
    Http2Chunked,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Length | Kind::Http2 => "/orders",
            Kind::Chunked | Kind::Http2Chunked => "/chunked",
            Kind::NoContent => "/empty",
            Kind::ZeroLength => "/empty-200",
        }
    }

    fn http2(self) -> bool {
        matches!(self, Kind::Http2 | Kind::Http2Chunked)
    }
}

/// One keyed POST over a connection of its own; the response read to its end.
async fn send(proxy: &str, kind: Kind, key: &str) -> Reply {
    if !kind.http2() {
        return Reply::of(keyed_post(proxy, kind.path(), key, "{}")).await;
    }
    // A client of its own per request: its connection is new, as a retrying client's would be.
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let request = http::Request::post(format!("{proxy}{}", kind.path()))
        .header("idempotency-key", key)
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let response = h2.request(request).await.expect("h2c request");
    assert_eq!(response.version(), http::Version::HTTP_2);
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the whole h2 body").to_bytes();
    Reply {
        status: reqwest::StatusCode::from_u16(parts.status.as_u16()).unwrap(),
        headers: to_reqwest(&parts.headers),
        body,
    }
}

fn to_reqwest(headers: &http::HeaderMap) -> reqwest::header::HeaderMap {
    let mut out = reqwest::header::HeaderMap::new();
    for (name, value) in headers {
        let name = reqwest::header::HeaderName::from_bytes(name.as_str().as_bytes()).unwrap();
        let value = reqwest::header::HeaderValue::from_bytes(value.as_bytes()).unwrap();
        out.append(name, value);
    }
    out
}

#[rstest]
#[tokio::test]
async fn a_retry_sent_the_moment_the_response_is_read_gets_the_replay(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
    #[values(
        Kind::Length,
        Kind::Chunked,
        Kind::NoContent,
        Kind::ZeroLength,
        Kind::Http2,
        Kind::Http2Chunked
    )]
    kind: Kind,
) {
    unless_skipped!(backend);
    let env = TestEnv::on(backend).await;
    // Without the replay cache every retry reads the store, as a retry sent to another replica does.
    let proxy = InProcessProxy::start(&env.config().set("replay_cache.max_size", "0")).await;
    let mut conflicts = Vec::new();
    for round in 0..ROUNDS {
        let key = format!("{kind:?}-{round}");
        let first = send(&proxy.url, kind, &key).await;
        assert!(first.status.is_success(), "{key}: {first:?}");
        assert!(!first.is_replay());
        let retry = send(&proxy.url, kind, &key).await;
        if retry.status == 409 {
            conflicts.push(key);
            continue;
        }
        assert!(retry.is_replay(), "{key}: the retry must be a replay: {retry:?}");
        assert_eq!((retry.status, &retry.body), (first.status, &first.body), "{key}");
    }
    assert!(
        conflicts.is_empty(),
        "{} of {ROUNDS} immediate retries got 409: {conflicts:?}",
        conflicts.len()
    );
    assert_eq!(env.upstream.executions(), ROUNDS);
    let hold_expired = metric(&proxy.admin_url, "idemproxy_completion_hold_expired_total", &[]).await;
    assert_eq!(hold_expired, 0.0, "every record was stored within the hold");
}

/// A store that does not answer holds the client only for the bound: the response arrives, the hold's
/// expiry is counted, and the completion goes on in the background, so a retry after the store is back
/// gets the replay.
#[tokio::test]
async fn a_store_slower_than_the_hold_delays_the_client_only_for_the_bound() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env
        .config()
        .set("store.url", env.db().url_via(relay.addr()))
        .set("store.timeout", "1s")
        .set("store.max_batch", 1)
        .set("replay_cache.max_size", "0");
    let proxy = InProcessProxy::start(&config).await;
    // The claim goes through, then the store stalls before the completion.
    let gate = "hold";
    let sending = tokio::spawn({
        let url = proxy.url.clone();
        async move { Reply::of(keyed_post(&url, "/status/201", "slow-store", "{}").header("x-gate", gate)).await }
    });
    env.upstream.wait_for_key("slow-store", 1).await;
    relay.stall();
    let started = std::time::Instant::now();
    env.upstream.release(gate);
    let first = tokio::time::timeout(Duration::from_secs(30), sending)
        .await
        .expect("the client is let go after the hold")
        .unwrap();
    assert_eq!(first.status, 201);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_completion_hold_expired_total", &[]).await,
        1.0
    );
    relay.resume();
    let retry = crate::support::settled(|| keyed_post(&proxy.url, "/status/201", "slow-store", "{}")).await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(env.upstream.executions_for_key("slow-store"), 1);
}
