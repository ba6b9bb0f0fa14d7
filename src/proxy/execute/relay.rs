//! Runs once a won claim's upstream answered with a response to keep: hands each frame to an ordered set
//! of taps — the capture first (`execute/capture.rs`, which writes its bytes to the response's log), then
//! whoever follows the response (a [`Tap`]), then the client (over `execute/channel.rs`) — then charges it
//! to the capture, and withholds whatever completes the response, handing it to `execute.rs` with the
//! record to store. Owns the
//! upstream body until its end; a client that leaves or stops reading is let go while the relay reads on.
//! A capture waiting for room in the capture budget holds up the next upstream read, never a frame
//! already read, and for at most `server.capture_wait` over the whole response. Touches no store.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, header};
use http_body::{Body as _, Frame};
use http_body_util::BodyExt;

use super::capture::Capture;
use super::channel::{self, Sender};
use crate::body::{self, BoxError, ProxyBody};
use crate::config::StoreRules;
use crate::error::ProxyError;
use crate::headers::REPLAYED_HEADER;
use crate::metrics::{Metrics, Outcome};
use crate::proxy::answer::Answer;
use crate::proxy::tap::Tap;
use crate::proxy::upstream::pool::PooledBody;
use crate::proxy::upstream::{is_hop_by_hop, strip_hop_by_hop};
use crate::store::{RecordId, TRAILER_PREFIX};

/// Frames buffered between the relay and a slow client before the relay waits.
const DOWNSTREAM_FRAMES: usize = 8;

/// The client's side of the relay: its response head until it is sent, then the channel to its response
/// body while the client is there.
pub(super) struct Client {
    head: Option<(Answer, Response<ProxyBody>)>,
    sender: Option<Sender>,
    write_timeout: Duration,
    /// Who follows the response (the duplicates, `on_in_flight = "attach"`), getting every frame the
    /// client gets, whether or not the client is still there.
    followers: Option<Box<dyn Tap>>,
}

impl Client {
    /// Sends the response head if it has not gone yet. It waits for the first body frame that is ready
    /// with it, so that a response whose body comes in one frame leaves in one write once it is stored.
    fn send_head(&mut self, id: &RecordId) {
        let Some((answer, response)) = self.head.take() else {
            return;
        };
        if !answer.send(Ok((response, Outcome::Executed))) {
            tracing::debug!(key_hash = %id.key_hash(), "client left before the response head; reading upstream to the end");
            self.sender = None;
        }
    }

    /// Queues `frame` for the client. A client that has gone is dropped; one that accepts nothing for
    /// `server.write_timeout` is let go with an error (its response must never look complete) and
    /// counted; either way the relay reads on.
    async fn deliver(&mut self, frame: Frame<Bytes>, metrics: &Metrics, id: &RecordId) {
        self.send_head(id);
        if let Some(followers) = &mut self.followers {
            followers.frame(&frame);
        }
        let Some(sender) = self.sender.as_mut() else {
            return;
        };
        match tokio::time::timeout(self.write_timeout, sender.send(frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                tracing::debug!(key_hash = %id.key_hash(), "client left mid-body; reading upstream to the end");
                self.sender = None;
            }
            Err(_) => {
                metrics.write_timeouts.inc();
                tracing::warn!(key_hash = %id.key_hash(), timeout = ?self.write_timeout,
                    "client accepted no response bytes; letting it go and reading upstream to the end");
                self.abort("the client stopped reading the response".into());
            }
        }
    }

    fn abort(&mut self, error: BoxError) {
        if let Some(sender) = self.sender.take() {
            sender.abort(error);
        }
    }

    /// The upstream failed mid-body: a client that has not had the head yet gets `failure` instead; one
    /// that has gets its stream ended with the error, never passed off as complete.
    pub(super) fn fail(&mut self, error: BoxError, failure: ProxyError) {
        if let Some(followers) = self.followers.take() {
            followers.end(false);
        }
        match self.head.take() {
            Some((answer, _)) => {
                answer.send(Err(failure));
                self.sender = None;
            }
            None => self.abort(error),
        }
    }
}

