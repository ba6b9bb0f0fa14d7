//! Runs after a claim is won, on the keyed task (`keyed.rs`), so that a client who disconnects cannot
//! cancel it. It sends the request upstream (`upstream.rs`) under a heartbeat (`execute/heartbeat.rs`),
//! asks the request's dialect what the answer's head and end mean for the key (`dialect.rs`: store,
//! release, unknown), relays the response to the client while capturing it (`execute/relay.rs`,
//! `execute/capture.rs`), and finally completes, releases or holds the record, saying which ([`Fate`])
//! for the keyed task to settle. It owns the upstream body until its end; it touches the store only
//! through fenced writes, each tried for at most the claim's lease.
//!
//! The response is not complete for the client before its record is stored: the relay holds back
//! whatever completes it — the frame that brings the body to its declared length, the end of a chunked
//! or HTTP/2 body, or, for an empty body, the head itself — until the completion (and the replay cache's
//! copy) is done, for at most `min(store.timeout, 2 s)`. So a client that has read the whole response
//! and retries at once gets the replay, never a 409.
//!
//! Whoever waits for the record is told by the keyed task once the execution has ended (`settle.rs`).

pub(crate) mod capture;
mod channel;
pub(crate) mod heartbeat;
mod relay;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, Request, request};
use tokio::time::Instant;
use tracing::Instrument;

use self::capture::{Capture, CaptureBudget};
use self::heartbeat::Heartbeat;
use self::relay::{Relay, Relayed, Taps, ToStore, Withheld};
use super::answer::{Answer, Handled};
use super::attach::log::Log;
use super::attach::{Attachments, Publisher};
use super::budget::ReservedBody;
use super::cache::{Fill, ReplayCache};
use super::dialect::{Dialect, OnHead, Verdict};
use super::downstream::Downstream;
use super::expiry;
use super::tap::Tap;
use super::upstream::{Upstream, stream_response};
use crate::body::ProxyBody;
use crate::config::{Config, OnInFlight, OnUnknownOutcome, Route};
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
    /// Bytes of keyed responses being captured for storage, and each scope's share, shared by every
    /// worker.
    captures: Arc<CaptureBudget>,
    /// Longest a client waits for its record to be stored before it gets the end of its response.
    completion_hold: Duration,
    metrics: Metrics,
    /// Whether store writes are traced (`traces.enabled`).
    traced: bool,
    /// The executions duplicates may follow (`on_in_flight = "attach"`), shared by every worker.
    attachments: Arc<Attachments>,
}

/// What an [`Executor`] is made of beside the configuration.
pub(crate) struct ExecutorParts {
    pub(crate) store: StoreHandle,
    pub(crate) upstream: Upstream,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) metrics: Metrics,
    pub(crate) attachments: Arc<Attachments>,
    /// Bytes of keyed responses being captured, and each scope's share: one budget for the process.
    pub(crate) captures: Arc<CaptureBudget>,
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
    /// The protocol the request speaks, which says what its answer means for the key.
    pub(crate) dialect: Dialect,
}

/// What became of a won claim's record once its execution ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// The response is stored.
    Completed,
    /// The key was given back: a retry executes again.
    Released,
    /// The record is marked unknown (`on_unknown_outcome = "hold"`).
    Held,
    /// Left to its lease: an unknown outcome a retry after the lease executes again, or a write the
    /// store did not answer in time.
    LeftToLease,
    /// A write refused by its fence: the claim was taken over meanwhile.
    Lost,
}

impl Fate {
    /// Whether the record settled, so whoever waits for it is to be told.
    pub(crate) fn wakes(self) -> bool {
        matches!(self, Fate::Completed | Fate::Released | Fate::Held)
    }
}

/// What an execution leaves: the record's fate, and the end of the response its client is still owed
/// once whoever waits for the record has been told (a whole answer whose status the dialect read in
/// its trailers, released or held: the waiters go first, since the client may take its time).
pub(crate) struct Executed {
    pub(crate) fate: Fate,
    pub(crate) rest: Rest,
}

/// The end of a response its client gets after the record's waiters are told; nothing for most.
pub(crate) struct Rest(Option<(Withheld, Metrics, RecordId)>);

