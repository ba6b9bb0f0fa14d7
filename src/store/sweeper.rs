//! Runs in the background of `serve`, on the task tracker that shutdown drains: every `sweeper.interval`
//! it deletes expired records in bounded batches, then publishes the count of records by state. Touches
//! only the store and the metrics. Many replicas may sweep one table at once: each batch statement skips
//! rows another holds, so no record is deleted or counted twice.

use tokio_util::sync::CancellationToken;

use super::{RecordStats, StoreError, StoreHandle};
use crate::config::SweeperConfig;
use crate::metrics::{Metrics, RecordCounts};

/// Sweeps until `shutdown` is cancelled; a failed sweep is logged (by the store handle) and tried again
/// at the next interval.
pub async fn run(store: StoreHandle, config: SweeperConfig, metrics: Metrics, shutdown: CancellationToken) {
    loop {
        if let Ok(deleted) =
            sweep_expired(&store, config.batch_size, Pace::Serving, &metrics, &shutdown).await
            && deleted > 0
        {
            tracing::info!(deleted, "expired records deleted");
        }
        if let Ok(stats) = store.stats().await {
            metrics.set_records(&record_counts(stats));
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.interval) => {}
        }
    }
}

/// The store's count of records by state, in the metrics' terms. Destructured in full, so a new state
/// does not compile until it is counted.
fn record_counts(stats: RecordStats) -> RecordCounts {
    let RecordStats {
        processing,
        completed,
        failed,
        unknown,
        expired,
    } = stats;
    RecordCounts {
        processing,
        completed,
        failed,
        unknown,
        expired,
    }
}

/// How a sweep spaces its batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pace {
    /// Beside serving: after each full batch, a pause as long as the batch took, so a backlog is
    /// deleted with at most half of one connection's time and the claims beside it keep their latency.
    Serving,
    /// An operator's purge: one batch after another.
    Flat,
}

/// Deletes expired records one batch (one short statement) at a time until a batch comes back short,
/// so a backlog never becomes one long transaction; stops early at shutdown. Returns how many this call
/// deleted, each also counted in `idemproxy_expired_keys_deleted_total`.
pub async fn sweep_expired(
    store: &StoreHandle,
    batch: u32,
    pace: Pace,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<u64, StoreError> {
    let mut total = 0;
    while !shutdown.is_cancelled() {
        let started = tokio::time::Instant::now();
        let deleted = store.sweep(batch).await?;
        metrics.expired_deleted.inc_by(deleted);
        total += deleted;
        if deleted < u64::from(batch) {
            break;
        }
        match pace {
            Pace::Serving => tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(started.elapsed()) => {}
            },
            Pace::Flat => tokio::task::yield_now().await,
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::stub::{Op, Reply, StubStore};

    /// A backlog of three full batches of 10, each taking 100 ms of the store's time; then a short one.
    async fn sweep_backlog(pace: Pace) -> (u64, Duration) {
        let metrics = Metrics::new();
        let backlog = StubStore::new();
        backlog
            .delay(Op::Sweep, Duration::from_millis(100))
            .always(Op::Sweep, Reply::Deleted(3));
        for _ in 0..3 {
            backlog.then(Op::Sweep, Reply::Deleted(10));
        }
        let store = backlog.handle(&metrics);
        let started = tokio::time::Instant::now();
        let deleted = sweep_expired(&store, 10, pace, &metrics, &CancellationToken::new())
            .await
            .unwrap();
        (deleted, started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn beside_serving_each_full_batch_is_followed_by_a_pause_as_long_as_itself() {
        let (deleted, took) = sweep_backlog(Pace::Serving).await;
        assert_eq!(deleted, 33);
        // Four batches of 100 ms, and a pause after each of the three full ones.
        assert_eq!(took, Duration::from_millis(700));
        let (deleted, took) = sweep_backlog(Pace::Flat).await;
        assert_eq!(deleted, 33);
        assert_eq!(took, Duration::from_millis(400), "a purge does not pause");
    }
}
