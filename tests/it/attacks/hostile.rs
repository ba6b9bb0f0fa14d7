//! Hostile and malformed input on a real socket: slow clients, oversized heads, smuggling shapes, bytes
//! that are not text, and connection floods. Each gets a clear answer (or a closed connection) and none
//! reaches the upstream in a form the proxy did not itself decide on. The "Hostile input" table of
//! docs/security.md lists these rows.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::raw::{self, RawReply, addr_of, head};
use crate::support::{InProcessProxy, Reply, TestEnv, keyed_post, metric_reaches, settled};

/// A proxy with short client bounds, so slow-client tests finish quickly.
async fn strict_proxy(env: &TestEnv) -> InProcessProxy {
    let config = env
        .config()
        .set("server.header_read_timeout", "1s")
        .set("server.body_read_timeout", "1s")
        .set("idempotency.max_request_body", "1KiB");
    InProcessProxy::start(&config).await
}

#[tokio::test]
async fn slow_request_head_is_cut_off_at_header_read_timeout() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let mut stream = raw::connect(&proxy.url).await;
    let host = addr_of(&proxy.url);
    stream
        .write_all(format!("POST /orders HTTP/1.1\r\nhost: {host}\r\nidempotency-key: slow\r\n").as_bytes())
        .await
        .unwrap();
    // The head never ends: the proxy must close the connection by itself.
    let reply = raw::read_reply(&mut stream).await;
    assert!(
        reply.status.is_none(),
        "a head that never ends is closed unanswered: {reply:?}"
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection stays open");
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn stalled_keyed_body_gets_408_and_is_never_forwarded() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let mut stream = raw::connect(&proxy.url).await;
    let head = head(
        "POST /orders",
        addr_of(&proxy.url),
        &["idempotency-key: stall", "content-length: 100"],
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(b"0123456789").await.unwrap();
    let reply = raw::read_reply(&mut stream).await;
    reply.assert_problem(408, "request-timeout");
    assert_eq!(env.upstream.executions(), 0);

    // Nothing was claimed: the same key with a whole body executes.
    let body = "x".repeat(100);
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "stall", &body)).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
}

#[tokio::test]
async fn stalled_passthrough_body_gets_408_and_the_upstream_executes_nothing() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let mut stream = raw::connect(&proxy.url).await;
    let head = head("POST /orders", addr_of(&proxy.url), &["content-length: 100"]);
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(b"0123456789").await.unwrap();
    let reply = raw::read_reply(&mut stream).await;
    reply.assert_problem(408, "request-timeout");
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn keyed_body_trickled_past_the_limit_gets_413_before_it_ends() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.body_read_timeout", "60s")
        .set("idempotency.max_request_body", "1KiB");
    let proxy = InProcessProxy::start(&config).await;
    let stream = raw::connect(&proxy.url).await;
    let (mut reader, mut writer) = stream.into_split();
    let head = head(
        "POST /orders",
        addr_of(&proxy.url),
        &["idempotency-key: trickle", "transfer-encoding: chunked"],
    );
    writer.write_all(head.as_bytes()).await.unwrap();
    // 100-byte chunks, each within the body timeout of the last, far past the 1 KiB limit if the proxy
    // kept reading; the writer stops as soon as the answer is in.
    let (answered, mut answer) = tokio::sync::oneshot::channel::<()>();
    let trickle = tokio::spawn(async move {
        let chunk = format!("64\r\n{}\r\n", "y".repeat(100));
        let mut sent = 0usize;
        for _ in 0..1000 {
            if answer.try_recv().is_ok() || writer.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
            sent += 100;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sent
    });
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buffer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(30), reader.read(&mut chunk))
            .await
            .expect("an answer while the body is still coming")
            .unwrap();
        assert!(n > 0, "closed without an answer");
        buffer.extend_from_slice(&chunk[..n]);
    }
    let _ = answered.send(());
    let sent = trickle.await.unwrap();
    let head = String::from_utf8_lossy(&buffer);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        sent < 100 * 1000,
        "the answer came only after the client stopped sending ({sent} bytes)"
    );
    assert_eq!(env.upstream.executions(), 0);
}

