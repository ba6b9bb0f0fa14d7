//! A forged webhook cannot squat a delivery id. On routes with a `signature`, the proxy checks the
//! sender's signature before the claim and before the replay cache: a forged delivery carrying a real id
//! gets 401 `signature-invalid`, reaches no upstream, claims nothing, and never reads the stored response
//! of the genuine one, which runs once and is replayed to its redeliveries. Rotation (two secrets), stale
//! and future timestamps, tampered bodies, and signature headers sent twice or oversized are refused; on
//! a shared scope, an upstream 401 or 403 is not stored. Every request is signed here as its sender signs
//! it (the signers of `support/signatures.rs` reproduce the senders' published vectors, checked below), at
//! the current time.

use rstest::rstest;

use crate::support::cli::{config_file, idemproxy};
use crate::support::http::client;
use crate::support::signatures::{
    STRIPE_SECRET, generic_signature, github_signature, now, secrets_file, shopify_signature,
    stripe_signature, sw_signature,
};
use crate::support::{Backend, InProcessProxy, Reply, TestEnv, metric};

/// The Standard Webhooks spec's example secret, and a second one for rotation.
const SW_OLD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SW_NEW: &str = "whsec_aWRlbXByb3h5IHJvdGF0aW9uIHRlc3Qgc2VjcmV0LCAzMkI=";
/// A secret the routes do not have: what a forger signs with.
const SW_FORGED: &str = "whsec_Zm9yZ2VyJ3Mgb3duIHNlY3JldCwgMjQgYnl0ZXM=";
const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const SHOPIFY_SECRET: &str = "shpss_test_client_secret";
const GENERIC_SECRET: &str = "generic secret";

const CHECKS: &str = "idemproxy_signature_checks_total";

/// The routes, their secrets in files (the way a mounted Kubernetes secret gives them).
struct Hooks {
    proxy: InProcessProxy,
    _files: Vec<tempfile::NamedTempFile>,
}

async fn start(env: &TestEnv) -> Hooks {
    let files = [
        secrets_file(&[SW_OLD, SW_NEW]),
        secrets_file(&[STRIPE_SECRET]),
        secrets_file(&[GITHUB_SECRET]),
        secrets_file(&[SHOPIFY_SECRET]),
        secrets_file(&[GENERIC_SECRET]),
    ];
    let path = |i: usize| files[i].path().display().to_string();
    let routes = format!(
        r#"
[[routes]]
name = "standard-webhooks"
path = "/webhooks/standard"
key = "header:webhook-id"
required = true
unscoped = "shared"
scope_headers = []
signature = {{ scheme = "standard_webhooks", secrets_file = "{sw}" }}

[[routes]]
name = "stripe"
path = "/webhooks/stripe"
key = "json:/id"
required = true
unscoped = "shared"
scope_headers = []
fingerprint_body = "json"
signature = {{ scheme = "stripe", secrets_file = "{stripe}" }}

[[routes]]
name = "github"
path = "/webhooks/github"
key = "header:X-GitHub-Delivery"
required = true
scope_headers = ["x-github-hook-id"]
signature = {{ scheme = "github", secrets_file = "{github}" }}

[[routes]]
name = "shopify"
path = "/webhooks/shopify"
key = "template:{{header:X-Shopify-Topic}}/{{header:X-Shopify-Event-Id}}"
required = true
scope_headers = ["x-shopify-shop-domain"]
signature = {{ scheme = "shopify", secrets_file = "{shopify}" }}

[[routes]]
name = "generic"
path = "/webhooks/generic"
key = "header:x-delivery"
unscoped = "shared"
scope_headers = []
signature = {{ scheme = "hmac", header = "X-Signature", algorithm = "sha512", encoding = "base64", secrets_file = "{generic}" }}

[[routes]]
name = "listed"
path_prefix = "/status"
match_methods = ["PATCH"]
key = "header:x-delivery"
unscoped = "shared"
scope_headers = []
release_statuses = ["5xx"]

[[routes]]
name = "open"
path_prefix = "/status"
key = "header:x-delivery"
unscoped = "shared"
scope_headers = []
"#,
        sw = path(0),
        stripe = path(1),
        github = path(2),
        shopify = path(3),
        generic = path(4),
    );
    let proxy = InProcessProxy::start(&env.config().with_toml(&routes)).await;
    Hooks {
        proxy,
        _files: files.into(),
    }
}

