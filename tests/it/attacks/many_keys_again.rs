//! A second attack on "one request, many keys" (issue 49), after the first attack's fixes
//! (`many_keys.rs`). Each test is a client of the real proxy over real sockets, in front of a service on
//! a real socket that counts its executions per key. Each names the hole it pins down and fails while the
//! hole is open.
//!
//! - Two calls of one batch whose ids are equal numbers in two spellings (`0` and `-0`, `1` and `1.0`)
//!   pass the proxy's duplicate-id check (by exact text), though a service answers them under one `id`:
//!   both answers are lost (each call left unknown, run again after its lease), or, where the service
//!   answers that `id` once, one call's response is stored as the other's.
//! - An event stream (MCP's Streamable HTTP) carrying a server-to-client request whose `id` equals a call's
//!   (the two sides number their requests apart) makes that call's response unreadable: left unknown,
//!   run again after the lease.
//! - A service that ran a batch and then answered one `-32603` error with `id` `null` has every key given
//!   back, as if it had refused the batch unread: every call runs again on retry.
//! - A batch answer that finds its scope's share of `server.max_buffered_responses` taken for a moment is
//!   dropped without waiting `capture_wait`: the client never gets the service's answers (a lone response
//!   in the same place is relayed in full).
//! - A keyed notification of a batch the service refuses whole (nothing ran) is completed `202`: sent
//!   again, it is replayed and never runs.
//! - A mutation waiting for its first field's key runs its second field first (GraphQL runs root
//!   mutation fields one after the other).
//! - Under `fail_open` on PostgreSQL, a completed call queued behind a blocked claim times out with it
//!   and runs again.
//! - A batch that wins a key while it waits for another (given back by its original) holds it, unsent,
//!   until the other settles or `wait_timeout`: a request for that key waits as long.
//! - A whole-batch refusal (`id` `null`, nothing ran) sent as an event stream leaves every key unknown:
//!   held for good on a route that holds.
//! - An event stream that breaks off after every response came in full leaves every call unknown.
//! - A batch whose client has gone on waiting for a key in flight elsewhere still sends that call upstream
//!   once the key is given back (a lone waiter stops: `client_gone`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::support::http::client;
use crate::support::{Backend, InProcessProxy, ProxyConfig, Reply, TestEnv};

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
name = "graphql-wait"
path = "/graphql-wait"
methods = ["POST"]
key = "graphql"
on_in_flight = "wait"
wait_timeout = "20s"
"#;

type Body = BoxBody<Bytes, std::io::Error>;

