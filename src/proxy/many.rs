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
//! A store that does not answer a claim leaves the whole request to `on_store_error`, as for a lone
//! request: what this request won so far is given back first.

pub mod graphql;
pub mod item;
pub mod jsonrpc;

/// How many of a request's claim statements, or of its items' writes, are in flight at once.
pub(crate) const CLAIMS_AT_ONCE: usize = 32;

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::{StreamExt, stream};
use tokio::time::Instant;

use self::item::{Claimed, Run, Won};
use super::answer::Answer;
use super::claim::{Attempt, Claims, Decision, decide};
use super::execute::heartbeat::Heartbeat;
use super::execute::{Executor, ItemWrite};
use super::intake::many::{ItemKey, Items, Many};
use super::passthrough::Forward;
use super::permit::KeyedPermit;
use super::settle::Settle;
use crate::config::Route;
use crate::error::ProxyError;
use crate::headers::REPLAYED_HEADER;
use crate::metrics::{Metrics, Outcome, RouteSeries};
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
    settle: &'a Settle,
}

impl<'a> ManyKeys<'a> {
    /// The stage over the claim stage's parts and `settle`.
    pub(crate) fn new(claims: &'a Claims, settle: &'a Settle) -> ManyKeys<'a> {
        let (store, executor, forward, waiters, metrics) = claims.parts();
        ManyKeys {
            store,
            executor,
            forward,
            waiters,
            metrics,
            claims,
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
        let claimed = match self.claim_all(&route, &scope, &items.keys()).await {
            Ok(claimed) => claimed,
            Err(error) => {
                let forward = Box::pin(self.forward.store_down(parts, body, &peer, error));
                answer.send(forward.await);
                return;
            }
        };
        let run = Run {
            executor: self.executor,
            settle: self.settle,
            route: &route,
            base,
            peer: &peer,
            parts: &parts,
            series: &series,
        };
        let mut handled = match items {
            Items::JsonRpc(calls) => jsonrpc::run(&run, body, calls, claimed).await,
            Items::GraphQl(fields) => graphql::run(&run, body, fields, claimed).await,
        };
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
    /// differ. A store that does not answer gives back what was won and leaves the request to
    /// `on_store_error` (its error).
    async fn claim_all(
        &self,
        route: &Arc<Route>,
        scope: &str,
        keys: &[&ItemKey],
    ) -> Result<Vec<Claimed>, StoreError> {
        let policy = &route.policy;
        let deadline = Instant::now() + policy.claim.wait_timeout;
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
            planned.push(Err(ClaimRequest {
                id: RecordId {
                    scope: scope.to_owned(),
                    key: key.clone(),
                    token: uuid::Uuid::new_v4(),
                },
                fingerprint: *fingerprint,
                lease: policy.claim.lock_timeout,
                ttl: policy.claim.ttl,
            }));
        }
        let claiming = planned.into_iter().map(|item| async move {
            match item {
                Ok(claimed) => Ok(claimed),
                Err(claim) => self.claim_one(route, claim, deadline).await,
            }
        });
        let results: Vec<Result<Claimed, StoreError>> =
            stream::iter(claiming).buffered(CLAIMS_AT_ONCE).collect().await;
        let mut claimed = Vec::with_capacity(results.len());
        let mut failed = None;
        for result in results {
            match result {
                Ok(item) => claimed.push(item),
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        if let Some(error) = failed {
            self.give_back_all(route, claimed).await;
            return Err(error);
        }
        Ok(claimed)
    }

    /// One item's claim; on a route that waits, a key in flight is claimed again each time its record
    /// settles (or its lease runs out) until `deadline`, the request's `wait_timeout`.
    async fn claim_one(
        &self,
        route: &Route,
        claim: ClaimRequest,
        deadline: Instant,
    ) -> Result<Claimed, StoreError> {
        let policy = &route.policy;
        let waits = policy.claim.on_in_flight.waits();
        let mut waiter = waits.then(|| {
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
                    return Ok(Claimed::Refused(ProxyError::RecordUnreadable));
                }
                Err(error) => {
                    // Not open yet: it was never sent, so there is nothing to give back.
                    if !matches!(error, StoreError::NotOpen) {
                        self.claims.orphaned(&claim);
                    }
                    return Err(error);
                }
            };
            if let (
                Some(waiter),
                ClaimResult::Held(Existing::Processing {
                    same_fingerprint: true,
                    lease_remaining,
                }),
            ) = (&mut waiter, &result)
                && Instant::now() < deadline
            {
                let until = (Instant::now() + *lease_remaining).min(deadline);
                tokio::select! {
                    () = waiter.woken() => {}
                    () = tokio::time::sleep_until(until) => {}
                }
                continue;
            }
            let hint = policy.claim.in_flight_retry_after;
            return Ok(match decide(result, &claim.id, hint, self.metrics) {
                Ok(Decision::Execute(..)) if sent.elapsed() > claim.lease / 2 => {
                    // Its heartbeat could come after the lease ran out: given back, as a lone claim is.
                    tracing::warn!(key_hash = %claim.id.key_hash(), "claim answered after more than half its lease; given back");
                    self.executor
                        .write_item(&claim.id, claim.lease, ItemWrite::Release)
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

    /// Gives back every item won so far, and tells whoever waits for them.
    async fn give_back_all(&self, route: &Route, claimed: Vec<Claimed>) {
        for item in claimed {
            if let Claimed::Won(won) = item {
                let id = won.into_id();
                let lease = route.policy.claim.lock_timeout;
                self.executor.write_item(&id, lease, ItemWrite::Release).await;
                self.settle.settled(route, &id).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::Request;

    use super::*;
    use crate::error::ProxyError;
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
    async fn a_store_that_fails_a_claim_gives_back_every_claim_won_and_nothing_is_forwarded() {
        let store = StubStore::new();
        store
            .then(Op::Claim, won())
            .then(Op::Claim, won())
            .then(Op::Claim, Reply::Fail(StoreError::Backend("reset".into())))
            .always(Op::Release, Reply::Done(true));
        let toml = "[upstream]\nurl = \"http://127.0.0.1:1\"\n[store]\ntimeout = \"1s\"\n";
        let stages = stage_tests::stages(toml, &store);
        let many = batch(&stages, &["a", "b", "c"]).await;
        let answer = run(&stages, many).await;
        assert!(
            matches!(answer, Err(ProxyError::StoreUnavailable(_))),
            "{answer:?}"
        );
        assert_eq!(
            store.count(Op::Release),
            2,
            "the two claims won are given back at once"
        );
        assert_eq!(store.count(Op::Complete), 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            store.count(Op::Release),
            3,
            "and the unanswered one after a store timeout"
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
