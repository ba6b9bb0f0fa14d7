//! Runs while a replay is built for a retry of a JSON-RPC call (a route keyed by `jsonrpc`): the stored
//! JSON-RPC response answers the original call's `id`, and the retry's client waits for its own, so the
//! response's top-level `id` is written over with the retry's ([`CallId`], of the type the retry sent).
//! A `text/event-stream` answer (MCP's Streamable HTTP may answer a call with events) has each JSON-RPC
//! response in an event's `data` rewritten the same way; its other events (notifications, requests the
//! server made) and fields stay as they were. A body that holds no JSON-RPC response is left as it is.
//! The body is checked as JSON by streaming (`key/json.rs`) and the `id` spliced in place: no tree is
//! built, and the copy made is the body's size. Pure functions of the stored body.

use bytes::Bytes;

use super::CallId;
use crate::proxy::key::json::{Reader, Scratch};

/// The stored `body` answering `id`; `None` when it holds no JSON-RPC response (it is replayed as it
/// is). `content_type` says whether the body is an event stream.
pub fn answer_as(body: &Bytes, content_type: Option<&[u8]>, id: &CallId) -> Option<Bytes> {
    let rewritten = if content_type.is_some_and(is_event_stream) {
        rewrite_stream(body, id.as_json().as_bytes())
    } else {
        rewrite_response(body, id.as_json().as_bytes())
    };
    rewritten.map(Bytes::from)
}

/// The stored `body`, one JSON-RPC response (not an event stream), answering `id`; `None` when it is not
/// one (a call of a batch gets the proxy's error instead).
pub fn response_as(body: &[u8], id: &CallId) -> Option<Vec<u8>> {
    rewrite_response(body, id.as_json().as_bytes())
}

fn is_event_stream(content_type: &[u8]) -> bool {
    let essence = content_type.split(|&b| b == b';').next().unwrap_or_default();
    essence.trim_ascii().eq_ignore_ascii_case(b"text/event-stream")
}

/// One JSON-RPC response (an object with `"jsonrpc": "2.0"`, one `id`, a `result` or an `error`, and no
/// `method`) with its `id` replaced by `id`; `None` for anything else.
fn rewrite_response(text: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let start = text.iter().position(|b| !b.is_ascii_whitespace())?;
    if text[start] != b'{' || !is_json(text) {
        return None;
    }
    let old = response_id(text, start)?;
    let mut out = Vec::with_capacity(text.len() - old.len() + id.len());
    out.extend_from_slice(&text[..old.start]);
    out.extend_from_slice(id);
    out.extend_from_slice(&text[old.end..]);
    Some(out)
}

/// Whether `text` is one JSON text, read as every JSON body is (depth and all); the memory it takes is
/// one decoded string at a time.
fn is_json(text: &[u8]) -> bool {
    let mut reader = Reader::new(text);
    let mut scratch = Scratch::unbounded();
    loop {
        match reader.next(&mut scratch) {
            Ok(Some(_)) => {}
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}

/// Where the `id` of the JSON-RPC response object opening at `open` is, in `text` (already known to be
/// JSON); `None` when the object is not a JSON-RPC response.
fn response_id(text: &[u8], open: usize) -> Option<std::ops::Range<usize>> {
    let mut scan = Scan { text, at: open + 1 };
    let (mut id, mut ids, mut version, mut outcome, mut method) = (None, 0, false, false, false);
    loop {
        scan.skip_space();
        if scan.peek()? != b'"' {
            break;
        }
        let name = scan.string();
        scan.skip_space();
        scan.at += 1; // the ':'
        scan.skip_space();
        let value = scan.value();
        match member_name(&text[name])?.as_str() {
            "id" => {
                ids += 1;
                id = Some(value);
            }
            "jsonrpc" => version = &text[value] == b"\"2.0\"",
            "result" | "error" => outcome = true,
            "method" => method = true,
            _ => {}
        }
        scan.skip_space();
        if scan.peek()? == b',' {
            scan.at += 1;
        }
    }
    (version && outcome && !method && ids == 1)
        .then_some(id)
        .flatten()
}

/// A member name (a JSON string with its quotes) as the text it stands for.
fn member_name(quoted: &[u8]) -> Option<String> {
    let inner = &quoted[1..quoted.len() - 1];
    if inner.contains(&b'\\') {
        return serde_json::from_slice(quoted).ok();
    }
    String::from_utf8(inner.to_vec()).ok()
}

/// A cursor over JSON text already known to be valid, stepping over whole values.
struct Scan<'a> {
    text: &'a [u8],
    at: usize,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while self
            .peek()
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.at += 1;
        }
    }

    /// The string opening at the cursor, quotes included; the cursor moves past it.
    fn string(&mut self) -> std::ops::Range<usize> {
        let start = self.at;
        self.at += 1;
        while let Some(b) = self.peek() {
            self.at += if b == b'\\' { 2 } else { 1 };
            if b == b'"' {
                break;
            }
        }
        start..self.at.min(self.text.len())
    }

    /// The value starting at the cursor; the cursor moves past it.
    fn value(&mut self) -> std::ops::Range<usize> {
        let start = self.at;
        let mut depth = 0usize;
        while let Some(b) = self.peek() {
            match b {
                b'"' => {
                    self.string();
                    if depth == 0 {
                        break;
                    }
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' if depth == 0 => break,
                b'}' | b']' => {
                    depth -= 1;
                    if depth == 0 {
                        self.at += 1;
                        break;
                    }
                }
                b',' | b' ' | b'\t' | b'\n' | b'\r' if depth == 0 => break,
                _ => {}
            }
            self.at += 1;
        }
        start..self.at
    }
}

