//! Any bytes split into a scope header and a body: hashing never panics, equal input hashes alike, and
//! flipping a body byte changes the fingerprint.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (credential, body) = data.split_at(split);
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(credential) {
        headers.insert("authorization", value);
    }
    let names = [HeaderName::from_static("authorization")];
    let scope = idemproxy::proxy::key::scope(&headers, &names);
    assert_eq!(scope, idemproxy::proxy::key::scope(&headers, &names));
    let uri = Uri::from_static("/pay");
    let fingerprint =
        |body: &[u8]| idemproxy::proxy::key::fingerprint(&Method::POST, &uri, &headers, &names, body);
    let base = fingerprint(body);
    assert_eq!(base, fingerprint(body));
    if let Some((first, rest)) = body.split_first() {
        let mut changed = vec![first ^ 0x01];
        changed.extend_from_slice(rest);
        assert_ne!(base, fingerprint(&changed));
    }
});
