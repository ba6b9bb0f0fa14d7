//! The request path, for every request on the proxy listener. [`Proxy::handle`] never fails: it counts,
//! logs and turns any [`ProxyError`] into a problem response. [`Proxy::handle_inner`] is the lifecycle in
//! order: the method and the path in their one spelling (`proxy/method.rs`, `proxy/path.rs`) → route by path and method → key → body (and
//! its signature) → scope and fingerprint → claim → decision → replay or execute, or, on a route with
//! `on_in_flight = "wait"` whose key is in flight, wait (`proxy/wait.rs`) and decide again: a keyed
//! request's whole work from its claim on is the keyed task's (`proxy/keyed.rs`). What the request's
//! protocol changes is asked of its dialect (`proxy/dialect.rs`), never decided here.
//! `handle` also reads the caller's trace context onto the request's span (`proxy/trace_context.rs`) and,
//! with `log.access` on, opens the request's access line (`access.rs`) and hands it the answer.

pub mod answer;
pub mod attach;
pub mod budget;
pub mod cache;
pub mod claim;
pub mod client_body;
pub mod dialect;
pub mod downstream;
pub mod execute;
pub mod expiry;
pub mod intake;
pub mod key;
pub mod keyed;
pub mod many;
pub mod method;
pub mod passthrough;
pub mod path;
pub mod permit;
pub mod replay;
pub mod settle;
pub mod signature;
pub mod tap;
pub mod trace_context;
pub mod trailers;
pub mod upstream;
pub mod wait;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use http::{Request, Response};
use hyper::body::Incoming;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use self::answer::{Answer, Handled};
use self::attach::Attachments;
use self::budget::BodyBudget;
use self::cache::ReplayCache;
use self::claim::{Claims, ClaimsParts};
use self::dialect::Dialect;
use self::downstream::Downstream;
use self::execute::capture::CaptureBudget;
use self::execute::{Executor, ExecutorParts};
use self::intake::examine::Examiners;
use self::intake::many::Many;
use self::intake::{Intake, Taken};
use self::keyed::KeyedTask;
use self::passthrough::Forward;
use self::permit::KeyedPermits;
use self::settle::Settle;
use self::trailers::TrailerRules;
use self::upstream::Upstream;
use self::wait::Waits;
use crate::access::{self, Line};
use crate::body::ProxyBody;
use crate::config::{Config, KeySource, PathRules, Route, RouteTable};
use crate::error::ProxyError;
use crate::jwks::KeySets;
use crate::metrics::{Metrics, Outcome, RouteSeries, RouteSet};
use crate::otlp;
use crate::store::Serving;
use crate::store::wake::Waiters;

/// The spine of the request path: it routes each request and composes the stages, each holding only
/// what it uses; shared behind an `Arc` by every connection of a worker.
pub struct Proxy {
    /// The routes and their policies; every request takes one.
    routes: Arc<RouteTable>,
    /// How every request's path is brought to its one spelling before it is routed (`server.paths`).
    paths: PathRules,
    pub(crate) metrics: Metrics,
    /// Each route's request counters and duration histogram, resolved at start.
    route_series: Arc<RouteSet>,
    /// Owns every keyed request's task, so shutdown can wait for them.
    pub(crate) tracker: TaskTracker,
    cache: Arc<ReplayCache>,
    /// The process's keyed permits (`server.max_keyed_in_flight`), shared by every worker.
    permits: KeyedPermits,
    /// How many of those one client connection may hold (`server.max_keyed_per_connection`).
    pub(crate) keyed_per_connection: usize,
    /// The TCP peers whose `X-Forwarded-For` names the client in the access log
    /// (`server.trusted_proxies`).
    pub(crate) trusted_proxies: Arc<[ipnet::IpNet]>,
    /// Whether each request writes an access line (`log.access`).
    access_log: bool,
    /// Whether requests are traced (`traces.enabled`, `otlp.rs`): off, no span beyond the log's is made.
    traced: bool,
    /// What every problem `type` URI starts with (`server.problem_type_base`).
    pub(crate) problem_base: Arc<str>,
    /// Takes keyed requests in: scope, body, signature, key, fingerprint.
    intake: Intake,
    /// Forwards what is not protected, over this worker's upstream connections.
    forward: Forward,
    /// A keyed request's task: its claim, its wait, its execution, its settlement.
    keyed: Arc<KeyedTask>,
}

