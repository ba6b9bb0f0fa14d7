//! Runs under every client connection's socket (held by `slots::Evictable`, which sees each write that
//! waits): a write that can make no progress for `server.write_timeout` (the client stopped reading, and
//! the socket's buffers are full) fails, so hyper ends the connection and lets go of whatever it was
//! sending — a passthrough body and the upstream connection behind it, a replay, a keyed response (whose
//! relay reads on and stores it). Free while writes go through: the timer exists only while one waits.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::time::Sleep;

/// The bound on one socket's stalled writes.
pub(super) struct WriteDeadline {
    timeout: Duration,
    /// Counts the connections ended this way.
    expired: IntCounter,
    /// Running while a write waits; dropped by any write that goes through.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteDeadline {
    /// Writes bounded by `timeout`; each expiry is counted in `expired`.
    pub(super) fn new(timeout: Duration, expired: IntCounter) -> WriteDeadline {
        WriteDeadline {
            timeout,
            expired,
            stalled: None,
        }
    }

    /// A write went through: the next wait starts a deadline of its own.
    pub(super) fn progressed(&mut self) {
        self.stalled = None;
    }

    /// A write is waiting: starts its deadline if it has none (waking the task when it passes), and
    /// fails once it has passed.
    pub(super) fn waiting(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Error> {
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
        Poll::Ready(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the client accepted no bytes for server.write_timeout",
        ))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};

    use super::*;

    fn deadline() -> WriteDeadline {
        WriteDeadline::new(
            Duration::from_secs(5),
            IntCounter::new("expired", "test").unwrap(),
        )
    }

    /// Writes `len` bytes to `io` as a socket's owner does: a write that waits asks the deadline.
    async fn write(io: &mut DuplexStream, deadline: &mut WriteDeadline, len: usize) -> std::io::Result<()> {
        let data = vec![0; len];
        let mut written = 0;
        std::future::poll_fn(|cx| {
            while written < len {
                match Pin::new(&mut *io).poll_write(cx, &data[written..]) {
                    Poll::Ready(result) => {
                        deadline.progressed();
                        written += result?;
                    }
                    Poll::Pending => return deadline.waiting(cx).map(Err),
                }
            }
            Poll::Ready(Ok(()))
        })
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_waits_past_the_timeout_fails_and_is_counted() {
        let (mut client, _reader) = tokio::io::duplex(16);
        let mut deadline = deadline();
        write(&mut client, &mut deadline, 16).await.unwrap();
        let error = write(&mut client, &mut deadline, 16).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(deadline.expired.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_keeps_taking_bytes_is_never_cut_off() {
        let (mut client, mut reader) = tokio::io::duplex(16);
        let mut deadline = deadline();
        let slow = tokio::spawn(async move {
            let mut buf = [0; 8];
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_secs(4)).await;
                let mut buf = ReadBuf::new(&mut buf);
                std::future::poll_fn(|cx| Pin::new(&mut reader).poll_read(cx, &mut buf))
                    .await
                    .unwrap();
            }
        });
        write(&mut client, &mut deadline, 64).await.unwrap();
        slow.await.unwrap();
        assert_eq!(
            deadline.expired.get(),
            0,
            "each wait was shorter than the timeout"
        );
    }
}