/// What the relay withholds from the client until the record is written.
pub(super) enum Withheld {
    /// An empty body: the head is the whole response (and the duplicates following it).
    Head(Answer, Response<ProxyBody>, Option<Box<dyn Tap>>),
    /// The last frame, if one is held, then the end of the body.
    End(Client, Option<Frame<Bytes>>),
}

impl Withheld {
    /// Lets the client have the rest of its response; the body ends once the client is dropped.
    pub(super) async fn hand_over(self, metrics: &Metrics, id: &RecordId) {
        match self {
            Withheld::Head(head, response, followers) => {
                head.send(Ok((response, Outcome::Executed)));
                if let Some(followers) = followers {
                    followers.end(true);
                }
            }
            Withheld::End(mut client, last) => {
                client.send_head(id);
                if let Some(frame) = last {
                    client.deliver(frame, metrics, id).await;
                }
                if let Some(followers) = client.followers.take() {
                    followers.end(true);
                }
            }
        }
    }
}

/// What the relay stores once the upstream body has ended.
pub(super) struct ToStore {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, Vec<u8>)>,
    pub(super) capture: Capture,
}

/// How a relay ended.
pub(super) enum Relayed {
    /// The upstream body ended: the record to store, and what the client gets once it is stored.
    Whole(ToStore, Withheld),
    /// The upstream body broke off or stalled: nothing is stored, and the client must not take what it
    /// got for a whole response (`Client::fail`).
    Broken {
        client: Client,
        error: BoxError,
        failure: ProxyError,
    },
}

/// What every relay of a worker is bounded by.
#[derive(Clone)]
pub(super) struct Relay {
    /// Longest a client may accept no bytes of a keyed response.
    write_timeout: Duration,
    /// Longest the upstream may send nothing (`upstream.timeout`).
    idle: Duration,
    metrics: Metrics,
}

/// Where a relayed response goes: its client's answer, the capture for its record, and who follows it.
pub(super) struct Taps {
    pub(super) answer: Answer,
    pub(super) capture: Capture,
    pub(super) followers: Option<Box<dyn Tap>>,
}

impl Relay {
    pub(super) fn new(write_timeout: Duration, idle: Duration, metrics: Metrics) -> Relay {
        Relay {
            write_timeout,
            idle,
            metrics,
        }
    }

    /// Relays the response to its taps, the client last, until the upstream body ends or breaks.
    pub(super) async fn run(
        &self,
        id: &RecordId,
        rules: &StoreRules,
        response: Response<PooledBody>,
        taps: Taps,
        stamp: impl Fn(&mut HeaderMap),
    ) -> Relayed {
        let Taps {
            answer,
            capture,
            mut followers,
        } = taps;
        let (mut parts, upstream) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let record = ToStore {
            status: parts.status.as_u16(),
            headers: storable_headers(&parts.headers, &rules.never_store_headers),
            capture,
        };
        if let Some(followers) = &mut followers {
            followers.head(
                parts.status,
                followed_head(&parts, &rules.never_store_headers, &stamp),
            );
        }
        // What the proxy adds for this client only, after the stored headers are taken.
        stamp(&mut parts.headers);
        if http_body::Body::is_end_stream(&upstream) {
            drop(upstream);
            let withheld = Withheld::Head(answer, Response::from_parts(parts, body::empty()), followers);
            return Relayed::Whole(record, withheld);
        }
        let declared = content_length(&parts.headers);
        let (sender, receiver) = channel::channel(DOWNSTREAM_FRAMES);
        let client = Client {
            head: Some((answer, Response::from_parts(parts, receiver.boxed()))),
            sender: Some(sender),
            write_timeout: self.write_timeout,
            followers,
        };
        self.body(id, rules, (upstream, declared), record, client).await
    }

