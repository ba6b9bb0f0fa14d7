//! A listener's connection slots, and which connection gives its slot up when none is free. Runs in the
//! accept loop (taking a slot, choosing a connection to evict) and at the start and end of every request
//! (a few atomics on the connection's own state). The list of open connections is locked when one opens
//! or closes and while the accept loop looks for one to evict, never on a request.
//!
//! At the cap, a flood of sockets that send nothing (or half a head) would keep real clients in the
//! listen backlog for a whole `header_read_timeout`, and the attacker just reconnects. So under pressure
//! (every slot taken and a client waiting) the connection idle the longest is closed, once it has been
//! idle for the listener's minimum (as Envoy's overload manager shortens idle timeouts); one per slot
//! needed, for as long as the pressure lasts. A connection is idle while each request of it in progress
//! (from the handler's call until its response body has been sent or dropped) is waiting for its
//! client's body, which has brought no progress since; with no request in progress, since its last one
//! ended. A client that sends a head and then stalls or trickles its body holds its slot no better
//! than one that sends half a head. What counts as progress, and as waiting (the proxy asked for body
//! bytes and has none, with no response begun), the body says through [`BodyWatch`]
//! (`proxy/passthrough/client_body.rs`).
//!
//! Eviction never cuts a request that is not waiting for its client: evicting, starting a request and a
//! body's wait ending race on one atomic per connection, which counts requests in progress and, apart,
//! those waiting. Eviction sets [`EVICTED`] only while the two counts are equal; a request start
//! increments the first and gives up if it finds [`EVICTED`] set (the request is answered 503 with
//! `Connection: close`, unforwarded); a wait's end decrements the second, and the body fails if it finds
//! [`EVICTED`] set, so a body the eviction caught waiting never ends whole.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::write_deadline::WriteDeadline;
use crate::metrics::Metrics;
use crate::proxy::client_body::BodyWatch;

/// The bit of a connection's state that says it was evicted. Below it, from [`WAITING`] up, the count of
/// its requests waiting for their client's body; below that, the count of its requests in progress.
const EVICTED: u64 = 1 << 63;

/// One request waiting for its client's body, in a connection's state.
const WAITING: u64 = 1 << 32;

/// The requests in progress in a connection's state.
const IN_PROGRESS: u64 = WAITING - 1;

/// Whether a connection in `state` may be evicted: not yet evicted, and each request in progress waits
/// for its client (none in progress, or all of them).
fn evictable(state: u64) -> bool {
    state & EVICTED == 0 && state >> 32 == state & IN_PROGRESS
}

/// The longest a connection must be idle before it can be evicted; shorter when the listener's
/// `header_read_timeout` is (it would close such a connection by then anyway).
const MAX_MIN_IDLE: Duration = Duration::from_secs(1);

/// A clock read on every request's end without asking the operating system: milliseconds since an
/// epoch, advanced at least every [`Clock::TICK`] by the worker threads' lead timers and whenever the
/// accept loops read the time. It may run behind by up to a tick, never ahead.
pub(super) struct Clock {
    epoch: Instant,
    coarse_ms: AtomicU64,
}

impl Clock {
    /// How often the clock must be advanced; idle times are read with this much slack.
    pub(super) const TICK: Duration = Duration::from_millis(250);

    /// A clock starting now.
    pub(super) fn new() -> Arc<Clock> {
        Arc::new(Clock {
            epoch: Instant::now(),
            coarse_ms: AtomicU64::new(0),
        })
    }

    /// The exact time, in milliseconds since the epoch; also advances the coarse reading.
    pub(super) fn advance(&self) -> u64 {
        let now = millis(self.epoch.elapsed());
        self.coarse_ms.fetch_max(now, Ordering::Relaxed);
        now
    }

    /// The time as of the last advance: one load, for the request path.
    fn coarse(&self) -> u64 {
        self.coarse_ms.load(Ordering::Relaxed)
    }

    fn instant_at(&self, ms: u64) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.epoch + Duration::from_millis(ms))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// What the connections of a listener share with its accept loop: whether it waits for a slot now with no
/// connection idle, and the signal that one of them has just become idle (sent only while it so waits).
/// While the loop knows of an idle connection it waits for that one's time instead, unwoken: a body that
/// waits and is fed a byte at a time turns its connection idle and busy again each time.
struct Pressure {
    clock: Arc<Clock>,
    on: AtomicBool,
    became_idle: Notify,
}

