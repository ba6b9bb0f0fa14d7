//! A JSON-RPC batch whose calls carry keys of their own, once its calls are claimed (`many.rs`): the
//! calls left to run (won, and those without a key, notifications included) go upstream as one batch,
//! each byte for byte, in the client's order; the upstream's answers are found by `id`
//! (`dialect/jsonrpc/batch.rs`), each stored as its call's record, and merged with the replays and the
//! proxy's own errors into one batch answer in the client's order, each under the client's `id`.
//!
//! What each won call's record becomes:
//! - the batch answered (2xx, as a JSON array or an event stream of responses): its response, stored as
//!   the same call alone would have it (`200`, JSON, the response object); a notification's `202`. A call
//!   the answer has no response for may have run: its outcome is unknown (held or left to its lease, as
//!   `on_unknown_outcome` says). One error for the whole batch (`id` `null`) ran nothing: every key is
//!   given back, and every call answered with that error;
//! - an answer too large to take apart (over 64 MiB, or past the room of `max_buffered_responses`): it
//!   ran; completed without its answer, as a lone answer over `max_stored_response` is;
//! - another status the route stores (a 4xx of the whole batch): that answer, as a lone call's would be;
//! - a status the route releases, or a batch never delivered: given back; one broken off: unknown.
//!
//! The proxy's own answer for a call is a JSON-RPC error under the call's `id`: `code` by what it is
//! ([`code`]), `message` its title, and `data` the problem object a lone call would have had
//! (`type`, `status`, `detail`, `retryable`), with `retryAfter` (seconds) for a key in flight.

use bytes::Bytes;
use http::{StatusCode, header};
use serde_json::Value;

use futures_util::future::join_all;

use super::item::{
    CLAIMS_AT_ONCE, Claimed, Exchanged, Run, Salvage, Won, overall, record, respond, stored_body,
};
use crate::error::ProxyError;
use crate::metrics::Outcome;
use crate::proxy::answer::Handled;
use crate::proxy::budget::ReservedBody;
use crate::proxy::claim::Attempt;
use crate::proxy::dialect::jsonrpc::CallId;
use crate::proxy::dialect::jsonrpc::answer::{is_event_stream, response_as};
use crate::proxy::dialect::jsonrpc::batch::{self, BatchAnswer};
use crate::proxy::execute::ItemWrite;
use crate::proxy::intake::many::Call;
use crate::store::ClaimKind;

/// The JSON-RPC error code of a call whose key is in flight.
pub const KEY_IN_FLIGHT: i64 = -32090;
/// The code of a call whose key was used with another call.
pub const KEY_REUSED: i64 = -32091;
/// The code of a call whose key's outcome is unknown (held).
pub const OUTCOME_UNKNOWN: i64 = -32092;
/// The code of a call the proxy could not run or answer otherwise: the service failed, the store did
/// not answer, its answer was not kept.
pub const NOT_RUN: i64 = -32093;

/// What a call is answered with.
#[derive(Clone)]
enum Reply {
    /// A JSON-RPC response, under the call's own `id`.
    Response(Bytes),
    /// The proxy's error.
    Error(Value),
    /// Nothing: a notification, or a call the service did not answer where it was not keyed.
    Nothing,
}

/// What a batch's rounds have answered so far: each call's reply once it has one, whether anything
/// went upstream, the first refusal, and the first exchange (whose failure answers a batch of
/// notifications).
pub(crate) struct Replies {
    replies: Vec<Option<Reply>>,
    sent: bool,
    refused: Option<Outcome>,
    first: Option<Exchanged>,
}

impl Replies {
    /// No reply yet for `calls` calls.
    pub(crate) fn new(calls: usize) -> Replies {
        Replies {
            replies: vec![None; calls],
            sent: false,
            refused: None,
            first: None,
        }
    }
}

