//! Runs before a keyed request's body is read whole (to fingerprint it), and until it has been sent
//! upstream: one budget of bytes, `server.max_buffered_bodies`, shared by every such body in the process.
//! Each body reserves its declared length (or `max_request_body` when the length is not declared) in one
//! piece before a byte is read, so no body holds part of the budget while waiting for more; what a body of
//! undeclared length did not use is returned once it has been read. Reading a body as JSON takes its
//! working memory from the budget too, growing the body's reservation while the parse runs, without
//! waiting (a body held while waiting for more would hold the budget against others). A flood of large
//! bodies waits, then gets 503 — it never costs more memory than the budget.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::body::{ProxyBody, Resendable};
use crate::metrics::Metrics;

/// The process's budget for buffered keyed request bodies, in bytes.
#[derive(Clone)]
pub struct BodyBudget {
    free: Arc<Semaphore>,
    metrics: Metrics,
}

/// Bytes of the budget held by one body; returned when dropped.
pub struct Reservation {
    free: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
}

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize, metrics: Metrics) -> BodyBudget {
        BodyBudget {
            free: Arc::new(Semaphore::new(bytes.min(Semaphore::MAX_PERMITS))),
            metrics,
        }
    }

    /// Reserves `bytes` in one piece, waiting up to `patience` while the budget is spent; `None` when it
    /// stays spent that long.
    pub async fn reserve(&self, bytes: usize, patience: Duration) -> Option<Reservation> {
        if bytes == 0 {
            return Some(Reservation {
                free: self.free.clone(),
                held: None,
            });
        }
        let bytes = u32::try_from(bytes).ok()?;
        let permit = match self.free.clone().try_acquire_many_owned(bytes) {
            Ok(permit) => permit,
            Err(_) => {
                self.metrics.body_budget_waits.inc();
                let waiting = self.free.clone().acquire_many_owned(bytes);
                tokio::time::timeout(patience, waiting).await.ok()?.ok()?
            }
        };
        Some(Reservation {
            free: self.free.clone(),
            held: Some(permit),
        })
    }
}

impl Reservation {
    /// Takes `bytes` more from the budget if they are free now; `false` (and nothing taken) if not.
    pub fn try_grow(&mut self, bytes: usize) -> bool {
        let Ok(bytes) = u32::try_from(bytes) else {
            return false;
        };
        let Ok(more) = self.free.clone().try_acquire_many_owned(bytes) else {
            return false;
        };
        match &mut self.held {
            Some(held) => held.merge(more),
            None => self.held = Some(more),
        }
        true
    }

    /// The bytes it holds.
    pub fn held(&self) -> usize {
        self.held.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }

    /// Returns everything beyond `bytes` to the budget.
    pub fn shrink_to(&mut self, bytes: usize) {
        if let Some(held) = &mut self.held
            && held.num_permits() > bytes
        {
            drop(held.split(held.num_permits() - bytes));
        }
    }
}

/// A keyed request's body, holding its share of the budget until it is dropped (sent upstream, or
/// answered without forwarding).
pub struct ReservedBody {
    /// The body's bytes.
    pub bytes: Bytes,
    /// The trailers the client sent after them, forwarded after them (not part of the fingerprint).
    /// Boxed: rare, and the body is moved along the keyed path many times.
    trailers: Option<Box<HeaderMap>>,
    reservation: Reservation,
}

impl ReservedBody {
    /// Bytes and the reservation that pays for them.
    pub fn new(bytes: Bytes, reservation: Reservation) -> ReservedBody {
        ReservedBody {
            bytes,
            trailers: None,
            reservation,
        }
    }

    /// The same body, with the trailers its client sent after it.
    pub fn with_trailers(self, trailers: Option<HeaderMap>) -> ReservedBody {
        ReservedBody {
            trailers: trailers.map(Box::new),
            ..self
        }
    }

    /// Takes `bytes` more from the budget, held as long as the body is, if they are free now; `false`
    /// (and nothing taken) if not.
    pub fn hold_more(&mut self, bytes: usize) -> bool {
        self.reservation.try_grow(bytes)
    }

    /// A body of its own for one part of this request (a GraphQL field's operation), paid for by this
    /// body's reservation, which must outlive it: it holds none, and carries no trailers.
    pub fn part(&self, bytes: Bytes) -> ReservedBody {
        ReservedBody::new(
            bytes,
            Reservation {
                free: self.reservation.free.clone(),
                held: None,
            },
        )
    }

