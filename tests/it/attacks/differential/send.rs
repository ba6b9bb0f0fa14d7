//! Sending one case to the proxy as its client would: HTTP/1.1 written byte for byte on a fresh socket, or
//! HTTP/2 with prior knowledge written frame by frame (HPACK literals, no compression), so that spellings a
//! client library refuses (upper-case names, `:method post`, `connection` in HTTP/2, trailers of any name)
//! go out as written. The answer is read as far as telling whose it is: the framework's (its JSON names
//! the app and handler), the proxy's own (a problem), something else, a reset, a close, or nothing.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::corpus::{Body, Case, Client};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::signatures::{STRIPE_SECRET, stripe_signature};

/// Bound on one case's answer: above the proxy's `upstream.timeout` (a case that makes the proxy wait it
/// out is caught by its 504), far above what any app takes to answer.
pub const CASE_BOUND: Duration = Duration::from_secs(40);

const PROBLEM_TYPES: &str = "https://idemproxy.dev/problems/";
const JSON_BODY: &str = r#"{"amount":1}"#;

/// What came back.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// A framework's answer: its JSON names the app and the handler that ran.
    App {
        status: u16,
        app: String,
        handler: String,
    },
    /// The proxy's own problem+json answer.
    Problem { status: u16, slug: String },
    /// An answer that is neither (a parser's bare 400, a framework's own 404 page); HTTP/2 status 0 when
    /// its encoding was not one this client reads.
    Other { status: u16, body: String },
    /// HTTP/2: the stream reset, or the connection refused with GOAWAY before the stream ran.
    Reset(String),
    /// The connection closed without an answer.
    Closed,
    /// Nothing within [`CASE_BOUND`].
    Hung,
}

impl Answer {
    /// The proxy's problem after it forwarded the request (`upstream-timeout`, `upstream-unreachable`...).
    pub fn upstream_problem(&self) -> Option<&str> {
        match self {
            Answer::Problem { slug, .. } if slug.starts_with("upstream") => Some(slug),
            _ => None,
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Answer::App { status, app, handler } => write!(f, "{status} from {app}'s {handler}"),
            Answer::Problem { status, slug } => write!(f, "{status} {slug}"),
            Answer::Other { status, body } => write!(f, "{status} {body:?}"),
            Answer::Reset(reason) => write!(f, "{reason}"),
            Answer::Closed => write!(f, "a close without an answer"),
            Answer::Hung => write!(f, "no answer within {}s", CASE_BOUND.as_secs()),
        }
    }
}

/// One case, filled in for one lane.
pub struct Request<'a> {
    case: &'a Case,
    id: &'a str,
    addr: &'a str,
    key: String,
    event: String,
}

