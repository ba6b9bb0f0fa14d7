//! The slots keyed work runs in: one of the process's `server.max_keyed_in_flight` and one of its
//! connection's `server.max_keyed_per_connection`, held by a keyed request's work to its end, detached
//! from its client or not. Taken by the spine before a claim, and by the claim stage for a request that
//! waited (it gave its slot up while it waited).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::downstream::Downstream;
use crate::error::Busy;

/// The process's keyed slots, shared by every worker.
#[derive(Clone)]
pub(crate) struct KeyedSlots(Arc<Semaphore>);

impl KeyedSlots {
    /// `max` slots (`server.max_keyed_in_flight`).
    pub(crate) fn new(max: usize) -> KeyedSlots {
        KeyedSlots(Arc::new(Semaphore::new(max)))
    }

    /// A slot for a keyed request's work, if its connection and the process both have one free.
    pub(crate) fn take(&self, peer: &Downstream) -> Result<KeyedSlot, Busy> {
        let connection = peer.keyed_slot().ok_or(Busy::KeyedOnConnection)?;
        let Ok(process) = self.0.clone().try_acquire_owned() else {
            return Err(Busy::KeyedInFlight);
        };
        Ok(KeyedSlot {
            _process: process,
            _connection: connection,
        })
    }
}

/// One keyed request's slots, given back when dropped.
pub(crate) struct KeyedSlot {
    _process: OwnedSemaphorePermit,
    _connection: OwnedSemaphorePermit,
}
