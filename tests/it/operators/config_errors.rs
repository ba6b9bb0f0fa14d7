//! Errors that say what to do, from the real binary: Kubernetes service-link variables are left out of
//! the configuration (and a misspelt variable is still an error), an unknown key gets the one meant, a
//! listener that cannot bind is named, and `check-config` warns about risky settings. Every mistake of a
//! run is reported in that run, one line each, types in words; a missing file gives the OS's reason;
//! `IDEMPROXY_CONFIG` names the file; a configuration naming no upstream is warned about; `store.url`
//! takes libpq's sslmodes; `:PORT` and `localhost:PORT` listen.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::cli::{assert_one_line_naming, config_file, idemproxy, stderr, stdout};
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
    let named = ["--upstream", "http://127.0.0.1:3000"];
    let output = idemproxy(&["check-config", "--config", path, named[0], named[1]], &[]).await;
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

    let denied = idemproxy(
        &[
            "check-config",
            "--config",
            path,
            "--deny-warnings",
            named[0],
            named[1],
        ],
        &[],
    )
    .await;
    assert_eq!(denied.status.code(), Some(64));
    assert!(stderr(&denied).contains("2 warning(s)"), "{}", stderr(&denied));

    let plain = idemproxy(&["check-config", "--deny-warnings", named[0], named[1]], &[]).await;
    assert_eq!(
        plain.status.code(),
        Some(0),
        "the defaults, with an upstream, warn about nothing"
    );
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

/// A configuration the binary refuses with several problems: exit 64 and one line for each of `wanted`
/// (each line holding every text of its entry), and no other line.
fn assert_lines_naming(output: &std::process::Output, wanted: &[&[&str]]) {
    assert_eq!(output.status.code(), Some(64), "{}", stderr(output));
    let said = stderr(output);
    let lines: Vec<&str> = said.trim_end().lines().collect();
    assert_eq!(lines.len(), wanted.len(), "one line per problem: {said}");
    for texts in wanted {
        assert!(
            lines.iter().any(|line| texts.iter().all(|t| line.contains(t))),
            "a line says {texts:?}: {said}"
        );
    }
    for word in ["usize", "u64", "u16", "i64", "``"] {
        assert!(
            !said.contains(word),
            "no Rust type or doubled quote {word}: {said}"
        );
    }
}

#[tokio::test]
async fn every_mistake_in_a_file_is_reported_in_one_run_each_on_its_own_line_naming_the_file() {
    let file = config_file(
        "[server]\nlisen = \"127.0.0.1:0\"\nwrokers = 2\n\
         [store]\npool_size = \"many\"\n\
         [upstream]\nprotocol = \"http3\"\n\
         [sweeper]\nbatch_size = 0\n",
    );
    let path = file.path().to_str().unwrap();
    for command in ["check-config", "serve"] {
        let output = idemproxy(&[command, "--config", path], &[]).await;
        assert_lines_naming(
            &output,
            &[
                &["server.lisen", "did you mean \"listen\"?", path],
                &["server.wrokers", "did you mean \"workers\"?", path],
                &["store.pool_size", "expected a whole number (0 or more)", path],
                &[
                    "upstream.protocol",
                    "\"http3\" is not one of \"http1\", \"h2c\", \"auto\"",
                    path,
                ],
                &["sweeper.batch_size", "must be", path],
            ],
        );
    }
}

#[tokio::test]
async fn mistakes_from_variables_and_flags_are_reported_with_the_files_and_name_where_each_came_from() {
    let file = config_file("[idempotency]\nttl = 5\n");
    let path = file.path().to_str().unwrap();
    let output = idemproxy(
        &["check-config", "--config", path, "--listen", "nowhere"],
        &[
            ("IDEMPROXY_SERVER_LISTEN", "127.0.0.1:0"),
            ("IDEMPROXY_STORE__MAX_BATCH", "0"),
            ("IDEMPROXY_REPLAY_CACHE_MAX_SIZE", "1MiB"),
        ],
    )
    .await;
    assert_lines_naming(
        &output,
        &[
            &["idempotency.ttl", "expected a duration", path],
            &[
                "IDEMPROXY_SERVER_LISTEN",
                "did you mean IDEMPROXY_SERVER__LISTEN?",
            ],
            &[
                "IDEMPROXY_REPLAY_CACHE_MAX_SIZE",
                "did you mean IDEMPROXY_REPLAY_CACHE__MAX_SIZE?",
            ],
            &["server.listen", "\"nowhere\"", "(from --listen)"],
            &["store.max_batch", "(from IDEMPROXY_STORE__MAX_BATCH)"],
        ],
    );
}

#[tokio::test]
async fn a_missing_config_file_is_named_with_the_reason_the_os_gives() {
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("idemproxy.toml");
    let missing = missing.to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", missing], &[]).await;
    assert_one_line_naming(&output, &[missing, "No such file or directory (os error 2)"]);
    let output = idemproxy(&["serve"], &[("IDEMPROXY_CONFIG", missing)]).await;
    assert_one_line_naming(&output, &[missing, "No such file or directory (os error 2)"]);
    let output = idemproxy(&["check-config", "--config", dir.path().to_str().unwrap()], &[]).await;
    assert_one_line_naming(&output, &["Is a directory (os error 21)"]);
}

