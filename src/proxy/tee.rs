//! Runs after a claim is won, on its own task so that a client who disconnects cannot cancel it: sends the
//! request upstream under a heartbeat, hands the response head to the client, then relays the body
//! downstream first and into the capture second, and finally completes or releases the claim. It owns the
//! upstream body until its end; it touches the store only through fenced writes.
//!
//! The response is not complete for the client before its record is stored: the relay holds back
//! whatever completes it — the frame that brings the body to its declared length, the end of a chunked
//! or HTTP/2 body, or, for an empty body, the head itself — until the completion (and the replay cache's
//! copy) is done, for at most `min(store.timeout, 2 s)`. So a client that has read the whole response
//! and retries at once gets the replay, never a 409.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode, header};
use http_body::{Body as _, Frame};
use http_body_util::BodyExt;
use prometheus::IntCounter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::cache::Fill;
use super::downstream::{self, Sender};
use super::forward::{Heartbeat, stream_response, strip_hop_by_hop};
use super::pool::PooledBody;
use super::{Answer, Proxy};
use crate::body::{self, BoxError, ProxyBody};
use crate::config::OnUnknownOutcome;
use crate::error::ProxyError;
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
            if failure.never_delivered() {
                return release_then_answer(&proxy, &id, head, Err(failure.into_error())).await;
            }
            return unknown_outcome(&proxy, &id, head, failure.into_error()).await;
        }
    };
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        // The upstream took the request and switched protocols instead of answering it: what it did is
        // not known, and a 101 can be neither relayed (nothing asked for an upgrade) nor replayed.
        heartbeat.stop();
        let error = ProxyError::UpstreamInvalidResponse(response.status());
        return unknown_outcome(&proxy, &id, head, error).await;
    }
    if proxy.policy.release.releases(response.status()) {
        heartbeat.stop();
        let answer = Ok((stream_response(response), Outcome::Executed));
        return release_then_answer(&proxy, &id, head, answer).await;
    }
    relay(proxy, id, response, head, heartbeat, fill).await;
}

/// The upstream may have acted on the request, but no full answer came back. With
/// `on_unknown_outcome = "retry"` the claim is left to its lease (a retry after it executes again);
/// with `"hold"` the record is marked unknown first, so a retry sent right after this answer is
/// refused until an operator releases the key. The client waits for the hold at most
/// `completion_hold`.
async fn unknown_outcome(proxy: &Proxy, id: &RecordId, head: Answer, error: ProxyError) {
    proxy.metrics.unknown_outcomes.inc();
    if proxy.policy.on_unknown_outcome == OnUnknownOutcome::Retry {
        tracing::warn!(key = %id.key, %error, "upstream outcome unknown; claim left to its lease");
        head.send(Err(error));
        return;
    }
    tracing::warn!(key = %id.key, %error, "upstream outcome unknown; holding the key until released");
    let holding = hold(proxy, id);
    tokio::pin!(holding);
    let in_time = tokio::time::timeout(proxy.completion_hold, &mut holding)
        .await
        .is_ok();
    head.send(Err(error));
    if !in_time {
        holding.await;
    }
}

/// Marks the record unknown, trying for up to the lease while the store does not answer.
async fn hold(proxy: &Proxy, id: &RecordId) {
    match until_answered(proxy.policy.lock_timeout, || proxy.store.hold(id)).await {
        Ok(true) => {}
        Ok(false) => lost_claim(proxy, id, "hold"),
        Err(error) => {
            tracing::error!(key = %id.key, %error, "holding the key failed; claim left to its lease")
        }
    }
}

/// The client's side of the relay: its response head until it is sent, then the channel to its response
/// body while the client is there.
struct Client {
    head: Option<(Answer, Response<ProxyBody>)>,
    sender: Option<Sender>,
    write_timeout: Duration,
}

impl Client {
    /// Sends the response head if it has not gone yet. It waits for the first body frame that is ready
    /// with it, so that a response whose body comes in one frame leaves in one write once it is stored.
    fn send_head(&mut self, id: &RecordId) {
        let Some((answer, response)) = self.head.take() else {
            return;
        };
        if !answer.send(Ok((response, Outcome::Executed))) {
            tracing::debug!(key = %id.key, "client left before the response head; reading upstream to the end");
            self.sender = None;
        }
    }

