//! The differential suite's hyper app: hyper's HTTP/1.1 and HTTP/2 (h2c) servers on 127.0.0.1:0, routing
//! as a hand-written hyper service does: `Method::POST` (so `post` is another method) and the exact path.
//! Every request runs a handler, which reads the body to its end (or failure) and reports what it saw.

use std::convert::Infallible;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{HeaderMap, Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use super::frameworks::{Execution, Ledger, Ports, Protocol};

/// Starts both servers, reporting into `ledger`; their ports.
pub fn serve(ledger: Ledger) -> BoxFuture<'static, Ports> {
    Box::pin(async move {
        let mut ports = Vec::new();
        for protocol in [Protocol::Http1, Protocol::H2c] {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            ports.push((protocol, listener.local_addr().unwrap().port()));
            tokio::spawn(accept(listener, protocol, ledger.clone()));
        }
        ports
    })
}

async fn accept(listener: TcpListener, protocol: Protocol, ledger: Ledger) {
    while let Ok((socket, _)) = listener.accept().await {
        let ledger = ledger.clone();
        let service = service_fn(move |request| handle(request, ledger.clone()));
        let io = TokioIo::new(socket);
        match protocol {
            Protocol::Http1 => {
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
            }
            Protocol::H2c => {
                let builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                tokio::spawn(async move { builder.serve_connection(io, service).await });
            }
        }
    }
}

fn route(method: &Method, path: &str) -> &'static str {
    match (method, path) {
        (&Method::POST, "/payments") => "payments",
        (&Method::POST, "/webhooks/stripe") => "webhook",
        _ => "other",
    }
}

async fn handle(request: Request<Incoming>, ledger: Ledger) -> Result<Response<Full<Bytes>>, Infallible> {
    let handler = route(request.method(), request.uri().path());
    let (parts, body) = request.into_parts();
    let (trailers, body_error) = match body.collect().await {
        Ok(collected) => (collected.trailers().map(pairs).unwrap_or_default(), None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    ledger.push(Execution {
        handler: handler.to_owned(),
        method: parts.method.to_string(),
        target: parts.uri.to_string(),
        headers: pairs(&parts.headers),
        trailers,
        body_error,
    });
    let body = format!(r#"{{"app":"hyper","handler":"{handler}"}}"#);
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap())
}

fn pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(name, value)| {
            (
                name.to_string(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}
