//! Runs while a client's request body is read: streamed to the upstream (passthrough), or read whole
//! before the claim (`intake.rs`). Bounds the silence between two chunks of a streamed body
//! (`server.body_read_timeout`) and remembers why the client's body failed, so the answer blames the
//! client (400, 408) rather than the upstream (502). Ends a body that is not whole in an error: an HTTP/2
//! stream the client reset before `END_STREAM` ends cleanly in hyper, but it is an abandoned request,
//! never a shorter complete one. And tells the client's connection ([`BodyWatch`], `server/slots.rs`)
//! when the body waits for its client and when it makes progress, so that at the connection cap a
//! connection whose requests all wait on stalled or trickled bodies is closed like an idle one. Its
//! trailers are cleaned on the way (`trailers.rs`).

use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Version};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::trailers::{TrailerRules, connection_named};
use crate::access::{self, Ledger};
use crate::body::BoxError;
use crate::error::{Busy, ProxyError};

/// What a client's connection is told about its requests' bodies as they are read. At the connection cap,
/// a connection whose every request in progress waits for its client, with no progress for a while, is
/// evicted like an idle one.
pub trait BodyWatch: Send + Sync {
    /// A body waits for its client: the proxy asked for bytes and has none, and no response has begun.
    fn waiting(&self);
    /// The body's wait has ended (bytes came, it ended, or a response began); `false` when its connection
    /// was evicted while it waited, and the body must then fail.
    fn resumed(&self) -> bool;
    /// A body made progress: it started, or brought [`PROGRESS`] more bytes.
    fn progressed(&self);
}

/// Bytes of body that count as progress. A body that brings fewer within the listener's idle minimum
/// (1 s at most) counts as idle while it waits: a client trickling a few bytes a second keeps nothing.
pub const PROGRESS: usize = 16 * 1024;

/// Where a body stands with its client; its wait is counted on the connection only in `WAITING`.
const READING: u8 = 0;
const WAITING: u8 = 1;
/// A response has begun: the body's waits no longer count.
const ANSWERED: u8 = 2;

/// The proxy's side of a client's body: why it failed, if it did, and whether it waits for its client;
/// shared with the body itself.
#[derive(Clone)]
pub struct ClientSide(Arc<Shared>);

struct Shared {
    failure: Mutex<Option<Failure>>,
    state: AtomicU8,
    watch: Option<Arc<dyn BodyWatch>>,
}

#[derive(Clone)]
enum Failure {
    Stalled(Duration),
    Broken(String),
    /// The connection was evicted to make room while the body waited for its client.
    Evicted,
}

impl ClientSide {
    fn new(watch: Option<Arc<dyn BodyWatch>>) -> ClientSide {
        if let Some(watch) = &watch {
            watch.progressed();
        }
        ClientSide(Arc::new(Shared {
            failure: Mutex::new(None),
            state: AtomicU8::new(READING),
            watch,
        }))
    }

    /// The client's fault as the answer, when its body failed.
    pub fn error(&self) -> Option<ProxyError> {
        let failure = self.0.failure.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        Some(match failure {
            Failure::Stalled(after) => ProxyError::RequestTimeout(after),
            Failure::Broken(why) => ProxyError::ClientBody(why),
            Failure::Evicted => ProxyError::Busy(Busy::Connections),
        })
    }

    /// A response to the request has begun: its connection is not idle, whatever its body does.
    pub fn answered(&self) {
        if self.0.state.swap(ANSWERED, Ordering::SeqCst) == WAITING {
            self.resumed();
        }
    }

    fn set(&self, failure: Failure) {
        *self.0.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(failure);
    }

    /// The body has nothing from its client.
    fn wait(&self) {
        let Some(watch) = &self.0.watch else { return };
        let state = &self.0.state;
        if state
            .compare_exchange(READING, WAITING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            watch.waiting();
        }
    }

