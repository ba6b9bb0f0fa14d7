//! The suite's client: one new connection per request, so that every request is a client of its own,
//! over HTTP/1.1 (hyper), HTTP/2 with prior knowledge (hyper), or bytes written as they are (for the
//! spellings hyper would tidy away: an upper-case header name, a lower-case method).

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most of one response the suite reads: more than any case asks for (16 MiB), and a bound on what
/// a target that never ends its body can make the suite hold.
pub const MAX_READ: usize = 64 << 20;

/// Where the suite sends its requests: a plain `http://` base URL.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port` to connect to.
    pub address: String,
    /// The `Host` header.
    pub authority: String,
    /// The base URL's path, without a trailing `/` (empty for the root).
    pub base: String,
}

impl Target {
    /// Reads `http://host[:port][/base]`.
    pub fn parse(text: &str) -> Result<Target, String> {
        let url = url::Url::parse(text).map_err(|e| format!("{text}: not a URL ({e})"))?;
        if url.scheme() != "http" {
            return Err(format!(
                "{text}: only http:// targets are supported; point the suite at a plain listener"
            ));
        }
        let host = url
            .host_str()
            .ok_or_else(|| format!("{text}: the URL names no host"))?;
        let port = url.port_or_known_default().unwrap_or(80);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let joined = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(Target {
            address: joined.clone(),
            authority: joined,
            base: url.path().trim_end_matches('/').to_owned(),
        })
    }
}

/// A request to send: `path` is below the target's base and may carry a query.
#[derive(Clone, Debug)]
pub struct Ask {
    /// The method.
    pub method: Method,
    /// The path, below the target's base, with any query.
    pub path: String,
    /// Its headers, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Its body (sent with its length).
    pub body: Bytes,
}

impl Ask {
    /// This request with `name: value` added (a second value of a name already there is a second line).
    pub fn header(mut self, name: &'static str, value: impl AsRef<[u8]>) -> Ask {
        let value = HeaderValue::from_bytes(value.as_ref()).unwrap_or(HeaderValue::from_static(""));
        self.headers.push((HeaderName::from_static(name), value));
        self
    }

    /// This request without any header named `name`.
    pub fn without(mut self, name: &str) -> Ask {
        self.headers.retain(|(n, _)| n.as_str() != name);
        self
    }

    /// This request with `name` set to `value` alone.
    pub fn set(self, name: &'static str, value: impl AsRef<[u8]>) -> Ask {
        self.without(name).header(name, value)
    }

    /// This request with another method.
    pub fn method(mut self, method: Method) -> Ask {
        self.method = method;
        self
    }

    /// This request with another body.
    pub fn body(mut self, body: impl Into<Bytes>) -> Ask {
        self.body = body.into();
        self
    }

    /// This request with `query` (without `?`) after its path.
    pub fn query(mut self, query: &str) -> Ask {
        let joiner = if self.path.contains('?') { '&' } else { '?' };
        self.path = format!("{}{joiner}{query}", self.path);
        self
    }

    /// The request as HTTP/1.1 bytes, with `method` spelled as given and header names as given.
    pub fn to_wire(&self, target: &Target, method: &str, names: &[(&str, &str)]) -> Vec<u8> {
        let mut wire = format!("{method} {}{} HTTP/1.1\r\n", target.base, self.path).into_bytes();
        wire.extend_from_slice(format!("Host: {}\r\n", target.authority).as_bytes());
        for (name, value) in &self.headers {
            let spelled = names
                .iter()
                .find(|(lower, _)| *lower == name.as_str())
                .map_or(name.as_str(), |(_, spelled)| spelled);
            wire.extend_from_slice(spelled.as_bytes());
            wire.extend_from_slice(b": ");
            wire.extend_from_slice(value.as_bytes());
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(
            format!("Content-Length: {}\r\nConnection: close\r\n\r\n", self.body.len()).as_bytes(),
        );
        wire.extend_from_slice(&self.body);
        wire
    }
}

/// What came back.
#[derive(Clone, Debug)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The response's headers.
    pub headers: HeaderMap,
    /// The body, as much as was read.
    pub body: Bytes,
    /// From sending the request to the end of the body.
    pub took: Duration,
}

