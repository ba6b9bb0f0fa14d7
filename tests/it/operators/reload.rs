//! Reloading without a restart, on the real binary: a route added and a webhook secret rotated by SIGHUP
//! and then by `idemproxy reload` while keyed requests flow (none refused or lost), a request in flight
//! finishing under the configuration it started with while the next goes to the new upstream, the
//! settings that wait for a restart named and left as they run, and a broken file refused by the command.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::support::cli::{idemproxy, stderr, stdout};
use crate::support::http::client;
use crate::support::signatures::{STRIPE_SECRET, now, stripe_route, stripe_signature};
use crate::support::{Backend, ProxyProcess, Reply, TestEnv, Upstream, keyed_post, metric, poll_until};

/// The secret the Stripe route rotates to.
const ROTATED: &str = "whsec_rotated_by_a_reload";

/// A route the reload adds: keys are required on `/payments`.
const PAYMENTS: &str = "name = \"payments\"\npath_prefix = \"/payments\"\nrequired = true";

/// A Stripe event with id `id`, signed with `secret`, on `proxy`: its status, and whether it was a
/// replay.
async fn stripe_event(proxy: &ProxyProcess, secret: &str, id: &str) -> (u16, bool) {
    let body = format!(r#"{{"id":"{id}","type":"charge.succeeded"}}"#);
    let response = client()
        .post(format!("{}/webhooks/stripe", proxy.url))
        .header("stripe-signature", stripe_signature(secret, now(), &body))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the proxy answers");
    let replayed = response.headers().contains_key("idempotent-replayed");
    (response.status().as_u16(), replayed)
}

/// A keyless POST to `/payments`: its status.
async fn keyless_payment(proxy: &ProxyProcess) -> u16 {
    let response = client()
        .post(format!("{}/payments", proxy.url))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .expect("the proxy answers");
    response.status().as_u16()
}

/// Keyed requests sent one after another, each with a new key, until stopped: how many were answered
/// 201, and what every other answer was.
struct Traffic {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(usize, Vec<String>)>,
}

impl Traffic {
    fn start(url: &str) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let (url, stopped) = (url.to_owned(), stop.clone());
        let task = tokio::spawn(async move {
            let (mut answered, mut wrong) = (0, Vec::new());
            while !stopped.load(Ordering::Relaxed) {
                let key = format!("flow-{answered}-{}", wrong.len());
                match keyed_post(&url, "/orders", &key, "{}").send().await {
                    Ok(response) if response.status() == 201 => answered += 1,
                    Ok(response) => wrong.push(format!("{key}: status {}", response.status())),
                    Err(error) => wrong.push(format!("{key}: {error}")),
                }
            }
            (answered, wrong)
        });
        Traffic { stop, task }
    }

    /// Stops the traffic and says what it saw.
    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the traffic task ends")
    }
}

/// The admin listener's address, as `--admin-listen` takes it.
fn admin_addr(proxy: &ProxyProcess) -> &str {
    proxy.admin_url.trim_start_matches("http://")
}

/// `idemproxy reload` against `proxy`, reading its configuration file.
async fn reload_command(proxy: &ProxyProcess) -> std::process::Output {
    let file = proxy.config_file().display().to_string();
    idemproxy(
        &["reload", "--config", &file, "--admin-listen", admin_addr(proxy)],
        &[],
    )
    .await
}

/// Waits until the process has logged a line saying `message` more than `seen` times.
async fn logged_after(proxy: &ProxyProcess, message: &str, seen: usize) -> serde_json::Value {
    poll_until(&format!("log line {} saying {message:?}", seen + 1), || async {
        proxy
            .stderr()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line["message"] == message)
            .nth(seen)
    })
    .await
}