    /// Runs `work` on the bytes, giving it a way to grow the reservation for working memory (`true`
    /// when the budget had the bytes free); what it grew by goes back to the budget when it returns.
    pub fn working<R>(&mut self, work: impl FnOnce(&[u8], &mut dyn FnMut(usize) -> bool) -> R) -> R {
        let reservation = &mut self.reservation;
        let held = reservation.held();
        let mut grow = |bytes| reservation.try_grow(bytes);
        let result = work(&self.bytes, &mut grow);
        self.reservation.shrink_to(held);
        result
    }

    /// The body for the upstream request, and a copy of it to send again if need be; the reservation
    /// is held until both are gone.
    pub fn into_resendable(self) -> (ProxyBody, Resendable) {
        let trailers = self.trailers.map(|trailers| *trailers);
        let again = Resendable::new(self.bytes, trailers, Arc::new(self.reservation));
        (again.body(), again)
    }

    /// The body for the upstream request; the reservation goes with it.
    pub fn into_body(self) -> ProxyBody {
        Held {
            inner: Full::new(self.bytes),
            trailers: self.trailers,
            _reservation: self.reservation,
        }
        .map_err(|never| match never {})
        .boxed()
    }
}

struct Held {
    inner: Full<Bytes>,
    /// Sent once the bytes are.
    trailers: Option<Box<HeaderMap>>,
    _reservation: Reservation,
}

impl Body for Held {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(None) => Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(*t)))),
            polled => polled,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream() && self.trailers.is_none()
    }

    /// Exact without trailers; with them, left undeclared, so an HTTP/1.1 upstream gets the body
    /// chunked, the only framing that carries trailers there.
    fn size_hint(&self) -> SizeHint {
        match self.trailers {
            None => self.inner.size_hint(),
            Some(_) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATIENCE: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn a_body_that_does_not_fit_waits_until_another_is_sent() {
        let metrics = Metrics::new();
        let budget = BodyBudget::new(100, metrics.clone());
        let first = budget.reserve(90, PATIENCE).await.unwrap();
        let held = ReservedBody::new(Bytes::from(vec![0; 90]), first);

        let waiting = budget.clone();
        let second = tokio::spawn(async move { waiting.reserve(20, PATIENCE).await.is_some() });
        while metrics.body_budget_waits.get() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(!second.is_finished(), "20 bytes do not fit beside 90 of 100");
        let body = held.into_body();
        assert_eq!(
            body.size_hint().exact(),
            Some(90),
            "the upstream learns the length"
        );
        drop(body);
        assert!(second.await.unwrap(), "room once the first body is gone");
    }

    #[tokio::test]
    async fn working_memory_grows_the_reservation_while_free_and_goes_back_after() {
        let budget = BodyBudget::new(100, Metrics::new());
        let reservation = budget.reserve(40, PATIENCE).await.unwrap();
        let mut body = ReservedBody::new(Bytes::from(vec![0; 40]), reservation);
        let (first, second) = body.working(|bytes, grow| {
            assert_eq!(bytes.len(), 40);
            (grow(50), grow(20))
        });
        assert!(first, "50 of the 60 left are free");
        assert!(!second, "20 more are not: refused at once, not waited for");
        assert!(budget.reserve(60, Duration::from_millis(10)).await.is_some());
        drop(body);
        assert!(budget.reserve(100, Duration::from_millis(10)).await.is_some());

        let mut empty = ReservedBody::new(Bytes::new(), budget.reserve(0, PATIENCE).await.unwrap());
        assert!(empty.working(|_, grow| grow(100)));
        assert!(budget.reserve(100, Duration::from_millis(10)).await.is_some());
    }

    #[tokio::test]
    async fn a_body_kept_to_send_again_holds_its_bytes_until_its_last_copy_is_gone() {
        let budget = BodyBudget::new(100, Metrics::new());
        let reservation = budget.reserve(40, PATIENCE).await.unwrap();
        let (sent, kept) = ReservedBody::new(Bytes::from(vec![0; 40]), reservation).into_resendable();
        let resent = kept.body();
        drop((sent, kept));
        assert!(
            budget.reserve(61, Duration::from_millis(10)).await.is_none(),
            "the copy being sent again still holds the 40 bytes"
        );
        drop(resent);
        assert!(budget.reserve(100, Duration::from_millis(10)).await.is_some());
    }

    #[tokio::test]
    async fn unused_bytes_are_returned_and_a_spent_budget_gives_up_after_patience() {
        let budget = BodyBudget::new(100, Metrics::new());
        let mut undeclared = budget.reserve(100, PATIENCE).await.unwrap();
        assert!(budget.reserve(1, Duration::from_millis(10)).await.is_none());
        undeclared.shrink_to(30);
        assert!(budget.reserve(70, Duration::from_millis(10)).await.is_some());
    }
}
