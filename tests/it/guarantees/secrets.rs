//! Secrets are not stored: response headers named in `idempotency.never_store_headers` (by default
//! `set-cookie`) reach the first client and never the store or a replay.

use rstest::rstest;

use crate::support::{Backend, InProcessProxy, Reply, TestEnv, keyed_post, settled};

#[rstest]
#[tokio::test]
async fn set_cookie_reaches_the_first_client_only(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    // No replay cache: the replay is read back from the store.
    let proxy = InProcessProxy::start(&env.config().set("replay_cache.max_size", "0")).await;
    let first = Reply::of(keyed_post(&proxy.url, "/cookie", "login", "{}")).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.header("set-cookie"), Some("session=1; HttpOnly"));
    let replay = settled(|| keyed_post(&proxy.url, "/cookie", "login", "{}")).await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!(replay.header("set-cookie"), None, "a replay carries no cookie");
    assert_eq!(
        replay.header("x-session"),
        Some("1"),
        "other headers are replayed"
    );
    assert_eq!(replay.body, first.body);
    if backend == Backend::Postgres {
        let db = env.db().client().await;
        let row = db
            .query_one(
                "SELECT response_header_names FROM idemproxy.records WHERE key = 'login'",
                &[],
            )
            .await
            .unwrap();
        let names: Vec<String> = row.get(0);
        assert!(!names.iter().any(|n| n == "set-cookie"), "{names:?}");
    } else {
        let db = rusqlite::Connection::open(env.store.sqlite_path()).unwrap();
        let headers: Vec<u8> = db
            .query_row(
                "SELECT response_headers FROM records WHERE key = 'login'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        let text = String::from_utf8_lossy(&headers);
        assert!(
            !text.contains("set-cookie") && !text.contains("session=1"),
            "{text}"
        );
        assert!(text.contains("x-session"), "{text}");
    }
}

#[rstest]
#[tokio::test]
async fn never_store_headers_names_the_headers_kept_from_the_store(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("replay_cache.max_size", "0")
        .set("idempotency.never_store_headers", vec!["set-cookie", "x-session"]);
    let proxy = InProcessProxy::start(&config).await;
    let first = Reply::of(keyed_post(&proxy.url, "/cookie", "private", "{}")).await;
    assert_eq!(first.header("x-session"), Some("1"));
    let replay = settled(|| keyed_post(&proxy.url, "/cookie", "private", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.header("x-session"), None);
    assert_eq!(replay.header("set-cookie"), None);
    assert_eq!(replay.header("content-type"), Some("application/json"));
}