/// The default count is hyper's own, so it is not passed to hyper; it must still hold.
#[tokio::test]
async fn the_default_header_count_of_100_holds() {
    let env = TestEnv::new().await;
    let proxy = InProcessProxy::start(&env.config()).await;
    let host = addr_of(&proxy.url);
    let lines = |n: usize| -> Vec<String> { (0..n).map(|i| format!("x-many-{i}: {i}")).collect() };

    // Host plus 90 others; the proxy adds three X-Forwarded-* on the way, and the test upstream has the
    // same limit.
    let fine = lines(90);
    let fine: Vec<&str> = fine.iter().map(String::as_str).collect();
    let reply = raw::exchange(&proxy.url, head("GET /fine", host, &fine).as_bytes()).await;
    assert_eq!(reply.status, Some(201), "91 headers are allowed: {reply:?}");

    let flood = lines(100);
    let flood: Vec<&str> = flood.iter().map(String::as_str).collect();
    let reply = raw::exchange(&proxy.url, head("GET /flood", host, &flood).as_bytes()).await;
    assert_eq!(reply.status, Some(431), "101 headers are refused: {reply:?}");
    assert_eq!(
        env.upstream.executions(),
        1,
        "only the allowed request was forwarded"
    );
}

#[tokio::test]
async fn header_floods_and_oversized_heads_get_431() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.max_headers", 50)
        .set("server.max_header_size", "16KiB");
    let proxy = InProcessProxy::start(&config).await;
    let host = addr_of(&proxy.url);

    let many: Vec<String> = (0..60).map(|i| format!("x-flood-{i}: {i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let reply = raw::exchange(&proxy.url, head("POST /orders", host, &many).as_bytes()).await;
    assert_eq!(reply.status, Some(431), "too many headers: {reply:?}");

    let big = format!("x-big: {}", "b".repeat(20 * 1024));
    let reply = raw::exchange(&proxy.url, head("POST /orders", host, &[&big]).as_bytes()).await;
    assert_eq!(reply.status, Some(431), "one oversized header: {reply:?}");

    let long_target = format!("GET /{}", "p".repeat(20 * 1024));
    let reply = raw::exchange(&proxy.url, head(&long_target, host, &[]).as_bytes()).await;
    assert!(
        matches!(reply.status, Some(414) | Some(431)),
        "oversized request line: {reply:?}"
    );

    // HTTP/2: a header list over the bound is refused, the connection survives for the next request.
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let refused = client
        .post(format!("{}/orders", proxy.url))
        .header("x-big", "b".repeat(20 * 1024))
        .send()
        .await;
    assert_eq!(refused.expect("an h2 answer").status(), 431);
    let fine = client.get(format!("{}/fine", proxy.url)).send().await.unwrap();
    assert_eq!(fine.status(), 201);

    assert_eq!(
        env.upstream.executions(),
        1,
        "only the well-formed request was forwarded"
    );
}

/// Sends each smuggling shape on its own connection; every one must be refused with 400.
async fn assert_all_refused(proxy: &InProcessProxy, shapes: &[(&str, String)]) {
    for (shape, bytes) in shapes {
        let reply: RawReply = raw::exchange(&proxy.url, bytes.as_bytes()).await;
        assert_eq!(reply.status, Some(400), "{shape}: {reply:?}");
    }
}

#[tokio::test]
async fn ambiguous_framing_is_refused_and_never_forwarded() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    let key = "idempotency-key: smuggle";
    let shapes = [
        (
            "two differing content-lengths",
            head(
                "POST /orders",
                host,
                &[key, "content-length: 5", "content-length: 6"],
            ) + "hello!",
        ),
        (
            "content-length list",
            head("POST /orders", host, &[key, "content-length: 5, 6"]) + "hello!",
        ),
        (
            "signed content-length",
            head("POST /orders", host, &[key, "content-length: +5"]) + "hello",
        ),
        (
            "obs-fold continuation line",
            head(
                "POST /orders",
                host,
                &[key, "x-folded: a", " b", "content-length: 5"],
            ) + "hello",
        ),
        (
            "chunked not the final transfer coding",
            head("POST /orders", host, &[key, "transfer-encoding: chunked, gzip"]) + "0\r\n\r\n",
        ),
        (
            "transfer-encoding on HTTP/1.0",
            format!(
                "POST /orders HTTP/1.0\r\nhost: {host}\r\n{key}\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
            ),
        ),
        (
            "space before the colon",
            head("POST /orders", host, &[key, "content-length : 5"]) + "hello",
        ),
    ];
    assert_all_refused(&proxy, &shapes).await;
    // The same shapes without a key (passthrough) are refused the same way.
    let keyless: Vec<(&str, String)> = shapes
        .iter()
        .map(|(shape, bytes)| (*shape, bytes.replace(&format!("{key}\r\n"), "")))
        .collect();
    assert_all_refused(&proxy, &keyless).await;
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn bad_chunk_sizes_get_400_and_reach_nothing() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    for chunk in [
        "zz\r\nhello\r\n0\r\n\r\n",
        "5\r\nhelloXX0\r\n\r\n",
        "-5\r\nhello\r\n0\r\n\r\n",
    ] {
        let keyed = head(
            "POST /orders",
            host,
            &["idempotency-key: chunks", "transfer-encoding: chunked"],
        ) + chunk;
        let reply = raw::exchange(&proxy.url, keyed.as_bytes()).await;
        reply.assert_problem(400, "bad-request-body");
        let keyless = head("POST /orders", host, &["transfer-encoding: chunked"]) + chunk;
        let reply = raw::exchange(&proxy.url, keyless.as_bytes()).await;
        reply.assert_problem(400, "bad-request-body");
    }
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn content_length_with_chunked_is_framed_by_chunked_alone() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    // The classic CL.TE shape: a front end trusting content-length would pass "0\r\n\r\nGET /smuggled"
    // as the body; the proxy frames by transfer-encoding (RFC 9112 §6.3), drops content-length and
    // re-frames the request it forwards, so the upstream sees one request whose framing is unambiguous.
    let request = head(
        "POST /orders",
        host,
        &[
            "idempotency-key: clte",
            "content-length: 30",
            "transfer-encoding: chunked",
        ],
    ) + "5\r\nhello\r\n0\r\n\r\n";
    let reply = raw::exchange(&proxy.url, request.as_bytes()).await;
    assert_eq!(reply.status, Some(201), "{reply:?}");
    let seen = env.upstream.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(&seen[0].body[..], b"hello");
    let lengths: Vec<_> = seen[0].headers.get_all("content-length").iter().collect();
    let chunked = seen[0].headers.contains_key("transfer-encoding");
    assert!(
        lengths.len() + usize::from(chunked) == 1 && lengths.iter().all(|l| *l == "5"),
        "exactly one framing, matching the body: {:?}",
        seen[0].headers
    );
}

