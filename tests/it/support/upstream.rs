//! A stub upstream on 127.0.0.1:0 that records every request it executes.
//!
//! The path picks the behaviour:
//! - `/status/<code>`: answers `<code>` with a short text body; first waits for its gate when the
//!   request names one in `x-gate`.
//! - `/fail-first/<code>`: the first request on this path answers `<code>` (after its gate, when it names
//!   one in `x-gate`); every later one answers like an unknown path (201, `created`).
//! - `/slow`: answers 201 (head and body) once the test opens the request's gate.
//! - `/stream`: sends the head and `FIRST_CHUNK`, then `REST_CHUNK` once the request's gate is open.
//!
//! A request's gate is named by its `x-gate` header, else by its path (`slow`, `stream`); a header
//! rather than the query, so that requests on different gates can share a fingerprint.
//! - `/reset-mid-body`: sends the head (content-length 1000) and 10 bytes, then drops the connection.
//! - `/big?bytes=<n>`: streams `n` bytes (see [`big_body`]) in 16 KiB chunks.
//! - `/held?bytes=<n>`: sends `n` bytes of [`big_body`] at once, then `REST_CHUNK` once the request's
//!   gate (`x-gate`, else `held`) is open.
//! - `/chunked`: 201 with a body of two chunks and no length (chunked on HTTP/1.1), answered at once.
//! - `/empty`: 204 with no body; `/empty-200`: 200 with `content-length: 0`.
//! - `/cookie`: 201 with `set-cookie: session=<n>` and `x-session: <n>` beside a JSON body.
//! - `/hop-by-hop`: 201 carrying hop-by-hop headers (`connection: x-upstream-hop`,
//!   `x-upstream-hop`, `proxy-authenticate`) beside `x-custom: value`.
//! - anything else: 201 with a JSON body carrying the execution number, plus headers
//!   `x-upstream-exec: <n>` and `x-custom: value`.

use std::{
    collections::{HashMap, HashSet},
    convert::Infallible,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http_body_util::{BodyExt, Full, StreamBody, combinators::UnsyncBoxBody};
use hyper::{
    HeaderMap, Request, Response, StatusCode,
    body::{Frame, Incoming},
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::watch};

pub const FIRST_CHUNK: &[u8] = b"first chunk\n";
pub const REST_CHUNK: &[u8] = b"the rest\n";

/// How long a gated response waits for its gate before answering anyway.
const GATE_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on every wait a test does on the stub.
const WAIT_BOUND: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// One request as the stub received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// 1 for the first request this stub executed, 2 for the next, …
    pub exec: usize,
    pub method: String,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub key: Option<String>,
}

#[derive(Default)]
struct State {
    connections: AtomicUsize,
    closed: AtomicUsize,
    requests: Mutex<Vec<Recorded>>,
    gates: Mutex<HashMap<String, watch::Sender<bool>>>,
    /// Paths of `/fail-first/<code>` requests seen so far.
    failed_first: Mutex<HashSet<String>>,
}

impl State {
    fn gate(&self, name: &str) -> watch::Sender<bool> {
        let mut gates = self.gates.lock().unwrap();
        gates
            .entry(name.to_string())
            .or_insert_with(|| watch::channel(false).0)
            .clone()
    }
}

