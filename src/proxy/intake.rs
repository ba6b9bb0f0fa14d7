//! Runs for a request that carries an idempotency key, or whose route reads its key from the body or
//! checks signatures, before anything touches the store: checks that it names a client in a scope
//! header (before its body is read, so a request that would be refused is never waited for), reads its
//! body whole under the shared body budget (`budget.rs`) and `server.body_read_timeout`, has its
//! webhook signature verified where the route has one (`signature.rs`), reads the key from the body and
//! the fingerprint (`intake/examine.rs`), and turns it into the claim the store will be asked for: scope,
//! key, fingerprint (`key.rs`), lease and time to live. Touches the body budget only.

pub mod examine;
pub mod many;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, Request, header, request};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use uuid::Uuid;

use self::examine::Examiners;
use self::many::Many;
use super::budget::{BodyBudget, ReservedBody};
use super::client_body::{self, GuardedBody, Trailers};
use super::dialect::Dialect;
use super::downstream::Downstream;
use super::key::Presented;
use super::key::client_cert::ClientCert;
use super::key::jwt::{self, Subject, Verified};
use super::trailers::TrailerRules;
use super::{key, signature};
use crate::access;
use crate::config::{Config, DEFAULT_ROUTE, KeySource, Policy, Route, Unscoped};
use crate::error::{Busy, ProxyError};
use crate::jwks::KeySets;
use crate::metrics::Metrics;
use crate::store::{ClaimRequest, RecordId};

/// The intake stage: what reading and examining keyed bodies is bounded by, shared by every worker.
#[derive(Clone)]
pub(crate) struct Intake {
    budget: BodyBudget,
    body_read_timeout: Duration,
    /// Examinations of large keyed bodies (JSON keys and fingerprints) off the workers, one per CPU.
    examiners: Examiners,
    /// How a body's trailers are cleaned.
    trailers: Arc<TrailerRules>,
    /// The key sets bearer tokens are verified with (`scope_jwt`).
    key_sets: Arc<KeySets>,
    /// The tokens verified lately, on every route.
    verified: Arc<Verified>,
    metrics: Metrics,
}

/// A keyed request taken in, as the keyed task owns it from here to its end and lends it to each stage:
/// the route, the claim to send (scope, key, fingerprint, lease, time to live), the dialect it speaks
/// (with what a replay must answer), who sent it, and the request itself, its body read whole (holding
/// its share of the budget until it has gone upstream).
pub(crate) struct Ticket {
    /// The route it took, whose policy it runs under.
    pub(crate) route: Arc<Route>,
    /// The claim, with the lease and time to live it is made under.
    pub(crate) claim: ClaimRequest,
    /// The protocol it speaks.
    pub(crate) dialect: Dialect,
    /// Who sent it.
    pub(crate) peer: Downstream,
    /// The request line and headers.
    pub(crate) parts: request::Parts,
    /// The body, read whole.
    pub(crate) body: ReservedBody,
}

/// What a request taken in comes to.
pub(crate) enum Taken {
    /// A keyed request, for the keyed task.
    One(Ticket),
    /// A request that carries many keys (a JSON-RPC batch, a GraphQL mutation), for the keyed task.
    Many(Many),
    /// A request without a key, forwarded as it came.
    Unkeyed(Unkeyed),
}

/// A request whose key comes from its body, which holds none, on a route where keys are optional: it is
/// forwarded unprotected with the body already read.
pub(crate) struct Unkeyed {
    pub(crate) parts: request::Parts,
    pub(crate) body: ReservedBody,
}

impl Intake {
    /// The intake stage as `config` sets it, drawing on the process's body budget and examiners
    /// (`pools`), which every generation of the request path shares.
    pub(crate) fn new(
        config: &Config,
        metrics: Metrics,
        (trailers, key_sets): (Arc<TrailerRules>, Arc<KeySets>),
        (budget, examiners): (BodyBudget, Examiners),
    ) -> Intake {
        Intake {
            budget,
            body_read_timeout: config.server.body_read_timeout,
            examiners,
            trailers,
            key_sets,
            verified: Arc::default(),
            metrics,
        }
    }

