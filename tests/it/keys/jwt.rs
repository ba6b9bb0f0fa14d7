//! Keys scoped by who the client is by its verified bearer token (`scope_jwt`), with tokens minted by
//! PyJWT (`jwt/mint.py`) on RSA, EC and Ed25519 keys and a key set served over HTTP as an issuer serves
//! it: a token refreshed for the same subject is the same client (its retry is replayed), another
//! subject another client; a forged, expired, premature, foreign, unsigned or HMAC-on-a-public-key token
//! on a keyed request is `401 invalid-token` and reaches nothing, while an unkeyed request goes to the
//! app untouched; a key rotated in (a new `kid`) is read without a restart, and the last good set is
//! kept while the endpoint fails; `/readyz` waits for the first set.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::support::cli::{config_file, json, keys_with};
use crate::support::http::{client, metric, readyz};
use crate::support::{InProcessProxy, ProxyProcess, Reply, TestEnv, poll_until};

/// `mint.py` and `requirements.txt` (PyJWT with cryptography, pinned).
const PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/keys/jwt");

const ISSUER: &str = "https://issuer.test/";
const AUDIENCE: &str = "payments";

/// A Python with PyJWT installed, in `target/test-tools/pyjwt` (seconds on first use).
fn pyjwt_python() -> PathBuf {
    crate::support::tools::python_venv("pyjwt", Path::new(&format!("{PROGRAMS}/requirements.txt")))
}

/// Key sets and tokens, minted anew for each test.
struct Minted {
    jwks_1: String,
    jwks_2: String,
    jwks_dup: String,
    tokens: HashMap<String, String>,
}

impl Minted {
    async fn new() -> Minted {
        let python = tokio::task::spawn_blocking(pyjwt_python).await.unwrap();
        let run = tokio::process::Command::new(python)
            .arg(format!("{PROGRAMS}/mint.py"))
            .args([ISSUER, AUDIENCE])
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("mint.py runs within a minute")
            .unwrap();
        assert!(
            output.status.success(),
            "mint.py: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let minted: Value = serde_json::from_slice(&output.stdout).expect("mint.py prints one JSON object");
        let tokens = minted["tokens"].as_object().unwrap();
        Minted {
            jwks_1: minted["jwks_1"].to_string(),
            jwks_2: minted["jwks_2"].to_string(),
            jwks_dup: minted["jwks_dup"].to_string(),
            tokens: tokens
                .iter()
                .map(|(name, token)| (name.clone(), token.as_str().unwrap().to_owned()))
                .collect(),
        }
    }

    fn token(&self, name: &str) -> &str {
        &self.tokens[name]
    }
}

/// An issuer's JWKS endpoint on a real socket: serves what it is told (as slowly as it is told), counts
/// its reads.
#[derive(Clone)]
pub(crate) struct JwksServer {
    pub(crate) url: String,
    answer: Arc<Mutex<(StatusCode, String)>>,
    delay: Arc<Mutex<Duration>>,
    reads: Arc<AtomicUsize>,
}

impl JwksServer {
    pub(crate) async fn start(body: &str) -> JwksServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = JwksServer {
            url: format!("http://{}/.well-known/jwks.json", listener.local_addr().unwrap()),
            answer: Arc::new(Mutex::new((StatusCode::OK, body.to_owned()))),
            delay: Arc::default(),
            reads: Arc::default(),
        };
        let serving = server.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let serving = serving.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |_request: Request<hyper::body::Incoming>| {
                        serving.reads.fetch_add(1, Ordering::SeqCst);
                        let (status, body) = serving.answer.lock().unwrap().clone();
                        let delay = *serving.delay.lock().unwrap();
                        let mut response = Response::new(Full::new(Bytes::from(body)));
                        *response.status_mut() = status;
                        async move {
                            tokio::time::sleep(delay).await;
                            Ok::<_, Infallible>(response)
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        server
    }

    pub(crate) fn serve(&self, status: StatusCode, body: &str) {
        *self.answer.lock().unwrap() = (status, body.to_owned());
    }

    /// Every answer from now on takes this long.
    fn slow(&self, delay: Duration) {
        *self.delay.lock().unwrap() = delay;
    }

    fn reads(&self) -> usize {
        self.reads.load(Ordering::SeqCst)
    }
}

/// A route keyed by `Idempotency-Key` (required) whose scope is the token's verified `iss` and `sub`.
fn routes(jwks_url: &str, min_refetch: &str) -> String {
    format!(
        r#"
[[routes]]
name = "payments"
path = "/payments"
scope_jwt = {{ jwks_url = "{jwks_url}", issuers = ["{ISSUER}"], audiences = ["{AUDIENCE}"], min_refetch = "{min_refetch}" }}
"#
    )
}

/// `POST /payments` with `token` as a bearer credential, keyed `key` (or not keyed).
async fn pay(proxy_url: &str, token: &str, key: Option<&str>, body: &str) -> Reply {
    let mut request = client()
        .post(format!("{proxy_url}/payments"))
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    Reply::of(request).await
}

#[tokio::test]
async fn a_refreshed_token_for_the_same_subject_replays_and_another_subject_runs_on_its_own() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let (env, proxy) = TestEnv::with_routes(&routes(&jwks.url, "30s")).await;

