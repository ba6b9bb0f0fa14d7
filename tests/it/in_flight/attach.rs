//! `on_in_flight = "attach"` and resumable event streams, from the clients' side: duplicates of a key
//! whose response is being streamed follow it live and get byte for byte what the original client got
//! (status, headers, body, trailers), with one execution; a duplicate that stops reading is cut off
//! without slowing the others; a retry carrying `Last-Event-ID` gets only the events after that id,
//! while the stream runs and after it is stored. Followers share one copy of the response, so thirty of
//! a response of tiny frames cost the proxy a fraction of thirty copies; HTTP/2 followers that never
//! open their window are let go after `server.write_timeout`. The clients are hyper's HTTP/1.1 client
//! and a raw HTTP/2 client over real sockets; the upstream is a hyper server sending server-sent events
//! one at a time, as the test lets it.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

use crate::support::history::memory_kib;
use crate::support::http::TEST_CREDENTIAL;
use crate::support::{
    Backend, InProcessProxy, ProxyConfig, ProxyProcess, TestStore, metric, metric_reaches, poll_until, raw_h2,
};

/// Bound on anything a test awaits.
const BOUND: Duration = Duration::from_secs(60);

/// A stream upstream: every request gets `text/event-stream` events `0..events`, each `size` bytes of
/// data; event 0 goes with the head once `opened` reaches 1 (the head's gate), event `i` once it
/// reaches `i + 1`. A trailer `x-events: <events>` (declared) ends the body. Counts its executions.
struct Events {
    url: String,
    gate: watch::Sender<usize>,
    executions: Arc<AtomicUsize>,
}

/// Event `i` as the upstream sends it.
fn event(i: usize, size: usize) -> Bytes {
    let data: String = std::iter::repeat_n(char::from(b'a' + (i % 26) as u8), size).collect();
    Bytes::from(format!("id: {i}\nevent: token\ndata: {data}\n\n"))
}

