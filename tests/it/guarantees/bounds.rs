//! Detached work is bounded: keyed requests being executed (their work outlives their clients) are
//! capped by `server.max_keyed_in_flight`, upstream connections per worker by `upstream.max_connections`,
//! and response captures by `server.max_buffered_responses`, of which one client (scope) holds at most
//! its share, so its responses cannot leave others' unretained. Over a bound nothing is claimed or
//! forwarded (503 `busy`), or a response is not retained (410 on retry); never unbounded memory or
//! connections. A claim won after its request stopped waiting for the store is given back by its token.

use rstest::rstest;

use crate::support::http::raw_keyed_post_to;
use crate::support::http::{TEST_CREDENTIAL, client};
use crate::support::pg::hold_key_row;
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, metric, metric_reaches, settled};

async fn held(url: &str, path: &str, key: &str, gate: &str) -> tokio::task::JoinHandle<Reply> {
    held_as(url, path, key, gate, TEST_CREDENTIAL).await
}

/// A keyed `POST {path}` from the client whose `Authorization` is `credential`, held on the stub's gate
/// `gate`, answered on a task of its own.
async fn held_as(
    url: &str,
    path: &str,
    key: &str,
    gate: &str,
    credential: &str,
) -> tokio::task::JoinHandle<Reply> {
    let request = post_as(url, path, key, credential).header("x-gate", gate);
    tokio::spawn(Reply::of(request))
}

/// `keyed_post` from the client whose `Authorization` is `credential`.
fn post_as(url: &str, path: &str, key: &str, credential: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{url}{path}"))
        .header("idempotency-key", key)
        .header("authorization", credential)
        .header("content-type", "application/json")
        .body("{}")
}

#[rstest]
#[tokio::test]
async fn keyed_requests_beyond_max_keyed_in_flight_get_503_and_claim_nothing(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&env.config().set("server.max_keyed_in_flight", 2)).await;
    let done = Reply::of(keyed_post(&proxy.url, "/orders", "done", "{}")).await;
    let one = held(&proxy.url, "/slow", "one", "one").await;
    let two = held(&proxy.url, "/slow", "two", "two").await;
    env.upstream.wait_for_key("two", 1).await;
    env.upstream.wait_for_key("one", 1).await;

    let third = Reply::of(keyed_post(&proxy.url, "/orders", "three", "{}")).await;
    third.assert_problem(503, "busy");
    assert_eq!(third.retry_after(), 1);
    assert_eq!(env.upstream.executions_for_key("three"), 0, "not forwarded");
    // A retry of a completed key needs no slot: it is answered from the replay cache.
    let replay = Reply::of(keyed_post(&proxy.url, "/orders", "done", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, done.body);

    env.upstream.release("one");
    env.upstream.release("two");
    assert_eq!(one.await.unwrap().status, 201);
    assert_eq!(two.await.unwrap().status, 201);
    let third = settled(|| keyed_post(&proxy.url, "/orders", "three", "{}")).await;
    assert_eq!(third.status, 201);
    assert!(
        !third.is_replay(),
        "nothing was claimed for it before: it executes now"
    );
    assert_eq!(env.upstream.executions_for_key("three"), 1);
}

#[tokio::test]
async fn work_detached_from_a_client_that_hung_up_still_counts_against_the_bound() {
    let env = TestEnv::new().await;
    let proxy = InProcessProxy::start(&env.config().set("server.max_keyed_in_flight", 1)).await;
    let connection = raw_keyed_post_to(&proxy.url, "/slow", "gone", "{}", "detached").await;
    env.upstream.wait_for_key("gone", 1).await;
    drop(connection);
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "next", "{}")).await;
    refused.assert_problem(503, "busy");
    env.upstream.release("detached");
    // Until the detached work has stored its response, its retry meets the bound (503) or the claim (409).
    let replay = crate::support::poll_until("the detached work's replay", || async {
        let reply = Reply::of(keyed_post(&proxy.url, "/slow", "gone", "{}")).await;
        reply.is_replay().then_some(reply)
    })
    .await;
    assert_eq!(replay.status, 201, "the detached work completed and was stored");
    let next = Reply::of(keyed_post(&proxy.url, "/orders", "next", "{}")).await;
    assert_eq!(next.status, 201, "the slot came back");
}