#[tokio::test]
async fn bytes_that_are_not_visible_ascii_in_the_key_are_refused() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    for key in [&b"caf\xc3\xa9"[..], b"\xff\xfe", b"a\x80b", b"\"\xff\""] {
        let mut request = format!("POST /orders HTTP/1.1\r\nhost: {host}\r\nidempotency-key: ").into_bytes();
        request.extend_from_slice(key);
        request.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\n{}");
        let reply = raw::exchange(&proxy.url, &request).await;
        reply.assert_problem(400, "invalid-key");
    }
    // Control characters are not header bytes at all: refused before the request exists.
    for key in [&b"a\x01b"[..], b"a\x7fb", b"a\x00b"] {
        let mut request = format!("POST /orders HTTP/1.1\r\nhost: {host}\r\nidempotency-key: ").into_bytes();
        request.extend_from_slice(key);
        request.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\n{}");
        let reply = raw::exchange(&proxy.url, &request).await;
        assert_eq!(reply.status, Some(400), "{key:?}: {reply:?}");
    }
    assert_eq!(env.upstream.executions(), 0);
}

#[tokio::test]
async fn non_utf8_scope_headers_are_hashed_and_keep_clients_apart() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    let request = |credential: &[u8]| {
        let mut bytes = format!(
            "POST /orders HTTP/1.1\r\nhost: {host}\r\nidempotency-key: shared\r\n\
             content-type: application/json\r\nauthorization: "
        )
        .into_bytes();
        bytes.extend_from_slice(credential);
        bytes.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\n{}");
        bytes
    };
    let alice = raw::exchange(&proxy.url, &request(b"Bearer \xff\xfe-alice")).await;
    assert_eq!(alice.status, Some(201), "{alice:?}");
    let bob = raw::exchange(&proxy.url, &request(b"Bearer \xff\xfe-bob")).await;
    assert_eq!(bob.status, Some(201), "{bob:?}");
    assert!(
        bob.header("idempotent-replayed").is_none(),
        "bob got alice's response"
    );
    assert_eq!(env.upstream.executions(), 2);
}

