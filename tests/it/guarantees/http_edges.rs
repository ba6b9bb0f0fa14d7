//! HTTP edge cases are refused, never forwarded: `CONNECT` (which would make the proxy a tunnel) and
//! `TRACE` (which echoes credentials) get 405 on HTTP/1.1 and HTTP/2, and an HTTP/2 request whose body
//! ends before its declared `content-length` is a malformed request (RFC 9113 §8.1.1) that reaches the
//! upstream only as an aborted one, never as complete, and claims nothing.

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use rstest::rstest;

use crate::support::http::TEST_CREDENTIAL;
use crate::support::raw::{self, addr_of, head};
use crate::support::raw_h2;
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, poll_until};

#[tokio::test]
async fn connect_and_trace_get_405_on_http1_and_are_never_forwarded() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let host = addr_of(&proxy.url);
    let keyed = ["idempotency-key: edge", "content-length: 0"];
    let requests = [
        head("CONNECT example.com:443", "example.com:443", &[]),
        head("CONNECT example.com:443", "example.com:443", &keyed),
        head("TRACE /orders", host, &[]),
        head("TRACE /orders", host, &keyed),
    ];
    for request in &requests {
        let reply = raw::exchange(&proxy.url, request.as_bytes()).await;
        reply.assert_problem(405, "method-not-allowed");
        let allow = reply
            .header("allow")
            .unwrap_or_else(|| panic!("no Allow: {reply:?}"));
        assert!(!allow.contains("CONNECT") && !allow.contains("TRACE"), "{allow}");
    }
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn connect_and_trace_get_405_on_http2_and_are_never_forwarded() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let mut client = raw_h2::connect(&proxy.url).await;
    let connect = Request::builder()
        .method(Method::CONNECT)
        .uri("example.com:443")
        .body(())
        .unwrap();
    let trace = Request::builder()
        .method(Method::TRACE)
        .uri(format!("{}/orders", proxy.url))
        .header("idempotency-key", "edge")
        .header("authorization", TEST_CREDENTIAL)
        .body(())
        .unwrap();
    for request in [connect, trace] {
        let method = request.method().clone();
        let (response, _) = client.send_request(request, true).expect("send");
        let reply = raw_h2::reply(response).await.expect("an answer, not a reset");
        reply.assert_problem(405, "method-not-allowed");
        assert!(reply.header("allow").is_some(), "{method}: no Allow header");
    }
    assert_eq!(env.upstream.executions(), 0);
}

/// Sends `content-length: 10` with 5 bytes and END_STREAM: in one DATA frame, or (`split`) the bytes
/// first and END_STREAM in an empty frame after them, so the proxy has already read part of the body.
async fn short_h2_body(proxy: &InProcessProxy, key: Option<&str>, split: bool) -> Result<Reply, h2::Error> {
    let mut client = raw_h2::connect(&proxy.url).await;
    let mut request = Request::post(format!("{}/orders", proxy.url))
        .header("content-length", "10")
        .header("content-type", "application/json")
        .header("authorization", TEST_CREDENTIAL);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let (response, mut body) = client
        .send_request(request.body(()).unwrap(), false)
        .expect("send the head");
    if split {
        body.send_data(Bytes::from_static(b"12345"), false)
            .expect("send 5 bytes");
        body.send_data(Bytes::new(), true).expect("end the stream");
    } else {
        body.send_data(Bytes::from_static(b"12345"), true)
            .expect("send 5 bytes and end");
    }
    raw_h2::reply(response).await
}

/// RFC 9113 §8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR, which the h2 library
/// raises as the short frame arrives; a 400 before it is allowed but cannot be sent on a stream that
/// is already reset. Either way, not a success.
fn assert_refused(answer: Result<Reply, h2::Error>) {
    match answer {
        Ok(reply) => reply.assert_problem(400, "bad-request-body"),
        Err(error) => assert_eq!(error.reason(), Some(h2::Reason::PROTOCOL_ERROR), "{error}"),
    }
}

#[rstest]
#[tokio::test]
async fn an_h2_body_shorter_than_its_content_length_is_refused_and_never_forwarded_whole(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
    #[values(false, true)] split: bool,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    // Keyed: the body is read whole before anything is claimed, so nothing is.
    assert_refused(short_h2_body(&proxy, Some("short"), split).await);

    // Passthrough: the upstream may see the request begin, never end. The proxy's connection to it
    // opens (the request is forwarded as it arrives) and closes with the request aborted.
    assert_refused(short_h2_body(&proxy, None, split).await);
    poll_until(
        "the upstream connection of the aborted request closed",
        || async {
            let upstream = &env.upstream;
            (upstream.connections() >= 1 && upstream.open_connections() == 0).then_some(())
        },
    )
    .await;
    assert_eq!(env.upstream.executions(), 0, "{:?}", env.upstream.requests());

    // The key was never claimed: the whole request executes now, once.
    let whole = Reply::of(keyed_post(&proxy.url, "/orders", "short", "1234567890")).await;
    assert_eq!(whole.status, StatusCode::CREATED, "{}", whole.text());
    assert!(!whole.is_replay());
    assert_eq!(env.upstream.executions_for_key("short"), 1);
    assert_eq!(env.upstream.requests()[0].body.len(), 10);
}
