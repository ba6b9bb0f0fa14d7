//! A proxy that dies mid-request and the one that takes its key over once the lease runs out, and the
//! attempt the upstream is told each execution is.

use super::{ProxyProcess, Reply, TestEnv, keyed_post, metric, poll_until};

/// Sends a keyed request through `dying` and kills it with SIGKILL while the upstream holds the request,
/// so its claim is left live with nobody to complete it.
pub async fn kill_mid_request(env: &TestEnv, dying: &mut ProxyProcess) {
    let original = tokio::spawn(Reply::try_of(keyed_post(&dying.url, "/slow", "k", "{}")));
    env.upstream.wait_for_key("k", 1).await;
    dying.kill().await;
    assert!(
        original.await.unwrap().is_err(),
        "the killed proxy cannot have answered"
    );
}

/// Once the dead proxy's lease runs out, `successor` executes the key again and counts a takeover.
pub async fn assert_taken_over(env: &TestEnv, successor: &ProxyProcess) {
    let taken_over = poll_until("the dead proxy's lease to run out", || async {
        let reply = Reply::of(keyed_post(&successor.url, "/slow", "k", "{}")).await;
        (reply.status != 409).then_some(reply)
    })
    .await;
    assert_eq!(taken_over.status, 201, "{}", taken_over.text());
    assert!(!taken_over.is_replay());
    assert_eq!(taken_over.text(), "slow done 2");
    assert_eq!(env.upstream.executions_for_key("k"), 2);
    let takeovers = metric(&successor.admin_url, "idemproxy_stale_takeovers_total", &[]).await;
    assert_eq!(takeovers, 1.0);
    // The upstream was told which execution each was, and that the second took over a lapsed one.
    assert_eq!(attempts_of(env, "k"), ["1", "2;takeover"]);
}

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
