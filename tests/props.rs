//! Property tests of what the proxy parses from untrusted input: the key header, the scope and the
//! fingerprint, JSON bodies (read by streaming: never a panic, and JSON exactly when serde_json says so),
//! `multipart/form-data` bodies (one fingerprint under any boundary, every byte of a part counting),
//! and the configuration loader. Case counts stay modest so the suite stays fast.

use http::{HeaderMap, HeaderValue, Method, Uri};
use idemproxy::config::Config;
use idemproxy::error::ProxyError;
use idemproxy::proxy::key::json::Scratch;
use idemproxy::proxy::key::pointer::{self, Found};
use idemproxy::proxy::key::{canonical, fingerprint, parse_key, scope};
use proptest::prelude::*;

const MAX_KEY: usize = 64;

fn key_of(value: &[u8]) -> Option<Result<Option<String>, ProxyError>> {
    let value = HeaderValue::from_bytes(value).ok()?;
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", value);
    Some(parse_key(headers.get_all("idempotency-key"), MAX_KEY))
}

fn sf_quote(key: &str) -> String {
    let escaped = key.replace('\\', "\\\\").replace('"', "\\\"");
    format!("\"{escaped}\"")
}

/// A path and query of URI characters, as a client could send it.
fn target() -> impl Strategy<Value = String> {
    "/[A-Za-z0-9._~%!$&'()*+,;=:@/-]{0,40}(\\?[A-Za-z0-9=&%-]{0,20})?"
}

fn policy() -> idemproxy::config::Policy {
    idemproxy::config::RawIdempotency::default()
        .validate()
        .expect("the default policy is valid")
}

fn fp(method: &Method, target: &str, content_type: &[u8], body: &[u8]) -> [u8; 32] {
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        HeaderValue::from_bytes(content_type).expect("valid header value"),
    );
    let uri: Uri = target.parse().expect("valid target");
    fingerprint(
        &policy().key,
        method,
        &uri,
        &headers,
        body,
        &mut Scratch::unbounded(),
    )
    .expect("no budget to run out of")
}