    /// Queues `frame` for the client. A client that has gone is dropped; one that accepts nothing for
    /// `server.write_timeout` is let go with an error (its response must never look complete) and
    /// counted; either way the relay reads on.
    async fn deliver(&mut self, frame: Frame<Bytes>, proxy: &Proxy, id: &RecordId) {
        self.send_head(id);
        let Some(sender) = self.sender.as_mut() else {
            return;
        };
        match tokio::time::timeout(self.write_timeout, sender.send(frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                tracing::debug!(key = %id.key, "client left mid-body; reading upstream to the end");
                self.sender = None;
            }
            Err(_) => {
                proxy.metrics.write_timeouts.inc();
                tracing::warn!(key = %id.key, timeout = ?self.write_timeout,
                    "client accepted no response bytes; letting it go and reading upstream to the end");
                self.abort("the client stopped reading the response".into());
            }
        }
    }

    fn abort(&mut self, error: BoxError) {
        if let Some(sender) = self.sender.take() {
            sender.abort(error);
        }
    }

    /// The upstream failed mid-body: a client that has not had the head yet gets `failure` instead; one
    /// that has gets its stream ended with the error, never passed off as complete.
    fn fail(&mut self, error: BoxError, failure: ProxyError) {
        match self.head.take() {
            Some((answer, _)) => {
                answer.send(Err(failure));
                self.sender = None;
            }
            None => self.abort(error),
        }
    }
}

/// What the relay holds back from the client until the record is stored.
enum Held {
    /// An empty body: the head is the whole response.
    Head(Answer, Response<ProxyBody>),
    /// The last frame, if one is held, then the end of the body.
    End(Client, Option<Frame<Bytes>>),
}

impl Held {
    /// Lets the client have the rest of its response; the body ends once the client is dropped.
    async fn release(self, proxy: &Proxy, id: &RecordId) {
        match self {
            Held::Head(head, response) => {
                head.send(Ok((response, Outcome::Executed)));
            }
            Held::End(mut client, last) => {
                client.send_head(id);
                if let Some(frame) = last {
                    client.deliver(frame, proxy, id).await;
                }
            }
        }
    }
}

/// What the relay stores once the upstream body has ended.
struct ToStore {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    capture: Capture,
    fill: Option<Fill>,
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
    let record = ToStore {
        status: parts.status.as_u16(),
        headers: storable_headers(&parts.headers, &proxy.policy.never_store_headers),
        capture: Capture::new(
            proxy.policy.max_stored_response,
            proxy.captures.clone(),
            proxy.metrics.capture_budget_exhausted.clone(),
        ),
        fill,
    };
    if http_body::Body::is_end_stream(&upstream) {
        drop(upstream);
        let held = Held::Head(head, Response::from_parts(parts, body::empty()));
        return finish(&proxy, &id, record, held, heartbeat).await;
    }
    let declared = content_length(&parts.headers);
    let (sender, channel) = downstream::channel(DOWNSTREAM_FRAMES);
    let mut client = Client {
        head: Some((head, Response::from_parts(parts, channel.boxed()))),
        sender: Some(sender),
        write_timeout: proxy.write_timeout,
    };
    let ToStore {
        status,
        headers,
        mut capture,
        fill,
    } = record;
    let mut last = None;
    let mut received = 0u64;
    let idle = proxy.upstream.timeout();
    loop {
        let polled = match frame_now(&mut upstream) {
            Poll::Ready(polled) => polled,
            Poll::Pending => {
                // Nothing more comes with the head now: let it go before waiting on the upstream.
                client.send_head(&id);
                match tokio::time::timeout(idle, upstream.frame()).await {
                    Ok(polled) => polled,
                    Err(_) => {
                        let failure = ProxyError::UpstreamTimeout(idle);
                        let error = "upstream body stalled".into();
                        return broken_body(&proxy, &id, client, heartbeat, error, failure).await;
                    }
                }
            }
        };
        let frame = match polled {
            None => break,
            Some(Ok(frame)) => frame,
            Some(Err(error)) => {
                let failure = ProxyError::UpstreamUnreachable(error.to_string());
                return broken_body(&proxy, &id, client, heartbeat, error.into(), failure).await;
            }
        };
        if let Some(data) = frame.data_ref() {
            received += data.len() as u64;
            capture.push(data.clone());
        }
        // A frame held as the last one was not, since another follows.
        if let Some(earlier) = last.take() {
            client.deliver(earlier, &proxy, &id).await;
        }
        if completes(&frame, &upstream, declared, received) {
            last = Some(frame);
        } else {
            client.deliver(frame, &proxy, &id).await;
        }
    }
    let record = ToStore {
        status,
        headers,
        capture,
        fill,
    };
    finish(&proxy, &id, record, Held::End(client, last), heartbeat).await;
}

