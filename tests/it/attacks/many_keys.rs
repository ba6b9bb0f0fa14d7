//! Attacks on "one request, many keys" (issue 49): a JSON-RPC batch whose calls each carry a key, and a
//! GraphQL mutation whose root fields carry `@idempotent`. Each test is a client of the real proxy over
//! real sockets, in front of a service on a real socket that counts its executions per key, so a second
//! execution of a key is seen where it happens. Each test names the hole it pins down; each fails while
//! the hole is open.
//!
//! - A call keyed like a notification of the same batch gets no answer at all.
//! - A service that answers a batch with the calls' ids in another spelling of the same JSON value
//!   (`1e0` as `1.0`: JSON-RPC asks for the same *value*), or as an event stream (MCP's Streamable HTTP),
//!   or that refuses batches as a whole, has every keyed call it ran left unknown: run again after the
//!   lease (or held though nothing ran).
//! - Two batches claiming the same keys in opposite orders on a route that waits hold each other until
//!   `wait_timeout`.
//! - A takeover sent in a batch beside a new call is told upstream as a first attempt.
//! - The service's answers to batches are held outside `server.max_buffered_responses`.
//! - A GraphQL mutation with `@idempotent` sent as `application/graphql`, or in a batch (a JSON array of
//!   operations), goes upstream unprotected: it runs on every retry.
//! - An item answered over `max_stored_response` (or a batch answer over 64 MiB) is left unknown, not
//!   completed: it runs again on every retry after the lease, where a lone request is replayed `410`.
//! - Under `fail_open`, one slow claim sends the whole batch upstream, calls found completed included.
//! - A batch's call waiting for its key is not counted as waiting (nor held to `server.max_waiting`).
//! - The service's batch answer is parsed once per call (work: calls × answer size).
//! - Keyed notifications the service answered `5xx` are answered `202 Accepted`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::support::http::client;
use crate::support::{Backend, InProcessProxy, ProxyConfig, ProxyProcess, Reply, TestEnv, metric};

const ROUTES: &str = r#"
[[routes]]
name = "rpc"
path = "/rpc"
methods = ["POST"]
key = "jsonrpc"

[[routes]]
name = "rpc-hold"
path = "/rpc-hold"
methods = ["POST"]
key = "jsonrpc"
on_unknown_outcome = "hold"

[[routes]]
name = "rpc-wait"
path = "/rpc-wait"
methods = ["POST"]
key = "jsonrpc"
on_in_flight = "wait"
wait_timeout = "20s"

[[routes]]
name = "graphql"
path = "/graphql"
methods = ["POST"]
key = "graphql"
"#;

/// What the service saw: executions per key, and each request's `Idempotency-Attempt`.
#[derive(Default)]
struct Seen {
    executions: HashMap<String, usize>,
    attempts: Vec<Option<String>>,
}

/// A service on 127.0.0.1:0 that executes every JSON-RPC call it gets (counting them by
/// `params._meta.idempotencyKey`) and every GraphQL `charge` field (counting them by its `ref`), and
/// answers as the request's `x-mode` says.
struct Service {
    url: String,
    seen: Arc<Mutex<Seen>>,
}

impl Service {
    async fn start() -> Service {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Seen::default()));
        let shared = seen.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let seen = shared.clone();
                let service = service_fn(move |request| serve(request, seen.clone()));
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(socket), service),
                );
            }
        });
        Service { url, seen }
    }

    fn executions(&self, key: &str) -> usize {
        self.seen
            .lock()
            .unwrap()
            .executions
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    fn attempts(&self) -> Vec<Option<String>> {
        self.seen.lock().unwrap().attempts.clone()
    }
}

