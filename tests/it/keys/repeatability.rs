//! OASIS Repeatable Requests (`key = "repeatability"`), as a client that follows the specification sends
//! them, on every store: the key is `Repeatability-Request-ID` and `Repeatability-First-Sent` the time
//! the client first sent the request. A fresh request executes and says `Repeatability-Result:
//! accepted`; its retry is replayed and says so too; one first sent longer ago than the route's
//! `repeatability_window`, or a minute or more in the future, is refused 412 `Repeatability-Result:
//! rejected` before anything is claimed or forwarded; one without a valid first-sent time is 400. The
//! stub upstream's execution count proves what ran.

use std::time::{Duration, SystemTime};

use rstest::rstest;

use crate::support::http::{TEST_CREDENTIAL, client};
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, unless_skipped};

const ROUTES: &str = r#"
[[routes]]
name = "repeatable"
path_prefix = "/emails"
key = "repeatability"
required = true
repeatability_window = "5m"

[[routes]]
name = "repeatable-statuses"
path_prefix = "/status"
key = "repeatability"
required = true
"#;

/// `POST /emails` with `id` as its Repeatability-Request-ID and `first_sent` (if any) as its
/// Repeatability-First-Sent.
async fn send(proxy: &InProcessProxy, id: &str, first_sent: Option<&str>) -> Reply {
    send_to(proxy, "/emails", id, first_sent).await
}