    /// Relays the body: each frame to the capture, then the followers and the client, the frame that
    /// completes the response withheld.
    async fn body(
        &self,
        id: &RecordId,
        rules: &StoreRules,
        (mut upstream, declared): (PooledBody, Option<u64>),
        mut record: ToStore,
        mut client: Client,
    ) -> Relayed {
        let mut last = None;
        let mut received = 0u64;
        loop {
            let frame = match self.next_frame(&mut upstream, &mut client, id).await {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err((error, failure)) => {
                    return Relayed::Broken {
                        client,
                        error,
                        failure,
                    };
                }
            };
            let data = frame.data_ref();
            received += data.map_or(0, |data| data.len() as u64);
            // Kept once, before anyone gets the frame: the followers read it from the log.
            if let Some(data) = data {
                record.capture.write(data);
            }
            if let Some(trailers) = frame.trailers_ref() {
                let stored = storable_trailers(trailers, &rules.never_store_headers);
                record.headers.extend(stored);
            }
            // A frame held as the last one was not, since another follows.
            if let Some(earlier) = last.take() {
                client.deliver(earlier, &self.metrics, id).await;
            }
            if completes(&frame, &upstream, declared, received) {
                last = Some(frame);
            } else {
                client.deliver(frame, &self.metrics, id).await;
            }
            // Charged once the client has the frame (or it is withheld as the last one): a capture that
            // waits for room in the budget delays the next read, not this frame.
            record.capture.charge().await;
        }
        Relayed::Whole(record, Withheld::End(client, last))
    }

    /// The upstream body's next frame (`None` at its end), or why it broke off: an error, or nothing
    /// for `upstream.timeout`. Before waiting on the upstream, the client gets its head.
    async fn next_frame(
        &self,
        upstream: &mut PooledBody,
        client: &mut Client,
        id: &RecordId,
    ) -> Result<Option<Frame<Bytes>>, (BoxError, ProxyError)> {
        let polled = match frame_now(upstream) {
            Poll::Ready(polled) => polled,
            Poll::Pending => {
                // Nothing more comes with the head now: let it go before waiting on the upstream.
                client.send_head(id);
                match tokio::time::timeout(self.idle, upstream.frame()).await {
                    Ok(polled) => polled,
                    Err(_) => {
                        let failure = ProxyError::UpstreamTimeout(self.idle);
                        return Err(("upstream body stalled".into(), failure));
                    }
                }
            }
        };
        match polled {
            None => Ok(None),
            Some(Ok(frame)) => Ok(Some(frame)),
            Some(Err(error)) => {
                let failure = ProxyError::UpstreamBroken(error.to_string());
                Err((error.into(), failure))
            }
        }
    }
}

/// The upstream body's next frame if it is there without waiting (it usually came in with the head).
fn frame_now(upstream: &mut PooledBody) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
    Pin::new(upstream).poll_frame(&mut Context::from_waker(Waker::noop()))
}

/// Whether `frame` completes the response for the client: trailers, the body's end as the upstream
/// reports it, or the declared length reached (HTTP/1.1 ends such a message with its last byte).
fn completes(frame: &Frame<Bytes>, upstream: &PooledBody, declared: Option<u64>, received: u64) -> bool {
    frame.is_trailers()
        || http_body::Body::is_end_stream(upstream)
        || declared.is_some_and(|length| received >= length)
}

/// The headers a duplicate that follows the response gets: those a replay of it would carry (the
/// length included, since the body is the same), marked replayed.
fn followed_head(
    parts: &http::response::Parts,
    never_store: &[HeaderName],
    stamp: &impl Fn(&mut HeaderMap),
) -> HeaderMap {
    let mut headers = parts.headers.clone();
    for name in never_store {
        headers.remove(name);
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    stamp(&mut headers);
    headers
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// End-to-end headers worth replaying. `content-length` is left out: a replay's length comes from the
/// stored body itself; so are `never_store` (`idempotency.never_store_headers`, such as `set-cookie`),
/// which only the first client gets.
fn storable_headers(headers: &HeaderMap, never_store: &[HeaderName]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH && !never_store.contains(name))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// The response's trailers as stored: after its headers, each name marked as a trailer's
/// ([`TRAILER_PREFIX`]); hop-by-hop and `never_store` names are left out, as they are from headers.
fn storable_trailers(trailers: &HeaderMap, never_store: &[HeaderName]) -> Vec<(String, Vec<u8>)> {
    trailers
        .iter()
        .filter(|(name, _)| !is_hop_by_hop(name) && !never_store.contains(name))
        .map(|(name, value)| {
            (
                format!("{TRAILER_PREFIX}{}", name.as_str()),
                value.as_bytes().to_vec(),
            )
        })
        .collect()
}
