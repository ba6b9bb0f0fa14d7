//! The on-call commands that find records as a client sees them (`keys show` by credential, `keys list`)
//! and forget one (`keys forget`), run as the real binary against a store a real proxy wrote to, with
//! the proxy's own configuration file.

use std::process::Output;

use idemproxy::store::ClaimKind;
use rstest::rstest;

use crate::store::suite::{DAY, LONG, request, won};
use crate::support::cli::{config_file, json, keys_with, stdout};
use crate::support::http::client;
use crate::support::proxy::without_test_env;
use crate::support::{Backend, InProcessProxy, ProxyConfig, Reply, TestEnv, TestStore};

/// `idemproxy keys --config <config> ARGS` with the store's own variables.
async fn keys(store: &TestStore, config: &ProxyConfig, args: &[&str]) -> Output {
    let file = config_file(&config.to_toml());
    let path = file.path().to_str().expect("UTF-8 path");
    keys_with(store, &["--config", path], args).await
}

/// The test config with a `payments` route whose scope is the `X-Api-Key` header, and no replay cache
/// (a forgotten response must not be answered from a proxy's memory in these tests).
fn config(env: &TestEnv) -> ProxyConfig {
    env.config()
        .set("replay_cache.max_age", "0s")
        .route("name = \"payments\"\npath_prefix = \"/payments\"\nscope_headers = [\"x-api-key\"]\n")
}

/// A keyed POST to `path` as the client with API key `api_key`.
async fn pay(proxy: &InProcessProxy, path: &str, key: &str, api_key: &str) -> Reply {
    let request = client()
        .post(format!("{}{path}", proxy.url))
        .header("idempotency-key", key)
        .header("x-api-key", api_key)
        .header("content-type", "application/json")
        .body("{\"amount\":100}");
    Reply::of(request).await
}

#[rstest]
#[tokio::test]
async fn show_by_credential_finds_the_record_the_proxy_keeps_for_that_client(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = config(&env);
    let proxy = InProcessProxy::start(&config).await;
    assert_eq!(pay(&proxy, "/payments/1", "pay-1", "alice").await.status, 201);
    assert_eq!(pay(&proxy, "/payments/1", "pay-1", "bob").await.status, 201);

    let by_route = [
        "show",
        "pay-1",
        "--route",
        "payments",
        "--header",
        "X-Api-Key: alice",
        "--json",
    ];
    let alice = json(&keys(&env.store, &config, &by_route).await);
    assert_eq!(alice.as_array().map(Vec::len), Some(1), "{alice}");
    let scope = alice[0]["scope"].as_str().expect("scope").to_owned();
    assert!(scope.starts_with("payments:"), "{scope}");
    assert_eq!(alice[0]["status"], "completed");

    let by_path = keys(
        &env.store,
        &config,
        &[
            "show",
            "pay-1",
            "--path",
            "/payments//1",
            "--method",
            "post",
            "-H",
            "x-api-key: alice",
        ],
    )
    .await;
    assert!(by_path.status.success(), "{}", stdout(&by_path));
    let text = stdout(&by_path);
    assert!(
        text.contains(&format!("route \"payments\": this client's scope is {scope}")),
        "the path is read as the proxy reads it (normalised) and takes the same route: {text}"
    );
    assert_eq!(text.matches("status    completed").count(), 1, "{text}");

    let bob = json(
        &keys(
            &env.store,
            &config,
            &[
                "show",
                "pay-1",
                "--route",
                "payments",
                "-H",
                "X-Api-Key: bob",
                "--json",
            ],
        )
        .await,
    );
    assert_ne!(
        bob[0]["scope"], alice[0]["scope"],
        "each client has its own scope"
    );

    let stranger = keys(
        &env.store,
        &config,
        &["show", "pay-1", "--route", "payments", "-H", "X-Api-Key: eve"],
    )
    .await;
    assert_eq!(stranger.status.code(), Some(1));
    assert!(
        stdout(&stranger).contains("no record for key \"pay-1\" in scope payments:"),
        "{}",
        stdout(&stranger)
    );
}

#[tokio::test]
async fn show_says_when_the_proxy_would_refuse_the_credential_and_names_an_unknown_route() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = config(&env);
    let _proxy = InProcessProxy::start(&config).await;
    let wrong_header = keys(
        &env.store,
        &config,
        &[
            "show",
            "k",
            "--route",
            "payments",
            "-H",
            "Authorization: Bearer x",
        ],
    )
    .await;
    assert!(
        stdout(&wrong_header).contains("the proxy refuses such keyed requests (400 missing-scope)"),
        "{}",
        stdout(&wrong_header)
    );
    let unknown = keys(
        &env.store,
        &config,
        &["show", "k", "--route", "paymnts", "-H", "X-Api-Key: a"],
    )
    .await;
    assert_eq!(unknown.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        stderr.contains("no route named \"paymnts\"") && stderr.contains("payments"),
        "{stderr}"
    );
}