/// The event stream with the JSON-RPC response of each event's `data` answering `id`; `None` when no
/// event holds one. A rewritten event's data lines become one `data:` line per line of the new text,
/// where its first data line was; its other lines keep their place and their line ends.
fn rewrite_stream(text: &[u8], id: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() + 64);
    let mut event: Vec<Line<'_>> = Vec::new();
    let mut changed = false;
    for line in lines(text) {
        let blank = line.text.is_empty();
        event.push(line);
        if blank {
            changed |= write_event(&mut out, &event, id);
            event.clear();
        }
    }
    changed |= write_event(&mut out, &event, id);
    changed.then_some(out)
}

/// One line of an event stream: its text and the line end that followed it (CRLF, LF, CR or none).
struct Line<'a> {
    text: &'a [u8],
    end: &'a [u8],
}

impl Line<'_> {
    /// The value of a `data` field, without its one optional leading space.
    fn data(&self) -> Option<&[u8]> {
        let rest = self.text.strip_prefix(b"data")?;
        if rest.is_empty() {
            return Some(rest);
        }
        let value = rest.strip_prefix(b":")?;
        Some(value.strip_prefix(b" ").unwrap_or(value))
    }
}

fn lines(text: &[u8]) -> impl Iterator<Item = Line<'_>> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = rest.iter().position(|&b| b == b'\n' || b == b'\r');
        let (line, end_len) = match cut {
            None => (rest, 0),
            Some(at) if rest[at..].starts_with(b"\r\n") => (&rest[..at], 2),
            Some(at) => (&rest[..at], 1),
        };
        let end = &rest[line.len()..line.len() + end_len];
        rest = &rest[line.len() + end_len..];
        Some(Line { text: line, end })
    })
}

