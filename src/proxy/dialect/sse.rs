//! Resuming a server-sent event stream (`text/event-stream`) where a client left it: a retry that
//! carries `Last-Event-ID` gets, of the stream replayed or followed under its key, only what comes after
//! the event that set that id (the WHATWG HTML event-stream format: lines end with CRLF, LF or CR; an
//! `id` field sets the last event id, which every event after carries until another changes it; a blank
//! line ends the event; a leading byte-order mark is ignored). A stream with no such event gives the
//! retry nothing; a stream sent with a content coding is not read, and replayed whole. Runs on the replay's body (`replay.rs`) and on a followed body (`attach.rs`), as
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

/// Whether a response with these headers is an event stream that can be resumed: one sent without a
/// content coding, whose bytes are the events themselves (a gzip stream is replayed whole).
pub fn resumable(headers: &HeaderMap) -> bool {
    is_event_stream(headers)
        && headers
            .get_all(header::CONTENT_ENCODING)
            .iter()
            .all(|coding| coding.as_bytes().eq_ignore_ascii_case(b"identity"))
}

/// Whether a response with these headers is an event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("text/event-stream"))
}

/// Bytes of one event held back while it may still be one the client had (see [`Resume`]); an event
/// longer than this is passed on rather than held, so a resumed client may get it again but never
/// loses it.
const HOLD_MAX: usize = 64 * 1024;

/// The byte-order mark one stream may open with, which the format ignores.
const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];

/// Skips a stream's bytes up to where a client whose last event id is the target left it, tracking the
/// last event id as the WHATWG algorithm does: an `id` field sets it, and every event dispatched after
/// carries it until another `id` changes it. So what passes begins with the first event whose id is
/// not the target after an event whose id was: an event without an `id` after the target's is one the
/// client already had (its last event id was still the target), and is skipped. Since whether an event
/// sets another id is known only once its `id` line (or its end) has come, the event after the
/// target's is held until then, at most [`HOLD_MAX`] bytes.
#[derive(Debug)]
pub struct Resume {
    target: Vec<u8>,
    /// The start of the line being read: enough of it to tell an `id` line for the target.
    line: Vec<u8>,
    /// Whether the line is longer than `line` holds.
    long: bool,
    /// The last byte was a CR, so an LF right after it ends no further line.
    after_cr: bool,
    /// How many bytes of a leading byte-order mark have been read, until the stream's first other byte.
    bom: Option<u8>,
    /// The last event id buffer is the target.
    id_is_target: bool,
    phase: Phase,
    /// The bytes of the event being held, from its first byte.
    held: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No event with the target's id has been dispatched yet: nothing passes.
    Seeking,
    /// The last event dispatched had the target's id: the next one is held until it sets another id
    /// (it passes) or ends without one (it is skipped).
    Holding,
    /// Everything passes.
    Passing,
}

/// What the end of a line did.
enum LineEnd {
    /// A blank line: the event ended, carrying the last event id.
    Dispatch,
    /// An `id` field set the last event id to something other than the target.
    OtherId,
    Other,
}

impl Resume {
    /// Resumes after the event with id `target`.
    pub fn after(target: &HeaderValue) -> Resume {
        Resume {
            target: target.as_bytes().to_vec(),
            line: Vec::new(),
            long: false,
            after_cr: false,
            bom: Some(0),
            id_is_target: false,
            phase: Phase::Seeking,
            held: Vec::new(),
        }
    }

    /// What of `chunk` passes: nothing until the client's resume point, then the rest.
    pub fn feed(&mut self, chunk: &Bytes) -> Option<Bytes> {
        if self.phase == Phase::Passing {
            return (!chunk.is_empty()).then(|| chunk.clone());
        }
        // Where in this chunk the event being held began.
        let mut held_from = 0;
        for (at, &byte) in chunk.iter().enumerate() {
            if self.phase == Phase::Holding && self.held.len() + (at - held_from) > HOLD_MAX {
                return Some(self.pass(&chunk[held_from..]));
            }
            if self.skips_bom(byte) {
                continue;
            }
            if std::mem::take(&mut self.after_cr) && byte == b'\n' {
                if held_from == at {
                    held_from = at + 1;
                }
                continue;
            }
            if byte != b'\r' && byte != b'\n' {
                if self.line.len() < self.target.len() + 4 {
                    self.line.push(byte);
                } else {
                    self.long = true;
                }
                continue;
            }
            self.after_cr = byte == b'\r';
            match self.end_line() {
                LineEnd::Dispatch if self.id_is_target => {
                    self.phase = Phase::Holding;
                    self.held.clear();
                    held_from = at + 1;
                }
                LineEnd::OtherId if self.phase == Phase::Holding => {
                    return Some(self.pass(&chunk[held_from..]));
                }
                LineEnd::Dispatch | LineEnd::OtherId | LineEnd::Other => {}
            }
        }
        if self.phase == Phase::Holding {
            self.held.extend_from_slice(&chunk[held_from.min(chunk.len())..]);
        }
        None
    }

    /// From here on everything passes: what was held, then `rest`.
    fn pass(&mut self, rest: &[u8]) -> Bytes {
        self.phase = Phase::Passing;
        let mut passed = std::mem::take(&mut self.held);
        passed.extend_from_slice(rest);
        Bytes::from(passed)
    }

