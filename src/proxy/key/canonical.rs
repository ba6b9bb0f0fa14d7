//! Runs while a keyed request is fingerprinted, on routes with `fingerprint_body = "json"`: turns a JSON
//! body into what it means, so a retry that re-serialises its body (keys in another order, other
//! whitespace) still matches and one whose content changed does not. The fields `fingerprint_exclude`
//! names are removed first. The meaning is written into the fingerprint's hash as a type-tagged,
//! length-prefixed stream with object keys sorted here (never by the JSON library's map order), so two
//! different documents never write the same stream. Pure functions of the body.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The body as JSON with the excluded fields removed; `None` when it does not parse (then it counts
/// byte for byte). Nesting deeper than serde_json's limit (128) does not parse.
pub fn parse(body: &[u8], exclude: &[String]) -> Option<Value> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    for pointer in exclude {
        remove(&mut value, pointer);
    }
    Some(value)
}

/// Removes the object member an RFC 6901 pointer names; a pointer that names nothing, or an array
/// element, is ignored.
fn remove(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    if let Some(Value::Object(members)) = value.pointer_mut(parent) {
        members.remove(&unescape(last));
    }
}

/// A pointer token's text: `~1` is `/`, then `~0` is `~` (RFC 6901, section 4).
fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// Writes `value`'s meaning: a tag per type, strings and numbers length-prefixed, arrays and objects
/// prefixed by their length, object members in the byte order of their names.
pub fn write(hash: &mut Sha256, value: &Value) {
    match value {
        Value::Null => hash.update(b"n"),
        Value::Bool(true) => hash.update(b"t"),
        Value::Bool(false) => hash.update(b"f"),
        Value::Number(number) => text(hash, b'#', number.to_string().as_bytes()),
        Value::String(string) => text(hash, b'"', string.as_bytes()),
        Value::Array(items) => {
            count(hash, b'[', items.len());
            items.iter().for_each(|item| write(hash, item));
        }
        Value::Object(members) => {
            let mut members: Vec<(&String, &Value)> = members.iter().collect();
            members.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            count(hash, b'{', members.len());
            for (name, member) in members {
                text(hash, b':', name.as_bytes());
                write(hash, member);
            }
        }
    }
}

fn text(hash: &mut Sha256, tag: u8, bytes: &[u8]) {
    count(hash, tag, bytes.len());
    hash.update(bytes);
}

fn count(hash: &mut Sha256, tag: u8, n: usize) {
    hash.update([tag]);
    hash.update((n as u64).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(body: &str, exclude: &[&str]) -> Option<[u8; 32]> {
        let exclude: Vec<String> = exclude.iter().map(|p| (*p).to_owned()).collect();
        let value = parse(body.as_bytes(), &exclude)?;
        let mut hash = Sha256::new();
        write(&mut hash, &value);
        Some(hash.finalize().into())
    }

    #[test]
    fn key_order_and_whitespace_do_not_count() {
        let compact = digest(r#"{"amount":100,"currency":"eur","meta":{"a":1,"b":[1,2]}}"#, &[]);
        let reordered = digest(
            "{ \"meta\" : { \"b\" : [ 1 , 2 ] , \"a\" : 1 } ,\n  \"currency\":\"eur\", \"amount\": 100 }",
            &[],
        );
        assert!(compact.is_some());
        assert_eq!(compact, reordered);
    }

    #[test]
    fn any_change_of_content_counts() {
        let base = digest(r#"{"amount":100,"items":[1,2]}"#, &[]);
        for other in [
            r#"{"amount":101,"items":[1,2]}"#,
            r#"{"amount":"100","items":[1,2]}"#,
            r#"{"amount":100,"items":[2,1]}"#,
            r#"{"amount":100,"items":[1,2],"x":null}"#,
            r#"{"amount":100,"items":[[1,2]]}"#,
            r#"{"amount":100,"items":[1,2,null]}"#,
            r#"{"Amount":100,"items":[1,2]}"#,
        ] {
            assert_ne!(base, digest(other, &[]), "{other}");
        }
    }

    #[test]
    fn documents_that_would_run_together_stay_apart() {
        let pairs = [
            (r#"["ab","c"]"#, r#"["a","bc"]"#),
            (r#"{"a":"b","c":"d"}"#, r#"{"a":"b\"c","d":""}"#),
            (r#"[[],[]]"#, r#"[[[]]]"#),
            (r#"{"a":{}}"#, r#"{"a":[]}"#),
            (r#"[null]"#, r#"["n"]"#),
            (r#"[true]"#, r#"["t"]"#),
            (r#"1"#, r#""1""#),
        ];
        for (a, b) in pairs {
            assert_ne!(digest(a, &[]), digest(b, &[]), "{a} vs {b}");
        }
    }

    #[test]
    fn excluded_fields_are_left_out_wherever_they_are() {
        let exclude = ["/created", "/meta/sent_at", "/a~1b", "/absent/field", "/items/0"];
        let one = digest(
            r#"{"amount":1,"created":1700000000,"meta":{"sent_at":"x","k":1},"a/b":1,"items":[1]}"#,
            &exclude,
        );
        let other = digest(
            r#"{"amount":1,"created":1800000000,"meta":{"sent_at":"y","k":1},"a/b":2,"items":[1]}"#,
            &exclude,
        );
        assert_eq!(one, other);
        let without = digest(r#"{"amount":1,"meta":{"k":1},"items":[1]}"#, &exclude);
        assert_eq!(one, without, "an excluded field counts the same as an absent one");
        let changed = digest(
            r#"{"amount":2,"created":1700000000,"meta":{"sent_at":"x","k":1},"a/b":1,"items":[1]}"#,
            &exclude,
        );
        assert_ne!(one, changed);
        let element = digest(r#"{"amount":1,"meta":{"k":1},"items":[2]}"#, &exclude);
        assert_ne!(without, element, "array elements are not excluded");
    }

    #[test]
    fn pointer_tokens_are_unescaped_as_rfc_6901_says() {
        assert_eq!(unescape("a~1b"), "a/b");
        assert_eq!(unescape("a~0b"), "a~b");
        assert_eq!(unescape("~01"), "~1");
    }

    #[test]
    fn bodies_that_are_not_json_do_not_parse() {
        let deep = "[".repeat(10_000) + &"]".repeat(10_000);
        for body in ["", "{", "not json", "{\"a\":1} trailing", &deep] {
            assert_eq!(digest(body, &[]), None, "{body:.20}");
        }
    }
}
