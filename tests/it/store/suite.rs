//! One store suite, written once against the `Store` trait and run on every backend (PostgreSQL, the
//! embedded SQLite file, one Redis server, a Redis Cluster, and PostgreSQL with the key table distributed
//! by Citus where `IDEMPROXY_TEST_CITUS_URL` names a coordinator): the claim's decision table, fencing,
//! leases and expiry, the sweeper's batches and replica safety (or Redis's own expiry), and the
//! operator's view (`keys show`, `stats`, `list` and `forget`). Lease and expiry waits are real time (the store's clock
//! decides), kept short.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idemproxy::store::{
    ClaimKind, ClaimRequest, ClaimResult, Existing, ListQuery, RecordId, RecordState, RecordStats,
    RecordStatus, ScopeFilter, Store, StoredResponse,
};
use rstest::rstest;
use uuid::Uuid;

use crate::support::Backend::{self, Citus, Postgres, Redis, RedisCluster, Sqlite};
use crate::support::{TestStore, unless_skipped};

pub const LONG: Duration = Duration::from_secs(30);
pub const DAY: Duration = Duration::from_secs(86_400);

pub async fn store(backend: Backend) -> (TestStore, Arc<dyn Store>) {
    let test_store = TestStore::create(backend).await;
    let store = test_store.open().await;
    (test_store, store)
}

/// The suite's store on `backend`; where the backend is skipped here (Citus without a coordinator, said
/// on stderr), the test returns at once.
macro_rules! suite_store {
    ($backend:expr) => {{
        unless_skipped!($backend);
        store($backend).await
    }};
}

pub fn request(key: &str, fingerprint: u8, lease: Duration, ttl: Duration) -> ClaimRequest {
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

pub fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: Some(Bytes::from_static(body)),
    }
}

pub async fn won(store: &dyn Store, request: &ClaimRequest) -> (i32, ClaimKind) {
    let (attempt, kind, _) = won_expiring(store, request).await;
    (attempt, kind)
}

/// Wins `request`'s claim: its attempt, its kind and the time to expiry it reports.
pub async fn won_expiring(store: &dyn Store, request: &ClaimRequest) -> (i32, ClaimKind, Duration) {
    match store.claim(request).await.expect("claim runs") {
        ClaimResult::Won {
            attempt,
            kind,
            expires_in,
        } => (attempt, kind, expires_in),
        ClaimResult::Held(existing) => panic!("expected to win the claim, found {existing:?}"),
    }
}

pub async fn held(store: &dyn Store, request: &ClaimRequest) -> Existing {
    match store.claim(request).await.expect("claim runs") {
        ClaimResult::Held(existing) => existing,
        won => panic!("expected the key to be held, but the claim won: {won:?}"),
    }
}

#[rstest]
#[tokio::test]
async fn concurrent_claims_of_one_key_have_exactly_one_winner(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    assert_eq!(
        concurrent_winners(&store, "race").await,
        vec![(1, ClaimKind::New)]
    );
}

/// The winners among 50 concurrent claims of `key`; every loser must see the winner's live claim with
/// its real lease (not the contention fallback).
async fn concurrent_winners(store: &Arc<dyn Store>, key: &'static str) -> Vec<(i32, ClaimKind)> {
    let claims: Vec<_> = (0..50)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.claim(&request(key, 1, LONG, DAY)).await })
        })
        .collect();
    let mut winners = Vec::new();
    for claim in claims {
        match claim.await.unwrap().expect("claim runs") {
            ClaimResult::Won { attempt, kind, .. } => winners.push((attempt, kind)),
            ClaimResult::Held(Existing::Processing {
                same_fingerprint: true,
                lease_remaining,
            }) => assert!(lease_remaining > Duration::from_secs(20), "{lease_remaining:?}"),
            other => panic!("a loser must see the winner's live claim, saw {other:?}"),
        }
    }
    winners
}