fn key_of(call: &Value) -> String {
    match &call["params"]["_meta"]["idempotencyKey"] {
        Value::String(text) => text.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

async fn serve(
    request: Request<hyper::body::Incoming>,
    seen: Arc<Mutex<Seen>>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    let mode = header("x-mode").unwrap_or_default();
    let pad: usize = header("x-pad").and_then(|p| p.parse().ok()).unwrap_or(0);
    let graphql = request.uri().path().starts_with("/graphql");
    let content_type = header("content-type").unwrap_or_default();
    seen.lock().unwrap().attempts.push(header("idempotency-attempt"));
    let body = request.into_body().collect().await?.to_bytes();
    if mode == "slow" {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    if graphql {
        return Ok(graphql_answer(&body, &content_type, &seen, pad));
    }
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        return Ok(reply(400, "text/plain", "not JSON".into()));
    };
    let execute = |call: &Value| -> Option<Value> {
        let call = call.as_object()?;
        let key = key_of(&Value::Object(call.clone()));
        let n = {
            let mut seen = seen.lock().unwrap();
            let n = seen.executions.entry(key.clone()).or_default();
            *n += 1;
            *n
        };
        let id = call.get("id")?.clone();
        // "respell": the id as a service that reads it into a number and writes it back has it (the
        // same JSON value, another spelling).
        let id = match (&id, mode.as_str()) {
            (Value::Number(number), "respell") => json!(number.as_f64().unwrap()),
            _ => id,
        };
        let mut result = json!({"key": key, "execution": n});
        if pad > 0 {
            result["pad"] = Value::String("x".repeat(pad));
        }
        Some(json!({"jsonrpc": "2.0", "id": id, "result": result}))
    };
    Ok(match &message {
        Value::Array(_) if mode == "unavailable" => reply(503, "text/plain", "down for maintenance".into()),
        Value::Array(_) if mode == "nobatch" => {
            let refusal = json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": -32600, "message": "batches are not supported"}});
            reply(200, "application/json", refusal.to_string())
        }
        Value::Array(calls) => {
            let answers: Vec<Value> = calls.iter().filter_map(execute).collect();
            if mode == "unanswered" {
                // Ran every call, answered none of them: each keyed call's outcome is unknown.
                reply(200, "application/json", "[]".into())
            } else if mode == "sse" {
                let events: String = answers
                    .iter()
                    .map(|answer| format!("event: message\r\ndata: {answer}\r\n\r\n"))
                    .collect();
                reply(200, "text/event-stream", events)
            } else if answers.is_empty() {
                reply(202, "", String::new())
            } else {
                reply(200, "application/json", Value::from(answers).to_string())
            }
        }
        call => match execute(call) {
            None => reply(202, "", String::new()),
            Some(answer) => reply(200, "application/json", answer.to_string()),
        },
    })
}

/// Executes each `charge(ref: "…")` of a GraphQL request (a JSON body, a JSON array of them, or an
/// `application/graphql` document), counting them by `ref`, and answers `{"data": {"a": …}}` for each.
fn graphql_answer(
    body: &[u8],
    content_type: &str,
    seen: &Arc<Mutex<Seen>>,
    pad: usize,
) -> Response<Full<Bytes>> {
    let documents: Vec<String> = if content_type.starts_with("application/graphql") {
        vec![String::from_utf8_lossy(body).into_owned()]
    } else {
        match serde_json::from_slice::<Value>(body) {
            Ok(Value::Array(operations)) => operations
                .iter()
                .map(|operation| operation["query"].as_str().unwrap_or_default().to_owned())
                .collect(),
            Ok(operation) => vec![operation["query"].as_str().unwrap_or_default().to_owned()],
            Err(_) => {
                return reply(
                    400,
                    "application/json",
                    r#"{"errors":[{"message":"not JSON"}]}"#.into(),
                );
            }
        }
    };
    let mut answers = Vec::new();
    for document in &documents {
        let mut n = 0;
        for (at, _) in document.match_indices("charge(ref: \"") {
            let rest = &document[at + "charge(ref: \"".len()..];
            let reference = rest.split('"').next().unwrap_or_default().to_owned();
            let mut seen = seen.lock().unwrap();
            let count = seen.executions.entry(reference).or_default();
            *count += 1;
            n = *count;
        }
        answers.push(json!({"data": {"a": {"execution": n, "pad": "x".repeat(pad)}}}));
    }
    let text = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Array(_)) => Value::from(answers).to_string(),
        _ => answers[0].to_string(),
    };
    reply(200, "application/json", text)
}

