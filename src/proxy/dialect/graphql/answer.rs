//! The answers of a split mutation: each part's answer (forwarded, replayed, or the proxy's own error)
//! merged into the one the client asked for, and the proxy's own GraphQL errors. Values are moved as the
//! service wrote them ([`RawValue`]), so a merged answer carries its numbers to the last digit (a
//! `serde_json::Value` would round integers past 64 bits and decimals past 17 digits); hence [`merge`]
//! writes bytes.
//!
//! How the answers merge, in the client's (the parts') order:
//! - `data`: each part's `data` members; a part whose `data` is `null` or absent (the field failed and
//!   took `data` with it, the service refused the part's request, or its answer is not GraphQL's) gives
//!   its response key `null`. The merged `data` is `null` only when no part has a `data` object and one
//!   at least has `data: null`; absent when none has `data` at all. One operation would have nulled the
//!   whole `data` when a non-null root field failed; split, the fields that ran did run, and hiding their
//!   answers would only send the client to retry them, so they stay, and the errors say which failed.
//! - `errors`: every part's, concatenated, as written (a part's field has the client's response key, so
//!   their `path`s are already the client's); absent when there are none. A part whose answer is not a
//!   GraphQL response gets an error of the proxy's at its response key.
//! - `extensions`: the members of every part's `extensions`, a later part's replacing an earlier part's
//!   of the same name (so a rate limit's status is the latest); absent when there are none. Other members
//!   of the answers are dropped.

use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::body::{Members, write_string};

/// The code of an error answering a keyed field whose key is still being executed by another request.
pub const IDEMPOTENCY_CONCURRENT_REQUEST: &str = "IDEMPOTENCY_CONCURRENT_REQUEST";
/// The code of an error answering a keyed field whose key was used with another request (another
/// fingerprint).
pub const IDEMPOTENCY_KEY_PARAMETER_MISMATCH: &str = "IDEMPOTENCY_KEY_PARAMETER_MISMATCH";
/// The code of an error answering a keyed field whose key's earlier execution failed.
pub const IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED: &str = "IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED";

/// A GraphQL error of the proxy's about the field at `response_key`, as Shopify's idempotency errors are
/// shaped: `{"message", "path": [response_key], "extensions": {"code"}}`.
pub fn idempotency_error(response_key: &str, code: &str, message: &str) -> Value {
    json!({
        "message": message,
        "path": [response_key],
        "extensions": { "code": code },
    })
}

/// A part's whole answer when the proxy answers the field itself with `error` (from
/// [`idempotency_error`]): `{"data": {response_key: null}, "errors": [error]}`, to [`merge`] as any other.
pub fn error_answer(response_key: &str, error: &Value) -> Vec<u8> {
    let answer = json!({ "data": { response_key: null }, "errors": [error] });
    serde_json::to_vec(&answer).unwrap_or_default()
}

/// A part's answer, read: its `data` members (`None` for `null` or absent), whether it had `data` at
/// all, its errors and its extensions.
struct Read<'a> {
    data: Option<Members<'a>>,
    has_data: bool,
    errors: Vec<&'a RawValue>,
    extensions: Vec<(String, &'a RawValue)>,
}

/// `answer` read; `None` when it is not a GraphQL response (not a JSON object, or `data`, `errors` or
/// `extensions` of the wrong type).
fn read(answer: &[u8]) -> Option<Read<'_>> {
    let members = Members::read(answer).ok()?;
    let member = |name: &str| {
        members
            .0
            .iter()
            .find(|(seen, _)| seen == name)
            .map(|(_, value)| *value)
    };
    let data = match member("data") {
        Some(raw) if raw.get() != "null" => Some(Members::read(raw.get().as_bytes()).ok()?),
        _ => None,
    };
    let errors = match members.get("errors") {
        Some(raw) => serde_json::from_str(raw.get()).ok()?,
        None => Vec::new(),
    };
    let extensions = match members.get("extensions") {
        Some(raw) => Members::read(raw.get().as_bytes()).ok()?.0,
        None => Vec::new(),
    };
    Some(Read {
        data,
        has_data: member("data").is_some(),
        errors,
        extensions,
    })
}

/// Whether a part's `answer` is its field's failure rather than its result: it has errors and no value
/// for the field (`data`, or every member of it, `null`). An answer that is not a GraphQL response
/// counts as a failure too. A field that answered `null` without errors succeeded.
pub fn field_failed(answer: &[u8]) -> bool {
    let Some(read) = read(answer) else {
        return true;
    };
    let valueless = read
        .data
        .as_ref()
        .is_none_or(|data| data.0.iter().all(|(_, value)| value.get() == "null"));
    !read.errors.is_empty() && valueless
}

/// The one answer to the client of the parts' answers, each with its part's response key, in the parts'
/// order (see the module's header for how).
pub fn merge(parts: &[(&str, &[u8])]) -> Vec<u8> {
    let mut data: Vec<(String, String)> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut extensions: Vec<(String, String)> = Vec::new();
    let (mut objects, mut nulls) = (0usize, 0usize);
    for (response_key, answer) in parts {
        let Some(read) = read(answer) else {
            data.push((response_key.to_string(), "null".into()));
            errors.push(not_graphql(response_key));
            nulls += 1;
            continue;
        };
        match read.data {
            Some(members) => {
                objects += 1;
                data.extend(
                    members
                        .0
                        .into_iter()
                        .map(|(name, value)| (name, value.get().to_owned())),
                );
            }
            None => {
                nulls += usize::from(read.has_data);
                data.push((response_key.to_string(), "null".into()));
            }
        }
        errors.extend(read.errors.into_iter().map(|error| error.get().to_owned()));
        for (name, value) in read.extensions {
            extensions.retain(|(seen, _)| *seen != name);
            extensions.push((name, value.get().to_owned()));
        }
    }
    write_answer(&data, (objects, nulls), &errors, &extensions)
}

/// The proxy's error for a part whose answer is not a GraphQL response.
fn not_graphql(response_key: &str) -> String {
    let error = json!({
        "message": "The service's answer to this field is not a GraphQL response.",
        "path": [response_key],
    });
    error.to_string()
}

fn write_answer(
    data: &[(String, String)],
    (objects, nulls): (usize, usize),
    errors: &[String],
    extensions: &[(String, String)],
) -> Vec<u8> {
    let mut members: Vec<(&str, String)> = Vec::new();
    if objects > 0 {
        members.push(("data", object(data)));
    } else if nulls > 0 {
        members.push(("data", "null".into()));
    }
    if !errors.is_empty() {
        members.push(("errors", format!("[{}]", errors.join(","))));
    }
    if !extensions.is_empty() {
        members.push(("extensions", object(extensions)));
    }
    let members: Vec<(String, String)> = members.into_iter().map(|(n, v)| (n.to_owned(), v)).collect();
    object(&members).into_bytes()
}

/// The JSON object of `members`, each value JSON text already.
fn object(members: &[(String, String)]) -> String {
    let mut out = Vec::new();
    out.push(b'{');
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(&mut out, name);
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
    }
    out.push(b'}');
    String::from_utf8(out).unwrap_or_default()
}
