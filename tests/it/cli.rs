//! The binary's configuration surface: layering, one-line errors with exit status 64, masked secrets.

use std::process::Output;

use tokio::process::Command;

pub async fn idemproxy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemproxy"));
    command.args(args).env_remove("RUST_LOG");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().await.expect("the binary runs")
}

/// A temporary TOML file holding `text`, removed on drop.
fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp config");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("temp config written");
    file
}

fn path(file: &tempfile::NamedTempFile) -> &str {
    file.path().to_str().expect("temp path is UTF-8")
}

fn assert_one_line_naming(output: &Output, key: &str) {
    assert_eq!(output.status.code(), Some(64), "bad config exits 64");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(key), "the line names {key}: {stderr}");
}

#[tokio::test]
async fn bad_value_in_the_file_exits_64_naming_the_key() {
    let file = config_file("[idempotency]\nlock_timeout = \"soon\"\n");
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, "idempotency.lock_timeout");
}

#[tokio::test]
async fn unknown_key_exits_64_naming_it() {
    let file = config_file("[upstream]\nurl = \"http://127.0.0.1:1\"\nretries = 3\n");
    let output = idemproxy(&["serve", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, "retries");
}

#[tokio::test]
async fn bad_environment_value_exits_64_naming_the_key() {
    let output = idemproxy(&["check-config"], &[("IDEMPROXY_STORE__POOL_SIZE", "many")]).await;
    assert_one_line_naming(&output, "store.pool_size");
}

#[tokio::test]
async fn missing_config_file_exits_64() {
    let output = idemproxy(&["check-config", "--config", "/nonexistent/idemproxy.toml"], &[]).await;
    assert_one_line_naming(&output, "/nonexistent/idemproxy.toml");
}

#[tokio::test]
async fn flags_override_environment_which_overrides_the_file() {
    let file = config_file(
        "[upstream]\nurl = \"http://127.0.0.1:1000\"\n[server]\nlisten = \"127.0.0.1:1001\"\n\
         [idempotency]\nttl = \"2h\"\n",
    );
    let output = idemproxy(
        &[
            "check-config",
            "--config",
            path(&file),
            "--listen",
            "127.0.0.1:3003",
        ],
        &[
            ("IDEMPROXY_UPSTREAM__URL", "http://127.0.0.1:2000"),
            ("IDEMPROXY_SERVER__LISTEN", "127.0.0.1:2001"),
        ],
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let effective: toml::Table = String::from_utf8(output.stdout)
        .unwrap()
        .parse()
        .expect("prints TOML");
    assert_eq!(
        effective["upstream"]["url"].as_str(),
        Some("http://127.0.0.1:2000"),
        "env over file"
    );
    assert_eq!(
        effective["server"]["listen"].as_str(),
        Some("127.0.0.1:3003"),
        "flag over env"
    );
    assert_eq!(
        effective["idempotency"]["ttl"].as_str(),
        Some("2h"),
        "file over default"
    );
    assert_eq!(
        effective["idempotency"]["lock_timeout"].as_str(),
        Some("30s"),
        "default"
    );
}

#[tokio::test]
async fn check_config_masks_the_store_password() {
    let output = idemproxy(
        &[
            "check-config",
            "--store",
            "postgres://app:hunter2@db.internal:5432/idem",
        ],
        &[],
    )
    .await;
    assert!(output.status.success());
    let printed = String::from_utf8(output.stdout).unwrap();
    assert!(!printed.contains("hunter2"), "{printed}");
    assert!(
        printed.contains("postgres://app:***@db.internal:5432/idem"),
        "{printed}"
    );
}

#[tokio::test]
async fn example_config_is_valid() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/idemproxy.toml");
    let output = idemproxy(&["check-config", "--config", example], &[]).await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
