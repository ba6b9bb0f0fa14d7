//! `idemproxy demo-upstream`, the README quickstart's service, as a client sees it: it numbers its
//! executions, holds a request for `delay_ms`, and `--probe` tells a listening address from a closed one.

use std::time::{Duration, Instant};

use crate::support::http::{Reply, client};
use crate::support::proxy::{binary, demo_upstream as demo};

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

#[tokio::test]
async fn under_c_it_counts_each_path_on_its_own_and_says_the_count_at_count() {
    let (_child, url) = demo().await;
    let count = |path: &'static str| {
        let url = url.clone();
        async move {
            Reply::of(client().get(format!("{url}/count/{path}")))
                .await
                .json()["count"]
                .clone()
        }
    };
    assert_eq!(count("run/a").await, 0);
    for expected in 1..=2 {
        let reply = Reply::of(client().post(format!("{url}/c/run/a?x=1")).body("{}")).await;
        assert_eq!(reply.json()["execution"], expected);
        assert_eq!(reply.header("x-execution"), Some(expected.to_string().as_str()));
    }
    let other = Reply::of(client().patch(format!("{url}/c/run/b"))).await;
    assert_eq!(
        (other.json()["execution"].clone(), other.json()["method"].clone()),
        (1.into(), "PATCH".into())
    );
    assert_eq!((count("run/a").await, count("run/b").await), (2.into(), 1.into()));
}

#[tokio::test]
async fn the_query_sets_the_status_fails_the_first_executions_and_pads_the_body() {
    let (_child, url) = demo().await;
    let reply = Reply::of(client().post(format!("{url}/c/s/x?status=422"))).await;
    assert_eq!(reply.status, 422);
    for (expected_status, expected_execution) in [(500, 1), (500, 2), (201, 3)] {
        let reply = Reply::of(client().post(format!("{url}/c/s/f?fail_first=2&fail_status=500"))).await;
        assert_eq!(
            (reply.status.as_u16(), reply.json()["execution"].clone()),
            (expected_status, expected_execution.into())
        );
    }
    let padded = Reply::of(client().post(format!("{url}/c/s/p?size=100000"))).await;
    assert!(padded.body.len() >= 100_000, "{}", padded.body.len());
    assert_eq!(padded.json()["execution"], 1);
}

#[tokio::test]
async fn chunks_stream_the_body_in_pieces_apart() {
    let (_child, url) = demo().await;
    let started = Instant::now();
    let mut response = client()
        .post(format!("{url}/c/s/chunks?size=1000&chunks=4&chunk_ms=150"))
        .send()
        .await
        .expect("send");
    assert_eq!(
        response.headers().get("content-length"),
        None,
        "a streamed body has no length"
    );
    let mut pieces = Vec::new();
    while let Some(piece) = response.chunk().await.expect("read a piece") {
        pieces.push((piece.len(), started.elapsed()));
    }
    assert!(pieces.len() >= 4, "{pieces:?}");
    assert!(
        pieces.last().expect("a piece").1 >= Duration::from_millis(450),
        "{pieces:?}"
    );
    assert!(pieces.iter().map(|p| p.0).sum::<usize>() >= 1000);
}
