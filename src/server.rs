//! The accept loops of the proxy and admin listeners, and the drain at shutdown. Serves HTTP/1.1 and
//! HTTP/2 on each connection through hyper-util's auto builder: h2c with prior knowledge in cleartext, or
//! negotiated by ALPN when the proxy listener has TLS.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::proxy::Proxy;
use crate::proxy::body::ProxyBody;
use crate::proxy::forward::Downstream;

/// Bound on a client's TLS handshake, so a silent client cannot hold a connection slot.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The proxy listener and what it needs to serve.
pub struct ProxyListener {
    /// The bound socket.
    pub listener: TcpListener,
    /// TLS for its connections, if on.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The request path.
    pub proxy: Arc<Proxy>,
}

/// Serves both listeners until `shutdown`, then stops accepting, lets open requests and their
/// forwarding tasks finish within `grace`, and returns.
pub async fn serve(
    proxy: ProxyListener,
    admin_listener: TcpListener,
    admin: Admin,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let ProxyListener { listener, tls, proxy } = proxy;
    let tracker = proxy.tracker.clone();
    let tls = tls.map(TlsAcceptor::from);
    let connections = GracefulShutdown::new();
    let admin_stop = CancellationToken::new();
    let admin_loop = tokio::spawn(accept_loop(
        admin_listener,
        None,
        admin_stop.clone(),
        None,
        move |_| {
            let admin = admin.clone();
            move |request| admin.clone().handle(request)
        },
    ));
    accept_loop(listener, tls, shutdown, Some(&connections), move |downstream| {
        let proxy = proxy.clone();
        move |request| proxy.clone().handle(request, downstream)
    })
    .await;
    drain(connections, &tracker, grace).await;
    admin_stop.cancel();
    let _ = admin_loop.await;
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

/// Accepts connections until `stop`, serving each (after its TLS handshake, if `tls`) with the handler
/// `make(downstream)` builds.
async fn accept_loop<M, H, F>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    stop: CancellationToken,
    graceful: Option<&GracefulShutdown>,
    make: M,
) where
    M: Fn(Downstream) -> H,
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, addr) = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let handler = make(Downstream {
            addr,
            tls: tls.is_some(),
        });
        let connection = Connection {
            builder: builder.clone(),
            tls: tls.clone(),
            watcher: graceful.map(GracefulShutdown::watcher),
        };
        tokio::spawn(connection.serve(stream, handler));
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
}

impl Connection {
    async fn serve<H, F>(self, stream: TcpStream, handler: H)
    where
        H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
    {
        let io: Box<dyn Io> = match &self.tls {
            None => Box::new(stream),
            Some(acceptor) => {
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => Box::new(stream),
                    Ok(Err(error)) => return tracing::debug!(%error, "TLS handshake failed"),
                    Err(_) => return tracing::debug!("TLS handshake timed out"),
                }
            }
        };
        let connection = self
            .builder
            .serve_connection(TokioIo::new(io), service_fn(handler))
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
