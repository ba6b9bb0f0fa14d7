//! The stuck-key runbook on the command line (`idemproxy keys`), run as the real binary against the
//! configured store, beside a serving proxy where that matters.

use std::time::Duration;

use idemproxy::store::{ClaimKind, Store};
use rstest::rstest;

use crate::store::suite::{DAY, LONG, request, response, won};
use crate::support::cli::{json, keys, stdout};
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, TestStore, keyed_post, settled};

#[rstest]
#[tokio::test]
async fn show_describes_a_record_beside_a_serving_proxy(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&env.config()).await;
    let body = r#"{"card":"4242424242424242"}"#;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "order-7", body)).await;
    assert_eq!(first.status, 201);
    assert!(
        settled(|| keyed_post(&proxy.url, "/orders", "order-7", body))
            .await
            .is_replay()
    );

    let text = keys(&env.store, &["show", "order-7"]).await;
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    let printed = stdout(&text);
    assert!(printed.contains("status    completed"), "{printed}");
    assert!(printed.contains("attempt   1 (new)"), "{printed}");
    assert!(
        printed.contains(&format!("201, {} bytes stored", first.body.len())),
        "{printed}"
    );
    assert!(
        !printed.contains("4242"),
        "no request or response data: {printed}"
    );

    let scripted = json(&keys(&env.store, &["show", "order-7", "--json"]).await);
    let record = &scripted[0];
    assert_eq!(record["key"], "order-7");
    assert_eq!(record["status"], "completed");
    assert_eq!(record["response_status"], 201);
    assert_eq!(record["response_bytes"], first.body.len());
    assert!(record["scope"].as_str().unwrap().starts_with("default:"));
}

#[tokio::test]
async fn show_of_an_unknown_key_says_so_and_exits_1() {
    let store = TestStore::create(Backend::Sqlite).await;
    store.open().await;
    let output = keys(&store, &["show", "nope"]).await;
    assert_eq!(output.status.code(), Some(1));
    assert!(stdout(&output).contains("no record for key \"nope\""));
    let scripted = keys(&store, &["show", "nope", "--json"]).await;
    assert_eq!(json(&scripted), serde_json::json!([]));
}

#[rstest]
#[tokio::test]
async fn release_frees_a_stuck_claim_so_the_next_retry_executes(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let test_store = TestStore::create(backend).await;
    let store = test_store.open().await;
    won(&*store, &request("stuck", 1, Duration::from_millis(200), DAY)).await;
    tokio::time::sleep(Duration::from_millis(600)).await;

    let output = keys(&test_store, &["release", "stuck"]).await;
    assert!(output.status.success(), "{}", stdout(&output));
    assert!(
        stdout(&output).contains("released: the next retry"),
        "{}",
        stdout(&output)
    );
    assert!(
        stdout(&output).contains("status    failed"),
        "{}",
        stdout(&output)
    );
    assert_eq!(
        won(&*store, &request("stuck", 1, LONG, DAY)).await,
        (2, ClaimKind::Retry)
    );
}

#[rstest]
#[tokio::test]
async fn release_of_a_live_claim_needs_force(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let test_store = TestStore::create(backend).await;
    let store = test_store.open().await;
    won(&*store, &request("live", 1, LONG, DAY)).await;

    let refused = keys(&test_store, &["release", "live", "--json"]).await;
    assert_eq!(refused.status.code(), Some(1));
    let answer = json(&refused);
    assert_eq!(answer["released"], false);
    assert!(answer["reason"].as_str().unwrap().contains("--force"), "{answer}");
    assert_eq!(answer["record"]["status"], "processing");

    let forced = keys(&test_store, &["release", "live", "--force", "--json"]).await;
    assert!(forced.status.success(), "{}", stdout(&forced));
    assert_eq!(json(&forced)["released"], true);
    assert_eq!(json(&forced)["record"]["status"], "failed");
}

#[tokio::test]
async fn release_never_touches_a_completed_key_and_asks_which_scope() {
    let test_store = TestStore::create(Backend::Sqlite).await;
    let store = test_store.open().await;
    complete(&*store, request("done", 1, LONG, DAY)).await;
    let output = keys(&test_store, &["release", "done", "--force"]).await;
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stdout(&output).contains("the key is completed"),
        "{}",
        stdout(&output)
    );

    let mut elsewhere = request("done", 1, LONG, DAY);
    elsewhere.id.scope = "default:other".into();
    won(&*store, &elsewhere).await;
    let ambiguous = keys(&test_store, &["release", "done"]).await;
    assert_eq!(ambiguous.status.code(), Some(1));
    assert!(
        stdout(&ambiguous).contains("pass --scope"),
        "{}",
        stdout(&ambiguous)
    );
    let scoped = keys(
        &test_store,
        &["release", "done", "--scope", "default:other", "--force"],
    )
    .await;
    assert!(scoped.status.success(), "{}", stdout(&scoped));
}

async fn complete(store: &dyn Store, claim: idemproxy::store::ClaimRequest) {
    won(store, &claim).await;
    assert!(store.complete(&claim.id, &response(b"ok")).await.unwrap());
}

#[rstest]
#[tokio::test]
async fn purge_deletes_expired_records_and_stats_count_the_rest(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let test_store = TestStore::create(backend).await;
    let store = test_store.open().await;
    for i in 0..3 {
        complete(
            &*store,
            request(&format!("old-{i}"), 1, LONG, Duration::from_millis(200)),
        )
        .await;
    }
    complete(&*store, request("kept", 1, LONG, DAY)).await;
    won(&*store, &request("running", 1, LONG, DAY)).await;
    tokio::time::sleep(Duration::from_millis(600)).await;

    // Redis deletes a record when it expires, leaving nothing to purge.
    let expired = if backend.self_expiring() { 0 } else { 3 };
    let before = json(&keys(&test_store, &["stats", "--json"]).await);
    assert_eq!(
        before,
        serde_json::json!({"processing": 1, "completed": 1, "failed": 0, "unknown": 0, "expired": expired})
    );
    let purged = keys(&test_store, &["purge", "--expired"]).await;
    assert!(purged.status.success());
    assert_eq!(stdout(&purged), format!("deleted {expired} expired records\n"));
    let after = keys(&test_store, &["stats"]).await;
    assert!(stdout(&after).contains("expired     0"), "{}", stdout(&after));
    assert!(stdout(&after).contains("completed   1"), "{}", stdout(&after));
}

#[tokio::test]
async fn purge_requires_saying_expired() {
    let store = TestStore::create(Backend::Sqlite).await;
    let output = keys(&store, &["purge"]).await;
    assert_eq!(output.status.code(), Some(2), "clap's usage error");
    assert!(String::from_utf8_lossy(&output.stderr).contains("--expired"));
}

#[tokio::test]
async fn a_missing_sqlite_file_is_named_not_created() {
    let store = TestStore::create(Backend::Sqlite).await;
    let output = keys(&store, &["stats"]).await;
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no SQLite store at"), "{stderr}");
    assert!(!store.sqlite_path().exists(), "a tool never creates the store");
}
