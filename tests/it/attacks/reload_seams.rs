//! Reloads where a setting the reload applies meets one that waits for a restart, on the real binary:
//! a `ttl` lengthened under encryption at rest (the life sealed into new records must follow it), routes
//! that outgrow the running buffers or need client certificates the running listener does not take
//! (refused, as a start would refuse them), a risky setting brought by a reload (warned of, as at
//! start), a `scope_jwt` set whose timings change while its issuer fails (its keys kept), and a key's
//! scope rules changed under a key in flight (a hole, now documented: its retry runs again).

use std::time::Duration;

use hyper::StatusCode;

use crate::keys::jwt::JwksServer;
use crate::support::certs::TestCa;
use crate::support::encryption::{K1, encrypted};
use crate::support::http::{client, readyz};
use crate::support::{Backend, ProxyProcess, Reply, TestEnv, keyed_post};

/// `POST /-/reload` on `proxy`'s admin listener: its status and JSON answer.
async fn reload(proxy: &ProxyProcess) -> (u16, serde_json::Value) {
    let answer = client()
        .post(format!("{}/-/reload", proxy.admin_url))
        .send()
        .await
        .expect("the admin listener answers");
    let status = answer.status().as_u16();
    let body = answer.bytes().await.unwrap();
    (status, serde_json::from_slice(&body).expect("a JSON answer"))
}

/// The JSON log lines `proxy` has written at level `level`.
fn logged(proxy: &ProxyProcess, level: &str) -> Vec<serde_json::Value> {
    proxy
        .stderr()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|line| line["level"] == level)
        .collect()
}

#[tokio::test]
async fn a_ttl_lengthened_by_a_reload_lengthens_the_life_sealed_into_new_records() {
    let env = TestEnv::on(Backend::Sqlite).await;
    // A record lives at most 3 s + 1 s lease + 1 s store timeout after its seal, give or take 1 s of
    // clock skew: a sealed response older than that is refused as a row put back from an earlier use.
    let config = encrypted(&env, "k1", &[("k1", K1)])
        .set("encryption.max_clock_skew", "1s")
        .set("idempotency.ttl", "3s")
        .set("idempotency.lock_timeout", "1s");
    let proxy = ProxyProcess::spawn(&config).await;
    std::fs::write(
        proxy.config_file(),
        config.clone().set("idempotency.ttl", "1h").to_toml(),
    )
    .unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["applied"], serde_json::json!(["idempotency.ttl"]));

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "long-lived", "{}")).await;
    assert_eq!(first.status, 201);
    tokio::time::sleep(Duration::from_secs(7)).await;
    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "long-lived", "{}")).await;
    assert_eq!(
        retry.status,
        201,
        "a record the reloaded ttl keeps for an hour replays after the ttl the proxy started with: {}",
        retry.text()
    );
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(env.upstream.executions_for_key("long-lived"), 1);
}

#[tokio::test]
async fn routes_that_outgrow_the_running_buffers_or_need_client_certificates_are_refused_by_a_reload() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("server.max_buffered_responses", "1MiB")
        .set("idempotency.max_stored_response", "1MiB");
    let proxy = ProxyProcess::spawn(&config).await;

    // Both raised in the file: the budget waits for a restart, so the route's larger responses would
    // not be kept (a retry would get 410) while its rules say they are.
    let outgrown = config
        .clone()
        .set("server.max_buffered_responses", "4MiB")
        .set("idempotency.max_stored_response", "2MiB");
    std::fs::write(proxy.config_file(), outgrown.to_toml()).unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 500, "{answer}");
    let error = answer["error"].as_str().unwrap();
    assert!(error.contains("idempotency.max_stored_response"), "{error}");
    assert!(error.contains("restart"), "{error}");

    // A route scoped by client certificate, with the listener's TLS that takes them: that TLS waits
    // for a restart, so every keyed request on the route would be refused 400 until then.
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("clients");
    let leaf = ca.issue("proxy", &["localhost"]);
    let path = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let tls = format!(
        "[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_ca = \"{}\"\n",
        path("cert.pem", &leaf.cert_pem),
        path("key.pem", &leaf.key_pem),
        path("ca.pem", &ca.pem())
    );
    let mtls = config
        .clone()
        .with_toml(&tls)
        .route("name = \"mtls\"\npath_prefix = \"/mtls\"\nscope_client_cert = true");
    std::fs::write(proxy.config_file(), mtls.to_toml()).unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 500, "{answer}");
    let error = answer["error"].as_str().unwrap();
    assert!(error.contains("routes[0].scope_client_cert"), "{error}");

    let order = Reply::of(keyed_post(&proxy.url, "/mtls/orders", "kept", "{}")).await;
    assert_eq!(order.status, 201, "the running routes serve on: {}", order.text());
}

