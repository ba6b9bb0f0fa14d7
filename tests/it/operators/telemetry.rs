//! What an operator reads: the metrics by route, the request duration, the build and process families;
//! the log lines (plain text in a pipe, flat JSON, the line at start); and SIGHUP sent to the real
//! binary (a filter that takes effect, settings that need a restart named, a broken file refused while
//! the proxy serves on, the listener certificate read again at once).

use crate::support::certs::{TestCa, toml_path};
use crate::support::{Backend, InProcessProxy, ProxyProcess, Reply, TestEnv, keyed_post, metric, poll_until};

/// The JSON lines the process has written, parsed.
fn json_lines(proxy: &ProxyProcess) -> Vec<serde_json::Value> {
    let stderr = proxy.stderr();
    stderr
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

/// Waits until the process has logged a JSON line saying `message`, and returns it.
async fn logged(proxy: &ProxyProcess, message: &str) -> serde_json::Value {
    poll_until(&format!("a log line saying {message:?}"), || async {
        json_lines(proxy)
            .into_iter()
            .find(|line| line["message"] == message)
    })
    .await
}

#[tokio::test]
async fn requests_are_counted_and_timed_by_route_and_outcome() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .route("name = \"payments\"\npath_prefix = \"/payments\"");
    let proxy = InProcessProxy::start(&config).await;

    let executed = Reply::of(keyed_post(&proxy.url, "/payments/1", "p1", "{}")).await;
    assert_eq!(executed.status, 201, "{}", executed.text());
    assert!(
        Reply::of(keyed_post(&proxy.url, "/payments/1", "p1", "{}"))
            .await
            .is_replay()
    );
    let elsewhere = Reply::of(keyed_post(&proxy.url, "/orders", "o1", "{}")).await;
    assert_eq!(elsewhere.status, 201);

    let admin = &proxy.admin_url;
    let requests = "idemproxy_requests_total";
    let payments = |outcome| [("route", "payments"), ("outcome", outcome)];
    assert_eq!(metric(admin, requests, &payments("executed")).await, 1.0);
    assert_eq!(metric(admin, requests, &payments("replayed")).await, 1.0);
    let default = [("route", "default"), ("outcome", "executed")];
    assert_eq!(
        metric(admin, requests, &default).await,
        1.0,
        "no route matched /orders"
    );
    let replays = [("route", "payments")];
    assert_eq!(metric(admin, "idemproxy_replays_total", &replays).await, 1.0);

    let timed = "idemproxy_request_duration_seconds_count";
    assert_eq!(metric(admin, timed, &payments("executed")).await, 1.0);
    assert_eq!(metric(admin, timed, &payments("replayed")).await, 1.0);
    assert_eq!(metric(admin, timed, &default).await, 1.0);
    let within_10s = [("route", "payments"), ("outcome", "executed"), ("le", "10")];
    let bucket = "idemproxy_request_duration_seconds_bucket";
    assert_eq!(metric(admin, bucket, &within_10s).await, 1.0);
}

#[tokio::test]
async fn the_build_and_the_process_are_described() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = InProcessProxy::start(&env.config()).await;
    let version = [("version", env!("CARGO_PKG_VERSION"))];
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_build_info", &version).await,
        1.0
    );
    let resident = metric(&proxy.admin_url, "process_resident_memory_bytes", &[]).await;
    assert!(resident > 1_000_000.0, "{resident}");
    assert!(metric(&proxy.admin_url, "process_open_fds", &[]).await >= 3.0);
    assert!(metric(&proxy.admin_url, "process_start_time_seconds", &[]).await > 1.7e9);
}

#[tokio::test]
async fn text_logs_in_a_pipe_carry_no_colour_codes() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = ProxyProcess::spawn(&env.config().set("log.format", "text")).await;
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "t1", "{}"))
            .await
            .status,
        201
    );
    let stderr = proxy.stderr();
    assert!(stderr.contains("proxy listening"), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "an escape byte in piped logs:\n{stderr:?}"
    );
}

