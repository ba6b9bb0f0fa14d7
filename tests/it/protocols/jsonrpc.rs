//! Routes keyed by `jsonrpc`: JSON-RPC 2.0 calls whose key is in the body (`params._meta.idempotencyKey`,
//! as MCP proposes, or a named pointer). Each test is a client of the real proxy in front of a JSON-RPC
//! server on a real socket that counts its executions and answers each call with its `id`, as JSON or as
//! an event stream (MCP's Streamable HTTP). A retry sends a new `id` (and a new progress token) and gets
//! the stored answer carrying its own `id`, of the type it sent; another call under the key is refused;
//! a notification runs once; a batch with a keyed call is refused; hostile bodies get problems.
//! `jsonrpc_mcp_sdk_*` drive the official MCP Python SDK, client and server, through the proxy configured
//! with the README's MCP route as written.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rstest::rstest;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::support::http::client;
use crate::support::{Backend, InProcessProxy, ProxyConfig, Reply, TestEnv, metric_reaches};

/// The routes the tests run under.
const ROUTES: &str = r#"
[[routes]]
name = "mcp"
path_prefix = "/mcp"
methods = ["POST"]
key = "jsonrpc"

[[routes]]
name = "strict"
path = "/strict"
methods = ["POST"]
key = "jsonrpc"
required = true
max_request_body = "64KiB"

[[routes]]
name = "waiting"
path = "/wait"
methods = ["POST"]
key = "jsonrpc"
on_in_flight = "wait"

[[routes]]
name = "attaching"
path = "/attach"
methods = ["POST"]
key = "jsonrpc"
on_in_flight = "attach"

[[routes]]
name = "named"
path = "/named"
methods = ["POST"]
key = "jsonrpc:/params/idempotency_key"
"#;

/// A JSON-RPC server on 127.0.0.1:0 that executes every call and notification it gets (counting
/// them) and answers a call `{"execution": n}` under the call's own `id`: as JSON, or, on a path ending
/// in `/sse`, as an event stream holding a progress notification and then the response, as MCP's
/// Streamable HTTP does. A notification gets `202` and no body; a batch, an array of the answers. A call
/// of the method `slow` says it has `arrived`, and is answered once the test opens `gate`.
struct RpcServer {
    url: String,
    executions: Arc<AtomicUsize>,
    gate: Gate,
}

/// A slow call's signal that it has arrived, and the test's that it may be answered.
#[derive(Clone, Default)]
struct Gate {
    arrived: Arc<Notify>,
    open: Arc<Notify>,
}

impl RpcServer {
    async fn start() -> RpcServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let executions = Arc::new(AtomicUsize::new(0));
        let gate = Gate::default();
        let (counter, opens) = (executions.clone(), gate.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let (counter, opens) = (counter.clone(), opens.clone());
                let service = service_fn(move |request| answer(request, counter.clone(), opens.clone()));
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(socket), service),
                );
            }
        });
        RpcServer {
            url,
            executions,
            gate,
        }
    }

    fn executions(&self) -> usize {
        self.executions.load(Ordering::SeqCst)
    }
}

async fn answer(
    request: Request<hyper::body::Incoming>,
    executions: Arc<AtomicUsize>,
    gate: Gate,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let sse = request.uri().path().ends_with("/sse");
    let body = request.into_body().collect().await?.to_bytes();
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        return Ok(reply(400, "text/plain", "not JSON".into()));
    };
    let mut execute = |call: &Value| {
        let n = executions.fetch_add(1, Ordering::SeqCst) + 1;
        let id = call.get("id")?;
        Some(json!({"jsonrpc": "2.0", "id": id, "result": {"execution": n}}))
    };
    if message["method"] == "slow" {
        executions.fetch_add(1, Ordering::SeqCst);
        gate.arrived.notify_one();
        gate.open.notified().await;
        let response = json!({"jsonrpc": "2.0", "id": message["id"], "result": {"slow": true}});
        return Ok(reply(200, "application/json", response.to_string()));
    }
    Ok(match &message {
        Value::Array(calls) => {
            let answers: Vec<Value> = calls.iter().filter_map(&mut execute).collect();
            reply(200, "application/json", Value::from(answers).to_string())
        }
        call => match execute(call) {
            None => reply(202, "", String::new()),
            Some(response) if sse => {
                let progress = json!({"jsonrpc": "2.0", "method": "notifications/progress",
                    "params": {"progressToken": call["params"]["_meta"]["progressToken"], "progress": 1}});
                let stream = format!(
                    "event: message\r\ndata: {progress}\r\n\r\nevent: message\r\nid: ev-1\r\ndata: {response}\r\n\r\n"
                );
                reply(200, "text/event-stream", stream)
            }
            Some(response) => reply(200, "application/json", response.to_string()),
        },
    })
}