    let first = pay(
        &proxy.url,
        minted.token("alice"),
        Some("pay-1"),
        r#"{"amount":100}"#,
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.is_replay());
    for retry_with in ["alice_refreshed", "alice_ec", "alice_eddsa", "alice_no_kid"] {
        let retry = pay(
            &proxy.url,
            minted.token(retry_with),
            Some("pay-1"),
            r#"{"amount":100}"#,
        )
        .await;
        assert_eq!(retry.status, 201, "{retry_with}: {}", retry.text());
        assert!(
            retry.is_replay(),
            "a retry with {retry_with} is the same client's"
        );
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(
        env.upstream.executions(),
        1,
        "a refreshed token executes nothing again"
    );

    let bob = pay(
        &proxy.url,
        minted.token("bob"),
        Some("pay-1"),
        r#"{"amount":100}"#,
    )
    .await;
    assert_eq!(bob.status, 201, "{}", bob.text());
    assert!(!bob.is_replay(), "another subject is another client");
    assert_eq!(env.upstream.executions(), 2);

    let changed = pay(
        &proxy.url,
        minted.token("alice_refreshed"),
        Some("pay-1"),
        r#"{"amount":999}"#,
    )
    .await;
    changed.assert_problem(422, "key-reused");
    assert_eq!(env.upstream.executions(), 2);
    assert_eq!(
        env.upstream.requests()[0].headers["authorization"],
        format!("Bearer {}", minted.token("alice")),
        "the app gets the token as sent"
    );
}

#[tokio::test]
async fn a_token_that_does_not_verify_gets_401_and_reaches_nothing_unless_unkeyed() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let (env, proxy) = TestEnv::with_routes(&routes(&jwks.url, "30s")).await;

    let refused = [
        "forged",
        "expired",
        "not_yet",
        "other_audience",
        "other_issuer",
        "no_subject",
        "no_expiry",
        "unknown_kid",
        "alg_none",
        "hmac_with_public_key",
        "critical_extension",
        "issuer_array",
        "nbf_text",
        "subject_past_64_bits",
        "empty_subject",
        "subject_named_twice",
    ];
    for (n, name) in refused.iter().enumerate() {
        let reply = pay(&proxy.url, minted.token(name), Some(&format!("bad-{n}")), "{}").await;
        reply.assert_problem(401, "invalid-token");
        assert_eq!(
            reply.header("www-authenticate"),
            Some(r#"Bearer error="invalid_token""#),
            "{name}"
        );
        assert!(
            !reply.text().contains(minted.token(name)),
            "{name}: the answer never repeats the token"
        );
    }
    // Why, in words that name the part at fault.
    let twice = pay(
        &proxy.url,
        minted.token("subject_named_twice"),
        Some("bad-twice"),
        "{}",
    )
    .await;
    assert!(twice.text().contains("named twice"), "{}", twice.text());
    let unsigned = pay(&proxy.url, minted.token("alg_none"), Some("bad-none"), "{}").await;
    assert!(unsigned.text().contains("alg"), "{}", unsigned.text());
    for garbage in ["abc", "a.b.c", "Zm9v.YmFy.YmF6", ""] {
        let reply = pay(&proxy.url, garbage, Some("bad-garbage"), "{}").await;
        if garbage.is_empty() {
            // `Bearer ` with nothing after it is no bearer token: the request names no client.
            reply.assert_problem(400, "missing-scope");
        } else {
            reply.assert_problem(401, "invalid-token");
        }
    }
    assert_eq!(env.upstream.executions(), 0, "no refused request reached the app");
    let rejected = metric(
        &proxy.admin_url,
        "idemproxy_requests_total",
        &[("outcome", "rejected")],
    )
    .await;
    assert_eq!(rejected, (refused.len() + 6) as f64);

    // The app stays the authority on access: an unkeyed request is forwarded as it came.
    let unkeyed = pay(&proxy.url, minted.token("forged"), None, "{}").await;
    assert_eq!(unkeyed.status, 201, "{}", unkeyed.text());
    assert_eq!(env.upstream.executions(), 1);
    assert_eq!(
        env.upstream.requests()[0].headers["authorization"],
        format!("Bearer {}", minted.token("forged"))
    );
}

#[tokio::test]
async fn a_key_rotated_in_is_read_without_a_restart_and_a_failing_endpoint_keeps_the_last_set() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let (env, proxy) = TestEnv::with_routes(&routes(&jwks.url, "1s")).await;
    let reads_at_start = jwks.reads();
    assert!(reads_at_start >= 1, "the set was read before the proxy was ready");

