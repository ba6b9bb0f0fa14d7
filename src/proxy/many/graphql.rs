//! A GraphQL mutation whose root fields are marked `@idempotent`, once its fields are claimed
//! (`many.rs`): each field left to run (won, or without a key) goes upstream as an operation of its own
//! (`dialect/graphql.rs` wrote them), one after the other in the client's order, as GraphQL runs root
//! mutation fields; each won field's record is written as soon as its answer is in, so a proxy stopped
//! after the second of three fields has stored two. The answers, replays and the proxy's own errors are
//! merged into one `{"data", "errors"}` answer in the client's order.
//!
//! What each won field's record becomes:
//! - answered with a status the route stores: that answer, unless it is the field's failure (errors and
//!   no value) on a route with `release_graphql_errors = true`, which is given back;
//! - a status the route releases, or never delivered: given back; broken off: unknown
//!   (`on_unknown_outcome`).
//!
//! The proxy's own answer for a field is a GraphQL error at the field's path, `data` null for it, with
//! `extensions.code` Shopify's for the idempotency refusals (`IDEMPOTENCY_CONCURRENT_REQUEST`,
//! `IDEMPOTENCY_KEY_PARAMETER_MISMATCH`, `IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED` for a key held after an
//! unknown outcome), else the problem's slug in capitals (`UPSTREAM_UNREACHABLE`), and
//! `extensions.problem` the problem object a lone request would have had.

use bytes::Bytes;
use http::{StatusCode, header};
use serde_json::Value;

use super::item::{Claimed, Exchanged, Run, Salvage, overall, record, respond, stored_body};
use crate::error::ProxyError;
use crate::metrics::Outcome;
use crate::proxy::answer::Handled;
use crate::proxy::budget::ReservedBody;
use crate::proxy::dialect::graphql::{self, answer as graphql_answer};
use crate::proxy::execute::ItemWrite;
use crate::proxy::intake::many::Field;

/// What a mutation's rounds have answered so far: each field's answer once it has one, whether anything
/// went upstream, and the first refusal.
pub(crate) struct Answers {
    answers: Vec<Option<Bytes>>,
    sent: bool,
    refused: Option<Outcome>,
}

impl Answers {
    /// No answer yet for `fields` fields.
    pub(crate) fn new(fields: usize) -> Answers {
        Answers {
            answers: vec![None; fields],
            sent: false,
            refused: None,
        }
    }
}

/// One round: the fields it sends (won, unkeyed) go upstream one after the other in the client's order,
/// each won field's record written as soon as its answer is in; every field it can answer is answered
/// and marked done. Pending fields and repeats are left for later.
pub(crate) async fn round(
    run: &Run<'_>,
    body: &ReservedBody,
    fields: &[Field],
    claimed: &mut [Claimed],
    answers: &mut Answers,
) {
    for (n, field) in fields.iter().enumerate() {
        if !claimed[n].is_answered_now() {
            continue;
        }
        let key = field.response_key.as_str();
        let answer = match std::mem::replace(&mut claimed[n], Claimed::Done) {
            Claimed::Unkeyed => {
                answers.sent = true;
                let exchanged = run
                    .exchange(body.part(field.body.clone()), None, Salvage::Nothing)
                    .await;
                answered(run, key, &exchanged)
            }
            Claimed::Won(won) => {
                answers.sent = true;
                let exchanged = run
                    .exchange(body.part(field.body.clone()), Some(won.attempt), Salvage::Nothing)
                    .await;
                let write = write_of(run, &exchanged);
                run.settle(&won, &write).await;
                run.count(exchanged.outcome());
                answered(run, key, &exchanged)
            }
            Claimed::Replayed(stored) => {
                run.count(Outcome::Replayed);
                match stored_body(&stored) {
                    Ok(body) => body.clone(),
                    Err(error) => refused(run, key, &error),
                }
            }
            Claimed::Refused(error) => {
                run.count(error.outcome());
                answers.refused = answers.refused.or(Some(error.outcome()));
                refused(run, key, &error)
            }
            Claimed::Repeat(_) | Claimed::Pending(..) | Claimed::Done => continue,
        };
        answers.answers[n] = Some(answer);
    }
}

