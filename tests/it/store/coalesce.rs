//! Coalesced claims and completions on PostgreSQL (`store.max_batch`). Each test holds the store's one
//! batch slot with a statement that waits on a lock the test holds, queues its operations behind it, and
//! only then lets the slot go, so the queued operations run as one batch whatever the machine's speed.
//! Rows written by one batch share a transaction id (`xmin`), which is how the tests see the batching.

use std::pin::pin;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::join_all;
use idemproxy::Config;
use idemproxy::store::{
    self, ClaimKind, ClaimRequest, ClaimResult, Existing, Purpose, Store, StoredResponse,
};
use uuid::Uuid;

use crate::store::suite::{DAY, LONG, request, response, won};
use crate::support::pg::TestDb;

/// A store whose pool of 4 allows one batch of each kind at a time, each of up to 64 operations.
async fn coalescing_store(db: &TestDb) -> Arc<dyn Store> {
    let config = Config::from_toml_str(&format!(
        "[store]\nurl = \"{}\"\ntimeout = \"10s\"\npool_size = 4\nmax_batch = 64\n",
        db.url()
    ))
    .expect("valid test config");
    store::migrate(&config.store).await.expect("migrations apply");
    store::open(&config.store, Purpose::Tool)
        .await
        .expect("store opens")
}

/// How many transactions wrote the current versions of these keys' records.
async fn writing_transactions(db: &TestDb, keys: &[String]) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(DISTINCT xmin::text) FROM idemproxy.records WHERE key = ANY($1)",
            &[&keys],
        )
        .await
        .expect("count writers")
        .get(0)
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Claims of `n` keys named after `prefix`, one request each.
fn new_claims(prefix: &str, n: usize) -> Vec<ClaimRequest> {
    keys(prefix, n).iter().map(|k| request(k, 1, LONG, DAY)).collect()
}

/// Claims `keys` one at a time (each alone), every one a new key won.
async fn won_one_by_one<'k>(
    store: &Arc<dyn Store>,
    keys: impl IntoIterator<Item = &'k str>,
) -> Vec<ClaimRequest> {
    let mut claims = Vec::new();
    for key in keys {
        let claim = request(key, 1, LONG, DAY);
        won(&**store, &claim).await;
        claims.push(claim);
    }
    claims
}

/// Holds a lock that the store's statement for `gate` waits on, until `open` is called.
struct Gate {
    _connection: tokio::task::JoinHandle<()>,
    transaction: tokio_postgres::Client,
}

impl Gate {
    /// An uncommitted record for `key`: a claim of `key` waits until the gate opens.
    async fn uncommitted_record(db: &TestDb, key: &str) -> Gate {
        let gate = Gate::begin(db).await;
        gate.transaction
            .execute(
                "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                     locked_until, created_at, expires_at, updated_at)
                 VALUES ('default:test', $1, $2, 'processing', $3, 1, 'new', now() + interval '1 hour',
                     now(), now() + interval '1 day', now())",
                &[&key, &vec![9u8; 32], &Uuid::new_v4()],
            )
            .await
            .expect("insert the gate record");
        gate
    }

    /// A row lock on `key`'s record: a completion of `key` waits until the gate opens.
    async fn row_lock(db: &TestDb, key: &str) -> Gate {
        let gate = Gate::begin(db).await;
        let locked = gate
            .transaction
            .execute(
                "SELECT 1 FROM idemproxy.records WHERE key = $1 FOR UPDATE",
                &[&key],
            )
            .await
            .expect("lock the gate record");
        assert_eq!(locked, 1);
        gate
    }

