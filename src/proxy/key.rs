//! Runs first for a protected request, before any store work: reads the idempotency key (from the
//! route's key source, `key/source.rs`, `key/cloudevents.rs`, `key/jsonrpc.rs`), derives the scope from the route's scope
//! name and the client's credentials (scope headers, an auth scheme read without case (`key/credential.rs`),
//! and the scope cookie, `key/cookie.rs`), and
//! fingerprints the request under the route's policy (a JSON body by its meaning with
//! `fingerprint_body = "json"`, `key/canonical.rs`; a `multipart/form-data` body by its parts, without
//! its boundary, on every route, `key/multipart.rs`). A body is read as JSON by streaming
//! (`key/json.rs`, `key/pointer.rs`), its working memory taken from an allowance the caller charges to
//! its budget. Pure functions of the request; touches nothing else.

pub mod canonical;
pub mod client_cert;
pub mod cloudevents;
pub mod cookie;
pub mod credential;
pub mod json;
pub mod jwt;
pub mod multipart;
pub mod pointer;
pub mod repeatability;
pub mod source;

use http::header::{CONTENT_TYPE, GetAll};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use sha2::{Digest, Sha256};

use self::client_cert::ClientCert;
use self::json::Scratch;
use self::jwt::Subject;
use crate::config::{FingerprintBody, KeyRules};
use crate::error::{Busy, ProxyError};

/// Reads the key from its header. `Ok(None)` when the header is absent.
///
/// Accepted forms: an RFC 8941 sf-string (`"abc"`, with `\"` and `\\` escapes) or a bare value (`abc`);
/// after unquoting, 1 to `max_len` visible ASCII characters. A bare value may not contain `,`, which is
/// what two header lines folded into one look like. Repeated headers are refused.
pub fn parse_key(values: GetAll<'_, HeaderValue>, max_len: usize) -> Result<Option<String>, ProxyError> {
    let mut values = values.iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(invalid("the header is repeated"));
    }
    let raw = value.to_str().map_err(|_| invalid("not visible ASCII"))?.trim();
    let key = if raw.starts_with('"') {
        unquote(raw)?
    } else {
        if raw.contains(',') {
            return Err(invalid(
                "a bare key may not contain ','; quote it as an sf-string",
            ));
        }
        raw.to_owned()
    };
    check_key(&key, max_len)?;
    Ok(Some(key))
}

fn unquote(raw: &str) -> Result<String, ProxyError> {
    let item: sfv::Item = sfv::Parser::new(raw)
        .parse()
        .map_err(|e| invalid(&format!("not a valid sf-string: {e}")))?;
    if !item.params.is_empty() {
        return Err(invalid("parameters are not allowed"));
    }
    match item.bare_item.as_string() {
        Some(s) => Ok(s.as_str().to_owned()),
        None => Err(invalid("not a valid sf-string")),
    }
}

/// Refuses a key that is empty, longer than `max_len`, or holds anything but visible ASCII.
pub(crate) fn check_key(key: &str, max_len: usize) -> Result<(), ProxyError> {
    if key.is_empty() {
        return Err(invalid("empty"));
    }
    if key.len() > max_len {
        return Err(invalid(&format!("longer than {max_len} characters")));
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid("only visible ASCII characters are allowed"));
    }
    Ok(())
}

fn invalid(why: &str) -> ProxyError {
    ProxyError::InvalidKey(why.to_owned())
}

/// Whether the request names its client in at least one of the policy's scope headers, or in the scope
/// cookie (an empty value names no one).
pub fn has_scope(rules: &KeyRules, headers: &HeaderMap) -> bool {
    has_scope_with(rules, headers, None)
}

/// [`has_scope`], where the request's connection presented `client`: on a route with
/// `scope_client_cert`, a client certificate names its client too.
pub fn has_scope_with(rules: &KeyRules, headers: &HeaderMap, client: Option<&ClientCert>) -> bool {
    if rules.scope_client_cert && client.is_some() {
        return true;
    }
    // A bearer token names a client on a `scope_jwt` route; verifying it decides whether truly.
    if rules.scope_jwt.is_some() && jwt::has_bearer(headers) {
        return true;
    }
    let by_header = rules
        .scope_headers
        .iter()
        .any(|name| headers.get_all(name).iter().any(|value| !value.is_empty()));
    by_header
        || rules
            .scope_cookie
            .as_deref()
            .is_some_and(|name| cookie::values(headers, name).iter().any(|v| !v.is_empty()))
}

