//! Any bytes as the key header: a key of visible ASCII within the limit, or a refusal; never a panic.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", value);
    if let Ok(Some(key)) = idemproxy::proxy::key::parse_key(headers.get_all("idempotency-key"), 255) {
        assert!(!key.is_empty() && key.len() <= 255);
        assert!(key.bytes().all(|b| b.is_ascii_graphic()));
    }
});