impl Rest {
    /// Nothing is left for the client.
    pub(crate) fn none() -> Rest {
        Rest(None)
    }

    /// Lets the client have the rest of its response.
    pub(crate) async fn hand_over(self) {
        if let Some((withheld, metrics, id)) = self.0 {
            withheld.hand_over(&metrics, &id).await;
        }
    }
}

impl Fate {
    /// The execution's end, with nothing left for the client.
    fn alone(self) -> Executed {
        Executed {
            fate: self,
            rest: Rest::none(),
        }
    }
}

/// What becomes of one item's record of a request that carries many keys ([`Executor::write_item`]).
pub(crate) enum ItemWrite<'a> {
    /// Its answer is stored.
    Complete(StoredResponse),
    /// Its key is given back: a retry executes it.
    Release,
    /// It may have run without an answer coming back (why, for the log): held where the route holds
    /// unknown outcomes, else left to its lease.
    Unknown(&'a str),
}

/// How the exchange with the upstream ended, before the record is written.
enum Ended {
    /// A whole answer to store, and what its client gets once it is stored.
    Whole(ToStore, Withheld),
    /// Not processed: the key is given back, then the client gets what it is owed.
    Released(Owed),
    /// The upstream may have acted without a full answer coming back (why, for the log).
    Unknown(Owed, String),
}

/// What the client is still owed when the record is written.
enum Owed {
    /// Its whole answer.
    Answer(Answer, Handled),
    /// The end of its relayed response.
    End(Withheld),
    /// Nothing: its stream was already failed.
    Nothing,
}

impl Owed {
    /// Gives the client what it is owed.
    async fn pay(self, metrics: &Metrics, id: &RecordId) {
        match self {
            Owed::Answer(answer, handled) => {
                answer.send(handled);
            }
            Owed::End(withheld) => withheld.hand_over(metrics, id).await,
            Owed::Nothing => {}
        }
    }
}

impl Executor {
    pub(crate) fn new(config: &Config, parts: ExecutorParts) -> Executor {
        let ExecutorParts {
            store,
            upstream,
            cache,
            metrics,
            attachments,
            captures,
        } = parts;
        Executor {
            relay: Relay::new(config.server.write_timeout, upstream.timeout(), metrics.clone()),
            captures,
            store,
            upstream,
            cache,
            completion_hold: config.store.timeout.min(COMPLETION_HOLD_MAX),
            metrics,
            traced: otlp::traced(&config.traces),
            attachments,
        }
    }

    /// The same stage for another worker thread: its pool of upstream connections and its store handle.
    pub(crate) fn for_worker(&self, upstream: Upstream, store: StoreHandle) -> Executor {
        Executor {
            upstream,
            store,
            ..self.clone()
        }
    }

    /// The request `parts` and `body`, read whole, as they go upstream from `peer` in its `dialect`.
    pub(crate) fn request(
        &self,
        mut parts: request::Parts,
        body: ReservedBody,
        (peer, dialect): (&Downstream, &Dialect),
    ) -> Request<ProxyBody> {
        dialect.to_upstream(&mut parts.headers, self.upstream.timeout());
        self.upstream.request_whole(parts, body, peer)
    }

    /// Executes a claimed request to the end, whatever happens to the client, and says what became of
    /// its record (and what its client still gets once the record's waiters are told). The response
    /// head (or the error) goes to `answer`.
    pub(crate) async fn execute(
        &self,
        claim: Claimed,
        request: Request<ProxyBody>,
        answer: Answer,
    ) -> Executed {
        let heartbeat = Heartbeat::new(&self.store, &claim.id, claim.lease, &self.metrics);
        // The execution's future is many kilobytes: on the heap, it is written once rather than copied
        // into each future that holds it, and the keyed task that every keyed request spawns (and that
        // tokio copies as it starts and finishes) stays small.
        let executed = Box::pin(self.executed(&claim, request, answer, &heartbeat));
        heartbeat.beside(executed).await
    }

