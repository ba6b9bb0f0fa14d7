//! `on_in_flight = "wait"`: a duplicate that finds its key in flight waits for the original instead of
//! getting 409, and gets the original's response, runs the request itself when the original was released
//! or died, or gets 409 when its wait runs out. Every test holds the original on a gate of the stub
//! upstream and opens it when the duplicates are known to be waiting (`idemproxy_waiting_requests`).

use std::time::Duration;

use futures_util::future::join_all;
use reqwest::RequestBuilder;
use rstest::rstest;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::support::Backend::{self, Citus, Postgres, Redis, RedisCluster, Sqlite};
use crate::support::{
    InProcessProxy, ProxyConfig, ProxyProcess, Reply, TestEnv, keyed_post, metric, metric_reaches,
    unless_skipped,
};

/// The proxy's claim statements so far, as its own store metrics count them.
const CLAIMS: (&str, &[(&str, &str)]) = ("idemproxy_store_duration_seconds_count", &[("op", "claim")]);

/// Test defaults with every keyed request waiting for its original, for longer than any test needs
/// (but less than the test client's own bound). The lease is longer still, so a waiter that was not
/// woken would time out rather than be saved by its lease re-check.
fn waiting(env: &TestEnv) -> ProxyConfig {
    env.config()
        .set("idempotency.on_in_flight", "wait")
        .set("idempotency.wait_timeout", "40s")
        .set("idempotency.lock_timeout", "120s")
        .set("store.timeout", "10s")
}

/// A keyed `POST {path}` held on the stub's gate `gate`; every copy has the same fingerprint.
fn gated(base: &str, path: &str, key: &str, gate: &str) -> RequestBuilder {
    keyed_post(base, path, key, r#"{"amount":42}"#).header("x-gate", gate)
}

fn spawn_all(requests: impl Iterator<Item = RequestBuilder>) -> Vec<JoinHandle<Reply>> {
    requests.map(|request| tokio::spawn(Reply::of(request))).collect()
}

async fn replies(tasks: Vec<JoinHandle<Reply>>) -> Vec<Reply> {
    join_all(tasks)
        .await
        .into_iter()
        .map(|reply| reply.expect("request task"))
        .collect()
}

/// Sends `n` duplicates of the gated request and returns once all of them wait.
async fn duplicates_waiting(
    proxy: &InProcessProxy,
    path: &str,
    key: &str,
    gate: &str,
    n: usize,
) -> Vec<JoinHandle<Reply>> {
    let waiting_before = metric(&proxy.admin_url, "idemproxy_waiting_requests", &[]).await;
    let duplicates = spawn_all((0..n).map(|_| gated(&proxy.url, path, key, gate)));
    let all = waiting_before + n as f64;
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], all).await;
    duplicates
}

async fn waits(proxy: &InProcessProxy, result: &str) -> f64 {
    metric(&proxy.admin_url, "idemproxy_waits_total", &[("result", result)]).await
}

/// `idemproxy_waits_total{result}` once it has reached `n`. A wait is counted when it ends, which for a
/// waiter that executes is after its whole execution, a moment after its client has the response.
async fn waits_reach(proxy: &InProcessProxy, result: &str, n: f64) -> f64 {
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_waits_total",
        &[("result", result)],
        n,
    )
    .await
}

/// Starts a proxy on PostgreSQL and returns once its wait listener listens, so that its first
/// connection's wake-up does not fall into a test's measurements.
async fn listening(config: &ProxyConfig) -> InProcessProxy {
    let proxy = InProcessProxy::start(config).await;
    metric_reaches(&proxy.admin_url, "idemproxy_wait_listener_connected", &[], 1.0).await;
    proxy
}

fn assert_all_replay(replies: &[Reply], original: &Reply) {
    for reply in replies {
        assert_eq!(reply.status, original.status, "{}", reply.text());
        assert_eq!(reply.body, original.body);
        assert!(reply.is_replay(), "a waiter gets the replay");
    }
}

#[rstest]
#[tokio::test]
async fn a_hundred_waiting_duplicates_get_the_one_execution_and_no_409(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&waiting(&env)).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;

    let duplicates = duplicates_waiting(&proxy, "/slow", "k", "g", 100).await;
    env.upstream.release("g");

    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert!(!original.is_replay());
    assert_all_replay(&replies(duplicates).await, &original);
    assert_eq!(env.upstream.executions(), 1);
    assert_eq!(waits_reach(&proxy, "replayed", 100.0).await, 100.0);
}

