//! gRPC services behind the proxy, driven by a real gRPC stack on both sides (tonic): the upstream is a
//! tonic server speaking only HTTP/2 (`upstream.protocol = "h2c"`, or `"auto"`, which sends gRPC requests
//! over h2c), the client a tonic channel. A call passes through with its message and its status (a
//! `grpc-status` in the trailers, or a trailers-only answer); a call with an `idempotency-key` executes
//! once and its retry gets the same message and status, replayed with the trailers stored beside it; a
//! server-streaming call is replayed message for message. The status decides what is kept: UNAVAILABLE
//! (before or after messages) gives the key back and the retry executes; INTERNAL is an unknown outcome,
//! held under `on_unknown_outcome = "hold"`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use http::uri::PathAndQuery;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rstest::rstest;
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse::ListServicesResponse;

use crate::support::certs::{TestCa, toml_path};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::{InProcessProxy, ProxyConfig, TestEnv};

const CREATE_PAYMENT: &str = "/payments.Payments/CreatePayment";
const LIST_REFUNDS: &str = "/payments.Payments/ListRefunds";

#[derive(Clone, PartialEq, prost::Message)]
struct CreatePayment {
    #[prost(string, tag = "1")]
    customer: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Payment {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
    /// Which execution of the method made this payment: 1 for the first.
    #[prost(uint64, tag = "3")]
    execution: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ListRefunds {
    #[prost(string, tag = "1")]
    payment: String,
    #[prost(uint32, tag = "2")]
    count: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Refund {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(uint64, tag = "2")]
    execution: u64,
}

/// The `payments.Payments` service. Each method counts its executions. `CreatePayment` refuses an
/// amount that is not positive with INVALID_ARGUMENT; `ListRefunds` streams `count` refunds. The next
/// execution of either can be made to fail with a given code (`fail_next`): `CreatePayment` before any
/// message (a trailers-only answer), `ListRefunds` after its messages (the status in the trailers).
#[derive(Clone, Default)]
struct Payments {
    executions: Arc<AtomicU64>,
    fail_next: Arc<std::sync::Mutex<Option<Code>>>,
    /// A `CreatePayment` of [`GATED`] says it has started here, then waits for `release`.
    entered: Arc<tokio::sync::Notify>,
    release: Gate,
    /// Told when a gated call is dropped before it was let go (its caller reset the stream).
    abandoned: Arc<tokio::sync::Notify>,
}

/// Lets gated calls go on, one per permit given.
#[derive(Clone)]
struct Gate(Arc<tokio::sync::Semaphore>);

impl Default for Gate {
    fn default() -> Self {
        Gate(Arc::new(tokio::sync::Semaphore::new(0)))
    }
}

impl Gate {
    /// Lets `calls` gated calls go on, now or when they come.
    fn open(&self, calls: usize) {
        self.0.add_permits(calls);
    }

    async fn pass(&self) {
        self.0.acquire().await.unwrap().forget();
    }
}

/// Tells `abandoned` when dropped while armed.
struct Abandoned(Option<Arc<tokio::sync::Notify>>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        if let Some(abandoned) = self.0.take() {
            abandoned.notify_one();
        }
    }
}

/// The amount of a `CreatePayment` that runs until the test lets it go.
const GATED: i64 = 4242;
/// The amount of a `CreatePayment` whose stream the service resets after it started executing.
const RESET: i64 = 5005;

impl Payments {
    fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
    }

    fn fail_next(&self, code: Code) {
        *self.fail_next.lock().unwrap() = Some(code);
    }

    /// Counts an execution; its number, and the failure it is to end with, if one was set.
    fn execute(&self) -> (u64, Option<Status>) {
        let execution = self.executions.fetch_add(1, Ordering::SeqCst) + 1;
        let failure = self.fail_next.lock().unwrap().take();
        (
            execution,
            failure.map(|code| Status::new(code, format!("failed with {code:?} on purpose"))),
        )
    }
}

