//! Where features meet, sent from outside over real sockets: other spellings of a method (`post`,
//! `Post`, `:method post`) are the method they spell for routing, keys, signatures and the CONNECT and
//! TRACE refusal; a signed route verifies every method and every case and trailing slash of its path;
//! the asterisk form is only for OPTIONS and an absolute-form target names the host; one credential in
//! any spelling of its scheme is one client; request trailers are cleaned as headers are, so none the
//! proxy owns or decides by reaches the upstream, and none can leave an HTTP/2 upstream's stream
//! half-sent, holding the key and a keyed slot until `upstream.timeout`. And where the dialects meet
//! the keyed task: a release read in a gRPC answer's trailers wakes whoever waits at once, however
//! slowly the original's client reads; a keyed request carrying `grpc-timeout` (gRPC-Web over HTTP)
//! goes upstream under `upstream.timeout`.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rstest::rstest;
use tokio::net::{TcpListener, TcpStream};

use crate::support::http::TEST_CREDENTIAL;
use crate::support::raw::{self, exchange, head};
use crate::support::{Backend, InProcessProxy, ProxyConfig, TestStore, raw_h2, signatures, unless_skipped};

const STRIPE_SECRET: &str = "whsec_seams_secret";

/// One request as the upstream executed it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: HeaderMap,
    trailers: Option<HeaderMap>,
}

/// An upstream on 127.0.0.1:0 speaking HTTP/1.1 and h2c (prior knowledge) that records every request
/// and answers `201 executed`.
async fn recording_upstream() -> (String, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let recorded = seen.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let recorded = recorded.clone();
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let recorded = recorded.clone();
                async move {
                    let (parts, body) = request.into_parts();
                    let collected = body.collect().await.map_err(|e| e.to_string())?;
                    if let Some(coding) = parts.headers.get("x-echo-events").cloned() {
                        return Ok(echo_events(collected.to_bytes(), coding));
                    }
                    recorded.lock().unwrap().push(Seen {
                        method: parts.method.to_string(),
                        path: parts.uri.path().to_owned(),
                        headers: parts.headers,
                        trailers: collected.trailers().cloned(),
                    });
                    let mut response = Response::new(Full::new(Bytes::from_static(b"executed")));
                    *response.status_mut() = http::StatusCode::CREATED;
                    Ok::<_, String>(response)
                }
            });
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let _ = builder.serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
    (url, seen)
}

/// The request's body sent back as an event stream, under the content coding `coding` unless it is
/// `identity`.
fn echo_events(body: Bytes, coding: HeaderValue) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body));
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("text/event-stream"));
    if coding != "identity" {
        headers.insert("content-encoding", coding);
    }
    response
}

struct World {
    _store: TestStore,
    proxy: InProcessProxy,
    seen: Arc<Mutex<Vec<Seen>>>,
    _secrets: tempfile::NamedTempFile,
}