    async fn begin(db: &TestDb) -> Gate {
        let url = db.url();
        let (transaction, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect");
        let connection = tokio::spawn(async move {
            let _ = connection.await;
        });
        transaction.batch_execute("BEGIN").await.expect("begin");
        Gate {
            _connection: connection,
            transaction,
        }
    }

    async fn open(self) {
        self.transaction.batch_execute("COMMIT").await.expect("commit");
    }
}

/// Runs `operations` as one queue behind a slot held shut by `gate`: every operation is submitted (one
/// poll queues them all) before the gate opens.
async fn behind<T>(gate: Gate, operations: impl IntoIterator<Item = impl Future<Output = T>>) -> Vec<T> {
    let mut all = pin!(join_all(operations));
    assert!(
        futures_util::poll!(&mut all).is_pending(),
        "the slot is held, so nothing can finish yet"
    );
    gate.open().await;
    all.await
}

/// Claims new keys in one batch, behind a held slot, every one won.
async fn won_in_one_batch(db: &TestDb, store: &Arc<dyn Store>, claims: &[ClaimRequest]) {
    let (gate, holder) = hold_the_claim_slot(db, store, "claims-gate").await;
    let claimed = behind(gate, claims.iter().map(|c| store.claim(c))).await;
    holder.await.unwrap();
    for result in &claimed {
        assert!(matches!(result, Ok(ClaimResult::Won { .. })), "{result:?}");
    }
}

/// Starts `key`'s claim (alone, in the batch slot) and waits until it is blocked on the gate.
async fn hold_the_claim_slot(
    db: &TestDb,
    store: &Arc<dyn Store>,
    key: &str,
) -> (Gate, tokio::task::JoinHandle<()>) {
    let gate = Gate::uncommitted_record(db, key).await;
    let holder = tokio::spawn({
        let store = Arc::clone(store);
        let claim = request(key, 1, LONG, DAY);
        async move {
            store.claim(&claim).await.expect("the gate's claim runs");
        }
    });
    db.wait_for_a_lock_waiter().await;
    (gate, holder)
}

#[tokio::test]
async fn claims_that_arrive_together_commit_together_and_each_key_has_one_winner() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let (gate, holder) = hold_the_claim_slot(&db, &store, "gate").await;

    // 50 keys, each claimed twice: the second request for a key lands in the same batch as the first
    // (keys 0..13) or in the next one (keys 14..49).
    let keys = keys("key", 50);
    let claims: Vec<ClaimRequest> = keys
        .iter()
        .chain(&keys)
        .map(|k| request(k, 1, LONG, DAY))
        .collect();
    let results = behind(gate, claims.iter().map(|c| store.claim(c))).await;
    holder.await.unwrap();

    for key in &keys {
        let answers: Vec<&ClaimResult> = claims
            .iter()
            .zip(&results)
            .filter(|(c, _)| &c.id.key == key)
            .map(|(_, r)| r.as_ref().expect("claim runs"))
            .collect();
        let winners = answers
            .iter()
            .filter(|r| matches!(r, ClaimResult::Won { .. }))
            .count();
        assert_eq!(winners, 1, "{key}: {answers:?}");
        assert!(
            answers.iter().any(|r| matches!(
                r,
                ClaimResult::Held(Existing::Processing {
                    same_fingerprint: true,
                    ..
                })
            )),
            "{key}: the other request sees the winner's live claim: {answers:?}"
        );
    }
    // Every key was won in the first batch: one transaction for the 50 new records.
    assert_eq!(writing_transactions(&db, &keys).await, 1);
}

