//! The upstream over TLS and over a unix socket: keyed requests execute once and replay, the upstream's
//! certificate is verified against `upstream.tls.ca_file`, a client certificate is presented for mutual
//! TLS, and every way of failing to connect is a 502 that names its cause. Idle upstream connections are
//! closed by the proxy after `upstream.idle_timeout`, before the upstream's own keep-alive timeout could
//! close one under a request.

use crate::support::certs::{TestCa, toml_path};
use crate::support::cli::{config_file, idemproxy};
use crate::support::{
    InProcessProxy, ProxyConfig, ProxyProcess, Reply, TestEnv, Upstream, keyed_post, poll_until,
};

/// An https stub whose certificate `ca` issued for 127.0.0.1; with `client_ca`, it requires a client
/// certificate that CA issued.
async fn https_upstream(ca: &TestCa, client_ca: Option<&TestCa>) -> Upstream {
    let leaf = ca.issue("upstream", &["127.0.0.1"]);
    Upstream::start_tls(leaf.server_config(client_ca)).await
}

fn tls_table(entries: &[(&str, String)]) -> toml::Value {
    let table: toml::Table = entries
        .iter()
        .map(|(key, value)| (key.to_string(), toml::Value::String(value.clone())))
        .collect();
    toml::Value::Table(table)
}

/// `env`'s store and `upstream`, with `[upstream.tls]` set to `tls`.
fn config(env: &TestEnv, upstream: &Upstream, tls: &[(&str, String)]) -> ProxyConfig {
    let config = ProxyConfig::new(&env.store.url(), &upstream.url());
    if tls.is_empty() {
        return config;
    }
    config.set("upstream.tls", tls_table(tls))
}

/// Asserts a keyed request executes once and its retry is replayed; returns what the upstream saw.
async fn executes_once_and_replays(proxy: &InProcessProxy, upstream: &Upstream, key: &str) {
    let first = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert!(replay.is_replay(), "{:?}", replay.headers);
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.executions_for_key(key), 1);
    let host = proxy.url.strip_prefix("http://").unwrap();
    assert_eq!(
        upstream.requests()[0].headers["host"],
        host,
        "the client's Host goes upstream"
    );
}

/// With `auto`, ALPN offers `h2` too; this upstream speaks only HTTP/1.1, so that is what is spoken.
#[rstest::rstest]
#[tokio::test]
async fn keyed_requests_run_once_and_replay_through_an_https_upstream(
    #[values("http1", "auto")] protocol: &str,
) {
    let env = TestEnv::new().await;
    let ca = TestCa::new("upstream CA");
    let upstream = https_upstream(&ca, None).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let config =
        config(&env, &upstream, &[("ca_file", toml_path(&ca_file))]).set("upstream.protocol", protocol);
    let proxy = InProcessProxy::start(&config).await;
    executes_once_and_replays(&proxy, &upstream, "https-1").await;
}

#[tokio::test]
async fn an_upstream_requiring_a_client_certificate_accepts_ours_and_refuses_none_with_a_502() {
    let env = TestEnv::new().await;
    let ca = TestCa::new("mutual CA");
    let upstream = https_upstream(&ca, Some(&ca)).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).unwrap();
    let (cert, key) = ca
        .issue("idemproxy", &["idemproxy.test"])
        .write(dir.path(), "client");
    let anonymous =
        InProcessProxy::start(&config(&env, &upstream, &[("ca_file", toml_path(&ca_file))])).await;
    let with_cert = config(
        &env,
        &upstream,
        &[
            ("ca_file", toml_path(&ca_file)),
            ("cert_file", toml_path(&cert)),
            ("key_file", toml_path(&key)),
        ],
    );
    let identified = InProcessProxy::start(&with_cert).await;

    let refused = Reply::of(keyed_post(&anonymous.url, "/orders", "mtls-1", "{}")).await;
    refused.assert_problem(502, "upstream-unreachable");
    assert_eq!(upstream.executions(), 0);
    // The refused handshake never delivered the request, so its claim was given back: the same key
    // through the proxy with a certificate executes at once instead of waiting out a lease.
    let accepted = Reply::of(keyed_post(&identified.url, "/orders", "mtls-1", "{}")).await;
    assert_eq!(accepted.status, 201, "{}", accepted.text());
    assert_eq!(upstream.executions_for_key("mtls-1"), 1);
}

