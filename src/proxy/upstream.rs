//! Runs once a request is cleared to reach the upstream (passthrough, a won claim, or fail_open): builds the
//! upstream request with clean headers, sends it over the worker's pool (`upstream/pool.rs`) under the
//! configured timeouts, and classifies failures by whether the upstream may have received the request.

mod connect;
mod multiplex;
pub mod pool;
mod send_error;

use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version, request};

use http_body::Body as _;
use http_body_util::BodyExt;
use tracing::Instrument;

use self::pool::{Pool, PooledBody, SendError};
use super::budget::ReservedBody;
use super::downstream::Downstream;
use crate::body::{BoxError, ProxyBody, Resendable};
use crate::config::UpstreamConfig;
use crate::error::{Busy, ProxyError};
use crate::headers::ATTEMPT_HEADER;
use crate::metrics::Metrics;
use crate::otlp;

/// Hop-by-hop headers (RFC 9110 §7.6.1): meaningful for one connection only, never forwarded or stored.
/// `Trailer` is not one: it names the trailer fields to come, and an HTTP/1.1 hop sends only those.
const HOP_BY_HOP: [HeaderName; 5] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Why the upstream did not give us a response head.
#[derive(Debug)]
pub enum UpstreamFailure {
    /// The connection could not be made: the upstream certainly never saw the request.
    NotDelivered(String),
    /// The request may have reached the upstream (reset, broken connection after sending).
    Ambiguous(String),
    /// No response head within `upstream.timeout`; the request may have reached the upstream.
    Timeout(Duration),
    /// Every connection of the worker's `upstream.max_connections` stayed busy for
    /// `upstream.connect_timeout`: the request was never sent.
    Busy,
}

impl UpstreamFailure {
    /// Whether the upstream certainly never saw the request, so its claim can be given back at once.
    pub fn never_delivered(&self) -> bool {
        matches!(self, UpstreamFailure::NotDelivered(_) | UpstreamFailure::Busy)
    }

    /// A fixed word for the failure, for its trace span.
    pub fn kind(&self) -> &'static str {
        match self {
            UpstreamFailure::NotDelivered(_) => "not_delivered",
            UpstreamFailure::Ambiguous(_) => "broken",
            UpstreamFailure::Timeout(_) => "timeout",
            UpstreamFailure::Busy => "busy",
        }
    }

    /// The client-facing error.
    pub fn into_error(self) -> ProxyError {
        match self {
            UpstreamFailure::NotDelivered(why) => ProxyError::UpstreamUnreachable(why),
            UpstreamFailure::Ambiguous(why) => ProxyError::UpstreamBroken(why),
            UpstreamFailure::Timeout(after) => ProxyError::UpstreamTimeout(after),
            UpstreamFailure::Busy => ProxyError::Busy(Busy::UpstreamConnections),
        }
    }
}

/// The client to the upstream, over a pool of keep-alive HTTP/1.1 connections or multiplexed HTTP/2 ones.
#[derive(Clone)]
pub struct Upstream {
    pool: Pool,
    base: Uri,
    timeout: Duration,
    metrics: Metrics,
    /// Whether each call gets a span and carries it as the request's `traceparent` (`otlp.rs`).
    traced: bool,
}

impl Upstream {
    /// A client with keep-alive pooling and the configured connect timeout.
    pub fn new(config: &UpstreamConfig, metrics: Metrics) -> Upstream {
        Upstream {
            pool: Pool::new(
                config.address.clone(),
                config.protocol,
                config.connect_timeout,
                config.idle_timeout,
                config.max_connections,
                config.max_concurrent_streams,
            ),
            base: config.base.clone(),
            timeout: config.timeout,
            metrics,
            traced: false,
        }
    }

    /// The same client, tracing its calls or not.
    pub fn traced(self, traced: bool) -> Upstream {
        Upstream { traced, ..self }
    }

    /// The same client over a pool of its own, for a worker whose requests should not share
    /// connections with other threads.
    pub fn with_own_pool(&self) -> Upstream {
        Upstream {
            pool: self.pool.empty_copy(),
            ..self.clone()
        }
    }

