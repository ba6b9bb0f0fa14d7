//! One request, many keys (issue 49): a JSON-RPC batch on a `jsonrpc` route, each call claimed under its
//! own key, and a GraphQL mutation on a `graphql` route, each root field claimed under its
//! `@idempotent(key:)`. Behind the proxy, real services in Python (`batches/`): `jsonrpcserver` and
//! `graphql-core` (whose schema does not declare `@idempotent`, so a directive the proxy forwarded would
//! fail there), each counting its executions per key or ref and showing what it received. In front, the
//! tests' own HTTP client, and the `jsonrpcclient` and `gql` libraries. Each test checks what ran upstream
//! and what every call or field was answered, in the client's order with the client's ids; the last ones
//! kill the real binary mid-batch and check that nothing completed before runs again.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use rstest::rstest;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use crate::support::http::client;
use crate::support::{
    Backend, InProcessProxy, ProxyConfig, ProxyProcess, Reply, TestEnv, metric_reaches, poll_until,
};

/// The JSON-RPC routes the tests run under: the issue's as written, and beside it one of each with the
/// setting a test is about.
const RPC_ROUTES: &str = r#"
[[routes]]
name = "rpc"
path = "/rpc"
methods = ["POST"]
key = "jsonrpc"

[[routes]]
name = "rpc-held"
path = "/rpc-held"
methods = ["POST"]
key = "jsonrpc"
on_unknown_outcome = "hold"

[[routes]]
name = "rpc-wait"
path = "/rpc-wait"
methods = ["POST"]
key = "jsonrpc"
on_in_flight = "wait"
wait_timeout = "60s"
"#;

/// The GraphQL routes, likewise.
const GRAPHQL_ROUTES: &str = r#"
[[routes]]
name = "gql"
path = "/graphql"
methods = ["POST"]
key = "graphql"

[[routes]]
name = "gql-held"
path = "/graphql-held"
methods = ["POST"]
key = "graphql"
on_unknown_outcome = "hold"

[[routes]]
name = "gql-released"
path = "/graphql-released"
methods = ["POST"]
key = "graphql"
release_graphql_errors = true

[[routes]]
name = "gql-required"
path = "/graphql-required"
methods = ["POST"]
key = "graphql"
required = true
"#;

/// The Python programs and their `requirements.txt` (pinned).
const PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/protocols/batches");

/// A Python with the libraries installed, in `target/test-tools/batches` (a minute on first use).
async fn python() -> PathBuf {
    tokio::task::spawn_blocking(|| {
        crate::support::tools::python_venv("batches", Path::new(&format!("{PROGRAMS}/requirements.txt")))
    })
    .await
    .unwrap()
}

/// A Python service of `batches/` on 127.0.0.1, killed when dropped.
struct Service {
    _child: Child,
    url: String,
}

impl Service {
    /// `program` started on any free port, once it has said which (its first line).
    async fn start(program: &str) -> Service {
        Service::start_on(program, 0).await
    }

    /// `program` started on `port` (any free one for 0).
    async fn start_on(program: &str, port: u16) -> Service {
        let mut child = Command::new(python().await)
            .arg(format!("{PROGRAMS}/{program}"))
            .arg(port.to_string())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{program} starts: {e}"));
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("{program} says its port within a minute"))
            .unwrap()
            .unwrap_or_default();
        let port: u16 = first
            .strip_prefix("PORT ")
            .and_then(|port| port.parse().ok())
            .unwrap_or_else(|| panic!("{program}'s first line is its port: {first:?}"));
        Service {
            _child: child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    async fn jsonrpc() -> Service {
        Service::start("jsonrpc_server.py").await
    }

    async fn graphql() -> Service {
        Service::start("graphql_server.py").await
    }

    /// What the service counted (`GET /counts`).
    async fn counts(&self) -> Value {
        Reply::of(client().get(format!("{}/counts", self.url)))
            .await
            .json()
    }

    /// Returns once the slow call `query` names (`key=K`, `ref=R`) has arrived.
    async fn arrived(&self, query: &str) {
        let reply = Reply::of(client().get(format!("{}/arrived?{query}", self.url))).await;
        assert_eq!(reply.status, 200, "the slow call {query} arrived");
    }

    /// `POST {path_and_query}` to the service's test endpoints (`/release?…`, `/fail?…`, `/fail-next`).
    async fn control(&self, path_and_query: &str) {
        let reply = Reply::of(client().post(format!("{}{path_and_query}", self.url))).await;
        assert_eq!(reply.status, 200, "{path_and_query}");
    }
}

/// A port on 127.0.0.1 that nothing listens on (until a test starts a service there).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A `TestEnv` on `backend` and the in-process proxy in front of `service` with `routes`.
async fn proxy_for(backend: Backend, service: &Service, routes: &str) -> (TestEnv, InProcessProxy) {
    let env = TestEnv::on(backend).await;
    let config = ProxyConfig::on(&env.store, &service.url).with_toml(routes);
    let proxy = InProcessProxy::start(&config).await;
    (env, proxy)
}

/// `POST {base}{path}` with a JSON body and the client's credential.
fn post(base: &str, path: &str, body: &Value) -> reqwest::RequestBuilder {
    post_as(base, path, body, "Bearer agent-1")
}

/// [`post`] with `credential` as the `Authorization`.
fn post_as(base: &str, path: &str, body: &Value, credential: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{base}{path}"))
        .header("authorization", credential)
        .header("content-type", "application/json")
        .body(body.to_string())
}

/// Runs the client `program` of `batches/` against `url` with `input` on its standard input, and returns
/// the JSON it prints.
async fn run_client(program: &str, url: &str, input: &Value) -> Value {
    let mut child = Command::new(python().await)
        .arg(format!("{PROGRAMS}/{program}"))
        .arg(url)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{program} starts: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.to_string().as_bytes()).await.unwrap();
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{program} finishes within two minutes"))
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{program} failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{program} printed {stdout}"))
}

// JSON-RPC batches.

/// A JSON-RPC call of `method` with `params`, under `key` in `params._meta.idempotencyKey` if any; a
/// notification where `id` is `None`.
fn rpc(method: &str, id: Option<Value>, key: Option<&str>, mut params: Value) -> Value {
    if let Some(key) = key {
        params["_meta"] = json!({"idempotencyKey": key});
    }
    let mut call = json!({"jsonrpc": "2.0", "method": method, "params": params});
    if let Some(id) = id {
        call["id"] = id;
    }
    call
}

/// `charge(amount)` with `id`, under `key` if any.
fn charge(id: Value, key: Option<&str>, amount: u64) -> Value {
    rpc("charge", Some(id), key, json!({"amount": amount}))
}

/// The answers of a batch reply: a `200` JSON array.
fn answers(reply: &Reply) -> Vec<Value> {
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        reply
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/json")),
        "{:?}",
        reply.header("content-type")
    );
    match reply.json() {
        Value::Array(answers) => answers,
        other => panic!("a batch is answered with an array: {other}"),
    }
}

/// The ids of `answers`, in order.
fn ids(answers: &[Value]) -> Vec<Value> {
    answers.iter().map(|answer| answer["id"].clone()).collect()
}

/// Asserts that `answer` is the proxy's error for the call `id`: JSON-RPC `code`, and in `data` the
/// problem type `slug` and the HTTP `status` a lone call would have got (where given).
fn assert_call_error(answer: &Value, id: &Value, code: i64, slug: &str, status: Option<u16>) {
    assert_eq!(answer["jsonrpc"], "2.0", "{answer}");
    assert_eq!(&answer["id"], id, "{answer}");
    assert!(answer.get("result").is_none(), "{answer}");
    let error = &answer["error"];
    assert_eq!(error["code"], code, "{answer}");
    assert!(error["message"].is_string(), "a title: {answer}");
    let expected = format!("https://idemproxy.dev/problems/{slug}");
    assert_eq!(error["data"]["type"], expected.as_str(), "{answer}");
    if let Some(status) = status {
        assert_eq!(error["data"]["status"], status, "{answer}");
    }
}

