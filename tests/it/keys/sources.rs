//! Keys that do not come from `Idempotency-Key`: webhook and event receivers keyed by their sender's
//! delivery id (GitHub, Standard Webhooks), a JSON field of the body (Stripe), a CloudEvent's source and
//! id in each mode, a template; a JSON body fingerprinted by its meaning; a scope taken from a session
//! cookie. Each test is a client of the real proxy, with `[[routes]]` as an operator would write them, on
//! both stores; the stub upstream's execution count proves what ran. Some attack the key itself: ids
//! that differ only past a float's precision, template parts that would run together, a JSON member
//! named twice, a cookie sent twice, a body-keyed request without a scope that never sends its body.

use rstest::rstest;
use tokio::io::AsyncWriteExt;

use crate::support::http::client;
use crate::support::raw::{self, addr_of};
use crate::support::{Backend, InProcessProxy, Reply, TestEnv};

/// The routes every test here runs under; each test uses the ones it names.
const ROUTES: &str = r#"
[[routes]]
name = "github"
path = "/webhooks/github"
key = "header:X-GitHub-Delivery"
required = true
scope_headers = ["x-github-hook-id"]

[[routes]]
name = "stripe"
path = "/webhooks/stripe"
key = "json:/id"
required = true
fingerprint_body = "json"
unscoped = "shared"
scope_headers = []

[[routes]]
name = "standard-webhooks"
path = "/webhooks/standard"
key = "header:webhook-id"
required = true
unscoped = "shared"
scope_headers = []

[[routes]]
name = "events"
path = "/events"
key = "cloudevents"
required = true
unscoped = "shared"
scope_headers = []

[[routes]]
name = "hooks"
path_prefix = "/hooks/"
key = "template:{header:x-hook-id}/{json:/delivery}"
required = true
unscoped = "shared"
scope_headers = []

[[routes]]
name = "payments"
path = "/payments"
fingerprint_body = "json"
fingerprint_exclude = ["/sent_at"]

[[routes]]
name = "checkout"
path = "/cart/checkout"
scope_headers = []
scope_cookie = "session"

[[routes]]
name = "optional"
path = "/optional"
key = "json:/id"
unscoped = "shared"
scope_headers = []

[[routes]]
name = "tenant-ops"
path = "/tenant-ops"
key = "template:{header:x-tenant}{header:x-op}"
required = true
unscoped = "shared"
scope_headers = []

[[routes]]
name = "orders-optional"
path = "/orders-optional"
key = "json:/order_id"
scope_headers = ["x-api-key"]

[[routes]]
name = "orders-required"
path = "/orders-required"
key = "json:/order_id"
required = true
scope_headers = ["x-api-key"]
"#;

fn post(proxy: &InProcessProxy, path: &str) -> reqwest::RequestBuilder {
    client().post(format!("{}{path}", proxy.url))
}

