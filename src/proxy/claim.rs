//! Runs once a keyed request has been taken in and missed the replay cache, on a task of its own: sends
//! the claim statement, feeds the replay cache from what it found, and decides with the decision table of
//! the design (execute, replay, 409, 422, 502 for a held outcome); a won claim goes on to `execute.rs`, a
//! completed one to `replay.rs`, and a store that did not answer to fail_closed or fail_open
//! (`passthrough.rs`). On a route with `on_in_flight = "wait"`, a key found in flight is handed back
//! instead of refused, for `wait.rs` to wait and claim again through [`Claims::claim_round`]. The table
//! itself, [`decide`], is pure apart from logging and counting.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::HeaderValue;
use tokio::time::Instant;
use tracing::Instrument;

use super::answer::Answer;
use super::answer::Handled;
use super::cache::{Fill, ReplayCache};
use super::execute::{Claimed, Executor};
use super::execute::{Fate, Rest};
use super::intake::Ticket;
use super::passthrough::Forward;
use super::permit::{KeyedPermit, KeyedPermits};
use super::upstream::Upstream;
use super::{expiry, replay};
use crate::config::{Config, Route};
use crate::error::ProxyError;
use crate::headers::ATTEMPT_HEADER;
use crate::metrics::{Metrics, Outcome};
use crate::otlp;
use crate::store::wake::{RecordTag, Waiter, Waiters};
use crate::store::{
    ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, StoreError, StoreHandle, StoredResponse,
};

/// The claim stage: sends claim statements and decides on their answers, handing a won claim to the
/// execute stage and a store that did not answer to the forward stage.
#[derive(Clone)]
pub(crate) struct Claims {
    store: StoreHandle,
    cache: Arc<ReplayCache>,
    permits: KeyedPermits,
    /// Bound on one store operation, the first wait before an orphaned claim is given back.
    store_timeout: Duration,
    /// Where requests on routes that wait start waiting for their record to settle.
    waiters: Arc<Waiters>,
    metrics: Metrics,
    /// Whether claim statements are traced (`traces.enabled`).
    traced: bool,
    executor: Executor,
    forward: Forward,
}

/// What [`Claims`] is made of beside the configuration.
pub(crate) struct ClaimsParts {
    pub(crate) store: StoreHandle,
    pub(crate) cache: Arc<ReplayCache>,
    pub(crate) permits: KeyedPermits,
    pub(crate) waiters: Arc<Waiters>,
    pub(crate) metrics: Metrics,
    pub(crate) executor: Executor,
    pub(crate) forward: Forward,
}

/// A keyed request between its claim statements: its ticket, and where its answer goes.
pub(crate) struct Keyed {
    /// The request and the claim it makes.
    pub(crate) ticket: Ticket,
    /// Where its answer goes.
    pub(crate) answer: Answer,
}

/// A request on a route that waits whose key was found in flight (processing under a live lease, for
/// the same request): handed to `wait.rs`.
pub(crate) struct InFlight {
    /// The request, untouched, body included: it may still have to be executed.
    pub(crate) keyed: Keyed,
    /// When the lease seen by the claim statement runs out, by this process's clock (no earlier than by
    /// the store's, since the store measured the lease left before its answer travelled here).
    pub(crate) lease_end: Instant,
    /// The request's interest in its record's settlement, made before the statement was sent.
    pub(crate) waiter: Waiter,
}

/// What one claim statement led to.
pub(crate) enum Round {
    /// The key is in flight and the request may wait (it came with a waiter).
    InFlight(Box<InFlight>),
    /// The claim was won: the request is to be executed ([`Claims::execute_won`]).
    Won(Box<Won>),
    /// Answered from the stored response.
    Replayed,
    /// Answered with a refusal, or as the store being unavailable.
    Refused,
}