#[rstest]
#[tokio::test]
async fn concurrent_takeovers_of_a_stale_claim_have_exactly_one_winner(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    won(
        &*store,
        &request("stale-race", 1, Duration::from_millis(200), DAY),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        concurrent_winners(&store, "stale-race").await,
        vec![(2, ClaimKind::Takeover)]
    );
}

#[rstest]
#[tokio::test]
async fn concurrent_retries_of_a_released_key_have_exactly_one_winner(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let first = request("retry-race", 1, LONG, DAY);
    won(&*store, &first).await;
    assert!(store.release(&first.id).await.unwrap());
    assert_eq!(
        concurrent_winners(&store, "retry-race").await,
        vec![(2, ClaimKind::Retry)]
    );
}

#[rstest]
#[tokio::test]
async fn completed_record_replays_for_the_same_fingerprint_only(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let first = request("done", 1, LONG, DAY);
    won(&*store, &first).await;
    assert!(store.complete(&first.id, &response(b"{\"id\":1}")).await.unwrap());
    match held(&*store, &request("done", 1, LONG, DAY)).await {
        Existing::Completed {
            same_fingerprint: true,
            response: stored,
            expires_in,
            token,
        } => {
            assert_eq!(stored, response(b"{\"id\":1}"));
            assert_eq!(token, first.id.token, "the epoch is the completing claim's token");
            assert!(
                expires_in > DAY - Duration::from_secs(60) && expires_in <= DAY,
                "{expires_in:?}"
            );
        }
        other => panic!("expected a replayable record, got {other:?}"),
    }
    assert!(matches!(
        held(&*store, &request("done", 2, LONG, DAY)).await,
        Existing::Completed {
            same_fingerprint: false,
            ..
        }
    ));
}

#[rstest]
#[tokio::test]
async fn live_claim_reports_its_remaining_lease(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    won(&*store, &request("live", 1, LONG, DAY)).await;
    match held(&*store, &request("live", 1, LONG, DAY)).await {
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
        held(&*store, &request("live", 2, LONG, DAY)).await,
        Existing::Processing {
            same_fingerprint: false,
            ..
        }
    ));
}

#[rstest]
#[tokio::test]
async fn stale_claim_is_taken_over_and_the_old_token_is_fenced_out(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let original = request("stale", 1, Duration::from_millis(300), DAY);
    won(&*store, &original).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let taker = request("stale", 1, LONG, DAY);
    assert_eq!(won(&*store, &taker).await, (2, ClaimKind::Takeover));

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
    match held(&*store, &request("stale", 1, LONG, DAY)).await {
        Existing::Completed { response: stored, .. } => assert_eq!(stored.body.as_deref(), Some(&b"new"[..])),
        other => panic!("expected the taker's response, got {other:?}"),
    }
}

#[rstest]
#[tokio::test]
async fn heartbeat_extends_the_lease(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let claim = request("beat", 1, Duration::from_millis(500), DAY);
    won(&*store, &claim).await;
    assert!(store.heartbeat(&claim.id, LONG).await.unwrap());
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        matches!(
            held(&*store, &request("beat", 1, LONG, DAY)).await,
            Existing::Processing { .. }
        ),
        "a renewed claim is not stale"
    );
}

#[rstest]
#[tokio::test]
async fn released_key_executes_again_for_the_same_request_only(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let first = request("again", 1, LONG, DAY);
    won(&*store, &first).await;
    assert!(store.release(&first.id).await.unwrap());
    assert!(matches!(
        held(&*store, &request("again", 2, LONG, DAY)).await,
        Existing::Failed
    ));
    assert_eq!(
        won(&*store, &request("again", 1, LONG, DAY)).await,
        (2, ClaimKind::Retry)
    );
}

