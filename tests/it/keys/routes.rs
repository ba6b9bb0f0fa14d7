//! `[[routes]]` as clients see them: which policy a request gets by path and method, what each route's
//! keys are unique within, the key expiry header, the problem type base, and the route table
//! `check-config` prints. And the one spelling of a path (`server.paths`): other spellings of a route's
//! path take that route, and go upstream, in their normal form, or are refused; prefixes take whole
//! segments; routes may ignore case and a trailing slash. Hostile spellings go over a raw socket, as a
//! client library would normalise some of them itself.

use std::time::SystemTime;

use rstest::rstest;

use crate::support::cli::{config_file, idemproxy};
use crate::support::http::{TEST_CREDENTIAL, client};
use crate::support::raw::{self, RawReply};
use crate::support::{Backend, ProxyProcess, Reply, TestEnv, keyed_post, poll_until, settled};

const PAYMENTS: &str = r#"
name = "payments"
path = "/payments"
required = true
ttl = "48h"
"#;

const HEALTH: &str = r#"
name = "health"
path_prefix = "/health"
passthrough = true
"#;

const REFUNDS: &str = r#"
name = "refunds"
path = "/orders/*/refund"
match_methods = ["POST"]
methods = ["POST", "PUT"]
"#;

fn unkeyed_post(base: &str, path: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("{base}{path}"))
        .header("authorization", TEST_CREDENTIAL)
        .header("content-type", "application/json")
        .body("{}")
}

#[rstest]
#[tokio::test]
async fn each_request_gets_the_policy_of_the_first_route_that_matches(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env.config().route(PAYMENTS).route(HEALTH).route(REFUNDS);
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();

    // payments requires a key; the default route does not.
    Reply::of(unkeyed_post(&url, "/payments"))
        .await
        .assert_problem(400, "missing-key");
    assert_eq!(Reply::of(unkeyed_post(&url, "/orders")).await.status, 201);
    assert_eq!(
        env.upstream.executions(),
        1,
        "only the unkeyed default-route request ran"
    );

    // A passthrough route forwards keyed requests every time.
    for _ in 0..2 {
        let reply = Reply::of(keyed_post(&url, "/health/deep", "hk-1", "{}")).await;
        assert_eq!(reply.status, 201);
        assert!(!reply.is_replay());
    }
    assert_eq!(env.upstream.executions_for_key("hk-1"), 2);

    // The refund route protects PUT too, which the default route passes through.
    let put = |path: &str| {
        client()
            .put(format!("{url}{path}"))
            .header("idempotency-key", "put-1")
            .header("authorization", TEST_CREDENTIAL)
            .body("{}")
    };
    let first = Reply::of(put("/orders/7/refund")).await;
    // match_methods = ["POST"]: a PUT is not this route's, so the default route passes it through.
    assert_eq!(first.status, 201);
    let again = Reply::of(put("/orders/7/refund")).await;
    assert!(!again.is_replay(), "the default route does not protect PUT");
    let posted = Reply::of(keyed_post(&url, "/orders/7/refund", "refund-1", "{}")).await;
    let replayed = Reply::of(keyed_post(&url, "/orders/7/refund", "refund-1", "{}")).await;
    assert_eq!(posted.status, 201);
    assert!(replayed.is_replay(), "the refund route protects its POSTs");
    assert_eq!(env.upstream.executions_for_key("refund-1"), 1);
}

#[rstest]
#[tokio::test]
async fn a_key_is_unique_within_its_route_scope(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .route("name = \"a\"\npath_prefix = \"/a/\"")
        .route("name = \"b\"\npath_prefix = \"/b/\"")
        .route("name = \"v1\"\npath_prefix = \"/v1/\"\nscope = \"orders\"")
        .route("name = \"v2\"\npath_prefix = \"/v2/\"\nscope = \"orders\"");
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();

    // One client, one key, two routes: two operations.
    assert_eq!(
        Reply::of(keyed_post(&url, "/a/x", "same", "{}")).await.status,
        201
    );
    assert!(
        !Reply::of(keyed_post(&url, "/b/x", "same", "{}"))
            .await
            .is_replay()
    );
    assert!(
        Reply::of(keyed_post(&url, "/a/x", "same", "{}"))
            .await
            .is_replay()
    );
    assert_eq!(env.upstream.executions_for_key("same"), 2);

    // Two routes sharing a scope name share their keys: the key used on v1 is taken on v2 (for another
    // path, so another request: 422).
    assert_eq!(
        Reply::of(keyed_post(&url, "/v1/orders", "shared", "{}"))
            .await
            .status,
        201
    );
    Reply::of(keyed_post(&url, "/v2/orders", "shared", "{}"))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions_for_key("shared"), 1);
}

