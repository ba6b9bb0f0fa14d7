//! Runs when a request goes upstream: picks the HTTP version (`upstream.protocol`); over HTTP/1.1 hands
//! the request to an idle connection to the upstream, or to a new one, and takes the connection back
//! once its response body has been read to the end; over HTTP/2 sends it as a stream of one of the worker's
//! multiplexed connections (`multiplex.rs`). Each worker has its own pool, so a request and the connection
//! carrying it run on the same thread. Uses hyper's connection-level client: one task per connection, no
//! pool-wide bookkeeping per request. Connections are opened by `connect.rs` (TCP, TLS or a unix socket);
//! reuse, the cap and the timeouts are the same for each. An HTTP/1.1 connection idle for
//! `upstream.idle_timeout` is never handed a request, and is closed by the pool within half that again:
//! the proxy, not the upstream, ends an idle connection, so a request is never written to one the
//! upstream is closing.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::connect::{self, Stream};
use super::multiplex::{Limits, Multiplexed, StreamSlot};
pub use super::send_error::SendError;
use crate::body::ProxyBody;
use crate::config::{UpstreamAddress, UpstreamProtocol};
use crate::error_chain::error_chain;
use crate::proxy::dialect::grpc::is_grpc;

/// Idle connections to one upstream.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    /// Where to connect, and how.
    address: UpstreamAddress,
    connect_timeout: Duration,
    idle_timeout: Duration,
    /// Most recently used last.
    idle: Mutex<Vec<Idle>>,
    /// One permit per connection the pool may hold open, in use or idle, HTTP/1.1 or HTTP/2; each
    /// connection's task holds one until the connection closes.
    room: Arc<Semaphore>,
    max_connections: usize,
    /// Signalled when a connection goes back to the idle list, for a request waiting at the cap.
    returned: Notify,
    /// Starts the task that closes connections idle for too long, with the first connection.
    closer: Once,
    /// The HTTP version spoken (`upstream.protocol`).
    protocol: UpstreamProtocol,
    /// The HTTP/2 connections, for the requests that go over HTTP/2.
    multiplexed: Multiplexed,
    /// With protocol `auto` over TLS: the upstream agreed to HTTP/2 (ALPN) on the last connection made.
    agreed_h2: AtomicBool,
}

/// A connection the pool opened.
enum Opened {
    /// An HTTP/1.1 connection, and whether it came from the idle list.
    Http1(SendRequest<ProxyBody>, bool),
    /// The upstream agreed to HTTP/2 (protocol `auto` over TLS): the connection is a multiplexed one.
    Http2,
}

struct Idle {
    sender: SendRequest<ProxyBody>,
    since: Instant,
}