    /// Takes in a request its route protects: scope check, body, then the claim it will make. `key` is
    /// the key when its source is in the head; a key taken from the body is read after the body. The
    /// scope is checked as soon as the request must be keyed: before the body for a key in the head, or
    /// on a route that reads its key from the body and requires one (a request that names no client is
    /// refused without waiting for its body); once the body holds a key where keys are optional, so that
    /// a request without a key goes to the app as it came, credential or not (an MCP client's first
    /// call, sent without a token to learn where to get one, gets the app's own `401`). `peer`'s
    /// connection is told when the body waits for its client; `dialect` is what the request's head
    /// speaks.
    pub(crate) async fn take(
        &self,
        request: Request<Incoming>,
        route: Arc<Route>,
        key: Option<String>,
        (peer, dialect): (&Downstream, Dialect),
    ) -> Result<Taken, ProxyError> {
        // A keyless request on a header-keyed route comes here only to have its signature verified.
        let scope_first =
            key.is_some() || (route.policy.key.source.needs_body() && route.policy.key.required);
        if scope_first {
            check_scope(
                &route,
                (request.headers(), request.extensions().get::<ClientCert>()),
            )?;
        }
        // A key from the head: the token is verified before the body is waited for. A key from the body
        // has it verified once the body holds one: a request without a key is the app's to judge.
        let by_token = route.policy.key.scope_jwt.is_some();
        let mut subject = match key {
            Some(_) if by_token => self.subject(&route, request.headers()).await?,
            _ => None,
        };
        let (parts, body) = request.into_parts();
        let body = self.read_body(&route.policy, &parts, body, peer).await?;
        signature::check(&route.policy, &parts.headers, &body.bytes, &self.metrics).await?;
        let examined = examine::examine(&self.examiners, route.clone(), parts, body, key).await?;
        let (parts, body) = (examined.parts, examined.body);
        let dialect = dialect.called(examined.call);
        if let Some(items) = examined.many {
            if !scope_first {
                check_scope(&route, (&parts.headers, parts.extensions.get::<ClientCert>()))?;
            }
            if by_token && subject.is_none() {
                subject = self.subject(&route, &parts.headers).await?;
            }
            let presented = Presented {
                cert: parts.extensions.get::<ClientCert>(),
                subject: subject.as_ref(),
            };
            let scope = key::scope_with(&route.scope, &route.policy.key, &parts.headers, presented);
            return Ok(Taken::Many(Many {
                route,
                scope,
                peer: peer.clone(),
                parts,
                body,
                items,
            }));
        }
        let Some((key, fingerprint)) = examined.keyed else {
            if route.policy.key.required && !examined.passes {
                return Err(ProxyError::MissingKey(key::source::describe(
                    &route.policy.key.source,
                )));
            }
            return Ok(Taken::Unkeyed(Unkeyed { parts, body }));
        };
        if !scope_first {
            check_scope(&route, (&parts.headers, parts.extensions.get::<ClientCert>()))?;
        }
        if by_token && subject.is_none() {
            subject = self.subject(&route, &parts.headers).await?;
        }
        // The window is held again at the claim: the body may have taken up to `body_read_timeout` (and
        // the wait for the budget) to come, and a retry let in at the window's end and claimed after it
        // could find the first attempt's record expired and run again.
        if route.policy.key.source == KeySource::Repeatability {
            let window = route.policy.key.repeatability_window;
            key::repeatability::check_first_sent(&parts.headers, window, SystemTime::now())?;
        }
        let claim = claim_request(&route, &parts, (key, fingerprint), subject.as_ref());
        access::key(|| claim.id.key_hash());
        Ok(Taken::One(Ticket {
            route,
            claim,
            dialect,
            peer: peer.clone(),
            parts,
            body,
        }))
    }

    /// The client a keyed request's bearer token names, verified, on a `scope_jwt` route: `None` on
    /// other routes and for a request with no bearer token (the scope check has had its say on that).
    async fn subject(&self, route: &Route, headers: &HeaderMap) -> Result<Option<Subject>, ProxyError> {
        let Some(rules) = &route.policy.key.scope_jwt else {
            return Ok(None);
        };
        let set = self
            .key_sets
            .get(&rules.source)
            .ok_or(ProxyError::KeysUnavailable)?;
        // On the heap: the verification (and a read of the set it may wait for) would otherwise make
        // every keyed request's intake future larger, copied as it is polled, on routes without it too.
        Box::pin(jwt::subject((rules, set, &self.verified), &route.name, headers)).await
    }