impl Answer {
    /// The value of header `name`, if it is text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as JSON, if it is.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The counting service's execution number, from its body (or its `X-Execution` header).
    pub fn execution(&self) -> Option<u64> {
        self.json()
            .and_then(|j| j.get("execution").and_then(serde_json::Value::as_u64))
            .or_else(|| self.header("x-execution").and_then(|v| v.parse().ok()))
    }

    /// Whether the body is a problem document (RFC 9457).
    pub fn is_problem(&self) -> bool {
        self.header("content-type")
            .is_some_and(|t| t.to_ascii_lowercase().starts_with("application/problem+json"))
    }

    /// Whether this is the replay of a stored answer by the suite's own measure: the service's
    /// execution number says `first` ran it.
    pub fn is_from(&self, first: &Answer) -> bool {
        self.status == first.status && self.execution().is_some() && self.execution() == first.execution()
    }

    /// One line saying what this answer was: status, type, a replay mark, and the body's start.
    pub fn brief(&self) -> String {
        let mut text = format!("{}", self.status);
        if let Some(kind) = self.header("content-type") {
            text.push_str(&format!(" {kind}"));
        }
        if let Some(replayed) = self.header("idempotent-replayed") {
            text.push_str(&format!(" idempotent-replayed: {replayed}"));
        }
        let body = String::from_utf8_lossy(&self.body);
        let body: String = body.chars().take(160).collect();
        if !body.is_empty() {
            text.push_str(&format!(" {body}"));
        }
        if self.body.len() > 160 {
            text.push_str(&format!("… ({} bytes)", self.body.len()));
        }
        text
    }
}

/// How a response is read.
#[derive(Clone, Copy, Debug)]
pub enum Reading {
    /// At once, to its end.
    Whole,
    /// A frame at a time, pausing between frames.
    Slowly(Duration),
    /// Until this many body bytes have arrived; then the connection is dropped.
    LeaveAfter(usize),
}

/// Sends requests to one target.
#[derive(Clone, Debug)]
pub struct Client {
    /// Where requests go.
    pub target: Target,
    /// How long one request may take, from connecting to the end of its body.
    pub timeout: Duration,
}

impl Client {
    /// Sends `ask` over HTTP/1.1 on a new connection and reads the whole response.
    pub async fn send(&self, ask: &Ask) -> Result<Answer, String> {
        self.send_reading(ask, Reading::Whole).await
    }

    /// Sends `ask` over HTTP/1.1 on a new connection and reads the response as `reading` says; a
    /// response left early has the bytes read until then.
    pub async fn send_reading(&self, ask: &Ask, reading: Reading) -> Result<Answer, String> {
        let run = async {
            let stream = self.connect().await?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
            let driver = tokio::spawn(connection);
            let answer = self
                .exchange(ask, reading, false, |request| sender.send_request(request))
                .await;
            driver.abort();
            answer
        };
        self.bounded(run).await
    }

    /// Sends `ask` over HTTP/2 with prior knowledge (h2c) on a new connection.
    pub async fn send_h2(&self, ask: &Ask) -> Result<Answer, String> {
        let mut answers = self.send_h2_at_once(std::slice::from_ref(ask)).await?;
        answers.pop().ok_or_else(|| "no answer".to_owned())
    }

    /// Sends every one of `asks` at once, each on its own stream of one new HTTP/2 (h2c) connection.
    pub async fn send_h2_at_once(&self, asks: &[Ask]) -> Result<Vec<Answer>, String> {
        let run = async {
            let stream = self.connect().await?;
            let (sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await
                    .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
            let driver = tokio::spawn(connection);
            let mut streams = Vec::new();
            for ask in asks {
                let client = self.clone();
                let ask = ask.clone();
                let mut sender = sender.clone();
                streams.push(tokio::spawn(async move {
                    client
                        .exchange(&ask, Reading::Whole, true, |request| sender.send_request(request))
                        .await
                }));
            }
            let mut answers = Vec::new();
            for stream in streams {
                answers.push(stream.await.map_err(|e| e.to_string())??);
            }
            driver.abort();
            Ok(answers)
        };
        self.bounded(run).await
    }

    /// Sends `asks` one after another on one HTTP/1.1 connection kept alive.
    pub async fn send_on_one_connection(&self, asks: &[Ask]) -> Result<Vec<Answer>, String> {
        let run = async {
            let stream = self.connect().await?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("HTTP/1.1 handshake: {e}"))?;
            let driver = tokio::spawn(connection);
            let mut answers = Vec::new();
            for ask in asks {
                sender
                    .ready()
                    .await
                    .map_err(|e| format!("the connection was not kept alive: {e}"))?;
                let answer = self
                    .exchange(ask, Reading::Whole, false, |request| sender.send_request(request))
                    .await?;
                answers.push(answer);
            }
            driver.abort();
            Ok(answers)
        };
        self.bounded(run).await
    }

