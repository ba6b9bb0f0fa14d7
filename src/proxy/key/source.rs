//! Reads a request's idempotency key from its route's key source: a header (the `Idempotency-Key`
//! form: an sf-string or a bare token), a CloudEvent's source and id (`key/cloudevents.rs`), a JSON
//! pointer into the body (`key/pointer.rs`), a JSON-RPC call's key and `id` (`key/jsonrpc.rs`), or a
//! template joining such parts, each part taken from the request written as its length, `:` and itself. [`from_head`] serves the sources found in the head,
//! before the body is read; [`from_body`] the rest, once it has been. Every key, whatever its source, is
//! 1 to `max_key_length` visible ASCII characters or a 400 `invalid-key`. Pure functions of the request;
//! the body is read as JSON at most once, by streaming, and only when a source asks for it.

use http::request::Parts;
use http::{HeaderMap, HeaderName, Method, Uri};

use super::json::Scratch;
use super::pointer::{self, Findings, Found};
use super::{check_key, cloudevents, parse_key};
use crate::config::{KeyPart, KeySource, Policy};
use crate::error::{Busy, ProxyError};
use crate::headers::{REPEATABILITY_FIRST_SENT_HEADER, REPEATABILITY_ID_HEADER};
use crate::proxy::dialect::jsonrpc::{self, CallId};

/// The key of a request whose source is in its head (`KeySource::needs_body` is false). `Ok(None)`
/// when the request carries none.
pub fn from_head(
    policy: &Policy,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
) -> Result<Option<String>, ProxyError> {
    debug_assert!(
        !policy.key.source.needs_body(),
        "{} needs the body",
        policy.key.source
    );
    Request {
        method,
        uri,
        headers,
        json: None,
    }
    .key(policy)
}

/// What a body holds for its route's key source: the key, and on a route keyed by `jsonrpc`, the `id`
/// of the call, which a replay answers with.
#[derive(Debug, Default)]
pub struct BodyKey {
    /// The key; `None` when the body holds none.
    pub key: Option<String>,
    /// The JSON-RPC call's `id`; `None` on other routes, for a notification, or a body that is not one
    /// call.
    pub call_id: Option<CallId>,
}

/// The key of a request whose source needs its body, read within `scratch` (503 `busy` when the budget
/// cannot supply it). No key when the request carries none: the body is not JSON, or holds nothing at
/// the pointer, or no CloudEvent. On a `jsonrpc` route `body` is one call (a batch is taken apart by
/// `intake/examine.rs`, and each of its calls read here); on a `graphql` route the key is the
/// document's (`dialect/graphql.rs`), never read here.
pub fn from_body(
    policy: &Policy,
    parts: &Parts,
    body: &[u8],
    scratch: &mut Scratch<'_>,
) -> Result<BodyKey, ProxyError> {
    let pointers = pointers(&policy.key.source, &parts.headers);
    let json = if pointers.is_empty() {
        None
    } else {
        pointer::find(body, pointers, scratch).map_err(|_| ProxyError::Busy(Busy::Parsing))?
    };
    let key = Request {
        method: &parts.method,
        uri: &parts.uri,
        headers: &parts.headers,
        json: json.as_ref(),
    }
    .key(policy)?;
    let call_id = match (&policy.key.source, &json) {
        (KeySource::JsonRpc(_), Some(json)) => CallId::from_found(json.get(jsonrpc::ID)),
        _ => None,
    };
    Ok(BodyKey { key, call_id })
}

/// The pointers a source reads the body at: its `json:` pointers, and a structured CloudEvent's.
fn pointers(source: &KeySource, headers: &HeaderMap) -> Vec<String> {
    let mut pointers = Vec::new();
    let mut add = |part: &KeyPart| match part {
        KeyPart::Json(pointer) => pointers.push(pointer.clone()),
        KeyPart::CloudEvents if cloudevents::reads_body(headers) => {
            pointers.extend(cloudevents::POINTERS.map(String::from));
        }
        _ => {}
    };
    match source {
        KeySource::Header(_) | KeySource::Repeatability | KeySource::GraphQl => {}
        KeySource::CloudEvents => add(&KeyPart::CloudEvents),
        KeySource::Json(pointer) => add(&KeyPart::Json(pointer.clone())),
        KeySource::JsonRpc(pointer) => {
            add(&KeyPart::Json(pointer.clone()));
            pointers.push(jsonrpc::ID.to_owned());
        }
        KeySource::Template(parts) => parts.iter().for_each(add),
    }
    pointers
}

