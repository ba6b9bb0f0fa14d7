//! The access log (`log.access`) read from the real binary's stderr, in JSON and text: what each line
//! says of its request (client address, host, user agent, protocol, bytes in and out, times), the client
//! address a trusted proxy on the unix socket gives and a spoofed `X-Forwarded-For` does not, and the W3C
//! trace context: passed through to the upstream, on the request's line, never part of the fingerprint.

use std::collections::BTreeMap;

use rstest::rstest;

use crate::support::proxy::{binary, strip_ansi};
use crate::support::{
    Backend, ProxyConfig, ProxyProcess, Reply, TestEnv, http::client, keyed_post, poll_until, settled,
};

const KEY: &str = "key-that-must-not-be-logged";
const SECRET: &str = "query-secret-value";
const TRACE_A: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE_B: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const AGENT: &str = "orders-client/1.0";
/// An address a client claims in `X-Forwarded-For`, which only a trusted proxy may give.
const SPOOFED: &str = "203.0.113.9";

/// One access line's fields, as strings.
type Fields = BTreeMap<String, String>;

/// The access lines the process has written so far, JSON or text.
fn access_lines(proxy: &ProxyProcess) -> Vec<Fields> {
    proxy
        .stderr()
        .lines()
        .filter_map(|line| json_access(line).or_else(|| text_access(line)))
        .collect()
}

/// The keys of a JSON line that are not the event's fields.
const LINE_KEYS: [&str; 4] = ["timestamp", "level", "target", "message"];

fn json_access(line: &str) -> Option<Fields> {
    let event: serde_json::Value = serde_json::from_str(line).ok()?;
    if event.get("target")?.as_str()? != "idemproxy::access" {
        return None;
    }
    // The event's fields are top-level keys, beside the line's own.
    let fields = event
        .as_object()?
        .iter()
        .filter(|(k, _)| !LINE_KEYS.contains(&k.as_str()));
    let text = |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
    Some(fields.map(|(k, v)| (k.clone(), text(v))).collect())
}

/// `... INFO idemproxy::access: access method=POST path=/orders route="default" ...`; a quoted value
/// may hold spaces.
fn text_access(line: &str) -> Option<Fields> {
    let line = strip_ansi(line);
    let (_, mut rest) = line.split_once(" idemproxy::access: access ")?;
    let mut fields = Fields::new();
    while let Some((key, after)) = rest.trim_start().split_once('=') {
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => quoted.split_once('"').unwrap_or((quoted, "")),
            None => after.split_once(' ').unwrap_or((after, "")),
        };
        fields.insert(key.to_owned(), value.to_owned());
        rest = next;
    }
    Some(fields)
}

/// Waits until a line has been written for each `(path, outcome)`, and returns all lines so far.
async fn wait_for_lines(proxy: &ProxyProcess, expected: &[(&str, &str)]) -> Vec<Fields> {
    poll_until(&format!("access lines for {expected:?}"), || async {
        let lines = access_lines(proxy);
        let all = expected.iter().all(|(path, outcome)| {
            lines
                .iter()
                .any(|l| l["path"] == *path && l["outcome"] == *outcome)
        });
        all.then_some(lines)
    })
    .await
}

fn line_for<'a>(lines: &'a [Fields], path: &str, outcome: &str) -> &'a Fields {
    lines
        .iter()
        .find(|l| l["path"] == path && l["outcome"] == outcome)
        .unwrap_or_else(|| panic!("no {outcome} line for {path}: {lines:#?}"))
}

fn assert_ms(line: &Fields, field: &str) {
    let value = line
        .get(field)
        .unwrap_or_else(|| panic!("{field} missing: {line:?}"));
    let ms: f64 = value
        .parse()
        .unwrap_or_else(|_| panic!("{field}={value} is not a number"));
    assert!(ms >= 0.0, "{field}={ms}");
}