#[tokio::test]
async fn a_batch_answers_each_request_as_it_would_be_answered_alone() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    // Records in every state a claim can meet, made one at a time.
    for key in ["replay", "other-payload", "expired", "released"] {
        let claim = request(key, 1, LONG, DAY);
        won(&*store, &claim).await;
        if key == "released" {
            assert!(store.release(&claim.id).await.unwrap());
        } else {
            assert!(store.complete(&claim.id, &response(b"stored")).await.unwrap());
        }
    }
    won(&*store, &request("in-flight", 1, LONG, DAY)).await;
    db.client()
        .await
        .execute(
            "UPDATE idemproxy.records SET expires_at = now() - interval '1 second' WHERE key = 'expired'",
            &[],
        )
        .await
        .unwrap();

    let (gate, holder) = hold_the_claim_slot(&db, &store, "gate").await;
    let claims = [
        request("replay", 1, LONG, DAY),
        request("other-payload", 2, LONG, DAY),
        request("in-flight", 1, LONG, DAY),
        request("expired", 2, LONG, DAY),
        request("released", 1, LONG, DAY),
        request("new", 1, LONG, DAY),
    ];
    let results = behind(gate, claims.iter().map(|c| store.claim(c))).await;
    holder.await.unwrap();

    let mut results = results.into_iter().map(|r| r.expect("claim runs"));
    let mut next = || results.next().unwrap();
    match next() {
        ClaimResult::Held(Existing::Completed {
            same_fingerprint: true,
            response: stored,
            expires_in,
            ..
        }) => {
            assert_eq!(stored, response(b"stored"));
            assert!(expires_in > DAY / 2);
        }
        other => panic!("replay: {other:?}"),
    }
    assert!(
        matches!(
            next(),
            ClaimResult::Held(Existing::Completed {
                same_fingerprint: false,
                ..
            })
        ),
        "another payload"
    );
    match next() {
        ClaimResult::Held(Existing::Processing {
            same_fingerprint: true,
            lease_remaining,
        }) => assert!(lease_remaining > LONG / 2),
        other => panic!("in flight: {other:?}"),
    }
    let mut won = |what: &str| match next() {
        ClaimResult::Won { attempt, kind, .. } => (attempt, kind),
        other => panic!("{what}: expected a win, got {other:?}"),
    };
    assert_eq!(won("expired"), (1, ClaimKind::New));
    assert_eq!(won("released"), (2, ClaimKind::Retry));
    assert_eq!(won("new"), (1, ClaimKind::New));
}

