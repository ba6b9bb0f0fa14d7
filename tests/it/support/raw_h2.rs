//! Raw HTTP/2 with prior knowledge, through the `h2` library, for what a client library never sends: a
//! body ended by `RST_STREAM` instead of `END_STREAM`, streams abandoned by the dozen on one connection,
//! a body longer than its `content-length`, a client that grants no flow-control window.

use bytes::{Bytes, BytesMut};
use h2::client::{ResponseFuture, SendRequest};
use h2::{Reason, SendStream};
use http::Request;

use super::Reply;
use super::http::TEST_CREDENTIAL;
use super::raw;

/// An HTTP/2 connection to the proxy at `base`, driven on its own task.
pub async fn connect(base: &str) -> SendRequest<Bytes> {
    connect_with(base, &h2::client::Builder::new()).await
}

/// An HTTP/2 connection whose streams grant no flow-control window (`SETTINGS_INITIAL_WINDOW_SIZE`
/// 0): the proxy may send response heads on it, never a byte of a body.
pub async fn connect_without_window(base: &str) -> SendRequest<Bytes> {
    connect_with(base, h2::client::Builder::new().initial_window_size(0)).await
}

async fn connect_with(base: &str, builder: &h2::client::Builder) -> SendRequest<Bytes> {
    let socket = raw::connect(base).await;
    let (client, connection) = builder.handshake(socket).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.expect("h2 connection ready")
}

/// Opens `POST path` on `client` with the test credential, `key` (if any) and `headers`, leaving the
/// body open for the test to send.
pub async fn open_post(
    client: &mut SendRequest<Bytes>,
    base: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
) -> (ResponseFuture, SendStream<Bytes>) {
    let mut request = Request::post(format!("{base}{path}"))
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let ready = client
        .clone()
        .ready()
        .await
        .expect("a stream slot on the connection");
    *client = ready;
    client
        .send_request(request.body(()).unwrap(), false)
        .expect("send the head")
}

/// Sends part of a body, then abandons the stream with `RST_STREAM(reason)` instead of `END_STREAM`.
pub fn abandon(mut body: SendStream<Bytes>, part: &'static [u8], reason: Reason) {
    body.send_data(Bytes::from_static(part), false)
        .expect("send part of the body");
    body.send_reset(reason);
}

/// The whole answer to an HTTP/2 request, or the stream error that ended it.
pub async fn reply(response: ResponseFuture) -> Result<Reply, h2::Error> {
    let (parts, mut body) = response.await?.into_parts();
    let mut bytes = BytesMut::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: bytes.freeze(),
    })
}

/// A whole keyed `POST path` with `body` on `client`, answered.
pub async fn keyed_post(
    client: &mut SendRequest<Bytes>,
    base: &str,
    path: &str,
    key: &str,
    body: &'static [u8],
) -> Result<Reply, h2::Error> {
    let (response, mut stream) = open_post(client, base, path, Some(key), &[]).await;
    stream
        .send_data(Bytes::from_static(body), true)
        .expect("send the body");
    reply(response).await
}
