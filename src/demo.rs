//! `idemproxy demo-upstream`: a tiny service to put the proxy in front of, for trying it without a
//! service of your own (the README's quickstart, docker-compose.yml, the Kubernetes examples). Not part
//! of the proxy: it runs only when asked for, and touches nothing else in the crate.
//!
//! It answers every request with `201` and a JSON body that numbers its executions, so a replay is easy
//! to tell from a second execution; `?delay_ms=N` makes it take N milliseconds, long enough to send a
//! duplicate while the first request is still in flight. `--probe` connects to the address and exits 0
//! if something accepts: the readiness probe of a pod whose app listens on loopback only, where the
//! kubelet's own TCP probe cannot reach. It ships in the proxy's binary (as Caddy ships `caddy respond`)
//! so that trying the proxy builds nothing more than the proxy.

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

/// Serves the demo on `listener` until the process ends, saying where on stderr.
pub async fn serve(listener: TcpListener) -> std::io::Result<()> {
    eprintln!("demo upstream listening on http://{}", listener.local_addr()?);
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

/// Connects to `addr` within a second; an error when nothing accepts.
pub async fn probe(addr: &str) -> std::io::Result<()> {
    let connect = tokio::net::TcpStream::connect(addr);
    match tokio::time::timeout(Duration::from_secs(1), connect).await {
        Ok(stream) => stream.map(drop),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("{addr} did not accept within 1s"),
        )),
    }
}

/// `delay_ms=N` in the query, else none.
fn delay(query: &str) -> Duration {
    let millis = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("delay_ms="))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Duration::from_millis(millis)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_ms_in_the_query_is_the_delay_and_anything_else_is_none() {
        assert_eq!(delay("delay_ms=3000"), Duration::from_secs(3));
        assert_eq!(delay("a=1&delay_ms=20"), Duration::from_millis(20));
        assert_eq!(delay("delay_ms=soon"), Duration::ZERO);
        assert_eq!(delay(""), Duration::ZERO);
    }
}