/// Holds the original for `hold` while `n` duplicates wait on it; the claim statements that cost.
async fn claims_for_a_hold(env: &TestEnv, proxy: &InProcessProxy, key: &str, hold: Duration) -> f64 {
    let before = metric(&proxy.admin_url, CLAIMS.0, CLAIMS.1).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/slow", key, key)));
    env.upstream.wait_for_key(key, 1).await;
    let duplicates = duplicates_waiting(proxy, "/slow", key, key, 10).await;
    // The hold is the measured variable here, not a synchronisation.
    tokio::time::sleep(hold).await;
    env.upstream.release(key);
    let original = original.await.unwrap();
    assert_all_replay(&replies(duplicates).await, &original);
    metric(&proxy.admin_url, CLAIMS.0, CLAIMS.1).await - before
}

#[rstest]
#[tokio::test]
async fn waiting_costs_the_same_store_statements_for_a_short_and_a_long_wait(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = waiting(&env);
    let proxy = match backend {
        Backend::Postgres | Backend::Citus => listening(&config).await,
        Backend::Sqlite | Backend::Redis | Backend::RedisCluster => InProcessProxy::start(&config).await,
    };
    let short = claims_for_a_hold(&env, &proxy, "short", Duration::from_millis(100)).await;
    let long = claims_for_a_hold(&env, &proxy, "long", Duration::from_secs(3)).await;
    eprintln!("claim statements for 1 original and 10 waiters: {short} (0.1 s hold), {long} (3 s hold)");
    assert_eq!(short, long, "the statements do not grow with the wait");
    assert!(long <= 1.0 + 2.0 * 10.0, "at most two claims per waiter: {long}");
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn a_released_original_is_run_again_by_exactly_one_waiter(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&waiting(&env)).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/fail-first/503", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;

    let duplicates = duplicates_waiting(&proxy, "/fail-first/503", "k", "g", 10).await;
    env.upstream.release("g");

    assert_eq!(original.await.unwrap().status, 503);
    let replies = replies(duplicates).await;
    let executed: Vec<&Reply> = replies.iter().filter(|r| !r.is_replay()).collect();
    assert_eq!(executed.len(), 1, "exactly one waiter runs it again");
    assert_eq!(executed[0].status, 201);
    assert_all_replay(
        &replies
            .iter()
            .filter(|r| r.is_replay())
            .cloned()
            .collect::<Vec<_>>(),
        executed[0],
    );
    assert_eq!(env.upstream.executions(), 2);
    assert_eq!(waits_reach(&proxy, "executed", 1.0).await, 1.0);
    assert_eq!(waits_reach(&proxy, "replayed", 9.0).await, 9.0);
}

#[rstest]
#[tokio::test]
async fn a_wait_longer_than_wait_timeout_gets_409_with_retry_after(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&waiting(&env).set("idempotency.wait_timeout", "1s")).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;

    let duplicate = Reply::of(gated(&proxy.url, "/slow", "k", "g")).await;
    duplicate.assert_problem(409, "key-in-flight");
    assert!(duplicate.retry_after() >= 1);
    assert_eq!(waits_reach(&proxy, "timeout", 1.0).await, 1.0);

    env.upstream.release("g");
    assert_eq!(original.await.unwrap().status, 201);
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn beyond_max_waiting_a_duplicate_gets_409_at_once(#[values(Postgres, Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&waiting(&env).set("server.max_waiting", 2)).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;
    let duplicates = duplicates_waiting(&proxy, "/slow", "k", "g", 2).await;

    // Answered while the original is still held, and not by the wait timing out.
    let third = Reply::of(gated(&proxy.url, "/slow", "k", "g")).await;
    third.assert_problem(409, "key-in-flight");
    assert_eq!(waits_reach(&proxy, "rejected_full", 1.0).await, 1.0);
    assert_eq!(waits(&proxy, "timeout").await, 0.0);

    env.upstream.release("g");
    let original = original.await.unwrap();
    assert_all_replay(&replies(duplicates).await, &original);
}

