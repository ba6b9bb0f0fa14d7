//! `idemproxy demo-upstream`: a tiny service to put the proxy in front of, for trying it without a
//! service of your own (the README's quickstart, docker-compose.yml, the Kubernetes examples). Not part
//! of the proxy: it runs only when asked for, and touches nothing else in the crate.
//!
//! It answers every request with `201` and a JSON body that numbers its executions, so a replay is
//! easy to tell from a second execution; `?delay_ms=N` makes it take N milliseconds, long enough to
//! send a duplicate while the first request is still in flight. Under `/c/` it is the counting
//! service of `idemproxy conformance` (docs/conformance.md): each path counted on its own,
//! `GET /count/…` saying how many times, and the query asking for a status, failures first, a size and a
//! streamed body. `--probe` connects to the address and exits 0 if something accepts: the readiness
//! probe of a pod whose app listens on loopback only, where the kubelet's own TCP probe cannot
//! reach. It ships in the proxy's binary (as Caddy ships `caddy respond`) so that trying the proxy
//! builds nothing more than the proxy.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

/// The most distinct `/c/` paths counted (about 1,400 runs of the conformance suite); beyond them a new
/// path is answered `503`, saying to restart the demo: with [`MAX_COUNTED_PATH`], at most about 100 MiB.
const MAX_COUNTED_PATHS: usize = 100_000;
/// The longest `/c/` path counted; a longer one is answered `414`, so the table's bound is one of bytes.
const MAX_COUNTED_PATH: usize = 1024;
/// How much of the request body the answer echoes (`received`): enough for every case of the suite,
/// and a bound on the answer a large body makes (JSON escapes a byte into as many as six).
const MAX_ECHO: usize = 64 << 10;
/// The largest request body read, and how long a request's head or body may take to arrive.
const MAX_BODY: usize = 64 << 20;
const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// The largest `size` and the most `chunks` a request may ask for.
const MAX_SIZE: usize = 64 << 20;
const MAX_CHUNKS: usize = 10_000;

type DemoBody = BoxBody<Bytes, Infallible>;

/// What the service has counted: every execution, and each `/c/` path's executions (the counting
/// service of `idemproxy conformance`, docs/conformance.md).
#[derive(Default)]
struct Counts {
    all: AtomicU64,
    per_path: Mutex<HashMap<String, u64>>,
}

impl Counts {
    /// Counts one more execution of `path`; `None` when it is a new path and the table is full.
    fn count(&self, path: &str) -> Option<u64> {
        let mut per_path = self.per_path.lock().unwrap_or_else(|e| e.into_inner());
        if !per_path.contains_key(path) && per_path.len() >= MAX_COUNTED_PATHS {
            return None;
        }
        let n = per_path.entry(path.to_owned()).or_insert(0);
        *n += 1;
        Some(*n)
    }

    fn of(&self, path: &str) -> u64 {
        let per_path = self.per_path.lock().unwrap_or_else(|e| e.into_inner());
        per_path.get(path).copied().unwrap_or(0)
    }
}