/// The upstream body's next frame if it is there without waiting (it usually came in with the head).
fn frame_now(upstream: &mut PooledBody) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
    Pin::new(upstream).poll_frame(&mut Context::from_waker(Waker::noop()))
}

/// Whether `frame` completes the response for the client: trailers, the body's end as the upstream
/// reports it, or the declared length reached (HTTP/1.1 ends such a message with its last byte).
fn completes(frame: &Frame<Bytes>, upstream: &PooledBody, declared: Option<u64>, received: u64) -> bool {
    frame.is_trailers()
        || http_body::Body::is_end_stream(upstream)
        || declared.is_some_and(|length| received >= length)
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Stores the response, then lets the client have the rest of it. The client waits for the store at most
/// `completion_hold`; past it the client gets the rest and the completion goes on (counted).
async fn finish(proxy: &Proxy, id: &RecordId, record: ToStore, held: Held, heartbeat: Heartbeat) {
    let captured = record.capture.finish();
    let stored = StoredResponse {
        status: record.status,
        headers: record.headers,
        body: captured.body,
    };
    if stored.body.is_none() {
        proxy.metrics.not_retained.inc();
    }
    let storing = store_and_remember(proxy, id, stored, record.fill);
    tokio::pin!(storing);
    let in_time = tokio::time::timeout(proxy.completion_hold, &mut storing)
        .await
        .is_ok();
    if !in_time {
        proxy.metrics.completion_hold_expired.inc();
        tracing::warn!(key = %id.key, hold = ?proxy.completion_hold,
            "record not stored within the hold; the client gets the rest of its response first");
    }
    held.release(proxy, id).await;
    if !in_time {
        storing.await;
    }
    heartbeat.stop();
    drop(captured.reservation);
}

/// Completes the record and, once it is stored, puts it in the replay cache.
async fn store_and_remember(proxy: &Proxy, id: &RecordId, stored: StoredResponse, fill: Option<Fill>) {
    if complete(proxy, id, &stored).await
        && let Some(fill) = fill
    {
        proxy
            .cache
            .insert(&id.scope, &id.key, fill.fingerprint, stored, fill.deadline);
    }
}

/// An upstream failure mid-body: the client's stream is aborted (never passed off as complete), or if it
/// has not had the head yet it gets `failure`; nothing is stored, and the outcome is unknown because the
/// upstream may have acted.
async fn broken_body(
    proxy: &Proxy,
    id: &RecordId,
    mut client: Client,
    heartbeat: Heartbeat,
    error: BoxError,
    failure: ProxyError,
) {
    heartbeat.stop();
    proxy.metrics.unknown_outcomes.inc();
    tracing::warn!(key = %id.key, %error, "upstream body broke off; outcome unknown");
    client.fail(error, failure);
    if proxy.policy.on_unknown_outcome == OnUnknownOutcome::Hold {
        hold(proxy, id).await;
    }
}

/// End-to-end headers worth replaying. `content-length` is left out: a replay's length comes from the
/// stored body itself; so are `never_store` (`idempotency.never_store_headers`, such as `set-cookie`),
/// which only the first client gets.
fn storable_headers(headers: &HeaderMap, never_store: &[HeaderName]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH && !never_store.contains(name))
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

/// The body as it will be stored, while it stays under the cap and the process's capture budget
/// (`server.max_buffered_responses`) has room for it.
struct Capture {
    limit: u64,
    chunks: Vec<Bytes>,
    len: u64,
    over: bool,
    budget: Arc<Semaphore>,
    reservation: Option<OwnedSemaphorePermit>,
    /// Counts captures given up because the budget had no room.
    starved: IntCounter,
}

/// What a capture kept.
struct Captured {
    /// The whole body, or `None` when it went over the cap or the budget.
    body: Option<Bytes>,
    /// The share of the budget the body holds until it is stored.
    reservation: Option<OwnedSemaphorePermit>,
}

impl Capture {
    fn new(limit: u64, budget: Arc<Semaphore>, starved: IntCounter) -> Capture {
        Capture {
            limit,
            chunks: Vec::new(),
            len: 0,
            over: false,
            budget,
            reservation: None,
            starved,
        }
    }

    fn push(&mut self, data: Bytes) {
        if self.over || data.is_empty() {
            return;
        }
        self.len += data.len() as u64;
        if self.len > self.limit {
            return self.give_up();
        }
        let room = u32::try_from(data.len())
            .ok()
            .and_then(|n| self.budget.clone().try_acquire_many_owned(n).ok());
        let Some(room) = room else {
            self.starved.inc();
            return self.give_up();
        };
        match &mut self.reservation {
            Some(held) => held.merge(room),
            None => self.reservation = Some(room),
        }
        self.chunks.push(data);
    }

    /// Stops capturing: the body will not be retained, and its share of the budget goes back.
    fn give_up(&mut self) {
        self.over = true;
        self.chunks = Vec::new();
        self.reservation = None;
    }

    fn finish(self) -> Captured {
        let body = if self.over {
            None
        } else if self.chunks.len() == 1 {
            self.chunks.into_iter().next()
        } else {
            let mut body = BytesMut::with_capacity(self.len as usize);
            for chunk in self.chunks {
                body.extend_from_slice(&chunk);
            }
            Some(body.freeze())
        };
        Captured {
            body,
            reservation: self.reservation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(bytes: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(bytes))
    }

    fn starved() -> IntCounter {
        IntCounter::new("starved", "test").unwrap()
    }

    #[test]
    fn capture_keeps_the_body_under_the_cap() {
        let mut capture = Capture::new(6, budget(100), starved());
        capture.push(Bytes::from_static(b"abc"));
        capture.push(Bytes::from_static(b"def"));
        assert_eq!(capture.finish().body.as_deref(), Some(&b"abcdef"[..]));
    }

    #[test]
    fn capture_drops_the_body_over_the_cap_and_gives_its_budget_back() {
        let shared = budget(100);
        let counted = starved();
        let mut capture = Capture::new(5, shared.clone(), counted.clone());
        capture.push(Bytes::from_static(b"abc"));
        assert_eq!(shared.available_permits(), 97);
        capture.push(Bytes::from_static(b"def"));
        capture.push(Bytes::from_static(b"g"));
        let captured = capture.finish();
        assert_eq!(captured.body, None);
        assert_eq!(counted.get(), 0, "over the cap, not the budget");
        assert_eq!(shared.available_permits(), 100);
    }

    #[test]
    fn a_capture_without_room_in_the_budget_is_not_retained() {
        let shared = budget(4);
        let counted = starved();
        let mut first = Capture::new(100, shared.clone(), counted.clone());
        first.push(Bytes::from_static(b"abc"));
        let mut second = Capture::new(100, shared.clone(), counted.clone());
        second.push(Bytes::from_static(b"de"));
        assert_eq!(counted.get(), 1, "counted when it happens");
        assert_eq!(second.finish().body, None);
        let kept = first.finish();
        assert_eq!(kept.body.as_deref(), Some(&b"abc"[..]));
        assert_eq!(shared.available_permits(), 1, "held until the body is stored");
        drop(kept);
        assert_eq!(shared.available_permits(), 4);
    }

    #[test]
    fn empty_body_is_retained_as_empty() {
        let captured = Capture::new(0, budget(0), starved()).finish();
        assert_eq!(captured.body.as_deref(), Some(&b""[..]));
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
