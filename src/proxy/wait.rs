//! Runs when a keyed request on a route with `on_in_flight = "wait"` finds its key in flight (processing
//! under a live lease, for the same request), on the request's own task (`keyed.rs`): instead of 409 it
//! waits for the original, holding its body but no `server.max_keyed_in_flight` permit, at most
//! `server.max_waiting` at once (beyond: 409 at once). It only waits: the keyed task sends the claim
//! statement of each re-check (`claim.rs`), one per wake-up, never by polling. Touches no store.
//!
//! A waiter re-checks its record when it is woken — the original completed, was released or held, here
//! or on another replica (`store/wake.rs`), or the listener for other replicas lost its connection —
//! and once when the lease it last saw runs out, since a dead original never announces anything (that
//! re-check takes the key over). A re-check tries the replay cache, then the keyed task sends one claim statement:
//! completed → the replay; released or stale → this request claims and executes it (of many waiters
//! exactly one wins, the others wait again); held → 502; still in flight → it waits again, within the
//! same deadline. `wait_timeout` after it began waiting it gets the 409 it would have got at once; at
//! shutdown, or when its client goes, at once.
//!
//! No settlement is missed between the claim statement that found the key in flight and the wait: the
//! request waiting to its record before that statement was sent, and each re-check marks earlier
//! wakes seen before its statement, so any settlement committed after the statement read the record
//! wakes it again.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::attach::{Attachments, Head, Joined};
use super::cache::ReplayCache;
use super::claim::{InFlight, in_flight_retry_after};
use super::dialect::sse::{self, Resume};
use super::replay;
use crate::body::ProxyBody;
use crate::config::OnInFlight;
use crate::error::ProxyError;
use crate::metrics::{Metrics, Outcome, WaitResult};

/// The least time before a lease re-check: a lease the store reports as (nearly) over is re-checked
/// after this, not in a loop.
const LEASE_RECHECK_MIN: Duration = Duration::from_millis(50);

/// The wait stage: waits for the record of a request whose key is in flight, or follows its execution.
#[derive(Clone)]
pub(crate) struct Waits {
    /// One permit per request waiting for a key in flight (`server.max_waiting`), shared by every worker.
    waiting: Arc<Semaphore>,
    /// Cancelled when the proxy begins shutting down; waiting requests are answered then.
    shutdown: CancellationToken,
    cache: Arc<ReplayCache>,
    /// The executions of this process that duplicates may follow.
    attachments: Arc<Attachments>,
    metrics: Metrics,
}

/// How one wait ended.
pub(crate) enum Waited {
    /// The record may have settled, or the lease seen ran out: the keyed task claims again.
    Recheck(Box<InFlight>),
    /// The request has been answered.
    Answered(WaitResult),
}

/// How following an execution ended, short of the record's fate.
enum Following {
    /// The request got the head, and follows the body.
    Attached,
    /// The execution ended without a response to follow: the request goes back to waiting.
    Back(Box<InFlight>),
    /// The wait is over without an answer: 409.
    Stop(Box<InFlight>, WaitResult),
}

/// Why a waiter woke up.
enum Woken {
    /// Its record may have settled, or the lease it saw ran out: re-check.
    Recheck,
    /// The wait is over without an answer (`wait_timeout`, shutdown, or the client went away): 409.
    Stop(WaitResult),
}

