//! Errors that say what to do, from the real binary: Kubernetes service-link variables are left out of
//! the configuration (and a misspelt variable is still an error), an unknown key gets the one meant, a
//! listener that cannot bind is named, and `check-config` warns about risky settings.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::cli::{assert_one_line_naming, config_file, idemproxy, stderr};
use crate::support::proxy::binary;
use crate::support::{Backend, Reply, TestEnv, keyed_post};

/// What Kubernetes sets in every pod of a namespace holding a Service `idemproxy` with the ports `http`
/// (8080) and `admin` (9090), values as it writes them.
const SERVICE_LINKS: [(&str, &str); 13] = [
    ("IDEMPROXY_SERVICE_HOST", "10.96.0.12"),
    ("IDEMPROXY_SERVICE_PORT", "8080"),
    ("IDEMPROXY_SERVICE_PORT_HTTP", "8080"),
    ("IDEMPROXY_SERVICE_PORT_ADMIN", "9090"),
    ("IDEMPROXY_PORT", "tcp://10.96.0.12:8080"),
    ("IDEMPROXY_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
    ("IDEMPROXY_PORT_8080_TCP_PROTO", "tcp"),
    ("IDEMPROXY_PORT_8080_TCP_PORT", "8080"),
    ("IDEMPROXY_PORT_8080_TCP_ADDR", "10.96.0.12"),
    ("IDEMPROXY_PORT_9090_TCP", "tcp://10.96.0.12:9090"),
    ("IDEMPROXY_PORT_9090_TCP_PROTO", "tcp"),
    ("IDEMPROXY_PORT_9090_TCP_PORT", "9090"),
    ("IDEMPROXY_PORT_9090_TCP_ADDR", "10.96.0.12"),
];

const BOUND: Duration = Duration::from_secs(30);

fn json_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let start = line.find(&format!("\"{name}\":\""))? + name.len() + 4;
    line[start..].split('"').next()
}

