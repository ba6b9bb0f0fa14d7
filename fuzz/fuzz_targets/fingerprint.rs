//! Any bytes split into a scope header and a body: hashing never panics, equal input hashes alike, and
//! flipping a body byte changes the fingerprint (counted byte for byte).
#![no_main]

use http::{HeaderMap, HeaderValue, Method, Uri};
use idemproxy::config::RawIdempotency;
use idemproxy::proxy::key::json::Scratch;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.first().map_or(0, |&b| usize::from(b)).min(data.len());
    let (credential, body) = data.split_at(split);
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_bytes(credential) {
        headers.insert("authorization", value);
    }
    let policy = RawIdempotency::default().validate().expect("the default policy is valid");
    let scope = idemproxy::proxy::key::scope("default", &policy, &headers);
    assert_eq!(scope, idemproxy::proxy::key::scope("default", &policy, &headers));
    let uri = Uri::from_static("/pay");
    let fingerprint = |body: &[u8]| {
        idemproxy::proxy::key::fingerprint(&policy, &Method::POST, &uri, &headers, body, &mut Scratch::unbounded())
            .expect("no budget to run out of")
    };
    let base = fingerprint(body);
    assert_eq!(base, fingerprint(body));
    if let Some((first, rest)) = body.split_first() {
        let mut changed = vec![first ^ 0x01];
        changed.extend_from_slice(rest);
        assert_ne!(base, fingerprint(&changed));
    }
});
