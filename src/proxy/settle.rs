//! Runs right after a claim's record settled for good or for a retry (completed, released or held),
//! once the store has it, and only on routes with `on_in_flight = "wait"`: wakes this process's requests
//! waiting for that record (`store/wake.rs`), then announces the settlement to the other replicas
//! (PostgreSQL `NOTIFY` or a Redis publish, one statement, coalesced with others sent at the same time).
//! Routes that do not wait skip both, so their completions cost what they did. Touches the waiters'
//! registry and the store's announcements only.

use std::sync::Arc;

use crate::config::Route;
use crate::store::listen;
use crate::store::wake::{RecordTag, Waiters};
use crate::store::{RecordId, StoreHandle};

/// The settle stage: who is told that a record settled.
#[derive(Clone)]
pub(crate) struct Settle {
    /// The requests waiting for a key in flight, by record; shared by every worker (and the listener).
    waiters: Arc<Waiters>,
    store: StoreHandle,
    /// Whether settlements are announced to other processes through the store (only a store that
    /// several replicas share has any).
    announce: bool,
}

impl Settle {
    pub(crate) fn new(waiters: Arc<Waiters>, store: StoreHandle, announce: bool) -> Settle {
        Settle {
            waiters,
            store,
            announce,
        }
    }

    /// Wakes whoever waits for `id`'s record, here and on the other replicas. An announcement that
    /// fails is logged and left: a waiter elsewhere then re-checks when the lease it saw runs out, or
    /// gets 409 at its `wait_timeout`.
    pub(crate) async fn settled(&self, route: &Route, id: &RecordId) {
        if !route.policy.claim.on_in_flight.waits() {
            return;
        }
        let tag = RecordTag::of(&id.scope, &id.key);
        self.waiters.wake(tag);
        if !self.announce {
            return;
        }
        if let Err(error) = self
            .store
            .announce(&listen::announcement(&self.waiters, tag))
            .await
        {
            tracing::warn!(key_hash = %id.key_hash(), %error,
                "could not tell other replicas the key settled; their waiters re-check at lease end");
        }
    }
}
