//! A part's fingerprint input ([`super::Part::fingerprint`]): what the part runs, without what a retry may
//! write differently. The document counts as its significant tokens, one space apart (GraphQL ignores
//! whitespace, comments and commas); the variables as canonical JSON: objects' members sorted by name
//! (the last of a name given twice, as JavaScript reads it), no whitespace, strings re-escaped, numbers as
//! written.

use apollo_parser::{Lexer, TokenKind};
use json_event_parser::{JsonEvent, SliceJsonParser};
use serde_json::value::RawValue;

use super::body::write_string;

/// Marks the layout, so a change to it never matches a fingerprint of the old one.
const VERSION: &[u8] = b"graphql-part/1\n";

/// The fingerprint input of a part with `document`, `operation_name` and `variables` (the values of those
/// its document declares).
pub(super) fn fingerprint(
    document: &str,
    operation_name: Option<&str>,
    variables: &[(&str, &RawValue)],
) -> Vec<u8> {
    let mut out = VERSION.to_vec();
    tokens(document, &mut out);
    out.push(b'\n');
    match operation_name {
        Some(name) => write_string(&mut out, name),
        None => out.extend_from_slice(b"null"),
    }
    out.push(b'\n');
    let mut sorted = variables.to_vec();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    out.push(b'{');
    for (i, (name, value)) in sorted.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(&mut out, name);
        out.push(b':');
        out.extend_from_slice(json(value.get()).as_bytes());
    }
    out.push(b'}');
    out
}

/// The significant tokens of `document`, one space apart.
fn tokens(document: &str, out: &mut Vec<u8>) {
    let significant = Lexer::new(document).flatten().filter(|token| {
        !matches!(
            token.kind(),
            TokenKind::Whitespace | TokenKind::Comment | TokenKind::Comma | TokenKind::Eof
        )
    });
    for (i, token) in significant.enumerate() {
        if i > 0 {
            out.push(b' ');
        }
        out.extend_from_slice(token.data().as_bytes());
    }
}

/// An open array or object while [`json`] reads.
enum Open {
    Array(Vec<String>),
    /// Members so far, and the name of the one whose value comes next.
    Object(Vec<(String, String)>, String),
}

/// `raw` (valid JSON, as serde_json checked it) in canonical form; `raw` itself should it not parse.
pub(super) fn json(raw: &str) -> String {
    let mut parser = SliceJsonParser::new(raw.as_bytes());
    let mut open: Vec<Open> = Vec::new();
    loop {
        let value = match parser.parse_next() {
            Ok(JsonEvent::Eof) | Err(_) => return raw.to_owned(),
            Ok(JsonEvent::StartArray) => {
                open.push(Open::Array(Vec::new()));
                continue;
            }
            Ok(JsonEvent::StartObject) => {
                open.push(Open::Object(Vec::new(), String::new()));
                continue;
            }
            Ok(JsonEvent::ObjectKey(name)) => {
                if let Some(Open::Object(_, next)) = open.last_mut() {
                    *next = name.into_owned();
                }
                continue;
            }
            Ok(JsonEvent::EndArray | JsonEvent::EndObject) => close(open.pop()),
            Ok(scalar) => scalar_text(scalar),
        };
        match open.last_mut() {
            None => return value,
            Some(Open::Array(items)) => items.push(value),
            Some(Open::Object(members, next)) => members.push((std::mem::take(next), value)),
        }
    }
}

fn scalar_text(event: JsonEvent<'_>) -> String {
    match event {
        JsonEvent::String(text) => {
            let mut out = Vec::new();
            write_string(&mut out, &text);
            String::from_utf8(out).unwrap_or_default()
        }
        JsonEvent::Number(text) => text.into_owned(),
        JsonEvent::Boolean(true) => "true".into(),
        JsonEvent::Boolean(false) => "false".into(),
        _ => "null".into(),
    }
}

/// The canonical text of a closed array or object.
fn close(closed: Option<Open>) -> String {
    match closed {
        Some(Open::Array(items)) => format!("[{}]", items.join(",")),
        Some(Open::Object(mut members, _)) => {
            members.sort_by(|a, b| a.0.cmp(&b.0));
            let mut out = String::from("{");
            for (i, (name, value)) in members.iter().enumerate() {
                let last_of_name = members.get(i + 1).is_none_or(|next| next.0 != *name);
                if last_of_name {
                    if out.len() > 1 {
                        out.push(',');
                    }
                    out.push_str(&scalar_text(JsonEvent::String(name.into())));
                    out.push(':');
                    out.push_str(value);
                }
            }
            out.push('}');
            out
        }
        None => String::new(),
    }
}