/// The 40 keyed calls an earlier request runs, and a batch of 100 with ids alternating numbers and
/// strings: the calls at `i % 5` 0 and 2 repeat the earlier ones in their order (same key, same call), the
/// others are new, 50 with keys of their own and 10 (`i % 10 == 9`) without a key.
fn hundred_calls() -> (Vec<Value>, Vec<Value>) {
    let earlier: Vec<Value> = (0..40)
        .map(|n| charge(json!(format!("earlier-{n}")), Some(&format!("k-{n}")), n))
        .collect();
    let mut repeated = 0;
    let batch = (0..100u64)
        .map(|i| {
            let id = if i % 2 == 0 {
                json!(i)
            } else {
                json!(format!("c-{i}"))
            };
            match i % 5 {
                0 | 2 => {
                    let n = repeated;
                    repeated += 1;
                    charge(id, Some(&format!("k-{n}")), n)
                }
                4 if i % 10 == 9 => charge(id, None, 1000 + i),
                _ => charge(id, Some(&format!("new-{i}")), 1000 + i),
            }
        })
        .collect();
    (earlier, batch)
}

/// The key of a call built by [`rpc`], if any.
fn key_of(call: &Value) -> Option<String> {
    call["params"]["_meta"]["idempotencyKey"]
        .as_str()
        .map(str::to_owned)
}

#[rstest]
#[tokio::test]
async fn batches_a_100_call_batch_whose_40_keys_already_ran_sends_60_calls_upstream_and_answers_all_100_in_order(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(backend, &service, RPC_ROUTES).await;
    let (earlier, batch) = hundred_calls();
    let first = answers(&Reply::of(post(&proxy.url, "/rpc", &Value::from(earlier.clone()))).await);
    assert_eq!(ids(&first), ids(&earlier));
    assert_eq!(service.counts().await["batches"], json!([40]));

    let reply = Reply::of(post(&proxy.url, "/rpc", &Value::from(batch.clone()))).await;
    assert!(!reply.is_replay(), "60 of its calls ran");
    let answered = answers(&reply);
    assert_eq!(
        ids(&answered),
        ids(&batch),
        "every call answered, in the client's order, with its id"
    );
    let counts = service.counts().await;
    assert_eq!(
        counts["batches"],
        json!([40, 60]),
        "the 60 calls not run before went upstream as one batch: {counts}"
    );
    assert_eq!(counts["executions"], 100);
    let upstream_keys: Vec<Option<String>> = counts["calls"].as_array().unwrap()[40..]
        .iter()
        .map(|call| call[1].as_str().map(str::to_owned))
        .collect();
    let sent: Vec<Option<String>> = batch
        .iter()
        .map(key_of)
        .filter(|key| !key.as_ref().is_some_and(|k| k.starts_with("k-")))
        .collect();
    assert_eq!(upstream_keys, sent, "in the client's order");
    for (call, answer) in batch.iter().zip(&answered) {
        match key_of(call) {
            Some(key) if key.starts_with("k-") => {
                let n: usize = key[2..].parse().unwrap();
                assert_eq!(
                    answer["result"], first[n]["result"],
                    "{key} answered from the store: {answer}"
                );
            }
            _ => assert_eq!(answer["result"]["charged"], call["params"]["amount"], "{answer}"),
        }
    }
    for (key, executions) in counts["keys"].as_object().unwrap() {
        assert_eq!(executions, 1, "{key} ran once");
    }
}

#[rstest]
#[tokio::test]
async fn batches_a_100_call_batch_repeating_40_keys_within_itself_sends_60_calls_upstream_and_replays_the_repeats(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(backend, &service, RPC_ROUTES).await;
    // Calls 0..60 have keys of their own; call 60 + n repeats call n's, with the same call, ids apart.
    let batch: Vec<Value> = (0..100u64)
        .map(|i| {
            let n = if i < 60 { i } else { i - 60 };
            charge(json!(format!("id-{i}")), Some(&format!("key-{n}")), n)
        })
        .collect();
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &Value::from(batch.clone()))).await);
    assert_eq!(ids(&answered), ids(&batch));
    let counts = service.counts().await;
    assert_eq!(counts["batches"], json!([60]), "{counts}");
    assert_eq!(counts["executions"], 60);
    for i in 60..100 {
        assert_eq!(
            answered[i]["result"],
            answered[i - 60]["result"],
            "the later call under a key is answered as a replay of the first"
        );
    }
    let once: Vec<&Value> = counts["keys"].as_object().unwrap().values().collect();
    assert_eq!(once, vec![&json!(1); 60]);
}

#[tokio::test]
async fn batches_a_batch_call_and_the_same_call_sent_alone_replay_each_other() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let charge_of = |key: &str, amount: u64, id: Value| json!(["charge", {"amount": amount, "_meta": {"idempotencyKey": key}}, id]);
    let messages = json!([
        {"batch": [charge_of("a", 5, json!(1)), charge_of("b", 7, json!(2))]},
        {"call": charge_of("a", 5, json!(10))},
        {"call": charge_of("c", 9, json!(11))},
        {"batch": [charge_of("c", 9, json!("x")), charge_of("b", 7, json!("y"))]},
    ]);
    let report = run_client("jsonrpc_client.py", &format!("{}/rpc", proxy.url), &messages).await;
    let answers = |n: usize| report[n]["answers"].clone();
    let result = |n: usize, i: usize| answers(n)[i]["ok"].clone();
    assert_eq!(
        ids(answers(0).as_array().unwrap()),
        [json!(1), json!(2)],
        "{report}"
    );
    assert_eq!(
        report[1]["replayed"], "true",
        "a batch call's retry alone is a replay: {report}"
    );
    assert_eq!(answers(1)[0]["id"], 10);
    assert_eq!(result(1, 0), result(0, 0), "{report}");
    assert_eq!(result(2, 0)["keyExecution"], 1, "{report}");
    assert_eq!(ids(answers(3).as_array().unwrap()), [json!("x"), json!("y")]);
    assert_eq!(
        result(3, 0),
        result(2, 0),
        "a lone call's retry in a batch is a replay: {report}"
    );
    assert_eq!(result(3, 1), result(0, 1), "{report}");
    let counts = service.counts().await;
    assert_eq!(counts["keys"], json!({"a": 1, "b": 1, "c": 1}));
    assert_eq!(
        counts["requests"], 2,
        "the batch answered from the store went nowhere: {counts}"
    );
}

#[tokio::test]
async fn batches_a_key_in_another_clients_batch_is_that_clients_own() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([
        charge(json!(1), Some("shared-name"), 5),
        charge(json!(2), None, 1)
    ]);
    let mine = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    let theirs = answers(&Reply::of(post_as(&proxy.url, "/rpc", &batch, "Bearer agent-2")).await);
    assert_eq!(mine[0]["result"]["keyExecution"], 1);
    assert_eq!(
        theirs[0]["result"]["keyExecution"], 2,
        "the other client's call ran"
    );
    let again = answers(&Reply::of(post_as(&proxy.url, "/rpc", &batch, "Bearer agent-2")).await);
    assert_eq!(
        again[0]["result"], theirs[0]["result"],
        "and is replayed to that client"
    );
}

#[tokio::test]
async fn batches_unkeyed_calls_and_notifications_go_upstream_with_the_keyed_calls_and_notifications_get_no_answer()
 {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([
        charge(json!(1), None, 1),
        charge(json!(2), Some("keyed"), 2),
        rpc("note", None, None, json!({})),
        rpc("note", None, Some("keyed-note"), json!({})),
        charge(json!(3), None, 3),
    ]);
    let first = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(ids(&first), [json!(1), json!(2), json!(3)]);
    assert_eq!(service.counts().await["batches"], json!([5]));

    let retry = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(ids(&retry), [json!(1), json!(2), json!(3)]);
    assert_eq!(retry[1]["result"], first[1]["result"], "the keyed call replayed");
    assert_ne!(
        retry[0]["result"], first[0]["result"],
        "a call without a key runs again"
    );
    let counts = service.counts().await;
    assert_eq!(
        counts["batches"],
        json!([5, 3]),
        "the unkeyed calls and notification went again, without the keyed ones: {counts}"
    );
    assert_eq!(counts["keys"], json!({"keyed": 1, "keyed-note": 1}));

    let notifications = json!([
        rpc("note", None, None, json!({})),
        rpc("note", None, Some("keyed-note"), json!({}))
    ]);
    let silent = Reply::of(post(&proxy.url, "/rpc", &notifications)).await;
    assert_eq!(silent.status, 202, "{}", silent.text());
    assert!(silent.body.is_empty(), "{}", silent.text());
    let done = json!([rpc("note", None, Some("keyed-note"), json!({}))]);
    let stored = Reply::of(post(&proxy.url, "/rpc", &done)).await;
    assert_eq!(stored.status, 202, "{}", stored.text());
    assert!(stored.body.is_empty(), "{}", stored.text());
    let counts = service.counts().await;
    assert_eq!(counts["batches"], json!([5, 3, 1]), "{counts}");
    assert_eq!(counts["keys"]["keyed-note"], 1);
}

