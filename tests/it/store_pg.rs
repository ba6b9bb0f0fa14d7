//! The PostgreSQL store through its trait: the claim's decision table, fencing, leases and expiry, on a real
//! database. Lease and expiry waits are real time (the database clock decides), kept short.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemproxy::Config;
use idemproxy::store::postgres::PostgresStore;
use idemproxy::store::{ClaimKind, ClaimRequest, ClaimResult, Existing, RecordId, Store, StoredResponse};
use uuid::Uuid;

use crate::support::pg::TestDb;

const LONG: Duration = Duration::from_secs(30);
const DAY: Duration = Duration::from_secs(86_400);

async fn store() -> (TestDb, Arc<PostgresStore>) {
    let db = TestDb::create().await;
    let config = Config::from_toml_str(&format!("[store]\nurl = \"{}\"\ntimeout = \"5s\"\n", db.url()))
        .expect("valid test config");
    PostgresStore::migrate(&config.store)
        .await
        .expect("migrations apply");
    let store = PostgresStore::connect(&config.store).expect("pool builds");
    (db, Arc::new(store))
}

fn request(key: &str, fingerprint: u8, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        id: RecordId {
            scope: "default:test".into(),
            key: key.into(),
            token: Uuid::new_v4(),
        },
        fingerprint: [fingerprint; 32],
        lease,
        ttl,
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: Some(Bytes::from_static(body)),
    }
}

async fn won(store: &PostgresStore, request: &ClaimRequest) -> (i32, ClaimKind) {
    match store.claim(request).await.expect("claim runs") {
        ClaimResult::Won { attempt, kind } => (attempt, kind),
        ClaimResult::Held(existing) => panic!("expected to win the claim, found {existing:?}"),
    }
}

async fn held(store: &PostgresStore, request: &ClaimRequest) -> Existing {
    match store.claim(request).await.expect("claim runs") {
        ClaimResult::Held(existing) => existing,
        won => panic!("expected the key to be held, but the claim won: {won:?}"),
    }
}

#[tokio::test]
async fn concurrent_claims_of_one_key_have_exactly_one_winner() {
    let (_db, store) = store().await;
    assert_eq!(
        concurrent_winners(&store, "race").await,
        vec![(1, ClaimKind::New)]
    );
}

/// The winners among 50 concurrent claims of `key`; every loser must see the winner's live claim with
/// its real lease (not the contention fallback).
async fn concurrent_winners(store: &Arc<PostgresStore>, key: &'static str) -> Vec<(i32, ClaimKind)> {
    let claims: Vec<_> = (0..50)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request(key, 1, LONG, DAY)).await })
        })
        .collect();
    let mut winners = Vec::new();
    for claim in claims {
        match claim.await.unwrap().expect("claim runs") {
            ClaimResult::Won { attempt, kind } => winners.push((attempt, kind)),
            ClaimResult::Held(Existing::Processing {
                same_fingerprint: true,
                lease_remaining,
            }) => assert!(lease_remaining > Duration::from_secs(20), "{lease_remaining:?}"),
            other => panic!("a loser must see the winner's live claim, saw {other:?}"),
        }
    }
    winners
}

#[tokio::test]
async fn concurrent_takeovers_of_a_stale_claim_have_exactly_one_winner() {
    let (_db, store) = store().await;
    won(&store, &request("stale-race", 1, Duration::from_millis(200), DAY)).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        concurrent_winners(&store, "stale-race").await,
        vec![(2, ClaimKind::Takeover)]
    );
}

#[tokio::test]
async fn concurrent_retries_of_a_released_key_have_exactly_one_winner() {
    let (_db, store) = store().await;
    let first = request("retry-race", 1, LONG, DAY);
    won(&store, &first).await;
    assert!(store.release(&first.id).await.unwrap());
    assert_eq!(
        concurrent_winners(&store, "retry-race").await,
        vec![(2, ClaimKind::Retry)]
    );
}

#[tokio::test]
async fn completed_record_replays_for_the_same_fingerprint_only() {
    let (_db, store) = store().await;
    let first = request("done", 1, LONG, DAY);
    won(&store, &first).await;
    assert!(store.complete(&first.id, &response(b"{\"id\":1}")).await.unwrap());
    match held(&store, &request("done", 1, LONG, DAY)).await {
        Existing::Completed {
            same_fingerprint: true,
            response: stored,
            expires_in,
        } => {
            assert_eq!(stored, response(b"{\"id\":1}"));
            assert!(
                expires_in > DAY - Duration::from_secs(60) && expires_in <= DAY,
                "{expires_in:?}"
            );
        }
        other => panic!("expected a replayable record, got {other:?}"),
    }
    assert!(matches!(
        held(&store, &request("done", 2, LONG, DAY)).await,
        Existing::Completed {
            same_fingerprint: false,
            ..
        }
    ));
}