/// One round: the calls this round sends (won, unkeyed) go upstream as one batch, and every call it
/// can answer is answered (sent, replayed, refused), each marked done; pending calls and repeats are
/// left for later. Every record is written before the round ends.
pub(crate) async fn round(
    run: &Run<'_>,
    body: &ReservedBody,
    calls: &[Call],
    claimed: &mut [Claimed],
    replies: &mut Replies,
) {
    let sent: Vec<usize> = (0..calls.len()).filter(|&n| claimed[n].is_sent()).collect();
    let exchanged = match sent.is_empty() {
        true => None,
        false => {
            let joined = batch::join(sent.iter().map(|&n| text(&calls[n])));
            let sent = body.part(joined.into());
            Some(run.exchange(sent, attempt(claimed), Salvage::EventStream).await)
        }
    };
    replies.sent |= exchanged.is_some();
    let read = exchanged.as_ref().and_then(|exchanged| match exchanged {
        Exchanged::Answered {
            status,
            headers,
            body,
            ..
        } if status.is_success() => {
            let event_stream = headers
                .get(header::CONTENT_TYPE)
                .is_some_and(|value| is_event_stream(value.as_bytes()));
            Some(batch::read_answer(body, event_stream))
        }
        _ => None,
    });
    let answered = Answered {
        exchanged: exchanged.as_ref(),
        read: read.as_ref(),
    };
    let mut writes: Vec<(Won, ItemWrite<'_>)> = Vec::new();
    for (n, call) in calls.iter().enumerate() {
        if !claimed[n].is_answered_now() {
            continue;
        }
        let reply = match std::mem::replace(&mut claimed[n], Claimed::Done) {
            Claimed::Unkeyed => unkeyed(run, call, &answered),
            Claimed::Won(won) => {
                let (write, reply) = executed(run, call, &answered);
                writes.push((won, write));
                run.count(answered.exchanged.map_or(Outcome::Executed, Exchanged::outcome));
                reply
            }
            Claimed::Replayed(stored) => {
                run.count(Outcome::Replayed);
                match stored_body(&stored) {
                    Ok(body) => replayed(run, call, stored.status, body),
                    Err(error) => error_reply(run, &error),
                }
            }
            Claimed::Refused(error) => {
                run.count(error.outcome());
                replies.refused = replies.refused.or(Some(error.outcome()));
                error_reply(run, &error)
            }
            Claimed::Repeat(_) | Claimed::Pending(..) | Claimed::Done => continue,
        };
        replies.replies[n] = Some(reply);
    }
    // Every record is written before the client has its answer: a retry sent the moment it is read
    // finds them stored.
    for chunk in writes.chunks(CLAIMS_AT_ONCE) {
        let mut writing = Vec::with_capacity(chunk.len());
        for (won, write) in chunk {
            writing.push(run.settle(won, write));
        }
        join_all(writing).await;
    }
    drop(writes);
    if replies.first.is_none() {
        replies.first = exchanged;
    }
}

/// The batch's answer once its rounds are done: each repeat answered as the call it repeats.
pub(crate) fn finish(run: &Run<'_>, calls: &[Call], claimed: &[Claimed], mut replies: Replies) -> Handled {
    for (n, call) in calls.iter().enumerate() {
        if let Claimed::Repeat(earlier) = claimed[n] {
            run.count(Outcome::Replayed);
            let first = replies.replies[earlier].clone().unwrap_or(Reply::Nothing);
            replies.replies[n] = Some(repeated(run, call, &first));
        }
    }
    let outcome = overall(replies.sent, replies.refused);
    let answered: Vec<Reply> = replies
        .replies
        .into_iter()
        .map(|reply| reply.unwrap_or(Reply::Nothing))
        .collect();
    Ok((answer(run, calls, &answered, replies.first.as_ref()), outcome))
}

/// The `Idempotency-Attempt` the batch goes upstream with: of the calls it carries, the one furthest
/// along (the highest attempt; at the same, a takeover before a retry before a new key), so a service
/// that resumes work it finds taken over (`N;takeover`) is told of any in the batch.
fn attempt(claimed: &[Claimed]) -> Option<Attempt> {
    let rank = |kind: ClaimKind| match kind {
        ClaimKind::New => 0,
        ClaimKind::Retry => 1,
        ClaimKind::Takeover => 2,
    };
    claimed
        .iter()
        .filter_map(|item| match item {
            Claimed::Won(won) => Some(won.attempt),
            _ => None,
        })
        .max_by_key(|attempt| (attempt.number, rank(attempt.kind)))
}

/// What the service answered the batch with: the exchange, and its answer read once where it was a
/// 2xx.
struct Answered<'a> {
    exchanged: Option<&'a Exchanged>,
    read: Option<&'a BatchAnswer>,
}

/// A call repeating the key of an earlier call of the batch: the earlier call's reply under this call's
/// `id`. A notification's reply is nothing; a call with an `id` repeating one gets what a replay of a
/// notification's stored `202` gets.
fn repeated(run: &Run<'_>, call: &Call, earlier: &Reply) -> Reply {
    let Some(id) = &call.id else {
        return Reply::Nothing;
    };
    match earlier {
        Reply::Response(first) => {
            Reply::Response(response_as(first, id).map_or_else(|| first.clone(), Bytes::from))
        }
        Reply::Error(error) => Reply::Error(error.clone()),
        Reply::Nothing => error_reply(run, &service_status(StatusCode::ACCEPTED)),
    }
}