#[tokio::test]
async fn batches_a_batch_without_keys_passes_through_untouched_even_repeating_an_id() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([charge(json!(1), None, 1), charge(json!(1), None, 2)]);
    for run in 1..=2 {
        let reply = Reply::of(post(&proxy.url, "/rpc", &batch)).await;
        assert!(!reply.is_replay());
        assert!(
            reply
                .text()
                .starts_with(r#"[{"jsonrpc": "2.0", "result": {"charged": 1"#),
            "the service's own bytes: {}",
            reply.text()
        );
        assert_eq!(service.counts().await["executions"], 2 * run);
    }
}

/// "As today": before batches were split, a batch without keys went upstream whatever its size.
#[tokio::test]
async fn batches_a_batch_without_keys_of_over_1000_calls_passes_through_as_it_came() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch: Vec<Value> = (0..1001).map(|n| charge(json!(n), None, 1)).collect();
    let reply = Reply::of(post(&proxy.url, "/rpc", &Value::from(batch))).await;
    assert_eq!(answers(&reply).len(), 1001);
    assert_eq!(service.counts().await["batches"], json!([1001]));
}

/// `1` and `"1"` are two ids: neither a repeat refusing the batch, nor answers mixed up.
#[tokio::test]
async fn batches_ids_of_other_json_types_are_other_ids() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([
        charge(json!(1), Some("number"), 1),
        charge(json!("1"), Some("string"), 2),
        charge(json!(2), None, 3),
        charge(json!("2"), None, 4),
    ]);
    for _ in 0..2 {
        let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
        assert_eq!(ids(&answered), [json!(1), json!("1"), json!(2), json!("2")]);
        let charged: Vec<&Value> = answered.iter().map(|a| &a["result"]["charged"]).collect();
        assert_eq!(
            charged,
            [&json!(1), &json!(2), &json!(3), &json!(4)],
            "{answered:?}"
        );
    }
    assert_eq!(service.counts().await["keys"], json!({"number": 1, "string": 1}));
}

/// JSON-RPC asks the service to answer "the same value" as the `id`, and a service that reads numbers
/// as numbers writes `1.50` back as `1.5` and `1e2` as `100.0` (Python's `json` here): the call's answer
/// is found all the same, so it is not an unknown outcome that runs again.
#[tokio::test]
async fn batches_a_numeric_id_the_service_writes_back_another_way_still_finds_its_answer() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = r#"[
        {"jsonrpc": "2.0", "id": 1.50, "method": "charge", "params": {"amount": 1, "_meta": {"idempotencyKey": "decimal"}}},
        {"jsonrpc": "2.0", "id": 1e2, "method": "charge", "params": {"amount": 2, "_meta": {"idempotencyKey": "exponent"}}}
    ]"#;
    let send = || {
        client()
            .post(format!("{}/rpc", proxy.url))
            .header("authorization", "Bearer agent-1")
            .header("content-type", "application/json")
            .body(batch)
    };
    let first = answers(&Reply::of(send()).await);
    let charged: Vec<&Value> = first.iter().map(|a| &a["result"]["charged"]).collect();
    assert_eq!(charged, [&json!(1), &json!(2)], "{first:?}");
    let retry = answers(&Reply::of(send()).await);
    let results: Vec<&Value> = retry.iter().map(|a| &a["result"]).collect();
    assert_eq!(results, [&first[0]["result"], &first[1]["result"]], "{retry:?}");
    assert_eq!(
        service.counts().await["keys"],
        json!({"decimal": 1, "exponent": 1})
    );
}

/// A batch is refused whole, before anything runs, where a lone call with one of its calls' keys would
/// be: a key that is not one, or no credential to scope the keys by.
#[tokio::test]
async fn batches_a_batch_with_an_invalid_key_or_no_credential_is_refused_whole() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let invalid = json!([
        charge(json!(1), Some("fine"), 1),
        charge(json!(2), Some("not a key"), 1)
    ]);
    Reply::of(post(&proxy.url, "/rpc", &invalid))
        .await
        .assert_problem(400, "invalid-key");
    let keyed = json!([charge(json!(1), Some("fine"), 1)]);
    let anonymous = client()
        .post(format!("{}/rpc", proxy.url))
        .header("content-type", "application/json")
        .body(keyed.to_string());
    Reply::of(anonymous).await.assert_problem(400, "missing-scope");
    assert_eq!(service.counts().await["requests"], 0);
}

/// A call whose key an earlier notification of the batch carried (the same call but for the `id`, which
/// is no part of what a key stands for) still gets an answer under its `id`: a call is always answered.
#[tokio::test]
async fn batches_a_call_repeating_a_notifications_key_is_still_answered() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([
        rpc("charge", None, Some("told"), json!({"amount": 1})),
        charge(json!(7), Some("told"), 1),
    ]);
    let reply = Reply::of(post(&proxy.url, "/rpc", &batch)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answered = answers(&reply);
    assert_eq!(ids(&answered), [json!(7)], "{answered:?}");
    assert_eq!(service.counts().await["keys"], json!({"told": 1}));
}

/// A service that refuses a batch whole answers one error object, not an array (`jsonrpcserver` does for a
/// batch holding an element that is no call): nothing ran, so the keys are given back and the client's
/// corrected batch runs.
#[tokio::test]
async fn batches_a_batch_the_service_refuses_whole_gives_its_keys_back() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let call = charge(json!(1), Some("whole"), 1);
    let refused = answers(&Reply::of(post(&proxy.url, "/rpc", &json!([call, 42]))).await);
    let keyed = refused
        .iter()
        .find(|answer| answer["id"] == 1)
        .unwrap_or_else(|| panic!("the keyed call is answered: {refused:?}"));
    assert!(keyed["error"]["code"].is_i64(), "{refused:?}");
    assert_eq!(service.counts().await["executions"], 0);

    let corrected = answers(&Reply::of(post(&proxy.url, "/rpc", &json!([call]))).await);
    assert_eq!(corrected[0]["result"]["keyExecution"], 1, "{corrected:?}");
}

#[tokio::test]
async fn batches_a_key_reused_with_other_params_is_refused_for_that_call_alone_with_32091() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let alone = Reply::of(post(&proxy.url, "/rpc", &charge(json!(0), Some("used"), 5))).await;
    assert_eq!(alone.status, 200, "{}", alone.text());

    let batch = json!([
        charge(json!(1), Some("used"), 6),
        charge(json!(2), Some("fresh"), 6)
    ]);
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_call_error(&answered[0], &json!(1), -32091, "key-reused", Some(422));
    assert_eq!(answered[1]["id"], 2);
    assert_eq!(answered[1]["result"]["keyExecution"], 1);

    let within = json!([
        charge(json!("a"), Some("twice"), 1),
        charge(json!("b"), Some("twice"), 2)
    ]);
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &within)).await);
    assert_eq!(answered[0]["result"]["charged"], 1, "{}", answered[0]);
    assert_call_error(&answered[1], &json!("b"), -32091, "key-reused", Some(422));
    assert_eq!(
        service.counts().await["keys"],
        json!({"used": 1, "fresh": 1, "twice": 1})
    );
}

