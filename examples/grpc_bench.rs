//! The gRPC upstream and load generator of bench/run's gRPC cases (`grpc-direct`, `grpc-passthrough`,
//! `grpc-keyed`): wrk and h2load cannot put a new `idempotency-key` on every call, so this does.
//!
//! `grpc_bench serve ADDR` serves the unary method `/payments.Payments/CreatePayment` over HTTP/2 with
//! prior knowledge (h2c) on `ADDR` (`127.0.0.1:0` picks a port), and prints the address it bound on the
//! first line of stdout. Every call gets the same `Payment`, 230 bytes of protobuf (about the size of
//! bench/run's JSON body), from tonic's server side on hyper's HTTP/2 server, on one thread: as bench/run's
//! HTTP upstream is nginx with one worker, so the upstream takes at most one of the machine's cores.
//!
//! `grpc_bench load --url URL --conns N --duration SECS [--threads T] [--keyed] [--key-prefix P]` runs
//! `N` callers for `SECS` seconds, each with a tonic channel of its own (one HTTP/2 connection), making
//! one `CreatePayment` after another: one call in flight per connection, as wrk's `N` connections keep
//! one HTTP/1.1 request in flight each. Every call carries a credential (`authorization`); with
//! `--keyed`, also an `idempotency-key` no call has carried before: `P-CALLER-COUNT`, with a prefix new
//! to each run. Every answer is checked: status OK and the expected message (with `--keyed`, not a
//! replay). It prints one JSON line: calls made, errors (any other outcome, or a call still unanswered
//! ten seconds after the end), seconds, calls per second, p50 and p99 latency in milliseconds, and the
//! first error's description; it exits non-zero when there were errors.

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use clap::{Args, Parser, Subcommand};
use http::uri::PathAndQuery;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::metadata::{MetadataValue, errors::InvalidMetadataValue};
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};
use tonic_prost::ProstCodec;

const CREATE_PAYMENT: &str = "/payments.Payments/CreatePayment";
/// What a caller sends: the credential the proxy scopes keys by, as bench/wrk.lua's.
const CREDENTIAL: &str = "Bearer bench-client";
/// How long after the end a call may still be unanswered before it counts as an error, as wrk's
/// `--timeout 10s` in bench/run.
const GRACE: Duration = Duration::from_secs(10);

#[derive(Clone, PartialEq, prost::Message)]
struct CreatePayment {
    #[prost(string, tag = "1")]
    customer: String,
    #[prost(int64, tag = "2")]
    amount: i64,
    #[prost(string, tag = "3")]
    currency: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Payment {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(string, tag = "2")]
    status: String,
    #[prost(int64, tag = "3")]
    amount: i64,
    #[prost(string, tag = "4")]
    currency: String,
    #[prost(string, tag = "5")]
    customer: String,
    #[prost(string, tag = "6")]
    created_at: String,
    #[prost(message, repeated, tag = "7")]
    items: Vec<Item>,
    #[prost(string, tag = "8")]
    note: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Item {
    #[prost(string, tag = "1")]
    sku: String,
    #[prost(uint32, tag = "2")]
    quantity: u32,
}

/// The call every caller makes.
fn order() -> CreatePayment {
    CreatePayment {
        customer: "c_123".into(),
        amount: 1000,
        currency: "EUR".into(),
    }
}

/// The answer to every call: 230 bytes encoded.
fn payment() -> Payment {
    let item = |sku: &str, quantity| Item {
        sku: sku.into(),
        quantity,
    };
    Payment {
        id: "pay_8f14e45fceea167a5a36dedd4bea2543".into(),
        status: "accepted".into(),
        amount: 1000,
        currency: "EUR".into(),
        customer: "c_123".into(),
        created_at: "2026-01-01T00:00:00Z".into(),
        items: vec![item("sku_001", 2), item("sku_002", 1)],
        note: "b".repeat(117),
    }
}

#[derive(Parser)]
#[command(about = "gRPC upstream and load generator for bench/run")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve CreatePayment over h2c on ADDR, printing the bound address first.
    Serve { addr: SocketAddr },
    /// Call CreatePayment at --url for --duration seconds.
    Load(Load),
}

#[derive(Args)]
struct Load {
    /// The server, as http://HOST:PORT.
    #[arg(long)]
    url: String,
    /// Concurrent callers, one HTTP/2 connection each.
    #[arg(long)]
    conns: usize,
    /// Seconds of calls.
    #[arg(long)]
    duration: u64,
    /// Threads of the load generator's runtime (default: one per core, as bench/run gives wrk).
    #[arg(long)]
    threads: Option<usize>,
    /// Put a new idempotency-key on every call.
    #[arg(long)]
    keyed: bool,
    /// The keys' prefix: new to each run, so that no key was used before.
    #[arg(long, default_value = "grpc-bench")]
    key_prefix: String,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Serve { addr } => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(serve(addr)),
        Command::Load(load) => {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            if let Some(threads) = load.threads {
                runtime.worker_threads(threads);
            }
            runtime.enable_all().build()?.block_on(run(load))
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// The upstream
// ----------------------------------------------------------------------------------------------------

async fn serve(addr: SocketAddr) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!("{}", listener.local_addr()?);
    let payments = Payments(payment());
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        stream.set_nodelay(true)?;
        let payments = payments.clone();
        let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
            payments.clone().call(request.map(Body::new))
        });
        tokio::spawn(
            hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service),
        );
    }
}

/// The `payments.Payments` service: `CreatePayment` answers with its one `Payment`.
#[derive(Clone)]
struct Payments(Payment);

