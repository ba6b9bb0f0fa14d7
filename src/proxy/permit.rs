//! The permits keyed work runs under: one of the process's `server.max_keyed_in_flight` and one of its
//! connection's `server.max_keyed_per_connection`, held by a keyed request's work to its end, detached
//! from its client or not. Taken by the spine before a claim, and by the claim stage for a request that
//! waited (it gave its permit up while it waited).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::downstream::Downstream;
use crate::error::Busy;

/// The process's keyed permits, shared by every worker.
#[derive(Clone)]
pub(crate) struct KeyedPermits(Arc<Semaphore>);

impl KeyedPermits {
    /// `max` permits (`server.max_keyed_in_flight`).
    pub(crate) fn new(max: usize) -> KeyedPermits {
        KeyedPermits(Arc::new(Semaphore::new(max)))
    }

    /// A permit for a keyed request's work, if its connection and the process both have one free.
    pub(crate) fn take(&self, peer: &Downstream) -> Result<KeyedPermit, Busy> {
        let connection = peer.keyed_permit().ok_or(Busy::KeyedOnConnection)?;
        let Ok(process) = self.0.clone().try_acquire_owned() else {
            return Err(Busy::KeyedInFlight);
        };
        Ok(KeyedPermit {
            _process: process,
            _connection: connection,
        })
    }
}

/// One keyed request's permits (the process's and its connection's), given back when dropped.
pub(crate) struct KeyedPermit {
    _process: OwnedSemaphorePermit,
    _connection: OwnedSemaphorePermit,
}
