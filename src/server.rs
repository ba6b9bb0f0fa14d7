//! The accept loops of the proxy and admin listeners, the worker threads that serve proxy connections,
//! and the drain at shutdown. Serves HTTP/1.1 and HTTP/2 on each connection through hyper-util's auto
//! builder: h2c with prior knowledge in cleartext, or negotiated by ALPN when the proxy listener has TLS.
//! The proxy listener's [`Limits`] bound what one client can hold: open connections, time to send a
//! request head, and the head's size. At the connection cap, idle connections make room for new ones
//! (`server/slots.rs`); the admin listener has a small cap of its own, kept the same way. The proxy
//! listener is TCP or a unix socket (`server/socket.rs`); with TLS, its certificate is reloaded when its
//! files change (`server/cert_reload.rs`).

mod cert_reload;
mod generations;
mod slots;
mod socket;
mod write_deadline;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{self, Either};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use self::generations::Generations;
use self::slots::{Clock, Evictable, Guarded, Slot, Slots, Tracked};
use self::socket::Accepted;
pub use self::socket::ProxySocket;
use self::write_deadline::WriteDeadline;
use crate::admin::Admin;
use crate::body::ProxyBody;
use crate::config::{ListenerTls, ServerConfig};
use crate::error::{Busy, ProxyError};
use crate::proxy::downstream::{Downstream, Peer};
use crate::proxy::key::client_cert::ClientCert;

/// Bound on a client's TLS handshake, so a silent client cannot hold a connection slot.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The header count hyper's HTTP/1.1 server allows when none is set.
const HYPER_DEFAULT_MAX_HEADERS: usize = 100;

/// How often an HTTP/2 connection is pinged, and how long its answer may take before it is closed.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);
/// Requests one HTTP/2 connection may have open at once (RFC 9113 asks for at least 100).
const H2_MAX_STREAMS: u32 = 100;

/// Connections the admin listener serves at once: a few scrapers and probes need far fewer, and a flood
/// on the admin port can then hold no more descriptors than this.
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// The proxy listener and what it needs to serve.
pub struct ProxyListener {
    /// The bound socket.
    pub listener: ProxySocket,
    /// TLS for its connections, if on.
    pub tls: Option<ListenerTls>,
    /// What one client may hold.
    pub limits: Limits,
    /// The request path of each worker thread serving its connections, with its own upstream
    /// connections; a reload replaces it.
    pub generations: Arc<Generations>,
    /// Notified when `POST /-/reload` asks for a reload: the certificate files are read again then, as
    /// at SIGHUP.
    pub certificates: Arc<tokio::sync::Notify>,
}

/// Bounds on the proxy listener's connections, and how far its clients are trusted, from `[server]`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most connections open at once; at this many, the listener accepts another only once one closes
    /// or an idle one is evicted to make room.
    pub max_connections: usize,
    /// Bound on receiving an HTTP/1.1 request head; the connection is closed when it runs out.
    pub header_read_timeout: Duration,
    /// Largest request head (HTTP/1.1) or header list (HTTP/2), bytes; larger gets 431.
    pub max_header_size: usize,
    /// Most header lines in an HTTP/1.1 request head; more gets 431.
    pub max_headers: usize,
    /// Longest a client may accept no bytes while the proxy has bytes for it; its connection ends then.
    pub write_timeout: Duration,
    /// Whether a unix-socket client's own `X-Forwarded-For` goes upstream (else it is removed).
    pub trust_unix_forwarded_for: bool,
}

impl From<&ServerConfig> for Limits {
    fn from(server: &ServerConfig) -> Limits {
        Limits {
            max_connections: server.max_connections,
            header_read_timeout: server.header_read_timeout,
            max_header_size: server.max_header_size,
            max_headers: server.max_headers,
            write_timeout: server.write_timeout,
            trust_unix_forwarded_for: server.trust_unix_forwarded_for,
        }
    }
}

