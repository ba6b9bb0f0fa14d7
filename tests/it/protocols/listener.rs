//! The listener speaks HTTP/2 as well as HTTP/1.1: h2c with prior knowledge reaches the same lifecycle.
//! A body is whole or not at all: an HTTP/2 body the client abandons (`RST_STREAM` before `END_STREAM`,
//! any code) is neither claimed nor forwarded whole, a length that disagrees with `content-length` is
//! refused, the upstream is told the buffered body's length, and one connection holds at most
//! `server.max_keyed_per_connection` keyed slots, its detached work included.

use rstest::rstest;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::http::TEST_CREDENTIAL;
use crate::support::raw_h2::{self, abandon, open_post};
use crate::support::{
    Backend, InProcessProxy, Reply, TestEnv, keyed_post, metric, metric_reaches, poll_until,
};

#[rstest]
#[tokio::test]
async fn h2c_prior_knowledge_executes_then_replays(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let send = || async {
        let request = Request::post(format!("{}/orders", proxy.url))
            .header("idempotency-key", "h2-key")
            .header("authorization", TEST_CREDENTIAL)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"n\":1}")))
            .unwrap();
        let response = client.request(request).await.expect("h2c request");
        assert_eq!(response.version(), http::Version::HTTP_2);
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, replayed, body)
    };
    let (status, replayed, first) = send().await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed);
    let replay = crate::support::poll_until("the completion to be stored", || async {
        let (status, replayed, body) = send().await;
        (status != StatusCode::CONFLICT).then_some((status, replayed, body))
    })
    .await;
    assert_eq!(replay, (StatusCode::CREATED, true, first));
    assert_eq!(env.upstream.executions_for_key("h2-key"), 1);
}

/// A proxy listening with TLS on a fresh self-signed certificate for `localhost`, and a client trusting it.
struct TlsProxy {
    env: TestEnv,
    proxy: crate::support::InProcessProxy,
    url: String,
    certificate: reqwest::Certificate,
    _files: (tempfile::NamedTempFile, tempfile::NamedTempFile),
}

impl TlsProxy {
    async fn start() -> TlsProxy {
        let env = TestEnv::new().await;
        let issued = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert_pem = issued.cert.pem();
        let cert = tempfile::NamedTempFile::new().unwrap();
        let key = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(cert.path(), &cert_pem).unwrap();
        std::fs::write(key.path(), issued.signing_key.serialize_pem()).unwrap();
        let mut files = toml::Table::new();
        files.insert("cert_file".into(), cert.path().to_str().unwrap().into());
        files.insert("key_file".into(), key.path().to_str().unwrap().into());
        let config = env.config().set("server.tls", files);
        let proxy = crate::support::InProcessProxy::start(&config).await;
        let port = proxy.url.rsplit(':').next().unwrap().to_owned();
        TlsProxy {
            env,
            proxy,
            url: format!("https://localhost:{port}"),
            certificate: reqwest::Certificate::from_pem(cert_pem.as_bytes()).unwrap(),
            _files: (cert, key),
        }
    }

    fn client(&self, http1_only: bool) -> reqwest::Client {
        let builder = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .add_root_certificate(self.certificate.clone());
        let builder = if http1_only { builder.http1_only() } else { builder };
        builder.build().unwrap()
    }
}

#[tokio::test]
async fn tls_listener_negotiates_h2_and_http1_by_alpn() {
    let tls = TlsProxy::start().await;
    for (http1_only, version) in [
        (false, reqwest::Version::HTTP_2),
        (true, reqwest::Version::HTTP_11),
    ] {
        let response = tls
            .client(http1_only)
            .post(format!("{}/orders", tls.url))
            .header("idempotency-key", format!("tls-{http1_only}"))
            .header("authorization", TEST_CREDENTIAL)
            .body("{}")
            .send()
            .await
            .expect("TLS request");
        assert_eq!(response.version(), version);
        assert_eq!(response.status(), 201);
    }
    let seen = tls.env.upstream.requests();
    assert_eq!(seen.len(), 2);
    for request in seen {
        assert_eq!(request.headers["x-forwarded-proto"], "https");
    }
    assert!(tls.proxy.url.starts_with("http://127.0.0.1:"));
}

#[tokio::test]
async fn tls_listener_refuses_cleartext_and_untrusted_clients() {
    let tls = TlsProxy::start().await;
    let cleartext = crate::support::http::client()
        .get(tls.url.replace("https://", "http://"))
        .send()
        .await;
    assert!(
        cleartext.is_err(),
        "cleartext HTTP on the TLS listener must not be served"
    );
    let stranger = reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .build()
        .unwrap()
        .get(&tls.url)
        .send()
        .await;
    assert!(
        stranger.is_err(),
        "a client that does not trust the certificate must not get through"
    );
    assert_eq!(tls.env.upstream.executions(), 0);
}