/// A service on 127.0.0.1:0 that executes every JSON-RPC call it gets (counting them by
/// `params._meta.idempotencyKey`, answering `{"key", "method", "execution"}`) and answers as the
/// request's `x-mode` says.
struct Service {
    url: String,
    executions: Arc<Mutex<HashMap<String, usize>>>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Service {
    async fn start() -> Service {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let executions = Arc::new(Mutex::new(HashMap::new()));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (shared, shared_log) = (executions.clone(), log.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (seen, log) = (shared.clone(), shared_log.clone());
                let service = service_fn(move |request| serve(request, seen.clone(), log.clone()));
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(socket), service),
                );
            }
        });
        Service { url, executions, log }
    }

    fn executions(&self, key: &str) -> usize {
        self.executions.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

/// An id as a JavaScript service writes it back: a number read into a double (`-0` and `1.0` come back
/// `0` and `1`).
fn js_id(id: &Value) -> Value {
    match id.as_f64() {
        Some(value) if value.fract() == 0.0 && value.abs() < 9e15 => json!(value as i64),
        Some(value) => json!(value),
        None => id.clone(),
    }
}

async fn serve(
    request: Request<hyper::body::Incoming>,
    seen: Arc<Mutex<HashMap<String, usize>>>,
    log: Arc<Mutex<Vec<String>>>,
) -> Result<Response<Body>, hyper::Error> {
    if request.uri().path().starts_with("/graphql") {
        return Ok(graphql(request, seen, log).await);
    }
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    let mode = header("x-mode").unwrap_or_default();
    let pad: usize = header("x-pad").and_then(|p| p.parse().ok()).unwrap_or(0);
    let body = request.into_body().collect().await?.to_bytes();
    if mode == "slow-then-503" {
        // Busy: nothing runs, the key is given back.
        tokio::time::sleep(Duration::from_secs(3)).await;
        return Ok(reply(503, "text/plain", "busy".into()));
    }
    if mode == "very-slow" {
        tokio::time::sleep(Duration::from_secs(30)).await;
    }
    let message: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if mode == "nobatch" && message.is_array() {
        // Does not take batches: one error, id null, and nothing runs.
        let refusal = json!({"jsonrpc": "2.0", "id": null,
            "error": {"code": -32600, "message": "batches are not supported"}});
        return Ok(reply(200, "application/json", refusal.to_string()));
    }
    if mode == "sse-nobatch" && message.is_array() {
        // The same, in an event stream, as an MCP server answering on Streamable HTTP may.
        let refusal = json!({"jsonrpc": "2.0", "id": null,
            "error": {"code": -32600, "message": "batches are not supported"}});
        return Ok(reply(
            200,
            "text/event-stream",
            format!("event: message\ndata: {refusal}\n\n"),
        ));
    }
    let execute = |call: &Value| -> Option<Value> {
        let key = call["params"]["_meta"]["idempotencyKey"].as_str()?.to_owned();
        let n = {
            let mut seen = seen.lock().unwrap();
            let n = seen.entry(key.clone()).or_default();
            *n += 1;
            *n
        };
        let id = call.get("id")?.clone();
        let id = match mode.as_str() {
            "js" | "js-map" => js_id(&id),
            _ => id,
        };
        let mut result = json!({"key": key, "method": call["method"], "execution": n});
        if pad > 0 {
            result["pad"] = Value::String("x".repeat(pad));
        }
        Some(json!({"jsonrpc": "2.0", "id": id, "result": result}))
    };
    let calls: Vec<Value> = match &message {
        Value::Array(calls) => calls.clone(),
        call => vec![call.clone()],
    };
    let mut answers: Vec<Value> = calls.iter().filter_map(execute).collect();
    if mode == "js-map" {
        // Answers kept in a map by id, as a service that tracks its pending calls by id does: one
        // answer per id value, the last.
        let mut by_value: Vec<Value> = Vec::new();
        for answer in answers {
            by_value.retain(|kept| kept["id"] != answer["id"]);
            by_value.push(answer);
        }
        answers = by_value;
    }
    let lone = !message.is_array();
    Ok(match mode.as_str() {
        "internal" => {
            // Ran every call, then failed writing the answer: one error, id null.
            let error = json!({"jsonrpc": "2.0", "id": null,
                "error": {"code": -32603, "message": "Internal error"}});
            reply(200, "application/json", error.to_string())
        }
        "sse-break" => {
            // Every response in full, then the stream breaks off (the connection is reset).
            let events: String = answers
                .iter()
                .map(|answer| format!("event: message\ndata: {answer}\n\n"))
                .collect();
            // The break comes a moment after the events, as on a real connection: written, then reset.
            let stream = futures_util::stream::unfold(Some(events), |events| async move {
                match events {
                    Some(events) => Some((Ok(Frame::data(Bytes::from(events))), None)),
                    None => {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        Some((Err(std::io::Error::other("reset")), None))
                    }
                }
            })
            .take(2);
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(stream)))
                .unwrap()
        }
        "sse-server-request" => {
            // Before each response, a request of the server's own (sampling), numbered by the server,
            // whose id happens to equal the call's.
            let events: String = answers
                .iter()
                .map(|answer| {
                    let asks = json!({"jsonrpc": "2.0", "id": answer["id"],
                        "method": "sampling/createMessage", "params": {}});
                    format!("event: message\ndata: {asks}\n\nevent: message\ndata: {answer}\n\n")
                })
                .collect();
            reply(200, "text/event-stream", events)
        }
        "slow-body" => {
            // Most of the answer at once, the rest after 3 s.
            let text = match lone {
                true => answers[0].to_string(),
                false => Value::from(answers).to_string(),
            };
            let (head, tail) = text.split_at(text.len() - 2);
            let (head, tail) = (Bytes::from(head.to_owned()), Bytes::from(tail.to_owned()));
            let stream = futures_util::stream::once(async move { head })
                .chain(futures_util::stream::once(async move {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    tail
                }))
                .map(|chunk| Ok::<_, std::io::Error>(Frame::data(chunk)));
            Response::builder()
                .status(200)
                .header("content-type", "application/json")
                .header("content-length", text.len())
                .body(BodyExt::boxed(StreamBody::new(stream)))
                .unwrap()
        }
        _ if answers.is_empty() => reply(202, "", String::new()),
        _ if lone => reply(200, "application/json", answers[0].to_string()),
        _ => reply(200, "application/json", Value::from(answers).to_string()),
    })
}

