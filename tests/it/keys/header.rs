//! The `Idempotency-Key` header: which forms are keys, which are refused, and which are the same key.

use rstest::rstest;

use reqwest::header::HeaderValue;

use crate::support::{Backend, Reply, TestEnv, http::client, keyed_post, settled};

async fn post_with_key_values(proxy_url: &str, values: &[HeaderValue]) -> Reply {
    let mut request = client()
        .post(format!("{proxy_url}/orders"))
        .header("content-type", "application/json")
        .body("{}");
    for value in values {
        request = request.header("idempotency-key", value.clone());
    }
    Reply::of(request).await
}

#[rstest]
#[tokio::test]
async fn every_malformed_key_is_400_invalid_key(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let too_long = "a".repeat(256);
    let quoted_too_long = format!("\"{too_long}\"");
    let malformed: Vec<(&str, HeaderValue)> = vec![
        ("empty", HeaderValue::from_static("")),
        (
            "longer than max_key_length",
            HeaderValue::from_str(&too_long).unwrap(),
        ),
        (
            "quoted, longer than max_key_length",
            HeaderValue::from_str(&quoted_too_long).unwrap(),
        ),
        ("inner space", HeaderValue::from_static("a b")),
        ("space inside quotes", HeaderValue::from_static("\"a b\"")),
        ("tab (control character)", HeaderValue::from_static("a\tb")),
        (
            "non-ASCII",
            HeaderValue::from_bytes("caf\u{e9}".as_bytes()).unwrap(),
        ),
        ("unterminated quote", HeaderValue::from_static("\"abc")),
        ("empty quoted string", HeaderValue::from_static("\"\"")),
        ("bad escape in quotes", HeaderValue::from_static("\"ab\\c\"")),
        (
            "text after the quoted string",
            HeaderValue::from_static("\"abc\"def"),
        ),
    ];
    for (form, value) in malformed {
        let reply = post_with_key_values(&proxy.url, &[value]).await;
        assert_eq!(reply.status, 400, "{form}: {}", reply.text());
        reply.assert_problem(400, "invalid-key");
    }

    let repeated = [HeaderValue::from_static("a"), HeaderValue::from_static("b")];
    post_with_key_values(&proxy.url, &repeated)
        .await
        .assert_problem(400, "invalid-key");
    let repeated_same = [HeaderValue::from_static("a"), HeaderValue::from_static("a")];
    post_with_key_values(&proxy.url, &repeated_same)
        .await
        .assert_problem(400, "invalid-key");

    assert_eq!(env.upstream.executions(), 0, "a refused request was forwarded");
}

#[rstest]
#[tokio::test]
async fn longest_allowed_key_is_accepted(#[values(Backend::Postgres, Backend::Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let longest = "a".repeat(255);
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", &longest, "{}")).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    let quoted = format!("\"{}\"", "b".repeat(255));
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", &quoted, "{}")).await;
    assert_eq!(
        reply.status,
        201,
        "the length counts after unquoting: {}",
        reply.text()
    );
}

#[rstest]
#[tokio::test]
async fn bare_and_quoted_forms_are_the_same_key(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let bare = Reply::of(keyed_post(&proxy.url, "/orders", "abc", "{}")).await;
    assert_eq!(bare.status, 201);
    let quoted = settled(|| keyed_post(&proxy.url, "/orders", "\"abc\"", "{}")).await;
    assert!(
        quoted.is_replay(),
        "\"abc\" must be the key abc: {}",
        quoted.text()
    );
    assert_eq!(quoted.body, bare.body);
    assert_eq!(env.upstream.executions(), 1);
}

#[rstest]
#[tokio::test]
async fn bare_uuid_is_a_key(#[values(Backend::Postgres, Backend::Sqlite)] backend: Backend) {
    let env = TestEnv::on(backend).await;
    let proxy = env.proxy().await;

    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let first = Reply::of(keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = settled(|| keyed_post(&proxy.url, "/orders", key, "{}")).await;
    assert!(retry.is_replay());
}