fn reply(status: u16, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::builder().status(status);
    if !content_type.is_empty() {
        response = response.header("content-type", content_type);
    }
    response.body(Full::new(Bytes::from(body))).unwrap()
}

/// The config of a proxy on `env`'s store in front of `service`, with a short lease so that a key left
/// to its lease comes back within the test.
fn config(env: &TestEnv, service: &Service) -> ProxyConfig {
    ProxyConfig::on(&env.store, &service.url)
        .with_toml(ROUTES)
        .set("idempotency.lock_timeout", "2s")
        .set("upstream.timeout", "10s")
}

async fn start(backend: Backend) -> (TestEnv, Service, InProcessProxy) {
    let env = TestEnv::on(backend).await;
    let service = Service::start().await;
    let proxy = InProcessProxy::start(&config(&env, &service)).await;
    (env, service, proxy)
}

fn post(url: &str, path: &str, body: impl Into<reqwest::Body>) -> reqwest::RequestBuilder {
    client()
        .post(format!("{url}{path}"))
        .header("authorization", "Bearer agent-1")
        .header("content-type", "application/json")
        .body(body)
}

/// A call with `id` (JSON text) keyed `key`.
fn call(id: &str, key: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"charge","params":{{"amount":5,"_meta":{{"idempotencyKey":"{key}"}}}}}}"#
    )
}

/// The answers of a batch answer, by their ids' JSON text.
fn by_id(reply: &Reply) -> HashMap<String, Value> {
    let answers: Vec<Value> = serde_json::from_slice(&reply.body)
        .unwrap_or_else(|e| panic!("a batch answer ({e}): {} {}", reply.status, reply.text()));
    answers
        .into_iter()
        .map(|answer| (answer["id"].to_string(), answer))
        .collect()
}

/// A batch whose keyed notification and keyed call share a key (the same call, so the second is
/// "answered as the first"): the call has an `id`, and JSON-RPC answers every call that has one. The
/// proxy answers it as the notification is, with nothing; a batch of only these two gets `202` and no
/// body, and the client waits for its call's answer forever.
#[tokio::test]
async fn many_keys_a_call_repeating_a_keyed_notification_of_its_batch_still_gets_an_answer() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let notification =
        r#"{"jsonrpc":"2.0","method":"charge","params":{"amount":5,"_meta":{"idempotencyKey":"shared"}}}"#;
    let batch = format!("[{notification},{}]", call("7", "shared"));
    let answer = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    assert_eq!(service.executions("shared"), 1, "run once");
    assert_eq!(
        answer.status,
        200,
        "the call with id 7 must be answered (a result or an error), not {} {:?}",
        answer.status,
        answer.text()
    );
    assert!(by_id(&answer).contains_key("7"), "{}", answer.text());
}

/// The service answers the batch in full, each call under its `id`, written back as the same JSON value
/// in its own spelling (`1e0` read as a number is written `1.0`; JSON-RPC requires the same value).
/// The proxy matches ids by their text, finds no answer for the call, marks its outcome unknown, and
/// once the lease runs out the retry runs the call again: a double execution of an operation that was
/// answered. A lone call with the same id is stored whole, whatever its answer's spelling.
#[tokio::test]
async fn many_keys_a_batch_answered_under_respelled_ids_runs_each_call_once() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let batch = format!("[{},{}]", call("1e0", "respelled-1"), call("2", "respelled-2"));
    let first = Reply::of(post(&proxy.url, "/rpc", batch.clone()).header("x-mode", "respell")).await;
    assert_eq!(service.executions("respelled-1"), 1);
    // Past the lease (2 s) a key left to it is taken over.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let retry = Reply::of(post(&proxy.url, "/rpc", batch).header("x-mode", "respell")).await;
    assert_eq!(
        service.executions("respelled-1"),
        1,
        "the call answered under id 1.0 ran again on retry; first answer: {}; retry: {}",
        first.text(),
        retry.text()
    );
    assert_eq!(service.executions("respelled-2"), 1);
}

