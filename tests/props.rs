//! Property tests of what the proxy parses from untrusted input: the key header, the scope and the
//! fingerprint, and the configuration loader. Case counts stay modest so the suite stays fast.

use http::{HeaderMap, HeaderValue, Method, Uri};
use idemproxy::config::Config;
use idemproxy::error::ProxyError;
use idemproxy::proxy::key::{fingerprint, parse_key, scope};
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

fn policy() -> idemproxy::config::IdempotencyConfig {
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
    fingerprint(&policy(), method, &uri, &headers, body)
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
        let scope_a = scope("default", &policy, &auth(&a));
        prop_assert_eq!(&scope_a, &scope("default", &policy, &auth(&a)));
        if a != b {
            prop_assert_ne!(&scope_a, &scope("default", &policy, &auth(&b)));
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

fn assert_one_line_naming_a_key(text: &str) -> Result<(), TestCaseError> {
    match Config::from_toml_str(text) {
        Ok(_) => {}
        Err(error) => {
            let line = error.to_string();
            prop_assert!(!error.key.is_empty(), "{line}");
            prop_assert!(!line.contains('\n'), "more than one line: {line:?}");
            prop_assert!(line.starts_with("config error: "), "{line}");
            prop_assert!(line.contains(&error.key), "{line}");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn config_loader_answers_any_text_with_a_config_or_one_line(text in "\\PC{0,200}") {
        assert_one_line_naming_a_key(&text)?;
    }

    #[test]
    fn config_loader_answers_any_toml_ish_document_with_a_config_or_one_line(text in toml_document()) {
        assert_one_line_naming_a_key(&text)?;
    }
}
