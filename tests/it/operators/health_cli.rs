//! `idemproxy health`, the real binary probing a proxy's admin listener the way a container HEALTHCHECK
//! does: exit 0 on 200, else 1 with one line saying what failed.

use std::process::Output;

use tokio::net::TcpListener;

use crate::support::cli::idemproxy;
use crate::support::{InProcessProxy, Relay, Reply, TestEnv, http::client, poll_until};

fn admin_addr(proxy: &InProcessProxy) -> String {
    proxy
        .admin_url
        .strip_prefix("http://")
        .expect("admin URL is http://")
        .to_owned()
}

async fn health(args: &[&str]) -> Output {
    idemproxy(&[&["health"], args].concat(), &[]).await
}

/// Exit 1 and one line on stderr containing each of `words`.
fn assert_unhealthy(output: &Output, words: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    for word in words {
        assert!(stderr.contains(word), "{word:?} in {stderr}");
    }
}

fn assert_healthy(output: &Output) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
}

#[tokio::test]
async fn a_ready_proxy_is_healthy_and_live() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let admin = admin_addr(&proxy);
    assert_healthy(&health(&["--admin-listen", &admin]).await);
    assert_healthy(&health(&["--admin-listen", &admin, "--live"]).await);
}

#[tokio::test]
async fn the_admin_address_comes_from_the_config_layers_and_unspecified_is_loopback() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let port = admin_addr(&proxy).rsplit_once(':').unwrap().1.to_owned();
    let unspecified = format!("0.0.0.0:{port}");

    let mut file = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    let toml = format!("[server]\nadmin_listen = \"{unspecified}\"\n");
    std::io::Write::write_all(&mut file, toml.as_bytes()).unwrap();
    let path = file.path().to_str().unwrap();
    assert_healthy(&health(&["--config", path]).await);

    let env_layer = [("IDEMPROXY_SERVER__ADMIN_LISTEN", unspecified.as_str())];
    assert_healthy(&idemproxy(&["health"], &env_layer).await);
}

#[tokio::test]
async fn not_ready_while_the_store_is_down_but_still_live() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env.config().set("store.url", env.db().url_via(relay.addr()));
    let proxy = InProcessProxy::start(&config).await;
    let admin = admin_addr(&proxy);

    relay.cut();
    poll_until("/readyz to see the store gone", || async {
        let readyz = Reply::of(client().get(format!("{}/readyz", proxy.admin_url))).await;
        (readyz.status == 503).then_some(())
    })
    .await;
    let ready = health(&["--admin-listen", &admin]).await;
    assert_unhealthy(&ready, &["/readyz", "503"]);
    assert_healthy(&health(&["--admin-listen", &admin, "--live"]).await);
}

#[tokio::test]
async fn nothing_listening_is_unhealthy_with_a_clear_message() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    let output = health(&["--admin-listen", &addr]).await;
    assert_unhealthy(&output, &[&addr, "cannot connect", "refused"]);
}

#[tokio::test]
async fn a_listener_that_never_answers_times_out() {
    // Connections complete in the kernel's backlog; nothing ever reads them.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let output = health(&["--admin-listen", &addr, "--timeout", "300ms"]).await;
    assert_unhealthy(&output, &["no answer within 300ms"]);
    drop(silent);
}