/// MCP's Streamable HTTP lets a server answer a POST of a batch with an event stream holding the
/// responses (the TypeScript SDK's default). The proxy reads the answer as a JSON array only: every keyed
/// call the service ran is left unknown (and run again after the lease), and the answers of the calls
/// without a key are dropped.
#[tokio::test]
async fn many_keys_a_batch_answered_as_an_event_stream_runs_each_call_once_and_answers_every_call() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let batch = format!(
        r#"[{},{{"jsonrpc":"2.0","id":2,"method":"tools/list"}}]"#,
        call("1", "streamed")
    );
    let send = || {
        post(&proxy.url, "/rpc", batch.clone())
            .header("x-mode", "sse")
            .header("accept", "application/json, text/event-stream")
    };
    let first = Reply::of(send()).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let _retry = Reply::of(send()).await;
    assert_eq!(
        service.executions("streamed"),
        1,
        "the keyed call, answered in the stream, ran again: {}",
        first.text()
    );
    let text = first.text();
    assert!(
        text.contains(r#""execution""#) && !text.contains("-32093"),
        "the service's answers must reach the client: {text}"
    );
}

/// A service that does not take batches answers one with a single JSON-RPC error (`id` null) and runs
/// nothing. On a route that holds unknown outcomes, the proxy holds every keyed call of it: each key is
/// refused (`502` `outcome-unknown`) until an operator releases it, though nothing ran.
#[tokio::test]
async fn many_keys_a_batch_the_service_refuses_whole_leaves_no_key_held() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let batch = format!("[{}]", call("1", "refused-whole"));
    let first = Reply::of(post(&proxy.url, "/rpc-hold", batch).header("x-mode", "nobatch")).await;
    assert_eq!(service.executions("refused-whole"), 0, "nothing ran");
    let lone = Reply::of(post(&proxy.url, "/rpc-hold", call("2", "refused-whole"))).await;
    assert_eq!(
        lone.status,
        200,
        "the key of a call that never ran is held: {} {}; the batch's answer was {}",
        lone.status,
        lone.text(),
        first.text()
    );
    assert_eq!(service.executions("refused-whole"), 1);
}

/// Two batches carrying the same two keys in opposite orders, on a route that waits: each claims its
/// first key and waits for its second, which the other holds, until `wait_timeout` (20 s here), then
/// answers that call `-32090`. The service is fast; nothing was in flight but the two claims.
#[tokio::test]
async fn many_keys_batches_claiming_keys_in_opposite_orders_do_not_hold_each_other() {
    let (_env, _service, proxy) = start(Backend::Sqlite).await;
    let started = Instant::now();
    let mut pairs = Vec::new();
    for pair in 0..4 {
        let (a, b) = (format!("order-a-{pair}"), format!("order-b-{pair}"));
        let forward = format!("[{},{}]", call("1", &a), call("2", &b));
        let backward = format!("[{},{}]", call("1", &b), call("2", &a));
        pairs.push(tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", forward))));
        pairs.push(tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", backward))));
    }
    let mut refused = 0;
    for pair in pairs {
        let reply = pair.await.unwrap();
        refused += reply.text().matches("-32090").count();
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10) && refused == 0,
        "8 batches of 2 fast calls took {took:?}, {refused} call(s) refused as in flight"
    );
}

/// A key whose outcome was left unknown is taken over after its lease; sent in a batch after a new
/// call, the service is told `Idempotency-Attempt: 1` for the batch, so a service that resumes work on
/// `N;takeover` (as the contract invites) redoes it instead. Alone, the same retry says `2;takeover`.
#[tokio::test]
async fn many_keys_a_takeover_sent_in_a_batch_is_told_upstream_as_a_takeover() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    // The service runs the call and answers none: outcome unknown, left to its lease.
    let stale = format!("[{}]", call("1", "stale"));
    Reply::of(post(&proxy.url, "/rpc", stale).header("x-mode", "unanswered")).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let batch = format!("[{},{}]", call("1", "fresh"), call("2", "stale"));
    let answer = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let told = service.attempts().last().cloned().flatten();
    assert!(
        told.as_deref().is_some_and(|t| t.contains("takeover")),
        "a batch carrying a takeover of `stale` was told Idempotency-Attempt {told:?}"
    );
}

