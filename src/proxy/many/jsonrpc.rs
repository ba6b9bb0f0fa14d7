//! A JSON-RPC batch whose calls carry keys of their own, once its calls are claimed (`many.rs`): the
//! calls left to run (won, and those without a key, notifications included) go upstream as one batch,
//! each byte for byte, in the client's order; the upstream's answers are found by `id`
//! (`dialect/jsonrpc/batch.rs`), each stored as its call's record, and merged with the replays and the
//! proxy's own errors into one batch answer in the client's order, each under the client's `id`.
//!
//! What each won call's record becomes:
//! - the batch answered (2xx): its response, stored as a lone call's (`200`, the answer's content type,
//!   the response object); a notification's `202`. A call the answer has no response for may have run:
//!   its outcome is unknown (held or left to its lease, as `on_unknown_outcome` says);
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

use super::CLAIMS_AT_ONCE;
use super::item::{Claimed, Exchanged, Run, Won, overall, record, respond, stored_body};
use crate::error::ProxyError;
use crate::metrics::Outcome;
use crate::proxy::answer::Handled;
use crate::proxy::budget::ReservedBody;
use crate::proxy::dialect::jsonrpc::answer::response_as;
use crate::proxy::dialect::jsonrpc::batch;
use crate::proxy::execute::ItemWrite;
use crate::proxy::intake::many::Call;

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

/// Runs the batch's remaining calls and answers it.
pub(crate) async fn run(
    run: &Run<'_>,
    body: ReservedBody,
    calls: Vec<Call>,
    claimed: Vec<Claimed>,
) -> Handled {
    let sent: Vec<usize> = (0..calls.len())
        .filter(|&n| matches!(claimed[n], Claimed::Unkeyed | Claimed::Won(_)))
        .collect();
    let attempt = claimed.iter().find_map(|item| match item {
        Claimed::Won(won) => Some(won.attempt),
        _ => None,
    });
    let exchanged = match sent.is_empty() {
        true => None,
        false => {
            let joined = batch::join(sent.iter().map(|&n| text(&calls[n])));
            Some(
                run.exchange(body.with_bytes(joined.into()), attempt, sent.len())
                    .await,
            )
        }
    };
    let outcome = overall(exchanged.is_some(), &claimed);
    let mut replies: Vec<Reply> = Vec::with_capacity(calls.len());
    let mut writes: Vec<(Won, Write<'_>)> = Vec::new();
    for (call, item) in calls.iter().zip(claimed) {
        let reply = match item {
            Claimed::Unkeyed => unkeyed(run, call, exchanged.as_ref()),
            Claimed::Won(won) => {
                let (write, reply) = executed(run, call, exchanged.as_ref());
                writes.push((won, write));
                run.count(exchanged.as_ref().map_or(Outcome::Executed, Exchanged::outcome));
                reply
            }
            Claimed::Replayed(stored) => {
                run.count(Outcome::Replayed);
                match stored_body(&stored) {
                    Ok(body) => replayed(run, call, stored.status, body),
                    Err(error) => error_reply(run, &error),
                }
            }
            Claimed::Repeat(earlier) => {
                run.count(Outcome::Replayed);
                match &replies[earlier] {
                    Reply::Response(first) => match &call.id {
                        Some(id) => {
                            Reply::Response(response_as(first, id).map_or_else(|| first.clone(), Bytes::from))
                        }
                        None => Reply::Nothing,
                    },
                    other => other.clone(),
                }
            }
            Claimed::Refused(error) => {
                run.count(error.outcome());
                error_reply(run, &error)
            }
        };
        replies.push(reply);
    }
    // Every record is written before the client has its answer: a retry sent the moment it is read
    // finds them stored.
    let hold = run.holds_unknown();
    for chunk in writes.chunks(CLAIMS_AT_ONCE) {
        let mut writing = Vec::with_capacity(chunk.len());
        for (won, write) in chunk {
            writing.push(run.settle(won, write.as_write(hold)));
        }
        join_all(writing).await;
    }
    Ok((answer(&calls, &replies), outcome))
}

/// The batch's answer: the replies of the calls with an `id`, in the client's order; `202` and no body
/// when there are none (every call a notification).
fn answer(calls: &[Call], replies: &[Reply]) -> http::Response<crate::body::ProxyBody> {
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
        return respond(StatusCode::ACCEPTED, "", Vec::new());
    }
    respond(
        StatusCode::OK,
        "application/json",
        batch::join(items.iter().map(String::as_str)),
    )
}

