//! What the relay of a keyed response hands its head, each frame and its end to beside its client (the
//! duplicates that follow it, `attach.rs`), so that the relay names none of them. A leaf: it knows the
//! frame and the head only.

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::Frame;

/// One who gets every frame of a keyed response as the relay reads it, whether or not its client is
/// still there.
pub(crate) trait Tap: Send {
    /// The response's head, with the headers a replay of it would carry.
    fn head(&mut self, status: StatusCode, headers: HeaderMap);
    /// A frame, as it goes to the client (or would have, had the client stayed).
    fn frame(&mut self, frame: &Frame<Bytes>);
    /// The response ended: `whole` once its record is written, else broken off.
    fn end(self: Box<Self>, whole: bool);
}