    // Tokens naming a kid the set lacks, all at once: the set is read again at most once for them.
    let ghosts = (0..20).map(|n| {
        let url = proxy.url.clone();
        let token = minted.token("unknown_kid").to_owned();
        async move { pay(&url, &token, Some(&format!("ghost-{n}")), "{}").await }
    });
    for reply in futures_util::future::join_all(ghosts).await {
        reply.assert_problem(401, "invalid-token");
    }
    assert!(
        jwks.reads() <= reads_at_start + 1,
        "20 tokens with an unknown kid read the set {} times",
        jwks.reads() - reads_at_start
    );

    // The issuer rotates a key in; a token signed with it is taken once the set is read again.
    jwks.serve(StatusCode::OK, &minted.jwks_2);
    let rotated = poll_until("a token on the rotated key to be taken", || async {
        let reply = pay(&proxy.url, minted.token("alice_rotated"), Some("rotated-1"), "{}").await;
        (reply.status == 201).then_some(reply)
    })
    .await;
    assert!(!rotated.is_replay());

    // The endpoint fails: the set read last is kept, and tokens on its keys are still taken.
    jwks.serve(StatusCode::INTERNAL_SERVER_ERROR, "down");
    let reads = jwks.reads();
    poll_until("the set to be read again while the endpoint fails", || async {
        let reply = pay(&proxy.url, minted.token("unknown_kid"), Some("ghost-again"), "{}").await;
        // 401 while the set read last (fine) is fresh; once a read has failed, whether the set now
        // holds the kid is not known: 503, try again.
        if reply.status == 503 {
            reply.assert_problem(503, "keys-unavailable");
        } else {
            reply.assert_problem(401, "invalid-token");
        }
        (jwks.reads() > reads).then_some(())
    })
    .await;
    let kept = pay(&proxy.url, minted.token("alice_rotated"), Some("rotated-1"), "{}").await;
    assert_eq!(kept.status, 201, "{}", kept.text());
    assert!(kept.is_replay(), "the rotated key is still known");
    let kept = pay(&proxy.url, minted.token("alice"), Some("after-failure"), "{}").await;
    assert_eq!(kept.status, 201, "{}", kept.text());
    assert_eq!(env.upstream.executions(), 2);
}

#[tokio::test]
async fn readiness_waits_for_the_first_key_set_and_keyed_requests_get_503_until_then() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start("").await;
    jwks.serve(StatusCode::SERVICE_UNAVAILABLE, "not yet");
    let env = TestEnv::new().await;
    let config = env.config().with_toml(&routes(&jwks.url, "1s"));
    let proxy = ProxyProcess::spawn_serving(&config).await;

    poll_until("the proxy to try the set", || async {
        (jwks.reads() > 0).then_some(())
    })
    .await;
    let unready = readyz(&proxy.admin_url).await;
    assert_eq!(unready.status, 503, "{}", unready.text());
    assert!(unready.text().contains("JWKS"), "{}", unready.text());
    let early = pay(&proxy.url, minted.token("alice"), Some("early"), "{}").await;
    early.assert_problem(503, "keys-unavailable");
    assert!(early.header("retry-after").is_some());
    assert_eq!(env.upstream.executions(), 0);

    jwks.serve(StatusCode::OK, &minted.jwks_1);
    poll_until("the proxy to be ready once the set is read", || async {
        (readyz(&proxy.admin_url).await.status == 200).then_some(())
    })
    .await;
    let first = pay(&proxy.url, minted.token("alice"), Some("early"), "{}").await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(env.upstream.executions(), 1);
}

