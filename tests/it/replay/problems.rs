//! What a refusal tells a client, from the client's side: on a route that sets its own statuses, a
//! key reused with another request and a key in flight get the route's status (for an API where 422
//! means a validation error, or 409 is not what its clients retry on), with the same problem type and
//! the members a client acts on. Every `Reply::assert_problem` in the suite checks those members too.

use crate::support::{Reply, TestEnv, keyed_post};

#[tokio::test]
async fn a_route_sets_its_own_status_for_a_reused_key_and_for_a_key_in_flight() {
    let (env, proxy) = TestEnv::with_routes(
        "[[routes]]\nname = \"orders\"\npath = \"/slow\"\nmismatch_status = 409\nin_flight_status = 429",
    )
    .await;

    // A key in flight: 429 on the route, with its Retry-After, and where its operation stands.
    let original = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/slow", "flight-1", "{}")));
    env.upstream.wait_for_key("flight-1", 1).await;
    let duplicate = Reply::of(keyed_post(&proxy.url, "/slow", "flight-1", "{}")).await;
    duplicate.assert_problem(429, "key-in-flight");
    assert!(duplicate.retry_after() >= 1);
    let problem = duplicate.json();
    assert_eq!(problem["operation_state"], "in_progress");
    assert_eq!(problem["retryable"], true);
    env.upstream.release("slow");
    assert_eq!(original.await.unwrap().status, 201);

    // A reused key: 409 on the route, the draft standard's 422 elsewhere; the same type either way.
    let first = Reply::of(keyed_post(&proxy.url, "/slow", "reused-1", "{\"amount\":1}")).await;
    assert_eq!(first.status, 201);
    let reused = Reply::of(keyed_post(&proxy.url, "/slow", "reused-1", "{\"amount\":2}")).await;
    reused.assert_problem(409, "key-reused");
    let problem = reused.json();
    assert_eq!(problem["operation_state"], "not_started");
    assert_eq!(problem["retryable"], false);
    assert_eq!(
        problem["safe_new_key"], true,
        "this request's effect was not applied"
    );
    Reply::of(keyed_post(&proxy.url, "/payments", "reused-2", "{\"amount\":1}")).await;
    Reply::of(keyed_post(&proxy.url, "/payments", "reused-2", "{\"amount\":2}"))
        .await
        .assert_problem(422, "key-reused");
}

#[tokio::test]
async fn a_status_a_route_may_not_set_stops_the_start_naming_the_key() {
    let env = TestEnv::new().await;
    for (key, value) in [("mismatch_status", 500), ("in_flight_status", 200)] {
        let config = env.config().route(&format!(
            "name = \"orders\"\npath_prefix = \"/orders\"\n{key} = {value}"
        ));
        let error = idemproxy::Config::from_toml_str(&config.to_toml()).unwrap_err();
        assert_eq!(error.key, format!("routes[0].{key}"), "{error}");
    }
}
