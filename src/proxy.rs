//! The request path, for every request on the proxy listener. [`Proxy::handle`] never fails: it counts,
//! logs and turns any [`ProxyError`] into a problem response. [`Proxy::handle_inner`] is the lifecycle in
//! order: the path in its one spelling (`proxy/path.rs`) → route by path and method → key → body (and
//! its signature) → scope and fingerprint → claim → decision → replay or execute, or, on a route with
//! `on_in_flight = "wait"` whose key is in flight, wait (`proxy/wait.rs`) and decide again.
//! `handle` also reads the caller's trace context onto the request's span (`proxy/trace_context.rs`) and,
//! with `log.access` on, opens the request's access line (`access.rs`) and hands it the answer.

pub mod cache;
pub mod claim;
pub mod execute;
pub mod expiry;
pub mod intake;
pub mod key;
pub mod passthrough;
pub mod path;
pub mod replay;
pub mod signature;
pub mod trace_context;
pub mod upstream;
pub mod wait;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use self::cache::{Lookup, ReplayCache};
use self::execute::capture::CaptureBudget;
use self::intake::budget::BodyBudget;
use self::intake::examine::Examiners;
use self::upstream::{Downstream, Upstream};
use crate::access::{self, Line};
use crate::body::ProxyBody;
use crate::config::{Config, OnStoreError, PathRules, Route, RouteTable};
use crate::error::{Busy, ProxyError};
use crate::metrics::{Metrics, Outcome, RouteSeries, RouteSet};
use crate::otlp;
use crate::store::notify::Waiters;
use crate::store::{Capabilities, ClaimRequest, StoreHandle};

/// Everything a request needs; shared behind an `Arc` by every connection and forwarding task of a worker.
#[derive(Clone)]
pub struct Proxy {
    /// The routes and their policies; every request takes one.
    pub(crate) routes: Arc<RouteTable>,
    /// How every request's path is brought to its one spelling before it is routed (`server.paths`).
    pub(crate) paths: PathRules,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store: StoreHandle,
    pub(crate) upstream: Upstream,
    pub(crate) metrics: Metrics,
    /// Each route's request counters and duration histogram, resolved at start.
    pub(crate) route_series: Arc<RouteSet>,
    pub(crate) tracker: TaskTracker,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) body_read_timeout: Duration,
    pub(crate) budget: BodyBudget,
    /// Examinations of large keyed bodies (JSON keys and fingerprints) off the workers, one per CPU.
    pub(crate) examiners: Examiners,
    /// Bytes of keyed responses being captured for storage, and each scope's share, shared by every
    /// worker.
    pub(crate) captures: Arc<CaptureBudget>,
    /// One permit per keyed request being executed (`server.max_keyed_in_flight`), shared by every worker.
    pub(crate) keyed_slots: Arc<Semaphore>,
    /// How many of those one client connection may hold (`server.max_keyed_per_connection`).
    pub(crate) keyed_per_connection: usize,
    /// Longest a client waits for its record to be stored before it gets the end of its response.
    pub(crate) completion_hold: Duration,
    /// Longest a client may accept no bytes of a keyed response.
    pub(crate) write_timeout: Duration,
    /// Bound on one store operation, the first wait before an orphaned claim is given back.
    pub(crate) store_timeout: Duration,
    /// Whether each request writes an access line (`log.access`).
    pub(crate) access_log: bool,
    /// Whether requests are traced (`traces.enabled`, `otlp.rs`): off, no span beyond the log's is made.
    pub(crate) traced: bool,
    /// What every problem `type` URI starts with (`server.problem_type_base`).
    pub(crate) problem_base: Arc<str>,
    /// The requests waiting for a key in flight, by record; shared by every worker (and the listener).
    pub(crate) waiters: Arc<Waiters>,
    /// One permit per request waiting for a key in flight (`server.max_waiting`), shared by every worker.
    pub(crate) waiting: Arc<Semaphore>,
    /// Whether settlements on wait routes are announced to other processes through the store (only a
    /// store that several replicas share has any).
    pub(crate) announce: bool,
    /// Cancelled when the proxy begins shutting down; waiting requests are answered then.
    pub(crate) shutdown: CancellationToken,
}

