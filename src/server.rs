//! The accept loops of the proxy and admin listeners, and the drain at shutdown. Serves HTTP/1.1 and
//! HTTP/2 (h2c prior knowledge) on each connection through hyper-util's auto builder.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::admin::Admin;
use crate::proxy::Proxy;
use crate::proxy::body::ProxyBody;

/// Serves both listeners until `shutdown`, then stops accepting, lets open requests and their
/// forwarding tasks finish within `grace`, and returns.
pub async fn serve(
    proxy_listener: TcpListener,
    admin_listener: TcpListener,
    proxy: Arc<Proxy>,
    admin: Admin,
    shutdown: CancellationToken,
    grace: Duration,
) {
    let tracker = proxy.tracker.clone();
    let connections = GracefulShutdown::new();
    let admin_stop = CancellationToken::new();
    let admin_loop = tokio::spawn(accept_loop(admin_listener, admin_stop.clone(), None, move |_| {
        let admin = admin.clone();
        move |request| admin.clone().handle(request)
    }));
    accept_loop(proxy_listener, shutdown, Some(&connections), move |peer| {
        let proxy = proxy.clone();
        move |request| proxy.clone().handle(request, peer)
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

/// Accepts connections until `stop`, serving each with the handler `make(peer)` builds.
async fn accept_loop<M, H, F>(
    listener: TcpListener,
    stop: CancellationToken,
    graceful: Option<&GracefulShutdown>,
    make: M,
) where
    M: Fn(SocketAddr) -> H,
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let (stream, peer) = tokio::select! {
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
        let connection = builder
            .serve_connection(TokioIo::new(stream), service_fn(make(peer)))
            .into_owned();
        match graceful {
            Some(graceful) => {
                tokio::spawn(log_connection_end(graceful.watch(connection)));
            }
            None => {
                tokio::spawn(log_connection_end(connection));
            }
        }
    }
}

async fn log_connection_end<E: std::fmt::Display>(connection: impl Future<Output = Result<(), E>>) {
    if let Err(error) = connection.await {
        tracing::debug!(%error, "connection ended with an error");
    }
}
