//! Runs on every keyed response the relay reads (`execute/relay.rs`): the response's body, kept once in
//! coalesced blocks (`attach/blocks.rs`), for the capture that stores it (`execute/capture.rs`) and for
//! the duplicates that follow it (`attach.rs`), each of which holds only a cursor into it. The relay
//! writes each frame's bytes as it reads them, and publishes them to the followers as the original
//! client gets them, so a frame held back from the client is held back from them too. Touches nothing
//! but its own memory and the counters of followers cut off.
//!
//! While the capture keeps the body, every byte is kept and charged to the capture budget (and once the
//! capture is done, the body stored or not, the log keeps that charge until its last reader lets go),
//! and a follower may read the beginning at its own pace: it is cut off once it falls more than
//! `server.attach_buffer` behind the bytes published since it joined. Once the capture gives up, the
//! beginning is let go and nobody new joins; the log keeps only what the slowest follower has yet to
//! read, and a follower more than `attach_buffer` behind the newest byte is cut off. So the uncharged
//! bytes of one execution are at most `attach_buffer`, two blocks and the frame held back, however many
//! follow it, and running executions are at most `server.max_keyed_in_flight`.
//!
//! A follower cut off (behind, or stalled: see `attach/watchdog.rs`) gives back at once what it holds
//! (its place among those that wait) and its claim on the blocks, even if its body is never polled again;
//! when polled, its body ends with an error, never passed off as whole.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use prometheus::IntCounter;

use super::blocks::{BLOCK, Blocks};
use super::watchdog;

/// What pays for something a log keeps (the capture's reservation for the bytes, a follower's place
/// among those that wait), let go with it.
pub(crate) type Paid = Box<dyn Send + Sync>;

/// Watchdog ticks in one `server.write_timeout`: a follower is cut off after this many ticks in a row
/// with bytes ready and none read, so after `write_timeout` and at most a tick more.
pub(super) const TICKS: u32 = 4;

/// How a followed response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// Whole, and stored (or given up on storing) as the original client was told.
    Whole,
    /// The upstream broke off, or the execution ended without its end: no duplicate may take it for whole.
    Broken,
}

/// Why a follower's body ended with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Cutoff {
    #[error("fell behind the response it follows by more than server.attach_buffer")]
    Behind,
    #[error("accepted none of the response it follows for server.write_timeout")]
    Stalled,
    #[error("the response it follows broke off")]
    Broken,
    /// Still reading `server.write_timeout` after the response ended: what it has not read is in the
    /// store, for a retry (`Last-Event-ID` resumes an event stream), and the log may not be held for it.
    #[error("did not finish reading the response it follows within server.write_timeout of its end")]
    Late,
}

/// What bounds the followers of a log.
pub(crate) struct Bounds {
    /// The most bytes a follower may fall behind (`server.attach_buffer`).
    pub(crate) buffer: u64,
    /// The longest a follower may take nothing it has ready (`server.write_timeout`).
    pub(crate) write_timeout: Duration,
    /// Counts followers cut off for falling behind.
    pub(crate) cutoffs: IntCounter,
    /// Counts followers cut off for taking nothing.
    pub(crate) stalls: IntCounter,
}

/// One response's body, as it is relayed.
pub(crate) struct Log {
    state: Mutex<State>,
    /// What bounds its followers; `None` when nobody may follow it (the capture's alone).
    bounds: Option<Bounds>,
}