#[tokio::test]
async fn json_logs_are_flat_and_begin_with_the_version_and_the_configuration() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("log.access", true)
        .route("name = \"payments\"\npath_prefix = \"/payments\"");
    let proxy = ProxyProcess::spawn(&config).await;

    let first = &json_lines(&proxy)[0];
    assert_eq!(first["message"], "idemproxy starting", "{first}");
    assert_eq!(first["version"], env!("CARGO_PKG_VERSION"), "{first}");
    assert_eq!(first["store"], "sqlite", "the store's kind, not its URL: {first}");
    assert_eq!(first["routes"], 1, "{first}");
    assert_eq!(first["log_format"], "json", "{first}");
    assert_eq!(first["listen"], "127.0.0.1:0", "{first}");
    let store_path = env.store.sqlite_path().display().to_string();
    assert!(!first.to_string().contains(&store_path), "{first}");

    let reply = Reply::of(keyed_post(&proxy.url, "/payments/1", "j1", "{}")).await;
    assert_eq!(reply.status, 201);
    let access = poll_until("the access line", || async {
        let lines = json_lines(&proxy).into_iter();
        lines.rev().find(|line| line["target"] == "idemproxy::access")
    })
    .await;
    assert_eq!(access["status"], 201, "status at the top level: {access}");
    assert_eq!(access["route"], "payments", "{access}");
    assert!(access.get("fields").is_none(), "{access}");
}

#[tokio::test]
async fn sighup_applies_a_new_log_filter_and_upstream_and_names_what_needs_a_restart() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let proxy = ProxyProcess::spawn(&config).await;
    let answered = |proxy: &ProxyProcess| {
        json_lines(proxy)
            .iter()
            .any(|line| line["message"] == "answered" && line["level"] == "DEBUG")
    };
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "h1", "{}"))
            .await
            .status,
        201
    );
    assert!(!answered(&proxy), "no DEBUG line at info");

    let other = crate::support::Upstream::start().await;
    let changed = config
        .set("log.filter", "info,idemproxy=debug")
        .set("upstream.url", other.url())
        .set("server.max_waiting", 7);
    std::fs::write(proxy.config_file(), changed.to_toml()).unwrap();
    proxy.hangup();
    let restart = logged(
        &proxy,
        "SIGHUP: these settings differ from the running ones and take effect only after a restart",
    )
    .await;
    assert_eq!(restart["settings"], "server.max_waiting", "{restart}");
    let applied = logged(&proxy, "SIGHUP: configuration reloaded; applied to new requests").await;
    assert_eq!(applied["settings"], "log.filter, upstream.url", "{applied}");
    logged(&proxy, "reload: log filter changed").await;

    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "h2", "{}"))
            .await
            .status,
        201
    );
    poll_until("a DEBUG line under the new filter", || async {
        answered(&proxy).then_some(())
    })
    .await;
    assert_eq!(
        other.executions_for_key("h2"),
        1,
        "the new upstream takes new requests"
    );
    assert_eq!(env.upstream.executions_for_key("h2"), 0);
    let reloads = [("result", "ok")];
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_config_reloads_total", &reloads).await,
        1.0
    );
}

#[tokio::test]
async fn sighup_with_a_broken_file_is_reported_and_the_proxy_serves_on() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let mut proxy = ProxyProcess::spawn(&config).await;
    std::fs::write(proxy.config_file(), "[upstream]\ntimeout = \"soon\"\n").unwrap();
    proxy.hangup();

    let refused = logged(
        &proxy,
        "SIGHUP: configuration not reloaded, it does not load; the running one is kept",
    )
    .await;
    assert_eq!(refused["level"], "ERROR", "{refused}");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(error.contains("upstream.timeout"), "names the key: {refused}");
    let file = proxy.config_file().display().to_string();
    assert_eq!(refused["file"], file.as_str(), "names the file: {refused}");
    assert!(proxy.is_running());
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "b1", "{}"))
            .await
            .status,
        201
    );
    let gauge = "idemproxy_config_last_reload_successful";
    assert_eq!(metric(&proxy.admin_url, gauge, &[]).await, 0.0);

    std::fs::write(proxy.config_file(), config.to_toml()).unwrap();
    proxy.hangup();
    poll_until("the repaired file to load", || async {
        (metric(&proxy.admin_url, gauge, &[]).await == 1.0).then_some(())
    })
    .await;
    assert!(proxy.is_running());
}

#[tokio::test]
async fn sighup_takes_a_new_listener_certificate_at_once() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let ca = TestCa::new("listener CA");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.issue("cert A", &["localhost"]).write(dir.path(), "listener");
    let mut tls = toml::Table::new();
    tls.insert("cert_file".into(), toml_path(&cert).into());
    tls.insert("key_file".into(), toml_path(&key).into());
    tls.insert("reload_interval".into(), "1h".into());
    let proxy = ProxyProcess::spawn(&env.config().set("server.tls", tls)).await;

    ca.issue("cert B", &["localhost"]).write(dir.path(), "listener");
    let ok = [("result", "ok")];
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_tls_reloads_total", &ok).await,
        0.0,
        "not before the hour"
    );
    proxy.hangup();
    poll_until("the certificate reloaded at SIGHUP", || async {
        (metric(&proxy.admin_url, "idemproxy_tls_reloads_total", &ok).await == 1.0).then_some(())
    })
    .await;
}
