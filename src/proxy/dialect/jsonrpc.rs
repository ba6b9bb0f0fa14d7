//! The JSON-RPC dialect, for a route keyed by `jsonrpc` (`key/source.rs`), once the body has been read:
//! tells one JSON-RPC 2.0 call from a batch (a JSON array of calls, taken apart and put back together
//! by `jsonrpc/batch.rs`), and names the `id` a replay of the call must answer with ([`CallId`]); a
//! replay answers the retry's `id` (`jsonrpc/answer.rs`). Pure functions of the body.

pub mod answer;
pub mod batch;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
