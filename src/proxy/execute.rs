//! Runs after a claim is won, on its own task so that a client who disconnects cannot cancel it: the won
//! claim's whole task. It sends the request upstream (`upstream.rs`) under a heartbeat
//! (`execute/heartbeat.rs`), relays the response to the client while capturing it (`execute/relay.rs`,
//! `execute/capture.rs`), and finally completes or releases the claim. It owns the upstream body until its
//! end; it touches the store only through fenced writes, each tried for at most the claim's lease.
//!
//! The response is not complete for the client before its record is stored: the relay holds back
//! whatever completes it — the frame that brings the body to its declared length, the end of a chunked
//! or HTTP/2 body, or, for an empty body, the head itself — until the completion (and the replay cache's
//! copy) is done, for at most `min(store.timeout, 2 s)`. So a client that has read the whole response
//! and retries at once gets the replay, never a 409.
//!
//! On a route with `on_in_flight = "wait"`, a record that settled (completed, released or held) is
//! announced to the requests waiting for it (`settle.rs`), once the store has it.

pub(crate) mod capture;
mod channel;
mod heartbeat;
mod relay;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, StatusCode, request};
use tokio::time::Instant;
use tracing::Instrument;

use self::capture::CaptureBudget;
use self::heartbeat::Heartbeat;
use self::relay::{Held, Relay, Relayed, ToStore};
use super::answer::{Answer, Handled};
use super::attach::Attachments;
use super::budget::ReservedBody;
use super::cache::{Fill, ReplayCache};
use super::downstream::Downstream;
use super::expiry;
use super::grpc;
use super::settle::Settle;
use super::upstream::{Upstream, stream_response};
use crate::body::{BoxError, ProxyBody};
use crate::config::{Config, GrpcOutcome, OnInFlight, OnUnknownOutcome, Route};
use crate::error::ProxyError;
use crate::metrics::{Metrics, Outcome};
use crate::otlp;
use crate::store::{RecordId, StoreError, StoreHandle, StoredResponse};

/// The first wait before a completion or release that failed because the store blipped is tried again;
/// each wait doubles, up to [`WRITE_BACKOFF_MAX`].
const WRITE_BACKOFF: Duration = Duration::from_millis(100);
const WRITE_BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The longest a client waits for its record to be stored (or less, `store.timeout`).
const COMPLETION_HOLD_MAX: Duration = Duration::from_secs(2);

/// The execute stage: everything a won claim's execution touches, over its worker's pool of upstream
/// connections.
#[derive(Clone)]
pub(crate) struct Executor {
    store: StoreHandle,
    upstream: Upstream,
    cache: Arc<ReplayCache>,
    relay: Relay,
    /// Longest a client waits for its record to be stored before it gets the end of its response.
    completion_hold: Duration,
    metrics: Metrics,
    /// Whether store writes are traced (`traces.enabled`).
    traced: bool,
    settle: Settle,
    /// The executions duplicates may follow (`on_in_flight = "attach"`), shared by every worker.
    attachments: Arc<Attachments>,
}

/// What an [`Executor`] is made of beside the configuration.
pub(crate) struct ExecutorParts {
    pub(crate) store: StoreHandle,
    pub(crate) upstream: Upstream,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) metrics: Metrics,
    pub(crate) settle: Settle,
    pub(crate) attachments: Arc<Attachments>,
}

/// A won claim: the record it holds, fenced by its token, and the lease it was claimed with. The
/// heartbeat renews that lease, and every fenced write is tried for at most that long.
pub(crate) struct Claimed {
    /// The record, with this claim's fencing token.
    pub(crate) id: RecordId,
    /// How long the claim holds without a heartbeat (`lock_timeout` when it was claimed).
    pub(crate) lease: Duration,
    /// The route the request took, whose policy decides what is stored and released.
    pub(crate) route: Arc<Route>,
    /// When the record expires as the claim left it, by this process's clock (never later than by the
    /// store's): what the expiry header of its response says.
    pub(crate) expires_at: SystemTime,
    /// The replay cache entry the completion may make.
    pub(crate) fill: Option<Fill>,
    /// The request's fingerprint: the duplicates that may follow its response have the same.
    pub(crate) fingerprint: [u8; 32],
}

