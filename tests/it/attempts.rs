//! The upstream is told which execution of a key each request is (`Idempotency-Attempt`), so a service
//! with work in several steps can resume rather than redo: `1` for the first, `N;retry` after an
//! attempt whose answer gave the key back, `N;takeover` after one whose lease ran out (a proxy that
//! died: `processes.rs`). Only the proxy sets it: a client's own never reaches the upstream.

use crate::support::{Reply, TestEnv, keyed_post};

/// The `Idempotency-Attempt` of each request the stub upstream executed for `key`, in order.
pub fn attempts_of(env: &TestEnv, key: &str) -> Vec<String> {
    env.upstream
        .requests()
        .iter()
        .filter(|request| request.key.as_deref() == Some(key))
        .map(|request| match request.headers.get("idempotency-attempt") {
            Some(value) => value.to_str().unwrap().to_owned(),
            None => "(none)".to_owned(),
        })
        .collect()
}

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