struct State {
    blocks: Blocks,
    /// Bytes published: what followers may read.
    visible: u64,
    trailers: Option<HeaderMap>,
    end: Option<End>,
    /// Whether every byte from the first is kept (the capture keeps the body).
    keeps: bool,
    /// Whether the execution may still publish (and duplicates join).
    publishing: bool,
    /// Whether the capture may still read the blocks.
    writing: bool,
    followers: HashMap<u64, Follower, foldhash::fast::RandomState>,
    next_id: u64,
    /// Followers not cut off.
    live: usize,
    /// No live follower's mark is below this (it is exact after a scan; reads only raise marks).
    floor: u64,
    /// Followers waiting for more, to wake.
    waiting: Vec<u64>,
    /// What pays for the bytes once the capture is done with them.
    paid: Option<Paid>,
    /// Whether a watchdog runs for the followers.
    watched: bool,
    /// Watchdog ticks since the response ended: after [`TICKS`] of them the followers still reading are
    /// cut off, so that a follower reading a little before each tick cannot keep the log, and the
    /// capture budget it is charged to, for as long as it likes.
    ticks_since_end: u32,
}

/// One follower's place in the log.
struct Follower {
    cursor: u64,
    /// `visible` when it joined: while the whole body is kept, it is behind by what was published since.
    joined_at: u64,
    trailers_read: bool,
    cut: Option<Cutoff>,
    /// What it holds until it ends or is cut off.
    guard: Option<Paid>,
    waker: Option<Waker>,
    /// Frames it has taken, and as many as the watchdog saw last, whether it had any ready then, and
    /// the ticks in a row it took none it had.
    reads: u64,
    seen_reads: u64,
    was_ready: bool,
    stalled_ticks: u32,
}

impl Follower {
    /// Where it is, as its lag is measured from.
    fn mark(&self, keeps: bool) -> u64 {
        if keeps {
            self.cursor.max(self.joined_at)
        } else {
            self.cursor
        }
    }

    fn has_ready(&self, visible: u64, trailers: bool, ended: bool) -> bool {
        self.cursor < visible || (trailers && !self.trailers_read) || ended
    }

    /// Ends it with `why`, letting go of what it holds into `released`.
    fn cut(&mut self, why: Cutoff, released: &mut Vec<Paid>) {
        self.cut = Some(why);
        released.extend(self.guard.take());
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }
}

impl Log {
    /// A log only the capture reads.
    pub(crate) fn unfollowed() -> Arc<Log> {
        Log::new(None, false, BLOCK)
    }

    /// A log duplicates may follow.
    pub(crate) fn followed(bounds: Bounds) -> Arc<Log> {
        Log::new(Some(bounds), true, BLOCK)
    }

