//! Every holder is bounded, measured from outside: for each structure that keeps bytes, a permit or time
//! per request (docs/security.md, "What each request may hold"), an attacker over real sockets against
//! the real binary, measuring (a) the memory the proxy holds per attacker byte while the attack runs, by
//! its resident set (`/proc/<pid>/status`), against the table's bound, and (b) how long the holder stays
//! held after the attacker stops making progress or leaves, by the holder's gauge on `/metrics` or by a
//! probe that needs the whole budget, against the table's deadline plus a margin. RSS is noisy: the
//! bounds are generous, and catch a holder that multiplies memory, not one that is a little over.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::support::raw::{self, addr_of};
use crate::support::{ProxyProcess, Reply, TestEnv, keyed_post, metric};

/// What the resident set may move by on its own while a test runs (allocator arenas, the runtime's
/// workers warming up, the log writer).
const RSS_NOISE: u64 = 24 * 1024 * 1024;

/// Added to a holder's deadline before the test gives up on it being freed: a loaded machine.
const MARGIN: Duration = Duration::from_secs(10);

/// The proxy's resident set in bytes.
fn rss(proxy: &ProxyProcess) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.pid())).expect("read status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib * 1024
}

/// Asserts that what the proxy's resident set grew by from `before` is within `per_byte` per attacker
/// byte plus `per_request` per attacking request (plus noise), and prints the measured figure.
fn assert_held(what: &str, proxy: &ProxyProcess, before: u64, attack: (u64, u64), bound: (f64, u64)) {
    let (bytes, requests) = attack;
    let (per_byte, per_request) = bound;
    let grown = rss(proxy).saturating_sub(before);
    let allowed = (bytes as f64 * per_byte) as u64 + requests * per_request + RSS_NOISE;
    eprintln!(
        "holder {what}: RSS grew {grown} bytes for {bytes} attacker bytes in {requests} requests \
         ({:.2} per byte; bound {per_byte} per byte + {per_request} per request + {RSS_NOISE} noise = {allowed})",
        grown as f64 / bytes.max(1) as f64
    );
    assert!(
        grown <= allowed,
        "{what}: the proxy grew by {grown} bytes for {bytes} attacker bytes in {requests} requests, over \
         the table's bound ({allowed} with noise)"
    );
}

