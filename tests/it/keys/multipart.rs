//! File uploads (`multipart/form-data`) retried as clients retry them: httpx draws a new boundary for
//! every request, so the retry's body and `Content-Type` differ from the first attempt's in the boundary
//! alone. The proxy counts the form by its parts, on every route whatever its `fingerprint_body`: the
//! retry is replayed, the upstream runs once, and the same key with another file is `422`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rstest::rstest;
use serde_json::Value;

use crate::support::TestEnv;
use crate::support::http::TEST_CREDENTIAL;

/// `upload.py`, the httpx client, and `requirements.txt`, httpx and what it installs with, pinned.
const PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/keys/multipart");

/// A route keyed by `Idempotency-Key` with the default fingerprint (`content-type` among its headers,
/// the body byte for byte), and one that reads bodies as JSON.
const ROUTES: &str = r#"
[[routes]]
name = "uploads"
path = "/uploads"
required = true

[[routes]]
name = "json-uploads"
path = "/json-uploads"
required = true
fingerprint_body = "json"
fingerprint_headers = ["content-type"]
"#;

/// A Python with httpx installed, in `target/test-tools/httpx` (seconds on first use).
fn httpx_python() -> PathBuf {
    crate::support::tools::python_venv("httpx", Path::new(&format!("{PROGRAMS}/requirements.txt")))
}

/// One upload through httpx of `file_text` with a form field, keyed `key`: what `upload.py` prints.
async fn upload(python: &Path, url: &str, key: &str, file_text: &str) -> Value {
    let run = tokio::process::Command::new(python)
        .arg(format!("{PROGRAMS}/upload.py"))
        .args([url, key, TEST_CREDENTIAL, file_text])
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("httpx uploads within a minute")
        .unwrap();
    assert!(
        output.status.success(),
        "upload.py: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("upload.py prints one JSON line")
}

#[rstest]
#[tokio::test]
async fn httpx_upload_retried_with_a_new_boundary_is_replayed_and_another_file_is_422(
    #[values("/uploads", "/json-uploads")] path: &str,
) {
    let python = tokio::task::spawn_blocking(httpx_python).await.unwrap();
    let (env, proxy) = TestEnv::with_routes(ROUTES).await;
    let url = format!("{}{path}", proxy.url);

    let first = upload(&python, &url, "upload-1", "id,amount\n1,100\n").await;
    assert_eq!(first["status"], 201, "{first}");
    let retry = upload(&python, &url, "upload-1", "id,amount\n1,100\n").await;
    assert_ne!(
        first["content_type"], retry["content_type"],
        "httpx drew a new boundary for the retry"
    );
    assert_eq!(retry["status"], 201, "{retry}");
    assert_eq!(retry["replayed"], "true", "{retry}");
    assert_eq!(retry["body"], first["body"]);
    assert_eq!(env.upstream.executions(), 1);

    let other = upload(&python, &url, "upload-1", "id,amount\n1,999\n").await;
    assert_eq!(other["status"], 422, "{other}");
    assert!(other["body"].as_str().unwrap().contains("key-reused"), "{other}");
    assert_eq!(env.upstream.executions(), 1);

    let recorded = &env.upstream.requests()[0];
    let sent = first["content_type"].as_str().unwrap();
    assert_eq!(
        recorded.headers["content-type"], sent,
        "the upstream gets the form as sent"
    );
    let boundary = sent.split("boundary=").nth(1).unwrap();
    assert!(recorded.body.starts_with(format!("--{boundary}\r\n").as_bytes()));
}

/// A form whose `Content-Type` names its boundary twice, once in RFC 2231's extended form
/// (`boundary*=utf-8''ccc`), which Werkzeug (Flask) and Go's `mime` let win: read under `ccc`, the
/// form holds one field whose value carries the other boundary's line. Two such forms that differ in
/// that other boundary alone are two requests to the app, so the same key on the second is `422`, not
/// a replay of the first.
#[tokio::test]
async fn a_form_that_also_names_an_extended_boundary_counts_byte_for_byte() {
    let (env, proxy) = TestEnv::with_routes(ROUTES).await;
    let send = |outer: &str| {
        let body = format!(
            "--ccc\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n\
             pay\r\n--{outer}\r\n\r\nnow\r\n--ccc--\r\n--{outer}--\r\n"
        );
        crate::support::http::client()
            .post(format!("{}/uploads", proxy.url))
            .header("authorization", TEST_CREDENTIAL)
            .header("idempotency-key", "extended-boundary")
            .header(
                "content-type",
                format!("multipart/form-data; boundary={outer}; boundary*=utf-8''ccc"),
            )
            .body(body)
    };
    let first = crate::support::Reply::of(send("100")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let other = crate::support::Reply::of(send("999")).await;
    assert_eq!(other.status, 422, "{}", other.text());
    assert!(other.text().contains("key-reused"), "{}", other.text());
    let same = crate::support::Reply::of(send("100")).await;
    assert!(same.is_replay(), "{:?}", same.headers);
    assert_eq!(env.upstream.executions(), 1);
}
