//! The JSON-RPC dialect, for a route keyed by `jsonrpc` (`key/source.rs`), once the body has been read:
//! tells one JSON-RPC 2.0 call from a batch (a JSON array of calls), names the `id` a replay of the call
//! must answer with ([`CallId`]), and finds whether any call of a batch carries a key; a replay answers
//! the retry's `id` (`jsonrpc/answer.rs`). Reads the body by
//! streaming under the limits every JSON reader shares (`key/json.rs`): no tree is built, and a batch
//! costs what its deepest call's path does. Pure functions of the body.

pub mod answer;
pub mod batch;

use crate::proxy::key::json::{Paths, Reader, Scratch, Stop};
use crate::proxy::key::pointer::Found;

/// Where a JSON-RPC request holds its `id`.
pub const ID: &str = "/id";

/// A JSON-RPC request's `id` as the JSON text a response carries it in, of the type the request sent:
/// a string (re-encoded, so its escapes may differ, never its value), a number (its exact text) or
/// `null`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallId(Box<str>);

impl CallId {
    /// The `id` found in a request; `None` for a notification (no `id`), or an `id` of a type JSON-RPC
    /// does not allow (an object, an array, a boolean) or named twice.
    pub fn from_found(found: &Found) -> Option<CallId> {
        match found {
            Found::String(text) => serde_json::to_string(text).ok().map(|json| CallId(json.into())),
            Found::Number(text) => Some(CallId(text.as_str().into())),
            Found::Other("null") => Some(CallId("null".into())),
            Found::Other(_) | Found::Absent | Found::Repeated => None,
        }
    }

    /// An `id` already in its one spelling (`batch.rs` reads it so).
    fn from_json(json: String) -> Option<CallId> {
        Some(CallId(json.into()))
    }

    /// The `id` as JSON text.
    pub fn as_json(&self) -> &str {
        &self.0
    }
}

/// Whether `body` is a batch: its first byte past JSON whitespace opens an array.
pub fn is_batch(body: &[u8]) -> bool {
    body.iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .is_some_and(|&b| b == b'[')
}

/// Whether any call of the batch `body` holds a value (of any type) at `pointer`, read relative to the
/// call. `Ok(false)` when the body is not JSON; `Err(Stop::OverBudget)` when reading it needs more
/// memory than `scratch` can get.
pub fn batch_keyed(body: &[u8], pointer: &str, scratch: &mut Scratch<'_>) -> Result<bool, Stop> {
    match scan_batch(body, pointer, scratch) {
        Ok(keyed) => Ok(keyed),
        Err(Stop::NotJson) => Ok(false),
        Err(Stop::OverBudget) => Err(Stop::OverBudget),
    }
}

/// Follows each element of the top-level array with paths of its own, the element as their root.
fn scan_batch(body: &[u8], pointer: &str, scratch: &mut Scratch<'_>) -> Result<bool, Stop> {
    let mut reader = Reader::new(body);
    let mut depth = 0usize;
    let mut call: Option<Paths> = None;
    let mut keyed = false;
    while let Some(event) = reader.next(scratch)? {
        use json_event_parser::JsonEvent::{EndArray, EndObject, StartArray, StartObject};
        let opens = matches!(event, StartArray | StartObject);
        if depth == 1 && opens {
            call = Some(Paths::new(&[pointer]));
        }
        if let Some(paths) = call.as_mut() {
            paths.step(&event);
            keyed |= !paths.hits().is_empty();
        }
        match event {
            StartArray | StartObject => depth += 1,
            EndArray | EndObject => {
                depth = depth.saturating_sub(1);
                if depth == 1 {
                    call = None;
                }
            }
            _ => {}
        }
    }
    Ok(keyed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "/params/_meta/idempotencyKey";

    fn keyed(body: &str) -> bool {
        batch_keyed(body.as_bytes(), KEY, &mut Scratch::unbounded()).unwrap()
    }

    #[test]
    fn an_id_keeps_the_type_the_request_sent() {
        let id = |found: Found| CallId::from_found(&found).map(|id| id.as_json().to_owned());
        assert_eq!(id(Found::Number("7".into())).as_deref(), Some("7"));
        assert_eq!(id(Found::Number("1.50".into())).as_deref(), Some("1.50"));
        assert_eq!(id(Found::String("7".into())).as_deref(), Some("\"7\""));
        assert_eq!(id(Found::String("a\"b\n".into())).as_deref(), Some(r#""a\"b\n""#));
        assert_eq!(id(Found::Other("null")).as_deref(), Some("null"));
        for found in [
            Found::Absent,
            Found::Repeated,
            Found::Other("an object"),
            Found::Other("a boolean"),
        ] {
            assert_eq!(id(found.clone()), None, "{found:?}");
        }
    }

    #[test]
    fn a_batch_is_an_array_at_the_top() {
        assert!(is_batch(b" \r\n\t[{}]"));
        assert!(!is_batch(b"{\"a\":[1]}"));
        assert!(!is_batch(b""));
        assert!(!is_batch(b"\xEF\xBB\xBF[]"));
    }

    #[test]
    fn a_batch_is_keyed_when_any_call_carries_a_key() {
        let plain = r#"{"jsonrpc":"2.0","id":1,"method":"a","params":{"_meta":{}}}"#;
        let with = r#"{"jsonrpc":"2.0","id":2,"method":"b","params":{"_meta":{"idempotencyKey":"k"}}}"#;
        assert!(!keyed(&format!("[{plain},{plain}]")));
        assert!(keyed(&format!("[{plain},{with}]")));
        assert!(keyed(&format!("[{with}]")));
        assert!(
            keyed(r#"[{"params":{"_meta":{"idempotencyKey":{"a":1}}}}]"#),
            "a key of any type counts"
        );
        assert!(
            !keyed(r#"[[{"params":{"_meta":{"idempotencyKey":"k"}}}]]"#),
            "a nested array is not a call"
        );
        assert!(
            !keyed(r#"[{"x":{"params":{"_meta":{"idempotencyKey":"k"}}}}]"#),
            "the pointer is read from the call's root"
        );
        assert!(!keyed("[1, \"a\", null]"));
        assert!(!keyed("[{\"params\":"), "not JSON: no key");
    }

    #[test]
    fn a_hostile_batch_is_no_key_and_no_panic() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(!keyed(&deep));
        let mut refuse = |_: usize| false;
        let escaped = format!(r#"[{{"params":{{"_meta":{{"x":"{}\n"}}}}}}]"#, "a".repeat(10_000));
        assert_eq!(
            batch_keyed(escaped.as_bytes(), KEY, &mut Scratch::within(&mut refuse)),
            Err(Stop::OverBudget)
        );
    }
}
