//! The PostgreSQL store on a key table distributed by Citus (on `key`, as docs/stores.md sets it
//! up): the request path reaches one shard per statement, whatever the load, and the sweeper deletes on
//! every shard. Run where `IDEMPROXY_TEST_CITUS_URL` names a coordinator, skipped otherwise (saying so);
//! the store suite runs on Citus under the same condition.

use futures_util::future::join_all;
use idemproxy::store::RecordStatus;

use crate::store::suite::{
    DAY, LONG, SHORT_TTL, completed_records, request, store, until_short_ttl_passed, won,
};
use crate::support::{Backend, Reply, TestEnv, keyed_post, unless_skipped};

/// `url` with every statement that needs more than one shard refused by the coordinator
/// (`citus.multi_task_query_log_level = error`).
fn one_shard_only(url: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options=-c%20citus.multi_task_query_log_level%3Derror")
}

/// How many of the key table's shards hold a record.
async fn shards_holding_records(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT count(DISTINCT get_shard_id_for_distribution_column('idemproxy.records', key))
             FROM idemproxy.records",
            &[],
        )
        .await
        .expect("count the shards holding records")
        .get(0)
}

#[tokio::test]
async fn on_citus_every_request_path_statement_reaches_one_shard_and_each_key_executes_once() {
    unless_skipped!(Backend::Citus);
    let env = TestEnv::on(Backend::Citus).await;
    let guarded = one_shard_only(&env.store.url());
    let (guard_check, connection) = tokio_postgres::connect(&guarded, tokio_postgres::NoTls)
        .await
        .expect("connect with the guard");
    tokio::spawn(connection);
    let refused = guard_check
        .query_one("SELECT count(*) FROM idemproxy.records", &[])
        .await;
    assert!(refused.is_err(), "the guard refuses a statement on every shard");

    // 48 clients at once, each retrying its key the moment it has read the whole response.
    let config = env
        .config()
        .set("store.url", guarded.as_str())
        .set("store.pool_size", 8)
        .set("store.timeout", "10s")
        .set("sweeper.enabled", false);
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let clients = (0..48).map(|i| {
        let url = proxy.url.clone();
        async move {
            let key = format!("order-{i}");
            let first = Reply::of(keyed_post(&url, "/orders", &key, "{}")).await;
            let retry = Reply::of(keyed_post(&url, "/orders", &key, "{}")).await;
            (key, first, retry)
        }
    });
    for (key, first, retry) in join_all(clients).await {
        assert_eq!(first.status, 201, "{key}: {}", first.text());
        assert!(!first.is_replay(), "{key}: the first answer is the execution");
        assert_eq!(retry.status, 201, "{key}: {}", retry.text());
        assert!(retry.is_replay(), "{key}: the retry is the replay");
        assert_eq!(retry.body, first.body, "{key}: the replay is the stored response");
        assert_eq!(env.upstream.executions_for_key(&key), 1, "{key} executed once");
    }
    assert_eq!(env.upstream.executions(), 48);

    let client = match &env.store {
        crate::support::TestStore::Citus(table) => table.client().await,
        _ => unreachable!("a Citus env"),
    };
    assert!(
        shards_holding_records(&client).await > 1,
        "the keys were spread over several shards"
    );
}

#[tokio::test]
async fn a_sweep_on_citus_deletes_a_batch_on_every_shard_at_once_and_keeps_live_records() {
    unless_skipped!(Backend::Citus);
    let (_table, store) = store(Backend::Citus).await;
    completed_records(&*store, "old", 40, SHORT_TTL).await;
    completed_records(&*store, "live", 5, DAY).await;
    won(&*store, &request("running", 1, LONG, SHORT_TTL)).await;
    until_short_ttl_passed().await;

    // A batch of one per shard: the first sweep deletes one record on each shard holding any, so more
    // than one in all, and far fewer than the 40.
    let first = store.sweep(1).await.expect("sweep runs on every shard");
    assert!((2..40).contains(&first), "one batch per shard deleted {first}");
    let mut deleted = first;
    loop {
        let batch = store.sweep(1).await.expect("sweep runs on every shard");
        if batch == 0 {
            break;
        }
        deleted += batch;
    }
    assert_eq!(deleted, 40, "every expired record deleted and counted once");

    assert!(store.find("old-0", None).await.unwrap().is_empty());
    assert_eq!(store.find("live-0", None).await.unwrap().len(), 1);
    let running = store.find("running", None).await.unwrap();
    assert_eq!(running.len(), 1, "a live lease keeps its expired record");
    assert_eq!(running[0].status, RecordStatus::Processing);
    let stats = store.stats().await.unwrap();
    assert_eq!(
        (stats.completed, stats.expired),
        (5, 1),
        "the live records, and the running one past its expiry"
    );
}
