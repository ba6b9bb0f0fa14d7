//! The proxy listener on a unix socket (keyed requests and replays, the socket file's mode from its first
//! moment, a stale file cleared, a live one left alone, the file removed at shutdown, a client's own
//! `X-Forwarded-For` not taken as given), and its TLS certificate reloaded from changed files without a
//! restart.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idemproxy::server::ProxySocket;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

use crate::support::certs::{TestCa, toml_path, write_atomically};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::{InProcessProxy, TestEnv, metric_reaches};

/// One HTTP/1.1 exchange on `stream`; status, headers and body.
async fn exchange<S>(stream: S, request: http::Request<Full<Bytes>>) -> (u16, http::HeaderMap, Bytes)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(connection);
    let response = sender.send_request(request).await.expect("a response");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("the body").to_bytes();
    (parts.status.as_u16(), parts.headers, body)
}

fn keyed_post(key: &str) -> http::Request<Full<Bytes>> {
    http::Request::post("/orders")
        .header("host", "orders.internal")
        .header("idempotency-key", key)
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

#[tokio::test]
async fn keyed_requests_run_once_and_replay_on_a_unix_socket_listener() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("proxy.sock");
    let socket = ProxySocket::bind_unix(&path, 0o600).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "server.socket_mode is applied");
    let proxy = InProcessProxy::start_on(&env.config(), socket).await;

    let connect = || async { UnixStream::connect(&path).await.unwrap() };
    let (status, _, first) = exchange(connect().await, keyed_post("unix-listener")).await;
    assert_eq!(status, 201);
    let (status, headers, replayed) = exchange(connect().await, keyed_post("unix-listener")).await;
    assert_eq!(status, 201);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(replayed, first);
    assert_eq!(env.upstream.executions_for_key("unix-listener"), 1);
    let seen = &env.upstream.requests()[0];
    assert_eq!(seen.headers["host"], "orders.internal");
    assert!(
        seen.headers.get("x-forwarded-for").is_none(),
        "a unix socket client has no address to forward"
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "still, after serving");

    proxy.stop().await.unwrap();
    assert!(!path.exists(), "the socket file is removed at shutdown");
}

