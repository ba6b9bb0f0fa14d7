//! Raw HTTP/1.1 on a plain socket, for request shapes a client library refuses to send: the test writes
//! the exact bytes and reads back whatever comes, including nothing at all.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A raw HTTP/1.1 request head: `request_line` (`POST /orders`), `host`, the test credential (so keyed
/// requests are scoped), then `headers`.
pub fn head(request_line: &str, host: &str, headers: &[&str]) -> String {
    let credential = super::http::TEST_CREDENTIAL;
    let mut text = format!("{request_line} HTTP/1.1\r\nhost: {host}\r\nauthorization: {credential}\r\n");
    for header in headers {
        text.push_str(header);
        text.push_str("\r\n");
    }
    text.push_str("\r\n");
    text
}

/// Bound on waiting for the proxy to answer or close.
const READ_BOUND: Duration = Duration::from_secs(30);

/// What came back on a raw connection.
#[derive(Debug)]
pub struct RawReply {
    /// The status of the first response, `None` when the connection closed without one.
    pub status: Option<u16>,
    /// The response head, lower-cased header names kept as sent.
    pub head: String,
    /// The response body (by its content-length), or whatever followed the head before the close.
    pub body: Vec<u8>,
}

impl RawReply {
    /// The value of header `name` (case-insensitive) in the head.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    /// Asserts a problem+json answer with `status` and the stable type slug.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, Some(status), "reply: {self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let problem: serde_json::Value =
            serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"));
        assert_eq!(
            problem["type"],
            format!("https://idemproxy.dev/problems/{slug}").as_str()
        );
    }
}

/// `host:port` of an `http://` base URL.
pub fn addr_of(base: &str) -> &str {
    base.strip_prefix("http://").expect("http base URL")
}

/// A fresh connection to the proxy.
pub async fn connect(base: &str) -> TcpStream {
    TcpStream::connect(addr_of(base)).await.expect("connect to proxy")
}

/// Writes `bytes` on a fresh connection and reads the answer.
pub async fn exchange(base: &str, bytes: &[u8]) -> RawReply {
    let mut stream = connect(base).await;
    stream.write_all(bytes).await.expect("write the request");
    read_reply(&mut stream).await
}

/// Reads one response (head, then a body by content-length), or up to the close when there is none.
pub async fn read_reply(stream: &mut TcpStream) -> RawReply {
    tokio::time::timeout(READ_BOUND, read_reply_unbounded(stream))
        .await
        .unwrap_or_else(|_| panic!("no answer and no close within {READ_BOUND:?}"))
}

async fn read_reply_unbounded(stream: &mut TcpStream) -> RawReply {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(reply) = complete_reply(&buffer) {
            return reply;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
    let Some(end) = find(&buffer, b"\r\n\r\n") else {
        return RawReply {
            status: None,
            head: String::from_utf8_lossy(&buffer).into_owned(),
            body: Vec::new(),
        };
    };
    let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
    RawReply {
        status: status_of(&head),
        head,
        body: buffer[end + 4..].to_vec(),
    }
}

fn complete_reply(buffer: &[u8]) -> Option<RawReply> {
    let end = find(buffer, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
    let mut reply = RawReply {
        status: status_of(&head),
        head,
        body: Vec::new(),
    };
    let length: usize = reply.header("content-length")?.parse().ok()?;
    let body = buffer.get(end + 4..end + 4 + length)?;
    reply.body = body.to_vec();
    Some(reply)
}

fn status_of(head: &str) -> Option<u16> {
    head.split(' ').nth(1)?.parse().ok()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
