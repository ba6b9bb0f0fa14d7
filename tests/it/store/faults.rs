//! The store goes away for real (a relay between proxy and PostgreSQL is cut).

use reqwest::RequestBuilder;
use tokio::task::JoinHandle;

use crate::support::{
    InProcessProxy, Relay, Reply, TestEnv, http::client, keyed_post, metric, metric_reaches, poll_until,
    settled,
};

#[tokio::test]
async fn store_unreachable_fails_closed_for_keyed_requests_only() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env.config().set("store.url", env.db().url_via(relay.addr()));
    let proxy = InProcessProxy::start(&config).await;
    let before = Reply::of(keyed_post(&proxy.url, "/orders", "before", "{}")).await;
    assert_eq!(before.status, 201);

    relay.cut();
    let keyed = Reply::of(keyed_post(&proxy.url, "/orders", "during", "{}")).await;
    keyed.assert_problem(503, "store-unavailable");
    assert!(keyed.retry_after() >= 1);
    assert_eq!(
        env.upstream.executions_for_key("during"),
        0,
        "forwarded unprotected"
    );

    let passthrough = Reply::of(client().get(format!("{}/orders", proxy.url))).await;
    assert_eq!(passthrough.status, 201, "passthrough must not need the store");
    assert_eq!(env.upstream.executions(), 2);

    relay.restore();
    let after = Reply::of(keyed_post(&proxy.url, "/orders", "during", "{}")).await;
    assert_eq!(after.status, 201, "{}", after.text());
    assert!(!after.is_replay());
    let replay = settled(|| keyed_post(&proxy.url, "/orders", "during", "{}")).await;
    assert!(replay.is_replay());
    assert_eq!(env.upstream.executions_for_key("during"), 1);
    let outcome = [("outcome", "store_unavailable")];
    assert!(metric(&proxy.admin_url, "idemproxy_requests_total", &outcome).await >= 1.0);
}

/// Proxies A and B on one database with a 2 s lease; A reaches the store through a relay.
struct TwoProxies {
    env: TestEnv,
    relay: Relay,
    a: InProcessProxy,
    b: InProcessProxy,
}

impl TwoProxies {
    async fn start() -> TwoProxies {
        let env = TestEnv::new().await;
        let relay = Relay::start(&env.db().server_addr()).await;
        let config = env.config().set("idempotency.lock_timeout", "2s");
        let a_config = config.clone().set("store.url", env.db().url_via(relay.addr()));
        let a = InProcessProxy::start(&a_config).await;
        let b = InProcessProxy::start(&config).await;
        TwoProxies { env, relay, a, b }
    }

    /// The request under test; `gate` names the stub gate holding its upstream call.
    fn post(base: &str, gate: &str) -> RequestBuilder {
        keyed_post(base, "/slow", "k", "{}").header("x-gate", gate)
    }

    /// A claims the key, its upstream call is held at gate `a`, and A loses the store, so it can no
    /// longer heartbeat. Returns A's client.
    async fn a_claims_then_loses_the_store(&self) -> JoinHandle<Reply> {
        let original = tokio::spawn(Reply::of(Self::post(&self.a.url, "a")));
        self.env.upstream.wait_for_key("k", 1).await;
        self.relay.cut();
        original
    }

    /// A's store comes back and A's upstream call returns: A's client gets A's response, but A's
    /// completion is refused.
    async fn a_finishes_late(&self, original: JoinHandle<Reply>) {
        self.relay.restore();
        self.env.upstream.release("a");
        let original = original.await.expect("A's client task");
        assert_eq!(
            original.text(),
            "slow done 1",
            "A's client still gets A's response"
        );
        metric_reaches(&self.a.admin_url, "idemproxy_lost_claims_total", &[], 1.0).await;
    }

    /// Both proxies replay B's response.
    async fn assert_b_result_kept(&self) {
        for base in [&self.a.url, &self.b.url] {
            let replay = settled(|| Self::post(base, "b")).await;
            assert!(replay.is_replay(), "{}", replay.text());
            assert_eq!(replay.text(), "slow done 2", "A's late completion overwrote B's");
        }
        assert_eq!(self.env.upstream.executions_for_key("k"), 2);
        let takeovers = metric(&self.b.admin_url, "idemproxy_stale_takeovers_total", &[]).await;
        assert_eq!(takeovers, 1.0);
    }
}