/// A GraphQL service running one root field per operation: `charge(ref: "…")` at once, `slowCharge(ref:
/// "…")` in 3 s; each logged as it starts and ends (`start:REF`, `end:REF`) and counted by its `ref`.
async fn graphql(
    request: Request<hyper::body::Incoming>,
    seen: Arc<Mutex<HashMap<String, usize>>>,
    log: Arc<Mutex<Vec<String>>>,
) -> Response<Body> {
    let body = request.into_body().collect().await.unwrap().to_bytes();
    let operation: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let document = operation["query"].as_str().unwrap_or_default().to_owned();
    let mut data = serde_json::Map::new();
    for field in ["slowCharge", "charge"] {
        let opening = format!("{field}(ref: \"");
        let Some(at) = document.find(&opening) else {
            continue;
        };
        let reference = document[at + opening.len()..]
            .split('"')
            .next()
            .unwrap_or_default()
            .to_owned();
        log.lock().unwrap().push(format!("start:{reference}"));
        if field == "slowCharge" {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        let n = {
            let mut seen = seen.lock().unwrap();
            let n = seen.entry(reference.clone()).or_default();
            *n += 1;
            *n
        };
        log.lock().unwrap().push(format!("end:{reference}"));
        data.insert(field.to_owned(), json!({"ref": reference, "execution": n}));
    }
    reply(200, "application/json", json!({"data": data}).to_string())
}

fn reply(status: u16, content_type: &str, body: String) -> Response<Body> {
    let mut response = Response::builder().status(status);
    if !content_type.is_empty() {
        response = response.header("content-type", content_type);
    }
    response
        .body(BodyExt::boxed(
            Full::new(Bytes::from(body)).map_err(|never| match never {}),
        ))
        .unwrap()
}

/// A proxy on `env`'s store in front of `service`, with a short lease so that a key left to its lease
/// comes back within the test.
fn config(env: &TestEnv, service: &Service) -> ProxyConfig {
    ProxyConfig::on(&env.store, &service.url)
        .with_toml(ROUTES)
        .set("idempotency.lock_timeout", "2s")
        .set("upstream.timeout", "10s")
}

async fn start() -> (TestEnv, Service, InProcessProxy) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let proxy = InProcessProxy::start(&config(&env, &service)).await;
    (env, service, proxy)
}

fn post(url: &str, path: &str, body: impl Into<reqwest::Body>) -> reqwest::RequestBuilder {
    client()
        .post(format!("{url}{path}"))
        .header("authorization", "Bearer agent-2")
        .header("content-type", "application/json")
        .body(body)
}