#[tokio::test]
async fn live_claim_reports_its_remaining_lease() {
    let (_db, store) = store().await;
    won(&store, &request("live", 1, LONG, DAY)).await;
    match held(&store, &request("live", 1, LONG, DAY)).await {
        Existing::Processing {
            same_fingerprint: true,
            lease_remaining,
        } => assert!(
            lease_remaining > Duration::from_secs(20) && lease_remaining <= LONG,
            "{lease_remaining:?}"
        ),
        other => panic!("expected a live claim, got {other:?}"),
    }
    assert!(matches!(
        held(&store, &request("live", 2, LONG, DAY)).await,
        Existing::Processing {
            same_fingerprint: false,
            ..
        }
    ));
}

#[tokio::test]
async fn stale_claim_is_taken_over_and_the_old_token_is_fenced_out() {
    let (_db, store) = store().await;
    let original = request("stale", 1, Duration::from_millis(300), DAY);
    won(&store, &original).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let taker = request("stale", 1, LONG, DAY);
    assert_eq!(won(&store, &taker).await, (2, ClaimKind::Takeover));

    assert!(
        !store.heartbeat(&original.id, LONG).await.unwrap(),
        "old heartbeat fenced"
    );
    assert!(
        !store.complete(&original.id, &response(b"old")).await.unwrap(),
        "old completion fenced"
    );
    assert!(!store.release(&original.id).await.unwrap(), "old release fenced");
    assert!(store.complete(&taker.id, &response(b"new")).await.unwrap());
    match held(&store, &request("stale", 1, LONG, DAY)).await {
        Existing::Completed { response: stored, .. } => assert_eq!(stored.body.as_deref(), Some(&b"new"[..])),
        other => panic!("expected the taker's response, got {other:?}"),
    }
}

#[tokio::test]
async fn heartbeat_extends_the_lease() {
    let (_db, store) = store().await;
    let claim = request("beat", 1, Duration::from_millis(500), DAY);
    won(&store, &claim).await;
    assert!(store.heartbeat(&claim.id, LONG).await.unwrap());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        matches!(
            held(&store, &request("beat", 1, LONG, DAY)).await,
            Existing::Processing { .. }
        ),
        "a renewed claim is not stale"
    );
}

#[tokio::test]
async fn released_key_executes_again_for_the_same_request_only() {
    let (_db, store) = store().await;
    let first = request("again", 1, LONG, DAY);
    won(&store, &first).await;
    assert!(store.release(&first.id).await.unwrap());
    assert!(matches!(
        held(&store, &request("again", 2, LONG, DAY)).await,
        Existing::Failed
    ));
    assert_eq!(
        won(&store, &request("again", 1, LONG, DAY)).await,
        (2, ClaimKind::Retry)
    );
}

#[tokio::test]
async fn expired_record_is_a_new_key_whatever_it_held() {
    let (_db, store) = store().await;
    let first = request("old", 1, Duration::from_millis(100), Duration::from_millis(300));
    won(&store, &first).await;
    assert!(store.complete(&first.id, &response(b"x")).await.unwrap());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        won(&store, &request("old", 2, LONG, DAY)).await,
        (1, ClaimKind::New)
    );
}

#[tokio::test]
async fn response_over_the_cap_is_completed_without_a_body() {
    let (_db, store) = store().await;
    let claim = request("big", 1, LONG, DAY);
    won(&store, &claim).await;
    let mut stored = response(b"");
    stored.body = None;
    assert!(store.complete(&claim.id, &stored).await.unwrap());
    match held(&store, &request("big", 1, LONG, DAY)).await {
        Existing::Completed { response, .. } => {
            assert_eq!(response.status, 201);
            assert_eq!(response.body, None);
        }
        other => panic!("expected a completed record, got {other:?}"),
    }
}

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
    assert_eq!(applied, 1, "the one migration is applied exactly once");
}

/// The winner's row is committed after the claim statement took its snapshot: the claim waits on the
/// row, cannot see it in its snapshot, and must still report it (here: a completed record to replay).
#[tokio::test]
async fn row_committed_after_the_claims_snapshot_is_still_seen() {
    let (db, store) = store().await;
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
