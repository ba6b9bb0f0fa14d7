//! Trailers over HTTP/1.1, from the client's side: a chunked request's trailers reach the upstream, and
//! a chunked response's trailers (declared in its `Trailer` header, as HTTP/1.1 requires) reach the
//! client on a passthrough, on a keyed request's first execution, and on its replay. The client and the
//! upstream are hyper's HTTP/1.1 client and server, over real sockets.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::stream;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use crate::support::http::TEST_CREDENTIAL;
use crate::support::{Backend, InProcessProxy, ProxyConfig, TestStore};

type Frames = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// A body of `data` then `trailers`, of no declared length (sent chunked over HTTP/1.1).
fn with_trailers(data: &'static str, trailers: &[(&'static str, &'static str)]) -> Frames {
    let mut map = HeaderMap::new();
    for (name, value) in trailers {
        map.insert(*name, HeaderValue::from_static(value));
    }
    StreamBody::new(stream::iter(vec![
        Ok(Frame::data(Bytes::from_static(data.as_bytes()))),
        Ok(Frame::trailers(map)),
    ]))
}

/// What the upstream saw of each request: its body and its trailers.
type Seen = Arc<Mutex<Vec<(Bytes, Option<HeaderMap>)>>>;

/// An HTTP/1.1 upstream on 127.0.0.1:0 that answers every request with a chunked `paid` and the trailer
/// `x-checksum: sha-1234`, declared in its `Trailer` header; its URL and what it saw.
async fn upstream() -> (String, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Seen::default();
    let recorded = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let recorded = recorded.clone();
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let recorded = recorded.clone();
                async move {
                    let collected = request.into_body().collect().await.unwrap();
                    let trailers = collected.trailers().cloned();
                    recorded.lock().unwrap().push((collected.to_bytes(), trailers));
                    let mut response = Response::new(with_trailers("paid", &[("x-checksum", "sha-1234")]));
                    response
                        .headers_mut()
                        .insert("trailer", HeaderValue::from_static("x-checksum"));
                    Ok::<_, Infallible>(response)
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    (url, seen)
}

/// Sends a chunked `POST /pay` with the trailer `x-digest: d-42` (declared) over HTTP/1.1 to the proxy
/// at `url`, with `key` if given: the response's status, headers, body and trailers.
async fn post(url: &str, key: Option<&str>) -> (u16, HeaderMap, Bytes, Option<HeaderMap>) {
    let authority = url.trim_start_matches("http://");
    let stream = TcpStream::connect(authority).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut request = Request::post("/pay")
        .header("host", authority)
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .header("te", "trailers")
        .header("trailer", "x-digest")
        .body(with_trailers("{\"amount\":42}", &[("x-digest", "d-42")]))
        .unwrap();
    if let Some(key) = key {
        request
            .headers_mut()
            .insert("idempotency-key", HeaderValue::from_str(key).unwrap());
    }
    let response = sender.send_request(request).await.unwrap();
    let (head, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (head.status.as_u16(), head.headers, collected.to_bytes(), trailers)
}

async fn proxy(upstream: &str) -> (TestStore, InProcessProxy) {
    let store = TestStore::create(Backend::Postgres).await;
    let config = ProxyConfig::on(&store, upstream);
    let proxy = InProcessProxy::start(&config).await;
    (store, proxy)
}

#[tokio::test]
async fn a_chunked_requests_trailers_reach_the_upstream_with_or_without_a_key() {
    let (upstream, seen) = upstream().await;
    let (_store, proxy) = proxy(&upstream).await;

    post(&proxy.url, None).await;
    post(&proxy.url, Some("trailers-in-1")).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    for (body, trailers) in seen {
        assert_eq!(body, "{\"amount\":42}");
        let trailers = trailers.expect("the request's trailers were forwarded");
        assert_eq!(trailers["x-digest"], "d-42");
    }
}

#[tokio::test]
async fn a_chunked_responses_trailers_reach_the_client_and_are_replayed() {
    let (upstream, seen) = upstream().await;
    let (_store, proxy) = proxy(&upstream).await;

    let (status, headers, body, trailers) = post(&proxy.url, None).await;
    assert_eq!((status, &body[..]), (200, &b"paid"[..]));
    assert_eq!(headers["trailer"], "x-checksum");
    assert_eq!(trailers.expect("passthrough trailers")["x-checksum"], "sha-1234");

    let (status, _, body, trailers) = post(&proxy.url, Some("trailers-out-1")).await;
    assert_eq!((status, &body[..]), (200, &b"paid"[..]));
    assert_eq!(
        trailers.expect("the first execution's trailers")["x-checksum"],
        "sha-1234"
    );

    // The retry, sent the moment the first answer was read, is the replay, trailers and all.
    let (status, headers, body, trailers) = post(&proxy.url, Some("trailers-out-1")).await;
    assert_eq!((status, &body[..]), (200, &b"paid"[..]));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(trailers.expect("the replay's trailers")["x-checksum"], "sha-1234");
    assert_eq!(seen.lock().unwrap().len(), 2, "the retry did not execute");
}
