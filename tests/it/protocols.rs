//! The listener speaks HTTP/2 as well as HTTP/1.1: h2c with prior knowledge reaches the same lifecycle.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::support::TestEnv;

#[tokio::test]
async fn h2c_prior_knowledge_executes_then_replays() {
    let env = TestEnv::new().await;
    let proxy = env.proxy().await;
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let send = || async {
        let request = Request::post(format!("{}/orders", proxy.url))
            .header("idempotency-key", "h2-key")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"n\":1}")))
            .unwrap();
        let response = client.request(request).await.expect("h2c request");
        assert_eq!(response.version(), http::Version::HTTP_2);
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, replayed, body)
    };
    let (status, replayed, first) = send().await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed);
    let replay = crate::support::poll_until("the completion to be stored", || async {
        let (status, replayed, body) = send().await;
        (status != StatusCode::CONFLICT).then_some((status, replayed, body))
    })
    .await;
    assert_eq!(replay, (StatusCode::CREATED, true, first));
    assert_eq!(env.upstream.executions_for_key("h2-key"), 1);
}
