//! The suite against the proxy: every case passes, or does not apply for a reason the case names, on
//! each store; and a proxy that breaks a promise on purpose fails it, naming the case and what it saw.

use std::collections::BTreeSet;

use crate::support::proxy::{ProxyConfig, ProxyProcess, demo_upstream};
use crate::support::store::{Backend, TestStore};

use super::command::conformance;

/// The cases that do not apply to the proxy in its default configuration (README's quickstart), each for
/// the reason it prints: keys are optional, no expiry header is set, no `--ttl` was given, and no route
/// reads OASIS keys.
const NOT_APPLICABLE_BY_DEFAULT: [&str; 5] = [
    "missing-key-problem-details",
    "expires-header",
    "expired-key-executes",
    "repeatability-accepted",
    "repeatability-too-old",
];

async fn passes_on(backend: Backend) {
    if backend.skipped() {
        return;
    }
    let store = TestStore::create(backend).await;
    let (_demo, demo_url) = demo_upstream().await;
    let proxy = ProxyProcess::spawn(&ProxyConfig::on(&store, &demo_url)).await;
    let run = conformance(&[&proxy.url]).await;
    assert_eq!(run.code, Some(0), "{}", run.table);
    assert!(run.cases().len() >= 60, "{} cases", run.cases().len());
    assert_eq!(run.failed(), Vec::<String>::new(), "{}", run.table);
    let not_applicable: BTreeSet<String> = run.with_outcome("not_applicable").into_iter().collect();
    let expected: BTreeSet<String> = NOT_APPLICABLE_BY_DEFAULT.iter().map(|s| s.to_string()).collect();
    assert_eq!(not_applicable, expected, "{}", run.table);
    for case in run.cases() {
        if case["outcome"] == "not_applicable" {
            assert!(!case["reason"].as_str().unwrap_or("").is_empty(), "{case}");
        }
    }
}

#[tokio::test]
async fn every_case_passes_or_does_not_apply_against_the_proxy_on_sqlite() {
    passes_on(Backend::Sqlite).await;
}

#[tokio::test]
async fn every_case_passes_or_does_not_apply_against_the_proxy_on_postgresql() {
    passes_on(Backend::Postgres).await;
}

#[tokio::test]
async fn every_case_passes_or_does_not_apply_against_the_proxy_on_redis() {
    passes_on(Backend::Redis).await;
}

#[tokio::test]
async fn the_cases_that_need_settings_pass_where_the_proxy_has_them() {
    let store = TestStore::create(Backend::Sqlite).await;
    let (_demo, demo_url) = demo_upstream().await;
    let config = ProxyConfig::on(&store, &demo_url)
        .set("idempotency.required", true)
        .set("idempotency.ttl", "3s")
        .set("idempotency.lock_timeout", "1s")
        .set("idempotency.expires_header", "Idempotency-Expires");
    let proxy = ProxyProcess::spawn(&config).await;
    let run = conformance(&[
        &proxy.url,
        "--ttl",
        "3s",
        "--case",
        "missing-key-problem-details",
        "--case",
        "expires-header",
        "--case",
        "expired-key-executes",
    ])
    .await;
    assert_eq!(run.code, Some(0), "{}", run.table);
    assert_eq!(run.with_outcome("pass").len(), 3, "{}", run.table);
}

#[tokio::test]
async fn a_proxy_that_does_not_keep_4xx_answers_fails_the_suite_naming_the_cases() {
    let store = TestStore::create(Backend::Sqlite).await;
    let (_demo, demo_url) = demo_upstream().await;
    let statuses: Vec<toml::Value> = ["400", "422", "5xx"].iter().map(|s| (*s).into()).collect();
    let config = ProxyConfig::on(&store, &demo_url).set("idempotency.release_statuses", statuses);
    let proxy = ProxyProcess::spawn(&config).await;
    let run = conformance(&[&proxy.url]).await;
    assert_eq!(run.code, Some(1), "{}", run.table);
    let failed = run.failed();
    for case in ["error-result-replayed", "service-422-replayed"] {
        assert!(
            failed.contains(&case.to_owned()),
            "{case} did not fail:\n{}",
            run.table
        );
    }
    let seen = run.case("error-result-replayed")["seen"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(seen.contains("executed it 2 times"), "{seen}");
    assert!(
        run.table.contains("FAIL  required     error-result-replayed"),
        "{}",
        run.table
    );
}

#[tokio::test]
async fn a_proxy_that_answers_a_reused_key_409_fails_only_the_422_case() {
    let store = TestStore::create(Backend::Sqlite).await;
    let (_demo, demo_url) = demo_upstream().await;
    let config = ProxyConfig::on(&store, &demo_url).set("idempotency.mismatch_status", 409);
    let proxy = ProxyProcess::spawn(&config).await;
    let run = conformance(&[&proxy.url]).await;
    assert_eq!(run.code, Some(1), "{}", run.table);
    assert_eq!(run.failed(), vec!["mismatch-422".to_owned()], "{}", run.table);
    let seen = run.case("mismatch-422")["seen"].as_str().unwrap_or("").to_owned();
    assert!(seen.starts_with("reuse 409"), "{seen}");
}

#[tokio::test]
async fn the_service_alone_without_an_idempotency_layer_fails_the_required_cases() {
    let (_demo, demo_url) = demo_upstream().await;
    let run = conformance(&[&demo_url]).await;
    assert_eq!(run.code, Some(1), "{}", run.table);
    let failed = run.failed();
    for case in [
        "retry-same-body",
        "retries-execute-once",
        "concurrent-duplicate-not-executed",
        "concurrent-burst-once",
        "mismatch-not-executed",
    ] {
        assert!(
            failed.contains(&case.to_owned()),
            "{case} did not fail:\n{}",
            run.table
        );
    }
    // What a layer must not overreach (two keys, two clients, a released failure) cannot be told of a
    // target that replays nothing: those cases do not apply, rather than pass for nothing.
    assert_eq!(
        run.with_outcome("pass"),
        vec!["first-execution".to_owned()],
        "{}",
        run.table
    );
    for case in [
        "distinct-keys-execute",
        "scope-between-clients",
        "503-released",
        "keyless-not-deduplicated",
    ] {
        assert!(
            run.with_outcome("not_applicable").contains(&case.to_owned()),
            "{case}:\n{}",
            run.table
        );
    }
}
