//! gRPC services behind the proxy, driven by a real gRPC stack on both sides (tonic): the upstream is a
//! tonic server speaking only HTTP/2 (`upstream.protocol = "h2c"`, or `"auto"`, which sends gRPC requests
//! over h2c), the client a tonic channel. A call passes through with its message and its status (a
//! `grpc-status` in the trailers, or a trailers-only answer); a call with an `idempotency-key` executes
//! once and its retry gets the same message and status, replayed with the trailers stored beside it.

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

use crate::support::http::TEST_CREDENTIAL;
use crate::support::{InProcessProxy, ProxyConfig, TestEnv};

const CREATE_PAYMENT: &str = "/payments.Payments/CreatePayment";

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

/// The `payments.Payments` service: `CreatePayment` counts its executions and refuses an amount that is
/// not positive with INVALID_ARGUMENT.
#[derive(Clone, Default)]
struct Payments {
    executions: Arc<AtomicU64>,
}

impl Payments {
    fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
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
            if request.uri().path() != CREATE_PAYMENT {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Payment, CreatePayment>::default());
            Ok(grpc.unary(Create(payments), request).await)
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
        let executions = self.0.executions.clone();
        Box::pin(async move {
            let execution = executions.fetch_add(1, Ordering::SeqCst) + 1;
            let CreatePayment { customer, amount } = request.into_inner();
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

/// `payments` served by tonic's server side on 127.0.0.1:0, over HTTP/2 only (hyper's h2c server, as
/// tonic's own transport runs it); its URL.
async fn grpc_upstream(payments: Payments) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let payments = payments.clone();
            let service = hyper::service::service_fn(move |request: http::Request<Incoming>| {
                let mut payments = payments.clone();
                async move { payments.call(request.map(Body::new)).await }
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    url
}

/// A proxy in front of `upstream`, speaking `protocol` to it.
async fn proxy(env: &TestEnv, upstream: &str, protocol: &str) -> InProcessProxy {
    let config = ProxyConfig::new(&env.store.url(), upstream).set("upstream.protocol", protocol);
    InProcessProxy::start(&config).await
}

/// `CreatePayment` through the proxy at `url` from a tonic client, with the test credential and, if
/// given, an `idempotency-key`: the message and the response metadata, or the status.
async fn create(url: &str, key: Option<&str>, amount: i64) -> Result<(Payment, MetadataMap), Status> {
    let channel = Channel::from_shared(url.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut request = tonic::Request::new(CreatePayment {
        customer: "c_1".into(),
        amount,
    });
    let metadata = request.metadata_mut();
    metadata.insert("authorization", TEST_CREDENTIAL.parse().unwrap());
    if let Some(key) = key {
        metadata.insert("idempotency-key", key.parse().unwrap());
    }
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
    let env = TestEnv::new().await;
    let payments = Payments::default();
    let upstream = grpc_upstream(payments.clone()).await;
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
    let env = TestEnv::new().await;
    let payments = Payments::default();
    let upstream = grpc_upstream(payments.clone()).await;
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
