//! Runs beside a won claim's execution, in its task: extends the claim's lease about every third of the
//! lease while the upstream works, so no other proxy takes a live claim over. Touches the store only
//! through fenced heartbeats; stops when stopped, when the execution ends, or by itself when it finds the
//! claim taken over.
//!
//! It is polled with the execution rather than spawned: most executions end long before their first
//! beat, and for those it costs one timer instead of a task of its own.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::store::{RecordId, StoreHandle};

/// Extends a claim's lease about every third of the lease while the work it runs [`beside`] goes on.
/// Stops when stopped; stops by itself when the claim turns out to be taken over (counted as lost).
/// A beat refused once the execution has begun writing its outcome ([`Heartbeat::settling`]) or has
/// stopped it is not counted: that write changed the record, and it reports a takeover itself.
///
/// [`beside`]: Heartbeat::beside
pub struct Heartbeat<'a> {
    store: &'a StoreHandle,
    id: &'a RecordId,
    lease: Duration,
    metrics: &'a Metrics,
    stopped: AtomicBool,
    settling: AtomicBool,
}

impl<'a> Heartbeat<'a> {
    /// A heartbeat for `id`, claimed for `lease`; it beats while [`Heartbeat::beside`] runs.
    pub fn new(store: &'a StoreHandle, id: &'a RecordId, lease: Duration, metrics: &'a Metrics) -> Self {
        Heartbeat {
            store,
            id,
            lease,
            metrics,
            stopped: AtomicBool::new(false),
            settling: AtomicBool::new(false),
        }
    }