    /// Writes `wire` as it is on a new connection and reads until the server closes it (the request
    /// asks for `Connection: close`).
    pub async fn send_wire(&self, wire: &[u8]) -> Result<Answer, String> {
        let run = async {
            let started = Instant::now();
            let mut stream = self.connect().await?;
            stream
                .write_all(wire)
                .await
                .map_err(|e| format!("writing the request: {e}"))?;
            let mut read = Vec::new();
            let limit = u64::try_from(MAX_READ).unwrap_or(u64::MAX) + 1;
            (&mut stream)
                .take(limit)
                .read_to_end(&mut read)
                .await
                .map_err(|e| format!("reading the response: {e}"))?;
            if read.len() > MAX_READ {
                return Err(format!("the response is longer than {MAX_READ} bytes"));
            }
            parse_wire(&read, started.elapsed())
        };
        self.bounded(run).await
    }

    /// Writes `wire` (a whole request) on a new connection and closes it without reading an answer.
    pub async fn send_and_leave(&self, wire: &[u8]) -> Result<(), String> {
        let mut stream = self.connect().await?;
        stream
            .write_all(wire)
            .await
            .map_err(|e| format!("writing the request: {e}"))?;
        stream.flush().await.map_err(|e| e.to_string())?;
        // Long enough for the request to have left this host before the connection is closed.
        tokio::time::sleep(Duration::from_millis(100)).await;
        Ok(())
    }

    async fn connect(&self) -> Result<TcpStream, String> {
        let stream = TcpStream::connect(&self.target.address)
            .await
            .map_err(|e| format!("connecting to {}: {e}", self.target.address))?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    async fn bounded<T>(
        &self,
        run: impl std::future::Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        tokio::time::timeout(self.timeout, run)
            .await
            .unwrap_or_else(|_| Err(format!("no complete answer within {:?}", self.timeout)))
    }

    /// Sends one request with `send`, its target in absolute form for HTTP/2 (`:scheme` and
    /// `:authority`) and in origin form for HTTP/1.1, as browsers and client libraries send it.
    async fn exchange<F, Fut>(
        &self,
        ask: &Ask,
        reading: Reading,
        absolute: bool,
        send: F,
    ) -> Result<Answer, String>
    where
        F: FnOnce(Request<Full<Bytes>>) -> Fut,
        Fut: std::future::Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>>,
    {
        let started = Instant::now();
        let origin = format!("{}{}", self.target.base, ask.path);
        let uri = if absolute {
            format!("http://{}{origin}", self.target.authority)
        } else {
            origin
        };
        let mut request = Request::builder()
            .method(ask.method.clone())
            .uri(uri)
            .body(Full::new(ask.body.clone()))
            .map_err(|e| format!("building the request: {e}"))?;
        if !absolute {
            request.headers_mut().insert(
                HOST,
                HeaderValue::from_str(&self.target.authority).map_err(|e| e.to_string())?,
            );
        }
        for (name, value) in &ask.headers {
            request.headers_mut().append(name.clone(), value.clone());
        }
        if !ask.body.is_empty() && !request.headers().contains_key(CONTENT_TYPE) {
            request
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
        }
        let response = send(request)
            .await
            .map_err(|e| format!("sending the request: {e}"))?;
        let (head, mut body) = response.into_parts();
        let mut read = BytesMut::new();
        loop {
            let frame = match body.frame().await {
                None => break,
                Some(Ok(frame)) => frame,
                Some(Err(e)) => return Err(format!("reading the response body: {e}")),
            };
            if let Ok(data) = frame.into_data() {
                if read.len() + data.len() > MAX_READ {
                    return Err(format!("the response body is longer than {MAX_READ} bytes"));
                }
                read.extend_from_slice(&data);
            }
            match reading {
                Reading::Whole => {}
                Reading::Slowly(pause) => tokio::time::sleep(pause).await,
                Reading::LeaveAfter(bytes) if read.len() >= bytes => break,
                Reading::LeaveAfter(_) => {}
            }
        }
        Ok(Answer {
            status: head.status.as_u16(),
            headers: head.headers,
            body: read.freeze(),
            took: started.elapsed(),
        })
    }
}

/// An HTTP/1.1 response read to the connection's end: its head, and its body (chunks joined).
fn parse_wire(read: &[u8], took: Duration) -> Result<Answer, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut response = httparse::Response::new(&mut headers);
    let head_len = match response.parse(read) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return Err(format!(
                "the connection closed after {} bytes, before a whole response head",
                read.len()
            ));
        }
        Err(e) => return Err(format!("the response head does not parse: {e}")),
    };
    let mut map = HeaderMap::new();
    for header in response.headers.iter() {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(header.name.as_bytes()),
            HeaderValue::from_bytes(header.value),
        ) {
            map.append(name, value);
        }
    }
    let raw = &read[head_len..];
    let chunked = map
        .get("transfer-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked { dechunk(raw) } else { raw.to_vec() };
    Ok(Answer {
        status: response.code.unwrap_or(0),
        headers: map,
        body: Bytes::from(body),
        took,
    })
}

