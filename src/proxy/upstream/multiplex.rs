//! Runs when a request goes to the upstream over HTTP/2 (`upstream.protocol`, `pool.rs` decides): keeps
//! one multiplexed connection per worker, on which each request is a stream. hyper's HTTP/2 layer holds
//! back a stream the upstream's SETTINGS leave no room for until one ends; a connection the upstream
//! closes or sends GOAWAY on is replaced by a new one for the requests that come after. Which failures
//! left the request certainly unprocessed follows RFC 9113 §8.7: a stream refused (`REFUSED_STREAM`), or
//! one above the last stream id a GOAWAY says the upstream processed.

use std::sync::Mutex;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri, Version, header};
use hyper::body::Incoming;
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use super::connect::Stream;
use super::send_error::SendError;
use crate::body::ProxyBody;
use crate::error_chain::error_chain;

/// A PING on a connection quiet for this long, so an upstream that vanished is noticed.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// How long the PING's answer may take before the connection is given up.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the upstream may send on one stream ahead of its client reading it.
const STREAM_WINDOW: u32 = 1 << 20;
/// What it may send ahead on the whole connection: 256 streams' worth, more than the concurrent
/// streams most servers allow (Go's 250, hyper's 200), so clients that stop reading their answers fill
/// their own streams' windows, never the connection's that every other request of the worker shares.
/// (hyper's default, 5 MiB against 2 MiB a stream, let three such clients stall the worker's every call.)
const CONNECTION_WINDOW: u32 = 256 * STREAM_WINDOW;

/// The worker's HTTP/2 connection to the upstream, once there is one.
pub(super) struct Multiplexed {
    current: Mutex<Option<SendRequest<ProxyBody>>>,
    /// One new connection at a time: requests that find none wait for it rather than each opening one.
    connecting: tokio::sync::Mutex<()>,
    /// `http` or `https`, as each request's `:scheme`.
    scheme: Scheme,
    /// The `:authority` of a request whose client sent no usable `Host`.
    authority: Authority,
}

impl Multiplexed {
    pub(super) fn new(scheme: Scheme, authority: Authority) -> Multiplexed {
        Multiplexed {
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            scheme,
            authority,
        }
    }

    /// The connection in use, if it is still open.
    fn live(&self) -> Option<SendRequest<ProxyBody>> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().filter(|sender| !sender.is_closed()).cloned()
    }

    #[cfg(test)]
    pub(super) fn is_open(&self) -> bool {
        self.live().is_some()
    }

    /// Makes `sender` the connection in use.
    pub(super) fn adopt(&self, sender: SendRequest<ProxyBody>) {
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = Some(sender);
    }

    /// Sends `request` (origin form, `Host` set) as a stream and waits for its response head. A
    /// connection that can take no new stream (closed, or going away) is replaced first; `connect`
    /// opens the stream a new connection runs on.
    pub(super) async fn send<C, F>(
        &self,
        request: Request<ProxyBody>,
        connect: C,
    ) -> Result<Response<Incoming>, SendError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Stream, SendError>>,
    {
        let mut request = self.in_h2_form(request);
        let mut last_try = false;
        loop {
            let mut sender = match self.live() {
                Some(sender) => sender,
                None => {
                    last_try = true;
                    self.connection(&connect).await?
                }
            };
            // An error here means the connection takes no new streams, and the request has not left.
            if sender.ready().await.is_err() {
                last_try = true;
                sender = self.connection(&connect).await?;
                sender
                    .ready()
                    .await
                    .map_err(|e| SendError::NotSent(error_chain(&e)))?;
            }
            match sender.try_send_request(request).await {
                Ok(response) => return Ok(response),
                Err(mut failed) => {
                    let why = error_chain(failed.error());
                    match failed.take_message() {
                        // The connection closed before the stream was opened: once more, at most.
                        Some(unsent) if !last_try => {
                            request = unsent;
                            last_try = true;
                        }
                        Some(_) => return Err(SendError::NotSent(why)),
                        None if refused(failed.error()) => return Err(SendError::NotSent(why)),
                        None => return Err(SendError::Failed(why)),
                    }
                }
            }
        }
    }

    /// A new connection, unless another request opened one meanwhile.
    async fn connection<C, F>(&self, connect: &C) -> Result<SendRequest<ProxyBody>, SendError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Stream, SendError>>,
    {
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(sender) = self.live().filter(SendRequest::is_ready) {
            return Ok(sender);
        }
        let stream = connect().await?;
        let sender = handshake(stream).await?;
        self.adopt(sender.clone());
        Ok(sender)
    }

    /// The request as HTTP/2 sends it: `:scheme` and `:authority` (the client's `Host`, else the
    /// upstream's own) in the target, no `Host` header.
    fn in_h2_form(&self, mut request: Request<ProxyBody>) -> Request<ProxyBody> {
        let authority = request
            .headers_mut()
            .remove(header::HOST)
            .and_then(|host| Authority::try_from(host.as_bytes()).ok())
            .unwrap_or_else(|| self.authority.clone());
        let mut parts = std::mem::take(request.uri_mut()).into_parts();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(authority);
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        *request.uri_mut() = Uri::from_parts(parts).unwrap_or_default();
        *request.version_mut() = Version::HTTP_2;
        request
    }
}