impl Limits {
    /// The connection builder enforcing these limits. hyper answers a head over the size or header count
    /// with 431 and closes the connection; a head that does not arrive in time closes it without an answer.
    fn builder(&self) -> auto::Builder<TokioExecutor> {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout)
            // hyper refuses a head once its read buffer is full, so the buffer bound is the head bound.
            .max_buf_size(self.max_header_size.max(8 * 1024));
        // hyper parses up to its default count in a buffer on the stack; any other count costs an
        // allocation per request head, so it is only set when it differs.
        if self.max_headers != HYPER_DEFAULT_MAX_HEADERS {
            builder.http1().max_headers(self.max_headers);
        }
        // HTTP/2 has no head timeout; pings find peers that vanished, so their slots come back.
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(H2_PING_INTERVAL)
            .keep_alive_timeout(H2_PING_TIMEOUT)
            .max_concurrent_streams(H2_MAX_STREAMS)
            .max_header_list_size(u32::try_from(self.max_header_size).unwrap_or(u32::MAX));
        builder
    }
}

/// Serves both listeners until `shutdown`, then stops accepting, lets open requests and their
/// forwarding tasks finish within `grace`, and returns. Proxy connections are accepted here and served
/// by the worker threads; the admin listener is served on the caller's runtime. Fails only when the
/// worker threads cannot be started.
pub async fn serve(
    proxy: ProxyListener,
    admin_listener: TcpListener,
    admin: Admin,
    shutdown: CancellationToken,
    grace: Duration,
) -> std::io::Result<()> {
    let ProxyListener {
        listener,
        tls,
        limits,
        generations,
        certificates,
    } = proxy;
    // What every generation shares (metrics, the tracker of forwarding tasks) and what only a restart
    // changes (the problem type base of the listener's own refusals) are read off the first.
    let proxy = generations.worker(0);
    let tracker = proxy.tracker.clone();
    let clock = Clock::new();
    let slots = Slots::new(
        limits.max_connections,
        limits.header_read_timeout,
        clock.clone(),
        Some(proxy.metrics.clone()),
    );
    let finished = CancellationToken::new();
    let deadline = Deadline {
        timeout: limits.write_timeout,
        expired: proxy.metrics.write_timeouts.clone(),
    };
    let serving = Serving {
        builder: limits.builder(),
        tls: tls.as_ref().map(|tls| TlsAcceptor::from(tls.config.clone())),
        deadline: deadline.clone(),
        problem_base: proxy.problem_base.clone(),
        trust_unix_forwarded_for: limits.trust_unix_forwarded_for,
    };
    // The workers (and the certificate reload) stop when this function ends however it ends: an error,
    // or its future dropped.
    let _stop_workers = finished.clone().drop_guard();
    let mut workers = Workers::start(&generations, &serving, &clock, &finished)?;
    if let Some(tls) = tls {
        let watched = (proxy.metrics.clone(), certificates);
        tokio::spawn(cert_reload::watch(tls, watched, finished.clone()));
    }
    let admin_stop = CancellationToken::new();
    let admin_slots = Slots::new(ADMIN_MAX_CONNECTIONS, limits.header_read_timeout, clock, None);
    let admin_loop = tokio::spawn(serve_admin(
        admin_listener,
        admin,
        Serving {
            builder: limits.builder(),
            tls: None,
            deadline,
            problem_base: proxy.problem_base.clone(),
            trust_unix_forwarded_for: false,
        },
        admin_slots,
        admin_stop.clone(),
    ));
    let connections = GracefulShutdown::new();
    accept_loop(&listener, &slots, &shutdown, |accepted, slot| {
        workers.hand_over(accepted, slot, connections.watcher());
    })
    .await;
    // Closed now, so that new clients are refused rather than left in the backlog while draining (and a
    // unix socket's file removed).
    drop(listener);
    workers.stop_handing_over();
    drain(connections, &tracker, grace).await;
    finished.cancel();
    workers.join().await;
    admin_stop.cancel();
    let _ = admin_loop.await;
    Ok(())
}

