//! A JSON-RPC batch taken apart and put back together, for a route keyed by `jsonrpc` where each call of
//! a batch carries a key of its own (issue 49; not yet on the request path): the batch's calls, each as
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

/// The upstream's answers to a batch, by the `id` each answers; `None` when the answer is not an array
/// (a server answers a batch it could not read at all with one error object). An answer whose `id`
/// repeats another's is kept only once: which call it answers cannot be told, so neither is taken.
pub fn answers(body: &[u8]) -> Option<HashMap<CallId, &RawValue>> {
    let items: Vec<&RawValue> = serde_json::from_slice(body).ok()?;
    let mut by_id: HashMap<CallId, Option<&RawValue>> = HashMap::with_capacity(items.len());
    for item in items {
        if let Some(id) = id_of(item) {
            by_id
                .entry(id)
                .and_modify(|seen| *seen = None)
                .or_insert(Some(item));
        }
    }
    Some(
        by_id
            .into_iter()
            .filter_map(|(id, item)| Some((id, item?)))
            .collect(),
    )
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

    #[test]
    fn the_upstream_answers_are_found_by_id_whatever_their_order_and_spelling() {
        let body = br#"[{"jsonrpc":"2.0","id":"\u0062","result":2},{"jsonrpc":"2.0","id":1,"result":1},
            {"jsonrpc":"2.0","id":7,"result":"first"},{"jsonrpc":"2.0","id":7,"result":"second"}]"#;
        let found = answers(body).unwrap();
        assert_eq!(found[&id("1")].get(), r#"{"jsonrpc":"2.0","id":1,"result":1}"#);
        assert_eq!(
            found[&id(r#""b""#)].get(),
            r#"{"jsonrpc":"2.0","id":"\u0062","result":2}"#
        );
        assert!(
            !found.contains_key(&id("7")),
            "two answers for one id answer neither call"
        );
        assert!(
            !found.contains_key(&id("2")),
            "a call the upstream did not answer"
        );
        let whole_batch_refused = br#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"x"}}"#;
        assert!(answers(whole_batch_refused).is_none());
    }
}