#[tokio::test]
async fn batches_a_call_whose_key_is_in_flight_gets_32090_with_retry_after_on_a_reject_route() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let slow = |id: Value| rpc("slow", Some(id), Some("slow-1"), json!({}));
    let original = tokio::spawn(Reply::of(post(&proxy.url, "/rpc", &slow(json!(1)))));
    service.arrived("key=slow-1").await;

    let batch = json!([slow(json!(7)), charge(json!(8), Some("beside"), 1)]);
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_call_error(&answered[0], &json!(7), -32090, "key-in-flight", Some(409));
    let retry_after = &answered[0]["error"]["data"]["retryAfter"];
    assert!(retry_after.as_u64().is_some_and(|s| s >= 1), "{}", answered[0]);
    assert_eq!(answered[1]["result"]["keyExecution"], 1, "the other call ran");

    service.control("/release?key=slow-1").await;
    let original = original.await.unwrap();
    assert_eq!(original.json()["result"]["slow"], true, "{}", original.text());
    let again = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(again[0]["id"], 7);
    assert_eq!(again[0]["result"], original.json()["result"], "now a replay");
    assert_eq!(again[1]["result"], answered[1]["result"]);
    assert_eq!(service.counts().await["keys"], json!({"slow-1": 1, "beside": 1}));
}

/// On a wait route, a batch that holds no key of its own waits for a key in flight as a lone call does: in
/// one of `server.max_waiting`'s seats (counted in `idemproxy_waiting_requests`, the test's signal), for
/// the stored answer; its calls without a key go upstream once it has it.
#[tokio::test]
async fn batches_a_call_whose_key_is_in_flight_waits_for_the_stored_answer_on_a_wait_route() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let slow = |id: Value| rpc("slow", Some(id), Some("slow-w"), json!({}));
    let original = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &slow(json!(1)))));
    service.arrived("key=slow-w").await;
    let batch = json!([slow(json!("waiter")), charge(json!(2), None, 1)]);
    let waiting = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &batch)));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    service.control("/release?key=slow-w").await;
    let original = original.await.unwrap();
    let answered = answers(&waiting.await.unwrap());
    assert_eq!(ids(&answered), [json!("waiter"), json!(2)]);
    assert_eq!(answered[0]["result"], original.json()["result"], "{answered:?}");
    assert_eq!(answered[1]["result"]["charged"], 1, "{answered:?}");
    let counts = service.counts().await;
    assert_eq!(counts["keys"], json!({"slow-w": 1}));
    assert_eq!(counts["executions"], 2);
}

#[tokio::test]
async fn batches_a_call_whose_key_stays_in_flight_gives_up_after_wait_timeout_with_32090() {
    let service = Service::jsonrpc().await;
    let routes = RPC_ROUTES.replace(r#"wait_timeout = "60s""#, r#"wait_timeout = "2s""#);
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, &routes).await;
    let slow = |id: Value| rpc("slow", Some(id), Some("stuck"), json!({}));
    let original = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &slow(json!(1)))));
    service.arrived("key=stuck").await;
    let batch = json!([slow(json!("waiter")), charge(json!(2), None, 1)]);
    let sent = std::time::Instant::now();
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc-wait", &batch)).await);
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_secs(2),
        "the call waited its wait_timeout: {waited:?}"
    );
    assert_call_error(&answered[0], &json!("waiter"), -32090, "key-in-flight", Some(409));
    assert_eq!(answered[1]["result"]["charged"], 1, "the other call ran");
    service.control("/release?key=stuck").await;
    original.await.unwrap();
    assert_eq!(service.counts().await["keys"], json!({"stuck": 1}));
}

/// A batch that holds keys runs them first, then waits for the key in flight elsewhere holding none of
/// its own (two batches each holding a key the other wants would otherwise wait for each other until both
/// time out): here it wins `beside` while a lone call holds `gate`, `beside` runs before it waits (the
/// signal: it is counted among the waiting requests), and once `gate` completes its answer is `gate`'s.
#[tokio::test]
async fn batches_a_batch_holding_keys_runs_them_then_waits_for_a_key_in_flight_on_a_wait_route() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let gate = |id: u64| rpc("slow", Some(json!(id)), Some("gate"), json!({}));
    let held = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &gate(0))));
    service.arrived("key=gate").await;
    let batch = json!([charge(json!(1), Some("beside"), 1), gate(2)]);
    let waiting = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &batch)));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    assert_eq!(
        service.counts().await["keys"],
        json!({"gate": 1, "beside": 1}),
        "beside ran before the batch waited"
    );
    service.control("/release?key=gate").await;
    let held = held.await.unwrap();
    let answered = answers(&waiting.await.unwrap());
    assert_eq!(answered[0]["result"]["keyExecution"], 1, "{answered:?}");
    assert_eq!(answered[1]["result"], held.json()["result"], "{answered:?}");
    assert_eq!(service.counts().await["keys"], json!({"gate": 1, "beside": 1}));
}

/// Two batches each wanting the key the other holds, behind a lone call holding `gate`: each runs what it
/// won, then both wait for `gate` holding nothing; once it completes, every call of both is answered and
/// each key ran once.
#[tokio::test]
async fn batches_two_batches_wanting_each_others_keys_on_a_wait_route_both_get_every_answer() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let gate = |id: u64| rpc("slow", Some(json!(id)), Some("gate"), json!({}));
    let held = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &gate(0))));
    service.arrived("key=gate").await;
    let batch = |(own, own_amount): (&str, u64), (other, other_amount): (&str, u64)| {
        json!([
            charge(json!(1), Some(own), own_amount),
            gate(2),
            charge(json!(3), Some(other), other_amount)
        ])
    };
    let (a, b) = (("a", 1), ("b", 2));
    let x = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &batch(a, b))));
    let y = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", &batch(b, a))));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 2.0).await;
    service.control("/release?key=gate").await;
    held.await.unwrap();
    for (name, batch) in [("x", x), ("y", y)] {
        let answered = answers(&batch.await.unwrap());
        let refused: Vec<&Value> = answered.iter().filter(|a| a.get("result").is_none()).collect();
        assert!(refused.is_empty(), "batch {name}: {refused:?}");
    }
    assert_eq!(service.counts().await["keys"], json!({"gate": 1, "a": 1, "b": 1}));
}

#[tokio::test]
async fn batches_a_call_the_upstream_left_unanswered_is_held_and_its_retry_gets_32092() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = |ids: [Value; 2]| {
        let [lost, kept] = ids;
        json!([
            rpc("vanish", Some(lost), Some("lost"), json!({})),
            charge(kept, Some("kept"), 1)
        ])
    };
    let first = answers(&Reply::of(post(&proxy.url, "/rpc-held", &batch([json!(1), json!(2)]))).await);
    assert_eq!(ids(&first), [json!(1), json!(2)]);
    let code = first[0]["error"]["code"].as_i64();
    assert!(
        matches!(code, Some(-32092 | -32093)),
        "the call whose answer never came is an error: {}",
        first[0]
    );
    assert_eq!(first[1]["result"]["keyExecution"], 1);

    let retry = answers(&Reply::of(post(&proxy.url, "/rpc-held", &batch([json!(5), json!(6)]))).await);
    assert_call_error(&retry[0], &json!(5), -32092, "outcome-unknown", Some(502));
    assert_eq!(
        retry[1]["result"], first[1]["result"],
        "the answered call replays"
    );
    let counts = service.counts().await;
    assert_eq!(counts["keys"], json!({"lost": 1, "kept": 1}));
    assert_eq!(counts["requests"], 1, "the held call was not sent again");
}

#[tokio::test]
async fn batches_an_upstream_5xx_for_the_batch_releases_every_call_and_a_retry_runs_them() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch = json!([
        charge(json!(1), Some("one"), 1),
        charge(json!(2), Some("two"), 2),
        charge(json!(3), None, 3),
    ]);
    service.control("/fail-next").await;
    let failed = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(ids(&failed), [json!(1), json!(2), json!(3)]);
    for (answer, id) in failed.iter().zip([json!(1), json!(2)]) {
        assert_eq!(answer["id"], id);
        assert_eq!(answer["error"]["code"], -32093, "{answer}");
        assert!(
            answer["error"]["data"]["type"]
                .as_str()
                .is_some_and(|t| t.starts_with("https://idemproxy.dev/problems/")),
            "{answer}"
        );
    }
    assert_eq!(service.counts().await["executions"], 0);

    let retry = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(ids(&retry), [json!(1), json!(2), json!(3)]);
    assert!(
        retry.iter().all(|answer| answer["result"]["charged"].is_number()),
        "{retry:?}"
    );
    let counts = service.counts().await;
    assert_eq!(counts["keys"], json!({"one": 1, "two": 1}));
    assert_eq!(counts["requests"], 2, "{counts}");
}