impl Pool {
    /// An empty pool for `address` speaking `protocol`, holding at most `max_connections` connections
    /// open, with at most `max_streams` streams on each HTTP/2 one; HTTP/1.1 connections left idle for
    /// `idle_timeout` are closed, and so are HTTP/2 ones beyond the first that carry no stream as long.
    pub fn new(
        address: UpstreamAddress,
        protocol: UpstreamProtocol,
        connect_timeout: Duration,
        idle_timeout: Duration,
        max_connections: usize,
        max_streams: usize,
    ) -> Pool {
        let (scheme, authority) = match &address {
            UpstreamAddress::Http { authority } => (Scheme::HTTP, authority.as_str()),
            UpstreamAddress::Https { authority, .. } => (Scheme::HTTPS, authority.as_str()),
            UpstreamAddress::Unix { .. } => (Scheme::HTTP, "localhost"),
        };
        let authority =
            Authority::try_from(authority).unwrap_or_else(|_| Authority::from_static("localhost"));
        let room = Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS)));
        let limits = Limits {
            max_streams,
            idle_timeout,
            wait: connect_timeout,
        };
        Pool {
            inner: Arc::new(Inner {
                address,
                connect_timeout,
                idle_timeout,
                idle: Mutex::new(Vec::new()),
                multiplexed: Multiplexed::new(scheme, authority, room.clone(), limits),
                room,
                max_connections,
                returned: Notify::new(),
                closer: Once::new(),
                protocol,
                agreed_h2: AtomicBool::new(false),
            }),
        }
    }

    /// A new, empty pool with the same settings.
    pub fn empty_copy(&self) -> Pool {
        let inner = &self.inner;
        Pool::new(
            inner.address.clone(),
            inner.protocol,
            inner.connect_timeout,
            inner.idle_timeout,
            inner.max_connections,
            inner.multiplexed.max_streams(),
        )
    }

    /// Whether a request may go over HTTP/2 (`upstream.protocol` is not `http1`).
    pub fn may_use_h2(&self) -> bool {
        self.inner.protocol != UpstreamProtocol::Http1
    }

    /// Idle connections held now.
    pub fn idle(&self) -> usize {
        self.inner.lock().len()
    }

    /// HTTP/2 connections open now.
    #[cfg(test)]
    pub(super) fn multiplexed_open(&self) -> usize {
        self.inner.multiplexed.open_connections()
    }

    /// Sends `request` (origin-form URI, `Host` set) and waits for the response head. A pooled
    /// connection that turns out to be closed before the request is written is discarded and the
    /// request goes to the next one, or to a new connection. A new connection the upstream's TLS layer
    /// refuses (a handshake alert, such as a missing client certificate) never delivered the request.
    pub async fn send(&self, mut request: Request<ProxyBody>) -> Result<Response<PooledBody>, SendError> {
        if self.inner.over_h2(&request) {
            return Box::pin(self.send_h2(request)).await;
        }
        loop {
            let (mut sender, reused) = match self.checkout().await {
                Some(sender) => (sender, true),
                // Connecting is rare and its state large; boxed, it stays out of every request's future.
                None => match Box::pin(self.connection()).await? {
                    Opened::Http1(sender, reused) => (sender, reused),
                    Opened::Http2 => return Box::pin(self.send_h2(request)).await,
                },
            };
            match sender.try_send_request(request).await {
                Ok(response) => return Ok(response.map(|body| self.returning(body, sender))),
                Err(mut failed) => match failed.take_message() {
                    Some(unsent) if reused => request = unsent,
                    Some(_) => return Err(SendError::NotSent(error_chain(failed.error()))),
                    None if !reused && connect::refused_handshake(failed.error()) => {
                        let why = error_chain(failed.error());
                        return Err(SendError::NotSent(format!(
                            "upstream TLS handshake failed: {why}"
                        )));
                    }
                    None => return Err(SendError::Failed(error_chain(failed.error()))),
                },
            }
        }
    }

    /// Sends `request` as a stream of a multiplexed HTTP/2 connection.
    async fn send_h2(&self, request: Request<ProxyBody>) -> Result<Response<PooledBody>, SendError> {
        let (response, stream) = self.inner.multiplexed.send(request, || self.open_h2()).await?;
        Ok(response.map(|body| PooledBody {
            body,
            home: None,
            stream: Some(stream),
        }))
    }

    /// A new connection for HTTP/2: over TLS, only if the upstream agrees to it (ALPN).
    async fn open_h2(&self) -> Result<Stream, SendError> {
        let stream = self.open().await?;
        if stream.is_tls() && !stream.agreed_h2() {
            self.inner.agreed_h2.store(false, Ordering::Relaxed);
            return Err(SendError::NotSent(format!(
                "{} no longer agrees to HTTP/2 (ALPN); the next request goes over HTTP/1.1",
                self.inner.address
            )));
        }
        Ok(stream)
    }

    /// A new connection to the upstream, within the connect timeout.
    async fn open(&self) -> Result<Stream, SendError> {
        let not_sent = |why: String| SendError::NotSent(format!("connect to {}: {why}", self.inner.address));
        match tokio::time::timeout(self.inner.connect_timeout, connect::connect(&self.inner.address)).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(error)) => Err(not_sent(error)),
            Err(_) => Err(not_sent(format!(
                "timed out after {:?}",
                self.inner.connect_timeout
            ))),
        }
    }

    /// The most recently used idle connection that is still open and ready for a request.
    async fn checkout(&self) -> Option<SendRequest<ProxyBody>> {
        loop {
            let Idle { mut sender, since } = self.inner.lock().pop()?;
            if since.elapsed() < self.inner.idle_timeout && sender.ready().await.is_ok() {
                return Some(sender);
            }
        }
    }

    /// A new connection if the cap allows one; otherwise the first connection to come back idle, or the
    /// room a closed one leaves, within the connect timeout.
    async fn connection(&self) -> Result<Opened, SendError> {
        let deadline = Instant::now() + self.inner.connect_timeout;
        loop {
            let returned = self.inner.returned.notified();
            tokio::pin!(returned);
            // Registered before the idle list is looked at, so a connection returned meanwhile wakes it.
            returned.as_mut().enable();
            if let Some(sender) = self.checkout().await {
                return Ok(Opened::Http1(sender, true));
            }
            let room = self.inner.room.clone();
            tokio::select! {
                permit = room.acquire_owned() => {
                    let permit = permit.map_err(|_| SendError::Busy)?;
                    return self.connect(permit).await;
                }
                _ = &mut returned => {}
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(upstream = %self.inner.address, max = self.inner.max_connections,
                        "every upstream connection stayed busy for the connect timeout");
                    return Err(SendError::Busy);
                }
            }
        }
    }

    async fn connect(&self, room: OwnedSemaphorePermit) -> Result<Opened, SendError> {
        let stream = self.open().await?;
        if stream.agreed_h2() {
            // Protocol `auto` over TLS, and the upstream prefers HTTP/2: requests are its streams from
            // now on.
            self.inner.multiplexed.add(stream, room).await?;
            self.inner.agreed_h2.store(true, Ordering::Relaxed);
            return Ok(Opened::Http2);
        }
        let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.map_err(|e| {
            SendError::NotSent(format!("connect to {}: {}", self.inner.address, error_chain(&e)))
        })?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(error = %error_chain(&error), "upstream connection ended with an error");
            }
            drop(room);
        });
        let pool = Arc::downgrade(&self.inner);
        self.inner
            .closer
            .call_once(|| drop(tokio::spawn(close_idle(pool))));
        Ok(Opened::Http1(sender, false))
    }

    fn returning(&self, body: Incoming, sender: SendRequest<ProxyBody>) -> PooledBody {
        PooledBody {
            body,
            home: Some((sender, self.inner.clone())),
            stream: None,
        }
    }
}

