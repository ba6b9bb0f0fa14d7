//! A request that carries many keys, on the keyed task (`keyed.rs`): a JSON-RPC batch whose calls carry
//! keys of their own (`many/jsonrpc.rs`), or a GraphQL mutation whose root fields are marked
//! `@idempotent` (`many/graphql.rs`). Each keyed item is claimed on its own, as an ordinary record
//! (lease, heartbeat, takeover, fence) under the request's scope, so an item another request already
//! completed is answered from the store and one in flight as the route's `on_in_flight` says; an item
//! whose key repeats an earlier item's of the same request is answered as that item is (a replay of it),
//! or refused as a reuse when the two differ. Only the items this request won, and the unkeyed ones, go
//! upstream, as the protocol sends them (one batch; one operation per field); each item's record is
//! completed, released or held as its own answer says, and whoever waits for it is told (`settle.rs`).
//! The client gets one answer, merged in its order.
//!
//! A request never waits while it holds keys (another request could be waiting for them): a batch's
//! calls in flight elsewhere wait after the rest have run, one at a time, each sent as soon as it is
//! won; a mutation's fields are claimed one at a time, in document order, each after the one before has
//! run. A store that does not answer an item's claim leaves that item alone to `on_store_error`.

pub mod graphql;
pub mod item;
pub mod jsonrpc;

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::{StreamExt, stream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::item::{CLAIMS_AT_ONCE, Claimed, Run, Won};
use super::answer::Answer;
use super::claim::{Attempt, Claims, Decision, decide, in_flight_retry_after};
use super::execute::heartbeat::Heartbeat;
use super::execute::{Executor, ItemWrite};
use super::intake::many::{ItemKey, Items, Many};
use super::passthrough::Forward;
use super::permit::KeyedPermit;
use super::settle::Settle;
use super::wait::{Waiting, Waits};
use crate::config::Route;
use crate::error::ProxyError;
use crate::headers::REPLAYED_HEADER;
use crate::metrics::{Metrics, Outcome, RouteSeries, WaitResult};
use crate::store::wake::{RecordTag, Waiters};
use crate::store::{ClaimRequest, ClaimResult, Existing, RecordId, StoreError, StoreHandle};

/// The stage: what claiming, forwarding and settling the items touches (the claim stage's parts, and
/// who is told of a settlement).
pub(crate) struct ManyKeys<'a> {
    store: &'a StoreHandle,
    executor: &'a Executor,
    forward: &'a Forward,
    waiters: &'a Arc<Waiters>,
    metrics: &'a Metrics,
    claims: &'a Claims,
    waits: &'a Waits,
    settle: &'a Settle,
}

