//! The listener speaks HTTP/2 as well as HTTP/1.1: h2c with prior knowledge reaches the same lifecycle.

use rstest::rstest;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::Backend;
use crate::support::TestEnv;
use crate::support::http::TEST_CREDENTIAL;

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
