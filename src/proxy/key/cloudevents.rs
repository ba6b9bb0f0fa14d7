//! Runs for a route keyed by `cloudevents` (or a template with a `{cloudevents}` part), once the body
//! has been read: finds the CloudEvent a request carries (CloudEvents HTTP binding 1.0) and makes its key
//! from the event's `source` and `id`, which the spec makes unique together ("id is unique within the
//! scope of the producer", the source). Binary mode: `ce-source` and `ce-id` headers. Structured mode: an
//! `application/cloudevents+json` body's `source` and `id` fields. Batched mode is refused with
//! `cloudevents-batch`: one request, many events, no one key. Pure functions of the request.
//!
//! The key is the same for the same event in either mode: header values are percent-decoded first (the
//! binding percent-encodes them), then source and id are written with only what a key may not hold
//! percent-encoded, the source length-prefixed so no two (source, id) pairs make one key:
//! `<length of source>:<source>:<id>`.

use http::HeaderMap;
use http::header::CONTENT_TYPE;
use percent_encoding::{AsciiSet, CONTROLS, percent_decode_str, utf8_percent_encode};

use super::pointer::{Findings, Found};
use crate::error::ProxyError;

/// The media type of a structured-mode event.
const STRUCTURED: &str = "application/cloudevents+json";
/// The media type of a batch of events.
const BATCH: &str = "application/cloudevents-batch+json";

/// What a key may not hold as is: controls, space, `"` and `%` (the escape itself); everything outside
/// ASCII is always encoded.
const KEY_UNSAFE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// The pointers a structured-mode event is read at: the whole body (an object), its `source` and `id`.
pub const POINTERS: [&str; 3] = ["", "/source", "/id"];

/// Whether the body is to be read for the event: the request is in structured mode (the key is then
/// read from [`POINTERS`]).
pub fn reads_body(headers: &HeaderMap) -> bool {
    media_type(headers).as_deref() == Some(STRUCTURED)
}

/// The CloudEvent's key, or `None` when the request carries no CloudEvent. `json` gives what the body
/// holds at [`POINTERS`] (`None` when it is not JSON); it is only asked for in structured mode.
pub fn key<'a>(
    headers: &HeaderMap,
    json: impl FnOnce() -> Option<&'a Findings>,
) -> Result<Option<String>, ProxyError> {
    let media_type = media_type(headers);
    if media_type.as_deref() == Some(BATCH) {
        return Err(ProxyError::CloudEventsBatch);
    }
    if let Some(event) = binary(headers)? {
        return Ok(Some(event.key()));
    }
    if media_type.as_deref() == Some(STRUCTURED) {
        return structured(json()).map(|event| Some(event.key()));
    }
    Ok(None)
}

/// A CloudEvent's identity, decoded.
#[derive(Debug, PartialEq, Eq)]
struct Event {
    source: String,
    id: String,
}

impl Event {
    fn key(&self) -> String {
        let source = utf8_percent_encode(&self.source, KEY_UNSAFE).to_string();
        let id = utf8_percent_encode(&self.id, KEY_UNSAFE);
        format!("{}:{source}:{id}", source.len())
    }
}

/// The `Content-Type` without parameters, lower-case.
fn media_type(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
    let essence = value.split(';').next().unwrap_or_default().trim();
    Some(essence.to_ascii_lowercase())
}

/// The binary-mode event: both headers, or neither (no event).
fn binary(headers: &HeaderMap) -> Result<Option<Event>, ProxyError> {
    match (header(headers, "ce-source")?, header(headers, "ce-id")?) {
        (None, None) => Ok(None),
        (Some(source), Some(id)) => Ok(Some(Event { source, id })),
        (None, Some(_)) => Err(invalid("ce-id came without ce-source; a CloudEvent needs both")),
        (Some(_), None) => Err(invalid("ce-source came without ce-id; a CloudEvent needs both")),
    }
}

/// One binary-mode attribute header, percent-decoded.
fn header(headers: &HeaderMap, name: &str) -> Result<Option<String>, ProxyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(invalid(&format!("the {name} header is repeated")));
    }
    let text = value.to_str().map_err(|_| {
        invalid(&format!(
            "{name} is not ASCII (the binding percent-encodes values)"
        ))
    })?;
    let decoded = percent_decode_str(text.trim())
        .decode_utf8()
        .map_err(|_| invalid(&format!("{name} is not percent-encoded UTF-8")))?;
    if decoded.is_empty() {
        return Err(invalid(&format!("{name} is empty")));
    }
    Ok(Some(decoded.into_owned()))
}

/// The structured-mode event: the body's `source` and `id`.
fn structured(json: Option<&Findings>) -> Result<Event, ProxyError> {
    let Some(event) = json.filter(|json| json.get("") == &Found::Other("an object")) else {
        return Err(invalid(
            "the application/cloudevents+json body is not a JSON object",
        ));
    };
    let field = |name: &str| match event.get(&format!("/{name}")) {
        Found::Absent => Err(invalid(&format!("the CloudEvent has no {name}"))),
        Found::String(text) if text.is_empty() => Err(invalid(&format!("the CloudEvent's {name} is empty"))),
        Found::String(text) => Ok(text.clone()),
        Found::Repeated => Err(invalid(&format!(
            "the CloudEvent names its {name} twice; which one counts is ambiguous"
        ))),
        Found::Number(_) | Found::Other(_) => {
            Err(invalid(&format!("the CloudEvent's {name} is not a string")))
        }
    };
    Ok(Event {
        source: field("source")?,
        id: field("id")?,
    })
}