#[tokio::test]
async fn a_reload_that_brings_a_risky_setting_warns_of_it_as_a_start_does() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let proxy = ProxyProcess::spawn(&config).await;
    // The file caught half-written: no upstream.url any more, and fail_open.
    let mut text = config.clone().set("store.on_error", "fail_open").to_toml();
    text = text
        .lines()
        .filter(|line| !line.starts_with("url = \"http"))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(proxy.config_file(), text).unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 200, "{answer}");
    let warned: Vec<String> = logged(&proxy, "WARN")
        .iter()
        .filter_map(|line| line["key"].as_str().map(str::to_owned))
        .collect();
    assert!(
        warned.iter().any(|key| key == "upstream.url"),
        "no warning that the upstream is no longer named: {warned:?}"
    );
    assert!(
        warned.iter().any(|key| key == "store.on_error"),
        "no warning of fail_open: {warned:?}"
    );
}

/// A P-256 key in a JWKS, as an issuer serves it; only whether the set reads matters here.
const JWKS: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"HdIZ7R1B7Pj0ETsap5Biwbzes7Oh19aeVVNdG6Cu5vk","y":"7L1QJOu2za_1eTukQC3wkiotv1FuZ9WR-AGxvFmqB4Y","kid":"reload","use":"sig","alg":"ES256"}]}"#;

/// A route scoped by the bearer token's subject, its keys from `jwks_url`, read every `refresh`.
fn jwt_route(jwks_url: &str, refresh: &str) -> String {
    format!(
        "name = \"pay\"\npath_prefix = \"/pay\"\n\
         scope_jwt = {{ jwks_url = \"{jwks_url}\", audiences = [\"pay\"], refresh = \"{refresh}\" }}"
    )
}

#[tokio::test]
async fn a_key_set_whose_refresh_a_reload_changes_keeps_its_keys_while_its_issuer_fails() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let issuer = JwksServer::start(JWKS).await;
    let config = env.config().route(&jwt_route(&issuer.url, "5m"));
    let proxy = ProxyProcess::spawn(&config).await;
    crate::support::poll_until("the key set read", || async {
        (readyz(&proxy.admin_url).await.status == 200).then_some(())
    })
    .await;

    issuer.serve(StatusCode::INTERNAL_SERVER_ERROR, "down");
    let changed = env.config().route(&jwt_route(&issuer.url, "10m"));
    std::fs::write(proxy.config_file(), changed.to_toml()).unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 200, "{answer}");
    for _ in 0..3 {
        let ready = readyz(&proxy.admin_url).await;
        assert_eq!(
            ready.status,
            200,
            "the keys read before the reload are still good: {}",
            ready.text()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
#[ignore = "hole: a reload that changes a route's scope rules (scope_headers, unscoped, its name) runs \
            again a key completed or in flight before it, and a changed fingerprint rule answers its retry \
            422 with safe_new_key (now said in docs/operations.md; records keep no rules to be found by)"]
async fn a_key_in_flight_across_a_reload_that_changes_its_scope_rules_is_replayed_to_its_retry() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let proxy = ProxyProcess::spawn(&config).await;
    let held = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "held", "{}")));
    env.upstream.wait_for_key("held", 1).await;

    let unscoped = config
        .clone()
        .set("idempotency.scope_headers", toml::Value::Array(Vec::new()))
        .set("idempotency.unscoped", "shared");
    std::fs::write(proxy.config_file(), unscoped.to_toml()).unwrap();
    let (status, answer) = reload(&proxy).await;
    assert_eq!(status, 200, "{answer}");
    env.upstream.release("slow");
    let held = held.await.unwrap();
    assert_eq!(held.status, 201);
    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "held", "{}")).await;
    assert_eq!(
        env.upstream.executions_for_key("held"),
        1,
        "the retry ran again: {}",
        retry.text()
    );
    assert_eq!(retry.body, held.body);
}
