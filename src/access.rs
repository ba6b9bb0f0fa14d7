//! The access log (`log.access`): one event per finished request on the target `idemproxy::access`.
//! `proxy.rs` opens a [`Line`] as a request arrives, with what its head says (client address, host, user
//! agent, protocol), and once the request is answered hands it the outcome and status with the response,
//! whose body then carries it, counting the bytes it hands the client; the line is written when that body
//! is dropped (after its last byte, or when the client goes), so its duration and bytes cover the whole
//! response. While the request runs, the store handle ([`store_op`]), the upstream client ([`upstream`]),
//! intake ([`key`]) and the client's body (`proxy/client_body.rs`, [`Ledger::body_read`]) add to the
//! request's [`Ledger`], a task-local that is set only while the log is on: with it off they pay one
//! empty thread-local lookup, and nothing here allocates or reads a clock. With it on, the head's fields
//! are kept as the request's own shared bytes, not copied.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HOST, USER_AGENT};
use http::uri::Authority;
use http::{HeaderValue, Method, Request, Response, Version};
use http_body::Frame;

use crate::body::{self, Inspect, ProxyBody};
use crate::headers::grpc_status;
use crate::metrics::Outcome;

/// The target access events are logged on, for `log.filter` / `RUST_LOG` to route or silence.
pub const TARGET: &str = "idemproxy::access";

/// The route name of a line whose request was not routed (refused before routing).
const UNROUTED: &str = "-";

/// Status and outcome of a line whose request was dropped before it was answered (nginx's 499).
const CLIENT_CLOSED: (&str, u16) = ("client_closed", 499);

tokio::task_local! {
    static LEDGER: Arc<Ledger>;
}

/// What one request spent where, added to by the layers it passes through.
#[derive(Debug, Default)]
pub struct Ledger {
    store_us: AtomicU64,
    upstream_us: AtomicU64,
    upstream_called: AtomicBool,
    /// Bytes of the client's request body read so far.
    bytes_in: AtomicU64,
    key_hash: OnceLock<String>,
    route: OnceLock<String>,
}

impl Ledger {
    /// Adds `bytes` of the client's request body, just read.
    pub fn body_read(&self, bytes: usize) {
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        self.bytes_in.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Where a request came from, as its line says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// This IP address: the TCP peer, or what a trusted proxy on the unix socket says of its client.
    Ip(IpAddr),
    /// A client on the unix socket with no address the proxy takes as given.
    Unix,
}

impl fmt::Display for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Client::Ip(ip) => ip.fmt(f),
            Client::Unix => f.write_str("unix"),
        }
    }
}

/// The host a request names: its target's authority (HTTP/2's `:authority`, an absolute-form target),
/// which names it over any `Host` header, or else that header, as the upstream is told (`proxy/upstream.rs`).
#[derive(Debug)]
enum Host {
    Target(Authority),
    Header(HeaderValue),
}

impl Host {
    fn of<B>(request: &Request<B>) -> Option<Host> {
        match request.uri().authority() {
            Some(authority) => Some(Host::Target(authority.clone())),
            None => request.headers().get(HOST).cloned().map(Host::Header),
        }
    }

    /// Without a target's userinfo (`user:pw@`), which names no host and may be a secret.
    fn as_str(&self) -> Option<&str> {
        match self {
            Host::Target(authority) => authority.as_str().rsplit('@').next(),
            Host::Header(value) => value.to_str().ok(),
        }
    }
}

/// The protocol as the access log names it.
fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP",
    }
}

/// Adds a store operation's time to the current request's ledger, if it has one.
pub fn store_op(elapsed: Duration) {
    let _ = LEDGER.try_with(|ledger| ledger.store_us.fetch_add(micros(elapsed), Ordering::Relaxed));
}

/// Adds the upstream call's time (to the response head) to the current request's ledger, if it has one.
pub fn upstream(elapsed: Duration) {
    let _ = LEDGER.try_with(|ledger| {
        ledger.upstream_us.fetch_add(micros(elapsed), Ordering::Relaxed);
        ledger.upstream_called.store(true, Ordering::Relaxed);
    });
}

/// Notes the request's key hash, computed by `hash` only when the request has a ledger.
pub fn key(hash: impl FnOnce() -> String) {
    let _ = LEDGER.try_with(|ledger| {
        ledger.key_hash.get_or_init(hash);
    });
}

/// Notes the name of the route the current request took, if it has a ledger.
pub fn route(name: &str) {
    let _ = LEDGER.try_with(|ledger| {
        ledger.route.get_or_init(|| name.to_owned());
    });
}

/// The current request's ledger, to carry onto a task the request spawns.
pub fn current() -> Option<Arc<Ledger>> {
    LEDGER.try_with(Arc::clone).ok()
}

