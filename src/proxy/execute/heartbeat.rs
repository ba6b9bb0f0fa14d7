//! Runs beside a won claim's upstream call, on a task of its own: extends the claim's lease about every
//! third of the lease while the upstream works, so no other proxy takes a live claim over. Touches the
//! store only through fenced heartbeats; stops when the claim is done, or by itself when it finds the
//! claim taken over.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics::Metrics;
use crate::store::{RecordId, StoreHandle};

/// Extends a claim's lease about every third of the lease while the upstream works. Stops when
/// dropped or stopped; stops by itself when the claim turns out to be taken over (counted as lost).
pub struct Heartbeat {
    stop: CancellationToken,
}

impl Heartbeat {
    /// Starts beating for `id` on a task owned by `tracker`.
    pub fn start(
        store: StoreHandle,
        id: RecordId,
        lease: Duration,
        metrics: Metrics,
        tracker: &TaskTracker,
    ) -> Heartbeat {
        let stop = CancellationToken::new();
        let token = stop.clone();
        tracker.spawn(async move {
            let mut ticks = tokio::time::interval(lease / 3);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                match store.heartbeat(&id, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        metrics.lost_claims.inc();
                        tracing::warn!(key_hash = %id.key_hash(), "claim was taken over; heartbeat stopped");
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(key_hash = %id.key_hash(), %error, "heartbeat failed; will retry")
                    }
                }
            }
        });
        Heartbeat { stop }
    }

    /// Stops extending the lease.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::stub::{Op, Reply, StubStore};

    fn start(beats: &Arc<StubStore>, metrics: &Metrics, tracker: &TaskTracker) -> Heartbeat {
        let id = RecordId {
            scope: "s".into(),
            key: "k".into(),
            token: uuid::Uuid::nil(),
        };
        Heartbeat::start(
            beats.handle(metrics),
            id,
            Duration::from_secs(30),
            metrics.clone(),
            tracker,
        )
    }

    async fn advance(by: Duration) {
        tokio::time::advance(by).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_lease_until_stopped() {
        let beats = StubStore::new();
        let metrics = Metrics::new();
        let tracker = TaskTracker::new();
        let heartbeat = start(&beats, &metrics, &tracker);
        advance(Duration::ZERO).await;
        advance(Duration::from_millis(9_900)).await;
        assert_eq!(
            beats.count(Op::Heartbeat),
            0,
            "no beat before a third of the lease"
        );
        advance(Duration::from_millis(200)).await;
        assert_eq!(beats.count(Op::Heartbeat), 1);
        advance(Duration::from_secs(10)).await;
        assert_eq!(beats.count(Op::Heartbeat), 2);
        heartbeat.stop();
        advance(Duration::from_secs(60)).await;
        assert_eq!(beats.count(Op::Heartbeat), 2, "no beat after stop");
        tracker.close();
        tracker.wait().await;
    }

    #[tokio::test(start_paused = true)]
    async fn stops_and_counts_a_lost_claim_when_fenced_out() {
        let beats = StubStore::new();
        beats.always(Op::Heartbeat, Reply::Done(false));
        let metrics = Metrics::new();
        let tracker = TaskTracker::new();
        let _heartbeat = start(&beats, &metrics, &tracker);
        advance(Duration::ZERO).await;
        advance(Duration::from_secs(10)).await;
        advance(Duration::from_secs(60)).await;
        assert_eq!(
            beats.count(Op::Heartbeat),
            1,
            "a fenced-out heartbeat does not beat again"
        );
        assert_eq!(metrics.lost_claims.get(), 1);
        tracker.close();
        tracker.wait().await;
    }
}
