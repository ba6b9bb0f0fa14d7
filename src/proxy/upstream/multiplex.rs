//! Runs when a request goes to the upstream over HTTP/2 (`upstream.protocol`, `pool.rs` decides): keeps
//! the worker's multiplexed connections, on which each request is a stream. A request takes a stream on
//! the first connection with fewer than `upstream.max_concurrent_streams` open; when every connection is
//! full, another is opened, within `upstream.max_connections`; at that cap a request waits for a stream
//! to end, and after `upstream.connect_timeout` is refused as busy, never sent. A connection beyond the
//! first that carries no stream for `upstream.idle_timeout` is let go. A connection the upstream closes
//! or sends GOAWAY on is replaced for the requests that come after. Which failures left the request
//! certainly unprocessed follows RFC 9113 §8.7: a stream refused (`REFUSED_STREAM`), or one above the
//! last stream id a GOAWAY says the upstream processed. Such a request is sent once more when a copy of
//! its body was kept (a body read whole, or none); otherwise it was never delivered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderMap, Method, Request, Response, Uri, Version, header};
use hyper::body::Incoming;
use hyper::client::conn::http2::{self, SendRequest};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::connect::Stream;
use super::send_error::SendError;
use crate::body::{ProxyBody, Resendable};
use crate::error_chain::error_chain;

/// A PING on a connection quiet for this long, so an upstream that vanished is noticed.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// How long the PING's answer may take before the connection is given up.
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the upstream may send on one stream ahead of its client reading it.
const STREAM_WINDOW: u32 = 1 << 20;
/// The largest flow-control window HTTP/2 allows (RFC 9113 §6.9.1).
const MAX_WINDOW: u32 = (1 << 31) - 1;

/// How the worker's HTTP/2 connections are shared out.
pub(super) struct Limits {
    /// Most streams open at once on one connection (`upstream.max_concurrent_streams`).
    pub max_streams: usize,
    /// How long a connection beyond the first may carry no stream before it is let go.
    pub idle_timeout: Duration,
    /// How long a request may wait for a stream when every connection the cap allows is full.
    pub wait: Duration,
}

/// The worker's HTTP/2 connections to the upstream.
pub(super) struct Multiplexed {
    /// Open connections, filled in order: the first takes every stream it has room for.
    connections: Mutex<Vec<Connection>>,
    /// One new connection at a time: requests that find no room wait for it rather than each opening one.
    connecting: tokio::sync::Mutex<()>,
    /// Told when a stream ends, for a request waiting for room.
    freed: Arc<Notify>,
    /// The upstream connections the worker may hold, HTTP/2 and HTTP/1.1 alike (`upstream.max_connections`):
    /// each connection's task holds one until the connection closes.
    room: Arc<Semaphore>,
    limits: Limits,
    /// `http` or `https`, as each request's `:scheme`.
    scheme: Scheme,
    /// The `:authority` of a request whose client sent no usable `Host`.
    authority: Authority,
}

/// One HTTP/2 connection, and the streams open on it.
struct Connection {
    sender: SendRequest<ProxyBody>,
    streams: Arc<Streams>,
}

struct Streams {
    open: AtomicUsize,
    /// When the last stream ended (or the connection was made).
    quiet_since: Mutex<Instant>,
}

impl Connection {
    /// Whether no stream has been open on it for `timeout`.
    fn idle_for(&self, timeout: Duration) -> bool {
        self.streams.open.load(Ordering::Acquire) == 0
            && self
                .streams
                .quiet_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                >= timeout
    }
}

/// A stream taken on a connection, given back when dropped (its response body ended or was dropped).
pub(super) struct StreamSlot {
    streams: Arc<Streams>,
    /// Who to tell when the stream ends.
    freed: Arc<Notify>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let was_open = self.streams.open.fetch_sub(1, Ordering::AcqRel);
        if was_open == 1 {
            *self.streams.quiet_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        // Every end, not only one on a full connection: two streams may end before the request woken by
        // the first takes its stream, and the second must wake another.
        self.freed.notify_one();
    }
}

