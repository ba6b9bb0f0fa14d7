//! A JSON-RPC batch taken apart and put back together, for a route keyed by `jsonrpc` where each call of
//! a batch carries a key of its own (`proxy/many/jsonrpc.rs`): the batch's calls, each as
//! the client wrote it (so the calls left to run go upstream byte for byte, in their order); the
//! upstream's batch answer found again by `id`, under the same spelling rules as [`CallId`] (a string
//! re-encoded, a number's exact text, `null`); and the client's answer, merged in its order. Pure
//! functions of the bytes; a batch is bounded by the body budget it was read within and [`MAX_CALLS`].

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::CallId;

/// The most calls one batch may hold: each keyed call is a claim of its own.
pub const MAX_CALLS: usize = 1000;

/// Why a body is not a batch this module takes apart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotABatch {
    /// Not a JSON array (or not JSON at all).
    #[error("not a JSON array of calls")]
    NotAnArray,
    /// `[]`, which JSON-RPC answers with one error.
    #[error("an empty batch")]
    Empty,
    /// More calls than [`MAX_CALLS`].
    #[error("{0} calls, over the {MAX_CALLS} a batch may hold")]
    TooMany(usize),
}

/// The calls of `body`, each as sent.
pub fn calls(body: &[u8]) -> Result<Vec<&RawValue>, NotABatch> {
    let calls: Vec<&RawValue> = serde_json::from_slice(body).map_err(|_| NotABatch::NotAnArray)?;
    match calls.len() {
        0 => Err(NotABatch::Empty),
        n if n > MAX_CALLS => Err(NotABatch::TooMany(n)),
        _ => Ok(calls),
    }
}

/// A batch of these calls (or answers), in this order, each byte for byte.
pub fn join<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<u8> {
    let mut joined = vec![b'['];
    for (n, item) in items.into_iter().enumerate() {
        if n > 0 {
            joined.push(b',');
        }
        joined.extend_from_slice(item.as_bytes());
    }
    joined.push(b']');
    joined
}

/// The `id` of a call or an answer, spelled as [`CallId`] spells it; `None` for a notification, an `id`
/// of a type JSON-RPC does not allow, or an element that is not an object.
pub fn id_of(item: &RawValue) -> Option<CallId> {
    #[derive(Deserialize)]
    struct Head<'a> {
        // As its raw text, `null` included (an `Option` alone would read `null` as no `id`).
        #[serde(borrow, default, deserialize_with = "present")]
        id: Option<&'a RawValue>,
    }
    fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
        <&RawValue>::deserialize(d).map(Some)
    }
    let head: Head<'_> = serde_json::from_str(item.get()).ok()?;
    let id = head.id?.get();
    match id.as_bytes().first()? {
        b'"' => {
            let text: String = serde_json::from_str(id).ok()?;
            CallId::from_json(serde_json::to_string(&text).ok()?)
        }
        b'-' | b'0'..=b'9' => CallId::from_json(id.to_owned()),
        _ if id == "null" => CallId::from_json(id.to_owned()),
        _ => None,
    }
}

/// Whether a call names an `id` member, of whatever type, or names it twice (a call whose `id` is not
/// one [`id_of`] reads is then not a notification but a call that cannot be answered).
pub fn names_an_id(item: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Head {
        #[serde(default)]
        id: Option<serde::de::IgnoredAny>,
    }
    match serde_json::from_str::<Head>(item.get()) {
        Ok(head) => head.id.is_some(),
        // An object naming `id` twice; anything else names none.
        Err(_) => item.get().trim_start().starts_with('{'),
    }
}

/// What the upstream answered a batch with, read once.
#[derive(Debug)]
pub enum BatchAnswer {
    /// Responses, found by the `id` each answers ([`Answers::get`]).
    Answers(Answers),
    /// One JSON-RPC error for the whole batch (`id` `null`): the server could not read it as a batch,
    /// and ran none of it (JSON-RPC 2.0 §6). The error object's text.
    Refused(String),
    /// Neither: what it ran, if anything, cannot be told.
    Unreadable,
}

/// A batch's responses by the `id` each answers: an `id` in its one spelling ([`CallId`]), or a number
/// written back in another spelling of the same value (`1e0` answered as `1.0`). An `id` answered twice
/// answers no call: which call each answers cannot be told.
#[derive(Debug, Default)]
pub struct Answers {
    by_id: HashMap<CallId, Option<Box<RawValue>>>,
}

impl Answers {
    /// The response answering `id`, as the server wrote it.
    pub fn get(&self, id: &CallId) -> Option<&RawValue> {
        if let Some(found) = self.by_id.get(id) {
            return found.as_deref();
        }
        // A number written back in another spelling: the one answer of the same value, if only one.
        let value = number(id.as_json())?;
        let mut same = self
            .by_id
            .iter()
            .filter(|(other, _)| number(other.as_json()) == Some(value));
        let (_, found) = same.next()?;
        match same.next() {
            Some(_) => None,
            None => found.as_deref(),
        }
    }

