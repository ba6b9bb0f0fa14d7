//! Runs inside the relay of a won claim, once per upstream body frame: keeps the body for storage while
//! it stays under `idempotency.max_stored_response` and there is room for it both in the process's
//! capture budget (`server.max_buffered_responses`) and in its scope's share of that budget
//! (`server.max_buffered_responses_per_scope`), so that one client's large or slow responses cannot leave
//! every other client's response unretained. The bytes are kept in the response's log
//! (`attach/log.rs`), in coalesced blocks, once for the store and for any duplicates that follow the
//! response; they are charged here, after the frame has gone to the client. A capture that finds no room
//! waits for some, for at most `server.capture_wait` over the whole response, then stops capturing —
//! never forwarding. Touches only the budget and the log.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::proxy::attach::log::Log;

/// The bytes of keyed responses being captured, shared by every relay in the process: what is free, and
/// what each scope holds. Room given back wakes every capture waiting for some.
pub(crate) struct CaptureBudget {
    ledger: Mutex<Ledger>,
    freed: Notify,
    /// The most one scope may hold.
    share: usize,
    /// The longest one response's capture waits for room, in all.
    patience: Duration,
    metrics: Metrics,
}

struct Ledger {
    free: usize,
    /// Bytes held by each scope that holds any; a scope leaves the map when it holds none. Every frame
    /// of every keyed response looks its scope up here, so the map hashes with foldhash rather than
    /// SipHash: a scope is a route name and a SHA-256, which no client can steer into collisions, and
    /// the hasher's seed is random per process besides.
    held: HashMap<Arc<str>, usize, foldhash::fast::RandomState>,
}

/// Why a capture found no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Short {
    /// The whole budget is spent.
    Budget,
    /// The capture's scope holds its whole share.
    Share,
}