fn invalid(why: &str) -> ProxyError {
    ProxyError::InvalidKey(why.to_owned())
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    fn read(pairs: &[(&str, &str)], body: &str) -> Result<Option<String>, ProxyError> {
        let pointers = POINTERS.map(String::from).to_vec();
        let json = super::super::pointer::find(
            body.as_bytes(),
            pointers,
            &mut super::super::json::Scratch::unbounded(),
        )
        .unwrap();
        key(&headers(pairs), || json.as_ref())
    }

    fn invalid_because(result: Result<Option<String>, ProxyError>) -> String {
        match result {
            Err(ProxyError::InvalidKey(why)) => why,
            other => panic!("expected invalid-key, got {other:?}"),
        }
    }

    const BINARY: [(&str, &str); 4] = [
        ("ce-specversion", "1.0"),
        ("ce-type", "dev.knative.example"),
        ("ce-source", "/apis/v1/namespaces/default/pingsources/p"),
        ("ce-id", "a1b2"),
    ];

    #[test]
    fn binary_mode_keys_by_source_and_id() {
        let key = read(&BINARY, "{\"any\":\"data\"}").unwrap();
        assert_eq!(
            key.as_deref(),
            Some("41:/apis/v1/namespaces/default/pingsources/p:a1b2")
        );
    }

    #[test]
    fn structured_mode_gives_the_same_key_as_binary_mode() {
        let body = r#"{"specversion":"1.0","type":"t","source":"/apis/v1/namespaces/default/pingsources/p",
                       "id":"a1b2","data":{}}"#;
        for content_type in [
            "application/cloudevents+json",
            "application/cloudevents+json; charset=utf-8",
            "Application/CloudEvents+JSON ;charset=UTF-8",
        ] {
            let structured = read(&[("content-type", content_type)], body).unwrap();
            assert_eq!(structured, read(&BINARY, "").unwrap(), "{content_type}");
        }
    }

    #[test]
    fn percent_encoded_headers_and_unicode_fields_make_one_key() {
        let binary = read(&[("ce-source", "urn:caf%C3%A9 1"), ("ce-id", "%25x")], "").unwrap();
        let body = r#"{"source":"urn:café 1","id":"%x"}"#;
        let structured = read(&[("content-type", STRUCTURED)], body).unwrap();
        assert_eq!(binary, structured);
        let key = binary.unwrap();
        assert_eq!(key, "17:urn:caf%C3%A9%201:%25x");
        assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{key}");
    }

    #[test]
    fn no_two_source_and_id_pairs_share_a_key() {
        let key = |source: &str, id: &str| {
            Event {
                source: source.into(),
                id: id.into(),
            }
            .key()
        };
        assert_ne!(key("a:b", "c"), key("a", "b:c"));
        assert_ne!(key("1:a", "b"), key("1", "a:b"));
        assert_ne!(key("a", "b"), key("b", "a"));
        assert_eq!(key("a", "b"), key("a", "b"));
    }

    #[test]
    fn a_binary_event_missing_one_half_is_refused_naming_it() {
        let why = invalid_because(read(&[("ce-id", "1")], ""));
        assert!(why.contains("without ce-source"), "{why}");
        let why = invalid_because(read(&[("ce-source", "/s")], ""));
        assert!(why.contains("without ce-id"), "{why}");
    }

    #[test]
    fn bad_binary_headers_are_refused() {
        for (pairs, says) in [
            (vec![("ce-source", "/s"), ("ce-id", "")], "ce-id is empty"),
            (
                vec![("ce-source", "%FF"), ("ce-id", "1")],
                "not percent-encoded UTF-8",
            ),
            (
                vec![("ce-source", "/s"), ("ce-id", "1"), ("ce-id", "2")],
                "repeated",
            ),
        ] {
            let why = invalid_because(read(&pairs, ""));
            assert!(why.contains(says), "{pairs:?}: {why}");
        }
    }

    #[test]
    fn bad_structured_events_are_refused() {
        let structured = [("content-type", STRUCTURED)];
        for (body, says) in [
            ("not json", "not a JSON object"),
            ("[]", "not a JSON object"),
            (r#"{"source":"/s"}"#, "has no id"),
            (r#"{"id":"1"}"#, "has no source"),
            (r#"{"source":"/s","id":1}"#, "id is not a string"),
            (r#"{"source":"","id":"1"}"#, "source is empty"),
            (r#"{"source":"/s","id":"1","id":"2"}"#, "names its id twice"),
            (
                r#"{"source":"/s","source":"/t","id":"1"}"#,
                "names its source twice",
            ),
            (r#"{"source":"/s","id":"1"} x"#, "not a JSON object"),
        ] {
            let why = invalid_because(read(&structured, body));
            assert!(why.contains(says), "{body}: {why}");
        }
    }

    #[test]
    fn a_batch_is_refused_with_its_own_problem() {
        for content_type in [BATCH, "application/cloudevents-batch+json; charset=utf-8"] {
            let result = read(&[("content-type", content_type)], r#"[{"source":"/s","id":"1"}]"#);
            assert!(matches!(result, Err(ProxyError::CloudEventsBatch)), "{result:?}");
        }
    }

    #[test]
    fn a_request_without_an_event_has_no_key() {
        assert_eq!(read(&[], "").unwrap(), None);
        let plain_json = [("content-type", "application/json")];
        assert_eq!(read(&plain_json, r#"{"source":"/s","id":"1"}"#).unwrap(), None);
    }
}