/// The mutation's answer once its rounds are done: the fields' answers merged in the client's order.
pub(crate) fn finish(run: &Run<'_>, fields: &[Field], claimed: &[Claimed], mut answers: Answers) -> Handled {
    for (n, field) in fields.iter().enumerate() {
        if let Claimed::Repeat(earlier) = claimed[n] {
            run.count(Outcome::Replayed);
            let first = answers.answers[earlier].clone();
            answers.answers[n] =
                first.or_else(|| Some(refused(run, &field.response_key, &ProxyError::KeyReused)));
        }
    }
    let outcome = overall(answers.sent, answers.refused);
    let empty = Bytes::new();
    let parts: Vec<(&str, &[u8])> = fields
        .iter()
        .zip(&answers.answers)
        .map(|(field, answer)| {
            (
                field.response_key.as_str(),
                answer.as_ref().unwrap_or(&empty).as_ref(),
            )
        })
        .collect();
    Ok((
        respond(StatusCode::OK, "application/json", graphql::merge(&parts)),
        outcome,
    ))
}

/// What a won field's record becomes after its exchange.
fn write_of<'a>(run: &Run<'_>, exchanged: &'a Exchanged) -> ItemWrite<'a> {
    match exchanged {
        Exchanged::Answered {
            status,
            headers,
            body,
            ..
        } => {
            if run.route.policy.store.release_graphql_errors && graphql::field_failed(body) {
                return ItemWrite::Release;
            }
            let content_type = headers.get(header::CONTENT_TYPE);
            ItemWrite::Complete(record(*status, content_type, body.clone(), run.max_stored()))
        }
        // It ran and was answered; the answer is not kept, as a lone one over the limit is not.
        Exchanged::TooLarge { status, headers } => {
            let mut stored = record(*status, headers.get(header::CONTENT_TYPE), Bytes::new(), 0);
            stored.body = None;
            ItemWrite::Complete(stored)
        }
        Exchanged::Released(..) => ItemWrite::Release,
        Exchanged::Unknown(_, why) => ItemWrite::Unknown(why),
    }
}

/// A field's answer from its exchange: the service's answer as it came (the merge reads it as
/// GraphQL, or says it was not), or the proxy's error where there was none.
fn answered(run: &Run<'_>, key: &str, exchanged: &Exchanged) -> Bytes {
    match exchanged {
        Exchanged::Answered { body, .. } => body.clone(),
        Exchanged::TooLarge { status, .. } => {
            let error = ProxyError::ResponseNotRetained {
                status: status.as_u16(),
            };
            refused(run, key, &error)
        }
        Exchanged::Released(_, Some((_, _, body))) if is_graphql(body) => body.clone(),
        Exchanged::Released(error, _) | Exchanged::Unknown(error, _) => refused(run, key, error),
    }
}

/// Whether an answer reads as a GraphQL response (a JSON object with `data` or `errors`).
fn is_graphql(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Map<String, Value>>(body)
        .is_ok_and(|object| object.contains_key("data") || object.contains_key("errors"))
}

/// The proxy's answer for the field at `key` refused with `error`.
fn refused(run: &Run<'_>, key: &str, error: &ProxyError) -> Bytes {
    let problem = run.problem(error);
    let title = problem["title"].as_str().unwrap_or_default().to_owned();
    let mut value = graphql_answer::idempotency_error(key, &code(error), &title);
    value["extensions"]["problem"] = problem;
    Bytes::from(graphql::error_answer(key, &value))
}

/// The `extensions.code` of the proxy's answer for a field.
pub fn code(error: &ProxyError) -> String {
    match error {
        ProxyError::KeyInFlight { .. } => graphql::IDEMPOTENCY_CONCURRENT_REQUEST.into(),
        ProxyError::KeyReused => graphql::IDEMPOTENCY_KEY_PARAMETER_MISMATCH.into(),
        ProxyError::OutcomeUnknown => graphql::IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED.into(),
        other => other.slug().to_ascii_uppercase().replace('-', "_"),
    }
}