#[tokio::test]
async fn completions_that_arrive_together_store_each_response_fenced_by_its_token() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let keys = keys("done", 30);
    let mut claims = won_one_by_one(
        &store,
        keys.iter().map(String::as_str).chain(["gate", "taken-over"]),
    )
    .await;
    // Responses of every shape: no headers, several, a body not retained, an empty body, binary.
    let responses: Vec<StoredResponse> = (0..keys.len())
        .map(|i| StoredResponse {
            status: 200 + i as u16,
            headers: (0..i % 4)
                .map(|h| (format!("x-header-{h}"), format!("{i}/{h}").into_bytes()))
                .collect(),
            body: match i % 3 {
                0 => None,
                1 => Some(Bytes::new()),
                _ => Some(Bytes::from(vec![i as u8; 100 + i])),
            },
        })
        .collect();
    // A completion by a claim that is no longer the holder's: fenced out even inside a batch.
    let stale = claims.pop().unwrap();
    db.client()
        .await
        .execute(
            "UPDATE idemproxy.records SET token = $1 WHERE key = 'taken-over'",
            &[&Uuid::new_v4()],
        )
        .await
        .unwrap();

    let gate = Gate::row_lock(&db, "gate").await;
    let gate_claim = claims.pop().unwrap();
    let holder = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.complete(&gate_claim.id, &response(b"gate")).await }
    });
    db.wait_for_a_lock_waiter().await;
    let stale_response = response(b"stale");
    let completions = claims
        .iter()
        .zip(&responses)
        .map(|(c, r)| (&c.id, r))
        .chain([(&stale.id, &stale_response)]);
    let stored = behind(gate, completions.map(|(id, r)| store.complete(id, r))).await;
    assert!(holder.await.unwrap().unwrap(), "the gate's own completion");

    let (fenced, completed) = stored.split_last().unwrap();
    assert!(
        !fenced.as_ref().unwrap(),
        "the stale holder's completion matches no record"
    );
    assert!(completed.iter().all(|r| *r.as_ref().unwrap()), "{completed:?}");
    for (key, expected) in keys.iter().zip(&responses) {
        match store.claim(&request(key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) => {
                assert_eq!(&response, expected, "{key}")
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(matches!(
        store.claim(&request("taken-over", 1, LONG, DAY)).await.unwrap(),
        ClaimResult::Held(Existing::Processing { .. })
    ));
    assert_eq!(
        writing_transactions(&db, &keys).await,
        1,
        "30 completions, one transaction"
    );
}

#[tokio::test]
async fn a_response_too_large_to_batch_is_stored_whole() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let claims: Vec<ClaimRequest> = ["large", "small-1", "small-2"]
        .iter()
        .map(|k| request(k, 1, LONG, DAY))
        .collect();
    for claim in &claims {
        won(&*store, claim).await;
    }
    let mut large = response(b"");
    large.body = Some(Bytes::from(vec![7u8; 300 * 1024]));
    let responses = [large, response(b"one"), response(b"two")];
    let stored = join_all(
        claims
            .iter()
            .zip(&responses)
            .map(|(c, r)| store.complete(&c.id, r)),
    )
    .await;
    assert!(stored.iter().all(|r| *r.as_ref().unwrap()));
    for (claim, expected) in claims.iter().zip(&responses) {
        match store.claim(&request(&claim.id.key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) => assert_eq!(&response, expected),
            other => panic!("{other:?}"),
        }
    }
}

/// A record rewritten after a batch's snapshot but before the batch writes it, as its own claim's
/// heartbeat does while the request runs: the completion still stores its response, and the record is
/// completed, not left `processing` for another replica to take over and run again.
#[tokio::test]
async fn a_completion_still_stores_its_response_when_a_heartbeat_rewrites_the_record_under_its_batch() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let keys = keys("beat", 4);
    let mut claims = won_one_by_one(&store, keys.iter().map(String::as_str).chain(["gate"])).await;
    let gate_claim = claims.pop().unwrap();
    let gate = Gate::row_lock(&db, "gate").await;
    let holder = tokio::spawn({
        let store = Arc::clone(&store);
        async move { store.complete(&gate_claim.id, &response(b"gate")).await }
    });
    db.wait_for_a_lock_waiter().await;
    // The heartbeat's statement, in a transaction that commits only once the batch waits for it.
    let heartbeat = Gate::begin(&db).await;
    let renewed = heartbeat
        .transaction
        .execute(
            "UPDATE idemproxy.records SET locked_until = locked_until + interval '1 minute',
                 updated_at = now()
             WHERE key = $1 AND token = $2 AND status = 'processing'",
            &[&keys[0], &claims[0].id.token],
        )
        .await
        .expect("renew the lease");
    assert_eq!(renewed, 1);

    let stored = response(b"stored");
    let mut all = pin!(join_all(claims.iter().map(|c| store.complete(&c.id, &stored))));
    assert!(futures_util::poll!(&mut all).is_pending(), "the slot is held");
    gate.open().await;
    assert!(holder.await.unwrap().unwrap(), "the gate's own completion");
    db.wait_for_a_lock_waiter().await;
    heartbeat.open().await;
    let completed = all.await;

    assert!(completed.iter().all(|r| *r.as_ref().unwrap()), "{completed:?}");
    for key in &keys {
        match store.claim(&request(key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) => assert_eq!(response, stored),
            other => panic!("{key}: {other:?}"),
        }
    }
}

/// What a claim or a completion answered, for one queue holding both kinds.
#[derive(Debug)]
enum Answer {
    Claim(ClaimResult),
    Complete(bool),
}

type Operation<'a> = std::pin::Pin<Box<dyn Future<Output = Answer> + Send + 'a>>;