impl Service<http::Request<Body>> for Payments {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let payments = self.clone();
        Box::pin(async move {
            match request.uri().path() {
                CREATE_PAYMENT => {
                    let mut grpc = tonic::server::Grpc::new(ProstCodec::<Payment, CreatePayment>::default());
                    Ok(grpc.unary(Create(payments), request).await)
                }
                LIST_REFUNDS => {
                    let mut grpc = tonic::server::Grpc::new(ProstCodec::<Refund, ListRefunds>::default());
                    Ok(grpc.server_streaming(List(payments), request).await)
                }
                _ => Ok(Status::unimplemented("no such method").into_http()),
            }
        })
    }
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "payments.Payments";
}

struct Create(Payments);

impl tonic::server::UnaryService<CreatePayment> for Create {
    type Response = Payment;
    type Future = BoxFuture<tonic::Response<Payment>, Status>;

    fn call(&mut self, request: tonic::Request<CreatePayment>) -> Self::Future {
        let (execution, failure) = self.0.execute();
        let (entered, release) = (self.0.entered.clone(), self.0.release.clone());
        let abandoned = self.0.abandoned.clone();
        Box::pin(async move {
            if let Some(failure) = failure {
                return Err(failure);
            }
            let CreatePayment { customer, amount } = request.into_inner();
            if amount == RESET {
                // hyper's server resets the stream of a call whose handler panics.
                panic!("the service fails mid-call");
            }
            if amount == GATED {
                let mut guard = Abandoned(Some(abandoned));
                entered.notify_one();
                release.pass().await;
                guard.0 = None;
            }
            if amount <= 0 {
                return Err(Status::invalid_argument(format!(
                    "amount {amount} is not positive"
                )));
            }
            Ok(tonic::Response::new(Payment {
                id: format!("pay_{customer}"),
                amount,
                execution,
            }))
        })
    }
}

struct List(Payments);

type Refunds = futures_util::stream::Iter<std::vec::IntoIter<Result<Refund, Status>>>;

impl tonic::server::ServerStreamingService<ListRefunds> for List {
    type Response = Refund;
    type ResponseStream = Refunds;
    type Future = BoxFuture<tonic::Response<Refunds>, Status>;

    fn call(&mut self, request: tonic::Request<ListRefunds>) -> Self::Future {
        let (execution, failure) = self.0.execute();
        let ListRefunds { payment, count } = request.into_inner();
        let mut items: Vec<_> = (1..=count)
            .map(|n| {
                Ok(Refund {
                    id: format!("{payment}_refund_{n}"),
                    execution,
                })
            })
            .collect();
        items.extend(failure.map(Err));
        Box::pin(async move { Ok(tonic::Response::new(futures_util::stream::iter(items))) })
    }
}

/// `payments` served by tonic's server side on 127.0.0.1:0, over HTTP/2 only (hyper's h2c server, as
/// tonic's own transport runs it); its URL.
async fn grpc_upstream(payments: Payments) -> String {
    grpc_upstream_taking(payments, HYPER_MAX_STREAMS).await
}

/// The concurrent streams hyper's HTTP/2 server allows on a connection unless told otherwise.
const HYPER_MAX_STREAMS: u32 = 200;