    /// Whether `byte` belongs to the byte-order mark the stream opens with, which is not parsed.
    fn skips_bom(&mut self, byte: u8) -> bool {
        let Some(read) = self.bom else {
            return false;
        };
        if BOM.get(usize::from(read)) == Some(&byte) {
            self.bom = (read < 2).then_some(read + 1);
            return true;
        }
        // Not a mark after all: what looked like its start is the first line's.
        self.bom = None;
        self.line.extend_from_slice(&BOM[..usize::from(read)]);
        false
    }

    fn end_line(&mut self) -> LineEnd {
        let line = std::mem::take(&mut self.line);
        let long = std::mem::take(&mut self.long);
        if line.is_empty() && !long {
            return LineEnd::Dispatch;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (&line[..], &[][..]),
        };
        if field != b"id" {
            return LineEnd::Other;
        }
        let value = value.strip_prefix(b" ").unwrap_or(value);
        // An id with a NUL in it is ignored by the format; a line too long to hold is not the target's.
        if value.contains(&0) {
            return LineEnd::Other;
        }
        self.id_is_target = !long && value == self.target.as_slice();
        if self.id_is_target {
            LineEnd::Other
        } else {
            LineEnd::OtherId
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
        let stream = "id:7\r\ndata: a\r\n\r\nid:8\r\ndata: b\r\n\r\n";
        assert_eq!(after("7", stream), "id:8\r\ndata: b\r\n\r\n");
        assert_eq!(after_bytewise("7", stream), "id:8\r\ndata: b\r\n\r\n");
        assert_eq!(
            after("7", "id: 7\rdata: a\r\rid: 8\rdata: b\r\r"),
            "id: 8\rdata: b\r\r"
        );
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
        let stream = format!("id: {long}\ndata: {long}\n\nid: 2\ndata: a\n\nid: 3\ndata: b\n\n");
        assert_eq!(after("2", &stream), "id: 3\ndata: b\n\n");
        let mut resume = Resume::after(&HeaderValue::from_static("2"));
        resume.feed(&Bytes::from(stream));
        assert!(resume.line.capacity() < 64, "kept {}", resume.line.capacity());
    }

    #[test]
    fn a_later_id_in_the_same_event_wins() {
        assert_eq!(after("1", "id: 1\nid: 2\n\ndata: a\n\n"), "");
        assert_eq!(
            after("2", "id: 1\nid: 2\n\nid: 3\ndata: a\n\n"),
            "id: 3\ndata: a\n\n"
        );
    }

    #[test]
    fn events_without_an_id_after_the_target_s_carry_its_id_and_were_had() {
        // A client that read `b` has 1 as its last event id too (WHATWG): it resumes after `b`.
        let stream = "id: 1\ndata: a\n\ndata: b\n\n: comment\n\ndata: c\nid: 2\n\ndata: d\n\n";
        assert_eq!(after("1", stream), "data: c\nid: 2\n\ndata: d\n\n");
        assert_eq!(after_bytewise("1", stream), "data: c\nid: 2\n\ndata: d\n\n");
        // An event that sets the target's id again is the client's too.
        assert_eq!(after("1", "id: 1\n\nid: 1\ndata: a\n\nid: 2\n\n"), "id: 2\n\n");
        // The id set to nothing is another id.
        assert_eq!(after("1", "id: 1\n\nid\ndata: a\n\n"), "id\ndata: a\n\n");
    }

    #[test]
    fn a_long_event_after_the_target_s_is_passed_on_rather_than_held() {
        let long = "x".repeat(HOLD_MAX + 10);
        let stream = format!("id: 1\n\ndata: {long}\n\nid: 2\n\n");
        let passed = after("1", &stream);
        assert!(
            passed == format!("data: {long}\n\nid: 2\n\n"),
            "sent again, never lost"
        );
        let mut resume = Resume::after(&HeaderValue::from_static("1"));
        for chunk in stream.as_bytes().chunks(1000) {
            resume.feed(&Bytes::copy_from_slice(chunk));
            assert!(resume.held.len() <= HOLD_MAX + 1000, "held {}", resume.held.len());
        }
    }

    #[test]
    fn a_leading_byte_order_mark_is_ignored_once() {
        let stream = "\u{feff}id: 1\ndata: a\n\nid: 2\ndata: b\n\n";
        assert_eq!(after("1", stream), "id: 2\ndata: b\n\n");
        assert_eq!(after_bytewise("1", stream), "id: 2\ndata: b\n\n");
        let twice = "\u{feff}\u{feff}id: 1\n\nid: 2\n\n";
        assert_eq!(
            after("1", twice),
            "",
            "a second mark is part of the first field's name"
        );
        assert_eq!(
            after("1", "\u{fe}id: 1\n\nid: 2\n\n"),
            "",
            "no mark: the bytes are the line's"
        );
    }

    #[test]
    fn only_a_stream_without_a_content_coding_is_resumable() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        assert!(resumable(&headers));
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("identity"));
        assert!(resumable(&headers));
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        assert!(!resumable(&headers));
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