#[rstest]
#[tokio::test]
async fn a_webhook_route_is_scoped_by_its_sender_not_by_a_credential(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .route("name = \"hooks\"\npath_prefix = \"/hooks/\"\nscope_headers = [\"x-sender\"]")
        .route("name = \"events\"\npath_prefix = \"/events/\"\nscope_headers = []\nunscoped = \"shared\"");
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();
    let hook = |sender: Option<&str>, key: &str| {
        let request = client()
            .post(format!("{url}/hooks/in"))
            .header("idempotency-key", key)
            .body("{}");
        match sender {
            Some(sender) => request.header("x-sender", sender),
            None => request,
        }
    };

    assert_eq!(Reply::of(hook(Some("shop-a"), "d-1")).await.status, 201);
    assert!(Reply::of(hook(Some("shop-a"), "d-1")).await.is_replay());
    assert!(!Reply::of(hook(Some("shop-b"), "d-1")).await.is_replay());
    assert_eq!(
        env.upstream.executions_for_key("d-1"),
        2,
        "one execution per sender"
    );
    let refused = Reply::of(hook(None, "d-2")).await;
    refused.assert_problem(400, "missing-scope");
    let detail = refused.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("route \"hooks\" (x-sender)"), "{detail}");

    // With a shared scope no credential is needed, and every client shares the keys.
    let event = || {
        client()
            .post(format!("{url}/events/in"))
            .header("idempotency-key", "e-1")
            .body("{}")
    };
    assert_eq!(Reply::of(event()).await.status, 201);
    assert!(Reply::of(event()).await.is_replay());
    assert_eq!(env.upstream.executions_for_key("e-1"), 1);
}

/// The expiry an `Idempotency-Expires` header announces, as seconds from now.
fn expires_in(reply: &Reply) -> i64 {
    let value = reply.header("idempotency-expires").expect("the expiry header");
    let at = httpdate::parse_http_date(value).expect("an HTTP date");
    let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
    secs(at) - secs(SystemTime::now())
}

#[rstest]
#[tokio::test]
async fn the_expiry_header_tells_each_client_when_its_route_forgets_the_key(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("idempotency.expires_header", "Idempotency-Expires")
        .route(PAYMENTS);
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();
    let hour = 3600;

    let first = Reply::of(keyed_post(&url, "/payments", "pay-1", "{}")).await;
    assert_eq!(first.status, 201);
    let left = expires_in(&first);
    assert!((48 * hour - 60..=48 * hour).contains(&left), "48h route: {left}s");
    let replay = Reply::of(keyed_post(&url, "/payments", "pay-1", "{}")).await;
    assert!(replay.is_replay());
    assert!(
        (left - 60..=left).contains(&expires_in(&replay)),
        "the same expiry on the replay"
    );

    let default = Reply::of(keyed_post(&url, "/orders", "ord-1", "{}")).await;
    let left = expires_in(&default);
    assert!(
        (24 * hour - 60..=24 * hour).contains(&left),
        "24h default: {left}s"
    );

    // Neither a refusal nor a passthrough names an expiry: no key is kept for them.
    let refused = Reply::of(unkeyed_post(&url, "/payments")).await;
    assert_eq!(refused.header("idempotency-expires"), None);
    let passed = Reply::of(unkeyed_post(&url, "/orders")).await;
    assert_eq!(passed.header("idempotency-expires"), None);
}

#[rstest]
#[tokio::test]
async fn problem_types_point_at_the_operators_documentation(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .set("server.problem_type_base", "https://docs.example.com/errors#")
        .route(PAYMENTS);
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let reply = Reply::of(unkeyed_post(&proxy.url.clone(), "/payments")).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.json()["type"],
        "https://docs.example.com/errors#missing-key"
    );
}