/// What a request on this source must carry, for the 400 `missing-key` detail.
pub fn describe(source: &KeySource) -> String {
    match source {
        KeySource::Header(name) => describe_header(name),
        KeySource::Repeatability => {
            format!("a {REPEATABILITY_ID_HEADER} header (with {REPEATABILITY_FIRST_SENT_HEADER})")
        }
        KeySource::CloudEvents => describe_part(&KeyPart::CloudEvents).unwrap_or_default(),
        KeySource::Json(pointer) | KeySource::JsonRpc(pointer) => describe_json(pointer),
        KeySource::GraphQl => "@idempotent(key: …) on each root field of its mutation".into(),
        KeySource::Template(parts) => {
            let needed: Vec<String> = parts.iter().filter_map(describe_part).collect();
            format!("{} (key = \"{source}\")", join_and(&needed))
        }
    }
}

fn describe_part(part: &KeyPart) -> Option<String> {
    match part {
        KeyPart::Header(name) => Some(describe_header(name)),
        KeyPart::Json(pointer) => Some(describe_json(pointer)),
        KeyPart::CloudEvents => Some(
            "a CloudEvent id and source (ce-id and ce-source headers, or an application/cloudevents+json \
             body)"
                .into(),
        ),
        KeyPart::Literal(_) | KeyPart::Method | KeyPart::Path => None,
    }
}

fn describe_header(name: &HeaderName) -> String {
    let article = if name.as_str().starts_with(['a', 'e', 'i', 'o', 'x']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {name} header")
}

fn describe_json(pointer: &str) -> String {
    if pointer.is_empty() {
        return "a JSON string or number as the whole body".into();
    }
    format!("the JSON field {pointer} in the body")
}

/// `a`, `a and b`, `a, b and c`.
fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The request as the key sources see it: its head, and what its body holds at the source's pointers
/// (`None` when the body is not JSON, or was not read).
struct Request<'a> {
    method: &'a Method,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    json: Option<&'a Findings>,
}