async fn serve_admin(
    listener: TcpListener,
    admin: Admin,
    serving: Serving,
    slots: Slots,
    stop: CancellationToken,
) {
    accept_loop(&listener, &slots, &stop, |(stream, _), slot| {
        let admin = admin.clone();
        let connection = Connection {
            builder: serving.builder.clone(),
            tls: None,
            watcher: None,
            deadline: serving.deadline.clone(),
            problem_base: serving.problem_base.clone(),
        };
        tokio::spawn(connection.serve(stream, slot, move |request| admin.clone().handle(request)));
    })
    .await;
}

async fn drain(connections: GracefulShutdown, tracker: &TaskTracker, grace: Duration) {
    tracker.close();
    let drained = tokio::time::timeout(grace, async {
        connections.shutdown().await;
        tracker.wait().await;
    })
    .await;
    match drained {
        Ok(()) => tracing::info!("drained; all in-flight requests finished"),
        Err(_) => tracing::warn!(?grace, "shutdown grace ran out with requests still in flight"),
    }
}

/// A listening socket the accept loop takes connections from.
trait Listener {
    /// A connection just accepted.
    type Accepted;

    /// The next connection.
    fn next(&self) -> impl Future<Output = std::io::Result<Self::Accepted>>;
}

impl Listener for TcpListener {
    type Accepted = (TcpStream, SocketAddr);

    fn next(&self) -> impl Future<Output = std::io::Result<Self::Accepted>> {
        self.accept()
    }
}

impl Listener for ProxySocket {
    type Accepted = Accepted;

    fn next(&self) -> impl Future<Output = std::io::Result<Accepted>> {
        self.accept()
    }
}

/// Accepts connections until `stop` and passes each to `dispatch` with its slot. While every slot is
/// taken, the connection just accepted waits for one (an idle connection is evicted to make room) and
/// further clients wait in the socket's backlog, holding no memory or descriptor of the process.
async fn accept_loop<L: Listener>(
    listener: &L,
    slots: &Slots,
    stop: &CancellationToken,
    mut dispatch: impl FnMut(L::Accepted, Slot),
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.next() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = slots.take(stop).await else {
            return;
        };
        dispatch(accepted, slot);
    }
}

/// How every proxy connection is served.
#[derive(Clone)]
struct Serving {
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    deadline: Deadline,
    /// `server.problem_type_base`, for the 503 of an evicted connection.
    problem_base: Arc<str>,
    /// `server.trust_unix_forwarded_for`.
    trust_unix_forwarded_for: bool,
}

/// The bound on a stalled write, and where its expiries are counted.
#[derive(Clone)]
struct Deadline {
    timeout: Duration,
    expired: prometheus::IntCounter,
}

/// A connection as it crosses to a worker's runtime: the socket leaves the accepting runtime's reactor.
struct InTransit {
    stream: StdStream,
    slot: Slot,
    watcher: Watcher,
}

/// An accepted socket outside any runtime.
enum StdStream {
    Tcp(std::net::TcpStream, SocketAddr),
    Unix(std::os::unix::net::UnixStream),
}

/// The worker threads, each a single-threaded runtime serving the connections handed to it with its
/// own [`Proxy`](crate::proxy::Proxy) (and so its own upstream connections): a request, its upstream exchange and their
/// wake-ups stay on one thread, as in nginx's worker processes.
struct Workers {
    queues: Vec<mpsc::UnboundedSender<InTransit>>,
    done: Vec<oneshot::Receiver<()>>,
    next: usize,
}

impl Workers {
    fn start(
        generations: &Arc<Generations>,
        serving: &Serving,
        clock: &Arc<Clock>,
        finished: &CancellationToken,
    ) -> std::io::Result<Workers> {
        let count = generations.len();
        let mut workers = Workers {
            queues: Vec::with_capacity(count),
            done: Vec::with_capacity(count),
            next: 0,
        };
        for index in 0..count {
            let (queue, handoffs) = mpsc::unbounded_channel();
            let (done, done_rx) = oneshot::channel();
            // The blocking pool's threads (SQLite's database work, large JSON bodies read off the
            // worker) carry a name of their own, so their CPU can be told from the worker's.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .thread_name(format!("idemproxy-blk-{index}"))
                .build()?;
            let work = work(
                (generations.clone(), index),
                serving.clone(),
                handoffs,
                clock.clone(),
                finished.clone(),
            );
            std::thread::Builder::new()
                .name(format!("idemproxy-worker-{index}"))
                .spawn(move || {
                    runtime.block_on(work);
                    drop(runtime);
                    let _ = done.send(());
                })?;
            workers.queues.push(queue);
            workers.done.push(done_rx);
        }
        Ok(workers)
    }