#[tokio::test]
async fn kubernetes_service_link_variables_do_not_stop_the_proxy_and_are_named_once() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let file = config_file(&env.config().to_toml());
    let mut command = binary();
    command
        .args(["serve", "--config"])
        .arg(file.path())
        .envs(SERVICE_LINKS)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("the binary starts");
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let address = tokio::time::timeout(BOUND, async {
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push(line.clone());
            if line.contains("proxy listening") {
                return json_field(&line, "addr").map(str::to_owned);
            }
        }
        None
    })
    .await;
    let Ok(Some(address)) = address else {
        panic!(
            "the proxy did not start with the service-link variables set:\n{}",
            seen.join("\n")
        );
    };
    let notes: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("service-link variables"))
        .collect();
    assert_eq!(notes.len(), 1, "one note at start: {seen:#?}");
    for (name, _) in SERVICE_LINKS {
        assert!(notes[0].contains(name), "the note names {name}: {}", notes[0]);
    }

    let url = format!("http://{address}");
    let reply = tokio::time::timeout(BOUND, async {
        loop {
            let request = keyed_post(&url, "/orders", "k8s-1", "{}");
            if let Ok(reply) = Reply::try_of(request).await {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the proxy serves");
    assert_eq!(reply.status, 201);
    assert!(
        Reply::of(keyed_post(&url, "/orders", "k8s-1", "{}"))
            .await
            .is_replay()
    );
    child.start_kill().expect("stop the proxy");
}

#[tokio::test]
async fn a_misspelt_variable_beside_the_service_links_still_exits_64_naming_it_and_the_one_meant() {
    let mut env: Vec<(&str, &str)> = SERVICE_LINKS.to_vec();
    env.push(("IDEMPROXY_SERVR__LISTEN", "127.0.0.1:0"));
    let output = idemproxy(&["serve"], &env).await;
    assert_one_line_naming(
        &output,
        &[
            "IDEMPROXY_SERVR__LISTEN",
            "did you mean IDEMPROXY_SERVER__LISTEN?",
        ],
    );
    let nested = idemproxy(&["check-config"], &[("IDEMPROXY_STORE__POOL_SIZ", "3")]).await;
    assert_one_line_naming(
        &nested,
        &[
            "store.pool_siz",
            "IDEMPROXY_STORE__POOL_SIZ",
            "did you mean IDEMPROXY_STORE__POOL_SIZE?",
        ],
    );
}

#[tokio::test]
async fn an_unknown_key_in_the_file_gets_the_nearest_known_key_not_the_whole_list() {
    let file = config_file("[server]\nlisen = \"127.0.0.1:0\"\n");
    let output = idemproxy(&["check-config", "--config", file.path().to_str().unwrap()], &[]).await;
    assert_one_line_naming(&output, &["server.lisen", "did you mean \"listen\"?"]);
    assert!(
        !stderr(&output).contains("admin_listen"),
        "not every field: {}",
        stderr(&output)
    );

    let route =
        config_file("[[routes]]\nname = \"a\"\npath = \"/a\"\nfingerprint_header = [\"content-type\"]\n");
    let output = idemproxy(&["check-config", "--config", route.path().to_str().unwrap()], &[]).await;
    assert_one_line_naming(
        &output,
        &[
            "routes[0].fingerprint_header",
            "did you mean \"fingerprint_headers\"?",
        ],
    );

    let far = config_file("[upstream]\nretries = 3\n");
    let output = idemproxy(&["check-config", "--config", far.path().to_str().unwrap()], &[]).await;
    assert_one_line_naming(&output, &["upstream.retries", "no known key is like it"]);
}

#[tokio::test]
async fn a_listener_whose_port_is_taken_is_named_with_what_to_do() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port to occupy");
    let address = taken.local_addr().expect("address").to_string();
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!("sqlite://{}", dir.path().join("idemproxy.db").display());
    for (flag, key, other) in [
        ("--listen", "server.listen", "--admin-listen"),
        ("--admin-listen", "server.admin_listen", "--listen"),
    ] {
        let args = ["serve", flag, &address, other, "127.0.0.1:0", "--store", &store];
        let output = idemproxy(&args, &[("IDEMPROXY_LOG__FORMAT", "json")]).await;
        assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
        let said = stderr(&output);
        assert!(
            said.contains(&format!("cannot listen on {key} = {address}")),
            "{said}"
        );
        assert!(said.contains("another process is listening there"), "{said}");
        assert!(
            said.contains(&format!("give {key} a free port ({flag}")),
            "{said}"
        );
    }
    drop(taken);
}

#[tokio::test]
async fn check_config_warns_about_risky_settings_and_fails_on_them_only_when_asked() {
    let risky = config_file(
        "[store]\non_error = \"fail_open\"\n\
         [[routes]]\nname = \"a\"\npath = \"/a\"\nscope = \"shared\"\n\
         [[routes]]\nname = \"b\"\npath = \"/b\"\nscope = \"shared\"\nfingerprint_body = \"json\"\n",
    );
    let path = risky.path().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", path], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let printed = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        printed.starts_with("# warning: store.on_error: \"fail_open\""),
        "{printed}"
    );
    assert!(
        printed.contains("# warning: routes[1].scope: routes \"a\" and \"b\" share the scope \"shared\""),
        "{printed}"
    );
    assert!(printed.contains("fingerprint_body"), "{printed}");
    printed
        .parse::<toml::Table>()
        .expect("still the effective config as TOML");

    let denied = idemproxy(&["check-config", "--config", path, "--deny-warnings"], &[]).await;
    assert_eq!(denied.status.code(), Some(64));
    assert!(stderr(&denied).contains("2 warning(s)"), "{}", stderr(&denied));

    let plain = idemproxy(&["check-config", "--deny-warnings"], &[]).await;
    assert_eq!(plain.status.code(), Some(0), "the defaults warn about nothing");
    assert!(!String::from_utf8_lossy(&plain.stdout).contains("# warning"));

    let links = idemproxy(&["check-config"], &SERVICE_LINKS).await;
    assert_eq!(links.status.code(), Some(0), "{}", stderr(&links));
    assert!(
        String::from_utf8_lossy(&links.stdout).contains("# note: ignoring Kubernetes service-link variables"),
        "{}",
        String::from_utf8_lossy(&links.stdout)
    );
}

#[tokio::test]
async fn a_syntax_error_names_its_line_and_column_but_never_echoes_the_line() {
    let secret = "k1-never-echoed-0123456789";
    for text in [
        format!("[encryption]\nkeys = {{ k1 = \"{secret}\n"),
        format!("[encryption]\nkeys = {{ k1 = \"{secret}\" \nactive_key = = \"k1\"\n"),
        format!("[store]\nurl = \"postgres://u:{secret}@db/x\" x\n"),
    ] {
        let file = config_file(&text);
        let path = file.path().to_str().unwrap();
        for command in ["check-config", "serve"] {
            let output = idemproxy(&[command, "--config", path], &[]).await;
            assert_one_line_naming(&output, &["config", "line ", "column "]);
            let line = stderr(&output);
            assert!(
                !line.contains(secret),
                "{command}: the line is never echoed: {line}"
            );
            assert!(!line.contains(" | "), "{command}: no quoted source: {line}");
        }
    }
}

#[tokio::test]
async fn a_value_of_the_wrong_type_is_named_by_its_key_and_never_echoed() {
    let secret = "c2VjcmV0LWtleS1uZXZlci1lY2hvZWQtMDEyMzQ1Njc4OQ==";
    let file = config_file(&format!("[encryption]\nkeys = \"{secret}\"\n"));
    let path = file.path().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", path], &[]).await;
    assert_one_line_naming(&output, &["encryption.keys", "a string of"]);
    assert!(!stderr(&output).contains(secret), "{}", stderr(&output));
    let traces = config_file("[traces]\nheaders = \"authorization=Bearer tok-never-echoed\"\n");
    let path = traces.path().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", path], &[]).await;
    assert_one_line_naming(&output, &["traces.headers"]);
    assert!(
        !stderr(&output).contains("tok-never-echoed"),
        "{}",
        stderr(&output)
    );
    let output = idemproxy(&["check-config"], &[("IDEMPROXY_ENCRYPTION__KEYS", secret)]).await;
    assert_one_line_naming(&output, &["encryption.keys"]);
    assert!(!stderr(&output).contains(secret), "{}", stderr(&output));
}
