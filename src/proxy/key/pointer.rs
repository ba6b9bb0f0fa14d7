//! Runs for a route keyed by a JSON field (`json:` keys and template parts) or by a structured
//! CloudEvent, once the body has been read: finds the values at a few RFC 6901 pointers in one pass over
//! the body (`key/json.rs`), without building the document: only the values found are kept. A value is
//! found only when the whole body is JSON. Pure functions of the body.

use std::borrow::Cow;

use json_event_parser::JsonEvent;

use super::json::{Paths, Reader, Scratch, Stop};

/// What a body holds at one pointer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// Nothing.
    Absent,
    /// A string, its escapes decoded.
    String(String),
    /// A number, as its exact text (`1.0` is not `1`; 24 digits stay 24 digits).
    Number(String),
    /// A value of another type, named for a message: `null`, `a boolean`, `an array`, `an object`.
    Other(&'static str),
    /// An object on the pointer's path names the pointer's member twice, so the app may read the
    /// other one.
    Repeated,
}

/// The values a body holds at the pointers asked for.
#[derive(Debug)]
pub struct Findings {
    pointers: Vec<String>,
    found: Vec<Found>,
}

impl Findings {
    /// What the body holds at `pointer`; [`Found::Absent`] for a pointer that was not asked for.
    pub fn get(&self, pointer: &str) -> &Found {
        self.pointers
            .iter()
            .position(|p| p == pointer)
            .map_or(&Found::Absent, |i| &self.found[i])
    }
}

/// The values at `pointers` in `body`; `Ok(None)` when the body is not JSON (see `key/json.rs`),
/// `Err(Stop::OverBudget)` when reading it needs more memory than `scratch` can get.
pub fn find(body: &[u8], pointers: Vec<String>, scratch: &mut Scratch<'_>) -> Result<Option<Findings>, Stop> {
    match walk(body, &pointers, scratch) {
        Ok(found) => Ok(Some(Findings { pointers, found })),
        Err(Stop::NotJson) => Ok(None),
        Err(Stop::OverBudget) => Err(Stop::OverBudget),
    }
}

fn walk(body: &[u8], pointers: &[String], scratch: &mut Scratch<'_>) -> Result<Vec<Found>, Stop> {
    let mut reader = Reader::new(body);
    let mut paths = Paths::new(pointers);
    let mut found = vec![Found::Absent; pointers.len()];
    while let Some(event) = reader.next(scratch)? {
        paths.step(&event);
        for &i in paths.hits() {
            if found[i] == Found::Absent {
                found[i] = keep(&event, scratch)?;
            }
        }
    }
    for (i, found) in found.iter_mut().enumerate() {
        if paths.repeated(i) {
            *found = Found::Repeated;
        }
    }
    Ok(found)
}