fn reply(status: u16, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::builder().status(status);
    if !content_type.is_empty() {
        response = response.header("content-type", content_type);
    }
    response.body(Full::new(Bytes::from(body))).unwrap()
}

/// The proxy, on `backend`, in front of a fresh [`RpcServer`].
async fn start(backend: Backend) -> (TestEnv, RpcServer, InProcessProxy) {
    start_cached(backend, true).await
}

/// [`start`], with the replay cache on (a retry answered from memory) or off (from the store).
async fn start_cached(backend: Backend, cached: bool) -> (TestEnv, RpcServer, InProcessProxy) {
    let env = TestEnv::on(backend).await;
    let server = RpcServer::start().await;
    let mut config = ProxyConfig::on(&env.store, &server.url).with_toml(ROUTES);
    if !cached {
        config = config.set("replay_cache.max_size", "0");
    }
    let proxy = InProcessProxy::start(&config).await;
    (env, server, proxy)
}

fn send(proxy: &InProcessProxy, path: &str, body: impl Into<reqwest::Body>) -> reqwest::RequestBuilder {
    send_as(proxy, path, body, "application/json")
}

/// [`send`] with `content_type` as the request's one content type.
fn send_as(
    proxy: &InProcessProxy,
    path: &str,
    body: impl Into<reqwest::Body>,
    content_type: &str,
) -> reqwest::RequestBuilder {
    client()
        .post(format!("{}{path}", proxy.url))
        .header("authorization", "Bearer agent-1")
        .header("content-type", content_type)
        .header("accept", "application/json, text/event-stream")
        .body(body)
}

/// A `tools/call` with `id`, the key `key` in `_meta`, a progress token of its own, and `amount`.
fn tool_call(id: Value, key: &str, token: u64, amount: u64) -> String {
    json!({
        "jsonrpc": "2.0",
        "id": id,
        "method": "tools/call",
        "params": {
            "name": "charge",
            "arguments": {"amount": amount},
            "_meta": {"idempotencyKey": key, "progressToken": token},
        },
    })
    .to_string()
}

#[rstest]
#[tokio::test]
async fn jsonrpc_a_retry_with_a_new_id_is_replayed_with_its_own_id_and_runs_once(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
    #[values(true, false)] replay_cache: bool,
) {
    let (_env, server, proxy) = start_cached(backend, replay_cache).await;
    let first = Reply::of(send(&proxy, "/mcp", tool_call(json!(1), "charge-1", 1, 5))).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert!(!first.is_replay());
    assert_eq!(
        first.json(),
        json!({"jsonrpc": "2.0", "id": 1, "result": {"execution": 1}})
    );

    let retry = Reply::of(send(&proxy, "/mcp", tool_call(json!(2), "charge-1", 2, 5))).await;
    assert!(retry.is_replay(), "{}", retry.text());
    assert_eq!(
        retry.json(),
        json!({"jsonrpc": "2.0", "id": 2, "result": {"execution": 1}}),
        "the stored answer, under the retry's id"
    );
    assert_eq!(server.executions(), 1);

    let another = Reply::of(send(&proxy, "/mcp", tool_call(json!(3), "charge-2", 3, 5))).await;
    assert!(!another.is_replay());
    assert_eq!(another.json()["result"]["execution"], 2);
    assert_eq!(server.executions(), 2);
}

