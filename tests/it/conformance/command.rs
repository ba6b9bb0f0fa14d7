//! The command as a user runs it: its report, its exit codes, what it says when the target or the
//! counting service is missing, `--demo-upstream`, `--list` and `--service`.

use std::process::Output;

use crate::support::proxy::{ProxyConfig, ProxyProcess, binary, demo_upstream};
use crate::support::store::{Backend, TestStore};

/// A finished run: its exit code, its table (stdout) and stderr, and its JSON report.
pub struct Run {
    pub code: Option<i32>,
    pub table: String,
    pub report: serde_json::Value,
}

impl Run {
    /// Every case of the report.
    pub fn cases(&self) -> Vec<serde_json::Value> {
        self.report["cases"].as_array().cloned().unwrap_or_default()
    }

    /// The ids of the cases that ended with `outcome`.
    pub fn with_outcome(&self, outcome: &str) -> Vec<String> {
        self.cases()
            .iter()
            .filter(|c| c["outcome"] == outcome)
            .map(|c| c["id"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    /// The ids of the cases that failed.
    pub fn failed(&self) -> Vec<String> {
        self.with_outcome("fail")
    }

    /// The report of case `id`.
    pub fn case(&self, id: &str) -> serde_json::Value {
        self.cases()
            .into_iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no case {id} in the report"))
    }
}

/// `idemproxy conformance ARGS --json FILE`, to its end.
pub async fn conformance(args: &[&str]) -> Run {
    let dir = tempfile::tempdir().expect("a temp dir");
    let json = dir.path().join("report.json");
    let output = binary()
        .arg("conformance")
        .args(args)
        .arg("--json")
        .arg(&json)
        .output()
        .await
        .expect("run idemproxy conformance");
    let table = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let report = std::fs::read(&json)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or(serde_json::Value::Null);
    Run {
        code: output.status.code(),
        table,
        report,
    }
}

async fn plain(args: &[&str]) -> Output {
    binary()
        .arg("conformance")
        .args(args)
        .output()
        .await
        .expect("run idemproxy conformance")
}

#[tokio::test]
async fn the_report_names_each_case_its_group_source_outcome_and_what_was_seen() {
    let (_demo, demo_url) = demo_upstream().await;
    let store = TestStore::create(Backend::Sqlite).await;
    let proxy = ProxyProcess::spawn(&ProxyConfig::on(&store, &demo_url)).await;
    let run = conformance(&[&proxy.url, "--case", "retry-same-body", "--case", "mismatch-422"]).await;
    assert_eq!(run.code, Some(0), "{}", run.table);
    assert_eq!(run.report["suite"], "idemproxy conformance");
    assert_eq!(run.report["target"], proxy.url.as_str());
    assert_eq!(run.report["summary"]["pass"], 2);
    let case = run.case("mismatch-422");
    assert_eq!(
        (case["group"].as_str(), case["source"].as_str()),
        (Some("required"), Some("draft-07 §2.7"))
    );
    assert!(
        case["seen"]
            .as_str()
            .unwrap_or("")
            .starts_with("reuse 422 application/problem+json"),
        "{case}"
    );
    assert!(
        run.table.contains("pass  required     mismatch-422"),
        "{}",
        run.table
    );
    assert!(
        run.table
            .contains("all          2 passed, 0 failed, 0 not applicable"),
        "{}",
        run.table
    );
}

#[tokio::test]
async fn with_demo_upstream_the_command_starts_the_counting_service_itself() {
    let store = TestStore::create(Backend::Sqlite).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("its address")
        .port();
    let service = format!("127.0.0.1:{port}");
    let proxy = ProxyProcess::spawn(&ProxyConfig::on(&store, &format!("http://{service}"))).await;
    let run = conformance(&[
        &proxy.url,
        "--demo-upstream",
        &service,
        "--case",
        "first-execution",
        "--case",
        "retry-same-body",
    ])
    .await;
    assert_eq!(run.code, Some(0), "{}", run.table);
    assert_eq!(run.with_outcome("pass").len(), 2, "{}", run.table);
}

#[tokio::test]
async fn a_target_that_does_not_answer_exits_2_and_says_what_the_suite_expects() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("its address");
    let output = plain(&[&format!("http://{closed}")]).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("connecting to"), "{stderr}");
    assert!(
        stderr.contains("counting service") && stderr.contains("demo-upstream"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_target_without_the_counting_service_behind_it_exits_2() {
    let store = TestStore::create(Backend::Sqlite).await;
    let nothing = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("its address");
    let proxy = ProxyProcess::spawn(&ProxyConfig::on(&store, &format!("http://{nothing}"))).await;
    let output = plain(&[&proxy.url]).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("GET /count/") && stderr.contains("502"),
        "{stderr}"
    );
}

#[tokio::test]
async fn list_names_at_least_sixty_cases_and_service_prints_the_counting_service() {
    let list = plain(&["--list"]).await;
    assert_eq!(list.status.code(), Some(0));
    let text = String::from_utf8_lossy(&list.stdout);
    let cases = text
        .lines()
        .filter(|l| l.contains("required") || l.contains("recommended") || l.contains("beyond"))
        .count();
    assert!(cases >= 60, "{text}");
    let service = plain(&["--service"]).await;
    let text = String::from_utf8_lossy(&service.stdout);
    assert!(
        text.contains("GET /count/") && text.contains("fail_first") && text.contains("X-Execution"),
        "{text}"
    );
}

#[tokio::test]
async fn an_unknown_case_or_a_bad_header_is_refused_before_anything_is_sent() {
    let output = plain(&["http://127.0.0.1:9", "--case", "no-such-case"]).await;
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no case `no-such-case`"));
    let output = plain(&["http://127.0.0.1:9", "--header", "no colon"]).await;
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("Name: value"));
    let output = plain(&["https://127.0.0.1:9"]).await;
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("http://"));
    for own in [
        "Authorization: Bearer mine",
        "Idempotency-Key: k",
        "Content-Length: 0",
        "Host: evil.example",
    ] {
        let output = plain(&["http://127.0.0.1:9", "--header", own]).await;
        assert_eq!(output.status.code(), Some(2), "{own}");
        assert!(
            String::from_utf8_lossy(&output.stderr).contains("the suite sets"),
            "{own}"
        );
    }
    let output = plain(&["http://u:p@127.0.0.1:9/"]).await;
    assert_eq!(output.status.code(), Some(2));
    let output = plain(&[
        "http://127.0.0.1:9",
        "--demo-upstream",
        "127.0.0.1:0",
        "--counts",
        "http://127.0.0.1:9",
    ])
    .await;
    assert!(String::from_utf8_lossy(&output.stderr).contains("one of them"));
    let output = plain(&["http://127.0.0.1:9", "--timeout", "0s"]).await;
    assert!(String::from_utf8_lossy(&output.stderr).contains("--timeout"));
}

#[tokio::test]
async fn a_report_path_that_cannot_be_written_is_refused_before_the_run() {
    let (_demo, demo_url) = demo_upstream().await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let output = plain(&[&demo_url, "--json", dir.path().to_str().expect("a path")]).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--json"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&output.stdout).is_empty(),
        "it ran:\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
}

#[tokio::test]
async fn with_counts_the_executions_are_asked_of_the_service_and_a_target_that_does_not_reach_it_is_refused()
{
    // The target is one demo service; --counts names another, which the target does not forward to.
    // A target that reported counts of its own choosing would be believed without --counts; with it,
    // the counts are the service's, and a request through the target that it never counts ends the
    // run before any case.
    let (_target, target_url) = demo_upstream().await;
    let (_service, service_url) = demo_upstream().await;
    let output = plain(&[&target_url, "--counts", &service_url]).await;
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("does not forward to it"), "{stderr}");
    assert!(String::from_utf8_lossy(&output.stdout).is_empty());
    // Where the target does reach it, the run says the counts are the service's.
    let store = TestStore::create(Backend::Sqlite).await;
    let proxy = ProxyProcess::spawn(&ProxyConfig::on(&store, &service_url)).await;
    let run = conformance(&[
        &proxy.url,
        "--counts",
        &service_url,
        "--case",
        "retries-execute-once",
    ])
    .await;
    assert_eq!(run.code, Some(0), "{}", run.table);
    let at = service_url.trim_start_matches("http://");
    assert!(
        run.table
            .contains(&format!("counted from the counting service at {at}")),
        "{}",
        run.table
    );
}