/// The `content-length` an abandoning client declares for its 10-byte body, if any.
fn declared(with_length: bool) -> &'static [(&'static str, &'static str)] {
    if with_length {
        &[("content-length", "10")]
    } else {
        &[]
    }
}

/// Waits until no request is being handled by the proxy (the abandoned ones included).
async fn no_request_in_flight(proxy: &InProcessProxy) {
    poll_until("no request in flight", || async {
        let in_flight = metric(&proxy.admin_url, "idemproxy_in_flight_requests", &[]).await;
        (in_flight == 0.0).then_some(())
    })
    .await;
}

#[rstest]
#[tokio::test]
async fn an_abandoned_h2_keyed_body_is_neither_claimed_nor_forwarded(
    #[values(h2::Reason::NO_ERROR, h2::Reason::CANCEL)] reason: h2::Reason,
    #[values(false, true)] with_length: bool,
) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let mut client = raw_h2::connect(&proxy.url).await;
    let (_, body) = open_post(
        &mut client,
        &proxy.url,
        "/orders",
        Some("gone"),
        declared(with_length),
    )
    .await;
    abandon(body, b"{\"n\":", reason);

    // The same key, whole, on the same connection after the reset: nothing holds it, nothing answers
    // for it, so it executes now, once, with its own body.
    let whole = raw_h2::keyed_post(&mut client, &proxy.url, "/orders", "gone", b"{\"n\":1234}")
        .await
        .expect("an answer");
    assert_eq!(whole.status, 201, "{}", whole.text());
    assert!(!whole.is_replay());
    no_request_in_flight(&proxy).await;
    let seen = env.upstream.requests();
    assert_eq!(seen.len(), 1, "the abandoned body reached the upstream: {seen:?}");
    assert_eq!(&seen[0].body[..], b"{\"n\":1234}");
}

#[tokio::test]
async fn dozens_of_abandoned_h2_streams_do_not_lock_other_clients_out() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config().set("server.max_keyed_in_flight", 8);
    let proxy = InProcessProxy::start(&config).await;
    let mut client = raw_h2::connect(&proxy.url).await;
    // Each stream is taken in (its handler reading the body) before it is reset: streams reset before
    // that are the h2 library's to limit (20, then the connection gets GOAWAY).
    let mut open = Vec::new();
    for i in 0..48 {
        let key = format!("abandoned-{i}");
        let (_, mut body) = open_post(&mut client, &proxy.url, "/orders", Some(&key), declared(true)).await;
        body.send_data(Bytes::from_static(b"{\"n\":"), false).unwrap();
        open.push(body);
    }
    metric_reaches(&proxy.admin_url, "idemproxy_in_flight_requests", &[], 48.0).await;
    for mut body in open {
        body.send_reset(h2::Reason::NO_ERROR);
    }
    // On the same connection, after every reset.
    let mine = raw_h2::keyed_post(&mut client, &proxy.url, "/orders", "after", b"{}")
        .await
        .expect("an answer");
    assert_eq!(mine.status, 201, "{}", mine.text());
    for i in 0..8 {
        let other = Reply::of(keyed_post(&proxy.url, "/orders", &format!("other-{i}"), "{}")).await;
        assert_eq!(other.status, 201, "{}", other.text());
    }
    no_request_in_flight(&proxy).await;
    assert_eq!(env.upstream.executions(), 9, "{:?}", env.upstream.requests());
}

#[rstest]
#[tokio::test]
async fn an_h2_body_longer_than_its_content_length_is_refused_and_claims_nothing(
    #[values(Some("long"), None)] key: Option<&str>,
) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let mut client = raw_h2::connect(&proxy.url).await;
    let (response, mut body) = open_post(
        &mut client,
        &proxy.url,
        "/orders",
        key,
        &[("content-length", "5")],
    )
    .await;
    body.send_data(Bytes::from_static(b"0123456789"), true)
        .expect("send 10 bytes");
    // RFC 9113 §8.1.1: a malformed request, reset with PROTOCOL_ERROR as the long frame arrives (a 400
    // cannot follow on a reset stream). Either way, not a success.
    match raw_h2::reply(response).await {
        Ok(reply) => reply.assert_problem(400, "bad-request-body"),
        Err(error) => assert_eq!(error.reason(), Some(h2::Reason::PROTOCOL_ERROR), "{error}"),
    }
    no_request_in_flight(&proxy).await;
    assert_eq!(env.upstream.executions(), 0, "{:?}", env.upstream.requests());
    let whole = raw_h2::keyed_post(&mut client, &proxy.url, "/orders", "long", b"01234")
        .await
        .expect("an answer");
    assert_eq!(whole.status, 201, "{}", whole.text());
    assert_eq!(env.upstream.executions_for_key("long"), 1);
}