/// The data of a chunked body (what arrived of it), without its sizes and trailers.
fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = raw.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&raw[..line_end]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_text, 16) else {
            break;
        };
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        let end = (start + size).min(raw.len());
        out.extend_from_slice(&raw[start..end]);
        raw = raw.get(end + 2..).unwrap_or(&[]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_a_plain_http_url_with_an_optional_base_path() {
        let target = Target::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            (target.address.as_str(), target.base.as_str()),
            ("127.0.0.1:8080", "")
        );
        let target = Target::parse("http://localhost/api/").unwrap();
        assert_eq!(
            (target.address.as_str(), target.base.as_str()),
            ("localhost:80", "/api")
        );
        let target = Target::parse("http://[::1]:9000").unwrap();
        assert_eq!(target.address, "[::1]:9000");
        assert!(
            Target::parse("https://example.com")
                .unwrap_err()
                .contains("http://")
        );
        assert!(Target::parse("not a url").is_err());
    }

    #[test]
    fn a_response_read_off_the_wire_has_its_chunks_joined() {
        let wire = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nX-Execution: 1\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n";
        let answer = parse_wire(wire, Duration::ZERO).unwrap();
        assert_eq!(answer.status, 201);
        assert_eq!(&answer.body[..], b"abcde");
        assert_eq!(answer.execution(), Some(1));
        assert!(parse_wire(b"HTTP/1.1 20", Duration::ZERO).is_err());
    }

    #[test]
    fn a_request_on_the_wire_keeps_the_spelling_it_is_given() {
        let target = Target::parse("http://127.0.0.1:1/base").unwrap();
        let ask = Ask {
            method: Method::POST,
            path: "/c/x".into(),
            headers: vec![(
                HeaderName::from_static("idempotency-key"),
                HeaderValue::from_static("k"),
            )],
            body: Bytes::from_static(b"{}"),
        };
        let wire = ask.to_wire(&target, "post", &[("idempotency-key", "IDEMPOTENCY-KEY")]);
        let text = String::from_utf8(wire).unwrap();
        assert!(text.starts_with("post /base/c/x HTTP/1.1\r\n"), "{text}");
        assert!(text.contains("IDEMPOTENCY-KEY: k\r\n"), "{text}");
        assert!(
            text.ends_with("Content-Length: 2\r\nConnection: close\r\n\r\n{}"),
            "{text}"
        );
    }
}