/// A configuration given through a pipe (`--config <(…)`, `/dev/stdin`) is read once: reading it twice
/// found the pipe empty the second time and ran on the defaults (a local SQLite store), exit 0.
#[tokio::test]
async fn a_configuration_piped_in_is_the_one_used_not_the_defaults() {
    use tokio::io::AsyncWriteExt;
    let mut command = binary();
    command
        .args(["check-config", "--config", "/dev/stdin"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("the binary starts");
    let mut stdin = child.stdin.take().expect("piped");
    stdin
        .write_all(b"[upstream]\nurl = \"http://127.0.0.1:4003\"\n[server]\nlisten = 5\n")
        .await
        .expect("written");
    drop(stdin);
    let output = tokio::time::timeout(BOUND, child.wait_with_output())
        .await
        .expect("check-config ends")
        .expect("the binary runs");
    assert_one_line_naming(&output, &["server.listen", "found a number", "/dev/stdin"]);
}

/// An endless file (`/dev/zero`) is refused after a bounded read, not read until memory runs out.
#[tokio::test]
async fn an_endless_config_file_is_refused_after_a_bounded_read() {
    let output = tokio::time::timeout(BOUND, idemproxy(&["check-config", "--config", "/dev/zero"], &[]))
        .await
        .expect("check-config ends");
    assert_one_line_naming(&output, &["/dev/zero", "larger than 16 MiB"]);
}

/// The admin listener on the proxy listener's port can never start: `check-config` said the
/// configuration was good (exit 0) and `serve` blamed "another process" for the port it took itself.
#[tokio::test]
async fn the_admin_listener_on_the_proxy_listeners_port_is_a_config_error() {
    for (listen, admin) in [(":18431", ":18431"), (":18432", "localhost:18432")] {
        let output = idemproxy(
            &["check-config", "--listen", listen, "--admin-listen", admin],
            &[],
        )
        .await;
        assert_one_line_naming(
            &output,
            &["server.admin_listen", "(from --admin-listen)", "server.listen"],
        );
    }
}

/// A wrong item in a list (`methods = ["POST", 5]`) stopped the search: the other mistakes of the file
/// went unreported, and the item's line named no file.
#[tokio::test]
async fn a_wrong_item_in_a_list_does_not_hide_the_other_mistakes() {
    let file = config_file(
        "[server]\nlisten = \"bad\"\n[store]\npool_size = \"x\"\n[idempotency]\nmethods = [\"POST\", 5]\n",
    );
    let name = file.path().file_name().unwrap().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", file.path().to_str().unwrap()], &[]).await;
    assert_eq!(output.status.code(), Some(64), "{}", stderr(&output));
    let said = stderr(&output);
    for key in ["idempotency.methods[1]", "store.pool_size", "server.listen"] {
        let line = said.lines().find(|l| l.contains(key));
        let line = line.unwrap_or_else(|| panic!("{key} is reported: {said}"));
        assert!(line.contains(name), "{key}'s line names the file: {said}");
    }
    assert_eq!(said.trim_end().lines().count(), 3, "{said}");
}

/// A named pipe nothing writes to: opening it blocks until a writer comes, so `check-config` and `serve`
/// would wait forever, silent; they give up after a few seconds, saying so. (A pipe with a writer,
/// `--config <(…)`, keeps working.)
#[tokio::test]
async fn a_named_pipe_nothing_writes_to_is_refused_not_waited_on_forever() {
    let dir = tempfile::tempdir().expect("temp dir");
    let fifo = dir.path().join("idemproxy.toml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let fifo = fifo.to_str().unwrap();
    let mut command = binary();
    command
        .args(["check-config", "--config", fifo])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(10), command.output())
        .await
        .expect("check-config answers within 10s instead of waiting for a writer")
        .expect("the binary runs");
    assert_one_line_naming(&output, &[fifo]);
}

#[tokio::test]
async fn idemproxy_config_names_the_file_unless_config_is_given() {
    let from_variable = config_file("[upstream]\nurl = \"http://127.0.0.1:4001\"\n");
    let from_flag = config_file("[upstream]\nurl = \"http://127.0.0.1:4002\"\n");
    let variable = [("IDEMPROXY_CONFIG", from_variable.path().to_str().unwrap())];
    let output = idemproxy(&["check-config"], &variable).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(stdout(&output).contains("127.0.0.1:4001"), "{}", stdout(&output));
    let flag = from_flag.path().to_str().unwrap();
    let output = idemproxy(&["check-config", "--config", flag], &variable).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    assert!(
        stdout(&output).contains("127.0.0.1:4002"),
        "the flag wins: {}",
        stdout(&output)
    );
}

#[tokio::test]
async fn a_configuration_naming_no_upstream_is_a_check_config_warning() {
    let output = idemproxy(&["check-config"], &[]).await;
    assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));
    let printed = stdout(&output);
    assert!(
        printed.starts_with(
            "# warning: upstream.url: not set, so requests go to the default http://127.0.0.1:3000"
        ),
        "{printed}"
    );
    for fix in ["--upstream", "IDEMPROXY_UPSTREAM__URL"] {
        assert!(printed.contains(fix), "{printed}");
    }
    let denied = idemproxy(&["check-config", "--deny-warnings"], &[]).await;
    assert_eq!(denied.status.code(), Some(64), "{}", stderr(&denied));
    for named in [
        idemproxy(&["check-config", "--upstream", "http://127.0.0.1:3000"], &[]).await,
        idemproxy(
            &["check-config"],
            &[("IDEMPROXY_UPSTREAM__URL", "http://127.0.0.1:3000")],
        )
        .await,
    ] {
        assert!(
            !stdout(&named).contains("upstream.url: not set"),
            "{}",
            stdout(&named)
        );
    }
}