/// The value an event starts, as kept (a string or a number is charged to the allowance).
fn keep(event: &JsonEvent<'_>, scratch: &mut Scratch<'_>) -> Result<Found, Stop> {
    let text = |text: &Cow<'_, str>, scratch: &mut Scratch<'_>| {
        scratch.take(text.len()).map(|()| text.clone().into_owned())
    };
    Ok(match event {
        JsonEvent::String(s) => Found::String(text(s, scratch)?),
        JsonEvent::Number(n) => Found::Number(text(n, scratch)?),
        JsonEvent::Null => Found::Other("null"),
        JsonEvent::Boolean(_) => Found::Other("a boolean"),
        JsonEvent::StartArray => Found::Other("an array"),
        JsonEvent::StartObject => Found::Other("an object"),
        JsonEvent::EndArray | JsonEvent::EndObject | JsonEvent::ObjectKey(_) | JsonEvent::Eof => {
            Found::Absent
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(body: &str, pointer: &str) -> Option<Found> {
        let findings = find(
            body.as_bytes(),
            vec![pointer.to_owned()],
            &mut Scratch::unbounded(),
        )
        .unwrap()?;
        Some(findings.get(pointer).clone())
    }

    fn string(s: &str) -> Option<Found> {
        Some(Found::String(s.to_owned()))
    }

    fn number(s: &str) -> Option<Found> {
        Some(Found::Number(s.to_owned()))
    }

    #[test]
    fn finds_strings_and_numbers_by_their_path() {
        assert_eq!(at(r#"{"id":"evt_1"}"#, "/id"), string("evt_1"));
        assert_eq!(
            at(r#"{"data":{"object":{"id":42}}}"#, "/data/object/id"),
            number("42")
        );
        assert_eq!(at(r#"{"a/b":[-1.5]}"#, "/a~1b/0"), number("-1.5"));
        assert_eq!(at(r#"{"~":{"x":[0,[1,{"y":"z"}]]}}"#, "/~0/x/1/1/y"), string("z"));
        assert_eq!(at(r#""whole""#, ""), string("whole"));
        assert_eq!(at(r#"{"":{"":7}}"#, "//"), number("7"));
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        assert_eq!(
            at(r#"{"id":123456789012345678901234}"#, "/id"),
            number("123456789012345678901234")
        );
        assert_eq!(at(r#"{"id":1.0}"#, "/id"), number("1.0"));
        assert_eq!(at(r#"{"id":1E+2}"#, "/id"), number("1E+2"));
        assert_eq!(at(r#"{"id":-0}"#, "/id"), number("-0"));
        assert_eq!(at(r#"{"id":1e309}"#, "/id"), number("1e309"));
    }

    #[test]
    fn strings_are_decoded() {
        assert_eq!(
            at(r#"{"id":"a\"b\\c\/d\u00e9\ud83d\ude00\n"}"#, "/id"),
            string("a\"b\\c/dé😀\n")
        );
        assert_eq!(
            at(r#"{"\u0069d":"x"}"#, "/id"),
            string("x"),
            "member names are decoded too"
        );
    }

    #[test]
    fn other_types_are_named() {
        for (body, kind) in [
            (r#"{"id":null}"#, "null"),
            (r#"{"id":false}"#, "a boolean"),
            (r#"{"id":[1]}"#, "an array"),
            (r#"{"id":{"id":1}}"#, "an object"),
        ] {
            assert_eq!(at(body, "/id"), Some(Found::Other(kind)), "{body}");
        }
        assert_eq!(at("{}", ""), Some(Found::Other("an object")));
    }

    #[test]
    fn a_path_the_body_does_not_have_is_absent() {
        for (body, pointer) in [
            (r#"{"other":1}"#, "/id"),
            (r#"[1,2]"#, "/id"),
            (r#"[1,2]"#, "/2"),
            (r#"[1,2]"#, "/01"),
            (r#"[1,2]"#, "/-"),
            (r#"{"a":{"b":1}}"#, "/b"),
            (r#"{"a":{"b":1}}"#, "/a/b/c"),
            (r#"{"x":{"id":1}}"#, "/id"),
            (r#"[{"id":1}]"#, "/id"),
            (r#""id""#, "/id"),
        ] {
            assert_eq!(at(body, pointer), Some(Found::Absent), "{body} {pointer}");
        }
        assert_eq!(
            at(r#"{"0":"zero"}"#, "/0"),
            string("zero"),
            "a digit token names a member too"
        );
    }

    #[test]
    fn a_member_named_twice_on_the_path_is_repeated() {
        for (body, pointer) in [
            (r#"{"id":"a","id":"b"}"#, "/id"),
            (r#"{"id":"a","x":1,"id":"a"}"#, "/id"),
            (r#"{"data":{"id":1},"data":{"id":2}}"#, "/data/id"),
            (r#"{"data":{"id":1,"id":2}}"#, "/data/id"),
            (r#"{"data":[{"id":1,"\u0069d":2}]}"#, "/data/0/id"),
        ] {
            assert_eq!(at(body, pointer), Some(Found::Repeated), "{body}");
        }
        for (body, pointer) in [
            (r#"{"id":"a","x":{"id":1},"y":[{"id":2}]}"#, "/id"),
            (r#"{"a":{"id":1},"b":{"id":2}}"#, "/a/id"),
            (r#"[{"id":1},{"id":2}]"#, "/1/id"),
            (r#"{"x":1,"x":2,"id":"a"}"#, "/id"),
        ] {
            assert_ne!(at(body, pointer), Some(Found::Repeated), "{body}");
        }
    }

    #[test]
    fn a_body_that_is_not_wholly_json_finds_nothing() {
        let deep = format!("{{\"id\":1,\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        for body in [
            "",
            "not json",
            "{\"id\":",
            "{\"id\":1",
            "{\"id\":1} trailing",
            "{\"id\":1}{}",
            "\u{feff}{\"id\":1}",
            "{\"id\":1,\"x\":\"\\ud800\"}",
            "{\"id\":1,\"x\":01}",
            "{\"id\":1,}",
            &deep,
        ] {
            assert_eq!(at(body, "/id"), None, "{body:.40}");
        }
        let mut bytes = br#"{"id":1,"x":""}"#.to_vec();
        bytes.insert(13, 0xff);
        let found = find(&bytes, vec!["/id".into()], &mut Scratch::unbounded()).unwrap();
        assert!(found.is_none(), "bytes that are not UTF-8 are not JSON");
    }

    #[test]
    fn nesting_is_bounded_at_serde_jsons_depth() {
        let nested = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        assert!(at(&nested(super::super::json::MAX_DEPTH), "/id").is_some());
        assert_eq!(at(&nested(super::super::json::MAX_DEPTH + 1), "/id"), None);
        let hostile = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(at(&hostile, "/id"), None);
        let deep_object = format!("{}1{}", "{\"id\":".repeat(100_000), "}".repeat(100_000));
        assert_eq!(at(&deep_object, "/id"), None);
    }

    #[test]
    fn several_pointers_are_found_in_one_pass() {
        let body = r#"{"specversion":"1.0","source":"/s","id":"e1","data":{"id":"inner"}}"#;
        let pointers = ["", "/source", "/id", "/data/id", "/absent"]
            .map(String::from)
            .to_vec();
        let findings = find(body.as_bytes(), pointers, &mut Scratch::unbounded())
            .unwrap()
            .unwrap();
        assert_eq!(findings.get(""), &Found::Other("an object"));
        assert_eq!(findings.get("/source"), &Found::String("/s".into()));
        assert_eq!(findings.get("/id"), &Found::String("e1".into()));
        assert_eq!(findings.get("/data/id"), &Found::String("inner".into()));
        assert_eq!(findings.get("/absent"), &Found::Absent);
        assert_eq!(findings.get("/not-asked"), &Found::Absent);
    }

    #[test]
    fn a_huge_flat_body_is_read_in_little_memory() {
        let members: Vec<String> = (0..200_000)
            .map(|i| format!("\"k{i}\":{{\"v\":\"a\\nb\"}}"))
            .collect();
        let body = format!("{{{},\"id\":\"last\"}}", members.join(","));
        let mut scratch = Scratch::unbounded();
        let findings = find(body.as_bytes(), vec!["/id".into()], &mut scratch)
            .unwrap()
            .unwrap();
        assert_eq!(findings.get("/id"), &Found::String("last".into()));
        assert!(
            scratch.peak() < 1024,
            "{} bytes for a {} byte body",
            scratch.peak(),
            body.len()
        );
    }

    #[test]
    fn a_budget_that_cannot_supply_the_value_stops_the_read() {
        let body = format!(r#"{{"id":"{}"}}"#, "a".repeat(10_000));
        let mut refuse = |_: usize| false;
        let result = find(
            body.as_bytes(),
            vec!["/id".into()],
            &mut Scratch::within(&mut refuse),
        );
        assert_eq!(result.unwrap_err(), Stop::OverBudget);
    }
}
