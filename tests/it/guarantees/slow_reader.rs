//! A client that stops reading does not hold its key: after `server.write_timeout` without taking a
//! byte it is let go (its response ends in an error, never as complete), the relay reads the upstream
//! to the end and stores the response, and a retry gets the replay.

use std::time::Duration;

use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::http::{TEST_CREDENTIAL, client};
use crate::support::raw::{self, addr_of};
use crate::support::upstream::big_body;
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, metric_reaches, settled};

/// Far more than the socket buffers on both sides of loopback and the relay's channel hold.
const BODY: usize = 32 << 20;

#[rstest]
#[tokio::test]
async fn a_client_that_stops_reading_is_let_go_and_the_response_is_stored(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("server.write_timeout", "1s")
        .set("idempotency.max_stored_response", "64MiB")
        .set("server.max_buffered_responses", "128MiB")
        .set("replay_cache.max_size", "0");
    let proxy = InProcessProxy::start(&config).await;
    let path = format!("/big?bytes={BODY}");
    let mut stalled = raw::connect(&proxy.url).await;
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {}\r\nidempotency-key: stuck\r\nauthorization: {TEST_CREDENTIAL}\r\n\
         content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}",
        addr_of(&proxy.url)
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    // The client reads nothing: the proxy must let it go on its own.
    metric_reaches(&proxy.admin_url, "idemproxy_write_timeouts_total", &[], 1.0).await;

    let replay = settled(|| keyed_post(&proxy.url, &path, "stuck", "{}")).await;
    assert_eq!(replay.status, 200);
    assert!(replay.is_replay(), "{:?}", replay.headers);
    assert!(replay.body == big_body(BODY), "the whole body was stored");
    assert_eq!(env.upstream.executions_for_key("stuck"), 1);

    assert_cut_short(stalled).await;
}

/// The same bound holds for every response: a client that stops reading a passthrough response is let go
/// after `write_timeout`, and the upstream connection behind it comes back, so a worker's capped upstream
/// connections cannot be held by clients that read nothing.
#[tokio::test]
async fn a_passthrough_client_that_stops_reading_does_not_hold_an_upstream_connection() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("server.write_timeout", "1s")
        .set("server.workers", 1)
        .set("upstream.max_connections", 1)
        .set("upstream.connect_timeout", "10s");
    let proxy = InProcessProxy::start(&config).await;
    let mut stalled = raw::connect(&proxy.url).await;
    let request = format!(
        "GET /big?bytes={BODY} HTTP/1.1\r\nhost: {}\r\n\r\n",
        addr_of(&proxy.url)
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    metric_reaches(&proxy.admin_url, "idemproxy_write_timeouts_total", &[], 1.0).await;

    let next = Reply::of(client().get(format!("{}/orders", proxy.url))).await;
    assert_eq!(
        next.status,
        201,
        "the one upstream connection came back: {}",
        next.text()
    );
    assert_cut_short(stalled).await;
}

/// What a stalled client can still read ends short of the full response, and the proxy closes the
/// connection: the response never looks complete.
async fn assert_cut_short(mut stalled: tokio::net::TcpStream) {
    let mut received = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stalled.read_to_end(&mut received)).await;
    assert!(read.is_ok(), "the proxy closed the stalled connection");
    assert!(
        received.len() < BODY,
        "{} bytes reached the stalled client",
        received.len()
    );
}
