//! Runs for every request the proxy does not protect (a method not in `idempotency.methods`, or no key
//! while keys are optional), and for a keyed request whose claim the store could not decide while
//! `store.on_error = "fail_open"`: forwards it upstream as it is and streams the answer back, with no
//! store work. A passthrough body streams to the upstream under `client_body.rs`'s bounds.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, request};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::answer::Handled;
use super::budget::ReservedBody;
use super::client_body::{ClientSide, GuardedBody, Trailers};
use super::downstream::Downstream;
use super::trailers::TrailerRules;
use super::upstream::pool::PooledBody;
use super::upstream::{Upstream, UpstreamFailure, stream_response};
use crate::body::{self, ProxyBody};
use crate::config::{Config, OnStoreError};
use crate::error::ProxyError;
use crate::metrics::{Metrics, Outcome};
use crate::store::StoreError;

/// The forward stage: sends a request upstream with no store work, over its worker's pool.
#[derive(Clone)]
pub(crate) struct Forward {
    upstream: Upstream,
    on_store_error: OnStoreError,
    body_read_timeout: Duration,
    /// How a streamed body's trailers are cleaned.
    trailers: Arc<TrailerRules>,
    metrics: Metrics,
}

impl Forward {
    pub(crate) fn new(
        config: &Config,
        upstream: Upstream,
        metrics: Metrics,
        trailers: Arc<TrailerRules>,
    ) -> Forward {
        Forward {
            upstream,
            on_store_error: config.store.on_error,
            body_read_timeout: config.server.body_read_timeout,
            trailers,
            metrics,
        }
    }

    /// The upstream it forwards to.
    pub(crate) fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// The same stage over another worker's pool of upstream connections.
    pub(crate) fn with_upstream(&self, upstream: Upstream) -> Forward {
        Forward {
            upstream,
            ..self.clone()
        }
    }

    /// Forwards an unprotected request; a client body that stalls or breaks is blamed on the client.
    pub(crate) async fn passthrough(&self, request: Request<Incoming>, peer: &Downstream) -> Handled {
        let (parts, body) = request.into_parts();
        // A request without a body, as most are, has no body to guard.
        let (body, client) = if body.is_end_stream() {
            (body::empty(), None)
        } else {
            let trailers = Trailers::of(&self.trailers, &parts.headers);
            let (body, client) = GuardedBody::new(
                body,
                (parts.version, trailers),
                self.body_read_timeout,
                peer.body_watch(),
            );
            (body.boxed(), Some(client))
        };
        let request = self.upstream.request(parts, body, peer);
        let response = self.upstream.send(request).await.map_err(|failure| {
            client
                .as_ref()
                .and_then(ClientSide::error)
                .unwrap_or_else(|| failure.into_error())
        })?;
        if let Some(client) = client {
            client.answered();
        }
        Ok((relayable(response)?, Outcome::Passthrough))
    }

    /// Forwards a request its route protects but which carries no key in its body (keys optional there):
    /// the body has been read already and goes upstream as it is.
    pub(crate) async fn read(&self, parts: request::Parts, body: ReservedBody, peer: &Downstream) -> Handled {
        self.forward_read(parts, body, peer, Outcome::Passthrough).await
    }

    /// Whether a request the store could not decide goes upstream unprotected (`fail_open`).
    pub(crate) fn fails_open(&self) -> bool {
        self.on_store_error == OnStoreError::FailOpen
    }

    /// The store could not decide the claim: refuse (fail_closed) or forward unprotected (fail_open).
    pub(crate) async fn store_down(
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
        self.forward_read(parts, body, peer, Outcome::StoreUnavailable)
            .await
    }

    /// Forwards a request whose body has been read whole, unprotected, counted as `outcome`.
    async fn forward_read(
        &self,
        parts: request::Parts,
        body: ReservedBody,
        peer: &Downstream,
        outcome: Outcome,
    ) -> Handled {
        let request = self.upstream.request_whole(parts, body, peer);
        let response = self
            .upstream
            .send(request)
            .await
            .map_err(UpstreamFailure::into_error)?;
        Ok((relayable(response)?, outcome))
    }
}

/// An upstream response streamed through as it is, unless it is a `101 Switching Protocols`: the proxy
/// forwards no `Upgrade`, so nothing asked for one, and the connection it would switch is not relayed.
fn relayable(response: Response<PooledBody>) -> Result<Response<ProxyBody>, ProxyError> {
    if response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
        return Err(ProxyError::UpstreamInvalidResponse(response.status()));
    }
    Ok(stream_response(response))
}
