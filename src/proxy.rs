//! The request path, for every request on the proxy listener. [`Proxy::handle`] never fails: it counts,
//! logs and turns any [`ProxyError`] into a problem response. [`Proxy::handle_inner`] is the lifecycle in
//! order: route by method → key → body → scope and fingerprint → claim → decision → replay or execute.

pub mod budget;
pub mod cache;
pub mod claim;
pub mod client_body;
pub mod downstream;
pub mod forward;
pub mod key;
pub mod pool;
pub mod replay;
pub mod tee;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Request, Response, header, request};
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use self::budget::{BodyBudget, ReservedBody};
use self::cache::{Fill, Lookup, ReplayCache};
use self::claim::Decision;
use self::client_body::GuardedBody;
use self::forward::{Downstream, Upstream, UpstreamFailure, stream_response};
use crate::body::{self, ProxyBody};
use crate::config::{Config, IdempotencyConfig, OnStoreError, Unscoped};
use crate::error::{Busy, ProxyError};
use crate::metrics::{Metrics, Outcome};
use crate::store::{ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, StoreError, StoreHandle};

/// Everything a request needs; shared behind an `Arc` by every connection and forwarding task of a worker.
#[derive(Clone)]
pub struct Proxy {
    pub(crate) policy: IdempotencyConfig,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store: StoreHandle,
    pub(crate) upstream: Upstream,
    pub(crate) metrics: Metrics,
    pub(crate) tracker: TaskTracker,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) body_read_timeout: Duration,
    pub(crate) budget: BodyBudget,
    /// Bytes of keyed responses being captured for storage, shared by every worker.
    pub(crate) captures: Arc<Semaphore>,
    /// One permit per keyed request being executed (`server.max_keyed_in_flight`), shared by every worker.
    pub(crate) keyed_slots: Arc<Semaphore>,
    /// Longest a client waits for its record to be stored before it gets the end of its response.
    pub(crate) completion_hold: Duration,
    /// Longest a client may accept no bytes of a keyed response.
    pub(crate) write_timeout: Duration,
    /// Bound on one store operation, the first wait before an orphaned claim is given back.
    pub(crate) store_timeout: Duration,
}

/// The longest a client waits for its record to be stored (or less, `store.timeout`).
const COMPLETION_HOLD_MAX: Duration = Duration::from_secs(2);

type Handled = Result<(Response<ProxyBody>, Outcome), ProxyError>;

impl Proxy {
    /// Assembles the request path; `tracker` owns the forwarding tasks so shutdown can wait for them.
    pub fn new(config: &Config, store: StoreHandle, metrics: Metrics, tracker: TaskTracker) -> Proxy {
        Proxy {
            policy: config.idempotency.clone(),
            on_store_error: config.store.on_error,
            store,
            upstream: Upstream::new(&config.upstream, metrics.clone()),
            budget: BodyBudget::new(config.server.max_buffered_bodies, metrics.clone()),
            metrics,
            tracker,
            cache: Arc::new(ReplayCache::new(
                config.replay_cache.max_size,
                config.replay_cache.max_age,
            )),
            body_read_timeout: config.server.body_read_timeout,
            captures: Arc::new(Semaphore::new(
                config.server.max_buffered_responses.min(Semaphore::MAX_PERMITS),
            )),
            keyed_slots: Arc::new(Semaphore::new(config.server.max_keyed_in_flight)),
            completion_hold: config.store.timeout.min(COMPLETION_HOLD_MAX),
            write_timeout: config.server.write_timeout,
            store_timeout: config.store.timeout,
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
        request: Request<Incoming>,
        peer: Downstream,
    ) -> Result<Response<ProxyBody>, Infallible> {
        let _in_flight = InFlight::enter(&self.metrics);
        let span = tracing::info_span!(
            "request",
            method = %request.method(),
            route = key::DEFAULT_SCOPE,
            outcome = tracing::field::Empty,
        );
        let started = tracing::enabled!(tracing::Level::DEBUG).then(std::time::Instant::now);
        let result = if span.is_disabled() {
            self.handle_inner(request, peer).await
        } else {
            self.handle_inner(request, peer).instrument(span.clone()).await
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
                let outcome = error.outcome();
                (error.into_response(), outcome)
            }
        };
        span.record("outcome", outcome.as_str());
        self.metrics.record(outcome);
        if let Some(started) = started {
            tracing::debug!(
                status = response.status().as_u16(),
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "answered"
            );
        }
        Ok(response)
    }