/// A call whose answer is larger than `max_stored_response`: alone, it is relayed, completed without
/// its body and replayed as `410` ("it ran; it will not run again"). In a batch the answer is read no
/// further than `max_stored_response` per call, so the call's outcome is left unknown: the client never
/// gets the answer, and every retry after the lease runs the call again. (The same for a batch whose
/// calls each answer under the limit but together pass the 64 MiB read for one batch.)
#[tokio::test]
async fn many_keys_a_call_answered_over_max_stored_response_in_a_batch_runs_once() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let config = config(&env, &service).set("idempotency.max_stored_response", "64KiB");
    let proxy = InProcessProxy::start(&config).await;
    let batch = format!("[{}]", call("1", "large-answer"));
    let send = || post(&proxy.url, "/rpc", batch.clone()).header("x-pad", "100000");
    let first = Reply::of(send()).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let _retry = Reply::of(send()).await;
    assert_eq!(
        service.executions("large-answer"),
        1,
        "a call answered with 100 kB ran again on retry; its first answer: {}",
        first.text().chars().take(300).collect::<String>()
    );
}

/// The same for a GraphQL field: its answer over `max_stored_response` leaves it unknown, and it runs
/// again on the retry after the lease.
#[tokio::test]
async fn many_keys_a_field_answered_over_max_stored_response_runs_once() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let config = config(&env, &service).set("idempotency.max_stored_response", "64KiB");
    let proxy = InProcessProxy::start(&config).await;
    let mutation = json!({"query": r#"mutation { a: charge(ref: "large-field") @idempotent(key: "graphql-large") { execution pad } }"#}).to_string();
    let send = || post(&proxy.url, "/graphql", mutation.clone()).header("x-pad", "100000");
    let first = Reply::of(send()).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let _retry = Reply::of(send()).await;
    assert_eq!(
        service.executions("large-field"),
        1,
        "a field answered with 100 kB ran again on retry; its first answer: {}",
        first.text().chars().take(300).collect::<String>()
    );
}

/// Under `store.on_error = "fail_open"`, a store that does not answer one item's claim in time sends
/// the client's whole body upstream unprotected: the calls whose keys this very request had just found
/// completed (answered from the store a moment before) run again. Here the claim of `blocked` waits on
/// a row another session holds (as a stuck transaction or a slow replica would) past `store.timeout`;
/// `done` was claimed first and found completed. Alone, `done` would be replayed.
#[tokio::test]
async fn many_keys_fail_open_does_not_rerun_the_calls_found_completed() {
    let env = TestEnv::on(Backend::Postgres).await;
    let service = Service::start().await;
    let config = config(&env, &service).set("store.on_error", "fail_open");
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(post(&proxy.url, "/rpc", format!("[{}]", call("1", "done")))).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let mut holder = env.db().client().await;
    let scope: String = holder
        .query_one("SELECT scope FROM idemproxy.records WHERE key = 'done'", &[])
        .await
        .unwrap()
        .get(0);
    let blocking = holder.transaction().await.unwrap();
    blocking
        .execute(
            "INSERT INTO idemproxy.records (scope, key, fingerprint, status, token, attempt, claim_kind,
                 locked_until, created_at, expires_at, updated_at)
             VALUES ($1, 'blocked', '\\x00', 'processing', gen_random_uuid(), 1, 'new', now(), now(),
                 now() + interval '1 day', now())",
            &[&scope],
        )
        .await
        .unwrap();
    let batch = format!("[{},{}]", call("1", "done"), call("2", "blocked"));
    let answer = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    blocking.rollback().await.unwrap();
    assert_eq!(
        service.executions("done"),
        1,
        "a call found completed ran again because another call's claim was slow: {}",
        answer.text()
    );
}