#[test]
fn the_test_signers_reproduce_the_senders_vectors() {
    // The Standard Webhooks spec's example; GitHub's documented example; npm `stripe` 23.1.0's
    // generateTestHeaderString; npm `@shopify/shopify-api` 13.1.0's createSHA256HMAC.
    assert_eq!(
        sw_signature(
            SW_OLD,
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1614265330,
            r#"{"test": 2432232314}"#
        ),
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    );
    assert_eq!(
        github_signature(GITHUB_SECRET, "Hello, World!"),
        "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    );
    assert_eq!(
        stripe_signature(
            STRIPE_SECRET,
            1700000000,
            r#"{"id":"evt_test_webhook","object":"event"}"#
        ),
        "t=1700000000,v1=d95c6b7477fbd7e9f90b1b0ef5f9c7ac25abca5382460e0d988c2b2a5b71b990"
    );
    assert_eq!(
        shopify_signature(
            SHOPIFY_SECRET,
            r#"{"id":820982911946154508,"email":"jon@example.com"}"#
        ),
        "UMfMPmYG431HYgDWLVuCYKtl7tnFBPlsemb2g673GlI="
    );
}

fn post(hooks: &Hooks, path: &str) -> reqwest::RequestBuilder {
    client().post(format!("{}{path}", hooks.proxy.url))
}

const SW_BODY: &str = r#"{"type":"invoice.paid","data":{"invoice":"in_1","amount":4200}}"#;

/// A Standard Webhooks delivery of `body` with `id`, signed with `secret` at `timestamp`.
fn sw_delivery(hooks: &Hooks, id: &str, secret: &str, timestamp: u64, body: &str) -> reqwest::RequestBuilder {
    post(hooks, "/webhooks/standard")
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", sw_signature(secret, id, timestamp, body))
        .header("content-type", "application/json")
        .body(body.to_owned())
}

async fn checks(hooks: &Hooks, result: &str) -> f64 {
    metric(&hooks.proxy.admin_url, CHECKS, &[("result", result)]).await
}

#[rstest]
#[tokio::test]
async fn a_forged_delivery_with_a_real_id_claims_nothing_and_the_genuine_one_runs_once(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let hooks = start(&env).await;
    let id = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W";
    let forged_body = r#"{"type":"invoice.paid","data":{"invoice":"in_forged","amount":1}}"#;
    let forged = Reply::of(sw_delivery(&hooks, id, SW_FORGED, now(), forged_body)).await;
    forged.assert_problem(401, "signature-invalid");
    assert_eq!(forged.header("www-authenticate"), Some("Webhook-Signature"));
    assert!(
        forged.json()["detail"]
            .as_str()
            .unwrap()
            .contains("no signature matched")
    );
    assert_eq!(
        env.upstream.executions(),
        0,
        "a forged delivery reaches no upstream"
    );
    let records = env
        .store
        .open()
        .await
        .find(id, None)
        .await
        .expect("the store answers");
    assert!(
        records.is_empty(),
        "a forged delivery claims nothing: {records:?}"
    );

    let genuine = Reply::of(sw_delivery(&hooks, id, SW_OLD, now(), SW_BODY)).await;
    assert_eq!(genuine.status, 201, "{}", genuine.text());
    assert!(!genuine.is_replay());
    assert_eq!(env.upstream.executions(), 1);
    let seen = &env.upstream.requests()[0];
    assert_eq!(seen.body, SW_BODY.as_bytes(), "the genuine body reaches the app");
    assert!(
        seen.headers.contains_key("webhook-signature"),
        "forwarded as received"
    );

    // A redelivery is signed anew (another timestamp, another signature) and replayed.
    let redelivery = Reply::of(sw_delivery(&hooks, id, SW_OLD, now() + 1, SW_BODY)).await;
    assert!(redelivery.is_replay(), "{}", redelivery.text());
    assert_eq!(redelivery.body, genuine.body);
    assert_eq!(env.upstream.executions(), 1);
    assert_eq!(checks(&hooks, "mismatch").await, 1.0);
    assert_eq!(checks(&hooks, "verified").await, 2.0);
}

const STRIPE_EVENT: &str =
    r#"{"id":"evt_1NG8Du2eZvKYlo2CUI79vXWy","type":"charge.succeeded","data":{"object":{"amount":2000}}}"#;

fn stripe_event(hooks: &Hooks, signature: &str, body: &str) -> reqwest::RequestBuilder {
    post(hooks, "/webhooks/stripe")
        .header("stripe-signature", signature)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

#[tokio::test]
async fn a_forged_request_for_a_completed_id_gets_401_never_the_stored_response() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let signed = stripe_signature(STRIPE_SECRET, now(), STRIPE_EVENT);
    let genuine = Reply::of(stripe_event(&hooks, &signed, STRIPE_EVENT)).await;
    assert_eq!(genuine.status, 201, "{}", genuine.text());
    assert_eq!(env.upstream.executions(), 1);

    // The completed record is in the replay cache and the store; neither answers a forger.
    let wrong_secret = stripe_signature("whsec_guessed", now(), STRIPE_EVENT);
    // The genuine signature under a later timestamp (the timestamp is signed too).
    let moved = format!("t={},{}", now() + 1, signed.split_once(',').unwrap().1);
    for signature in [wrong_secret.as_str(), moved.as_str(), "t=1,v1=00", "garbage"] {
        let forged = Reply::of(stripe_event(&hooks, signature, STRIPE_EVENT)).await;
        forged.assert_problem(401, "signature-invalid");
        assert!(!forged.is_replay(), "{signature}");
        assert_ne!(forged.body, genuine.body, "{signature}");
    }
    assert_eq!(checks(&hooks, "mismatch").await, 2.0);
    assert_eq!(checks(&hooks, "timestamp").await, 1.0);
    assert_eq!(checks(&hooks, "malformed").await, 1.0);
    let unsigned = Reply::of(
        post(&hooks, "/webhooks/stripe")
            .header("content-type", "application/json")
            .body(STRIPE_EVENT),
    )
    .await;
    unsigned.assert_problem(401, "signature-invalid");
    assert!(
        unsigned.json()["detail"]
            .as_str()
            .unwrap()
            .contains("no stripe-signature header")
    );
    assert_eq!(checks(&hooks, "missing").await, 1.0);

    let redelivery = stripe_signature(STRIPE_SECRET, now(), STRIPE_EVENT);
    let replay = Reply::of(stripe_event(&hooks, &redelivery, STRIPE_EVENT)).await;
    assert!(replay.is_replay(), "{}", replay.text());
    assert_eq!(replay.body, genuine.body);
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn deliveries_signed_with_either_of_two_secrets_verify() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let old = Reply::of(sw_delivery(&hooks, "msg_old", SW_OLD, now(), SW_BODY)).await;
    assert_eq!(old.status, 201, "{}", old.text());
    let new = Reply::of(sw_delivery(&hooks, "msg_new", SW_NEW, now(), SW_BODY)).await;
    assert_eq!(new.status, 201, "{}", new.text());
    let other = Reply::of(sw_delivery(&hooks, "msg_other", SW_FORGED, now(), SW_BODY)).await;
    other.assert_problem(401, "signature-invalid");
    // A sender mid-rotation signs with both; one it signs with that the route lacks does not matter.
    let (id, t) = ("msg_both", now());
    let both = format!(
        "{} {}",
        sw_signature(SW_FORGED, id, t, SW_BODY),
        sw_signature(SW_NEW, id, t, SW_BODY)
    );
    let rotating = post(&hooks, "/webhooks/standard")
        .header("webhook-id", id)
        .header("webhook-timestamp", t.to_string())
        .header("webhook-signature", both)
        .body(SW_BODY);
    let rotating = Reply::of(rotating).await;
    assert_eq!(rotating.status, 201, "{}", rotating.text());
    assert_eq!(env.upstream.executions(), 3);
}

#[tokio::test]
async fn a_stale_or_future_timestamp_is_refused_and_reaches_nothing() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    for t in [now() - 600, now() + 600] {
        let stale = Reply::of(sw_delivery(&hooks, "msg_late", SW_OLD, t, SW_BODY)).await;
        stale.assert_problem(401, "signature-invalid");
        let detail = stale.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("webhook-timestamp is more than 5m"), "{detail}");
        let signature = stripe_signature(STRIPE_SECRET, t, STRIPE_EVENT);
        let stripe = Reply::of(stripe_event(&hooks, &signature, STRIPE_EVENT)).await;
        stripe.assert_problem(401, "signature-invalid");
    }
    assert_eq!(env.upstream.executions(), 0);
    assert_eq!(checks(&hooks, "timestamp").await, 4.0);
    let on_time = Reply::of(sw_delivery(&hooks, "msg_late", SW_OLD, now() - 240, SW_BODY)).await;
    assert_eq!(
        on_time.status,
        201,
        "4 minutes late is within 5: {}",
        on_time.text()
    );
}