impl World {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A proxy on `backend` with a `required` route at `/pay` and a Stripe-signed webhook route at
/// `/webhooks/stripe`, in front of a recording upstream spoken to over `protocol`.
async fn world(backend: Backend, protocol: &str, extra: &[(&str, toml::Value)]) -> World {
    let (upstream, seen) = recording_upstream().await;
    let store = TestStore::create(backend).await;
    let secrets = signatures::secrets_file(&[STRIPE_SECRET]);
    let routes = format!(
        "[[routes]]\nname = \"pay\"\npath = \"/pay\"\nrequired = true\n{}",
        signatures::stripe_route(secrets.path())
    );
    let mut config = ProxyConfig::on(&store, &upstream)
        .with_toml(&routes)
        .set("upstream.protocol", protocol);
    for (path, value) in extra {
        config = config.set(path, value.clone());
    }
    World {
        proxy: InProcessProxy::start(&config).await,
        _store: store,
        seen,
        _secrets: secrets,
    }
}

/// `Stripe-Signature` for `body` signed with `secret` now, as Stripe writes it.
fn stripe_signature(secret: &str, body: &str) -> String {
    signatures::stripe_signature(secret, signatures::now(), body)
}

/// A raw HTTP/1.1 request with a body of `body`.
fn raw_request(line: &str, headers: &[&str], body: &str) -> Vec<u8> {
    let length = format!("content-length: {}", body.len());
    let mut all: Vec<&str> = headers.to_vec();
    all.push(&length);
    let mut bytes = head(line, "api.example", &all).into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    bytes
}

#[rstest]
#[tokio::test]
async fn every_spelling_of_post_is_post_for_keys_and_replays(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    let world = world(backend, "http1", &[]).await;
    for method in ["post", "Post", "pOST"] {
        let keyless = exchange(
            &world.proxy.url,
            &raw_request(&format!("{method} /pay"), &[], "{}"),
        )
        .await;
        keyless.assert_problem(400, "missing-key");
    }
    assert!(
        world.seen().is_empty(),
        "no keyless spelling of POST reached the upstream"
    );

    let first = exchange(
        &world.proxy.url,
        &raw_request("post /pay", &["idempotency-key: spelled-1"], "{}"),
    )
    .await;
    assert_eq!(first.status, Some(201), "{first:?}");
    let retry = exchange(
        &world.proxy.url,
        &raw_request("POST /pay", &["idempotency-key: spelled-1"], "{}"),
    )
    .await;
    assert_eq!(retry.status, Some(201), "{retry:?}");
    assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{retry:?}");
    let seen = world.seen();
    assert_eq!(seen.len(), 1, "one execution for two spellings of one request");
    assert_eq!(seen[0].method, "POST", "the upstream gets the one spelling");
    assert_eq!(seen[0].headers["idempotency-attempt"], "1", "executed keyed");
}

#[tokio::test]
async fn an_http2_method_in_lower_case_is_refused_a_missing_key_and_trace_and_connect_in_any_case_are_refused()
 {
    let world = world(Backend::Postgres, "http1", &[]).await;
    let mut client = raw_h2::connect(&world.proxy.url).await;
    let request = Request::builder()
        .method(Method::from_bytes(b"post").unwrap())
        .uri(format!("{}/pay", world.proxy.url))
        .header("authorization", TEST_CREDENTIAL)
        .body(())
        .unwrap();
    client = client.ready().await.unwrap();
    let (response, mut body) = client.send_request(request, false).unwrap();
    body.send_data(Bytes::from_static(b"{}"), true).unwrap();
    let reply = raw_h2::reply(response).await.unwrap();
    assert_eq!(reply.status, 400, "{reply:?}");

    for method in ["trace", "Trace", "connect"] {
        let target = if method.eq_ignore_ascii_case("connect") {
            "example.com:443"
        } else {
            "/pay"
        };
        let line = format!("{method} {target}");
        let bytes = head(&line, "api.example", &["idempotency-key: t-1"]);
        let refused = exchange(&world.proxy.url, bytes.as_bytes()).await;
        refused.assert_problem(405, "method-not-allowed");
    }
    assert!(world.seen().is_empty(), "nothing reached the upstream");
}

#[tokio::test]
async fn a_signed_route_verifies_every_method_and_every_spelling_of_its_path() {
    let world = world(Backend::Postgres, "http1", &[]).await;
    let body = r#"{"id":"evt_seams_1"}"#;
    let forged = format!("stripe-signature: {}", stripe_signature("whsec_forged", body));
    let cases = [
        "post /webhooks/stripe",
        "Post /webhooks/stripe",
        "POST /WEBHOOKS/stripe",
        "POST /Webhooks/Stripe/",
        "POST /webhooks/stripe/",
        "PUT /webhooks/stripe",
        "DELETE /webhooks/stripe",
        "OPTIONS /webhooks/stripe",
        "GET /webhooks/stripe",
    ];
    for line in cases {
        let unsigned = exchange(&world.proxy.url, &raw_request(line, &[], body)).await;
        unsigned.assert_problem(401, "signature-invalid");
        let forged = exchange(&world.proxy.url, &raw_request(line, &[&forged], body)).await;
        forged.assert_problem(401, "signature-invalid");
    }
    assert!(
        world.seen().is_empty(),
        "no unverified request reached the handler"
    );

    // Signed, another method goes through unkeyed, and another spelling of the path as the route's.
    let signed = format!("stripe-signature: {}", stripe_signature(STRIPE_SECRET, body));
    let put = exchange(
        &world.proxy.url,
        &raw_request("put /webhooks/stripe", &[&signed], body),
    )
    .await;
    assert_eq!(put.status, Some(201), "{put:?}");
    let post = exchange(
        &world.proxy.url,
        &raw_request("POST /WEBHOOKS/stripe/", &[&signed], body),
    )
    .await;
    assert_eq!(post.status, Some(201), "{post:?}");
    let seen = world.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("PUT", "/webhooks/stripe")
    );
    assert!(
        seen[0].headers.get("idempotency-attempt").is_none(),
        "a PUT is not keyed here"
    );
    assert_eq!(
        (seen[1].method.as_str(), seen[1].path.as_str()),
        ("POST", "/webhooks/stripe")
    );
    assert_eq!(
        seen[1].headers["idempotency-attempt"], "1",
        "a POST is keyed by its event id"
    );
}

