//! The upstream is told which execution of a key each request is (`Idempotency-Attempt`), so a service
//! with work in several steps can resume rather than redo: `1` for the first, `N;retry` after an
//! attempt whose answer gave the key back, `N;takeover` after one whose lease ran out (a proxy that
//! died: `operators/processes.rs`). Only the proxy sets it: a client's own never reaches the upstream.

use std::time::{Duration, SystemTime};

use rstest::rstest;

use crate::support::takeover::attempts_of;
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, poll_until};

#[tokio::test]
async fn each_execution_of_a_key_tells_the_upstream_its_attempt() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;

    // The first attempt's 503 gives the key back; the retry is the second attempt, after a release.
    let failed = Reply::of(keyed_post(&proxy.url, "/fail-first/503", "attempt-1", "{}")).await;
    assert_eq!(failed.status, 503);
    let retried = Reply::of(keyed_post(&proxy.url, "/fail-first/503", "attempt-1", "{}")).await;
    assert_eq!(retried.status, 201);
    // Its replay executes nothing, so tells nothing.
    let replayed = Reply::of(keyed_post(&proxy.url, "/fail-first/503", "attempt-1", "{}")).await;
    assert!(replayed.is_replay());
    assert_eq!(attempts_of(&env, "attempt-1"), ["1", "2;retry"]);
}

#[tokio::test]
async fn a_clients_own_attempt_header_never_reaches_the_upstream() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;

    let keyed = keyed_post(&proxy.url, "/pay", "forged-1", "{}").header("idempotency-attempt", "7;takeover");
    assert_eq!(Reply::of(keyed).await.status, 201);
    assert_eq!(
        attempts_of(&env, "forged-1"),
        ["1"],
        "the proxy's, not the client's"
    );

    let unkeyed = crate::support::http::client()
        .get(format!("{}/pay", proxy.url))
        .header("idempotency-attempt", "7;takeover");
    Reply::of(unkeyed).await;
    let passed = env.upstream.requests().into_iter().last().unwrap();
    assert_eq!(passed.method, "GET");
    assert!(
        passed.headers.get("idempotency-attempt").is_none(),
        "{:?}",
        passed.headers
    );
}

/// The expiry an `Idempotency-Expires` header announces.
fn announced(reply: &Reply) -> SystemTime {
    let value = reply.header("idempotency-expires").expect("the expiry header");
    httpdate::parse_http_date(value).expect("an HTTP date")
}

/// Checks that every answer in `replies` announces the same expiry, which is the record of `key` as
/// the store holds it: rounded down to the second, and never later. (An announcement is made from the
/// store's time to expiry measured from before the claim statement: it may fall a second earlier when a
/// second boundary comes within a claim's round trip of the expiry, so two answers may differ by that.)
async fn announce_the_records_expiry(env: &TestEnv, key: &str, replies: &[&Reply]) {
    let store = env.store.open().await;
    let record = store.find(key, None).await.unwrap().remove(0);
    let real = record.expires_at;
    let second = Duration::from_secs(1);
    let whole = SystemTime::UNIX_EPOCH
        + Duration::from_secs(real.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs());
    for reply in replies {
        let at = announced(reply);
        assert!(
            at <= real,
            "announced {at:?}, after the record's expiry: {record:?}"
        );
        assert!(
            at + second >= whole,
            "announced {at:?}, before the record's expiry: {record:?}"
        );
    }
    let first = announced(replies[0]);
    for reply in &replies[1..] {
        let at = announced(reply);
        let apart = at.duration_since(first).unwrap_or_else(|e| e.duration());
        assert!(apart <= second, "{first:?} then {at:?}");
    }
}

#[rstest]
#[tokio::test]
async fn a_retry_and_a_takeover_announce_the_expiry_their_replays_announce(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("idempotency.expires_header", "Idempotency-Expires")
        .set("idempotency.ttl", "1h")
        .set("idempotency.lock_timeout", "1s")
        .set("upstream.timeout", "500ms");
    let proxy = InProcessProxy::start(&config).await;
    let post = |url: &str, path: &str, key: &str| Reply::of(keyed_post(url, path, key, "{}"));

    // A 503 gives the key back, and keeps nothing, so announces no expiry; the retry keeps the hour
    // the key was first claimed with.
    let failed = post(&proxy.url, "/fail-first/503", "retried").await;
    assert_eq!(failed.status, 503);
    assert_eq!(failed.header("idempotency-expires"), None);
    let retried = post(&proxy.url, "/fail-first/503", "retried").await;
    assert_eq!(retried.status, 201);
    let retried_replay = post(&proxy.url, "/fail-first/503", "retried").await;
    assert!(retried_replay.is_replay());
    assert_eq!(attempts_of(&env, "retried"), ["1", "2;retry"]);

    // An upstream that does not answer in time leaves the claim to its lease; once it lapses, the
    // same request takes the key over.
    post(&proxy.url, "/slow", "taken")
        .await
        .assert_problem(504, "upstream-timeout");
    env.upstream.release("slow");
    let taken = poll_until("the lapsed lease to be taken over", || async {
        let reply = post(&proxy.url, "/slow", "taken").await;
        (reply.status != 409).then_some(reply)
    })
    .await;
    assert_eq!(taken.status, 201, "{}", taken.text());
    let taken_replay = post(&proxy.url, "/slow", "taken").await;
    assert!(taken_replay.is_replay());
    assert_eq!(attempts_of(&env, "taken"), ["1", "2;takeover"]);

    // Those replays came from the replay cache; a proxy started afresh replays from the store.
    proxy.stop().await.expect("the proxy stops");
    let restarted = InProcessProxy::start(&config).await;
    let retried_stored = post(&restarted.url, "/fail-first/503", "retried").await;
    let taken_stored = post(&restarted.url, "/slow", "taken").await;
    assert!(retried_stored.is_replay() && taken_stored.is_replay());
    announce_the_records_expiry(&env, "retried", &[&retried, &retried_replay, &retried_stored]).await;
    announce_the_records_expiry(&env, "taken", &[&taken, &taken_replay, &taken_stored]).await;
}