#[tokio::test]
async fn an_upstream_certificate_from_another_ca_is_a_502_and_the_log_names_the_cause() {
    let env = TestEnv::new().await;
    let upstream = https_upstream(&TestCa::new("the upstream's CA"), None).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("other-ca.pem");
    std::fs::write(&ca_file, TestCa::new("another CA").pem()).unwrap();
    let proxy = ProxyProcess::spawn(&config(&env, &upstream, &[("ca_file", toml_path(&ca_file))])).await;

    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "wrong-ca", "{}")).await;
    reply.assert_problem(502, "upstream-unreachable");
    assert_eq!(upstream.executions(), 0);
    let cause = "upstream TLS handshake failed: invalid peer certificate: UnknownIssuer";
    poll_until("the log line naming the cause", || async {
        proxy.stderr().contains(cause).then_some(())
    })
    .await;
}

#[tokio::test]
async fn keyed_requests_run_once_and_replay_through_a_unix_socket_upstream() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let upstream = Upstream::start_unix(&dir.path().join("app.sock")).await;
    let proxy = InProcessProxy::start(&config(&env, &upstream, &[])).await;
    executes_once_and_replays(&proxy, &upstream, "unix-1").await;
}

#[tokio::test]
async fn a_unix_socket_upstream_that_does_not_exist_is_a_502() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let missing = format!("unix:{}", dir.path().join("missing.sock").display());
    let config = ProxyConfig::new(&env.store.url(), &missing);
    let proxy = InProcessProxy::start(&config).await;
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "no-socket", "{}")).await;
    reply.assert_problem(502, "upstream-unreachable");
}

#[tokio::test]
async fn an_idle_upstream_connection_is_closed_by_the_proxy_after_the_idle_timeout() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.workers", 1)
        .set("upstream.idle_timeout", "300ms");
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "idle-1", "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(env.upstream.connections(), 1);
    // The stub never closes an idle connection itself (its hyper server has no timer): a close seen here
    // is the proxy's.
    poll_until("the proxy to close its idle upstream connection", || async {
        (env.upstream.open_connections() == 0).then_some(())
    })
    .await;
    let second = Reply::of(keyed_post(&proxy.url, "/orders", "idle-2", "{}")).await;
    let third = Reply::of(keyed_post(&proxy.url, "/orders", "idle-3", "{}")).await;
    assert_eq!((second.status.as_u16(), third.status.as_u16()), (201, 201));
    assert_eq!(
        env.upstream.connections(),
        2,
        "a new connection after the idle time, then reused while it is fresh"
    );
}

#[tokio::test]
async fn a_zero_or_nonsense_idle_timeout_exits_64_naming_the_key() {
    for value in ["\"0s\"", "\"soon\"", "\"2h\"", "-1"] {
        let file = config_file(&format!("[upstream]\nidle_timeout = {value}\n"));
        let path = file.path().to_str().unwrap();
        let output = idemproxy(&["check-config", "--config", path], &[]).await;
        assert_eq!(output.status.code(), Some(64), "{value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim_end().lines().count(), 1, "{value}: {stderr}");
        assert!(stderr.contains("upstream.idle_timeout"), "{value}: {stderr}");
    }
}

/// An HTTP/2-only upstream on 127.0.0.1:0: `/big` answers 3 MiB, anything else `ok`. Its URL.
async fn h2_upstream_with_a_big_answer() -> String {
    use http_body_util::Full;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service =
                hyper::service::service_fn(|request: http::Request<hyper::body::Incoming>| async move {
                    let body = if request.uri().path() == "/big" {
                        bytes::Bytes::from(vec![b'x'; 3 << 20])
                    } else {
                        bytes::Bytes::from_static(b"ok")
                    };
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(body)))
                });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    url
}