impl Events {
    async fn start(events: usize, size: usize) -> Events {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (gate, opened) = watch::channel(0usize);
        let executions = Arc::new(AtomicUsize::new(0));
        let counted = executions.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (opened, counted) = (opened.clone(), counted.clone());
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let (mut opened, counted) = (opened.clone(), counted.clone());
                    async move {
                        request.into_body().collect().await.unwrap();
                        counted.fetch_add(1, Ordering::SeqCst);
                        opened.wait_for(|n| *n >= 1).await.unwrap();
                        let frames = futures_util::stream::iter(0..=events).then(move |i| {
                            let mut opened = opened.clone();
                            async move {
                                opened.wait_for(|n| *n > i).await.unwrap();
                                if i == events {
                                    let mut trailers = HeaderMap::new();
                                    trailers.insert("x-events", HeaderValue::from(events));
                                    return Ok::<_, Infallible>(Frame::trailers(trailers));
                                }
                                Ok(Frame::data(event(i, size)))
                            }
                        });
                        let mut response = Response::new(StreamBody::new(frames));
                        let headers = response.headers_mut();
                        headers.insert("content-type", HeaderValue::from_static("text/event-stream"));
                        headers.insert("trailer", HeaderValue::from_static("x-events"));
                        headers.insert("set-cookie", HeaderValue::from_static("session=first-only"));
                        Ok::<_, Infallible>(response)
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        Events {
            url,
            gate,
            executions,
        }
    }

    /// Returns once `n` requests have reached the upstream: the first of them holds its key.
    async fn arrived(&self, n: usize) {
        poll_until("the original reached the upstream", || async {
            (self.executions.load(Ordering::SeqCst) >= n).then_some(())
        })
        .await;
    }

    /// Lets the head and the events before `n - 1` go (`open(1)`: the head and event 0); `open(0)` holds
    /// the streams requested from then on again.
    fn open(&self, n: usize) {
        self.gate.send_replace(n);
    }
}

/// A proxy config on a new PostgreSQL store whose routes attach, with `toml` over it.
async fn config(upstream: &str, toml: &str) -> (TestStore, ProxyConfig) {
    let store = TestStore::create(Backend::Postgres).await;
    let config = ProxyConfig::on(&store, upstream)
        .set("idempotency.on_in_flight", "attach")
        .set("idempotency.wait_timeout", "50s")
        .set("idempotency.lock_timeout", "120s")
        .set("idempotency.max_stored_response", "32MiB")
        .set("server.max_buffered_responses", "256MiB")
        .with_toml(toml);
    (store, config)
}

async fn proxy(upstream: &str, toml: &str) -> (TestStore, InProcessProxy) {
    let (store, config) = config(upstream, toml).await;
    let proxy = InProcessProxy::start(&config).await;
    (store, proxy)
}

/// A response as a client read it.
#[derive(Debug, PartialEq)]
struct Read {
    status: u16,
    content_type: Option<HeaderValue>,
    cookie: Option<HeaderValue>,
    replayed: bool,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

/// A keyed `POST /chat` to the proxy at `url` over its own HTTP/1.1 connection (`receive_buffer`: the
/// socket's receive buffer, if set), with `Last-Event-ID` if given: its head, and its body unread.
async fn post(
    url: String,
    key: &str,
    last_event_id: Option<&str>,
    receive_buffer: Option<u32>,
) -> Response<Incoming> {
    let authority = url.trim_start_matches("http://");
    let socket = TcpSocket::new_v4().unwrap();
    if let Some(size) = receive_buffer {
        socket.set_recv_buffer_size(size).unwrap();
    }
    let stream: TcpStream = socket.connect(authority.parse().unwrap()).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut request = Request::post("/chat")
        .header("host", authority)
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .header("te", "trailers")
        .body(http_body_util::Full::new(Bytes::from_static(
            b"{\"prompt\":\"hi\"}",
        )))
        .unwrap();
    if let Some(id) = last_event_id {
        request
            .headers_mut()
            .insert("last-event-id", HeaderValue::from_str(id).unwrap());
    }
    tokio::time::timeout(BOUND, sender.send_request(request))
        .await
        .expect("a response head in time")
        .unwrap()
}

/// Reads `response` to its end: what the client got, or the error its body ended with.
async fn read(response: Response<Incoming>) -> Result<Read, hyper::Error> {
    read_counting(response, Arc::default()).await
}

/// [`read`], counting in `progress` the body bytes read so far.
async fn read_counting(
    response: Response<Incoming>,
    progress: Arc<AtomicUsize>,
) -> Result<Read, hyper::Error> {
    let (head, mut body) = response.into_parts();
    let mut data = Vec::new();
    let mut trailers = None;
    let reading = async {
        while let Some(frame) = body.frame().await {
            let frame = frame?;
            if let Some(chunk) = frame.data_ref() {
                data.extend_from_slice(chunk);
                progress.store(data.len(), Ordering::SeqCst);
            }
            if let Ok(sent) = frame.into_trailers() {
                trailers = Some(sent);
            }
        }
        Ok::<_, hyper::Error>(())
    };
    tokio::time::timeout(BOUND, reading)
        .await
        .expect("the body ends in time")?;
    Ok(Read {
        status: head.status.as_u16(),
        content_type: head.headers.get("content-type").cloned(),
        cookie: head.headers.get("set-cookie").cloned(),
        replayed: head
            .headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true"),
        trailers,
        body: Bytes::from(data),
    })
}

async fn attached(proxy: &InProcessProxy) -> f64 {
    metric(&proxy.admin_url, "idemproxy_attached_requests", &[]).await
}

#[tokio::test]
async fn ten_duplicates_follow_one_slow_stream_byte_for_byte_and_one_that_stops_reading_is_cut_off() {
    // 12 MiB of events: more than the stalled client's socket buffers and its 256 KiB attach buffer
    // can hold, so it falls behind; each of the others reads everything.
    const EVENTS: usize = 192;
    const SIZE: usize = 64 * 1024;
    /// Events let go at once: 256 KiB, well under the attach buffer, so that readers which keep up
    /// are never cut off.
    const STEP: usize = 4;
    let upstream = Events::start(EVENTS, SIZE).await;
    let (_store, proxy) = proxy(&upstream.url, "[server]\nattach_buffer = \"1MiB\"\n").await;
    let lengths: Vec<usize> = (0..EVENTS).map(|i| event(i, SIZE).len()).collect();
    let sent = |n: usize| lengths[..n.min(EVENTS)].iter().sum::<usize>();

    let original = tokio::spawn(post(proxy.url.clone(), "chat-1", None, None));
    upstream.arrived(1).await;
    // Five duplicates come before the head, and wait for it.
    let early: Vec<_> = (0..5)
        .map(|_| tokio::spawn(post(proxy.url.clone(), "chat-1", None, None)))
        .collect();
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 5.0).await;
    upstream.open(3);
    let mut progress = vec![Arc::new(AtomicUsize::new(0))];
    let original = tokio::spawn(read_counting(original.await.unwrap(), progress[0].clone()));
    // Five more come mid-stream: they get the first three events from the capture, then the rest live.
    let late: Vec<_> = (0..5)
        .map(|_| tokio::spawn(post(proxy.url.clone(), "chat-1", None, None)))
        .collect();
    let stalled = post(proxy.url.clone(), "chat-1", None, Some(4096)).await;
    let mut followers = Vec::new();
    for response in early.into_iter().chain(late) {
        let counter = Arc::new(AtomicUsize::new(0));
        progress.push(counter.clone());
        followers.push(tokio::spawn(read_counting(response.await.unwrap(), counter)));
    }
    assert_eq!(
        attached(&proxy).await,
        11.0,
        "ten readers and the stalled one follow"
    );
    // The upstream goes on a step at a time, once every reader has had the events before: a slow
    // stream, as a model's tokens come.
    for open in (3 + STEP..=EVENTS + STEP).step_by(STEP) {
        let want = sent(open - STEP);
        poll_until("every reader has the events so far", || async {
            progress
                .iter()
                .all(|read| read.load(Ordering::SeqCst) >= want)
                .then_some(())
        })
        .await;
        upstream.open(open.min(EVENTS + 1));
    }

