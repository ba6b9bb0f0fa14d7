//! The one response body type every path of the proxy answers with: upstream bodies streamed through,
//! relay channels, stored bodies and problem documents, all boxed behind [`ProxyBody`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};

/// Errors a body may yield mid-stream.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed response (or upstream request) body.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// A body of known bytes.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

/// Known bytes, then `trailers`. Its length is left undeclared, so an HTTP/1.1 hop sends it chunked,
/// the only framing that carries trailers there.
pub fn full_with_trailers(bytes: impl Into<Bytes>, trailers: HeaderMap) -> ProxyBody {
    let frames = [Frame::data(bytes.into()), Frame::trailers(trailers)];
    StreamBody::new(futures_util::stream::iter(frames.map(Ok))).boxed()
}

/// A request body read whole, kept beside the one sent, so that a request the upstream certainly did
/// not process (its HTTP/2 stream refused) can be sent once more. Shares the bytes rather than copying
/// them, and holds what pays for them (the body budget's reservation) until the last copy is gone.
#[derive(Clone)]
pub struct Resendable {
    bytes: Bytes,
    trailers: Option<HeaderMap>,
    paid: Arc<dyn Send + Sync>,
}

impl Resendable {
    /// `bytes` then `trailers`, paid for by `paid`.
    pub fn new(bytes: Bytes, trailers: Option<HeaderMap>, paid: Arc<dyn Send + Sync>) -> Resendable {
        Resendable {
            bytes,
            trailers,
            paid,
        }
    }

    /// No body at all: nothing to pay for.
    pub fn empty() -> Resendable {
        Resendable::new(Bytes::new(), None, Arc::new(()))
    }

    /// A copy of the body to send.
    pub fn body(&self) -> ProxyBody {
        let body = match &self.trailers {
            None => full(self.bytes.clone()),
            Some(trailers) => full_with_trailers(self.bytes.clone(), trailers.clone()),
        };
        let paying = Paying {
            _paid: self.paid.clone(),
        };
        inspected(body, paying)
    }
}

/// What pays for a body's bytes, held until the body is dropped; it looks at no frame.
struct Paying {
    _paid: Arc<dyn Send + Sync>,
}

impl Inspect for Paying {
    fn frame(&mut self, _: &Frame<Bytes>) {}
}

/// A body with no bytes.
pub fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed()
}

/// What watches a body's frames as they pass ([`inspected`]); the body's end, or its being dropped
/// before the end, it learns by its own `Drop`, which runs after the body's.
pub trait Inspect: Send + Sync + Unpin + 'static {
    /// Sees each frame the body yields, before its reader does.
    fn frame(&mut self, frame: &Frame<Bytes>);
}

/// `body` with `inspector` told of each of its frames, and dropped with it.
pub fn inspected(body: ProxyBody, inspector: impl Inspect) -> ProxyBody {
    Inspected { body, inspector }.boxed()
}

/// A body and its inspector; fields drop in order, so the inspector outlives the body it watched.
struct Inspected<I> {
    body: ProxyBody,
    inspector: I,
}

impl<I: Inspect> Body for Inspected<I> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            this.inspector.frame(frame);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
