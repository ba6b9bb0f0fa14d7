//! HTTP helpers: a client, a fully read reply, raw requests, and the admin `/metrics` reader.

use std::time::Duration;

use bytes::Bytes;
use reqwest::{RequestBuilder, StatusCode, header::HeaderMap};
use tokio::{io::AsyncWriteExt, net::TcpStream};

/// Bound on any one request a test sends.
const REQUEST_BOUND: Duration = Duration::from_secs(60);

/// A client that does not pool connections, so every request opens its own.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(REQUEST_BOUND)
        .build()
        .expect("build the HTTP client")
}

/// A response read to the end.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// Sends the request and reads the whole response.
    pub async fn of(request: RequestBuilder) -> Reply {
        Reply::try_of(request)
            .await
            .expect("send the request and read the response")
    }

    /// Sends the request and reads the whole response, or says why that failed.
    pub async fn try_of(request: RequestBuilder) -> Result<Reply, reqwest::Error> {
        let response = request.send().await?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await?;
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ASCII header"))
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Whether this is the proxy's replay of a stored response.
    pub fn is_replay(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts an RFC 9457 problem with `status` and the type `https://idemproxy.dev/problems/<slug>`.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "status; body: {}", self.text());
        let content_type = self.header("content-type").unwrap_or("");
        assert!(
            content_type.starts_with("application/problem+json"),
            "content-type {content_type:?}"
        );
        let problem = self.json();
        let expected = format!("https://idemproxy.dev/problems/{slug}");
        assert_eq!(problem["type"], expected.as_str(), "problem: {problem}");
        assert_eq!(problem["status"], status, "problem: {problem}");
        assert!(problem["title"].is_string(), "problem: {problem}");
        // The members every problem carries for a client to act on (docs/contract.md, Problem types).
        let state = problem["operation_state"].as_str().unwrap_or_default();
        assert!(
            ["not_started", "in_progress", "completed", "unknown"].contains(&state),
            "operation_state; problem: {problem}"
        );
        assert!(problem["retryable"].is_boolean(), "retryable; problem: {problem}");
        let safe_new_key = problem.get("safe_new_key");
        match state {
            "not_started" => assert_eq!(safe_new_key, Some(&true.into()), "problem: {problem}"),
            _ => assert_eq!(safe_new_key, None, "problem: {problem}"),
        }
        assert_eq!(
            self.header("cache-control"),
            Some("no-store"),
            "problem: {problem}"
        );
    }

    /// The `Retry-After` header as whole seconds.
    pub fn retry_after(&self) -> u64 {
        let value = self.header("retry-after").expect("Retry-After header");
        value
            .parse()
            .unwrap_or_else(|_| panic!("Retry-After {value:?} is not whole seconds"))
    }
}

/// Sends a fresh request from `make` until the answer is not 409, and returns that answer: for a retry
/// sent while the original may still be running (a client that has its whole response gets the replay
/// at once; see `guarantees::full_response`).
pub async fn settled(make: impl Fn() -> RequestBuilder) -> Reply {
    super::poll_until("an answer other than 409", || async {
        let reply = Reply::of(make()).await;
        (reply.status != 409).then_some(reply)
    })
    .await
}

/// The credential test clients send by default: a keyed request without one is refused
/// (`idempotency.unscoped = "reject"`).
pub const TEST_CREDENTIAL: &str = "Bearer test-client";

/// `POST {base}{path}` with `Idempotency-Key: {key}`, the test credential and a JSON body.
pub fn keyed_post(base: &str, path: &str, key: &str, body: &str) -> RequestBuilder {
    client()
        .post(format!("{base}{path}"))
        .header("idempotency-key", key)
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Starts a keyed `POST /stream` and reads its first chunk, which the stub sends before waiting on its
/// gate; returns the response with the rest still to come.
pub async fn stream_until_first_chunk(base: &str, key: &str) -> reqwest::Response {
    let mut response = keyed_post(base, "/stream", key, "{}").send().await.expect("send");
    assert_eq!(response.status(), 200);
    let first = tokio::time::timeout(REQUEST_BOUND, response.chunk())
        .await
        .expect("first chunk must arrive while the upstream is still held")
        .expect("read first chunk")
        .expect("a first chunk");
    assert_eq!(&first[..], crate::support::upstream::FIRST_CHUNK);
    response
}

/// Writes `POST {path}` with `key` and `body` on a fresh connection to the proxy and returns the
/// connection without reading anything, so the test decides when the client goes away.
pub async fn raw_keyed_post(base: &str, path: &str, key: &str, body: &str) -> TcpStream {
    raw_keyed_post_with(base, path, key, body, "").await
}

/// [`raw_keyed_post`] of a request held on the stub upstream's gate `gate` (`x-gate`).
pub async fn raw_keyed_post_to(base: &str, path: &str, key: &str, body: &str, gate: &str) -> TcpStream {
    raw_keyed_post_with(base, path, key, body, &format!("x-gate: {gate}\r\n")).await
}

async fn raw_keyed_post_with(base: &str, path: &str, key: &str, body: &str, extra: &str) -> TcpStream {
    let addr = base.strip_prefix("http://").expect("http base URL");
    let mut stream = TcpStream::connect(addr).await.expect("connect to proxy");
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: {key}\r\n\
         authorization: {TEST_CREDENTIAL}\r\ncontent-type: application/json\r\n{extra}\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("write the request");
    stream
}

/// `GET {admin_url}/readyz`, read to the end.
pub async fn readyz(admin_url: &str) -> Reply {
    Reply::of(client().get(format!("{admin_url}/readyz"))).await
}

/// The value of the counter `name` whose labels include `labels`, summed over any other labels;
/// 0 when no such sample is exported yet. Panics when `name` is not exported at all (a misspelling).
pub async fn metric(admin_url: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = Reply::of(client().get(format!("{admin_url}/metrics")))
        .await
        .text();
    assert!(text.contains(name), "metric {name} is not exported:\n{text}");
    samples(&text)
        .filter(|sample| sample.name == name)
        .filter(|sample| labels.iter().all(|l| sample.labels.contains(&(l.0, l.1))))
        .map(|sample| sample.value)
        .sum()
}

struct Sample<'a> {
    name: &'a str,
    labels: Vec<(&'a str, &'a str)>,
    value: f64,
}

/// Samples of the Prometheus text format, simply parsed: label values hold no `,` or `"`.
fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)),
                None => (series, Vec::new()),
            };
            Some(Sample {
                name,
                labels,
                value: value.parse().ok()?,
            })
        })
}

fn parse_labels(text: &str) -> Vec<(&str, &str)> {
    text.split(',')
        .filter_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            Some((name.trim(), value.trim().trim_matches('"')))
        })
        .collect()
}