/// Runs `work` with `ledger` as its request's ledger (as it is, without one).
pub async fn within<F: Future>(ledger: Option<Arc<Ledger>>, work: F) -> F::Output {
    match ledger {
        Some(ledger) => LEDGER.scope(ledger, work).await,
        None => work.await,
    }
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

fn millis(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// One request's access line, written when dropped.
#[derive(Debug)]
pub struct Line {
    started: Instant,
    method: Method,
    path: String,
    client: Client,
    host: Option<Host>,
    user_agent: Option<HeaderValue>,
    protocol: &'static str,
    /// Bytes of the response body handed to the client's connection.
    bytes_out: u64,
    trace_id: Option<String>,
    ledger: Arc<Ledger>,
    answered: Option<(Outcome, u16)>,
    /// A gRPC answer's `grpc-status`: from a trailers-only head, or from the trailers as they pass.
    grpc_status: Option<u32>,
}

impl Line {
    /// Opens the line of `request`, which has just arrived from `client`. Its path is kept alone: a query
    /// string can carry secrets and never reaches the log.
    pub fn open<B>(request: &Request<B>, client: Client, trace_id: Option<&str>) -> Line {
        Line {
            started: Instant::now(),
            method: request.method().clone(),
            path: request.uri().path().to_owned(),
            client,
            host: Host::of(request),
            user_agent: request.headers().get(USER_AGENT).cloned(),
            protocol: protocol(request.version()),
            bytes_out: 0,
            trace_id: trace_id.map(str::to_owned),
            ledger: Arc::default(),
            answered: None,
            grpc_status: None,
        }
    }

    /// The ledger the request's work adds to.
    pub fn ledger(&self) -> Arc<Ledger> {
        self.ledger.clone()
    }

    /// Notes the answer; the line is written when the returned response's body is dropped.
    pub fn answered(mut self, outcome: Outcome, response: Response<ProxyBody>) -> Response<ProxyBody> {
        self.answered = Some((outcome, response.status().as_u16()));
        self.grpc_status = grpc_status(response.headers());
        response.map(|body| body::inspected(body, self))
    }

    fn write(&self) {
        let (outcome, status) = match self.answered {
            Some((outcome, status)) => (outcome.as_str(), status),
            None => CLIENT_CLOSED,
        };
        let ledger = &self.ledger;
        let upstream_ms = ledger
            .upstream_called
            .load(Ordering::Relaxed)
            .then(|| millis(ledger.upstream_us.load(Ordering::Relaxed)));
        tracing::info!(
            target: TARGET,
            parent: None,
            client = %self.client,
            method = %self.method,
            host = self.host.as_ref().and_then(Host::as_str),
            path = %self.path,
            protocol = self.protocol,
            route = ledger.route.get().map_or(UNROUTED, String::as_str),
            outcome,
            status,
            bytes_in = ledger.bytes_in.load(Ordering::Relaxed),
            bytes_out = self.bytes_out,
            key_hash = ledger.key_hash.get().map(String::as_str),
            upstream_ms,
            store_ms = millis(ledger.store_us.load(Ordering::Relaxed)),
            duration_ms = millis(micros(self.started.elapsed())),
            grpc_status = self.grpc_status,
            user_agent = self.user_agent.as_ref().and_then(|agent| agent.to_str().ok()),
            trace_id = self.trace_id.as_deref(),
            "access"
        );
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        self.write();
    }
}

/// The line counts its response's bytes and watches its frames for a gRPC answer's trailers, and is
/// written when the body is dropped.
impl Inspect for Line {
    fn frame(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.bytes_out += data.len() as u64;
        }
        if let Some(trailers) = frame.trailers_ref() {
            self.grpc_status = grpc_status(trailers).or(self.grpc_status);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn work_within_a_ledger_adds_to_it_and_work_outside_adds_nowhere() {
        store_op(Duration::from_millis(5));
        let ledger = Arc::new(Ledger::default());
        within(Some(ledger.clone()), async {
            store_op(Duration::from_micros(1500));
            store_op(Duration::from_micros(500));
            upstream(Duration::from_millis(3));
            key(|| "abc".to_owned());
            key(|| "def".to_owned());
            let spawned = within(current(), async { store_op(Duration::from_millis(1)) });
            tokio::spawn(spawned).await.unwrap();
        })
        .await;
        assert_eq!(ledger.store_us.load(Ordering::Relaxed), 3000);
        assert_eq!(ledger.upstream_us.load(Ordering::Relaxed), 3000);
        assert_eq!(ledger.key_hash.get().map(String::as_str), Some("abc"));
        assert!(current().is_none());
    }
}