#[tokio::test]
async fn check_config_prints_the_route_table_in_match_order() {
    let file = config_file(&format!(
        "[[routes]]\n{PAYMENTS}\n[[routes]]\n{HEALTH}\n[[routes]]\n{REFUNDS}\n"
    ));
    let output = idemproxy(&["check-config", "--config", file.path().to_str().unwrap()], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|line| !line.starts_with("# Routes"))
        .collect();
    assert_eq!(table.len(), 5, "{stdout}");
    assert!(
        table[1].contains("0. \"payments\" * path = \"/payments\""),
        "{stdout}"
    );
    assert!(
        table[1].contains("(required)") && table[1].contains("ttl 2days"),
        "{stdout}"
    );
    assert!(
        table[2].contains("1. \"health\" * path_prefix = \"/health\": passthrough"),
        "{stdout}"
    );
    assert!(
        table[3].contains("2. \"refunds\" POST path = \"/orders/*/refund\""),
        "{stdout}"
    );
    assert!(table[3].contains("protects POST,PUT"), "{stdout}");
    assert!(
        table[4].contains("-. \"default\" * (any other request)"),
        "{stdout}"
    );
    assert!(stdout.parse::<toml::Table>().is_ok(), "check-config prints TOML");
}

#[tokio::test]
async fn a_route_that_can_never_match_stops_the_start_with_one_line() {
    let file = config_file(
        "[[routes]]\nname = \"all\"\npath_prefix = \"/\"\n[[routes]]\nname = \"pay\"\npath = \"/pay\"\n",
    );
    let output = idemproxy(&["serve", "--config", file.path().to_str().unwrap()], &[]).await;
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("routes[1]") && stderr.contains("routes[0]"),
        "{stderr}"
    );
}

/// The text of the first block opened by `fence` after `after`, in docs/routes.md.
fn doc_block(after: &str, fence: &str) -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/routes.md")).unwrap();
    let section = &doc[doc.find(after).expect("the section of docs/routes.md")..];
    let start = section.find(fence).expect("the block") + fence.len();
    let end = start + section[start..].find("```").expect("the block's end");
    section[start..end].to_owned()
}

#[tokio::test]
async fn the_documented_route_example_prints_the_table_the_docs_show() {
    let example = doc_block("\n## Routes\n", "```toml\n");
    let file = config_file(&example);
    let output = idemproxy(&["check-config", "--config", file.path().to_str().unwrap()], &[]).await;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let printed = &stdout[stdout.find("# Routes").expect("the route table")..];
    let shown = doc_block("`check-config`** prints the resolved table", "```\n");
    assert_eq!(printed, shown);
}

/// Sends a keyed POST whose response the upstream breaks off mid-body; the client sees it broken.
async fn broken_post(base: &str, key: &str) {
    let response = keyed_post(base, "/reset-mid-body", key, "{}").send().await;
    let broken = match response {
        Ok(response) => response.bytes().await.is_err(),
        Err(_) => true,
    };
    assert!(broken, "the client must not see a complete body");
}

