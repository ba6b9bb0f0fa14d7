//! Runs after a claim is won, on its own task so that a client who disconnects cannot cancel it: sends the
//! request upstream under a heartbeat, hands the response head to the client, then relays the body
//! downstream first and into the capture second, and finally completes or releases the claim. It owns the
//! upstream body until its end; it touches the store only through fenced writes.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, header};
use http_body_util::BodyExt;
use http_body_util::channel::{Channel, Sender};
use hyper::body::Incoming;

use super::body::{BoxError, ProxyBody};
use super::cache::Fill;
use super::forward::{Heartbeat, UpstreamFailure, stream_response, strip_hop_by_hop};
use super::{Answer, Proxy};
use crate::metrics::Outcome;
use crate::store::{RecordId, StoredResponse};

/// Frames buffered between the relay and a slow client before the relay waits.
const DOWNSTREAM_FRAMES: usize = 8;

/// How often a completion that failed because the store blipped is tried again, and the first backoff.
const COMPLETE_ATTEMPTS: u32 = 4;
const COMPLETE_BACKOFF: Duration = Duration::from_millis(200);

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
                release(&proxy, &id).await;
            } else {
                tracing::warn!(key = %id.key, "upstream outcome unknown; claim left to its lease");
            }
            head.send(Err(failure.into_error()));
            return;
        }
    };
    if proxy.policy.release.releases(response.status()) {
        heartbeat.stop();
        release(&proxy, &id).await;
        head.send(Ok((stream_response(response), Outcome::Executed)));
        return;
    }
    relay(proxy, id, response, head, heartbeat, fill).await;
}

async fn relay(
    proxy: Arc<Proxy>,
    id: RecordId,
    response: Response<Incoming>,
    head: Answer,
    heartbeat: Heartbeat,
    fill: Option<Fill>,
) {
    let (mut parts, mut upstream) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let stored_headers = storable_headers(&parts.headers);
    let status = parts.status;
    let (sender, channel) = Channel::<Bytes, BoxError>::new(DOWNSTREAM_FRAMES);
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
fn broken_body(
    id: &RecordId,
    downstream: Option<Sender<Bytes, BoxError>>,
    heartbeat: Heartbeat,
    error: BoxError,
) {
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

/// Stores the response under the claim's fence; `true` once it is stored.
async fn complete(proxy: &Proxy, id: &RecordId, stored: &StoredResponse) -> bool {
    let mut backoff = COMPLETE_BACKOFF;
    for attempt in 1..=COMPLETE_ATTEMPTS {
        match proxy.store.complete(id, stored).await {
            Ok(true) => return true,
            Ok(false) => {
                lost_claim(proxy, id, "completion");
                return false;
            }
            Err(error) if attempt < COMPLETE_ATTEMPTS => {
                tracing::warn!(key = %id.key, %error, attempt, "completion failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            Err(error) => {
                tracing::error!(key = %id.key, %error, "completion failed; claim left to its lease");
            }
        }
    }
    false
}

async fn release(proxy: &Proxy, id: &RecordId) {
    match proxy.store.release(id).await {
        Ok(true) => {}
        Ok(false) => lost_claim(proxy, id, "release"),
        Err(error) => {
            tracing::warn!(key = %id.key, %error, "release failed; claim left to its lease")
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
}