#[rstest]
#[tokio::test]
async fn waiters_on_another_replica_get_the_replay(
    #[values(Postgres, Redis, RedisCluster, Citus)] backend: Backend,
) {
    unless_skipped!(backend);
    let env = TestEnv::on(backend).await;
    let config = waiting(&env);
    let first = listening(&config).await;
    let second = listening(&config).await;
    let original = tokio::spawn(Reply::of(gated(&first.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;

    let claims_before = metric(&second.admin_url, CLAIMS.0, CLAIMS.1).await;
    let duplicates = duplicates_waiting(&second, "/slow", "k", "g", 10).await;
    env.upstream.release("g");

    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    assert_all_replay(&replies(duplicates).await, &original);
    assert_eq!(env.upstream.executions(), 1);
    assert_eq!(waits_reach(&second, "replayed", 10.0).await, 10.0);
    let claims = metric(&second.admin_url, CLAIMS.0, CLAIMS.1).await - claims_before;
    let notifies = [("op", "notify")];
    let notified = metric(&first.admin_url, CLAIMS.0, &notifies).await;
    eprintln!(
        "10 waiters on another replica: {claims} claim statements there, {notified} announcements here"
    );
    assert!(
        claims <= 2.0 * 10.0,
        "a claim to find the key in flight, one when woken: {claims}"
    );
    assert_eq!(
        notified, 1.0,
        "one announcement (NOTIFY or PUBLISH) for the completion"
    );
}

/// Ends the wait listener's session of the proxy whose store URL names `application`.
async fn terminate_listener(env: &TestEnv, application: &str) {
    let client = env.db().client().await;
    let row = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name = $1 AND query LIKE 'LISTEN%'",
            &[&application],
        )
        .await
        .expect("terminate the listener's backend");
    assert_eq!(row.get::<_, i64>(0), 1, "one listener session for {application}");
}

#[tokio::test]
async fn waiters_re_check_when_the_listener_connection_is_lost_and_end_with_the_replay() {
    let env = TestEnv::new().await;
    let config = waiting(&env);
    let first = listening(&config).await;
    let url = format!("{}?application_name=waiters", env.db().url());
    let second = listening(&config.clone().set("store.url", url)).await;
    let original = tokio::spawn(Reply::of(gated(&first.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;
    let duplicates = duplicates_waiting(&second, "/slow", "k", "g", 5).await;
    let claims = metric(&second.admin_url, CLAIMS.0, CLAIMS.1).await;

    terminate_listener(&env, "waiters").await;
    metric_reaches(
        &second.admin_url,
        "idemproxy_wait_listener_reconnects_total",
        &[],
        1.0,
    )
    .await;
    // Woken to re-check at the loss (and again once listening anew); still in flight, they wait on.
    metric_reaches(&second.admin_url, CLAIMS.0, CLAIMS.1, claims + 5.0).await;
    metric_reaches(&second.admin_url, "idemproxy_wait_listener_connected", &[], 1.0).await;
    env.upstream.release("g");

    let original = original.await.unwrap();
    assert_all_replay(&replies(duplicates).await, &original);
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn shutdown_answers_waiters_at_once_and_does_not_delay_the_drain(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let grace = Duration::from_secs(20);
    let config = waiting(&env).set("server.shutdown_grace", "20s");
    let proxy = InProcessProxy::start(&config).await;
    let original = tokio::spawn(Reply::of(gated(&proxy.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;
    let duplicates = duplicates_waiting(&proxy, "/slow", "k", "g", 5).await;

    let stopping = Instant::now();
    proxy.shutdown.cancel();
    // Answered while the original is still held: they do not wait for it.
    for reply in replies(duplicates).await {
        reply.assert_problem(409, "key-in-flight");
    }
    assert_eq!(waits_reach(&proxy, "shutdown", 5.0).await, 5.0);
    env.upstream.release("g");

    assert_eq!(original.await.unwrap().status, 201);
    proxy.stop().await.expect("the proxy stops cleanly");
    assert!(
        stopping.elapsed() < grace,
        "drained in {:?}, within the grace",
        stopping.elapsed()
    );
}

#[rstest]
#[tokio::test]
async fn a_waiter_takes_over_the_key_of_a_dead_original_once_its_lease_runs_out(
    #[values(Postgres, Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    // Long enough that the new proxy's duplicates meet the dead claim's lease even on a loaded machine
    // (they must wait for it, not find it run out already), short enough to wait out.
    let config = waiting(&env).set("idempotency.lock_timeout", "15s");
    let mut dying = ProxyProcess::spawn(&config).await;
    let original = tokio::spawn(Reply::try_of(gated(&dying.url, "/slow", "k", "g")));
    env.upstream.wait_for_key("k", 1).await;
    dying.kill().await;
    assert!(original.await.unwrap().is_err(), "the original's proxy died");
    env.upstream.release("g");

    // Its claim stays for up to a lease; the embedded store takes a new proxy only once the old is gone.
    let proxy = InProcessProxy::start(&config).await;
    let replies = replies(spawn_all((0..5).map(|_| gated(&proxy.url, "/slow", "k", "g")))).await;

    let executed: Vec<&Reply> = replies.iter().filter(|r| !r.is_replay()).collect();
    assert_eq!(executed.len(), 1, "exactly one waiter takes it over");
    assert_eq!(executed[0].status, 201);
    for reply in replies.iter().filter(|r| r.is_replay()) {
        assert_eq!(reply.body, executed[0].body);
    }
    assert_eq!(env.upstream.executions(), 2);
    assert_eq!(
        waits_reach(&proxy, "executed", 1.0).await,
        1.0,
        "it waited for the lease"
    );
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_stale_takeovers_total", &[]).await,
        1.0
    );
}