#[rstest]
#[tokio::test]
async fn each_route_option_applies_to_its_own_route_only(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let config = env
        .config()
        .route("name = \"keep-503\"\npath = \"/status/503\"\nrelease_statuses = []")
        .route(
            "name = \"tenant\"\npath = \"/tenant\"\nfingerprint_headers = [\"content-type\", \"x-version\"]",
        )
        .route("name = \"small\"\npath = \"/small\"\nmax_request_body = \"16B\"")
        .route(
            "name = \"sessions\"\npath = \"/cookie\"\nnever_store_headers = [\"set-cookie\", \"x-session\"]",
        )
        .route("name = \"quick\"\npath = \"/reset-mid-body\"\nlock_timeout = \"1s\"\nttl = \"1h\"");
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();
    let post = |path: &str, key: &str| keyed_post(&url, path, key, "{}");

    // release_statuses = []: a 503 is stored and replayed, where the default releases it.
    assert_eq!(Reply::of(post("/status/503", "s-1")).await.status, 503);
    assert!(Reply::of(post("/status/503", "s-1")).await.is_replay());
    assert_eq!(env.upstream.executions_for_key("s-1"), 1);
    assert_eq!(Reply::of(post("/status/502", "s-2")).await.status, 502);
    assert!(!Reply::of(post("/status/502", "s-2")).await.is_replay());
    assert_eq!(env.upstream.executions_for_key("s-2"), 2);

    // A fingerprint header of one route: another value is another request (422) there only.
    let versioned = |path: &str, version: &str| post(path, "v-1").header("x-version", version);
    assert_eq!(Reply::of(versioned("/tenant", "1")).await.status, 201);
    Reply::of(versioned("/tenant", "2"))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(Reply::of(versioned("/other", "1")).await.status, 201);
    assert!(Reply::of(versioned("/other", "2")).await.is_replay());

    // max_request_body of one route.
    let big = "x".repeat(100);
    Reply::of(keyed_post(&url, "/small", "b-1", &big))
        .await
        .assert_problem(413, "request-too-large");
    assert_eq!(
        Reply::of(keyed_post(&url, "/large", "b-1", &big)).await.status,
        201
    );

    // never_store_headers of one route: the replay there lacks x-session, the default's keeps it.
    let first = Reply::of(post("/cookie", "c-1")).await;
    assert!(first.header("x-session").is_some());
    let replay = Reply::of(post("/cookie", "c-1")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.header("x-session"), None);

    // lock_timeout of one route: an ambiguous failure holds the key for 1 s there, after which the
    // retry runs again (a stale takeover); the default route's 30 s lease would still answer 409.
    broken_post(&url, "r-1").await;
    Reply::of(post("/reset-mid-body", "r-1"))
        .await
        .assert_problem(409, "key-in-flight");
    crate::support::poll_until("the 1 s lease to run out", || async {
        // Executed again, the retry is broken off mid-body like the original.
        match Reply::try_of(post("/reset-mid-body", "r-1")).await {
            Ok(reply) if reply.status == 409 => None,
            _ => Some(()),
        }
    })
    .await;
    assert_eq!(env.upstream.executions_for_key("r-1"), 2);
}

/// `POST {target}` with a JSON body (and `key`, when given) over a raw socket: the target as written.
async fn raw_post(base: &str, target: &str, key: Option<&str>) -> RawReply {
    let body = "{}";
    let length = format!("content-length: {}", body.len());
    let key = key.map(|key| format!("idempotency-key: {key}"));
    let mut headers = vec!["content-type: application/json", length.as_str()];
    headers.extend(key.as_deref());
    let head = raw::head(&format!("POST {target}"), raw::addr_of(base), &headers);
    raw::exchange(base, format!("{head}{body}").as_bytes()).await
}

/// The paths and queries the stub upstream received, in order.
fn received(env: &TestEnv) -> Vec<String> {
    env.upstream
        .requests()
        .into_iter()
        .map(|r| r.path_and_query)
        .collect()
}

/// Spellings of `/payments` a client can send, each another way past an exact route.
const SPELLINGS: &[&str] = &[
    "//payments",
    "///payments",
    "/%70ayments",
    "/%70%61yments",
    "/./payments",
    "/x/../payments",
    "/../payments",
    "/%2e/payments",
    "/x/%2E%2e/payments",
    "/x/y/../../payments",
];

#[tokio::test]
async fn every_spelling_of_a_required_route_needs_its_key() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = crate::support::InProcessProxy::start(&env.config().route(PAYMENTS)).await;
    for spelling in SPELLINGS {
        raw_post(&proxy.url, spelling, None)
            .await
            .assert_problem(400, "missing-key");
    }
    // Over HTTP/2 too (the client keeps the empty segment).
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let refused = Reply::of(
        h2.post(format!("{}//payments", proxy.url))
            .header("authorization", TEST_CREDENTIAL)
            .body("{}"),
    )
    .await;
    refused.assert_problem(400, "missing-key");
    assert_eq!(
        received(&env),
        Vec::<String>::new(),
        "nothing reached the upstream"
    );
}