#[tokio::test]
async fn completion_after_takeover_completed_is_fenced_off() {
    let proxies = TwoProxies::start().await;
    let original = proxies.a_claims_then_loses_the_store().await;

    proxies.env.upstream.release("b");
    let taken_over = poll_until("A's lease to run out", || async {
        let reply = Reply::of(TwoProxies::post(&proxies.b.url, "b")).await;
        (reply.status != 409).then_some(reply)
    })
    .await;
    assert_eq!(taken_over.status, 201, "{}", taken_over.text());
    assert_eq!(taken_over.text(), "slow done 2");

    proxies.a_finishes_late(original).await;
    proxies.assert_b_result_kept().await;
}

/// A's completion arrives while B's takeover is still executing: only the claim token tells them apart.
#[tokio::test]
async fn completion_during_takeover_is_fenced_off() {
    let proxies = TwoProxies::start().await;
    let original = proxies.a_claims_then_loses_the_store().await;

    let taker = poll_until("A's lease to run out", || async {
        let mut attempt = tokio::spawn(Reply::of(TwoProxies::post(&proxies.b.url, "b")));
        tokio::select! {
            refused = &mut attempt => {
                refused.expect("B's client task").assert_problem(409, "key-in-flight");
                None
            }
            () = proxies.env.upstream.wait_for_key("k", 2) => Some(attempt),
        }
    })
    .await;

    proxies.a_finishes_late(original).await;
    let during = Reply::of(TwoProxies::post(&proxies.a.url, "b")).await;
    during.assert_problem(409, "key-in-flight");

    proxies.env.upstream.release("b");
    let taken_over = taker.await.expect("B's client task");
    assert_eq!(taken_over.status, 201, "{}", taken_over.text());
    assert_eq!(taken_over.text(), "slow done 2");
    proxies.assert_b_result_kept().await;
}

#[tokio::test]
async fn store_unreachable_fail_open_forwards_keyed_requests() {
    let env = TestEnv::new().await;
    let relay = Relay::start(&env.db().server_addr()).await;
    let config = env
        .config()
        .set("store.url", env.db().url_via(relay.addr()))
        .set("store.on_error", "fail_open");
    let proxy = InProcessProxy::start(&config).await;

    relay.cut();
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", "k", "{}")).await;
    assert_eq!(reply.status, 201, "{}", reply.text());
    assert!(!reply.is_replay());
    assert_eq!(env.upstream.executions_for_key("k"), 1);
    let unprotected = metric(&proxy.admin_url, "idemproxy_unprotected_requests_total", &[]).await;
    assert_eq!(unprotected, 1.0, "every unprotected forward is counted");
}

/// A claim answered after more than half its lease is not forwarded on: the key table is locked for longer
/// than that, so the claim statement waits behind the lock. The request gets 503 (as when the store does
/// not answer in time), nothing reaches the upstream, and the claim is given back: the retry executes at
/// once instead of meeting a live claim (409) for the rest of the lease.
#[tokio::test]
async fn a_claim_answered_after_half_its_lease_is_given_back_not_forwarded() {
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("idempotency.lock_timeout", "2s")
        .set("store.timeout", "10s");
    let proxy = InProcessProxy::start(&config).await;
    let warm = Reply::of(keyed_post(&proxy.url, "/orders", "warm", "{}")).await;
    assert_eq!(warm.status, 201, "{}", warm.text());

    let locker = env.db().client().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE idemproxy.records IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock the key table");
    let slow = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/orders", "slow", "{}")));
    env.db().wait_for_a_lock_waiter().await;
    // Past half of the 2 s lease from the moment the claim waits.
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    locker.batch_execute("COMMIT").await.expect("unlock");

    let late = slow.await.expect("request task");
    late.assert_problem(503, "store-unavailable");
    assert_eq!(
        env.upstream.executions_for_key("slow"),
        0,
        "forwarded on a late claim"
    );

    let retry = Reply::of(keyed_post(&proxy.url, "/orders", "slow", "{}")).await;
    assert_eq!(
        retry.status,
        201,
        "the late claim was given back: {}",
        retry.text()
    );
    assert!(!retry.is_replay());
    assert_eq!(env.upstream.executions_for_key("slow"), 1);
}