impl Executor {
    pub(crate) fn new(config: &Config, parts: ExecutorParts) -> Executor {
        let ExecutorParts {
            store,
            upstream,
            cache,
            metrics,
            settle,
            attachments,
        } = parts;
        let server = &config.server;
        // Bytes of keyed responses being captured, and each scope's share: one budget for every worker.
        let captures = Arc::new(CaptureBudget::new(
            server.max_buffered_responses,
            server.max_buffered_responses_per_scope,
            server.capture_wait,
            metrics.clone(),
        ));
        Executor {
            relay: Relay::new(
                captures,
                config.server.write_timeout,
                upstream.timeout(),
                metrics.clone(),
            ),
            store,
            upstream,
            cache,
            completion_hold: config.store.timeout.min(COMPLETION_HOLD_MAX),
            metrics,
            traced: otlp::traced(&config.traces),
            settle,
            attachments,
        }
    }

    /// The executions of this process that duplicates may follow.
    pub(crate) fn attachments(&self) -> &Arc<Attachments> {
        &self.attachments
    }

    /// The same stage for another worker thread: its pool of upstream connections and its store handle.
    pub(crate) fn for_worker(&self, upstream: Upstream, store: StoreHandle) -> Executor {
        Executor {
            upstream,
            store,
            ..self.clone()
        }
    }

    /// The request `parts` and `body`, read whole, as they go upstream from `peer`.
    pub(crate) fn request(
        &self,
        mut parts: request::Parts,
        body: ReservedBody,
        peer: &Downstream,
    ) -> Request<ProxyBody> {
        grpc::set_deadline(&mut parts.headers, self.upstream.timeout());
        self.upstream.request_whole(parts, body, peer)
    }

    /// Executes a claimed request to the end, whatever happens to the client. The response head (or the
    /// error) goes to `head`.
    pub(crate) async fn execute(&self, claim: Claimed, request: Request<ProxyBody>, head: Answer) {
        let heartbeat = Heartbeat::new(&self.store, &claim.id, claim.lease, &self.metrics);
        // The execution's future is many kilobytes: on the heap, it is written once rather than copied
        // into each future that holds it, and the claim task that every keyed request spawns (and that
        // tokio copies as it starts and finishes) stays small.
        let executed = Box::pin(self.executed(&claim, request, head, &heartbeat));
        heartbeat.beside(executed).await;
    }

