//! Resuming a server-sent event stream (`text/event-stream`) where a client left it: a retry that
//! carries `Last-Event-ID` gets, of the stream replayed or followed under its key, only what comes after
//! the event that set that id (the WHATWG HTML event-stream format: lines end with CRLF, LF or CR; an
//! `id` field sets the event's id; a blank line ends the event). A stream with no such event gives the
//! retry nothing. Runs on the replay's body (`replay.rs`) and on a followed body (`attach.rs`), as
//! bytes pass; keeps no more than the start of one line.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};

use crate::headers::LAST_EVENT_ID_HEADER;

/// The id a request resumes after, if it names one (an empty one resumes nothing).
pub fn last_event_id(headers: &HeaderMap) -> Option<&HeaderValue> {
    headers
        .get(LAST_EVENT_ID_HEADER)
        .filter(|value| !value.as_bytes().is_empty())
}

/// Whether a response with these headers is an event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Skips a stream's bytes up to the end of the event whose id is the one resumed after.
#[derive(Debug)]
pub struct Resume {
    target: Vec<u8>,
    /// The start of the line being read: enough of it to tell an `id` line for the target.
    line: Vec<u8>,
    /// Whether the line is longer than `line` holds.
    long: bool,
    /// The last byte was a CR, so an LF right after it ends no further line.
    after_cr: bool,
    /// The event being read set its id to the target.
    sets_target: bool,
    /// The target's event has ended: everything from here passes.
    found: bool,
}

impl Resume {
    /// Resumes after the event with id `target`.
    pub fn after(target: &HeaderValue) -> Resume {
        Resume {
            target: target.as_bytes().to_vec(),
            line: Vec::new(),
            long: false,
            after_cr: false,
            sets_target: false,
            found: false,
        }
    }

    /// What of `chunk` passes: nothing while the target's event has not ended, then the rest.
    pub fn feed(&mut self, chunk: &Bytes) -> Option<Bytes> {
        let mut start = 0;
        if !self.found {
            start = chunk.len();
            for (at, &byte) in chunk.iter().enumerate() {
                if std::mem::take(&mut self.after_cr) && byte == b'\n' {
                    continue;
                }
                if byte == b'\r' || byte == b'\n' {
                    self.after_cr = byte == b'\r';
                    self.end_line();
                    if self.found {
                        start = at + 1;
                        break;
                    }
                } else if self.line.len() < self.target.len() + 4 {
                    self.line.push(byte);
                } else {
                    self.long = true;
                }
            }
        }
        // A CR that ended the target's event may have its LF in the next byte, even the next chunk's.
        if self.found && self.after_cr && start < chunk.len() {
            self.after_cr = false;
            if chunk[start] == b'\n' {
                start += 1;
            }
        }
        (start < chunk.len()).then(|| chunk.slice(start..))
    }

    fn end_line(&mut self) {
        let line = std::mem::take(&mut self.line);
        let long = std::mem::take(&mut self.long);
        if line.is_empty() && !long {
            self.found = self.sets_target;
            self.sets_target = false;
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (&line[..], &[][..]),
        };
        if field != b"id" {
            return;
        }
        let value = value.strip_prefix(b" ").unwrap_or(value);
        // An id with a NUL in it is ignored by the format; a line too long to hold is not the target's.
        if !value.contains(&0) {
            self.sets_target = !long && value == self.target.as_slice();
        }
    }
}

/// What a stored event stream resumed after `target` replays: the bytes after its event, or none.
pub fn resumed(body: &Bytes, target: &HeaderValue) -> Bytes {
    Resume::after(target).feed(body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn after(id: &str, stream: &str) -> String {
        let body = Bytes::copy_from_slice(stream.as_bytes());
        String::from_utf8(resumed(&body, &HeaderValue::from_str(id).unwrap()).to_vec()).unwrap()
    }

    /// Feeds `stream` one byte at a time, as a live stream may come.
    fn after_bytewise(id: &str, stream: &str) -> String {
        let mut resume = Resume::after(&HeaderValue::from_str(id).unwrap());
        let mut out = Vec::new();
        for byte in stream.as_bytes() {
            if let Some(passed) = resume.feed(&Bytes::copy_from_slice(&[*byte])) {
                out.extend_from_slice(&passed);
            }
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn resumes_after_the_event_that_set_the_id() {
        let stream = "id: 1\ndata: a\n\nid: 2\ndata: b\n\nid: 3\ndata: c\n\n";
        assert_eq!(after("1", stream), "id: 2\ndata: b\n\nid: 3\ndata: c\n\n");
        assert_eq!(after("2", stream), "id: 3\ndata: c\n\n");
        assert_eq!(after("3", stream), "");
        assert_eq!(after_bytewise("2", stream), "id: 3\ndata: c\n\n");
    }

    #[test]
    fn every_line_ending_counts_and_a_crlf_is_not_split() {
        let stream = "id:7\r\ndata: a\r\n\r\ndata: b\r\n\r\n";
        assert_eq!(after("7", stream), "data: b\r\n\r\n");
        assert_eq!(after_bytewise("7", stream), "data: b\r\n\r\n");
        assert_eq!(after("7", "id: 7\rdata: a\r\rdata: b\r\r"), "data: b\r\r");
    }

    #[test]
    fn an_unknown_id_resumes_nothing_and_lookalikes_do_not_match() {
        let stream = "data: id: 1\n\n: id: 1\n\nid: 10\n\nid:  1\n\nid: 1x\n\n";
        assert_eq!(after("1", stream), "");
        assert_eq!(after("nope", "id: 1\ndata: a\n\n"), "");
    }

    #[test]
    fn a_long_line_is_read_through_without_being_kept() {
        let long = "x".repeat(100_000);
        let stream = format!("id: {long}\ndata: {long}\n\nid: 2\ndata: a\n\ndata: b\n\n");
        assert_eq!(after("2", &stream), "data: b\n\n");
        let mut resume = Resume::after(&HeaderValue::from_static("2"));
        resume.feed(&Bytes::from(stream));
        assert!(resume.line.capacity() < 64, "kept {}", resume.line.capacity());
    }

    #[test]
    fn a_later_id_in_the_same_event_wins() {
        assert_eq!(after("1", "id: 1\nid: 2\n\ndata: a\n\n"), "");
        assert_eq!(after("2", "id: 1\nid: 2\n\ndata: a\n\n"), "data: a\n\n");
    }

    #[test]
    fn event_streams_are_told_by_their_media_type() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("Text/Event-Stream; charset=utf-8"),
        );
        assert!(is_event_stream(&headers));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        assert!(!is_event_stream(&headers));
    }
}