/// The batch's answer: the replies of the calls with an `id`, in the client's order. When there are
/// none (every call a notification): `202` and no body, or, where the service did not take them, its
/// own answer (a `5xx`, a refusal of the batch), or the proxy's refusal, as a lone notification gets.
fn answer(
    run: &Run<'_>,
    calls: &[Call],
    replies: &[Reply],
    exchanged: Option<&Exchanged>,
) -> http::Response<crate::body::ProxyBody> {
    let mut items: Vec<String> = Vec::with_capacity(calls.len());
    for (call, reply) in calls.iter().zip(replies) {
        let Some(id) = &call.id else { continue };
        match reply {
            Reply::Response(text) => items.push(String::from_utf8_lossy(text).into_owned()),
            Reply::Error(error) => items.push(format!(
                r#"{{"jsonrpc":"2.0","id":{},"error":{error}}}"#,
                id.as_json()
            )),
            Reply::Nothing => {}
        }
    }
    if items.is_empty() {
        return match exchanged {
            // Notifications of a batch the service refused whole: its refusal, as it came.
            Some(Exchanged::Answered {
                status,
                headers,
                body,
                ..
            }) if refused_whole_batch(headers, body) => {
                let mut response = respond(*status, "", body.to_vec());
                if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, content_type.clone());
                }
                response
            }
            Some(
                Exchanged::Released(_, Some((status, headers, body)))
                | Exchanged::Answered {
                    status,
                    headers,
                    body,
                    ..
                },
            ) if !status.is_success() => {
                let mut response = respond(*status, "", body.to_vec());
                if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, content_type.clone());
                }
                response
            }
            Some(Exchanged::Released(error, None) | Exchanged::Unknown(error, _)) => {
                let status = error.status_under(&run.route.policy.statuses);
                respond(
                    status,
                    "application/problem+json",
                    run.problem(error).to_string().into_bytes(),
                )
            }
            _ => respond(StatusCode::ACCEPTED, "", Vec::new()),
        };
    }
    respond(
        StatusCode::OK,
        "application/json",
        batch::join(items.iter().map(String::as_str)),
    )
}

/// Whether the service's answer refuses the whole batch (one error answering `null`).
fn refused_whole_batch(headers: &http::HeaderMap, body: &Bytes) -> bool {
    let event_stream = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| is_event_stream(value.as_bytes()));
    matches!(batch::read_answer(body, event_stream), BatchAnswer::Refused(_))
}

/// The call's text as it goes upstream.
fn text(call: &Call) -> &str {
    // The batch was read as JSON, so every call is UTF-8.
    std::str::from_utf8(&call.text).unwrap_or("null")
}

/// An unkeyed call's reply: the service's answer to it, as it came.
fn unkeyed(run: &Run<'_>, call: &Call, answered: &Answered<'_>) -> Reply {
    let Some(id) = &call.id else {
        return Reply::Nothing;
    };
    match (answered.exchanged, answered.read) {
        (_, Some(BatchAnswer::Answers(answers))) => answers.get(id).map_or(Reply::Nothing, |raw| {
            Reply::Response(Bytes::copy_from_slice(raw.get().as_bytes()))
        }),
        (_, Some(BatchAnswer::Refused(error))) => refused_whole(run, error, id),
        (_, Some(BatchAnswer::Unreadable)) => Reply::Nothing,
        (Some(Exchanged::Answered { status, .. } | Exchanged::TooLarge { status, .. }), None) => {
            error_reply(run, &service_status(*status))
        }
        (Some(Exchanged::Released(error, _) | Exchanged::Unknown(error, _)), None) => error_reply(run, error),
        (None, None) => Reply::Nothing,
    }
}