/// A running stub upstream; it lives as long as the test's runtime.
pub struct Upstream {
    url: String,
    state: Arc<State>,
    executed: watch::Sender<usize>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind stub upstream");
        let addr = listener.local_addr().expect("stub upstream address");
        let upstream = Upstream::new(format!("http://{addr}"));
        tokio::spawn(accept_loop(
            listener,
            upstream.state.clone(),
            upstream.executed.clone(),
        ));
        upstream
    }

    /// The stub over TLS on 127.0.0.1:0, with `tls` (its certificate, and any client certificate it
    /// requires); its URL is `https://127.0.0.1:<port>`. Handshakes that fail are dropped unserved.
    pub async fn start_tls(tls: Arc<rustls::ServerConfig>) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind stub upstream");
        let addr = listener.local_addr().expect("stub upstream address");
        let upstream = Upstream::new(format!("https://{addr}"));
        let (state, executed) = (upstream.state.clone(), upstream.executed.clone());
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (acceptor, state, executed) = (acceptor.clone(), state.clone(), executed.clone());
                tokio::spawn(async move {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        serve(stream, state, executed).await;
                    }
                });
            }
        });
        upstream
    }

    /// The stub on a unix socket at `path`; its URL is `unix:<path>`.
    pub async fn start_unix(path: &std::path::Path) -> Upstream {
        let listener = tokio::net::UnixListener::bind(path).expect("bind stub upstream socket");
        let upstream = Upstream::new(format!("unix:{}", path.display()));
        let (state, executed) = (upstream.state.clone(), upstream.executed.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, state.clone(), executed.clone()));
            }
        });
        upstream
    }

    fn new(url: String) -> Upstream {
        Upstream {
            url,
            state: Arc::new(State::default()),
            executed: watch::channel(0).0,
        }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// Every request executed so far, in arrival order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.state.requests.lock().unwrap().clone()
    }

    /// Connections the proxy has opened to the stub so far.
    pub fn connections(&self) -> usize {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Connections from the proxy still open.
    pub fn open_connections(&self) -> usize {
        self.connections() - self.state.closed.load(Ordering::SeqCst)
    }

    pub fn executions(&self) -> usize {
        self.state.requests.lock().unwrap().len()
    }

    /// Executions whose `Idempotency-Key` header was exactly `key` (as sent on the wire).
    pub fn executions_for_key(&self, key: &str) -> usize {
        let requests = self.state.requests.lock().unwrap();
        requests.iter().filter(|r| r.key.as_deref() == Some(key)).count()
    }

    /// Waits until at least `n` requests carrying `key` have been executed.
    pub async fn wait_for_key(&self, key: &str, n: usize) {
        let what = format!("{n} executions of key {key:?}");
        self.wait_until(|| self.executions_for_key(key) >= n, &what).await;
    }

    /// Waits until at least `n` requests have been executed.
    pub async fn wait_until_executions(&self, n: usize) {
        self.wait_until(|| self.executions() >= n, &format!("{n} executions"))
            .await;
    }

    /// Opens the gate `name`: held and future `/slow` or `/stream` requests on it go ahead.
    pub fn release(&self, name: &str) {
        self.state.gate(name).send_replace(true);
    }

    async fn wait_until(&self, done: impl Fn() -> bool, what: &str) {
        let mut changes = self.executed.subscribe();
        let waited = tokio::time::timeout(WAIT_BOUND, changes.wait_for(|_| done())).await;
        if waited.is_err() {
            panic!(
                "stub upstream: waited {WAIT_BOUND:?} for {what}; saw {} executions",
                self.executions()
            );
        }
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, executed: watch::Sender<usize>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(serve(stream, state.clone(), executed.clone()));
    }
}

/// Serves one connection, counting it open and then closed.
async fn serve<S>(stream: S, state: Arc<State>, executed: watch::Sender<usize>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    state.connections.fetch_add(1, Ordering::SeqCst);
    let serving = state.clone();
    let service = service_fn(move |request| handle(request, serving.clone(), executed.clone()));
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
    state.closed.fetch_add(1, Ordering::SeqCst);
}

async fn handle(
    request: Request<Incoming>,
    state: Arc<State>,
    executed: watch::Sender<usize>,
) -> Result<Response<Body>, BoxError> {
    let recorded = record(request, &state).await?;
    executed.send_replace(recorded.exec);
    Ok(respond(&recorded, &state).await)
}

async fn record(request: Request<Incoming>, state: &State) -> Result<Recorded, BoxError> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let key = parts
        .headers
        .get("idempotency-key")
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let mut requests = state.requests.lock().unwrap();
    let recorded = Recorded {
        exec: requests.len() + 1,
        method: parts.method.to_string(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_string(), |pq| pq.to_string()),
        headers: parts.headers,
        body,
        key,
    };
    requests.push(recorded.clone());
    Ok(recorded)
}

async fn respond(recorded: &Recorded, state: &State) -> Response<Body> {
    let (path, query) = recorded
        .path_and_query
        .split_once('?')
        .unwrap_or((&recorded.path_and_query, ""));
    let param = |name: &str| {
        query
            .split('&')
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .map(str::to_string)
    };
    match path {
        "/slow" => slow(recorded, state.gate(&gate_name(recorded, "slow"))).await,
        "/stream" => streamed(state.gate(&gate_name(recorded, "stream"))),
        "/reset-mid-body" => reset_mid_body(),
        "/hop-by-hop" => hop_by_hop(),
        "/chunked" => chunked(recorded),
        "/empty" => empty(StatusCode::NO_CONTENT),
        "/empty-200" => empty(StatusCode::OK),
        "/cookie" => cookie(recorded),
        "/big" => big(param("bytes").and_then(|n| n.parse().ok()).unwrap_or(0)),
        "/held" => held(
            param("bytes").and_then(|n| n.parse().ok()).unwrap_or(0),
            state.gate(&gate_name(recorded, "held")),
        ),
        _ if path.starts_with("/fail-first/") => fail_first(recorded, state, path).await,
        _ => match path.strip_prefix("/status/").and_then(|c| c.parse().ok()) {
            Some(code) if recorded.headers.contains_key("x-gate") => {
                wait_open(state.gate(&gate_name(recorded, "status"))).await;
                status(code)
            }
            Some(code) => status(code),
            None => created(recorded),
        },
    }
}

async fn fail_first(recorded: &Recorded, state: &State, path: &str) -> Response<Body> {
    let first = state.failed_first.lock().unwrap().insert(path.to_string());
    if recorded.headers.contains_key("x-gate") {
        wait_open(state.gate(&gate_name(recorded, "fail-first"))).await;
    }
    match path.strip_prefix("/fail-first/").and_then(|c| c.parse().ok()) {
        Some(code) if first => status(code),
        _ => created(recorded),
    }
}