/// [`grpc_upstream`], allowing `max_streams` concurrent streams on each connection.
async fn grpc_upstream_taking(payments: Payments, max_streams: u32) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // The standard health service beside it, reporting it serving, and server reflection describing it.
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<Payments>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .unwrap();
    tokio::spawn(async move {
        let _reporter = reporter;
        while let Ok((stream, _)) = listener.accept().await {
            let (payments, health, reflection) = (payments.clone(), health.clone(), reflection.clone());
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let (mut payments, mut health) = (payments.clone(), health.clone());
                let mut reflection = reflection.clone();
                async move {
                    let request = request.map(Body::new);
                    let path = request.uri().path();
                    if path.starts_with("/grpc.health.v1.Health/") {
                        return health.call(request).await;
                    }
                    if path.starts_with("/grpc.reflection.v1.ServerReflection/") {
                        return reflection.call(request).await;
                    }
                    payments.call(request).await
                }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .max_concurrent_streams(max_streams)
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    url
}

/// `payments` over TLS with ALPN `h2` only, with a certificate `ca` issued for 127.0.0.1; its URL.
async fn grpc_upstream_over_tls(payments: Payments, ca: &TestCa) -> String {
    let mut tls = (*ca.issue("upstream", &["127.0.0.1"]).server_config(None)).clone();
    tls.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (payments, acceptor) = (payments.clone(), acceptor.clone());
            tokio::spawn(async move {
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                    let mut payments = payments.clone();
                    async move { payments.call(request.map(Body::new)).await }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

/// A store, and `payments` served over h2c: the store, the service, and its URL.
async fn service() -> (TestEnv, Payments, String) {
    let env = TestEnv::new().await;
    let payments = Payments::default();
    let upstream = grpc_upstream(payments.clone()).await;
    (env, payments, upstream)
}

/// A proxy in front of `upstream`, speaking `protocol` to it.
async fn proxy(env: &TestEnv, upstream: &str, protocol: &str) -> InProcessProxy {
    InProcessProxy::start(&config(env, upstream, protocol)).await
}

/// The proxy's config: the README's gRPC example as written (its route, and its `[upstream]` but for the
/// protocol, which is `protocol`).
fn config(env: &TestEnv, upstream: &str, protocol: &str) -> ProxyConfig {
    ProxyConfig::new(&env.store.url(), upstream)
        .with_toml(&readme_grpc_example())
        .set("upstream.protocol", protocol)
}

/// The TOML block of the README's "gRPC services" section.
fn readme_grpc_example() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme
        .find("## gRPC services")
        .expect("the README's gRPC section")..];
    let block = &section[section.find("```toml\n").expect("its TOML block") + "```toml\n".len()..];
    block[..block.find("```").unwrap()].to_owned()
}

/// A tonic client of the proxy at `url`, and a request carrying the test credential and `key`.
async fn client<M>(
    url: &str,
    key: Option<&str>,
    message: M,
) -> (tonic::client::Grpc<Channel>, tonic::Request<M>) {
    let (grpc, mut request) = anonymous_client(url, key, message).await;
    let credential = TEST_CREDENTIAL.parse().unwrap();
    request.metadata_mut().insert("authorization", credential);
    (grpc, request)
}

/// [`client`] without a credential.
async fn anonymous_client<M>(
    url: &str,
    key: Option<&str>,
    message: M,
) -> (tonic::client::Grpc<Channel>, tonic::Request<M>) {
    let channel = Channel::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    (grpc, request)
}

/// `CreatePayment` through the proxy at `url` from a tonic client, with the test credential and, if
/// given, an `idempotency-key`: the message and the response metadata, or the status.
async fn create(url: &str, key: Option<&str>, amount: i64) -> Result<(Payment, MetadataMap), Status> {
    let message = CreatePayment {
        customer: "c_1".into(),
        amount,
    };
    let (grpc, request) = client(url, key, message).await;
    send_create(grpc, request).await
}

/// Sends `request`, a prepared `CreatePayment`, on `grpc`: the message and the response metadata, or
/// the status.
async fn send_create(
    mut grpc: tonic::client::Grpc<Channel>,
    request: tonic::Request<CreatePayment>,
) -> Result<(Payment, MetadataMap), Status> {
    let codec = ProstCodec::<CreatePayment, Payment>::default();
    let response = grpc
        .unary(request, PathAndQuery::from_static(CREATE_PAYMENT), codec)
        .await?;
    let (metadata, payment, _) = response.into_parts();
    Ok((payment, metadata))
}

#[rstest]
#[tokio::test]
async fn a_call_without_a_key_passes_through_with_its_message_and_status(
    #[values("h2c", "auto")] protocol: &str,
) {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, protocol).await;

    let (payment, metadata) = create(&proxy.url, None, 1200).await.expect("the call succeeds");
    assert_eq!(payment.id, "pay_c_1");
    assert_eq!(payment.amount, 1200);
    assert!(metadata.get("idempotent-replayed").is_none());

    // A status other than OK comes from the upstream as a trailers-only answer, and reaches the client.
    let refused = create(&proxy.url, None, -5)
        .await
        .expect_err("the upstream refuses it");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_eq!(refused.message(), "amount -5 is not positive");
    assert_eq!(payments.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn a_call_with_a_key_executes_once_and_its_retry_gets_the_same_message_and_status(
    #[values("h2c", "auto")] protocol: &str,
) {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, protocol).await;

    let (first, metadata) = create(&proxy.url, Some("grpc-pay-1"), 700)
        .await
        .expect("first call");
    assert_eq!(first.execution, 1);
    assert!(metadata.get("idempotent-replayed").is_none());
    // The retry is sent the moment the first answer is read, on a new connection.
    let (retry, metadata) = create(&proxy.url, Some("grpc-pay-1"), 700).await.expect("retry");
    assert_eq!(retry, first, "the same message, from the first execution");
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(payments.executions(), 1, "the retry did not run the method");

    // A deterministic error is stored too, and its retry gets the same status without running again.
    let refused = create(&proxy.url, Some("grpc-pay-2"), 0)
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    let again = create(&proxy.url, Some("grpc-pay-2"), 0)
        .await
        .expect_err("refused again");
    assert_eq!(
        (again.code(), again.message()),
        (refused.code(), refused.message())
    );
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(payments.executions(), 2);
}

/// `ListRefunds` through the proxy at `url` with `key`: every message the stream brought until its
/// status, the status (OK or not), and whether the answer said it was replayed.
async fn list(url: &str, key: &str, count: u32) -> (Vec<Refund>, Status, bool) {
    let message = ListRefunds {
        payment: "pay_1".into(),
        count,
    };
    let (mut grpc, request) = client(url, Some(key), message).await;
    let codec = ProstCodec::<ListRefunds, Refund>::default();
    let response = match grpc
        .server_streaming(request, PathAndQuery::from_static(LIST_REFUNDS), codec)
        .await
    {
        Ok(response) => response,
        Err(status) => return (Vec::new(), status, false),
    };
    let replayed = response.metadata().get("idempotent-replayed").is_some();
    let mut stream = response.into_inner();
    let mut refunds = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(refund)) => refunds.push(refund),
            Ok(None) => return (refunds, Status::ok(""), replayed),
            Err(status) => return (refunds, status, replayed),
        }
    }
}