    /// Takes `item` if it is a response (a `result` or an `error`, no `method`): a request the server
    /// makes of the client in an event stream may carry an `id` of its own numbering.
    fn add(&mut self, item: Box<RawValue>) {
        if !is_response(&item) {
            return;
        }
        if let Some(id) = id_of(&item) {
            self.by_id
                .entry(id)
                .and_modify(|seen| *seen = None)
                .or_insert(Some(item));
        }
    }
}

/// The shape of a message, as far as telling a response from a request goes.
#[derive(Deserialize)]
struct Shape<'a> {
    #[serde(borrow, default)]
    method: Option<&'a RawValue>,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
}

fn shape(item: &RawValue) -> Option<Shape<'_>> {
    serde_json::from_str(item.get()).ok()
}

/// Whether a message is a response: a `result` or an `error`, and no `method`.
fn is_response(item: &RawValue) -> bool {
    shape(item)
        .is_some_and(|shape| shape.method.is_none() && (shape.result.is_some() || shape.error.is_some()))
}

/// An `id` as its duplicates are told: a number by its value (`1` and `1.0`, `0` and `-0`, and integers
/// past a double's precision that round to one are one id, since a server may answer them as one), a
/// string and `null` by their one spelling. Two calls of a keyed batch may not share one.
pub fn id_value(id: &CallId) -> String {
    match number(id.as_json()) {
        Some(0.0) => "n:0".into(),
        Some(value) => format!("n:{value:e}"),
        None if id.as_json().starts_with(|c: char| c == '-' || c.is_ascii_digit()) => {
            format!("n:{}", id.as_json())
        }
        None => format!("s:{}", id.as_json()),
    }
}

/// A JSON number's value, for ids a server writes back in another spelling; `None` for anything else.
fn number(json: &str) -> Option<f64> {
    if !json.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        return None;
    }
    json.parse::<f64>().ok().filter(|value| value.is_finite())
}

/// The upstream's answer to a batch: a JSON array of responses, or an event stream (`event_stream`)
/// whose events each hold a response or an array of them (MCP's Streamable HTTP answers so), or one
/// error refusing the whole batch.
pub fn read_answer(body: &[u8], event_stream: bool) -> BatchAnswer {
    let texts: Vec<Vec<u8>> = match event_stream {
        true => super::answer::event_data(body),
        false => vec![body.to_vec()],
    };
    let mut answers = Answers::default();
    let mut refused = None;
    let mut array = false;
    for text in texts {
        if let Ok(items) = serde_json::from_slice::<Vec<Box<RawValue>>>(&text) {
            items.into_iter().for_each(|item| answers.add(item));
            array = true;
        } else if let Ok(item) = serde_json::from_slice::<Box<RawValue>>(&text) {
            match refusal(&item) {
                true => refused = Some(item.get().to_owned()),
                // A lone response answers a batch only among the events of a stream.
                false if event_stream => answers.add(item),
                false => {}
            }
        }
    }
    match (array || !answers.by_id.is_empty(), refused) {
        (true, _) => BatchAnswer::Answers(answers),
        (false, Some(error)) => BatchAnswer::Refused(error),
        (false, None) => BatchAnswer::Unreadable,
    }
}

/// Whether a response refuses a whole batch: an error answering `id` `null`.
fn refusal(item: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Error {
        code: i64,
    }
    let Some(error) = shape(item).and_then(|shape| shape.error) else {
        return false;
    };
    // Parse error or invalid request: the batch was not read. Any other error answering `null` (an
    // internal error after the calls ran) says nothing of what ran.
    let code = serde_json::from_str::<Error>(error.get()).map(|error| error.code);
    matches!(code, Ok(-32700 | -32600)) && id_of(item).is_some_and(|id| id.as_json() == "null")
}