fn auth(value: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        "authorization",
        HeaderValue::from_bytes(value).expect("valid header value"),
    );
    headers
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn key_parser_never_panics_and_accepts_only_visible_ascii(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
        if let Some(result) = key_of(&bytes) {
            match result {
                Ok(Some(key)) => {
                    prop_assert!(!key.is_empty() && key.len() <= MAX_KEY, "{key:?}");
                    prop_assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{key:?}");
                }
                Ok(None) => prop_assert!(false, "a present header is never 'no key'"),
                Err(ProxyError::InvalidKey(_)) => {}
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            }
        }
    }

    #[test]
    fn a_key_and_its_sf_string_are_the_same_key(key in "[!-~]{1,64}") {
        let quoted = key_of(sf_quote(&key).as_bytes()).expect("a quoted key is a header value");
        prop_assert_eq!(quoted.ok().flatten(), Some(key.clone()));
        if !key.contains(',') && !key.starts_with('"') {
            let bare = key_of(key.as_bytes()).expect("a bare key is a header value");
            prop_assert_eq!(bare.ok().flatten(), Some(key));
        }
    }

    #[test]
    fn keys_longer_than_the_limit_are_refused(key in "[A-Za-z0-9_-]{65,100}") {
        prop_assert!(matches!(key_of(key.as_bytes()), Some(Err(ProxyError::InvalidKey(_)))));
        prop_assert!(matches!(key_of(sf_quote(&key).as_bytes()), Some(Err(ProxyError::InvalidKey(_)))));
    }

    #[test]
    fn equal_requests_have_equal_fingerprints(
        target in target(),
        body in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        prop_assert_eq!(
            fp(&Method::POST, &target, b"application/json", &body),
            fp(&Method::POST, &target, b"application/json", &body)
        );
    }

    #[test]
    fn any_single_byte_change_in_the_body_changes_the_fingerprint(
        body in prop::collection::vec(any::<u8>(), 1..200),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let mut changed = body.clone();
        let i = at.index(body.len());
        changed[i] ^= flip;
        prop_assert_ne!(
            fp(&Method::POST, "/pay", b"application/json", &body),
            fp(&Method::POST, "/pay", b"application/json", &changed)
        );
    }

    #[test]
    fn method_path_header_and_boundaries_all_count(
        target in target(),
        body in prop::collection::vec(any::<u8>(), 0..100),
        content_type in "[a-z/+.-]{1,30}",
    ) {
        let base = fp(&Method::POST, &target, content_type.as_bytes(), &body);
        prop_assert_ne!(base, fp(&Method::PATCH, &target, content_type.as_bytes(), &body));
        let other_target = format!("{target}x");
        prop_assert_ne!(base, fp(&Method::POST, &other_target, content_type.as_bytes(), &body));
        let other_type = format!("{content_type}x");
        prop_assert_ne!(base, fp(&Method::POST, &target, other_type.as_bytes(), &body));
        // A byte moved from the body's start to the header's end is a different request.
        if let Some((&first, rest)) = body.split_first() {
            let mut shifted = content_type.clone().into_bytes();
            shifted.push(first);
            if HeaderValue::from_bytes(&shifted).is_ok() {
                prop_assert_ne!(base, fp(&Method::POST, &target, &shifted, rest));
            }
        }
    }

    #[test]
    fn scopes_separate_credentials_and_never_contain_them(
        a in prop::collection::vec(32u8..=255, 1..60).prop_filter("not DEL", |v| !v.contains(&127)),
        b in prop::collection::vec(32u8..=255, 1..60).prop_filter("not DEL", |v| !v.contains(&127)),
    ) {
        let policy = policy();
        let scope_a = scope("default", &policy.key, &auth(&a));
        prop_assert_eq!(&scope_a, &scope("default", &policy.key, &auth(&a)));
        if a != b {
            prop_assert_ne!(&scope_a, &scope("default", &policy.key, &auth(&b)));
        }
        let hex = scope_a.strip_prefix("default:").expect("route scope prefix");
        prop_assert!(hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_hexdigit()), "{scope_a}");
    }
}

/// A value as TOML text: well-typed, mistyped or malformed.
fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        "\"[ -~]{0,20}\"",
        "\"[0-9]{1,4}(ms|s|m|h|d|KiB|MiB|GB|x)?\"",
        any::<i64>().prop_map(|n| n.to_string()),
        any::<bool>().prop_map(|b| b.to_string()),
        "\\[(\"[A-Za-z0-9-]{0,8}\", ?){0,3}\\]",
        "\\{ ?([a-z0-9]{1,3} = \"[A-Za-z0-9+/=]{0,48}\", ?){0,2}\\}",
        "[ -~]{0,12}",
    ]
}

/// A line `key = value` with a key the loader knows, or a near miss.
fn toml_line() -> impl Strategy<Value = String> {
    let keys = prop::sample::select(vec![
        "listen",
        "admin_listen",
        "shutdown_grace",
        "header_read_timeout",
        "body_read_timeout",
        "max_header_size",
        "max_headers",
        "max_connections",
        "url",
        "connect_timeout",
        "timeout",
        "pool_size",
        "max_batch",
        "on_error",
        "migrate",
        "tls_ca_file",
        "header",
        "methods",
        "required",
        "ttl",
        "lock_timeout",
        "max_key_length",
        "max_request_body",
        "max_stored_response",
        "scope_headers",
        "fingerprint_headers",
        "release_statuses",
        "format",
        "filter",
        "active_key",
        "keys",
        "accept_plaintext",
        "cert_file",
        "key_file",
        "nonsense",
    ]);
    (keys, toml_value()).prop_map(|(k, v)| format!("{k} = {v}"))
}