#[rstest]
#[tokio::test]
async fn expired_record_is_a_new_key_whatever_it_held(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let first = request("old", 1, Duration::from_millis(100), Duration::from_millis(300));
    won(&*store, &first).await;
    assert!(store.complete(&first.id, &response(b"x")).await.unwrap());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        won(&*store, &request("old", 2, LONG, DAY)).await,
        (1, ClaimKind::New)
    );
}

#[rstest]
#[tokio::test]
async fn a_running_key_past_its_expiry_is_not_new(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let running = request("running", 1, LONG, SHORT_TTL);
    won(&*store, &running).await;
    until_short_ttl_passed().await;
    for fingerprint in [1, 2] {
        match held(&*store, &request("running", fingerprint, LONG, DAY)).await {
            Existing::Processing { lease_remaining, .. } => {
                assert!(lease_remaining > LONG / 2, "{lease_remaining:?}")
            }
            other => panic!("a running key must stay in flight, found {other:?}"),
        }
    }
    assert!(store.heartbeat(&running.id, LONG).await.unwrap());
    let record = store.find("running", None).await.unwrap().remove(0);
    assert!(
        record.expires_at >= record.locked_until,
        "a heartbeat keeps the expiry at least as late as the lease: {record:?}"
    );
    assert!(!record.expired());
    assert!(store.complete(&running.id, &response(b"done")).await.unwrap());
}

#[rstest]
#[tokio::test]
async fn a_takeover_keeps_the_expiry_at_least_as_late_as_its_lease(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    // Expires one second after creation, so it is unexpired when its short lease has run out.
    won(&*store, &request("stale", 1, SHORT_TTL, Duration::from_secs(1))).await;
    until_short_ttl_passed().await;
    let taker = request("stale", 1, LONG, DAY);
    assert_eq!(won(&*store, &taker).await, (2, ClaimKind::Takeover));
    let record = store.find("stale", None).await.unwrap().remove(0);
    assert!(record.expires_at >= record.locked_until, "{record:?}");
}

const HOUR: Duration = Duration::from_secs(3_600);

/// Wins `request`'s claim, checking that the time to expiry it reports is the record's expiry as the
/// store holds it: never later (the proxy announces it to clients), and no earlier than the claim's own
/// round trip allows. Returns the attempt, the kind and the time reported.
async fn won_reporting_its_expiry(store: &dyn Store, request: &ClaimRequest) -> (i32, ClaimKind, Duration) {
    let sent = SystemTime::now();
    let (attempt, kind, expires_in) = won_expiring(store, request).await;
    let answered = SystemTime::now();
    let record = store.find(&request.id.key, None).await.unwrap().remove(0);
    // The store reports to the millisecond, rounded up; `keys show` reads the expiry to the millisecond.
    let ms = Duration::from_millis(1);
    assert!(
        sent + expires_in.saturating_sub(ms) <= record.expires_at,
        "reported {expires_in:?}, later than the record's expiry: {record:?}"
    );
    assert!(
        record.expires_at <= answered + expires_in + ms,
        "reported {expires_in:?}, earlier than the record's expiry: {record:?}"
    );
    (attempt, kind, expires_in)
}