/// The set may come from a file too; `check-config` reads it, and a broken one names the key.
#[tokio::test]
async fn a_key_set_from_a_file_verifies_as_one_from_a_url() {
    let minted = Minted::new().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, &minted.jwks_1).unwrap();
    let toml = format!(
        r#"
[[routes]]
name = "payments"
path = "/payments"
scope_jwt = {{ jwks_file = "{}", audiences = ["{AUDIENCE}"] }}
"#,
        file.display()
    );
    let (env, proxy): (TestEnv, InProcessProxy) = TestEnv::with_routes(&toml).await;
    let first = pay(&proxy.url, minted.token("alice"), Some("file-1"), "{}").await;
    assert_eq!(first.status, 201, "{}", first.text());
    let retry = pay(&proxy.url, minted.token("alice_refreshed"), Some("file-1"), "{}").await;
    assert!(retry.is_replay());
    pay(&proxy.url, minted.token("forged"), Some("file-2"), "{}")
        .await
        .assert_problem(401, "invalid-token");
    assert_eq!(env.upstream.executions(), 1);
}

/// A key set from a file is read again at a reload (`idemproxy reload`, as at SIGHUP): a key rotated in
/// the file is taken without a restart, and a route that names a set for the first time verifies with it.
#[tokio::test]
async fn a_key_file_rotated_is_read_again_at_a_reload() {
    let minted = Minted::new().await;
    let env = TestEnv::on(crate::support::Backend::Sqlite).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, &minted.jwks_1).unwrap();
    let route = format!(
        "name = \"payments\"\npath = \"/payments\"\nscope_jwt = {{ jwks_file = \"{}\", audiences = [\"{AUDIENCE}\"] }}",
        file.display()
    );
    let config = env.config();
    let proxy = ProxyProcess::spawn(&config.clone().route(&route)).await;
    pay(&proxy.url, minted.token("alice_rotated"), Some("file-r1"), "{}")
        .await
        .assert_problem(401, "invalid-token");

    std::fs::write(&file, &minted.jwks_2).unwrap();
    let reload = |proxy: &ProxyProcess| {
        let admin = proxy.admin_url.trim_start_matches("http://").to_owned();
        async move { crate::support::cli::idemproxy(&["reload", "--admin-listen", &admin], &[]).await }
    };
    let output = reload(&proxy).await;
    assert!(
        output.status.success(),
        "{}",
        crate::support::cli::stderr(&output)
    );
    let rotated = pay(&proxy.url, minted.token("alice_rotated"), Some("file-r1"), "{}").await;
    assert_eq!(
        rotated.status,
        201,
        "the rotated key is taken: {}",
        rotated.text()
    );
    assert_eq!(env.upstream.executions(), 1);

    // A second route naming another set, added by a reload, verifies with it at once.
    let other = dir.path().join("other.json");
    std::fs::write(&other, &minted.jwks_1).unwrap();
    let second = route.replace(
        "payments\"\npath = \"/payments\"",
        "refunds\"\npath = \"/refunds\"",
    );
    let second = second.replace(&file.display().to_string(), &other.display().to_string());
    std::fs::write(proxy.config_file(), config.route(&route).route(&second).to_toml()).unwrap();
    let output = reload(&proxy).await;
    assert!(
        output.status.success(),
        "{}",
        crate::support::cli::stderr(&output)
    );
    let refund = Reply::of(
        client()
            .post(format!("{}/refunds", proxy.url))
            .header("authorization", format!("Bearer {}", minted.token("alice")))
            .header("idempotency-key", "refund-1")
            .header("content-type", "application/json")
            .body("{}"),
    )
    .await;
    assert_eq!(refund.status, 201, "{}", refund.text());
    let forged = Reply::of(
        client()
            .post(format!("{}/refunds", proxy.url))
            .header("authorization", format!("Bearer {}", minted.token("forged")))
            .header("idempotency-key", "refund-2")
            .header("content-type", "application/json")
            .body("{}"),
    )
    .await;
    forged.assert_problem(401, "invalid-token");
}