#[tokio::test]
async fn batches_a_keyed_batch_repeating_an_id_or_over_1000_calls_is_refused_whole() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let repeated = json!([charge(json!(1), Some("r-1"), 1), charge(json!(1), Some("r-2"), 1)]);
    Reply::of(post(&proxy.url, "/rpc", &repeated))
        .await
        .assert_problem(400, "jsonrpc-batch");
    let beside_unkeyed = json!([charge(json!("x"), None, 1), charge(json!("x"), Some("r-3"), 1)]);
    Reply::of(post(&proxy.url, "/rpc", &beside_unkeyed))
        .await
        .assert_problem(400, "jsonrpc-batch");
    let many: Vec<Value> = (0..1001)
        .map(|n| charge(json!(n), Some(&format!("m-{n}")), 1))
        .collect();
    Reply::of(post(&proxy.url, "/rpc", &Value::from(many)))
        .await
        .assert_problem(400, "jsonrpc-batch");
    assert_eq!(service.counts().await["requests"], 0, "nothing ran");
    let again = answers(
        &Reply::of(post(
            &proxy.url,
            "/rpc",
            &json!([charge(json!(1), Some("r-1"), 1)]),
        ))
        .await,
    );
    assert_eq!(
        again[0]["result"]["keyExecution"], 1,
        "no key was claimed: {}",
        again[0]
    );
}

#[tokio::test]
async fn batches_a_batch_of_1000_keyed_calls_runs_each_once() {
    let service = Service::jsonrpc().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, RPC_ROUTES).await;
    let batch: Vec<Value> = (0..1000)
        .map(|n| charge(json!(n), Some(&format!("t-{n}")), n))
        .collect();
    let batch = Value::from(batch);
    let answered = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(answered.len(), 1000);
    assert!(answered.iter().all(|a| a["result"]["keyExecution"] == 1));
    let again = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(again, answered, "all replayed");
    assert_eq!(service.counts().await["batches"], json!([1000]));
}

#[tokio::test]
async fn batches_a_batch_sent_while_the_service_is_down_is_released_and_its_retry_runs() {
    let port = closed_port();
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = ProxyConfig::on(&env.store, &format!("http://127.0.0.1:{port}")).with_toml(RPC_ROUTES);
    let proxy = InProcessProxy::start(&config).await;
    let batch = json!([
        charge(json!(1), Some("d-1"), 1),
        charge(json!("two"), Some("d-2"), 2)
    ]);
    let failed = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_call_error(&failed[0], &json!(1), -32093, "upstream-unreachable", Some(502));
    assert_call_error(
        &failed[1],
        &json!("two"),
        -32093,
        "upstream-unreachable",
        Some(502),
    );

    let service = Service::start_on("jsonrpc_server.py", port).await;
    let retry = answers(&Reply::of(post(&proxy.url, "/rpc", &batch)).await);
    assert_eq!(ids(&retry), [json!(1), json!("two")]);
    assert_eq!(service.counts().await["keys"], json!({"d-1": 1, "d-2": 1}));
}

// GraphQL.

/// A GraphQL-over-HTTP body.
fn graphql(query: &str, variables: Value) -> Value {
    json!({"query": query, "variables": variables})
}

/// The member names of the `data` object of the GraphQL answer `text`, in the order written.
fn data_keys(text: &str) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Answer {
        data: Keys,
    }
    serde_json::from_str::<Answer>(text)
        .unwrap_or_else(|e| panic!("{e}: {text}"))
        .data
        .0
}

/// An object's member names, in order.
struct Keys(Vec<String>);

impl<'de> Deserialize<'de> for Keys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Keys, D::Error> {
        struct Names;
        impl<'de> Visitor<'de> for Names {
            type Value = Keys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                let mut names = Vec::new();
                while let Some((name, IgnoredAny)) = map.next_entry::<String, IgnoredAny>()? {
                    names.push(name);
                }
                Ok(Keys(names))
            }
        }
        deserializer.deserialize_map(Names)
    }
}

/// The GraphQL requests the service received, as sent.
async fn posts(service: &Service) -> Vec<Value> {
    service.counts().await["posts"].as_array().unwrap().clone()
}

/// Asserts the proxy's GraphQL error with `code` about the field `response_key` is among `errors`.
fn assert_idempotency_error(answer: &Value, response_key: &str, code: &str) {
    assert_eq!(answer["data"][response_key], Value::Null, "{answer}");
    let errors = answer["errors"].as_array().unwrap_or_else(|| panic!("{answer}"));
    let error = errors
        .iter()
        .find(|e| e["path"] == json!([response_key]))
        .unwrap_or_else(|| panic!("an error at {response_key}: {answer}"));
    assert_eq!(error["extensions"]["code"], code, "{answer}");
    assert!(error["message"].is_string(), "{answer}");
}

const THREE: &str = r#"mutation Pay {
  first: charge(amount: 1, ref: "one") @idempotent(key: "pay-1") { ref execution }
  second: charge(amount: 2, ref: "two") @idempotent(key: "pay-2") { ref execution }
  third: charge(amount: 3, ref: "three") @idempotent(key: "pay-3") { ref execution }
}"#;

#[tokio::test]
async fn batches_graphql_three_keyed_mutations_retried_after_the_third_failed_execute_only_the_third() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    service.control("/fail?ref=three&times=1").await;
    let requests = json!([{"query": THREE}, {"query": THREE}]);
    let report = run_client("graphql_client.py", &format!("{}/graphql", proxy.url), &requests).await;
    let (first, retry) = (&report[0], &report[1]);
    assert_eq!(
        first["data"]["first"],
        json!({"ref": "one", "execution": 1}),
        "{report}"
    );
    assert_eq!(
        first["data"]["second"],
        json!({"ref": "two", "execution": 1}),
        "{report}"
    );
    assert_eq!(first["data"]["third"], Value::Null, "the third failed: {report}");
    assert!(
        first["errors"].as_array().is_some_and(|e| !e.is_empty()),
        "{report}"
    );
    assert_eq!(
        retry["data"],
        json!({
            "first": {"ref": "one", "execution": 1},
            "second": {"ref": "two", "execution": 1},
            "third": {"ref": "three", "execution": 1},
        }),
        "{report}"
    );
    assert_eq!(retry["errors"], Value::Null, "{report}");
    let counts = service.counts().await;
    assert_eq!(counts["executions"], json!({"one": 1, "two": 1, "three": 1}));
    assert_eq!(
        counts["posts"].as_array().map(Vec::len),
        Some(4),
        "three parts, then the third alone: {counts}"
    );
}

#[tokio::test]
async fn batches_graphql_fields_sent_while_the_service_is_down_are_released_and_their_retry_runs() {
    let port = closed_port();
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = ProxyConfig::on(&env.store, &format!("http://127.0.0.1:{port}")).with_toml(GRAPHQL_ROUTES);
    let proxy = InProcessProxy::start(&config).await;
    let body = graphql(
        r#"mutation {
  x: charge(amount: 1, ref: "x") @idempotent(key: "down-x") { execution }
  y: charge(amount: 2, ref: "y") @idempotent(key: "down-y") { execution }
}"#,
        json!({}),
    );
    let failed = Reply::of(post(&proxy.url, "/graphql", &body)).await.json();
    for field in ["x", "y"] {
        assert_eq!(failed["data"][field], Value::Null, "{failed}");
        let errors = failed["errors"].as_array().unwrap_or_else(|| panic!("{failed}"));
        assert!(errors.iter().any(|e| e["path"] == json!([field])), "{failed}");
    }

    let service = Service::start_on("graphql_server.py", port).await;
    let retry = Reply::of(post(&proxy.url, "/graphql", &body)).await.json();
    assert_eq!(
        retry,
        json!({"data": {"x": {"execution": 1}, "y": {"execution": 1}}})
    );
    assert_eq!(service.counts().await["executions"], json!({"x": 1, "y": 1}));
}

