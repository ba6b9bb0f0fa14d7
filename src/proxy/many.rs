//! A request that carries many keys, on the keyed task (`keyed.rs`): a JSON-RPC batch whose calls carry
//! keys of their own (`many/jsonrpc.rs`), or a GraphQL mutation whose root fields are marked
//! `@idempotent` (`many/graphql.rs`). Each keyed item is claimed on its own, as an ordinary record
//! (lease, heartbeat, takeover, fence) under the request's scope, so an item another request already
//! completed is answered from the store and one in flight as the route's `on_in_flight` says; an item
//! whose key repeats an earlier item's of the same request is answered as that item is (a replay of it),
//! or refused as a reuse when the two differ. Only the items this request won, and the unkeyed ones, go
//! upstream, as the protocol sends them (one batch; one operation per field); each item's record is
//! completed, released or held as its own answer says, and whoever waits for it is told (`settle.rs`).
//! The client gets one answer, merged in its order.
//!
//! A store that does not answer a claim leaves the whole request to `on_store_error`, as for a lone
//! request: what this request won so far is given back first.

pub mod graphql;
pub mod jsonrpc;

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode, header, request};
use http_body_util::{BodyExt, Limited};
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::answer::Answer;
use super::budget::ReservedBody;
use super::claim::{Attempt, Claims, Decision, decide};
use super::dialect::{Dialect, OnHead};
use super::downstream::Downstream;
use super::execute::heartbeat::Heartbeat;
use super::execute::{Executor, Fate, ItemWrite};
use super::passthrough::Forward;
use super::permit::KeyedPermit;
use super::settle::Settle;
use crate::body::ProxyBody;
use crate::config::{OnUnknownOutcome, Route};
use crate::error::ProxyError;
use crate::headers::ATTEMPT_HEADER;
use crate::metrics::{Metrics, Outcome, RouteSeries};
use crate::store::wake::{RecordTag, Waiters};
use crate::store::{ClaimRequest, ClaimResult, Existing, RecordId, StoreError, StoreHandle, StoredResponse};

/// The most bytes an upstream answer to one exchange may have: it is read whole, to be taken apart.
const MAX_ANSWER: u64 = 64 * 1024 * 1024;

/// A request that carries many keys, taken in: its route, its scope, who sent it, its head and body, and
/// its items in the client's order.
pub(crate) struct Many {
    pub(crate) route: Arc<Route>,
    /// The scope every item's key is claimed in (the request's).
    pub(crate) scope: String,
    pub(crate) peer: Downstream,
    pub(crate) parts: request::Parts,
    /// The client's body, whole, holding its share of the body budget (and what the items took).
    pub(crate) body: ReservedBody,
    pub(crate) items: Items,
}

/// The items of a request that carries many keys.
pub(crate) enum Items {
    /// A JSON-RPC batch's calls.
    JsonRpc(Vec<jsonrpc::Call>),
    /// A GraphQL mutation's root fields, each an operation of its own.
    GraphQl(Vec<graphql::Field>),
}

/// An item's key and fingerprint, where it has a key.
pub(crate) type ItemKey = Option<(String, [u8; 32])>;

impl Items {
    fn keys(&self) -> Vec<&ItemKey> {
        match self {
            Items::JsonRpc(calls) => calls.iter().map(|call| &call.keyed).collect(),
            Items::GraphQl(fields) => fields.iter().map(|field| &field.keyed).collect(),
        }
    }
}

/// What an item's claim came to.
pub(crate) enum Claimed {
    /// No key: it goes upstream every time.
    Unkeyed,
    /// This request holds its key: it goes upstream.
    Won(Won),
    /// Its key completed before: answered with the stored answer.
    Replayed(StoredResponse),
    /// Its key is the one of the item at this index of the same request, with the same fingerprint:
    /// answered as that item is.
    Repeat(usize),
    /// Refused: in flight elsewhere, reused with another request, held, or not claimed in time.
    Refused(ProxyError),
}

/// A key this request holds for one of its items: the record, fenced by its token, and its heartbeat.
pub(crate) struct Won {
    pub(crate) id: RecordId,
    pub(crate) attempt: Attempt,
    beat: BeatTask,
}

/// An item's heartbeat, on a task of its own (their number varies as the claims are won), stopped when
/// the item's record is written or the request's task ends.
struct BeatTask(AbortHandle);