    /// Runs `work` to its end, beating beside it until stopped. A beat in flight when the work ends is
    /// dropped with it: it only extends a lease that the work's end has made moot.
    /// `work` is polled in place: a large future is best boxed by the caller, so that it is not copied
    /// into this one.
    pub async fn beside<F: Future + Unpin>(&self, mut work: F) -> F::Output {
        let mut beats = pin!(self.beat());
        let mut beating = true;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = Pin::new(&mut work).poll(cx) {
                return Poll::Ready(output);
            }
            if beating && beats.as_mut().poll(cx).is_ready() {
                beating = false;
            }
            Poll::Pending
        })
        .await
    }

    /// Stops extending the lease.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
    }

    fn stopped(&self) -> bool {
        self.stopped.load(Ordering::Relaxed)
    }

    /// The execution is writing its outcome (the completion) while the lease is still extended: a beat
    /// refused from now on may be refused because that write changed the record.
    pub fn settling(&self) {
        self.settling.store(true, Ordering::Relaxed);
    }

    /// Whether a refused beat says nothing the execution's own write will not: that write has begun
    /// (settling) or the execution stopped the beats to write.
    fn refusal_is_moot(&self) -> bool {
        self.stopped() || self.settling.load(Ordering::Relaxed)
    }

    /// Beats every third of the lease; ends when stopped or fenced out. Run beside the work by
    /// [`Heartbeat::beside`], or on its own for each item of a request that carries many keys.
    pub(crate) async fn beat(&self) {
        let period = self.lease / 3;
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if self.stopped() {
                return;
            }
            match self.store.heartbeat(self.id, self.lease).await {
                Ok(true) => {}
                // The record was changed by this execution's own completion, release or hold while the
                // beat was on its way; if it was taken over, that write finds out and counts it.
                Ok(false) if self.refusal_is_moot() => return,
                Ok(false) => {
                    self.metrics.lost_claims.inc();
                    tracing::warn!(key_hash = %self.id.key_hash(), "claim was taken over; heartbeat stopped");
                    return;
                }
                Err(error) => {
                    tracing::warn!(key_hash = %self.id.key_hash(), %error, "heartbeat failed; will retry")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::stub::{Op, Reply, StubStore};

    /// What a heartbeat borrows: a stub store that counts the beats, its handle, the metrics and the
    /// record, for a claim of 30 s (a beat every 10 s).
    struct Claim {
        beats: Arc<StubStore>,
        metrics: Metrics,
        store: StoreHandle,
        id: RecordId,
    }

    impl Claim {
        fn new() -> Claim {
            let beats = StubStore::new();
            let metrics = Metrics::new();
            let store = beats.handle(&metrics);
            let id = RecordId {
                scope: "s".into(),
                key: "k".into(),
                token: uuid::Uuid::nil(),
            };
            Claim {
                beats,
                metrics,
                store,
                id,
            }
        }

        fn heartbeat(&self) -> Heartbeat<'_> {
            Heartbeat::new(&self.store, &self.id, Duration::from_secs(30), &self.metrics)
        }
    }

    async fn advance(by: Duration) {
        tokio::time::advance(by).await;
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn renews_every_third_of_the_lease_until_stopped() {
        let claim = Claim::new();
        let heartbeat = claim.heartbeat();
        heartbeat
            .beside(Box::pin(async {
                advance(Duration::ZERO).await;
                advance(Duration::from_millis(9_900)).await;
                assert_eq!(
                    claim.beats.count(Op::Heartbeat),
                    0,
                    "no beat before a third of the lease"
                );
                advance(Duration::from_millis(200)).await;
                assert_eq!(claim.beats.count(Op::Heartbeat), 1);
                advance(Duration::from_secs(10)).await;
                assert_eq!(claim.beats.count(Op::Heartbeat), 2);
                heartbeat.stop();
                advance(Duration::from_secs(60)).await;
                assert_eq!(claim.beats.count(Op::Heartbeat), 2, "no beat after stop");
            }))
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn ends_with_the_work_it_runs_beside() {
        let claim = Claim::new();
        let heartbeat = claim.heartbeat();
        let answer = heartbeat
            .beside(Box::pin(tokio::time::sleep(Duration::from_secs(15))))
            .await;
        assert_eq!(answer, ());
        assert_eq!(claim.beats.count(Op::Heartbeat), 1, "one beat in 15 s of work");
        advance(Duration::from_secs(60)).await;
        assert_eq!(
            claim.beats.count(Op::Heartbeat),
            1,
            "no beat once the work has ended"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stops_and_counts_a_lost_claim_when_fenced_out() {
        let claim = Claim::new();
        claim.beats.always(Op::Heartbeat, Reply::Done(false));
        let heartbeat = claim.heartbeat();
        heartbeat
            .beside(Box::pin(async {
                advance(Duration::ZERO).await;
                advance(Duration::from_secs(10)).await;
                advance(Duration::from_secs(60)).await;
            }))
            .await;
        assert_eq!(
            claim.beats.count(Op::Heartbeat),
            1,
            "a fenced-out heartbeat does not beat again"
        );
        assert_eq!(claim.metrics.lost_claims.get(), 1);
    }

    /// A beat on its way when the execution's own write changes the record is refused by its fence;
    /// that is not a takeover, and the alert on lost claims must not fire for it.
    #[tokio::test(start_paused = true)]
    async fn a_beat_refused_after_the_execution_began_its_own_write_is_not_a_lost_claim() {
        for stop in [false, true] {
            let claim = Claim::new();
            claim
                .beats
                .delay(Op::Heartbeat, Duration::from_secs(2))
                .always(Op::Heartbeat, Reply::Done(false));
            let heartbeat = claim.heartbeat();
            heartbeat
                .beside(Box::pin(async {
                    advance(Duration::ZERO).await;
                    advance(Duration::from_secs(10)).await;
                    assert_eq!(claim.beats.count(Op::Heartbeat), 1, "a beat is on its way");
                    if stop {
                        heartbeat.stop();
                    } else {
                        heartbeat.settling();
                    }
                    advance(Duration::from_secs(5)).await;
                }))
                .await;
            assert_eq!(claim.beats.count(Op::Heartbeat), 1);
            assert_eq!(claim.metrics.lost_claims.get(), 0, "stopped: {stop}");
        }
    }
}