    /// The bound on waiting for a response head and between body chunks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Builds the upstream request: same method, path and query; hop-by-hop headers removed;
    /// `X-Forwarded-*` set; the host the client named kept (the target's authority before `Host`); the body's own length as `Content-Length`.
    pub fn request(&self, parts: request::Parts, body: ProxyBody, peer: &Downstream) -> Request<ProxyBody> {
        let request::Parts {
            method,
            uri,
            mut headers,
            ..
        } = parts;
        // The proxy relays trailers, so a client that accepts them (gRPC's always do) says so upstream
        // too; `TE`'s other codings are for this hop only.
        let trailers = accepts_trailers(&headers);
        // The proxy has answered any 100-continue itself by reading the body.
        // Nor does a client tell the upstream which attempt this is: only the proxy knows.
        strip_hop_by_hop_and(&mut headers, |name| {
            name == header::EXPECT || name == ATTEMPT_HEADER
        });
        if trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        set_length(&mut headers, &body);
        // HTTP/2 (`:authority`) and absolute-form requests name the host in the target, and that names
        // it over any `Host` header (RFC 9112 §3.2.2, RFC 9113 §8.3.1); otherwise the `Host` header; with
        // neither, the upstream's own authority.
        // Without its userinfo (`user:pw@`), which names no host and is never forwarded (RFC 9110 §4.2.4).
        let named = uri.authority().and_then(|a| {
            let host = a.as_str().rsplit('@').next().unwrap_or_default();
            HeaderValue::from_str(host).ok()
        });
        let host = match named {
            Some(named) => {
                headers.insert(header::HOST, named.clone());
                Some(named)
            }
            None => {
                let sent = headers.get(header::HOST).cloned();
                if sent.is_none()
                    && let Some(upstream_host) = self.base_host()
                {
                    headers.insert(header::HOST, upstream_host);
                }
                sent
            }
        };
        peer.set_forwarded(&mut headers, host);
        // A request without a body can be sent again as it is, should an HTTP/2 upstream refuse it.
        let resendable = self.pool.may_use_h2() && body.is_end_stream();
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = origin_form(uri);
        *request.version_mut() = Version::HTTP_11;
        *request.headers_mut() = headers;
        if resendable {
            request.extensions_mut().insert(Resendable::empty());
        }
        request
    }

    /// [`Upstream::request`] for a body read whole. When the request may go over HTTP/2 it carries a copy
    /// of the body (its bytes shared, not copied), so that a stream the upstream refuses unprocessed is
    /// sent again (`multiplex.rs`).
    pub fn request_whole(
        &self,
        parts: request::Parts,
        body: ReservedBody,
        peer: &Downstream,
    ) -> Request<ProxyBody> {
        if !self.pool.may_use_h2() {
            return self.request(parts, body.into_body(), peer);
        }
        let (body, again) = body.into_resendable();
        let mut request = self.request(parts, body, peer);
        request.extensions_mut().insert(again);
        request
    }

    /// The upstream's own authority, as the `Host` of a request that came without one.
    fn base_host(&self) -> Option<HeaderValue> {
        let authority = self.base.authority()?;
        HeaderValue::from_str(authority.as_str()).ok()
    }