#[tokio::test]
async fn claims_and_completions_that_arrive_together_share_one_commit() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let done = keys("done", 20);
    let mut running = won_one_by_one(&store, done.iter().map(String::as_str).chain(["purged"])).await;
    // A record an operator purged while its request ran: its completion finds nothing to store and
    // must not bring the record back.
    let purged = running.pop().unwrap();
    let deleted = db
        .client()
        .await
        .execute("DELETE FROM idemproxy.records WHERE key = 'purged'", &[])
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let fresh = keys("fresh", 20);
    let claims: Vec<ClaimRequest> = fresh.iter().map(|k| request(k, 1, LONG, DAY)).collect();
    let stored = response(b"stored");

    let (gate, holder) = hold_the_claim_slot(&db, &store, "gate").await;
    let (store_ref, stored_ref) = (&store, &stored);
    let completions = running.iter().chain([&purged]).map(|c| -> Operation<'_> {
        Box::pin(async move { Answer::Complete(store_ref.complete(&c.id, stored_ref).await.unwrap()) })
    });
    let claimed = claims.iter().map(|c| -> Operation<'_> {
        Box::pin(async move { Answer::Claim(store_ref.claim(c).await.unwrap()) })
    });
    let operations: Vec<Operation<'_>> = completions.chain(claimed).collect();
    let answers = behind(gate, operations).await;
    holder.await.unwrap();

    let (completed, claimed) = answers.split_at(running.len() + 1);
    for answer in &completed[..running.len()] {
        assert!(matches!(answer, Answer::Complete(true)), "{answer:?}");
    }
    assert!(
        matches!(completed[running.len()], Answer::Complete(false)),
        "the purged record's completion stores nothing"
    );
    for answer in claimed {
        assert!(
            matches!(
                answer,
                Answer::Claim(ClaimResult::Won {
                    attempt: 1,
                    kind: ClaimKind::New,
                    ..
                })
            ),
            "{answer:?}"
        );
    }
    let mut written = done.clone();
    written.extend(fresh.iter().cloned());
    assert_eq!(
        writing_transactions(&db, &written).await,
        1,
        "20 completions and 20 new claims, one transaction"
    );
    let purged_rows: i64 = db
        .client()
        .await
        .query_one("SELECT count(*) FROM idemproxy.records WHERE key = 'purged'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(purged_rows, 0, "a completion never inserts a record");
    for key in &done {
        match store.claim(&request(key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) => assert_eq!(response, stored),
            other => panic!("{key}: {other:?}"),
        }
    }
}