/// Writes one event (its lines up to and including the blank one), its data rewritten when it is a
/// JSON-RPC response; whether it was.
fn write_event(out: &mut Vec<u8>, event: &[Line<'_>], id: &[u8]) -> bool {
    let data: Vec<&[u8]> = event.iter().filter_map(Line::data).collect();
    let rewritten = (!data.is_empty())
        .then(|| rewrite_response(&data.join(&b'\n'), id))
        .flatten();
    let Some(new) = rewritten else {
        for line in event {
            out.extend_from_slice(line.text);
            out.extend_from_slice(line.end);
        }
        return false;
    };
    let mut written = false;
    for line in event {
        if line.data().is_none() {
            out.extend_from_slice(line.text);
            out.extend_from_slice(line.end);
        } else if !written {
            for text in new.split(|&b| b == b'\n') {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(text);
                out.extend_from_slice(if line.end.is_empty() { b"\n" } else { line.end });
            }
            written = true;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::key::pointer::Found;

    fn id(found: Found) -> CallId {
        CallId::from_found(&found).unwrap()
    }

    fn json(body: &str, to: &CallId) -> Option<String> {
        answer_as(&Bytes::from(body.to_owned()), Some(b"application/json"), to)
            .map(|b| String::from_utf8(b.to_vec()).unwrap())
    }

    fn sse(body: &str, to: &CallId) -> Option<String> {
        answer_as(
            &Bytes::from(body.to_owned()),
            Some(b"text/event-stream; charset=utf-8"),
            to,
        )
        .map(|b| String::from_utf8(b.to_vec()).unwrap())
    }

    #[test]
    fn a_response_answers_the_retry_id_in_the_type_it_was_sent() {
        let body = r#"{"jsonrpc":"2.0","id":1,"result":{"id":1,"content":[]}}"#;
        assert_eq!(
            json(body, &id(Found::Number("42".into()))).as_deref(),
            Some(r#"{"jsonrpc":"2.0","id":42,"result":{"id":1,"content":[]}}"#),
            "only the top-level id changes"
        );
        assert_eq!(
            json(body, &id(Found::String("req-2".into()))).as_deref(),
            Some(r#"{"jsonrpc":"2.0","id":"req-2","result":{"id":1,"content":[]}}"#)
        );
        let spaced = "{ \"result\" : [1, {\"a\":\"}\"}],\n \"id\" : \"a\\\"b\" , \"jsonrpc\":\"2.0\" }";
        assert_eq!(
            json(spaced, &id(Found::Number("7".into()))).as_deref(),
            Some("{ \"result\" : [1, {\"a\":\"}\"}],\n \"id\" : 7 , \"jsonrpc\":\"2.0\" }")
        );
        let error = r#"{"jsonrpc":"2.0","error":{"code":-32602,"message":"x"},"\u0069d":null}"#;
        assert_eq!(
            json(error, &id(Found::Number("3".into()))).as_deref(),
            Some(r#"{"jsonrpc":"2.0","error":{"code":-32602,"message":"x"},"\u0069d":3}"#),
            "an escaped member name is the name it stands for"
        );
    }

    #[test]
    fn a_body_that_is_no_jsonrpc_response_is_left_as_it_is() {
        let to = id(Found::Number("9".into()));
        for body in [
            "",
            "not json",
            "[{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":1}]",
            r#"{"id":1,"result":1}"#,
            r#"{"jsonrpc":"1.0","id":1,"result":1}"#,
            r#"{"jsonrpc":"2.0","result":1}"#,
            r#"{"jsonrpc":"2.0","id":1}"#,
            r#"{"jsonrpc":"2.0","id":1,"method":"sampling/createMessage","params":{}}"#,
            r#"{"jsonrpc":"2.0","id":1,"id":2,"result":1}"#,
            r#"{"jsonrpc":"2.0","id":1,"result":1} trailing"#,
            r#"{"jsonrpc":"2.0","id":1,"result":"#,
        ] {
            assert_eq!(json(body, &to), None, "{body}");
        }
        let deep = format!(
            r#"{{"jsonrpc":"2.0","id":1,"result":{}1{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        );
        assert_eq!(json(&deep, &to), None, "nested past the JSON depth limit");
    }

    #[test]
    fn a_stream_has_its_response_event_rewritten_and_nothing_else() {
        let to = id(Found::String("b".into()));
        let stream = concat!(
            ": ping\r\n\r\n",
            "event: message\r\nid: ev-1\r\n",
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{\"progressToken\":1}}\r\n\r\n",
            "event: message\r\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"elicitation/create\",\"params\":{}}\r\n\r\n",
            "event: message\r\nid: ev-2\r\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":\"a\",\"result\":{\"ok\":true}}\r\n\r\n",
        );
        let expected = stream.replace(r#""id":"a""#, r#""id":"b""#);
        assert_eq!(sse(stream, &to).as_deref(), Some(expected.as_str()));
        assert_eq!(
            json(stream, &to),
            None,
            "read as an event stream only when it says it is one"
        );
    }

    #[test]
    fn a_response_split_over_data_lines_is_rewritten_whole() {
        let to = id(Found::Number("5".into()));
        let stream = "data: {\"jsonrpc\":\"2.0\",\ndata: \"id\":1,\ndata:\"result\":{}}\n\n";
        assert_eq!(
            sse(stream, &to).as_deref(),
            Some("data: {\"jsonrpc\":\"2.0\",\ndata: \"id\":5,\ndata: \"result\":{}}\n\n")
        );
        let unterminated = "data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}";
        assert_eq!(
            sse(unterminated, &to).as_deref(),
            Some("data: {\"jsonrpc\":\"2.0\",\"id\":5,\"result\":{}}\n")
        );
        assert_eq!(sse(": only a comment\n\n", &to), None);
        assert_eq!(sse("data: not json\r\rdata: [1]\r\r", &to), None);
    }
}
