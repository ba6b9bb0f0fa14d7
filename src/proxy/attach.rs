//! Runs where a route has `on_in_flight = "attach"`: a duplicate of a key whose response this process is
//! relaying follows that response instead of waiting for it to be stored. The execution publishes it
//! (`execute/relay.rs`): the head, then each frame as it goes to the original client, then the end once
//! the record is stored (or the break, when the upstream broke off). A duplicate that joins (`wait.rs`)
//! reads the response from its first byte: byte for byte what the original client got.
//!
//! The body is kept once, in the response's log (`attach/log.rs`), which the capture writes and every
//! duplicate reads through a cursor of its own, so a duplicate costs its place in the log, not a copy;
//! while the capture keeps the body, the capture budget counts its bytes once, however many read them.
//! Once the capture gives up (the response outgrew `max_stored_response` or found no room), the beginning
//! is gone and a later duplicate waits instead, and the log keeps only what the slowest duplicate has yet
//! to read. One that falls more than `server.attach_buffer` behind, or takes nothing it has ready for
//! `server.write_timeout` (`attach/watchdog.rs`), is cut off, its body ended with an error rather than
//! passed off as whole; nothing ever waits on a duplicate, so a slow one slows neither the original,
//! nor the capture, nor the others.
//!
//! Only this process's executions can be followed: on another replica a duplicate waits for the stored
//! response. Touches no store and no socket.

mod blocks;
pub(crate) mod log;
mod watchdog;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame};
use tokio::sync::watch;

pub(crate) use self::log::End;
use self::log::{Bounds, Log, Seat};
use super::dialect::sse::Resume;
use super::tap::Tap;
use crate::body::BoxError;
use crate::metrics::Metrics;
use crate::store::RecordId;
use crate::store::wake::{RecordTag, Waiters};

/// The executions of this process that duplicates may follow, by record. One per process, shared by
/// every worker.
pub(crate) struct Attachments {
    live: Mutex<HashMap<String, Arc<Live>, foldhash::fast::RandomState>>,
    /// The most bytes a duplicate may fall behind (`server.attach_buffer`).
    buffer: usize,
    /// The longest a duplicate may take nothing it has ready (`server.write_timeout`).
    write_timeout: Duration,
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
    /// Its body, which the duplicates read.
    log: Arc<Log>,
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

impl Attachments {
    pub(crate) fn new(
        buffer: usize,
        write_timeout: Duration,
        waiters: Arc<Waiters>,
        metrics: Metrics,
    ) -> Arc<Attachments> {
        Arc::new(Attachments {
            live: Mutex::new(HashMap::default()),
            buffer,
            write_timeout,
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
        let log = Log::followed(Bounds {
            buffer: self.buffer as u64,
            write_timeout: self.write_timeout,
            cutoffs: self.metrics.attach_cutoffs.clone(),
            stalls: self.metrics.attach_write_timeouts.clone(),
        });
        let live = Arc::new(Live {
            fingerprint,
            phase: watch::channel(Phase::Starting).0,
            log,
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
        let seat = live.log.join()?;
        Some(Joined { phase, seat })
    }

    /// How many executions may be followed now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
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

    /// The log the response's body is written to, which the duplicates read.
    pub(crate) fn log(&self) -> &Arc<Log> {
        &self.live.log
    }

    /// A frame that went to the original client (or would have, had it stayed).
    pub(crate) fn frame(&self, frame: &Frame<Bytes>) {
        self.live.log.publish(frame);
    }

    /// The response ended as `end`; every duplicate's body ends so once it has the frames before.
    pub(crate) fn end(mut self, end: End) {
        self.ended = true;
        self.live.log.end(end);
    }
}

impl Tap for Publisher {
    fn head(&mut self, status: StatusCode, headers: HeaderMap) {
        Publisher::head(self, Head { status, headers });
    }

    fn frame(&mut self, frame: &Frame<Bytes>) {
        Publisher::frame(self, frame);
    }

    fn end(self: Box<Self>, whole: bool) {
        Publisher::end(*self, if whole { End::Whole } else { End::Broken });
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if !self.ended {
            self.live.log.end(End::Broken);
        }
        self.live.log.unpublished();
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
    seat: Seat,
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
    /// holds `guard` (whatever bounds the duplicates) until it ends or is cut off.
    pub(crate) fn body<G: Send + Sync + 'static>(self, guard: G, resume: Option<Resume>) -> Followed {
        self.seat.hold(Box::new(guard));
        Followed {
            seat: self.seat,
            resume,
        }
    }
}

/// A duplicate's response body: the frames of the response it follows, then its end.
pub(crate) struct Followed {
    seat: Seat,
    /// An event stream resumed after an event (`Last-Event-ID`): what comes before is skipped.
    resume: Option<Resume>,
}

impl Body for Followed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            let frame = match ready!(this.seat.poll_read(cx)) {
                None => return Poll::Ready(None),
                Some(Err(cutoff)) => return Poll::Ready(Some(Err(cutoff.into()))),
                Some(Ok(frame)) => frame,
            };
            let Some(resume) = &mut this.resume else {
                return Poll::Ready(Some(Ok(frame)));
            };
            match frame.into_data() {
                Ok(data) => {
                    if let Some(passed) = resume.feed(&data) {
                        return Poll::Ready(Some(Ok(Frame::data(passed))));
                    }
                }
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.seat.is_end_stream()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    fn attachments(buffer: usize) -> Arc<Attachments> {
        Attachments::new(buffer, Duration::from_secs(30), Waiters::new(), Metrics::new())
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

    /// Relays `text` as the relay does: written to the log, then published as it goes to the client.
    fn relay(publisher: &Publisher, text: &'static str) {
        let data = Bytes::from_static(text.as_bytes());
        publisher.log().write(&data);
        publisher.frame(&Frame::data(data));
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
        relay(&publisher, "ab");
        let mut late = attachments.join(&id("k"), &[1; 32]).expect("joined mid-stream");
        assert_eq!(late.head().await.expect("a head").status, StatusCode::OK);
        relay(&publisher, "cd");
        let mut trailers = HeaderMap::new();
        trailers.insert("x-done", http::HeaderValue::from_static("1"));
        publisher.frame(&Frame::trailers(trailers.clone()));
        publisher.end(End::Whole);
        let collected = early.body((), None).collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers), "trailers after the data");
        assert_eq!(collected.to_bytes(), "abcd");
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
            relay(&publisher, chunk);
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
        relay(&publisher, "ab");
        publisher.log().forget();
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

    #[tokio::test]
    async fn a_follower_resumed_after_an_event_gets_what_follows_it_on_any_frame_boundaries() {
        let attachments = attachments(1024);
        let publisher = attachments.publish(&id("k"), [1; 32]);
        let joined = attachments.join(&id("k"), &[1; 32]).unwrap();
        publisher.head(head());
        let resume = Resume::after(&http::HeaderValue::from_static("1"));
        let mut body = joined.body((), Some(resume));
        // The event that sets id 1 ends with a CR whose LF comes in the next frame.
        for frame in [
            "id: 0\ndata: a\n\nid",
            ": 1\r\ndata: b\r\n\r",
            "\nid: 2\r\ndata: c\r\n\r\n",
        ] {
            relay(&publisher, frame);
        }
        publisher.end(End::Whole);
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            got.extend_from_slice(&frame.unwrap().into_data().unwrap());
        }
        assert_eq!(got, b"id: 2\r\ndata: c\r\n\r\n");
    }
}
