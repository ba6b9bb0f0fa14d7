//! Runs after a claim is won, on its own task so that a client who disconnects cannot cancel it: sends the
//! request upstream under a heartbeat, hands the response head to the client, then relays the body
//! downstream first and into the capture second, and finally completes or releases the claim. It owns the
//! upstream body until its end; it touches the store only through fenced writes.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, header};
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::body::{BoxError, ProxyBody};
use super::cache::Fill;
use super::downstream::{self, Sender};
use super::forward::{Heartbeat, UpstreamFailure, stream_response, strip_hop_by_hop};
use super::pool::PooledBody;
use super::{Answer, Proxy};
use crate::metrics::Outcome;
use crate::store::{RecordId, StoreError, StoredResponse};

/// Frames buffered between the relay and a slow client before the relay waits.
const DOWNSTREAM_FRAMES: usize = 8;

/// The first wait before a completion or release that failed because the store blipped is tried again;
/// each wait doubles, up to [`WRITE_BACKOFF_MAX`].
const WRITE_BACKOFF: Duration = Duration::from_millis(100);
const WRITE_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Executes a claimed request to the end, whatever happens to the client. The response head (or the
/// error) goes to `head`.
pub(crate) async fn execute(
    proxy: Arc<Proxy>,
    id: RecordId,
    request: Request<ProxyBody>,
    head: Answer,
    fill: Option<Fill>,
) {
    let heartbeat = Heartbeat::start(
        proxy.store.clone(),
        id.clone(),
        proxy.policy.lock_timeout,
        proxy.metrics.clone(),
        &proxy.tracker,
    );
    let response = match proxy.upstream.send(request).await {
        Ok(response) => response,
        Err(failure) => {
            heartbeat.stop();
            if let UpstreamFailure::NotDelivered(_) = &failure {
                return release_then_answer(&proxy, &id, head, Err(failure.into_error())).await;
            }
            tracing::warn!(key = %id.key, "upstream outcome unknown; claim left to its lease");
            head.send(Err(failure.into_error()));
            return;
        }
    };
    if proxy.policy.release.releases(response.status()) {
        heartbeat.stop();
        let answer = Ok((stream_response(response), Outcome::Executed));
        return release_then_answer(&proxy, &id, head, answer).await;
    }
    relay(proxy, id, response, head, heartbeat, fill).await;
}

async fn relay(
    proxy: Arc<Proxy>,
    id: RecordId,
    response: Response<PooledBody>,
    head: Answer,
    heartbeat: Heartbeat,
    fill: Option<Fill>,
) {
    let (mut parts, mut upstream) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let stored_headers = storable_headers(&parts.headers);
    let status = parts.status;
    let (sender, channel) = downstream::channel(DOWNSTREAM_FRAMES);
    let mut downstream = Some(sender);
    let response = Response::from_parts(parts, channel.boxed());
    if !head.send(Ok((response, Outcome::Executed))) {
        tracing::debug!(key = %id.key, "client left before the response head; reading upstream to the end");
        downstream = None;
    }
    let mut capture = Capture::new(proxy.policy.max_stored_response);
    let idle = proxy.upstream.timeout();
    loop {
        let frame = match tokio::time::timeout(idle, upstream.frame()).await {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(error))) => return broken_body(&id, downstream, heartbeat, error.into()),
            Err(_) => {
                return broken_body(&id, downstream, heartbeat, "upstream body stalled".into());
            }
        };
        let data = frame.data_ref().cloned();
        if let Some(sender) = downstream.as_mut()
            && sender.send(frame).await.is_err()
        {
            tracing::debug!(key = %id.key, "client left mid-body; reading upstream to the end");
            downstream = None;
        }
        if let Some(data) = data {
            capture.push(data);
        }
    }
    drop(downstream);
    let stored = StoredResponse {
        status: status.as_u16(),
        headers: stored_headers,
        body: capture.finish(),
    };
    if stored.body.is_none() {
        proxy.metrics.not_retained.inc();
    }
    let completed = complete(&proxy, &id, &stored).await;
    heartbeat.stop();
    if let (true, Some(fill)) = (completed, fill) {
        proxy
            .cache
            .insert(&id.scope, &id.key, fill.fingerprint, stored, fill.deadline);
    }
}

/// An upstream failure mid-body: the client's stream is aborted (never passed off as complete), nothing is
/// stored, and the claim is left to its lease because the upstream may have acted.
fn broken_body(id: &RecordId, downstream: Option<Sender>, heartbeat: Heartbeat, error: BoxError) {
    heartbeat.stop();
    tracing::warn!(key = %id.key, %error, "upstream body broke off; claim left to its lease");
    if let Some(sender) = downstream {
        sender.abort(error);
    }
}

/// End-to-end headers worth replaying. `content-length` is left out: a replay's length comes from the
/// stored body itself.
fn storable_headers(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH)
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// Stores the response under the claim's fence, retrying a store that does not answer for up to the lease
/// (see [`until_answered`]); `true` once it is stored.
async fn complete(proxy: &Proxy, id: &RecordId, stored: &StoredResponse) -> bool {
    let window = proxy.policy.lock_timeout;
    match until_answered(window, || proxy.store.complete(id, stored)).await {
        Ok(true) => true,
        Ok(false) => {
            lost_claim(proxy, id, "completion");
            false
        }
        Err(error) => {
            tracing::error!(key = %id.key, %error, "completion failed; claim left to its lease");
            false
        }
    }
}