/// Marks the listener under pressure (with no connection known to be idle) for as long as it lives.
struct UnderPressure<'a>(&'a Pressure);

impl<'a> UnderPressure<'a> {
    fn begin(pressure: &'a Pressure) -> UnderPressure<'a> {
        pressure.watch();
        UnderPressure(pressure)
    }
}

impl Pressure {
    /// Asks to be told when a connection becomes idle. SeqCst with the connections' own SeqCst state
    /// changes: either a connection that turns idle sees the flag (and signals), or the scan that follows
    /// sees it idle.
    fn watch(&self) {
        self.on.store(true, Ordering::SeqCst);
    }
}

impl Drop for UnderPressure<'_> {
    fn drop(&mut self) {
        self.0.on.store(false, Ordering::SeqCst);
    }
}

/// One open connection's state, shared by its task, its requests (their bodies too) and the accept loop.
pub(super) struct Tracked {
    /// Requests in progress and requests waiting for their client's body, with [`EVICTED`] set once the
    /// connection was chosen to be closed.
    state: AtomicU64,
    /// When its last request ended, or a body of it last made progress (or it was accepted), by the
    /// [`Clock`].
    idle_since_ms: AtomicU64,
    /// The connection's task, woken when it is evicted.
    on_eviction: AtomicWaker,
    pressure: Arc<Pressure>,
}

impl Tracked {
    /// A request starts on this connection; `None` when the connection was evicted, in which case
    /// the request must not be handled.
    pub(super) fn start(self: &Arc<Self>) -> Option<InProgress> {
        let before = self.state.fetch_add(1, Ordering::SeqCst);
        (before & EVICTED == 0).then(|| InProgress(self.clone()))
    }

    fn is_evicted(&self) -> bool {
        self.state.load(Ordering::SeqCst) & EVICTED != 0
    }

    fn finish(&self) {
        // Written before the count drops, so an evictor that sees the connection idle sees this time too.
        self.mark();
        let before = self.state.fetch_sub(1, Ordering::SeqCst);
        self.became_evictable(before - 1);
    }

    /// Stamps now as the connection's last activity.
    fn mark(&self) {
        self.idle_since_ms
            .store(self.pressure.clock.coarse(), Ordering::Relaxed);
    }

    /// Tells a waiting accept loop that the connection, now in `state`, may be evicted.
    fn became_evictable(&self, state: u64) {
        if evictable(state) && self.pressure.on.load(Ordering::SeqCst) {
            self.pressure.became_idle.notify_one();
        }
    }

    fn idle_since(&self) -> Option<u64> {
        let state = self.state.load(Ordering::SeqCst);
        evictable(state).then(|| self.idle_since_ms.load(Ordering::Relaxed))
    }

    /// Closes the connection if it is still idle; `false` when a request started on it meanwhile, or a
    /// body's wait ended.
    fn evict(&self) -> bool {
        let swapped = self
            .state
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |state| {
                evictable(state).then_some(state | EVICTED)
            });
        if swapped.is_ok() {
            self.on_eviction.wake();
        }
        swapped.is_ok()
    }
}

impl BodyWatch for Tracked {
    fn waiting(&self) {
        let before = self.state.fetch_add(WAITING, Ordering::SeqCst);
        self.became_evictable(before + WAITING);
    }

    fn resumed(&self) -> bool {
        let before = self.state.fetch_sub(WAITING, Ordering::SeqCst);
        before & EVICTED == 0
    }

    fn progressed(&self) {
        self.mark();
    }
}

fn closed_to_make_room() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "idle connection closed to make room for another",
    )
}

/// A connection's socket whose waits end in an error once the connection is evicted, so whatever serves
/// it (hyper, or the TLS handshake) ends and drops it. An idle connection always waits on its socket, and
/// that wait is what eviction wakes: nothing else is polled beside the connection, and a socket with
/// bytes ready costs no more than before. A write that waits longer than its [`WriteDeadline`] (if it
/// has one) fails the same way.
pub(super) struct Evictable<T> {
    io: T,
    tracked: Arc<Tracked>,
    /// The waker last registered for the eviction. A connection's task keeps one waker, so after the
    /// first wait on the socket each further wait costs a comparison, not the registration's atomics.
    registered: Option<Waker>,
    deadline: Option<WriteDeadline>,
}

impl<T> Evictable<T> {
    /// `io`, closed when `tracked` is evicted, or when a write waits past `deadline`.
    pub(super) fn new(io: T, tracked: Arc<Tracked>, deadline: Option<WriteDeadline>) -> Evictable<T> {
        Evictable {
            io,
            tracked,
            registered: None,
            deadline,
        }
    }