/// What every generation of the request path is built over, made once at start: the store, the
/// metrics, the tasks shutdown waits for, the wake-ups, shutdown itself, and the process's budgets,
/// seats and permits (`server.max_buffered_bodies`, `server.max_waiting`, `server.max_keyed_in_flight`,
/// `server.max_buffered_responses`), the replay cache and the executions duplicates attach to. A
/// reload (`reload.rs`) builds a new [`Proxy`] from a new configuration over the same grounds, so a
/// bound is never counted twice, and a retry finds what a request of the older generation left.
#[derive(Clone)]
pub struct Grounds {
    serving: Serving,
    metrics: Metrics,
    tracker: TaskTracker,
    waiters: Arc<Waiters>,
    shutdown: CancellationToken,
    cache: Arc<ReplayCache>,
    permits: KeyedPermits,
    bodies: BodyBudget,
    examiners: Examiners,
    seats: Arc<Semaphore>,
    captures: Arc<CaptureBudget>,
    attachments: Arc<Attachments>,
}

impl Grounds {
    /// The grounds as `config` sizes them, over the store `serving` opens; `tracker` owns the forwarding
    /// tasks so shutdown can wait for them, `waiters` is where waiting requests are woken, and
    /// `shutdown` ends their waits.
    pub fn new(
        config: &Config,
        serving: &Serving,
        metrics: Metrics,
        (tracker, waiters): (TaskTracker, Arc<Waiters>),
        shutdown: CancellationToken,
    ) -> Grounds {
        let server = &config.server;
        Grounds {
            serving: serving.clone(),
            tracker,
            shutdown,
            cache: Arc::new(ReplayCache::new(
                config.replay_cache.max_size,
                config.replay_cache.max_age,
            )),
            permits: KeyedPermits::new(server.max_keyed_in_flight),
            bodies: BodyBudget::new(server.max_buffered_bodies, metrics.clone()),
            examiners: Examiners::per_cpu(),
            seats: Arc::new(Semaphore::new(server.max_waiting)),
            captures: Arc::new(CaptureBudget::new(
                server.max_buffered_responses,
                server.max_buffered_responses_per_scope,
                server.capture_wait,
                metrics.clone(),
            )),
            attachments: Attachments::new(
                server.attach_buffer,
                server.write_timeout,
                waiters.clone(),
                metrics.clone(),
            ),
            waiters,
            metrics,
        }
    }

    /// The request path as `config` routes and forwards, over these grounds; `key_sets` are the sets
    /// its `scope_jwt` routes verify tokens with. What the grounds hold is sized by the configuration
    /// they were made with: a reload leaves those settings (and the store's, the listeners') as they were.
    pub fn proxy(&self, config: &Config, key_sets: &Arc<KeySets>) -> Proxy {
        let server = &config.server;
        let metrics = self.metrics.clone();
        let upstream = Upstream::new(&config.upstream, metrics.clone()).traced(otlp::traced(&config.traces));
        let trailers = TrailerRules::new(config);
        let forward = Forward::new(config, upstream.clone(), metrics.clone(), trailers.clone());
        let keyed = self.keyed(config, upstream, forward.clone());
        let pools = (self.bodies.clone(), self.examiners.clone());
        Proxy {
            routes: Arc::new(config.routes.clone()),
            paths: server.paths,
            route_series: Arc::new(metrics.routes(
                config.routes.routes.iter().map(|route| route.name.as_str()),
                &config.routes.default.name,
            )),
            tracker: self.tracker.clone(),
            keyed: Arc::new(keyed),
            cache: self.cache.clone(),
            permits: self.permits.clone(),
            keyed_per_connection: server.max_keyed_per_connection,
            trusted_proxies: server.trusted_proxies.clone(),
            access_log: config.log.access,
            traced: otlp::traced(&config.traces),
            problem_base: server.problem_type_base.as_str().into(),
            intake: Intake::new(config, metrics.clone(), (trailers, key_sets.clone()), pools),
            forward,
            metrics,
        }
    }