/// A claim this request won, not executed yet.
pub(crate) struct Won {
    keyed: Keyed,
    /// An instant before the claim statement was sent.
    started: Instant,
    /// When the record expires, as the claim left it (by this process's clock, never later than by the
    /// store's).
    expires_at: SystemTime,
    /// The replay cache entry the completion may make.
    fill: Option<Fill>,
    /// The request's keyed permit, if it holds one.
    permit: Option<KeyedPermit>,
    /// Which execution of the key this is.
    attempt: Attempt,
}

/// What became of a won claim's record, for the keyed task to settle (`keyed.rs`).
pub(crate) struct Settled {
    /// The route, whose policy says whether anyone waits for the record.
    pub(crate) route: Arc<Route>,
    /// The record.
    pub(crate) id: RecordId,
    /// What happened to it.
    pub(crate) fate: Fate,
    /// Whether the request was executed (not when its claim came too late, or it found no permit).
    pub(crate) executed: bool,
    /// What its client still gets once whoever waits for the record has been told.
    pub(crate) rest: Rest,
}

/// Which execution of a key a won claim is, as the upstream is told (`Idempotency-Attempt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// 1 for a new record, one more for each retry or takeover.
    pub number: i32,
    /// How the claim came about.
    pub kind: ClaimKind,
}

impl Attempt {
    /// The `Idempotency-Attempt` value: `1`, `2;retry`, `3;takeover`.
    pub fn header_value(self) -> HeaderValue {
        let parameter = match self.kind {
            ClaimKind::New => return HeaderValue::from(self.number),
            ClaimKind::Retry => "retry",
            ClaimKind::Takeover => "takeover",
        };
        // Digits and a word: always a valid value.
        HeaderValue::try_from(format!("{};{parameter}", self.number))
            .unwrap_or_else(|_| HeaderValue::from(self.number))
    }
}

impl Claims {
    pub(crate) fn new(config: &Config, parts: ClaimsParts) -> Claims {
        let ClaimsParts {
            store,
            cache,
            permits,
            waiters,
            metrics,
            executor,
            forward,
        } = parts;
        Claims {
            store,
            cache,
            permits,
            store_timeout: config.store.timeout,
            waiters,
            metrics,
            traced: otlp::traced(&config.traces),
            executor,
            forward,
        }
    }

    /// The same stage for another worker thread: its executions and its fail_open forwards go through
    /// `upstream` and `forward`, and its claims through the thread's store handle.
    pub(crate) fn for_worker(&self, upstream: Upstream, forward: Forward) -> Claims {
        let store = self.store.for_worker();
        Claims {
            executor: self.executor.for_worker(upstream, store.clone()),
            forward,
            store,
            ..self.clone()
        }
    }

    /// The parts a request that carries many keys is claimed, forwarded and written with (`many.rs`).
    pub(crate) fn parts(&self) -> (&StoreHandle, &Executor, &Forward, &Arc<Waiters>, &Metrics) {
        (
            &self.store,
            &self.executor,
            &self.forward,
            &self.waiters,
            &self.metrics,
        )
    }

    /// Bound on one store operation (`store.timeout`).
    pub(crate) fn store_timeout(&self) -> Duration {
        self.store_timeout
    }

    /// A claim whose statement failed, which may still commit: given back later, as [`Orphan`] says.
    pub(crate) fn orphaned(&self, claim: &ClaimRequest) {
        let orphan = Orphan {
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            store_timeout: self.store_timeout,
        };
        tokio::spawn(orphan.release(claim.id.clone(), claim.lease));
    }

    /// On a route that waits, the request's interest in its record, taken before the first claim
    /// statement: a settlement that commits after the statement read the record wakes it, whatever
    /// the statement found. Routes that do not wait pay nothing.
    pub(crate) fn waiter(&self, route: &Route, id: &RecordId) -> Option<Waiter> {
        route
            .policy
            .claim
            .on_in_flight
            .waits()
            .then(|| self.waiters.wait_for(RecordTag::of(&id.scope, &id.key)))
    }