    /// [`Executor::execute`] beside its `heartbeat`: the exchange, then the record's write. The
    /// heartbeat stops before a release or a hold, and once a completion is written.
    async fn executed(
        &self,
        claim: &Claimed,
        request: Request<ProxyBody>,
        answer: Answer,
        heartbeat: &Heartbeat<'_>,
    ) -> Executed {
        let ended = self.exchange(claim, request, answer).await;
        if !matches!(ended, Ended::Whole(..)) {
            heartbeat.stop();
        }
        match ended {
            Ended::Whole(record, withheld) => self.finish(claim, record, withheld, heartbeat).await.alone(),
            Ended::Released(owed) => self.release(claim, owed).await,
            Ended::Unknown(owed, why) => self.unknown(claim, owed, &why).await,
        }
    }

    /// The rest of a response, for its client once the record's waiters are told.
    fn rest(&self, claim: &Claimed, withheld: Withheld) -> Rest {
        Rest(Some((withheld, self.metrics.clone(), claim.id.clone())))
    }

    /// Sends the request and relays the answer, as far as the answer decides what becomes of the key:
    /// its head (a failure to deliver, a `101`, a status released, a gRPC status), then its end.
    async fn exchange(&self, claim: &Claimed, request: Request<ProxyBody>, answer: Answer) -> Ended {
        // Followable from before it is sent, so that a duplicate that comes meanwhile gets its head.
        let publisher = (claim.route.policy.claim.on_in_flight == OnInFlight::Attach)
            .then(|| self.attachments.publish(&claim.id, claim.fingerprint));
        let response = match self.upstream.send(request).await {
            Ok(response) => response,
            Err(failure) if failure.never_delivered() => {
                return Ended::Released(Owed::Answer(answer, Err(failure.into_error())));
            }
            Err(failure) => {
                let error = failure.into_error();
                let why = error.to_string();
                return Ended::Unknown(Owed::Answer(answer, Err(error)), why);
            }
        };
        let rules = &claim.route.policy.store;
        let as_is =
            |answer, response| Owed::Answer(answer, Ok((stream_response(response), Outcome::Executed)));
        match claim
            .dialect
            .on_head(rules, response.status(), response.headers())
        {
            OnHead::Relay => {}
            OnHead::Release => return Ended::Released(as_is(answer, response)),
            OnHead::Unknown(why) => return Ended::Unknown(as_is(answer, response), why),
            OnHead::Refused(error) => {
                let why = error.to_string();
                return Ended::Unknown(Owed::Answer(answer, Err(error)), why);
            }
        }
        let stamp = |headers: &mut HeaderMap| expiry::stamp(headers, rules, Some(claim.expires_at));
        let taps = self.taps(claim, answer, publisher);
        match self.relay.run(&claim.id, rules, response, taps, stamp).await {
            Relayed::Whole(record, withheld) => {
                match claim.dialect.on_end(rules, record.status, &record.headers) {
                    Verdict::Store => Ended::Whole(record, withheld),
                    Verdict::Release => Ended::Released(Owed::End(withheld)),
                    Verdict::Unknown(why) => Ended::Unknown(Owed::End(withheld), why),
                }
            }
            Relayed::Broken {
                mut client,
                error,
                failure,
            } => {
                // The client's stream is aborted (never passed off as complete), or if it has not had
                // the head yet it gets `failure`.
                tracing::warn!(key_hash = %claim.id.key_hash(), %error, "upstream body broke off; outcome unknown");
                let why = format!("upstream body broke off: {error}");
                client.fail(error, failure);
                Ended::Unknown(Owed::Nothing, why)
            }
        }
    }

    /// Where the relay hands the response: the client's `answer`, the capture for the record (writing to
    /// the log the duplicates read, where the execution is followable), and the `publisher` of it.
    fn taps(&self, claim: &Claimed, answer: Answer, publisher: Option<Publisher>) -> Taps {
        let (log, followers) = match publisher {
            Some(publisher) => (publisher.log().clone(), Some(Box::new(publisher) as Box<dyn Tap>)),
            None => (Log::unfollowed(), None),
        };
        let limit = claim.route.policy.store.max_stored_response;
        Taps {
            answer,
            capture: Capture::new(limit, &self.captures, &claim.id.scope, log),
            followers,
        }
    }