fn github_delivery(proxy: &InProcessProxy, hook: &str, delivery: &str) -> reqwest::RequestBuilder {
    post(proxy, "/webhooks/github")
        .header("x-github-hook-id", hook)
        .header("x-github-delivery", delivery)
        .header("x-github-event", "push")
        .header("content-type", "application/json")
        .body(r#"{"ref":"refs/heads/main","after":"9f2c"}"#)
}

#[rstest]
#[tokio::test]
async fn keys_a_github_redelivery_is_replayed_and_runs_once(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    let first = Reply::of(github_delivery(&proxy, "4001", delivery)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.is_replay());
    let redelivery = Reply::of(github_delivery(&proxy, "4001", delivery)).await;
    assert!(redelivery.is_replay(), "{:?}", redelivery.headers);
    assert_eq!(redelivery.body, first.body);
    assert_eq!(env.upstream.executions(), 1);
    let seen = &env.upstream.requests()[0];
    assert_eq!(
        seen.headers["x-github-delivery"], delivery,
        "the id reaches the app"
    );

    let next = Reply::of(github_delivery(
        &proxy,
        "4001",
        "0b989ba4-242f-11e5-81e1-c7b6c2aafc6b",
    ))
    .await;
    assert_eq!(next.status, 201);
    assert!(!next.is_replay());
    assert_eq!(env.upstream.executions(), 2);

    // Another webhook subscribed to the same event gets the same GUID: its own scope, its own run.
    let other_hook = Reply::of(github_delivery(&proxy, "4002", delivery)).await;
    assert!(!other_hook.is_replay());
    assert_eq!(env.upstream.executions(), 3);
    let unsigned = Reply::of(post(&proxy, "/webhooks/github").header("x-github-delivery", delivery)).await;
    unsigned.assert_problem(400, "missing-scope");
    assert_eq!(env.upstream.executions(), 3);
}

fn stripe_event(proxy: &InProcessProxy, body: &str) -> reqwest::RequestBuilder {
    post(proxy, "/webhooks/stripe")
        .header("stripe-signature", format!("t={},v1=abc", body.len()))
        .header("content-type", "application/json")
        .body(body.to_owned())
}

#[rstest]
#[tokio::test]
async fn keys_a_stripe_event_is_keyed_by_its_id_and_a_reserialised_redelivery_is_replayed(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let event = r#"{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","type":"charge.succeeded","data":{"object":{"amount":2000,"currency":"usd"}}}"#;
    let reserialised = r#"{
        "type": "charge.succeeded",
        "data": { "object": { "currency": "usd", "amount": 2000 } },
        "id": "evt_1NG8Du2eZvKYlo2CUI79vXWy"
    }"#;
    let first = Reply::of(stripe_event(&proxy, event)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let redelivery = Reply::of(stripe_event(&proxy, reserialised)).await;
    assert!(redelivery.is_replay(), "{}", redelivery.text());
    assert_eq!(redelivery.body, first.body);
    assert_eq!(env.upstream.executions(), 1);

    let other = event.replace("evt_1NG8Du2eZvKYlo2CUI79vXWy", "evt_2");
    let next = Reply::of(stripe_event(&proxy, &other)).await;
    assert_eq!(next.status, 201);
    assert!(!next.is_replay());
    assert_eq!(env.upstream.executions(), 2);

    let object_id = Reply::of(stripe_event(&proxy, r#"{"id":{"nested":1}}"#)).await;
    object_id.assert_problem(400, "invalid-key");
    assert!(object_id.json()["detail"].as_str().unwrap().contains("/id"));
    assert_eq!(env.upstream.executions(), 2);
}

fn standard_webhook(proxy: &InProcessProxy, id: &str, attempt: u64) -> reqwest::RequestBuilder {
    // The timestamp and signature are new on every attempt; the id is not.
    post(proxy, "/webhooks/standard")
        .header("webhook-id", id)
        .header("webhook-timestamp", (1_700_000_000 + attempt).to_string())
        .header("webhook-signature", format!("v1,sig{attempt}"))
        .header("content-type", "application/json")
        .body(r#"{"type":"invoice.paid","data":{"invoice":"in_1"}}"#)
}

#[rstest]
#[tokio::test]
async fn keys_a_standard_webhooks_retry_is_replayed_by_its_webhook_id(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first = Reply::of(standard_webhook(&proxy, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", 0)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = Reply::of(standard_webhook(&proxy, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W", 1)).await;
    assert!(retry.is_replay(), "{}", retry.text());
    let other = Reply::of(standard_webhook(&proxy, "msg_other", 0)).await;
    assert!(!other.is_replay());
    assert_eq!(env.upstream.executions(), 2);
}

const EVENT_SOURCE: &str = "/apis/v1/namespaces/default/pingsources/ping";

fn binary_event(proxy: &InProcessProxy, id: &str) -> reqwest::RequestBuilder {
    post(proxy, "/events")
        .header("ce-specversion", "1.0")
        .header("ce-type", "dev.knative.sources.ping")
        .header("ce-source", EVENT_SOURCE)
        .header("ce-id", id)
        .header("content-type", "application/json")
        .body(r#"{"message":"hello"}"#)
}

fn structured_event(proxy: &InProcessProxy, id: &str) -> reqwest::RequestBuilder {
    let event = serde_json::json!({
        "specversion": "1.0",
        "type": "dev.knative.sources.ping",
        "source": EVENT_SOURCE,
        "id": id,
        "datacontenttype": "application/json",
        "data": {"message": "hello"},
    });
    post(proxy, "/events")
        .header("content-type", "application/cloudevents+json; charset=utf-8")
        .body(event.to_string())
}

#[rstest]
#[tokio::test]
async fn keys_a_cloudevent_is_keyed_by_source_and_id_in_binary_and_structured_mode(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let binary = Reply::of(binary_event(&proxy, "b-1")).await;
    assert_eq!(binary.status, 201, "{}", binary.text());
    assert!(Reply::of(binary_event(&proxy, "b-1")).await.is_replay());
    let structured = Reply::of(structured_event(&proxy, "s-1")).await;
    assert_eq!(structured.status, 201, "{}", structured.text());
    assert!(Reply::of(structured_event(&proxy, "s-1")).await.is_replay());
    assert_eq!(env.upstream.executions(), 2);

    let half = post(&proxy, "/events").header("ce-id", "x").body("{}");
    let half = Reply::of(half).await;
    half.assert_problem(400, "invalid-key");
    assert!(half.json()["detail"].as_str().unwrap().contains("ce-source"));
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn keys_one_event_sent_in_both_modes_runs_once_and_the_second_mode_is_told_it_differs(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let binary = Reply::of(binary_event(&proxy, "both-1")).await;
    assert_eq!(binary.status, 201, "{}", binary.text());
    // Same source and id, so the same key; another content type and body, so another fingerprint.
    let structured = Reply::of(structured_event(&proxy, "both-1")).await;
    structured.assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 1, "one event, one execution");
}

#[rstest]
#[tokio::test]
async fn keys_a_cloudevents_batch_is_refused_with_its_own_problem_type(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let batch = serde_json::json!([
        {"specversion": "1.0", "type": "t", "source": EVENT_SOURCE, "id": "1"},
        {"specversion": "1.0", "type": "t", "source": EVENT_SOURCE, "id": "2"},
    ]);
    let request = post(&proxy, "/events")
        .header("content-type", "application/cloudevents-batch+json")
        .body(batch.to_string());
    let refused = Reply::of(request).await;
    refused.assert_problem(400, "cloudevents-batch");
    assert!(refused.json()["detail"].as_str().unwrap().contains("each event"));
    assert_eq!(env.upstream.executions(), 0);
}

fn hook(proxy: &InProcessProxy, hook_id: &str, delivery: &str) -> reqwest::RequestBuilder {
    post(proxy, "/hooks/deploy")
        .header("x-hook-id", hook_id)
        .header("content-type", "application/json")
        .body(format!(r#"{{"delivery":"{delivery}","status":"ok"}}"#))
}

#[rstest]
#[tokio::test]
async fn keys_a_template_key_joins_a_header_and_a_body_field(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first = Reply::of(hook(&proxy, "h1", "d1")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(Reply::of(hook(&proxy, "h1", "d1")).await.is_replay());
    assert!(!Reply::of(hook(&proxy, "h2", "d1")).await.is_replay());
    assert!(!Reply::of(hook(&proxy, "h1", "d2")).await.is_replay());
    assert_eq!(env.upstream.executions(), 3);
}

#[rstest]
#[tokio::test]
async fn keys_a_required_key_that_is_missing_is_a_400_naming_the_source(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    for (path, body, needs) in [
        ("/webhooks/github", "{}", "an x-github-delivery header"),
        (
            "/webhooks/stripe",
            r#"{"type":"charge.succeeded"}"#,
            "the JSON field /id in the body",
        ),
        ("/webhooks/stripe", "not json", "the JSON field /id in the body"),
        ("/events", "{}", "a CloudEvent id and source"),
        (
            "/hooks/deploy",
            r#"{"delivery":"d1"}"#,
            "an x-hook-id header and the JSON field /delivery",
        ),
    ] {
        let request = post(&proxy, path)
            .header("content-type", "application/json")
            .body(body);
        let refused = Reply::of(request).await;
        refused.assert_problem(400, "missing-key");
        let detail = refused.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(needs), "{path} {body}: {detail}");
    }
    assert_eq!(env.upstream.executions(), 0);
}

fn payment(proxy: &InProcessProxy, body: &str) -> reqwest::RequestBuilder {
    post(proxy, "/payments")
        .header("idempotency-key", "pay-1")
        .header("authorization", "Bearer shop")
        .header("content-type", "application/json")
        .body(body.to_owned())
}

#[rstest]
#[tokio::test]
async fn keys_a_json_fingerprint_replays_a_reordered_retry_and_refuses_a_changed_amount(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first = r#"{"amount":100,"currency":"eur","sent_at":"2026-01-01T10:00:00Z"}"#;
    let retry = r#"{ "sent_at": "2026-01-01T10:00:05Z", "currency": "eur", "amount": 100 }"#;
    let changed = r#"{"amount":999,"currency":"eur","sent_at":"2026-01-01T10:00:09Z"}"#;
    let original = Reply::of(payment(&proxy, first)).await;
    assert_eq!(original.status, 201, "{}", original.text());
    let replay = Reply::of(payment(&proxy, retry)).await;
    assert!(replay.is_replay(), "{}", replay.text());
    assert_eq!(replay.body, original.body);
    Reply::of(payment(&proxy, changed))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 1);
}

fn checkout(proxy: &InProcessProxy, cookie: Option<&str>) -> reqwest::RequestBuilder {
    let request = post(proxy, "/cart/checkout")
        .header("idempotency-key", "checkout-1")
        .header("content-type", "application/json")
        .body(r#"{"cart":"c1"}"#);
    match cookie {
        Some(cookie) => request.header("cookie", cookie),
        None => request,
    }
}

#[rstest]
#[tokio::test]
async fn keys_a_cookie_scope_keeps_sessions_apart_and_refuses_a_request_without_one(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let alice = Reply::of(checkout(&proxy, Some("theme=dark; session=alice-7f3a"))).await;
    assert_eq!(alice.status, 201, "{}", alice.text());
    let bob = Reply::of(checkout(&proxy, Some("session=bob-91c2"))).await;
    assert_eq!(bob.status, 201, "{}", bob.text());
    assert!(!bob.is_replay(), "another session's key is another key");
    let again = Reply::of(checkout(&proxy, Some("session=alice-7f3a; theme=light"))).await;
    assert!(again.is_replay(), "{}", again.text());
    assert_eq!(again.body, alice.body);
    assert_eq!(env.upstream.executions(), 2);

    for cookie in [None, Some("theme=dark"), Some("session=")] {
        let refused = Reply::of(checkout(&proxy, cookie)).await;
        refused.assert_problem(400, "missing-scope");
        let detail = refused.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("cookie session"), "{cookie:?}: {detail}");
    }
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn keys_a_body_without_the_key_passes_through_unprotected_when_keys_are_optional(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    for body in ["", "not json", r#"{"other":1}"#] {
        for _ in 0..2 {
            let reply = Reply::of(post(&proxy, "/optional").body(body)).await;
            assert_eq!(reply.status, 201, "{body:?}: {}", reply.text());
            assert!(!reply.is_replay(), "{body:?}");
        }
    }
    assert_eq!(env.upstream.executions(), 6, "each request without a key ran");
    let last = env.upstream.requests().pop().unwrap();
    assert_eq!(
        &last.body[..],
        br#"{"other":1}"#,
        "the body reaches the app whole"
    );

    let keyed = r#"{"id":"o-1"}"#;
    assert!(!Reply::of(post(&proxy, "/optional").body(keyed)).await.is_replay());
    assert!(Reply::of(post(&proxy, "/optional").body(keyed)).await.is_replay());
    assert_eq!(env.upstream.executions(), 7);
}

#[rstest]
#[tokio::test]
async fn keys_two_24_digit_ids_are_two_keys_and_two_executions(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    // One f64 holds both (1.2345678901234568e23): read as a float, they were one key.
    let first = r#"{"id":123456789012345678901234,"type":"charge.succeeded"}"#;
    let second = r#"{"id":123456789012345678901235,"type":"charge.succeeded"}"#;
    for body in [first, second] {
        let reply = Reply::of(stripe_event(&proxy, body)).await;
        assert_eq!(reply.status, 201, "{body}: {}", reply.text());
        assert!(!reply.is_replay(), "{body}");
    }
    assert_eq!(env.upstream.executions(), 2);
    assert!(Reply::of(stripe_event(&proxy, first)).await.is_replay());
    let as_text = r#"{"id":"123456789012345678901234","type":"charge.succeeded"}"#;
    let reply = Reply::of(stripe_event(&proxy, as_text)).await;
    reply.assert_problem(422, "key-reused");
    assert_eq!(
        env.upstream.executions(),
        2,
        "the id's text is the key, the body another request"
    );
}

#[rstest]
#[tokio::test]
async fn keys_template_parts_that_would_run_together_are_two_keys(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let op = |tenant: &str, op: &str| {
        post(&proxy, "/tenant-ops")
            .header("x-tenant", tenant)
            .header("x-op", op)
            .body(format!("{tenant}|{op}"))
    };
    let first = Reply::of(op("ac", "me1")).await;
    assert_eq!(first.status, 201, "{}", first.text());
    let second = Reply::of(op("acme", "1")).await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(
        !second.is_replay(),
        "tenant acme's op 1 is not tenant ac's op me1"
    );
    assert_eq!(env.upstream.executions(), 2);
    let bodies: Vec<_> = env.upstream.requests().iter().map(|r| r.body.clone()).collect();
    assert_eq!(bodies, [&b"ac|me1"[..], b"acme|1"]);
    let retry = Reply::of(op("acme", "1")).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, second.body);
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn keys_a_json_key_named_twice_in_its_object_is_refused_naming_the_pointer(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    // One parser reads evt_1, another evt_2: which delivery this is depends on who reads it.
    for body in [
        r#"{"id":"evt_1","type":"charge.succeeded","id":"evt_2"}"#,
        r#"{"id":"evt_1","\u0069d":"evt_1"}"#,
    ] {
        let refused = Reply::of(stripe_event(&proxy, body)).await;
        refused.assert_problem(400, "invalid-key");
        let detail = refused.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("/id") && detail.contains("twice"), "{detail}");
    }
    assert_eq!(env.upstream.executions(), 0);
    let other_objects = r#"{"id":"evt_3","data":{"id":"a"},"items":[{"id":1},{"id":2}]}"#;
    assert_eq!(Reply::of(stripe_event(&proxy, other_objects)).await.status, 201);
}

#[rstest]
#[tokio::test]
async fn keys_a_scope_cookie_sent_twice_keeps_its_scope_in_either_order(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let (env, proxy) = TestEnv::with_routes_on(backend, ROUTES).await;
    let first = Reply::of(checkout(
        &proxy,
        Some("session=app-7f3a; theme=dark; session=dom-91c2"),
    ))
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = Reply::of(checkout(&proxy, Some("session=dom-91c2; session=app-7f3a"))).await;
    assert!(
        retry.is_replay(),
        "the same two cookies in another order: {}",
        retry.text()
    );
    assert_eq!(retry.body, first.body);
    let one_of_them = Reply::of(checkout(&proxy, Some("session=app-7f3a"))).await;
    assert!(!one_of_them.is_replay(), "one of the two is another scope");
    assert_eq!(env.upstream.executions(), 2);
}

#[rstest]
#[tokio::test]
async fn keys_a_body_keyed_request_without_a_scope_is_refused_before_its_body_where_keys_are_required(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .with_toml(ROUTES)
        .set("server.body_read_timeout", "60s");
    let proxy = InProcessProxy::start(&config).await;
    for path in ["/orders-required"] {
        // The head promises a body that never comes: a proxy that read it first would answer 408 only
        // after body_read_timeout, long past the reply's bound.
        let mut stream = raw::connect(&proxy.url).await;
        let head = raw::head(
            &format!("POST {path}"),
            addr_of(&proxy.url),
            &["content-type: application/json", "content-length: 100000"],
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let reply = raw::read_reply(&mut stream).await;
        reply.assert_problem(400, "missing-scope");
        let problem: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
        assert!(
            problem["detail"].as_str().unwrap().contains("x-api-key"),
            "{problem}"
        );
    }
    assert_eq!(env.upstream.executions(), 0);

    let order = |path: &str| {
        post(&proxy, path)
            .header("x-api-key", "shop-1")
            .header("content-type", "application/json")
            .body(r#"{"order_id":"o-1"}"#)
    };
    // Where keys are optional, the body decides: one that holds a key and names no client is refused
    // once read; one without a key goes to the app as it came, as any unkeyed request does.
    let unscoped = |body: &'static str| {
        post(&proxy, "/orders-optional")
            .header("content-type", "application/json")
            .body(body)
    };
    Reply::of(unscoped(r#"{"order_id":"o-9"}"#))
        .await
        .assert_problem(400, "missing-scope");
    assert_eq!(env.upstream.executions(), 0);
    let unkeyed = Reply::of(unscoped(r#"{"note":"no key here"}"#)).await;
    assert_eq!(unkeyed.status, 201, "{}", unkeyed.text());
    assert_eq!(env.upstream.executions(), 1);

    for path in ["/orders-optional", "/orders-required"] {
        assert!(!Reply::of(order(path)).await.is_replay());
        assert!(Reply::of(order(path)).await.is_replay(), "{path}");
    }
    assert_eq!(env.upstream.executions(), 3);
}
