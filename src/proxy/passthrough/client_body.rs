//! Runs while a passthrough request's body streams to the upstream: bounds the silence between two chunks
//! from the client (`server.body_read_timeout`) and remembers why the client's body failed, so the answer
//! blames the client (400, 408) rather than the upstream (502). Also tells, for both passthrough and keyed
//! bodies (`intake.rs`), whether a body that ended is whole: an HTTP/2 stream the client reset before
//! `END_STREAM` ends cleanly in hyper, but it is an abandoned request, never a shorter complete one.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Version;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use crate::body::BoxError;
use crate::error::ProxyError;

/// What went wrong with the client's body, if anything; shared with the body itself.
#[derive(Clone, Default)]
pub struct ClientFailure(Arc<Mutex<Option<Failure>>>);

#[derive(Clone)]
enum Failure {
    Stalled(Duration),
    Broken(String),
}

impl ClientFailure {
    /// The client's fault as the answer, when its body failed.
    pub fn error(&self) -> Option<ProxyError> {
        let failure = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()?;
        Some(match failure {
            Failure::Stalled(after) => ProxyError::RequestTimeout(after),
            Failure::Broken(why) => ProxyError::ClientBody(why),
        })
    }

    fn set(&self, failure: Failure) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(failure);
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
pub fn ended_whole(body: &Incoming, version: Version) -> bool {
    version != Version::HTTP_2 || body.is_end_stream()
}

/// Refuses a body read to its end that is not whole: abandoned by its client ([`ended_whole`]), or of
/// `read` bytes where its `content-length` declared another length.
pub fn check_whole(
    body: &Incoming,
    version: Version,
    declared: Option<u64>,
    read: usize,
) -> Result<(), ProxyError> {
    if !ended_whole(body, version) {
        return Err(ProxyError::ClientBody(ABANDONED.into()));
    }
    match declared {
        Some(length) if u64::try_from(read).ok() != Some(length) => Err(ProxyError::ClientBody(format!(
            "{read} bytes where content-length declared {length}"
        ))),
        _ => Ok(()),
    }
}

/// The client's request body with an idle bound between frames, which ends in an error rather than
/// cleanly when its client abandoned it.
pub struct GuardedBody {
    inner: Incoming,
    version: Version,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    failure: ClientFailure,
}

impl GuardedBody {
    /// Wraps `inner`, the body of a request of `version`; a gap of more than `idle` between two frames
    /// ends the body with an error.
    pub fn new(inner: Incoming, version: Version, idle: Duration) -> (GuardedBody, ClientFailure) {
        let failure = ClientFailure::default();
        let body = GuardedBody {
            inner,
            version,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            failure: failure.clone(),
        };
        (body, failure)
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
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.deadline.as_mut().reset(Instant::now() + this.idle);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                this.failure.set(Failure::Broken(error.to_string()));
                Poll::Ready(Some(Err(error.into())))
            }
            Poll::Ready(None) if !ended_whole(&this.inner, this.version) => {
                this.failure.set(Failure::Broken(ABANDONED.into()));
                Poll::Ready(Some(Err(ABANDONED.into())))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.failure.set(Failure::Stalled(this.idle));
                    Poll::Ready(Some(Err("the client's request body stalled".into())))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