impl Inner {
    /// Whether `request` goes over HTTP/2.
    fn over_h2(&self, request: &Request<ProxyBody>) -> bool {
        match self.protocol {
            UpstreamProtocol::Http1 => false,
            UpstreamProtocol::H2c => true,
            UpstreamProtocol::Auto => match self.address {
                UpstreamAddress::Https { .. } => self.agreed_h2.load(Ordering::Relaxed),
                _ => is_grpc(request),
            },
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, sender: SendRequest<ProxyBody>) {
        self.lock().push(Idle {
            sender,
            since: Instant::now(),
        });
        self.returned.notify_one();
    }
}

/// Closes connections idle for longer than the pool's idle timeout, checking twice per timeout, for as
/// long as the pool lives.
async fn close_idle(pool: Weak<Inner>) {
    let Some(period) = pool.upgrade().map(|pool| pool.idle_timeout / 2) else {
        return;
    };
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        pool.lock()
            .retain(|i| i.since.elapsed() < pool.idle_timeout && !i.sender.is_closed());
    }
}

/// An upstream response body; its HTTP/1.1 connection goes back to the pool once the body has ended (a
/// body dropped before its end takes its connection with it: hyper closes it), and its HTTP/2 stream
/// stops counting against its connection's limit.
pub struct PooledBody {
    body: Incoming,
    home: Option<(SendRequest<ProxyBody>, Arc<Inner>)>,
    stream: Option<StreamSlot>,
}