    fn new(bounds: Option<Bounds>, publishing: bool, block: usize) -> Arc<Log> {
        Arc::new(Log {
            state: Mutex::new(State {
                blocks: Blocks::new(block),
                visible: 0,
                trailers: None,
                end: None,
                keeps: true,
                publishing,
                writing: true,
                followers: HashMap::default(),
                next_id: 0,
                live: 0,
                floor: 0,
                waiting: Vec::new(),
                paid: None,
                watched: false,
                ticks_since_end: 0,
            }),
            bounds,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a frame's bytes, as the relay reads them.
    pub(crate) fn write(&self, data: &Bytes) {
        let mut released = Vec::new();
        let mut state = self.lock();
        if !state.keeps && self.bounds.is_none() {
            return;
        }
        let sealed = state.blocks.write(data);
        if sealed && !state.keeps {
            state.scan(self.bounds.as_ref(), &mut released);
        }
    }

    /// The capture gave the body up: the beginning is let go, and nobody new joins.
    pub(crate) fn forget(&self) {
        let mut released = Vec::new();
        let mut state = self.lock();
        state.keeps = false;
        state.scan(self.bounds.as_ref(), &mut released);
    }

    /// The whole body written, as one run of bytes, if it is all kept.
    pub(crate) fn whole(&self) -> Option<Bytes> {
        let mut state = self.lock();
        if !state.keeps {
            return None;
        }
        state.blocks.whole()
    }

    /// The capture is done with the blocks; `paid` keeps them charged for as long as they are kept.
    pub(crate) fn written(&self, paid: Paid) {
        let mut released = vec![paid];
        let mut state = self.lock();
        state.writing = false;
        if state.keeps {
            state.paid = released.pop();
        }
        state.release_if_done(&mut released);
    }

    /// A frame went to the original client: its bytes, or its trailers, are the followers' to read.
    pub(crate) fn publish(&self, frame: &Frame<Bytes>) {
        let mut released = Vec::new();
        let mut state = self.lock();
        if let Some(data) = frame.data_ref() {
            state.visible = (state.visible + data.len() as u64).min(state.blocks.end());
        } else if let Some(trailers) = frame.trailers_ref() {
            state.trailers = Some(trailers.clone());
        }
        if let Some(bounds) = &self.bounds
            && state.visible.saturating_sub(state.floor) > bounds.buffer
        {
            state.scan(Some(bounds), &mut released);
        }
        state.wake();
    }

    /// The response ended as `end` (the first end said is the one followers get).
    pub(crate) fn end(&self, end: End) {
        let mut state = self.lock();
        state.end.get_or_insert(end);
        state.wake();
    }

    /// The execution is over: nothing more is published, and nobody new joins.
    pub(crate) fn unpublished(&self) {
        let mut released = Vec::new();
        let mut state = self.lock();
        state.publishing = false;
        state.end.get_or_insert(End::Broken);
        state.wake();
        state.release_if_done(&mut released);
    }

    /// A new follower, from the first byte, if the first byte is still kept (or nothing was published
    /// yet). The followers get a watchdog if they have none.
    pub(crate) fn join(self: &Arc<Self>) -> Option<Seat> {
        let bounds = self.bounds.as_ref()?;
        let mut state = self.lock();
        let nothing_yet = state.visible == 0 && state.trailers.is_none();
        if !state.publishing || !(state.keeps || nothing_yet) || state.blocks.start() != 0 {
            return None;
        }
        let id = state.next_id;
        state.next_id += 1;
        let joined_at = state.visible;
        state.followers.insert(
            id,
            Follower {
                cursor: 0,
                joined_at,
                trailers_read: false,
                cut: None,
                guard: None,
                waker: None,
                reads: 0,
                seen_reads: 0,
                was_ready: false,
                stalled_ticks: 0,
            },
        );
        state.live += 1;
        let watch = !std::mem::replace(&mut state.watched, true);
        drop(state);
        if watch {
            watchdog::spawn(Arc::downgrade(self), bounds.write_timeout / TICKS);
        }
        Some(Seat {
            log: self.clone(),
            id,
        })
    }

    /// Bytes of memory the kept blocks take.
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> usize {
        self.lock().blocks.footprint()
    }
}

impl watchdog::Watched for Log {
    /// The watchdog's look at the followers: one that had something ready at the last tick and has
    /// read nothing since has stalled a tick more, and after [`TICKS`] of them it is cut off; once the
    /// response has ended, every follower is cut off after [`TICKS`] more, however it reads. `false`
    /// once no follower is left to watch (the watchdog then ends).
    fn tick(&self) -> bool {
        let Some(bounds) = &self.bounds else {
            return false;
        };
        let mut released = Vec::new();
        let mut state = self.lock();
        let State {
            followers,
            visible,
            trailers,
            end,
            live,
            ticks_since_end,
            ..
        } = &mut *state;
        if end.is_some() {
            *ticks_since_end += 1;
        }
        let late = *ticks_since_end > TICKS;
        for follower in followers.values_mut().filter(|f| f.cut.is_none()) {
            if follower.was_ready && follower.reads == follower.seen_reads {
                follower.stalled_ticks += 1;
            } else {
                follower.stalled_ticks = 0;
            }
            follower.was_ready = follower.has_ready(*visible, trailers.is_some(), end.is_some());
            follower.seen_reads = follower.reads;
            let cut = match (follower.stalled_ticks >= TICKS, late) {
                (true, _) => Cutoff::Stalled,
                (false, true) => Cutoff::Late,
                (false, false) => continue,
            };
            follower.cut(cut, &mut released);
            bounds.stalls.inc();
            *live -= 1;
        }
        state.release_if_done(&mut released);
        let watching = state.live > 0;
        state.watched = watching;
        watching
    }
}

impl State {
    /// Cuts off the followers that are too far behind, brings `floor` up to the slowest of the others,
    /// and, once the beginning is no longer kept, lets go of what they have all read.
    fn scan(&mut self, bounds: Option<&Bounds>, released: &mut Vec<Paid>) {
        let Some(bounds) = bounds else {
            self.blocks.clear();
            return;
        };
        let limit = self.visible.saturating_sub(bounds.buffer);
        let mut floor = self.visible;
        for follower in self.followers.values_mut().filter(|f| f.cut.is_none()) {
            let mark = follower.mark(self.keeps);
            if mark < limit {
                follower.cut(Cutoff::Behind, released);
                bounds.cutoffs.inc();
                self.live -= 1;
            } else {
                floor = floor.min(mark);
            }
        }
        self.floor = floor;
        if !self.keeps {
            self.blocks.forget_before(floor);
        }
        self.release_if_done(released);
    }

    fn wake(&mut self) {
        for id in self.waiting.drain(..) {
            if let Some(waker) = self.followers.get_mut(&id).and_then(|f| f.waker.take()) {
                waker.wake();
            }
        }
    }

    /// Once neither the execution, nor the capture, nor a live follower needs the blocks, lets them
    /// go, and what paid for them.
    fn release_if_done(&mut self, released: &mut Vec<Paid>) {
        if self.publishing || self.writing || self.live > 0 {
            return;
        }
        self.blocks.clear();
        self.trailers = None;
        released.extend(self.paid.take());
    }
}

/// A follower's place in a log, its own until it is dropped.
pub(crate) struct Seat {
    log: Arc<Log>,
    id: u64,
}

impl Seat {
    /// Keeps `guard` (what bounds the followers) until the follower ends or is cut off.
    pub(crate) fn hold(&self, guard: Paid) {
        let mut released = vec![guard];
        let mut state = self.log.lock();
        if let Some(follower) = state.followers.get_mut(&self.id)
            && follower.cut.is_none()
        {
            follower.guard = released.pop();
        }
    }

    /// The next frame: the unread bytes up to the newest published (at most a block of them), then the
    /// trailers, then the end.
    pub(crate) fn poll_read(&self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Cutoff>>> {
        let mut state = self.log.lock();
        let State {
            blocks,
            visible,
            trailers,
            end,
            followers,
            waiting,
            ..
        } = &mut *state;
        let Some(follower) = followers.get_mut(&self.id) else {
            return Poll::Ready(Some(Err(Cutoff::Behind)));
        };
        if let Some(why) = follower.cut {
            return Poll::Ready(Some(Err(why)));
        }
        if follower.cursor < *visible {
            // Cut-offs come before bytes are let go, so its bytes are there.
            let Some(chunk) = blocks.read(follower.cursor, *visible) else {
                return Poll::Ready(Some(Err(Cutoff::Behind)));
            };
            follower.cursor += chunk.len() as u64;
            follower.reads += 1;
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        if let Some(trailers) = trailers
            && !follower.trailers_read
        {
            follower.trailers_read = true;
            follower.reads += 1;
            return Poll::Ready(Some(Ok(Frame::trailers(trailers.clone()))));
        }
        match end {
            Some(End::Whole) => Poll::Ready(None),
            Some(End::Broken) => Poll::Ready(Some(Err(Cutoff::Broken))),
            None => {
                if follower.waker.replace(cx.waker().clone()).is_none() {
                    waiting.push(self.id);
                }
                Poll::Pending
            }
        }
    }

    /// Whether the follower has read everything of a whole response.
    pub(crate) fn is_end_stream(&self) -> bool {
        let state = self.log.lock();
        state.followers.get(&self.id).is_some_and(|follower| {
            follower.cut.is_none()
                && follower.cursor == state.visible
                && (state.trailers.is_none() || follower.trailers_read)
                && state.end == Some(End::Whole)
        })
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut released = Vec::new();
        let mut state = self.log.lock();
        if let Some(follower) = state.followers.remove(&self.id) {
            if follower.cut.is_none() {
                state.live -= 1;
            }
            released.extend(follower.guard);
        }
        state.release_if_done(&mut released);
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;

    fn bounds(buffer: u64) -> Bounds {
        Bounds {
            buffer,
            write_timeout: Duration::from_secs(4),
            cutoffs: IntCounter::new("cutoffs", "test").unwrap(),
            stalls: IntCounter::new("stalls", "test").unwrap(),
        }
    }

    /// A followed log whose followers may fall `buffer` behind, in blocks of `block` bytes.
    fn log(buffer: u64, block: usize) -> Arc<Log> {
        Log::new(Some(bounds(buffer)), true, block)
    }

    /// `text` as the relay hands it on: written, then published.
    fn relay(log: &Log, text: &str) {
        let data = Bytes::copy_from_slice(text.as_bytes());
        log.write(&data);
        log.publish(&Frame::data(data));
    }

    fn poll_now(seat: &Seat) -> Poll<Option<Result<Frame<Bytes>, Cutoff>>> {
        seat.poll_read(&mut Context::from_waker(Waker::noop()))
    }

    /// What the follower can read now, a frame at a time: the text, and each frame's length.
    fn drain(seat: &Seat) -> (String, Vec<usize>) {
        let (mut text, mut frames) = (String::new(), Vec::new());
        while let Poll::Ready(Some(Ok(frame))) = poll_now(seat) {
            let Ok(data) = frame.into_data() else { break };
            frames.push(data.len());
            text.push_str(std::str::from_utf8(&data).unwrap());
        }
        (text, frames)
    }

    /// Reads one frame, if one is ready.
    fn read_one(seat: &Seat) {
        let _ = poll_now(seat);
    }

    /// Why the follower was cut off, if it was, without reading anything.
    fn cutoff(seat: &Seat) -> Option<Cutoff> {
        seat.log.lock().followers.get(&seat.id).and_then(|f| f.cut)
    }

    /// A guard whose drop can be seen: its count goes back to 1.
    fn guard(seat: &Seat) -> Arc<()> {
        let guard = Arc::new(());
        seat.hold(Box::new(guard.clone()));
        guard
    }

    #[tokio::test]
    async fn followers_read_a_block_at_most_across_block_boundaries_and_the_filling_tail_as_a_copy() {
        let log = log(1024, 8);
        let seat = log.join().unwrap();
        for frame in ["abc", "def", "ghi", "jk"] {
            relay(&log, frame);
        }
        assert_eq!(drain(&seat), ("abcdefghijk".into(), vec![6, 5]));
        relay(&log, "l");
        assert_eq!(drain(&seat), ("l".into(), vec![1]), "the unread part only");
        let late = log.join().unwrap();
        assert_eq!(
            drain(&late),
            ("abcdefghijkl".into(), vec![6, 6]),
            "from the first byte"
        );
    }

    #[tokio::test]
    async fn a_frame_held_back_from_the_client_is_held_back_from_the_followers() {
        let log = log(1024, 8);
        let seat = log.join().unwrap();
        let last = Bytes::from_static(b"end");
        log.write(&last);
        assert!(poll_now(&seat).is_pending(), "written, not published");
        log.publish(&Frame::data(last));
        let mut trailers = HeaderMap::new();
        trailers.insert("x-n", http::HeaderValue::from_static("1"));
        log.publish(&Frame::trailers(trailers.clone()));
        assert!(!seat.is_end_stream());
        log.end(End::Whole);
        let frames: Vec<_> = (0..2)
            .map(|_| match poll_now(&seat) {
                Poll::Ready(Some(Ok(frame))) => frame,
                _ => panic!("a frame"),
            })
            .collect();
        assert_eq!(frames[0].data_ref().map(|d| &d[..]), Some(&b"end"[..]));
        assert_eq!(
            frames[1].trailers_ref(),
            Some(&trailers),
            "trailers after the data"
        );
        assert!(seat.is_end_stream());
        assert!(matches!(poll_now(&seat), Poll::Ready(None)));
    }

    #[tokio::test]
    async fn a_follower_waiting_for_more_is_woken_when_it_comes() {
        let log = log(1024, 8);
        let seat = log.join().unwrap();
        let reading = tokio::spawn(async move { poll_fn(|cx| seat.poll_read(cx)).await.map(|f| f.is_ok()) });
        tokio::task::yield_now().await;
        relay(&log, "a");
        assert_eq!(reading.await.unwrap(), Some(true));
    }

    #[tokio::test]
    async fn while_the_body_is_kept_a_follower_is_behind_by_what_came_since_it_joined() {
        let log = log(4, 8);
        relay(&log, "abcdef");
        let late = log.join().unwrap();
        let guard = guard(&late);
        relay(&log, "gh");
        assert_eq!(
            cutoff(&late),
            None,
            "6 bytes of the beginning and 2 new: within 4"
        );
        relay(&log, "ijk");
        assert_eq!(
            cutoff(&late),
            Some(Cutoff::Behind),
            "5 bytes came since it joined"
        );
        assert_eq!(Arc::strong_count(&guard), 1, "its guard is let go at once");
        assert_eq!(log.bounds.as_ref().unwrap().cutoffs.get(), 1);
    }

    #[tokio::test]
    async fn once_the_beginning_is_forgotten_a_follower_more_than_the_buffer_behind_is_cut_off() {
        let log = log(16, 8);
        relay(&log, &"x".repeat(40));
        let (quick, late) = (log.join().unwrap(), log.join().unwrap());
        drain(&quick);
        relay(&log, "y");
        assert_eq!(
            cutoff(&late),
            None,
            "kept: the beginning costs the capture, not the follower"
        );
        log.forget();
        assert_eq!(cutoff(&late), Some(Cutoff::Behind), "41 behind the newest byte");
        assert!(
            log.join().is_none(),
            "nobody new joins once the beginning is gone"
        );
        assert_eq!(drain(&quick).0, "y");
        assert!(
            log.footprint() <= 8,
            "nothing left that anyone needs: {}",
            log.footprint()
        );
    }

    #[tokio::test]
    async fn once_the_beginning_is_forgotten_the_log_keeps_only_what_the_slowest_follower_needs() {
        const BUFFER: usize = 64;
        const BLOCK: usize = 8;
        let log = log(BUFFER as u64, BLOCK);
        let (quick, slow) = (log.join().unwrap(), log.join().unwrap());
        log.forget();
        let mut read = String::new();
        for i in 0..40 {
            relay(&log, "abcd");
            read.push_str(&drain(&quick).0);
            // The slow one reads two frames' worth every fourth frame, falling behind, then stops.
            if i % 4 == 3 && i < 20 {
                let mut bytes = 0;
                while bytes < 8 {
                    let Poll::Ready(Some(Ok(frame))) = poll_now(&slow) else {
                        panic!("the slow one is still following");
                    };
                    bytes += frame.data_ref().map_or(0, Bytes::len);
                }
            }
            assert!(
                log.footprint() <= BUFFER + 2 * BLOCK,
                "frame {i}: {} bytes kept",
                log.footprint()
            );
        }
        assert_eq!(read, "abcd".repeat(40));
        assert_eq!(
            cutoff(&slow),
            Some(Cutoff::Behind),
            "it fell more than 64 bytes behind"
        );
        for _ in 0..4 {
            relay(&log, "abcd");
            drain(&quick);
        }
        assert!(
            log.footprint() <= 2 * BLOCK,
            "only the quick one: {}",
            log.footprint()
        );
    }

    #[tokio::test]
    async fn a_cut_off_follower_that_is_never_polled_again_holds_nothing() {
        let log = log(4, 8);
        let seat = log.join().unwrap();
        let guard = guard(&seat);
        relay(&log, "abcdefgh");
        assert_eq!(Arc::strong_count(&guard), 1);
        let paid = Arc::new(());
        log.written(Box::new(paid.clone()));
        log.end(End::Whole);
        log.unpublished();
        assert_eq!(
            log.footprint(),
            0,
            "its seat is still there, but not its claim on the blocks"
        );
        assert_eq!(Arc::strong_count(&paid), 1, "nor what paid for them");
        drop(seat);
    }

    #[tokio::test]
    async fn the_charge_is_kept_until_the_last_follower_lets_go() {
        let log = log(1024, 8);
        let seat = log.join().unwrap();
        relay(&log, "abc");
        let paid = Arc::new(());
        log.written(Box::new(paid.clone()));
        log.end(End::Whole);
        log.unpublished();
        assert_eq!(Arc::strong_count(&paid), 2, "a follower still reads");
        assert_eq!(drain(&seat).0, "abc");
        drop(seat);
        assert_eq!(Arc::strong_count(&paid), 1);
        assert_eq!(log.footprint(), 0);
    }

    #[tokio::test]
    async fn a_log_nobody_follows_keeps_nothing_once_forgotten() {
        let log = Log::new(None, false, 8);
        log.write(&Bytes::from_static(b"abcdefghij"));
        assert!(log.join().is_none());
        log.forget();
        log.write(&Bytes::from_static(b"klmnop"));
        assert_eq!(log.footprint(), 0);
        assert_eq!(log.whole(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_that_takes_nothing_it_has_ready_for_write_timeout_is_cut_off() {
        let log = log(1024, 8);
        let (stalled, reader) = (log.join().unwrap(), log.join().unwrap());
        let (stalled_guard, reader_guard) = (guard(&stalled), guard(&reader));
        relay(&log, "ab");
        assert_eq!(drain(&reader).0, "ab");
        // Ticks a second apart (a quarter of 4 s); the reader reads every half second, then waits at the
        // newest byte with nothing ready, which is no stall.
        for _ in 0..7 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            relay(&log, "c");
            drain(&reader);
        }
        assert_eq!(cutoff(&stalled), None, "3.5 s without reading: not yet");
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(cutoff(&stalled), Some(Cutoff::Stalled));
        assert_eq!(Arc::strong_count(&stalled_guard), 1, "its place is given back");
        assert_eq!(
            cutoff(&reader),
            None,
            "the reader waits for more, it is not stalled"
        );
        assert_eq!(Arc::strong_count(&reader_guard), 2);
        assert_eq!(log.bounds.as_ref().unwrap().stalls.get(), 1);
        drop((stalled, reader));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            Arc::weak_count(&log),
            0,
            "the watchdog ended with the last follower"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_that_never_takes_its_end_is_cut_off_too() {
        let log = log(1024, 8);
        let seat = log.join().unwrap();
        let guard = guard(&seat);
        relay(&log, "ab");
        drain(&seat);
        log.end(End::Whole);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(Arc::strong_count(&guard), 1);
        assert_eq!(cutoff(&seat), Some(Cutoff::Stalled));
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_still_reading_write_timeout_after_the_end_is_cut_off_however_it_reads() {
        let log = log(1024, 8);
        let slow = log.join().unwrap();
        let guard = guard(&slow);
        for _ in 0..64 {
            relay(&log, "abcdefgh");
        }
        log.end(End::Whole);
        // It reads a little before every tick, so it never stalls, but it never catches up.
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(900)).await;
            read_one(&slow);
            assert_eq!(cutoff(&slow), None, "within write_timeout of the end");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(cutoff(&slow), Some(Cutoff::Late));
        assert_eq!(
            Arc::strong_count(&guard),
            1,
            "its place and its hold on the log are given back"
        );
    }
}