#[rstest]
#[tokio::test]
async fn a_retry_and_a_takeover_report_the_expiry_they_keep(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let (_, _, new) = won_reporting_its_expiry(&*store, &request("kept", 1, SHORT_TTL, HOUR)).await;
    assert!(
        new <= HOUR && new > HOUR - LONG,
        "a new key expires its TTL after: {new:?}"
    );
    until_short_ttl_passed().await;
    // The retry and the takeover ask for a day: the record keeps the hour it was created with.
    let taker = request("kept", 1, LONG, DAY);
    let (attempt, kind, taken) = won_reporting_its_expiry(&*store, &taker).await;
    assert_eq!((attempt, kind), (2, ClaimKind::Takeover));
    assert!(
        taken <= new && taken > HOUR - LONG,
        "a takeover keeps the expiry: {taken:?}"
    );
    assert!(store.release(&taker.id).await.unwrap());
    let (attempt, kind, retried) = won_reporting_its_expiry(&*store, &request("kept", 1, LONG, DAY)).await;
    assert_eq!((attempt, kind), (3, ClaimKind::Retry));
    assert!(
        retried <= taken && retried > HOUR - LONG,
        "a retry keeps the expiry: {retried:?}"
    );

    // A record about to expire is kept at least until the new lease ends, and says so.
    won(&*store, &request("ending", 1, SHORT_TTL, Duration::from_secs(1))).await;
    until_short_ttl_passed().await;
    let (attempt, kind, moved) = won_reporting_its_expiry(&*store, &request("ending", 1, LONG, DAY)).await;
    assert_eq!((attempt, kind), (2, ClaimKind::Takeover));
    assert!(
        moved <= LONG && moved > LONG / 2,
        "the expiry moves to the lease's end: {moved:?}"
    );
}

#[rstest]
#[tokio::test]
async fn a_held_outcome_is_never_claimed_until_an_operator_releases_it(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let first = request("unsure", 1, SHORT_TTL, DAY);
    won(&*store, &first).await;
    let mut other_token = first.id.clone();
    other_token.token = Uuid::new_v4();
    assert!(!store.hold(&other_token).await.unwrap(), "holding is fenced");
    assert!(store.hold(&first.id).await.unwrap());
    until_short_ttl_passed().await;
    assert!(matches!(
        held(&*store, &request("unsure", 1, LONG, DAY)).await,
        Existing::Unknown {
            same_fingerprint: true
        }
    ));
    assert!(matches!(
        held(&*store, &request("unsure", 2, LONG, DAY)).await,
        Existing::Unknown {
            same_fingerprint: false
        }
    ));
    let record = store.find("unsure", None).await.unwrap().remove(0);
    assert_eq!(record.status, RecordStatus::Unknown);
    assert!(!store.complete(&first.id, &response(b"late")).await.unwrap());
    assert!(
        store.release_stale(&first.id).await.unwrap(),
        "an operator releases it"
    );
    assert_eq!(
        won(&*store, &request("unsure", 1, LONG, DAY)).await,
        (2, ClaimKind::Retry)
    );
}

#[rstest]
#[tokio::test]
async fn response_over_the_cap_is_completed_without_a_body(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let claim = request("big", 1, LONG, DAY);
    won(&*store, &claim).await;
    let mut stored = response(b"");
    stored.body = None;
    assert!(store.complete(&claim.id, &stored).await.unwrap());
    match held(&*store, &request("big", 1, LONG, DAY)).await {
        Existing::Completed { response, .. } => {
            assert_eq!(response.status, 201);
            assert_eq!(response.body, None);
        }
        other => panic!("expected a completed record, got {other:?}"),
    }
}

/// Creates `count` completed records under `prefix` that expire after `ttl`.
pub async fn completed_records(store: &dyn Store, prefix: &str, count: usize, ttl: Duration) {
    for i in 0..count {
        let claim = request(&format!("{prefix}-{i}"), 1, LONG, ttl);
        won(store, &claim).await;
        assert!(store.complete(&claim.id, &response(b"done")).await.unwrap());
    }
}

pub const SHORT_TTL: Duration = Duration::from_millis(200);

/// Long enough for a `SHORT_TTL` record to be past its expiry by any clock the store uses.
pub async fn until_short_ttl_passed() {
    tokio::time::sleep(SHORT_TTL * 3).await;
}