    /// The keyed task and the stages it runs: claim, wait, execute and settle.
    fn keyed(&self, config: &Config, upstream: Upstream, forward: Forward) -> KeyedTask {
        let (metrics, store) = (&self.metrics, self.serving.store.clone());
        let waiters = self.waiters.clone();
        let settle = Settle::new(waiters.clone(), store.clone(), self.serving.capabilities.shared);
        let executor = Executor::new(
            config,
            ExecutorParts {
                store: store.clone(),
                upstream,
                cache: self.cache.clone(),
                metrics: metrics.clone(),
                attachments: self.attachments.clone(),
                captures: self.captures.clone(),
            },
        );
        let parts = ClaimsParts {
            store,
            cache: self.cache.clone(),
            permits: self.permits.clone(),
            waiters,
            metrics: metrics.clone(),
            executor,
            forward,
        };
        let waits = Waits::new(
            self.seats.clone(),
            self.cache.clone(),
            self.attachments.clone(),
            metrics.clone(),
            self.shutdown.clone(),
        );
        KeyedTask::new(Claims::new(config, parts), waits, settle)
    }
}

impl Proxy {
    /// The same request path for another worker thread: everything shared but the pool of upstream
    /// connections, which stays with the thread that uses it.
    pub fn for_worker(&self) -> Proxy {
        let upstream = self.forward.upstream().with_own_pool();
        let forward = self.forward.with_upstream(upstream.clone());
        let claims = self.keyed.claims().for_worker(upstream, forward.clone());
        Proxy {
            routes: self.routes.clone(),
            paths: self.paths,
            metrics: self.metrics.clone(),
            route_series: self.route_series.clone(),
            tracker: self.tracker.clone(),
            cache: self.cache.clone(),
            permits: self.permits.clone(),
            keyed_per_connection: self.keyed_per_connection,
            trusted_proxies: self.trusted_proxies.clone(),
            access_log: self.access_log,
            traced: self.traced,
            problem_base: self.problem_base.clone(),
            intake: self.intake.clone(),
            forward,
            keyed: Arc::new(self.keyed.with_claims(claims)),
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
        // Before anything reads the method or the path: the access line records what is routed.
        method::normalise(&mut request);
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
        let line = self.open_line(&request, &peer, &span);
        // The proxy's own answers are written as the request's dialect reads them.
        let dialect = Dialect::of(request.headers());
        // A refused path is counted under the default route, as a path no route matches is.
        let (normal, route) = match normal {
            Ok(()) => self.route(&request),
            Err(refused) => (Err(refused), &self.routes.default),
        };
        let route = route.clone();
        otlp::adopt(&span, self.traced, &request, &route.name);
        let series = self.route_series.get(&route.name);
        let statuses = route.policy.statuses;
        let repeatable = (route.policy.key.source == KeySource::Repeatability).then(|| route.clone());
        let inner = access::within(
            line.as_ref().map(Line::ledger),
            self.handle_inner(request, (peer, dialect.clone()), normal, route),
        );
        let result = if span.is_disabled() {
            inner.await
        } else {
            inner.instrument(span.clone()).await
        };
        let _entered = span.enter();
        let (response, outcome) = self.answered(result, &dialect, (&statuses, repeatable.as_deref()));
        span.record("outcome", outcome.as_str());
        otlp::answered(&span, self.traced, response.status());
        let elapsed = arrived.elapsed();
        series.answered(outcome, elapsed);
        let response = dialect.counted(response, series);
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

    /// What the request is answered with: its response, or its error logged, counted and written as a
    /// refusal in its `dialect` (with the route's `statuses`). On a route keyed by `repeatability`
    /// (`repeatable`), an answer that is kept — replayed, or executed and stored, not released — says
    /// `Repeatability-Result: accepted` (OASIS Repeatable Requests: it ran once, and every retry gets
    /// this), and an id that is no key says `rejected`; the upstream's own word, where it implements the
    /// specification itself, stands.
    fn answered(
        &self,
        result: Handled,
        dialect: &Dialect,
        (statuses, repeatable): (&crate::config::ProblemStatuses, Option<&Route>),
    ) -> (Response<ProxyBody>, Outcome) {
        match result {
            Ok((mut response, outcome)) => {
                if let Some(route) = repeatable {
                    let kept = match outcome {
                        Outcome::Replayed => true,
                        Outcome::Executed => !route.policy.store.release.releases(response.status()),
                        _ => false,
                    };
                    if kept {
                        repeatability_result(&mut response, "accepted");
                    }
                }
                (response, outcome)
            }
            Err(error) => {
                let rejected = repeatable.is_some() && matches!(error, ProxyError::InvalidKey(_));
                let (mut response, outcome) = self.refused(error, dialect, statuses);
                if rejected {
                    repeatability_result(&mut response, "rejected");
                }
                (response, outcome)
            }
        }
    }

    /// A refusal, logged, counted and written in the request's `dialect`.
    fn refused(
        &self,
        error: ProxyError,
        dialect: &Dialect,
        statuses: &crate::config::ProblemStatuses,
    ) -> (Response<ProxyBody>, Outcome) {
        if error.status().is_server_error() {
            tracing::warn!(%error, status = error.status().as_u16(), "request failed");
        } else {
            tracing::debug!(%error, "request refused");
        }
        if let ProxyError::Busy(what) = &error {
            self.metrics.busy(*what);
        }
        let outcome = error.outcome();
        (dialect.refusal(error, &self.problem_base, statuses), outcome)
    }

    /// The route `request` (its path in normal form) takes; refused when it spells another route's path
    /// in another case or with another trailing slash (`RouteTable::misspelt`), counted under the
    /// default route.
    fn route(&self, request: &Request<Incoming>) -> (Result<(), ProxyError>, &Arc<Route>) {
        let (method, path) = (request.method(), request.uri().path());
        let route = self.routes.select(method, path);
        if self.routes.misspelt(method, path, route) {
            let refused = ProxyError::NonNormalPath(crate::config::NotNormal::RouteSpelling);
            return (Err(refused), &self.routes.default);
        }
        (Ok(()), route)
    }

    /// Puts the caller's trace context on the request's span, and opens its access line, from `peer`,
    /// while the access log is on. With the span disabled and the log off, does nothing.
    fn open_line(
        &self,
        request: &Request<Incoming>,
        peer: &Downstream,
        span: &tracing::Span,
    ) -> Option<Line> {
        if span.is_disabled() && !self.access_log {
            return None;
        }
        let trace = trace_context::parse(request.headers());
        if let Some(trace) = trace {
            span.record("trace_id", trace.trace_id);
            span.record("parent_id", trace.parent_id);
        }
        self.access_log.then(|| {
            let client = peer.logged_client(request.headers());
            Line::open(request, client, trace.map(|t| t.trace_id))
        })
    }

    /// The lifecycle after `normal`, the path's normalisation (`path::normalise`), which a refused path
    /// ends here, and `route`, the route `handle` selected by that path.
    async fn handle_inner(
        &self,
        mut request: Request<Incoming>,
        (peer, dialect): (Downstream, Dialect),
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
        if route.passthrough || dialect.passes_untouched(&request) {
            return self.forward.passthrough(request, &peer).await;
        }
        let protects = route.policy.key.methods.contains(request.method());
        if (protects || route.policy.signature.is_some())
            && let Some(name) = trailers::names_decisive(&route.policy, request.headers())
        {
            return Err(ProxyError::InvalidKey(format!(
                "the Connection header names {name}, which this route reads its key, scope or \
                 signature from; the service would not get it"
            )));
        }
        if !protects {
            if route.policy.signature.is_some() {
                // Verified like the rest: a signed route's handler sees no request of any method
                // that has not passed.
                return Box::pin(self.verified(request, route, peer)).await;
            }
            return self.forward.passthrough(request, &peer).await;
        }
        match key_of(&request, &route)? {
            // A keyed request's state is many times a passthrough's; on the heap it stays out of the
            // future every request carries and moves.
            Some(key) => Box::pin(self.protected(request, route, key, (peer, dialect))).await,
            None => self.forward.passthrough(request, &peer).await,
        }
    }

    /// A request of a method the route does not protect, on a route with a signature: its body is read
    /// and its signature verified, then it is forwarded unkeyed.
    async fn verified(&self, request: Request<Incoming>, route: Arc<Route>, peer: Downstream) -> Handled {
        let unkeyed = self.intake.verify(request, &route, &peer).await?;
        self.forward.read(unkeyed.parts, unkeyed.body, &peer).await
    }

    /// A request with a key: intake (scope, body, fingerprint), then the replay cache, or the keyed
    /// task, which answers through its [`Answer`].
    async fn protected(
        &self,
        request: Request<Incoming>,
        route: Arc<Route>,
        key: Option<String>,
        (peer, dialect): (Downstream, Dialect),
    ) -> Handled {
        let ticket = match self.intake.take(request, route, key, (&peer, dialect)).await? {
            Taken::One(ticket) => ticket,
            Taken::Many(many) => return Box::pin(self.many(many, &peer)).await,
            // Rare, and its forward is large: on the heap, it stays out of every keyed request's future.
            Taken::Unkeyed(unkeyed) => {
                return Box::pin(self.forward.read(unkeyed.parts, unkeyed.body, &peer)).await;
            }
        };
        let request = (&ticket.parts.headers, &ticket.dialect);
        let cached = replay::from_cache(&self.cache, &ticket.claim, &ticket.route, request, &self.metrics);
        if let Some(answer) = cached {
            return answer;
        }
        // Keyed work outlives its client on purpose; this bounds how much of it runs at once.
        let permit = self.permits.take(&peer).map_err(ProxyError::Busy)?;
        // A client whose dialect gives it a deadline of its own is answered at it; the execution runs
        // on under upstream.timeout and stores its result for the retry, as for a client that left.
        let deadline = ticket.dialect.client_deadline(&ticket.parts.headers);
        let series: &Arc<RouteSeries> = self.route_series.get(&ticket.route.name);
        let (head, response) = Answer::new(series.clone());
        // On the heap from the start: the task's future is many kilobytes, and each wrapper below and the
        // spawn would otherwise copy it whole, as would the task's cell when it finishes.
        let keyed = Box::pin(self.keyed.clone().run(ticket, head, permit));
        let keyed = access::within(access::current(), keyed);
        self.tracker.spawn(keyed.instrument(tracing::Span::current()));
        let answered = match deadline {
            None => response.await,
            Some(deadline) => match tokio::time::timeout(deadline, response).await {
                Ok(answered) => answered,
                Err(_) => return Err(ProxyError::UpstreamTimeout(deadline)),
            },
        };
        answered.unwrap_or_else(|_| {
            Err(ProxyError::UpstreamBroken(
                "the request's task ended without a response".into(),
            ))
        })
    }
}

impl Proxy {
    /// A request that carries many keys: the keyed task runs it, under one keyed permit, and answers
    /// through its [`Answer`].
    async fn many(&self, many: Many, peer: &Downstream) -> Handled {
        let permit = self.permits.take(peer).map_err(ProxyError::Busy)?;
        let series: &Arc<RouteSeries> = self.route_series.get(&many.route.name);
        let (head, response) = Answer::new(series.clone());
        let task =
            self.keyed
                .clone()
                .run_many(many, head, (permit, series.clone(), self.problem_base.clone()));
        let task = access::within(access::current(), Box::pin(task));
        self.tracker.spawn(task.instrument(tracing::Span::current()));
        response.await.unwrap_or_else(|_| {
            Err(ProxyError::UpstreamBroken(
                "the request's task ended without a response".into(),
            ))
        })
    }
}

/// Says `Repeatability-Result: verdict` on `response`, unless the upstream said it itself.
fn repeatability_result(response: &mut Response<ProxyBody>, verdict: &'static str) {
    let value = http::HeaderValue::from_static(verdict);
    let headers = response.headers_mut();
    headers
        .entry(crate::headers::REPEATABILITY_RESULT_HEADER)
        .or_insert(value);
}

/// What becomes of a request of a method its route protects: `Some` goes on to [`Proxy::protected`]
/// with its key, or `None` for a key read from its body (or a signed request without one, to be
/// verified); `None` is forwarded unkeyed (no key where keys are optional); a missing key where keys
/// are required is refused.
fn key_of(request: &Request<Incoming>, route: &Route) -> Result<Option<Option<String>>, ProxyError> {
    let policy = &route.policy;
    if policy.key.source.needs_body() {
        return Ok(Some(None));
    }
    match key::source::from_head(policy, request.method(), request.uri(), request.headers())? {
        Some(key) => {
            if policy.key.source == KeySource::Repeatability {
                let window = policy.key.repeatability_window;
                key::repeatability::check_first_sent(request.headers(), window, SystemTime::now())?;
            }
            Ok(Some(Some(key)))
        }
        None if policy.key.required => Err(ProxyError::MissingKey(key::source::describe(&policy.key.source))),
        // Verified before it goes anywhere: intake reads its body, then forwards it unkeyed.
        None if policy.signature.is_some() => Ok(Some(None)),
        None => Ok(None),
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

/// What the stages' unit tests share.
#[cfg(test)]
mod stage_tests;