    /// The body has something from its client (or ended); `false` when its connection was evicted while
    /// it waited.
    fn fed(&self) -> bool {
        let state = &self.0.state;
        let waited = state
            .compare_exchange(WAITING, READING, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        !waited || self.resumed()
    }

    fn resumed(&self) -> bool {
        self.0.watch.as_ref().is_none_or(|watch| watch.resumed())
    }

    fn progressed(&self) {
        if let Some(watch) = &self.0.watch {
            watch.progressed();
        }
    }
}

/// What an abandoned body is refused with.
const ABANDONED: &str = "the client abandoned the request body (its HTTP/2 stream was reset before the end)";

/// Whether `body`, just read to its end, ended as its client meant it to. An HTTP/1.1 body ends only at
/// its declared length or its last chunk: hyper reports any other end as an error. An HTTP/2 body ends
/// with `END_STREAM`, but hyper also ends it cleanly, without an error, when the client resets the
/// stream with `NO_ERROR` (RFC 9113 §8.1 lets a client stop sending that way once it has its answer).
/// The h2 stream remembers whether `END_STREAM` arrived, through a reset too, and `is_end_stream` reads
/// it once every frame has been taken.
fn ended_whole(body: &Incoming, version: Version) -> bool {
    version != Version::HTTP_2 || body.is_end_stream()
}

/// Refuses a body of `read` bytes whose `content-length` declared another length.
pub fn check_length(declared: Option<u64>, read: usize) -> Result<(), ProxyError> {
    match declared {
        Some(length) if u64::try_from(read).ok() != Some(length) => Err(ProxyError::ClientBody(format!(
            "{read} bytes where content-length declared {length}"
        ))),
        _ => Ok(()),
    }
}

/// What a body caught waiting by its connection's eviction fails with.
const EVICTED: &str = "the connection was closed to make room while its request's body waited";

/// The client's request body: ends in an error rather than cleanly when its client abandoned it,
/// optionally with an idle bound between frames, and reporting its waits to its connection.
pub struct GuardedBody {
    inner: Incoming,
    version: Version,
    /// How its trailers are cleaned before they go on.
    trailers: Trailers,
    idle: Option<Idle>,
    client: ClientSide,
    /// Bytes since the body last reported progress.
    unreported: usize,
    /// The request's access-log ledger, which counts the bytes read (`access.rs`), while the log is on.
    ledger: Option<Arc<Ledger>>,
}

/// The rules a body's trailers are cleaned by (`trailers.rs`), and the fields its head's `Connection`
/// names.
pub(crate) struct Trailers {
    rules: Arc<TrailerRules>,
    named: Vec<HeaderName>,
}

impl Trailers {
    /// The rules for a request with `head`.
    pub(crate) fn of(rules: &Arc<TrailerRules>, head: &HeaderMap) -> Trailers {
        let named = if head.contains_key(http::header::CONNECTION) {
            connection_named(head)
        } else {
            Vec::new()
        };
        Trailers {
            rules: rules.clone(),
            named,
        }
    }