#[tokio::test]
async fn the_asterisk_form_is_only_for_options_and_an_absolute_form_target_names_the_host() {
    let world = world(Backend::Postgres, "http1", &[]).await;
    let asterisk = exchange(
        &world.proxy.url,
        &raw_request("POST *", &["idempotency-key: a-1"], "{}"),
    )
    .await;
    asterisk.assert_problem(400, "non-normal-path");
    let options = exchange(&world.proxy.url, head("OPTIONS *", "api.example", &[]).as_bytes()).await;
    assert_eq!(options.status, Some(201), "{options:?}");

    let absolute = exchange(
        &world.proxy.url,
        &raw_request("POST http://other.example/pay", &["idempotency-key: a-2"], "{}"),
    )
    .await;
    assert_eq!(absolute.status, Some(201), "{absolute:?}");
    let seen = world.seen();
    assert_eq!(seen.len(), 2, "the POST * never reached the upstream");
    assert_eq!(seen[0].method, "OPTIONS");
    assert_eq!(seen[1].path, "/pay");
    assert_eq!(
        seen[1].headers["host"], "other.example",
        "the target's authority, not Host"
    );
    assert_eq!(seen[1].headers["x-forwarded-host"], "other.example");
}

#[rstest]
#[tokio::test]
async fn one_credential_in_any_spelling_of_its_scheme_is_one_client(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    let world = world(backend, "http1", &[]).await;
    let send = |authorization: &'static str| {
        let url = world.proxy.url.clone();
        async move {
            let bytes = format!(
                "POST /pay HTTP/1.1\r\nhost: api.example\r\nauthorization: {authorization}\r\n\
                 idempotency-key: cred-1\r\ncontent-length: 2\r\n\r\n{{}}"
            );
            exchange(&url, bytes.as_bytes()).await
        }
    };
    let first = send("Bearer tok-1").await;
    assert_eq!(first.status, Some(201), "{first:?}");
    for spelling in ["bearer tok-1", "BEARER tok-1", "Bearer  tok-1", "bEaReR\ttok-1"] {
        let retry = send(spelling).await;
        assert_eq!(
            retry.header("idempotent-replayed"),
            Some("true"),
            "{spelling:?}: {retry:?}"
        );
    }
    let other = send("Bearer TOK-1").await;
    assert_eq!(other.status, Some(201));
    assert!(
        other.header("idempotent-replayed").is_none(),
        "a token keeps its case: another client"
    );
    assert_eq!(world.seen().len(), 2);
}

type Frames = StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

/// A chunked HTTP/1.1 `POST /pay` with `trailers` after its body, sent by hyper's client.
async fn post_with_trailers(url: &str, key: &str, trailers: &[(&'static str, &'static str)]) -> u16 {
    let authority = url.trim_start_matches("http://");
    let stream = TcpStream::connect(authority).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let mut map = HeaderMap::new();
    for (name, value) in trailers {
        map.append(*name, HeaderValue::from_static(value));
    }
    let declared: Vec<&str> = trailers.iter().map(|(name, _)| *name).collect();
    let body: Frames = StreamBody::new(stream::iter(vec![
        Ok(Frame::data(Bytes::from_static(b"{}"))),
        Ok(Frame::trailers(map)),
    ]));
    let request = Request::post("/pay")
        .header("host", authority)
        .header("authorization", TEST_CREDENTIAL)
        .header("idempotency-key", key)
        .header("te", "trailers")
        .header("trailer", declared.join(", "))
        .body(body)
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    response.status().as_u16()
}

/// Trailers a client may send that no upstream may get from the proxy.
const POISON: [(&str, &str); 10] = [
    ("te", "gzip"),
    ("connection", "close"),
    ("keep-alive", "timeout=1"),
    ("idempotency-key", "smuggled"),
    ("idempotency-attempt", "7;takeover"),
    ("x-forwarded-for", "10.9.9.9"),
    ("host", "evil.example"),
    ("authorization", "Bearer someone-else"),
    ("content-length", "99"),
    ("proxy-authorization", "Basic eA=="),
];