/// With `on_in_flight = "attach"` too: a call does not follow the original's live answer, which carries
/// the original's id, but waits for the stored one; so does a call its client mislabels as gRPC (a
/// gRPC body is never a JSON-RPC call).
#[rstest::rstest]
#[tokio::test]
async fn jsonrpc_a_duplicate_that_waits_for_the_original_gets_its_answer_under_its_own_id(
    #[values("/wait", "/attach")] path: &str,
    #[values("application/json", "application/grpc")] content_type: &str,
) {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let slow = |id: Value| tool_call(id, "waited", 1, 5).replace("tools/call", "slow");
    let labelled = |id: Value| send_as(&proxy, path, slow(id), content_type);
    let first = tokio::spawn(Reply::of(labelled(json!(1))));
    server.gate.arrived.notified().await;
    let duplicate = tokio::spawn(Reply::of(labelled(json!("dup"))));
    metric_reaches(&proxy.admin_url, "idemproxy_waiting_requests", &[], 1.0).await;
    server.gate.open.notify_one();
    let (first, duplicate) = (first.await.unwrap(), duplicate.await.unwrap());
    assert_eq!(first.json()["id"], 1);
    assert!(duplicate.is_replay(), "{}", duplicate.text());
    assert_eq!(
        duplicate.json(),
        json!({"jsonrpc": "2.0", "id": "dup", "result": {"slow": true}})
    );
    assert_eq!(server.executions(), 1);
}

#[tokio::test]
async fn jsonrpc_a_replay_keeps_the_json_type_of_the_id_the_retry_sent() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let first = Reply::of(send(&proxy, "/mcp", tool_call(json!("a-1"), "typed", 1, 5))).await;
    assert_eq!(first.json()["id"], json!("a-1"));
    for id in [
        json!(7),
        json!("7"),
        json!("a \"quoted\" \u{e9}"),
        json!(1.5e3),
        json!(null),
    ] {
        let retry = Reply::of(send(&proxy, "/mcp", tool_call(id.clone(), "typed", 2, 5))).await;
        assert!(retry.is_replay(), "{}", retry.text());
        assert_eq!(retry.json()["id"], id, "{}", retry.text());
        assert_eq!(retry.json()["result"]["execution"], 1);
    }
    let exact = Reply::of(send(&proxy, "/mcp", tool_call(json!(7), "typed", 3, 5))).await;
    assert!(
        exact.text().contains("\"id\":7,"),
        "a number stays a number: {}",
        exact.text()
    );
    assert_eq!(server.executions(), 1);
}

#[tokio::test]
async fn jsonrpc_an_event_stream_answer_is_replayed_with_the_retrys_id_in_its_response_event() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let first = Reply::of(send(&proxy, "/mcp/sse", tool_call(json!(10), "stream-1", 10, 5))).await;
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    assert!(first.text().contains(r#""id":10,"#), "{}", first.text());

    let retry = Reply::of(send(
        &proxy,
        "/mcp/sse",
        tool_call(json!("r-11"), "stream-1", 11, 5),
    ))
    .await;
    assert!(retry.is_replay());
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    let expected = first.text().replace(r#""id":10,"#, r#""id":"r-11","#);
    assert_eq!(
        retry.text(),
        expected,
        "the response event answers the retry; the notification and the event fields are untouched"
    );
    assert_eq!(server.executions(), 1);
}

#[tokio::test]
async fn jsonrpc_another_call_under_the_same_key_is_refused_as_key_reused() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let first = Reply::of(send(&proxy, "/mcp", tool_call(json!(1), "reused", 1, 5))).await;
    assert_eq!(first.status, 200);
    let other = Reply::of(send(&proxy, "/mcp", tool_call(json!(2), "reused", 1, 6))).await;
    other.assert_problem(422, "key-reused");
    let renamed = tool_call(json!(3), "reused", 1, 5).replace("tools/call", "tools/other");
    Reply::of(send(&proxy, "/mcp", renamed))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(server.executions(), 1);
}

#[tokio::test]
async fn jsonrpc_a_keyed_notification_runs_once_and_its_retry_gets_the_stored_202() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let notification =
        json!({"jsonrpc": "2.0", "method": "notifications/charge", "params": {"_meta": {"idempotencyKey": "note-1"}}})
            .to_string();
    let first = Reply::of(send(&proxy, "/mcp", notification.clone())).await;
    assert_eq!(first.status, 202);
    assert!(first.body.is_empty());
    let retry = Reply::of(send(&proxy, "/mcp", notification)).await;
    assert_eq!(retry.status, 202);
    assert!(retry.is_replay());
    assert!(retry.body.is_empty());
    assert_eq!(server.executions(), 1);
}