/// Releases the claim before answering, so that a retry sent right after the answer finds the key free.
/// When the store is away the client is not kept waiting on it: it is answered at once, and the release
/// is tried again afterwards (see [`until_answered`]).
async fn release_then_answer(proxy: &Proxy, id: &RecordId, head: Answer, answer: super::Handled) {
    match proxy.store.release(id).await {
        Ok(true) => {}
        Ok(false) => lost_claim(proxy, id, "release"),
        Err(error) => {
            tracing::warn!(key = %id.key, %error, "release failed; answering, then retrying");
            head.send(answer);
            return release(proxy, id).await;
        }
    }
    head.send(answer);
}

async fn release(proxy: &Proxy, id: &RecordId) {
    let window = proxy.policy.lock_timeout;
    match until_answered(window, || proxy.store.release(id)).await {
        Ok(true) => {}
        Ok(false) => lost_claim(proxy, id, "release"),
        Err(error) => {
            tracing::warn!(key = %id.key, %error, "release failed; claim left to its lease")
        }
    }
}

/// Runs a fenced write until the store answers it, backing off between tries, for at most `window`
/// (the lease): past the lease the claim is stale and the next retry may take it over anyway, so the
/// claim is left to its lease instead of waiting on the store without end. Every failed try is counted
/// by the store handle. The store's answer, or its last error once the window has closed.
async fn until_answered<F, Fut>(window: Duration, mut write: F) -> Result<bool, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let deadline = Instant::now() + window;
    let mut backoff = WRITE_BACKOFF;
    let mut tries = 1u32;
    loop {
        match write().await {
            Err(error) if Instant::now() + backoff < deadline => {
                tracing::warn!(%error, tries, "store write failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(WRITE_BACKOFF_MAX);
                tries += 1;
            }
            answer => return answer,
        }
    }
}

fn lost_claim(proxy: &Proxy, id: &RecordId, write: &str) {
    proxy.metrics.lost_claims.inc();
    tracing::warn!(key = %id.key, write, "claim was taken over meanwhile; write refused by its fence");
}

/// The response body as it will be stored, while it stays under the cap.
struct Capture {
    limit: u64,
    chunks: Vec<Bytes>,
    len: u64,
    over: bool,
}

impl Capture {
    fn new(limit: u64) -> Capture {
        Capture {
            limit,
            chunks: Vec::new(),
            len: 0,
            over: false,
        }
    }

    fn push(&mut self, data: Bytes) {
        if self.over {
            return;
        }
        self.len += data.len() as u64;
        if self.len > self.limit {
            self.over = true;
            self.chunks = Vec::new();
            return;
        }
        self.chunks.push(data);
    }

    /// The whole body, or `None` when it went over the cap.
    fn finish(self) -> Option<Bytes> {
        if self.over {
            return None;
        }
        if self.chunks.len() == 1 {
            return self.chunks.into_iter().next();
        }
        let mut body = BytesMut::with_capacity(self.len as usize);
        for chunk in self.chunks {
            body.extend_from_slice(&chunk);
        }
        Some(body.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_keeps_the_body_under_the_cap() {
        let mut capture = Capture::new(6);
        capture.push(Bytes::from_static(b"abc"));
        capture.push(Bytes::from_static(b"def"));
        assert_eq!(capture.finish().as_deref(), Some(&b"abcdef"[..]));
    }

    #[test]
    fn capture_drops_the_body_over_the_cap() {
        let mut capture = Capture::new(5);
        capture.push(Bytes::from_static(b"abc"));
        capture.push(Bytes::from_static(b"def"));
        capture.push(Bytes::from_static(b"g"));
        assert_eq!(capture.finish(), None);
    }

    #[test]
    fn empty_body_is_retained_as_empty() {
        assert_eq!(Capture::new(0).finish().as_deref(), Some(&b""[..]));
    }

    /// A write that fails `failures` times, then answers `true`; counts its tries.
    fn flaky(failures: u32, tries: &std::cell::Cell<u32>) -> impl Future<Output = Result<bool, StoreError>> {
        tries.set(tries.get() + 1);
        let failed = tries.get() <= failures;
        async move {
            if failed {
                Err(StoreError::Backend("connection closed".into()))
            } else {
                Ok(true)
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_is_retried_until_the_store_answers() {
        let tries = std::cell::Cell::new(0);
        let started = Instant::now();
        let answer = until_answered(Duration::from_secs(30), || flaky(3, &tries)).await;
        assert!(matches!(answer, Ok(true)), "{answer:?}");
        assert_eq!(tries.get(), 4);
        assert_eq!(started.elapsed(), Duration::from_millis(100 + 200 + 400));
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_gives_up_when_the_window_closes() {
        let tries = std::cell::Cell::new(0);
        let started = Instant::now();
        let answer = until_answered(Duration::from_secs(5), || flaky(u32::MAX, &tries)).await;
        assert!(matches!(answer, Err(StoreError::Backend(_))), "{answer:?}");
        // Waits of 0.1, 0.2, 0.4, 0.8, 1.6 s; the next (2 s, capped) would end past the window.
        assert_eq!(tries.get(), 6);
        assert_eq!(started.elapsed(), Duration::from_millis(3_100));
    }
}