#[rstest]
#[tokio::test]
async fn sweep_deletes_expired_records_in_bounded_batches(#[values(Postgres, Sqlite)] backend: Backend) {
    let (_store, store) = suite_store!(backend);
    completed_records(&*store, "old", 25, SHORT_TTL).await;
    completed_records(&*store, "live", 3, DAY).await;
    until_short_ttl_passed().await;

    let mut batches = Vec::new();
    loop {
        let deleted = store.sweep(10).await.unwrap();
        batches.push(deleted);
        if deleted == 0 {
            break;
        }
    }
    assert_eq!(batches, vec![10, 10, 5, 0]);
    assert!(store.find("old-0", None).await.unwrap().is_empty());
    assert_eq!(store.find("live-0", None).await.unwrap().len(), 1);
    assert_eq!(
        store.stats().await.unwrap(),
        RecordStats {
            completed: 3,
            ..RecordStats::default()
        }
    );
}

#[rstest]
#[tokio::test]
async fn sweep_keeps_an_expired_processing_record_until_its_lease_runs_out(
    #[values(Postgres, Sqlite, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    won(&*store, &request("held", 1, LONG, SHORT_TTL)).await;
    won(&*store, &request("stale", 1, SHORT_TTL, SHORT_TTL)).await;
    until_short_ttl_passed().await;

    assert_eq!(
        store.sweep(100).await.unwrap(),
        1,
        "only the record past both bounds"
    );
    assert!(store.find("stale", None).await.unwrap().is_empty());
    let held = store.find("held", None).await.unwrap();
    assert_eq!(held.len(), 1, "a live lease keeps its record");
    assert_eq!(held[0].status, RecordStatus::Processing);
}

#[rstest]
#[tokio::test]
async fn concurrent_sweepers_delete_and_count_each_record_once(
    #[values(Postgres, Sqlite, Citus)] backend: Backend,
) {
    let (test_store, store) = suite_store!(backend);
    completed_records(&*store, "gone", 120, SHORT_TTL).await;
    until_short_ttl_passed().await;

    // Each sweeper has its own connections, as replicas do.
    let mut sweepers = Vec::new();
    for _ in 0..4 {
        let replica = test_store.open().await;
        sweepers.push(tokio::spawn(async move {
            let mut counted = 0;
            loop {
                let deleted = replica.sweep(7).await.expect("sweep runs");
                counted += deleted;
                if deleted == 0 {
                    return counted;
                }
            }
        }));
    }
    let mut total = 0;
    for sweeper in sweepers {
        total += sweeper.await.unwrap();
    }
    assert_eq!(total, 120, "every record deleted and counted exactly once");
    assert_eq!(store.stats().await.unwrap(), RecordStats::default());
}

#[rstest]
#[tokio::test]
async fn stats_count_records_by_state(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    won(&*store, &request("running", 1, LONG, DAY)).await;
    completed_records(&*store, "done", 2, DAY).await;
    let released = request("released", 1, LONG, DAY);
    won(&*store, &released).await;
    assert!(store.release(&released.id).await.unwrap());
    let unsure = request("unsure", 1, LONG, DAY);
    won(&*store, &unsure).await;
    assert!(store.hold(&unsure.id).await.unwrap());
    completed_records(&*store, "old", 1, SHORT_TTL).await;
    until_short_ttl_passed().await;

    assert_eq!(
        store.stats().await.unwrap(),
        RecordStats {
            processing: 1,
            completed: 2,
            failed: 1,
            unknown: 1,
            // Redis deletes a record when it expires; the SQL stores keep it for the sweeper.
            expired: if backend.self_expiring() { 0 } else { 1 },
        }
    );
}

#[rstest]
#[tokio::test]
async fn redis_deletes_expired_records_itself_but_keeps_a_running_one(
    #[values(Redis, RedisCluster)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    completed_records(&*store, "old", 25, SHORT_TTL).await;
    completed_records(&*store, "live", 3, DAY).await;
    won(&*store, &request("held", 1, LONG, SHORT_TTL)).await;
    won(&*store, &request("stale", 1, SHORT_TTL, SHORT_TTL)).await;
    until_short_ttl_passed().await;

    assert_eq!(store.sweep(10).await.unwrap(), 0, "nothing is left to sweep");
    assert!(store.find("old-0", None).await.unwrap().is_empty());
    assert!(store.find("stale", None).await.unwrap().is_empty());
    let held = store.find("held", None).await.unwrap();
    assert_eq!(held.len(), 1, "a live lease keeps its record");
    assert_eq!(held[0].status, RecordStatus::Processing);
    assert!(held[0].expired(), "past its expiry, kept by its lease");
    assert_eq!(
        store.stats().await.unwrap(),
        RecordStats {
            completed: 3,
            expired: 1,
            ..RecordStats::default()
        }
    );
}