const PUSH: &str = r#"{"ref":"refs/heads/main","after":"9f2c"}"#;

fn github_delivery(hooks: &Hooks, delivery: &str, signature: &str, body: &str) -> reqwest::RequestBuilder {
    post(hooks, "/webhooks/github")
        .header("x-github-hook-id", "4001")
        .header("x-github-delivery", delivery)
        .header("x-hub-signature-256", signature)
        .header("content-type", "application/json")
        .body(body.to_owned())
}

#[tokio::test]
async fn a_tampered_body_is_refused_and_the_genuine_delivery_still_runs() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    let signature = github_signature(GITHUB_SECRET, PUSH);
    let tampered = PUSH.replace("9f2c", "dead");
    let refused = Reply::of(github_delivery(&hooks, delivery, &signature, &tampered)).await;
    refused.assert_problem(401, "signature-invalid");
    assert_eq!(env.upstream.executions(), 0);
    let genuine = Reply::of(github_delivery(&hooks, delivery, &signature, PUSH)).await;
    assert_eq!(genuine.status, 201, "{}", genuine.text());
    assert_eq!(env.upstream.requests()[0].body, PUSH.as_bytes());
    let redelivery = Reply::of(github_delivery(&hooks, delivery, &signature, PUSH)).await;
    assert!(redelivery.is_replay());
    assert_eq!(env.upstream.executions(), 1);
}

