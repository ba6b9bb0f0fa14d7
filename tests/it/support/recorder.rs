//! A recording upstream for histories and load: every request that reaches it is an execution, recorded
//! with the credentials, key and payload it carried, and answered with a body that echoes all three, so
//! a response that reached the wrong client or the wrong key shows in the body itself.
//!
//! The request picks its answer: `x-want-status` (default 201) and `x-delay-ms` (time before the head).
//! The body goes out in two chunks; the test can make the next responses break off after the first chunk
//! (a reset) or pause there (a stall), to fault the upstream mid-body.

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http_body_util::{BodyExt, StreamBody, combinators::UnsyncBoxBody};
use hyper::{
    Request, Response,
    body::{Frame, Incoming},
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// One execution as the upstream saw it, with the response it produced.
#[derive(Debug, Clone)]
pub struct Execution {
    pub exec: usize,
    pub authorization: String,
    pub key: String,
    pub payload: String,
    pub status: u16,
    pub body: Bytes,
    /// When the request arrived.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct State {
    executions: Mutex<Vec<Execution>>,
    per_key: Mutex<HashMap<(String, String), usize>>,
    resets: AtomicUsize,
    stalls: AtomicUsize,
    stall_for: Mutex<Duration>,
}

/// The running recorder; it lives as long as the test's runtime.
pub struct Recorder {
    addr: SocketAddr,
    state: Arc<State>,
}

impl Recorder {
    pub async fn start() -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind recorder");
        let addr = listener.local_addr().expect("recorder address");
        let state = Arc::new(State::default());
        tokio::spawn(accept_loop(listener, state.clone()));
        Recorder { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every execution so far, in arrival order.
    pub fn executions(&self) -> Vec<Execution> {
        self.state.executions.lock().unwrap().clone()
    }

    pub fn execution_count(&self) -> usize {
        self.state.executions.lock().unwrap().len()
    }

    /// Executions of `key` under `authorization`.
    pub fn executions_of(&self, authorization: &str, key: &str) -> usize {
        let per_key = self.state.per_key.lock().unwrap();
        let id = (authorization.to_string(), key.to_string());
        per_key.get(&id).copied().unwrap_or(0)
    }

    /// The next `n` responses send their first chunk, then break the connection.
    pub fn reset_next(&self, n: usize) {
        self.state.resets.fetch_add(n, Ordering::SeqCst);
    }

    /// The next `n` responses send their first chunk, then pause `pause` before the rest.
    pub fn stall_next(&self, n: usize, pause: Duration) {
        *self.state.stall_for.lock().unwrap() = pause;
        self.state.stalls.fetch_add(n, Ordering::SeqCst);
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| handle(request, state.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(request: Request<Incoming>, state: Arc<State>) -> Result<Response<Body>, BoxError> {
    let (parts, body) = request.into_parts();
    let payload = body.collect().await?.to_bytes();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let status: u16 = header("x-want-status")
        .and_then(|s| s.parse().ok())
        .unwrap_or(201);
    let delay: u64 = header("x-delay-ms").and_then(|s| s.parse().ok()).unwrap_or(0);
    let execution = record(
        &state,
        header("authorization").unwrap_or_default(),
        header("idempotency-key").unwrap_or_default(),
        String::from_utf8_lossy(&payload).into_owned(),
        status,
    );
    tokio::time::sleep(Duration::from_millis(delay)).await;
    Ok(respond(&execution, &state))
}

fn record(state: &State, authorization: String, key: String, payload: String, status: u16) -> Execution {
    let mut executions = state.executions.lock().unwrap();
    let exec = executions.len() + 1;
    let body = serde_json::json!({
        "exec": exec,
        "authorization": authorization,
        "key": key,
        "payload": payload,
        "pad": "x".repeat(exec * 37 % 3000),
    });
    let execution = Execution {
        exec,
        authorization,
        key,
        payload,
        status,
        body: Bytes::from(body.to_string()),
        at: std::time::Instant::now(),
    };
    executions.push(execution.clone());
    let id = (execution.authorization.clone(), execution.key.clone());
    *state.per_key.lock().unwrap().entry(id).or_default() += 1;
    execution
}

/// Takes one from a fault counter, if any is left.
fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

fn respond(execution: &Execution, state: &State) -> Response<Body> {
    let half = execution.body.len() / 2;
    let first = execution.body.slice(..half);
    let rest = execution.body.slice(half..);
    let first = stream::once(async move { Ok::<_, BoxError>(Frame::data(first)) });
    let body: Body = if take(&state.resets) {
        // hyper drops unflushed output when a body fails: let the head and first chunk leave first.
        let reset = stream::once(async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            Err::<Frame<Bytes>, BoxError>("recorder resets the connection mid-body".into())
        });
        BodyExt::boxed_unsync(StreamBody::new(first.chain(reset)))
    } else {
        let pause = if take(&state.stalls) {
            *state.stall_for.lock().unwrap()
        } else {
            Duration::ZERO
        };
        let rest = stream::once(async move {
            tokio::time::sleep(pause).await;
            Ok(Frame::data(rest))
        });
        BodyExt::boxed_unsync(StreamBody::new(first.chain(rest)))
    };
    Response::builder()
        .status(execution.status)
        .header("content-type", "application/json")
        .header("x-exec", execution.exec.to_string())
        .body(body)
        .expect("valid recorder response")
}