#[tokio::test]
async fn with_protocol_auto_an_https_upstream_that_agrees_to_h2_gets_grpc_calls_over_it() {
    let env = TestEnv::new().await;
    let ca = TestCa::new("upstream CA");
    let payments = Payments::default();
    let upstream = grpc_upstream_over_tls(payments.clone(), &ca).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let mut tls = toml::Table::new();
    tls.insert("ca_file".into(), toml_path(&ca_file).into());
    let proxy = InProcessProxy::start(&config(&env, &upstream, "auto").set("upstream.tls", tls)).await;

    let (first, _) = create(&proxy.url, Some("tls-1"), 900)
        .await
        .expect("over h2 and TLS");
    let (retry, metadata) = create(&proxy.url, Some("tls-1"), 900).await.expect("replayed");
    assert_eq!(retry, first);
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    let (other, _) = create(&proxy.url, None, 5).await.expect("a passthrough call");
    assert_eq!(other.execution, 2);
    assert_eq!(payments.executions(), 2);
}

#[tokio::test]
async fn a_server_streaming_call_is_replayed_message_for_message() {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, "h2c").await;

    let (first, status, replayed) = list(&proxy.url, "refunds-1", 3).await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    assert!(!replayed);
    assert_eq!(first.len(), 3);
    let (again, status, replayed) = list(&proxy.url, "refunds-1", 3).await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    assert!(replayed);
    assert_eq!(again, first, "the same messages, from the first execution");
    assert_eq!(payments.executions(), 1);
}

#[tokio::test]
async fn a_stream_longer_than_max_stored_response_reaches_its_client_whole_and_its_retry_is_already_exists() {
    let (env, payments, upstream) = service().await;
    let config = config(&env, &upstream, "h2c").set("idempotency.max_stored_response", "1KiB");
    let proxy = InProcessProxy::start(&config).await;

    // 100 refunds are about 3 KiB of messages: all of them reach the client that asked.
    let (first, status, _) = list(&proxy.url, "long-1", 100).await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    assert_eq!(first.len(), 100);
    // The retry is told the call ran and its answer was not kept, as a gRPC status, and runs nothing.
    let (again, status, _) = list(&proxy.url, "long-1", 100).await;
    assert!(again.is_empty());
    assert_eq!(status.code(), Code::AlreadyExists, "{status:?}");
    assert_problem(&status, "response-not-retained");
    assert_eq!(payments.executions(), 1);
}