    /// The upstream may have acted on the request, but no full answer came back. With
    /// `on_unknown_outcome = "retry"` the claim is left to its lease (a retry after it executes again);
    /// with `"hold"` the record is marked unknown first, so a retry sent right after this answer is
    /// refused until an operator releases the key. A client owed its answer waits for the hold at most
    /// `completion_hold`; one owed the end of a relayed answer gets it once the key is held and its
    /// waiters told. `why` says what happened, for the log.
    async fn unknown(&self, claim: &Claimed, owed: Owed, why: &str) -> Executed {
        if !self.holds_unknown(claim, why) {
            owed.pay(&self.metrics, &claim.id).await;
            return Fate::LeftToLease.alone();
        }
        if let Owed::End(withheld) = owed {
            let fate = self.hold(claim).await;
            let rest = self.rest(claim, withheld);
            return Executed { fate, rest };
        }
        let holding = self.hold(claim);
        tokio::pin!(holding);
        let in_time = tokio::time::timeout(self.completion_hold, &mut holding).await;
        owed.pay(&self.metrics, &claim.id).await;
        match in_time {
            Ok(fate) => fate,
            Err(_) => holding.await,
        }
        .alone()
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

    /// Marks the record unknown, trying for up to the lease while the store does not answer.
    async fn hold(&self, claim: &Claimed) -> Fate {
        let id = &claim.id;
        match until_answered(claim.lease, || self.store.hold(id)).await {
            Ok(true) => Fate::Held,
            Ok(false) => self.lost_claim(id, "hold"),
            Err(error) => {
                tracing::error!(key_hash = %id.key_hash(), %error, "holding the key failed; claim left to its lease");
                Fate::LeftToLease
            }
        }
    }

    /// Stores the response, then lets the client have the rest of it. The client waits for the store at most
    /// `completion_hold`; past it the client gets the rest and the completion goes on (counted).
    async fn finish(
        &self,
        claim: &Claimed,
        record: ToStore,
        withheld: Withheld,
        heartbeat: &Heartbeat<'_>,
    ) -> Fate {
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
        withheld.hand_over(&self.metrics, id).await;
        let fate = match in_time {
            Ok(fate) => fate,
            Err(_) => storing.await,
        };
        heartbeat.stop();
        // The log keeps the charge while duplicates still read the bytes.
        drop(captured.reservation);
        fate
    }

    /// Completes the record and, once it is stored, puts it in the replay cache.
    async fn store_and_remember(&self, claim: &Claimed, stored: StoredResponse) -> Fate {
        let id = &claim.id;
        let fate = self.complete(claim, &stored).await;
        if fate == Fate::Completed
            && let Some(fill) = &claim.fill
        {
            self.cache
                .insert(&id.scope, &id.key, fill.fingerprint, stored, fill.deadline);
        }
        fate
    }

    /// Stores the response under the claim's fence, retrying a store that does not answer for up to the lease
    /// (see [`until_answered`]).
    async fn complete(&self, claim: &Claimed, stored: &StoredResponse) -> Fate {
        let id = &claim.id;
        let span = otlp::settlement(self.traced, true);
        let writing = until_answered(claim.lease, || self.store.complete(id, stored));
        match writing.instrument(span.clone()).await {
            Ok(true) => Fate::Completed,
            Ok(false) => {
                otlp::failed(&span, "fenced");
                self.lost_claim(id, "completion")
            }
            Err(error) => {
                otlp::failed(&span, "store_error");
                tracing::error!(key_hash = %id.key_hash(), %error, "completion failed; claim left to its lease");
                Fate::LeftToLease
            }
        }
    }

    /// Releases the claim before the client gets what it is `owed`, so that a retry sent right after
    /// finds the key free. When the store is away a client owed its answer is not kept waiting on it:
    /// it is answered at once, and the release is tried again afterwards (see [`until_answered`]). One
    /// owed the end of a relayed answer gets it once the key is released and its waiters told.
    async fn release(&self, claim: &Claimed, owed: Owed) -> Executed {
        if let Owed::End(withheld) = owed {
            let fate = self.release_until_answered(claim).await;
            let rest = self.rest(claim, withheld);
            return Executed { fate, rest };
        }
        self.release_then_pay(claim, owed).await.alone()
    }

    /// [`Executor::release`] for a client owed its answer, or nothing.
    async fn release_then_pay(&self, claim: &Claimed, owed: Owed) -> Fate {
        let id = &claim.id;
        let span = otlp::settlement(self.traced, false);
        match self.store.release(id).instrument(span.clone()).await {
            Ok(released) => {
                let fate = match released {
                    true => Fate::Released,
                    false => {
                        otlp::failed(&span, "fenced");
                        self.lost_claim(id, "release")
                    }
                };
                owed.pay(&self.metrics, id).await;
                fate
            }
            Err(error) => {
                otlp::failed(&span, "store_error");
                tracing::warn!(key_hash = %id.key_hash(), %error, "release failed; answering, then retrying");
                owed.pay(&self.metrics, id).await;
                self.release_until_answered(claim).await
            }
        }
    }

    /// Releases the claim, trying for up to the lease while the store does not answer.
    async fn release_until_answered(&self, claim: &Claimed) -> Fate {
        let id = &claim.id;
        match until_answered(claim.lease, || self.store.release(id)).await {
            Ok(true) => Fate::Released,
            Ok(false) => self.lost_claim(id, "release"),
            Err(error) => {
                tracing::warn!(key_hash = %id.key_hash(), %error, "release failed; claim left to its lease");
                Fate::LeftToLease
            }
        }
    }

    /// The upstream its executions go to.
    pub(crate) fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Nothing yet of the budget of keyed responses held for storage (`server.max_buffered_responses`
    /// and the per-scope share), for an answer read whole by a request of `scope` that carries many keys.
    pub(crate) fn answer_hold(&self, scope: &str) -> capture::Reservation {
        capture::Reservation::none(&self.captures, scope)
    }

    /// Writes what became of one item of a request that carries many keys (`many.rs`), under the item's
    /// fence, trying for up to its `lease` while the store does not answer: its answer stored, its key
    /// given back, or its outcome unknown (held with `on_unknown_outcome = "hold"`, else left to its
    /// lease). Counted and logged as a lone request's write is.
    pub(crate) async fn write_item(
        &self,
        id: &RecordId,
        (lease, hold): (Duration, bool),
        write: &ItemWrite<'_>,
    ) -> Fate {
        let (name, writing) = match write {
            ItemWrite::Complete(stored) => {
                if stored.body.is_none() {
                    self.metrics.not_retained.inc();
                }
                (
                    "completion",
                    until_answered(lease, || self.store.complete(id, stored)).await,
                )
            }
            ItemWrite::Release => ("release", until_answered(lease, || self.store.release(id)).await),
            ItemWrite::Unknown(why) => {
                self.metrics.unknown_outcomes.inc();
                let key_hash = id.key_hash();
                if !hold {
                    tracing::warn!(%key_hash, error = why, "upstream outcome unknown; claim left to its lease");
                    return Fate::LeftToLease;
                }
                tracing::warn!(%key_hash, error = why, "upstream outcome unknown; holding the key until released");
                ("hold", until_answered(lease, || self.store.hold(id)).await)
            }
        };
        match (name, writing) {
            ("completion", Ok(true)) => Fate::Completed,
            ("release", Ok(true)) => Fate::Released,
            (_, Ok(true)) => Fate::Held,
            (name, Ok(false)) => self.lost_claim(id, name),
            (name, Err(error)) => {
                tracing::error!(key_hash = %id.key_hash(), %error, write = name, "store write failed; claim left to its lease");
                Fate::LeftToLease
            }
        }
    }

    /// Counts a write refused by its fence.
    fn lost_claim(&self, id: &RecordId, write: &str) -> Fate {
        self.metrics.lost_claims.inc();
        tracing::warn!(key_hash = %id.key_hash(), write, "claim was taken over meanwhile; write refused by its fence");
        Fate::Lost
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
        let taken = stage_tests::ticket(stages).await;
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
            dialect: taken.dialect.clone(),
        };
        let request = stages
            .executor
            .request(taken.parts, taken.body, (&taken.peer, &taken.dialect));
        let (head, answer) = stage_tests::answer(&stages.metrics);
        let client = async {
            let (response, _) = answer.await.expect("an answer").expect("a response");
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.expect("a whole body");
            (status, body.to_bytes(), Instant::now())
        };
        let executor = async {
            let executed = stages.executor.execute(claimed, request, head).await;
            executed.rest.hand_over().await;
        };
        let ((), read) = tokio::join!(executor, client);
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