/// The scope a key is unique within: the route's scope name plus a SHA-256 of the scope headers' values
/// and the scope cookie's, so clients with different credentials never share keys and credentials are
/// never stored.
pub fn scope(scope_name: &str, rules: &KeyRules, headers: &HeaderMap) -> String {
    scope_with(scope_name, rules, headers, Presented::default())
}

/// Who the client showed itself to be beyond its headers: the certificate its connection presented, and
/// the subject its verified bearer token names.
#[derive(Debug, Clone, Copy, Default)]
pub struct Presented<'a> {
    /// The client certificate's identity, on a connection that presented one.
    pub cert: Option<&'a ClientCert>,
    /// The verified token's subject, on a `scope_jwt` route.
    pub subject: Option<&'a Subject>,
}

/// [`scope`], where the client `presented` more: on a route with `scope_client_cert`, its certificate's
/// public key is hashed after the headers and the cookie, behind a field no header can hold, so a client
/// is the same client on every certificate renewed on its key; on a route with `scope_jwt`, so are its
/// token's verified claims, so a client is the same client on every token refreshed for it.
pub fn scope_with(
    scope_name: &str,
    rules: &KeyRules,
    headers: &HeaderMap,
    presented: Presented<'_>,
) -> String {
    let mut hash = Sha256::new();
    for name in &rules.scope_headers {
        hash_header(&mut hash, name, headers);
    }
    if let Some(name) = &rules.scope_cookie {
        hash_cookie(&mut hash, name, headers);
    }
    if rules.scope_client_cert {
        hash_field(&mut hash, b"\0client-cert");
        match presented.cert {
            Some(client) => hash_field(&mut hash, &client.0),
            None => hash_count(&mut hash, 0),
        }
    }
    if rules.scope_jwt.is_some() {
        hash_field(&mut hash, b"\0jwt");
        match presented.subject {
            Some(subject) => hash_field(&mut hash, &subject.0),
            None => hash_count(&mut hash, 0),
        }
    }
    // Written in place: every keyed request has a scope, and `format!` with `hex::encode` builds it
    // through a formatter and a string of its own, a character at a time.
    let mut digits = [0u8; 64];
    hex::encode_to_slice(hash.finalize(), &mut digits).expect("64 digits hold a SHA-256 digest");
    let mut scope = String::with_capacity(scope_name.len() + 1 + digits.len());
    scope.push_str(scope_name);
    scope.push(':');
    scope.push_str(std::str::from_utf8(&digits).expect("hex digits are ASCII"));
    scope
}

/// The scope cookie's part of the scope hash, after the headers'. It opens with a field that starts
/// with a NUL byte, which no header name or value can hold, so where the headers' values end and the
/// cookie's begin is never in doubt. A cookie sent more than once counts as the set of its values
/// (`key/cookie.rs`), so a retry that sends them in another order keeps its scope.
fn hash_cookie(hash: &mut Sha256, name: &str, headers: &HeaderMap) {
    hash_field(hash, format!("\0cookie:{name}").as_bytes());
    let values = cookie::values(headers, name);
    hash_count(hash, values.len());
    for value in values {
        hash_field(hash, value.as_bytes());
    }
}

/// A header's name, the number of its values, then each value, in the order sent: the count frames
/// them, so no value can pass from one header (or one count of values) to another.
/// A credential header's values are hashed in their one spelling (`key/credential.rs`).
fn hash_header(hash: &mut Sha256, name: &HeaderName, headers: &HeaderMap) {
    hash_field(hash, name.as_str().as_bytes());
    hash_count(hash, headers.get_all(name).iter().count());
    let spelled = credential::is_credential(name);
    for value in headers.get_all(name) {
        if spelled {
            hash_field(hash, &credential::canonical(value.as_bytes()));
        } else {
            hash_field(hash, value.as_bytes());
        }
    }
}

