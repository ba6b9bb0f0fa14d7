//! What the items of a request that carries many keys come to (`many.rs` claims them), and what the
//! protocol halves beside this file share to run the ones left and answer: [`Run`], one request's
//! exchange with the upstream, the writes of its items' records and their counting, and the answers'
//! pieces.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode, header, request};
use http_body_util::BodyExt;
use tokio::task::AbortHandle;

use crate::body::ProxyBody;
use crate::config::{OnUnknownOutcome, Route};
use crate::error::ProxyError;
use crate::headers::ATTEMPT_HEADER;
use crate::metrics::{Outcome, RouteSeries};
use crate::proxy::budget::ReservedBody;
use crate::proxy::claim::Attempt;
use crate::proxy::dialect::{Dialect, OnHead};
use crate::proxy::downstream::Downstream;
use crate::proxy::execute::{Executor, Fate, ItemWrite, capture};
use crate::proxy::settle::Settle;
use crate::store::{RecordId, StoredResponse};

/// The most bytes an upstream answer to one exchange may have, whatever it carries: it is read whole, to
/// be taken apart, its bytes charged to `server.max_buffered_responses` as a capture's are.
const MAX_ANSWER: usize = 64 * 1024 * 1024;

/// How many of a request's claim statements, or of its items' writes, are in flight at once.
pub(crate) const CLAIMS_AT_ONCE: usize = 32;

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
    /// In flight elsewhere, on a route that waits: claimed again once this request's other items are
    /// done (so it never waits while holding keys another request may wait for). The claim, and the
    /// lease left on the record.
    Pending(crate::store::ClaimRequest, std::time::Duration),
    /// Answered in an earlier round.
    Done,
}

impl Claimed {
    /// Whether it goes upstream in this round.
    pub(crate) fn is_sent(&self) -> bool {
        matches!(self, Claimed::Unkeyed | Claimed::Won(_))
    }

    /// Whether a round answers it (else it waits for a later one, or is a repeat, answered last).
    pub(crate) fn is_answered_now(&self) -> bool {
        matches!(
            self,
            Claimed::Unkeyed | Claimed::Won(_) | Claimed::Replayed(_) | Claimed::Refused(_)
        )
    }
}

/// A key this request holds for one of its items: the record, fenced by its token, and its heartbeat.
pub(crate) struct Won {
    pub(crate) id: RecordId,
    pub(crate) attempt: Attempt,
    beat: BeatTask,
}

impl Won {
    /// A won item whose heartbeat runs as the task `beat`, stopped when the item is settled.
    pub(crate) fn new(id: RecordId, attempt: Attempt, beat: AbortHandle) -> Won {
        Won {
            id,
            attempt,
            beat: BeatTask(beat),
        }
    }
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
    /// A whole answer: its status, headers and body, and its share of the response budget.
    Answered {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
        _held: capture::Reservation,
    },
    /// An answer to store over [`MAX_ANSWER`], or over what the response budget had room for: the
    /// service ran the items and answered, but the answer could not be taken apart. Its items are
    /// completed without their answers, as a lone response over `max_stored_response` is.
    TooLarge { status: StatusCode, headers: HeaderMap },
    /// Not processed (never delivered, or a status the route releases): the items are given back, and
    /// answered with this error; `answer` is the upstream's own, if it gave one.
    Released(ProxyError, Option<(StatusCode, HeaderMap, Bytes)>),
    /// The upstream may have acted without a whole answer coming back: the error its items answer, and
    /// why, for the log.
    Unknown(ProxyError, String),
}

impl Exchanged {
    /// How an item it carried counts: executed when the service answered (even with a status that gives
    /// the key back), else as its error.
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            Exchanged::Answered { .. } | Exchanged::TooLarge { .. } | Exchanged::Released(_, Some(_)) => {
                Outcome::Executed
            }
            Exchanged::Released(error, None) | Exchanged::Unknown(error, _) => error.outcome(),
        }
    }
}

/// One request's run: what every item shares, and what its exchanges and writes go through.
pub(crate) struct Run<'a> {
    pub(crate) executor: &'a Executor,
    pub(crate) settle: &'a Settle,
    pub(crate) route: &'a Arc<Route>,
    /// The scope its keys are claimed in, whose share of the response budget its answers take.
    pub(crate) scope: &'a str,
    /// What every problem `type` URI starts with.
    pub(crate) base: &'a str,
    pub(crate) peer: &'a Downstream,
    pub(crate) parts: &'a request::Parts,
    pub(crate) series: &'a RouteSeries,
}