    let original = original.await.unwrap().expect("the original's whole response");
    assert_eq!(original.status, 200);
    assert_eq!(original.body.len(), sent(EVENTS));
    assert_eq!(original.trailers.as_ref().expect("trailers")["x-events"], "192");
    assert!(!original.replayed);
    for follower in followers {
        let follower = follower.await.unwrap().expect("a follower's whole response");
        assert_eq!(follower.status, original.status);
        assert_eq!(follower.content_type, original.content_type);
        assert!(
            follower.body == original.body,
            "a follower's body differs from the original's"
        );
        assert_eq!(follower.trailers, original.trailers);
        assert!(follower.replayed, "a follower's response is marked replayed");
        assert_eq!(
            follower.cookie, None,
            "never_store headers go to the first client only"
        );
    }
    assert_eq!(upstream.executions.load(Ordering::SeqCst), 1);
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_attach_cutoffs_total", &[]).await,
        1.0
    );
    assert_eq!(
        metric(
            &proxy.admin_url,
            "idemproxy_waits_total",
            &[("result", "attached")]
        )
        .await,
        11.0
    );
    // The stalled client, reading at last, finds its response broken off, not passed off as whole.
    let cut = read(stalled).await;
    assert!(
        cut.is_err(),
        "the stalled follower's body ended cleanly: {:?}",
        cut.map(|r| r.body.len())
    );
    // Each follower's place among those that wait is given back once its response has ended.
    poll_until("no request follows any more", || async {
        (attached(&proxy).await == 0.0).then_some(())
    })
    .await;

    // A retry now is the stored response's replay, the same bytes again.
    let replay = read(post(proxy.url.clone(), "chat-1", None, None).await)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert!(replay.body == original.body);
    assert_eq!(replay.trailers, original.trailers);
}

