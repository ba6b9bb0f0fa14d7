//! Runs where a route has `on_in_flight = "attach"`: a duplicate of a key whose response this process is
//! relaying follows that response instead of waiting for it to be stored. The execution publishes it
//! (`execute/relay.rs`): the head, then each frame as it goes to the original client, then the end once
//! the record is stored (or the break, when the upstream broke off). A duplicate that joins (`wait.rs`)
//! gets what was relayed so far, then the live frames: byte for byte what the original client got.
//!
//! What was relayed so far is the capture's own bytes, shared rather than copied, so the capture budget
//! counts them once; once the capture gives up (the response outgrew `max_stored_response` or found no
//! room), the beginning is gone and a later duplicate waits instead. Each duplicate has its own queue of
//! live frames, of at most `server.attach_buffer` bytes: one that falls further behind is cut off, its
//! body ended with an error rather than passed off as whole, and nothing ever waits on a duplicate, so
//! a slow one slows neither the original, nor the capture, nor the others.
//!
//! Only this process's executions can be followed: on another replica a duplicate waits for the stored
//! response. Touches no store and no socket.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame};
use tokio::sync::watch;

use super::sse::Resume;
use crate::body::BoxError;
use crate::metrics::Metrics;
use crate::store::RecordId;
use crate::store::wake::{RecordTag, Waiters};

/// The executions of this process that duplicates may follow, by record. One per process, shared by
/// every worker.
pub(crate) struct Attachments {
    live: Mutex<HashMap<String, Arc<Live>, foldhash::fast::RandomState>>,
    /// The most bytes of live frames queued for one duplicate (`server.attach_buffer`).
    buffer: usize,
    /// Woken when an execution is published, for the duplicates that found none yet.
    waiters: Arc<Waiters>,
    metrics: Metrics,
}

/// One execution's response as it is relayed.
struct Live {
    /// The request it executes, as its fingerprint: only the same request follows it.
    fingerprint: [u8; 32],
    /// Where its head is, for the duplicates that joined before it.
    phase: watch::Sender<Phase>,
    shared: Mutex<Shared>,
}

/// How far an execution's response has come, as the duplicates waiting for its head see it.
#[derive(Clone)]
enum Phase {
    /// No head yet.
    Starting,
    /// The head the duplicates get.
    Head(Arc<Head>),
    /// The execution ended without a response to follow (given back, held, failed before its head):
    /// the duplicates waiting for one go back to waiting for the record.
    Gone,
}

/// The status and headers a duplicate gets: those a replay of the response would carry.
#[derive(Debug)]
pub(crate) struct Head {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
}

struct Shared {
    /// Every frame relayed so far, while the capture keeps the body; `None` once it gave up.
    log: Option<Vec<Piece>>,
    /// Whether any frame has been relayed.
    relayed: bool,
    /// How the response ended, once it has.
    end: Option<End>,
    followers: Vec<Arc<Follower>>,
}

/// A frame as the duplicates get it.
#[derive(Clone)]
enum Piece {
    Data(Bytes),
    Trailers(HeaderMap),
}

impl Piece {
    fn of(frame: &Frame<Bytes>) -> Option<Piece> {
        if let Some(data) = frame.data_ref() {
            return Some(Piece::Data(data.clone()));
        }
        frame.trailers_ref().cloned().map(Piece::Trailers)
    }

    fn len(&self) -> usize {
        match self {
            Piece::Data(data) => data.len(),
            Piece::Trailers(trailers) => trailers
                .iter()
                .map(|(name, value)| name.as_str().len() + value.len())
                .sum(),
        }
    }

    fn frame(self) -> Frame<Bytes> {
        match self {
            Piece::Data(data) => Frame::data(data),
            Piece::Trailers(trailers) => Frame::trailers(trailers),
        }
    }
}

/// How a followed response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// Whole, and stored (or given up on storing) as the original client was told.
    Whole,
    /// The upstream broke off, or the execution ended without its end: no duplicate may take it for whole.
    Broken,
}

/// One duplicate's queue.
struct Follower {
    queue: Mutex<Queue>,
}