impl Run<'_> {
    /// Sends `body` upstream with the request's head, as a keyed request's body goes (`attempt` is the
    /// `Idempotency-Attempt` of the first item it carries, where any), and reads the answer to its
    /// `items` whole, up to `max_stored_response` for each (and [`MAX_ANSWER`] in all): a longer answer
    /// is read no further, and its items' outcome is unknown.
    pub(crate) async fn exchange(
        &self,
        body: ReservedBody,
        attempt: Option<Attempt>,
        salvage: Salvage,
    ) -> Exchanged {
        let executor = self.executor;
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
        let timeout = executor.upstream().timeout();
        let mut held = executor.answer_hold(self.scope);
        // Room in the response budget is waited for as long as half the upstream's time allows: an
        // answer it cannot hold is completed without it, and lost to the client too.
        let patience = (timeout / 2).max(held.patience());
        let reading = tokio::time::timeout(timeout, read_whole(response.into_body(), &mut held, patience));
        let body = match reading.await {
            Ok(Ok(Some(body))) => body,
            Ok(Ok(None)) => {
                return match decided {
                    OnHead::Relay => Exchanged::TooLarge { status, headers },
                    OnHead::Release => Exchanged::Released(released(status), None),
                    OnHead::Unknown(why) => {
                        Exchanged::Unknown(ProxyError::UpstreamInvalidResponse(status), why)
                    }
                    OnHead::Refused(error) => {
                        let why = error.to_string();
                        Exchanged::Unknown(error, why)
                    }
                };
            }
            // An event stream's whole events came before it broke: their responses stand (the items
            // without one are unknown).
            Ok(Err((_, partial)))
                if salvage == Salvage::EventStream
                    && matches!(decided, OnHead::Relay)
                    && status.is_success()
                    && crate::proxy::dialect::sse::is_event_stream(&headers) =>
            {
                partial
            }
            Ok(Err((error, _))) => {
                let why = format!("upstream body broke off: {error}");
                return Exchanged::Unknown(ProxyError::UpstreamBroken(why.clone()), why);
            }
            Err(_) => {
                let why = "upstream body timed out".to_owned();
                return Exchanged::Unknown(ProxyError::UpstreamTimeout(timeout), why);
            }
        };
        match decided {
            OnHead::Relay => Exchanged::Answered {
                status,
                headers,
                body,
                _held: held,
            },
            OnHead::Release => Exchanged::Released(released(status), Some((status, headers, body))),
            OnHead::Unknown(why) => Exchanged::Unknown(ProxyError::UpstreamInvalidResponse(status), why),
            OnHead::Refused(error) => {
                let why = error.to_string();
                Exchanged::Unknown(error, why)
            }
        }
    }

    /// Writes what became of a won item's record, stops its heartbeat, tells whoever waits for it, and
    /// counts the item (executed, or as `refused` says for one answered with the proxy's error).
    pub(crate) async fn settle(&self, won: &Won, write: &ItemWrite<'_>) -> Fate {
        won.beat.0.abort();
        let lease = self.route.policy.claim.lock_timeout;
        let hold = self.route.policy.store.on_unknown_outcome == OnUnknownOutcome::Hold;
        let fate = self.executor.write_item(&won.id, (lease, hold), write).await;
        if fate.wakes() {
            self.settle.settled(self.route, &won.id).await;
        }
        fate
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

/// The outcome a request that carries many keys is counted as, as a whole, from its rounds: executed
/// when anything of it went upstream (`sent`), else replayed when every keyed item was, else as its
/// first refusal (`refused`).
pub(crate) fn overall(sent: bool, refused: Option<Outcome>) -> Outcome {
    match (sent, refused) {
        (true, _) => Outcome::Executed,
        (false, Some(outcome)) => outcome,
        (false, None) => Outcome::Replayed,
    }
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

/// The error items answer when the service answered with a status the route releases.
fn released(status: StatusCode) -> ProxyError {
    ProxyError::UpstreamUnreachable(format!("the service answered {status}"))
}

/// Whether an answer that breaks off keeps what came before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Salvage {
    /// Nothing: the items' outcome is unknown.
    Nothing,
    /// An event stream's whole events (a JSON-RPC batch answered as MCP's Streamable HTTP does).
    EventStream,
}

/// `body` read whole, each frame charged to `held` first (waiting for room up to `patience` in all, as
/// a capture does); `None` once it passes [`MAX_ANSWER`] or the budget stays without room (read no
/// further). A body that breaks off: its error, and what came before.
async fn read_whole<B>(
    mut body: B,
    held: &mut capture::Reservation,
    mut patience: std::time::Duration,
) -> Result<Option<Bytes>, (B::Error, Bytes)>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    let mut whole = bytes::BytesMut::new();
    let mut waited = false;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Err((error, whole.freeze())),
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if whole.len() + data.len() > MAX_ANSWER {
            return Ok(None);
        }
        if !held.grow(data.len(), (&mut patience, &mut waited)).await {
            return Ok(None);
        }
        whole.extend_from_slice(&data);
    }
    Ok(Some(whole.freeze()))
}