    /// [`Executor::execute`] beside its `heartbeat`.
    async fn executed(
        &self,
        claim: &Claimed,
        request: Request<ProxyBody>,
        head: Answer,
        heartbeat: &Heartbeat<'_>,
    ) {
        let grpc = grpc::is_grpc(&request);
        // Followable from before it is sent, so that a duplicate that comes meanwhile gets its head.
        let publisher = (claim.route.policy.claim.on_in_flight == OnInFlight::Attach)
            .then(|| self.attachments.publish(&claim.id, claim.fingerprint));
        let response = match self.upstream.send(request).await {
            Ok(response) => response,
            Err(failure) => {
                heartbeat.stop();
                if failure.never_delivered() {
                    return self
                        .release_then_answer(claim, head, Err(failure.into_error()))
                        .await;
                }
                let error = failure.into_error();
                let why = error.to_string();
                return self.unknown_outcome(claim, head, Err(error), &why).await;
            }
        };
        if response.status() == StatusCode::SWITCHING_PROTOCOLS {
            // The upstream took the request and switched protocols instead of answering it: what it did is
            // not known, and a 101 can be neither relayed (nothing asked for an upgrade) nor replayed.
            heartbeat.stop();
            let error = ProxyError::UpstreamInvalidResponse(response.status());
            let why = error.to_string();
            return self.unknown_outcome(claim, head, Err(error), &why).await;
        }
        if claim.route.policy.store.release.releases(response.status()) {
            heartbeat.stop();
            let answer = Ok((stream_response(response), Outcome::Executed));
            return self.release_then_answer(claim, head, answer).await;
        }
        // A gRPC answer that is trailers only carries its status in the head: what it means for the key
        // is known before any body.
        let head_status = (grpc && response.status() == StatusCode::OK)
            .then(|| crate::headers::grpc_status(response.headers()))
            .flatten();
        if let Some(code) = head_status {
            let outcome = claim.route.policy.store.grpc.of(code);
            if outcome != GrpcOutcome::Store {
                heartbeat.stop();
                let answer = Ok((stream_response(response), Outcome::Executed));
                if outcome == GrpcOutcome::Release {
                    return self.release_then_answer(claim, head, answer).await;
                }
                let why = format!("gRPC status {code}");
                return self.unknown_outcome(claim, head, answer, &why).await;
            }
        }
        let stamp =
            |headers: &mut HeaderMap| expiry::stamp(headers, &claim.route.policy, Some(claim.expires_at));
        match self
            .relay
            .run(&claim.id, &claim.route.policy, response, (head, publisher), stamp)
            .await
        {
            Relayed::Whole(record, held) if grpc && record.status == 200 => {
                // The status came after the messages, in the trailers; none at all is a broken call.
                match grpc::stored_status(&record.headers)
                    .map(|code| (code, claim.route.policy.store.grpc.of(code)))
                {
                    Some((_, GrpcOutcome::Store)) => self.finish(claim, record, held, heartbeat).await,
                    Some((code, GrpcOutcome::Release)) => {
                        self.not_stored(claim, held, heartbeat, None).await;
                        tracing::debug!(key_hash = %claim.id.key_hash(), code, "gRPC status gave the key back");
                    }
                    Some((code, GrpcOutcome::Unknown)) => {
                        let why = format!("gRPC status {code}");
                        self.not_stored(claim, held, heartbeat, Some(&why)).await;
                    }
                    None => {
                        let why = "a gRPC answer without grpc-status";
                        self.not_stored(claim, held, heartbeat, Some(why)).await;
                    }
                }
            }
            Relayed::Whole(record, held) => self.finish(claim, record, held, heartbeat).await,
            Relayed::Broken {
                client,
                error,
                failure,
            } => self.broken_body(claim, client, heartbeat, error, failure).await,
        }
    }

    /// The upstream may have acted on the request, but no full answer came back. With
    /// `on_unknown_outcome = "retry"` the claim is left to its lease (a retry after it executes again);
    /// with `"hold"` the record is marked unknown first, so a retry sent right after this answer is
    /// refused until an operator releases the key. The client waits for the hold at most
    /// `completion_hold`.
    /// The client's answer is `answer`: the error, or the upstream's own answer when it said the outcome
    /// is not known (a gRPC status such as DEADLINE_EXCEEDED); `why` says what happened, for the log.
    async fn unknown_outcome(&self, claim: &Claimed, head: Answer, answer: Handled, why: &str) {
        if !self.holds_unknown(claim, why) {
            head.send(answer);
            return;
        }
        let holding = self.hold(claim);
        tokio::pin!(holding);
        let in_time = tokio::time::timeout(self.completion_hold, &mut holding).await;
        head.send(answer);
        let held = match in_time {
            Ok(held) => held,
            Err(_) => holding.await,
        };
        if held {
            self.settle.settled(&claim.route, &claim.id).await;
        }
    }

    /// Counts and logs an unknown outcome; whether the route holds its key (`on_unknown_outcome =
    /// "hold"`) rather than leaving the claim to its lease.
    fn holds_unknown(&self, claim: &Claimed, why: &str) -> bool {
        self.metrics.unknown_outcomes.inc();
        let key_hash = claim.id.key_hash();
        if claim.route.policy.store.on_unknown_outcome == OnUnknownOutcome::Retry {
            tracing::warn!(%key_hash, error = why, "upstream outcome unknown; claim left to its lease");
            return false;
        }
        tracing::warn!(%key_hash, error = why, "upstream outcome unknown; holding the key until released");
        true
    }

    /// Marks the record unknown, trying for up to the lease while the store does not answer; `true` once
    /// it is held.
    async fn hold(&self, claim: &Claimed) -> bool {
        let id = &claim.id;
        match until_answered(claim.lease, || self.store.hold(id)).await {
            Ok(true) => true,
            Ok(false) => {
                self.lost_claim(id, "hold");
                false
            }
            Err(error) => {
                tracing::error!(key_hash = %id.key_hash(), %error, "holding the key failed; claim left to its lease");
                false
            }
        }
    }