    /// Gives the connection to the next worker in turn.
    fn hand_over(&mut self, accepted: Accepted, slot: Slot, watcher: Watcher) {
        let stream = match accepted {
            Accepted::Tcp(stream, addr) => stream.into_std().map(|stream| StdStream::Tcp(stream, addr)),
            Accepted::Unix(stream) => stream.into_std().map(StdStream::Unix),
        };
        let stream = match stream {
            Ok(stream) => stream,
            Err(error) => return tracing::debug!(%error, "accepted connection lost before serving"),
        };
        let queue = &self.queues[self.next % self.queues.len()];
        self.next = self.next.wrapping_add(1);
        let in_transit = InTransit {
            stream,
            slot,
            watcher,
        };
        if queue.send(in_transit).is_err() {
            tracing::error!("a worker thread has stopped; connection dropped");
        }
    }

    /// No more connections: each worker keeps serving the ones it has until `finished`.
    fn stop_handing_over(&mut self) {
        self.queues.clear();
    }

    /// Waits for every worker thread to end, which it does once `finished` is cancelled.
    async fn join(self) {
        for done in self.done {
            let _ = done.await;
        }
    }
}

/// A worker's life: serve each connection handed over, then keep running (connection tasks, relays,
/// heartbeats, store connections opened here) until the whole server has `finished`.
async fn work(
    (generations, index): (Arc<Generations>, usize),
    serving: Serving,
    mut handoffs: mpsc::UnboundedReceiver<InTransit>,
    clock: Arc<Clock>,
    finished: CancellationToken,
) {
    tokio::spawn(keep_a_timer_first(clock));
    while let Some(InTransit {
        stream,
        slot,
        watcher,
    }) = handoffs.recv().await
    {
        let (stream, peer) = match stream {
            StdStream::Tcp(stream, addr) => (TcpStream::from_std(stream).map(Either::Left), Peer::Tcp(addr)),
            StdStream::Unix(stream) => (
                UnixStream::from_std(stream).map(Either::Right),
                Peer::Unix {
                    trusted: serving.trust_unix_forwarded_for,
                },
            ),
        };
        let now = generations.worker(index);
        let downstream = Downstream::new(
            peer,
            serving.tls.is_some(),
            now.keyed_per_connection,
            Some(slot.tracked()),
        )
        .trusting(&now.trusted_proxies);
        drop(now);
        let stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, "cannot serve an accepted connection");
                continue;
            }
        };
        let generations = generations.clone();
        let connection = Connection {
            builder: serving.builder.clone(),
            tls: serving.tls.clone(),
            watcher: Some(watcher),
            deadline: serving.deadline.clone(),
            problem_base: serving.problem_base.clone(),
        };
        // Each request is served by the generation current when it arrives, and keeps it to its end.
        let handler = move |request| generations.worker(index).handle(request, downstream.clone());
        match stream {
            Either::Left(tcp) => tokio::spawn(connection.serve(tcp, slot, handler)),
            Either::Right(unix) => tokio::spawn(connection.serve(unix, slot, handler)),
        };
    }
    finished.cancelled().await;
}

/// Keeps a timer pending on the worker that expires before any request's timeouts. tokio wakes its own
/// I/O driver (an eventfd write and one more turn of the event loop) whenever a timer is registered
/// that expires before every timer already pending. Without this, most requests' header-read and
/// upstream timeouts did that on a busy worker; with it, only this timer does, four times a second.
/// Each tick also advances the coarse clock that stamps when a connection's last request ended.
async fn keep_a_timer_first(clock: Arc<Clock>) {
    let mut ticks = tokio::time::interval(Clock::TICK);
    loop {
        ticks.tick().await;
        clock.advance();
    }
}