/// The fingerprint of a request under its route's policy: SHA-256 over what makes two requests "the
/// same": method, path with query, the fingerprint headers' values, and the body, byte for byte or (with
/// `fingerprint_body = "json"`) by its JSON meaning, read within `scratch` (503 `busy` when the budget
/// cannot supply what the body's objects need). A `multipart/form-data` body that reads as its form
/// counts by its parts whatever the policy says, and its `Content-Type` (when a fingerprint header)
/// without the boundary: the boundary is drawn at random for every request.
pub fn fingerprint(
    rules: &KeyRules,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    scratch: &mut Scratch<'_>,
) -> Result<[u8; 32], ProxyError> {
    let form = multipart::Form::of(headers).and_then(|form| Some((form, form.digest(body)?)));
    let names = &rules.fingerprint_headers;
    let mut hash = head_hash(method, uri, headers, names, form.map(|(form, _)| form));
    match (form, rules.fingerprint_body) {
        (Some((_, parts)), _) => {
            hash_field(&mut hash, b"multipart");
            hash_field(&mut hash, &parts);
        }
        (None, FingerprintBody::Bytes) => hash_field(&mut hash, body),
        (None, FingerprintBody::Json) => {
            hash_json_body(&mut hash, body, &rules.fingerprint_exclude, scratch)?;
        }
    }
    Ok(hash.finalize().into())
}

/// The fingerprint of one part of a request that carries many keys (a GraphQL field), whose body counts
/// as `part` says: the request's head as [`fingerprint`] counts it, then the part's own description,
/// tagged so that it never meets a whole body's.
pub fn fingerprint_part(
    rules: &KeyRules,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    (kind, part): (&[u8], &[u8]),
) -> [u8; 32] {
    let mut hash = head_hash(method, uri, headers, &rules.fingerprint_headers, None);
    hash_field(&mut hash, kind);
    hash_field(&mut hash, part);
    hash.finalize().into()
}

/// A body counted by its meaning when it is I-JSON, else by its bytes; a tag field says which, so the
/// two never meet.
fn hash_json_body(
    hash: &mut Sha256,
    body: &[u8],
    exclude: &[String],
    scratch: &mut Scratch<'_>,
) -> Result<(), ProxyError> {
    match canonical::digest(body, exclude, scratch) {
        Ok(Some(digest)) => {
            hash_field(hash, b"json");
            hash_field(hash, &digest);
        }
        Ok(None) => {
            hash_field(hash, b"bytes");
            hash_field(hash, body);
        }
        Err(_) => return Err(ProxyError::Busy(Busy::Parsing)),
    }
    Ok(())
}

/// The fingerprint with the body counted byte for byte.
#[cfg(test)]
fn fingerprint_of(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    names: &[HeaderName],
    body: &[u8],
) -> [u8; 32] {
    let mut hash = head_hash(method, uri, headers, names, None);
    hash_field(&mut hash, body);
    hash.finalize().into()
}

/// The hash of the request's head as the fingerprint counts it. Every field is length-prefixed so no two
/// different requests hash alike by shifting bytes between fields. When the body is read as a `form`,
/// its one `Content-Type` counts without the boundary parameter.
fn head_hash(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    names: &[HeaderName],
    form: Option<multipart::Form<'_>>,
) -> Sha256 {
    let mut hash = Sha256::new();
    hash_field(&mut hash, method.as_str().as_bytes());
    let target = uri.path_and_query().map(|pq| pq.as_str()).unwrap_or("/");
    hash_field(&mut hash, target.as_bytes());
    for name in names {
        match form {
            Some(form) if name == CONTENT_TYPE => hash_form_type(&mut hash, form),
            _ => hash_header(&mut hash, name, headers),
        }
    }
    hash
}

/// A form's `Content-Type` as [`hash_header`] counts a header of one value, with the value's boundary
/// parameter left out.
fn hash_form_type(hash: &mut Sha256, form: multipart::Form<'_>) {
    hash_field(hash, CONTENT_TYPE.as_str().as_bytes());
    hash_count(hash, 1);
    let [before, after] = form.without_boundary();
    hash_count(hash, before.len() + after.len());
    hash.update(before);
    hash.update(after);
}

fn hash_field(hash: &mut Sha256, bytes: &[u8]) {
    hash_count(hash, bytes.len());
    hash.update(bytes);
}

