//! Encryption at rest against real PostgreSQL: what the table holds with it off and on, byte-identical
//! replays, key rotation, and records that must not be replayed (tampered, or sealed with a key that is
//! no longer configured).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;

use crate::support::encryption::{K1, K2, contains, encrypted, execute_and_settle, uncached};
use crate::support::{InProcessProxy, Reply, TestEnv, keyed_post, metric, settled};

/// `(response_body, response_header_values)` of the record for `key`.
async fn stored(env: &TestEnv, key: &str) -> (Vec<u8>, Vec<Vec<u8>>) {
    let client = env.db().client().await;
    let row = client
        .query_one(
            "SELECT response_body, response_header_values FROM idemproxy.records WHERE key = $1",
            &[&key],
        )
        .await
        .expect("the record exists");
    let header_values: Option<Vec<Vec<u8>>> = row.get(1);
    (row.get(0), header_values.unwrap_or_default())
}

#[tokio::test]
async fn without_keys_the_stored_body_is_readable_in_the_table() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let (first, _) = execute_and_settle(&proxy, "clear").await;
    let (body, header_values) = stored(&env, "clear").await;
    assert_eq!(body, first.body.to_vec());
    assert!(header_values.iter().any(|v| v == b"application/json"));
}

#[tokio::test]
async fn with_a_key_the_table_holds_ciphertext_and_the_replay_is_byte_identical() {
    let env = TestEnv::new().await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    let (first, replay) = execute_and_settle(&proxy, "sealed").await;
    assert_eq!(replay.body, first.body);
    for name in ["content-type", "x-custom", "x-upstream-exec"] {
        assert_eq!(replay.header(name), first.header(name), "{name}");
    }
    assert_eq!(env.upstream.executions(), 1);

    let (body, header_values) = stored(&env, "sealed").await;
    assert!(body.starts_with(b"\0IPE\x03\x02k1"), "{body:?}");
    assert!(!contains(&body, b"\"exec\""), "the body is in clear");
    assert!(!contains(&body, b"application/json"), "a header is in clear");
    assert!(header_values.is_empty(), "headers are sealed in the body's blob");
}

#[tokio::test]
async fn rotation_keeps_old_records_readable_and_seals_new_ones_with_the_active_key() {
    let env = TestEnv::new().await;
    let old = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    let (before, _) = execute_and_settle(&old, "before").await;
    old.stop().await.unwrap();

    let rotated = InProcessProxy::start(&encrypted(&env, "k2", &[("k1", K1), ("k2", K2)])).await;
    let replay = settled(|| keyed_post(&rotated.url, "/orders", "before", "{\"card\":\"4111\"}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, before.body, "sealed with k1, opened after rotation");
    execute_and_settle(&rotated, "after").await;
    assert!(stored(&env, "before").await.0.starts_with(b"\0IPE\x03\x02k1"));
    assert!(stored(&env, "after").await.0.starts_with(b"\0IPE\x03\x02k2"));

    // Encryption turned off, keys kept: old records still open, new ones are stored in clear.
    rotated.stop().await.unwrap();
    let mut keys = toml::Table::new();
    keys.insert("k1".into(), BASE64.encode(K1).into());
    keys.insert("k2".into(), BASE64.encode(K2).into());
    let off = InProcessProxy::start(&uncached(&env).set("encryption.keys", keys)).await;
    let replay = settled(|| keyed_post(&off.url, "/orders", "after", "{\"card\":\"4111\"}")).await;
    assert!(replay.is_replay());
    let (clear, _) = execute_and_settle(&off, "clear-again").await;
    assert_eq!(stored(&env, "clear-again").await.0, clear.body.to_vec());
    assert_eq!(env.upstream.executions(), 3);
}

#[tokio::test]
async fn a_tampered_or_moved_record_is_refused_never_replayed_and_never_re_executed() {
    let env = TestEnv::new().await;
    let proxy = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&proxy, "victim").await;
    execute_and_settle(&proxy, "other").await;
    let client = env.db().client().await;

    // One changed byte in the ciphertext (the last one, part of the tag).
    client
        .execute(
            "UPDATE idemproxy.records
             SET response_body = set_byte(response_body, length(response_body) - 1,
                 (get_byte(response_body, length(response_body) - 1) + 1) % 256)
             WHERE key = 'victim'",
            &[],
        )
        .await
        .unwrap();
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "victim", "{\"card\":\"4111\"}")).await;
    reply.assert_problem(500, "record-unreadable");
    assert!(!reply.text().contains("exec"), "{}", reply.text());

    // Another record's intact ciphertext, moved into this row: bound to its own key, so refused.
    client
        .execute(
            "UPDATE idemproxy.records SET response_body = (SELECT response_body FROM idemproxy.records
             WHERE key = 'other') WHERE key = 'victim'",
            &[],
        )
        .await
        .unwrap();
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "victim", "{\"card\":\"4111\"}")).await;
    reply.assert_problem(500, "record-unreadable");

    // The body replaced by cleartext is refused too while plaintext is not accepted.
    client
        .execute(
            "UPDATE idemproxy.records SET response_body = '\\x7b7d'::bytea WHERE key = 'victim'",
            &[],
        )
        .await
        .unwrap();
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "victim", "{\"card\":\"4111\"}")).await;
    reply.assert_problem(500, "record-unreadable");

    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_undecryptable_records_total", &[]).await,
        3.0
    );
    assert_eq!(
        env.upstream.executions(),
        2,
        "a refused record is never executed again"
    );
}

#[tokio::test]
async fn a_record_sealed_with_a_key_no_longer_configured_is_refused() {
    let env = TestEnv::new().await;
    let old = InProcessProxy::start(&encrypted(&env, "k1", &[("k1", K1)])).await;
    execute_and_settle(&old, "orphan").await;
    old.stop().await.unwrap();

    let fail_open = encrypted(&env, "k2", &[("k2", K2)]).set("store.on_error", "fail_open");
    let proxy = InProcessProxy::start(&fail_open).await;
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "orphan", "{\"card\":\"4111\"}")).await;
    reply.assert_problem(500, "record-unreadable");
    assert_eq!(
        env.upstream.executions(),
        1,
        "not forwarded, even with fail_open: the store did answer"
    );
}