impl Service<http::Request<Body>> for Payments {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let answer = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != CREATE_PAYMENT {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Payment, CreatePayment>::default());
            Ok(grpc.unary(Create(answer), request).await)
        })
    }
}

struct Create(Payment);

impl tonic::server::UnaryService<CreatePayment> for Create {
    type Response = Payment;
    type Future = std::future::Ready<Result<Response<Payment>, Status>>;

    fn call(&mut self, _: tonic::Request<CreatePayment>) -> Self::Future {
        std::future::ready(Ok(Response::new(std::mem::take(&mut self.0))))
    }
}

// ----------------------------------------------------------------------------------------------------
// The load generator
// ----------------------------------------------------------------------------------------------------

async fn run(load: Load) -> Result<()> {
    let endpoint = Endpoint::from_shared(load.url.clone()).context("--url")?;
    let mut channels = Vec::with_capacity(load.conns);
    for _ in 0..load.conns {
        let channel = endpoint.connect().await;
        channels.push(channel.with_context(|| format!("connecting to {}", load.url))?);
    }
    let started = Instant::now();
    let end = started + Duration::from_secs(load.duration);
    let callers: Vec<_> = channels
        .into_iter()
        .enumerate()
        .map(|(n, channel)| {
            let keys = load.keyed.then(|| format!("{}-{n}-", load.key_prefix));
            tokio::spawn(caller(channel, keys, end))
        })
        .collect();
    let mut total = Tally::default();
    for caller in callers {
        match tokio::time::timeout_at(end + GRACE, caller).await {
            Ok(tally) => total.add(tally?),
            Err(_) => total.unanswered(),
        }
    }
    total.report(started.elapsed())
}

/// One caller's calls, back to back until `end`; with `keys`, each under the key `keys` + its number.
async fn caller(channel: Channel, keys: Option<String>, end: Instant) -> Tally {
    let mut grpc = tonic::client::Grpc::new(channel);
    let expected = payment();
    let mut tally = Tally::default();
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        let key = keys.as_ref().map(|prefix| format!("{prefix}{n}"));
        let sent = Instant::now();
        let outcome = create(&mut grpc, key, &expected).await;
        tally.record(sent.elapsed(), outcome.err());
    }
    tally
}

/// One `CreatePayment`, checked against `expected`: `Err` says what was wrong with its outcome. With a
/// key, the answer must be a first execution's, not a replay.
async fn create(
    grpc: &mut tonic::client::Grpc<Channel>,
    key: Option<String>,
    expected: &Payment,
) -> Result<(), String> {
    let keyed = key.is_some();
    let request = request(key).map_err(|e| format!("key: {e}"))?;
    grpc.ready().await.map_err(|e| format!("channel: {e}"))?;
    let codec = ProstCodec::<CreatePayment, Payment>::default();
    let response = grpc
        .unary(request, PathAndQuery::from_static(CREATE_PAYMENT), codec)
        .await
        .map_err(|status| format!("status {:?}: {}", status.code(), status.message()))?;
    let (metadata, payment, _) = response.into_parts();
    if keyed && metadata.get("idempotent-replayed").is_some() {
        return Err("a new key's call was answered as a replay".into());
    }
    if payment != *expected {
        return Err(format!("unexpected message: {payment:?}"));
    }
    Ok(())
}

fn request(key: Option<String>) -> Result<tonic::Request<CreatePayment>, InvalidMetadataValue> {
    let mut request = tonic::Request::new(order());
    let metadata = request.metadata_mut();
    metadata.insert("authorization", MetadataValue::from_static(CREDENTIAL));
    if let Some(key) = key {
        metadata.insert("idempotency-key", MetadataValue::try_from(key)?);
    }
    Ok(request)
}

/// Calls answered, with their latencies in microseconds; calls unanswered; and the errors among both.
#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    unanswered: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    fn record(&mut self, latency: Duration, error: Option<String>) {
        self.latencies_us
            .push(u32::try_from(latency.as_micros()).unwrap_or(u32::MAX));
        if let Some(error) = error {
            self.failed(error);
        }
    }

    /// A caller whose call was still unanswered `GRACE` after the end.
    fn unanswered(&mut self) {
        self.unanswered += 1;
        self.failed(format!("a call unanswered {} s after the end", GRACE.as_secs()));
    }

    fn failed(&mut self, error: String) {
        self.errors += 1;
        self.first_error.get_or_insert(error);
    }

    fn add(&mut self, other: Tally) {
        self.latencies_us.extend(other.latencies_us);
        self.unanswered += other.unanswered;
        self.errors += other.errors;
        if let Some(error) = other.first_error {
            self.first_error.get_or_insert(error);
        }
    }

    /// Prints the JSON line; an error when any call failed.
    fn report(mut self, elapsed: Duration) -> Result<()> {
        self.latencies_us.sort_unstable();
        let calls = self.latencies_us.len() as u64 + self.unanswered;
        let seconds = elapsed.as_secs_f64();
        let line = serde_json::json!({
            "requests": calls,
            "errors": self.errors,
            "seconds": seconds,
            "rps": calls as f64 / seconds,
            "p50_ms": self.percentile_ms(50),
            "p99_ms": self.percentile_ms(99),
            "first_error": self.first_error,
        });
        println!("{line}");
        if self.errors > 0 {
            bail!("{} of {calls} calls failed", self.errors);
        }
        Ok(())
    }

    /// The `p`th percentile of the sorted latencies, as bench/run reads pgbench's.
    fn percentile_ms(&self, p: usize) -> f64 {
        let sorted = &self.latencies_us;
        let at = (sorted.len() * p / 100).min(sorted.len().saturating_sub(1));
        sorted.get(at).map_or(0.0, |&us| f64::from(us) / 1000.0)
    }
}