/// A batch's keyed calls are claimed one by one: a call completed before (alone or in a batch) is
/// answered from the store under the batch's own `id`, only the rest go upstream as one batch, and the
/// answer keeps the client's order; a call without a key and a keyed notification run as they are.
#[tokio::test]
async fn jsonrpc_a_batch_runs_each_keyed_call_once_and_answers_in_the_clients_order() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let list = |id: u64| json!({"jsonrpc": "2.0", "id": id, "method": "tools/list"}).to_string();
    let notify = json!({"jsonrpc": "2.0", "method": "notifications/charge",
        "params": {"_meta": {"idempotencyKey": "n-1"}}})
    .to_string();
    let first = format!("[{},{},{notify}]", list(1), tool_call(json!(2), "a", 1, 5));
    let reply = Reply::of(send(&proxy, "/mcp", first)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let answers = reply.json();
    let ids: Vec<&Value> = answers.as_array().unwrap().iter().map(|a| &a["id"]).collect();
    assert_eq!(ids, [&json!(1), &json!(2)], "{answers}");
    assert_eq!(server.executions(), 3);
    let a = answers[1]["result"].clone();

    let second = format!(
        "[{},{},{},{notify}]",
        tool_call(json!("x"), "b", 2, 7),
        tool_call(json!(7), "a", 3, 5),
        list(9)
    );
    let reply = Reply::of(send(&proxy, "/mcp", second)).await;
    let answers = reply.json();
    assert_eq!(answers[0]["id"], "x");
    assert_eq!(answers[1]["id"], 7);
    assert_eq!(answers[1]["result"], a, "the completed call is replayed");
    assert_eq!(answers[2]["id"], 9);
    assert_eq!(answers.as_array().unwrap().len(), 3);
    assert_eq!(server.executions(), 5, "only b and the unkeyed call ran");

    assert!(!reply.is_replay(), "some of it ran");
    let again = format!(
        "[{},{}]",
        tool_call(json!(11), "a", 5, 5),
        tool_call(json!(12), "b", 6, 7)
    );
    let replayed = Reply::of(send(&proxy, "/mcp", again)).await;
    assert!(replayed.is_replay(), "every call answered from the store");
    assert_eq!(replayed.json()[1]["id"], 12);

    let alone = Reply::of(send(&proxy, "/mcp", tool_call(json!(10), "b", 4, 7))).await;
    assert!(alone.is_replay(), "a call of a batch is the same request alone");
    assert_eq!(alone.json()["id"], 10);
    assert_eq!(alone.json()["result"], answers[0]["result"]);
    assert_eq!(server.executions(), 5);
}