#[tokio::test]
async fn a_route_added_and_a_secret_rotated_apply_by_sighup_and_by_the_reload_command_with_no_request_lost() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let secrets = crate::support::signatures::secrets_file(&[STRIPE_SECRET]);
    let config = env.config().with_toml(&stripe_route(secrets.path()));
    let proxy = ProxyProcess::spawn(&config).await;
    assert_eq!(keyless_payment(&proxy).await, 201, "no route keys /payments yet");
    assert_eq!(stripe_event(&proxy, STRIPE_SECRET, "evt_1").await, (201, false));
    assert_eq!(stripe_event(&proxy, ROTATED, "evt_2").await.0, 401);
    let traffic = Traffic::start(&proxy.url);

    // SIGHUP: the route is added and the secret rotated, in one reload.
    std::fs::write(secrets.path(), format!("{ROTATED}\n")).unwrap();
    std::fs::write(proxy.config_file(), config.clone().route(PAYMENTS).to_toml()).unwrap();
    proxy.hangup();
    let applied = logged_after(
        &proxy,
        "SIGHUP: configuration reloaded; applied to new requests",
        0,
    )
    .await;
    assert_eq!(applied["settings"], "routes", "{applied}");
    assert_eq!(keyless_payment(&proxy).await, 400, "the new route requires a key");
    assert_eq!(
        stripe_event(&proxy, STRIPE_SECRET, "evt_3").await.0,
        401,
        "the old secret is gone"
    );
    assert_eq!(
        stripe_event(&proxy, ROTATED, "evt_4").await,
        (201, false),
        "the new secret is taken"
    );
    assert_eq!(
        stripe_event(&proxy, ROTATED, "evt_1").await,
        (201, true),
        "a delivery done before the reload replays"
    );

    // `idemproxy reload`: back as it was, the command saying what it applied.
    std::fs::write(secrets.path(), format!("{STRIPE_SECRET}\n")).unwrap();
    std::fs::write(proxy.config_file(), config.to_toml()).unwrap();
    let output = reload_command(&proxy).await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        stdout(&output).trim(),
        "reloaded; applied to new requests: routes"
    );
    assert_eq!(keyless_payment(&proxy).await, 201, "the route is gone");
    assert_eq!(stripe_event(&proxy, STRIPE_SECRET, "evt_5").await, (201, false));
    assert_eq!(stripe_event(&proxy, ROTATED, "evt_6").await.0, 401);

    let (answered, wrong) = traffic.stop().await;
    assert!(
        wrong.is_empty(),
        "requests refused or lost during the reloads: {wrong:?}"
    );
    assert!(answered > 0, "the traffic flowed");
    let reloads = [("result", "ok")];
    assert_eq!(
        metric(&proxy.admin_url, "idemproxy_config_reloads_total", &reloads).await,
        2.0
    );
}

#[tokio::test]
async fn a_request_in_flight_finishes_under_the_configuration_it_started_with() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let proxy = ProxyProcess::spawn(&config).await;
    let held = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "held", "{}")));
    env.upstream.wait_for_key("held", 1).await;

    let other = Upstream::start().await;
    std::fs::write(
        proxy.config_file(),
        config.clone().set("upstream.url", other.url()).to_toml(),
    )
    .unwrap();
    let output = reload_command(&proxy).await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        stdout(&output).trim(),
        "reloaded; applied to new requests: upstream.url"
    );
    let new = Reply::of(keyed_post(&proxy.url, "/orders", "new", "{}")).await;
    assert_eq!(new.status, 201);
    assert_eq!(
        other.executions_for_key("new"),
        1,
        "a new request goes to the new upstream"
    );
    assert_eq!(env.upstream.executions_for_key("new"), 0);

    env.upstream.release("slow");
    let held = held.await.unwrap();
    assert_eq!(
        held.status, 201,
        "the request in flight is answered by the upstream it started on"
    );
    let retry = Reply::of(keyed_post(&proxy.url, "/slow", "held", "{}")).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.body, held.body, "its retry replays it");
    assert_eq!(env.upstream.executions_for_key("held"), 1);
    assert_eq!(other.executions_for_key("held"), 0, "the retry runs nowhere");
}