/// Tuples read from the key table and its primary key since the database was created, once every
/// backend of the store has exited (a backend reports its counts as it exits).
async fn key_table_tuples_read(db: &TestDb) -> i64 {
    let client = db.client().await;
    for _ in 0..100 {
        let open: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND application_name = 'idemproxy'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if open == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    client
        .batch_execute("SELECT pg_stat_clear_snapshot()")
        .await
        .unwrap();
    client
        .query_one(
            "SELECT coalesce(t.seq_tup_read, 0) + coalesce(i.idx_tup_read, 0)
             FROM pg_stat_user_tables t JOIN pg_stat_user_indexes i USING (relid)
             WHERE t.schemaname = 'idemproxy' AND t.relname = 'records' AND i.indexrelname = 'records_pkey'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The completions of claims that won in one batch reach their records by the addresses the batch's
/// INSERT returned: one batch of 20 completions reads no record through the primary key.
#[tokio::test]
async fn completions_of_batched_claims_reach_their_records_without_a_lookup_by_key() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let claims = new_claims("addressed", 20);
    won_in_one_batch(&db, &store, &claims).await;
    let stored = response(b"addressed");
    let (gate, holder) = hold_the_claim_slot(&db, &store, "completions-gate").await;
    let completed = behind(gate, claims.iter().map(|c| store.complete(&c.id, &stored))).await;
    holder.await.unwrap();
    assert!(completed.iter().all(|r| *r.as_ref().unwrap()), "{completed:?}");
    drop(store);

    // The two gates' claims read their gates' records, 10 tuples in all; a lookup per completion would
    // read 20 more.
    let read = key_table_tuples_read(&db).await;
    assert!(
        read < 20,
        "{read} tuples read: the completions looked their records up"
    );
    let keys: Vec<String> = claims.iter().map(|c| c.id.key.clone()).collect();
    assert_eq!(
        writing_transactions(&db, &keys).await,
        1,
        "one batch of completions"
    );
    let store = coalescing_store(&db).await;
    for claim in &claims {
        match store.claim(&request(&claim.id.key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) => assert_eq!(response, stored),
            other => panic!("{}: {other:?}", claim.id.key),
        }
    }
}

/// An address is only a hint: a completion whose record was rewritten since its claim (the address now
/// holds a dead version) still stores its response, and one whose record another claim took over, or an
/// operator deleted, stores nothing and brings nothing back.
#[tokio::test]
async fn a_completion_whose_address_went_stale_is_judged_by_its_record_as_it_is() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    let claims = new_claims("stale", 6);
    won_in_one_batch(&db, &store, &claims).await;
    let client = db.client().await;
    for (statement, key) in [
        (
            "UPDATE idemproxy.records SET locked_until = locked_until + interval '1 minute'",
            "stale-0",
        ),
        (
            "UPDATE idemproxy.records SET token = gen_random_uuid()",
            "stale-1",
        ),
        ("DELETE FROM idemproxy.records", "stale-2"),
    ] {
        let changed = client
            .execute(
                &format!("{statement} WHERE scope = 'default:test' AND key = $1"),
                &[&key],
            )
            .await
            .unwrap();
        assert_eq!(changed, 1, "{statement}");
    }

    let stored = response(b"stored");
    let (gate, holder) = hold_the_claim_slot(&db, &store, "completions-gate").await;
    let completed = behind(gate, claims.iter().map(|c| store.complete(&c.id, &stored))).await;
    holder.await.unwrap();
    let completed: Vec<bool> = completed.into_iter().map(Result::unwrap).collect();
    assert_eq!(completed, [true, false, false, true, true, true]);
    for (claim, stored_it) in claims.iter().zip(&completed) {
        let key = &claim.id.key;
        match store.claim(&request(key, 1, LONG, DAY)).await.unwrap() {
            ClaimResult::Held(Existing::Completed { response, .. }) if *stored_it => {
                assert_eq!(response, stored, "{key}")
            }
            ClaimResult::Held(Existing::Processing { .. }) if key == "stale-1" => {}
            ClaimResult::Won { .. } if key == "stale-2" => {}
            other => panic!("{key}: {other:?}"),
        }
    }
}

/// Claims `n` new keys at once, then completes them at once: batches and single statements alike.
async fn claim_and_complete(store: &Arc<dyn Store>, prefix: &str, n: usize) {
    let claims = new_claims(prefix, n);
    for result in join_all(claims.iter().map(|c| store.claim(c))).await {
        assert!(matches!(result, Ok(ClaimResult::Won { .. })), "{result:?}");
    }
    let stored = response(b"ok");
    for result in join_all(claims.iter().map(|c| store.complete(&c.id, &stored))).await {
        assert!(result.unwrap());
    }
}

#[tokio::test]
async fn plans_made_while_the_key_table_was_empty_still_find_each_record_by_its_key() {
    let db = TestDb::create().await;
    let store = coalescing_store(&db).await;
    // An empty table, vacuumed, and no analyze to come: every plan made now sees a table of no pages,
    // where scanning it whole looks cheaper than any index.
    let client = db.client().await;
    client
        .batch_execute("ALTER TABLE idemproxy.records SET (autovacuum_enabled = false)")
        .await
        .unwrap();
    client.batch_execute("VACUUM idemproxy.records").await.unwrap();
    // Enough runs of every statement, alone and batched, for each connection to settle on its plans.
    for round in 0..12 {
        claim_and_complete(&store, &format!("empty-{round}"), 1 + round % 6).await;
    }
    // The table grows to 50,000 records behind those plans' back.
    db.client()
        .await
        .batch_execute(
            "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                 locked_until, created_at, expires_at, updated_at)
             SELECT 'default:bulk', 'bulk-' || g, '\\x00', 'completed', gen_random_uuid(), 1, 'new',
                 now(), now(), now() + interval '1 day', now()
             FROM generate_series(1, 50000) AS g",
        )
        .await
        .unwrap();
    for round in 0..12 {
        claim_and_complete(&store, &format!("full-{round}"), 1 + round % 6).await;
    }
    drop(store);
    // Some 80 writes after the table grew: by key, a few tuples each; one scan would read 50,000.
    let read = key_table_tuples_read(&db).await;
    assert!(
        read < 5_000,
        "{read} tuples read: a statement scanned the key table"
    );
}