    /// Stores the response, then lets the client have the rest of it. The client waits for the store at most
    /// `completion_hold`; past it the client gets the rest and the completion goes on (counted). Whoever
    /// waits for the record is told last, off the client's path.
    async fn finish(&self, claim: &Claimed, record: ToStore, held: Held, heartbeat: &Heartbeat<'_>) {
        let id = &claim.id;
        heartbeat.settling();
        let captured = record.capture.finish();
        let stored = StoredResponse {
            status: record.status,
            headers: record.headers,
            body: captured.body,
        };
        if stored.body.is_none() {
            self.metrics.not_retained.inc();
        }
        let storing = self.store_and_remember(claim, stored);
        tokio::pin!(storing);
        let in_time = tokio::time::timeout(self.completion_hold, &mut storing).await;
        if in_time.is_err() {
            self.metrics.completion_hold_expired.inc();
            tracing::warn!(key_hash = %id.key_hash(), hold = ?self.completion_hold,
                "record not stored within the hold; the client gets the rest of its response first");
        }
        held.release(&self.metrics, id).await;
        let completed = match in_time {
            Ok(completed) => completed,
            Err(_) => storing.await,
        };
        heartbeat.stop();
        // The log keeps the charge while duplicates still read the bytes.
        drop(captured.reservation);
        if completed {
            self.settle.settled(&claim.route, id).await;
        }
    }

    /// A whole answer that is not a result to store (a gRPC status in the trailers): the key is given back
    /// (`unknown` is `None`), or the outcome is unknown (`unknown` says why) and `on_unknown_outcome`
    /// decides. The client gets the end of its answer after that, so a retry sent right after it finds
    /// the key free, or held.
    async fn not_stored(
        &self,
        claim: &Claimed,
        held: Held,
        heartbeat: &Heartbeat<'_>,
        unknown: Option<&str>,
    ) {
        heartbeat.stop();
        match unknown {
            None => self.release(claim).await,
            Some(why) => {
                if self.holds_unknown(claim, why) && self.hold(claim).await {
                    self.settle.settled(&claim.route, &claim.id).await;
                }
            }
        }
        held.release(&self.metrics, &claim.id).await;
    }

    /// Completes the record and, once it is stored, puts it in the replay cache; `true` once it is stored.
    async fn store_and_remember(&self, claim: &Claimed, stored: StoredResponse) -> bool {
        let id = &claim.id;
        let completed = self.complete(claim, &stored).await;
        if completed && let Some(fill) = &claim.fill {
            self.cache
                .insert(&id.scope, &id.key, fill.fingerprint, stored, fill.deadline);
        }
        completed
    }

    /// An upstream failure mid-body: the client's stream is aborted (never passed off as complete), or if it
    /// has not had the head yet it gets `failure`; nothing is stored, and the outcome is unknown because the
    /// upstream may have acted.
    async fn broken_body(
        &self,
        claim: &Claimed,
        mut client: relay::Client,
        heartbeat: &Heartbeat<'_>,
        error: BoxError,
        failure: ProxyError,
    ) {
        heartbeat.stop();
        self.metrics.unknown_outcomes.inc();
        tracing::warn!(key_hash = %claim.id.key_hash(), %error, "upstream body broke off; outcome unknown");
        client.fail(error, failure);
        if claim.route.policy.store.on_unknown_outcome == OnUnknownOutcome::Hold && self.hold(claim).await {
            self.settle.settled(&claim.route, &claim.id).await;
        }
    }
    /// Stores the response under the claim's fence, retrying a store that does not answer for up to the lease
    /// (see [`until_answered`]); `true` once it is stored.
    async fn complete(&self, claim: &Claimed, stored: &StoredResponse) -> bool {
        let id = &claim.id;
        let span = otlp::settlement(self.traced, true);
        let writing = until_answered(claim.lease, || self.store.complete(id, stored));
        match writing.instrument(span.clone()).await {
            Ok(true) => true,
            Ok(false) => {
                otlp::failed(&span, "fenced");
                self.lost_claim(id, "completion");
                false
            }
            Err(error) => {
                otlp::failed(&span, "store_error");
                tracing::error!(key_hash = %id.key_hash(), %error, "completion failed; claim left to its lease");
                false
            }
        }
    }