#[rstest]
#[tokio::test]
async fn list_pages_through_a_route_and_filters_by_state(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = config(&env);
    let proxy = InProcessProxy::start(&config).await;
    for i in 0..5 {
        assert_eq!(
            pay(&proxy, "/payments/1", &format!("pay-{i}"), "alice")
                .await
                .status,
            201
        );
    }
    let other = Reply::of(crate::support::keyed_post(&proxy.url, "/orders", "order-1", "{}")).await;
    assert_eq!(other.status, 201);

    let mut keys_seen = Vec::new();
    let mut after: Option<String> = None;
    for _ in 0..100 {
        let mut args = vec!["list", "--route", "payments", "--limit", "2", "--json"];
        if let Some(cursor) = &after {
            args.extend(["--after", cursor.as_str()]);
        }
        let page = json(&keys(&env.store, &config, &args).await);
        for record in page["records"].as_array().expect("records") {
            assert_eq!(record["state"], "completed");
            keys_seen.push(record["key"].as_str().expect("key").to_owned());
        }
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    keys_seen.sort();
    assert_eq!(
        keys_seen,
        ["pay-0", "pay-1", "pay-2", "pay-3", "pay-4"],
        "every record of the route once, no other"
    );

    let text = stdout(&keys(&env.store, &config, &["list", "--limit", "2"]).await);
    assert!(text.contains("next page: --after '"), "{text}");
    let in_flight = keys(&env.store, &config, &["list", "--state", "in-flight,held"]).await;
    assert!(in_flight.status.success());
    assert!(
        stdout(&in_flight).contains("0 records; end of the list"),
        "{}",
        stdout(&in_flight)
    );
}

#[rstest]
#[tokio::test]
async fn forget_confirms_and_the_next_request_with_the_key_executes_again(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = config(&env);
    let proxy = InProcessProxy::start(&config).await;
    assert_eq!(pay(&proxy, "/payments/1", "pay-1", "alice").await.status, 201);
    assert!(pay(&proxy, "/payments/1", "pay-1", "alice").await.is_replay());

    let client_args = ["forget", "pay-1", "--route", "payments", "-H", "X-Api-Key: alice"];
    let unconfirmed = keys(&env.store, &config, &client_args).await;
    assert_eq!(unconfirmed.status.code(), Some(1));
    assert!(
        stdout(&unconfirmed).contains("no terminal to ask at; pass --yes"),
        "{}",
        stdout(&unconfirmed)
    );
    assert!(
        pay(&proxy, "/payments/1", "pay-1", "alice").await.is_replay(),
        "nothing was forgotten"
    );

    let mut confirmed = client_args.to_vec();
    confirmed.push("--yes");
    let forgotten = keys(&env.store, &config, &confirmed).await;
    assert!(forgotten.status.success(), "{}", stdout(&forgotten));
    assert!(stdout(&forgotten).contains("the next request with this key executes again"));

    let again = pay(&proxy, "/payments/1", "pay-1", "alice").await;
    assert_eq!(again.status, 201);
    assert!(!again.is_replay(), "executed again, not replayed");
    assert_eq!(env.upstream.executions_for_key("pay-1"), 2);
}

#[rstest]
#[tokio::test]
async fn forget_refuses_a_claim_in_flight_without_force(
    #[values(Backend::Postgres, Backend::Sqlite, Backend::Redis)] backend: Backend,
) {
    let test_store = TestStore::create(backend).await;
    let store = test_store.open().await;
    won(&*store, &request("live", 1, LONG, DAY)).await;
    let config = ProxyConfig::on(&test_store, "http://127.0.0.1:9");

    let refused = keys(&test_store, &config, &["forget", "live", "--yes", "--json"]).await;
    assert_eq!(refused.status.code(), Some(1));
    let answer = json(&refused);
    assert_eq!(answer["forgotten"], false);
    assert!(answer["reason"].as_str().unwrap().contains("--force"), "{answer}");
    assert_eq!(store.find("live", None).await.unwrap().len(), 1, "kept");

    let forced = keys(&test_store, &config, &["forget", "live", "--yes", "--force"]).await;
    assert!(forced.status.success(), "{}", stdout(&forced));
    assert_eq!(
        won(&*store, &request("live", 1, LONG, DAY)).await,
        (1, ClaimKind::New)
    );
}

/// `idemproxy keys --store URL forget KEY` at a terminal (a pseudo-terminal from util-linux `script`),
/// with `typed` typed in; its exit code and everything the terminal showed.
async fn forget_at_a_terminal(store: &TestStore, key: &str, typed: &str) -> (Option<i32>, String) {
    use tokio::io::AsyncWriteExt;
    let inner = format!(
        "{} keys --store {} forget {key}",
        env!("CARGO_BIN_EXE_idemproxy"),
        store.url()
    );
    let mut command = tokio::process::Command::new("script");
    command
        .args(["-qec", &inner, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    without_test_env(&mut command);
    let mut child = command.spawn().expect("util-linux script runs");
    let mut stdin = child.stdin.take().expect("piped");
    stdin.write_all(typed.as_bytes()).await.expect("typed");
    let output = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the command ends")
        .expect("script ran");
    drop(stdin);
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test]
async fn forget_at_a_terminal_deletes_only_when_the_key_is_typed_back() {
    let test_store = TestStore::create(Backend::Sqlite).await;
    let store = test_store.open().await;
    let done = request("order-9", 1, LONG, DAY);
    won(&*store, &done).await;
    assert!(
        store
            .complete(&done.id, &crate::store::suite::response(b"ok"))
            .await
            .unwrap()
    );

    let (code, shown) = forget_at_a_terminal(&test_store, "order-9", "order-8\n").await;
    assert_eq!(code, Some(1), "{shown}");
    assert!(shown.contains("Type the key to confirm"), "{shown}");
    assert!(shown.contains("does not match; nothing was forgotten"), "{shown}");
    assert_eq!(store.find("order-9", None).await.unwrap().len(), 1, "kept");

    let (code, shown) = forget_at_a_terminal(&test_store, "order-9", "order-9\n").await;
    assert_eq!(code, Some(0), "{shown}");
    assert!(
        shown.contains("forgotten: the next request with this key executes again"),
        "{shown}"
    );
    assert!(store.find("order-9", None).await.unwrap().is_empty());
}