#[rstest]
#[tokio::test]
async fn find_describes_records_in_every_scope_or_one(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let mine = request("shared", 1, LONG, DAY);
    won(&*store, &mine).await;
    assert!(store.complete(&mine.id, &response(b"12345")).await.unwrap());
    let mut theirs = request("shared", 1, LONG, DAY);
    theirs.id.scope = "default:other".into();
    won(&*store, &theirs).await;

    let all = store.find("shared", None).await.unwrap();
    assert_eq!(all.len(), 2);
    let only = store.find("shared", Some("default:test")).await.unwrap();
    assert_eq!(only.len(), 1);
    let record = &only[0];
    assert_eq!(record.status, RecordStatus::Completed);
    assert_eq!(record.attempt, 1);
    assert_eq!(record.claim_kind, ClaimKind::New);
    assert_eq!(record.token, mine.id.token);
    assert_eq!(record.response_status, Some(201));
    assert_eq!(record.response_bytes, Some(5));
    assert_eq!(record.body_retained, Some(true));
    assert!(!record.expired());
    let expiry = record.expires_at.duration_since(record.observed_at).unwrap();
    assert!(expiry > DAY - Duration::from_secs(60), "{expiry:?}");
    assert!(store.find("absent", None).await.unwrap().is_empty());
}

#[rstest]
#[tokio::test]
async fn operator_release_waits_for_the_lease_and_is_fenced(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let live = request("live", 1, LONG, DAY);
    won(&*store, &live).await;
    assert!(
        !store.release_stale(&live.id).await.unwrap(),
        "a live lease is not released"
    );

    let stuck = request("stuck", 1, SHORT_TTL, DAY);
    won(&*store, &stuck).await;
    until_short_ttl_passed().await;
    let mut stale_token = stuck.id.clone();
    stale_token.token = Uuid::new_v4();
    assert!(
        !store.release_stale(&stale_token).await.unwrap(),
        "another token is fenced out"
    );
    assert!(store.release_stale(&stuck.id).await.unwrap());
    assert_eq!(
        won(&*store, &request("stuck", 1, LONG, DAY)).await,
        (2, ClaimKind::Retry),
        "the next retry executes"
    );

    let done = request("done", 1, SHORT_TTL, DAY);
    won(&*store, &done).await;
    assert!(store.complete(&done.id, &response(b"x")).await.unwrap());
    until_short_ttl_passed().await;
    assert!(
        !store.release_stale(&done.id).await.unwrap(),
        "a completed record stays completed"
    );
}

/// Every record `keys list` pages reach from the start, in pages of at most `limit` (a Redis page, one
/// `SCAN` step, may hold a few more), with its state.
async fn walk(
    store: &dyn Store,
    backend: Backend,
    scope: ScopeFilter,
    states: &[RecordState],
    limit: u32,
) -> Vec<(String, String, RecordState)> {
    let mut seen = Vec::new();
    let mut after = None;
    // A Redis server is shared by the tests: a page may be a SCAN step over other tests' records only.
    for _ in 0..1_000_000 {
        let query = ListQuery {
            scope: scope.clone(),
            states: states.to_vec(),
            after: after.take(),
            limit,
            examine: limit,
        };
        let page = store.list(&query).await.expect("list runs");
        if !backend.self_expiring() {
            assert!(page.records.len() <= limit as usize, "{page:?}");
            assert!(page.examined <= limit, "{page:?}");
        }
        let found = page
            .records
            .iter()
            .map(|r| (r.scope.clone(), r.key.clone(), r.state()));
        seen.extend(found);
        match page.next {
            Some(next) => after = Some(next),
            None => {
                seen.sort();
                return seen;
            }
        }
    }
    panic!("the walk never reached the end");
}