    /// Sends the claim statement and answers what it can: a replay or a refusal. A won claim is handed
    /// back to be executed, with `permit`, the request's keyed permit if it holds one.
    /// With a `waiter` (a route that waits), every wake before the statement is marked seen first,
    /// and a key in flight is handed back rather than refused.
    pub(crate) async fn round(
        &self,
        keyed: Keyed,
        permit: Option<KeyedPermit>,
        mut waiter: Option<Waiter>,
    ) -> Round {
        if let Some(waiter) = &mut waiter {
            waiter.mark_seen();
        }
        let started = Instant::now();
        let sent = SystemTime::now();
        let span = otlp::claim(self.traced);
        let claiming = self.store.claim(&keyed.ticket.claim);
        let result = match claiming.instrument(span.clone()).await {
            Ok(result) => {
                otlp::claimed(&span, found(&result));
                result
            }
            Err(error) => {
                otlp::failed(&span, "store_error");
                return self.unanswered(keyed, error).await;
            }
        };
        if let Some(waiter) = waiter
            && let Some(lease_remaining) = in_flight(&result)
        {
            let lease_end = Instant::now() + lease_remaining;
            return Round::InFlight(Box::new(InFlight {
                keyed,
                lease_end,
                waiter,
            }));
        }
        let fill = self.cache.remember(&keyed.ticket.claim, &result, started);
        let (policy, id) = (&keyed.ticket.route.policy, &keyed.ticket.claim.id);
        match decide(result, id, policy.claim.in_flight_retry_after, &self.metrics) {
            Ok(Decision::Execute(attempt, expires_in)) => Round::Won(Box::new(Won {
                keyed,
                started,
                expires_at: expiry::after(sent, expires_in),
                fill,
                permit,
                attempt,
            })),
            Ok(Decision::Replay(stored, expires_in)) => {
                let expires_at = expiry::after(sent, expires_in);
                keyed.answer.send(replayed(&keyed.ticket, &stored, expires_at));
                Round::Replayed
            }
            Err(refusal) => {
                keyed.answer.send(Err(refusal));
                Round::Refused
            }
        }
    }

    /// A claim statement that failed. An undecryptable record is an answer that must be neither
    /// replayed nor forwarded; anything else is a store that did not answer: its claim may still commit
    /// (given back later by `release_orphan`), and the request goes to fail_closed or fail_open.
    async fn unanswered(&self, keyed: Keyed, error: StoreError) -> Round {
        let Keyed { ticket, answer } = keyed;
        if let StoreError::Undecryptable(_) = error {
            answer.send(Err(ProxyError::RecordUnreadable));
            return Round::Refused;
        }
        let claim = &ticket.claim;
        // A store not open yet was never sent the claim: there is nothing to give back.
        if !matches!(error, StoreError::NotOpen) {
            self.orphaned(claim);
        }
        // Rare, and a forward is many kilobytes of future: on the heap, it stays out of the claim task
        // that every keyed request spawns (and tokio copies as it starts and as it finishes).
        let forward = Box::pin(
            self.forward
                .store_down(ticket.parts, ticket.body, &ticket.peer, error),
        );
        answer.send(forward.await);
        Round::Refused
    }