#[tokio::test]
async fn unavailable_before_or_after_the_messages_gives_the_key_back_and_the_retry_executes() {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, "h2c").await;

    // A trailers-only answer: the status comes in the head.
    payments.fail_next(Code::Unavailable);
    let refused = create(&proxy.url, Some("unavailable-1"), 300)
        .await
        .expect_err("unavailable");
    assert_eq!(refused.code(), Code::Unavailable);
    let (payment, metadata) = create(&proxy.url, Some("unavailable-1"), 300)
        .await
        .expect("the retry runs");
    assert_eq!(payment.execution, 2);
    assert!(metadata.get("idempotent-replayed").is_none());

    // The status in the trailers, after messages the client has already read.
    payments.fail_next(Code::Unavailable);
    let (refunds, status, _) = list(&proxy.url, "unavailable-2", 2).await;
    assert_eq!((refunds.len(), status.code()), (2, Code::Unavailable));
    let (refunds, status, replayed) = list(&proxy.url, "unavailable-2", 2).await;
    assert_eq!((refunds.len(), status.code(), replayed), (2, Code::Ok, false));
    assert_eq!(refunds[0].execution, 4, "the retry ran the method again");
    // Each call is counted by the status its client got.
    for (code, calls) in [("UNAVAILABLE", 2.0), ("OK", 2.0)] {
        let labels = [("route", "payments"), ("code", code)];
        let counted = crate::support::metric(&proxy.admin_url, "idemproxy_grpc_calls_total", &labels).await;
        assert_eq!(counted, calls, "{code}");
    }
}

#[tokio::test]
async fn an_unknown_outcome_status_is_relayed_and_holds_the_key_under_hold() {
    let (env, payments, upstream) = service().await;
    let config = config(&env, &upstream, "h2c").set("idempotency.on_unknown_outcome", "hold");
    let proxy = InProcessProxy::start(&config).await;

    payments.fail_next(Code::Internal);
    let failed = create(&proxy.url, Some("internal-1"), 300)
        .await
        .expect_err("internal");
    assert_eq!(
        failed.code(),
        Code::Internal,
        "the client gets the upstream's own status"
    );
    assert_eq!(failed.message(), "failed with Internal on purpose");
    // The key is held: the retry neither runs the method again nor gets INTERNAL replayed as a result.
    let retry = create(&proxy.url, Some("internal-1"), 300)
        .await
        .expect_err("held");
    assert_held(&retry, &failed);
    payments.fail_next(Code::Internal);
    let (refunds, status, _) = list(&proxy.url, "internal-2", 1).await;
    assert_eq!((refunds.len(), status.code()), (1, Code::Internal));
    let (_, retry, _) = list(&proxy.url, "internal-2", 1).await;
    assert_held(&retry, &failed);
    assert_eq!(payments.executions(), 2, "neither retry executed");
}

/// `retry` is the proxy's refusal of a held key, not the upstream's `failed` replayed.
fn assert_held(retry: &Status, failed: &Status) {
    assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
    assert_problem(retry, "outcome-unknown");
    assert_ne!(retry.message(), failed.message(), "{retry:?}");
    assert!(retry.metadata().get("idempotent-replayed").is_none(), "{retry:?}");
}

