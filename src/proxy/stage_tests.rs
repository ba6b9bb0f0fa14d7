#![cfg(test)]
//! What the stages' unit tests share: the claim and execute stages built from a configuration over a
//! stub store (`store/stub.rs`), a keyed request to hand them, and a small upstream on a real socket
//! whose answer waits on the (paused) tokio clock.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::answer::{Answer, Handled};
use super::attach::Attachments;
use super::budget::{BodyBudget, ReservedBody};
use super::cache::ReplayCache;
use super::claim::{Claims, ClaimsParts};
use super::dialect::Dialect;
use super::downstream::{Downstream, Peer};
use super::execute::{Executor, ExecutorParts};
use super::intake::Ticket;
use super::keyed::KeyedTask;
use super::passthrough::Forward;
use super::permit::KeyedPermits;
use super::settle::Settle;
use super::upstream::Upstream;
use super::wait::Waits;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::stub::StubStore;
use crate::store::wake::Waiters;
use crate::store::{ClaimRequest, RecordId};

/// The claim stage and the execute stage it hands won claims to, over one stub store.
pub(crate) struct Stages {
    pub(crate) config: Config,
    pub(crate) claims: Claims,
    pub(crate) executor: Executor,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) metrics: Metrics,
    pub(crate) permits: KeyedPermits,
    pub(crate) tracker: TaskTracker,
    pub(crate) waiters: Arc<Waiters>,
    attachments: Arc<Attachments>,
    pub(crate) settle: Settle,
}

impl Stages {
    /// The keyed task over these stages, its waits ended by `shutdown`.
    pub(crate) fn keyed(&self, shutdown: CancellationToken) -> Arc<KeyedTask> {
        let (cache, metrics) = (self.cache.clone(), self.metrics.clone());
        let seats = Arc::new(tokio::sync::Semaphore::new(self.config.server.max_waiting));
        let waits = Waits::new(seats, cache, self.attachments.clone(), metrics, shutdown);
        Arc::new(KeyedTask::new(self.claims.clone(), waits, self.settle.clone()))
    }
}

/// The stages as `toml` configures them (the default route is keyed), over `store`.
pub(crate) fn stages(toml: &str, store: &Arc<StubStore>) -> Stages {
    let config = Config::from_toml_str(toml).expect("a valid test configuration");
    let metrics = Metrics::new();
    let handle = store.handle(&metrics);
    let tracker = TaskTracker::new();
    let cache = Arc::new(ReplayCache::new(1 << 20, Duration::from_secs(60)));
    let waiters = Waiters::new();
    let settle = Settle::new(waiters.clone(), handle.clone(), false);
    let upstream = Upstream::new(&config.upstream, metrics.clone());
    let attachments = Attachments::new(
        config.server.attach_buffer,
        config.server.write_timeout,
        waiters.clone(),
        metrics.clone(),
    );
    let executor = Executor::new(
        &config,
        ExecutorParts {
            store: handle.clone(),
            upstream: upstream.clone(),
            cache: cache.clone(),
            metrics: metrics.clone(),
            attachments: attachments.clone(),
            captures: Arc::new(super::execute::capture::CaptureBudget::new(
                config.server.max_buffered_responses,
                config.server.max_buffered_responses_per_scope,
                config.server.capture_wait,
                metrics.clone(),
            )),
        },
    );
    let permits = KeyedPermits::new(4);
    let claims = Claims::new(
        &config,
        ClaimsParts {
            store: handle,
            cache: cache.clone(),
            permits: permits.clone(),
            waiters: waiters.clone(),
            metrics: metrics.clone(),
            executor: executor.clone(),
            forward: Forward::new(
                &config,
                upstream,
                metrics.clone(),
                super::trailers::TrailerRules::new(&config),
            ),
        },
    );
    Stages {
        config,
        claims,
        executor,
        cache,
        metrics,
        permits,
        tracker,
        waiters,
        attachments,
        settle,
    }
}

/// A client connection allowed a few keyed requests at once.
pub(crate) fn peer() -> Downstream {
    Downstream::new(Peer::Tcp("127.0.0.1:40000".parse().unwrap()), false, 4, None)
}

/// Where a keyed request's answer goes, and where the test reads it.
pub(crate) fn answer(metrics: &Metrics) -> (Answer, oneshot::Receiver<Handled>) {
    let routes = metrics.routes(std::iter::empty(), "default");
    Answer::new(routes.get("default").clone())
}

/// A `POST /payments` with key `k` on the default route, its body read, as intake hands it on.
pub(crate) async fn ticket(stages: &Stages) -> Ticket {
    let route = stages.config.routes.default.clone();
    let (parts, ()) = Request::post("/payments")
        .header("idempotency-key", "k")
        .body(())
        .unwrap()
        .into_parts();
    let bytes = Bytes::from_static(b"{\"amount\":1000}");
    let budget = BodyBudget::new(1 << 20, stages.metrics.clone());
    let reservation = budget
        .reserve(bytes.len(), Duration::from_secs(1))
        .await
        .expect("room in an empty budget");
    let claim = ClaimRequest {
        id: RecordId {
            scope: "default:s".into(),
            key: "k".into(),
            token: Uuid::new_v4(),
        },
        fingerprint: [7; 32],
        lease: route.policy.claim.lock_timeout,
        ttl: route.policy.claim.ttl,
    };
    Ticket {
        route,
        claim,
        dialect: Dialect::Http,
        peer: peer(),
        parts,
        body: ReservedBody::new(bytes, reservation),
    }
}

/// An upstream on a real socket that answers every request `201` with `done` after `delay` by the
/// tokio clock, and notes when each request arrived.
pub(crate) struct SlowUpstream {
    pub(crate) addr: SocketAddr,
    arrivals: Arc<Mutex<Vec<Instant>>>,
}

impl SlowUpstream {
    pub(crate) async fn start(delay: Duration) -> SlowUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let noted = arrivals.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let noted = noted.clone();
                let service = service_fn(move |request: Request<Incoming>| {
                    noted.lock().unwrap().push(Instant::now());
                    async move {
                        let _ = request.into_body().collect().await;
                        tokio::time::sleep(delay).await;
                        let response = Response::builder()
                            .status(201)
                            .body(Full::new(Bytes::from_static(b"done")))
                            .unwrap();
                        Ok::<_, Infallible>(response)
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        SlowUpstream { addr, arrivals }
    }

    /// When each request arrived.
    pub(crate) fn arrivals(&self) -> Vec<Instant> {
        self.arrivals.lock().unwrap().clone()
    }
}
