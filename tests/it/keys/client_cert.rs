//! Keys scoped by who the client is by its TLS client certificate (`scope_client_cert`, with
//! `server.tls.client_ca`), as clients that present certificates see it: a certificate renewed on the
//! same key is the same client (its retry is replayed), another key another client (the same key runs
//! again for it), and a keyed request without a certificate names no client (400 `missing-scope`).

use crate::support::certs::{Leaf, TestCa, toml_path};
use crate::support::cli::{config_file, json, keys_with};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::{InProcessProxy, ProxyConfig, Reply, TestEnv};

/// A TLS proxy for `localhost` taking client certificates from `clients`, on a route that scopes keys by
/// them alone; its files live in `dir`.
async fn start(clients: &TestCa, dir: &tempfile::TempDir) -> (TestEnv, InProcessProxy, TestCa) {
    let (env, config, server_ca) = configure(clients, dir).await;
    let proxy = InProcessProxy::start(&config).await;
    (env, proxy, server_ca)
}

/// [`start`]'s configuration, not started.
async fn configure(clients: &TestCa, dir: &tempfile::TempDir) -> (TestEnv, ProxyConfig, TestCa) {
    let server_ca = TestCa::new("server-ca");
    let (cert, key) = server_ca
        .issue("localhost", &["localhost"])
        .write(dir.path(), "server");
    let client_ca = dir.path().join("clients.pem");
    std::fs::write(&client_ca, clients.pem()).unwrap();
    let toml = format!(
        r#"
[server.tls]
cert_file = "{}"
key_file = "{}"
client_ca = "{}"

[[routes]]
name = "mtls"
path = "/transfers"
required = true
scope_headers = []
scope_client_cert = true
"#,
        toml_path(&cert),
        toml_path(&key),
        toml_path(&client_ca)
    );
    let env = TestEnv::new().await;
    let config = env.config().with_toml(&toml);
    (env, config, server_ca)
}

/// `POST /transfers` with `key` over TLS, presenting `client` (if any).
async fn transfer(proxy: &InProcessProxy, server_ca: &TestCa, client: Option<&Leaf>, key: &str) -> Reply {
    try_transfer(proxy, server_ca, client, key)
        .await
        .expect("send the request and read the answer")
}

/// [`transfer`], or the error that ended it (a handshake the proxy refused).
async fn try_transfer(
    proxy: &InProcessProxy,
    server_ca: &TestCa,
    client: Option<&Leaf>,
    key: &str,
) -> Result<Reply, reqwest::Error> {
    let port = proxy.url.rsplit(':').next().unwrap();
    let trusted = reqwest::Certificate::from_pem(server_ca.pem().as_bytes()).unwrap();
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(trusted);
    if let Some(client) = client {
        let identity = format!("{}{}", client.cert_pem, client.key_pem);
        builder = builder.identity(reqwest::Identity::from_pem(identity.as_bytes()).unwrap());
    }
    let request = builder
        .build()
        .unwrap()
        .post(format!("https://localhost:{port}/transfers"))
        .header("idempotency-key", key)
        .header("authorization", TEST_CREDENTIAL)
        .body(r#"{"amount":100}"#);
    Reply::try_of(request).await
}

#[tokio::test]
async fn a_certificate_renewed_on_its_key_keeps_its_scope_and_another_key_is_another_client() {
    let clients = TestCa::new("clients");
    let dir = tempfile::tempdir().unwrap();
    let (env, proxy, server_ca) = start(&clients, &dir).await;
    let first = clients.issue("acme-payments", &[]);
    let renewed = clients.issue_on_key("acme-payments (renewed)", &first.key_pem);
    let other = clients.issue("globex", &[]);

    let original = transfer(&proxy, &server_ca, Some(&first), "transfer-1").await;
    assert_eq!(original.status, 201, "{}", original.text());
    let retry = transfer(&proxy, &server_ca, Some(&renewed), "transfer-1").await;
    assert!(
        retry.is_replay(),
        "the renewed certificate names the same client: {:?}",
        retry.headers
    );
    assert_eq!(retry.body, original.body);
    assert_eq!(env.upstream.executions(), 1);

    let elsewhere = transfer(&proxy, &server_ca, Some(&other), "transfer-1").await;
    assert_eq!(elsewhere.status, 201, "{}", elsewhere.text());
    assert!(
        !elsewhere.is_replay(),
        "another key is another client, with keys of its own"
    );
    assert_eq!(env.upstream.executions(), 2);

    let anonymous = transfer(&proxy, &server_ca, None, "transfer-1").await;
    anonymous.assert_problem(400, "missing-scope");
    assert_eq!(env.upstream.executions(), 2);

    // A certificate on the client's very key, but from an authority the proxy does not take: no
    // handshake, so its key names no one and nothing of the client's is replayed to it.
    let forger = TestCa::new("forger");
    let forged = forger.issue_on_key("acme-payments", &first.key_pem);
    let refused = try_transfer(&proxy, &server_ca, Some(&forged), "transfer-1").await;
    assert!(
        refused.is_err(),
        "a certificate from another authority is refused: {refused:?}"
    );
    assert_eq!(env.upstream.executions(), 2);
}

/// The on-call command finds a client's record by the certificate the client presents, as the proxy
/// scopes it: a renewed certificate finds the record its first one made; another key finds its own.
#[tokio::test]
async fn keys_show_finds_the_record_by_the_clients_certificate() {
    let clients = TestCa::new("clients");
    let dir = tempfile::tempdir().unwrap();
    let (env, config, server_ca) = configure(&clients, &dir).await;
    let proxy = InProcessProxy::start(&config).await;
    let first = clients.issue("acme-payments", &[]);
    let renewed = clients.issue_on_key("acme-payments (renewed)", &first.key_pem);
    let other = clients.issue("globex", &[]);
    assert_eq!(
        transfer(&proxy, &server_ca, Some(&first), "transfer-1")
            .await
            .status,
        201
    );
    assert_eq!(
        transfer(&proxy, &server_ca, Some(&other), "transfer-1")
            .await
            .status,
        201
    );

    let file = config_file(&config.to_toml());
    let at = ["--config", file.path().to_str().unwrap()];
    let show = |leaf: &crate::support::certs::Leaf, name: &str| {
        let pem = dir.path().join(format!("{name}.pem"));
        std::fs::write(&pem, &leaf.cert_pem).unwrap();
        let store = &env.store;
        async move {
            let pem = pem.to_str().unwrap().to_owned();
            let args = [
                "show",
                "transfer-1",
                "--route",
                "mtls",
                "--client-cert",
                &pem,
                "--json",
            ];
            json(&keys_with(store, &at, &args).await)
        }
    };
    let by_renewed = show(&renewed, "renewed").await;
    assert_eq!(by_renewed.as_array().map(Vec::len), Some(1), "{by_renewed}");
    assert_eq!(by_renewed[0]["status"], "completed");
    let by_first = show(&first, "first").await;
    assert_eq!(
        by_first[0]["scope"], by_renewed[0]["scope"],
        "one key, one client"
    );
    let by_other = show(&other, "other").await;
    assert_eq!(by_other.as_array().map(Vec::len), Some(1), "{by_other}");
    assert_ne!(by_other[0]["scope"], by_first[0]["scope"]);
}