#[rstest]
#[tokio::test]
async fn request_trailers_are_cleaned_and_never_leave_an_upstream_stream_half_sent(
    #[values("http1", "h2c")] protocol: &str,
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    unless_skipped!(backend);
    // An upstream timeout far beyond the bound below: a request left half-sent would wait it out.
    let world = world(backend, protocol, &[("upstream.timeout", "300s".into())]).await;
    for (at, trailer) in POISON.iter().enumerate() {
        let key = format!("trailer-{at}");
        let trailers = [*trailer, ("x-checksum", "sha-1")];
        let sent = post_with_trailers(&world.proxy.url, &key, &trailers);
        let status = tokio::time::timeout(Duration::from_secs(60), sent)
            .await
            .unwrap_or_else(|_| panic!("{protocol}: the request with trailer {trailer:?} got no answer"));
        assert_eq!(status, 201, "{protocol}: trailer {trailer:?}");
    }
    let seen = world.seen();
    assert_eq!(seen.len(), POISON.len(), "each executed once");
    for (at, request) in seen.iter().enumerate() {
        let trailers = request.trailers.clone().unwrap_or_default();
        let names: Vec<&str> = trailers.keys().map(|n| n.as_str()).collect();
        assert_eq!(
            names,
            ["x-checksum"],
            "{protocol}: trailers after {:?}",
            POISON[at]
        );
        assert_eq!(request.headers["idempotency-attempt"], "1");
        assert_eq!(request.headers["authorization"], TEST_CREDENTIAL);
    }
    // The same trailers on a passthrough request (a method the route does not protect).
    let bytes = b"PUT /other HTTP/1.1\r\nhost: api.example\r\ntransfer-encoding: chunked\r\n\
                  trailer: x-checksum, idempotency-key, te\r\n\r\n\
                  2\r\n{}\r\n0\r\nidempotency-key: smuggled\r\nidempotency-attempt: 3\r\nte: gzip\r\n\
                  x-checksum: sha-2\r\n\r\n";
    let passthrough = exchange(&world.proxy.url, bytes).await;
    assert_eq!(passthrough.status, Some(201), "{passthrough:?}");
    let last = world.seen().pop().unwrap();
    let names: Vec<String> = last
        .trailers
        .unwrap_or_default()
        .keys()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(
        names,
        ["x-checksum"],
        "{protocol}: a passthrough's trailers are cleaned too"
    );
}