#[rstest]
#[tokio::test]
async fn one_access_line_per_request_names_what_happened(
    #[values("json", "text")] format: &str,
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().set("log.format", format).set("log.access", true);
    let proxy = ProxyProcess::spawn(&config).await;
    let orders = format!("/orders?token={SECRET}");

    let executed = keyed_post(&proxy.url, &orders, KEY, "{}")
        .header("traceparent", TRACE_A)
        .header("user-agent", AGENT)
        .header("x-forwarded-for", SPOOFED);
    let executed = Reply::of(executed).await;
    assert_eq!(executed.status, 201);
    let replay = settled(|| keyed_post(&proxy.url, &orders, KEY, "{}").header("traceparent", TRACE_B)).await;
    assert!(replay.is_replay());
    let mismatch = Reply::of(keyed_post(&proxy.url, &orders, KEY, r#"{"other":1}"#)).await;
    assert_eq!(mismatch.status, 422);
    let slow = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "s", "{}")));
    env.upstream.wait_for_key("s", 1).await;
    let conflict = Reply::of(keyed_post(&proxy.url, "/slow", "s", "{}")).await;
    assert_eq!(conflict.status, 409);
    env.upstream.release("slow");
    assert_eq!(slow.await.expect("slow request").status, 201);
    let passthrough = Reply::of(client().get(format!("{}/items?token={SECRET}", proxy.url))).await;
    assert_eq!(passthrough.status, 201);
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let over_h2 = Reply::of(
        h2.get(format!("{}/h2", proxy.url))
            .header("user-agent", "h2 client"),
    )
    .await;
    assert_eq!(over_h2.status, 201);
    let replies = [
        (&executed, "2"),
        (&replay, "2"),
        (&mismatch, "11"),
        (&passthrough, "0"),
    ];

    let expected = [
        ("/orders", "executed"),
        ("/orders", "replayed"),
        ("/orders", "mismatch"),
        ("/slow", "conflict"),
        ("/slow", "executed"),
        ("/items", "passthrough"),
        ("/h2", "passthrough"),
    ];
    let lines = wait_for_lines(&proxy, &expected).await;
    let executed = line_for(&lines, "/orders", "executed");
    let replayed = line_for(&lines, "/orders", "replayed");
    let mismatch = line_for(&lines, "/orders", "mismatch");
    let conflict = line_for(&lines, "/slow", "conflict");
    let slow = line_for(&lines, "/slow", "executed");
    let passthrough = line_for(&lines, "/items", "passthrough");
    let over_h2_line = line_for(&lines, "/h2", "passthrough");
    let statuses = [(executed, "201"), (replayed, "201"), (mismatch, "422")];
    let statuses = statuses
        .into_iter()
        .chain([(conflict, "409"), (slow, "201"), (passthrough, "201")]);
    for (line, status) in statuses {
        assert_eq!(line["status"], status, "{line:?}");
        assert_eq!(line["route"], "default", "{line:?}");
        assert!(line["method"] == "POST" || line["method"] == "GET", "{line:?}");
        assert_ms(line, "store_ms");
        assert_ms(line, "duration_ms");
    }
    assert_eq!(passthrough["method"], "GET");

    let host = proxy.url.trim_start_matches("http://");
    for (line, (reply, bytes_in)) in [executed, replayed, mismatch, passthrough]
        .into_iter()
        .zip(replies)
    {
        assert_eq!(
            line["client"], "127.0.0.1",
            "the peer, never a spoofed chain: {line:?}"
        );
        assert_eq!(line["host"], host, "{line:?}");
        assert_eq!(line["protocol"], "HTTP/1.1", "{line:?}");
        assert_eq!(line["bytes_in"], bytes_in, "the request body's bytes: {line:?}");
        assert_eq!(
            line["bytes_out"],
            reply.body.len().to_string(),
            "the response body's bytes: {line:?}"
        );
    }
    assert_eq!(executed["user_agent"], AGENT);
    assert!(!passthrough.contains_key("user_agent"), "{passthrough:?}");
    assert_eq!(over_h2_line["protocol"], "HTTP/2", "{over_h2_line:?}");
    assert_eq!(
        over_h2_line["host"], host,
        "HTTP/2's :authority: {over_h2_line:?}"
    );
    assert_eq!(over_h2_line["user_agent"], "h2 client", "{over_h2_line:?}");
    assert_eq!(over_h2_line["bytes_out"], over_h2.body.len().to_string());

    let hash = &executed["key_hash"];
    assert_eq!(hash.len(), 16, "{executed:?}");
    assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
    for same_key in [replayed, mismatch] {
        assert_eq!(&same_key["key_hash"], hash, "{same_key:?}");
    }
    assert_eq!(conflict["key_hash"], slow["key_hash"]);
    assert_ne!(&conflict["key_hash"], hash);
    assert!(!passthrough.contains_key("key_hash"), "{passthrough:?}");

    for called in [executed, slow, passthrough] {
        assert_ms(called, "upstream_ms");
    }
    for not_called in [replayed, mismatch, conflict] {
        assert!(!not_called.contains_key("upstream_ms"), "{not_called:?}");
    }
    let store_ms: f64 = executed["store_ms"].parse().unwrap();
    assert!(
        store_ms > 0.0,
        "the claim and the completion took time: {executed:?}"
    );
    let passthrough_store: f64 = passthrough["store_ms"].parse().unwrap();
    assert_eq!(passthrough_store, 0.0, "{passthrough:?}");

    assert_eq!(executed["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(replayed["trace_id"], "0af7651916cd43dd8448eb211c80319c");
    assert!(!mismatch.contains_key("trace_id"), "{mismatch:?}");

    let written: Vec<String> = proxy
        .stderr()
        .lines()
        .filter(|l| l.contains("idemproxy::access"))
        .map(str::to_owned)
        .collect();
    for line in &written {
        assert!(!line.contains(SECRET), "the query string was logged: {line}");
        assert!(!line.contains(KEY), "the key was logged: {line}");
    }
}

/// A POST through a proxy on the unix socket: the real binary serving `config` on `socket`, a
/// forwarded chain naming `chain`; the process is stopped once answered, and its access lines returned
/// with the response's body.
async fn through_the_unix_socket(
    config: &ProxyConfig,
    socket: &std::path::Path,
    chain: &str,
) -> (Vec<Fields>, usize) {
    let file = crate::support::cli::config_file(&config.to_toml());
    let child = binary()
        .arg("serve")
        .arg("--config")
        .arg(file.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the idemproxy binary");
    let stream = poll_until("the unix socket accepting", || async {
        tokio::net::UnixStream::connect(socket).await.ok()
    })
    .await;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP/1.1 handshake");
    tokio::spawn(connection);
    let request = http::Request::post("/items")
        .header("host", "items.internal")
        .header("user-agent", AGENT)
        .header("x-forwarded-for", chain)
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"hello")))
        .unwrap();
    let response = sender.send_request(request).await.expect("a response");
    assert_eq!(response.status(), 201);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let pid = child.id().expect("running").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let output = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("idemproxy exits after SIGTERM")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    (stderr.lines().filter_map(json_access).collect(), body.len())
}