#[rstest::rstest]
#[tokio::test]
async fn a_unix_client_s_forwarded_for_is_removed_unless_trusted(#[values(false, true)] trusted: bool) {
    let env = TestEnv::on(crate::support::Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("proxy.sock");
    let socket = ProxySocket::bind_unix(&path, 0o600).unwrap();
    let config = env.config().set("server.trust_unix_forwarded_for", trusted);
    let _proxy = InProcessProxy::start_on(&config, socket).await;

    let forged = |mut request: http::Request<Full<Bytes>>| {
        let headers = request.headers_mut();
        headers.insert("x-forwarded-for", "203.0.113.9".parse().unwrap());
        headers.insert("x-forwarded-host", "forged.example".parse().unwrap());
        request
    };
    let connect = || async { UnixStream::connect(&path).await.unwrap() };
    let (status, _, _) = exchange(connect().await, forged(keyed_post("xff"))).await;
    assert_eq!(status, 201);
    let (status, _, _) = exchange(connect().await, forged(get("/plain"))).await;
    assert_eq!(status, 201);
    let seen = env.upstream.requests();
    assert_eq!(seen.len(), 2);
    for request in &seen {
        let chain = request.headers.get("x-forwarded-for");
        if trusted {
            assert_eq!(chain.unwrap(), "203.0.113.9", "{request:?}");
        } else {
            assert!(
                chain.is_none(),
                "a unix client's chain passed as given: {request:?}"
            );
        }
        assert_eq!(request.headers["x-forwarded-host"], request.headers["host"]);
    }
}

#[tokio::test]
async fn the_socket_file_never_has_a_wider_mode_than_socket_mode() {
    // A watcher stats the path as fast as it can while the socket is bound: the first mode it sees is
    // the one the file was created with. Bound then chmod-ed, the file would first have the process's
    // default (0777 less the umask) for a moment; many binds make that moment hard to miss.
    let dir = tempfile::tempdir().unwrap();
    for round in 0..200 {
        let path = dir.path().join(format!("p{round}.sock"));
        let watched = path.clone();
        let (started, watching) = std::sync::mpsc::channel();
        let watcher = std::thread::spawn(move || {
            started.send(()).unwrap();
            let give_up = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while std::time::Instant::now() < give_up {
                if let Ok(meta) = std::fs::symlink_metadata(&watched) {
                    return Some(meta.permissions().mode() & 0o777);
                }
            }
            None
        });
        watching.recv().unwrap();
        let socket = ProxySocket::bind_unix(&path, 0o600).unwrap();
        let first = watcher.join().unwrap().expect("the socket file appears");
        assert_eq!(
            first, 0o600,
            "round {round}: the socket file was first seen as {first:o}"
        );
        drop(socket);
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "nothing is left beside the sockets: {left:?}");
}

#[tokio::test]
async fn a_stale_socket_file_is_replaced_but_a_live_socket_or_another_file_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("proxy.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
    assert!(
        path.exists(),
        "a socket file left behind by a process that is gone"
    );

    let live = ProxySocket::bind_unix(&path, 0o660).expect("the stale file is replaced");
    let refused = ProxySocket::bind_unix(&path, 0o660)
        .err()
        .expect("a live socket is refused");
    assert_eq!(refused.kind(), std::io::ErrorKind::AddrInUse);
    assert!(refused.to_string().contains(path.to_str().unwrap()), "{refused}");
    drop(live);
    assert!(!path.exists(), "the listener removes its file when it closes");

    std::fs::write(&path, "not a socket").unwrap();
    let refused = ProxySocket::bind_unix(&path, 0o660)
        .err()
        .expect("a regular file is refused");
    assert_eq!(refused.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a socket");
}

/// A TLS connection to the proxy at `url` trusting `ca`, and the certificate the proxy presented.
async fn connect_tls(
    url: &str,
    ca: &TestCa,
) -> (
    tokio_rustls::client::TlsStream<TcpStream>,
    CertificateDer<'static>,
) {
    let addr = url.strip_prefix("http://").unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let stream = tokio_rustls::TlsConnector::from(ca.client_config())
        .connect(name, tcp)
        .await
        .expect("TLS handshake with the proxy");
    let presented = stream.get_ref().1.peer_certificates().unwrap()[0].clone();
    (stream, presented)
}

fn get(path: &str) -> http::Request<Full<Bytes>> {
    http::Request::get(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

#[tokio::test]
async fn a_replaced_listener_certificate_serves_new_connections_without_a_restart() {
    let env = TestEnv::new().await;
    let ca = TestCa::new("listener CA");
    let (a, b) = (
        ca.issue("cert A", &["localhost"]),
        ca.issue("cert B", &["localhost"]),
    );
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = a.write(dir.path(), "listener");
    let mut tls = toml::Table::new();
    tls.insert("cert_file".into(), toml_path(&cert).into());
    tls.insert("key_file".into(), toml_path(&key).into());
    tls.insert("reload_interval".into(), "50ms".into());
    let proxy = InProcessProxy::start(&env.config().set("server.tls", tls)).await;

    let (before, presented) = connect_tls(&proxy.url, &ca).await;
    assert_eq!(presented, a.der(), "cert A at first");
    b.write(dir.path(), "listener");
    let ok = [("result", "ok")];
    metric_reaches(&proxy.admin_url, "idemproxy_tls_reloads_total", &ok, 1.0).await;
    let (_, presented) = connect_tls(&proxy.url, &ca).await;
    assert_eq!(presented, b.der(), "cert B on a new connection");
    let (status, _, _) = exchange(before, get("/anything")).await;
    assert_eq!(status, 201, "the connection made under cert A still serves");

    write_atomically(Path::new(&cert), "not a certificate\n");
    let error = [("result", "error")];
    metric_reaches(&proxy.admin_url, "idemproxy_tls_reloads_total", &error, 1.0).await;
    let (_, presented) = connect_tls(&proxy.url, &ca).await;
    assert_eq!(presented, b.der(), "a broken replacement keeps cert B in service");
}