#[tokio::test]
async fn a_flood_of_trailer_poisoned_requests_leaves_keyed_slots_for_other_clients() {
    let world = world(
        Backend::Postgres,
        "h2c",
        &[
            ("upstream.timeout", "300s".into()),
            ("server.max_keyed_in_flight", 16.into()),
        ],
    )
    .await;
    // More than the slots, each on a connection of its own, held open while the victim tries (a
    // connection closed before the proxy read its request would cancel it).
    let mut flood = Vec::new();
    for at in 0..64 {
        let authority = world.proxy.url.trim_start_matches("http://").to_owned();
        let bytes = format!(
            "POST /pay HTTP/1.1\r\nhost: {authority}\r\nauthorization: {TEST_CREDENTIAL}\r\n\
             idempotency-key: flood-{at}\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\
             te: gzip\r\nconnection: close\r\n\r\n"
        );
        let mut stream = raw::connect(&world.proxy.url).await;
        tokio::io::AsyncWriteExt::write_all(&mut stream, bytes.as_bytes())
            .await
            .unwrap();
        flood.push(stream);
    }
    // Served once the flood's own requests have run (each is answered at once now); a flood that held
    // its slots until upstream.timeout kept answering 503 busy here.
    let victim = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let reply = exchange(
                &world.proxy.url,
                &raw_request("POST /pay", &["idempotency-key: victim-1"], "{}"),
            )
            .await;
            if reply.status != Some(503) {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("another client's keyed request is served within a minute");
    assert_eq!(victim.status, Some(201), "{victim:?}");
    drop(flood);
}

/// A keyed `POST /pay` whose body the upstream sends back as an event stream (`x-echo-events: coding`),
/// resumed after `last` if given: the body.
async fn events(
    url: &str,
    key: &str,
    stream: &str,
    coding: &str,
    last: Option<&str>,
) -> (Option<String>, Vec<u8>) {
    let mut headers = vec![
        format!("idempotency-key: {key}"),
        format!("x-echo-events: {coding}"),
    ];
    if let Some(last) = last {
        headers.push(format!("last-event-id: {last}"));
    }
    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    let reply = exchange(url, &raw_request("POST /pay", &headers, stream)).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    (reply.header("idempotent-replayed").map(str::to_owned), reply.body)
}

#[tokio::test]
async fn a_stored_event_stream_resumes_as_a_browser_tracks_its_last_event_id() {
    let world = world(Backend::Postgres, "http1", &[]).await;
    let url = &world.proxy.url;
    // A leading byte-order mark; an event without an id after event 1 carries id 1 (WHATWG), so a
    // client whose last id is 1 had it.
    let stream = "\u{feff}id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\ndata: d\n\n";
    let (replayed, first) = events(url, "sse-1", stream, "identity", None).await;
    assert_eq!((replayed, first), (None, stream.as_bytes().to_vec()));
    let (replayed, resumed) = events(url, "sse-1", stream, "identity", Some("1")).await;
    assert_eq!(replayed.as_deref(), Some("true"));
    assert_eq!(
        String::from_utf8(resumed).unwrap(),
        "id: 2\ndata: c\n\ndata: d\n\n"
    );
    let (_, after_last) = events(url, "sse-1", stream, "identity", Some("2")).await;
    assert!(after_last.is_empty(), "nothing after the last id");

    // The same bytes under a content coding are not events the proxy can read: replayed whole.
    let (_, coded) = events(url, "sse-2", stream, "gzip", None).await;
    let (replayed, whole) = events(url, "sse-2", stream, "gzip", Some("1")).await;
    assert_eq!(replayed.as_deref(), Some("true"));
    assert_eq!(whole, coded, "a coded stream is replayed whole, never cut");
}

#[tokio::test]
async fn a_connection_header_naming_the_key_or_the_credential_is_refused_before_the_claim() {
    let world = world(Backend::Postgres, "http1", &[]).await;
    for connection in ["connection: Idempotency-Key", "connection: close, authorization"] {
        let refused = exchange(
            &world.proxy.url,
            &raw_request("POST /pay", &["idempotency-key: conn-1", connection], "{}"),
        )
        .await;
        refused.assert_problem(400, "invalid-key");
    }
    // A GET passes through whatever its Connection names: nothing is decided by those headers there.
    let get = exchange(
        &world.proxy.url,
        head("GET /pay", "api.example", &["connection: authorization"]).as_bytes(),
    )
    .await;
    assert_eq!(get.status, Some(201), "{get:?}");
    let keyed = exchange(
        &world.proxy.url,
        &raw_request("POST /pay", &["idempotency-key: conn-1"], "{}"),
    )
    .await;
    assert_eq!(
        keyed.status,
        Some(201),
        "the refused ones claimed nothing: {keyed:?}"
    );
    assert!(keyed.header("idempotent-replayed").is_none());
    let seen = world.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[1].headers["idempotency-key"], "conn-1",
        "the service gets the key it was executed by"
    );
}

#[tokio::test]
async fn another_case_or_trailing_slash_of_a_keyed_route_s_path_is_refused_not_passed_through() {
    let world = world(Backend::Postgres, "http1", &[]).await;
    // Express and ASP.NET route these to the /pay handler: passed through keyless, they ran unkeyed.
    for line in ["POST /PAY", "POST /Pay", "POST /pay/", "post /PAY/"] {
        let refused = exchange(&world.proxy.url, &raw_request(line, &[], "{}")).await;
        refused.assert_problem(400, "non-normal-path");
    }
    assert!(world.seen().is_empty(), "nothing reached the upstream");
    let get = exchange(&world.proxy.url, head("GET /PAY", "api.example", &[]).as_bytes()).await;
    assert_eq!(
        get.status,
        Some(201),
        "a GET is not protected on /pay, in any spelling: {get:?}"
    );
}

/// One gRPC message frame (uncompressed) holding `payload`.
fn grpc_message(payload: &[u8]) -> Bytes {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload);
    Bytes::from(framed)
}