    /// Sends the request and waits for the response head within `upstream.timeout`. Traced, the call is
    /// a span of its own, which the upstream gets as the parent in its `traceparent`.
    pub async fn send(
        &self,
        mut request: Request<ProxyBody>,
    ) -> Result<Response<PooledBody>, UpstreamFailure> {
        let span = otlp::upstream(self.traced, &mut request);
        let started = std::time::Instant::now();
        // A gRPC client's own deadline is the service's to enforce (it gets `grpc-timeout`) and the
        // client's to keep: a passthrough call ends when its client gives up, and a keyed one goes on
        // to be stored (`proxy.rs`).
        let timeout = self.timeout;
        let sending = tokio::time::timeout(timeout, self.pool.send(request));
        let result = if span.is_none() {
            sending.await
        } else {
            sending.instrument(span.clone()).await
        };
        let elapsed = started.elapsed();
        self.metrics.upstream_duration.observe(elapsed.as_secs_f64());
        crate::access::upstream(elapsed);
        let result = match result {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(SendError::NotSent(why))) => Err(UpstreamFailure::NotDelivered(why)),
            Ok(Err(SendError::Failed(why))) => Err(UpstreamFailure::Ambiguous(why)),
            Ok(Err(SendError::Busy)) => Err(UpstreamFailure::Busy),
            Err(_) => Err(UpstreamFailure::Timeout(timeout)),
        };
        match &result {
            Ok(response) => otlp::upstream_answered(&span, response.status()),
            Err(failure) => otlp::failed(&span, failure.kind()),
        }
        result
    }
}

/// An upstream response passed through as it streams, without capture.
pub fn stream_response(response: Response<PooledBody>) -> Response<ProxyBody> {
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(BoxError::from).boxed())
}

/// Removes hop-by-hop headers, including every header the `Connection` header names. Runs twice per
/// request, so the usual case (nothing or only `Connection` to remove) costs a scan of the names and
/// no allocation.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    strip_hop_by_hop_and(headers, |_| false);
}

/// [`strip_hop_by_hop`], and every header `also` picks out.
fn strip_hop_by_hop_and(headers: &mut HeaderMap, also: impl Fn(&HeaderName) -> bool) {
    let doomed = |name: &HeaderName| is_hop_by_hop(name) || also(name);
    // Most heads have nothing to remove, or only `Connection` (a keep-alive upstream's responses): one
    // scan of the names tells which, without a lookup.
    let mut found = headers.keys().filter(|name| doomed(name));
    let Some(first) = found.next() else { return };
    let only_connection = first == header::CONNECTION && found.next().is_none();
    let mut named = Vec::new();
    for value in headers.get_all(header::CONNECTION) {
        let Ok(value) = value.to_str() else { continue };
        for option in value.split(',').map(str::trim) {
            // Names are stored in lowercase; an option no header has needs no removal.
            if let Some(name) = headers
                .keys()
                .find(|name| name.as_str().eq_ignore_ascii_case(option))
            {
                named.push(name.clone());
            }
        }
    }
    for name in named {
        headers.remove(name);
    }
    if only_connection {
        headers.remove(header::CONNECTION);
        return;
    }
    while let Some(name) = headers.keys().find(|name| doomed(name)).cloned() {
        headers.remove(name);
    }
}

/// The request target in origin form: the client's path and query. A target already in that form (as
/// HTTP/1.1 requests send it) goes as it came.
fn origin_form(uri: Uri) -> Uri {
    if uri.scheme().is_none() && uri.authority().is_none() {
        return uri;
    }
    // An empty path (`http://host?q`) is `/` in origin form (RFC 9112 §3.2.1).
    let target = match (uri.path(), uri.query()) {
        ("", None) => return Uri::from_static("/"),
        ("", Some(query)) => format!("/?{query}"),
        _ => {
            return Uri::from(
                uri.path_and_query()
                    .cloned()
                    .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
            );
        }
    };
    Uri::try_from(target).unwrap_or_else(|_| Uri::from_static("/"))
}

/// Whether the client's `TE` lists `trailers` (RFC 9110 §10.1.4).
fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers.get_all(header::TE).iter().any(|value| {
        value.to_str().is_ok_and(|value| {
            value.split(',').any(|coding| {
                coding
                    .split(';')
                    .next()
                    .is_some_and(|c| c.trim().eq_ignore_ascii_case("trailers"))
            })
        })
    })
}

/// Whether `name` is hop-by-hop of itself (not counting what a `Connection` header names).
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name) || name.as_str().starts_with("proxy-")
}