    async fn handle_inner(self: &Arc<Self>, request: Request<Incoming>, peer: Downstream) -> Handled {
        // CONNECT would make the proxy a tunnel (a 2xx from the upstream turns the client's connection
        // into raw bytes) and TRACE echoes the request, credentials included: neither is forwarded.
        let method = request.method();
        if method == http::Method::CONNECT || method == http::Method::TRACE {
            return Err(ProxyError::MethodNotAllowed(method.clone()));
        }
        if !self.policy.methods.contains(request.method()) {
            return self.passthrough(request, &peer).await;
        }
        let headers = request.headers();
        let Some(key) = key::parse_key(headers.get_all(&self.policy.header), self.policy.max_key_length)?
        else {
            if self.policy.required {
                return Err(ProxyError::MissingKey(self.policy.header.clone()));
            }
            return self.passthrough(request, &peer).await;
        };
        self.check_scope(headers)?;
        // A keyed request's state is many times a passthrough's; on the heap it stays out of the future
        // every request carries and moves.
        Box::pin(self.protected(request, key, peer)).await
    }

    /// Refuses a keyed request that names no client in any scope header (unless scopes may be shared):
    /// without one, every such client would share one scope, and one client's key would answer another's.
    fn check_scope(&self, headers: &HeaderMap) -> Result<(), ProxyError> {
        let policy = &self.policy;
        if policy.unscoped == Unscoped::Shared || key::has_scope(headers, &policy.scope_headers) {
            return Ok(());
        }
        let names: Vec<&str> = policy.scope_headers.iter().map(HeaderName::as_str).collect();
        Err(ProxyError::MissingScope(names.join(", ")))
    }

    /// A request with a key: body, fingerprint, then the replay cache or the keyed lifecycle.
    async fn protected(
        self: &Arc<Self>,
        request: Request<Incoming>,
        key: String,
        peer: Downstream,
    ) -> Handled {
        let (parts, body) = request.into_parts();
        let body = self.read_body(&parts.headers, body).await?;
        let claim = self.claim_request(&parts, key, &body.bytes);
        if let Some(answer) = self.answer_from_cache(&claim) {
            return answer;
        }
        // Keyed work outlives its client on purpose; this bounds how much of it runs at once.
        let Ok(slot) = self.keyed_slots.clone().try_acquire_owned() else {
            return Err(ProxyError::Busy(Busy::KeyedInFlight));
        };
        let (head, response) = oneshot::channel();
        let head = Answer {
            head,
            metrics: self.metrics.clone(),
        };
        let keyed = self.clone().keyed(parts, claim, body, peer, head, slot);
        self.tracker.spawn(keyed.instrument(tracing::Span::current()));
        response.await.unwrap_or_else(|_| {
            Err(ProxyError::UpstreamUnreachable(
                "the request's task ended without a response".into(),
            ))
        })
    }

    /// The keyed lifecycle from the claim on. It runs on its own task: once the claim statement is sent,
    /// a client that disconnects can no longer cancel anything, so a won claim is always executed and
    /// completed (or released) instead of being left to its lease. The answer goes to `head`.
    async fn keyed(
        self: Arc<Self>,
        parts: request::Parts,
        claim: ClaimRequest,
        body: ReservedBody,
        peer: Downstream,
        head: Answer,
        _slot: OwnedSemaphorePermit,
    ) {
        let started = Instant::now();
        let result = match self.store.claim(&claim).await {
            Ok(result) => result,
            // The store answered, but with a record that must not be replayed; never forward either.
            Err(StoreError::Undecryptable(_)) => {
                head.send(Err(ProxyError::RecordUnreadable));
                return;
            }
            Err(error) => {
                tokio::spawn(release_orphan(self.clone(), claim.id.clone()));
                head.send(self.store_down(parts, body, &peer, error).await);
                return;
            }
        };
        let fill = self.remember(&claim, &result, started);
        let answer = match claim::decide(
            result,
            &claim.id.key,
            self.policy.in_flight_retry_after,
            &self.metrics,
        ) {
            Ok(Decision::Execute) => {
                let waited = started.elapsed();
                if waited > claim.lease / 2 {
                    let late = self.claimed_too_late(&claim, waited).await;
                    head.send(self.store_down(parts, body, &peer, late).await);
                    return;
                }
                let request = self.upstream.request(parts, body.into_body(), &peer);
                return tee::execute(self, claim.id, request, head, fill).await;
            }
            Ok(Decision::Replay(stored)) => replay::response(&stored).map(|r| (r, Outcome::Replayed)),
            Err(refusal) => Err(refusal),
        };
        head.send(answer);
    }

