//! A tiny service to put idemproxy in front of, for trying the proxy without a service of your own.
//!
//! `cargo run --example upstream` listens on 127.0.0.1:3000 (or the address given as the first argument)
//! and answers every request with `201` and a JSON body that numbers its executions, so a replay is easy
//! to tell from a second execution. `?delay_ms=N` makes it take N milliseconds, long enough to send a
//! duplicate while the first request is still in flight.
//!
//! `upstream probe ADDR` connects to ADDR and exits 0 if something accepts, 1 otherwise: the readiness
//! probe of a pod whose app listens on loopback only, where the kubelet's own TCP probe cannot reach.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:3000".into());
    if addr == "probe" {
        let target = std::env::args().nth(2).unwrap_or_else(|| "127.0.0.1:3000".into());
        return probe(&target).await;
    }
    let listener = TcpListener::bind(&addr).await?;
    eprintln!("example upstream listening on http://{addr}");
    let executions = Arc::new(AtomicU64::new(0));
    loop {
        let (stream, _) = listener.accept().await?;
        let executions = executions.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| answer(request, executions.clone()));
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(
    request: Request<Incoming>,
    executions: Arc<AtomicU64>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let delay = delay(request.uri().query().unwrap_or(""));
    let method = request.method().to_string();
    let path = request.uri().path().to_owned();
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    tokio::time::sleep(delay).await;
    let execution = executions.fetch_add(1, Ordering::SeqCst) + 1;
    eprintln!("execution {execution}: {method} {path}");
    let json = serde_json::json!({
        "execution": execution,
        "method": method,
        "path": path,
        "received": String::from_utf8_lossy(&body),
    });
    let mut response = Response::new(Full::new(Bytes::from(json.to_string())));
    *response.status_mut() = StatusCode::CREATED;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// Connects to `addr` within a second; an error (the process exits 1) when nothing accepts.
async fn probe(addr: &str) -> std::io::Result<()> {
    let connect = tokio::net::TcpStream::connect(addr);
    match tokio::time::timeout(Duration::from_secs(1), connect).await {
        Ok(stream) => stream.map(drop),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{addr} did not accept within 1s"),
        )),
    }
}

fn delay(query: &str) -> Duration {
    let millis = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("delay_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_millis(millis)
}
