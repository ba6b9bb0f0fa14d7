//! Runs while a passthrough request's body streams to the upstream: bounds the silence between two chunks
//! from the client (`server.body_read_timeout`) and remembers why the client's body failed, so the answer
//! blames the client (400, 408) rather than the upstream (502).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
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

/// The client's request body with an idle bound between frames.
pub struct GuardedBody {
    inner: Incoming,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    failure: ClientFailure,
}

impl GuardedBody {
    /// Wraps `inner`; a gap of more than `idle` between two frames ends the body with an error.
    pub fn new(inner: Incoming, idle: Duration) -> (GuardedBody, ClientFailure) {
        let failure = ClientFailure::default();
        let body = GuardedBody {
            inner,
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
