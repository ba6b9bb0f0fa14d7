//! Runs inside the relay of a won claim, once per upstream body frame: keeps a copy of the body for
//! storage while it stays under `idempotency.max_stored_response` and the process's capture budget
//! (`server.max_buffered_responses`) has room. Over either, it stops capturing, never forwarding.
//! Touches only its share of the budget.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use prometheus::IntCounter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The body as it will be stored, while it stays under the cap and the process's capture budget
/// (`server.max_buffered_responses`) has room for it.
pub(super) struct Capture {
    limit: u64,
    chunks: Vec<Bytes>,
    len: u64,
    over: bool,
    budget: Arc<Semaphore>,
    reservation: Option<OwnedSemaphorePermit>,
    /// Counts captures given up because the budget had no room.
    starved: IntCounter,
}

/// What a capture kept.
pub(super) struct Captured {
    /// The whole body, or `None` when it went over the cap or the budget.
    pub(super) body: Option<Bytes>,
    /// The share of the budget the body holds until it is stored.
    pub(super) reservation: Option<OwnedSemaphorePermit>,
}

impl Capture {
    pub(super) fn new(limit: u64, budget: Arc<Semaphore>, starved: IntCounter) -> Capture {
        Capture {
            limit,
            chunks: Vec::new(),
            len: 0,
            over: false,
            budget,
            reservation: None,
            starved,
        }
    }

    pub(super) fn push(&mut self, data: Bytes) {
        if self.over || data.is_empty() {
            return;
        }
        self.len += data.len() as u64;
        if self.len > self.limit {
            return self.give_up();
        }
        let room = u32::try_from(data.len())
            .ok()
            .and_then(|n| self.budget.clone().try_acquire_many_owned(n).ok());
        let Some(room) = room else {
            self.starved.inc();
            return self.give_up();
        };
        match &mut self.reservation {
            Some(held) => held.merge(room),
            None => self.reservation = Some(room),
        }
        self.chunks.push(data);
    }

    /// Stops capturing: the body will not be retained, and its share of the budget goes back.
    fn give_up(&mut self) {
        self.over = true;
        self.chunks = Vec::new();
        self.reservation = None;
    }

    pub(super) fn finish(self) -> Captured {
        let body = if self.over {
            None
        } else if self.chunks.len() == 1 {
            self.chunks.into_iter().next()
        } else {
            let mut body = BytesMut::with_capacity(self.len as usize);
            for chunk in self.chunks {
                body.extend_from_slice(&chunk);
            }
            Some(body.freeze())
        };
        Captured {
            body,
            reservation: self.reservation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(bytes: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(bytes))
    }

    fn starved() -> IntCounter {
        IntCounter::new("starved", "test").unwrap()
    }

    #[test]
    fn capture_keeps_the_body_under_the_cap() {
        let mut capture = Capture::new(6, budget(100), starved());
        capture.push(Bytes::from_static(b"abc"));
        capture.push(Bytes::from_static(b"def"));
        assert_eq!(capture.finish().body.as_deref(), Some(&b"abcdef"[..]));
    }

    #[test]
    fn capture_drops_the_body_over_the_cap_and_gives_its_budget_back() {
        let shared = budget(100);
        let counted = starved();
        let mut capture = Capture::new(5, shared.clone(), counted.clone());
        capture.push(Bytes::from_static(b"abc"));
        assert_eq!(shared.available_permits(), 97);
        capture.push(Bytes::from_static(b"def"));
        capture.push(Bytes::from_static(b"g"));
        let captured = capture.finish();
        assert_eq!(captured.body, None);
        assert_eq!(counted.get(), 0, "over the cap, not the budget");
        assert_eq!(shared.available_permits(), 100);
    }

    #[test]
    fn a_capture_without_room_in_the_budget_is_not_retained() {
        let shared = budget(4);
        let counted = starved();
        let mut first = Capture::new(100, shared.clone(), counted.clone());
        first.push(Bytes::from_static(b"abc"));
        let mut second = Capture::new(100, shared.clone(), counted.clone());
        second.push(Bytes::from_static(b"de"));
        assert_eq!(counted.get(), 1, "counted when it happens");
        assert_eq!(second.finish().body, None);
        let kept = first.finish();
        assert_eq!(kept.body.as_deref(), Some(&b"abc"[..]));
        assert_eq!(shared.available_permits(), 1, "held until the body is stored");
        drop(kept);
        assert_eq!(shared.available_permits(), 4);
    }

    #[test]
    fn empty_body_is_retained_as_empty() {
        let captured = Capture::new(0, budget(0), starved()).finish();
        assert_eq!(captured.body.as_deref(), Some(&b""[..]));
    }
}