/// A set may hold two keys under one kid (an issuer rotating a key in under the old one's kid): a token
/// signed by either verifies, and names the same client.
#[tokio::test]
async fn a_set_with_two_keys_under_one_kid_takes_a_token_signed_by_either() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_dup).await;
    let (env, proxy) = TestEnv::with_routes(&routes(&jwks.url, "30s")).await;

    let first = pay(&proxy.url, minted.token("alice_dup_first"), Some("dup-1"), "{}").await;
    assert_eq!(first.status, 201, "{}", first.text());
    let second = pay(&proxy.url, minted.token("alice_dup_second"), Some("dup-1"), "{}").await;
    assert_eq!(second.status, 201, "{}", second.text());
    assert!(
        second.is_replay(),
        "the same subject on the other key is the same client"
    );
    let forged = pay(&proxy.url, minted.token("forged"), Some("dup-2"), "{}").await;
    forged.assert_problem(401, "invalid-token");
    assert_eq!(env.upstream.executions(), 1);
}

/// While the issuer's endpoint fails, a token naming a kid the kept set lacks may be one signed by a key
/// just rotated in: it gets 503 `keys-unavailable` (try again), not 401 (which tells a client its good
/// token is bad). Once the endpoint answers, the token is taken.
#[tokio::test]
async fn a_kid_the_set_lacks_while_the_endpoint_fails_is_unavailable_not_invalid() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let (env, proxy) = TestEnv::with_routes(&routes(&jwks.url, "1s")).await;

    jwks.serve(StatusCode::INTERNAL_SERVER_ERROR, "down");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let reads = jwks.reads();
    let during = pay(&proxy.url, minted.token("alice_rotated"), Some("rotated-1"), "{}").await;
    assert!(jwks.reads() > reads, "the set was read again for the unknown kid");
    during.assert_problem(503, "keys-unavailable");
    assert!(during.header("retry-after").is_some());
    assert!(
        during.header("www-authenticate").is_none(),
        "the token was not found bad"
    );
    let known = pay(&proxy.url, minted.token("alice"), Some("known-1"), "{}").await;
    assert_eq!(known.status, 201, "a kid the kept set holds: {}", known.text());

    jwks.serve(StatusCode::OK, &minted.jwks_2);
    let rotated = poll_until("the rotated key to be read once the endpoint answers", || async {
        let reply = pay(&proxy.url, minted.token("alice_rotated"), Some("rotated-1"), "{}").await;
        (reply.status == 201).then_some(reply)
    })
    .await;
    assert!(!rotated.is_replay());
    assert_eq!(env.upstream.executions(), 2);
}

/// An endpoint that hangs holds no request: before the first read, a keyed request gets 503 at once
/// rather than waiting out the read; once read, tokens that wait for a slow read for an unknown kid wait
/// for that one read, not for another after it, and a token waits a few seconds at most for an endpoint
/// that hangs (then 503, try again), while tokens on known keys never wait.
#[tokio::test]
async fn a_slow_endpoint_holds_a_request_for_one_read_at_most() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    jwks.slow(Duration::from_secs(30));
    let env = TestEnv::new().await;
    let config = env.config().with_toml(&routes(&jwks.url, "1s"));
    let proxy = ProxyProcess::spawn_serving(&config).await;
    poll_until("the proxy to start reading the set", || async {
        (jwks.reads() > 0).then_some(())
    })
    .await;
    let started = std::time::Instant::now();
    let early = pay(&proxy.url, minted.token("alice"), Some("early"), "{}").await;
    early.assert_problem(503, "keys-unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the first read hangs, and the request waited {:?} for it",
        started.elapsed()
    );

    // The set is read (quickly), then the endpoint takes 2s to answer, with the same keys.
    jwks.slow(Duration::ZERO);
    poll_until("the proxy to be ready", || async {
        (readyz(&proxy.admin_url).await.status == 200).then_some(())
    })
    .await;
    jwks.slow(Duration::from_secs(2));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let reads = jwks.reads();
    let url = proxy.url.clone();
    let token = minted.token("unknown_kid").to_owned();
    let first = tokio::spawn(async move { pay(&url, &token, Some("ghost-1"), "{}").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    let second = pay(&proxy.url, minted.token("unknown_kid"), Some("ghost-2"), "{}").await;
    second.assert_problem(401, "invalid-token");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "a token waiting for a 2s read waited {:?}",
        started.elapsed()
    );
    first.await.unwrap().assert_problem(401, "invalid-token");
    assert_eq!(jwks.reads(), reads + 1, "the tokens waited for one read together");

    // The endpoint hangs: a token naming an unknown kid is told to try again within seconds.
    jwks.slow(Duration::from_secs(60));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = std::time::Instant::now();
    let hung = pay(&proxy.url, minted.token("alice_rotated"), Some("rotated-1"), "{}").await;
    hung.assert_problem(503, "keys-unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a token waited {:?} for a hanging endpoint",
        started.elapsed()
    );
    let started = std::time::Instant::now();
    let known = pay(&proxy.url, minted.token("alice"), Some("known-1"), "{}").await;
    assert_eq!(known.status, 201, "{}", known.text());
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(env.upstream.executions(), 1);
}

