//! The store over TLS (`sslmode=require`): the server's certificate and name are verified, and keyed
//! requests work over the encrypted connection; `verify-full` verifies the name too, `verify-ca` only the
//! chain. Needs the server under test to have TLS on and a certificate for `localhost` (Debian's default
//! cluster does, and so does the server the tests start themselves); otherwise these tests say so and
//! stop, or fail where `CI` is set.

use crate::support::{InProcessProxy, Reply, TestEnv, keyed_post, settled};

/// The server's certificate as PEM, when TLS is on; read through SQL so no path is assumed.
async fn server_certificate(env: &TestEnv) -> Option<String> {
    let client = env.db().client().await;
    let ssl: String = client.query_one("SHOW ssl", &[]).await.unwrap().get(0);
    if ssl != "on" {
        crate::support::tools::skip(
            "the PostgreSQL server under test has ssl = off",
            "turn ssl on, or let the tests start their own server with IDEMPROXY_TEST_PG=own",
        );
        return None;
    }
    let row = client
        .query_one("SELECT pg_read_file(current_setting('ssl_cert_file'))", &[])
        .await
        .expect("read the server certificate (needs a superuser test role)");
    Some(row.get(0))
}

fn tls_url(env: &TestEnv, host: &str) -> String {
    tls_url_with(env, host, "require")
}

fn tls_url_with(env: &TestEnv, host: &str, mode: &str) -> String {
    let mut url = url::Url::parse(&env.db().url()).unwrap();
    url.set_host(Some(host)).unwrap();
    url.set_query(Some(&format!("sslmode={mode}")));
    url.to_string()
}

/// Starts the in-process proxy on `config`, or returns why it did not start.
async fn start(config: &crate::support::ProxyConfig) -> Result<(), String> {
    let listeners = idemproxy::Listeners {
        proxy: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().into(),
        admin: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let config = idemproxy::Config::from_toml_str(&config.to_toml()).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let run = idemproxy::run(config, listeners, shutdown.clone());
    match tokio::time::timeout(std::time::Duration::from_secs(3), run).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Ok(()),
    }
}

#[tokio::test]
async fn verify_full_checks_the_host_name_and_verify_ca_only_the_chain() {
    let env = TestEnv::new().await;
    let Some(certificate) = server_certificate(&env).await else {
        return;
    };
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), certificate).unwrap();
    let ca = ca.path().to_str().unwrap();
    // The certificate names localhost, not 127.0.0.1.
    let chain_only = env
        .config()
        .set("store.url", tls_url_with(&env, "127.0.0.1", "verify-ca"))
        .set("store.tls_ca_file", ca);
    let proxy = InProcessProxy::start(&chain_only).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "verify-ca", "{}")).await;
    assert_eq!(first.status, 201, "verify-ca trusts the chain: {}", first.text());

    let full = env
        .config()
        .set("store.url", tls_url_with(&env, "127.0.0.1", "verify-full"))
        .set("store.tls_ca_file", ca);
    let error = start(&full).await.expect_err("verify-full refuses another name");
    assert!(error.contains("certificate not valid for name"), "{error}");

    let by_name = env
        .config()
        .set("store.url", tls_url_with(&env, "localhost", "verify-full"))
        .set("store.tls_ca_file", ca);
    let proxy = InProcessProxy::start(&by_name).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "verify-full", "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
}

#[tokio::test]
async fn store_over_tls_serves_keyed_requests_on_encrypted_connections() {
    let env = TestEnv::new().await;
    let Some(certificate) = server_certificate(&env).await else {
        return;
    };
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), certificate).unwrap();
    let config = env
        .config()
        .set("store.url", tls_url(&env, "localhost"))
        .set("store.tls_ca_file", ca.path().to_str().unwrap());
    let proxy = InProcessProxy::start(&config).await;

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "tls", "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "tls", "{}")).await;
    assert!(replay.is_replay());

    let observer = env.db().client().await;
    let row = observer
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a
             JOIN pg_stat_ssl s USING (pid)
             WHERE a.datname = current_database() AND a.application_name = 'idemproxy'",
            &[],
        )
        .await
        .unwrap();
    let (connections, encrypted): (i64, i64) = (row.get(0), row.get(1));
    assert!(connections > 0, "the proxy holds pooled store connections");
    assert_eq!(encrypted, connections, "every store connection is encrypted");
}

#[tokio::test]
async fn store_certificate_for_another_name_is_refused() {
    let env = TestEnv::new().await;
    let Some(certificate) = server_certificate(&env).await else {
        return;
    };
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), certificate).unwrap();
    // The certificate, trusted, names localhost, not 127.0.0.1: the connection must not be trusted.
    let config = env
        .config()
        .set("store.url", tls_url(&env, "127.0.0.1"))
        .set("store.tls_ca_file", ca.path().to_str().unwrap());
    let error = start(&config)
        .await
        .expect_err("start-up must fail on an untrusted store certificate");
    assert!(error.contains("certificate not valid for name"), "{error}");
}

/// `verify-ca` checks no name, so a certificate any of the system's CAs signed (a public CA signs one for
/// anyone's own name) must not pass: only the CAs of `store.tls_ca_file` vouch for the server, as in
/// libpq. Here the server's own certificate stands for the public CA among the system's, and
/// `store.tls_ca_file` holds the operator's own, unrelated CA.
#[tokio::test]
async fn verify_ca_trusts_only_store_tls_ca_file_never_the_systems_cas() {
    let env = TestEnv::new().await;
    let Some(certificate) = server_certificate(&env).await else {
        return;
    };
    let system = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(system.path(), certificate).unwrap();
    let no_dir = tempfile::tempdir().unwrap();
    let own_ca = rcgen::generate_simple_self_signed(vec!["db.internal".into()]).unwrap();
    let own = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(own.path(), own_ca.cert.pem()).unwrap();
    let file = crate::support::cli::config_file(&format!("[store]\ntls_ca_file = {:?}\n", own.path()));
    let file = file.path().to_str().unwrap();
    let system_cas = [
        ("SSL_CERT_FILE", system.path().to_str().unwrap()),
        ("SSL_CERT_DIR", no_dir.path().to_str().unwrap()),
    ];
    let migrate = |host: &str, mode: &str| {
        let url = tls_url_with(&env, host, mode);
        async move {
            crate::support::cli::idemproxy(&["migrate", "--store", &url, "--config", file], &system_cas).await
        }
    };
    let output = migrate("localhost", "verify-full").await;
    assert_eq!(
        output.status.code(),
        Some(0),
        "verify-full trusts the system's CAs: {}",
        crate::support::cli::stderr(&output)
    );
    let output = migrate("127.0.0.1", "verify-ca").await;
    assert_ne!(
        output.status.code(),
        Some(0),
        "verify-ca connected on a certificate of a system CA, not of store.tls_ca_file: {}",
        crate::support::cli::stderr(&output)
    );
}
