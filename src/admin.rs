//! The admin listener's three endpoints: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (the store answers and no shutdown has begun). Reads metrics and pings the store; never
//! touches the request path.

use std::convert::Infallible;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::proxy::body::{self, ProxyBody};
use crate::store::StoreHandle;

/// What the admin endpoints read.
#[derive(Clone)]
pub struct Admin {
    metrics: Metrics,
    store: StoreHandle,
    shutdown: CancellationToken,
}

impl Admin {
    /// The admin endpoints over these metrics and this store; `/readyz` fails once `shutdown` is cancelled.
    pub fn new(metrics: Metrics, store: StoreHandle, shutdown: CancellationToken) -> Admin {
        Admin {
            metrics,
            store,
            shutdown,
        }
    }

    /// Answers one admin request.
    pub async fn handle(self, request: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
        if request.method() != Method::GET && request.method() != Method::HEAD {
            return Ok(text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"));
        }
        let response = match request.uri().path() {
            "/metrics" => {
                let mut response = Response::new(body::full(self.metrics.render()));
                response.headers_mut().insert(
                    header::CONTENT_TYPE,
                    header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                response
            }
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" if self.shutdown.is_cancelled() => {
                text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
            }
            "/readyz" => match self.store.ping().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n"),
            },
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        };
        Ok(response)
    }
}

fn text(status: StatusCode, message: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(body::full(message));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
