//! A running key is never new: a request still running under a live lease when its key's TTL ends keeps
//! the key; a retry then is in flight (409), not a second execution.

use rstest::rstest;

use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, settled};

#[rstest]
#[tokio::test]
async fn a_retry_after_the_ttl_of_a_still_running_key_does_not_execute_it_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("idempotency.ttl", "2s")
        .set("idempotency.lock_timeout", "1500ms")
        .set("replay_cache.max_size", "0");
    let proxy = InProcessProxy::start(&config).await;
    let original = tokio::spawn({
        let url = proxy.url.clone();
        async move { Reply::of(keyed_post(&url, "/slow", "long", "{}")).await }
    });
    env.upstream.wait_for_key("long", 1).await;
    // Well past the TTL; the heartbeat has kept the lease (and now the expiry) alive meanwhile.
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "long", "{}")).await;
    retry.assert_problem(409, "key-in-flight");
    assert_eq!(retry.retry_after(), 1, "a short hint, not the lease");
    assert_eq!(env.upstream.executions_for_key("long"), 1);

    env.upstream.release("slow");
    let first = original.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = settled(|| keyed_post(&proxy.url, "/slow", "long", "{}")).await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.body, first.body);
    assert_eq!(env.upstream.executions_for_key("long"), 1);
}