impl Multiplexed {
    pub(super) fn new(
        scheme: Scheme,
        authority: Authority,
        room: Arc<Semaphore>,
        limits: Limits,
    ) -> Multiplexed {
        Multiplexed {
            connections: Mutex::new(Vec::new()),
            connecting: tokio::sync::Mutex::new(()),
            freed: Arc::new(Notify::new()),
            room,
            limits,
            scheme,
            authority,
        }
    }

    /// A stream on the first open connection with room for one. Forgets closed connections, and those
    /// beyond the first that have carried no stream for the idle timeout.
    fn slot(&self) -> Option<(SendRequest<ProxyBody>, StreamSlot)> {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        let mut first = true;
        connections.retain(|connection| {
            let keep =
                !connection.sender.is_closed() && (first || !connection.idle_for(self.limits.idle_timeout));
            first &= !keep;
            keep
        });
        let connection = connections
            .iter()
            .find(|connection| connection.streams.open.load(Ordering::Acquire) < self.limits.max_streams)?;
        connection.streams.open.fetch_add(1, Ordering::AcqRel);
        let slot = StreamSlot {
            streams: connection.streams.clone(),
            freed: self.freed.clone(),
        };
        Some((connection.sender.clone(), slot))
    }

    /// Most streams open at once on one connection.
    pub(super) fn max_streams(&self) -> usize {
        self.limits.max_streams
    }

    /// Connections open now.
    #[cfg(test)]
    pub(super) fn open_connections(&self) -> usize {
        let connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        connections.iter().filter(|c| !c.sender.is_closed()).count()
    }

    /// Makes an HTTP/2 connection over `stream`, holding `room` while it lasts, and sends requests on it.
    pub(super) async fn add(&self, stream: Stream, room: OwnedSemaphorePermit) -> Result<(), SendError> {
        let sender = handshake(stream, room, self.limits.max_streams).await?;
        let connection = Connection {
            sender,
            streams: Arc::new(Streams {
                open: AtomicUsize::new(0),
                quiet_since: Mutex::new(Instant::now()),
            }),
        };
        self.connections
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(connection);
        Ok(())
    }

    /// Sends `request` (origin form, `Host` set) as a stream and waits for its response head; the
    /// stream counts against its connection's limit until the slot returned with it is dropped.
    /// `connect` opens the stream a new connection runs on. A request carrying a [`Resendable`] copy of
    /// its body is sent once more, on another stream, when the upstream refuses its stream unprocessed
    /// (`REFUSED_STREAM`, or above a GOAWAY's last stream id, whose connection is then left).
    pub(super) async fn send<C, F>(
        &self,
        request: Request<ProxyBody>,
        connect: C,
    ) -> Result<(Response<Incoming>, StreamSlot), SendError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Stream, SendError>>,
    {
        let mut request = self.in_h2_form(request);
        let mut again = request.extensions_mut().remove::<Resendable>().map(|body| {
            let head = (
                request.method().clone(),
                request.uri().clone(),
                request.headers().clone(),
            );
            (head, body)
        });
        let mut last_try = false;
        loop {
            let (mut sender, slot) = self.ready_stream(&connect, &mut last_try).await?;
            match sender.try_send_request(request).await {
                Ok(response) => return Ok((response, slot)),
                Err(mut failed) => {
                    let why = error_chain(failed.error());
                    match (failed.take_message(), refused(failed.error())) {
                        // The connection closed before the stream was opened: once more, at most.
                        (Some(unsent), _) if !last_try => {
                            request = unsent;
                            last_try = true;
                        }
                        (Some(_), _) => return Err(SendError::NotSent(why)),
                        (None, Some(refusal)) => {
                            let Some(((method, uri, headers), body)) = again.take() else {
                                return Err(SendError::NotSent(why));
                            };
                            tracing::debug!(
                                why,
                                "the upstream refused the stream unprocessed; sending it once more"
                            );
                            if refusal == Refusal::GoingAway {
                                self.leave(&slot);
                            }
                            request = resent((method, uri, headers), &body);
                        }
                        (None, None) => return Err(SendError::Failed(why)),
                    }
                }
            }
        }
    }