struct Queue {
    /// The pieces not read yet, each with whether it counts in `live`.
    pieces: VecDeque<(Piece, bool)>,
    /// Bytes of live frames queued, which `Attachments::buffer` bounds (not the beginning it joined
    /// with, which is the capture's).
    live: usize,
    /// How the body ends once the queue is empty; `Err` ends it with that error.
    end: Option<Result<(), &'static str>>,
    waker: Option<Waker>,
}

impl Follower {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a live piece; `false` when that leaves the duplicate more than `buffer` behind, and it is
    /// cut off.
    fn push(&self, piece: &Piece, buffer: usize) -> bool {
        let mut queue = self.lock();
        if queue.end.is_some() {
            return true;
        }
        let len = piece.len();
        let kept = queue.live.saturating_add(len) <= buffer;
        if kept {
            queue.live += len;
            queue.pieces.push_back((piece.clone(), true));
        } else {
            queue.pieces.clear();
            queue.live = 0;
            queue.end = Some(Err(
                "fell behind the response it follows by more than server.attach_buffer",
            ));
        }
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
        kept
    }

    fn end(&self, end: End) {
        let mut queue = self.lock();
        if queue.end.is_none() {
            queue.end = Some(match end {
                End::Whole => Ok(()),
                End::Broken => Err("the response it follows broke off"),
            });
        }
        if let Some(waker) = queue.waker.take() {
            waker.wake();
        }
    }
}