/// A field keyed in a mutation of several is the same request as the operation with it alone, and the
/// other way round: the operation (its name, the field's alias and arguments) is what counts.
#[tokio::test]
async fn batches_graphql_a_field_sent_among_others_and_then_alone_replays_and_vice_versa() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let send = |query: &str| Reply::of(post(&proxy.url, "/graphql", &graphql(query, json!({}))));
    let first = r#"mutation Pay { p: charge(amount: 1, ref: "p") @idempotent(key: "p") { execution } }"#;
    let second = r#"mutation Pay { q: charge(amount: 2, ref: "q") @idempotent(key: "q") { execution } }"#;
    let together = r#"mutation Pay {
  p: charge(amount: 1, ref: "p") @idempotent(key: "p") { execution }
  q: charge(amount: 2, ref: "q") @idempotent(key: "q") { execution }
}"#;
    let alone = send(first).await.json();
    assert_eq!(alone, json!({"data": {"p": {"execution": 1}}}));
    let both = send(together).await.json();
    assert_eq!(
        both,
        json!({"data": {"p": {"execution": 1}, "q": {"execution": 1}}}),
        "p replayed, q ran"
    );
    let again = send(second).await;
    assert_eq!(again.json(), json!({"data": {"q": {"execution": 1}}}));
    assert_eq!(service.counts().await["executions"], json!({"p": 1, "q": 1}));
}

/// A batch whose every call, and a mutation whose every field, is answered from the store is a replay,
/// as a lone call's retry is: nothing ran, and `Idempotent-Replayed: true` says so.
#[tokio::test]
async fn batches_a_request_answered_wholly_from_the_store_says_it_is_a_replay() {
    let rpc_service = Service::jsonrpc().await;
    let (_rpc_env, rpc_proxy) = proxy_for(Backend::Sqlite, &rpc_service, RPC_ROUTES).await;
    let batch = json!([charge(json!(1), Some("r-a"), 1), charge(json!(2), Some("r-b"), 2)]);
    let first = Reply::of(post(&rpc_proxy.url, "/rpc", &batch)).await;
    assert!(!first.is_replay());
    let again = Reply::of(post(&rpc_proxy.url, "/rpc", &batch)).await;
    assert_eq!(answers(&again), answers(&first));
    assert_eq!(rpc_service.counts().await["requests"], 1);

    let gql_service = Service::graphql().await;
    let (_gql_env, gql_proxy) = proxy_for(Backend::Sqlite, &gql_service, GRAPHQL_ROUTES).await;
    let mutation = graphql(
        r#"mutation { p: charge(amount: 1, ref: "p") @idempotent(key: "p") { execution } }"#,
        json!({}),
    );
    let gql_first = Reply::of(post(&gql_proxy.url, "/graphql", &mutation)).await;
    assert!(!gql_first.is_replay());
    let gql_again = Reply::of(post(&gql_proxy.url, "/graphql", &mutation)).await;
    assert_eq!(gql_again.json(), gql_first.json());
    assert_eq!(gql_service.counts().await["executions"], json!({"p": 1}));

    assert!(again.is_replay(), "the batch: {:?}", again.headers);
    assert!(gql_again.is_replay(), "the mutation: {:?}", gql_again.headers);
}

/// A document of several operations: the one `operationName` names is split; each part carries only the
/// fragments its field spreads (GraphQL refuses a document with a fragment it does not use).
#[tokio::test]
async fn batches_graphql_the_operation_named_is_split_and_each_part_takes_the_fragments_it_spreads() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let document = r#"query Greet { hello }
mutation Pay {
  withFragment: charge(amount: 1, ref: "f1") @idempotent(key: "f1") { ...Done }
  plain: charge(amount: 2, ref: "f2") @idempotent(key: "f2") { execution }
}
fragment Done on Charge { ref execution }"#;
    let body = json!({"query": document, "operationName": "Pay", "variables": {}});
    let reply = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(
        reply.json(),
        json!({"data": {
            "withFragment": {"ref": "f1", "execution": 1},
            "plain": {"execution": 1},
        }}),
    );
    let sent = posts(&service).await;
    assert_eq!(sent.len(), 2, "{sent:?}");
    let (first, second) = (
        sent[0]["query"].as_str().unwrap(),
        sent[1]["query"].as_str().unwrap(),
    );
    assert!(first.contains("fragment Done"), "{first}");
    assert!(!second.contains("fragment Done"), "{second}");
    assert!(!first.contains("Greet") && !second.contains("Greet"), "{sent:?}");
    let again = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(again.json(), reply.json());
    assert_eq!(service.counts().await["executions"], json!({"f1": 1, "f2": 1}));
}

/// A variable the key shares with an argument stays declared and given: only a declaration the directive
/// alone used goes with it.
#[tokio::test]
async fn batches_graphql_a_key_variable_the_field_also_uses_goes_upstream_with_it() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let query = r#"mutation Pay($k: String!) {
  charge(amount: 5, ref: $k) @idempotent(key: $k) { ref execution }
}"#;
    let body = graphql(query, json!({"k": "order-7"}));
    let first = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(
        first.json(),
        json!({"data": {"charge": {"ref": "order-7", "execution": 1}}})
    );
    let sent = posts(&service).await;
    assert_eq!(sent[0]["variables"], json!({"k": "order-7"}), "{sent:?}");
    assert!(!sent[0]["query"].as_str().unwrap().contains("@idempotent"));
    let other = Reply::of(post(
        &proxy.url,
        "/graphql",
        &graphql(query, json!({"k": "order-8"})),
    ))
    .await;
    assert_eq!(
        other.json()["data"]["charge"]["ref"],
        "order-8",
        "another key: another run"
    );
    let again = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(again.json(), first.json());
    assert_eq!(
        service.counts().await["executions"],
        json!({"order-7": 1, "order-8": 1})
    );
}

#[tokio::test]
async fn batches_graphql_root_fields_go_upstream_one_request_each_without_the_directive_and_merge_in_the_clients_order()
 {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let query = r#"mutation Pay($k: String!, $amount: Int!) {
  zulu: charge(amount: $amount, ref: "z") @idempotent(key: $k) { ref amount }
  alpha: charge(amount: 2, ref: "a") @idempotent(key: "lit") { ref amount }
  mike: charge(amount: 3, ref: "m") { ref amount }
}"#;
    let body = graphql(query, json!({"k": "var-key", "amount": 7}));
    let reply = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        data_keys(&reply.text()),
        ["zulu", "alpha", "mike"],
        "{}",
        reply.text()
    );
    assert_eq!(
        reply.json(),
        json!({"data": {
            "zulu": {"ref": "z", "amount": 7},
            "alpha": {"ref": "a", "amount": 2},
            "mike": {"ref": "m", "amount": 3},
        }})
    );
    let sent = posts(&service).await;
    assert_eq!(sent.len(), 3, "one request per root field: {sent:?}");
    for (post, field) in sent.iter().zip(["zulu:", "alpha:", "mike:"]) {
        let document = post["query"].as_str().unwrap();
        assert!(document.contains(field), "in document order: {sent:?}");
        assert_eq!(document.matches("charge(").count(), 1, "{document}");
        assert!(!document.contains("@idempotent"), "{document}");
    }
    let zulu = sent[0]["query"].as_str().unwrap();
    assert!(
        !zulu.contains("$k"),
        "the key's variable goes with the directive: {zulu}"
    );
    assert_eq!(sent[0]["variables"], json!({"amount": 7}), "{sent:?}");

    let retry = Reply::of(post(&proxy.url, "/graphql", &body)).await;
    assert_eq!(retry.json(), reply.json());
    let counts = service.counts().await;
    assert_eq!(
        counts["executions"],
        json!({"z": 1, "a": 1, "m": 2}),
        "the unkeyed field ran again"
    );
}