    /// Executes a won claim to the end, and says what became of its record. Not when the claim came too
    /// late, nor when the request holds no permit (it waited) and finds none free: then the claim is
    /// given back.
    pub(crate) async fn execute_won(&self, won: Won) -> Settled {
        let Keyed { ticket, answer } = won.keyed;
        let Ticket {
            route,
            claim,
            dialect,
            peer,
            parts,
            body,
        } = ticket;
        let settled = |fate, executed, rest| Settled {
            route: route.clone(),
            id: claim.id.clone(),
            fate,
            executed,
            rest,
        };
        let waited = won.started.elapsed();
        if waited > claim.lease / 2 {
            let (fate, late) = self.claimed_too_late(&claim, waited).await;
            let forward = Box::pin(self.forward.store_down(parts, body, &peer, late));
            answer.send(forward.await);
            return settled(fate, false, Rest::none());
        }
        let permit = match won.permit {
            Some(permit) => Ok(permit),
            None => self.permits.take(&peer),
        };
        let _permit = match permit {
            Ok(permit) => permit,
            Err(busy) => {
                let fate = self.give_back(&claim.id).await;
                answer.send(Err(ProxyError::Busy(busy)));
                return settled(fate, false, Rest::none());
            }
        };
        let mut request = self.executor.request(parts, body, (&peer, &dialect));
        request
            .headers_mut()
            .insert(ATTEMPT_HEADER, won.attempt.header_value());
        let claimed = Claimed {
            id: claim.id.clone(),
            lease: claim.lease,
            route: route.clone(),
            expires_at: won.expires_at,
            fill: won.fill,
            fingerprint: claim.fingerprint,
            dialect,
        };
        let executed = self.executor.execute(claimed, request, answer).await;
        settled(executed.fate, true, executed.rest)
    }

    /// A won claim whose answer came after more than half its lease (the lease started no earlier than the
    /// claim was sent): a starved process, or a store slower than the lease. The heartbeat's first
    /// extension, a third of a lease after forwarding, might come after the lease ran out, and another
    /// proxy could take the key over while the upstream works. So the claim is given back (fenced by its
    /// token) and the request is answered as if the store had not answered in time.
    async fn claimed_too_late(&self, claim: &ClaimRequest, waited: Duration) -> (Fate, StoreError) {
        tracing::warn!(
            key_hash = %claim.id.key_hash(),
            waited_ms = waited.as_millis() as u64,
            lease_ms = claim.lease.as_millis() as u64,
            "claim answered after more than half its lease; not forwarded on it"
        );
        let fate = self.give_back(&claim.id).await;
        (fate, StoreError::Timeout(waited))
    }

    /// Releases a won claim that will not be executed (fenced by its token), so that whoever waits for
    /// it can execute instead once the keyed task has woken them.
    async fn give_back(&self, id: &RecordId) -> Fate {
        match self.store.release(id).await {
            Ok(true) => Fate::Released,
            Ok(false) => Fate::Lost,
            Err(error) => {
                tracing::warn!(key_hash = %id.key_hash(), %error, "giving the claim back failed; it expires with its lease");
                Fate::LeftToLease
            }
        }
    }
}

/// The stored response as a replay answers `ticket`, its expiry header saying `expires_at`.
fn replayed(ticket: &Ticket, stored: &StoredResponse, expires_at: SystemTime) -> Handled {
    let request = (&ticket.parts.headers, &ticket.dialect);
    replay::response(stored, request.0, request.1).map(|mut response| {
        expiry::stamp(
            response.headers_mut(),
            &ticket.route.policy.store,
            Some(expires_at),
        );
        (response, Outcome::Replayed)
    })
}

/// The lease left on a record the claim found processing for the same request; `None` for any other
/// answer.
fn in_flight(result: &ClaimResult) -> Option<Duration> {
    match result {
        ClaimResult::Held(Existing::Processing {
            same_fingerprint: true,
            lease_remaining,
        }) => Some(*lease_remaining),
        _ => None,
    }
}

/// What giving back an orphaned claim needs, off the request's task.
struct Orphan {
    store: StoreHandle,
    metrics: Metrics,
    store_timeout: Duration,
}