impl Waits {
    /// The waits over `waiting`, the process's seats for waiting requests (`server.max_waiting`).
    pub(crate) fn new(
        waiting: Arc<Semaphore>,
        cache: Arc<ReplayCache>,
        attachments: Arc<Attachments>,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Waits {
        Waits {
            waiting,
            shutdown,
            cache,
            attachments,
            metrics,
        }
    }

    /// A place among the requests that wait for `in_flight`, until its route's `wait_timeout`; `None`
    /// when `server.max_waiting` are waiting already: then it has been answered 409 (counted).
    pub(crate) fn enter(&self, in_flight: Box<InFlight>) -> Result<(Waiting, Box<InFlight>), ()> {
        let Ok(permit) = self.waiting.clone().try_acquire_owned() else {
            tracing::debug!(key_hash = %in_flight.keyed.ticket.claim.id.key_hash(), "too many requests waiting; 409");
            self.ended(WaitResult::RejectedFull);
            conflict(in_flight);
            return Err(());
        };
        let deadline = Instant::now() + in_flight.keyed.ticket.route.policy.claim.wait_timeout;
        Ok((Waiting::enter(&self.metrics, permit, deadline), in_flight))
    }

    /// A seat among the requests that wait, until `deadline`, for a request that carries many keys
    /// (one for all its items): counted in `idemproxy_waiting_requests` while held. `None` when
    /// `server.max_waiting` requests already wait (counted as such).
    pub(crate) fn seat(&self, deadline: Instant) -> Option<Waiting> {
        let Ok(permit) = self.waiting.clone().try_acquire_owned() else {
            self.ended(WaitResult::RejectedFull);
            return None;
        };
        Some(Waiting::enter(&self.metrics, permit, deadline))
    }

    /// Cancelled when the proxy begins shutting down.
    pub(crate) fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Counts a wait by how it ended.
    pub(crate) fn ended(&self, result: WaitResult) {
        self.metrics.wait_ended(result);
    }

    /// Waits once for the record of `in_flight` to settle: on a route that attaches, follows the
    /// execution wherever this process runs it, else sleeps until woken, then tries the replay cache.
    pub(crate) async fn wait(&self, mut in_flight: Box<InFlight>, waiting: &mut Waiting) -> Waited {
        if let Some(joined) = self.joinable(&in_flight) {
            in_flight = match self.follow(in_flight, joined, waiting).await {
                Following::Attached => return Waited::Answered(WaitResult::Attached),
                Following::Stop(in_flight, result) => {
                    conflict(in_flight);
                    return Waited::Answered(result);
                }
                // The execution is over: its record has settled, or soon will.
                Following::Back(in_flight) => in_flight,
            };
        } else if let Woken::Stop(result) = self.until_woken(&mut in_flight, waiting.deadline).await {
            conflict(in_flight);
            return Waited::Answered(result);
        }
        let ticket = &in_flight.keyed.ticket;
        let request = (&ticket.parts.headers, &ticket.dialect);
        let Some(answer) =
            replay::from_cache(&self.cache, &ticket.claim, &ticket.route, request, &self.metrics)
        else {
            return Waited::Recheck(in_flight);
        };
        let result = match answer.is_ok() {
            true => WaitResult::Replayed,
            false => WaitResult::Refused,
        };
        in_flight.keyed.answer.send(answer);
        Waited::Answered(result)
    }

    /// The execution this request may follow: on a route that attaches, in a dialect that may, where
    /// this process runs it for the same request.
    fn joinable(&self, in_flight: &InFlight) -> Option<Joined> {
        let ticket = &in_flight.keyed.ticket;
        let attaches =
            ticket.route.policy.claim.on_in_flight == OnInFlight::Attach && ticket.dialect.may_attach();
        let claim = &ticket.claim;
        attaches
            .then(|| self.attachments.join(&claim.id, &claim.fingerprint))
            .flatten()
    }

    /// Follows the execution the request joined: once its head comes, the request is answered with it
    /// and a body that follows the response to its end, holding the request's place among those that
    /// wait until then.
    async fn follow(
        &self,
        mut in_flight: Box<InFlight>,
        mut joined: Joined,
        waiting: &mut Waiting,
    ) -> Following {
        let head = tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => return Following::Stop(in_flight, WaitResult::Shutdown),
            _ = in_flight.keyed.answer.closed() => return Following::Stop(in_flight, WaitResult::ClientGone),
            _ = sleep_until(waiting.deadline) => return Following::Stop(in_flight, WaitResult::Timeout),
            head = joined.head() => head,
        };
        let Some(head) = head else {
            return Following::Back(in_flight);
        };
        let place = Attached::enter(&self.metrics, waiting.permit.take());
        let request = &in_flight.keyed.ticket.parts.headers;
        let resume = sse::last_event_id(request)
            .filter(|_| sse::resumable(&head.headers))
            .map(Resume::after);
        let response = followed(&head, joined, place, resume);
        in_flight.keyed.answer.send(Ok((response, Outcome::Replayed)));
        Following::Attached
    }

    /// Sleeps until the next reason to re-check or to stop. Shutdown and a gone client come first, then
    /// the deadline, so a wake that comes with them does not start another round.
    async fn until_woken(&self, in_flight: &mut InFlight, deadline: Instant) -> Woken {
        let lease_over = in_flight.lease_end.max(Instant::now() + LEASE_RECHECK_MIN);
        let InFlight { keyed, waiter, .. } = in_flight;
        tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => Woken::Stop(WaitResult::Shutdown),
            _ = keyed.answer.closed() => Woken::Stop(WaitResult::ClientGone),
            _ = sleep_until(deadline) => Woken::Stop(WaitResult::Timeout),
            _ = waiter.woken() => Woken::Recheck,
            _ = sleep_until(lease_over) => Woken::Recheck,
        }
    }
}

/// Answers a waiter 409 `key-in-flight`, as if it had not waited, its `Retry-After` from the lease it
/// last saw. A client that has gone has it counted all the same.
fn conflict(in_flight: Box<InFlight>) {
    let left = in_flight.lease_end.saturating_duration_since(Instant::now());
    let hint = in_flight.keyed.ticket.route.policy.claim.in_flight_retry_after;
    let retry_after = in_flight_retry_after(left, hint);
    in_flight
        .keyed
        .answer
        .send(Err(ProxyError::KeyInFlight { retry_after }));
}

/// A request counted in `idemproxy_waiting_requests`, holding its `server.max_waiting` permit until it
/// stops waiting, or hands it to the response it follows; and when its wait ends (`wait_timeout`).
pub(crate) struct Waiting {
    metrics: Metrics,
    permit: Option<OwnedSemaphorePermit>,
    deadline: Instant,
}

