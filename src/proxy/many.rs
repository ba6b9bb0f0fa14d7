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

use std::sync::Arc;

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
use crate::metrics::{Metrics, RouteSeries};
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
        let handled = match items {
            Items::JsonRpc(calls) => jsonrpc::run(&run, body, calls, claimed).await,
            Items::GraphQl(fields) => graphql::run(&run, body, fields, claimed).await,
        };
        answer.send(handled);
    }

    /// Claims every keyed item in the client's order. A store that does not answer gives back what was
    /// won and leaves the request to `on_store_error` (its error).
    async fn claim_all(
        &self,
        route: &Arc<Route>,
        scope: &str,
        keys: &[&ItemKey],
    ) -> Result<Vec<Claimed>, StoreError> {
        let policy = &route.policy;
        let deadline = Instant::now() + policy.claim.wait_timeout;
        let mut claimed: Vec<Claimed> = Vec::with_capacity(keys.len());
        for (n, keyed) in keys.iter().enumerate() {
            let Some((key, fingerprint)) = keyed else {
                claimed.push(Claimed::Unkeyed);
                continue;
            };
            let earlier = keys[..n]
                .iter()
                .position(|other| other.as_ref().is_some_and(|(k, _)| k == key));
            if let Some(earlier) = earlier {
                let same = keys[earlier].as_ref().is_some_and(|(_, f)| f == fingerprint);
                claimed.push(match same {
                    true => Claimed::Repeat(earlier),
                    false => Claimed::Refused(ProxyError::KeyReused),
                });
                continue;
            }
            let claim = ClaimRequest {
                id: RecordId {
                    scope: scope.to_owned(),
                    key: key.clone(),
                    token: uuid::Uuid::new_v4(),
                },
                fingerprint: *fingerprint,
                lease: policy.claim.lock_timeout,
                ttl: policy.claim.ttl,
            };
            match self.claim_one(route, claim, deadline).await {
                Ok(item) => claimed.push(item),
                Err(error) => {
                    self.give_back_all(route, claimed).await;
                    return Err(error);
                }
            }
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
