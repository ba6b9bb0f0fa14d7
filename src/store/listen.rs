//! Announcing and listening: how the replicas sharing a store tell one another that a record settled.
//! An announcement names the record's tag and the announcing process ([`announcement`]); a process
//! that hears one wakes its own waiters for that record ([`heard`]). Below that, the wait listener's
//! life, whatever the store: one session at a time that hears other replicas'
//! announcements (`store/postgres/listen.rs` by LISTEN, `store/redis/listen.rs` by SUBSCRIBE), and
//! a new one after each loss, with backoff, from start to shutdown. A lost session may have missed
//! announcements, so every waiter is woken to re-check, and again once a new session listens (an
//! announcement sent in between reached no one). Meanwhile a waiter still ends, by the lease it saw
//! running out or by its `wait_timeout`. Touches the waiters, the listener metrics and the log.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::wake::{RecordTag, Waiters};
use crate::metrics::Metrics;

/// What this process tells the others when the record `tag` names settled: the tag and this process's
/// id, in hex (33 bytes, far under PostgreSQL's 8000-byte payload limit).
pub(crate) fn announcement(waiters: &Waiters, tag: RecordTag) -> String {
    format!("{:016x}.{:016x}", tag.bits(), waiters.instance())
}

/// Wakes the waiters an announcement heard from the store names, unless it came from this process,
/// which woke its own waiters as it announced. `false` for a payload that is not an announcement.
pub(crate) fn heard(waiters: &Waiters, payload: &str) -> bool {
    let Some((tag, instance)) = parse(payload) else {
        return false;
    };
    if instance != waiters.instance() {
        waiters.wake(tag);
    }
    true
}

fn parse(payload: &str) -> Option<(RecordTag, u64)> {
    let (tag, instance) = payload.split_once('.')?;
    if tag.len() != 16 || instance.len() != 16 {
        return None;
    }
    let tag = u64::from_str_radix(tag, 16).ok()?;
    let instance = u64::from_str_radix(instance, 16).ok()?;
    Some((RecordTag::from_bits(tag), instance))
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::wake::tests::is_woken;

    #[tokio::test]
    async fn another_process_announcement_wakes_and_our_own_is_ignored() {
        let (ours, theirs) = (Waiters::new(), Waiters::new());
        let tag = RecordTag::of("s", "k");
        let mut waiter = ours.wait_for(tag);
        let own = announcement(&ours, tag);
        assert_eq!(own.len(), 33);
        assert!(heard(&ours, &own));
        assert!(!is_woken(&mut waiter).await, "already woken locally");
        assert!(heard(&ours, &announcement(&theirs, tag)));
        assert!(is_woken(&mut waiter).await);
    }

    #[test]
    fn a_payload_that_is_not_an_announcement_is_refused() {
        let waiters = Waiters::new();
        for payload in [
            "",
            "abc",
            "0123456789abcdef",
            "0123456789abcdef.0123456789abcde",
            "zz23456789abcdef.0123456789abcdef",
        ] {
            assert!(!heard(&waiters, payload), "{payload:?}");
        }
    }
}