/// `Content-Length` from the body when it knows its length (a body read whole, or a client's body whose
/// length its head declared): hyper's client would frame the request by a client's header it finds,
/// whatever the body holds. A body of no bytes gets one only if the client sent one.
fn set_length(headers: &mut HeaderMap, body: &ProxyBody) {
    match body.size_hint().exact() {
        Some(0) if !headers.contains_key(header::CONTENT_LENGTH) => {}
        Some(length) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::downstream::{Peer, X_FORWARDED_FOR, X_FORWARDED_HOST, X_FORWARDED_PROTO};

    /// The names left after stripping a head of these header lines, in order.
    fn left_after_stripping(lines: &[(&'static str, &'static str)]) -> Vec<String> {
        let mut headers = HeaderMap::new();
        for &(name, value) in lines {
            headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        strip_hop_by_hop(&mut headers);
        headers.keys().map(|name| name.as_str().to_owned()).collect()
    }

    #[test]
    fn hop_by_hop_headers_and_connection_named_ones_are_removed() {
        let left = left_after_stripping(&[
            ("connection", "keep-alive, x-secret"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("transfer-encoding", "chunked"),
            ("proxy-authorization", "Basic x"),
            ("content-type", "text/plain"),
        ]);
        assert_eq!(left, vec!["content-type"]);
    }

    #[test]
    fn connection_options_match_header_names_in_any_case_and_need_not_exist() {
        let left = left_after_stripping(&[
            ("connection", "close, X-Secret, x-absent"),
            ("connection", "X-Other"),
            ("x-secret", "1"),
            ("x-other", "2"),
            ("proxy-connection", "keep-alive"),
            ("proxy-authorization", "Basic x"),
            ("accept", "*/*"),
        ]);
        assert_eq!(left, vec!["accept"]);
    }

    #[test]
    fn a_lone_connection_header_goes_with_the_headers_it_names_and_nothing_else() {
        let left = left_after_stripping(&[
            ("server", "nginx"),
            ("connection", "keep-alive, X-Secret"),
            ("x-secret", "1"),
            ("content-length", "2"),
        ]);
        assert_eq!(left, vec!["server", "content-length"]);
        let left =
            left_after_stripping(&[("connection", "close"), ("date", "Sat, 21 Nov 2026 12:00:00 GMT")]);
        assert_eq!(left, vec!["date"]);
    }

    fn upstream(base: &str) -> Upstream {
        let base: Uri = base.parse().unwrap();
        let config = UpstreamConfig {
            address: crate::config::UpstreamAddress::Http {
                authority: base.authority().unwrap().to_string(),
            },
            base,
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            max_connections: 16,
            max_concurrent_streams: 100,
            idle_timeout: Duration::from_secs(1),
            protocol: crate::config::UpstreamProtocol::Http1,
        };
        Upstream::new(&config, Metrics::new())
    }

    fn parts(request: http::request::Builder) -> request::Parts {
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_upstream_request_keeps_the_client_host_and_drops_expect_and_hop_by_hop_headers() {
        let client = parts(
            Request::post("/pay?x=1")
                .header(header::HOST, "api.example")
                .header(header::EXPECT, "100-continue")
                .header(header::TRANSFER_ENCODING, "chunked")
                .header(header::CONTENT_TYPE, "application/json"),
        );
        let peer = Downstream::new(Peer::Tcp("10.1.2.3:5000".parse().unwrap()), false, 1, None);
        let request = upstream("http://127.0.0.1:9").request(client, crate::body::empty(), &peer);
        assert_eq!(request.method(), http::Method::POST);
        assert_eq!(request.uri(), "/pay?x=1");
        let headers = request.headers();
        assert_eq!(headers[header::HOST], "api.example");
        assert_eq!(headers[&X_FORWARDED_HOST], "api.example");
        assert_eq!(headers[&X_FORWARDED_FOR], "10.1.2.3");
        assert_eq!(headers[header::CONTENT_TYPE], "application/json");
        assert!(headers.get(header::EXPECT).is_none());
        assert!(headers.get(header::TRANSFER_ENCODING).is_none());
    }

    #[test]
    fn an_absolute_form_target_names_the_host_over_the_host_header() {
        let client =
            parts(Request::post("http://other.example:8443/pay?x=1").header(header::HOST, "api.example"));
        let peer = Downstream::new(Peer::Tcp("10.1.2.3:5000".parse().unwrap()), false, 1, None);
        let request = upstream("http://127.0.0.1:9").request(client, crate::body::empty(), &peer);
        assert_eq!(request.uri(), "/pay?x=1", "sent in origin form");
        assert_eq!(request.headers()[header::HOST], "other.example:8443");
        assert_eq!(request.headers()[&X_FORWARDED_HOST], "other.example:8443");
        assert_eq!(request.headers().get_all(header::HOST).iter().count(), 1);
        let client = parts(Request::post("http://user:pw@other.example?z=1"));
        let request = upstream("http://127.0.0.1:9").request(client, crate::body::empty(), &peer);
        assert_eq!(request.uri(), "/?z=1", "an empty path is / in origin form");
        assert_eq!(
            request.headers()[header::HOST],
            "other.example",
            "userinfo is never forwarded"
        );
    }

    #[test]
    fn te_goes_upstream_as_trailers_only_when_the_client_accepts_trailers() {
        let peer = Downstream::new(Peer::Tcp("10.1.2.3:5000".parse().unwrap()), false, 1, None);
        let te = |value: Option<&'static str>| {
            let mut client = Request::post("/pay");
            if let Some(value) = value {
                client = client.header(header::TE, value);
            }
            let request = upstream("http://127.0.0.1:9").request(parts(client), crate::body::empty(), &peer);
            request
                .headers()
                .get(header::TE)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(te(Some("trailers")).as_deref(), Some("trailers"));
        assert_eq!(te(Some("gzip;q=0.5, Trailers")).as_deref(), Some("trailers"));
        assert_eq!(
            te(Some("gzip, deflate")),
            None,
            "other codings are for this hop only"
        );
        assert_eq!(te(None), None);
    }

    #[test]
    fn the_upstream_is_told_the_body_s_own_length_whatever_the_client_declared() {
        let peer = Downstream::new(Peer::Tcp("10.1.2.3:5000".parse().unwrap()), false, 1, None);
        let length = |request: http::request::Builder, body: &'static [u8]| {
            let upstream = upstream("http://127.0.0.1:9");
            let request = upstream.request(parts(request), crate::body::full(body), &peer);
            request.headers().get(header::CONTENT_LENGTH).cloned()
        };
        let declared = Request::post("/pay").header(header::CONTENT_LENGTH, "10");
        assert_eq!(length(declared, b"12345").unwrap(), "5");
        assert_eq!(length(Request::post("/pay"), b"12345").unwrap(), "5");
        assert_eq!(length(Request::get("/pay"), b""), None, "no body, no length");
        let empty = Request::post("/pay").header(header::CONTENT_LENGTH, "0");
        assert_eq!(length(empty, b"").unwrap(), "0");
    }

    #[test]
    fn without_a_host_header_the_target_authority_or_else_the_upstream_is_the_host() {
        let peer = Downstream::new(Peer::Tcp("[::1]:5000".parse().unwrap()), true, 1, None);
        let http2 = parts(Request::get("https://api.example:8443/a"));
        let request = upstream("http://10.0.0.9:8080").request(http2, crate::body::empty(), &peer);
        assert_eq!(request.uri(), "/a");
        assert_eq!(request.headers()[header::HOST], "api.example:8443");
        assert_eq!(request.headers()[&X_FORWARDED_HOST], "api.example:8443");
        assert_eq!(request.headers()[&X_FORWARDED_FOR], "::1");
        assert_eq!(request.headers()[&X_FORWARDED_PROTO], "https");
        let bare = parts(Request::get("/a"));
        let request = upstream("http://10.0.0.9:8080").request(bare, crate::body::empty(), &peer);
        assert_eq!(request.headers()[header::HOST], "10.0.0.9:8080");
        assert!(request.headers().get(&X_FORWARDED_HOST).is_none());
    }
}