#[tokio::test]
async fn over_http2_clients_that_stop_reading_big_answers_do_not_stall_the_others() {
    use crate::support::raw_h2;
    let env = TestEnv::new().await;
    let upstream = h2_upstream_with_a_big_answer().await;
    let config = ProxyConfig::new(&env.store.url(), &upstream)
        .set("upstream.protocol", "h2c")
        .set("server.workers", 1);
    let proxy = InProcessProxy::start(&config).await;

    // Eight clients ask for 3 MiB each and read none of it: what the upstream sends them backs up in
    // the proxy, on the worker's one connection to the upstream.
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut client = raw_h2::connect(&proxy.url).await;
        let request = http::Request::get(format!("{}/big", proxy.url)).body(()).unwrap();
        client = client.ready().await.unwrap();
        let (response, _) = client.send_request(request, true).unwrap();
        let head = response.await.expect("the head of the big answer");
        assert_eq!(head.status(), 200);
        stalled.push((client, head));
    }
    // Another client's small answer still comes, over the same upstream connection.
    let mut client = raw_h2::connect(&proxy.url).await;
    let request = http::Request::get(format!("{}/small", proxy.url))
        .body(())
        .unwrap();
    client = client.ready().await.unwrap();
    let (response, _) = client.send_request(request, true).unwrap();
    let small = tokio::time::timeout(std::time::Duration::from_secs(10), raw_h2::reply(response))
        .await
        .expect("the small answer is not held up by the stalled ones")
        .unwrap();
    assert_eq!(&small.body[..], b"ok");
    drop(stalled);
}

/// An h2c upstream that refuses the first stream of each connection (`REFUSED_STREAM`: not processed,
/// safe to send again) and answers the others `200 paid: <body>`; its URL, and how many it answered.
async fn h2_upstream_refusing_each_first_stream() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>)
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answered = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = answered.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut connection = h2::server::handshake(stream).await.unwrap();
                let mut first = true;
                while let Some(Ok((request, mut respond))) = connection.accept().await {
                    if std::mem::take(&mut first) {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let counter = counter.clone();
                    tokio::spawn(async move {
                        let mut body = request.into_body();
                        let mut read = Vec::new();
                        while let Some(Ok(chunk)) = body.data().await {
                            let _ = body.flow_control().release_capacity(chunk.len());
                            read.extend_from_slice(&chunk);
                        }
                        counter.fetch_add(1, Ordering::SeqCst);
                        let mut sending = respond.send_response(http::Response::new(()), false).unwrap();
                        let answer = format!("paid: {}", String::from_utf8_lossy(&read));
                        sending.send_data(bytes::Bytes::from(answer), true).unwrap();
                    });
                }
            });
        }
    });
    (url, answered)
}

#[tokio::test]
async fn over_http2_a_request_the_upstream_refuses_unprocessed_is_sent_again_when_its_body_was_read_whole() {
    use std::sync::atomic::Ordering;
    let env = TestEnv::new().await;
    let (upstream, answered) = h2_upstream_refusing_each_first_stream().await;
    let config = ProxyConfig::new(&env.store.url(), &upstream)
        .set("upstream.protocol", "h2c")
        .set("server.workers", 1);
    let proxy = InProcessProxy::start(&config).await;

    // A keyed request's body was read whole: refused once, it is sent again, and runs once.
    let first = Reply::of(keyed_post(&proxy.url, "/pay", "refused-once-1", "{\"amount\":5}")).await;
    assert_eq!(
        (first.status.as_u16(), first.text().as_str()),
        (200, "paid: {\"amount\":5}")
    );
    assert_eq!(answered.load(Ordering::SeqCst), 1);
    let retry = Reply::of(keyed_post(&proxy.url, "/pay", "refused-once-1", "{\"amount\":5}")).await;
    assert!(retry.is_replay());
    assert_eq!(answered.load(Ordering::SeqCst), 1, "the retry was the replay");

    // So is a request without a body, on a proxy of its own (whose first stream is refused).
    let fresh = InProcessProxy::start(&config).await;
    let get = Reply::of(crate::support::http::client().get(format!("{}/pay", fresh.url))).await;
    assert_eq!((get.status.as_u16(), get.text().as_str()), (200, "paid: "));
    assert_eq!(answered.load(Ordering::SeqCst), 2);

    // A streamed body is gone once sent: the refusal reaches the client as a 502, nothing having run.
    let fresh = InProcessProxy::start(&config).await;
    let chunks = futures_util::stream::iter([Ok::<_, std::io::Error>("{\"amount\":6}")]);
    let streamed = Reply::of(
        crate::support::http::client()
            .post(format!("{}/pay", fresh.url))
            .body(reqwest::Body::wrap_stream(chunks)),
    )
    .await;
    assert_eq!(streamed.status, 502, "{}", streamed.text());
    assert_eq!(answered.load(Ordering::SeqCst), 2);
}
