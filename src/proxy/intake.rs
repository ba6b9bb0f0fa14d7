//! Runs for a request that carries an idempotency key, before anything touches the store: checks that it
//! names a client in a scope header, reads its body whole under the shared body budget
//! (`intake/budget.rs`) and `server.body_read_timeout`, and turns it into the claim the store will be
//! asked for: scope, key, fingerprint (`key.rs`), lease and time to live. Touches the body budget only.

pub mod budget;

use http::{HeaderMap, HeaderName, Request, header, request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use uuid::Uuid;

use self::budget::ReservedBody;
use super::{Proxy, key};
use crate::access;
use crate::config::Unscoped;
use crate::error::{Busy, ProxyError};
use crate::store::{ClaimRequest, RecordId};

/// A keyed request taken in: its head, the claim to send, and its body (holding its share of the budget
/// until it has gone upstream).
pub(crate) struct Intake {
    /// The request line and headers.
    pub(crate) parts: request::Parts,
    /// The claim, with the lease and time to live it is made under.
    pub(crate) claim: ClaimRequest,
    /// The body, read whole.
    pub(crate) body: ReservedBody,
}

impl Proxy {
    /// Takes in a keyed request: scope check, body, then the claim it will make.
    pub(crate) async fn intake(&self, request: Request<Incoming>, key: String) -> Result<Intake, ProxyError> {
        self.check_scope(request.headers())?;
        let (parts, body) = request.into_parts();
        let body = self.read_body(&parts.headers, body).await?;
        let claim = self.claim_request(&parts, key, &body.bytes);
        access::key(|| key::key_hash(&claim.id.scope, &claim.id.key));
        Ok(Intake { parts, claim, body })
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
}