impl CaptureBudget {
    /// A budget of `total` bytes, of which one scope may hold `share`; a capture waits for room at most
    /// `patience` per response.
    pub(crate) fn new(total: usize, share: usize, patience: Duration, metrics: Metrics) -> CaptureBudget {
        CaptureBudget {
            ledger: Mutex::new(Ledger {
                free: total,
                held: HashMap::default(),
            }),
            freed: Notify::new(),
            share,
            patience,
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn try_take(&self, scope: &Arc<str>, bytes: usize) -> Result<(), Short> {
        let mut ledger = self.lock();
        let Ledger { free, held } = &mut *ledger;
        let entry = held.entry(scope.clone());
        let holds = match &entry {
            Entry::Occupied(holding) => *holding.get(),
            Entry::Vacant(_) => 0,
        };
        let short = if holds.saturating_add(bytes) > self.share {
            Some(Short::Share)
        } else if *free < bytes {
            Some(Short::Budget)
        } else {
            None
        };
        if let Some(short) = short {
            return Err(short);
        }
        *free -= bytes;
        *entry.or_insert(0) += bytes;
        Ok(())
    }

    fn give_back(&self, scope: &Arc<str>, bytes: usize) {
        if bytes == 0 {
            return;
        }
        {
            let mut ledger = self.lock();
            ledger.free += bytes;
            if let Entry::Occupied(mut holding) = ledger.held.entry(scope.clone()) {
                let left = holding.get().saturating_sub(bytes);
                if left == 0 {
                    holding.remove();
                } else {
                    holding.insert(left);
                }
            }
        }
        self.freed.notify_waiters();
    }

    fn count_give_up(&self, short: Short) {
        match short {
            Short::Budget => self.metrics.capture_budget_exhausted.inc(),
            Short::Share => self.metrics.capture_scope_share_exhausted.inc(),
        }
    }
}

/// Bytes of the budget one capture holds for its scope; given back when dropped (once the body is
/// stored, or when the capture gives up).
pub(crate) struct Reservation {
    budget: Arc<CaptureBudget>,
    scope: Arc<str>,
    bytes: usize,
}

impl Reservation {
    /// Nothing of `budget` yet, for `scope`: an answer read whole outside a relay (`proxy/many.rs`)
    /// grows it as it is read ([`Reservation::try_grow`]).
    pub(crate) fn none(budget: &Arc<CaptureBudget>, scope: &str) -> Reservation {
        Reservation {
            budget: budget.clone(),
            scope: scope.into(),
            bytes: 0,
        }
    }

    /// How long one response may wait for room, in all (`server.capture_wait`).
    pub(crate) fn patience(&self) -> Duration {
        self.budget.patience
    }

    /// Takes `bytes` more, waiting for room while `patience` lasts (what is left of it stays in it); a
    /// refusal is counted as a capture's is.
    pub(crate) async fn grow(
        &mut self,
        bytes: usize,
        (patience, waited): (&mut Duration, &mut bool),
    ) -> bool {
        match self.room(bytes, (patience, waited)).await {
            Ok(()) => true,
            Err(short) => {
                self.budget.count_give_up(short);
                false
            }
        }
    }

    /// Takes `bytes` of the budget for the scope, waiting while there is `patience` left (counting the
    /// first wait, `waited`, once).
    async fn room(
        &mut self,
        bytes: usize,
        (patience, waited): (&mut Duration, &mut bool),
    ) -> Result<(), Short> {
        let budget = self.budget.clone();
        loop {
            let freed = budget.freed.notified();
            tokio::pin!(freed);
            // Registered before the ledger is read, so room given back meanwhile wakes this wait.
            freed.as_mut().enable();
            let short = match budget.try_take(&self.scope, bytes) {
                Ok(()) => {
                    self.bytes += bytes;
                    return Ok(());
                }
                Err(short) => short,
            };
            if patience.is_zero() {
                return Err(short);
            }
            if !std::mem::replace(waited, true) {
                budget.metrics.capture_budget_waits.inc();
            }
            let started = Instant::now();
            let _ = tokio::time::timeout(*patience, freed).await;
            *patience = patience.saturating_sub(started.elapsed());
        }
    }

    fn release(&mut self) {
        self.budget
            .give_back(&self.scope, std::mem::take(&mut self.bytes));
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.release();
    }
}

/// The body as it will be stored, while it stays under the cap and the budget has room for it.
pub(super) struct Capture {
    limit: u64,
    /// Where the bytes are kept, shared with the duplicates that follow the response, if any.
    log: Arc<Log>,
    len: u64,
    /// Bytes written to the log and not charged to the budget yet.
    uncharged: usize,
    over: bool,
    reservation: Reservation,
    /// What is left of `server.capture_wait` for this response.
    patience: Duration,
    /// Whether this capture has waited for room yet (counted once).
    waited: bool,
    /// Whether the body was taken (`finish`): a capture dropped before hands its share to the log itself.
    finished: bool,
}

/// What a capture kept.
pub(super) struct Captured {
    /// The whole body, or `None` when it went over the cap or found no room in the budget.
    pub(super) body: Option<Bytes>,
    /// The share of the budget the body holds until it is stored, and then for as long as duplicates
    /// read its bytes from the log.
    pub(super) reservation: Charge,
}

/// A capture's share of the budget, handed to its log when dropped.
pub(super) struct Charge {
    reservation: Option<Reservation>,
    log: Arc<Log>,
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(reservation) = self.reservation.take() {
            self.log.written(Box::new(reservation));
        }
    }
}

impl Capture {
    /// A capture of at most `limit` bytes into `log`, charged to `scope` in `budget`.
    pub(super) fn new(limit: u64, budget: &Arc<CaptureBudget>, scope: &str, log: Arc<Log>) -> Capture {
        Capture {
            limit,
            log,
            len: 0,
            uncharged: 0,
            over: false,
            patience: budget.patience,
            reservation: Reservation {
                budget: budget.clone(),
                scope: scope.into(),
                bytes: 0,
            },
            waited: false,
            finished: false,
        }
    }

    /// Writes `data` to the log, once for the store and the followers, as it is read; over the cap, the
    /// capture gives up. It is charged later ([`Capture::charge`]).
    pub(super) fn write(&mut self, data: &Bytes) {
        self.log.write(data);
        if self.over || data.is_empty() {
            return;
        }
        self.len += data.len() as u64;
        if self.len > self.limit {
            return self.give_up();
        }
        self.uncharged += data.len();
    }

    /// Charges what was written since the last charge to the budget, waiting for room if there is
    /// none (for what is left of the response's patience); still without room, the capture gives up.
    pub(super) async fn charge(&mut self) {
        if self.over || self.uncharged == 0 {
            return;
        }
        match self.room(self.uncharged).await {
            Ok(()) => self.uncharged = 0,
            Err(short) => {
                self.reservation.budget.count_give_up(short);
                self.give_up();
            }
        }
    }

    /// [`Capture::write`] and [`Capture::charge`] at once.
    #[cfg(test)]
    async fn push(&mut self, data: Bytes) {
        self.write(&data);
        self.charge().await;
    }

    /// Takes `bytes` of the budget for the capture's scope, waiting while there is patience left.
    async fn room(&mut self, bytes: usize) -> Result<(), Short> {
        self.reservation
            .room(bytes, (&mut self.patience, &mut self.waited))
            .await
    }

