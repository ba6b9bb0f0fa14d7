//! Stored responses are sealed per record, on both stores: the table holds one sealed blob per record and
//! the retry replays it byte for byte; a blob copied into another record, or put back after the key was
//! completed again, is refused (500 `record-unreadable`) and never executed again; so is a whole row put
//! back after its record's life ended, even with its expiry rewritten, while the same row put back as it
//! was only makes the key run again, as deleting it would; a response kept without its body leaves nothing
//! but its status; records sealed by the previous formats still replay until `encryption.min_format`
//! refuses them. Rows are read and written with SQL, as someone with access to the database would.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use rstest::rstest;

use std::time::{Duration, Instant};

use chacha20poly1305::aead::{AeadInOut, KeyInit as _};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use crate::support::encryption::{K1, contains, encrypted, execute_and_settle};
use crate::support::{
    Backend, InProcessProxy, Reply, TestEnv, TestStore, keyed_post, metric, poll_until, settled,
};

const ORDER: &str = "{\"card\":\"4111\"}";

/// Bytes of the stub's response that must never reach the table in clear.
const SECRETS: [&[u8]; 5] = [
    b"\"exec\"",
    b"body_len",
    b"x-upstream-exec",
    b"x-custom",
    b"application/json",
];

/// A record's row: what it keeps of the stored response, and its epoch.
#[derive(Debug)]
struct Row {
    scope: String,
    status: Option<i64>,
    /// Header names and values as stored, all concatenated.
    headers: Vec<u8>,
    body: Option<Vec<u8>>,
    token: String,
}

