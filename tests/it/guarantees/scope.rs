//! No shared scope by accident: a keyed request that names no client in any scope header is refused
//! before anything is claimed or forwarded, unless the operator said scopes may be shared.

use rstest::rstest;

use crate::support::cli::idemproxy;
use crate::support::http::client;
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post};

fn without_credential(base: &str, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{base}/orders"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}")
}

#[rstest]
#[tokio::test]
async fn a_keyed_request_without_a_credential_is_refused_and_never_forwarded(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;
    let refused = Reply::of(without_credential(&proxy.url, "anon")).await;
    refused.assert_problem(400, "missing-scope");
    let detail = refused.json()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("idempotency.scope_headers"), "{detail}");
    assert!(detail.contains("authorization"), "{detail}");
    let empty = Reply::of(without_credential(&proxy.url, "anon").header("authorization", "")).await;
    empty.assert_problem(400, "missing-scope");
    assert_eq!(env.upstream.executions(), 0, "nothing forwarded");

    // Nothing was claimed: the same key with a credential is new.
    let first = Reply::of(keyed_post(&proxy.url, "/orders", "anon", "{}")).await;
    assert_eq!(first.status, 201);
    assert!(!first.is_replay());
    // A request without a key needs no credential: it is passed through.
    let keyless = Reply::of(client().post(format!("{}/orders", proxy.url)).body("{}")).await;
    assert_eq!(keyless.status, 201);
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn shared_scopes_serve_keyed_requests_without_a_credential_when_configured(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = InProcessProxy::start(&env.config().set("idempotency.unscoped", "shared")).await;
    let first = Reply::of(without_credential(&proxy.url, "shared")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let again = Reply::of(without_credential(&proxy.url, "shared")).await;
    assert!(
        again.is_replay(),
        "one scope for every client without a credential"
    );
    assert_eq!(again.body, first.body);
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn an_empty_scope_header_list_that_would_refuse_everything_is_a_config_error() {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "[idempotency]\nscope_headers = []\n").unwrap();
    let path = file.path().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", path], &[]).await;
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("idempotency.scope_headers"), "{stderr}");
    assert!(stderr.contains("unscoped"), "{stderr}");
}