#[tokio::test]
async fn batches_graphql_each_idempotency_code_answers_the_field_it_concerns() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let send = |query: &str| Reply::of(post(&proxy.url, "/graphql-held", &graphql(query, json!({}))));
    let done =
        send(r#"mutation { used: charge(amount: 1, ref: "used") @idempotent(key: "used") { execution } }"#)
            .await;
    assert_eq!(done.json()["data"]["used"]["execution"], 1, "{}", done.text());
    // The service closes the connection once the field ran: nobody knows its outcome.
    send(r#"mutation { lost: vanish(ref: "lost") @idempotent(key: "lost") { execution } }"#).await;
    let running = tokio::spawn(send(
        r#"mutation { busy: slow(ref: "busy") @idempotent(key: "busy") { execution } }"#,
    ));
    service.arrived("ref=busy").await;

    let all = send(
        r#"mutation {
  used: charge(amount: 2, ref: "used") @idempotent(key: "used") { execution }
  busy: slow(ref: "busy") @idempotent(key: "busy") { execution }
  lost: vanish(ref: "lost") @idempotent(key: "lost") { execution }
  fresh: charge(amount: 3, ref: "fresh") @idempotent(key: "fresh") { execution }
}"#,
    )
    .await;
    assert_eq!(all.status, 200, "{}", all.text());
    let answer = all.json();
    assert_idempotency_error(&answer, "used", "IDEMPOTENCY_KEY_PARAMETER_MISMATCH");
    assert_idempotency_error(&answer, "busy", "IDEMPOTENCY_CONCURRENT_REQUEST");
    assert_idempotency_error(&answer, "lost", "IDEMPOTENCY_PREVIOUS_ATTEMPT_FAILED");
    assert_eq!(answer["data"]["fresh"]["execution"], 1, "{answer}");
    assert_eq!(answer["errors"].as_array().map(Vec::len), Some(3), "{answer}");
    assert_eq!(data_keys(&all.text()), ["used", "busy", "lost", "fresh"]);

    service.control("/release?ref=busy").await;
    running.await.unwrap();
    let counts = service.counts().await;
    assert_eq!(
        counts["executions"],
        json!({"used": 1, "lost": 1, "busy": 1, "fresh": 1})
    );
}

#[tokio::test]
async fn batches_graphql_a_field_error_is_stored_and_replayed_unless_the_route_releases_it() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let refused = |route: &str, reference: &str| {
        let query = format!(
            r#"mutation {{ r: refuse(amount: 4, ref: "{reference}") @idempotent(key: "refused") {{ execution }} }}"#
        );
        Reply::of(post(&proxy.url, route, &graphql(&query, json!({}))))
    };
    let first = refused("/graphql", "stored").await;
    assert_eq!(first.json()["data"], json!({"r": null}), "{}", first.text());
    assert_eq!(first.json()["errors"][0]["message"], "card declined");
    let again = refused("/graphql", "stored").await;
    assert_eq!(again.json(), first.json(), "the stored field error, replayed");

    let first = refused("/graphql-released", "released").await;
    assert_eq!(first.json()["errors"][0]["message"], "card declined");
    let again = refused("/graphql-released", "released").await;
    assert_eq!(again.json()["errors"][0]["message"], "card declined");
    assert!(!again.is_replay());
    assert_eq!(
        service.counts().await["executions"],
        json!({"stored": 1, "released": 2}),
        "released: the retry ran again"
    );
}

#[tokio::test]
async fn batches_graphql_queries_and_unkeyed_mutations_pass_through_untouched() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let bodies = [
        graphql("query Hi($n: String) { hello(name: $n) }", json!({"n": "you"})),
        graphql(
            r#"mutation { charge(amount: 1, ref: "plain") { execution } }"#,
            json!({}),
        ),
    ];
    for body in &bodies {
        for _ in 0..2 {
            let reply = Reply::of(post(&proxy.url, "/graphql", body)).await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            assert!(!reply.is_replay());
        }
    }
    let sent = posts(&service).await;
    assert_eq!(
        sent,
        [&bodies[0], &bodies[0], &bodies[1], &bodies[1]].map(Value::clone),
        "forwarded as sent"
    );
    assert_eq!(
        service.counts().await["executions"],
        json!({"query": 2, "plain": 2})
    );
}

/// A document that does not parse, sent where keys are optional (`/graphql`) and where they are required
/// (`/graphql-required`): the service's own answer, or `400` `graphql-request` before the service.
async fn send_unparseable(query: &str) -> (Reply, Reply, Vec<Value>) {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let broken = graphql(query, json!({}));
    let optional = Reply::of(post(&proxy.url, "/graphql", &broken)).await;
    let required = Reply::of(post(&proxy.url, "/graphql-required", &broken)).await;
    (optional, required, posts(&service).await)
}

/// The service's syntax error: the answer of a service that got the document as sent.
fn assert_service_syntax_error(reply: &Reply) {
    assert!(
        reply.json()["errors"][0]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("Syntax Error")),
        "the service's own answer: {}",
        reply.text()
    );
}

#[tokio::test]
async fn batches_graphql_an_unparseable_document_is_forwarded_where_keys_are_optional_and_refused_where_required()
 {
    let query = r#"mutation { charge(amount: 1 { execution }"#;
    let (optional, required, posts) = send_unparseable(query).await;
    assert_service_syntax_error(&optional);
    required.assert_problem(400, "graphql-request");
    assert_eq!(
        posts,
        [graphql(query, json!({}))],
        "once, where keys are optional"
    );
}

/// As the issue has it: a document that does not parse is forwarded unprotected where keys are optional,
/// whatever it holds (`@idempotent` included).
#[tokio::test]
async fn batches_graphql_an_unparseable_document_naming_idempotent_is_forwarded_where_keys_are_optional() {
    let query = r#"mutation { charge(amount: 1 @idempotent(key: "broken") { execution }"#;
    let (optional, required, posts) = send_unparseable(query).await;
    required.assert_problem(400, "graphql-request");
    assert_service_syntax_error(&optional);
    assert_eq!(posts, [graphql(query, json!({}))]);
}

/// A JSON array of GraphQL requests (Apollo's batching) cannot be split into keyed fields: it is
/// forwarded as it came where it names no `@idempotent`, and refused where it does, so a keyed field is
/// never run unprotected.
#[tokio::test]
async fn batches_graphql_a_batched_array_of_requests_passes_unless_it_names_idempotent() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let plain = json!([graphql("{ hello }", json!({})), graphql("{ hello }", json!({}))]);
    let forwarded = Reply::of(post(&proxy.url, "/graphql", &plain)).await;
    assert_eq!(
        forwarded.json(),
        json!([{"data": {"hello": "hello world"}}, {"data": {"hello": "hello world"}}])
    );
    let keyed = json!([graphql(
        r#"mutation { charge(amount: 1, ref: "arr") @idempotent(key: "arr") { execution } }"#,
        json!({})
    )]);
    Reply::of(post(&proxy.url, "/graphql", &keyed))
        .await
        .assert_problem(400, "graphql-request");
    assert_eq!(posts(&service).await, [plain]);
}

#[tokio::test]
async fn batches_graphql_a_misplaced_or_repeated_directive_or_one_key_on_two_fields_is_refused() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let refused = [
        r#"mutation { charge(amount: 1) { execution @idempotent(key: "nested") } }"#,
        r#"query { hello @idempotent(key: "in-a-query") }"#,
        r#"mutation { ...F } fragment F on Mutation { charge(amount: 1) @idempotent(key: "fragment") { execution } }"#,
        r#"mutation { charge(amount: 1) @idempotent(key: "one") @idempotent(key: "two") { execution } }"#,
        r#"mutation {
  a: charge(amount: 1) @idempotent(key: "same") { execution }
  b: charge(amount: 2) @idempotent(key: "same") { execution }
}"#,
    ];
    for query in refused {
        let reply = Reply::of(post(&proxy.url, "/graphql", &graphql(query, json!({})))).await;
        assert_eq!(reply.status, 400, "{query}: {}", reply.text());
        reply.assert_problem(400, "graphql-request");
    }
    assert!(posts(&service).await.is_empty());
}