#[tokio::test]
async fn paths_with_raw_or_encoded_non_utf8_bytes() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let host = addr_of(&proxy.url);
    let mut raw_bytes = b"POST /caf\xc3\xa9/\xff HTTP/1.1\r\nhost: ".to_vec();
    raw_bytes.extend_from_slice(host.as_bytes());
    raw_bytes
        .extend_from_slice(b"\r\nidempotency-key: path\r\nauthorization: t\r\ncontent-length: 2\r\n\r\n{}");
    let reply = raw::exchange(&proxy.url, &raw_bytes).await;
    assert_eq!(reply.status, Some(400), "raw bytes in the target: {reply:?}");
    assert_eq!(env.upstream.executions(), 0);

    // Percent-encoded, the same bytes are a valid target: forwarded as sent, and part of the fingerprint.
    let first = Reply::of(keyed_post(&proxy.url, "/caf%C3%A9/%FF", "path", "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let seen = env.upstream.requests();
    assert_eq!(seen[0].path_and_query, "/caf%C3%A9/%FF");
    let replay = settled(|| keyed_post(&proxy.url, "/caf%C3%A9/%FF", "path", "{}")).await;
    assert!(replay.is_replay());
    let other = Reply::of(keyed_post(&proxy.url, "/caf%C3%A9/%FE", "path", "{}")).await;
    other.assert_problem(422, "key-reused");
}

#[tokio::test]
async fn connections_beyond_max_connections_wait_until_one_closes() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.max_connections", 2)
        .set("server.header_read_timeout", "60s");
    let proxy = InProcessProxy::start(&config).await;
    let host = addr_of(&proxy.url).to_string();

    // Two clients hold every slot: each has sent a request and keeps its connection open.
    let mut holders = Vec::new();
    for i in 0..2 {
        let mut stream = raw::connect(&proxy.url).await;
        let request = head(&format!("GET /hold-{i}"), &host, &[]);
        stream.write_all(request.as_bytes()).await.unwrap();
        let reply = raw::read_reply(&mut stream).await;
        assert_eq!(reply.status, Some(201));
        holders.push(stream);
    }
    assert_eq!(
        crate::support::metric(&proxy.admin_url, "idemproxy_open_connections", &[]).await,
        2.0
    );

    // A third connects but is not served while both slots are held. (Both holders are idle, so after
    // a second one would be evicted to make room: tests/it/guarantees/flood.rs.)
    let mut third = raw::connect(&proxy.url).await;
    third
        .write_all(head("GET /third", &host, &[]).as_bytes())
        .await
        .unwrap();
    metric_reaches(
        &proxy.admin_url,
        "idemproxy_connection_cap_reached_total",
        &[],
        1.0,
    )
    .await;
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut byte)).await;
    assert!(early.is_err(), "served beyond max_connections");
    assert_eq!(env.upstream.executions(), 2);

    drop(holders.pop());
    let reply = raw::read_reply(&mut third).await;
    assert_eq!(reply.status, Some(201), "served once a slot freed: {reply:?}");
    assert_eq!(env.upstream.executions(), 3);
}