/// An h2c gRPC upstream on 127.0.0.1:0: its first execution streams nine messages, ten milliseconds
/// apart, then `grpc-status: 14` (UNAVAILABLE) in its trailers; each later one answers one message and
/// status 0. Counts its executions.
async fn streaming_grpc_upstream() -> (String, Arc<std::sync::atomic::AtomicU32>) {
    use std::sync::atomic::{AtomicU32, Ordering};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let executions = Arc::new(AtomicU32::new(0));
    let counted = executions.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let counted = counted.clone();
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let execution = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    let _ = request.into_body().collect().await;
                    let (messages, code) = if execution == 1 { (9, "14") } else { (1, "0") };
                    let (sender, receiver) = tokio::sync::mpsc::channel::<Frame<Bytes>>(1);
                    tokio::spawn(async move {
                        for sent in 0..messages {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            let message = grpc_message(format!("m{sent}").as_bytes());
                            let _ = sender.send(Frame::data(message)).await;
                        }
                        let mut trailers = HeaderMap::new();
                        trailers.insert("grpc-status", HeaderValue::from_static(code));
                        let _ = sender.send(Frame::trailers(trailers)).await;
                    });
                    let frames = stream::unfold(receiver, |mut receiver| async move {
                        let frame = receiver.recv().await?;
                        Some((Ok::<_, Infallible>(frame), receiver))
                    });
                    let response = Response::builder()
                        .header("content-type", "application/grpc")
                        .body(StreamBody::new(Box::pin(frames)))
                        .unwrap();
                    Ok::<_, Infallible>(response)
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    (url, executions)
}

/// A keyed gRPC call `/payments.Payments/Refund` with `key`, as its head and one message.
fn grpc_call(base: &str, key: &str) -> Request<()> {
    Request::post(format!("{base}/payments.Payments/Refund"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", TEST_CREDENTIAL)
        .header("idempotency-key", key)
        .body(())
        .unwrap()
}

#[tokio::test]
async fn a_waiter_is_woken_by_a_release_read_in_the_trailers_however_slowly_the_original_client_reads() {
    let (upstream, executions) = streaming_grpc_upstream().await;
    let store = TestStore::create(Backend::Postgres).await;
    let config = ProxyConfig::on(&store, &upstream)
        .set("upstream.protocol", "h2c")
        .set("idempotency.on_in_flight", "wait")
        .set("idempotency.wait_timeout", "20s")
        .set("server.write_timeout", "60s");
    let proxy = InProcessProxy::start(&config).await;
    // The original's client grants its stream no window: the end of its answer waits on it.
    let mut stalled = raw_h2::connect_without_window(&proxy.url).await;
    let (_original, mut body) = stalled
        .send_request(grpc_call(&proxy.url, "stalled-release"), false)
        .expect("send the original's head");
    body.send_data(grpc_message(b"refund"), true)
        .expect("send its message");
    // The duplicate waits (the route waits) until the key is released, then executes.
    let started = async {
        while executions.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), started)
        .await
        .expect("the original reaches the upstream");
    let mut client = raw_h2::connect(&proxy.url).await;
    let (duplicate, mut body) = client
        .send_request(grpc_call(&proxy.url, "stalled-release"), false)
        .expect("send the duplicate's head");
    body.send_data(grpc_message(b"refund"), true)
        .expect("send its message");
    let answer = raw_h2::reply(duplicate).await.expect("the duplicate's answer");
    assert_eq!(answer.status, 200);
    assert!(
        answer.headers.get("grpc-status").is_none(),
        "the duplicate executed, not refused (ABORTED at its wait_timeout): {:?}",
        answer.headers
    );
    assert_eq!(
        executions.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the release woke the waiter, which executed the call again"
    );
    drop(stalled);
}

#[tokio::test]
async fn a_keyed_grpc_web_call_goes_upstream_with_the_proxys_deadline_not_its_own() {
    let world = world(Backend::Postgres, "http1", &[("upstream.timeout", "45s".into())]).await;
    let reply = exchange(
        &world.proxy.url,
        &raw_request(
            "POST /pay",
            &[
                "idempotency-key: grpc-web-1",
                "content-type: application/grpc-web+proto",
                "grpc-timeout: 100m",
            ],
            "{}",
        ),
    )
    .await;
    assert_eq!(reply.status, Some(201), "{reply:?}");
    let seen = world.seen();
    assert_eq!(
        seen[0].headers["grpc-timeout"], "45000m",
        "the execution of a key runs under upstream.timeout, whoever gives up first"
    );
}
