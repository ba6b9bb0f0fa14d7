//! The harness itself behaves: the relay cuts and restores, the stub upstream's gates and bodies, the
//! PostgreSQL server a test process starts for itself, and a test that cannot run here.

use crate::support::{Relay, Reply, TestEnv, http, upstream};

#[tokio::test]
async fn relay_cut_closes_connections_and_restore_reopens() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let url = env.db().url_via(relay.addr());
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    client.simple_query("select 1").await.unwrap();
    relay.cut();
    assert!(client.simple_query("select 1").await.is_err());
    let _ = conn.await;
    assert!(
        tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .is_err()
    );
    relay.restore();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.simple_query("select 1").await.unwrap();
}

#[tokio::test]
async fn stub_stream_sends_first_chunk_before_gate() {
    let env = TestEnv::new().await;
    let mut response = http::client()
        .get(format!("{}/stream", env.upstream.url()))
        .send()
        .await
        .unwrap();
    let first = response.chunk().await.unwrap().unwrap();
    assert_eq!(&first[..], upstream::FIRST_CHUNK);
    env.upstream.release("stream");
    let rest = response.chunk().await.unwrap().unwrap();
    assert_eq!(&rest[..], upstream::REST_CHUNK);
}

#[tokio::test]
async fn stub_big_and_reset() {
    let env = TestEnv::new().await;
    let reply = Reply::of(http::client().get(format!("{}/big?bytes=100000", env.upstream.url()))).await;
    assert_eq!(reply.body.as_ref(), upstream::big_body(100000).as_slice());
    let response = http::client()
        .get(format!("{}/reset-mid-body", env.upstream.url()))
        .send()
        .await
        .unwrap();
    assert!(response.bytes().await.is_err());
    assert_eq!(env.upstream.executions(), 2);
}

/// This test binary run again, as a process of its own, for the one ignored probe `test` (under
/// `support::selftest::`) with `env` set (`None`: removed); its exit status and what it printed.
fn run_probe(test: &str, env: &[(&str, Option<&str>)]) -> (bool, String) {
    let mut command = std::process::Command::new(std::env::current_exe().expect("the test binary"));
    command.args([
        "--exact",
        &format!("support::selftest::{test}"),
        "--ignored",
        "--nocapture",
    ]);
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let out = command.output().expect("run the test binary");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), printed)
}

/// Prints what the server the process found is: `probe: <url> <data directory> <max_connections> <ssl>`.
#[tokio::test]
#[ignore = "run by the_tests_start_their_own_postgres_and_stop_it_when_they_exit, in a process of its own"]
async fn own_server_probe() {
    let url = crate::support::pg::base_url();
    let client = crate::support::pg::connect(&url).await;
    let mut shown = Vec::new();
    for setting in ["data_directory", "max_connections", "ssl"] {
        let row = client.query_one(&format!("SHOW {setting}"), &[]).await.unwrap();
        shown.push(row.get::<_, String>(0));
    }
    println!("probe: {url} {}", shown.join(" "));
}

/// With no `DATABASE_URL` and `IDEMPROXY_TEST_PG=own` (as with nothing on 5432), the test process
/// starts its own PostgreSQL on another port, with room for the suite's connections and TLS on; once
/// the process exits, the server is stopped and its directory removed.
#[test]
fn the_tests_start_their_own_postgres_and_stop_it_when_they_exit() {
    let (passed, printed) = run_probe(
        "own_server_probe",
        &[("DATABASE_URL", None), ("IDEMPROXY_TEST_PG", Some("own"))],
    );
    assert!(passed, "{printed}");
    let line = printed
        .lines()
        .find_map(|line| line.strip_prefix("probe: "))
        .unwrap_or_else(|| panic!("the probe printed no server:\n{printed}"));
    let [url, data, max_connections, ssl] = line.split(' ').collect::<Vec<_>>()[..] else {
        panic!("the probe printed {line:?}");
    };
    let url = url::Url::parse(url).expect("the probe's URL");
    assert_eq!(url.host_str(), Some("127.0.0.1"), "{url}");
    let port = url.port().expect("a port");
    assert_ne!(port, 5432, "the process's own server, not the machine's");
    assert_eq!((max_connections, ssl), ("300", "on"));
    let dir = std::path::Path::new(data)
        .parent()
        .expect("the data directory is in the server's directory")
        .to_path_buf();
    let gone = (0..600).any(|_| {
        let stopped = std::net::TcpStream::connect(("127.0.0.1", port)).is_err();
        if stopped && !dir.exists() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        false
    });
    assert!(
        gone,
        "30 s after the test process exited, its server on port {port} or {} is still there",
        dir.display()
    );
}

#[test]
#[ignore = "run by a_test_that_cannot_run_says_so_and_fails_under_ci, in a process of its own"]
fn skip_probe() {
    crate::support::tools::skip_missing("probe-tool", "apt-get install probe-tool");
}

/// A test that cannot run says why and how to mend it, and passes; where `CI` is set it fails.
#[test]
fn a_test_that_cannot_run_says_so_and_fails_under_ci() {
    let said = "skipped: probe-tool is not installed (apt-get install probe-tool)";
    let (passed, printed) = run_probe("skip_probe", &[("CI", None)]);
    assert!(passed, "{printed}");
    assert!(printed.contains(said), "{printed}");
    let (passed, printed) = run_probe("skip_probe", &[("CI", Some("true"))]);
    assert!(!passed, "the skipped test passed under CI:\n{printed}");
    assert!(printed.contains(said), "{printed}");
    assert!(printed.contains("CI is set"), "{printed}");
}
