//! What only PostgreSQL has to prove: replicas migrating at once, and claims racing a transaction that
//! commits after the claim statement's snapshot. The rest of the store's behaviour is in `store::suite`.

use idemproxy::Config;
use idemproxy::store::postgres::PostgresStore;
use idemproxy::store::{ClaimResult, Existing};
use uuid::Uuid;

use crate::store::suite::{DAY, LONG, request, store};
use crate::support::Backend;
use crate::support::pg::TestDb;

#[tokio::test]
async fn migrations_are_safe_when_replicas_start_together() {
    let db = TestDb::create().await;
    let config = Config::from_toml_str(&format!("[store]\nurl = \"{}\"\n", db.url())).unwrap();
    let runs = (0..4).map(|_| {
        let config = config.store.clone();
        tokio::spawn(async move { PostgresStore::migrate(&config).await })
    });
    let mut applied = 0;
    for run in runs {
        applied += run.await.unwrap().expect("every concurrent migrate succeeds");
    }
    let migrations = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/postgres"))
        .unwrap()
        .count();
    assert_eq!(applied, migrations, "each migration is applied exactly once");
}

/// The winner's row is committed after the claim statement took its snapshot: the claim waits on the
/// row, cannot see it in its snapshot, and must still report it (here: a completed record to replay).
#[tokio::test]
async fn row_committed_after_the_claims_snapshot_is_still_seen() {
    let (test_store, store) = store(Backend::Postgres).await;
    let db = test_store.pg();
    let (mut writer, connection) = tokio_postgres::connect(&db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let concurrent = writer.transaction().await.unwrap();
    concurrent
        .execute(
            "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                 locked_until, created_at, expires_at, updated_at, response_status, response_header_names,
                 response_header_values, response_body, body_retained)
             VALUES ('default:test', 'late', $1, 'completed', $2, 1, 'new', now(), now(),
                 now() + interval '1 day', now(), 200, '{}', '{}', 'late body', true)",
            &[&vec![1u8; 32], &Uuid::new_v4()],
        )
        .await
        .unwrap();

    let claimer = {
        let store = store.clone();
        tokio::spawn(async move { store.claim(&request("late", 1, LONG, DAY)).await })
    };
    db.wait_for_a_lock_waiter().await;
    concurrent.commit().await.unwrap();

    match claimer.await.unwrap().expect("claim runs") {
        ClaimResult::Held(Existing::Completed {
            same_fingerprint: true,
            response,
            ..
        }) => assert_eq!(response.body.as_deref(), Some(&b"late body"[..])),
        other => panic!("expected the concurrently committed record, got {other:?}"),
    }
}