/// The call's text as it goes upstream.
fn text(call: &Call) -> &str {
    // The batch was read as JSON, so every call is UTF-8.
    std::str::from_utf8(&call.text).unwrap_or("null")
}

/// An unkeyed call's reply: the service's answer to it, as it came.
fn unkeyed(run: &Run<'_>, call: &Call, exchanged: Option<&Exchanged>) -> Reply {
    let Some(id) = &call.id else {
        return Reply::Nothing;
    };
    match exchanged {
        Some(Exchanged::Answered { status, body, .. }) if status.is_success() => batch::answers(body)
            .and_then(|answers| {
                answers
                    .get(id)
                    .map(|raw| Reply::Response(Bytes::copy_from_slice(raw.get().as_bytes())))
            })
            .unwrap_or(Reply::Nothing),
        Some(Exchanged::Answered { status, .. }) => error_reply(run, &service_status(*status)),
        Some(Exchanged::Released(error, _) | Exchanged::Unknown(error, _)) => error_reply(run, error),
        None => Reply::Nothing,
    }
}

/// What a won call's record becomes, and its reply.
fn executed<'a>(run: &Run<'_>, call: &Call, exchanged: Option<&'a Exchanged>) -> (Write<'a>, Reply) {
    let Some(exchanged) = exchanged else {
        // Never happens: a won call is always sent.
        return (Write::Release, Reply::Nothing);
    };
    match exchanged {
        Exchanged::Answered {
            status,
            headers,
            body,
        } if status.is_success() => {
            let content_type = headers.get(header::CONTENT_TYPE);
            let Some(id) = &call.id else {
                let stored = record(StatusCode::ACCEPTED, None, Bytes::new(), run.max_stored());
                return (Write::Complete(stored), Reply::Nothing);
            };
            match batch::answers(body).and_then(|answers| answers.get(id).copied()) {
                Some(raw) => {
                    let text = Bytes::copy_from_slice(raw.get().as_bytes());
                    let stored = record(*status, content_type, text.clone(), run.max_stored());
                    (Write::Complete(stored), Reply::Response(text))
                }
                None => {
                    let why = "the service's batch answer has no response for this call";
                    let error = ProxyError::UpstreamBroken(why.into());
                    (Write::Unknown(why), error_reply(run, &error))
                }
            }
        }
        Exchanged::Answered {
            status,
            headers,
            body,
        } => {
            let content_type = headers.get(header::CONTENT_TYPE);
            let stored = record(*status, content_type, body.clone(), run.max_stored());
            (
                Write::Complete(stored),
                error_reply(run, &service_status(*status)),
            )
        }
        Exchanged::Released(error, _) => (Write::Release, error_reply(run, error)),
        Exchanged::Unknown(error, why) => (Write::Unknown(why), error_reply(run, error)),
    }
}

/// What a won call's record becomes.
enum Write<'a> {
    Complete(crate::store::StoredResponse),
    Release,
    Unknown(&'a str),
}

impl Write<'_> {
    fn as_write(&self, hold: bool) -> ItemWrite<'_> {
        match self {
            Write::Complete(stored) => ItemWrite::Complete(stored),
            Write::Release => ItemWrite::Release,
            Write::Unknown(why) => ItemWrite::Unknown { hold, why },
        }
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