#[rstest]
#[tokio::test]
async fn the_client_on_a_unix_socket_is_what_a_trusted_proxy_says_else_unix(
    #[values(true, false)] trusted: bool,
) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("proxy.sock");
    let config = env
        .config()
        .set("server.listen", format!("unix:{}", socket.display()))
        .set("server.trust_unix_forwarded_for", trusted)
        .set("log.access", true);
    // The ingress in front appended the address it saw last; what came before, its client wrote.
    let (lines, body) = through_the_unix_socket(&config, &socket, &format!("{SPOOFED}, 198.51.100.7")).await;
    let [line] = lines.as_slice() else {
        panic!("one access line: {lines:#?}")
    };
    let client = if trusted { "198.51.100.7" } else { "unix" };
    assert_eq!(line["client"], client, "{line:?}");
    assert_eq!(line["host"], "items.internal", "{line:?}");
    assert_eq!(line["user_agent"], AGENT, "{line:?}");
    assert_eq!(line["protocol"], "HTTP/1.1", "{line:?}");
    assert_eq!(line["bytes_in"], "5", "{line:?}");
    assert_eq!(line["bytes_out"], body.to_string(), "{line:?}");
}

#[tokio::test]
async fn no_access_line_when_the_access_log_is_off() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let mut proxy = ProxyProcess::spawn(&env.config()).await;
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}"))
            .await
            .status,
        201
    );
    assert_eq!(
        Reply::of(client().get(format!("{}/items", proxy.url)))
            .await
            .status,
        201
    );
    // Everything the process would write is written by the time it has exited.
    proxy.terminate();
    assert!(proxy.wait().await.success());
    let stderr = proxy.stderr();
    assert!(stderr.contains("proxy listening"), "the log was read: {stderr}");
    assert!(access_lines(&proxy).is_empty(), "{stderr}");
}