    /// A stream ready to take the request: on the first connection with one free, else on a new
    /// connection (`last_try` set: a request that fails there is not sent again for a closed one).
    async fn ready_stream<C, F>(
        &self,
        connect: &C,
        last_try: &mut bool,
    ) -> Result<(SendRequest<ProxyBody>, StreamSlot), SendError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Stream, SendError>>,
    {
        let (mut sender, mut slot) = match self.slot() {
            Some(found) => found,
            None => {
                *last_try = true;
                self.connection(connect).await?
            }
        };
        // An error here means the connection takes no new streams, and the request has not left.
        if sender.ready().await.is_err() {
            *last_try = true;
            drop(slot);
            (sender, slot) = self.connection(connect).await?;
            sender
                .ready()
                .await
                .map_err(|e| SendError::NotSent(error_chain(&e)))?;
        }
        Ok((sender, slot))
    }

    /// Stops giving streams of `slot`'s connection to new requests (it is going away).
    fn leave(&self, slot: &StreamSlot) {
        let mut connections = self.connections.lock().unwrap_or_else(|e| e.into_inner());
        connections.retain(|connection| !Arc::ptr_eq(&connection.streams, &slot.streams));
    }

    /// A stream on a new connection, unless another request opened one meanwhile or a stream ended; at
    /// the connection cap, waits for either up to the limit's wait, then the request is busy.
    async fn connection<C, F>(&self, connect: &C) -> Result<(SendRequest<ProxyBody>, StreamSlot), SendError>
    where
        C: Fn() -> F,
        F: Future<Output = Result<Stream, SendError>>,
    {
        let deadline = Instant::now() + self.limits.wait;
        let mut permit = None;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            // Registered before looking for room, so a stream that ends meanwhile wakes it.
            freed.as_mut().enable();
            {
                let _one_at_a_time = self.connecting.lock().await;
                if let Some(found) = self.slot() {
                    return Ok(found);
                }
                if let Some(permit) = permit
                    .take()
                    .or_else(|| self.room.clone().try_acquire_owned().ok())
                {
                    self.add(connect().await?, permit).await?;
                    return self.slot().ok_or(SendError::Busy);
                }
            }
            tokio::select! {
                _ = &mut freed => {}
                acquired = self.room.clone().acquire_owned() => {
                    permit = Some(acquired.map_err(|_| SendError::Busy)?);
                }
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(max_streams = self.limits.max_streams,
                        "every stream of every HTTP/2 connection to the upstream stayed busy for the connect timeout");
                    return Err(SendError::Busy);
                }
            }
        }
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

/// The HTTP/2 handshake over `stream`; the connection runs on a task of its own, holding `room`, until
/// it ends. The upstream may send `max_streams` streams' worth ahead on the connection: clients that stop
/// reading their answers fill their own streams' windows, never the connection's that every other
/// request on it shares (hyper's default, 5 MiB against 2 MiB a stream, let three such clients stall
/// every call).
async fn handshake(
    stream: Stream,
    room: OwnedSemaphorePermit,
    max_streams: usize,
) -> Result<SendRequest<ProxyBody>, SendError> {
    let connection_window = u32::try_from(max_streams)
        .unwrap_or(u32::MAX)
        .saturating_mul(STREAM_WINDOW)
        .min(MAX_WINDOW);
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(connection_window)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| SendError::NotSent(format!("HTTP/2 handshake: {}", error_chain(&e))))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(error = %error_chain(&error), "upstream HTTP/2 connection ended with an error");
        }
        drop(room);
    });
    Ok(sender)
}

/// How the upstream said it did not process a stream.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// `REFUSED_STREAM`: this stream only.
    Refused,
    /// A GOAWAY whose last stream id is below the stream's: the connection takes no more.
    GoingAway,
}

/// Whether the upstream said it did not process the stream: `REFUSED_STREAM`, or a GOAWAY whose last
/// stream id is below the stream's (h2 fails exactly those streams with the GOAWAY's error; one that
/// was processed and then lost its connection fails with a broken pipe instead).
fn refused(error: &(dyn std::error::Error + 'static)) -> Option<Refusal> {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return match (h2.is_remote(), h2.is_go_away(), h2.reason()) {
                (true, true, _) => Some(Refusal::GoingAway),
                (true, false, Some(h2::Reason::REFUSED_STREAM)) => Some(Refusal::Refused),
                _ => None,
            };
        }
        cause = error.source();
    }
    None
}