impl Drop for BeatTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// An upstream exchange's end, as far as its items are concerned.
pub(crate) enum Exchanged {
    /// A whole answer: its status, headers and body.
    Answered {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    /// Not processed (never delivered, or a status the route releases): the items are given back, and
    /// answered with this error; `answer` is the upstream's own, if it gave one.
    Released(ProxyError, Option<(StatusCode, HeaderMap, Bytes)>),
    /// The upstream may have acted without a whole answer coming back: the error its items answer, and
    /// why, for the log.
    Unknown(ProxyError, String),
}

/// The stage: what claiming, forwarding and settling the items touches (the claim stage's parts, and
/// who is told of a settlement).
pub(crate) struct ManyKeys<'a> {
    store: &'a StoreHandle,
    executor: &'a Executor,
    forward: &'a Forward,
    waiters: &'a Arc<Waiters>,
    metrics: &'a Metrics,
    claims: &'a Claims,
    settle: &'a Settle,
}

/// One request's run: the stage, and what every item shares.
pub(crate) struct Run<'a> {
    stage: &'a ManyKeys<'a>,
    pub(crate) route: &'a Arc<Route>,
    /// What every problem `type` URI starts with.
    base: &'a str,
    peer: &'a Downstream,
    parts: &'a request::Parts,
    series: &'a RouteSeries,
}

impl<'a> ManyKeys<'a> {
    /// The stage over the claim stage's parts and `settle`.
    pub(crate) fn new(claims: &'a Claims, settle: &'a Settle) -> ManyKeys<'a> {
        let (store, executor, forward, waiters, metrics) = claims.parts();
        ManyKeys {
            store,
            executor,
            forward,
            waiters,
            metrics,
            claims,
            settle,
        }
    }

    /// Runs `many` to its end, answering through `answer`, under `permit`; its items are counted in
    /// `series` by what each came to.
    pub(crate) async fn run(
        &self,
        many: Many,
        answer: Answer,
        (permit, series, base): (KeyedPermit, Arc<RouteSeries>, &str),
    ) {
        let _permit = permit;
        let Many {
            route,
            scope,
            peer,
            parts,
            body,
            items,
        } = many;
        let claimed = match self.claim_all(&route, &scope, &items.keys()).await {
            Ok(claimed) => claimed,
            Err(error) => {
                let forward = Box::pin(self.forward.store_down(parts, body, &peer, error));
                answer.send(forward.await);
                return;
            }
        };
        let run = Run {
            stage: self,
            route: &route,
            base,
            peer: &peer,
            parts: &parts,
            series: &series,
        };
        let handled = match items {
            Items::JsonRpc(calls) => jsonrpc::run(&run, body, calls, claimed).await,
            Items::GraphQl(fields) => graphql::run(&run, body, fields, claimed).await,
        };
        answer.send(handled);
    }

    /// Claims every keyed item in the client's order. A store that does not answer gives back what was
    /// won and leaves the request to `on_store_error` (its error).
    async fn claim_all(
        &self,
        route: &Arc<Route>,
        scope: &str,
        keys: &[&ItemKey],
    ) -> Result<Vec<Claimed>, StoreError> {
        let policy = &route.policy;
        let deadline = Instant::now() + policy.claim.wait_timeout;
        let mut claimed: Vec<Claimed> = Vec::with_capacity(keys.len());
        for (n, keyed) in keys.iter().enumerate() {
            let Some((key, fingerprint)) = keyed else {
                claimed.push(Claimed::Unkeyed);
                continue;
            };
            let earlier = keys[..n]
                .iter()
                .position(|other| other.as_ref().is_some_and(|(k, _)| k == key));
            if let Some(earlier) = earlier {
                let same = keys[earlier].as_ref().is_some_and(|(_, f)| f == fingerprint);
                claimed.push(match same {
                    true => Claimed::Repeat(earlier),
                    false => Claimed::Refused(ProxyError::KeyReused),
                });
                continue;
            }
            let claim = ClaimRequest {
                id: RecordId {
                    scope: scope.to_owned(),
                    key: key.clone(),
                    token: uuid::Uuid::new_v4(),
                },
                fingerprint: *fingerprint,
                lease: policy.claim.lock_timeout,
                ttl: policy.claim.ttl,
            };
            match self.claim_one(route, claim, deadline).await {
                Ok(item) => claimed.push(item),
                Err(error) => {
                    self.give_back_all(route, claimed).await;
                    return Err(error);
                }
            }
        }
        Ok(claimed)
    }

    /// One item's claim; on a route that waits, a key in flight is claimed again each time its record
    /// settles (or its lease runs out) until `deadline`, the request's `wait_timeout`.
    async fn claim_one(
        &self,
        route: &Route,
        claim: ClaimRequest,
        deadline: Instant,
    ) -> Result<Claimed, StoreError> {
        let policy = &route.policy;
        let waits = policy.claim.on_in_flight.waits();
        let mut waiter = waits.then(|| {
            self.waiters
                .wait_for(RecordTag::of(&claim.id.scope, &claim.id.key))
        });
        loop {
            if let Some(waiter) = &mut waiter {
                waiter.mark_seen();
            }
            let sent = Instant::now();
            let result = match self.store.claim(&claim).await {
                Ok(result) => result,
                Err(StoreError::Undecryptable(_)) => {
                    return Ok(Claimed::Refused(ProxyError::RecordUnreadable));
                }
                Err(error) => {
                    // Not open yet: it was never sent, so there is nothing to give back.
                    if !matches!(error, StoreError::NotOpen) {
                        self.claims.orphaned(&claim);
                    }
                    return Err(error);
                }
            };
            if let (
                Some(waiter),
                ClaimResult::Held(Existing::Processing {
                    same_fingerprint: true,
                    lease_remaining,
                }),
            ) = (&mut waiter, &result)
                && Instant::now() < deadline
            {
                let until = (Instant::now() + *lease_remaining).min(deadline);
                tokio::select! {
                    () = waiter.woken() => {}
                    () = tokio::time::sleep_until(until) => {}
                }
                continue;
            }
            let hint = policy.claim.in_flight_retry_after;
            return Ok(match decide(result, &claim.id, hint, self.metrics) {
                Ok(Decision::Execute(..)) if sent.elapsed() > claim.lease / 2 => {
                    // Its heartbeat could come after the lease ran out: given back, as a lone claim is.
                    tracing::warn!(key_hash = %claim.id.key_hash(), "claim answered after more than half its lease; given back");
                    self.executor
                        .write_item(&claim.id, claim.lease, ItemWrite::Release)
                        .await;
                    self.settle.settled(route, &claim.id).await;
                    Claimed::Refused(ProxyError::StoreUnavailable(
                        "the claim was answered too late".into(),
                    ))
                }
                Ok(Decision::Execute(attempt, _)) => Claimed::Won(self.won(claim, attempt)),
                Ok(Decision::Replay(stored, _)) => Claimed::Replayed(stored),
                Err(refusal) => Claimed::Refused(refusal),
            });
        }
    }

    /// A won item, its heartbeat started.
    fn won(&self, claim: ClaimRequest, attempt: Attempt) -> Won {
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let (id, lease) = (claim.id.clone(), claim.lease);
        let task = tokio::spawn(async move {
            Heartbeat::new(&store, &id, lease, &metrics).beat().await;
        });
        Won {
            id: claim.id,
            attempt,
            beat: BeatTask(task.abort_handle()),
        }
    }

    /// Gives back every item won so far, and tells whoever waits for them.
    async fn give_back_all(&self, route: &Route, claimed: Vec<Claimed>) {
        for item in claimed {
            if let Claimed::Won(won) = item {
                drop(won.beat);
                self.executor
                    .write_item(&won.id, route.policy.claim.lock_timeout, ItemWrite::Release)
                    .await;
                self.settle.settled(route, &won.id).await;
            }
        }
    }
}