fn toml_document() -> impl Strategy<Value = String> {
    let section = prop::sample::select(vec![
        "[server]",
        "[server.tls]",
        "[upstream]",
        "[store]",
        "[idempotency]",
        "[log]",
        "[encryption]",
        "[bogus]",
        "",
    ]);
    prop::collection::vec((section, prop::collection::vec(toml_line(), 0..4)), 0..4).prop_map(|sections| {
        sections
            .into_iter()
            .map(|(section, lines)| format!("{section}\n{}\n", lines.join("\n")))
            .collect()
    })
}

/// A configuration, or one line per problem found, each naming its key.
fn assert_a_line_per_problem_naming_its_key(text: &str) -> Result<(), TestCaseError> {
    match Config::from_toml_str(text) {
        Ok(_) => {}
        Err(error) => {
            let said = error.to_string();
            let problems: Vec<(&str, &str)> = error.problems().collect();
            let lines: Vec<&str> = said.lines().collect();
            prop_assert_eq!(lines.len(), problems.len(), "one line per problem: {:?}", said);
            for (line, (key, message)) in lines.iter().zip(problems) {
                prop_assert!(!key.is_empty(), "{}", said);
                prop_assert!(!message.contains('\n'), "a problem in one line: {:?}", said);
                prop_assert_eq!(*line, format!("config error: {key}: {message}"));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn config_loader_answers_any_text_with_a_config_or_a_line_per_problem(text in "\\PC{0,200}") {
        assert_a_line_per_problem_naming_its_key(&text)?;
    }

    #[test]
    fn config_loader_answers_any_toml_ish_document_with_a_config_or_a_line_per_problem(text in toml_document()) {
        assert_a_line_per_problem_naming_its_key(&text)?;
    }
}

/// Any JSON document of a few levels: every type, keys and strings with characters JSON escapes.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        "[ -~é\u{1F600}\n]{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 40, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map("[a-z\"/~é]{0,4}", inner, 0..5)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

/// `value` as another client might write it: object members in reverse order, whitespace everywhere.
fn messy_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(messy_json).collect();
            format!("[ {} ]", items.join(" ,\n "))
        }
        Value::Object(members) => {
            let members: Vec<String> = members
                .iter()
                .rev()
                .map(|(name, member)| format!("{} :\t{}", Value::from(name.as_str()), messy_json(member)))
                .collect();
            format!("{{\n  {}\n}}", members.join(",\n  "))
        }
        scalar => format!(" {scalar} "),
    }
}

fn json_fp(body: &str) -> [u8; 32] {
    let policy = idemproxy::config::RawIdempotency {
        fingerprint_body: idemproxy::config::FingerprintBody::Json,
        ..idemproxy::config::RawIdempotency::default()
    }
    .validate()
    .expect("a JSON fingerprint policy is valid");
    let uri: Uri = "/pay".parse().expect("valid target");
    fingerprint(
        &policy.key,
        &Method::POST,
        &uri,
        &HeaderMap::new(),
        body.as_bytes(),
        &mut Scratch::unbounded(),
    )
    .expect("no budget to run out of")
}

/// The key a source reads from a request with these headers and body, keys up to `max` long.
fn source_key(
    source: &str,
    max: usize,
    headers: &[(&str, String)],
    body: &[u8],
) -> Result<Option<String>, ProxyError> {
    let policy = idemproxy::config::RawIdempotency {
        key: Some(source.to_owned()),
        max_key_length: max,
        ..idemproxy::config::RawIdempotency::default()
    }
    .validate()
    .expect("a valid key source");
    let mut request = http::Request::post("/events");
    for (name, value) in headers {
        request = request.header(*name, value.as_str());
    }
    let (parts, ()) = request.body(()).expect("a valid request").into_parts();
    idemproxy::proxy::key::source::from_body(&policy, &parts, body, &mut Scratch::unbounded())
        .map(|found| found.key)
}