/// Within one batch a key repeated with the same call is answered as the first, never run twice; with
/// another call it is a reuse, as is a key completed before with another call. Calls that repeat an id
/// cannot be told apart and refuse the whole batch, as a required key missing from one call does.
#[tokio::test]
async fn jsonrpc_a_batch_answers_repeats_and_reuses_per_call_and_refuses_what_cannot_be_split() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let twice = format!(
        "[{},{},{}]",
        tool_call(json!(1), "c", 1, 5),
        tool_call(json!(2), "c", 2, 5),
        tool_call(json!(3), "c", 3, 6)
    );
    let reply = Reply::of(send(&proxy, "/mcp", twice)).await;
    let answers = reply.json();
    assert_eq!(server.executions(), 1, "{answers}");
    assert_eq!(answers[0]["result"], answers[1]["result"]);
    assert_eq!(answers[1]["id"], 2);
    assert_eq!(answers[2]["id"], 3);
    assert_eq!(answers[2]["error"]["code"], -32091, "{answers}");
    assert!(
        answers[2]["error"]["data"]["type"]
            .as_str()
            .unwrap()
            .ends_with("/key-reused")
    );

    let reused = format!("[{}]", tool_call(json!(4), "c", 4, 9));
    let reply = Reply::of(send(&proxy, "/mcp", reused)).await;
    assert_eq!(reply.json()[0]["error"]["code"], -32091);
    assert_eq!(reply.json()[0]["error"]["data"]["status"], 422);
    assert_eq!(server.executions(), 1);

    let same_id = format!(
        "[{},{}]",
        tool_call(json!(5), "d", 1, 1),
        tool_call(json!(5), "e", 1, 1)
    );
    Reply::of(send(&proxy, "/mcp", same_id))
        .await
        .assert_problem(400, "jsonrpc-batch");
    let plain =
        r#"[{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"ping"}]"#;
    let forwarded = Reply::of(send(&proxy, "/mcp", plain)).await;
    assert_eq!(forwarded.json().as_array().map(Vec::len), Some(2));
    assert!(!forwarded.is_replay(), "a batch without keys passes as it came");
    Reply::of(send(&proxy, "/strict", plain))
        .await
        .assert_problem(400, "missing-key");
    let partly = format!(
        "[{},{}]",
        tool_call(json!(1), "f", 1, 1),
        r#"{"jsonrpc":"2.0","id":2,"method":"ping"}"#
    );
    Reply::of(send(&proxy, "/strict", partly))
        .await
        .assert_problem(400, "missing-key");
    assert_eq!(server.executions(), 3, "only the unkeyed batch ran");
}

#[tokio::test]
async fn jsonrpc_a_named_pointer_keys_the_call_and_a_call_without_a_key_passes_through() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let call = |id: u64| {
        json!({"jsonrpc": "2.0", "id": id, "method": "create", "params": {"idempotency_key": "n-1", "x": 1}})
            .to_string()
    };
    let first = Reply::of(send(&proxy, "/named", call(1))).await;
    assert_eq!(first.json()["id"], 1);
    let retry = Reply::of(send(&proxy, "/named", call(2))).await;
    assert!(retry.is_replay());
    assert_eq!(retry.json()["id"], 2);
    assert_eq!(server.executions(), 1);

    let unkeyed = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}).to_string();
    for _ in 0..2 {
        let reply = Reply::of(send(&proxy, "/mcp", unkeyed.clone())).await;
        assert!(!reply.is_replay());
    }
    assert_eq!(server.executions(), 3, "keys are optional there");
}