impl Request<'_> {
    fn key(&self, policy: &Policy) -> Result<Option<String>, ProxyError> {
        let max_len = policy.key.max_key_length;
        let key = match &policy.key.source {
            KeySource::Header(name) => return parse_key(self.headers.get_all(name), max_len),
            KeySource::Repeatability => {
                return parse_key(self.headers.get_all(REPEATABILITY_ID_HEADER), max_len);
            }
            KeySource::CloudEvents => self.cloudevent()?,
            KeySource::GraphQl => return Ok(None),
            KeySource::Json(pointer) | KeySource::JsonRpc(pointer) => self.json_field(pointer)?,
            KeySource::Template(parts) => self.template(parts, max_len)?,
        };
        let Some(key) = key else {
            return Ok(None);
        };
        check_key(&key, max_len)?;
        Ok(Some(key))
    }

    fn cloudevent(&self) -> Result<Option<String>, ProxyError> {
        cloudevents::key(self.headers, || self.json)
    }

    /// The value at `pointer` in a JSON body: a string as it is (escapes decoded), a number as its exact
    /// text.
    fn json_field(&self, pointer: &str) -> Result<Option<String>, ProxyError> {
        let Some(json) = self.json else {
            return Ok(None);
        };
        match json.get(pointer) {
            Found::Absent => Ok(None),
            Found::String(text) | Found::Number(text) => Ok(Some(text.clone())),
            Found::Other(kind) => Err(ProxyError::InvalidKey(format!(
                "the JSON field {pointer} is {kind}; a key must be a string or a number"
            ))),
            Found::Repeated => Err(ProxyError::InvalidKey(format!(
                "the body names the JSON field {pointer} twice in one object; which one counts is \
                 ambiguous"
            ))),
        }
    }

    /// The template's parts joined, each part taken from the request written as `<length>:<value>`
    /// (literal text as written), so no two sets of values make one key; `None` as soon as one is
    /// missing.
    fn template(&self, parts: &[KeyPart], max_len: usize) -> Result<Option<String>, ProxyError> {
        let mut key = String::new();
        for part in parts {
            let Some(value) = self.part(part, max_len)? else {
                return Ok(None);
            };
            if !value.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ProxyError::InvalidKey(format!(
                    "the key part {part} holds characters other than visible ASCII"
                )));
            }
            if !matches!(part, KeyPart::Literal(_)) {
                key.push_str(&format!("{}:", value.len()));
            }
            key.push_str(&value);
        }
        Ok(Some(key))
    }

    fn part(&self, part: &KeyPart, max_len: usize) -> Result<Option<String>, ProxyError> {
        match part {
            KeyPart::Literal(text) => Ok(Some(text.clone())),
            KeyPart::Method => Ok(Some(self.method.as_str().to_owned())),
            KeyPart::Path => Ok(Some(self.uri.path().to_owned())),
            KeyPart::Header(name) => parse_key(self.headers.get_all(name), max_len).map_err(|e| match e {
                ProxyError::InvalidKey(why) => ProxyError::InvalidKey(format!("{name}: {why}")),
                other => other,
            }),
            KeyPart::Json(pointer) => self.json_field(pointer),
            KeyPart::CloudEvents => self.cloudevent(),
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Request as HttpRequest};

    use super::*;
    use crate::config::RawIdempotency;

    fn policy(key: &str) -> Policy {
        RawIdempotency {
            key: Some(key.into()),
            max_key_length: 40,
            ..RawIdempotency::default()
        }
        .validate()
        .unwrap()
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut request = HttpRequest::post(uri);
        for (name, value) in headers {
            request = request.header(*name, HeaderValue::from_str(value).unwrap());
        }
        request.body(()).unwrap().into_parts().0
    }

    fn key(source: &str, headers: &[(&str, &str)], body: &str) -> Result<Option<String>, ProxyError> {
        read(&policy(source), headers, body).map(|found| found.key)
    }

    fn read(policy: &Policy, headers: &[(&str, &str)], body: &str) -> Result<BodyKey, ProxyError> {
        from_body(
            policy,
            &parts("/hooks/pay?x=1", headers),
            body.as_bytes(),
            &mut Scratch::unbounded(),
        )
    }

    fn invalid(result: Result<Option<String>, ProxyError>) -> String {
        match result {
            Err(ProxyError::InvalidKey(why)) => why,
            other => panic!("expected invalid-key, got {other:?}"),
        }
    }

    #[test]
    fn a_header_source_reads_the_header_in_both_forms() {
        let policy = policy("header:x-github-delivery");
        let read = |value: &str| {
            let parts = parts("/", &[("x-github-delivery", value)]);
            from_head(&policy, &parts.method, &parts.uri, &parts.headers)
        };
        assert_eq!(read("72d3162e").unwrap().as_deref(), Some("72d3162e"));
        assert_eq!(read("\"72d3162e\"").unwrap().as_deref(), Some("72d3162e"));
        assert!(matches!(read("a b"), Err(ProxyError::InvalidKey(_))));
        let none = parts("/", &[]);
        assert_eq!(
            from_head(&policy, &none.method, &none.uri, &none.headers).unwrap(),
            None
        );
    }

    #[test]
    fn a_json_pointer_takes_strings_and_numbers() {
        assert_eq!(
            key("json:/id", &[], r#"{"id":"evt_1"}"#).unwrap().as_deref(),
            Some("evt_1")
        );
        assert_eq!(
            key("json:/data/object/id", &[], r#"{"data":{"object":{"id":42}}}"#)
                .unwrap()
                .as_deref(),
            Some("42")
        );
        assert_eq!(
            key("json:/a~1b/0", &[], r#"{"a/b":[-1.5]}"#).unwrap().as_deref(),
            Some("-1.5")
        );
    }

    #[test]
    fn a_json_number_is_its_exact_text() {
        let one = key("json:/id", &[], r#"{"id":123456789012345678901234}"#).unwrap();
        let two = key("json:/id", &[], r#"{"id":123456789012345678901235}"#).unwrap();
        assert_eq!(one.as_deref(), Some("123456789012345678901234"));
        assert_ne!(one, two, "two ids one f64 holds as one are two keys");
        assert_eq!(
            key("json:/id", &[], r#"{"id":1.0}"#).unwrap().as_deref(),
            Some("1.0")
        );
        assert_eq!(
            key("json:/id", &[], r#"{"id":1e2}"#).unwrap().as_deref(),
            Some("1e2")
        );
    }

    #[test]
    fn a_json_field_named_twice_on_its_path_is_an_invalid_key() {
        for body in [
            r#"{"id":"a","id":"b"}"#,
            r#"{"id":"a","id":"a"}"#,
            r#"{"id":"a","\u0069d":"b"}"#,
        ] {
            let why = invalid(key("json:/id", &[], body));
            assert!(why.contains("/id") && why.contains("twice"), "{body}: {why}");
        }
        let why = invalid(key("json:/data/id", &[], r#"{"data":{"id":1},"data":{"id":2}}"#));
        assert!(why.contains("/data/id"), "{why}");
        assert_eq!(
            key("json:/id", &[], r#"{"id":"a","x":{"id":"b"},"y":1,"y":2}"#)
                .unwrap()
                .as_deref(),
            Some("a"),
            "names repeated off the path do not count"
        );
        assert_eq!(key("json:/id", &[], r#"{"id":"a","id":"b"} x"#).unwrap(), None);
    }

    #[test]
    fn a_json_pointer_finds_no_key_in_a_body_without_one() {
        for body in ["", "not json", "{\"other\":1}", "[1,2]", "{\"id\":", "\u{feff}{}"] {
            assert_eq!(key("json:/id", &[], body).unwrap(), None, "{body:?}");
        }
    }

    #[test]
    fn a_json_field_of_another_type_is_an_invalid_key() {
        for (body, kind) in [
            (r#"{"id":null}"#, "null"),
            (r#"{"id":true}"#, "a boolean"),
            (r#"{"id":[1]}"#, "an array"),
            (r#"{"id":{"a":1}}"#, "an object"),
        ] {
            let why = invalid(key("json:/id", &[], body));
            assert!(why.contains(kind) && why.contains("/id"), "{why}");
        }
    }

    #[test]
    fn keys_from_the_body_obey_the_key_rules() {
        assert!(invalid(key("json:/id", &[], r#"{"id":""}"#)).contains("empty"));
        assert!(invalid(key("json:/id", &[], r#"{"id":"a b"}"#)).contains("visible ASCII"));
        assert!(invalid(key("json:/id", &[], r#"{"id":"café"}"#)).contains("visible ASCII"));
        let long = format!(r#"{{"id":"{}"}}"#, "a".repeat(41));
        assert!(invalid(key("json:/id", &[], &long)).contains("longer than 40"));
        let longest = format!(r#"{{"id":"{}"}}"#, "a".repeat(40));
        assert!(key("json:/id", &[], &longest).unwrap().is_some());
    }

    #[test]
    fn hostile_json_is_no_key_and_no_panic() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(key("json:/id", &[], &deep).unwrap(), None);
        let deep_object = format!("{}1{}", "{\"id\":".repeat(5000), "}".repeat(5000));
        assert_eq!(key("json:/id", &[], &deep_object).unwrap(), None);
        assert_eq!(key("json:/id", &[], "{\"id\":\"\\ud800\"}").unwrap(), None);
    }

    #[test]
    fn a_template_joins_its_parts() {
        let source = "template:{method}:{path}:{header:x-hook}/{json:/id}";
        let headers = [("x-hook", "h1")];
        assert_eq!(
            key(source, &headers, r#"{"id":7}"#).unwrap().as_deref(),
            Some("4:POST:10:/hooks/pay:2:h1/1:7"),
            "the path is taken without its query"
        );
    }

    #[test]
    fn template_parts_cannot_run_into_each_other() {
        let source = "template:{header:x-tenant}{header:x-op}";
        let read = |tenant: &str, op: &str| {
            key(source, &[("x-tenant", tenant), ("x-op", op)], "")
                .unwrap()
                .unwrap()
        };
        assert_eq!(read("acme", "1"), "4:acme1:1");
        assert_ne!(read("ac", "me1"), read("acme", "1"));
        assert_ne!(read("1:a", "b"), read("1", "a:b"));
        let shopify = "template:{header:X-Shopify-Topic}/{header:X-Shopify-Event-Id}";
        let read = |topic: &str, id: &str| {
            key(
                shopify,
                &[("x-shopify-topic", topic), ("x-shopify-event-id", id)],
                "",
            )
            .unwrap()
            .unwrap()
        };
        assert_eq!(read("orders/create", "e1"), "13:orders/create/2:e1");
        assert_ne!(read("orders/create", "e1"), read("orders", "create/e1"));
        assert_ne!(
            key("template:{json:/a}{json:/b}", &[], r#"{"a":"12","b":"3"}"#).unwrap(),
            key("template:{json:/a}{json:/b}", &[], r#"{"a":"1","b":"23"}"#).unwrap()
        );
    }

    #[test]
    fn a_template_with_a_part_missing_has_no_key() {
        let source = "template:{header:x-hook}/{json:/id}";
        assert_eq!(key(source, &[], r#"{"id":7}"#).unwrap(), None);
        assert_eq!(key(source, &[("x-hook", "h1")], "{}").unwrap(), None);
    }

    #[test]
    fn a_template_refuses_bad_parts_and_checks_the_whole_length() {
        let source = "template:{header:x-hook}/{json:/id}";
        let why = invalid(key(source, &[("x-hook", "h1")], r#"{"id":"a b"}"#));
        assert!(why.contains("{json:/id}"), "{why}");
        let why = invalid(key(source, &[("x-hook", "a,b")], r#"{"id":1}"#));
        assert!(why.starts_with("x-hook: "), "{why}");
        let long = format!(r#"{{"id":"{}"}}"#, "a".repeat(38));
        assert!(invalid(key(source, &[("x-hook", "h1")], &long)).contains("longer than 40"));
    }

    #[test]
    fn a_template_of_head_parts_is_read_from_the_head() {
        let policy = policy("template:{method}{path}-{header:webhook-id}");
        let parts = parts("/p?q", &[("webhook-id", "msg_1")]);
        let key = from_head(&policy, &parts.method, &parts.uri, &parts.headers).unwrap();
        assert_eq!(key.as_deref(), Some("4:POST2:/p-5:msg_1"));
    }

    fn call_id(found: &BodyKey) -> Option<&str> {
        found.call_id.as_ref().map(CallId::as_json)
    }

    #[test]
    fn a_jsonrpc_source_reads_the_key_from_meta_and_the_call_id() {
        let rpc = policy("jsonrpc");
        let call =
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"_meta":{"idempotencyKey":"k-1"}}}"#;
        let found = read(&rpc, &[], call).unwrap();
        assert_eq!(found.key.as_deref(), Some("k-1"));
        assert_eq!(call_id(&found), Some("7"));
        let string_id = call.replace("\"id\":7", "\"id\":\"7\"");
        assert_eq!(call_id(&read(&rpc, &[], &string_id).unwrap()), Some("\"7\""));
        let notification =
            r#"{"jsonrpc":"2.0","method":"notify","params":{"_meta":{"idempotencyKey":"k-2"}}}"#;
        let found = read(&rpc, &[], notification).unwrap();
        assert_eq!(found.key.as_deref(), Some("k-2"));
        assert_eq!(call_id(&found), None, "a notification has no id");
        let named = policy("jsonrpc:/params/idempotency_key");
        let found = read(&named, &[], r#"{"id":1,"params":{"idempotency_key":"k-3"}}"#).unwrap();
        assert_eq!(found.key.as_deref(), Some("k-3"));
        assert_eq!(call_id(&found), Some("1"));
        let json = read(&policy("json:/params/_meta/idempotencyKey"), &[], call).unwrap();
        assert_eq!(call_id(&json), None, "only a jsonrpc route knows the call's id");
    }

    #[test]
    fn a_jsonrpc_key_obeys_the_key_rules_and_a_body_without_one_has_none() {
        let policy = policy("jsonrpc");
        let with = |key: &str| format!(r#"{{"id":1,"params":{{"_meta":{{"idempotencyKey":{key}}}}}}}"#);
        assert!(invalid(read(&policy, &[], &with(r#""""#)).map(|f| f.key)).contains("empty"));
        assert!(invalid(read(&policy, &[], &with(r#"{"a":1}"#)).map(|f| f.key)).contains("an object"));
        for body in [
            "",
            "not json",
            "{\"id\":1}",
            "\"k\"",
            "{\"params\":{\"_meta\":1}}",
        ] {
            let found = read(&policy, &[], body).unwrap();
            assert_eq!(found.key, None, "{body:?}");
        }
    }

    #[test]
    fn each_source_says_what_a_request_must_carry() {
        let describe = |text: &str| describe(&KeySource::parse("k", text).unwrap());
        assert_eq!(describe("header:Idempotency-Key"), "an idempotency-key header");
        assert_eq!(describe("header:webhook-id"), "a webhook-id header");
        assert_eq!(describe("json:/id"), "the JSON field /id in the body");
        assert_eq!(
            describe("jsonrpc"),
            "the JSON field /params/_meta/idempotencyKey in the body"
        );
        assert_eq!(
            describe("cloudevents"),
            "a CloudEvent id and source (ce-id and ce-source headers, or an application/cloudevents+json \
             body)"
        );
        assert_eq!(
            describe("template:{method}:{header:x-hook}/{json:/id}"),
            "an x-hook header and the JSON field /id in the body (key = \
             \"template:{method}:{header:x-hook}/{json:/id}\")"
        );
    }
}
