//! Runs under every client connection's socket: a write that can make no progress for
//! `server.write_timeout` (the client stopped reading, and the socket's buffers are full) fails, so hyper
//! ends the connection and lets go of whatever it was sending — a passthrough body and the upstream
//! connection behind it, a replay, a keyed response (whose relay reads on and stores it). Free while
//! writes go through: the timer exists only while a write waits.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// `io` whose writes fail once one has waited `timeout` without progress.
pub(super) struct WriteDeadline<T> {
    io: T,
    timeout: Duration,
    /// Counts the connections ended this way.
    expired: IntCounter,
    /// Running while a write waits; dropped by any write that goes through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteDeadline<T> {
    /// `io`, with writes bounded by `timeout`; each expiry is counted in `expired`.
    pub(super) fn new(io: T, timeout: Duration, expired: IntCounter) -> WriteDeadline<T> {
        WriteDeadline {
            io,
            timeout,
            expired,
            stalled: None,
        }
    }

    /// A write is waiting: starts its deadline if it has none, and fails once the deadline has passed.
    fn wait<R>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<R>> {
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.expired.inc();
        tracing::debug!(
            ?timeout,
            "client accepted no bytes for server.write_timeout; closing"
        );
        Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the client accepted no bytes for server.write_timeout",
        )))
    }
}

impl<T: AsyncWrite + Unpin> WriteDeadline<T> {
    fn poll_progress<R>(
        &mut self,
        cx: &mut Context<'_>,
        write: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        match write(Pin::new(&mut self.io), cx) {
            Poll::Pending => self.wait(cx),
            done => {
                self.stalled = None;
                done
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteDeadline<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.get_mut().poll_progress(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .poll_progress(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().poll_progress(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    fn counter() -> IntCounter {
        IntCounter::new("expired", "test").unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_waits_past_the_timeout_fails_and_is_counted() {
        let (client, _reader) = tokio::io::duplex(16);
        let expired = counter();
        let mut io = WriteDeadline::new(client, Duration::from_secs(5), expired.clone());
        io.write_all(&[0; 16]).await.unwrap();
        let error = io.write_all(&[0; 16]).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(expired.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_keeps_taking_bytes_is_never_cut_off() {
        let (client, mut reader) = tokio::io::duplex(16);
        let expired = counter();
        let mut io = WriteDeadline::new(client, Duration::from_secs(5), expired.clone());
        let slow = tokio::spawn(async move {
            let mut buf = [0; 8];
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                tokio::io::AsyncReadExt::read_exact(&mut reader, &mut buf)
                    .await
                    .unwrap();
            }
        });
        io.write_all(&[0; 64]).await.unwrap();
        slow.await.unwrap();
        assert_eq!(expired.get(), 0, "each wait was shorter than the timeout");
    }
}