/// `status` is the proxy's own answer, of problem type `slug`.
fn assert_problem(status: &Status, slug: &str) {
    let problem = status
        .metadata()
        .get("idemproxy-problem")
        .map(|v| v.to_str().unwrap().to_owned());
    assert_eq!(
        problem,
        Some(format!("https://idemproxy.dev/problems/{slug}")),
        "{status:?}"
    );
    // Where the operation stands, as a problem body would say (docs/contract.md, Problem types).
    let metadata = status.metadata();
    let state = metadata
        .get("idemproxy-operation-state")
        .map(|v| v.to_str().unwrap());
    assert!(
        matches!(
            state,
            Some("not_started" | "in_progress" | "completed" | "unknown")
        ),
        "{status:?}"
    );
    assert!(
        matches!(
            metadata.get("idemproxy-retryable").map(|v| v.to_str().unwrap()),
            Some("true" | "false")
        ),
        "{status:?}"
    );
    let safe_new_key = metadata
        .get("idemproxy-safe-new-key")
        .map(|v| v.to_str().unwrap());
    assert_eq!(
        safe_new_key,
        (state == Some("not_started")).then_some("true"),
        "{status:?}"
    );
}

#[tokio::test]
async fn the_proxys_own_refusals_are_grpc_statuses_the_client_reads() {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, "h2c").await;

    // A key without a credential to scope it.
    let message = CreatePayment {
        customer: "c_1".into(),
        amount: 10,
    };
    let (grpc, request) = anonymous_client(&proxy.url, Some("anon-1"), message).await;
    let refused = send_create(grpc, request).await.expect_err("no credential");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("credential"), "{refused:?}");
    assert_problem(&refused, "missing-scope");

    // The same key with another message.
    create(&proxy.url, Some("reused-1"), 10).await.expect("first use");
    let reused = create(&proxy.url, Some("reused-1"), 11)
        .await
        .expect_err("another message");
    assert_eq!(reused.code(), Code::InvalidArgument, "{reused:?}");
    assert!(reused.message().contains("different request"), "{reused:?}");
    assert_problem(&reused, "key-reused");

    // A duplicate while the first call runs: ABORTED, with when to try again.
    let entered = payments.entered.notified();
    let url = proxy.url.clone();
    let first = tokio::spawn(async move { create(&url, Some("in-flight-1"), GATED).await });
    entered.await;
    let duplicate = create(&proxy.url, Some("in-flight-1"), GATED)
        .await
        .expect_err("in flight");
    assert_eq!(duplicate.code(), Code::Aborted, "{duplicate:?}");
    assert_problem(&duplicate, "key-in-flight");
    let pushback = duplicate
        .metadata()
        .get("grpc-retry-pushback-ms")
        .expect("pushback");
    assert!(pushback.to_str().unwrap().parse::<u64>().unwrap() >= 1000);
    payments.release.open(1);
    let (original, _) = first.await.unwrap().expect("the original completes");
    let (retry, metadata) = create(&proxy.url, Some("in-flight-1"), GATED)
        .await
        .expect("replayed");
    assert_eq!(retry, original);
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(payments.executions(), 2, "reused-1 and in-flight-1 ran once each");
}