/// An MCP-style JSON-RPC route: keys in `params._meta`, the scope by the token. A call without a key and
/// without a token (an MCP client's first `initialize`, sent to learn where to get a token) goes to the
/// app as it came, for the app to answer `401` itself; a keyed call needs a token that verifies, and its
/// retry under a refreshed token, with a new `id`, is replayed.
#[tokio::test]
async fn on_a_json_rpc_route_a_call_without_a_key_reaches_the_app_token_or_not() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let routes = format!(
        r#"
[[routes]]
name = "mcp"
path = "/mcp"
key = "jsonrpc"
scope_jwt = {{ jwks_url = "{}", audiences = ["{AUDIENCE}"] }}
"#,
        jwks.url
    );
    let (env, proxy) = TestEnv::with_routes(&routes).await;
    let call = |token: Option<&str>, body: String| {
        let mut request = client()
            .post(format!("{}/mcp", proxy.url))
            .header("content-type", "application/json")
            .body(body);
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        Reply::of(request)
    };
    let initialize = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#.to_owned();
    let first_contact = call(None, initialize).await;
    assert_eq!(first_contact.status, 201, "{}", first_contact.text());
    assert_eq!(
        env.upstream.executions(),
        1,
        "the app judges a call without a key"
    );
    assert!(!env.upstream.requests()[0].headers.contains_key("authorization"));

    let tool = |id: u32| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"refund","arguments":{{"order":"o-1"}},"_meta":{{"idempotencyKey":"refund-o-1"}}}}}}"#
        )
    };
    call(None, tool(2)).await.assert_problem(400, "missing-scope");
    call(Some(minted.token("forged")), tool(2))
        .await
        .assert_problem(401, "invalid-token");
    assert_eq!(env.upstream.executions(), 1);
    let ran = call(Some(minted.token("alice")), tool(2)).await;
    assert_eq!(ran.status, 201, "{}", ran.text());
    let again = call(Some(minted.token("alice_refreshed")), tool(3)).await;
    assert!(again.is_replay(), "{}", again.text());
    assert_eq!(env.upstream.executions(), 2);
}

/// The on-call command finds a client's record by its token, as the proxy scopes it: a refreshed token
/// (or one since expired: the command reads it, it does not verify it) finds what the first one made,
/// another subject's token finds nothing of it.
#[tokio::test]
async fn keys_show_finds_the_record_by_the_tokens_subject() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let env = TestEnv::new().await;
    let config = env.config().with_toml(&routes(&jwks.url, "30s"));
    let proxy = InProcessProxy::start(&config).await;
    let ran = pay(&proxy.url, minted.token("alice"), Some("pay-9"), "{}").await;
    assert_eq!(ran.status, 201, "{}", ran.text());

    let file = config_file(&config.to_toml());
    let at = ["--config", file.path().to_str().unwrap()];
    let show = |token: &str| {
        let header = format!("Authorization: Bearer {token}");
        let store = &env.store;
        async move {
            let args = ["show", "pay-9", "--route", "payments", "-H", &header, "--json"];
            keys_with(store, &at, &args).await
        }
    };
    for token in ["alice_refreshed", "expired"] {
        let found = json(&show(minted.token(token)).await);
        assert_eq!(found.as_array().map(Vec::len), Some(1), "{token}: {found}");
        assert_eq!(found[0]["status"], "completed");
    }
    let bob = show(minted.token("bob")).await;
    assert!(!bob.status.success(), "another subject has no such record");
    let garbage = show("not-a-jwt").await;
    assert!(!garbage.status.success());
    assert!(
        String::from_utf8_lossy(&garbage.stderr).contains("Authorization"),
        "{}",
        String::from_utf8_lossy(&garbage.stderr)
    );
}