impl Attachments {
    pub(crate) fn new(buffer: usize, waiters: Arc<Waiters>, metrics: Metrics) -> Arc<Attachments> {
        Arc::new(Attachments {
            live: Mutex::new(HashMap::default()),
            buffer,
            waiters,
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Live>, foldhash::fast::RandomState>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Makes the execution of `id` (of the request `fingerprint`) followable until the publisher is
    /// dropped, and wakes the duplicates of this process that wait for the record, so that those that
    /// found nothing to follow yet join.
    pub(crate) fn publish(self: &Arc<Self>, id: &RecordId, fingerprint: [u8; 32]) -> Publisher {
        let live = Arc::new(Live {
            fingerprint,
            phase: watch::channel(Phase::Starting).0,
            shared: Mutex::new(Shared {
                log: Some(Vec::new()),
                relayed: false,
                end: None,
                followers: Vec::new(),
            }),
        });
        let name = name(&id.scope, &id.key);
        self.lock().insert(name.clone(), live.clone());
        self.waiters.wake(RecordTag::of(&id.scope, &id.key));
        Publisher {
            attachments: self.clone(),
            name,
            live,
            ended: false,
        }
    }

    /// Joins the execution of `id` running here, if there is one for the same request whose beginning
    /// is still kept.
    pub(crate) fn join(&self, id: &RecordId, fingerprint: &[u8; 32]) -> Option<Joined> {
        let live = self.lock().get(&name(&id.scope, &id.key))?.clone();
        if live.fingerprint != *fingerprint {
            return None;
        }
        let phase = live.phase.subscribe();
        if matches!(*phase.borrow(), Phase::Gone) {
            return None;
        }
        let follower = {
            let mut shared = live.shared_lock();
            let beginning = match (&shared.log, shared.relayed) {
                (Some(log), _) => log.iter().map(|piece| (piece.clone(), false)).collect(),
                (None, false) => VecDeque::new(),
                (None, true) => return None,
            };
            let follower = Arc::new(Follower {
                queue: Mutex::new(Queue {
                    pieces: beginning,
                    live: 0,
                    end: None,
                    waker: None,
                }),
            });
            match shared.end {
                Some(end) => follower.end(end),
                None => shared.followers.push(follower.clone()),
            }
            follower
        };
        Some(Joined { phase, follower })
    }

    /// How many executions may be followed now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

impl Live {
    fn shared_lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A record's name in the map: its scope and key, the scope's length first so that no two records share
/// one.
fn name(scope: &str, key: &str) -> String {
    format!("{}:{scope}{key}", scope.len())
}

/// The execution's side: what it relays goes to every duplicate that follows it.
pub(crate) struct Publisher {
    attachments: Arc<Attachments>,
    name: String,
    live: Arc<Live>,
    ended: bool,
}

impl Publisher {
    /// The response's head, as the duplicates get it.
    pub(crate) fn head(&self, head: Head) {
        self.live.phase.send_replace(Phase::Head(Arc::new(head)));
    }

    /// A frame that went to the original client (or would have, had it stayed).
    pub(crate) fn frame(&self, frame: &Frame<Bytes>) {
        let Some(piece) = Piece::of(frame) else {
            return;
        };
        let buffer = self.attachments.buffer;
        let mut shared = self.live.shared_lock();
        shared.relayed = true;
        if let Some(log) = &mut shared.log {
            log.push(piece.clone());
        }
        let metrics = &self.attachments.metrics;
        shared.followers.retain(|follower| {
            // A follower only the list holds has been dropped: its duplicate went away.
            if Arc::strong_count(follower) == 1 {
                return false;
            }
            let kept = follower.push(&piece, buffer);
            if !kept {
                metrics.attach_cutoffs.inc();
            }
            kept
        });
    }

    /// The capture gave the body up: the beginning is no longer kept, and later duplicates wait.
    pub(crate) fn forget(&self) {
        self.live.shared_lock().log = None;
    }

    /// The response ended as `end`; every duplicate's body ends so once it has the frames before.
    pub(crate) fn end(mut self, end: End) {
        self.finish(end);
    }

    fn finish(&mut self, end: End) {
        self.ended = true;
        let mut shared = self.live.shared_lock();
        shared.end = Some(end);
        for follower in shared.followers.drain(..) {
            follower.end(end);
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if !self.ended {
            self.finish(End::Broken);
        }
        // Those still waiting for a head will get none.
        self.live.phase.send_if_modified(|phase| match phase {
            Phase::Starting => {
                *phase = Phase::Gone;
                true
            }
            _ => false,
        });
        let mut live = self.attachments.lock();
        if live
            .get(&self.name)
            .is_some_and(|found| Arc::ptr_eq(found, &self.live))
        {
            live.remove(&self.name);
        }
    }
}

/// A duplicate that joined an execution, before its head.
pub(crate) struct Joined {
    phase: watch::Receiver<Phase>,
    follower: Arc<Follower>,
}

impl Joined {
    /// The head, once the execution has one; `None` if it ended without a response to follow.
    pub(crate) async fn head(&mut self) -> Option<Arc<Head>> {
        let phase = self
            .phase
            .wait_for(|phase| !matches!(phase, Phase::Starting))
            .await
            .ok()?
            .clone();
        match phase {
            Phase::Head(head) => Some(head),
            Phase::Starting | Phase::Gone => None,
        }
    }

    /// The response body the duplicate reads, from the start or after the event `resume` names; it
    /// holds `guard` (whatever bounds the duplicates) until it ends or is dropped.
    pub(crate) fn body<G: Send + Sync + 'static>(self, guard: G, resume: Option<Resume>) -> Followed<G> {
        Followed {
            follower: self.follower,
            resume,
            _guard: guard,
        }
    }
}

/// A duplicate's response body: the frames of the response it follows, then its end.
pub(crate) struct Followed<G> {
    follower: Arc<Follower>,
    /// An event stream resumed after an event (`Last-Event-ID`): what comes before is skipped.
    resume: Option<Resume>,
    _guard: G,
}

impl<G: Unpin> Body for Followed<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let mut queue = this.follower.lock();
        while let Some((piece, counted)) = queue.pieces.pop_front() {
            if counted {
                queue.live -= piece.len();
            }
            let piece = match (piece, &mut this.resume) {
                (Piece::Data(data), Some(resume)) => match resume.feed(&data) {
                    Some(passed) => Piece::Data(passed),
                    None => continue,
                },
                (piece, _) => piece,
            };
            return Poll::Ready(Some(Ok(piece.frame())));
        }
        match queue.end {
            Some(Ok(())) => Poll::Ready(None),
            Some(Err(why)) => Poll::Ready(Some(Err(why.into()))),
            None => {
                queue.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        let queue = self.follower.lock();
        queue.pieces.is_empty() && queue.end == Some(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn attachments(buffer: usize) -> Arc<Attachments> {
        Attachments::new(buffer, Waiters::new(), Metrics::new())
    }

    fn id(key: &str) -> RecordId {
        RecordId {
            scope: "s".into(),
            key: key.into(),
            token: uuid::Uuid::nil(),
        }
    }

    fn head() -> Head {
        Head {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
        }
    }

    fn data(text: &'static str) -> Frame<Bytes> {
        Frame::data(Bytes::from_static(text.as_bytes()))
    }

    async fn read(joined: Joined) -> Result<Bytes, BoxError> {
        Ok(joined.body((), None).collect().await?.to_bytes())
    }

    #[tokio::test]
    async fn a_late_joiner_gets_the_beginning_then_the_rest() {
        let attachments = attachments(1024);
        let publisher = attachments.publish(&id("k"), [1; 32]);
        let early = attachments
            .join(&id("k"), &[1; 32])
            .expect("joined before the head");
        publisher.head(head());
        publisher.frame(&data("ab"));
        let mut late = attachments.join(&id("k"), &[1; 32]).expect("joined mid-stream");
        assert_eq!(late.head().await.expect("a head").status, StatusCode::OK);
        publisher.frame(&data("cd"));
        publisher.end(End::Whole);
        assert_eq!(read(early).await.unwrap(), "abcd");
        assert_eq!(read(late).await.unwrap(), "abcd");
        assert_eq!(attachments.len(), 0, "not followable once it has ended");
    }

    #[tokio::test]
    async fn only_the_same_request_of_the_same_record_joins() {
        let attachments = attachments(1024);
        let _publisher = attachments.publish(&id("k"), [1; 32]);
        assert!(attachments.join(&id("k"), &[2; 32]).is_none());
        assert!(attachments.join(&id("other"), &[1; 32]).is_none());
    }

    #[tokio::test]
    async fn a_follower_more_than_its_buffer_behind_is_cut_off_and_the_others_are_not() {
        let attachments = attachments(4);
        let publisher = attachments.publish(&id("k"), [1; 32]);
        let slow = attachments.join(&id("k"), &[1; 32]).unwrap();
        let mut quick = attachments.join(&id("k"), &[1; 32]).unwrap().body((), None);
        publisher.head(head());
        for chunk in ["abc", "def", "ghi"] {
            publisher.frame(&data(chunk));
            let frame = quick.frame().await.unwrap().unwrap();
            assert_eq!(frame.into_data().unwrap(), chunk);
        }
        publisher.end(End::Whole);
        assert!(quick.frame().await.is_none(), "the quick one ends whole");
        let error = read(slow).await.expect_err("cut off");
        assert!(error.to_string().contains("attach_buffer"), "{error}");
        assert_eq!(attachments.metrics.attach_cutoffs.get(), 1);
    }

    #[tokio::test]
    async fn once_the_beginning_is_forgotten_nobody_new_joins_and_a_break_is_an_error() {
        let attachments = attachments(1024);
        let publisher = attachments.publish(&id("k"), [1; 32]);
        let joined = attachments.join(&id("k"), &[1; 32]).unwrap();
        publisher.head(head());
        publisher.frame(&data("ab"));
        publisher.forget();
        assert!(attachments.join(&id("k"), &[1; 32]).is_none());
        drop(publisher);
        assert!(
            read(joined).await.is_err(),
            "an execution that ended without its end broke off"
        );
        assert_eq!(attachments.len(), 0);
    }

    #[tokio::test]
    async fn an_execution_without_a_response_sends_its_joiners_back() {
        let attachments = attachments(1024);
        let publisher = attachments.publish(&id("k"), [1; 32]);
        let mut joined = attachments.join(&id("k"), &[1; 32]).unwrap();
        drop(publisher);
        assert!(joined.head().await.is_none());
        assert!(attachments.join(&id("k"), &[1; 32]).is_none());
    }
}