#[tokio::test]
async fn a_client_past_its_grpc_timeout_is_answered_and_the_call_goes_on_to_be_stored() {
    let (env, payments, upstream) = service().await;
    let proxy = proxy(&env, &upstream, "h2c").await;

    let message = CreatePayment {
        customer: "c_1".into(),
        amount: GATED,
    };
    let entered = payments.entered.notified();
    let (grpc, mut request) = client(&proxy.url, Some("deadline-1"), message).await;
    request.set_timeout(std::time::Duration::from_millis(300));
    let failed = send_create(grpc, request).await.expect_err("past its deadline");
    // tonic gives up at the deadline itself (CANCELLED), or reads the proxy's DEADLINE_EXCEEDED.
    assert!(
        matches!(failed.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{failed:?}"
    );
    entered.await;
    // The service runs the call under the proxy's deadline (upstream.timeout), not the client's: it
    // completes once released, and its result is stored for the retry.
    payments.release.open(1);
    crate::support::poll_until("the call was stored", || async {
        let replay = create(&proxy.url, Some("deadline-1"), GATED).await;
        replay
            .ok()
            .filter(|(_, metadata)| metadata.get("idempotent-replayed").is_some())
    })
    .await;
    assert_eq!(payments.executions(), 1, "executed once, never run again");
    assert!(
        futures_util::FutureExt::now_or_never(payments.abandoned.notified()).is_none(),
        "the service's call was never cancelled"
    );
}

#[tokio::test]
async fn in_wait_mode_a_duplicate_in_flight_gets_the_stored_answer() {
    let (env, payments, upstream) = service().await;
    let config = config(&env, &upstream, "h2c").set("idempotency.on_in_flight", "wait");
    let proxy = InProcessProxy::start(&config).await;

    let entered = payments.entered.notified();
    let url = proxy.url.clone();
    let first = tokio::spawn(async move { create(&url, Some("wait-1"), GATED).await });
    entered.await;
    let url = proxy.url.clone();
    let duplicate = tokio::spawn(async move { create(&url, Some("wait-1"), GATED).await });
    // The duplicate is waiting once the proxy counts it.
    crate::support::metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    payments.release.open(1);
    let (original, _) = first.await.unwrap().expect("the original completes");
    let (waited, metadata) = duplicate
        .await
        .unwrap()
        .expect("the duplicate gets the stored answer");
    assert_eq!(waited, original);
    assert_eq!(metadata.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(payments.executions(), 1);
}

/// `CreatePayment` of [`GATED`] with `key`, sent from a task of its own.
fn gated_call(url: &str, key: &str) -> tokio::task::JoinHandle<Result<(Payment, MetadataMap), Status>> {
    let (url, key) = (url.to_owned(), key.to_owned());
    tokio::spawn(async move { create(&url, Some(&key), GATED).await })
}

/// Waits until `payments` has started `n` executions.
async fn executing(payments: &Payments, n: u64) {
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while payments.executions() < n {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} of {n} calls reached the service", payments.executions()));
}

#[tokio::test]
async fn calls_beyond_an_upstream_connections_stream_limit_run_at_once_on_another() {
    let env = TestEnv::new().await;
    let payments = Payments::default();
    // The service allows two streams per connection, and the proxy is told so.
    let upstream = grpc_upstream_taking(payments.clone(), 2).await;
    let config = config(&env, &upstream, "h2c").set("upstream.max_concurrent_streams", 2);
    let proxy = InProcessProxy::start(&config).await;

    let calls: Vec<_> = (0..5)
        .map(|n| gated_call(&proxy.url, &format!("limit-{n}")))
        .collect();
    // All five execute at once: none waits for a stream of a full connection.
    executing(&payments, 5).await;
    payments.release.open(5);
    let mut seen = Vec::new();
    for call in calls {
        let (payment, metadata) = call.await.unwrap().expect("every call succeeds");
        assert!(metadata.get("idempotent-replayed").is_none());
        seen.push(payment.execution);
    }
    seen.sort_unstable();
    assert_eq!(seen, [1, 2, 3, 4, 5], "five executions, one per key");
}

#[tokio::test]
async fn at_the_upstream_connection_cap_a_call_with_no_stream_free_is_unavailable_and_its_retry_executes() {
    let (env, payments, upstream) = service().await;
    let config = config(&env, &upstream, "h2c")
        .set("server.workers", 1)
        .set("upstream.max_connections", 1)
        .set("upstream.max_concurrent_streams", 1)
        .set("upstream.connect_timeout", "300ms");
    let proxy = InProcessProxy::start(&config).await;

    let first = gated_call(&proxy.url, "cap-1");
    executing(&payments, 1).await;
    let busy = create(&proxy.url, Some("cap-2"), 300)
        .await
        .expect_err("no stream is free");
    assert_eq!(busy.code(), Code::Unavailable, "{busy:?}");
    assert_problem(&busy, "busy");
    assert!(
        busy.metadata().get("grpc-retry-pushback-ms").is_some(),
        "{busy:?}"
    );
    assert_eq!(
        payments.executions(),
        1,
        "the busy call never reached the service"
    );

    payments.release.open(1);
    first.await.unwrap().expect("the first call completes");
    // The key was given back: its retry executes.
    let (payment, metadata) = create(&proxy.url, Some("cap-2"), 300).await.expect("the retry");
    assert_eq!(payment.execution, 2);
    assert!(metadata.get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn health_checks_and_reflection_pass_through_on_a_route_that_requires_keys() {
    let (env, _, upstream) = service().await;
    let config = ProxyConfig::new(&env.store.url(), &upstream)
        .set("upstream.protocol", "h2c")
        .route("name = \"everything\"\npath_prefix = \"/\"\nrequired = true");
    let proxy = InProcessProxy::start(&config).await;

    let channel = Channel::from_shared(proxy.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "payments.Payments"] {
        let request = tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        };
        let answer = health
            .check(request)
            .await
            .expect("the health check passes through");
        assert_eq!(
            answer.into_inner().status(),
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service:?}"
        );
    }
    // Server reflection, as grpcurl and Postman use it: a bidirectional stream, without a key.
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);
    let ask = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(futures_util::stream::iter([ask]))
        .await
        .expect("reflection passes through")
        .into_inner();
    let answer = answers.message().await.unwrap().expect("an answer");
    let Some(ListServicesResponse(list)) = answer.message_response else {
        panic!("not a list of services: {answer:?}");
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"grpc.health.v1.Health".to_owned()), "{names:?}");
    // The route does require a key of every other call.
    let refused = create(&proxy.url, None, 10).await.expect_err("no key");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert_problem(&refused, "missing-key");
}