impl Orphan {
    /// A claim whose statement did not answer in time may still have been won, by a statement that
    /// committed after its request stopped waiting; left alone, it would hold the key for a lease and then
    /// count as a stale takeover although nothing ran. It is given back by its token (which matches nothing
    /// if it was never won), tried after one store timeout, when such a statement has most likely ended,
    /// and again with doubling waits while its lease could still be live.
    async fn release(self, id: RecordId, lease: Duration) {
        let deadline = Instant::now() + lease + self.store_timeout;
        let mut wait = self.store_timeout;
        while Instant::now() + wait <= deadline {
            tokio::time::sleep(wait).await;
            match self.store.release(&id).await {
                Ok(true) => {
                    self.metrics.orphan_claims_released.inc();
                    tracing::warn!(key_hash = %id.key_hash(), "a claim won after its request gave up waiting was given back");
                    return;
                }
                Ok(false) => {}
                // The give-back may have been applied with its answer lost: then the next try finds the key
                // released, or re-claimed by a retry, and the log would otherwise never say why.
                Err(_) => {
                    tracing::info!(key_hash = %id.key_hash(), "an orphaned claim's give-back went unanswered; it may have been given back")
                }
            }
            wait *= 2;
        }
    }
}

/// What to do with a request after its claim statement.
#[derive(Debug)]
pub enum Decision {
    /// This request holds the key: forward it, as this attempt; the record expires after the duration
    /// (a new key's TTL, or the expiry a retry or takeover keeps).
    Execute(Attempt, Duration),
    /// Answer from the stored response; the record expires after the duration.
    Replay(StoredResponse, Duration),
}

/// The decision table. Errors are the refusals (409, 422, 502 for a held outcome). A 409's `Retry-After`
/// is `retry_hint` (`idempotency.in_flight_retry_after`), or the lease left if that is shorter, at
/// least a second: most keys in flight complete well within a lease, so the whole lease would keep a
/// client waiting for nothing.
pub fn decide(
    result: ClaimResult,
    id: &RecordId,
    retry_hint: Duration,
    metrics: &Metrics,
) -> Result<Decision, ProxyError> {
    match result {
        ClaimResult::Won {
            attempt,
            kind,
            expires_in,
        } => {
            if kind == ClaimKind::Takeover {
                metrics.stale_takeovers.inc();
                tracing::warn!(key_hash = %id.key_hash(), attempt, "stale claim taken over: its lease ran out");
            } else if kind == ClaimKind::Retry {
                tracing::info!(key_hash = %id.key_hash(), attempt, "released key executes again");
            }
            Ok(Decision::Execute(
                Attempt {
                    number: attempt,
                    kind,
                },
                expires_in,
            ))
        }
        ClaimResult::Held(existing) => held(existing, retry_hint),
    }
}

fn held(existing: Existing, retry_hint: Duration) -> Result<Decision, ProxyError> {
    match existing {
        Existing::Completed {
            same_fingerprint: true,
            response,
            expires_in,
            ..
        } => Ok(Decision::Replay(response, expires_in)),
        Existing::Processing {
            same_fingerprint: true,
            lease_remaining,
        } => Err(ProxyError::KeyInFlight {
            retry_after: in_flight_retry_after(lease_remaining, retry_hint),
        }),
        Existing::Unknown {
            same_fingerprint: true,
        } => Err(ProxyError::OutcomeUnknown),
        Existing::Completed { .. }
        | Existing::Processing { .. }
        | Existing::Unknown { .. }
        | Existing::Failed => Err(ProxyError::KeyReused),
    }
}

/// The `Retry-After` of a 409 for a key in flight: `retry_hint` (`idempotency.in_flight_retry_after`),
/// or the lease left if that is shorter, at least a second.
pub(crate) fn in_flight_retry_after(lease_remaining: Duration, retry_hint: Duration) -> Duration {
    lease_remaining.min(retry_hint).max(Duration::from_secs(1))
}

