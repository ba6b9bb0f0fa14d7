//! Wake-ups across replicas for requests that wait for a key in flight (`on_in_flight = "wait"`), on
//! Redis: the `PUBLISH` a process sends after a record of a wait route settled, on the channel
//! `<key_prefix>:settled`, and the one subscriber connection per process that hears them and wakes this
//! process's waiters (`store/wake.rs`). The subscriber has a connection of its own to one node (a
//! cluster's bus carries every `PUBLISH` to every node), the next seed node after a loss;
//! `store/listen.rs` keeps it running from start to shutdown, and only when some route waits.

use futures_util::StreamExt;
use tokio::time::timeout;

use super::connect::{Redis, backend};
use crate::metrics::Metrics;
use crate::store::StoreError;
use crate::store::listen::{self, Ended, now_listening};
use crate::store::wake::Waiters;

/// The channel of a deployment's announcements.
pub(super) fn channel(prefix: &str) -> String {
    format!("{prefix}:settled")
}

/// One subscriber session on the node `attempt` picks: waits, then wakes this process's waiters
/// for every announcement until the connection ends.
pub(super) async fn session(
    redis: &Redis,
    channel: &str,
    attempt: u64,
    waiters: &Waiters,
    metrics: &Metrics,
) -> Ended {
    let subscribing = async {
        let client = redis.node_client(attempt)?;
        let mut pubsub = client.get_async_pubsub().await.map_err(backend)?;
        pubsub.subscribe(channel).await.map_err(backend)?;
        Ok::<_, StoreError>(pubsub)
    };
    let mut pubsub = match timeout(redis.timeout(), subscribing).await {
        Ok(Ok(pubsub)) => pubsub,
        Ok(Err(error)) => return ended(false, error),
        Err(_) => return ended(false, StoreError::Timeout(redis.timeout())),
    };
    now_listening(waiters, metrics);
    let mut messages = pubsub.on_message();
    while let Some(message) = messages.next().await {
        let payload = String::from_utf8_lossy(message.get_payload_bytes());
        if !listen::heard(waiters, &payload) {
            tracing::debug!(channel, "ignored a message that is not an announcement");
        }
    }
    ended(
        true,
        StoreError::Backend("the subscriber's connection closed".into()),
    )
}

fn ended(listened: bool, error: StoreError) -> Ended {
    Ended {
        listened,
        why: error.to_string(),
    }
}