/// The app refuses a token the proxy took (its own clock, no leeway, a revocation): its `401` is given
/// back, not stored, so the client's retry with a refreshed token runs; a route can turn a section's
/// `scope_jwt` off, for clients whose `Authorization` is a static API key.
#[tokio::test]
async fn the_apps_refusal_of_a_token_is_not_replayed_to_the_refreshed_one() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let routes = format!(
        r#"
[idempotency.scope_jwt]
jwks_url = "{}"
audiences = ["{AUDIENCE}"]

[[routes]]
name = "refunds"
path_prefix = "/fail-first"

[[routes]]
name = "partners"
path_prefix = "/partners"
scope_jwt = false
"#,
        jwks.url
    );
    let (env, proxy) = TestEnv::with_routes(&routes).await;
    let refund = |token: &str| {
        Reply::of(
            client()
                .post(format!("{}/fail-first/401", proxy.url))
                .header("authorization", format!("Bearer {token}"))
                .header("idempotency-key", "refund-1")
                .body("{}"),
        )
    };
    let refused = refund(minted.token("alice")).await;
    assert_eq!(refused.status, 401, "the app's own refusal: {}", refused.text());
    let retried = refund(minted.token("alice_refreshed")).await;
    assert_eq!(retried.status, 201, "{}", retried.text());
    assert!(!retried.is_replay());
    assert_eq!(env.upstream.executions(), 2);

    let partner = |key: &str| {
        Reply::of(
            client()
                .post(format!("{}/partners", proxy.url))
                .header("authorization", "Bearer sk_live_partner")
                .header("idempotency-key", key)
                .body("{}"),
        )
    };
    let first = partner("p-1").await;
    assert_eq!(
        first.status,
        201,
        "a static key is no JWT, and needs none here: {}",
        first.text()
    );
    assert!(partner("p-1").await.is_replay());
    assert_eq!(env.upstream.executions(), 3);
}

/// A token verified once is not verified again for the same route while it stands, but only while it
/// stands: past its `exp` it is refused, and once the key set is read again without its key, it is
/// refused too.
#[tokio::test]
async fn a_token_verified_before_is_refused_once_expired_or_once_its_key_leaves_the_set() {
    let minted = Minted::new().await;
    let jwks = JwksServer::start(&minted.jwks_1).await;
    let routes = format!(
        r#"
[[routes]]
name = "payments"
path = "/payments"
scope_jwt = {{ jwks_url = "{}", audiences = ["{AUDIENCE}"], leeway = "0s", min_refetch = "1s" }}
"#,
        jwks.url
    );
    let (env, proxy) = TestEnv::with_routes(&routes).await;

    let short = minted.token("alice_short");
    assert_eq!(pay(&proxy.url, short, Some("short-1"), "{}").await.status, 201);
    assert_eq!(pay(&proxy.url, short, Some("short-2"), "{}").await.status, 201);
    let mut n = 2;
    poll_until("the short-lived token to be refused past its exp", || {
        n += 1;
        let key = format!("short-{n}");
        let url = proxy.url.clone();
        async move {
            let reply = pay(&url, short, Some(&key), "{}").await;
            (reply.status == 401).then_some(())
        }
    })
    .await;

    let alice = minted.token("alice");
    assert_eq!(pay(&proxy.url, alice, Some("kept-1"), "{}").await.status, 201);
    assert_eq!(pay(&proxy.url, alice, Some("kept-2"), "{}").await.status, 201);
    // The issuer takes rsa-1 out of its set; the proxy reads the set again (a token names a kid it
    // lacks), and alice's token, verified before with rsa-1, is verified anew and refused.
    let mut set: Value = serde_json::from_str(&minted.jwks_1).unwrap();
    set["keys"]
        .as_array_mut()
        .unwrap()
        .retain(|key| key["kid"] != "rsa-1");
    jwks.serve(StatusCode::OK, &set.to_string());
    let reads = jwks.reads();
    poll_until("the set to be read again", || async {
        let _ = pay(&proxy.url, minted.token("unknown_kid"), Some("ghost"), "{}").await;
        (jwks.reads() > reads).then_some(())
    })
    .await;
    pay(&proxy.url, alice, Some("kept-3"), "{}")
        .await
        .assert_problem(401, "invalid-token");
    let ec = pay(&proxy.url, minted.token("alice_ec"), Some("kept-4"), "{}").await;
    assert_eq!(ec.status, 201, "a key still in the set: {}", ec.text());
    assert_eq!(env.upstream.executions(), n - 1 + 3);
}