    /// A won claim whose answer came after more than half its lease (the lease started no earlier than the
    /// claim was sent): a starved process, or a store slower than the lease. The heartbeat's first
    /// extension, a third of a lease after forwarding, might come after the lease ran out, and another
    /// proxy could take the key over while the upstream works. So the claim is given back (fenced by its
    /// token) and the request is answered as if the store had not answered in time.
    async fn claimed_too_late(&self, claim: &ClaimRequest, waited: Duration) -> StoreError {
        tracing::warn!(
            key = %claim.id.key,
            waited_ms = waited.as_millis() as u64,
            lease_ms = claim.lease.as_millis() as u64,
            "claim answered after more than half its lease; not forwarded on it"
        );
        if let Err(error) = self.store.release(&claim.id).await {
            tracing::warn!(key = %claim.id.key, %error, "releasing the late claim failed; it expires with its lease");
        }
        StoreError::Timeout(waited)
    }

    /// A retry of a record this process has seen completed, answered without the store.
    fn answer_from_cache(&self, claim: &ClaimRequest) -> Option<Handled> {
        let answer = match self
            .cache
            .lookup(&claim.id.scope, &claim.id.key, &claim.fingerprint)
        {
            Lookup::Replay(stored) => replay::response(&stored).map(|r| (r, Outcome::Replayed)),
            Lookup::Mismatch => Err(ProxyError::KeyReused),
            Lookup::Miss => return None,
        };
        self.metrics.replay_cache_hits.inc();
        Some(answer)
    }

    /// Feeds the replay cache from what the claim statement found, with deadlines measured from `started`,
    /// an instant before the statement ran. A completed record reported by the store enters now. A new
    /// record (expiring `ttl` after the statement) can enter once it is completed: that is the returned
    /// [`Fill`]. A retry or takeover keeps an expiry this process never saw, so it does not enter.
    fn remember(&self, claim: &ClaimRequest, result: &ClaimResult, started: Instant) -> Option<Fill> {
        match result {
            ClaimResult::Won {
                kind: ClaimKind::New, ..
            } => Some(Fill {
                fingerprint: claim.fingerprint,
                deadline: started + claim.ttl,
            }),
            ClaimResult::Held(Existing::Completed {
                same_fingerprint: true,
                response,
                expires_in,
                ..
            }) => {
                // The store rounds its time to expiry up to the millisecond.
                let deadline = started + expires_in.saturating_sub(Duration::from_millis(1));
                let id = &claim.id;
                self.cache
                    .insert(&id.scope, &id.key, claim.fingerprint, response.clone(), deadline);
                None
            }
            _ => None,
        }
    }

    fn claim_request(&self, parts: &request::Parts, key: String, body: &[u8]) -> ClaimRequest {
        let policy = &self.policy;
        ClaimRequest {
            id: RecordId {
                scope: key::scope(&parts.headers, &policy.scope_headers),
                key,
                token: Uuid::new_v4(),
            },
            fingerprint: key::fingerprint(
                &parts.method,
                &parts.uri,
                &parts.headers,
                &policy.fingerprint_headers,
                body,
            ),
            lease: policy.lock_timeout,
            ttl: policy.ttl,
        }
    }

