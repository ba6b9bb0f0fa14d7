//! Secrets are not stored: response headers named in `idempotency.never_store_headers` (by default
//! `set-cookie`) reach the first client and never the store or a replay. Nor printed: `check-config`, the
//! one-line errors and every log line of a store that cannot be reached show no password, in any of the
//! forms a store or upstream address carries one.

use std::process::Stdio;
use std::time::Duration;

use rstest::rstest;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::cli::{config_file, idemproxy};
use crate::support::proxy::binary;
use crate::support::{Backend, InProcessProxy, ProxyConfig, Reply, TestEnv, keyed_post, settled};

/// The password in every address below; no byte of output may hold it.
const SECRET: &str = "Sup3rS3cret";

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

/// A TCP port on 127.0.0.1 where nothing listens.
async fn closed_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

/// Every form a store URL carries a password in, each at a port where nothing listens.
async fn store_urls() -> Vec<String> {
    let (a, b) = (closed_port().await, closed_port().await);
    vec![
        format!("postgres://app:{SECRET}@127.0.0.1:{a}/idem"),
        format!("postgres://app@127.0.0.1:{a}/idem?password={SECRET}"),
        format!("postgresql://app:{SECRET}@127.0.0.1:{a}/idem?sslmode=disable&password={SECRET}"),
        format!("redis://:{SECRET}@127.0.0.1:{a}"),
        format!("redis://app:{SECRET}@127.0.0.1:{a}/1"),
        format!("rediss://app:{SECRET}@127.0.0.1:{a}"),
        format!("redis+cluster://app:{SECRET}@127.0.0.1:{a},127.0.0.1:{b}"),
        format!("rediss+cluster://:{SECRET}@127.0.0.1:{a},127.0.0.1:{b}"),
    ]
}

fn assert_no_secret(what: &str, output: &[u8]) {
    let text = String::from_utf8_lossy(output);
    assert!(!text.contains(SECRET), "{what} shows the password:\n{text}");
}

#[tokio::test]
async fn check_config_prints_no_password_in_any_form() {
    for url in store_urls().await {
        let output = idemproxy(&["check-config", "--store", &url], &[]).await;
        assert!(
            output.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_no_secret(&url, &output.stdout);
        assert_no_secret(&url, &output.stderr);
        let printed = String::from_utf8_lossy(&output.stdout);
        assert!(printed.contains("***"), "{url}: {printed}");
        assert!(
            printed.contains("127.0.0.1"),
            "the rest of the URL stays: {printed}"
        );
    }
}

/// A libpq `key=value` string is not a URL the proxy takes, and an upstream URL may carry no
/// credentials: both are refused with one line naming the key, which does not repeat the password.
#[tokio::test]
async fn refused_addresses_are_named_without_their_password() {
    let refused = [
        (
            "store.url",
            format!("host=db user=app password={SECRET} dbname=idem"),
        ),
        ("upstream.url", format!("http://app:{SECRET}@127.0.0.1:3000")),
        ("upstream.url", format!("https://:{SECRET}@svc.internal")),
    ];
    for (key, value) in refused {
        let file = config_file(&format!("{}\n", toml_line(key, &value)));
        let path = file.path().to_str().unwrap();
        let output = idemproxy(&["check-config", "--config", path], &[]).await;
        assert_eq!(output.status.code(), Some(64), "{value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(key), "{stderr}");
        assert_no_secret(&value, &output.stderr);
        assert_no_secret(&value, &output.stdout);
    }
}

/// `section.key = "value"` as a TOML table line.
fn toml_line(key: &str, value: &str) -> String {
    let (section, key) = key.split_once('.').unwrap();
    format!("[{section}]\n{key} = {}", toml::Value::String(value.into()))
}

#[tokio::test]
async fn keys_against_an_unreachable_store_prints_no_password() {
    for url in store_urls().await {
        let args = ["keys", "show", "some-key", "--store", &url];
        let output = tokio::time::timeout(Duration::from_secs(60), idemproxy(&args, &[]))
            .await
            .expect("keys gives up on an unreachable store");
        assert!(!output.status.success(), "{url}");
        assert_no_secret(&url, &output.stdout);
        assert_no_secret(&url, &output.stderr);
    }
}

/// Runs `idemproxy serve` at debug level against a store that cannot be reached, sends it one keyed
/// request once it listens (a Redis store connects on first use), and returns its stderr once a warning
/// or an error has been logged, or the process has exited.
async fn log_of_a_failing_store(url: &str) -> String {
    let config = ProxyConfig::new(url, "http://127.0.0.1:1")
        .set("log.filter", "debug")
        .set("store.timeout", "1s");
    let file = config_file(&config.to_toml());
    let mut child = binary()
        .args(["serve", "--config", file.path().to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn idemproxy");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let reading = async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(addr) = listening_on(&line) {
                tokio::spawn(async move {
                    let _ = Reply::of(keyed_post(&format!("http://{addr}"), "/orders", "k", "{}")).await;
                });
            }
            let failed = line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"");
            seen.push(line);
            if failed {
                break;
            }
        }
    };
    let logged = tokio::time::timeout(Duration::from_secs(60), reading).await;
    let _ = child.start_kill();
    let log = seen.join("\n");
    assert!(logged.is_ok(), "{url}: no warning or error logged:\n{log}");
    assert!(
        log.contains("\"level\":\"WARN\"") || log.contains("\"level\":\"ERROR\""),
        "{url}: the failure was logged:\n{log}"
    );
    log
}

/// The proxy listener's address, from its "proxy listening" JSON line.
fn listening_on(line: &str) -> Option<String> {
    let event: serde_json::Value = serde_json::from_str(line).ok()?;
    (event.get("message")?.as_str()? == "proxy listening").then_some(())?;
    Some(event.get("addr")?.as_str()?.to_owned())
}

#[tokio::test]
async fn the_log_of_a_store_that_cannot_be_reached_shows_no_password() {
    for url in store_urls().await {
        let log = log_of_a_failing_store(&url).await;
        assert_no_secret(&url, log.as_bytes());
    }
}