#[rstest]
#[tokio::test]
async fn upstream_connections_are_capped_per_worker(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("server.workers", 1)
        .set("upstream.max_connections", 1)
        .set("upstream.connect_timeout", "1s");
    let proxy = InProcessProxy::start(&config).await;
    let busy = tokio::spawn({
        let url = proxy.url.clone();
        async move { Reply::of(client().get(format!("{url}/slow")).header("x-gate", "busy")).await }
    });
    env.upstream.wait_until_executions(1).await;

    let passthrough = Reply::of(client().get(format!("{}/orders", proxy.url))).await;
    passthrough.assert_problem(503, "busy");
    let keyed = Reply::of(keyed_post(&proxy.url, "/orders", "capped", "{}")).await;
    keyed.assert_problem(503, "busy");
    assert_eq!(env.upstream.connections(), 1, "never a second connection");
    assert_eq!(env.upstream.executions(), 1);

    env.upstream.release("busy");
    assert_eq!(busy.await.unwrap().status, 201);
    // The keyed request's claim was given back at once: its retry executes, no 409.
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "capped", "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.is_replay());
    assert_eq!(env.upstream.connections(), 1, "the one connection is reused");
}

#[rstest]
#[tokio::test]
async fn captures_beyond_max_buffered_responses_are_not_retained(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("server.max_buffered_responses", "64KiB")
        .set("idempotency.max_stored_response", "64KiB");
    let proxy = InProcessProxy::start(&config).await;
    let path = "/held?bytes=40000";
    let first = held(&proxy.url, path, "first", "first").await;
    env.upstream.wait_for_key("first", 1).await;
    // The first capture holds 40,000 bytes of 64 KiB until it is stored; the second, another client's,
    // does not fit, waits `server.capture_wait` for room and gives up.
    let second = held_as(&proxy.url, path, "second", "second", "Bearer other").await;
    env.upstream.wait_for_key("second", 1).await;
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_capture_budget_exhausted_total",
        &[],
        1.0,
    )
    .await;
    env.upstream.release("first");
    env.upstream.release("second");
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(
        (first.status.as_u16(), second.status.as_u16()),
        (200, 200),
        "relayed in full"
    );
    assert_eq!(second.body.len(), 40_000 + 9);

    let replay = Reply::of(keyed_post(&proxy.url, path, "first", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    let gone = Reply::of(post_as(&proxy.url, path, "second", "Bearer other")).await;
    gone.assert_problem(410, "response-not-retained");
    assert_eq!(env.upstream.executions(), 2, "neither runs again");
    let waited = metric(&proxy.admin_url, "idemproxy_capture_budget_waits_total", &[]).await;
    assert_eq!(waited, 1.0);
}

/// One client (one `Authorization`) holds many slow large responses: without a share it would fill the
/// capture budget, and every other client's response finishing meanwhile would not be retained. With
/// it, that client holds at most its quarter; another client's response is retained and its retry
/// replays, while the hog's own excess is relayed in full and not retained, as before.
#[tokio::test]
async fn one_client_holding_large_slow_responses_cannot_starve_others_retention() {
    let env = TestEnv::new().await;
    // 128 KiB in all, so a share of 32 KiB: one 30,000-byte capture per client at a time.
    let config = env
        .config()
        .set("server.max_buffered_responses", "128KiB")
        .set("idempotency.max_stored_response", "32KiB");
    let proxy = InProcessProxy::start(&config).await;
    let hog_path = "/held?bytes=30000";
    let mut hogs = Vec::new();
    for n in 0..4 {
        let key = format!("hog-{n}");
        hogs.push(held_as(&proxy.url, hog_path, &key, &key, "Bearer hog").await);
    }
    // Four captures of 30,000 bytes would leave 11,072 of 131,072 free; the share lets one through and
    // the three others wait `capture_wait`, then give up.
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_capture_scope_share_exhausted_total",
        &[],
        3.0,
    )
    .await;

    let victim_path = "/held?bytes=16000";
    let victim = held_as(&proxy.url, victim_path, "victim", "victim", "Bearer victim").await;
    env.upstream.wait_for_key("victim", 1).await;
    env.upstream.release("victim");
    let victim = victim.await.unwrap();
    assert_eq!(victim.status.as_u16(), 200);
    assert_eq!(victim.body.len(), 16_000 + 9);
    let replay = settled(|| post_as(&proxy.url, victim_path, "victim", "Bearer victim")).await;
    assert_eq!(replay.status.as_u16(), 200, "{}", replay.text());
    assert!(replay.is_replay());
    assert_eq!(replay.body, victim.body);

    for n in 0..4 {
        env.upstream.release(&format!("hog-{n}"));
    }
    for hog in hogs {
        let hog = hog.await.unwrap();
        assert_eq!(
            (hog.status.as_u16(), hog.body.len()),
            (200, 30_000 + 9),
            "relayed in full"
        );
    }
    let mut replayed = 0;
    for n in 0..4 {
        let retry = settled(|| post_as(&proxy.url, hog_path, &format!("hog-{n}"), "Bearer hog")).await;
        if retry.status == 200 {
            assert!(retry.is_replay());
            assert_eq!(retry.body.len(), 30_000 + 9);
            replayed += 1;
        } else {
            retry.assert_problem(410, "response-not-retained");
        }
    }
    assert_eq!(replayed, 1, "the hog's share held one of its responses");
    assert_eq!(env.upstream.executions(), 5, "nothing ran twice");
    let starved = metric(&proxy.admin_url, "idemproxy_capture_budget_exhausted_total", &[]).await;
    assert_eq!(starved, 0.0, "the budget itself never ran out");
}

