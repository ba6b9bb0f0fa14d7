//! Runs once a request is cleared to reach the upstream (passthrough, a won claim, or fail_open): builds the
//! upstream request with clean headers, sends it under the configured timeouts, and classifies failures by
//! whether the upstream may have received the request. Also owns the claim's heartbeat.

use std::net::SocketAddr;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version, request};
use tokio_util::sync::CancellationToken;

use http_body_util::BodyExt;

use super::body::{BoxError, ProxyBody};
use super::pool::{Pool, PooledBody, SendError};
use crate::config::UpstreamConfig;
use crate::error::ProxyError;
use crate::metrics::Metrics;
use crate::store::{RecordId, StoreHandle};

/// Hop-by-hop headers (RFC 9110 §7.6.1): meaningful for one connection only, never forwarded or stored.
const HOP_BY_HOP: [HeaderName; 6] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The client side of a connection, as far as the upstream is told about it.
#[derive(Debug, Clone, Copy)]
pub struct Downstream {
    /// The client's address.
    pub addr: SocketAddr,
    /// Whether the client connected over TLS.
    pub tls: bool,
}

/// Why the upstream did not give us a response head.
#[derive(Debug)]
pub enum UpstreamFailure {
    /// The connection could not be made: the upstream certainly never saw the request.
    NotDelivered(String),
    /// The request may have reached the upstream (reset, broken connection after sending).
    Ambiguous(String),
    /// No response head within `upstream.timeout`; the request may have reached the upstream.
    Timeout(Duration),
}

impl UpstreamFailure {
    /// The client-facing error.
    pub fn into_error(self) -> ProxyError {
        match self {
            UpstreamFailure::NotDelivered(why) | UpstreamFailure::Ambiguous(why) => {
                ProxyError::UpstreamUnreachable(why)
            }
            UpstreamFailure::Timeout(after) => ProxyError::UpstreamTimeout(after),
        }
    }
}

/// How long an upstream connection may stay idle in the pool before it is closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The HTTP/1.1 client to the upstream, over a pool of keep-alive connections.
#[derive(Clone)]
pub struct Upstream {
    pool: Pool,
    base: Uri,
    timeout: Duration,
    metrics: Metrics,
}

impl Upstream {
    /// A client with keep-alive pooling and the configured connect timeout.
    pub fn new(config: &UpstreamConfig, metrics: Metrics) -> Upstream {
        let base = &config.base;
        let host = base.host().unwrap_or("localhost");
        let authority = format!("{host}:{}", base.port_u16().unwrap_or(80));
        Upstream {
            pool: Pool::new(authority, config.connect_timeout, POOL_IDLE_TIMEOUT),
            base: base.clone(),
            timeout: config.timeout,
            metrics,
        }
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
    /// `X-Forwarded-*` set; the client's `Host` kept.
    pub fn request(&self, parts: &request::Parts, body: ProxyBody, peer: Downstream) -> Request<ProxyBody> {
        let mut headers = parts.headers.clone();
        strip_hop_by_hop(&mut headers);
        // The proxy has answered any 100-continue itself by reading the body.
        headers.remove(header::EXPECT);
        let host = original_host(parts);
        let upstream_host = host.clone().or_else(|| self.base_host());
        if let Some(upstream_host) = upstream_host {
            headers.insert(header::HOST, upstream_host);
        }
        set_forwarded(&mut headers, peer, host);
        let mut request = Request::new(body);
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = self.uri_for(&parts.uri);
        *request.version_mut() = Version::HTTP_11;
        *request.headers_mut() = headers;
        request
    }

    /// The request target in origin form: the client's path and query.
    fn uri_for(&self, uri: &Uri) -> Uri {
        let path = uri.path_and_query().cloned();
        Uri::from(path.unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")))
    }

    /// The upstream's own authority, as the `Host` of a request that came without one.
    fn base_host(&self) -> Option<HeaderValue> {
        let authority = self.base.authority()?;
        HeaderValue::from_str(authority.as_str()).ok()
    }

    /// Sends the request and waits for the response head within `upstream.timeout`.
    pub async fn send(&self, request: Request<ProxyBody>) -> Result<Response<PooledBody>, UpstreamFailure> {
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(self.timeout, self.pool.send(request)).await;
        self.metrics
            .upstream_duration
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(SendError::NotSent(why))) => Err(UpstreamFailure::NotDelivered(why)),
            Ok(Err(SendError::Failed(why))) => Err(UpstreamFailure::Ambiguous(why)),
            Err(_) => Err(UpstreamFailure::Timeout(self.timeout)),
        }
    }
}

/// An upstream response passed through as it streams, without capture.
pub fn stream_response(response: Response<PooledBody>) -> Response<ProxyBody> {
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, body.map_err(BoxError::from).boxed())
}

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    let proxy: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("proxy-"))
        .cloned()
        .collect();
    for name in proxy {
        headers.remove(name);
    }
}

fn original_host(parts: &request::Parts) -> Option<HeaderValue> {
    parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}

fn set_forwarded(headers: &mut HeaderMap, peer: Downstream, host: Option<HeaderValue>) {
    let client_ip = peer.addr.ip().to_string();
    let forwarded_for = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(prior) => format!("{prior}, {client_ip}"),
        None => client_ip,
    };
    if let Ok(value) = HeaderValue::from_str(&forwarded_for) {
        headers.insert(X_FORWARDED_FOR, value);
    }
    let proto = if peer.tls { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST, host);
    }
}

/// Extends a claim's lease about every third of `lock_timeout` while the upstream works. Stops when
/// dropped or stopped; stops by itself when the claim turns out to be taken over (counted as lost).
pub struct Heartbeat {
    stop: CancellationToken,
}

