//! The binary run as a command, as an operator runs it: to its exit, with a config file to point it at,
//! and the `keys` runbook against a test's store.

use std::process::Output;

use super::proxy::binary;
use super::store::TestStore;

/// `idemproxy ARGS` with `env` set, run to its exit.
pub async fn idemproxy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = binary();
    command.args(args);
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().await.expect("the binary runs")
}

/// A temporary TOML file holding `text`, removed on drop.
pub fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("temp config");
    std::io::Write::write_all(&mut file, text.as_bytes()).expect("temp config written");
    file
}

/// `idemproxy keys --store URL ARGS` against `store`, with the store's own variables.
pub async fn keys(store: &TestStore, args: &[&str]) -> Output {
    keys_with(store, &["--store", &store.url()], args).await
}

/// `idemproxy keys WHERE ARGS` with the store's own variables; `WHERE` names the store (`--store URL`
/// or `--config FILE`).
pub async fn keys_with(store: &TestStore, at: &[&str], args: &[&str]) -> Output {
    let mut full = vec!["keys"];
    full.extend_from_slice(at);
    full.extend_from_slice(args);
    let env = store.cli_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    idemproxy(&full, &env).await
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Standard output as JSON; panics with both streams when it is not.
pub fn json(output: &Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            stdout(output),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// A configuration the binary refuses: exit status 64 and one line on stderr that says each of `wanted`.
pub fn assert_one_line_naming(output: &Output, wanted: &[&str]) {
    assert_eq!(
        output.status.code(),
        Some(64),
        "bad config exits 64: {}",
        stderr(output)
    );
    let line = stderr(output);
    assert_eq!(line.trim_end().lines().count(), 1, "one line: {line}");
    for text in wanted {
        assert!(line.contains(text), "the line says {text}: {line}");
    }
}