fn in_scope(scope: &str, key: &str, fingerprint: u8) -> ClaimRequest {
    let mut claim = request(key, fingerprint, LONG, DAY);
    claim.id.scope = scope.into();
    claim
}

#[rstest]
#[tokio::test]
async fn list_pages_reach_every_record_once_by_scope_name_scope_and_state(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let scopes = ["orders:aa", "orders:bb", "orders2:aa", "refunds:aa"];
    let mut all = Vec::new();
    for scope in scopes {
        for i in 0..4 {
            let claim = in_scope(scope, &format!("k{i}"), 1);
            won(&*store, &claim).await;
            let state = if i == 0 {
                RecordState::InFlight
            } else {
                assert!(store.complete(&claim.id, &response(b"ok")).await.unwrap());
                RecordState::Completed
            };
            all.push((scope.to_owned(), format!("k{i}"), state));
        }
    }
    all.sort();
    let of = |wanted: &dyn Fn(&(String, String, RecordState)) -> bool| -> Vec<_> {
        all.iter().filter(|r| wanted(r)).cloned().collect()
    };

    assert_eq!(walk(&*store, backend, ScopeFilter::All, &[], 3).await, all);
    assert_eq!(
        walk(&*store, backend, ScopeFilter::Named("orders".into()), &[], 2).await,
        of(&|r| r.0.starts_with("orders:")),
        "a scope name's records, not those of a name it begins"
    );
    assert_eq!(
        walk(&*store, backend, ScopeFilter::Exact("orders:bb".into()), &[], 3).await,
        of(&|r| r.0 == "orders:bb")
    );
    assert_eq!(
        walk(&*store, backend, ScopeFilter::All, &[RecordState::InFlight], 3).await,
        of(&|r| r.2 == RecordState::InFlight)
    );
}

#[rstest]
#[tokio::test]
async fn a_cursor_the_store_did_not_print_is_refused(#[values(Postgres, Sqlite, Redis)] backend: Backend) {
    let (_store, store) = suite_store!(backend);
    let query = ListQuery {
        scope: ScopeFilter::All,
        states: Vec::new(),
        after: Some("not a cursor".into()),
        limit: 10,
        examine: 10,
    };
    let error = store.list(&query).await.expect_err("refused");
    assert!(
        error.to_string().contains("not a cursor this store printed"),
        "{error}"
    );
}

#[rstest]
#[tokio::test]
async fn forget_deletes_the_record_it_was_shown_and_the_key_is_new_again(
    #[values(Postgres, Sqlite, Redis, RedisCluster, Citus)] backend: Backend,
) {
    let (_store, store) = suite_store!(backend);
    let done = request("done", 1, LONG, DAY);
    won(&*store, &done).await;
    assert!(store.complete(&done.id, &response(b"ok")).await.unwrap());

    let mut other_token = done.id.clone();
    other_token.token = Uuid::new_v4();
    assert!(
        !store.forget(&other_token).await.unwrap(),
        "a record claimed again since it was read is kept"
    );
    assert_eq!(store.find("done", None).await.unwrap().len(), 1);

    assert!(store.forget(&done.id).await.unwrap());
    assert!(store.find("done", None).await.unwrap().is_empty());
    assert!(!store.forget(&done.id).await.unwrap(), "nothing left to forget");
    assert_eq!(
        won(&*store, &request("done", 2, LONG, DAY)).await,
        (1, ClaimKind::New),
        "the next request with the key executes as new, whatever its payload"
    );
}