/// Bytes in both directions, in clear or through TLS.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One accepted connection, to be served on its own task.
struct Connection {
    builder: auto::Builder<TokioExecutor>,
    tls: Option<TlsAcceptor>,
    watcher: Option<Watcher>,
    deadline: Deadline,
    problem_base: Arc<str>,
}

impl Connection {
    /// Serves the connection until it ends or is evicted; its slot is freed after its socket is closed.
    async fn serve<S, H, F>(self, stream: S, slot: Slot, handler: H)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
    {
        let tracked = slot.tracked();
        let deadline = WriteDeadline::new(self.deadline.timeout, self.deadline.expired.clone());
        let stream = Evictable::new(stream, tracked.clone(), Some(deadline));
        self.serve_http(stream, tracked, handler).await;
        drop(slot);
    }

    async fn serve_http<S, H, F>(self, stream: Evictable<S>, tracked: Arc<Tracked>, handler: H)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
    {
        let (io, client): (Box<dyn Io>, Option<ClientCert>) = match &self.tls {
            None => (Box::new(stream), None),
            Some(acceptor) => {
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => {
                        let client = client_cert(&stream);
                        (Box::new(stream), client)
                    }
                    Ok(Err(error)) => return tracing::debug!(%error, "TLS handshake failed"),
                    Err(_) => return tracing::debug!("TLS handshake timed out"),
                }
            }
        };
        let base = self.problem_base.clone();
        let service = service_fn(move |mut request: Request<Incoming>| {
            // Who the connection's certificate names goes with each of its requests, out of reach of
            // anything the client sends.
            if let Some(client) = client {
                request.extensions_mut().insert(client);
            }
            answer(&tracked, &handler, request, &base)
        });
        let connection = self
            .builder
            .serve_connection(TokioIo::new(io), service)
            .into_owned();
        let result = match self.watcher {
            Some(watcher) => watcher.watch(connection).await,
            None => connection.await,
        };
        if let Err(error) = result {
            tracing::debug!(%error, "connection ended with an error");
        }
    }
}

/// The certificate the client presented in `stream`'s handshake (verified against `server.tls.client_ca`),
/// as the identity `scope_client_cert` scopes keys by.
fn client_cert<S>(stream: &tokio_rustls::server::TlsStream<S>) -> Option<ClientCert> {
    let leaf = stream.get_ref().1.peer_certificates()?.first()?;
    ClientCert::of(leaf)
}

/// Answers one request with `handler`, keeping the request in progress on its connection (so it is never
/// evicted) from this call until the response body has been sent or dropped. A request that finds its
/// connection evicted is not handled: it gets 503 and the connection closes.
///
/// Combinators rather than an `async` block: a block awaiting the handler's future it captured would
/// hold that future (about 3 KiB) twice, and hyper moves what it is given once per request (measured:
/// 900 more instructions per request than these).
fn answer<H, F>(
    tracked: &Arc<Tracked>,
    handler: &H,
    request: Request<Incoming>,
    problem_base: &str,
) -> impl Future<Output = Result<Response<Guarded<ProxyBody>>, Infallible>> + use<H, F>
where
    H: Fn(Request<Incoming>) -> F,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>>,
{
    match tracked.start() {
        Some(in_progress) => Either::Left(handler(request).map(move |answered| {
            answered.map(|response| response.map(|body| Guarded::new(body, Some(in_progress))))
        })),
        None => Either::Right(future::ready(Ok(
            evicted(problem_base).map(|body| Guarded::new(body, None))
        ))),
    }
}

/// The answer to a request that arrived on a connection just evicted; nothing was forwarded.
fn evicted(problem_base: &str) -> Response<ProxyBody> {
    let mut response = ProxyError::Busy(Busy::Connections).into_problem(problem_base, &Default::default());
    response
        .headers_mut()
        .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    response
}
