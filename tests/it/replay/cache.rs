//! The replay cache: retries of completed keys are answered without the store, exactly as the store would
//! answer them, and never past the record's expiry. The store is taken away for real (a cut relay) to
//! tell a cached answer from a stored one.

use std::sync::atomic::{AtomicUsize, Ordering};

use futures_util::future::join_all;
use tokio::time::{Duration, Instant};

use crate::support::{
    InProcessProxy, ProxyConfig, Relay, Reply, TestEnv, keyed_post, metric, poll_until, settled,
};

/// A proxy that reaches its store through a relay the test can cut.
async fn proxy_via_relay(env: &TestEnv, config: ProxyConfig) -> (InProcessProxy, Relay) {
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = config.set("store.url", env.db().url_via(relay.addr()));
    (InProcessProxy::start(&config).await, relay)
}

#[tokio::test]
async fn own_completion_replays_and_mismatches_without_the_store() {
    let env = TestEnv::new().await;
    let (proxy, relay) = proxy_via_relay(&env, env.config()).await;
    let original = Reply::of(keyed_post(&proxy.url, "/orders", "k", r#"{"a":1}"#)).await;
    assert_eq!(original.status, 201);
    settled(|| keyed_post(&proxy.url, "/orders", "k", r#"{"a":1}"#)).await;

    relay.cut();
    let replay = Reply::of(keyed_post(&proxy.url, "/orders", "k", r#"{"a":1}"#)).await;
    assert_eq!(replay.status, 201, "{}", replay.text());
    assert!(replay.is_replay());
    assert_eq!(replay.body, original.body);
    assert_eq!(replay.header("x-custom"), Some("value"));
    let other = Reply::of(keyed_post(&proxy.url, "/orders", "k", r#"{"a":2}"#)).await;
    other.assert_problem(422, "key-reused");
    let new_key = Reply::of(keyed_post(&proxy.url, "/orders", "new", "{}")).await;
    new_key.assert_problem(503, "store-unavailable");

    assert_eq!(env.upstream.executions(), 1);
    let hits = metric(&proxy.admin_url, "idemproxy_replay_cache_hits_total", &[]).await;
    assert!(hits >= 2.0, "hits {hits}");
}

#[tokio::test]
async fn with_the_cache_off_a_retry_needs_the_store() {
    let env = TestEnv::new().await;
    let config = env.config().set("replay_cache.max_size", "0");
    let (proxy, relay) = proxy_via_relay(&env, config).await;
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}"))
            .await
            .status,
        201
    );
    assert!(
        settled(|| keyed_post(&proxy.url, "/orders", "k", "{}"))
            .await
            .is_replay()
    );

    relay.cut();
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    retry.assert_problem(503, "store-unavailable");
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_replay_cache_hits_total", &[]).await,
        0.0
    );
}

#[tokio::test]
async fn a_record_completed_by_another_proxy_is_cached_once_seen() {
    let env = TestEnv::new().await;
    let other = env.proxy().await;
    let original = Reply::of(keyed_post(&other.url, "/orders", "k", "{}")).await;
    assert_eq!(original.status, 201);
    settled(|| keyed_post(&other.url, "/orders", "k", "{}")).await;

    let (proxy, relay) = proxy_via_relay(&env, env.config()).await;
    let from_store = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert!(from_store.is_replay());
    relay.cut();
    let from_cache = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert!(from_cache.is_replay(), "{}", from_cache.text());
    assert_eq!(from_cache.body, original.body);
    let mismatch = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{\"x\":1}")).await;
    mismatch.assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn a_cached_record_is_never_replayed_past_its_expiry() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("idempotency.ttl", "2s")
        .set("idempotency.lock_timeout", "1s");
    let (proxy, relay) = proxy_via_relay(&env, config).await;
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}"))
            .await
            .status,
        201
    );
    // The record was written before its response arrived, so it expires before this.
    let expiry = Instant::now() + Duration::from_secs(2);
    settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    relay.cut();

    let replays = AtomicUsize::new(0);
    let after_expiry = poll_until("the cached record to expire", || async {
        let sent = Instant::now();
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
        if reply.is_replay() {
            assert!(sent < expiry, "replayed from the cache after the record expired");
            replays.fetch_add(1, Ordering::SeqCst);
            return None;
        }
        Some(reply)
    })
    .await;
    after_expiry.assert_problem(503, "store-unavailable");
    assert!(
        replays.load(Ordering::SeqCst) >= 1,
        "the record was never replayed from the cache"
    );

    relay.restore();
    // The cache's entry expires first: its expiry is counted from before the claim statement, the
    // record's from the database's clock as the claim ran (later by the claim's connection set-up and
    // round trip). Until the record's own expiry the store may still replay it, rightly.
    tokio::time::sleep_until(expiry).await;
    let again = settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert_eq!(again.status, 201);
    assert!(!again.is_replay(), "an expired key executes again");
    assert_eq!(env.upstream.executions_for_key("k"), 2);
}

#[tokio::test]
async fn concurrent_retries_of_a_cached_key_replay_or_mismatch_alike() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let original = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    settled(|| keyed_post(&proxy.url, "/orders", "k", "{}")).await;

    let same = (0..40).map(|_| Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")));
    let other = (0..40).map(|_| Reply::of(keyed_post(&proxy.url, "/orders", "k", "{\"b\":2}")));
    let (same, other) = tokio::join!(join_all(same), join_all(other));
    for reply in same {
        assert!(reply.is_replay(), "{}", reply.text());
        assert_eq!(reply.body, original.body);
    }
    for reply in other {
        reply.assert_problem(422, "key-reused");
    }
    assert_eq!(env.upstream.executions(), 1);
}