fn assert_a_key_or_a_400(result: Result<Option<String>, ProxyError>) -> Result<(), TestCaseError> {
    match result {
        Ok(Some(key)) => {
            prop_assert!(!key.is_empty() && key.len() <= MAX_KEY, "{key:?}");
            prop_assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{key:?}");
        }
        Ok(None) | Err(ProxyError::InvalidKey(_)) | Err(ProxyError::CloudEventsBatch) => {}
        Err(other) => prop_assert!(false, "unexpected error {other:?}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_re_serialised_json_body_has_the_same_json_fingerprint(value in json_value()) {
        let compact = value.to_string();
        let messy = messy_json(&value);
        prop_assert_eq!(json_fp(&compact), json_fp(&messy), "{} vs {}", compact, messy);
    }

    #[test]
    fn different_json_documents_have_different_json_fingerprints(a in json_value(), b in json_value()) {
        if a != b {
            prop_assert_ne!(json_fp(&a.to_string()), json_fp(&b.to_string()), "{} vs {}", a, b);
        }
    }

    #[test]
    fn body_key_sources_answer_any_body_with_a_valid_key_or_a_400(
        body in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..120),
            json_value().prop_map(|v| v.to_string().into_bytes()),
            json_value().prop_map(|v| serde_json::json!({"id": v, "source": "/s"}).to_string().into_bytes()),
        ],
        structured in any::<bool>(),
    ) {
        assert_a_key_or_a_400(source_key("json:/id", MAX_KEY, &[], &body))?;
        assert_a_key_or_a_400(source_key("template:{method}{path}/{json:/id}", MAX_KEY, &[], &body))?;
        let content_type = if structured { "application/cloudevents+json" } else { "application/json" };
        let headers = [("content-type", content_type.to_owned())];
        assert_a_key_or_a_400(source_key("cloudevents", MAX_KEY, &headers, &body))?;
    }

    #[test]
    fn a_cloudevent_has_one_key_in_binary_and_structured_mode(
        source in "[ -~é\u{1F600}]{1,12}",
        id in "[ -~é\u{1F600}]{1,12}",
    ) {
        use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
        let binary = [
            ("ce-source", utf8_percent_encode(&source, NON_ALPHANUMERIC).to_string()),
            ("ce-id", utf8_percent_encode(&id, NON_ALPHANUMERIC).to_string()),
        ];
        let binary_key = source_key("cloudevents", 4096, &binary, b"{}");
        let structured = [("content-type", "application/cloudevents+json".to_owned())];
        let event = serde_json::json!({"specversion": "1.0", "source": source, "id": id});
        let structured_key = source_key("cloudevents", 4096, &structured, event.to_string().as_bytes());
        let key = binary_key.expect("a binary event's key").expect("a binary event has a key");
        prop_assert!(key.bytes().all(|b| b.is_ascii_graphic()), "{key:?}");
        prop_assert_eq!(Some(key), structured_key.expect("a structured event's key"));
    }
}

/// A path a hostile client could send: escapes (good and broken, either case), dots, slashes, path
/// parameters, backslashes and any other character.
fn hostile_path() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("/".to_owned()),
        Just(".".to_owned()),
        Just("..".to_owned()),
        Just(";".to_owned()),
        Just("\\".to_owned()),
        "%[0-9a-fA-F]{2}",
        "%[0-9a-zA-Z%]{0,2}",
        "[A-Za-z0-9_~:@!$&'()*+,=-]{1,3}",
        "\\PC",
    ];
    prop::collection::vec(piece, 0..24).prop_map(|pieces| format!("/{}", pieces.concat()))
}