#[tokio::test]
async fn a_keyed_request_goes_upstream_in_normal_form_and_its_retries_in_any_spelling_replay() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .route(PAYMENTS)
        .route("name = \"orders\"\npath_prefix = \"/orders\"\nkey = \"template:{path}/{header:x-op}\"");
    let proxy = crate::support::InProcessProxy::start(&config).await;

    let first = raw_post(&proxy.url, "//x/..//payments?a=%2e%2E&b=//c", Some("pay-1")).await;
    assert_eq!(first.status, Some(201), "{first:?}");
    assert_eq!(received(&env), ["/payments?a=%2e%2E&b=//c"], "the query as sent");
    // The fingerprint saw the normal form: a retry in another spelling is the same request.
    for spelling in ["/./payments", "/%70ayments", "/payments"] {
        let retry = raw_post(&proxy.url, &format!("{spelling}?a=%2e%2E&b=//c"), Some("pay-1")).await;
        assert_eq!(retry.status, Some(201), "{spelling}: {retry:?}");
        assert_eq!(retry.header("idempotent-replayed"), Some("true"), "{spelling}");
    }
    assert_eq!(env.upstream.executions_for_key("pay-1"), 1);

    // `{path}` in a key template sees the normal form: one key for every spelling.
    let op = |target: &str| {
        let head = raw::head(
            &format!("POST {target}"),
            raw::addr_of(&proxy.url),
            &["x-op: capture", "content-length: 2"],
        );
        format!("{head}{{}}")
    };
    let executed = raw::exchange(&proxy.url, op("/orders/%34%32").as_bytes()).await;
    assert_eq!(executed.status, Some(201), "{executed:?}");
    let other = raw::exchange(&proxy.url, op("/orders//42/.").as_bytes()).await;
    assert_eq!(other.status, Some(201), "{other:?}");
    assert_eq!(
        other.header("idempotent-replayed"),
        None,
        "/orders/42/ is another path"
    );
    let replayed = raw::exchange(&proxy.url, op("/orders/x/../42").as_bytes()).await;
    assert_eq!(
        replayed.header("idempotent-replayed"),
        Some("true"),
        "{replayed:?}"
    );
    assert_eq!(
        received(&env)[1..],
        ["/orders/42", "/orders/42/"],
        "two executions, in normal form"
    );
}

#[tokio::test]
async fn a_prefix_takes_whole_segments_only() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = crate::support::InProcessProxy::start(&env.config().route(HEALTH)).await;
    let url = proxy.url.clone();
    // /health/... passes through every time; /healthz is the default route's, which protects it.
    for path in ["/health", "/health/deep"] {
        for _ in 0..2 {
            let reply = Reply::of(keyed_post(&url, path, path, "{}")).await;
            assert!(!reply.is_replay(), "{path}");
        }
        assert_eq!(env.upstream.executions_for_key(path), 2, "{path}");
    }
    assert_eq!(
        Reply::of(keyed_post(&url, "/healthz", "hz", "{}")).await.status,
        201
    );
    assert!(
        settled(|| keyed_post(&url, "/healthz", "hz", "{}"))
            .await
            .is_replay()
    );
    assert_eq!(env.upstream.executions_for_key("hz"), 1);
}

#[tokio::test]
async fn reject_mode_refuses_every_other_spelling_with_a_problem() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env.config().set("server.paths", "reject").route(PAYMENTS);
    let proxy = crate::support::InProcessProxy::start(&config).await;
    for spelling in SPELLINGS.iter().chain(&["/payments/x/..", "/caf%c3%a9"]) {
        let refused = raw_post(&proxy.url, spelling, Some("k-1")).await;
        refused.assert_problem(400, "non-normal-path");
        let detail = serde_json::from_slice::<serde_json::Value>(&refused.body).unwrap()["detail"].clone();
        assert!(detail.as_str().unwrap().contains("normal form"), "{detail}");
    }
    assert_eq!(
        received(&env),
        Vec::<String>::new(),
        "nothing reached the upstream"
    );
    let normal = raw_post(&proxy.url, "/payments?q=//./", Some("k-1")).await;
    assert_eq!(normal.status, Some(201), "{normal:?}");
    assert_eq!(received(&env), ["/payments?q=//./"]);
}