    /// Stops capturing: the body will not be retained, its share of the budget goes back, and the log
    /// lets its beginning go.
    fn give_up(&mut self) {
        self.over = true;
        self.uncharged = 0;
        self.reservation.release();
        self.log.forget();
    }

    pub(super) fn finish(mut self) -> Captured {
        self.finished = true;
        let body = if self.over { None } else { self.log.whole() };
        Captured {
            body,
            reservation: Charge {
                reservation: Some(self.hand_over()),
                log: self.log.clone(),
            },
        }
    }

    /// The capture's share of the budget, for whoever keeps the bytes now.
    fn hand_over(&mut self) -> Reservation {
        Reservation {
            budget: self.reservation.budget.clone(),
            scope: self.reservation.scope.clone(),
            bytes: std::mem::take(&mut self.reservation.bytes),
        }
    }
}

impl Drop for Capture {
    /// A capture dropped unfinished (the upstream broke off, or the answer was not one to store) hands
    /// its share to the log at once: the bytes stay charged while duplicates read them.
    fn drop(&mut self) {
        if !self.finished {
            let reservation = self.hand_over();
            self.log.written(Box::new(reservation));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATIENCE: Duration = Duration::from_millis(250);

    fn budget(total: usize, share: usize, patience: Duration) -> (Arc<CaptureBudget>, Metrics) {
        let metrics = Metrics::new();
        let budget = CaptureBudget::new(total, share, patience, metrics.clone());
        (Arc::new(budget), metrics)
    }

    fn free(budget: &CaptureBudget) -> usize {
        budget.lock().free
    }

    #[tokio::test]
    async fn capture_keeps_the_body_under_the_cap() {
        let (budget, _) = budget(100, 100, PATIENCE);
        let mut capture = Capture::new(6, &budget, "s", Log::unfollowed());
        capture.push(Bytes::from_static(b"abc")).await;
        capture.push(Bytes::from_static(b"def")).await;
        assert_eq!(capture.finish().body.as_deref(), Some(&b"abcdef"[..]));
    }

    #[tokio::test]
    async fn capture_drops_the_body_over_the_cap_and_gives_its_budget_back() {
        let (budget, metrics) = budget(100, 100, PATIENCE);
        let mut capture = Capture::new(5, &budget, "s", Log::unfollowed());
        capture.push(Bytes::from_static(b"abc")).await;
        assert_eq!(free(&budget), 97);
        capture.push(Bytes::from_static(b"def")).await;
        capture.push(Bytes::from_static(b"g")).await;
        let captured = capture.finish();
        assert_eq!(captured.body, None);
        assert_eq!(
            metrics.capture_budget_exhausted.get(),
            0,
            "over the cap, not the budget"
        );
        assert_eq!(metrics.capture_budget_waits.get(), 0);
        assert_eq!(free(&budget), 100);
        assert!(
            budget.lock().held.is_empty(),
            "a scope that holds nothing is forgotten"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_capture_without_room_waits_its_patience_then_is_not_retained() {
        let (budget, metrics) = budget(4, 4, PATIENCE);
        let mut first = Capture::new(100, &budget, "a", Log::unfollowed());
        first.push(Bytes::from_static(b"abc")).await;
        let mut second = Capture::new(100, &budget, "b", Log::unfollowed());
        let started = Instant::now();
        second.push(Bytes::from_static(b"de")).await;
        assert_eq!(started.elapsed(), PATIENCE, "waited, and no longer");
        assert_eq!(metrics.capture_budget_waits.get(), 1);
        assert_eq!(
            metrics.capture_budget_exhausted.get(),
            1,
            "counted when it happens"
        );
        assert_eq!(second.finish().body, None);
        let kept = first.finish();
        assert_eq!(kept.body.as_deref(), Some(&b"abc"[..]));
        assert_eq!(free(&budget), 1, "held until the body is stored");
        drop(kept);
        assert_eq!(free(&budget), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_capture_that_waits_gets_the_room_another_gives_back() {
        let (budget, metrics) = budget(4, 4, PATIENCE);
        let mut first = Capture::new(100, &budget, "a", Log::unfollowed());
        first.push(Bytes::from_static(b"abc")).await;
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move {
                let mut second = Capture::new(100, &budget, "b", Log::unfollowed());
                second.push(Bytes::from_static(b"de")).await;
                second.finish().body
            }
        });
        while metrics.capture_budget_waits.get() == 0 {
            tokio::task::yield_now().await;
        }
        drop(first.finish());
        assert_eq!(waiting.await.unwrap().as_deref(), Some(&b"de"[..]));
        assert_eq!(metrics.capture_budget_exhausted.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn one_scope_holds_no_more_than_its_share_and_leaves_room_for_others() {
        let (budget, metrics) = budget(100, 40, PATIENCE);
        let mut hog = Capture::new(100, &budget, "hog", Log::unfollowed());
        hog.push(Bytes::from(vec![0; 30])).await;
        let mut more = Capture::new(100, &budget, "hog", Log::unfollowed());
        more.push(Bytes::from(vec![0; 20])).await;
        assert_eq!(more.finish().body, None, "over the hog's share of 40");
        assert_eq!(metrics.capture_scope_share_exhausted.get(), 1);
        assert_eq!(metrics.capture_budget_exhausted.get(), 0);
        let mut other = Capture::new(100, &budget, "other", Log::unfollowed());
        other.push(Bytes::from(vec![1; 40])).await;
        assert_eq!(other.finish().body.map(|b| b.len()), Some(40));
    }

    #[tokio::test(start_paused = true)]
    async fn the_patience_is_for_the_whole_response_not_each_frame() {
        let (budget, metrics) = budget(10, 10, PATIENCE);
        let mut holder = Capture::new(100, &budget, "a", Log::unfollowed());
        holder.push(Bytes::from(vec![0; 9])).await;
        let mut slow = Capture::new(100, &budget, "b", Log::unfollowed());
        let started = Instant::now();
        slow.push(Bytes::from_static(b"x")).await;
        let hand_back = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(holder.finish());
        });
        // The second frame waits until the holder gives its room back, 100 ms on.
        slow.push(Bytes::from(vec![0; 5])).await;
        hand_back.await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_millis(100));
        slow.push(Bytes::from(vec![0; 5])).await;
        assert_eq!(
            started.elapsed(),
            PATIENCE,
            "the last frame waits only what is left of the 250 ms"
        );
        assert_eq!(slow.finish().body, None);
        assert_eq!(
            metrics.capture_budget_waits.get(),
            1,
            "one response, one wait counted"
        );
    }

    #[tokio::test]
    async fn with_no_patience_a_capture_gives_up_at_once() {
        let (budget, metrics) = budget(1, 1, Duration::ZERO);
        let mut first = Capture::new(100, &budget, "a", Log::unfollowed());
        first.push(Bytes::from_static(b"a")).await;
        let mut second = Capture::new(100, &budget, "b", Log::unfollowed());
        second.push(Bytes::from_static(b"b")).await;
        assert_eq!(second.finish().body, None);
        assert_eq!(metrics.capture_budget_waits.get(), 0);
        assert_eq!(metrics.capture_budget_exhausted.get(), 1);
    }

    /// A log that duplicates may follow, counted in `metrics`.
    fn followed(metrics: &Metrics) -> Arc<Log> {
        Log::followed(crate::proxy::attach::log::Bounds {
            buffer: 1024,
            write_timeout: Duration::from_secs(30),
            cutoffs: metrics.attach_cutoffs.clone(),
            stalls: metrics.attach_write_timeouts.clone(),
        })
    }

    #[tokio::test]
    async fn the_share_stays_charged_until_the_last_follower_has_read_the_bytes() {
        let (budget, metrics) = budget(100, 100, PATIENCE);
        let log = followed(&metrics);
        let follower = log.join().expect("a follower");
        let mut capture = Capture::new(100, &budget, "s", log.clone());
        capture.push(Bytes::from_static(b"abc")).await;
        let captured = capture.finish();
        assert_eq!(captured.body.as_deref(), Some(&b"abc"[..]));
        drop(captured);
        log.unpublished();
        assert_eq!(free(&budget), 97, "stored, but a follower still reads");
        drop(follower);
        assert_eq!(free(&budget), 100);

        let log = followed(&metrics);
        let follower = log.join().expect("a follower");
        let mut broken = Capture::new(100, &budget, "s", log.clone());
        broken.push(Bytes::from_static(b"abcd")).await;
        drop(broken);
        log.unpublished();
        assert_eq!(
            free(&budget),
            96,
            "dropped unfinished: charged while the follower reads"
        );
        drop(follower);
        assert_eq!(free(&budget), 100);
    }

    #[tokio::test]
    async fn empty_body_is_retained_as_empty() {
        let (budget, _) = budget(0, 0, PATIENCE);
        let captured = Capture::new(0, &budget, "s", Log::unfollowed()).finish();
        assert_eq!(captured.body.as_deref(), Some(&b""[..]));
    }
}