#[tokio::test]
async fn an_event_stream_resumes_after_last_event_id_while_it_runs_and_once_it_is_stored() {
    const EVENTS: usize = 6;
    const SIZE: usize = 8;
    let upstream = Events::start(EVENTS, SIZE).await;
    let (_store, proxy) = proxy(&upstream.url, "").await;
    let after = |id: usize| {
        (id + 1..EVENTS)
            .flat_map(|i| event(i, SIZE).to_vec())
            .collect::<Vec<u8>>()
    };

    let original = tokio::spawn(post(proxy.url.clone(), "chat-2", None, None));
    upstream.open(3);
    let original = tokio::spawn(read(original.await.unwrap()));
    // Events 0..=2 have gone to the original: a reconnect that saw event 1 gets 2 onwards.
    let resumed = post(proxy.url.clone(), "chat-2", Some("1"), None).await;
    assert!(resumed.headers().get("content-length").is_none());
    let resumed = tokio::spawn(read(resumed));
    upstream.open(EVENTS + 1);
    let original = original.await.unwrap().unwrap();
    let resumed = resumed.await.unwrap().unwrap();
    assert_eq!(resumed.body, after(1), "live, from after event 1");
    assert!(resumed.replayed);
    assert_eq!(resumed.trailers, original.trailers);

    // Once stored: after event 3, after the last one (nothing), an id the stream never sent (nothing),
    // and without the header (everything).
    let stored = read(post(proxy.url.clone(), "chat-2", Some("3"), None).await)
        .await
        .unwrap();
    assert!(stored.replayed);
    assert_eq!(stored.body, after(3));
    let last = read(post(proxy.url.clone(), "chat-2", Some("5"), None).await)
        .await
        .unwrap();
    assert_eq!(last.body, Bytes::new());
    let unknown = read(post(proxy.url.clone(), "chat-2", Some("nope"), None).await)
        .await
        .unwrap();
    assert_eq!(unknown.body, Bytes::new());
    let whole = read(post(proxy.url.clone(), "chat-2", None, None).await)
        .await
        .unwrap();
    assert_eq!(whole.body, original.body);
    assert_eq!(upstream.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn on_another_replica_a_duplicate_waits_for_the_stored_response() {
    const EVENTS: usize = 4;
    let upstream = Events::start(EVENTS, 8).await;
    let (store, here) = proxy(&upstream.url, "").await;
    let config = ProxyConfig::on(&store, &upstream.url)
        .set("idempotency.on_in_flight", "attach")
        .set("idempotency.wait_timeout", "50s")
        .set("idempotency.lock_timeout", "120s");
    let there = InProcessProxy::start(&config).await;

    let original = tokio::spawn(post(here.url.clone(), "chat-3", None, None));
    upstream.open(2);
    let original = tokio::spawn(read(original.await.unwrap()));
    let duplicate = tokio::spawn(post(there.url.clone(), "chat-3", None, None));
    metric_reaches(&there.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    assert!(!duplicate.is_finished(), "no head before the original is stored");
    upstream.open(EVENTS + 1);
    let original = original.await.unwrap().unwrap();
    let duplicate = read(duplicate.await.unwrap()).await.unwrap();
    assert!(duplicate.replayed);
    assert_eq!(duplicate.body, original.body);
    assert_eq!(
        metric(
            &there.admin_url,
            "idemproxy_waits_total",
            &[("result", "replayed")]
        )
        .await,
        1.0
    );
    assert_eq!(upstream.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_stream_too_long_to_keep_is_followed_by_those_already_there_and_is_gone_for_later_ones() {
    const EVENTS: usize = 6;
    const SIZE: usize = 32 * 1024;
    let upstream = Events::start(EVENTS, SIZE).await;
    let (_store, proxy) = proxy(&upstream.url, "[idempotency]\nmax_stored_response = \"64KiB\"\n").await;

    let original = tokio::spawn(post(proxy.url.clone(), "chat-5", None, None));
    upstream.arrived(1).await;
    let early = tokio::spawn(post(proxy.url.clone(), "chat-5", None, None));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    upstream.open(4);
    let progress = Arc::new(AtomicUsize::new(0));
    let original = tokio::spawn(read_counting(original.await.unwrap(), progress.clone()));
    let early = tokio::spawn(read(early.await.unwrap()));
    // Three events (96 KiB) are past the 64 KiB the proxy keeps, and once the original has the fourth,
    // the third has been offered to the capture: a later duplicate cannot have the beginning, so it
    // waits for the record, and that record has no body.
    let four: usize = (0..4).map(|i| event(i, SIZE).len()).sum();
    poll_until("the original has four events", || async {
        (progress.load(Ordering::SeqCst) >= four).then_some(())
    })
    .await;
    let late = tokio::spawn(post(proxy.url.clone(), "chat-5", None, None));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    upstream.open(EVENTS + 1);
    let original = original.await.unwrap().unwrap();
    let early = early.await.unwrap().expect("the early follower's whole response");
    assert!(early.body == original.body, "the early follower got it all");
    let late = late.await.unwrap();
    assert_eq!(late.status(), 410, "response-not-retained");
    assert_eq!(upstream.executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn thirty_followers_of_a_response_of_tiny_frames_share_one_copy_of_it() {
    // About 4 MiB in 51-byte frames; three quarters of it has gone when the followers join.
    const EVENTS: usize = 82_000;
    const BEFORE: usize = 61_500;
    const SIZE: usize = 20;
    const FOLLOWERS: usize = 30;
    /// What a follower may cost the proxy at most while it follows, its connection included.
    const PER_FOLLOWER: usize = 256 * 1024;
    let upstream = Events::start(EVENTS, SIZE).await;
    let (_store, config) = config(&upstream.url, "[server]\nattach_buffer = \"8MiB\"\n").await;
    let proxy = ProxyProcess::spawn(&config).await;
    let body: usize = (0..EVENTS).map(|i| event(i, SIZE).len()).sum();
    let before: usize = (0..BEFORE).map(|i| event(i, SIZE).len()).sum();

    // The response alone first, without followers: what relaying, capturing and storing it costs.
    let (stop, sampled) = sample_rss(proxy.pid());
    let alone = tokio::spawn(post(proxy.url.clone(), "alone", None, None));
    upstream.arrived(1).await;
    upstream.open(EVENTS + 1);
    let alone = read(alone.await.unwrap()).await.expect("the whole response");
    assert_eq!(alone.body.len(), body);
    let _ = stop.send(());
    let (baseline, alone_peak) = sampled.await.unwrap();

    // Then the same response with thirty followers.
    upstream.open(0);
    let (stop, sampled) = sample_rss(proxy.pid());
    let rss = || memory_kib(proxy.pid()).map_or(0, |(_, rss)| rss) as usize * 1024;
    let start = rss();
    let original = tokio::spawn(post(proxy.url.clone(), "tiny", None, None));
    upstream.arrived(2).await;
    upstream.open(BEFORE + 1);
    let mut progress = vec![Arc::new(AtomicUsize::new(0))];
    let original = tokio::spawn(read_counting(original.await.unwrap(), progress[0].clone()));
    let has = |progress: &[Arc<AtomicUsize>], bytes: usize| {
        progress.iter().all(|read| read.load(Ordering::SeqCst) >= bytes)
    };
    poll_until("the original has the first three quarters", || async {
        has(&progress, before).then_some(())
    })
    .await;
    let responses: Vec<_> = (0..FOLLOWERS)
        .map(|_| tokio::spawn(post(proxy.url.clone(), "tiny", None, None)))
        .collect();
    let mut followers = Vec::new();
    for response in responses {
        let counter = Arc::new(AtomicUsize::new(0));
        progress.push(counter.clone());
        followers.push(tokio::spawn(read_counting(response.await.unwrap(), counter)));
    }
    poll_until("every follower has read the beginning", || async {
        has(&progress, before).then_some(())
    })
    .await;
    // Each follower copying the beginning cost several MiB.
    let following = rss().saturating_sub(start);
    let bound = 2 * body + FOLLOWERS * PER_FOLLOWER;
    assert!(
        following < bound,
        "the proxy grew by {} KiB with {FOLLOWERS} followers of the first {} KiB of a {} KiB response, \
         more than {} KiB",
        following / 1024,
        before / 1024,
        body / 1024,
        bound / 1024
    );
    upstream.open(EVENTS + 1);

    let original = original.await.unwrap().expect("the original's whole response");
    assert!(original.body == alone.body);
    for follower in followers {
        let follower = follower.await.unwrap().expect("a follower's whole response");
        assert!(
            follower.body == original.body,
            "a follower's body differs from the original's"
        );
        assert_eq!(follower.trailers, original.trailers);
    }
    let _ = stop.send(());
    let (_, peak) = sampled.await.unwrap();
    let (alone, followed) = (alone_peak - baseline, peak.saturating_sub(baseline));
    eprintln!(
        "resident set grew by {alone} KiB alone; with {FOLLOWERS} followers, {} KiB while they followed, \
         {followed} KiB in all",
        following / 1024
    );
    // Over the whole run, storing included (where allocations freed on one thread are not all reused
    // on another), a follower costs less than a quarter of a copy of the response.
    let bound = alone + (FOLLOWERS * body / 4 / 1024) as u64;
    assert!(
        followed < bound,
        "the proxy grew by {followed} KiB with {FOLLOWERS} followers of a {} KiB response, and by \
         {alone} KiB without: more than {bound} KiB",
        body / 1024
    );
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_attach_cutoffs_total", &[]).await,
        0.0
    );
}

/// Samples the process's resident set every 20 ms until `stop`: the first sample, and the largest.
fn sample_rss(
    pid: u32,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<(u64, u64)>,
) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let rss = move || memory_kib(pid).map_or(0, |(_, rss)| rss);
    let baseline = rss();
    let sampler = tokio::spawn(async move {
        let mut peak = baseline;
        let mut every = tokio::time::interval(Duration::from_millis(20));
        loop {
            tokio::select! {
                _ = &mut stopped => return (baseline, peak.max(rss())),
                _ = every.tick() => peak = peak.max(rss()),
            }
        }
    });
    (stop, sampler)
}

#[tokio::test]
async fn http2_followers_that_never_open_their_window_are_let_go_after_the_write_timeout() {
    const EVENTS: usize = 4;
    const FOLLOWERS: usize = 3;
    let upstream = Events::start(EVENTS, 64).await;
    let (_store, proxy) = proxy(&upstream.url, "[server]\nwrite_timeout = \"1s\"\n").await;

    let original = tokio::spawn(post(proxy.url.clone(), "no-window", None, None));
    upstream.arrived(1).await;
    upstream.open(2);
    let original = tokio::spawn(read(original.await.unwrap()));
    // Each on a connection that grants its streams no window: they get the head, and no body byte.
    let mut held = Vec::new();
    for _ in 0..FOLLOWERS {
        let mut client = raw_h2::connect_without_window(&proxy.url).await;
        let (response, mut request) =
            raw_h2::open_post(&mut client, &proxy.url, "/chat", Some("no-window"), &[]).await;
        request
            .send_data(Bytes::from_static(b"{\"prompt\":\"hi\"}"), true)
            .expect("send the body");
        let response = tokio::time::timeout(BOUND, response)
            .await
            .expect("a head in time")
            .expect("a head");
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["idempotent-replayed"], "true");
        held.push((client, response));
    }
    assert_eq!(attached(&proxy).await, FOLLOWERS as f64);
    upstream.open(EVENTS + 1);
    let original = original.await.unwrap().expect("the original's whole response");
    assert_eq!(original.trailers.as_ref().expect("trailers")["x-events"], "4");

    // A second on, each has had its body ready and taken none of it for server.write_timeout: cut off,
    // its place among those that wait given back, though nothing ever polls its body again.
    poll_until("no request follows any more", || async {
        (attached(&proxy).await == 0.0).then_some(())
    })
    .await;
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_attach_write_timeouts_total", &[]).await,
        FOLLOWERS as f64
    );
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_attach_cutoffs_total", &[]).await,
        0.0
    );
    // A retry now is the stored response's replay.
    let replay = read(post(proxy.url.clone(), "no-window", None, None).await)
        .await
        .unwrap();
    assert!(replay.replayed);
    assert!(replay.body == original.body);
    drop(held);
}
