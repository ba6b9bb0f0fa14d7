//! The open-files limit, from the real binary started under a low `ulimit -n`: the soft limit raised to
//! the hard one and logged, one warning when even the hard limit is below what the settings need, the
//! `idemproxy_open_files_*` gauges, and the proxy serving all the same.

use std::sync::{Arc, Mutex};

use rstest::rstest;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::http::{client, metric};
use crate::support::proxy::without_test_env;
use crate::support::{Backend, Reply, TestEnv, poll_until};

/// What the settings below need: server.max_connections + 8 admin + upstream.max_connections ×
/// server.workers + store.pool_size (SQLite keeps one) + 64 spare + 2 per worker.
const NEEDED: u64 = 300 + 8 + 50 * 2 + 1 + 64 + 2 * 2;

/// The JSON events the process wrote, each as its fields (the line's own keys among them).
fn events(lines: &Mutex<Vec<String>>) -> Vec<serde_json::Value> {
    let lines = lines.lock().unwrap();
    lines
        .iter()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

fn with_message<'a>(events: &'a [serde_json::Value], part: &str) -> Vec<&'a serde_json::Value> {
    let says = |event: &&serde_json::Value| event["message"].as_str().is_some_and(|m| m.contains(part));
    events.iter().filter(says).collect()
}

/// The `addr` of the event whose message is `message`.
fn listening(events: &[serde_json::Value], message: &str) -> Option<String> {
    let event = events.iter().find(|event| event["message"] == message)?;
    Some(format!("http://{}", event["addr"].as_str()?))
}

#[rstest]
#[case::soft_limit_only("ulimit -Sn 256")]
#[case::hard_limit_too("ulimit -n 256")]
#[tokio::test]
async fn a_low_open_files_limit_is_raised_logged_and_warned_of(#[case] ulimit: &str) {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("server.max_connections", 300)
        .set("server.workers", 2)
        .set("upstream.max_connections", 50);
    let file = crate::support::cli::config_file(&config.to_toml());
    let mut command = tokio::process::Command::new("sh");
    without_test_env(&mut command)
        .arg("-c")
        .arg(format!("{ulimit} && exec \"$0\" serve --config \"$1\""))
        .arg(env!("CARGO_BIN_EXE_idemproxy"))
        .arg(file.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("spawn sh and idemproxy");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let seen = lines.clone();
    tokio::spawn(async move {
        while let Ok(Some(line)) = stderr.next_line().await {
            seen.lock().unwrap().push(line);
        }
    });
    let (proxy, admin) = poll_until("both listeners logged", || async {
        let events = events(&lines);
        Some((
            listening(&events, "proxy listening")?,
            listening(&events, "admin listening")?,
        ))
    })
    .await;

    let (_, our_hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap();
    let hard = if ulimit.contains("-Sn") { our_hard } else { 256 };
    let events = events(&lines);
    let raised = with_message(&events, "soft limit raised to the hard limit");
    let [raised] = raised.as_slice() else {
        panic!("one line on the limit: {events:#?}")
    };
    assert_eq!(raised["level"], "INFO", "{raised}");
    assert_eq!(raised["before"], 256, "{raised}");
    assert_eq!(raised["after"], hard, "{raised}");
    assert_eq!(raised["hard"], hard, "{raised}");

    let warned = with_message(&events, "open files limit");
    let warned: Vec<_> = warned.into_iter().filter(|e| e["level"] == "WARN").collect();
    if hard < NEEDED {
        let [warning] = warned.as_slice() else {
            panic!("one warning: {events:#?}")
        };
        let text = warning["message"].as_str().unwrap();
        assert_eq!(warning["limit"], hard, "{warning}");
        assert_eq!(warning["needed"], NEEDED, "{warning}");
        for named in [
            "server.max_connections 300",
            "upstream.max_connections 50",
            "server.workers 2",
            "store.pool_size 1",
            &format!("ulimit -n {NEEDED}"),
            &format!("LimitNOFILE={NEEDED}"),
            &format!("--ulimit nofile={NEEDED}:{NEEDED}"),
        ] {
            assert!(text.contains(named), "{named} in {text}");
        }
    } else {
        assert!(warned.is_empty(), "a hard limit of {hard} is enough: {warned:#?}");
    }

    assert_eq!(
        metric(&admin, "idemproxy_open_files_limit", &[]).await,
        hard as f64
    );
    assert_eq!(
        metric(&admin, "idemproxy_open_files_needed", &[]).await,
        NEEDED as f64
    );
    let served = Reply::of(client().get(format!("{proxy}/items"))).await;
    assert_eq!(served.status, 201, "it serves under the limit");
    let _ = child.start_kill();
}

#[tokio::test]
async fn a_limit_too_low_to_bind_the_listeners_is_named_not_the_address() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let file = crate::support::cli::config_file(&env.config().to_toml());
    let mut command = tokio::process::Command::new("sh");
    without_test_env(&mut command)
        .arg("-c")
        .arg("ulimit -n 9 && exec \"$0\" serve --config \"$1\"")
        .arg(env!("CARGO_BIN_EXE_idemproxy"))
        .arg(file.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let run = command.output();
    let output = tokio::time::timeout(std::time::Duration::from_secs(30), run)
        .await
        .expect("the proxy stops at once")
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stopped = stderr
        .lines()
        .find(|line| line.contains("cannot listen on"))
        .unwrap_or_else(|| panic!("no listener error: {stderr}"));
    assert!(stopped.contains("RLIMIT_NOFILE"), "{stopped}");
    assert!(
        !stopped.contains("check server."),
        "no address is wrong: {stopped}"
    );
}
