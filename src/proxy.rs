//! The request path, for every request on the proxy listener. [`Proxy::handle`] never fails: it counts,
//! logs and turns any [`ProxyError`] into a problem response. [`Proxy::handle_inner`] is the lifecycle in
//! order: route by method → key → body → scope and fingerprint → claim → decision → replay or execute.

pub mod body;
pub mod claim;
pub mod downstream;
pub mod forward;
pub mod key;
pub mod replay;
pub mod tee;

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, header, request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use uuid::Uuid;

use self::body::{BoxError, ProxyBody};
use self::claim::Decision;
use self::forward::{Downstream, Upstream, UpstreamFailure, stream_response};
use crate::config::{Config, IdempotencyConfig, OnStoreError};
use crate::error::ProxyError;
use crate::metrics::{Metrics, Outcome};
use crate::store::{ClaimRequest, RecordId, StoreError, StoreHandle};

/// Everything a request needs; shared behind an `Arc` by every connection and forwarding task.
pub struct Proxy {
    pub(crate) policy: IdempotencyConfig,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) store: StoreHandle,
    pub(crate) upstream: Upstream,
    pub(crate) metrics: Metrics,
    pub(crate) tracker: TaskTracker,
}

type Handled = Result<(Response<ProxyBody>, Outcome), ProxyError>;

impl Proxy {
    /// Assembles the request path; `tracker` owns the forwarding tasks so shutdown can wait for them.
    pub fn new(config: &Config, store: StoreHandle, metrics: Metrics, tracker: TaskTracker) -> Proxy {
        Proxy {
            policy: config.idempotency.clone(),
            on_store_error: config.store.on_error,
            store,
            upstream: Upstream::new(&config.upstream, metrics.clone()),
            metrics,
            tracker,
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
        let started = std::time::Instant::now();
        let result = self.handle_inner(request, peer).instrument(span.clone()).await;
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
        tracing::debug!(
            status = response.status().as_u16(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
            "answered"
        );
        Ok(response)
    }

    async fn handle_inner(self: &Arc<Self>, request: Request<Incoming>, peer: Downstream) -> Handled {
        if !self.policy.methods.contains(request.method()) {
            return self.passthrough(request, peer).await;
        }
        let headers = request.headers();
        let Some(key) = key::parse_key(headers.get_all(&self.policy.header), self.policy.max_key_length)?
        else {
            if self.policy.required {
                return Err(ProxyError::MissingKey(self.policy.header.clone()));
            }
            return self.passthrough(request, peer).await;
        };
        let (parts, body) = request.into_parts();
        let body = self.read_body(&parts.headers, body).await?;
        let (head, response) = oneshot::channel();
        let head = Answer {
            head,
            metrics: self.metrics.clone(),
        };
        let keyed = self.clone().keyed(parts, key, body, peer, head);
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
        key: String,
        body: Bytes,
        peer: Downstream,
        head: Answer,
    ) {
        let claim = self.claim_request(&parts, key, &body);
        let decision = match self.store.claim(&claim).await {
            Ok(result) => claim::decide(result, &claim.id.key, &self.metrics),
            Err(error) => {
                head.send(self.store_down(&parts, body, peer, error).await);
                return;
            }
        };
        let answer = match decision {
            Ok(Decision::Execute) => {
                let request = self.upstream.request(&parts, body::full(body), peer);
                return tee::execute(self, claim.id, request, head).await;
            }
            Ok(Decision::Replay(stored)) => replay::response(stored).map(|r| (r, Outcome::Replayed)),
            Err(refusal) => Err(refusal),
        };
        head.send(answer);
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
    /// anything over `max_request_body` as early as its declared length allows.
    async fn read_body(&self, headers: &HeaderMap, body: Incoming) -> Result<Bytes, ProxyError> {
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
        match Limited::new(body, limit).collect().await {
            Ok(collected) => Ok(collected.to_bytes()),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => Err(too_large),
            Err(e) => Err(ProxyError::ClientBody(e.to_string())),
        }
    }

    async fn passthrough(&self, request: Request<Incoming>, peer: Downstream) -> Handled {
        let (parts, body) = request.into_parts();
        let request = self
            .upstream
            .request(&parts, body.map_err(BoxError::from).boxed(), peer);
        let response = self
            .upstream
            .send(request)
            .await
            .map_err(UpstreamFailure::into_error)?;
        Ok((stream_response(response), Outcome::Passthrough))
    }

    /// The store could not decide the claim: refuse (fail_closed) or forward unprotected (fail_open).
    async fn store_down(
        &self,
        parts: &request::Parts,
        body: Bytes,
        peer: Downstream,
        error: StoreError,
    ) -> Handled {
        if self.on_store_error == OnStoreError::FailClosed {
            return Err(ProxyError::StoreUnavailable(error.to_string()));
        }
        self.metrics.unprotected.inc();
        tracing::warn!(%error, "store unavailable; forwarding without idempotency (fail_open)");
        let request = self.upstream.request(parts, body::full(body), peer);
        let response = self
            .upstream
            .send(request)
            .await
            .map_err(UpstreamFailure::into_error)?;
        Ok((stream_response(response), Outcome::StoreUnavailable))
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