    /// Reads a keyed request's body whole (its fingerprint must be known before the claim), refusing
    /// anything over `max_request_body` as early as its declared length allows, or as soon as the bytes
    /// received pass it, and anything that takes longer than `server.body_read_timeout` to arrive. Room
    /// for the body is reserved from the shared body budget first; 503 when none comes in that time.
    async fn read_body(&self, headers: &HeaderMap, body: Incoming) -> Result<ReservedBody, ProxyError> {
        let limit = self.policy.max_request_body;
        let too_large = ProxyError::RequestTooLarge { limit };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit) {
            return Err(too_large);
        }
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let need = declared.map_or(limit, |len| usize::try_from(len).unwrap_or(limit));
        let Some(mut reservation) = self.budget.reserve(need, self.body_read_timeout).await else {
            return Err(ProxyError::Busy(Busy::Bodies));
        };
        let reading = tokio::time::timeout(self.body_read_timeout, Limited::new(body, limit).collect());
        let bytes = match reading.await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large),
            Ok(Err(e)) => return Err(ProxyError::ClientBody(e.to_string())),
            Err(_) => return Err(ProxyError::RequestTimeout(self.body_read_timeout)),
        };
        reservation.shrink_to(bytes.len());
        Ok(ReservedBody::new(bytes, reservation))
    }

    async fn passthrough(&self, request: Request<Incoming>, peer: &Downstream) -> Handled {
        let (parts, body) = request.into_parts();
        // A request without a body, as most are, has no body to guard.
        let (body, client) = if body.is_end_stream() {
            (body::empty(), None)
        } else {
            let (body, client) = GuardedBody::new(body, self.body_read_timeout);
            (body.boxed(), Some(client))
        };
        let request = self.upstream.request(parts, body, peer);
        let response = self.upstream.send(request).await.map_err(|failure| {
            client
                .and_then(|client| client.error())
                .unwrap_or_else(|| failure.into_error())
        })?;
        Ok((relayable(response)?, Outcome::Passthrough))
    }

    /// The store could not decide the claim: refuse (fail_closed) or forward unprotected (fail_open).
    async fn store_down(
        &self,
        parts: request::Parts,
        body: ReservedBody,
        peer: &Downstream,
        error: StoreError,
    ) -> Handled {
        if self.on_store_error == OnStoreError::FailClosed {
            return Err(ProxyError::StoreUnavailable(error.to_string()));
        }
        self.metrics.unprotected.inc();
        tracing::warn!(%error, "store unavailable; forwarding without idempotency (fail_open)");
        let request = self.upstream.request(parts, body.into_body(), peer);
        let response = self
            .upstream
            .send(request)
            .await
            .map_err(UpstreamFailure::into_error)?;
        Ok((relayable(response)?, Outcome::StoreUnavailable))
    }
}

/// An upstream response streamed through as it is, unless it is a `101 Switching Protocols`: the proxy
/// forwards no `Upgrade`, so nothing asked for one, and the connection it would switch is not relayed.
fn relayable(response: Response<pool::PooledBody>) -> Result<Response<ProxyBody>, ProxyError> {
    if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return Err(ProxyError::UpstreamInvalidResponse(response.status()));
    }
    Ok(stream_response(response))
}

/// A claim whose statement did not answer in time may still have been won, by a statement that
/// committed after its request stopped waiting; left alone, it would hold the key for a lease and then
/// count as a stale takeover although nothing ran. It is given back by its token (which matches nothing
/// if it was never won), tried after one store timeout, when such a statement has most likely ended,
/// and again with doubling waits while its lease could still be live.
async fn release_orphan(proxy: Arc<Proxy>, id: RecordId) {
    let deadline = Instant::now() + proxy.policy.lock_timeout + proxy.store_timeout;
    let mut wait = proxy.store_timeout;
    while Instant::now() + wait <= deadline {
        tokio::time::sleep(wait).await;
        if let Ok(true) = proxy.store.release(&id).await {
            proxy.metrics.orphan_claims_released.inc();
            tracing::warn!(key = %id.key, "a claim won after its request gave up waiting was given back");
            return;
        }
        wait *= 2;
    }
}

/// Where a keyed request's answer goes. `handle` counts every outcome, unless the client hung up and took
/// `handle` with it; such answers are counted here instead, so executions are never missing from
/// `idemproxy_requests_total`.
pub(crate) struct Answer {
    head: oneshot::Sender<Handled>,
    metrics: Metrics,
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
            self.metrics.record(outcome);
        }
        delivered
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
