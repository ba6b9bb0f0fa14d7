//! `idemproxy demo-upstream`, the README quickstart's service, as a client sees it: it numbers its
//! executions, holds a request for `delay_ms`, and `--probe` tells a listening address from a closed one.

use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::http::{Reply, client};
use crate::support::proxy::binary;

/// Starts the demo on a free port; the child (killed on drop) and its base URL, from the line it prints.
async fn demo() -> (tokio::process::Child, String) {
    let mut child = binary()
        .args(["demo-upstream", "127.0.0.1:0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start idemproxy demo-upstream");
    let stderr = child.stderr.take().expect("its stderr");
    let mut lines = BufReader::new(stderr).lines();
    let line = lines
        .next_line()
        .await
        .expect("read stderr")
        .expect("a first line");
    let url = line
        .strip_prefix("demo upstream listening on ")
        .unwrap_or_else(|| panic!("not the listening line: {line}"))
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
}

async fn probe(addr: &str) -> Option<i32> {
    let output = binary()
        .args(["demo-upstream", "--probe", addr])
        .output()
        .await
        .expect("run the probe");
    output.status.code()
}

#[tokio::test]
async fn each_request_is_a_numbered_execution_answered_201() {
    let (_child, url) = demo().await;
    for expected in 1..=2 {
        let reply = Reply::of(client().post(format!("{url}/payments")).body("{}")).await;
        assert_eq!(reply.status, 201);
        assert_eq!(reply.json()["execution"], expected);
        assert_eq!(reply.json()["received"], "{}");
    }
}

#[tokio::test]
async fn delay_ms_holds_the_answer_that_long() {
    let (_child, url) = demo().await;
    let started = Instant::now();
    let reply = Reply::of(client().post(format!("{url}/payments?delay_ms=300"))).await;
    assert_eq!(reply.status, 201);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn the_probe_exits_0_where_it_listens_and_1_where_nothing_does() {
    let (_child, url) = demo().await;
    let addr = url.strip_prefix("http://").expect("an http URL");
    assert_eq!(probe(addr).await, Some(0));
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let closed_addr = closed.local_addr().expect("its address").to_string();
    drop(closed);
    assert_eq!(probe(&closed_addr).await, Some(1));
}