#[rstest]
#[tokio::test]
async fn trace_context_reaches_the_upstream_unchanged(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;
    let state = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";
    let keyed = keyed_post(&proxy.url, "/orders", "t", "{}")
        .header("traceparent", TRACE_A)
        .header("tracestate", state);
    assert_eq!(Reply::of(keyed).await.status, 201);
    let invalid = "00-not-a-trace-context";
    let passthrough = client()
        .get(format!("{}/items", proxy.url))
        .header("traceparent", invalid)
        .header("tracestate", state);
    assert_eq!(
        Reply::of(passthrough).await.status,
        201,
        "an invalid traceparent is not an error"
    );
    let requests = env.upstream.requests();
    let sent = |path: &str| {
        let recorded = requests
            .iter()
            .find(|r| r.path_and_query == path)
            .unwrap_or_else(|| panic!("{path} reached the upstream"));
        let header = |name: &str| recorded.headers.get(name).map(|v| v.to_str().unwrap().to_owned());
        (header("traceparent"), header("tracestate"))
    };
    assert_eq!(
        sent("/orders"),
        (Some(TRACE_A.to_owned()), Some(state.to_owned()))
    );
    assert_eq!(sent("/items"), (Some(invalid.to_owned()), Some(state.to_owned())));
}

#[rstest]
#[tokio::test]
async fn a_retry_with_a_new_trace_context_is_a_replay(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;
    let first = keyed_post(&proxy.url, "/orders", "r", "{}")
        .header("traceparent", TRACE_A)
        .header("tracestate", "a=1");
    assert_eq!(Reply::of(first).await.status, 201);
    let retry = settled(|| {
        keyed_post(&proxy.url, "/orders", "r", "{}")
            .header("traceparent", TRACE_B)
            .header("tracestate", "b=2")
            .header("date", "Mon, 23 Nov 2026 14:00:00 GMT")
    })
    .await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(retry.is_replay());
    assert_eq!(env.upstream.executions_for_key("r"), 1);
}

#[tokio::test]
async fn a_trace_header_in_fingerprint_headers_is_refused_at_load() {
    let config = ProxyConfig::new("sqlite://unused.db", "http://127.0.0.1:1").set(
        "idempotency.fingerprint_headers",
        vec!["content-type", "traceparent"],
    );
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), config.to_toml()).unwrap();
    let path = file.path().to_str().unwrap();
    let output = crate::support::cli::idemproxy(&["check-config", "--config", path], &[]).await;
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("idempotency.fingerprint_headers"), "{stderr}");
    assert!(stderr.contains("traceparent"), "{stderr}");
}

/// A POST to `path` with the forwarded chain `chain`, on a connection of its own.
async fn forwarded_post(proxy: &ProxyProcess, path: &str, chain: &str) {
    let fresh = reqwest::Client::builder().build().unwrap();
    let reply = Reply::of(
        fresh
            .post(format!("{}{path}", proxy.url))
            .header("x-forwarded-for", chain),
    )
    .await;
    assert_eq!(reply.status, 201);
}

#[tokio::test]
async fn a_trusted_proxy_over_tcp_names_the_client_and_a_reload_applies_the_list_to_new_connections() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("log.access", true)
        .set("server.trusted_proxies", vec!["10.0.0.0/8"]);
    let proxy = ProxyProcess::spawn(&config).await;
    // The test's own address (127.0.0.1) is not trusted: its chain is never believed.
    forwarded_post(&proxy, "/untrusted", &format!("{SPOOFED}, 198.51.100.7")).await;

    let trusting = config.set("server.trusted_proxies", vec!["127.0.0.0/8", "10.0.0.0/8"]);
    std::fs::write(proxy.config_file(), trusting.to_toml()).unwrap();
    let admin = proxy.admin_url.trim_start_matches("http://").to_owned();
    let reloaded = crate::support::cli::idemproxy(&["reload", "--admin-listen", &admin], &[]).await;
    assert!(
        crate::support::cli::stdout(&reloaded).contains("server.trusted_proxies"),
        "{}",
        crate::support::cli::stderr(&reloaded)
    );
    // Walking from the right past every trusted hop: the client the first untrusted one names.
    forwarded_post(&proxy, "/trusted", &format!("{SPOOFED}, 198.51.100.7, 10.9.9.9")).await;
    forwarded_post(&proxy, "/all-trusted", "10.1.1.1, 10.2.2.2").await;

    let expected = [
        ("/untrusted", "passthrough"),
        ("/trusted", "passthrough"),
        ("/all-trusted", "passthrough"),
    ];
    let lines = wait_for_lines(&proxy, &expected).await;
    assert_eq!(
        line_for(&lines, "/untrusted", "passthrough")["client"],
        "127.0.0.1"
    );
    assert_eq!(
        line_for(&lines, "/trusted", "passthrough")["client"],
        "198.51.100.7"
    );
    assert_eq!(
        line_for(&lines, "/all-trusted", "passthrough")["client"],
        "10.1.1.1"
    );
}