/// A call with `id` (JSON text) keyed `key`, of `method`.
fn call(id: &str, method: &str, key: &str) -> String {
    format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{{"_meta":{{"idempotencyKey":"{key}"}}}}}}"#
    )
}

/// A batch whose two calls have ids `0` and `-0`: two spellings of one number, which a service (any that
/// reads ids as numbers: Python's, JavaScript's) answers as `0` both times. The proxy refuses a batch
/// repeating an id only by its exact text, so it sends this one; it then cannot tell the two answers
/// apart, answers both calls "unknown" and leaves both keys to their lease: each retry after the lease
/// runs both again.
#[tokio::test]
async fn many_keys_again_ids_equal_in_value_are_not_run_again_for_want_of_telling_their_answers_apart() {
    let (_env, service, proxy) = start().await;
    let batch = format!("[{},{}]", call("0", "a", "zero-a"), call("-0", "b", "zero-b"));
    let first = Reply::of(post(&proxy.url, "/rpc", batch.clone()).header("x-mode", "js")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let retry = Reply::of(post(&proxy.url, "/rpc", batch).header("x-mode", "js")).await;
    let runs = (service.executions("zero-a"), service.executions("zero-b"));
    assert!(
        runs.0 <= 1 && runs.1 <= 1,
        "each call ran {runs:?} times; the batch was answered {} {} then {} {}",
        first.status,
        first.text(),
        retry.status,
        retry.text()
    );
}

/// Ids `1` and `1.0` in one batch, before a service that keeps its pending calls in a map by id (one
/// answer per id value; JavaScript writes both back as `1`). The proxy finds the one answer for both
/// calls (`1` by its text, `1.0` by its value): the first call's key is completed with the second call's
/// response, replayed to it for the record's life, and its own answer is lost.
#[tokio::test]
async fn many_keys_again_ids_equal_in_value_do_not_store_one_calls_answer_as_the_others() {
    let (_env, service, proxy) = start().await;
    let batch = format!(
        "[{},{}]",
        call("1", "transfer_to_alice", "map-a"),
        call("1.0", "transfer_to_bob", "map-b")
    );
    let first = Reply::of(post(&proxy.url, "/rpc", batch).header("x-mode", "js-map")).await;
    let alone = Reply::of(post(&proxy.url, "/rpc", call("1", "transfer_to_alice", "map-a"))).await;
    assert!(
        !alone.text().contains("transfer_to_bob"),
        "the call transfer_to_alice (key map-a) is answered with transfer_to_bob's result: {}; the batch \
         was answered {}; executions {:?}",
        alone.text(),
        first.text(),
        (service.executions("map-a"), service.executions("map-b"))
    );
}

/// An MCP service answering a batch as an event stream sends, before each response, a request of its
/// own (`sampling/createMessage`) numbered from its side, whose `id` equals the call's. The proxy reads
/// every object with an `id` as a response: two for one `id`, so the call's response is not found, the
/// call is answered "unknown" and run again after the lease. Sent alone, the same exchange is answered
/// and stored.
#[tokio::test]
async fn many_keys_again_a_server_request_in_an_event_stream_does_not_hide_the_calls_response() {
    let (_env, service, proxy) = start().await;
    let batch = format!("[{},{}]", call("1", "a", "sse-a"), call("2", "b", "sse-b"));
    let first =
        Reply::of(post(&proxy.url, "/rpc", batch.clone()).header("x-mode", "sse-server-request")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let retry = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    assert!(
        first.text().contains(r#""execution":1"#) && service.executions("sse-a") == 1,
        "the batch was answered {}; its retry after the lease {}; sse-a ran {} times",
        first.text(),
        retry.text(),
        service.executions("sse-a")
    );
}

/// A service that ran a batch and then answered it with one error under `id` `null` (`-32603`, an
/// internal error writing its answer, not a refusal of a batch it could not read): the proxy takes any
/// `id`-`null` error for a refusal that ran nothing and gives every key back, so the client's retry runs
/// every call again.
#[tokio::test]
async fn many_keys_again_an_internal_error_with_id_null_after_the_batch_ran_does_not_run_it_again() {
    let (_env, service, proxy) = start().await;
    let batch = format!(
        "[{},{}]",
        call("1", "a", "internal-a"),
        call("2", "b", "internal-b")
    );
    let first = Reply::of(post(&proxy.url, "/rpc", batch.clone()).header("x-mode", "internal")).await;
    let retry = Reply::of(post(&proxy.url, "/rpc", batch)).await;
    assert_eq!(
        service.executions("internal-a"),
        1,
        "the batch was answered {}; its retry {}",
        first.text(),
        retry.text()
    );
}

/// One client's slow 400 KB answer holds its scope's share of `max_buffered_responses` for 3 s; a batch
/// of the same client answered meanwhile with 160 KB (each call under `max_stored_response`) is dropped
/// at once (no `capture_wait`), and the client gets `-32093 response-not-retained` for every call, for
/// ever: the service's answers are lost. A lone call in the same place waits, then is relayed in full.
#[tokio::test]
async fn many_keys_again_a_batch_answer_is_not_lost_when_the_response_budget_is_busy_for_a_moment() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let service = Service::start().await;
    let config = config(&env, &service)
        .set("server.max_buffered_responses", "1MiB")
        .set("idempotency.max_stored_response", "512KiB");
    let proxy = InProcessProxy::start(&config).await;
    let holder = tokio::spawn(Reply::of(
        post(&proxy.url, "/rpc", call("1", "a", "budget-holder"))
            .header("x-mode", "slow-body")
            .header("x-pad", "400000"),
    ));
    tokio::time::sleep(Duration::from_millis(800)).await;
    let batch = format!("[{},{}]", call("1", "b", "budget-1"), call("2", "b", "budget-2"));
    let answer = Reply::of(post(&proxy.url, "/rpc", batch).header("x-pad", "80000")).await;
    let holder = holder.await.unwrap();
    assert_eq!(holder.status, 200);
    assert!(
        answer.text().contains(r#""execution":1"#),
        "the batch ran (executions {}, {}) and its answer was lost: {}",
        service.executions("budget-1"),
        service.executions("budget-2"),
        &answer.text()[..answer.text().len().min(600)]
    );
}

/// A batch waits for its key in flight elsewhere; its client hangs up; the original is refused by the
/// service (`503`, nothing ran) and gives the key back. The batch, whose client is gone, still claims the
/// key and sends the call upstream, where a lone waiter stops when its client goes
/// (`idemproxy_waits_total{result="client_gone"}`).
#[tokio::test]
async fn many_keys_again_a_batch_whose_client_has_gone_does_not_run_what_it_waited_for() {
    let (_env, service, proxy) = start().await;
    let original = tokio::spawn(Reply::of(
        post(&proxy.url, "/rpc-wait", call("1", "a", "gone-a")).header("x-mode", "slow-then-503"),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = format!("[{},{}]", call("1", "a", "gone-a"), call("2", "b", "gone-b"));
    let leaving = post(&proxy.url, "/rpc-wait", batch)
        .timeout(Duration::from_secs(1))
        .send()
        .await;
    assert!(leaving.is_err(), "the client gave up after 1 s");
    let original = original.await.unwrap();
    assert_eq!(original.status, 503, "{}", original.text());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        service.executions("gone-a"),
        0,
        "the call of a client that had gone ran once its key was given back"
    );
}

/// A batch of a keyed notification and a keyed call, before a service that does not take batches (one
/// `-32600` error, `id` `null`: nothing ran). The call's key is given back; the notification's is
/// completed as if the service had taken it (`202`), so the notification, sent again alone (as the
/// refusal invites), is replayed `202` and never runs. A batch of notifications only is answered `202`.
#[tokio::test]
async fn many_keys_again_a_keyed_notification_of_a_batch_refused_whole_runs_when_sent_again() {
    let (_env, service, proxy) = start().await;
    let notification =
        r#"{"jsonrpc":"2.0","method":"notify","params":{"_meta":{"idempotencyKey":"refused-note"}}}"#;
    let batch = format!("[{notification},{}]", call("1", "a", "refused-call"));
    let first = Reply::of(post(&proxy.url, "/rpc", batch).header("x-mode", "nobatch")).await;
    let alone = Reply::of(post(&proxy.url, "/rpc", notification)).await;
    assert_eq!(
        service.executions("refused-note"),
        1,
        "the batch was refused whole ({}); the notification sent again alone was answered {} {:?}",
        first.text(),
        alone.status,
        alone.headers.get("idempotent-replayed")
    );
}

/// GraphQL runs a mutation's root fields one after the other. A mutation whose first field's key is in
/// flight in another request (on a route that waits) and whose second field is new: the proxy sends the
/// second field at once, while the first is still running elsewhere, and waits for the first after.
#[tokio::test]
async fn many_keys_again_a_mutation_waiting_for_its_first_field_does_not_run_the_second_before_it() {
    let (_env, service, proxy) = start().await;
    let first = r#"slowCharge(ref: \"order\") @idempotent(key: \"order-1\") { ref execution }"#;
    let second = r#"charge(ref: \"pay\") @idempotent(key: \"pay-1\") { ref execution }"#;
    let original = tokio::spawn(Reply::of(post(
        &proxy.url,
        "/graphql-wait",
        format!(r#"{{"query":"mutation {{ {first} }}"}}"#),
    )));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let both = Reply::of(post(
        &proxy.url,
        "/graphql-wait",
        format!(r#"{{"query":"mutation {{ {first} {second} }}"}}"#),
    ))
    .await;
    let original = original.await.unwrap();
    let log = service.log.lock().unwrap().clone();
    let end_order = log.iter().position(|entry| entry == "end:order");
    let start_pay = log.iter().position(|entry| entry == "start:pay");
    assert!(
        start_pay.is_none() || start_pay > end_order,
        "the service saw {log:?}: the second field ran while the first was still running; answers {} and {}",
        original.text(),
        both.text()
    );
}

/// Under `store.on_error = "fail_open"` on PostgreSQL, a batch whose first call's claim waits on a row
/// another session holds (a stuck transaction) past `store.timeout`, and whose second call's key another
/// replica completed: the second claim is queued behind the first on the store's connection and times
/// out with it, so the completed call is sent upstream unprotected and runs again. (The first attack's
/// test had the completed call first, and answered by the replay cache of the proxy that completed it.)
#[tokio::test]
async fn many_keys_again_fail_open_does_not_rerun_a_completed_call_queued_behind_a_blocked_claim() {
    let env = TestEnv::on(Backend::Postgres).await;
    let service = Service::start().await;
    let config = config(&env, &service)
        .set("store.on_error", "fail_open")
        .set("store.timeout", "1s");
    let replica_a = InProcessProxy::start(&config).await;
    let replica_b = InProcessProxy::start(&config).await;
    let first = Reply::of(post(
        &replica_a.url,
        "/rpc",
        format!("[{}]", call("1", "a", "done")),
    ))
    .await;
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
    let batch = format!("[{},{}]", call("1", "b", "blocked"), call("2", "a", "done"));
    let answer = Reply::of(post(&replica_b.url, "/rpc", batch)).await;
    blocking.rollback().await.unwrap();
    assert_eq!(
        service.executions("done"),
        1,
        "a call completed on another replica ran again because the claim before it was slow: {}",
        answer.text()
    );
}

/// A request never waits while it holds keys, the fix said. A batch of `x` and `w`, both in flight
/// elsewhere, waits for both; `x`'s original is refused by the service (`503`, nothing ran) at 3 s and
/// gives it back: the batch wins `x` and holds it, unsent, while it goes on waiting for `w` (whose
/// original is stuck until its lease runs out after the upstream timeout, about 12 s). A lone request
/// for `x` sent at 4 s waits all that time for a call that runs in no time.
#[tokio::test]
async fn many_keys_again_a_batch_does_not_hold_a_key_it_won_while_waiting_for_another() {
    let (_env, service, proxy) = start().await;
    let x_original = tokio::spawn(Reply::of(
        post(&proxy.url, "/rpc-wait", call("1", "a", "held-x")).header("x-mode", "slow-then-503"),
    ));
    let w_original = tokio::spawn(Reply::of(
        post(&proxy.url, "/rpc-wait", call("1", "w", "held-w")).header("x-mode", "very-slow"),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let batch = format!("[{},{}]", call("1", "a", "held-x"), call("2", "w", "held-w"));
    let waiting = tokio::spawn(Reply::of(post(&proxy.url, "/rpc-wait", batch)));
    tokio::time::sleep(Duration::from_millis(3700)).await;
    let sent = std::time::Instant::now();
    let lone = Reply::of(post(&proxy.url, "/rpc-wait", call("7", "a", "held-x"))).await;
    let took = sent.elapsed();
    let (batch, _, _) = (
        waiting.await.unwrap(),
        x_original.await.unwrap(),
        w_original.await.unwrap(),
    );
    assert!(
        took < Duration::from_secs(3),
        "a lone request for held-x waited {took:?} (answered {}), while the batch held the key it had won \
         and waited for another (answered {}); held-x ran {} time(s)",
        lone.text(),
        batch.text(),
        service.executions("held-x")
    );
}

/// A service that does not take batches and says so in an event stream (one `-32600` error, `id`
/// `null`; nothing ran), as an MCP server answering on Streamable HTTP may. Sent as JSON, the same
/// refusal gives every key back; as an event stream, every call is left unknown, and on a route that
/// holds, each key is held until an operator releases it: the calls can never run.
#[tokio::test]
async fn many_keys_again_a_whole_batch_refusal_in_an_event_stream_holds_no_key() {
    let (_env, service, proxy) = start().await;
    let batch = format!(
        "[{},{}]",
        call("1", "a", "sse-refused-a"),
        call("2", "b", "sse-refused-b")
    );
    let first = Reply::of(post(&proxy.url, "/rpc-hold", batch).header("x-mode", "sse-nobatch")).await;
    let alone = Reply::of(post(&proxy.url, "/rpc-hold", call("1", "a", "sse-refused-a"))).await;
    assert_eq!(
        service.executions("sse-refused-a"),
        1,
        "nothing ran (the batch was refused: {}), and the call sent again alone was answered {} {}",
        first.text(),
        alone.status,
        alone.text()
    );
}

/// A batch answered as an event stream carrying every call's response in full, after which the
/// connection breaks off. Each response arrived, but the proxy drops them all: every call is answered
/// "unknown", and on a route that holds, held until an operator releases it.
#[tokio::test]
async fn many_keys_again_responses_that_came_in_full_before_a_stream_broke_off_are_kept() {
    let (_env, service, proxy) = start().await;
    let batch = format!("[{},{}]", call("1", "a", "broken-a"), call("2", "b", "broken-b"));
    let first = Reply::of(post(&proxy.url, "/rpc-hold", batch.clone()).header("x-mode", "sse-break")).await;
    let retry = Reply::of(post(&proxy.url, "/rpc-hold", batch)).await;
    assert!(
        retry.text().contains(r#""execution":1"#),
        "the responses came in full before the stream broke off; the batch was answered {} and its retry {}; \
         broken-a ran {} time(s)",
        first.text(),
        retry.text(),
        service.executions("broken-a")
    );
}
