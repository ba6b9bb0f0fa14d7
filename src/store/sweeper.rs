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
        if let Ok(deleted) = sweep_expired(&store, config.batch_size, &metrics, &shutdown).await
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

/// Deletes expired records one batch (one short statement) at a time until a batch comes back short,
/// so a backlog never becomes one long transaction; stops early at shutdown. Returns how many this call
/// deleted, each also counted in `idemproxy_expired_keys_deleted_total`.
pub async fn sweep_expired(
    store: &StoreHandle,
    batch: u32,
    metrics: &Metrics,
    shutdown: &CancellationToken,
) -> Result<u64, StoreError> {
    let mut total = 0;
    while !shutdown.is_cancelled() {
        let deleted = store.sweep(batch).await?;
        metrics.expired_deleted.inc_by(deleted);
        total += deleted;
        if deleted < u64::from(batch) {
            break;
        }
        tokio::task::yield_now().await;
    }
    Ok(total)
}