    fn clean(&self, frame: Frame<Bytes>) -> Frame<Bytes> {
        match frame.into_trailers() {
            Ok(mut trailers) => {
                self.rules.clean(&mut trailers, &self.named);
                Frame::trailers(trailers)
            }
            Err(frame) => frame,
        }
    }
}

/// The bound on the silence between two frames.
struct Idle {
    after: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl GuardedBody {
    /// Wraps `inner`, the body of a request of `version` streamed as it arrives; a gap of more than
    /// `idle` between two frames ends the body with an error. Its waits are reported to `watch`.
    pub(crate) fn new(
        inner: Incoming,
        (version, trailers): (Version, Trailers),
        idle: Duration,
        watch: Option<Arc<dyn BodyWatch>>,
    ) -> (GuardedBody, ClientSide) {
        let mut guarded = GuardedBody::whole(inner, (version, trailers), watch);
        guarded.idle = Some(Idle {
            after: idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
        });
        let client = guarded.client.clone();
        (guarded, client)
    }

    /// Wraps `inner`, a body read whole under a bound of the caller's; its waits are reported to `watch`.
    pub(crate) fn whole(
        inner: Incoming,
        (version, trailers): (Version, Trailers),
        watch: Option<Arc<dyn BodyWatch>>,
    ) -> GuardedBody {
        GuardedBody {
            inner,
            version,
            trailers,
            idle: None,
            client: ClientSide::new(watch),
            unreported: 0,
            ledger: access::current(),
        }
    }

    /// Why the body failed, if it did.
    pub fn error(&self) -> Option<ProxyError> {
        self.client.error()
    }

    /// A frame (or the end) came: the wait, if any, is over, and enough bytes are progress.
    fn fed(&mut self, frame: &Option<Result<Frame<Bytes>, hyper::Error>>) -> Result<(), BoxError> {
        if !self.client.fed() {
            self.client.set(Failure::Evicted);
            return Err(EVICTED.into());
        }
        if let Some(Ok(frame)) = frame
            && let Some(data) = frame.data_ref()
        {
            self.unreported += data.len();
            if let Some(ledger) = &self.ledger {
                ledger.body_read(data.len());
            }
            if self.unreported >= PROGRESS {
                self.unreported = 0;
                self.client.progressed();
            }
        }
        if let Some(idle) = &mut self.idle {
            idle.deadline.as_mut().reset(Instant::now() + idle.after);
        }
        Ok(())
    }

    /// Nothing came: the body waits for its client, until its idle bound if it has one.
    fn starved(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.client.wait();
        let Some(idle) = &mut self.idle else {
            return Poll::Pending;
        };
        match idle.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.client.set(Failure::Stalled(idle.after));
                Poll::Ready(Some(Err("the client's request body stalled".into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => return this.starved(cx),
            Poll::Ready(polled) => polled,
        };
        if let Err(evicted) = this.fed(&polled) {
            return Poll::Ready(Some(Err(evicted)));
        }
        Poll::Ready(match polled {
            Some(Ok(frame)) => Some(Ok(this.trailers.clean(frame))),
            Some(Err(error)) => {
                this.client.set(Failure::Broken(error.to_string()));
                Some(Err(error.into()))
            }
            None if !ended_whole(&this.inner, this.version) => {
                this.client.set(Failure::Broken(ABANDONED.into()));
                Some(Err(ABANDONED.into()))
            }
            None => None,
        })
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        // A body dropped while it waited no longer waits.
        self.client.fed();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicI64;

    use super::*;

    /// Counts the waits its connection is told of.
    #[derive(Default)]
    struct Waits(AtomicI64);

    impl BodyWatch for Waits {
        fn waiting(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }

        fn resumed(&self) -> bool {
            self.0.fetch_sub(1, Ordering::SeqCst);
            true
        }

        fn progressed(&self) {}
    }

    #[test]
    fn a_body_s_wait_ends_once_and_stops_counting_once_a_response_has_begun() {
        let waits = Arc::new(Waits::default());
        let client = ClientSide::new(Some(waits.clone()));
        let count = || waits.0.load(Ordering::SeqCst);
        client.wait();
        client.wait();
        assert_eq!(count(), 1, "one wait, however often the body finds nothing");
        assert!(client.fed());
        assert!(client.fed());
        assert_eq!(count(), 0);
        client.wait();
        client.answered();
        assert_eq!(count(), 0, "a response began: the wait is over");
        client.wait();
        assert_eq!(count(), 0, "and no later wait counts");
        assert!(client.fed());
        assert_eq!(count(), 0);
    }

    #[test]
    fn a_length_other_than_the_declared_one_is_refused() {
        assert!(check_length(Some(5), 5).is_ok());
        assert!(check_length(None, 7).is_ok());
        assert!(matches!(
            check_length(Some(10), 5),
            Err(ProxyError::ClientBody(_))
        ));
    }
}