/// Serves the demo on `listener` until the process ends, saying where on stderr.
pub async fn serve(listener: TcpListener) -> std::io::Result<()> {
    eprintln!("demo upstream listening on http://{}", listener.local_addr()?);
    let counts = Arc::new(Counts::default());
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, or a connection reset before it was taken: say so, wait a
                // little and go on, rather than end the service.
                eprintln!("demo upstream: accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let counts = counts.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| answer(request, counts.clone()));
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(READ_TIMEOUT);
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

async fn answer(request: Request<Incoming>, counts: Arc<Counts>) -> Result<Response<DemoBody>, Infallible> {
    let path = request.uri().path().to_owned();
    if let Some(rest) = path.strip_prefix("/count/") {
        let count = counts.of(&format!("/c/{rest}"));
        let json = serde_json::json!({ "count": count });
        return Ok(json_response(StatusCode::OK, None, full(json.to_string())));
    }
    let asked = Asked::from_query(request.uri().query().unwrap_or(""));
    let counted = path.starts_with("/c/");
    if counted && path.len() > MAX_COUNTED_PATH {
        let body = full(r#"{"error":"a counted path is at most 1024 bytes"}"#);
        return Ok(json_response(StatusCode::URI_TOO_LONG, None, body));
    }
    let execution = if counted {
        match counts.count(&path) {
            Some(n) => n,
            None => {
                let body = full(r#"{"error":"100000 paths counted: restart the demo to count more"}"#);
                return Ok(json_response(StatusCode::SERVICE_UNAVAILABLE, None, body));
            }
        }
    } else {
        counts.all.fetch_add(1, Ordering::SeqCst) + 1
    };
    let method = request.method().to_string();
    let limited = http_body_util::Limited::new(request.into_body(), MAX_BODY);
    let body = match tokio::time::timeout(READ_TIMEOUT, limited.collect()).await {
        Ok(Ok(body)) => body.to_bytes(),
        Ok(Err(_)) | Err(_) => {
            let body = full(r#"{"error":"the request body is over 64 MiB, broken, or too slow"}"#);
            return Ok(json_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                Some(execution),
                body,
            ));
        }
    };
    tokio::time::sleep(asked.delay).await;
    eprintln!("execution {execution}: {method} {path}");
    let mut json = serde_json::json!({
        "execution": execution,
        "method": method,
        "path": path,
        "received": String::from_utf8_lossy(&body[..body.len().min(MAX_ECHO)]),
    });
    let mut text = json.to_string();
    if text.len() < asked.size {
        json["pad"] = serde_json::Value::String("x".repeat(asked.size - text.len()));
        text = json.to_string();
    }
    let status = if counted && execution <= asked.fail_first {
        asked.fail_status
    } else {
        asked.status
    };
    let body = if asked.chunks > 1 {
        chunked(Bytes::from(text), asked.chunks, asked.chunk_gap)
    } else {
        full(text)
    };
    Ok(json_response(status, Some(execution), body))
}

fn full(text: impl Into<Bytes>) -> DemoBody {
    Full::new(text.into()).boxed()
}

/// `bytes` in `pieces` frames, `gap` apart, the first at once: a response that streams.
fn chunked(bytes: Bytes, pieces: usize, gap: Duration) -> DemoBody {
    let size = bytes.len().div_ceil(pieces).max(1);
    let frames: Vec<Bytes> = (0..bytes.len())
        .step_by(size)
        .map(|start| bytes.slice(start..(start + size).min(bytes.len())))
        .collect();
    let stream =
        futures_util::stream::iter(frames.into_iter().enumerate()).then(move |(i, frame)| async move {
            if i > 0 {
                tokio::time::sleep(gap).await;
            }
            Ok::<_, Infallible>(Frame::data(frame))
        });
    BodyExt::boxed(StreamBody::new(stream))
}

fn json_response(status: StatusCode, execution: Option<u64>, body: DemoBody) -> Response<DemoBody> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    if let Some(n) = execution {
        headers.insert("x-execution", header::HeaderValue::from(n));
    }
    response
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

/// What a request asks of the service in its query (docs/conformance.md, "The counting service").
#[derive(Debug, PartialEq)]
struct Asked {
    status: StatusCode,
    delay: Duration,
    fail_first: u64,
    fail_status: StatusCode,
    size: usize,
    chunks: usize,
    chunk_gap: Duration,
}

impl Asked {
    /// Reads the query; a parameter that is absent or not a number (or not a status) keeps its default.
    fn from_query(query: &str) -> Asked {
        let number = |name: &str| -> Option<u64> {
            query
                .split('&')
                .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
        };
        let status = |name: &str, default: StatusCode| {
            number(name)
                .and_then(|n| u16::try_from(n).ok())
                .and_then(|n| StatusCode::from_u16(n).ok())
                .filter(|s| !s.is_informational())
                .unwrap_or(default)
        };
        let millis = |name: &str| Duration::from_millis(number(name).unwrap_or(0).min(600_000));
        let capped =
            |name: &str, cap: usize| number(name).map_or(0, |n| usize::try_from(n).unwrap_or(cap).min(cap));
        Asked {
            status: status("status", StatusCode::CREATED),
            delay: millis("delay_ms"),
            fail_first: number("fail_first").unwrap_or(0),
            fail_status: status("fail_status", StatusCode::SERVICE_UNAVAILABLE),
            size: capped("size", MAX_SIZE),
            chunks: capped("chunks", MAX_CHUNKS),
            chunk_gap: millis("chunk_ms"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_ms_in_the_query_is_the_delay_and_anything_else_is_none() {
        let delay = |q: &str| Asked::from_query(q).delay;
        assert_eq!(delay("delay_ms=3000"), Duration::from_secs(3));
        assert_eq!(delay("a=1&delay_ms=20"), Duration::from_millis(20));
        assert_eq!(delay("delay_ms=soon"), Duration::ZERO);
        assert_eq!(delay("xdelay_ms=5"), Duration::ZERO);
        assert_eq!(delay(""), Duration::ZERO);
    }

    #[test]
    fn the_query_asks_for_a_status_failures_first_a_size_and_chunks() {
        let asked = Asked::from_query("status=400&fail_first=2&fail_status=500&size=10&chunks=3&chunk_ms=7");
        assert_eq!(asked.status, StatusCode::BAD_REQUEST);
        assert_eq!(asked.fail_first, 2);
        assert_eq!(asked.fail_status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!((asked.size, asked.chunks), (10, 3));
        assert_eq!(asked.chunk_gap, Duration::from_millis(7));
        let plain = Asked::from_query("status=99&fail_status=abc&size=99999999999");
        assert_eq!(plain.status, StatusCode::CREATED);
        assert_eq!(plain.fail_status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(plain.size, MAX_SIZE);
    }

    #[test]
    fn each_counted_path_counts_on_its_own_and_the_table_is_bounded() {
        let counts = Counts::default();
        assert_eq!(counts.count("/c/a"), Some(1));
        assert_eq!(counts.count("/c/a"), Some(2));
        assert_eq!(counts.count("/c/b"), Some(1));
        assert_eq!((counts.of("/c/a"), counts.of("/c/z")), (2, 0));
    }
}
