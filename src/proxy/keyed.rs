//! The keyed task: runs a keyed request from its claim to its end, on a task of its own, so that a client
//! that hangs up can no longer cancel anything once the claim statement is sent. It owns the request's
//! [`Ticket`] and its answer and lends them to each stage: the claim (`claim.rs`), the wait where the
//! key is in flight on a route that waits (`wait.rs`, claiming again after each wake-up), the execution
//! of a won claim (`execute.rs`), and last the settlement: whoever waits for a record that completed,
//! was released or held is told here (`settle.rs`), and only here, before the client gets whatever end
//! of its answer the execution left it.
//!
//! It is written for a request that makes several claims: each claim runs as [`KeyedTask::claimed`]
//! does and comes back with what became of its record ([`Settled`]), and each settlement is told once
//! every answer has gone. A request that carries many keys (a JSON-RPC batch, a GraphQL mutation) is
//! run by `many.rs`, which claims, executes and settles each of its items.

use std::sync::Arc;

use super::answer::Answer;
use super::claim::{Claims, InFlight, Round, Settled};
use super::intake::Ticket;
use super::intake::many::Many;
use super::many::ManyKeys;
use super::permit::KeyedPermit;
use super::settle::Settle;
use super::wait::{Waited, Waits};
use crate::metrics::{RouteSeries, WaitResult};

/// The keyed task's stages: the claim stage (which hands won claims to the execute stage), the wait
/// stage, and who is told of a settlement.
pub(crate) struct KeyedTask {
    claims: Claims,
    waits: Waits,
    settle: Settle,
}

impl KeyedTask {
    pub(crate) fn new(claims: Claims, waits: Waits, settle: Settle) -> KeyedTask {
        KeyedTask {
            claims,
            waits,
            settle,
        }
    }

    /// The claim stage it runs.
    pub(crate) fn claims(&self) -> &Claims {
        &self.claims
    }

    /// The same task over another worker's claim stage (its upstream connections and store handle).
    pub(crate) fn with_claims(&self, claims: Claims) -> KeyedTask {
        KeyedTask {
            claims,
            waits: self.waits.clone(),
            settle: self.settle.clone(),
        }
    }

    /// A keyed request's work from its claim on, answering through `answer`, under `permit`.
    pub(crate) async fn run(self: Arc<Self>, ticket: Ticket, answer: Answer, permit: KeyedPermit) {
        let Some(settled) = self.claimed(ticket, answer, permit).await else {
            return;
        };
        if settled.fate.wakes() {
            self.settle.settled(&settled.route, &settled.id).await;
        }
        // A client that takes its time over the end of its answer keeps no waiter waiting.
        settled.rest.hand_over().await;
    }

    /// A request that carries many keys from its claims to its end (`many.rs`), answering through
    /// `answer`; `base` is what every problem `type` URI starts with.
    pub(crate) async fn run_many(
        self: Arc<Self>,
        many: Many,
        answer: Answer,
        (permit, series, base): (KeyedPermit, Arc<RouteSeries>, Arc<str>),
    ) {
        let stage = ManyKeys::new(&self.claims, &self.settle);
        stage.run(many, answer, (permit, series, &base)).await;
    }

    /// One claim: its statement, then the execution of a won claim, or the wait of a key in flight on a
    /// route that waits. What became of the record, where this request touched it.
    async fn claimed(&self, ticket: Ticket, answer: Answer, permit: KeyedPermit) -> Option<Settled> {
        let waiter = self.claims.waiter(&ticket.route, &ticket.claim.id);
        let keyed = super::claim::Keyed { ticket, answer };
        match self.claims.round(keyed, Some(permit), waiter).await {
            Round::Won(won) => Some(self.claims.execute_won(*won).await),
            // The wait (and the execution it may lead to) is as large as the claim's own future; on
            // the heap, only the requests that wait pay for it.
            Round::InFlight(in_flight) => Box::pin(self.waited(in_flight)).await,
            Round::Replayed | Round::Refused => None,
        }
    }

    /// Waits for the original of a request whose key is in flight, claiming again at each re-check,
    /// then answers or executes it as the record's fate decides; every wait is counted by how it ended.
    /// An execution starts only once the request has stopped counting as waiting.
    async fn waited(&self, in_flight: Box<InFlight>) -> Option<Settled> {
        let Ok((mut waiting, mut in_flight)) = self.waits.enter(in_flight) else {
            return None;
        };
        let won = loop {
            in_flight = match self.waits.wait(in_flight, &mut waiting).await {
                Waited::Recheck(in_flight) => in_flight,
                Waited::Answered(result) => break Err(result),
            };
            let InFlight { keyed, waiter, .. } = *in_flight;
            in_flight = match self.claims.round(keyed, None, Some(waiter)).await {
                Round::InFlight(again) => again,
                Round::Won(won) => break Ok(won),
                Round::Replayed => break Err(WaitResult::Replayed),
                Round::Refused => break Err(WaitResult::Refused),
            };
        };
        drop(waiting);
        let (result, settled) = match won {
            Err(result) => (result, None),
            Ok(won) => {
                let settled = self.claims.execute_won(*won).await;
                let result = match settled.executed {
                    true => WaitResult::Executed,
                    false => WaitResult::Refused,
                };
                (result, Some(settled))
            }
        };
        self.waits.ended(result);
        settled
    }
}