    /// Takes in a request its route does not protect but whose signature it checks: its body, read whole
    /// as a keyed one is, then the signature. Nothing is keyed or claimed.
    pub(crate) async fn verify(
        &self,
        request: Request<Incoming>,
        route: &Route,
        peer: &Downstream,
    ) -> Result<Unkeyed, ProxyError> {
        let (parts, body) = request.into_parts();
        let body = self.read_body(&route.policy, &parts, body, peer).await?;
        signature::check(&route.policy, &parts.headers, &body.bytes, &self.metrics).await?;
        Ok(Unkeyed { parts, body })
    }

    /// Reads a keyed request's body whole (its fingerprint must be known before the claim), refusing
    /// anything over `max_request_body` as early as its declared length allows, or as soon as the bytes
    /// received pass it, and anything that takes longer than `server.body_read_timeout` to arrive. Room
    /// for the body is reserved from the shared body budget first; 503 when none comes in that time.
    /// A body is whole or not at all: one the client abandoned (an HTTP/2 stream reset before its end)
    /// or whose length is not its `content-length` is refused, so nothing is claimed for it.
    async fn read_body(
        &self,
        policy: &Policy,
        parts: &request::Parts,
        body: Incoming,
        peer: &Downstream,
    ) -> Result<ReservedBody, ProxyError> {
        let limit = policy.key.max_request_body;
        let too_large = ProxyError::RequestTooLarge { limit };
        let declared = parts
            .headers
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
        let trailers = Trailers::of(&self.trailers, &parts.headers);
        let mut body = GuardedBody::whole(body, (parts.version, trailers), peer.body_watch());
        let reading = tokio::time::timeout(self.body_read_timeout, Limited::new(&mut body, limit).collect());
        let (bytes, trailers) = match reading.await {
            Ok(Ok(collected)) => {
                let trailers = collected.trailers().cloned();
                (collected.to_bytes(), trailers)
            }
            Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large),
            Ok(Err(e)) => return Err(body.error().unwrap_or(ProxyError::ClientBody(e.to_string()))),
            Err(_) => return Err(ProxyError::RequestTimeout(self.body_read_timeout)),
        };
        client_body::check_length(declared, bytes.len())?;
        reservation.shrink_to(bytes.len());
        Ok(ReservedBody::new(bytes, reservation).with_trailers(trailers))
    }
}

/// Refuses a keyed request that names no client in any scope header or the scope cookie (unless scopes
/// may be shared): without one, every such client would share one scope, and one client's key would
/// answer another's.
fn check_scope(
    route: &Route,
    (headers, client): (&HeaderMap, Option<&ClientCert>),
) -> Result<(), ProxyError> {
    let policy = &route.policy;
    if policy.key.unscoped == Unscoped::Shared || key::has_scope_with(&policy.key, headers, client) {
        return Ok(());
    }
    Err(ProxyError::MissingScope(scope_setting(route, policy)))
}

/// The scope setting a refused request did not satisfy, as the `missing-scope` detail names it.
fn scope_setting(route: &Route, policy: &Policy) -> String {
    let mut names: Vec<String> = policy
        .key
        .scope_headers
        .iter()
        .map(HeaderName::as_str)
        .map(str::to_owned)
        .collect();
    if let Some(cookie) = &policy.key.scope_cookie {
        names.push(format!("cookie {cookie}"));
    }
    if policy.key.scope_client_cert {
        names.push("a TLS client certificate".to_owned());
    }
    if policy.key.scope_jwt.is_some() {
        names.push("a bearer token (scope_jwt)".to_owned());
    }
    let names = names.join(", ");
    match route.name.as_str() {
        DEFAULT_ROUTE => format!("idempotency.scope_headers ({names})"),
        name => format!("the scope headers of route {name:?} ({names})"),
    }
}

fn claim_request(
    route: &Route,
    parts: &request::Parts,
    (key, fingerprint): (String, [u8; 32]),
    subject: Option<&Subject>,
) -> ClaimRequest {
    let policy = &route.policy;
    let presented = Presented {
        cert: parts.extensions.get::<ClientCert>(),
        subject,
    };
    ClaimRequest {
        id: RecordId {
            scope: key::scope_with(&route.scope, &policy.key, &parts.headers, presented),
            key,
            token: Uuid::new_v4(),
        },
        fingerprint,
        lease: policy.claim.lock_timeout,
        ttl: policy.claim.ttl,
    }
}