#[tokio::test]
async fn a_run_that_cannot_start_leaves_an_earlier_report_as_it_was() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let earlier = dir.path().join("report.json");
    std::fs::write(&earlier, "{\"earlier\": true}").expect("an earlier report");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("its address");
    let output = plain(&[
        &format!("http://{closed}"),
        "--json",
        earlier.to_str().expect("a path"),
    ])
    .await;
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        std::fs::read_to_string(&earlier).expect("still there"),
        "{\"earlier\": true}"
    );
}

#[tokio::test]
async fn a_target_that_refuses_a_reused_key_and_executes_it_a_moment_later_fails() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let (_demo, demo_url) = demo_upstream().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/conformance/late_target.py");
    let mut late = tokio::process::Command::new("python3")
        .args([script, &demo_url])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs the late target");
    let mut lines = BufReader::new(late.stdout.take().expect("its stdout")).lines();
    let first = lines.next_line().await.expect("read").expect("its port line");
    let port = first.strip_prefix("PORT ").expect("PORT <n>");
    let run = conformance(&[
        &format!("http://127.0.0.1:{port}"),
        "--counts",
        &demo_url,
        "--case",
        "mismatch-not-executed",
        "--case",
        "mismatch-422",
    ])
    .await;
    // The 422 is what the draft asks for; the execution behind it is what the suite must see.
    assert_eq!(
        run.with_outcome("pass"),
        vec!["mismatch-422".to_owned()],
        "{}",
        run.table
    );
    let seen = run.case("mismatch-not-executed")["seen"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(seen.contains("executed it 2 times"), "{seen}");
}
