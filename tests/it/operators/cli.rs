//! The binary's configuration surface: layering, one-line errors with exit status 64, masked secrets.

use crate::support::cli::{assert_one_line_naming, config_file, idemproxy};
use crate::support::proxy::binary;

fn path(file: &tempfile::NamedTempFile) -> &str {
    file.path().to_str().expect("temp path is UTF-8")
}

#[tokio::test]
async fn bad_value_in_the_file_exits_64_naming_the_key() {
    let file = config_file("[idempotency]\nlock_timeout = \"soon\"\n");
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["idempotency.lock_timeout"]);
}

#[tokio::test]
async fn unknown_key_exits_64_naming_it() {
    let file = config_file("[upstream]\nurl = \"http://127.0.0.1:1\"\nretries = 3\n");
    let output = idemproxy(&["serve", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["retries"]);
}

#[tokio::test]
async fn bad_environment_value_exits_64_naming_the_key() {
    let output = idemproxy(&["check-config"], &[("IDEMPROXY_STORE__POOL_SIZE", "many")]).await;
    assert_one_line_naming(&output, &["store.pool_size"]);
}

#[tokio::test]
async fn batch_size_out_of_range_exits_64_naming_the_key() {
    let file = config_file("[store]\nmax_batch = 0\n");
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["store.max_batch"]);
}

#[tokio::test]
async fn missing_config_file_exits_64() {
    let output = idemproxy(&["check-config", "--config", "/nonexistent/idemproxy.toml"], &[]).await;
    assert_one_line_naming(&output, &["/nonexistent/idemproxy.toml"]);
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

const KEY_32: &str = "ERERERERERERERERERERERERERERERERERERERERERE=";

#[tokio::test]
async fn check_config_masks_encryption_keys_from_file_and_environment() {
    let file = config_file(&format!(
        "[encryption]\nactive_key = \"k1\"\nkeys = {{ k1 = \"{KEY_32}\" }}\n"
    ));
    let output = idemproxy(
        &["check-config", "--config", path(&file)],
        &[("IDEMPROXY_ENCRYPTION__KEYS__K2", KEY_32)],
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8(output.stdout).unwrap();
    assert!(!printed.contains(KEY_32), "{printed}");
    let effective: toml::Table = printed.parse().expect("prints TOML");
    let keys = effective["encryption"]["keys"].as_table().expect("keys table");
    assert_eq!(keys["k1"].as_str(), Some("***"));
    assert_eq!(keys["k2"].as_str(), Some("***"), "the environment adds a key");
    assert_eq!(effective["encryption"]["active_key"].as_str(), Some("k1"));
}

#[tokio::test]
async fn an_encryption_key_of_the_wrong_length_exits_64_naming_it() {
    let file = config_file("[encryption]\nactive_key = \"k1\"\nkeys = { k1 = \"c2hvcnQ=\" }\n");
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["encryption.keys.k1"]);
    assert!(!String::from_utf8_lossy(&output.stderr).contains("c2hvcnQ="));
    let output = idemproxy(&["check-config"], &[("IDEMPROXY_ENCRYPTION__ACTIVE_KEY", "k9")]).await;
    assert_one_line_naming(&output, &["encryption.active_key"]);
}

#[tokio::test]
async fn a_config_file_that_is_not_utf8_exits_64_on_one_line() {
    let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(&mut file, b"[server]\nlisten = \"\xff\xfe\"\n").unwrap();
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["config"]);
    let file = config_file("[idempotency]\nheader = \"Idem\\u0001Key\"\n");
    let output = idemproxy(&["check-config", "--config", path(&file)], &[]).await;
    assert_one_line_naming(&output, &["idempotency.header"]);
}

#[tokio::test]
async fn an_environment_value_that_is_not_utf8_exits_64_naming_the_key() {
    use std::os::unix::ffi::OsStrExt;
    let output = binary()
        .arg("check-config")
        .env(
            "IDEMPROXY_SERVER__LISTEN",
            std::ffi::OsStr::from_bytes(b"127.0.0.1:\xff"),
        )
        .output()
        .await
        .expect("the binary runs");
    assert_one_line_naming(&output, &["server.listen"]);
}

/// Runs `program` with `args`, `input` on its standard input, to its exit.
fn run_with_input(program: &str, args: &[&str], input: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// The checkout's commit as `git rev-parse --short HEAD` gives it, when built in one.
fn checkout_commit() -> Option<String> {
    let output = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

#[tokio::test]
async fn version_names_the_commit_the_profile_and_the_features() {
    let output = idemproxy(&["--version"], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let printed = String::from_utf8(output.stdout).unwrap();
    let commit = checkout_commit().unwrap_or_else(|| "unknown".to_owned());
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let features = if cfg!(feature = "otlp") { "otlp" } else { "none" };
    let version = env!("CARGO_PKG_VERSION");
    let clean = format!("idemproxy {version} (commit {commit}, {profile} build, features: {features})\n");
    let dirty =
        format!("idemproxy {version} (commit {commit}-dirty, {profile} build, features: {features})\n");
    assert!(printed == clean || printed == dirty, "{printed:?}, not {clean:?}");
}

#[tokio::test]
async fn bash_completions_parse_and_name_the_subcommands() {
    let output = idemproxy(&["completions", "bash"], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let script = String::from_utf8(output.stdout).unwrap();
    let checked = run_with_input("bash", &["-n"], script.as_bytes());
    assert!(
        checked.status.success(),
        "bash -n: {}",
        String::from_utf8_lossy(&checked.stderr)
    );
    for subcommand in [
        "serve",
        "migrate",
        "check-config",
        "keys",
        "health",
        "completions",
        "man",
    ] {
        assert!(
            script.contains(subcommand),
            "{subcommand} in the bash completions"
        );
    }
    assert!(script.contains("complete -F"), "registers a completion function");
    let refused = idemproxy(&["completions", "tcsh"], &[]).await;
    assert_eq!(
        refused.status.code(),
        Some(2),
        "clap refuses a shell it has no generator for"
    );
}

#[tokio::test]
async fn the_man_page_renders_with_the_subcommands() {
    let output = idemproxy(&["man"], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let roff = String::from_utf8(output.stdout).unwrap();
    assert!(roff.contains(".TH idemproxy 1"), "a section-1 page: {roff}");
    let rendered = if std::process::Command::new("man")
        .arg("--version")
        .output()
        .is_ok()
    {
        let man = run_with_input("man", &["-P", "cat", "-l", "-"], roff.as_bytes());
        assert!(
            man.status.success(),
            "man -l: {}",
            String::from_utf8_lossy(&man.stderr)
        );
        String::from_utf8_lossy(&man.stdout).into_owned()
    } else {
        roff
    };
    for named in [
        "idemproxy",
        "serve",
        "check-config",
        "completions",
        "Idempotency sidecar",
    ] {
        assert!(rendered.contains(named), "{named} on the page: {rendered}");
    }
}