/// The longest a client waits for its record to be stored (or less, `store.timeout`).
const COMPLETION_HOLD_MAX: Duration = Duration::from_secs(2);

type Handled = Result<(Response<ProxyBody>, Outcome), ProxyError>;

impl Proxy {
    /// Assembles the request path; `tracker` owns the forwarding tasks so shutdown can wait for them,
    /// `waiters` is where waiting requests are woken, and `shutdown` ends their waits.
    pub fn new(
        config: &Config,
        store: StoreHandle,
        metrics: Metrics,
        tracker: TaskTracker,
        waiters: Arc<Waiters>,
        shutdown: CancellationToken,
    ) -> Proxy {
        let server = &config.server;
        let captures = Arc::new(CaptureBudget::new(
            server.max_buffered_responses,
            server.max_buffered_responses_per_scope,
            server.capture_wait,
            metrics.clone(),
        ));
        Proxy {
            routes: Arc::new(config.routes.clone()),
            paths: config.server.paths,
            on_store_error: config.store.on_error,
            store,
            upstream: Upstream::new(&config.upstream, metrics.clone()).traced(otlp::traced(&config.traces)),
            budget: BodyBudget::new(config.server.max_buffered_bodies, metrics.clone()),
            examiners: Examiners::per_cpu(),
            route_series: Arc::new(metrics.routes(
                config.routes.routes.iter().map(|route| route.name.as_str()),
                &config.routes.default.name,
            )),
            metrics,
            tracker,
            cache: Arc::new(ReplayCache::new(
                config.replay_cache.max_size,
                config.replay_cache.max_age,
            )),
            body_read_timeout: config.server.body_read_timeout,
            captures,
            keyed_slots: Arc::new(Semaphore::new(config.server.max_keyed_in_flight)),
            keyed_per_connection: config.server.max_keyed_per_connection,
            completion_hold: config.store.timeout.min(COMPLETION_HOLD_MAX),
            write_timeout: config.server.write_timeout,
            store_timeout: config.store.timeout,
            access_log: config.log.access,
            traced: otlp::traced(&config.traces),
            problem_base: config.server.problem_type_base.as_str().into(),
            waiters,
            waiting: Arc::new(Semaphore::new(config.server.max_waiting)),
            announce: Capabilities::of(&config.store).shared,
            shutdown,
        }
    }

    /// The same request path for another worker thread: everything shared but the pool of upstream
    /// connections, which stays with the thread that uses it.
    pub fn for_worker(&self) -> Proxy {
        Proxy {
            upstream: self.upstream.with_own_pool(),
            ..self.clone()
        }
    }

    /// Answers one request. Never fails.
    pub async fn handle(
        self: Arc<Self>,
        mut request: Request<Incoming>,
        peer: Downstream,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let arrived = Instant::now();
        let _in_flight = InFlight::enter(&self.metrics);
        // Before anything reads the path: the access line records the path that is routed.
        let normal = path::normalise(&mut request, &self.paths);
        let span = tracing::info_span!(
            "request",
            method = %request.method(),
            route = tracing::field::Empty,
            outcome = tracing::field::Empty,
            trace_id = tracing::field::Empty,
            parent_id = tracing::field::Empty,
            otel.kind = tracing::field::Empty,
            otel.name = tracing::field::Empty,
        );
        let line = self.open_line(&request, &span);
        // A refused path is counted under the default route, as a path no route matches is.
        let route = match normal {
            Ok(()) => self.routes.select(request.method(), request.uri().path()),
            Err(_) => &self.routes.default,
        }
        .clone();
        otlp::adopt(&span, self.traced, &request, &route.name);
        let series = self.route_series.get(&route.name);
        let inner = access::within(
            line.as_ref().map(Line::ledger),
            self.handle_inner(request, peer, normal, route),
        );
        let result = if span.is_disabled() {
            inner.await
        } else {
            inner.instrument(span.clone()).await
        };
        let _entered = span.enter();
        let (response, outcome) = match result {
            Ok(answered) => answered,
            Err(error) => {
                if error.status().is_server_error() {
                    tracing::warn!(%error, status = error.status().as_u16(), "request failed");
                } else {
                    tracing::debug!(%error, "request refused");
                }
                if let ProxyError::Busy(what) = &error {
                    self.metrics.busy(*what);
                }
                let outcome = error.outcome();
                (error.into_problem(&self.problem_base), outcome)
            }
        };
        span.record("outcome", outcome.as_str());
        otlp::answered(&span, self.traced, response.status());
        let elapsed = arrived.elapsed();
        series.answered(outcome, elapsed);
        tracing::debug!(
            status = response.status().as_u16(),
            elapsed_ms = elapsed.as_secs_f64() * 1000.0,
            "answered"
        );
        Ok(match line {
            Some(line) => line.answered(outcome, response),
            None => response,
        })
    }