#[tokio::test]
async fn store_url_takes_libpqs_sslmodes_and_refuses_others() {
    for mode in [
        "disable",
        "allow",
        "prefer",
        "require",
        "verify-ca",
        "verify-full",
    ] {
        let url = format!("postgres://app@127.0.0.1/idem?sslmode={mode}");
        let ca = config_file("");
        // verify-ca trusts only store.tls_ca_file, which needs a mode that may use TLS.
        let file = match mode {
            "disable" => config_file(""),
            _ => config_file(&format!("[store]\ntls_ca_file = {:?}\n", ca.path())),
        };
        let file = file.path().to_str().unwrap();
        let output = idemproxy(&["check-config", "--store", &url, "--config", file], &[]).await;
        assert_eq!(output.status.code(), Some(0), "{mode}: {}", stderr(&output));
    }
    // With no name checked, a public CA's certificate for anyone's name would pass: verify-ca trusts
    // only store.tls_ca_file, so it must be set.
    let url = "postgres://app@127.0.0.1/idem?sslmode=verify-ca";
    let output = idemproxy(&["check-config", "--store", url], &[]).await;
    assert_one_line_naming(&output, &["store.url", "(from --store)", "store.tls_ca_file"]);
    let remote = "postgres://app@db.example.com/idem?sslmode=prefer";
    let output = idemproxy(&["check-config", "--store", remote], &[]).await;
    let printed = stdout(&output);
    assert!(
        printed.contains("# warning: store.url: the store at db.example.com is reached without TLS"),
        "{printed}"
    );
    assert!(printed.contains("write sslmode=verify-full"), "{printed}");
    let verified = "postgres://app@db.example.com/idem?sslmode=verify-full";
    let output = idemproxy(&["check-config", "--store", verified], &[]).await;
    assert!(
        !stdout(&output).contains("# warning: store.url"),
        "{}",
        stdout(&output)
    );
    let output = idemproxy(
        &[
            "check-config",
            "--store",
            "postgres://app@db/idem?sslmode=verify_full",
        ],
        &[],
    )
    .await;
    assert_one_line_naming(&output, &["store.url", "(from --store)", "verify-full"]);
}

#[tokio::test]
async fn a_bare_port_and_localhost_listen_and_serve_and_no_upstream_is_warned_about_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!("sqlite://{}", dir.path().join("idemproxy.db").display());
    let mut command = binary();
    command
        .args([
            "serve",
            "--listen",
            ":0",
            "--admin-listen",
            "localhost:0",
            "--store",
            &store,
        ])
        .env("IDEMPROXY_LOG__FORMAT", "json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("the binary starts");
    let mut lines = BufReader::new(child.stderr.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let started = tokio::time::timeout(BOUND, async {
        let (mut proxy, mut admin, mut warned) = (None, None, false);
        while let Ok(Some(line)) = lines.next_line().await {
            seen.push(line.clone());
            if line.contains("proxy listening") {
                proxy = json_field(&line, "addr").map(str::to_owned);
            }
            if line.contains("admin listening") {
                admin = json_field(&line, "addr").map(str::to_owned);
            }
            warned |= line.contains("WARN") && line.contains("upstream.url");
            if let (Some(proxy), Some(admin), true) = (&proxy, &admin, warned) {
                return Some((proxy.clone(), admin.clone()));
            }
        }
        None
    })
    .await;
    let Ok(Some((proxy, admin))) = started else {
        panic!("no listeners and upstream warning at start:\n{}", seen.join("\n"));
    };
    let port = proxy
        .strip_prefix("0.0.0.0:")
        .unwrap_or_else(|| panic!(":0 is every IPv4 interface: {proxy}"));
    assert!(admin.starts_with("127.0.0.1:"), "localhost is 127.0.0.1: {admin}");
    let health = reqwest::get(format!("http://{admin}/healthz"))
        .await
        .expect("the admin listener on localhost answers");
    assert_eq!(health.status(), 200);
    let answer = reqwest::get(format!("http://127.0.0.1:{port}/"))
        .await
        .expect("the proxy on :0 answers on loopback");
    assert!(answer.status().as_u16() >= 200, "{}", answer.status());
    child.start_kill().expect("stop the proxy");
}