#[tokio::test]
async fn a_signature_header_sent_twice_or_oversized_is_refused() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let signature = github_signature(GITHUB_SECRET, PUSH);
    let twice =
        github_delivery(&hooks, "d-twice", &signature, PUSH).header("x-hub-signature-256", &signature);
    let twice = Reply::of(twice).await;
    twice.assert_problem(401, "signature-invalid");
    let detail = twice.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("sent more than once"), "{detail}");
    let oversized = format!("{signature}{}", "0".repeat(5000));
    let oversized = Reply::of(github_delivery(&hooks, "d-long", &oversized, PUSH)).await;
    oversized.assert_problem(401, "signature-invalid");
    let detail = oversized.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("longer than 4096 bytes"), "{detail}");
    let t = now();
    let two_ids = post(&hooks, "/webhooks/standard")
        .header("webhook-id", "msg_a")
        .header("webhook-id", "msg_b")
        .header("webhook-timestamp", t.to_string())
        .header("webhook-signature", sw_signature(SW_OLD, "msg_a", t, SW_BODY))
        .body(SW_BODY);
    Reply::of(two_ids).await.assert_problem(400, "invalid-key");
    assert_eq!(env.upstream.executions(), 0);
    assert_eq!(checks(&hooks, "malformed").await, 2.0);
}