/// What a claim statement found, in a word for its trace span: the claim's kind when won, else the
/// state of the record that holds the key.
fn found(result: &ClaimResult) -> &'static str {
    match result {
        ClaimResult::Won { kind, .. } => kind.as_str(),
        ClaimResult::Held(Existing::Completed { .. }) => "completed",
        ClaimResult::Held(Existing::Processing { .. }) => "processing",
        ClaimResult::Held(Existing::Failed) => "failed",
        ClaimResult::Held(Existing::Unknown { .. }) => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::answer::Handled;
    use crate::proxy::stage_tests::{self, Stages};
    use crate::store::stub::{Op, Reply, StubStore};

    /// The stages with a lease of 10 s and `store_timeout`, in front of an upstream that refuses every
    /// connection (a request that is forwarded is answered 502 unreachable).
    fn stages(store_timeout: &str, store: &Arc<StubStore>) -> Stages {
        let toml = format!(
            "[upstream]\nurl = \"http://127.0.0.1:1\"\n[idempotency]\nlock_timeout = \"10s\"\n\
             [store]\ntimeout = \"{store_timeout}\"\n"
        );
        stage_tests::stages(&toml, store)
    }

    /// Sends a new request with key `k` through the keyed task, holding a keyed permit, on a route
    /// that does not wait; what its client is answered, once the task has ended.
    async fn claim(stages: &Stages) -> Handled {
        let ticket = stage_tests::ticket(stages).await;
        let permit = stages.permits.take(&ticket.peer).expect("a free permit");
        let (head, answer) = stage_tests::answer(&stages.metrics);
        let keyed = stages.keyed(tokio_util::sync::CancellationToken::new());
        keyed.run(ticket, head, permit).await;
        answer.await.expect("an answer")
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_won_after_half_its_lease_is_given_back_and_never_forwarded() {
        let store = StubStore::new();
        store.delay(Op::Claim, Duration::from_millis(5_100));
        let late = stages("5s", &store);
        let answer = claim(&late).await;
        assert!(
            matches!(answer, Err(ProxyError::StoreUnavailable(_))),
            "{answer:?}"
        );
        assert_eq!(store.count(Op::Release), 1, "the late claim is given back");
        assert_eq!(store.count(Op::Heartbeat), 0);

        let store = StubStore::new();
        store.delay(Op::Claim, Duration::from_millis(4_900));
        let in_time = stages("5s", &store);
        let answer = claim(&in_time).await;
        assert!(
            matches!(answer, Err(ProxyError::UpstreamUnreachable(_))),
            "a claim won within half its lease is forwarded: {answer:?}"
        );
        assert_eq!(store.count(Op::Release), 1, "released: the upstream never had it");
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_the_store_did_not_answer_is_given_back_after_a_store_timeout_then_at_doubling_waits() {
        let store = StubStore::new();
        store
            .then(
                Op::Claim,
                Reply::Fail(StoreError::Timeout(Duration::from_secs(1))),
            )
            .then(Op::Release, Reply::Done(false))
            .then(Op::Release, Reply::Done(false))
            .then(Op::Release, Reply::Done(true));
        let stages = stages("1s", &store);
        let answer = claim(&stages).await;
        assert!(
            matches!(answer, Err(ProxyError::StoreUnavailable(_))),
            "{answer:?}"
        );
        let claimed = store.times(Op::Claim)[0];
        tokio::time::sleep(Duration::from_secs(60)).await;
        let releases: Vec<Duration> = store.times(Op::Release).iter().map(|at| *at - claimed).collect();
        assert_eq!(releases, [1, 3, 7].map(Duration::from_secs));
        assert_eq!(stages.metrics.orphan_claims_released.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_orphan_is_given_back_only_while_its_lease_could_be_live() {
        let store = StubStore::new();
        store
            .then(
                Op::Claim,
                Reply::Fail(StoreError::Backend("connection reset".into())),
            )
            .always(Op::Release, Reply::Done(false));
        let stages = stages("1s", &store);
        claim(&stages).await.expect_err("fail_closed refuses");
        let claimed = store.times(Op::Claim)[0];
        tokio::time::sleep(Duration::from_secs(60)).await;
        let releases: Vec<Duration> = store.times(Op::Release).iter().map(|at| *at - claimed).collect();
        // The next try, 8 s after the last, would come after the lease and a store timeout (11 s).
        assert_eq!(releases, [1, 3, 7].map(Duration::from_secs));
        assert_eq!(stages.metrics.orphan_claims_released.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_not_open_yet_was_sent_nothing_to_give_back() {
        let store = StubStore::new();
        store.then(Op::Claim, Reply::Fail(StoreError::NotOpen));
        let stages = stages("1s", &store);
        let answer = claim(&stages).await;
        assert!(
            matches!(answer, Err(ProxyError::StoreUnavailable(_))),
            "{answer:?}"
        );
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(store.count(Op::Release), 0);
    }

    const HINT: Duration = Duration::from_secs(1);

    fn id() -> RecordId {
        RecordId {
            scope: "default:s".into(),
            key: "k".into(),
            token: uuid::Uuid::nil(),
        }
    }

    fn stored() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![],
            body: None,
        }
    }

    #[test]
    fn takeover_executes_and_is_counted() {
        let metrics = Metrics::new();
        let result = ClaimResult::Won {
            attempt: 2,
            kind: ClaimKind::Takeover,
            expires_in: Duration::from_secs(80),
        };
        assert!(matches!(
            decide(result, &id(), HINT, &metrics),
            Ok(Decision::Execute(
                Attempt {
                    number: 2,
                    kind: ClaimKind::Takeover
                },
                expires_in
            )) if expires_in == Duration::from_secs(80)
        ));
        assert_eq!(metrics.stale_takeovers.get(), 1);
    }

    #[test]
    fn completed_same_fingerprint_replays() {
        let result = ClaimResult::Held(Existing::Completed {
            same_fingerprint: true,
            response: stored(),
            expires_in: Duration::from_secs(60),
            token: uuid::Uuid::nil(),
        });
        assert!(matches!(
            decide(result, &id(), HINT, &Metrics::new()),
            Ok(Decision::Replay(..))
        ));
    }

    #[test]
    fn other_fingerprint_is_a_mismatch_in_every_state() {
        let states = [
            Existing::Completed {
                same_fingerprint: false,
                response: stored(),
                expires_in: Duration::from_secs(60),
                token: uuid::Uuid::nil(),
            },
            Existing::Processing {
                same_fingerprint: false,
                lease_remaining: Duration::from_secs(3),
            },
            Existing::Failed,
            Existing::Unknown {
                same_fingerprint: false,
            },
        ];
        for state in states {
            let result = decide(ClaimResult::Held(state), &id(), HINT, &Metrics::new());
            assert!(matches!(result, Err(ProxyError::KeyReused)), "{result:?}");
        }
    }

    #[test]
    fn live_claim_is_a_conflict_with_a_short_hint_never_the_whole_lease() {
        let conflict = |lease_ms: u64, hint: Duration| {
            let result = ClaimResult::Held(Existing::Processing {
                same_fingerprint: true,
                lease_remaining: Duration::from_millis(lease_ms),
            });
            match decide(result, &id(), hint, &Metrics::new()) {
                Err(ProxyError::KeyInFlight { retry_after }) => retry_after,
                other => panic!("expected a conflict, got {other:?}"),
            }
        };
        assert_eq!(conflict(29_400, HINT), HINT, "the hint, not the lease");
        assert_eq!(conflict(29_400, Duration::from_secs(5)), Duration::from_secs(5));
        assert_eq!(
            conflict(2_500, Duration::from_secs(5)),
            Duration::from_millis(2_500)
        );
        assert_eq!(conflict(0, HINT), Duration::from_secs(1), "at least a second");
    }

    #[test]
    fn a_held_outcome_is_refused_for_the_same_request() {
        let result = ClaimResult::Held(Existing::Unknown {
            same_fingerprint: true,
        });
        assert!(matches!(
            decide(result, &id(), HINT, &Metrics::new()),
            Err(ProxyError::OutcomeUnknown)
        ));
    }
}