#[tokio::test]
async fn idle_keep_alive_connection_is_closed_after_header_read_timeout() {
    let env = TestEnv::new().await;
    let proxy = strict_proxy(&env).await;
    let mut stream = raw::connect(&proxy.url).await;
    let request = head("GET /first", addr_of(&proxy.url), &[]);
    stream.write_all(request.as_bytes()).await.unwrap();
    let reply = raw::read_reply(&mut stream).await;
    assert_eq!(reply.status, Some(201));
    assert!(reply.header("connection").is_none(), "kept alive: {reply:?}");
    // No next request: the proxy closes the idle connection by itself, freeing its slot.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the idle connection stays open");
    assert!(rest.is_empty(), "{rest:?}");
}

/// Sends a keyed head declaring 16 KiB and the first 100 bytes, then stalls.
async fn stalled_body(proxy: &InProcessProxy, key: &str) -> tokio::net::TcpStream {
    let mut stream = raw::connect(&proxy.url).await;
    let key = format!("idempotency-key: {key}");
    let request = head(
        "POST /orders",
        addr_of(&proxy.url),
        &[&key, "content-length: 16384"],
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream.write_all(&[b'h'; 100]).await.unwrap();
    stream
}

#[tokio::test]
async fn keyed_bodies_beyond_max_buffered_bodies_wait_then_get_503() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.body_read_timeout", "3s")
        .set("server.max_buffered_bodies", "16KiB")
        .set("idempotency.max_request_body", "16KiB");
    let proxy = InProcessProxy::start(&config).await;
    let waits = |at_least| {
        metric_reaches(
            &proxy.admin_url,
            "idemproxy_body_budget_waits_total",
            &[],
            at_least,
        )
    };

    // The first stalled body holds the whole budget; the second waits for it (first in line), so the
    // small body behind them finds no room within its patience.
    let mut first = stalled_body(&proxy, "first").await;
    metric_reaches(&proxy.admin_url, "idemproxy_in_flight_requests", &[], 1.0).await;
    // The second's patience must end after the first's body deadline, which starts once the first has
    // reserved its room; nothing reports that moment, so leave a clear margin. (Without it, on two
    // worker threads the second could start waiting before the first's deadline was set, give up just
    // before the first's room came back, and leave that room to the small body.)
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut second = stalled_body(&proxy, "second").await;
    waits(1.0).await;
    let small = Reply::of(keyed_post(&proxy.url, "/orders", "small", "{}")).await;
    small.assert_problem(503, "busy");
    assert_eq!(small.retry_after(), 1);
    assert!(waits(2.0).await >= 2.0);
    raw::read_reply(&mut first)
        .await
        .assert_problem(408, "request-timeout");
    raw::read_reply(&mut second)
        .await
        .assert_problem(408, "request-timeout");

    // Their room came back with their 408s.
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "after", "{}")).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(env.upstream.executions(), 1);
}

/// A route keyed by a JSON field of the body, beside the default policy with JSON fingerprints; bodies
/// up to 9 MiB, and a body budget of `budget`.
async fn json_proxy(env: &TestEnv, budget: &str) -> InProcessProxy {
    let config = env
        .config()
        .set("server.max_buffered_bodies", budget)
        .set("idempotency.max_request_body", "9MiB")
        .set("idempotency.fingerprint_body", "json")
        .with_toml(
            r#"
[[routes]]
name = "events"
path = "/events"
key = "json:/id"
required = true
unscoped = "shared"
scope_headers = []
fingerprint_body = "json"
max_request_body = "9MiB"
"#,
        );
    InProcessProxy::start(&config).await
}