/// A claim statement that waits on a row lock past `store.timeout` is answered 503, but commits once
/// the lock goes: the claim it wins belongs to no request. It is given back by its token, so the key's
/// retry executes at once instead of meeting 409 for a lease and then a stale takeover.
#[tokio::test]
async fn a_claim_won_after_its_request_gave_up_is_given_back() {
    let env = TestEnv::new().await;
    let proxy = InProcessProxy::start(&env.config().set("store.max_batch", 1)).await;
    let mut holder = env.db().client().await;
    let blocking = hold_key_row(&mut holder, "orphan").await;
    let waiting = tokio::spawn({
        let url = proxy.url.clone();
        async move { Reply::of(keyed_post(&url, "/orders", "orphan", "{}")).await }
    });
    env.db().wait_for_a_lock_waiter().await;
    let refused = waiting.await.unwrap();
    refused.assert_problem(503, "store-unavailable");
    let detail = refused.json()["detail"].as_str().unwrap().to_string();
    assert!(
        !detail.contains("timed out") && !detail.contains("store error"),
        "{detail}"
    );
    blocking.rollback().await.unwrap();

    metric_reaches(
        &proxy.admin_url,
        "idemproxy_orphan_claims_released_total",
        &[],
        1.0,
    )
    .await;
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "orphan", "{}")).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.is_replay());
    assert_eq!(env.upstream.executions_for_key("orphan"), 1);
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_stale_takeovers_total", &[]).await,
        0.0
    );
    let client = env.db().client().await;
    let row = client
        .query_one(
            "SELECT claim_kind, attempt FROM idemproxy.records WHERE key = 'orphan'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, i32>(1)),
        ("retry".into(), 2)
    );
}

/// On SQLite a claim whose caller stopped waiting before it got the connection does not run at all: with
/// another program holding the file's write lock past `store.timeout`, the request gets 503; once the
/// lock goes, its key is not held by anyone (no 409, no stale takeover) and its retry executes once.
#[tokio::test]
async fn a_sqlite_claim_its_request_gave_up_on_holds_nothing() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = InProcessProxy::start(&env.config()).await;
    let path = env.store.sqlite_path();
    let (locked, unlock) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
    let holder = std::thread::spawn(move || {
        let db = rusqlite::Connection::open(path).unwrap();
        db.execute_batch("BEGIN IMMEDIATE").unwrap();
        locked.0.send(()).unwrap();
        unlock.1.recv().unwrap();
        db.execute_batch("ROLLBACK").unwrap();
    });
    locked.1.recv().unwrap();
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "abandoned", "{}")).await;
    refused.assert_problem(503, "store-unavailable");
    unlock.0.send(()).unwrap();
    holder.join().unwrap();

    let retry = crate::support::poll_until("the key to be free", || async {
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", "abandoned", "{}")).await;
        (reply.status != 503).then_some(reply)
    })
    .await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.is_replay());
    assert_eq!(env.upstream.executions_for_key("abandoned"), 1);
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_stale_takeovers_total", &[]).await,
        0.0
    );
}