    /// Puts the caller's trace context on the request's span, and opens its access line while the access
    /// log is on. With the span disabled and the log off, does nothing.
    fn open_line(&self, request: &Request<Incoming>, span: &tracing::Span) -> Option<Line> {
        if span.is_disabled() && !self.access_log {
            return None;
        }
        let trace = trace_context::parse(request.headers());
        if let Some(trace) = trace {
            span.record("trace_id", trace.trace_id);
            span.record("parent_id", trace.parent_id);
        }
        self.access_log
            .then(|| Line::open(request.method(), request.uri().path(), trace.map(|t| t.trace_id)))
    }

    /// The lifecycle after `normal`, the path's normalisation (`path::normalise`), which a refused path
    /// ends here, and `route`, the route `handle` selected by that path.
    async fn handle_inner(
        self: &Arc<Self>,
        mut request: Request<Incoming>,
        peer: Downstream,
        normal: Result<(), ProxyError>,
        route: Arc<Route>,
    ) -> Handled {
        normal?;
        // CONNECT would make the proxy a tunnel (a 2xx from the upstream turns the client's connection
        // into raw bytes) and TRACE echoes the request, credentials included: neither is forwarded.
        let method = request.method();
        if method == http::Method::CONNECT || method == http::Method::TRACE {
            return Err(ProxyError::MethodNotAllowed(method.clone()));
        }
        tracing::Span::current().record("route", route.name.as_str());
        access::route(&route.name);
        path::respell(&mut request, &route)?;
        let method = request.method();
        if route.passthrough || !route.policy.methods.contains(method) {
            return self.passthrough(request, &peer).await;
        }
        let key = if route.policy.key.needs_body() {
            None
        } else {
            let Some(key) =
                key::source::from_head(&route.policy, request.method(), request.uri(), request.headers())?
            else {
                if route.policy.required {
                    return Err(ProxyError::MissingKey(key::source::describe(&route.policy.key)));
                }
                if route.policy.signature.is_some() {
                    // Verified before it goes anywhere: intake reads its body, then forwards it unkeyed.
                    return Box::pin(self.protected(request, route, None, peer)).await;
                }
                return self.passthrough(request, &peer).await;
            };
            Some(key)
        };
        // A keyed request's state is many times a passthrough's; on the heap it stays out of the future
        // every request carries and moves.
        Box::pin(self.protected(request, route, key, peer)).await
    }