/// [`send`] to `path`.
async fn send_to(proxy: &InProcessProxy, path: &str, id: &str, first_sent: Option<&str>) -> Reply {
    let mut request = client()
        .post(format!("{}{path}", proxy.url))
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .header("repeatability-request-id", id)
        .body(r#"{"to":"a@example.com"}"#);
    if let Some(first_sent) = first_sent {
        request = request.header("repeatability-first-sent", first_sent);
    }
    Reply::of(request).await
}

/// `at` as an IMF-fixdate.
fn imf(at: SystemTime) -> String {
    httpdate::fmt_http_date(at)
}

fn result(reply: &Reply) -> Option<&str> {
    reply
        .headers
        .get("repeatability-result")
        .and_then(|value| value.to_str().ok())
}

#[rstest]
#[tokio::test]
async fn a_repeatable_request_runs_once_and_its_repeat_is_replayed_accepted(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first_sent = imf(SystemTime::now());
    let id = "7b5b9a25-4b1e-4d1c-a0a8-0d2a6a6f1b71";
    let first = send(&proxy, id, Some(&first_sent)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.is_replay());
    assert_eq!(result(&first), Some("accepted"));
    let repeat = send(&proxy, id, Some(&first_sent)).await;
    assert!(repeat.is_replay(), "{:?}", repeat.headers);
    assert_eq!(repeat.body, first.body);
    assert_eq!(result(&repeat), Some("accepted"));
    // A repeat must say when the request was first sent, as the first did: one that moves the time is
    // another request, never a way past the window.
    let moved = imf(httpdate::parse_http_date(&first_sent).unwrap() + Duration::from_secs(3));
    let refreshed = send(&proxy, id, Some(&moved)).await;
    refreshed.assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn an_answer_that_gives_the_request_back_is_not_accepted_and_its_repeat_runs_again(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first_sent = imf(SystemTime::now());
    // A 503 releases the key: the repeat runs the request again, so neither answer may promise it ran once.
    for _ in 0..2 {
        let unavailable = send_to(&proxy, "/status/503", "d3-released", Some(&first_sent)).await;
        assert_eq!(unavailable.status, 503, "{}", unavailable.text());
        assert_eq!(result(&unavailable), None, "{:?}", unavailable.headers);
    }
    assert_eq!(env.upstream.executions(), 2);
    // A 409 it got from the upstream is an answer, stored and replayed: accepted.
    let conflict = send_to(&proxy, "/status/409", "d3-stored", Some(&first_sent)).await;
    assert_eq!(
        (conflict.status.as_u16(), result(&conflict)),
        (409, Some("accepted"))
    );
    let replayed = send_to(&proxy, "/status/409", "d3-stored", Some(&first_sent)).await;
    assert!(replayed.is_replay());
    assert_eq!(result(&replayed), Some("accepted"));
    assert_eq!(env.upstream.executions(), 3);
}

#[rstest]
#[tokio::test]
async fn a_request_first_sent_outside_the_window_is_rejected_412_and_never_runs(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let now = SystemTime::now();
    // Six minutes ago (the window is five), and five minutes ahead of the proxy's clock.
    for first_sent in [now - Duration::from_secs(360), now + Duration::from_secs(300)] {
        let stale = send(&proxy, "b1f0f0a0-stale", Some(&imf(first_sent))).await;
        stale.assert_problem(412, "repeatability-expired");
        assert_eq!(result(&stale), Some("rejected"));
    }
    // Nothing was claimed: the same id, first sent now, runs.
    let fresh = send(&proxy, "b1f0f0a0-stale", Some(&imf(now))).await;
    assert_eq!(fresh.status, 201, "{}", fresh.text());
    assert_eq!(result(&fresh), Some("accepted"));
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn a_request_id_without_a_valid_first_sent_time_is_rejected_400_and_never_runs(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let asctime = "Sun Nov  6 08:49:37 1994";
    for first_sent in [None, Some("yesterday"), Some(asctime)] {
        let refused = send(&proxy, "c2a1-no-first-sent", first_sent).await;
        refused.assert_problem(400, "repeatability-invalid");
        assert_eq!(result(&refused), Some("rejected"), "{first_sent:?}");
    }
    // An id that is no key (a space in it) is refused for its repeatability headers too.
    let bad_id = send(&proxy, "not an id", Some(&imf(SystemTime::now()))).await;
    bad_id.assert_problem(400, "invalid-key");
    assert_eq!(result(&bad_id), Some("rejected"));
    // Without a request id the route's keys are required: the usual 400, with no repeatability result.
    let keyless = Reply::of(
        client()
            .post(format!("{}/emails", proxy.url))
            .header("authorization", TEST_CREDENTIAL)
            .body("{}"),
    )
    .await;
    keyless.assert_problem(400, "missing-key");
    assert_eq!(result(&keyless), None);
    assert_eq!(env.upstream.executions(), 0);
}

/// A first-sent time a full minute ahead of the proxy's clock is refused: the window counts whole
/// seconds, so one taken at a minute ahead would be let in again up to a second after the record of a
/// route whose `ttl` is the window and a minute (the least allowed) has expired. 59 seconds ahead runs.
#[tokio::test]
async fn a_first_sent_a_minute_ahead_is_rejected_and_59_seconds_ahead_runs() {
    let (env, proxy) = TestEnv::with_routes_on(Backend::Sqlite, ROUTES).await;
    // Early in a second, so the proxy reads its clock in the same whole second as this one.
    while SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .subsec_millis()
        > 300
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now = SystemTime::now();
    let minute = send(
        &proxy,
        "a-minute-ahead",
        Some(&imf(now + Duration::from_secs(60))),
    )
    .await;
    assert_eq!(minute.status, 412, "{}", minute.text());
    assert_eq!(result(&minute), Some("rejected"));
    let ahead = send(&proxy, "59s-ahead", Some(&imf(now + Duration::from_secs(59)))).await;
    assert_eq!(ahead.status, 201, "{}", ahead.text());
    assert_eq!(result(&ahead), Some("accepted"));
    assert_eq!(env.upstream.executions(), 1);
}

/// A client whose body comes slowly: the window is held again once the body is in, so a request let in
/// at the window's end is not claimed after it (when its first attempt's record may have expired, on a
/// route whose `ttl` is just the window and a minute).
#[tokio::test]
async fn a_request_whose_body_comes_after_the_window_closed_is_rejected_and_never_runs() {
    let routes = r#"
[[routes]]
name = "tight"
path_prefix = "/tight"
key = "repeatability"
required = true
repeatability_window = "2s"
ttl = "62s"
"#;
    let (env, proxy) = TestEnv::with_routes(routes).await;
    let chunks = async_stream_of_slow_body();
    let reply = Reply::of(
        client()
            .post(format!("{}/tight", proxy.url))
            .header("authorization", TEST_CREDENTIAL)
            .header("content-type", "application/json")
            .header("content-length", "22")
            .header("repeatability-request-id", "slow-1")
            .header("repeatability-first-sent", imf(SystemTime::now()))
            .body(reqwest::Body::wrap_stream(chunks)),
    )
    .await;
    reply.assert_problem(412, "repeatability-expired");
    assert_eq!(result(&reply), Some("rejected"));
    assert_eq!(env.upstream.executions(), 0, "nothing was claimed or forwarded");
}

/// `{"to":"a@example.com"}` in two chunks, the second 3.5 s after the first (past a 2 s window).
fn async_stream_of_slow_body()
-> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static {
    futures_util::stream::unfold(0u8, |step| async move {
        match step {
            0 => Some((Ok(bytes::Bytes::from_static(br#"{"to":"a@exa"#)), 1)),
            1 => {
                tokio::time::sleep(Duration::from_millis(3500)).await;
                Some((Ok(bytes::Bytes::from_static(br#"mple.com"}"#)), 2))
            }
            _ => None,
        }
    })
}