fn gate_name(recorded: &Recorded, default: &str) -> String {
    recorded
        .headers
        .get("x-gate")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(default)
        .to_string()
}

fn created(recorded: &Recorded) -> Response<Body> {
    let body = serde_json::json!({
        "exec": recorded.exec,
        "method": recorded.method,
        "path": recorded.path_and_query,
        "body_len": recorded.body.len(),
    });
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("x-upstream-exec", recorded.exec.to_string())
        .header("x-custom", "value")
        .body(full(body.to_string()))
        .expect("valid stub response")
}

fn chunked(recorded: &Recorded) -> Response<Body> {
    let chunks = [
        format!("{{\"exec\":{},", recorded.exec),
        "\"chunked\":true}".to_string(),
    ];
    let frames = chunks.map(|c| Ok::<_, BoxError>(Frame::data(Bytes::from(c))));
    Response::builder()
        .status(StatusCode::CREATED)
        .header("x-upstream-exec", recorded.exec.to_string())
        .body(BodyExt::boxed_unsync(StreamBody::new(stream::iter(frames))))
        .expect("valid stub response")
}

/// No body: a 204 has none by definition, a 200 says `content-length: 0`.
fn empty(status: StatusCode) -> Response<Body> {
    let mut response = Response::builder().status(status);
    if status != StatusCode::NO_CONTENT {
        response = response.header("content-length", "0");
    }
    response.body(full(String::new())).expect("valid stub response")
}

fn cookie(recorded: &Recorded) -> Response<Body> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("content-type", "application/json")
        .header("set-cookie", format!("session={}; HttpOnly", recorded.exec))
        .header("x-session", recorded.exec.to_string())
        .body(full(format!("{{\"exec\":{}}}", recorded.exec)))
        .expect("valid stub response")
}

fn hop_by_hop() -> Response<Body> {
    Response::builder()
        .status(StatusCode::CREATED)
        .header("connection", "x-upstream-hop")
        .header("x-upstream-hop", "1")
        .header("proxy-authenticate", "Basic realm=\"upstream\"")
        .header("x-custom", "value")
        .body(full("hop".to_string()))
        .expect("valid stub response")
}

fn status(code: u16) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "text/plain")
        .body(full(format!("status {code}")))
        .expect("valid status code")
}

async fn slow(recorded: &Recorded, gate: watch::Sender<bool>) -> Response<Body> {
    wait_open(gate).await;
    Response::builder()
        .status(StatusCode::CREATED)
        .header("x-upstream-exec", recorded.exec.to_string())
        .body(full(format!("slow done {}", recorded.exec)))
        .expect("valid stub response")
}

fn streamed(gate: watch::Sender<bool>) -> Response<Body> {
    let first = stream::once(async { Ok(Frame::data(Bytes::from_static(FIRST_CHUNK))) });
    let rest = stream::once(async move {
        wait_open(gate).await;
        Ok(Frame::data(Bytes::from_static(REST_CHUNK)))
    });
    Response::new(BodyExt::boxed_unsync(StreamBody::new(first.chain(rest))))
}

fn held(bytes: usize, gate: watch::Sender<bool>) -> Response<Body> {
    let first = stream::once(async move { Ok(Frame::data(Bytes::from(big_body(bytes)))) });
    let rest = stream::once(async move {
        wait_open(gate).await;
        Ok(Frame::data(Bytes::from_static(REST_CHUNK)))
    });
    Response::new(BodyExt::boxed_unsync(StreamBody::new(first.chain(rest))))
}

fn reset_mid_body() -> Response<Body> {
    let first = stream::once(async { Ok(Frame::data(Bytes::from_static(b"0123456789"))) });
    // hyper drops unflushed output when a body fails: give the head and first bytes time to leave.
    let reset = stream::once(async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Err("stub upstream resets the connection".into())
    });
    Response::builder()
        .header("content-length", "1000")
        .body(BodyExt::boxed_unsync(StreamBody::new(first.chain(reset))))
        .expect("valid stub response")
}

fn big(bytes: usize) -> Response<Body> {
    let body = big_body(bytes);
    let chunks: Vec<Result<Frame<Bytes>, BoxError>> = body
        .chunks(16 * 1024)
        .map(|c| Ok(Frame::data(Bytes::copy_from_slice(c))))
        .collect();
    Response::new(BodyExt::boxed_unsync(StreamBody::new(stream::iter(chunks))))
}

/// The body `/big?bytes=n` answers with.
pub fn big_body(bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i % 251) as u8).collect()
}

fn full(text: String) -> Body {
    Full::new(Bytes::from(text))
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

async fn wait_open(gate: watch::Sender<bool>) {
    let mut open = gate.subscribe();
    let _ = tokio::time::timeout(GATE_TIMEOUT, open.wait_for(|open| *open)).await;
}
