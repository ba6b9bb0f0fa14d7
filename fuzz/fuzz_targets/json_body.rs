//! Any bytes as a JSON body: the streaming readers (a pointer's value, the canonical digest) never
//! panic, answer alike twice, and find a value only in a body serde_json reads too (or one holding a
//! number too large for it, which they keep as text).
#![no_main]

use idemproxy::proxy::key::json::Scratch;
use idemproxy::proxy::key::{canonical, pointer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let pointers = || ["", "/a", "/0", "/a/0/b"].map(String::from).to_vec();
    let found = pointer::find(body, pointers(), &mut Scratch::unbounded()).expect("no budget to run out of");
    let again = pointer::find(body, pointers(), &mut Scratch::unbounded()).expect("no budget to run out of");
    assert_eq!(found.is_some(), again.is_some());
    let exclude = ["/a".to_owned()];
    let digest = canonical::digest(body, &exclude, &mut Scratch::unbounded()).expect("no budget to run out of");
    assert_eq!(digest, canonical::digest(body, &exclude, &mut Scratch::unbounded()).expect("no budget"));
    if serde_json::from_slice::<serde_json::Value>(body).is_ok() {
        assert!(found.is_some(), "serde_json reads it");
    }
    if digest.is_some() {
        assert!(found.is_some(), "a digest only for JSON");
    }
});