impl PooledBody {
    fn go_home(&mut self) {
        if let Some((sender, pool)) = self.home.take() {
            pool.put(sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                self.go_home();
                self.stream = None;
            }
            Poll::Ready(Some(Err(_))) => {
                self.home = None;
                self.stream = None;
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        if self.body.is_end_stream() {
            self.go_home();
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::mpsc;

    use super::*;
    use crate::body;

    const RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    /// What the stub upstream saw happen to its connections.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Accepted,
        Closed,
    }

    /// A keep-alive upstream on 127.0.0.1:0 that answers `answers` requests per connection (none: never
    /// answers, closes after reading the request head), then closes without announcing it.
    async fn upstream(answers: usize) -> (String, mpsc::UnboundedReceiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        let (seen, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let seen = seen.clone();
                let _ = seen.send(Seen::Accepted);
                tokio::spawn(async move {
                    for _ in 0..answers.max(1) {
                        if !read_head(&mut stream).await {
                            break;
                        }
                        if answers == 0 || stream.write_all(RESPONSE).await.is_err() {
                            break;
                        }
                    }
                    drop(stream);
                    let _ = seen.send(Seen::Closed);
                });
            }
        });
        (authority, events)
    }

    /// Reads up to the end of a request head; `false` at the end of the stream.
    async fn read_head(stream: &mut TcpStream) -> bool {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte).await {
                Ok(1) => head.push(byte[0]),
                _ => return false,
            }
        }
        true
    }

    fn pool(authority: String, idle_timeout: Duration) -> Pool {
        Pool::new(
            UpstreamAddress::Http { authority },
            UpstreamProtocol::Http1,
            Duration::from_secs(2),
            idle_timeout,
            16,
            100,
        )
    }

    fn get() -> Request<ProxyBody> {
        Request::builder()
            .uri("/")
            .header(http::header::HOST, "upstream")
            .body(body::empty())
            .unwrap()
    }

    async fn fetch(pool: &Pool) -> Result<Bytes, SendError> {
        let response = pool.send(get()).await?;
        Ok(response.into_body().collect().await.unwrap().to_bytes())
    }

    #[tokio::test]
    async fn requests_in_sequence_share_one_connection() {
        let (authority, mut seen) = upstream(usize::MAX).await;
        let pool = pool(authority, Duration::from_secs(90));
        for _ in 0..3 {
            assert_eq!(fetch(&pool).await.unwrap(), "ok");
        }
        assert_eq!(pool.idle(), 1);
        assert_eq!(seen.recv().await, Some(Seen::Accepted));
        assert!(seen.try_recv().is_err(), "only one connection was opened");
    }

    #[tokio::test]
    async fn a_pooled_connection_the_upstream_closed_is_replaced_not_an_error() {
        let (authority, mut seen) = upstream(1).await;
        let pool = pool(authority, Duration::from_secs(90));
        assert_eq!(fetch(&pool).await.unwrap(), "ok");
        assert_eq!(seen.recv().await, Some(Seen::Accepted));
        assert_eq!(seen.recv().await, Some(Seen::Closed));
        assert_eq!(pool.idle(), 1, "the closed connection is still pooled");
        assert_eq!(fetch(&pool).await.unwrap(), "ok");
        assert_eq!(seen.recv().await, Some(Seen::Accepted));
    }

    #[tokio::test]
    async fn a_refused_connection_is_not_sent() {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = closed.local_addr().unwrap().to_string();
        drop(closed);
        let failed = fetch(&pool(authority, Duration::from_secs(90))).await;
        assert!(matches!(failed, Err(SendError::NotSent(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn a_connection_that_breaks_after_the_request_is_written_is_failed() {
        let (authority, _seen) = upstream(0).await;
        let failed = fetch(&pool(authority, Duration::from_secs(90))).await;
        assert!(matches!(failed, Err(SendError::Failed(_))), "{failed:?}");
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_does_not_return_its_connection() {
        let (authority, _seen) = upstream(usize::MAX).await;
        let pool = pool(authority, Duration::from_secs(90));
        drop(pool.send(get()).await.unwrap());
        assert_eq!(pool.idle(), 0);
    }

    #[tokio::test]
    async fn idle_connections_are_closed_after_the_idle_timeout() {
        let (authority, mut seen) = upstream(usize::MAX).await;
        let pool = pool(authority, Duration::from_millis(200));
        assert_eq!(fetch(&pool).await.unwrap(), "ok");
        assert_eq!(seen.recv().await, Some(Seen::Accepted));
        let closed = tokio::time::timeout(Duration::from_secs(5), seen.recv()).await;
        assert_eq!(closed.unwrap(), Some(Seen::Closed));
        assert_eq!(pool.idle(), 0);
    }
}