#[tokio::test]
async fn jsonrpc_hostile_bodies_get_problems_and_never_reach_the_server() {
    let (_env, server, proxy) = start(Backend::Sqlite).await;
    let with_key = |key: Value| {
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"_meta": {"idempotencyKey": key}}})
            .to_string()
    };
    let cases: Vec<(String, u16, &str)> = vec![
        (with_key(json!({"nested": "object"})), 400, "invalid-key"),
        (with_key(json!(["k"])), 400, "invalid-key"),
        (with_key(json!("")), 400, "invalid-key"),
        (with_key(json!("a b")), 400, "invalid-key"),
        (with_key(json!("k".repeat(300))), 400, "invalid-key"),
        (
            r#"{"jsonrpc":"2.0","id":1,"method":"tools/call"}"#.into(),
            400,
            "missing-key",
        ),
        ("not json".into(), 400, "missing-key"),
        ("\"params\"".into(), 400, "missing-key"),
        (
            format!("{}1{}", r#"{"params":"#.repeat(5000), "}".repeat(5000)),
            400,
            "missing-key",
        ),
        (
            format!(r#"[{}{}]"#, "[".repeat(100_000), "]".repeat(100_000)),
            413,
            "request-too-large",
        ),
        (
            format!(
                r#"{{"id":1,"params":{{"_meta":{{"idempotencyKey":"big"}},"pad":"{}"}}}}"#,
                "x".repeat(70_000)
            ),
            413,
            "request-too-large",
        ),
    ];
    for (body, status, slug) in cases {
        let head: String = body.chars().take(60).collect();
        let reply = Reply::of(send(&proxy, "/strict", body)).await;
        assert_eq!(reply.status, status, "{head}: {}", reply.text());
        reply.assert_problem(status, slug);
    }
    let repeated = r#"{"id":1,"params":{"_meta":{"idempotencyKey":"a","idempotencyKey":"b"}}}"#;
    Reply::of(send(&proxy, "/strict", repeated))
        .await
        .assert_problem(400, "invalid-key");
    assert_eq!(server.executions(), 0);
}

/// The Python programs the `jsonrpc_mcp_sdk_*` tests run: the SDK's server with a counting tool, its
/// client, and `requirements.txt`, the SDK (`mcp`, from PyPI) and what it installs with, pinned.
const MCP_PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/protocols/mcp_sdk");

/// A Python with the MCP SDK installed, in `target/test-tools/mcp` (a minute on first use).
fn mcp_python() -> PathBuf {
    crate::support::tools::python_venv("mcp", Path::new(&format!("{MCP_PROGRAMS}/requirements.txt")))
}

/// `server.py` serving, answering JSON (`answer = "json"`) or, once its tool reports progress, an event
/// stream; killed when dropped. Its port, read from its first line.
async fn mcp_server(python: &Path, answer: &str) -> (tokio::process::Child, u16) {
    let mut server = tokio::process::Command::new(python)
        .arg(format!("{MCP_PROGRAMS}/server.py"))
        .arg(answer)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the MCP server starts");
    let mut lines = BufReader::new(server.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the MCP server says its port within a minute")
        .unwrap()
        .unwrap_or_default();
    let port = first
        .strip_prefix("PORT ")
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("the MCP server's first line is its port: {first:?}"));
    (server, port)
}

/// The README's MCP route, as written (the TOML block of its "gRPC services and MCP servers" section
/// that keys by `jsonrpc`).
fn readme_mcp_route() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let section = &readme[readme
        .find("## gRPC services and MCP servers")
        .expect("the README's MCP section")..];
    section
        .split("```toml\n")
        .skip(1)
        .map(|block| block.split("```").next().unwrap_or_default())
        .find(|block| block.contains("key = \"jsonrpc\""))
        .expect("the README's MCP route")
        .to_owned()
}

#[rstest]
#[tokio::test]
async fn jsonrpc_mcp_sdk_tools_call_through_the_proxy_twice_with_one_key_executes_once(
    #[values("json", "sse")] answer: &str,
    #[values("auto", "legacy")] mode: &str,
) {
    let python = tokio::task::spawn_blocking(mcp_python).await.unwrap();
    let (_server, port) = mcp_server(&python, answer).await;
    let env = TestEnv::on(Backend::Sqlite).await;
    let config =
        ProxyConfig::on(&env.store, &format!("http://127.0.0.1:{port}")).with_toml(&readme_mcp_route());
    let proxy = InProcessProxy::start(&config).await;

    let client = tokio::process::Command::new(&python)
        .arg(format!("{MCP_PROGRAMS}/client.py"))
        .arg(format!("{}/mcp", proxy.url))
        .arg(mode)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), client)
        .await
        .expect("the MCP client finishes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the MCP client failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|_| panic!("{stdout}"));
    assert_eq!(
        report["results"],
        json!([
            "charged 5: execution 1",
            "charged 5: execution 1",
            "charged 5: execution 2"
        ]),
        "the retry under one key got the first execution's answer; a new key executed"
    );
    let media = if answer == "json" {
        "application/json"
    } else {
        "text/event-stream"
    };
    let answers = report["answers"].as_array().unwrap();
    let seen: Vec<(bool, Option<&str>)> = answers
        .iter()
        .map(|a| (a[0].as_str().unwrap().starts_with(media), a[1].as_str()))
        .collect();
    assert_eq!(
        seen,
        [(true, None), (true, Some("true")), (true, None)],
        "{media} each time, the second a replay: {answers:?}"
    );
}