/// A batch's call that waits for its key (in flight in another request, on a route that waits) is
/// neither counted in `idemproxy_waiting_requests` nor held to `server.max_waiting`: a lone request
/// waiting the same way is both.
#[tokio::test]
async fn many_keys_a_batch_waiting_for_a_key_counts_as_waiting() {
    let (_env, _service, proxy) = start(Backend::Sqlite).await;
    let original = tokio::spawn(Reply::of(
        post(&proxy.url, "/rpc-wait", call("1", "waited-for")).header("x-mode", "slow"),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = tokio::spawn(Reply::of(post(
        &proxy.url,
        "/rpc-wait",
        format!("[{}]", call("2", "waited-for")),
    )));
    let mut seen = 0.0f64;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        seen = seen.max(metric(&proxy.admin_url, "idemproxy_waiting_requests", &[]).await);
    }
    let (original, batch) = (original.await.unwrap(), batch.await.unwrap());
    assert_eq!(original.status, 200, "{}", original.text());
    assert!(batch.text().contains(r#""execution":1"#), "{}", batch.text());
    assert!(
        seen >= 1.0,
        "a batch waited about 2.7 s for its call's key; idemproxy_waiting_requests never left {seen}"
    );
}

/// A batch of keyed notifications the service answers `503` (not processed: the keys are given back):
/// the client is told `202 Accepted`, as if the service had taken them, and has no reason to send them
/// again. Sent alone, the same notification gets the service's `503`.
#[tokio::test]
async fn many_keys_notifications_the_service_did_not_take_are_not_answered_accepted() {
    let (_env, _service, proxy) = start(Backend::Sqlite).await;
    let batch = r#"[{"jsonrpc":"2.0","method":"notify","params":{"_meta":{"idempotencyKey":"note-1"}}}]"#;
    let answer = Reply::of(post(&proxy.url, "/rpc", batch).header("x-mode", "unavailable")).await;
    assert!(
        !answer.status.is_success(),
        "the service answered 503 to the batch; the client got {} {:?}",
        answer.status,
        answer.text()
    );
}

/// The CPU time process `pid` has used, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// Each keyed call's answer is looked up by parsing the service's whole batch answer again
/// (`batch::answers` once per call): the proxy's work is the number of calls times the answer's size.
/// 300 calls answered with 20 kB each (a 6 MB answer) cost a parse of 6 MB 300 times over.
#[tokio::test]
async fn many_keys_a_batch_answer_is_read_once_not_once_per_call() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let proxy = ProxyProcess::spawn(&config(&env, &service)).await;
    let calls: Vec<String> = (0..300)
        .map(|n| call(&n.to_string(), &format!("cpu-{n}")))
        .collect();
    let body = format!("[{}]", calls.join(","));
    let before = cpu_seconds(proxy.pid());
    let request = post(&proxy.url, "/rpc", body)
        .header("x-pad", "20000")
        .timeout(Duration::from_secs(300));
    let answer = Reply::of(request).await;
    let spent = cpu_seconds(proxy.pid()) - before;
    assert_eq!(answer.status, 200);
    assert!(
        spent < 5.0,
        "one batch of 300 calls with a 6 MB answer took {spent:.1} s of the proxy's CPU"
    );
}

/// The peak resident memory of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// `server.max_buffered_responses` bounds the responses captured for storage at once, and the
/// operations guide promises memory "bounded by configuration, not by traffic". The service's answers
/// to batches are read whole (up to `max_stored_response` per call, 64 MiB per batch) outside that
/// budget, then copied: 8 batches of 12 calls of 3 MB each at once grow the real binary by about a GiB
/// with the budget set to 8 MiB.
#[tokio::test]
async fn many_keys_batch_answers_are_bounded_by_the_response_budget() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let config = config(&env, &service)
        .set("server.max_buffered_responses", "8MiB")
        .set("server.max_buffered_bodies", "16MiB")
        .set("idempotency.max_request_body", "1MiB");
    let proxy = ProxyProcess::spawn(&config).await;
    let before = peak_rss(proxy.pid());
    let mut batches = Vec::new();
    for batch in 0..8 {
        let calls: Vec<String> = (0..12)
            .map(|n| call(&n.to_string(), &format!("big-{batch}-{n}")))
            .collect();
        let body = format!("[{}]", calls.join(","));
        let request = post(&proxy.url, "/rpc", body)
            .header("x-pad", "3000000")
            .timeout(Duration::from_secs(120));
        batches.push(tokio::spawn(Reply::try_of(request)));
    }
    for batch in batches {
        let _ = batch.await.unwrap();
    }
    let grown = peak_rss(proxy.pid()).saturating_sub(before);
    eprintln!(
        "8 batches of 12 answers of 3 MB, max_buffered_responses = 8MiB: peak RSS grew {} MiB",
        grown / (1024 * 1024)
    );
    assert!(
        grown < 256 * 1024 * 1024,
        "the proxy grew by {} MiB holding batch answers, with max_buffered_responses = 8MiB",
        grown / (1024 * 1024)
    );
}

/// `application/graphql` (the document as the body, which express-graphql, graphql-yoga and others
/// take) with an `@idempotent` field: the proxy reads only JSON bodies, takes it for "not a GraphQL
/// request" and forwards it unprotected, so every retry runs the field again on a service that declares
/// the directive.
#[tokio::test]
async fn many_keys_an_idempotent_mutation_sent_as_application_graphql_runs_once() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let document = r#"mutation { a: charge(ref: "doc-1") @idempotent(key: "graphql-doc-1") { execution } }"#;
    for _ in 0..2 {
        let request = client()
            .post(format!("{}/graphql", proxy.url))
            .header("authorization", "Bearer agent-1")
            .header("content-type", "application/graphql")
            .body(document);
        let _ = Reply::of(request).await;
    }
    assert!(
        service.executions("doc-1") <= 1,
        "an @idempotent field ran {} times",
        service.executions("doc-1")
    );
}