    /// Releases the claim before answering, so that a retry sent right after the answer finds the key free.
    /// When the store is away the client is not kept waiting on it: it is answered at once, and the release
    /// is tried again afterwards (see [`until_answered`]). Whoever waits for the record is told after the
    /// answer.
    async fn release_then_answer(&self, claim: &Claimed, head: Answer, answer: Handled) {
        let id = &claim.id;
        let span = otlp::settlement(self.traced, false);
        match self.store.release(id).instrument(span.clone()).await {
            Ok(true) => {
                head.send(answer);
                self.settle.settled(&claim.route, id).await;
            }
            Ok(false) => {
                otlp::failed(&span, "fenced");
                self.lost_claim(id, "release");
                head.send(answer);
            }
            Err(error) => {
                otlp::failed(&span, "store_error");
                tracing::warn!(key_hash = %id.key_hash(), %error, "release failed; answering, then retrying");
                head.send(answer);
                self.release(claim).await;
            }
        }
    }

    async fn release(&self, claim: &Claimed) {
        let id = &claim.id;
        match until_answered(claim.lease, || self.store.release(id)).await {
            Ok(true) => self.settle.settled(&claim.route, id).await,
            Ok(false) => self.lost_claim(id, "release"),
            Err(error) => {
                tracing::warn!(key_hash = %id.key_hash(), %error, "release failed; claim left to its lease")
            }
        }
    }

    fn lost_claim(&self, id: &RecordId, write: &str) {
        self.metrics.lost_claims.inc();
        tracing::warn!(key_hash = %id.key_hash(), write, "claim was taken over meanwhile; write refused by its fence");
    }
}