fn path_rules() -> impl Strategy<Value = idemproxy::config::PathRules> {
    use idemproxy::config::{Ambiguous, PathMode, PathRules};
    let ambiguous = || prop_oneof![Just(Ambiguous::Reject), Just(Ambiguous::Keep)];
    let mode = prop_oneof![Just(PathMode::Normalize), Just(PathMode::Reject)];
    (mode, ambiguous(), ambiguous()).prop_map(|(mode, escaped_slashes, path_parameters)| PathRules {
        mode,
        escaped_slashes,
        path_parameters,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Normalising never panics, its result is a valid request path in normal form (normalising it
    /// again changes nothing, and reject mode accepts it), and it is what `reject` mode lets through.
    #[test]
    fn a_path_normalises_once_and_for_all(path in hostile_path(), rules in path_rules()) {
        use idemproxy::config::{PathMode, PathRules, normal};
        let normalize = PathRules { mode: PathMode::Normalize, ..rules };
        let Ok(once) = normal(&path, &normalize) else {
            return Ok(());
        };
        prop_assert!(once.starts_with('/'), "{once}");
        prop_assert!(once.parse::<http::uri::PathAndQuery>().is_ok(), "{once}");
        prop_assert!(!once.contains("//") && !once.contains("/./") && !once.contains("/../"), "{once}");
        let twice = normal(&once, &normalize).expect("a normal path is accepted");
        prop_assert_eq!(&*twice, &*once);
        prop_assert!(matches!(twice, std::borrow::Cow::Borrowed(_)), "{once}");
        let reject = PathRules { mode: PathMode::Reject, ..rules };
        let accepted = normal(&once, &reject);
        prop_assert_eq!(accepted.as_deref(), Ok(&*once));
        prop_assert_eq!(normal(&path, &reject).is_ok(), path == *once, "{}", path);
    }
}

/// A JSON document's text with a few bytes changed, inserted or removed: mostly not JSON, some still JSON.
fn mangled_json() -> impl Strategy<Value = Vec<u8>> {
    let edit = (
        any::<prop::sample::Index>(),
        0u8..3,
        prop::sample::select(b"{}[]\",:0-1.eE \\utnf\xff\xc3".to_vec()),
    );
    (json_value(), prop::collection::vec(edit, 0..4)).prop_map(|(value, edits)| {
        let mut bytes = value.to_string().into_bytes();
        for (at, kind, byte) in edits {
            let i = at.index(bytes.len() + 1);
            match kind {
                0 => bytes.insert(i, byte),
                1 if i < bytes.len() => {
                    bytes.remove(i);
                }
                _ if i < bytes.len() => bytes[i] = byte,
                _ => {}
            }
        }
        bytes
    })
}

/// Whether serde_json reads `bytes` as one JSON document with no number it cannot hold (the streaming
/// reader keeps numbers as text, so it reads `1e999` too).
fn serde_reads(bytes: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(bytes).ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_json_readers_never_panic_and_read_json_exactly_when_serde_json_does(
        bytes in prop_oneof![prop::collection::vec(any::<u8>(), 0..120), mangled_json()],
    ) {
        let pointers = ["", "/a", "/0", "/a/0/b"].map(String::from).to_vec();
        let found = pointer::find(&bytes, pointers, &mut Scratch::unbounded()).expect("no budget to run out of");
        let digest = canonical::digest(&bytes, &["/a".to_owned()], &mut Scratch::unbounded())
            .expect("no budget to run out of");
        match serde_reads(&bytes) {
            Some(_) => prop_assert!(found.is_some(), "serde_json reads {:?}", String::from_utf8_lossy(&bytes)),
            None => {
                let text = String::from_utf8_lossy(&bytes);
                let big_number = text.contains('e') || text.contains('E');
                prop_assert!(found.is_none() || big_number, "serde_json refuses {:?}", text);
                prop_assert!(digest.is_none() || big_number, "serde_json refuses {:?}", text);
            }
        }
    }

    #[test]
    fn a_pointer_finds_the_value_serde_json_finds(value in json_value(), other in json_value()) {
        let body = serde_json::json!({"a": [{"b": value.clone()}], "z": other}).to_string();
        let found = pointer::find(body.as_bytes(), vec!["/a/0/b".into()], &mut Scratch::unbounded())
            .expect("no budget to run out of")
            .expect("a JSON body");
        let expected = match &value {
            serde_json::Value::String(s) => Found::String(s.clone()),
            serde_json::Value::Number(n) => Found::Number(n.to_string()),
            serde_json::Value::Null => Found::Other("null"),
            serde_json::Value::Bool(_) => Found::Other("a boolean"),
            serde_json::Value::Array(_) => Found::Other("an array"),
            serde_json::Value::Object(_) => Found::Other("an object"),
        };
        prop_assert_eq!(found.get("/a/0/b"), &expected, "{}", body);
    }
}

/// A boundary as clients draw them (RFC 2046's characters but the space).
fn boundary() -> impl Strategy<Value = String> {
    "[A-Za-z0-9'()+_,./:=?-]{1,70}"
}

/// Form parts: a field name, whether it is a file, and content that holds no line break followed by
/// `--` (where a boundary could start).
fn form_parts() -> impl Strategy<Value = Vec<(String, bool, Vec<u8>)>> {
    let content = prop::collection::vec(any::<u8>(), 0..60)
        .prop_filter("no delimiter start", |c| !c.windows(4).any(|w| w == b"\r\n--"));
    prop::collection::vec(("[a-z_]{1,10}", any::<bool>(), content), 1..6)
}

/// The parts as a client writes them under `boundary`.
fn form_body(boundary: &str, parts: &[(String, bool, Vec<u8>)]) -> Vec<u8> {
    form_with_contents(boundary, parts).0
}

/// [`form_body`], and where each part's content lies in it.
fn form_with_contents(boundary: &str, parts: &[(String, bool, Vec<u8>)]) -> (Vec<u8>, Vec<usize>) {
    let mut body = Vec::new();
    let mut contents = Vec::new();
    for (name, file, content) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        let disposition = format!("Content-Disposition: form-data; name=\"{name}\"");
        if *file {
            body.extend_from_slice(format!("{disposition}; filename=\"{name}.bin\"\r\n").as_bytes());
            body.extend_from_slice(b"Content-Type: application/octet-stream\r\n\r\n");
        } else {
            body.extend_from_slice(format!("{disposition}\r\n\r\n").as_bytes());
        }
        contents.extend(body.len()..body.len() + content.len());
        body.extend_from_slice(content);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (body, contents)
}

fn form_fp(boundary: &str, body: &[u8]) -> [u8; 32] {
    let content_type = format!("multipart/form-data; boundary=\"{boundary}\"");
    fp(&Method::POST, "/upload", content_type.as_bytes(), body)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_form_has_one_fingerprint_under_any_boundary(
        parts in form_parts(),
        one in boundary(),
        other in boundary(),
    ) {
        prop_assert_eq!(
            form_fp(&one, &form_body(&one, &parts)),
            form_fp(&other, &form_body(&other, &parts))
        );
    }

    #[test]
    fn any_byte_changed_in_a_part_or_a_boundary_changes_the_fingerprint(
        parts in form_parts(),
        b in boundary(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let (body, contents) = form_with_contents(&b, &parts);
        // Header spelling (a name's case, whitespace) is the one other change that may keep it.
        let boundaries: Vec<usize> = (0..body.len())
            .filter(|&i| body[i..].starts_with(b"--") && (i == 0 || body[i - 1] == b'\n'))
            .flat_map(|i| i..(i + 2 + b.len()).min(body.len()))
            .collect();
        let changeable = [contents, boundaries].concat();
        prop_assume!(!changeable.is_empty());
        let mut changed = body.clone();
        changed[changeable[at.index(changeable.len())]] ^= flip;
        prop_assert_ne!(form_fp(&b, &body), form_fp(&b, &changed));
    }

    #[test]
    fn a_cut_or_arbitrary_form_never_panics(
        parts in form_parts(),
        b in boundary(),
        at in any::<prop::sample::Index>(),
        noise in prop::collection::vec(any::<u8>(), 0..200),
    ) {
        let body = form_body(&b, &parts);
        form_fp(&b, &body[..at.index(body.len())]);
        form_fp(&b, &noise);
        form_fp(&b, &[&body[..at.index(body.len())], &noise[..]].concat());
    }
}