/// What a won call's record becomes, and its reply.
fn executed<'a>(run: &Run<'_>, call: &Call, answered: &Answered<'a>) -> (ItemWrite<'a>, Reply) {
    let Some(exchanged) = answered.exchanged else {
        // Never happens: a won call is always sent.
        return (ItemWrite::Release, Reply::Nothing);
    };
    match (exchanged, answered.read) {
        (Exchanged::Answered { status, headers, .. }, Some(read)) => {
            let Some(id) = &call.id else {
                // A notification: it ran, unless the service refused the whole batch.
                if let BatchAnswer::Refused(_) = read {
                    return (ItemWrite::Release, Reply::Nothing);
                }
                let stored = record(StatusCode::ACCEPTED, None, Bytes::new(), run.max_stored());
                return (ItemWrite::Complete(stored), Reply::Nothing);
            };
            let found = match read {
                BatchAnswer::Answers(answers) => answers.get(id),
                BatchAnswer::Refused(error) => return (ItemWrite::Release, refused_whole(run, error, id)),
                BatchAnswer::Unreadable => None,
            };
            match found {
                Some(raw) => {
                    // Stored as the same call alone would have it: one response, as JSON.
                    let text = Bytes::copy_from_slice(raw.get().as_bytes());
                    let json = http::HeaderValue::from_static("application/json");
                    let content_type = headers
                        .get(header::CONTENT_TYPE)
                        .filter(|value| !is_event_stream(value.as_bytes()));
                    let stored = record(
                        *status,
                        Some(content_type.unwrap_or(&json)),
                        text.clone(),
                        run.max_stored(),
                    );
                    (ItemWrite::Complete(stored), Reply::Response(text))
                }
                None => {
                    let why = "the service's batch answer has no response for this call";
                    let error = ProxyError::UpstreamBroken(why.into());
                    (ItemWrite::Unknown(why), error_reply(run, &error))
                }
            }
        }
        (
            Exchanged::Answered {
                status,
                headers,
                body,
                ..
            },
            None,
        ) => {
            let content_type = headers.get(header::CONTENT_TYPE);
            let stored = record(*status, content_type, body.clone(), run.max_stored());
            (
                ItemWrite::Complete(stored),
                error_reply(run, &service_status(*status)),
            )
        }
        (Exchanged::TooLarge { status, headers }, _) => {
            // It ran and was answered; the answer is not kept, as a lone one over the limit is not.
            let content_type = headers.get(header::CONTENT_TYPE);
            let mut stored = record(*status, content_type, Bytes::new(), 0);
            stored.body = None;
            let error = ProxyError::ResponseNotRetained {
                status: status.as_u16(),
            };
            (ItemWrite::Complete(stored), error_reply(run, &error))
        }
        (Exchanged::Released(error, _), _) => (ItemWrite::Release, error_reply(run, error)),
        (Exchanged::Unknown(error, why), _) => (ItemWrite::Unknown(why), error_reply(run, error)),
    }
}

/// A call of a batch the service refused whole (`error`, answering `id` `null`): that error under the
/// call's `id`. Nothing of the batch ran, so its keys are given back.
fn refused_whole(run: &Run<'_>, error: &str, id: &CallId) -> Reply {
    match batch::refusal_as(error, id) {
        Some(text) => Reply::Response(Bytes::from(text)),
        None => error_reply(
            run,
            &ProxyError::UpstreamBroken("the service refused the batch".into()),
        ),
    }
}

/// A stored answer as a replay gives it to this call: a JSON-RPC response under the call's `id`; an
/// answer that is none (the whole batch's status, an event stream) is the proxy's error naming its
/// status.
fn replayed(run: &Run<'_>, call: &Call, status: u16, body: &Bytes) -> Reply {
    let Some(id) = &call.id else {
        return Reply::Nothing;
    };
    match response_as(body, id) {
        Some(text) => Reply::Response(Bytes::from(text)),
        None => error_reply(
            run,
            &service_status(StatusCode::from_u16(status).unwrap_or(StatusCode::OK)),
        ),
    }
}

/// The error of a call whose answer is the whole batch's status, not a response of its own.
fn service_status(status: StatusCode) -> ProxyError {
    ProxyError::UpstreamBroken(format!(
        "the service answered the batch with HTTP {status}, not a response to this call"
    ))
}

/// The proxy's error for a call.
fn error_reply(run: &Run<'_>, error: &ProxyError) -> Reply {
    let mut data = run.problem(error);
    if let Some(secs) = error.retry_after() {
        data["retryAfter"] = Value::from(secs);
    }
    Reply::Error(serde_json::json!({
        "code": code(error),
        "message": data["title"].clone(),
        "data": data,
    }))
}

/// The JSON-RPC error code of the proxy's answer to a call.
pub fn code(error: &ProxyError) -> i64 {
    match error {
        ProxyError::KeyInFlight { .. } => KEY_IN_FLIGHT,
        ProxyError::KeyReused => KEY_REUSED,
        ProxyError::OutcomeUnknown => OUTCOME_UNKNOWN,
        _ => NOT_RUN,
    }
}
