//! The harness itself behaves: the relay cuts and restores, the stub upstream's gates and bodies.

use crate::support::{Relay, Reply, TestEnv, http, upstream};

#[tokio::test]
async fn relay_cut_closes_connections_and_restore_reopens() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let url = env.db().url_via(relay.addr());
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    client.simple_query("select 1").await.unwrap();
    relay.cut();
    assert!(client.simple_query("select 1").await.is_err());
    let _ = conn.await;
    assert!(
        tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .is_err()
    );
    relay.restore();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.simple_query("select 1").await.unwrap();
}

#[tokio::test]
async fn stub_stream_sends_first_chunk_before_gate() {
    let env = TestEnv::new().await;
    let mut response = http::client()
        .get(format!("{}/stream", env.upstream.url()))
        .send()
        .await
        .unwrap();
    let first = response.chunk().await.unwrap().unwrap();
    assert_eq!(&first[..], upstream::FIRST_CHUNK);
    env.upstream.release("stream");
    let rest = response.chunk().await.unwrap().unwrap();
    assert_eq!(&rest[..], upstream::REST_CHUNK);
}

#[tokio::test]
async fn stub_big_and_reset() {
    let env = TestEnv::new().await;
    let reply = Reply::of(http::client().get(format!("{}/big?bytes=100000", env.upstream.url()))).await;
    assert_eq!(reply.body.as_ref(), upstream::big_body(100000).as_slice());
    let response = http::client()
        .get(format!("{}/reset-mid-body", env.upstream.url()))
        .send()
        .await
        .unwrap();
    assert!(response.bytes().await.is_err());
    assert_eq!(env.upstream.executions(), 2);
}