fn hash_count(hash: &mut Sha256, count: usize) {
    hash.update((count as u64).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(values: &[&[u8]]) -> Result<Option<String>, ProxyError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        parse_key(headers.get_all("idempotency-key"), 16)
    }

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(key_of(&[b"abc-1"]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key_of(&[b"\"abc-1\""]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key_of(&[br#""a\"b""#]).unwrap().as_deref(), Some("a\"b"));
    }

    #[test]
    fn absent_header_is_no_key() {
        assert!(key_of(&[]).unwrap().is_none());
    }

    #[test]
    fn malformed_keys_are_refused() {
        let cases: &[&[&[u8]]] = &[
            &[b""],
            &[b"\"\""],
            &[b"\"unterminated"],
            &[b"\"a\";p=1"],
            &[b"a b"],
            &[b"\"a b\""],
            &[b"a,b"],
            &[b"0123456789abcdefX"],
            &[b"caf\xc3\xa9"],
            &[b"a", b"b"],
        ];
        for case in cases {
            let result = key_of(case);
            assert!(
                matches!(result, Err(ProxyError::InvalidKey(_))),
                "{case:?} gave {result:?}"
            );
        }
    }

    #[test]
    fn scope_separates_credentials_and_hides_them() {
        let policy = crate::config::RawIdempotency::default().validate().unwrap().key;
        let mut a = HeaderMap::new();
        a.insert("authorization", HeaderValue::from_static("Bearer alice"));
        let mut b = HeaderMap::new();
        b.insert("authorization", HeaderValue::from_static("Bearer bob"));
        assert_ne!(scope("r", &policy, &a), scope("r", &policy, &b));
        assert_eq!(scope("r", &policy, &a), scope("r", &policy, &a.clone()));
        assert_ne!(scope("r", &policy, &a), scope("s", &policy, &a));
        assert!(scope("r", &policy, &a).starts_with("r:"));
        assert!(!scope("r", &policy, &a).contains("alice"));
        let mut shouted = HeaderMap::new();
        shouted.insert("authorization", HeaderValue::from_static("BEARER   alice"));
        assert_eq!(
            scope("r", &policy, &a),
            scope("r", &policy, &shouted),
            "one credential, one scope"
        );
    }

    fn cookie_policy() -> KeyRules {
        crate::config::RawIdempotency {
            scope_cookie: Some("session".into()),
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key
    }

    fn with_cookie(line: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer app"));
        headers.insert("cookie", HeaderValue::from_static(line));
        headers
    }

    #[test]
    fn the_scope_cookie_separates_sessions_and_hides_them() {
        let policy = cookie_policy();
        let alice = with_cookie("theme=dark; session=alice-session");
        let bob = with_cookie("session=bob-session");
        assert_ne!(scope("r", &policy, &alice), scope("r", &policy, &bob));
        assert!(!scope("r", &policy, &alice).contains("alice"));
        let same = with_cookie("session=\"alice-session\"; lang=en");
        assert_eq!(scope("r", &policy, &alice), scope("r", &policy, &same));
        let without = with_cookie("theme=dark");
        assert_ne!(scope("r", &policy, &alice), scope("r", &policy, &without));
    }

    #[test]
    fn a_scope_hashes_each_scope_header_with_its_count_of_values() {
        let plain = crate::config::RawIdempotency::default().validate().unwrap().key;
        let headers = with_cookie("session=s");
        assert_ne!(
            scope("r", &plain, &headers),
            scope("r", &cookie_policy(), &headers)
        );
        let mut hash = Sha256::new();
        hash_field(&mut hash, b"authorization");
        hash_count(&mut hash, 1);
        hash_field(&mut hash, b"Bearer app");
        assert_eq!(
            scope("r", &plain, &headers),
            format!("r:{}", hex::encode(hash.finalize()))
        );
    }

    /// Headers `x-a` and `x-b` with these values (in order).
    fn two_headers(a: &[&'static str], b: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in a {
            headers.append("x-a", HeaderValue::from_static(value));
        }
        for value in b {
            headers.append("x-b", HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn values_never_pass_from_one_header_to_another() {
        // Without the count, both hash the fields x-a, a, x-b, c, x-b.
        let one = two_headers(&["a", "x-b", "c"], &[]);
        let other = two_headers(&["a"], &["c", "x-b"]);
        let policy = crate::config::RawIdempotency {
            scope_headers: vec!["x-a".into(), "x-b".into()],
            fingerprint_headers: vec!["x-a".into(), "x-b".into()],
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key;
        assert_ne!(scope("r", &policy, &one), scope("r", &policy, &other));
        let uri: Uri = "/pay".parse().unwrap();
        let mut scratch = Scratch::unbounded();
        let mut fp = |headers| fingerprint(&policy, &Method::POST, &uri, headers, b"", &mut scratch).unwrap();
        let (a, b) = (fp(&one), fp(&other));
        assert_ne!(a, b);
        assert_ne!(
            scope("r", &policy, &two_headers(&["a", "b"], &[])),
            scope("r", &policy, &two_headers(&["a"], &["b"]))
        );
        assert_eq!(
            scope("r", &policy, &two_headers(&["a", "b"], &["c"])),
            scope("r", &policy, &two_headers(&["a", "b"], &["c"]))
        );
    }

    #[test]
    fn a_scope_cookie_sent_twice_counts_as_its_set_of_values() {
        let policy = cookie_policy();
        let one = with_cookie("session=a; theme=dark; session=b");
        let reordered = with_cookie("session=b; session=a");
        let repeated = with_cookie("session=a; session=b; session=a");
        assert_eq!(scope("r", &policy, &one), scope("r", &policy, &reordered));
        assert_eq!(scope("r", &policy, &one), scope("r", &policy, &repeated));
        assert_ne!(
            scope("r", &policy, &one),
            scope("r", &policy, &with_cookie("session=a"))
        );
        assert_ne!(
            scope("r", &policy, &one),
            scope("r", &policy, &with_cookie("session=b"))
        );
    }

    #[test]
    fn a_cookie_value_never_passes_for_a_header_value() {
        let policy = crate::config::RawIdempotency {
            scope_cookie: Some("session".into()),
            scope_headers: vec!["x-user".into(), "x-tenant".into()],
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key;
        let mut in_header = HeaderMap::new();
        in_header.insert("x-tenant", HeaderValue::from_static("s1"));
        let mut in_cookie = HeaderMap::new();
        in_cookie.insert("cookie", HeaderValue::from_static("session=s1"));
        assert_ne!(scope("r", &policy, &in_header), scope("r", &policy, &in_cookie));
    }

    #[test]
    fn the_scope_cookie_names_a_client() {
        let policy = crate::config::RawIdempotency {
            scope_cookie: Some("session".into()),
            scope_headers: Vec::new(),
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key;
        let mut headers = HeaderMap::new();
        assert!(!has_scope(&policy, &headers));
        headers.insert("cookie", HeaderValue::from_static("theme=dark; session="));
        assert!(!has_scope(&policy, &headers), "an empty cookie names no one");
        headers.insert("cookie", HeaderValue::from_static("theme=dark; session=s1"));
        assert!(has_scope(&policy, &headers));
        let plain = crate::config::RawIdempotency::default().validate().unwrap().key;
        assert!(
            !has_scope(&plain, &headers),
            "cookies count only when the policy names one"
        );
    }

    fn json_policy(exclude: &[&str]) -> KeyRules {
        crate::config::RawIdempotency {
            fingerprint_body: FingerprintBody::Json,
            fingerprint_exclude: exclude.iter().map(|p| (*p).to_owned()).collect(),
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap()
        .key
    }

    fn json_fingerprint(policy: &KeyRules, body: &str) -> [u8; 32] {
        let uri: Uri = "/pay".parse().unwrap();
        let mut scratch = Scratch::unbounded();
        fingerprint(
            policy,
            &Method::POST,
            &uri,
            &HeaderMap::new(),
            body.as_bytes(),
            &mut scratch,
        )
        .unwrap()
    }

    #[test]
    fn a_json_fingerprint_ignores_form_and_excluded_fields_only() {
        let policy = json_policy(&["/sent_at"]);
        let base = json_fingerprint(&policy, r#"{"amount":100,"currency":"eur","sent_at":1}"#);
        let retry = json_fingerprint(
            &policy,
            "{\"sent_at\": 2,\n \"currency\": \"eur\", \"amount\": 100}",
        );
        assert_eq!(base, retry);
        assert_ne!(
            base,
            json_fingerprint(&policy, r#"{"amount":999,"currency":"eur","sent_at":1}"#)
        );
        let bytes = crate::config::RawIdempotency::default().validate().unwrap().key;
        assert_ne!(
            json_fingerprint(&bytes, r#"{"a":1,"b":2}"#),
            json_fingerprint(&bytes, r#"{"b":2,"a":1}"#),
            "bytes mode counts the bytes"
        );
    }

    #[test]
    fn a_jsonrpc_route_fingerprints_the_call_without_its_id_and_meta() {
        let policy = crate::config::RawIdempotency {
            key: Some("jsonrpc".into()),
            ..crate::config::RawIdempotency::default()
        }
        .validate()
        .unwrap();
        assert_eq!(policy.key.fingerprint_body, FingerprintBody::Json);
        assert_eq!(policy.key.fingerprint_exclude, ["/id", "/params/_meta"]);
        let call = |id: &str, token: &str, amount: u32| {
            json_fingerprint(
                &policy.key,
                &format!(
                    r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"charge",
                    "arguments":{{"amount":{amount}}},"_meta":{{"idempotencyKey":"k","progressToken":{token}}}}}}}"#
                ),
            )
        };
        let first = call("1", "1", 5);
        assert_eq!(
            first,
            call("\"retry-7\"", "\"p-9\"", 5),
            "a new id and progress token"
        );
        assert_ne!(first, call("1", "1", 6), "other arguments");
    }

    #[test]
    fn a_json_fingerprint_of_a_body_that_is_not_json_counts_its_bytes_apart_from_json() {
        let policy = json_policy(&[]);
        assert_eq!(
            json_fingerprint(&policy, "a=1&b=2"),
            json_fingerprint(&policy, "a=1&b=2")
        );
        assert_ne!(
            json_fingerprint(&policy, "a=1&b=2"),
            json_fingerprint(&policy, "b=2&a=1")
        );
        assert_ne!(json_fingerprint(&policy, "\"x\""), json_fingerprint(&policy, "x"));
    }

    #[test]
    fn the_bytes_fingerprint_frames_every_field() {
        let policy = crate::config::RawIdempotency::default().validate().unwrap().key;
        let uri: Uri = "/pay?x=1".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let mut hash = Sha256::new();
        for field in [&b"POST"[..], b"/pay?x=1", b"content-type"] {
            hash_field(&mut hash, field);
        }
        hash_count(&mut hash, 1);
        for field in [&b"application/json"[..], b"{}"] {
            hash_field(&mut hash, field);
        }
        let expected: [u8; 32] = hash.finalize().into();
        let mut scratch = Scratch::unbounded();
        assert_eq!(
            fingerprint(&policy, &Method::POST, &uri, &headers, b"{}", &mut scratch).unwrap(),
            expected
        );
    }

    #[test]
    fn a_json_fingerprint_counts_a_body_with_a_repeated_name_by_its_bytes() {
        let policy = json_policy(&[]);
        assert_eq!(
            json_fingerprint(&policy, r#"{"a":1,"a":2}"#),
            json_fingerprint(&policy, r#"{"a":1,"a":2}"#)
        );
        assert_ne!(
            json_fingerprint(&policy, r#"{"a":1,"a":2}"#),
            json_fingerprint(&policy, r#"{"a":2,"a":1}"#),
            "not reordered as JSON: counted byte for byte"
        );
    }

    #[test]
    fn a_json_fingerprint_the_budget_cannot_supply_is_503_busy() {
        let policy = json_policy(&[]);
        let members: Vec<String> = (0..1000).map(|i| format!(r#""m{i}":{i}"#)).collect();
        let body = format!("{{{}}}", members.join(","));
        let uri: Uri = "/pay".parse().unwrap();
        let mut refuse = |_: usize| false;
        let mut scratch = Scratch::within(&mut refuse);
        let result = fingerprint(
            &policy,
            &Method::POST,
            &uri,
            &HeaderMap::new(),
            body.as_bytes(),
            &mut scratch,
        );
        assert!(
            matches!(result, Err(ProxyError::Busy(Busy::Parsing))),
            "{result:?}"
        );
    }

    #[test]
    fn fingerprint_covers_method_path_headers_and_body() {
        let names = [HeaderName::from_static("content-type")];
        let uri: Uri = "/pay?x=1".parse().unwrap();
        let headers = HeaderMap::new();
        let fingerprint = fingerprint_of;
        let base = fingerprint(&Method::POST, &uri, &headers, &names, b"{}");
        assert_eq!(base, fingerprint(&Method::POST, &uri, &headers, &names, b"{}"));
        assert_ne!(base, fingerprint(&Method::PATCH, &uri, &headers, &names, b"{}"));
        assert_ne!(
            base,
            fingerprint(
                &Method::POST,
                &"/pay?x=2".parse().unwrap(),
                &headers,
                &names,
                b"{}"
            )
        );
        assert_ne!(base, fingerprint(&Method::POST, &uri, &headers, &names, b"{ }"));
        let mut json = HeaderMap::new();
        json.insert("content-type", HeaderValue::from_static("application/json"));
        assert_ne!(base, fingerprint(&Method::POST, &uri, &json, &names, b"{}"));
    }
}