impl<'a> Request<'a> {
    /// `case` with the id `id`, to the proxy at `addr` (`host:port`).
    pub fn new(case: &'a Case, id: &'a str, addr: &'a str) -> Request<'a> {
        let event = format!(
            r#"{{"id":"evt_{}","type":"charge.succeeded","data":{{"object":{{"amount":2000}}}}}}"#,
            id.replace(['/', '.'], "_")
        );
        Request {
            case,
            id,
            addr,
            key: format!("k-{id}"),
            event,
        }
    }

    /// The key `{key}` stands for.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Sends the request and reads the answer, within [`CASE_BOUND`].
    pub async fn send(&self) -> Answer {
        let exchange = async {
            match self.case.client {
                Client::H1 => self.h1().await,
                Client::H2 => self.h2().await,
            }
        };
        tokio::time::timeout(CASE_BOUND, exchange)
            .await
            .unwrap_or(Answer::Hung)
    }

    fn fill(&self, text: &str) -> String {
        if !text.contains('{') || text == "{}" {
            return text.to_owned();
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
        text.replace("{key}", &self.key)
            .replace("{sig}", &stripe_signature(STRIPE_SECRET, now, &self.event))
            .replace("{badsig}", &stripe_signature("whsec_guessed", now, &self.event))
            .replace("{case}", self.id)
            .replace("{host}", self.addr)
    }

    fn body(&self) -> Option<String> {
        match self.case.body {
            Body::Empty => None,
            Body::Json | Body::Chunked(_) => Some(JSON_BODY.to_owned()),
            Body::Event => Some(self.event.clone()),
            Body::Raw(raw) => Some(self.fill(raw)),
        }
    }

    fn trailers(&self) -> Vec<String> {
        match self.case.body {
            Body::Chunked(lines) => lines.iter().map(|line| self.fill(line)).collect(),
            _ => Vec::new(),
        }
    }

    /// The trailers' names, as a `Trailer` header declares them: HTTP/1.1 asks it of a sender, and
    /// hyper's HTTP/1.1 client (the proxy's) sends only the trailers it declares.
    fn trailer_names(&self) -> String {
        let trailers = self.trailers();
        let names: Vec<&str> = trailers.iter().map(|line| split_field(line).0).collect();
        names.join(", ")
    }

    fn sends(&self, name: &str) -> bool {
        self.case.headers.iter().any(|line| {
            line.split(':')
                .next()
                .is_some_and(|n| n.trim().eq_ignore_ascii_case(name))
        })
    }

    fn h1_bytes(&self) -> Vec<u8> {
        let mut text = format!("{} HTTP/1.1\r\n", self.case.head);
        if !self.sends("host") {
            text += &format!("host: {}\r\n", self.addr);
        }
        text += &format!("authorization: {TEST_CREDENTIAL}\r\nx-diff-case: {}\r\n", self.id);
        let body = self.body();
        if body.is_some() && !matches!(self.case.body, Body::Raw(_)) {
            text += "content-type: application/json\r\n";
        }
        for line in self.case.headers {
            text += &self.fill(line);
            text += "\r\n";
        }
        match (self.case.body, &body) {
            (Body::Json | Body::Event, Some(body)) => text += &format!("content-length: {}\r\n", body.len()),
            (Body::Chunked(_), _) => {
                text += &format!(
                    "trailer: {}\r\ntransfer-encoding: chunked\r\n",
                    self.trailer_names()
                );
            }
            _ => {}
        }
        text += "\r\n";
        match (self.case.body, body) {
            (Body::Chunked(_), Some(body)) => {
                text += &format!("{:x}\r\n{body}\r\n0\r\n", body.len());
                for line in self.trailers() {
                    text += &line;
                    text += "\r\n";
                }
                text += "\r\n";
            }
            (_, Some(body)) => text += &body,
            (_, None) => {}
        }
        text.into_bytes()
    }

    async fn h1(&self) -> Answer {
        let Ok(mut stream) = TcpStream::connect(self.addr).await else {
            return Answer::Closed;
        };
        if stream.write_all(&self.h1_bytes()).await.is_err() {
            return Answer::Closed;
        }
        read_h1(&mut stream).await
    }

    fn h2_fields(&self) -> Vec<(String, String)> {
        let (method, path) = self.case.head.split_once(' ').expect("head is `METHOD target`");
        let mut pseudo = vec![
            (":method".to_owned(), method.to_owned()),
            (":scheme".to_owned(), "http".to_owned()),
            (":authority".to_owned(), self.addr.to_owned()),
            (":path".to_owned(), path.to_owned()),
        ];
        let mut fields = vec![
            ("authorization".to_owned(), TEST_CREDENTIAL.to_owned()),
            ("x-diff-case".to_owned(), self.id.to_owned()),
        ];
        if self.body().is_some() {
            fields.push(("content-type".to_owned(), "application/json".to_owned()));
        }
        if !self.trailers().is_empty() {
            fields.push(("trailer".to_owned(), self.trailer_names()));
        }
        for line in self.case.headers {
            let (name, value) = split_field(line);
            let value = self.fill(value);
            match pseudo.iter_mut().find(|(n, _)| n == name) {
                Some(slot) => slot.1 = value,
                None => fields.push((name.to_owned(), value)),
            }
        }
        pseudo.extend(fields);
        pseudo
    }

    async fn h2(&self) -> Answer {
        assert!(
            !matches!(self.case.body, Body::Raw(_)),
            "{}: a raw body is HTTP/1.1 only",
            self.case.name
        );
        let Ok(mut stream) = TcpStream::connect(self.addr).await else {
            return Answer::Closed;
        };
        let trailers: Vec<(String, String)> = self
            .trailers()
            .iter()
            .map(|line| {
                let (name, value) = split_field(line);
                (name.to_owned(), value.to_owned())
            })
            .collect();
        let bytes = h2::request(&self.h2_fields(), self.body().as_deref(), &trailers);
        if stream.write_all(&bytes).await.is_err() {
            return Answer::Closed;
        }
        h2::read(&mut stream).await
    }
}

/// `name: value` as a name and a value, a leading `:` (a pseudo-header) part of the name.
fn split_field(line: &str) -> (&str, &str) {
    let split = line[1..]
        .find(':')
        .map(|at| at + 1)
        .expect("a header line is `name: value`");
    (&line[..split], line[split + 1..].trim_start())
}

/// Whose answer `body` is.
fn classify(status: u16, body: &[u8]) -> Answer {
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(body) {
        if let (Some(app), Some(handler)) = (json["app"].as_str(), json["handler"].as_str()) {
            let (app, handler) = (app.to_owned(), handler.to_owned());
            return Answer::App { status, app, handler };
        }
        if let Some(slug) = json["type"].as_str().and_then(|t| t.strip_prefix(PROBLEM_TYPES)) {
            let slug = slug.to_owned();
            return Answer::Problem { status, slug };
        }
    }
    let body: String = String::from_utf8_lossy(body).chars().take(60).collect();
    Answer::Other { status, body }
}

/// Reads one HTTP/1.1 answer (after any interim 1xx), framed by `content-length`, chunked, or the close.
async fn read_h1(stream: &mut TcpStream) -> Answer {
    let mut buffer = Vec::new();
    let mut closed = false;
    loop {
        if let Some(end) = find(&buffer, b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            let status: u16 = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
            if (100..200).contains(&status) && status != 101 {
                buffer.drain(..end + 4);
                continue;
            }
            let rest = &buffer[end + 4..];
            let body = match header(&head, "content-length").and_then(|n| n.parse::<usize>().ok()) {
                Some(length) => rest.get(..length).map(<[u8]>::to_vec),
                None if header(&head, "transfer-encoding").is_some_and(|t| t.contains("chunked")) => {
                    dechunk(rest)
                }
                None if status == 101 || status == 204 || status == 304 => Some(Vec::new()),
                None => closed.then(|| rest.to_vec()),
            };
            match body {
                Some(body) => return classify(status, &body),
                None if closed => return classify(status, rest),
                None => {}
            }
        } else if closed {
            return match buffer.is_empty() {
                true => Answer::Closed,
                false => classify(0, &buffer),
            };
        }
        let mut chunk = [0u8; 8192];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => closed = true,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

fn header<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A whole chunked body, or `None` while it is incomplete.
fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line = find(rest, b"\r\n")?;
        let size_text = String::from_utf8_lossy(&rest[..line]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line + 2..];
        if size == 0 {
            return find(rest, b"\r\n").map(|_| body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// HTTP/2 by hand: the frames of one request on stream 1, and the reading of its answer.
mod h2 {
    use super::*;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const DATA: u8 = 0;
    const HEADERS: u8 = 1;
    const RST_STREAM: u8 = 3;
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const GOAWAY: u8 = 7;
    const END_STREAM: u8 = 0x1;
    const ACK: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    const PADDED: u8 = 0x8;
    const PRIORITY: u8 = 0x20;

    /// The preface, an empty SETTINGS, and the request: HEADERS, a DATA frame with `body`, and a
    /// HEADERS of `trailers`, END_STREAM on the last.
    pub fn request(
        fields: &[(String, String)],
        body: Option<&str>,
        trailers: &[(String, String)],
    ) -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        frame(&mut out, SETTINGS, 0, 0, &[]);
        let ends_at_head = body.is_none() && trailers.is_empty();
        let flags = END_HEADERS | if ends_at_head { END_STREAM } else { 0 };
        frame(&mut out, HEADERS, flags, 1, &literals(fields));
        if let Some(body) = body {
            let flags = if trailers.is_empty() { END_STREAM } else { 0 };
            frame(&mut out, DATA, flags, 1, body.as_bytes());
        }
        if !trailers.is_empty() {
            frame(
                &mut out,
                HEADERS,
                END_HEADERS | END_STREAM,
                1,
                &literals(trailers),
            );
        }
        out
    }

    fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
        out.extend_from_slice(&[kind, flags]);
        out.extend_from_slice(&stream.to_be_bytes());
        out.extend_from_slice(payload);
    }

    /// Each field as a literal without indexing, with a literal name, neither Huffman-coded: the names
    /// go out in the case the corpus wrote them.
    fn literals(fields: &[(String, String)]) -> Vec<u8> {
        let mut block = Vec::new();
        for (name, value) in fields {
            block.push(0);
            for text in [name, value] {
                integer(&mut block, text.len(), 7, 0);
                block.extend_from_slice(text.as_bytes());
            }
        }
        block
    }

    fn integer(out: &mut Vec<u8>, mut value: usize, prefix: u32, high: u8) {
        let max = (1usize << prefix) - 1;
        if value < max {
            out.push(high | value as u8);
            return;
        }
        out.push(high | max as u8);
        value -= max;
        while value >= 128 {
            out.push((value % 128) as u8 | 0x80);
            value /= 128;
        }
        out.push(value as u8);
    }

    /// Reads frames until stream 1 ends, is reset, or the connection goes; acknowledges SETTINGS and PING.
    pub async fn read(stream: &mut TcpStream) -> Answer {
        let (mut status, mut body) = (None, Vec::new());
        loop {
            let mut head = [0u8; 9];
            if stream.read_exact(&mut head).await.is_err() {
                return match status {
                    Some(status) => classify(status, &body),
                    None => Answer::Closed,
                };
            }
            let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let (kind, flags) = (head[3], head[4]);
            let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; length];
            if stream.read_exact(&mut payload).await.is_err() {
                return Answer::Closed;
            }
            match kind {
                SETTINGS | PING if flags & ACK == 0 => {
                    let mut ack = Vec::new();
                    frame(&mut ack, kind, ACK, 0, if kind == PING { &payload } else { &[] });
                    let _ = stream.write_all(&ack).await;
                }
                HEADERS if id == 1 => {
                    let block = unpadded(flags, &payload, flags & PRIORITY != 0);
                    if status.is_none() {
                        match decode_status(block) {
                            Some(informational) if (100..200).contains(&informational) => continue,
                            decoded => status = Some(decoded.unwrap_or(0)),
                        }
                    }
                    if flags & END_STREAM != 0 {
                        return classify(status.unwrap_or(0), &body);
                    }
                }
                DATA if id == 1 => {
                    body.extend_from_slice(unpadded(flags, &payload, false));
                    if flags & END_STREAM != 0 {
                        return classify(status.unwrap_or(0), &body);
                    }
                }
                RST_STREAM if id == 1 => {
                    return Answer::Reset(format!("RST_STREAM {}", error_code(&payload)));
                }
                GOAWAY => {
                    let last = u32::from_be_bytes(payload[..4].try_into().unwrap()) & 0x7fff_ffff;
                    if last == 0 && status.is_none() {
                        return Answer::Reset(format!("GOAWAY {}", error_code(&payload[4..])));
                    }
                }
                _ => {}
            }
        }
    }

    fn unpadded(flags: u8, payload: &[u8], priority: bool) -> &[u8] {
        let (mut start, mut end) = (0, payload.len());
        if flags & PADDED != 0 && !payload.is_empty() {
            start = 1;
            end = end.saturating_sub(payload[0] as usize);
        }
        if priority {
            start += 5;
        }
        payload.get(start..end).unwrap_or_default()
    }

    fn error_code(payload: &[u8]) -> &'static str {
        let code = payload
            .get(..4)
            .map_or(u32::MAX, |b| u32::from_be_bytes(b.try_into().unwrap()));
        match code {
            0 => "NO_ERROR",
            1 => "PROTOCOL_ERROR",
            2 => "INTERNAL_ERROR",
            3 => "FLOW_CONTROL_ERROR",
            5 => "STREAM_CLOSED",
            6 => "FRAME_SIZE_ERROR",
            7 => "REFUSED_STREAM",
            8 => "CANCEL",
            11 => "ENHANCE_YOUR_CALM",
            13 => "HTTP_1_1_REQUIRED",
            _ => "(other error)",
        }
    }

    /// `:status` from the first field of a response block, as an encoder writes it: an indexed static
    /// entry (8 to 14), or a literal under the static name `:status` (index 8), its digits plain or
    /// Huffman-coded. A dynamic table size update before it is skipped.
    pub(super) fn decode_status(mut block: &[u8]) -> Option<u16> {
        while block.first().is_some_and(|b| b & 0xe0 == 0x20) {
            let continued = block[0] & 0x1f == 0x1f;
            let skip = if continued {
                1 + block[1..].iter().position(|b| b & 0x80 == 0)? + 1
            } else {
                1
            };
            block = &block[skip..];
        }
        let first = *block.first()?;
        if first & 0x80 != 0 {
            let statuses = [200, 204, 206, 304, 400, 404, 500];
            return statuses.get(usize::from(first & 0x7f).checked_sub(8)?).copied();
        }
        let name = if first & 0xc0 == 0x40 {
            first & 0x3f
        } else {
            first & 0x0f
        };
        if name != 8 {
            return None;
        }
        let (huffman, length) = (block.get(1)? & 0x80 != 0, usize::from(block.get(1)? & 0x7f));
        let value = block.get(2..2 + length)?;
        let digits = match huffman {
            true => huffman_digits(value)?,
            false => String::from_utf8(value.to_vec()).ok()?,
        };
        digits.parse().ok()
    }

    /// Three digits from HPACK's Huffman code: `0`-`2` are 5 bits (`00000`-`00010`), `3`-`9` 6 bits
    /// (`011001`-`011111`).
    fn huffman_digits(bytes: &[u8]) -> Option<String> {
        let bit = |at: usize| bytes.get(at / 8).map(|b| (b >> (7 - at % 8)) & 1);
        let (mut at, mut digits) = (0, String::new());
        while digits.len() < 3 {
            let mut code = 0u8;
            for _ in 0..5 {
                code = code << 1 | bit(at)?;
                at += 1;
            }
            let digit = match code {
                0..=2 => code,
                12..=15 => {
                    let six = code << 1 | bit(at)?;
                    at += 1;
                    six.checked_sub(22).filter(|d| (3..=9).contains(d))?
                }
                _ => return None,
            };
            digits.push(char::from(b'0' + digit));
        }
        Some(digits)
    }
}

#[cfg(test)]
mod tests {
    use super::h2::decode_status;

    #[test]
    fn status_is_read_indexed_plain_or_huffman_coded() {
        assert_eq!(decode_status(&[0x88]), Some(200));
        assert_eq!(decode_status(&[0x8c]), Some(400));
        assert_eq!(decode_status(&[0x08, 0x03, b'4', b'2', b'2']), Some(422));
        // "401" Huffman-coded: 011010 00000 00001, padded with ones.
        assert_eq!(decode_status(&[0x48, 0x82, 0b0110_1000, 0b0000_0001]), Some(401));
        // "503": 011011 00000 011001, padded.
        assert_eq!(
            decode_status(&[0x48, 0x83, 0b0110_1100, 0b0000_1100, 0b1111_1111]),
            Some(503)
        );
    }
}