impl<'a> ManyKeys<'a> {
    /// The stage over the claim stage's parts and `settle`.
    pub(crate) fn new(claims: &'a Claims, waits: &'a Waits, settle: &'a Settle) -> ManyKeys<'a> {
        let (store, executor, forward, waiters, metrics) = claims.parts();
        ManyKeys {
            store,
            executor,
            forward,
            waiters,
            metrics,
            claims,
            waits,
            settle,
        }
    }

    /// Runs `many` to its end, answering through `answer`, under `permit`; its items are counted in
    /// `series` by what each came to.
    pub(crate) async fn run(
        &self,
        many: Many,
        answer: Answer,
        (permit, series, base): (KeyedPermit, Arc<RouteSeries>, &str),
    ) {
        let _permit = permit;
        let Many {
            route,
            scope,
            peer,
            parts,
            body,
            items,
        } = many;
        let deadline = Instant::now() + route.policy.claim.wait_timeout;
        let run = Run {
            executor: self.executor,
            settle: self.settle,
            route: &route,
            scope: &scope,
            base,
            peer: &peer,
            parts: &parts,
            series: &series,
        };
        let mut waiting = Seat::Unasked;
        let mut answer = answer;
        let mut handled = match &items {
            // A round answers what it can; the calls in flight elsewhere then wait one at a time, the
            // request holding no key meanwhile, each sent on its own as soon as it is won.
            Items::JsonRpc(calls) => {
                let mut claimed = self.claim_all(&route, &scope, &items.keys()).await;
                let mut replies = jsonrpc::Replies::new(calls.len());
                jsonrpc::round(&run, &body, calls, &mut claimed, &mut replies).await;
                while let Some(n) = claimed
                    .iter()
                    .position(|item| matches!(item, Claimed::Pending(..)))
                {
                    let pending = std::mem::replace(&mut claimed[n], Claimed::Done);
                    claimed[n] = self
                        .wait_one(&route, pending, deadline, (&mut waiting, &mut answer))
                        .await;
                    jsonrpc::round(&run, &body, calls, &mut claimed, &mut replies).await;
                }
                jsonrpc::finish(&run, calls, &claimed, replies)
            }
            // Root mutation fields run one after the other: each is claimed only once the one before
            // it has run, so a field in flight elsewhere waits holding no key, and none runs early.
            Items::GraphQl(fields) => {
                let keys = items.keys();
                let mut claimed: Vec<Claimed> = keys.iter().map(|_| Claimed::Done).collect();
                let mut answers = graphql::Answers::new(fields.len());
                for (n, keyed) in keys.iter().enumerate() {
                    claimed[n] = match keyed {
                        None => Claimed::Unkeyed,
                        Some((key, fingerprint)) => {
                            let claim = claim_request(&route, &scope, key, fingerprint);
                            match self.claim_one(&route, claim, None, None).await {
                                Pass::InFlight(claim, lease) if route.policy.claim.on_in_flight.waits() => {
                                    let pending = Claimed::Pending(claim, lease);
                                    self.wait_one(&route, pending, deadline, (&mut waiting, &mut answer))
                                        .await
                                }
                                pass => self.resolved(&route, pass),
                            }
                        }
                    };
                    graphql::round(&run, &body, fields, &mut claimed, &mut answers).await;
                }
                graphql::finish(&run, fields, &claimed, answers)
            }
        };
        drop(waiting);
        // Every keyed item answered from the store, nothing sent: the whole answer is a replay.
        if let Ok((response, Outcome::Replayed)) = &mut handled {
            let replayed = http::HeaderValue::from_static("true");
            response.headers_mut().insert(REPLAYED_HEADER, replayed);
        }
        answer.send(handled);
    }

    /// Claims every keyed item, [`CLAIMS_AT_ONCE`] at a time (a store that batches its statements
    /// takes them together), and says what each came to, in the client's order. An item whose key an
    /// earlier item of the request has is not claimed again: a repeat of it, or a reuse if the two
    /// differ. An item in flight elsewhere is left pending on a route that waits (for
    /// [`ManyKeys::wait_pending`]), refused at once on one that does not.
    async fn claim_all(&self, route: &Arc<Route>, scope: &str, keys: &[&ItemKey]) -> Vec<Claimed> {
        let policy = &route.policy;
        let mut first: HashMap<&str, (usize, &[u8; 32])> = HashMap::with_capacity(keys.len());
        let mut planned: Vec<Result<Claimed, ClaimRequest>> = Vec::with_capacity(keys.len());
        for (n, keyed) in keys.iter().enumerate() {
            let Some((key, fingerprint)) = keyed else {
                planned.push(Ok(Claimed::Unkeyed));
                continue;
            };
            if let Some(&(earlier, earlier_fingerprint)) = first.get(key.as_str()) {
                planned.push(Ok(match earlier_fingerprint == fingerprint {
                    true => Claimed::Repeat(earlier),
                    false => Claimed::Refused(ProxyError::KeyReused),
                }));
                continue;
            }
            first.insert(key, (n, fingerprint));
            planned.push(Err(claim_request(route, scope, key, fingerprint)));
        }
        let claiming = planned.into_iter().map(|item| async move {
            match item {
                Ok(claimed) => Pass::Done(claimed),
                Err(claim) => self.claim_one(route, claim, None, None).await,
            }
        });
        let mut passes: Vec<Pass> = stream::iter(claiming).buffered(CLAIMS_AT_ONCE).collect().await;
        self.claim_again_alone(route, &mut passes).await;
        let waits = policy.claim.on_in_flight.waits();
        passes
            .into_iter()
            .map(|pass| match pass {
                Pass::InFlight(claim, lease_remaining) if waits => Claimed::Pending(claim, lease_remaining),
                other => self.resolved(route, other),
            })
            .collect()
    }

    /// The items whose claims failed, claimed again one at a time, in the client's order, each begun
    /// within two store timeouts: a store that batches statements (PostgreSQL) sends a request's claims
    /// as one, so one claim held up (a row another session locks) times out its neighbours too, which
    /// alone are answered at once. Each is sent anew (a new token: the timed-out one is given back as
    /// an orphan). What is still unanswered stays to `on_store_error`.
    async fn claim_again_alone(&self, route: &Route, passes: &mut [Pass]) {
        let store_timeout = self.claims.store_timeout();
        let end = Instant::now() + store_timeout * 2;
        for pass in passes.iter_mut() {
            let Pass::StoreDown(claim, error) = pass else {
                continue;
            };
            if matches!(error, StoreError::NotOpen) {
                return;
            }
            if Instant::now() >= end {
                return;
            }
            let mut again = claim.clone();
            again.id.token = uuid::Uuid::new_v4();
            *pass = self.claim_one(route, again, None, None).await;
        }
    }

    /// Waits for a `pending` item (in flight elsewhere, on a route that waits) until its record
    /// settles, claiming it again each time, until `deadline` (the request's `wait_timeout`), its client
    /// leaving, or shutdown; in the request's one seat among the waiters (taken at its first wait; none
    /// free: refused at once). What it comes to.
    async fn wait_one(
        &self,
        route: &Route,
        pending: Claimed,
        deadline: Instant,
        (seat, answer): (&mut Seat, &mut Answer),
    ) -> Claimed {
        let Claimed::Pending(claim, lease_remaining) = pending else {
            return pending;
        };
        if let Seat::Unasked = seat {
            *seat = match self.waits.seat(deadline) {
                Some(waiting) => Seat::Held { _waiting: waiting },
                None => Seat::Refused,
            };
        }
        if let Seat::Refused = seat {
            return self.resolved(route, Pass::InFlight(claim, lease_remaining));
        }
        let stop = self.waits.shutdown().child_token();
        let watching = async {
            answer.closed().await;
            stop.cancel();
            std::future::pending::<()>().await;
        };
        let waited = tokio::select! {
            waited = self.claim_one(route, claim, Some(deadline), Some(&stop)) => waited,
            () = watching => unreachable!("watching never ends"),
        };
        let result = match (&waited, stop.is_cancelled()) {
            (Pass::InFlight(..), true) if self.waits.shutdown().is_cancelled() => WaitResult::Shutdown,
            (Pass::InFlight(..), true) => WaitResult::ClientGone,
            _ => waited.wait_result(),
        };
        self.waits.ended(result);
        self.resolved(route, waited)
    }

    /// What an item comes to once its claim is decided: a store that did not answer leaves it to
    /// `on_store_error`, the item alone (the rest of the request goes on): sent unprotected with
    /// `fail_open`, refused with `fail_closed`.
    fn resolved(&self, route: &Route, pass: Pass) -> Claimed {
        match pass {
            Pass::Done(claimed) => claimed,
            Pass::InFlight(_, lease_remaining) => {
                let hint = route.policy.claim.in_flight_retry_after;
                let retry_after = in_flight_retry_after(lease_remaining, hint);
                Claimed::Refused(ProxyError::KeyInFlight { retry_after })
            }
            Pass::StoreDown(_, error) if self.forward.fails_open() => {
                self.metrics.unprotected.inc();
                tracing::warn!(%error, "store unavailable; an item forwarded without idempotency (fail_open)");
                Claimed::Unkeyed
            }
            Pass::StoreDown(_, error) => Claimed::Refused(ProxyError::StoreUnavailable(error.to_string())),
        }
    }

    /// One item's claim. Found in flight: handed back without a `deadline`; with one, claimed again each
    /// time its record settles (or its lease runs out) until then, the request's `wait_timeout`, or until
    /// `stop` (handed back then).
    async fn claim_one(
        &self,
        route: &Route,
        claim: ClaimRequest,
        deadline: Option<Instant>,
        stop: Option<&CancellationToken>,
    ) -> Pass {
        let policy = &route.policy;
        let mut waiter = deadline.is_some().then(|| {
            self.waiters
                .wait_for(RecordTag::of(&claim.id.scope, &claim.id.key))
        });
        loop {
            if let Some(waiter) = &mut waiter {
                waiter.mark_seen();
            }
            let sent = Instant::now();
            let result = match self.store.claim(&claim).await {
                Ok(result) => result,
                Err(StoreError::Undecryptable(_)) => {
                    return Pass::Done(Claimed::Refused(ProxyError::RecordUnreadable));
                }
                Err(error) => {
                    // Not open yet: it was never sent, so there is nothing to give back.
                    if !matches!(error, StoreError::NotOpen) {
                        self.claims.orphaned(&claim);
                    }
                    return Pass::StoreDown(claim, error);
                }
            };
            let in_flight = match &result {
                ClaimResult::Held(Existing::Processing {
                    same_fingerprint: true,
                    lease_remaining,
                }) => Some(*lease_remaining),
                _ => None,
            };
            if let (Some(lease_remaining), None) = (in_flight, deadline) {
                return Pass::InFlight(claim, lease_remaining);
            }
            if let (Some(waiter), Some(lease_remaining), Some(deadline)) = (&mut waiter, in_flight, deadline)
                && Instant::now() < deadline
            {
                let until = (Instant::now() + lease_remaining).min(deadline);
                let stopped = async {
                    match stop {
                        Some(stop) => stop.cancelled().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = waiter.woken() => {}
                    () = tokio::time::sleep_until(until) => {}
                    () = stopped => return Pass::InFlight(claim, lease_remaining),
                }
                continue;
            }
            let hint = policy.claim.in_flight_retry_after;
            return Pass::Done(match decide(result, &claim.id, hint, self.metrics) {
                Ok(Decision::Execute(..)) if sent.elapsed() > claim.lease / 2 => {
                    // Its heartbeat could come after the lease ran out: given back, as a lone claim is.
                    tracing::warn!(key_hash = %claim.id.key_hash(), "claim answered after more than half its lease; given back");
                    self.executor
                        .write_item(&claim.id, (claim.lease, false), &ItemWrite::Release)
                        .await;
                    self.settle.settled(route, &claim.id).await;
                    Claimed::Refused(ProxyError::StoreUnavailable(
                        "the claim was answered too late".into(),
                    ))
                }
                Ok(Decision::Execute(attempt, _)) => Claimed::Won(self.won(claim, attempt)),
                Ok(Decision::Replay(stored, _)) => Claimed::Replayed(stored),
                Err(refusal) => Claimed::Refused(refusal),
            });
        }
    }

    /// A won item, its heartbeat started.
    fn won(&self, claim: ClaimRequest, attempt: Attempt) -> Won {
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let (id, lease) = (claim.id.clone(), claim.lease);
        let task = tokio::spawn(async move {
            Heartbeat::new(&store, &id, lease, &metrics).beat().await;
        });
        Won::new(claim.id, attempt, task.abort_handle())
    }
}

/// The claim of an item keyed `key` with `fingerprint`, in the request's `scope`, under its route's
/// lease and time to live.
fn claim_request(route: &Route, scope: &str, key: &str, fingerprint: &[u8; 32]) -> ClaimRequest {
    ClaimRequest {
        id: RecordId {
            scope: scope.to_owned(),
            key: key.to_owned(),
            token: uuid::Uuid::new_v4(),
        },
        fingerprint: *fingerprint,
        lease: route.policy.claim.lock_timeout,
        ttl: route.policy.claim.ttl,
    }
}

/// A request's one seat among the waiters, taken at its first wait.
enum Seat {
    /// Not needed yet.
    Unasked,
    /// Held until the request ends.
    Held { _waiting: Waiting },
    /// None was free: the items that would wait are refused.
    Refused,
}

/// What an item's first claim statement found.
enum Pass {
    /// Decided.
    Done(Claimed),
    /// In flight elsewhere: the claim to send again, and the lease left on the record.
    InFlight(ClaimRequest, std::time::Duration),
    /// The store did not answer.
    StoreDown(ClaimRequest, StoreError),
}

impl Pass {
    /// How a wait for the item ended, as `idemproxy_waits_total` counts it.
    fn wait_result(&self) -> WaitResult {
        match self {
            Pass::Done(Claimed::Replayed(_)) => WaitResult::Replayed,
            Pass::Done(Claimed::Won(_)) => WaitResult::Executed,
            Pass::Done(Claimed::Refused(ProxyError::KeyInFlight { .. })) => WaitResult::Timeout,
            Pass::Done(_) | Pass::InFlight(..) | Pass::StoreDown(..) => WaitResult::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::Request;

    use super::*;
    use crate::proxy::budget::{BodyBudget, ReservedBody};
    use crate::proxy::intake::many::Call;
    use crate::proxy::stage_tests::{self, SlowUpstream, Stages};
    use crate::store::stub::{Op, Reply, StubStore};
    use crate::store::{ClaimKind, ClaimResult};

    fn won() -> Reply {
        Reply::Claim(ClaimResult::Won {
            attempt: 1,
            kind: ClaimKind::New,
            expires_in: Duration::from_secs(60),
        })
    }

    /// A batch of `keys.len()` calls, each keyed as `keys` says, on the default route.
    async fn batch(stages: &Stages, keys: &[&str]) -> Many {
        let texts: Vec<String> = keys
            .iter()
            .enumerate()
            .map(|(n, key)| format!(r#"{{"jsonrpc":"2.0","id":{n},"method":"m","params":{{"_meta":{{"idempotencyKey":"{key}"}}}}}}"#))
            .collect();
        let whole = Bytes::from(format!("[{}]", texts.join(",")));
        let mut calls = Vec::new();
        let mut at = 1;
        for (text, key) in texts.iter().zip(keys) {
            let raw: &serde_json::value::RawValue = serde_json::from_str(text).unwrap();
            calls.push(Call {
                text: whole.slice(at..at + text.len()),
                id: crate::proxy::dialect::jsonrpc::batch::id_of(raw),
                keyed: Some(((*key).to_owned(), [key.as_bytes()[0]; 32])),
            });
            at += text.len() + 1;
        }
        let budget = BodyBudget::new(1 << 20, stages.metrics.clone());
        let reservation = budget.reserve(whole.len(), Duration::from_secs(1)).await.unwrap();
        let (parts, ()) = Request::post("/rpc").body(()).unwrap().into_parts();
        Many {
            route: stages.config.routes.default.clone(),
            scope: "default:s".into(),
            peer: stage_tests::peer(),
            parts,
            body: ReservedBody::new(whole, reservation),
            items: Items::JsonRpc(calls),
        }
    }

    /// Runs `many` through the keyed task; what its client is answered.
    async fn run(stages: &Stages, many: Many) -> crate::proxy::answer::Handled {
        let permit = stages.permits.take(&many.peer).expect("a free permit");
        let (head, answer) = stage_tests::answer(&stages.metrics);
        let routes = stages.metrics.routes(std::iter::empty(), "default");
        let series = routes.get("default").clone();
        let keyed = stages.keyed(tokio_util::sync::CancellationToken::new());
        keyed
            .run_many(
                many,
                head,
                (permit, series, "https://idemproxy.dev/problems/".into()),
            )
            .await;
        answer.await.expect("an answer")
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_that_fails_one_claim_twice_refuses_that_call_alone_and_gives_its_claims_back_later() {
        let store = StubStore::new();
        store
            .then(Op::Claim, won())
            .then(Op::Claim, won())
            .then(Op::Claim, Reply::Fail(StoreError::Backend("reset".into())))
            .then(Op::Claim, Reply::Fail(StoreError::Backend("reset".into())))
            .always(Op::Release, Reply::Done(true));
        let toml = "[upstream]\nurl = \"http://127.0.0.1:1\"\n[store]\ntimeout = \"1s\"\n";
        let stages = stage_tests::stages(toml, &store);
        let many = batch(&stages, &["a", "b", "c"]).await;
        let (response, _) = run(&stages, many).await.expect("the batch is answered");
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        let answers: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let types: Vec<&str> = (0..3)
            .map(|n| answers[n]["error"]["data"]["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            [
                "https://idemproxy.dev/problems/upstream-unreachable",
                "https://idemproxy.dev/problems/upstream-unreachable",
                "https://idemproxy.dev/problems/store-unavailable"
            ],
            "the two won calls went upstream (refused there); the third is refused (fail_closed)"
        );
        assert_eq!(
            store.count(Op::Claim),
            4,
            "the failed claim is sent again, alone, once"
        );
        assert_eq!(
            store.count(Op::Release),
            2,
            "the two calls never delivered are given back"
        );
        assert_eq!(store.count(Op::Complete), 0);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            store.count(Op::Release),
            4,
            "and both unanswered claims after a store timeout"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn every_won_item_keeps_its_lease_while_the_service_works_and_a_missing_answer_is_unknown() {
        let upstream = SlowUpstream::start(Duration::from_secs(25)).await;
        let store = StubStore::new();
        store
            .always(Op::Claim, won())
            .always(Op::Heartbeat, Reply::Done(true));
        let toml = format!(
            "[upstream]\nurl = \"http://{}\"\ntimeout = \"60s\"\n[idempotency]\nlock_timeout = \"9s\"\n",
            upstream.addr
        );
        let stages = stage_tests::stages(&toml, &store);
        let many = batch(&stages, &["a", "b", "c", "a"]).await;
        let (response, _) = run(&stages, many).await.expect("the batch is answered");
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        let answers: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let codes: Vec<&serde_json::Value> = (0..4).map(|n| &answers[n]["error"]["code"]).collect();
        assert_eq!(codes, [&serde_json::json!(-32093); 4], "{answers}");
        assert_eq!(answers[3]["id"], 3, "the repeat answers under its own id");
        assert_eq!(store.count(Op::Claim), 3, "the repeated key is claimed once");
        assert_eq!(upstream.arrivals().len(), 1, "one exchange for the batch");
        // A beat every 3 s for 25 s: 8 per item, 24 in all (a beat may land as the answer comes).
        let beats = store.count(Op::Heartbeat);
        assert!((21..=27).contains(&beats), "{beats} beats");
        // The service's answer ("done") holds no response: each call's outcome is unknown, its claim
        // left to its lease (on_unknown_outcome = "retry"): nothing written, no beat after.
        assert_eq!(
            store.count(Op::Complete) + store.count(Op::Release) + store.count(Op::Hold),
            0
        );
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(
            store.count(Op::Heartbeat),
            beats,
            "the beats stopped with the request"
        );
    }
}