/// Runs a fenced write until the store answers it, backing off between tries, for at most `lease`
/// (the claim's): past the lease the claim is stale and the next retry may take it over anyway, so the
/// claim is left to its lease instead of waiting on the store without end. Every failed try is counted
/// by the store handle. The store's answer, or its last error once the lease has run out.
async fn until_answered<F, Fut>(lease: Duration, mut write: F) -> Result<bool, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool, StoreError>>,
{
    let deadline = Instant::now() + lease;
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::BodyExt;

    use super::*;
    use crate::proxy::cache::Lookup;
    use crate::proxy::stage_tests::{self, SlowUpstream, Stages};
    use crate::store::stub::{Op, Reply, StubStore};

    /// The stages in front of `upstream`, with a lease of 30 s and a store timeout of 5 s (so a
    /// completion hold of 2 s).
    fn stages(upstream: &SlowUpstream, store: &Arc<StubStore>) -> Stages {
        let toml = format!(
            "[upstream]\nurl = \"http://{}\"\ntimeout = \"120s\"\n\
             [idempotency]\nlock_timeout = \"30s\"\n[store]\ntimeout = \"5s\"\n",
            upstream.addr
        );
        stage_tests::stages(&toml, store)
    }

    /// Executes a won claim of a new key and reads its answer to the end as a client would: its
    /// status, its body, and when its last byte came (by the tokio clock).
    async fn execute_and_read(stages: &Stages) -> (u16, Bytes, Instant) {
        let taken = stage_tests::taken_in(stages).await;
        let claimed = Claimed {
            id: taken.claim.id.clone(),
            lease: taken.claim.lease,
            route: taken.route.clone(),
            expires_at: SystemTime::now() + Duration::from_secs(600),
            fill: Some(Fill {
                fingerprint: taken.claim.fingerprint,
                deadline: Instant::now() + Duration::from_secs(600),
            }),
            fingerprint: taken.claim.fingerprint,
        };
        let request = stages
            .executor
            .request(taken.parts, taken.body, &stage_tests::peer());
        let (head, answer) = stage_tests::answer(&stages.metrics);
        let client = async {
            let (response, _) = answer.await.expect("an answer").expect("a response");
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.expect("a whole body");
            (status, body.to_bytes(), Instant::now())
        };
        let ((), read) = tokio::join!(stages.executor.execute(claimed, request, head), client);
        read
    }

    fn cached(stages: &Stages) -> bool {
        matches!(
            stages.cache.lookup("default:s", "k", &[7; 32]),
            Lookup::Replay(..)
        )
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_renew_the_lease_while_the_upstream_works_and_stop_with_the_completion() {
        let upstream = SlowUpstream::start(Duration::from_secs(25)).await;
        let store = StubStore::new();
        let stages = stages(&upstream, &store);
        let (status, body, _) = execute_and_read(&stages).await;
        assert_eq!((status, &body[..]), (201, &b"done"[..]));
        let beats = store.times(Op::Heartbeat);
        let completed = store.times(Op::Complete);
        assert_eq!(completed.len(), 1, "{:?}", store.calls());
        let stored = store.calls().into_iter().find_map(|call| call.stored);
        let stored = stored.expect("the completion carries the response");
        assert_eq!((stored.status, stored.body.as_deref()), (201, Some(&b"done"[..])));
        let arrived = upstream.arrivals()[0];
        let working = beats.iter().filter(|beat| **beat > arrived).count();
        assert!(
            working >= 2,
            "25 s of upstream work is renewed at least twice: {beats:?}"
        );
        for pair in beats.windows(2) {
            assert_eq!(
                pair[1] - pair[0],
                Duration::from_secs(10),
                "a third of the lease apart"
            );
        }
        assert!(beats.iter().all(|beat| *beat < completed[0]));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(
            store.count(Op::Heartbeat),
            beats.len(),
            "no beat after the completion"
        );
        stages.tracker.close();
        stages.tracker.wait().await;
    }

    /// A new key whose completion takes `storing`: how long after the completion began the client got
    /// the end of its response, and whether the record was then cached.
    async fn end_after_completion(storing: Duration) -> (Duration, Stages) {
        let upstream = SlowUpstream::start(Duration::ZERO).await;
        let store = StubStore::new();
        store.delay(Op::Complete, storing);
        let stages = stages(&upstream, &store);
        let (status, body, ended) = execute_and_read(&stages).await;
        assert_eq!((status, &body[..]), (201, &b"done"[..]));
        assert_eq!(store.count(Op::Complete), 1);
        (ended - store.times(Op::Complete)[0], stages)
    }

    #[tokio::test(start_paused = true)]
    async fn the_client_gets_the_end_of_its_response_once_its_record_is_stored() {
        let (waited, stages) = end_after_completion(Duration::from_secs(1)).await;
        assert_eq!(waited, Duration::from_secs(1), "the end waits for the store");
        assert_eq!(stages.metrics.completion_hold_expired.get(), 0);
        assert!(cached(&stages), "a stored record fills the replay cache");
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_slower_than_the_hold_lets_the_client_finish_first_and_still_completes() {
        let (waited, stages) = end_after_completion(Duration::from_secs(4)).await;
        assert_eq!(
            waited,
            Duration::from_secs(2),
            "the client waits for the store no longer than the hold"
        );
        assert_eq!(stages.metrics.completion_hold_expired.get(), 1);
        assert!(
            cached(&stages),
            "the completion went on after the hold, and was cached"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_refused_by_its_fence_is_a_lost_claim_and_is_never_cached() {
        let upstream = SlowUpstream::start(Duration::ZERO).await;
        let store = StubStore::new();
        store.always(Op::Complete, Reply::Done(false));
        let stages = stages(&upstream, &store);
        let (status, body, _) = execute_and_read(&stages).await;
        assert_eq!(
            (status, &body[..]),
            (201, &b"done"[..]),
            "the client still has its response"
        );
        assert_eq!(store.count(Op::Complete), 1, "a fenced-out write is not retried");
        assert_eq!(stages.metrics.lost_claims.get(), 1);
        assert!(
            !cached(&stages),
            "what another claim owns now is not replayed from here"
        );
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
    async fn a_write_gives_up_when_the_lease_runs_out() {
        let tries = std::cell::Cell::new(0);
        let started = Instant::now();
        let answer = until_answered(Duration::from_secs(5), || flaky(u32::MAX, &tries)).await;
        assert!(matches!(answer, Err(StoreError::Backend(_))), "{answer:?}");
        // Waits of 0.1, 0.2, 0.4, 0.8, 1.6 s; the next (2 s, capped) would end past the lease.
        assert_eq!(tries.get(), 6);
        assert_eq!(started.elapsed(), Duration::from_millis(3_100));
    }
}