/// About `bytes` of small JSON objects in one array, each `{"id":N,"n":"x"}` (or with its members the
/// other way round, the same length), then the body's own `"id"`.
fn small_objects(bytes: usize, reversed: bool) -> String {
    let mut body = String::from("{\"items\":[");
    let mut i = 0;
    while body.len() < bytes {
        if i > 0 {
            body.push(',');
        }
        match reversed {
            false => body.push_str(&format!("{{\"id\":{i},\"n\":\"x\"}}")),
            true => body.push_str(&format!("{{\"n\":\"x\",\"id\":{i}}}")),
        }
        i += 1;
    }
    body.push_str("],\"id\":\"evt-8mib\"}");
    body
}

#[tokio::test]
async fn an_8_mib_json_body_of_small_objects_is_read_within_the_body_budget() {
    let env = TestEnv::new().await;
    // Room for the body and little more: the JSON is read in kilobytes, not in a tree of hundreds of
    // megabytes.
    let proxy = json_proxy(&env, "9MiB").await;
    let body = small_objects(8 << 20, false);
    let reordered = small_objects(8 << 20, true);
    assert_eq!(body.len(), reordered.len());

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "big-1", &body)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "big-1", &reordered)).await;
    assert!(
        retry.is_replay(),
        "the same JSON, members reordered: {}",
        retry.text()
    );
    assert_eq!(env.upstream.executions(), 1);

    let event = || {
        crate::support::http::client()
            .post(format!("{}/events", proxy.url))
            .header("content-type", "application/json")
            .body(body.clone())
    };
    let delivered = Reply::of(event()).await;
    assert_eq!(delivered.status, 201, "{}", delivered.text());
    assert!(
        Reply::of(event()).await.is_replay(),
        "keyed by the id after 8 MiB of items"
    );
    assert_eq!(env.upstream.executions(), 2);
    let seen = env.upstream.requests();
    assert_eq!(seen[1].body.len(), body.len(), "the app got the body whole");
}

#[tokio::test]
async fn a_json_body_whose_objects_need_more_than_the_budget_has_gets_503_and_runs_nothing() {
    let env = TestEnv::new().await;
    let proxy = json_proxy(&env, "9MiB").await;
    // 600,000 members in one object (8 MiB): ordering them takes about 30 MB, more than the budget.
    let members: Vec<String> = (0..600_000).map(|i| format!("\"m{i:07}\":1")).collect();
    let wide = format!("{{{}}}", members.join(","));
    assert!(wide.len() < 9 << 20);
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "wide", &wide)).await;
    refused.assert_problem(503, "busy");
    let detail = refused.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("JSON"), "{detail}");
    assert_eq!(env.upstream.executions(), 0);

    // Its reservation went back with the answer: the same key, a small body, executes.
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "wide", r#"{"m":1}"#)).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn hostile_json_nesting_is_counted_by_its_bytes_and_holds_no_key() {
    let env = TestEnv::new().await;
    let proxy = json_proxy(&env, "32MiB").await;
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "deep", &deep)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(
        Reply::of(keyed_post(&proxy.url, "/orders", "deep", &deep))
            .await
            .is_replay()
    );
    let spaced = format!("{} ", deep);
    Reply::of(keyed_post(&proxy.url, "/orders", "deep", &spaced))
        .await
        .assert_problem(422, "key-reused");

    let deep_id = format!("{}\"x\"{}", "{\"id\":".repeat(100_000), "}".repeat(100_000));
    for body in [
        deep.as_str(),
        &deep_id,
        "{\"id\":\"e1\"",
        "\u{feff}{\"id\":\"e1\"}",
    ] {
        let request = crate::support::http::client()
            .post(format!("{}/events", proxy.url))
            .body(body.to_owned());
        Reply::of(request).await.assert_problem(400, "missing-key");
    }
    assert_eq!(env.upstream.executions(), 1);
}