/// A batched GraphQL request (a JSON array of operations, as Apollo's BatchHttpLink sends and Apollo
/// Server and others take) with an `@idempotent` field: forwarded unprotected, it runs on every retry.
#[tokio::test]
async fn many_keys_an_idempotent_mutation_in_a_graphql_batch_runs_once() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let operation = json!({"query": r#"mutation { a: charge(ref: "batched-1") @idempotent(key: "graphql-batched-1") { execution } }"#});
    let batch = Value::from(vec![operation]).to_string();
    for _ in 0..2 {
        let _ = Reply::of(post(&proxy.url, "/graphql", batch.clone())).await;
    }
    assert!(
        service.executions("batched-1") <= 1,
        "an @idempotent field ran {} times",
        service.executions("batched-1")
    );
}

/// What holds, for contrast: a key twice in one batch (same call) runs once and both calls are
/// answered; the key a batch completed replays to a lone retry under its own id; a GraphQL field's key
/// completed by a mutation replays, reformatted.
#[tokio::test]
async fn many_keys_what_holds_a_repeated_key_runs_once_and_replays_across_shapes() {
    let (_env, service, proxy) = start(Backend::Sqlite).await;
    let batch = format!("[{},{}]", call("1", "twice"), call("\"two\"", "twice"));
    let answer = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    let answers = by_id(&answer);
    assert_eq!(answers["1"]["result"]["execution"], 1, "{}", answer.text());
    assert_eq!(answers["\"two\""]["result"]["execution"], 1, "{}", answer.text());
    let lone = Reply::of(post(&proxy.url, "/rpc", call("9", "twice"))).await;
    assert_eq!(lone.json()["id"], 9);
    assert_eq!(service.executions("twice"), 1);

    let mutation = |spacing: &str| {
        json!({"query": format!(
            r#"mutation {{{spacing}a: charge(ref: "held-1") @idempotent(key: "graphql-held-1") {{ execution }} }}"#
        )})
        .to_string()
    };
    for spacing in ["", "\n  # a comment\n  "] {
        let reply = Reply::of(post(&proxy.url, "/graphql", mutation(spacing))).await;
        assert_eq!(reply.json()["data"]["a"]["execution"], 1, "{}", reply.text());
    }
    assert_eq!(service.executions("held-1"), 1);
}
