//! The relay's bounded channel to the client's response body, used by `execute/relay.rs`: frames in
//! order, then either a clean end or an error. The end is only reported once every frame sent before it has been
//! delivered, and an abort is never reported as a clean end.
//!
//! `http_body_util::channel::Channel` is not used here: once its frame queue looks empty it checks the
//! abort slot, and a sender that queued its last frame and was dropped between those two checks
//! (the relay and the connection run on different threads) ends the body early, without that frame and
//! without an error. The client would see a truncated response framed as complete.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::sync::{mpsc, oneshot};

use crate::body::BoxError;

/// Creates a channel buffering up to `frames` frames.
pub fn channel(frames: usize) -> (Sender, Receiver) {
    let (frames_tx, frames_rx) = mpsc::channel(frames);
    let (error_tx, error_rx) = oneshot::channel();
    (
        Sender {
            frames: frames_tx,
            error: error_tx,
        },
        Receiver {
            frames: frames_rx,
            error: error_rx,
        },
    )
}

/// The relay's end.
pub struct Sender {
    frames: mpsc::Sender<Frame<Bytes>>,
    error: oneshot::Sender<BoxError>,
}

impl Sender {
    /// Queues a frame, waiting while the buffer is full; `Err` when the client's body is gone.
    pub async fn send(&mut self, frame: Frame<Bytes>) -> Result<(), Frame<Bytes>> {
        self.frames.send(frame).await.map_err(|e| e.0)
    }

    /// Ends the body with `error` after the frames already queued.
    pub fn abort(self, error: BoxError) {
        // The error is in place before the frame queue closes, which is when the receiver looks for it.
        let _ = self.error.send(error);
    }
}

/// The response body the client reads.
pub struct Receiver {
    frames: mpsc::Receiver<Frame<Bytes>>,
    error: oneshot::Receiver<BoxError>,
}

impl Body for Receiver {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // `None` from the queue means every sender is gone and every queued frame was delivered.
        match std::task::ready!(self.frames.poll_recv(cx)) {
            Some(frame) => Poll::Ready(Some(Ok(frame))),
            None => Poll::Ready(self.error.try_recv().ok().map(Err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn data(text: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(text.as_bytes()))
    }

    async fn next(receiver: &mut Receiver) -> Option<Result<Bytes, String>> {
        let frame = receiver.frame().await?;
        Some(
            frame
                .map(|f| f.into_data().unwrap_or_default())
                .map_err(|e| e.to_string()),
        )
    }

    #[tokio::test]
    async fn a_dropped_sender_ends_the_body_after_every_queued_frame() {
        let (mut sender, mut receiver) = channel(4);
        sender.send(data("one")).await.unwrap();
        sender.send(data("two")).await.unwrap();
        drop(sender);
        assert_eq!(next(&mut receiver).await, Some(Ok(Bytes::from("one"))));
        assert_eq!(next(&mut receiver).await, Some(Ok(Bytes::from("two"))));
        assert_eq!(next(&mut receiver).await, None);
    }

    #[tokio::test]
    async fn an_abort_comes_after_the_queued_frames_and_is_an_error() {
        let (mut sender, mut receiver) = channel(4);
        sender.send(data("one")).await.unwrap();
        sender.abort("upstream broke off".into());
        assert_eq!(next(&mut receiver).await, Some(Ok(Bytes::from("one"))));
        assert_eq!(
            next(&mut receiver).await,
            Some(Err("upstream broke off".to_string()))
        );
        assert_eq!(next(&mut receiver).await, None);
    }

    /// The relay queues its last frame and ends while the connection is polling on another thread:
    /// the client must get every frame, whatever the interleaving.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_frame_is_lost_when_the_end_races_the_reader() {
        for _ in 0..10_000 {
            let (mut sender, receiver) = channel(8);
            let relay = tokio::spawn(async move {
                for text in ["a", "b", "c"] {
                    sender.send(data(text)).await.unwrap();
                    tokio::task::yield_now().await;
                }
            });
            let body = receiver.collect().await.unwrap().to_bytes();
            relay.await.unwrap();
            assert_eq!(&body[..], b"abc");
        }
    }

    #[tokio::test]
    async fn a_send_fails_once_the_client_is_gone() {
        let (mut sender, receiver) = channel(1);
        drop(receiver);
        assert!(sender.send(data("lost")).await.is_err());
    }
}