impl Run<'_> {
    /// Sends `body` upstream with the request's head, as a keyed request's body goes (`attempt` is the
    /// `Idempotency-Attempt` of the first item it carries, where any), and reads the answer whole.
    pub(crate) async fn exchange(&self, body: ReservedBody, attempt: Option<Attempt>) -> Exchanged {
        let executor = &self.stage.executor;
        let mut request = executor.request(head(self.parts), body, (self.peer, &Dialect::Http));
        if let Some(attempt) = attempt {
            request
                .headers_mut()
                .insert(ATTEMPT_HEADER, attempt.header_value());
        }
        let response = match executor.upstream().send(request).await {
            Ok(response) => response,
            Err(failure) if failure.never_delivered() => {
                return Exchanged::Released(failure.into_error(), None);
            }
            Err(failure) => {
                let error = failure.into_error();
                let why = error.to_string();
                return Exchanged::Unknown(error, why);
            }
        };
        let rules = &self.route.policy.store;
        let (status, headers) = (response.status(), response.headers().clone());
        let decided = Dialect::Http.on_head(rules, status, &headers);
        let limit = usize::try_from(MAX_ANSWER).unwrap_or(usize::MAX);
        let reading = tokio::time::timeout(
            executor.upstream().timeout(),
            Limited::new(response.into_body(), limit).collect(),
        );
        let body = match reading.await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(error)) => {
                let why = format!("upstream body broke off: {error}");
                return Exchanged::Unknown(ProxyError::UpstreamBroken(why.clone()), why);
            }
            Err(_) => {
                let timeout = executor.upstream().timeout();
                return Exchanged::Unknown(
                    ProxyError::UpstreamTimeout(timeout),
                    "upstream body timed out".into(),
                );
            }
        };
        match decided {
            OnHead::Relay => Exchanged::Answered {
                status,
                headers,
                body,
            },
            OnHead::Release => Exchanged::Released(
                ProxyError::UpstreamUnreachable(format!("the service answered {status}")),
                Some((status, headers, body)),
            ),
            OnHead::Unknown(why) => Exchanged::Unknown(ProxyError::UpstreamInvalidResponse(status), why),
            OnHead::Refused(error) => {
                let why = error.to_string();
                Exchanged::Unknown(error, why)
            }
        }
    }

    /// Writes what became of a won item's record, stops its heartbeat, tells whoever waits for it, and
    /// counts the item (executed, or as `refused` says for one answered with the proxy's error).
    pub(crate) async fn settle(&self, won: Won, write: ItemWrite<'_>) -> Fate {
        drop(won.beat);
        let lease = self.route.policy.claim.lock_timeout;
        let fate = self.stage.executor.write_item(&won.id, lease, write).await;
        if fate.wakes() {
            self.stage.settle.settled(self.route, &won.id).await;
        }
        fate
    }

    /// Whether an unknown outcome holds the item's key (`on_unknown_outcome = "hold"`).
    pub(crate) fn holds_unknown(&self) -> bool {
        self.route.policy.store.on_unknown_outcome == OnUnknownOutcome::Hold
    }

    /// The largest answer an item's record keeps.
    pub(crate) fn max_stored(&self) -> usize {
        usize::try_from(self.route.policy.store.max_stored_response).unwrap_or(usize::MAX)
    }

    /// The problem object a lone request refused with `error` would have had.
    pub(crate) fn problem(&self, error: &ProxyError) -> serde_json::Value {
        error.problem(self.base, &self.route.policy.statuses)
    }

    /// Counts one keyed item by how it ended.
    pub(crate) fn count(&self, outcome: Outcome) {
        self.series.record(outcome);
    }
}