#[tokio::test]
async fn settings_that_need_a_restart_are_named_and_keep_their_running_values() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("server.max_waiting", 64)
        .set("idempotency.on_in_flight", "wait");
    let proxy = ProxyProcess::spawn(&config).await;
    let changed = config
        .clone()
        .set("server.max_waiting", 1)
        .set("upstream.timeout", "9s");
    std::fs::write(proxy.config_file(), changed.to_toml()).unwrap();
    let answer = client()
        .post(format!("{}/-/reload", proxy.admin_url))
        .send()
        .await
        .expect("the admin listener answers");
    assert_eq!(answer.status(), 200);
    let answer: serde_json::Value = serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap();
    assert_eq!(
        answer,
        serde_json::json!({"reloaded": true, "applied": ["upstream.timeout"], "restart": ["server.max_waiting"]})
    );
    // Asked again with nothing changed since, the setting still waits for a restart.
    let output = reload_command(&proxy).await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        stdout(&output),
        "reloaded; applied to new requests: none\ntake effect only after a restart: server.max_waiting\n"
    );
    let warned = logged_after(
        &proxy,
        "POST /-/reload: these settings differ from the running ones and take effect only after a restart",
        1,
    )
    .await;
    assert_eq!(warned["settings"], "server.max_waiting");

    // Still 64 seats: two duplicates of a key in flight both wait for the original's answer, where
    // with one seat the second would be refused 409 at once.
    let original = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "seat", "{}")));
    env.upstream.wait_for_key("seat", 1).await;
    let duplicates = [(); 2].map(|()| tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "seat", "{}"))));
    poll_until("both duplicates waiting", || async {
        let waiting = metric(&proxy.admin_url, "idemproxy_waiting_requests", &[]).await;
        (waiting == 2.0).then_some(())
    })
    .await;
    env.upstream.release("slow");
    let original = original.await.unwrap();
    assert_eq!(original.status, 201);
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap();
        assert_eq!(duplicate.status, 201);
        assert_eq!(duplicate.body, original.body);
    }
    assert_eq!(env.upstream.executions_for_key("seat"), 1);
}

#[tokio::test]
async fn a_broken_file_is_refused_by_the_reload_command_and_the_proxy_serves_on() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config();
    let mut proxy = ProxyProcess::spawn(&config).await;
    std::fs::write(proxy.config_file(), "[upstream]\ntimeout = \"soon\"\n").unwrap();
    // Given only the admin address, the command asks, and the proxy refuses the file it reads.
    let output = idemproxy(&["reload", "--admin-listen", admin_addr(&proxy)], &[]).await;
    assert_eq!(output.status.code(), Some(1), "{}", stdout(&output));
    let said = stderr(&output);
    assert!(
        said.contains("configuration not reloaded, the running one is kept"),
        "{said}"
    );
    assert!(said.contains("upstream.timeout"), "names the key: {said}");
    assert_eq!(said.lines().count(), 1, "{said}");
    // Pointed at the proxy's own port, it asks nothing: a POST there would run in the app.
    let proxy_addr = proxy.url.trim_start_matches("http://").to_owned();
    let output = idemproxy(&["reload", "--admin-listen", &proxy_addr], &[]).await;
    assert_eq!(output.status.code(), Some(1), "{}", stdout(&output));
    assert!(
        stderr(&output).contains("does not answer as idemproxy's admin listener"),
        "{}",
        stderr(&output)
    );
    let posted = env
        .upstream
        .requests()
        .into_iter()
        .filter(|r| r.method == "POST" && r.path_and_query == "/-/reload");
    assert_eq!(posted.count(), 0, "no reload was sent to the app");
    // Given the broken file too, it says so itself.
    let output = reload_command(&proxy).await;
    assert_eq!(output.status.code(), Some(1), "{}", stdout(&output));
    assert!(
        stderr(&output).contains("upstream.timeout"),
        "{}",
        stderr(&output)
    );
    assert!(proxy.is_running());
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "after", "{}"))
            .await
            .status,
        201
    );
    let gauge = "idemproxy_config_last_reload_successful";
    assert_eq!(metric(&proxy.admin_url, gauge, &[]).await, 0.0);
    let get = client()
        .get(format!("{}/-/reload", proxy.admin_url))
        .send()
        .await
        .expect("the admin listener answers");
    assert_eq!(get.status(), 405, "a reload is a POST");
    assert_eq!(get.headers()["allow"], "POST");
}

#[tokio::test]
async fn a_reload_that_changes_how_a_route_scopes_its_keys_warns_naming_the_route() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let route =
        |scope: &str| format!("name = \"payments\"\npath_prefix = \"/payments\"\nscope_headers = [{scope}]");
    let config = env.config().route(&route("\"authorization\""));
    let proxy = ProxyProcess::spawn(&config).await;
    let changed = env.config().route(&route("\"x-tenant\""));
    std::fs::write(proxy.config_file(), changed.to_toml()).unwrap();
    let output = reload_command(&proxy).await;
    assert!(output.status.success(), "{}", stderr(&output));
    let message = "POST /-/reload: how this route reads keys, scopes or fingerprints changed: a retry of a key \
                   it completed before is judged by the new rules, so it may run again (in another scope) or \
                   get 422 (another payload), as after a restart";
    let warned = logged_after(&proxy, message, 0).await;
    assert_eq!(warned["route"], "payments", "{warned}");
    assert_eq!(warned["level"], "WARN", "{warned}");
}