impl Waiting {
    fn enter(metrics: &Metrics, permit: OwnedSemaphorePermit, deadline: Instant) -> Waiting {
        metrics.waiting.inc();
        Waiting {
            metrics: metrics.clone(),
            permit: Some(permit),
            deadline,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.metrics.waiting.dec();
    }
}

/// A request following an execution, counted in `idemproxy_attached_requests` and holding its
/// `server.max_waiting` permit until its response ends, its client goes, or it is cut off (the log it
/// follows holds it, so a body nothing polls any more gives it back too).
struct Attached {
    metrics: Metrics,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Attached {
    fn enter(metrics: &Metrics, permit: Option<OwnedSemaphorePermit>) -> Attached {
        metrics.attached.inc();
        Attached {
            metrics: metrics.clone(),
            _permit: permit,
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.metrics.attached.dec();
    }
}

/// The response a request that follows an execution gets: its head, and a body that follows it (from
/// after the event `resume` names, if any).
fn followed(
    head: &Head,
    joined: Joined,
    place: Attached,
    resume: Option<Resume>,
) -> http::Response<ProxyBody> {
    let resumed = resume.is_some();
    let mut response = http::Response::new(joined.body(place, resume).boxed());
    *response.status_mut() = head.status;
    *response.headers_mut() = head.headers.clone();
    if resumed {
        response.headers_mut().remove(http::header::CONTENT_LENGTH);
    }
    response
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::proxy::answer::Handled;
    use crate::proxy::keyed::KeyedTask;
    use crate::proxy::stage_tests::{self, Stages};
    use crate::store::stub::{Op, Reply, StubStore};
    use crate::store::wake::RecordTag;
    use crate::store::{ClaimResult, Existing, StoredResponse};

    /// The stages on a route that waits at most 5 s, in front of an upstream that refuses every
    /// connection.
    fn stages(store: &Arc<StubStore>) -> Stages {
        let toml = "[upstream]\nurl = \"http://127.0.0.1:1\"\n[idempotency]\nlock_timeout = \"30s\"\n\
                    on_in_flight = \"wait\"\nwait_timeout = \"5s\"\n";
        stage_tests::stages(toml, store)
    }

    fn in_flight() -> Reply {
        Reply::Claim(ClaimResult::Held(Existing::Processing {
            same_fingerprint: true,
            lease_remaining: Duration::from_secs(20),
        }))
    }

    /// Starts a new request with key `k` on its own keyed task, as the spine does; where its answer
    /// comes.
    async fn start(stages: &Stages, keyed: &Arc<KeyedTask>) -> tokio::sync::oneshot::Receiver<Handled> {
        let ticket = stage_tests::ticket(stages).await;
        let permit = stages.permits.take(&ticket.peer).expect("a free permit");
        let (head, answer) = stage_tests::answer(&stages.metrics);
        tokio::spawn(keyed.clone().run(ticket, head, permit));
        answer
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_woken_by_the_settlement_claims_again_at_once_and_gets_the_replay() {
        let store = StubStore::new();
        store.then(Op::Claim, in_flight()).then(
            Op::Claim,
            Reply::Claim(ClaimResult::Held(Existing::Completed {
                same_fingerprint: true,
                response: StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: Some(Bytes::from_static(b"done")),
                },
                expires_in: Duration::from_secs(60),
                token: uuid::Uuid::nil(),
            })),
        );
        let stages = stages(&store);
        let keyed = stages.keyed(CancellationToken::new());
        let answer = start(&stages, &keyed).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(store.count(Op::Claim), 1, "waiting, not polling");
        stages.waiters.wake(RecordTag::of("default:s", "k"));
        let (response, _) = answer.await.unwrap().expect("the replay");
        assert_eq!(response.status(), 201);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"done");
        let claims = store.times(Op::Claim);
        assert_eq!(
            claims[1] - claims[0],
            Duration::from_secs(2),
            "claimed again when woken"
        );
        assert_eq!(stages.metrics.waiting.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_nobody_wakes_gets_the_conflict_at_its_wait_timeout() {
        let store = StubStore::new();
        store.always(Op::Claim, in_flight());
        let stages = stages(&store);
        let keyed = stages.keyed(CancellationToken::new());
        let started = Instant::now();
        let answer = start(&stages, &keyed).await.await.unwrap();
        assert!(
            matches!(answer, Err(ProxyError::KeyInFlight { .. })),
            "{answer:?}"
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert_eq!(
            store.count(Op::Claim),
            1,
            "no re-check before the lease it saw runs out"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_is_answered_at_once_when_the_proxy_shuts_down() {
        let store = StubStore::new();
        store.always(Op::Claim, in_flight());
        let stages = stages(&store);
        let shutdown = CancellationToken::new();
        let keyed = stages.keyed(shutdown.clone());
        let answer = start(&stages, &keyed).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let started = Instant::now();
        shutdown.cancel();
        let answer = answer.await.unwrap();
        assert!(
            matches!(answer, Err(ProxyError::KeyInFlight { .. })),
            "{answer:?}"
        );
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