#[tokio::test]
async fn shopify_and_a_generic_hmac_verify_over_the_wire_keyed_or_not() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let order = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    let shopify = |signature: String| {
        post(&hooks, "/webhooks/shopify")
            .header("x-shopify-topic", "orders/create")
            .header("x-shopify-event-id", "98880550-7158-44d4-b7cd-2c97c8a091b5")
            .header("x-shopify-shop-domain", "shop.myshopify.com")
            .header("x-shopify-hmac-sha256", signature)
            .body(order)
    };
    let forged = Reply::of(shopify(shopify_signature("shpss_guessed", order))).await;
    forged.assert_problem(401, "signature-invalid");
    let genuine = Reply::of(shopify(shopify_signature(SHOPIFY_SECRET, order))).await;
    assert_eq!(genuine.status, 201, "{}", genuine.text());
    assert_eq!(env.upstream.executions(), 1);

    // A keyless request on a verifying route is verified too, then forwarded unprotected.
    let body = r#"{"event":"ping"}"#;
    let unsigned = Reply::of(post(&hooks, "/webhooks/generic").body(body)).await;
    unsigned.assert_problem(401, "signature-invalid");
    assert_eq!(
        env.upstream.executions(),
        1,
        "an unverified keyless request is not forwarded"
    );
    let keyless = || {
        post(&hooks, "/webhooks/generic")
            .header("x-signature", generic_signature(GENERIC_SECRET, body))
            .body(body)
    };
    for _ in 0..2 {
        let passed = Reply::of(keyless()).await;
        assert_eq!(passed.status, 201, "{}", passed.text());
        assert!(!passed.is_replay());
    }
    assert_eq!(
        env.upstream.executions(),
        3,
        "keyless: forwarded each time, never stored"
    );
    let keyed = || keyless().header("x-delivery", "delivery-1");
    let first = Reply::of(keyed()).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(Reply::of(keyed()).await.is_replay());
    assert_eq!(env.upstream.executions(), 4);
}

#[tokio::test]
async fn on_a_shared_scope_401_and_403_are_not_stored_unless_listed() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let hooks = start(&env).await;
    let send = |method: reqwest::Method, path: &str, delivery: &str| {
        client()
            .request(method, format!("{}{path}", hooks.proxy.url))
            .header("x-delivery", delivery)
            .body("{}")
    };
    for status in [401, 403] {
        let path = format!("/status/{status}");
        let delivery = format!("delivery-{status}");
        for attempt in 1..=2 {
            let answer = Reply::of(send(reqwest::Method::POST, &path, &delivery)).await;
            assert_eq!(answer.status, status);
            assert!(
                !answer.is_replay(),
                "attempt {attempt} of {status} is executed again"
            );
        }
    }
    assert_eq!(env.upstream.executions(), 4);
    // An explicit release_statuses list wins: there a 401 is stored like any answer.
    let first = Reply::of(send(reqwest::Method::PATCH, "/status/401", "delivery-listed")).await;
    assert_eq!(first.status, 401);
    let again = Reply::of(send(reqwest::Method::PATCH, "/status/401", "delivery-listed")).await;
    assert!(again.is_replay(), "{:?}", again.headers);
    assert_eq!(env.upstream.executions(), 5);
}

const ROUTE_FROM_ENV: &str = "[[routes]]\nname = \"stripe\"\npath = \"/webhooks/stripe\"\nkey = \"json:/id\"\n\
    unscoped = \"shared\"\nscope_headers = []\n\
    signature = { scheme = \"stripe\", secrets_env = \"HOOK_SIGNING_SECRET\" }\n";

#[tokio::test]
async fn a_missing_or_malformed_secret_stops_the_start_with_one_line_naming_the_key() {
    let file = config_file(ROUTE_FROM_ENV);
    let path = file.path().to_str().expect("a UTF-8 path");
    for env in [
        &[][..],
        &[("HOOK_SIGNING_SECRET", "sk_live_not_a_webhook_secret")][..],
    ] {
        let output = idemproxy(&["serve", "--config", path], env).await;
        assert_eq!(output.status.code(), Some(64), "{output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
        assert!(stderr.contains("routes[0].signature.secrets_env"), "{stderr}");
        assert!(stderr.contains("HOOK_SIGNING_SECRET"), "{stderr}");
        assert!(
            !stderr.contains("sk_live"),
            "the secret is never printed: {stderr}"
        );
    }
    let secret = "whsec_never_printed_1234";
    let output = idemproxy(
        &["check-config", "--config", path],
        &[("HOOK_SIGNING_SECRET", secret)],
    )
    .await;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(!printed.contains(secret), "{printed}");
    assert!(
        printed.contains("secrets_env = \"HOOK_SIGNING_SECRET\""),
        "{printed}"
    );
    assert!(
        printed.contains(
            "signature stripe (1 secret; every method and every case and trailing slash of the path verified)"
        ),
        "check-config says what the route verifies: {printed}"
    );
}