#[tokio::test]
async fn the_upstream_is_told_the_buffered_body_s_length() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let mut client = raw_h2::connect(&proxy.url).await;
    // No content-length, the body in two DATA frames.
    let (response, mut body) = open_post(&mut client, &proxy.url, "/orders", Some("len"), &[]).await;
    body.send_data(Bytes::from_static(b"{\"n\":"), false).unwrap();
    body.send_data(Bytes::from_static(b"1}"), true).unwrap();
    assert_eq!(raw_h2::reply(response).await.expect("an answer").status, 201);
    // HTTP/1.1, chunked.
    let host = crate::support::raw::addr_of(&proxy.url);
    let chunked = crate::support::raw::head(
        "POST /orders",
        host,
        &["idempotency-key: chunked", "transfer-encoding: chunked"],
    ) + "3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n";
    let reply = crate::support::raw::exchange(&proxy.url, chunked.as_bytes()).await;
    assert_eq!(reply.status, Some(201), "{reply:?}");
    let seen = env.upstream.requests();
    for (request, length) in seen.iter().zip(["7", "7"]) {
        assert_eq!(request.headers["content-length"], length, "{request:?}");
        assert!(request.headers.get("transfer-encoding").is_none(), "{request:?}");
        assert_eq!(request.body.len(), 7);
    }
}

#[rstest]
#[tokio::test]
async fn an_abandoned_h2_passthrough_body_reaches_the_upstream_only_as_aborted(
    #[values(false, true)] with_length: bool,
) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = env.proxy().await;
    let mut client = raw_h2::connect(&proxy.url).await;
    let (_, mut body) = open_post(&mut client, &proxy.url, "/orders", None, declared(with_length)).await;
    body.send_data(Bytes::from_static(b"{\"n\":"), false).unwrap();
    // A passthrough is forwarded as it arrives: the upstream connection opens with the head.
    poll_until("the proxy to connect upstream", || async {
        (env.upstream.connections() >= 1).then_some(())
    })
    .await;
    body.send_reset(h2::Reason::NO_ERROR);
    // The upstream's connection closes with the request aborted; a request that looked complete would
    // have been executed and left its connection idle in the proxy's pool.
    poll_until(
        "the upstream connection of the aborted request closed",
        || async { (env.upstream.open_connections() == 0).then_some(()) },
    )
    .await;
    assert_eq!(env.upstream.executions(), 0, "{:?}", env.upstream.requests());
}

#[tokio::test]
async fn one_connection_holds_at_most_its_share_of_keyed_slots_even_after_it_hangs_up() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("server.max_keyed_in_flight", 8)
        .set("server.max_keyed_per_connection", 2);
    let proxy = InProcessProxy::start(&config).await;
    let mut client = raw_h2::connect(&proxy.url).await;
    let gate = [("x-gate", "share")];
    let mut held = Vec::new();
    for key in ["share-1", "share-2"] {
        let (response, mut body) = open_post(&mut client, &proxy.url, "/slow", Some(key), &gate).await;
        body.send_data(Bytes::from_static(b"{}"), true).unwrap();
        held.push((response, body));
    }
    env.upstream.wait_until_executions(2).await;

    // The connection's share is taken: its next keyed request is refused, claiming nothing, while
    // another client is served.
    let over = raw_h2::keyed_post(&mut client, &proxy.url, "/orders", "share-3", b"{}")
        .await
        .expect("an answer");
    over.assert_problem(503, "busy");
    let other = Reply::of(keyed_post(&proxy.url, "/orders", "other", "{}")).await;
    assert_eq!(other.status, 201, "{}", other.text());

    // Resetting the held streams detaches their work; it still holds the connection's share.
    for (response, mut body) in held {
        body.send_reset(h2::Reason::CANCEL);
        drop(response);
    }
    no_request_in_flight(&proxy).await;
    let still = raw_h2::keyed_post(&mut client, &proxy.url, "/orders", "share-3", b"{}")
        .await
        .expect("an answer");
    still.assert_problem(503, "busy");

    // Once the detached work ends, the share comes back.
    env.upstream.release("share");
    let after = poll_until("the connection's share to come back", || {
        let mut client = client.clone();
        let url = proxy.url.clone();
        async move {
            let reply = raw_h2::keyed_post(&mut client, &url, "/orders", "share-3", b"{}")
                .await
                .expect("an answer");
            (reply.status != 503).then_some(reply)
        }
    })
    .await;
    assert_eq!(after.status, 201, "{}", after.text());
    assert_eq!(env.upstream.executions_for_key("share-3"), 1);
    assert_eq!(env.upstream.executions(), 4);
}