/// The error object of a response refusing a whole batch (`text`), answering the call `id`.
pub fn refusal_as(text: &str, id: &CallId) -> Option<Vec<u8>> {
    super::answer::response_as(text.as_bytes(), id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(json: &str) -> CallId {
        CallId::from_json(json.to_owned()).unwrap()
    }

    #[test]
    fn a_batch_is_its_calls_as_sent_and_joins_back_byte_for_byte() {
        let body = br#" [ {"jsonrpc":"2.0","id":1,"method":"a"} ,{"jsonrpc" : "2.0", "method":"note"},
            {"jsonrpc":"2.0","id":"x\u0079","method":"b","params":{"n":1.50}} ] "#;
        let calls = calls(body).unwrap();
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[1].get(), r#"{"jsonrpc" : "2.0", "method":"note"}"#);
        assert_eq!(id_of(calls[0]), Some(id("1")));
        assert_eq!(id_of(calls[1]), None, "a notification");
        assert_eq!(
            id_of(calls[2]),
            Some(id(r#""xy""#)),
            "a string id in its one spelling"
        );
        let kept = join([calls[0].get(), calls[2].get()]);
        assert_eq!(
            kept,
            br#"[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","id":"x\u0079","method":"b","params":{"n":1.50}}]"#
        );
    }

    #[test]
    fn what_is_not_a_batch_says_why() {
        assert_eq!(calls(b"{}").unwrap_err(), NotABatch::NotAnArray);
        assert_eq!(calls(b"[1,").unwrap_err(), NotABatch::NotAnArray);
        assert_eq!(calls(b" [ ] ").unwrap_err(), NotABatch::Empty);
        let many = join(std::iter::repeat_n("{}", MAX_CALLS + 1));
        assert_eq!(calls(&many).unwrap_err(), NotABatch::TooMany(MAX_CALLS + 1));
        assert_eq!(
            calls(&join(std::iter::repeat_n("{}", MAX_CALLS))).unwrap().len(),
            MAX_CALLS
        );
    }

    #[test]
    fn ids_of_other_types_name_no_call() {
        for item in [r#"{"id":true}"#, r#"{"id":{}}"#, r#"{"id":[1]}"#, "5", r#""s""#] {
            let raw: Box<RawValue> = serde_json::from_str(item).unwrap();
            assert_eq!(id_of(&raw), None, "{item}");
        }
        let null: Box<RawValue> = serde_json::from_str(r#"{"id":null}"#).unwrap();
        assert_eq!(id_of(&null), Some(id("null")));
        let big: Box<RawValue> = serde_json::from_str(r#"{"id":123456789012345678901234567890}"#).unwrap();
        assert_eq!(
            id_of(&big),
            Some(id("123456789012345678901234567890")),
            "a number's exact text"
        );
    }

    fn answers(body: &[u8], event_stream: bool) -> Answers {
        match read_answer(body, event_stream) {
            BatchAnswer::Answers(answers) => answers,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_upstream_answers_are_found_by_id_whatever_their_order_and_spelling() {
        let body = br#"[{"jsonrpc":"2.0","id":"\u0062","result":2},{"jsonrpc":"2.0","id":1,"result":1},
            {"jsonrpc":"2.0","id":7,"result":"first"},{"jsonrpc":"2.0","id":7,"result":"second"},
            {"jsonrpc":"2.0","id":1.0e1,"result":10}]"#;
        let found = answers(body, false);
        let get = |text: &str| found.get(&id(text)).map(RawValue::get);
        assert_eq!(get("1"), Some(r#"{"jsonrpc":"2.0","id":1,"result":1}"#));
        assert_eq!(
            get(r#""b""#),
            Some(r#"{"jsonrpc":"2.0","id":"\u0062","result":2}"#)
        );
        assert_eq!(get("7"), None, "two answers for one id answer neither call");
        assert_eq!(get("2"), None, "a call the upstream did not answer");
        assert_eq!(
            get("10"),
            Some(r#"{"jsonrpc":"2.0","id":1.0e1,"result":10}"#),
            "a number written back in another spelling of its value"
        );
        assert_eq!(get(r#""10""#), None, "a string is no number");
    }

    #[test]
    fn an_event_stream_answers_with_its_events_and_a_whole_batch_refusal_is_told_apart() {
        let stream = b"event: message\r\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\r\n\r\n\
            data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}\n\ndata: [{\"jsonrpc\":\"2.0\",\"id\":2,\ndata: \"result\":2}]\n\n";
        let found = answers(stream, true);
        assert_eq!(
            found.get(&id("1")).map(RawValue::get),
            Some(r#"{"jsonrpc":"2.0","id":1,"result":1}"#)
        );
        assert!(
            found.get(&id("2")).is_some(),
            "an array in an event, over two data lines"
        );
        let refused = br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"x"}}"#;
        assert!(matches!(read_answer(refused, false), BatchAnswer::Refused(_)));
        let in_a_stream =
            b"data: {\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32700,\"message\":\"x\"}}\n\n";
        assert!(matches!(read_answer(in_a_stream, true), BatchAnswer::Refused(_)));
        let internal = br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32603,"message":"x"}}"#;
        assert!(
            matches!(read_answer(internal, false), BatchAnswer::Unreadable),
            "an internal error may come after the calls ran"
        );
        let request = b"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"sampling/createMessage\"}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":7}\n\n";
        assert_eq!(
            answers(request, true).get(&id("1")).map(RawValue::get),
            Some(r#"{"jsonrpc":"2.0","id":1,"result":7}"#),
            "the server's own request with the same id is no response"
        );
        assert_eq!(id_value(&id("1")), id_value(&id("1.0")));
        assert_eq!(id_value(&id("0")), id_value(&id("-0")));
        assert_eq!(
            id_value(&id("12345678901234567890123")),
            id_value(&id("12345678901234567890124"))
        );
        assert_ne!(id_value(&id("1")), id_value(&id(r#""1""#)));
        assert!(matches!(read_answer(b"<html>", false), BatchAnswer::Unreadable));
        assert!(matches!(
            read_answer(br#"{"jsonrpc":"2.0","id":1,"result":1}"#, false),
            BatchAnswer::Unreadable
        ));
    }
}