/// A copy of the request's head, for one exchange of many.
fn head(parts: &request::Parts) -> request::Parts {
    let mut copy = http::Request::new(()).into_parts().0;
    copy.method = parts.method.clone();
    copy.uri = parts.uri.clone();
    copy.version = parts.version;
    copy.headers = parts.headers.clone();
    copy
}

/// The merged answer's response: `status`, `content_type`, and the body.
pub(crate) fn respond(status: StatusCode, content_type: &'static str, body: Vec<u8>) -> Response<ProxyBody> {
    let mut response = Response::new(crate::body::full(body));
    *response.status_mut() = status;
    if !content_type.is_empty() {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, http::HeaderValue::from_static(content_type));
    }
    response
}

/// The outcome a request that carries many keys is counted as, as a whole: executed when anything of it
/// went upstream, else replayed when every keyed item was, else as its first refusal.
pub(crate) fn overall(sent: bool, claimed: &[Claimed]) -> Outcome {
    if sent {
        return Outcome::Executed;
    }
    claimed
        .iter()
        .find_map(|item| match item {
            Claimed::Refused(error) => Some(error.outcome()),
            _ => None,
        })
        .unwrap_or(Outcome::Replayed)
}

/// A stored answer as this request's item gets it: its body, or the refusal of one not retained.
pub(crate) fn stored_body(stored: &StoredResponse) -> Result<&Bytes, ProxyError> {
    stored.body.as_ref().ok_or(ProxyError::ResponseNotRetained {
        status: stored.status,
    })
}

/// The record of an item's answer: `status`, the answer's content type, and `body` unless it is over
/// `max` bytes (then kept without it, as a lone response over `max_stored_response` is).
pub(crate) fn record(
    status: StatusCode,
    content_type: Option<&http::HeaderValue>,
    body: Bytes,
    max: usize,
) -> StoredResponse {
    let headers = content_type
        .map(|value| {
            vec![(
                header::CONTENT_TYPE.as_str().to_owned(),
                value.as_bytes().to_vec(),
            )]
        })
        .unwrap_or_default();
    StoredResponse {
        status: status.as_u16(),
        headers,
        body: (body.len() <= max).then_some(body),
    }
}