    /// A request with a key: intake (scope, body, fingerprint), then the replay cache, or the claim on a
    /// task of its own, which answers through `head`.
    async fn protected(
        self: &Arc<Self>,
        request: Request<Incoming>,
        route: Arc<Route>,
        key: Option<String>,
        peer: Downstream,
    ) -> Handled {
        let intake = match self.intake(request, route, key, &peer).await? {
            Ok(intake) => intake,
            // Rare, and its forward is large: on the heap, it stays out of every keyed request's future.
            Err(unkeyed) => return Box::pin(unkeyed.forward(self, &peer)).await,
        };
        if let Some(answer) = self.answer_from_cache(&intake.claim, &intake.route) {
            return answer;
        }
        // Keyed work outlives its client on purpose; this bounds how much of it runs at once.
        let slot = self.keyed_slot(&peer).map_err(ProxyError::Busy)?;
        let (head, response) = oneshot::channel();
        let head = Answer {
            head,
            series: self.route_series.get(&intake.route.name).clone(),
        };
        let proxy = self.clone();
        let keyed = async move {
            if let Some(in_flight) = proxy.clone().claim(intake, peer, head, slot).await {
                // The wait (and the execution it may lead to) is as large as the claim's own future;
                // on the heap, only the requests that wait pay for it, and the task every keyed request
                // spawns stays the size of the claim alone.
                Box::pin(proxy.wait(in_flight)).await;
            }
        };
        let keyed = access::within(access::current(), keyed);
        self.tracker.spawn(keyed.instrument(tracing::Span::current()));
        response.await.unwrap_or_else(|_| {
            Err(ProxyError::UpstreamUnreachable(
                "the request's task ended without a response".into(),
            ))
        })
    }

    /// A slot for a keyed request's work, if its connection and the process both have one free.
    pub(crate) fn keyed_slot(&self, peer: &Downstream) -> Result<KeyedSlot, Busy> {
        let connection = peer.keyed_slot().ok_or(Busy::KeyedOnConnection)?;
        let Ok(process) = self.keyed_slots.clone().try_acquire_owned() else {
            return Err(Busy::KeyedInFlight);
        };
        Ok(KeyedSlot {
            _process: process,
            _connection: connection,
        })
    }

    /// A retry of a record this process has seen completed, answered without the store.
    fn answer_from_cache(&self, claim: &ClaimRequest, route: &Route) -> Option<Handled> {
        let answer = match self
            .cache
            .lookup(&claim.id.scope, &claim.id.key, &claim.fingerprint)
        {
            Lookup::Replay(stored, expires_at) => replay::response(&stored).map(|mut response| {
                expiry::stamp(response.headers_mut(), &route.policy, Some(expires_at));
                (response, Outcome::Replayed)
            }),
            Lookup::Mismatch => Err(ProxyError::KeyReused),
            Lookup::Miss => return None,
        };
        self.metrics.replay_cache_hits.inc();
        Some(answer)
    }
}

/// What a keyed request's work holds while it runs, detached from its client or not: one of the
/// process's `server.max_keyed_in_flight` slots and one of its connection's
/// `server.max_keyed_per_connection`.
pub(crate) struct KeyedSlot {
    _process: OwnedSemaphorePermit,
    _connection: OwnedSemaphorePermit,
}

/// Where a keyed request's answer goes. `handle` counts every outcome, unless the client hung up and took
/// `handle` with it; such answers are counted here instead, so executions are never missing from
/// `idemproxy_requests_total`.
pub(crate) struct Answer {
    head: oneshot::Sender<Handled>,
    series: Arc<RouteSeries>,
}

impl Answer {
    /// Hands the answer to the client; `false` when the client has gone.
    pub(crate) fn send(self, answer: Handled) -> bool {
        let outcome = match &answer {
            Ok((_, outcome)) => *outcome,
            Err(error) => error.outcome(),
        };
        let delivered = self.head.send(answer).is_ok();
        if !delivered {
            self.series.record(outcome);
        }
        delivered
    }

    /// Returns once the client has gone (its request's handler was dropped).
    pub(crate) async fn closed(&mut self) {
        self.head.closed().await;
    }
}

/// Keeps `idemproxy_in_flight_requests` up while a request is being answered.
struct InFlight<'a>(&'a Metrics);

impl<'a> InFlight<'a> {
    fn enter(metrics: &'a Metrics) -> InFlight<'a> {
        metrics.in_flight.inc();
        InFlight(metrics)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}