#[tokio::test]
async fn encoded_slashes_backslashes_and_path_parameters_are_refused_unless_kept() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = crate::support::InProcessProxy::start(&env.config().route(PAYMENTS)).await;
    for target in [
        "/v1%2Fpayments",
        "/v1%2fpayments",
        "/x/..%2F..%2Fpayments",
        "/v1%5Cpayments",
        "/payments;jsessionid=1",
        "/x/..;/payments",
        "/payments%zz",
        "/payments%",
    ] {
        raw_post(&proxy.url, target, None)
            .await
            .assert_problem(400, "non-normal-path");
    }
    // A raw backslash reaches the proxy (hyper lets it through), which refuses it the same way.
    raw_post(&proxy.url, "/x\\..\\payments", None)
        .await
        .assert_problem(400, "non-normal-path");
    assert_eq!(
        received(&env),
        Vec::<String>::new(),
        "nothing reached the upstream"
    );
    proxy.stop().await.expect("a clean stop");

    let kept = env
        .config()
        .set("server.escaped_slashes", "keep")
        .set("server.path_parameters", "keep")
        .route(PAYMENTS);
    let proxy = crate::support::InProcessProxy::start(&kept).await;
    // Kept, they are data: no separator for the route, and forwarded as the normal form spells them.
    for (target, upstream) in [
        ("/x/..%2f..%2fpayments", "/x/..%2F..%2Fpayments"),
        ("/payments;v=1", "/payments;v=1"),
        ("/a%5c%70", "/a%5Cp"),
    ] {
        let reply = raw_post(&proxy.url, target, None).await;
        assert_eq!(
            reply.status,
            Some(201),
            "{target} takes the default route: {reply:?}"
        );
        assert_eq!(received(&env).last().map(String::as_str), Some(upstream));
    }
}

#[tokio::test]
async fn a_route_may_ignore_case_and_a_trailing_slash_and_forwards_its_own_spelling() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .route(
            "name = \"payments\"\npath = \"/v1/payments\"\nrequired = true\nignore_case = true\n\
             ignore_trailing_slash = true",
        )
        .route("name = \"refunds\"\npath = \"/v1/refunds\"\nrequired = true");
    let proxy = crate::support::InProcessProxy::start(&config).await;
    let url = proxy.url.clone();

    for spelling in [
        "/V1/payments",
        "/v1/PAYMENTS/",
        "/V1/Payments/",
        "//V1/./payments/",
    ] {
        raw_post(&url, spelling, None)
            .await
            .assert_problem(400, "missing-key");
    }
    assert_eq!(received(&env), Vec::<String>::new());

    // Every spelling is one request: forwarded as the route writes it, then replayed.
    let first = Reply::of(keyed_post(&url, "/V1/Payments/?q=A", "p-1", "{}")).await;
    assert_eq!(first.status, 201);
    assert_eq!(received(&env), ["/v1/payments?q=A"]);
    for spelling in ["/v1/payments?q=A", "/V1/PAYMENTS?q=A"] {
        assert!(
            settled(|| keyed_post(&url, spelling, "p-1", "{}"))
                .await
                .is_replay()
        );
    }
    Reply::of(keyed_post(&url, "/v1/payments?q=a", "p-1", "{}"))
        .await
        .assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions_for_key("p-1"), 1);

    // A route without the options takes its own spelling only; the others are refused rather than
    // passed through unprotected, since frameworks that route without case or slash would run its handler.
    raw_post(&url, "/v1/refunds", None)
        .await
        .assert_problem(400, "missing-key");
    for other in ["/V1/refunds", "/v1/refunds/"] {
        raw_post(&url, other, None)
            .await
            .assert_problem(400, "non-normal-path");
    }
    assert_eq!(
        received(&env),
        ["/v1/payments?q=A"],
        "nothing else reached the upstream"
    );
}

#[tokio::test]
async fn the_access_log_carries_the_path_that_was_routed() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let config = env
        .config()
        .set("log.format", "json")
        .set("log.filter", "info,idemproxy=debug")
        .set("log.access", true)
        .route(PAYMENTS);
    let proxy = ProxyProcess::spawn(&config).await;
    raw_post(&proxy.url, "//x/../%70ayments?secret=1", None)
        .await
        .assert_problem(400, "missing-key");
    let event = |wanted: fn(&serde_json::Value) -> bool| {
        proxy
            .stderr()
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .find(wanted)
    };
    let access = poll_until("the access line", || async {
        event(|e| e["target"] == "idemproxy::access")
    })
    .await;
    assert_eq!(access["path"], "/payments", "{access}");
    assert_eq!(access["route"], "payments", "{access}");
    let refused = event(|e| e["message"] == "request refused").expect("the refusal's event");
    assert_eq!(refused["route"], "payments", "{refused}");
    assert_eq!(refused["span"], "request", "{refused}");
    assert!(!proxy.stderr().contains("secret=1"), "the query is never logged");
}