/// The HTTP/2 handshake over `stream`; the connection runs on a task of its own until it ends.
pub(super) async fn handshake(stream: Stream) -> Result<SendRequest<ProxyBody>, SendError> {
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| SendError::NotSent(format!("HTTP/2 handshake: {}", error_chain(&e))))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(error = %error_chain(&error), "upstream HTTP/2 connection ended with an error");
        }
    });
    Ok(sender)
}

/// Whether the upstream said it did not process the stream: `REFUSED_STREAM`, or a GOAWAY whose last
/// stream id is below the stream's (h2 fails exactly those streams with the GOAWAY's error; one that
/// was processed and then lost its connection fails with a broken pipe instead).
fn refused(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.is_remote() && (h2.is_go_away() || h2.reason() == Some(h2::Reason::REFUSED_STREAM));
        }
        cause = error.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::StatusCode;
    use http_body_util::BodyExt;
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use super::*;
    use crate::body;
    use crate::config::{UpstreamAddress, UpstreamProtocol};
    use crate::proxy::upstream::pool::Pool;

    /// What an HTTP/2 stub upstream does with each stream.
    #[derive(Clone, Copy)]
    enum Answer {
        /// 200 with body `ok`.
        Ok,
        /// `RST_STREAM` with this reason, before any response.
        Reset(h2::Reason),
        /// 200 to the first stream of each connection, then GOAWAY (graceful) and the connection's end.
        OnceThenGoAway,
    }

    /// An h2c upstream on 127.0.0.1:0; reports each connection it accepts.
    async fn upstream(answer: Answer) -> (String, mpsc::UnboundedReceiver<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        let (accepted, connections) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = accepted.send(());
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(stream).await.unwrap();
                    while let Some(Ok((request, mut respond))) = connection.accept().await {
                        drop(request);
                        match answer {
                            Answer::Reset(reason) => respond.send_reset(reason),
                            Answer::Ok | Answer::OnceThenGoAway => {
                                let response = http::Response::new(());
                                let mut body = respond.send_response(response, false).unwrap();
                                body.send_data(Bytes::from_static(b"ok"), true).unwrap();
                            }
                        }
                        if let Answer::OnceThenGoAway = answer {
                            connection.graceful_shutdown();
                        }
                    }
                });
            }
        });
        (authority, connections)
    }

    fn pool(authority: String) -> Pool {
        Pool::new(
            UpstreamAddress::Http { authority },
            UpstreamProtocol::H2c,
            Duration::from_secs(2),
            Duration::from_secs(90),
            16,
        )
    }

    async fn fetch(pool: &Pool) -> Result<Bytes, SendError> {
        let request = Request::post("/pay")
            .header(header::HOST, "api.example")
            .body(body::full("{}"))
            .unwrap();
        let response = pool.send(request).await?;
        assert_eq!(response.status(), StatusCode::OK);
        Ok(response.into_body().collect().await.unwrap().to_bytes())
    }

    #[tokio::test]
    async fn requests_at_once_are_streams_of_one_connection() {
        let (authority, mut connections) = upstream(Answer::Ok).await;
        let pool = pool(authority);
        let fetched = futures_util::future::join_all((0..8).map(|_| fetch(&pool))).await;
        for body in fetched {
            assert_eq!(body.unwrap(), "ok");
        }
        assert_eq!(connections.recv().await, Some(()));
        assert!(connections.try_recv().is_err(), "only one connection was opened");
    }

    #[tokio::test]
    async fn a_stream_the_upstream_refuses_was_not_sent() {
        let (authority, _connections) = upstream(Answer::Reset(h2::Reason::REFUSED_STREAM)).await;
        let failed = fetch(&pool(authority)).await;
        assert!(matches!(failed, Err(SendError::NotSent(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn a_stream_the_upstream_resets_otherwise_may_have_been_processed() {
        let (authority, _connections) = upstream(Answer::Reset(h2::Reason::INTERNAL_ERROR)).await;
        let failed = fetch(&pool(authority)).await;
        assert!(matches!(failed, Err(SendError::Failed(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn after_a_goaway_the_next_request_goes_over_a_new_connection() {
        let (authority, mut connections) = upstream(Answer::OnceThenGoAway).await;
        let pool = pool(authority);
        for _ in 0..3 {
            assert_eq!(fetch(&pool).await.unwrap(), "ok");
            // The GOAWAY, and the connection's end, reach the client after the response does.
            tokio::time::timeout(Duration::from_secs(10), async {
                while pool.multiplexed_is_open() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("the upstream's GOAWAY closes the connection");
        }
        for _ in 0..3 {
            assert_eq!(connections.recv().await, Some(()));
        }
    }
}
