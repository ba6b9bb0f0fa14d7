//! Keys are never written to a log in clear, at any level: every line about a record names it by its key
//! hash (`store::key_hash`: 8 bytes of SHA-256 over scope and key), as the access log does. The real
//! binary runs with `log.filter = "trace"` and JSON lines through the paths that log about a key (an
//! execution and its replay, a mismatch, a duplicate in flight, a client that leaves before the head, an
//! upstream body that breaks off and the stale takeover after it), and its whole stderr is searched for the keys.

use std::time::Duration;

use crate::support::http::client;
use crate::support::{Backend, ProxyProcess, Reply, TestEnv, keyed_post, poll_until, settled};

/// Keys no other text of a log could hold by chance.
const EXECUTED: &str = "ord-LOGSECRET-executed";
const UNSURE: &str = "ord-LOGSECRET-unsure";
const LEFT: &str = "ord-LOGSECRET-left";

/// The JSON log lines whose message is `message`.
fn lines_saying(log: &str, message: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line.get(line.find('{')?..)?).ok())
        .filter(|event| event["message"] == message)
        .collect()
}

/// The scope the proxy stored `key` under.
async fn scope_of(env: &TestEnv, key: &str) -> String {
    let db = env.db().client().await;
    let row = db
        .query_one("SELECT scope FROM idemproxy.records WHERE key = $1", &[&key])
        .await
        .expect("the record");
    row.get(0)
}

#[tokio::test]
async fn no_log_line_at_any_level_holds_a_key() {
    let env = TestEnv::on(Backend::Postgres).await;
    let config = env
        .config()
        .set("log.filter", "trace")
        .set("log.format", "json")
        .set("log.access", true)
        .set("idempotency.lock_timeout", "1s")
        .set("replay_cache.max_size", "0");
    let proxy = ProxyProcess::spawn(&config).await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", EXECUTED, "{}")).await;
    assert_eq!(first.status, 201);
    let replay = settled(|| keyed_post(&proxy.url, "/orders", EXECUTED, "{}")).await;
    assert!(replay.is_replay(), "{replay:?}");
    let other = Reply::of(keyed_post(&proxy.url, "/orders", EXECUTED, "{\"other\":1}")).await;
    other.assert_problem(422, "key-reused");

    // A client that gives up before the head: its request runs on, and the proxy notes that it left.
    let impatient = keyed_post(&proxy.url, "/slow", LEFT, "{}").timeout(Duration::from_millis(300));
    assert!(impatient.send().await.is_err(), "the gated request times out");
    env.upstream.wait_for_key(LEFT, 1).await;
    let duplicate = Reply::of(keyed_post(&proxy.url, "/slow", LEFT, "{}")).await;
    duplicate.assert_problem(409, "key-in-flight");
    env.upstream.release("slow");
    settled(|| keyed_post(&proxy.url, "/slow", LEFT, "{}")).await;

    // An unknown outcome leaves the claim to its lease; the retry after it takes the key over.
    let broken = match keyed_post(&proxy.url, "/reset-mid-body", UNSURE, "{}")
        .send()
        .await
    {
        Ok(response) => response.bytes().await.is_err(),
        Err(_) => true,
    };
    assert!(broken, "the client must not see a complete body");
    poll_until("a stale takeover of the unsure key", || async {
        let _ = client()
            .post(format!("{}/reset-mid-body", proxy.url))
            .header("idempotency-key", UNSURE)
            .header("authorization", crate::support::http::TEST_CREDENTIAL)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await;
        let log = proxy.stderr();
        (!lines_saying(&log, "stale claim taken over: its lease ran out").is_empty()).then_some(())
    })
    .await;

    let log = proxy.stderr();
    for key in [EXECUTED, UNSURE, LEFT] {
        let holding: Vec<&str> = log.lines().filter(|line| line.contains(key)).collect();
        assert!(holding.is_empty(), "{key} is in the log:\n{}", holding.join("\n"));
    }
    // The lines about those records were written, naming them by their hash.
    let hash = |scope: &str, key: &str| idemproxy::store::key_hash(scope, key);
    let unsure = hash(&scope_of(&env, UNSURE).await, UNSURE);
    for message in [
        "upstream body broke off; outcome unknown",
        "stale claim taken over: its lease ran out",
    ] {
        let lines = lines_saying(&log, message);
        assert!(
            lines.iter().any(|event| event["key_hash"] == unsure.as_str()),
            "no {message:?} line names {unsure}: {lines:?}"
        );
    }
    let left = hash(&scope_of(&env, LEFT).await, LEFT);
    let lines = lines_saying(
        &log,
        "client left before the response head; reading upstream to the end",
    );
    assert!(
        lines.iter().any(|event| event["key_hash"] == left.as_str()),
        "no line says the client of {left} left: {lines:?}"
    );
    let executed = hash(&scope_of(&env, EXECUTED).await, EXECUTED);
    let access = log
        .lines()
        .filter(|line| line.contains("idemproxy::access"))
        .filter(|line| line.contains(&executed))
        .count();
    assert!(
        access >= 3,
        "the access log names each request of {executed}: {access} lines"
    );
}