/// The request sent once more, from its head and the copy of its body kept for that.
fn resent((method, uri, headers): (Method, Uri, HeaderMap), body: &Resendable) -> Request<ProxyBody> {
    let mut request = Request::new(body.body());
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_2;
    *request.headers_mut() = headers;
    request
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
        /// 200 with body `ok` once the stub's gate lets it: one stream per permit.
        Held,
        /// `RST_STREAM` with this reason, before any response.
        Reset(h2::Reason),
        /// `REFUSED_STREAM` to the first stream of each connection, 200 with body `ok` to the others.
        RefuseFirst,
        /// On the first connection, a GOAWAY whose last stream id (0) is below the first stream's, as
        /// that stream's HEADERS arrive, then the connection's end; 200 with body `ok` on later ones.
        GoAwayFirst,
        /// 200 to the first stream of each connection, then GOAWAY (graceful) and the connection's end.
        OnceThenGoAway,
    }

    /// An h2c upstream on 127.0.0.1:0.
    struct Stub {
        authority: String,
        /// One message per connection accepted.
        connections: mpsc::UnboundedReceiver<()>,
        /// One message per stream received.
        streams: mpsc::UnboundedReceiver<()>,
        /// Lets held streams be answered.
        gate: Arc<Semaphore>,
    }

    async fn upstream(answer: Answer) -> Stub {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        let (accepted, connections) = mpsc::unbounded_channel();
        let (received, streams) = mpsc::unbounded_channel();
        let gate = Arc::new(Semaphore::new(0));
        let held = gate.clone();
        tokio::spawn(async move {
            let mut first_connection = true;
            while let Ok((stream, _)) = listener.accept().await {
                let _ = accepted.send(());
                let (received, held) = (received.clone(), held.clone());
                if matches!(answer, Answer::GoAwayFirst) && std::mem::take(&mut first_connection) {
                    tokio::spawn(go_away_at_first_stream(stream, received));
                    continue;
                }
                tokio::spawn(async move {
                    let mut connection = h2::server::handshake(stream).await.unwrap();
                    let mut first = true;
                    while let Some(Ok((request, mut respond))) = connection.accept().await {
                        drop(request);
                        let _ = received.send(());
                        let reset = match answer {
                            Answer::Reset(reason) => Some(reason),
                            Answer::RefuseFirst if first => Some(h2::Reason::REFUSED_STREAM),
                            _ => None,
                        };
                        first = false;
                        if let Some(reason) = reset {
                            respond.send_reset(reason);
                            continue;
                        }
                        let held = held.clone();
                        let answered = async move {
                            if let Answer::Held = answer {
                                held.acquire().await.unwrap().forget();
                            }
                            let response = http::Response::new(());
                            let mut body = respond.send_response(response, false).unwrap();
                            body.send_data(Bytes::from_static(b"ok"), true).unwrap();
                        };
                        match answer {
                            Answer::Held => drop(tokio::spawn(answered)),
                            _ => answered.await,
                        }
                        if let Answer::OnceThenGoAway = answer {
                            connection.graceful_shutdown();
                        }
                    }
                });
            }
        });
        Stub {
            authority,
            connections,
            streams,
            gate,
        }
    }

    /// Speaks just enough HTTP/2 to refuse the client's first stream by a GOAWAY that says no stream was
    /// processed (h2's own server counts every stream it has received as processed, so it cannot).
    async fn go_away_at_first_stream(mut stream: tokio::net::TcpStream, received: mpsc::UnboundedSender<()>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const SETTINGS: u8 = 4;
        const GOAWAY: u8 = 7;
        const HEADERS: u8 = 1;
        let mut preface = [0u8; 24];
        stream.read_exact(&mut preface).await.unwrap();
        stream
            .write_all(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0])
            .await
            .unwrap();
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.unwrap();
            let length = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut payload = vec![0u8; length];
            stream.read_exact(&mut payload).await.unwrap();
            if head[3] == HEADERS {
                let _ = received.send(());
                // Last stream id 0, error NO_ERROR: nothing was processed.
                let go_away = [0, 0, 8, GOAWAY, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                stream.write_all(&go_away).await.unwrap();
                stream.shutdown().await.unwrap();
                return;
            }
        }
    }

    fn pool(authority: String) -> Pool {
        limited_pool(authority, 16, 100, Duration::from_secs(2))
    }

    /// A pool of at most `connections` HTTP/2 connections of `streams` streams each, whose requests
    /// wait up to `wait` for room.
    fn limited_pool(authority: String, connections: usize, streams: usize, wait: Duration) -> Pool {
        Pool::new(
            UpstreamAddress::Http { authority },
            UpstreamProtocol::H2c,
            wait,
            Duration::from_millis(200),
            connections,
            streams,
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

    /// Waits for `n` messages on `events`.
    async fn seen(events: &mut mpsc::UnboundedReceiver<()>, n: usize) {
        for _ in 0..n {
            tokio::time::timeout(Duration::from_secs(10), events.recv())
                .await
                .expect("the stub upstream saw it")
                .unwrap();
        }
    }

    #[tokio::test]
    async fn requests_at_once_are_streams_of_one_connection() {
        let mut stub = upstream(Answer::Ok).await;
        let pool = pool(stub.authority);
        let fetched = futures_util::future::join_all((0..8).map(|_| fetch(&pool))).await;
        for body in fetched {
            assert_eq!(body.unwrap(), "ok");
        }
        assert_eq!(stub.connections.recv().await, Some(()));
        assert!(
            stub.connections.try_recv().is_err(),
            "only one connection was opened"
        );
    }

    #[tokio::test]
    async fn with_every_stream_taken_the_next_request_opens_another_connection() {
        let mut stub = upstream(Answer::Held).await;
        let pool = limited_pool(stub.authority, 16, 2, Duration::from_secs(10));
        let fetching = tokio::spawn(async move {
            let fetched = futures_util::future::join_all((0..5).map(|_| fetch(&pool))).await;
            (pool, fetched)
        });
        // All five reach the upstream at once, two streams on each connection but the last.
        seen(&mut stub.streams, 5).await;
        seen(&mut stub.connections, 3).await;
        assert!(
            stub.connections.try_recv().is_err(),
            "three connections, not more"
        );
        stub.gate.add_permits(5);
        let (pool, fetched) = fetching.await.unwrap();
        for body in fetched {
            assert_eq!(body.unwrap(), "ok");
        }
        assert_eq!(pool.multiplexed_open(), 3);
        // The two beyond the first, quiet for the idle timeout, are let go as requests come.
        tokio::time::timeout(Duration::from_secs(10), async {
            while pool.multiplexed_open() > 1 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                stub.gate.add_permits(1);
                assert_eq!(fetch(&pool).await.unwrap(), "ok");
            }
        })
        .await
        .expect("idle connections beyond the first are closed");
    }

    #[tokio::test]
    async fn at_the_connection_cap_a_request_with_no_stream_free_is_busy_and_not_sent() {
        let mut stub = upstream(Answer::Held).await;
        let pool = Arc::new(limited_pool(stub.authority, 1, 2, Duration::from_millis(300)));
        let held: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { fetch(&pool).await })
            })
            .collect();
        seen(&mut stub.streams, 2).await;
        let refused = tokio::time::timeout(Duration::from_secs(10), fetch(&pool)).await;
        assert!(matches!(refused, Ok(Err(SendError::Busy))), "{refused:?}");
        stub.gate.add_permits(2);
        for fetched in held {
            assert_eq!(fetched.await.unwrap().unwrap(), "ok");
        }
        assert!(
            stub.streams.try_recv().is_err(),
            "the busy request never reached the upstream"
        );
        stub.gate.add_permits(1);
        assert_eq!(fetch(&pool).await.unwrap(), "ok", "the streams are free again");
        assert_eq!(stub.connections.recv().await, Some(()));
        assert!(stub.connections.try_recv().is_err(), "one connection, as capped");
    }

    #[tokio::test]
    async fn at_the_connection_cap_a_request_takes_the_first_stream_that_ends() {
        let mut stub = upstream(Answer::Held).await;
        let pool = Arc::new(limited_pool(stub.authority, 1, 1, Duration::from_secs(10)));
        let first = {
            let pool = pool.clone();
            tokio::spawn(async move { fetch(&pool).await })
        };
        seen(&mut stub.streams, 1).await;
        let second = {
            let pool = pool.clone();
            tokio::spawn(async move { fetch(&pool).await })
        };
        stub.gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap(), "ok");
        assert_eq!(second.await.unwrap().unwrap(), "ok");
        seen(&mut stub.streams, 1).await;
    }

    #[tokio::test]
    async fn streams_that_end_together_each_let_a_waiting_request_go() {
        let stub = upstream(Answer::Ok).await;
        let pool = limited_pool(stub.authority, 1, 2, Duration::from_secs(10));
        let post = || {
            Request::post("/pay")
                .header(header::HOST, "api.example")
                .body(body::full("{}"))
                .unwrap()
        };
        // Two answers whose bodies are held: the one connection's two streams stay taken.
        let held = (pool.send(post()).await.unwrap(), pool.send(post()).await.unwrap());
        let waiting: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { fetch(&pool).await })
            })
            .collect();
        // Both find no stream and wait (no I/O stands between them and their wait).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        drop(held);
        for waiter in waiting {
            assert_eq!(waiter.await.unwrap().unwrap(), "ok");
        }
    }

    #[tokio::test]
    async fn a_stream_the_upstream_refuses_was_not_sent() {
        let stub = upstream(Answer::Reset(h2::Reason::REFUSED_STREAM)).await;
        let failed = fetch(&pool(stub.authority)).await;
        assert!(matches!(failed, Err(SendError::NotSent(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn a_refused_stream_whose_body_is_kept_is_sent_once_more() {
        let mut stub = upstream(Answer::RefuseFirst).await;
        let pool = pool(stub.authority);
        let mut request = Request::post("/pay")
            .header(header::HOST, "api.example")
            .body(body::full("{}"))
            .unwrap();
        let kept = Resendable::new(Bytes::from_static(b"{}"), None, Arc::new(()));
        request.extensions_mut().insert(kept);
        let response = pool.send(request).await.expect("sent again, and answered");
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        seen(&mut stub.streams, 2).await;
    }

    #[tokio::test]
    async fn a_stream_above_a_goaways_last_stream_id_is_sent_again_on_a_new_connection() {
        let mut stub = upstream(Answer::GoAwayFirst).await;
        let mut request = Request::post("/pay")
            .header(header::HOST, "api.example")
            .body(body::full("{}"))
            .unwrap();
        request
            .extensions_mut()
            .insert(Resendable::new(Bytes::from_static(b"{}"), None, Arc::new(())));
        let sent = pool(stub.authority).send(request).await;
        let response = sent.expect("sent again, and answered");
        assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "ok");
        seen(&mut stub.streams, 2).await;
        seen(&mut stub.connections, 2).await;
        // Without a copy of its body, the same refusal is a request never delivered.
        let mut stub = upstream(Answer::GoAwayFirst).await;
        let failed = fetch(&pool(stub.authority.clone())).await;
        assert!(matches!(failed, Err(SendError::NotSent(_))), "{failed:?}");
        seen(&mut stub.streams, 1).await;
    }

    #[tokio::test]
    async fn a_stream_the_upstream_resets_otherwise_may_have_been_processed() {
        let stub = upstream(Answer::Reset(h2::Reason::INTERNAL_ERROR)).await;
        let failed = fetch(&pool(stub.authority)).await;
        assert!(matches!(failed, Err(SendError::Failed(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn after_a_goaway_the_next_request_goes_over_a_new_connection() {
        let mut stub = upstream(Answer::OnceThenGoAway).await;
        let pool = pool(stub.authority);
        for _ in 0..3 {
            assert_eq!(fetch(&pool).await.unwrap(), "ok");
            // The GOAWAY, and the connection's end, reach the client after the response does.
            tokio::time::timeout(Duration::from_secs(10), async {
                while pool.multiplexed_open() > 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await
            .expect("the upstream's GOAWAY closes the connection");
        }
        seen(&mut stub.connections, 3).await;
    }
}