#[rstest]
#[tokio::test]
async fn a_call_whose_stream_the_service_resets_is_held_or_left_to_its_lease(
    #[values("hold", "retry")] policy: &str,
) {
    let (env, payments, upstream) = service().await;
    let config = config(&env, &upstream, "h2c")
        .set("idempotency.on_unknown_outcome", policy)
        .set("idempotency.lock_timeout", "1s");
    let proxy = InProcessProxy::start(&config).await;

    let failed = create(&proxy.url, Some("reset-1"), RESET)
        .await
        .expect_err("reset");
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert_problem(&failed, "upstream-unreachable");
    let retry = create(&proxy.url, Some("reset-1"), RESET)
        .await
        .expect_err("not run again yet");
    if policy == "hold" {
        assert_eq!(retry.code(), Code::FailedPrecondition, "{retry:?}");
        assert_problem(&retry, "outcome-unknown");
    } else {
        // Left to its lease: in flight until the lease has run out, then run again.
        assert_eq!(retry.code(), Code::Aborted, "{retry:?}");
        let again = crate::support::poll_until("the lease to run out", || async {
            let again = create(&proxy.url, Some("reset-1"), RESET)
                .await
                .expect_err("reset again");
            (again.code() != Code::Aborted).then_some(again)
        })
        .await;
        assert_eq!(again.code(), Code::Unavailable, "{again:?}");
    }
    let executions = if policy == "hold" { 1 } else { 2 };
    assert_eq!(payments.executions(), executions);
}

#[tokio::test]
async fn the_access_log_names_each_calls_method_and_grpc_status() {
    let (env, _, upstream) = service().await;
    let config = config(&env, &upstream, "h2c")
        .set("log.format", "json")
        .set("log.access", true);
    let proxy = crate::support::ProxyProcess::spawn(&config).await;

    create(&proxy.url, Some("logged-1"), 10).await.expect("executed");
    create(&proxy.url, Some("logged-1"), 10).await.expect("replayed");
    let refused = create(&proxy.url, Some("logged-2"), -1)
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    let reused = create(&proxy.url, Some("logged-1"), 11)
        .await
        .expect_err("reused");
    assert_eq!(reused.code(), Code::InvalidArgument);

    let lines = crate::support::poll_until("four access lines", || async {
        let lines: Vec<serde_json::Value> = proxy
            .stderr()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|event| event["target"] == "idemproxy::access")
            .collect();
        (lines.len() >= 4).then_some(lines)
    })
    .await;
    let seen: Vec<(&str, &str, Option<u64>)> = lines
        .iter()
        .map(|line| {
            (
                line["path"].as_str().unwrap(),
                line["outcome"].as_str().unwrap(),
                line["grpc_status"].as_u64(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (CREATE_PAYMENT, "executed", Some(0)),
            (CREATE_PAYMENT, "replayed", Some(0)),
            (CREATE_PAYMENT, "executed", Some(3)),
            (CREATE_PAYMENT, "mismatch", Some(3)),
        ]
    );
}
