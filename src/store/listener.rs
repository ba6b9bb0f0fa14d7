//! The wait listener's life, whatever the store: one session at a time that hears other replicas'
//! announcements (`store/postgres/listen.rs` by LISTEN, `store/redis/listen.rs` by SUBSCRIBE), and
//! a new one after each loss, with backoff, from start to shutdown. A lost session may have missed
//! announcements, so every waiter is woken to re-check, and again once a new session listens (an
//! announcement sent in between reached no one). Meanwhile a waiter still ends, by the lease it saw
//! running out or by its `wait_timeout`. Touches the waiters, the listener metrics and the log.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::notify::Waiters;
use crate::metrics::Metrics;

/// The first wait before the listener connects again; each wait doubles up to [`RECONNECT_MAX`], and
/// starts over once a session has listened.
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(5);

/// How a listening session ended.
pub(crate) struct Ended {
    /// Whether it got as far as listening.
    pub(crate) listened: bool,
    /// Why it ended.
    pub(crate) why: String,
}

/// Runs `session` (numbered from 0) again and again until `shutdown`; each session calls
/// [`now_listening`] once it hears announcements, and returns when its connection is lost.
pub(crate) async fn keep_listening<S, F>(
    waiters: Arc<Waiters>,
    metrics: Metrics,
    shutdown: CancellationToken,
    mut session: S,
) where
    S: FnMut(u64) -> F,
    F: Future<Output = Ended>,
{
    let mut backoff = RECONNECT_FIRST;
    for attempt in 0.. {
        let ended = tokio::select! {
            ended = session(attempt) => ended,
            _ = shutdown.cancelled() => break,
        };
        metrics.wait_listener_connected.set(0);
        metrics.wait_listener_reconnects.inc();
        waiters.wake_all();
        if ended.listened {
            backoff = RECONNECT_FIRST;
        }
        tracing::warn!(error = %ended.why, retry_in = ?backoff,
            "wait listener lost its connection; waiting requests re-check their keys");
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.cancelled() => break,
        }
        backoff = (backoff * 2).min(RECONNECT_MAX);
    }
    metrics.wait_listener_connected.set(0);
}

/// Marks a session as listening: counted, logged, and every waiter woken, since whatever settled before
/// now reached no listener of this process.
pub(crate) fn now_listening(waiters: &Waiters, metrics: &Metrics) {
    metrics.wait_listener_connected.set(1);
    tracing::info!("wait listener is listening for other replicas' completions");
    waiters.wake_all();
}