/// Polls `freed` until it says the holder is free, at most `deadline` + [`MARGIN`]; returns how long
/// that took and prints it.
async fn freed_within<F, Fut>(what: &str, deadline: Duration, mut freed: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    let bound = deadline + MARGIN;
    while !freed().await {
        assert!(
            started.elapsed() < bound,
            "{what}: still held {:?} after the attacker stopped (deadline {deadline:?} + margin)",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    eprintln!("holder {what}: freed {took:?} after the attacker stopped (deadline {deadline:?})");
    took
}

/// A keyed request that needs `bytes` of the body budget: answered 201 once the budget has them whole.
async fn whole_budget_probe(proxy: &ProxyProcess, key: &str, bytes: usize) -> bool {
    let body = "x".repeat(bytes);
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", key, "").body(body)).await;
    reply.status == 201
}

/// Opens `count` raw connections, each sending `head` for its own key; the sockets are left open.
async fn open_with_heads(
    proxy: &ProxyProcess,
    count: usize,
    head: impl Fn(usize) -> String,
) -> Vec<TcpStream> {
    let mut sockets = Vec::new();
    for n in 0..count {
        let mut socket = raw::connect(&proxy.url).await;
        socket.set_nodelay(true).expect("no delay");
        socket.write_all(head(n).as_bytes()).await.expect("write a head");
        sockets.push(socket);
    }
    sockets
}

/// Body budget: keyed bodies trickled a byte per segment hold about their bytes (not a read buffer per
/// segment), and the budget is whole again within `server.body_read_timeout` of their clients going
/// silent, the sockets still open.
#[tokio::test]
async fn trickled_keyed_bodies_hold_their_bytes_and_the_budget_returns_after_body_read_timeout() {
    const CLIENTS: usize = 32;
    const TRICKLED: usize = 500;
    const DECLARED: usize = 64 * 1024;
    const BUDGET: usize = 4 * 1024 * 1024;
    const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.max_buffered_bodies", "4MiB")
        .set("idempotency.max_request_body", "4MiB")
        .set("server.body_read_timeout", "10s");
    let proxy = ProxyProcess::spawn(&config).await;
    assert!(whole_budget_probe(&proxy, "warm-up", BUDGET).await);
    let before = rss(&proxy);

    let host = addr_of(&proxy.url).to_owned();
    let mut sockets = open_with_heads(&proxy, CLIENTS, |n| {
        let key = format!("idempotency-key: trickle-{n}");
        raw::head(
            "POST /orders",
            &host,
            &[&key, &format!("content-length: {DECLARED}")],
        )
    })
    .await;
    let trickles = sockets.iter_mut().map(|socket| async move {
        for _ in 0..TRICKLED {
            socket.write_all(b"x").await.expect("trickle a byte");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    join_all(trickles).await;
    let stopped = Instant::now();
    let attack = (CLIENTS * TRICKLED) as u64;
    assert_held(
        "keyed body budget (trickled)",
        &proxy,
        before,
        (attack, CLIENTS as u64),
        (2.0, 96 * 1024),
    );

    let took = freed_within("keyed body budget", BODY_READ_TIMEOUT, || async {
        whole_budget_probe(
            &proxy,
            &format!("probe-{}", stopped.elapsed().as_millis()),
            BUDGET,
        )
        .await
    })
    .await;
    assert!(
        took <= BODY_READ_TIMEOUT + MARGIN,
        "held {took:?} after its clients went silent"
    );
    drop(sockets);
}

/// Connection slots: silent connections and half-sent heads hold a connection's buffers each, and are
/// closed `server.header_read_timeout` after they stop, their slots given back.
#[tokio::test]
async fn half_sent_heads_hold_one_read_buffer_each_and_are_closed_after_header_read_timeout() {
    const CLIENTS: usize = 200;
    const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(3);
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.max_connections", 1000)
        .set("server.header_read_timeout", "3s");
    let proxy = ProxyProcess::spawn(&config).await;
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, "/orders", "warm-up", "{}"))
            .await
            .status,
        201
    );
    let before = rss(&proxy);

    let host = addr_of(&proxy.url).to_owned();
    let padding = format!("x-padding: {}", "p".repeat(4000));
    let sockets = open_with_heads(&proxy, CLIENTS, |_| {
        format!("POST /orders HTTP/1.1\r\nhost: {host}\r\n{padding}\r\n")
    })
    .await;
    crate::support::metric_reaches(
        &proxy.admin_url,
        "idemproxy_open_connections",
        &[],
        CLIENTS as f64,
    )
    .await;
    let attack = (CLIENTS * (padding.len() + host.len() + 30)) as u64;
    assert_held(
        "connection slots (half-sent heads)",
        &proxy,
        before,
        (attack, CLIENTS as u64),
        (2.0, 96 * 1024),
    );

    freed_within("connection slots", HEADER_READ_TIMEOUT, || async {
        metric(&proxy.admin_url, "idemproxy_open_connections", &[]).await == 0.0
    })
    .await;
    drop(sockets);
}

/// Waiters: duplicates of a key in flight beyond `server.max_waiting` are refused at once; those that
/// wait hold a request each, and are let go as soon as their clients leave.
#[tokio::test]
async fn waiters_are_capped_and_let_go_when_their_clients_leave() {
    const MAX_WAITING: usize = 16;
    const DUPLICATES: usize = 64;
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("idempotency.on_in_flight", "wait")
        .set("idempotency.wait_timeout", "60s")
        .set("idempotency.lock_timeout", "120s")
        .set("server.max_waiting", MAX_WAITING as i64);
    let proxy = ProxyProcess::spawn(&config).await;
    let body = "b".repeat(16 * 1024);
    let original = tokio::spawn(Reply::of(
        keyed_post(&proxy.url, "/slow", "in-flight", &body).header("x-gate", "original"),
    ));
    env.upstream.wait_for_key("in-flight", 1).await;
    let before = rss(&proxy);

    let host = addr_of(&proxy.url).to_owned();
    let sockets = open_with_heads(&proxy, DUPLICATES, |_| {
        raw::head(
            "POST /slow",
            &host,
            &[
                "idempotency-key: in-flight",
                "content-type: application/json",
                "x-gate: original",
                &format!("content-length: {}", body.len()),
            ],
        ) + &body
    })
    .await;
    let waiting = crate::support::poll_until("the waiters", || async {
        let waiting = metric(&proxy.admin_url, "idemproxy_waiting_requests", &[]).await;
        (waiting >= MAX_WAITING as f64).then_some(waiting)
    })
    .await;
    assert_eq!(waiting, MAX_WAITING as f64, "never more than server.max_waiting");
    let attack = (DUPLICATES * (body.len() + 200)) as u64;
    assert_held(
        "waiters",
        &proxy,
        before,
        (attack, DUPLICATES as u64),
        (2.0, 96 * 1024),
    );

    drop(sockets);
    freed_within("waiters", Duration::ZERO, || async {
        metric(&proxy.admin_url, "idemproxy_waiting_requests", &[]).await == 0.0
    })
    .await;
    env.upstream.release("original");
    assert_eq!(original.await.unwrap().status, 201);
}

/// Keyed slots: keyed work whose clients hung up holds its slot until its upstream call ends, at most
/// `upstream.timeout`; meanwhile others get 503 at once, and then the slots come back.
#[tokio::test]
async fn detached_keyed_work_gives_its_slots_back_within_upstream_timeout() {
    const SLOTS: usize = 4;
    const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
    let env = TestEnv::new().await;
    let config = env
        .config()
        .set("server.max_keyed_in_flight", SLOTS as i64)
        .set("upstream.timeout", "3s");
    let proxy = ProxyProcess::spawn(&config).await;
    let host = addr_of(&proxy.url).to_owned();
    let sockets = open_with_heads(&proxy, SLOTS, |n| {
        raw::head(
            "POST /slow",
            &host,
            &[
                &format!("idempotency-key: detached-{n}"),
                "x-gate: never",
                "content-length: 2",
            ],
        ) + "{}"
    })
    .await;
    for n in 0..SLOTS {
        env.upstream.wait_for_key(&format!("detached-{n}"), 1).await;
    }
    drop(sockets);
    let refused = Reply::of(keyed_post(&proxy.url, "/orders", "refused", "{}")).await;
    refused.assert_problem(503, "busy");

    let mut n = 0;
    freed_within("keyed slots", UPSTREAM_TIMEOUT, || {
        n += 1;
        let probe = keyed_post(&proxy.url, "/orders", &format!("probe-{n}"), "{}");
        async move { Reply::of(probe).await.status == 201 }
    })
    .await;
}

/// Replay cache: completed responses kept in memory never pass `replay_cache.max_size`, however many
/// an attacker completes (the oldest go first).
#[tokio::test]
async fn completed_responses_beyond_the_replay_cache_size_are_not_kept_in_memory() {
    const KEYS: usize = 192;
    const RESPONSE: usize = 256 * 1024;
    const CACHE: u64 = 4 * 1024 * 1024;
    let env = TestEnv::new().await;
    let config = env.config().set("replay_cache.max_size", "4MiB");
    let proxy = ProxyProcess::spawn(&config).await;
    let path = format!("/big?bytes={RESPONSE}");
    assert_eq!(
        Reply::of(keyed_post(&proxy.url, &path, "warm-up", "{}"))
            .await
            .status,
        200
    );
    let before = rss(&proxy);

    for n in 0..KEYS {
        let reply = Reply::of(keyed_post(&proxy.url, &path, &format!("cached-{n}"), "{}")).await;
        assert_eq!(reply.status, 200);
    }
    let attack = (KEYS * RESPONSE) as u64;
    // What the cache may hold is `max_size` whatever the attack; per attacker byte, only what that is of it.
    assert_held(
        "replay cache",
        &proxy,
        before,
        (attack, KEYS as u64),
        (CACHE as f64 * 1.5 / attack as f64, 0),
    );
}