impl Heartbeat {
    /// Starts beating for `id` on a task owned by `tracker`.
    pub fn start(
        store: StoreHandle,
        id: RecordId,
        lease: Duration,
        metrics: Metrics,
        tracker: &tokio_util::task::TaskTracker,
    ) -> Heartbeat {
        let stop = CancellationToken::new();
        let token = stop.clone();
        tracker.spawn(async move {
            let mut ticks = tokio::time::interval(lease / 3);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                match store.heartbeat(&id, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        metrics.lost_claims.inc();
                        tracing::warn!(key = %id.key, "claim was taken over; heartbeat stopped");
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(key = %id.key, %error, "heartbeat failed; will retry")
                    }
                }
            }
        });
        Heartbeat { stop }
    }

    /// Stops extending the lease.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_connection_named_ones_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        headers.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, vec!["content-type"]);
    }

    #[test]
    fn forwarded_for_appends_the_peer() {
        let mut headers = HeaderMap::new();
        headers.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        let peer = Downstream {
            addr: "127.0.0.1:5000".parse().unwrap(),
            tls: false,
        };
        set_forwarded(&mut headers, peer, Some(HeaderValue::from_static("api")));
        assert_eq!(headers[&X_FORWARDED_FOR], "10.0.0.1, 127.0.0.1");
        assert_eq!(headers[&X_FORWARDED_HOST], "api");
        assert_eq!(headers[&X_FORWARDED_PROTO], "http");
        set_forwarded(&mut headers, Downstream { tls: true, ..peer }, None);
        assert_eq!(headers[&X_FORWARDED_PROTO], "https");
    }
}

#[cfg(test)]
mod heartbeat_tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::store::{
        ClaimRequest, ClaimResult, RecordInfo, RecordStats, Store, StoreError, StoredResponse,
    };

    /// Counts heartbeats; answers "still yours" until `taken_over` is set.
    #[derive(Default)]
    struct Beats {
        count: AtomicUsize,
        taken_over: AtomicBool,
    }

    #[async_trait::async_trait]
    impl Store for Beats {
        async fn claim(&self, _: &ClaimRequest) -> Result<ClaimResult, StoreError> {
            unreachable!("heartbeats never claim")
        }
        async fn heartbeat(&self, _: &RecordId, _: Duration) -> Result<bool, StoreError> {
            self.count.fetch_add(1, Ordering::SeqCst);
            Ok(!self.taken_over.load(Ordering::SeqCst))
        }
        async fn complete(&self, _: &RecordId, _: &StoredResponse) -> Result<bool, StoreError> {
            unreachable!("heartbeats never complete")
        }
        async fn release(&self, _: &RecordId) -> Result<bool, StoreError> {
            unreachable!("heartbeats never release")
        }
        async fn ping(&self) -> Result<(), StoreError> {
            Ok(())
        }
        async fn release_stale(&self, _: &RecordId) -> Result<bool, StoreError> {
            unreachable!("heartbeats never release")
        }
        async fn sweep(&self, _: u32) -> Result<u64, StoreError> {
            unreachable!("heartbeats never sweep")
        }
        async fn find(&self, _: &str, _: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
            unreachable!("heartbeats never look records up")
        }
        async fn stats(&self) -> Result<RecordStats, StoreError> {
            unreachable!("heartbeats never count records")
        }
    }

    fn start(beats: &Arc<Beats>, metrics: &Metrics, tracker: &tokio_util::task::TaskTracker) -> Heartbeat {
        let store = StoreHandle::new(beats.clone(), metrics.clone());
        let id = RecordId {
            scope: "s".into(),
            key: "k".into(),
            token: uuid::Uuid::nil(),
        };
        Heartbeat::start(store, id, Duration::from_secs(30), metrics.clone(), tracker)
    }

    async fn advance(by: Duration) {
        tokio::time::advance(by).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_lease_until_stopped() {
        let beats = Arc::new(Beats::default());
        let metrics = Metrics::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let heartbeat = start(&beats, &metrics, &tracker);
        advance(Duration::ZERO).await;
        advance(Duration::from_millis(9_900)).await;
        assert_eq!(
            beats.count.load(Ordering::SeqCst),
            0,
            "no beat before a third of the lease"
        );
        advance(Duration::from_millis(200)).await;
        assert_eq!(beats.count.load(Ordering::SeqCst), 1);
        advance(Duration::from_secs(10)).await;
        assert_eq!(beats.count.load(Ordering::SeqCst), 2);
        heartbeat.stop();
        advance(Duration::from_secs(60)).await;
        assert_eq!(beats.count.load(Ordering::SeqCst), 2, "no beat after stop");
        tracker.close();
        tracker.wait().await;
    }

    #[tokio::test(start_paused = true)]
    async fn stops_and_counts_a_lost_claim_when_fenced_out() {
        let beats = Arc::new(Beats::default());
        beats.taken_over.store(true, Ordering::SeqCst);
        let metrics = Metrics::new();
        let tracker = tokio_util::task::TaskTracker::new();
        let _heartbeat = start(&beats, &metrics, &tracker);
        advance(Duration::ZERO).await;
        advance(Duration::from_secs(10)).await;
        advance(Duration::from_secs(60)).await;
        assert_eq!(
            beats.count.load(Ordering::SeqCst),
            1,
            "a fenced-out heartbeat does not beat again"
        );
        assert_eq!(metrics.lost_claims.get(), 1);
        tracker.close();
        tracker.wait().await;
    }
}