    /// After an I/O poll came back pending: wakes the task at eviction, or says it has happened.
    fn pending<R>(&mut self, cx: &Context<'_>) -> Poll<std::io::Result<R>> {
        let waker = cx.waker();
        if !self.registered.as_ref().is_some_and(|w| w.will_wake(waker)) {
            self.tracked.on_eviction.register(waker);
            self.registered = Some(waker.clone());
        }
        // Checked after registering, so an eviction between the two still wakes the task.
        if self.tracked.is_evicted() {
            return Poll::Ready(Err(closed_to_make_room()));
        }
        Poll::Pending
    }

    /// The inner poll; where it would wait, the eviction ends the wait. (An evicted connection that
    /// still has bytes to read gets them: it ends at its next wait, which comes at once.)
    fn poll_io<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>>
    where
        T: Unpin,
    {
        match poll(Pin::new(&mut self.io), cx) {
            Poll::Pending => self.pending(cx),
            ready => ready,
        }
    }

    /// [`Evictable::poll_io`] for a write, which also ends once it has waited past the deadline.
    fn poll_write_io<R>(
        &mut self,
        cx: &mut Context<'_>,
        poll: impl FnOnce(Pin<&mut T>, &mut Context<'_>) -> Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>>
    where
        T: Unpin,
    {
        let polled = self.poll_io(cx, poll);
        let Some(deadline) = self.deadline.as_mut() else {
            return polled;
        };
        match polled {
            Poll::Pending => deadline.waiting(cx).map(Err),
            done => {
                deadline.progressed();
                done
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Evictable<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.get_mut().poll_io(cx, |io, cx| io.poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Evictable<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.get_mut().poll_write_io(cx, |io, cx| io.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut()
            .poll_write_io(cx, |io, cx| io.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().poll_write_io(cx, |io, cx| io.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A request in progress on a connection; it ends when this is dropped.
pub(super) struct InProgress(Arc<Tracked>);

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// A response body that keeps its request in progress until the body has been sent or dropped. No box
/// of its own: the connection serves this type directly.
pub(super) struct Guarded<B> {
    body: B,
    _request: Option<InProgress>,
}

impl<B> Guarded<B> {
    /// `body`, keeping `request` in progress while it lives.
    pub(super) fn new(body: B, request: Option<InProgress>) -> Guarded<B> {
        Guarded {
            body,
            _request: request,
        }
    }
}

impl<B: Body + Unpin> Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The open connections, in a slab: an index per connection, reused after it closes.
#[derive(Default)]
struct Open {
    entries: Vec<Option<Arc<Tracked>>>,
    vacant: Vec<usize>,
}

impl Open {
    fn insert(&mut self, tracked: Arc<Tracked>) -> usize {
        match self.vacant.pop() {
            Some(index) => {
                self.entries[index] = Some(tracked);
                index
            }
            None => {
                self.entries.push(Some(tracked));
                self.entries.len() - 1
            }
        }
    }

    fn remove(&mut self, index: usize) {
        if let Some(entry) = self.entries.get_mut(index) {
            *entry = None;
            self.vacant.push(index);
        }
    }

    /// The connection idle the longest, and since when.
    fn idlest(&self) -> Option<(&Arc<Tracked>, u64)> {
        self.entries
            .iter()
            .flatten()
            .filter_map(|tracked| Some((tracked, tracked.idle_since()?)))
            .min_by_key(|(_, since)| *since)
    }
}

/// What the accept loop should wait for after looking for a connection to evict.
enum Next {
    /// One was evicted: its slot comes free as soon as its task ends.
    Evicted,
    /// The idlest connection may be evicted at this time, unless a slot comes free first.
    At(tokio::time::Instant),
    /// None is idle: wait for a slot, or for a connection to become idle.
    Idle,
}

/// A listener's connection slots, one per open connection; clones share them.
#[derive(Clone)]
pub(super) struct Slots(Arc<Registry>);

struct Registry {
    free: Arc<Semaphore>,
    open: Mutex<Open>,
    pressure: Arc<Pressure>,
    min_idle_ms: u64,
    /// The proxy listener's connections are counted; the admin listener's are not.
    metrics: Option<Metrics>,
}

impl Slots {
    /// `max` slots; a connection can be evicted once idle for `header_read_timeout` or 1 s, whichever
    /// is shorter.
    pub(super) fn new(
        max: usize,
        header_read_timeout: Duration,
        clock: Arc<Clock>,
        metrics: Option<Metrics>,
    ) -> Slots {
        let pressure = Arc::new(Pressure {
            clock,
            on: AtomicBool::new(false),
            became_idle: Notify::new(),
        });
        Slots(Arc::new(Registry {
            free: Arc::new(Semaphore::new(max)),
            open: Mutex::new(Open::default()),
            pressure,
            min_idle_ms: millis(header_read_timeout.min(MAX_MIN_IDLE)),
            metrics,
        }))
    }

    /// A free slot, making room for it while every slot is taken; `None` once `stop` is cancelled.
    pub(super) async fn take(&self, stop: &CancellationToken) -> Option<Slot> {
        let permit = match self.0.free.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => self.make_room(stop).await?,
        };
        Some(self.register(permit))
    }

    /// Evicts idle connections, one per wait, until a slot is free.
    async fn make_room(&self, stop: &CancellationToken) -> Option<OwnedSemaphorePermit> {
        if let Some(metrics) = &self.0.metrics {
            metrics.connection_cap_reached.inc();
        }
        tracing::debug!("every connection slot is taken; the idlest connection makes room for a new one");
        let pressure = UnderPressure::begin(&self.0.pressure);
        loop {
            pressure.0.watch();
            let next = self.evict_idlest();
            if !matches!(next, Next::Idle) {
                pressure.0.on.store(false, Ordering::SeqCst);
            }
            let matured = async {
                match next {
                    Next::At(at) => tokio::time::sleep_until(at).await,
                    Next::Evicted | Next::Idle => std::future::pending().await,
                }
            };
            let became_idle = async {
                match next {
                    Next::Evicted | Next::At(_) => std::future::pending().await,
                    Next::Idle => self.0.pressure.became_idle.notified().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return None,
                permit = self.0.free.clone().acquire_owned() => return permit.ok(),
                _ = matured => {}
                _ = became_idle => {}
            }
        }
    }

    fn evict_idlest(&self) -> Next {
        let clock = &self.0.pressure.clock;
        // The coarse clock may have stamped an idle start up to a tick early.
        let min_idle = self.0.min_idle_ms + millis(Clock::TICK);
        let now = clock.advance();
        let open = self.open();
        loop {
            let Some((tracked, since)) = open.idlest() else {
                return Next::Idle;
            };
            let due = since.saturating_add(min_idle);
            if due > now {
                return Next::At(clock.instant_at(due));
            }
            if tracked.evict() {
                if let Some(metrics) = &self.0.metrics {
                    metrics.connections_evicted.inc();
                }
                tracing::debug!(idle_ms = now - since, "idle connection closed to make room");
                return Next::Evicted;
            }
        }
    }

    fn register(&self, permit: OwnedSemaphorePermit) -> Slot {
        let tracked = Arc::new(Tracked {
            state: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(self.0.pressure.clock.advance()),
            on_eviction: AtomicWaker::new(),
            pressure: self.0.pressure.clone(),
        });
        let index = self.open().insert(tracked.clone());
        if let Some(metrics) = &self.0.metrics {
            metrics.open_connections.inc();
        }
        Slot {
            _permit: permit,
            index,
            tracked,
            slots: self.clone(),
        }
    }

    fn open(&self) -> MutexGuard<'_, Open> {
        // The slab stays consistent whatever panicked while it was locked: each change is one step.
        self.0.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An open connection's slot; frees it when the connection ends.
pub(super) struct Slot {
    _permit: OwnedSemaphorePermit,
    index: usize,
    tracked: Arc<Tracked>,
    slots: Slots,
}

impl Slot {
    /// The connection's state, for its task and its requests.
    pub(super) fn tracked(&self) -> Arc<Tracked> {
        self.tracked.clone()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.open().remove(self.index);
        if let Some(metrics) = &self.slots.0.metrics {
            metrics.open_connections.dec();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(max: usize) -> Slots {
        Slots::new(max, Duration::from_secs(10), Clock::new(), None)
    }

    #[test]
    fn a_request_that_started_keeps_its_connection() {
        let slots = slots(1);
        let permit = slots.0.free.clone().try_acquire_owned().unwrap();
        let slot = slots.register(permit);
        let request = slot.tracked().start().expect("not evicted");
        assert!(!slot.tracked.evict(), "evicted with a request in progress");
        drop(request);
        assert!(slot.tracked.evict(), "idle, so it can be evicted");
        assert!(slot.tracked().start().is_none(), "no request starts once evicted");
    }

    #[test]
    fn the_connection_idle_the_longest_is_evicted_once_idle_long_enough() {
        let clock = Arc::new(Clock {
            epoch: Instant::now() - Duration::from_secs(60),
            coarse_ms: AtomicU64::new(0),
        });
        let slots = Slots::new(3, Duration::from_secs(10), clock, None);
        let take = || slots.register(slots.0.free.clone().try_acquire_owned().unwrap());
        let (oldest, busy, recent) = (take(), take(), take());
        let request = busy.tracked().start().unwrap();
        busy.tracked.idle_since_ms.store(0, Ordering::SeqCst);
        oldest.tracked.idle_since_ms.store(10_000, Ordering::SeqCst);
        assert!(matches!(slots.evict_idlest(), Next::Evicted));
        assert!(
            oldest.tracked().start().is_none(),
            "the oldest idle one was evicted"
        );
        // The other idle one has been idle for less than a second: it is due later.
        assert!(matches!(slots.evict_idlest(), Next::At(_)));
        assert!(recent.tracked().start().is_some());
        drop(request);
    }

    #[test]
    fn a_connection_whose_requests_all_wait_for_their_bodies_is_idle() {
        let slots = slots(1);
        let slot = slots.register(slots.0.free.clone().try_acquire_owned().unwrap());
        let tracked = slot.tracked();
        let (first, second) = (tracked.start().unwrap(), tracked.start().unwrap());
        tracked.waiting();
        assert!(
            tracked.idle_since().is_none(),
            "the other request is being handled"
        );
        assert!(!tracked.evict());
        tracked.waiting();
        assert!(tracked.idle_since().is_some(), "both wait for their clients");
        assert!(tracked.resumed(), "a body may go on while not evicted");
        assert!(!tracked.evict(), "one request has its bytes again");
        tracked.waiting();
        assert!(tracked.evict());
        assert!(!tracked.resumed(), "a body caught waiting fails");
        assert!(!tracked.resumed());
        assert!(tracked.start().is_none());
        drop((first, second));
    }

    #[test]
    fn a_body_s_progress_makes_its_connection_recently_active() {
        let clock = Arc::new(Clock {
            epoch: Instant::now() - Duration::from_secs(60),
            coarse_ms: AtomicU64::new(0),
        });
        let slots = Slots::new(1, Duration::from_secs(10), clock.clone(), None);
        let slot = slots.register(slots.0.free.clone().try_acquire_owned().unwrap());
        let tracked = slot.tracked();
        slot.tracked.idle_since_ms.store(0, Ordering::SeqCst);
        let request = tracked.start().unwrap();
        clock.advance();
        tracked.progressed();
        tracked.waiting();
        assert!(
            matches!(slots.evict_idlest(), Next::At(_)),
            "waiting, but it made progress just now"
        );
        slot.tracked.idle_since_ms.store(0, Ordering::SeqCst);
        assert!(matches!(slots.evict_idlest(), Next::Evicted));
        drop(request);
    }

    #[tokio::test]
    async fn an_evicted_connection_s_waiting_read_fails_at_once() {
        use tokio::io::AsyncReadExt;
        let slots = slots(1);
        let slot = slots.register(slots.0.free.clone().try_acquire_owned().unwrap());
        let (client, server) = tokio::io::duplex(64);
        let mut socket = Evictable::new(server, slot.tracked(), None);
        let tracked = slot.tracked();
        let reading = tokio::spawn(async move {
            let mut byte = [0u8; 1];
            socket.read(&mut byte).await
        });
        // The read runs until it waits on the socket (a single-threaded runtime runs it on this yield).
        tokio::task::yield_now().await;
        assert!(!reading.is_finished(), "nothing was written, so the read waits");
        assert!(tracked.evict());
        let read = reading.await.unwrap();
        assert_eq!(read.unwrap_err().kind(), std::io::ErrorKind::ConnectionAborted);
        drop(client);
    }

    #[test]
    fn a_closed_connection_leaves_the_slab_and_its_index_is_reused() {
        let slots = slots(2);
        let take = || slots.register(slots.0.free.clone().try_acquire_owned().unwrap());
        let first = take();
        let index = first.index;
        drop(first);
        assert!(slots.open().idlest().is_none());
        assert_eq!(take().index, index);
    }
}