#[tokio::test]
async fn batches_graphql_an_unreadable_key_or_a_mutation_over_32_fields_is_refused() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let fields: String = (0..33)
        .map(|n| format!(r#"f{n}: charge(amount: {n}) @idempotent(key: "wide-{n}") {{ execution }} "#))
        .collect();
    let cases = [
        (
            graphql(
                r#"mutation { charge(amount: 1) @idempotent(key: 5) { execution } }"#,
                json!({}),
            ),
            "invalid-key",
        ),
        (
            graphql(
                r#"mutation M($k: String) { charge(amount: 1) @idempotent(key: $k) { execution } }"#,
                json!({}),
            ),
            "invalid-key",
        ),
        (
            graphql(
                r#"mutation { charge(amount: 1) @idempotent(key: "") { execution } }"#,
                json!({}),
            ),
            "invalid-key",
        ),
        (
            graphql(&format!("mutation {{ {fields}}}"), json!({})),
            "graphql-request",
        ),
    ];
    for (body, slug) in cases {
        let reply = Reply::of(post(&proxy.url, "/graphql", &body)).await;
        assert_eq!(reply.status, 400, "{body}: {}", reply.text());
        reply.assert_problem(400, slug);
    }
    assert!(posts(&service).await.is_empty());
}

#[tokio::test]
async fn batches_graphql_a_route_requiring_keys_passes_queries_and_refuses_an_unkeyed_mutation() {
    let service = Service::graphql().await;
    let (_env, proxy) = proxy_for(Backend::Sqlite, &service, GRAPHQL_ROUTES).await;
    let query = graphql("{ hello }", json!({}));
    let reply = Reply::of(post(&proxy.url, "/graphql-required", &query)).await;
    assert_eq!(reply.json(), json!({"data": {"hello": "hello world"}}));
    let unkeyed = graphql(r#"mutation { charge(amount: 1) { execution } }"#, json!({}));
    Reply::of(post(&proxy.url, "/graphql-required", &unkeyed))
        .await
        .assert_problem(400, "missing-key");
    assert_eq!(posts(&service).await, [query]);
}

// A proxy killed mid-batch.

/// The issue's JSON-RPC route for the crash tests, with a lease short enough to wait out and long enough
/// to outlive a restart.
const CRASH_RPC_ROUTE: &str = r#"
[[routes]]
name = "rpc"
path = "/rpc"
methods = ["POST"]
key = "jsonrpc"
lock_timeout = "15s"
"#;

/// The issue's GraphQL route, likewise.
const CRASH_GRAPHQL_ROUTE: &str = r#"
[[routes]]
name = "gql"
path = "/graphql"
methods = ["POST"]
key = "graphql"
lock_timeout = "15s"
"#;

/// The real binary in front of `service`, on `env`'s store, with `routes`.
async fn process_for(env: &TestEnv, service: &Service, routes: &str) -> ProxyProcess {
    ProxyProcess::spawn(&ProxyConfig::on(&env.store, &service.url).with_toml(routes)).await
}

#[rstest]
#[tokio::test]
async fn batches_a_proxy_killed_mid_batch_and_restarted_runs_no_completed_call_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let service = Service::jsonrpc().await;
    let env = TestEnv::on(backend).await;
    let mut dying = process_for(&env, &service, CRASH_RPC_ROUTE).await;
    let earlier = json!([charge(json!(1), Some("k1"), 1), charge(json!(2), Some("k2"), 2)]);
    let done = answers(&Reply::of(post(&dying.url, "/rpc", &earlier)).await);

    let batch = json!([
        charge(json!(11), Some("k1"), 1),
        charge(json!(12), Some("k2"), 2),
        rpc("slow", Some(json!(13)), Some("k3"), json!({})),
        charge(json!(14), Some("k4"), 4),
        charge(json!(15), None, 5),
    ]);
    // k1 and k2 are answered from the store; k3, k4 and the unkeyed call go upstream as one batch, where
    // the service runs them in order and holds k3 (never released: k4 never runs there).
    let original = tokio::spawn(Reply::try_of(post(&dying.url, "/rpc", &batch)));
    service.arrived("key=k3").await;
    dying.kill().await;
    assert!(
        original.await.unwrap().is_err(),
        "the killed proxy cannot have answered"
    );

    let successor = process_for(&env, &service, CRASH_RPC_ROUTE).await;
    let early = answers(&Reply::of(post(&successor.url, "/rpc", &batch)).await);
    assert_eq!(
        early[0]["result"], done[0]["result"],
        "completed before the kill: replayed"
    );
    assert_eq!(early[1]["result"], done[1]["result"]);
    assert_call_error(&early[2], &json!(13), -32090, "key-in-flight", Some(409));
    assert_call_error(&early[3], &json!(14), -32090, "key-in-flight", Some(409));

    let taken_over = poll_until("the dead proxy's lease to run out", || async {
        let answered = answers(&Reply::of(post(&successor.url, "/rpc", &batch)).await);
        (answered[2]["error"]["code"] != -32090).then_some(answered)
    })
    .await;
    assert_eq!(ids(&taken_over), ids(batch.as_array().unwrap()));
    assert_eq!(taken_over[0]["result"], done[0]["result"]);
    assert_eq!(taken_over[2]["result"]["slow"], true, "{}", taken_over[2]);
    assert_eq!(taken_over[3]["result"]["charged"], 4, "{}", taken_over[3]);
    let last = answers(&Reply::of(post(&successor.url, "/rpc", &batch)).await);
    assert_eq!(
        last[2]["result"], taken_over[2]["result"],
        "the taken-over call is stored"
    );
    assert_eq!(last[3]["result"], taken_over[3]["result"]);
    let counts = service.counts().await;
    assert_eq!(
        (
            &counts["keys"]["k1"],
            &counts["keys"]["k2"],
            &counts["keys"]["k4"]
        ),
        (&json!(1), &json!(1), &json!(1)),
        "nothing that had completed ran again: {counts}"
    );
    assert_eq!(
        counts["keys"]["k3"], 2,
        "the call running when the proxy died ran again once taken over: {counts}"
    );
}

#[rstest]
#[tokio::test]
async fn batches_graphql_a_proxy_killed_between_fields_and_restarted_runs_no_completed_field_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let service = Service::graphql().await;
    let env = TestEnv::on(backend).await;
    let mut dying = process_for(&env, &service, CRASH_GRAPHQL_ROUTE).await;
    let body = graphql(
        r#"mutation {
  a: charge(amount: 1, ref: "a") @idempotent(key: "a") { execution }
  b: charge(amount: 2, ref: "b") @idempotent(key: "b") { execution }
  c: slow(ref: "c") @idempotent(key: "c") { execution }
  d: charge(amount: 4, ref: "d") @idempotent(key: "d") { execution }
}"#,
        json!({}),
    );
    // a and b run and are stored one after the other; c is held at the service (never released), d waits.
    let original = tokio::spawn(Reply::try_of(post(&dying.url, "/graphql", &body)));
    service.arrived("ref=c").await;
    dying.kill().await;
    assert!(
        original.await.unwrap().is_err(),
        "the killed proxy cannot have answered"
    );

    let successor = process_for(&env, &service, CRASH_GRAPHQL_ROUTE).await;
    let early = Reply::of(post(&successor.url, "/graphql", &body)).await.json();
    assert_eq!(early["data"]["a"], json!({"execution": 1}), "replayed: {early}");
    assert_eq!(early["data"]["b"], json!({"execution": 1}), "replayed: {early}");
    assert_idempotency_error(&early, "c", "IDEMPOTENCY_CONCURRENT_REQUEST");

    let taken_over = poll_until("the dead proxy's lease to run out", || async {
        let answer = Reply::of(post(&successor.url, "/graphql", &body)).await.json();
        answer["data"]["c"].is_object().then_some(answer)
    })
    .await;
    assert_eq!(
        taken_over["data"],
        json!({
            "a": {"execution": 1},
            "b": {"execution": 1},
            "c": {"execution": 2},
            "d": {"execution": 1},
        }),
        "{taken_over}"
    );
    let last = Reply::of(post(&successor.url, "/graphql", &body)).await.json();
    assert_eq!(last["data"], taken_over["data"], "all stored now");
    assert_eq!(
        service.counts().await["executions"],
        json!({"a": 1, "b": 1, "c": 2, "d": 1}),
        "nothing that had completed ran again; the field running at the kill ran again once taken over"
    );
}