async fn row(env: &TestEnv, key: &str) -> Row {
    match &env.store {
        TestStore::Postgres(db) => {
            let row = db
                .client()
                .await
                .query_one(
                    "SELECT scope, response_status::bigint, response_header_names, response_header_values,
                            response_body, token::text
                     FROM idemproxy.records WHERE key = $1",
                    &[&key],
                )
                .await
                .expect("the record exists");
            let names: Option<Vec<String>> = row.get(2);
            let values: Option<Vec<Vec<u8>>> = row.get(3);
            let names = names.unwrap_or_default().into_iter().map(String::into_bytes);
            Row {
                scope: row.get(0),
                status: row.get(1),
                headers: names.chain(values.unwrap_or_default()).flatten().collect(),
                body: row.get(4),
                token: row.get(5),
            }
        }
        TestStore::Sqlite(_) => {
            let sql = "SELECT scope, response_status, response_headers, response_body, hex(token)
                       FROM records WHERE key = ?1";
            on_sqlite(env, key, move |db, key| {
                db.query_row(sql, [key], |row| {
                    Ok(Row {
                        scope: row.get(0)?,
                        status: row.get(1)?,
                        headers: row.get::<_, Option<Vec<u8>>>(2)?.unwrap_or_default(),
                        body: row.get(3)?,
                        token: row.get(4)?,
                    })
                })
                .expect("the record exists")
            })
            .await
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

/// Runs `work` on a connection of its own to the test's SQLite file, as another program would.
async fn on_sqlite<T: Send + 'static>(
    env: &TestEnv,
    key: &str,
    work: impl FnOnce(&rusqlite::Connection, &str) -> T + Send + 'static,
) -> T {
    let path = env.store.sqlite_path();
    let key = key.to_owned();
    tokio::task::spawn_blocking(move || {
        let db = rusqlite::Connection::open(path).expect("open the SQLite file");
        db.busy_timeout(std::time::Duration::from_secs(10))
            .expect("set a busy timeout");
        work(&db, &key)
    })
    .await
    .expect("the SQLite task ran")
}

/// Overwrites the stored body of the record for `key`.
async fn set_body(env: &TestEnv, key: &str, body: Vec<u8>) {
    match &env.store {
        TestStore::Postgres(db) => {
            let sql = "UPDATE idemproxy.records SET response_body = $2 WHERE key = $1";
            let updated = db.client().await.execute(sql, &[&key, &body]).await.unwrap();
            assert_eq!(updated, 1);
        }
        TestStore::Sqlite(_) => {
            let sql = "UPDATE records SET response_body = ?2 WHERE key = ?1";
            let updated = on_sqlite(env, key, move |db, key| {
                db.execute(sql, rusqlite::params![key, body])
            })
            .await;
            assert_eq!(updated.unwrap(), 1);
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

/// Makes the record for `key` expire now, so its next request claims it afresh under a new token.
async fn expire(env: &TestEnv, key: &str) {
    match &env.store {
        TestStore::Postgres(db) => {
            let sql = "UPDATE idemproxy.records SET expires_at = now() - interval '1 second' WHERE key = $1";
            let updated = db.client().await.execute(sql, &[&key]).await.unwrap();
            assert_eq!(updated, 1);
        }
        TestStore::Sqlite(_) => {
            let sql = "UPDATE records SET expires_at = 0 WHERE key = ?1";
            let updated = on_sqlite(env, key, move |db, key| db.execute(sql, [key])).await;
            assert_eq!(updated.unwrap(), 1);
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

async fn refused(proxy: &InProcessProxy, key: &str) {
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", key, ORDER)).await;
    reply.assert_problem(500, "record-unreadable");
    assert!(!reply.text().contains("exec"), "{}", reply.text());
}

fn assert_sealed(row: &Row) {
    assert_eq!(row.status, Some(201), "the status stays in clear");
    assert!(row.headers.is_empty(), "headers are stored: {:?}", row.headers);
    let body = row.body.as_deref().expect("a sealed body");
    assert!(body.starts_with(b"\0IPE\x03\x02k1"), "{body:?}");
    for secret in SECRETS {
        assert!(
            !contains(body, secret),
            "{:?} is in clear",
            String::from_utf8_lossy(secret)
        );
    }
}

#[rstest]
#[tokio::test]
async fn a_keyed_response_is_stored_as_one_sealed_blob_and_replayed_byte_for_byte(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    let (first, replay) = execute_and_settle(&proxy, "sealed").await;
    assert_eq!(replay.status, first.status);
    assert_eq!(replay.body, first.body);
    for name in ["content-type", "x-custom", "x-upstream-exec"] {
        assert_eq!(replay.header(name), first.header(name), "{name}");
    }
    assert_sealed(&row(&env, "sealed").await);
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn the_sqlite_files_hold_no_byte_of_the_response_in_clear() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&proxy, "sealed").await;
    proxy.stop().await.unwrap();
    let path = env.store.sqlite_path();
    let mut files = vec![std::fs::read(&path).unwrap()];
    files.extend(std::fs::read(path.with_extension("db-wal")).ok());
    for file in files {
        for secret in SECRETS {
            assert!(
                !contains(&file, secret),
                "{:?} is in the file",
                String::from_utf8_lossy(secret)
            );
        }
    }
}

#[rstest]
#[tokio::test]
async fn a_sealed_body_copied_into_another_record_is_refused_and_never_executed_again(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&proxy, "victim").await;
    let (donor, _) = execute_and_settle(&proxy, "donor").await;

    let donor_blob = row(&env, "donor").await.body.expect("a sealed body");
    set_body(&env, "victim", donor_blob).await;
    refused(&proxy, "victim").await;
    refused(&proxy, "victim").await;

    let untouched = Reply::of(keyed_post(&proxy.url, "/orders", "donor", ORDER)).await;
    assert!(untouched.is_replay());
    assert_eq!(untouched.body, donor.body);
    assert_eq!(
        env.upstream.executions(),
        2,
        "a refused record is never executed again"
    );
    let undecryptable = metric(&proxy.admin_url, "idemproxy_undecryptable_records_total", &[]).await;
    assert_eq!(undecryptable, 2.0);
}

#[rstest]
#[tokio::test]
async fn a_blob_put_back_after_the_key_was_completed_again_is_refused(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&proxy, "k").await;
    let earlier = row(&env, "k").await;

    expire(&env, "k").await;
    let (again, replay) = execute_and_settle(&proxy, "k").await;
    assert_eq!(replay.body, again.body);
    let later = row(&env, "k").await;
    assert_ne!(later.token, earlier.token, "completed again under a new claim");
    assert_eq!(
        (later.status, later.headers.len()),
        (earlier.status, earlier.headers.len()),
        "only the epoch tells the two completions apart"
    );

    set_body(&env, "k", earlier.body.expect("a sealed body")).await;
    refused(&proxy, "k").await;
    assert_eq!(
        env.upstream.executions(),
        2,
        "the rolled-back record is not executed again"
    );
}

#[rstest]
#[tokio::test]
async fn a_response_kept_without_its_body_leaves_only_its_status(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = encrypted(&env, "k1", &[("k1", K1)]).set("idempotency.max_stored_response", "16B");
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "big", ORDER)).await;
    assert_eq!(first.status, 201);
    let retry = settled(|| keyed_post(&proxy.url, "/orders", "big", ORDER)).await;
    retry.assert_problem(410, "response-not-retained");

    let row = row(&env, "big").await;
    assert_eq!(row.status, Some(201));
    assert!(row.headers.is_empty(), "headers are stored: {:?}", row.headers);
    assert_eq!(row.body.unwrap_or_default(), Vec::<u8>::new());
    assert_eq!(env.upstream.executions(), 1);
}

/// A value sealed as format 1 wrote it: AES-256-GCM, bound to scope, key, status and the value's place.
fn seal_v1(scope: &str, key: &str, status: u16, place: &[u8], plain: &[u8]) -> Vec<u8> {
    let mut context = b"idemproxy-record-v1".to_vec();
    for field in [scope.as_bytes(), key.as_bytes()] {
        context.extend_from_slice(&(field.len() as u64).to_be_bytes());
        context.extend_from_slice(field);
    }
    context.extend_from_slice(&status.to_be_bytes());
    context.extend_from_slice(place);
    let nonce = [0x5a; 12];
    let cipher = Aes256Gcm::new_from_slice(&K1).unwrap();
    let payload = Payload {
        msg: plain,
        aad: &context,
    };
    let sealed = cipher.encrypt(Nonce::from_slice(&nonce), payload).unwrap();
    [&b"\0IPE\x01\x02k1"[..], &nonce, &sealed].concat()
}

/// Rewrites the record for `key` as format 1 stored it: one sealed value per header, and the body.
async fn write_v1(env: &TestEnv, key: &str, headers: &[(&str, &[u8])], body: &[u8]) {
    let scope = row(env, key).await.scope;
    let values: Vec<Vec<u8>> = headers
        .iter()
        .enumerate()
        .map(|(index, (name, value))| {
            let place = [&b"header"[..], &(index as u64).to_be_bytes(), name.as_bytes()].concat();
            seal_v1(&scope, key, 201, &place, value)
        })
        .collect();
    let body = seal_v1(&scope, key, 201, b"body", body);
    let names: Vec<String> = headers.iter().map(|(name, _)| name.to_string()).collect();
    match &env.store {
        TestStore::Postgres(db) => {
            let sql = "UPDATE idemproxy.records SET response_header_names = $2, response_header_values = $3,
                       response_body = $4 WHERE key = $1";
            let client = db.client().await;
            let updated = client
                .execute(sql, &[&key, &names, &values, &body])
                .await
                .unwrap();
            assert_eq!(updated, 1);
        }
        TestStore::Sqlite(_) => {
            // The SQLite store keeps headers as one blob of u32-length-prefixed names and values.
            let mut blob = Vec::new();
            for field in names
                .iter()
                .map(String::as_bytes)
                .zip(&values)
                .flat_map(|(n, v)| [n, v])
            {
                blob.extend_from_slice(&(field.len() as u32).to_be_bytes());
                blob.extend_from_slice(field);
            }
            let sql = "UPDATE records SET response_headers = ?2, response_body = ?3 WHERE key = ?1";
            let updated = on_sqlite(env, key, move |db, key| {
                db.execute(sql, rusqlite::params![key, blob, body])
            })
            .await;
            assert_eq!(updated.unwrap(), 1);
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

#[rstest]
#[tokio::test]
async fn a_record_sealed_by_the_previous_format_still_replays(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&proxy, "old").await;
    let headers: [(&str, &[u8]); 2] = [("content-type", b"text/plain"), ("x-from", b"format 1")];
    write_v1(&env, "old", &headers, b"sealed before the upgrade").await;

    let replay = Reply::of(keyed_post(&proxy.url, "/orders", "old", ORDER)).await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.status, 201);
    assert_eq!(replay.header("content-type"), Some("text/plain"));
    assert_eq!(replay.header("x-from"), Some("format 1"));
    assert_eq!(&replay.body[..], b"sealed before the upgrade");
    assert_eq!(env.upstream.executions(), 1);
}

/// A replica started without `[encryption]` (a forgotten secret, a misconfigured rollout) finds a record
/// sealed by one that has keys: it refuses it rather than replaying the ciphertext as the body.
#[rstest]
#[tokio::test]
async fn a_replica_without_keys_refuses_a_sealed_record(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let keyed = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&keyed, "sealed").await;
    keyed.stop().await.unwrap();
    let keyless = InProcessProxy::start(&env.config().set("replay_cache.max_size", "0")).await;
    refused(&keyless, "sealed").await;
    assert_eq!(env.upstream.executions(), 1, "never executed again");
}

/// Every column of a record but its scope and key, as the backup below copies them back.
const ROW_COLUMNS: [&str; 12] = [
    "fingerprint",
    "status",
    "token",
    "attempt",
    "claim_kind",
    "locked_until",
    "created_at",
    "updated_at",
    "response_status",
    "response_body",
    "body_retained",
    "expires_at",
];

/// Copies the record for `key`, whole, into a table `backup` beside the key table, as a backup would.
async fn back_up(env: &TestEnv, key: &str) {
    match &env.store {
        TestStore::Postgres(db) => {
            let sql = format!(
                "CREATE TABLE idemproxy.backup AS SELECT * FROM idemproxy.records WHERE key = '{key}'"
            );
            db.client().await.batch_execute(&sql).await.unwrap();
        }
        TestStore::Sqlite(_) => {
            let sql = "CREATE TABLE backup AS SELECT * FROM records WHERE key = ?1";
            on_sqlite(env, key, move |db, key| db.execute(sql, [key]))
                .await
                .unwrap();
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

/// Puts the backed-up row back over the record for `key`, every column as it was; with `live_for_a_day`,
/// its expiry is moved a day ahead, so the store sees a completed record and replays it.
async fn put_back(env: &TestEnv, key: &str, live_for_a_day: bool) {
    let (columns, expiry) = ROW_COLUMNS.split_at(ROW_COLUMNS.len() - 1);
    let mut set: Vec<String> = columns.iter().map(|c| format!("{c} = b.{c}")).collect();
    match &env.store {
        TestStore::Postgres(db) => {
            set.push("response_header_names = b.response_header_names".into());
            set.push("response_header_values = b.response_header_values".into());
            set.push(match live_for_a_day {
                true => "expires_at = now() + interval '1 day'".into(),
                false => format!("{} = b.{}", expiry[0], expiry[0]),
            });
            let sql = format!(
                "UPDATE idemproxy.records r SET {} FROM idemproxy.backup b WHERE r.key = b.key AND r.key = $1",
                set.join(", ")
            );
            let updated = db.client().await.execute(&sql, &[&key]).await.unwrap();
            assert_eq!(updated, 1);
        }
        TestStore::Sqlite(_) => {
            set.push("response_headers = b.response_headers".into());
            set.push(match live_for_a_day {
                true => "expires_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) + 86400000".into(),
                false => format!("{} = b.{}", expiry[0], expiry[0]),
            });
            let sql = format!(
                "UPDATE records SET {} FROM backup AS b WHERE records.key = b.key AND records.key = ?1",
                set.join(", ")
            );
            let updated = on_sqlite(env, key, move |db, key| db.execute(&sql, [key])).await;
            assert_eq!(updated.unwrap(), 1);
        }
        TestStore::Redis { .. } | TestStore::Citus(_) => {
            unreachable!("these tests reach into the rows of the SQL stores they run on")
        }
    }
}

/// A key's first use completes and is backed up; once it expires the client uses the key again, which
/// executes and completes anew. Someone with the backup puts the first row back, whole, with its expiry a
/// day ahead, so that the store replays it: the record's sealed life has ended, so it is refused and not
/// executed again. Put back as it was (expired), the row only makes the key run again, as deleting it
/// would: that much a table writer can always do.
#[rstest]
#[tokio::test]
async fn a_whole_row_put_back_after_its_life_ended_is_refused_even_with_a_new_expiry(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    // A record lives at most ttl + lock_timeout + store.timeout (1s) after its seal: 4 s.
    let config = encrypted(&env, "k1", &[("k1", K1)])
        .set("idempotency.ttl", "2s")
        .set("idempotency.lock_timeout", "1s")
        .set("encryption.max_clock_skew", "0s");
    let proxy = InProcessProxy::start(&config).await;
    let (first, _) = execute_and_settle(&proxy, "k").await;
    let first_life_ends = Instant::now() + Duration::from_secs(4);
    back_up(&env, "k").await;

    let again = poll_until("the key to expire and run again", || async {
        let reply = Reply::of(keyed_post(&proxy.url, "/orders", "k", ORDER)).await;
        (reply.status == 201 && !reply.is_replay()).then_some(reply)
    })
    .await;
    assert_ne!(again.body, first.body, "a second execution");
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "k", ORDER)).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, again.body);
    // What is waited for is the clock itself: the end of the first record's sealed life (a second more
    // for the seal, which came before the first answer).
    tokio::time::sleep_until((first_life_ends + Duration::from_secs(1)).into()).await;

    put_back(&env, "k", true).await;
    refused(&proxy, "k").await;
    assert_eq!(env.upstream.executions_for_key("k"), 2, "not executed again");
    let undecryptable = metric(&proxy.admin_url, "idemproxy_undecryptable_records_total", &[]).await;
    assert_eq!(undecryptable, 1.0);

    put_back(&env, "k", false).await;
    let third = Reply::of(keyed_post(&proxy.url, "/orders", "k", ORDER)).await;
    assert_eq!(third.status, 201);
    assert!(!third.is_replay(), "an expired row is a new key");
    assert_eq!(env.upstream.executions_for_key("k"), 3);
}

/// Rewrites the record for `key` as format 2 stored it: one XChaCha20-Poly1305 blob bound to scope, key,
/// epoch and status, without the end of the record's life.
async fn write_v2(env: &TestEnv, key: &str, headers: &[(&str, &[u8])], body: &[u8]) {
    let row = row(env, key).await;
    let token = hex::decode(row.token.replace('-', "")).expect("a token");
    let mut head = b"\0IPE\x02\x02k1".to_vec();
    head.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    let mut aad = b"idemproxy-record-v2".to_vec();
    for field in [row.scope.as_bytes(), key.as_bytes()] {
        aad.extend_from_slice(&(field.len() as u64).to_be_bytes());
        aad.extend_from_slice(field);
    }
    aad.extend_from_slice(&token);
    aad.extend_from_slice(&201u16.to_be_bytes());
    aad.extend_from_slice(&head);
    let mut plain = 201u16.to_be_bytes().to_vec();
    plain.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    for (name, value) in headers {
        for field in [name.as_bytes(), value] {
            plain.extend_from_slice(&(field.len() as u32).to_be_bytes());
            plain.extend_from_slice(field);
        }
    }
    plain.extend_from_slice(&(body.len() as u64).to_be_bytes());
    plain.extend_from_slice(body);
    let nonce = XNonce::from([0x5a; 24]);
    let cipher = XChaCha20Poly1305::new(&K1.into());
    let tag = cipher
        .encrypt_inout_detached(&nonce, &aad, plain.as_mut_slice().into())
        .unwrap();
    let blob = [&head[..], &nonce[..], &plain, &tag[..]].concat();
    set_body(env, key, blob).await;
}

/// Every format a record may be in opens by default; once every record of an older format has had its
/// `ttl` to expire, `min_format` refuses them: a record of a refused format answers 500 and is never
/// executed again, whatever a database writer puts in its row.
#[rstest]
#[tokio::test]
async fn min_format_refuses_records_of_the_formats_below_it(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let keys = [("k1", K1)];
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &keys)).await;
    execute_and_settle(&proxy, "v1").await;
    execute_and_settle(&proxy, "v2").await;
    let headers: [(&str, &[u8]); 1] = [("content-type", b"text/plain")];
    write_v1(&env, "v1", &headers, b"sealed as format 1").await;
    write_v2(&env, "v2", &headers, b"sealed as format 2").await;
    for (key, body) in [("v1", "sealed as format 1"), ("v2", "sealed as format 2")] {
        let replay = Reply::of(keyed_post(&proxy.url, "/orders", key, ORDER)).await;
        assert!(replay.is_replay(), "{key}: {replay:?}");
        assert_eq!(replay.text(), body);
    }
    proxy.stop().await.unwrap();

    let no_v1 = encrypted(&env, "k1", &keys).set("encryption.min_format", 2);
    let proxy = InProcessProxy::start(&no_v1).await;
    refused(&proxy, "v1").await;
    let replay = Reply::of(keyed_post(&proxy.url, "/orders", "v2", ORDER)).await;
    assert_eq!(replay.text(), "sealed as format 2");
    proxy.stop().await.unwrap();

    let only_v3 = encrypted(&env, "k1", &keys).set("encryption.min_format", 3);
    let proxy = InProcessProxy::start(&only_v3).await;
    refused(&proxy, "v1").await;
    refused(&proxy, "v2").await;
    let (first, replay) = execute_and_settle(&proxy, "v3").await;
    assert_eq!(replay.body, first.body, "what this version seals opens");
    assert_eq!(env.upstream.executions(), 3, "nothing refused ran again");
    let undecryptable = metric(&proxy.admin_url, "idemproxy_undecryptable_records_total", &[]).await;
    assert_eq!(undecryptable, 2.0);
}
