//! A Redis Cluster under faults, as clients see the proxy in front of it: a primary killed mid-load (503
//! while its replica takes over, and no request executed twice when claims wait for a replica); slots
//! migrated between primaries mid-load (MOVED followed, nothing refused, every record still replayed
//! from its new node); and one slot held mid-migration, step by step, so that new and moved records are
//! reached through ASK. Each test starts its own six-node cluster.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::support::history::scope_of;
use crate::support::http::TEST_CREDENTIAL;
use crate::support::redis::{RedisCluster, RedisServer};
use crate::support::{InProcessProxy, ProxyConfig, Reply, Upstream, keyed_post};

const CLIENTS: usize = 8;
/// Keys each client sends at least, and goes on sending until the fault is over.
const MIN_KEYS_PER_CLIENT: usize = 30;
/// Bound on one key's retries: a failover, a lease left by a lost answer, and slack.
const KEY_BOUND: Duration = Duration::from_secs(60);

/// What the clients saw, by status, and every key they finished; `over` tells them the fault is over.
#[derive(Default)]
struct Seen {
    statuses: BTreeMap<u16, usize>,
    done: Vec<String>,
    over: AtomicBool,
}

/// Sends one client's keys one after another, each retried until it is answered 201: 503 (the store is
/// unavailable) and 409 (in flight, e.g. a claim whose answer was lost) are retried after a short pause,
/// anything else fails the test. Goes on until the fault is over and it sent its minimum.
async fn client(proxy: String, client: usize, seen: Arc<Mutex<Seen>>) {
    for n in 0.. {
        if n >= MIN_KEYS_PER_CLIENT && seen.lock().unwrap().over.load(Ordering::SeqCst) {
            return;
        }
        let key = format!("c{client}-k{n}");
        let body = format!(r#"{{"order":"{key}"}}"#);
        let started = Instant::now();
        loop {
            let reply = Reply::of(keyed_post(&proxy, "/orders", &key, &body)).await;
            let status = reply.status.as_u16();
            *seen.lock().unwrap().statuses.entry(status).or_default() += 1;
            match status {
                201 => break,
                503 => reply.assert_problem(503, "store-unavailable"),
                409 => {}
                other => panic!("key {key}: unexpected {other}: {}", reply.text()),
            }
            assert!(started.elapsed() < KEY_BOUND, "key {key} never went through");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        seen.lock().unwrap().done.push(key);
    }
}

fn start_clients(proxy: &InProcessProxy, seen: &Arc<Mutex<Seen>>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|i| tokio::spawn(client(proxy.url.clone(), i, seen.clone())))
        .collect()
}

async fn finished(seen: &Arc<Mutex<Seen>>, clients: Vec<tokio::task::JoinHandle<()>>) {
    seen.lock().unwrap().over.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.expect("client task");
    }
}

async fn until_done(seen: &Arc<Mutex<Seen>>, at_least: usize) {
    crate::support::poll_until(&format!("{at_least} keys done"), || async {
        (seen.lock().unwrap().done.len() >= at_least).then_some(())
    })
    .await;
}

/// Every finished key executed exactly once, and a retry of it now is a replay of that execution.
async fn each_executed_once_and_replayed(
    proxy: &InProcessProxy,
    upstream: &Upstream,
    seen: &Arc<Mutex<Seen>>,
) {
    let done = seen.lock().unwrap().done.clone();
    assert!(done.len() >= CLIENTS * MIN_KEYS_PER_CLIENT, "{} keys", done.len());
    for key in &done {
        assert_eq!(upstream.executions_for_key(key), 1, "key {key}");
        let body = format!(r#"{{"order":"{key}"}}"#);
        let retry = Reply::of(keyed_post(&proxy.url, "/orders", key, &body)).await;
        assert!(retry.is_replay(), "key {key}: {} {}", retry.status, retry.text());
    }
}

fn cluster_config(cluster: &RedisCluster, upstream: &Upstream, extra: &str) -> ProxyConfig {
    ProxyConfig::new(&cluster.url(), &upstream.url())
        .set("store.timeout", "2s")
        .set("idempotency.lock_timeout", "3s")
        .set("replay_cache.max_size", "0")
        .with_toml(extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_mid_load_is_503_until_its_replica_takes_over_and_nothing_runs_twice() {
    let mut cluster = tokio::task::spawn_blocking(RedisCluster::start).await.unwrap();
    let upstream = Upstream::start().await;
    let config = cluster_config(
        &cluster,
        &upstream,
        "[store.redis]\nwait_replicas = 1\nwait_timeout = \"500ms\"\n",
    );
    let proxy = InProcessProxy::start(&config).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let clients = start_clients(&proxy, &seen);

    until_done(&seen, CLIENTS * 3).await;
    // Load goes on while a replica takes over, and until the dead node, restarted, has rejoined as its
    // replica: only then can claims on those slots reach a replica again (wait_replicas = 1).
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.kill_a_primary_and_restart_it();
        cluster
    })
    .await
    .unwrap();
    finished(&seen, clients).await;

    let statuses = seen.lock().unwrap().statuses.clone();
    eprintln!("statuses seen across the failover: {statuses:?}");
    assert!(
        statuses.get(&503).copied().unwrap_or(0) > 0,
        "requests for the dead primary's slots are refused until its replica takes over: {statuses:?}"
    );
    each_executed_once_and_replayed(&proxy, &upstream, &seen).await;
    drop(cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_migrated_mid_load_are_followed_and_every_record_moves_with_them() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.unwrap();
    let upstream = Upstream::start().await;
    let proxy = InProcessProxy::start(&cluster_config(&cluster, &upstream, "")).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let clients = start_clients(&proxy, &seen);

    until_done(&seen, CLIENTS * 3).await;
    let primaries: Vec<&RedisServer> = cluster
        .nodes
        .iter()
        .filter(|node| node.info("replication", "role").as_deref() == Some("master"))
        .collect();
    let (from, to) = (primaries[0], primaries[1]);
    let id = |node: &RedisServer| node.cli(&["CLUSTER", "MYID"]).expect("node id").trim().to_owned();
    let (from_id, to_id) = (id(from), id(to));
    let reshard = {
        let seed = from.address();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("redis-cli")
                .args([
                    "--cluster",
                    "reshard",
                    &seed,
                    "--cluster-from",
                    &from_id,
                    "--cluster-to",
                    &to_id,
                ])
                .args([
                    "--cluster-slots",
                    "3000",
                    "--cluster-yes",
                    "--cluster-pipeline",
                    "5",
                ])
                .output()
                .expect("redis-cli runs")
        })
    };
    let resharded = reshard.await.unwrap();
    assert!(
        resharded.status.success(),
        "reshard failed: {}",
        String::from_utf8_lossy(&resharded.stdout)
    );
    finished(&seen, clients).await;

    let statuses = seen.lock().unwrap().statuses.clone();
    eprintln!("statuses seen across the reshard: {statuses:?}");
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        vec![201],
        "a migration is followed, never refused: {statuses:?}"
    );
    let owned = |node: &RedisServer| {
        node.cli(&["CLUSTER", "NODES"])
            .expect("cluster nodes")
            .lines()
            .find(|line| line.contains("myself"))
            .map(|line| line.split_whitespace().skip(8).count())
            .unwrap_or(0)
    };
    assert!(owned(to) >= 2, "the target primary now owns the moved slots too");
    each_executed_once_and_replayed(&proxy, &upstream, &seen).await;
}

/// The Redis key of `key`'s record for the test credential (see `store/redis/record.rs`): the scope's
/// `:` percent-encoded, the key plain (letters, digits and `-`).
fn record_name(key: &str) -> String {
    format!(
        "idemproxy:{{{}:{key}}}",
        scope_of(TEST_CREDENTIAL).replace(':', "%3A")
    )
}

/// The cluster slot of a Redis key whose hash tag is its `{…}` part.
fn slot(name: &str) -> u16 {
    let tag = name
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map_or(name, |(tag, _)| tag);
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % 16384
}

/// The status of `key`'s record as `node` holds it.
fn status_on(node: &RedisServer, key: &str) -> String {
    let status = node.cli(&["HGET", &record_name(key), "st"]);
    status.expect("the record").trim().to_owned()
}

fn node_id(node: &RedisServer) -> String {
    node.cli(&["CLUSTER", "MYID"]).expect("node id").trim().to_owned()
}

fn asking_calls(node: &RedisServer) -> u64 {
    node.calls("asking")
}

/// Whether `node` is a primary that owns `slot`, by its own `CLUSTER NODES` line.
fn owns(node: &RedisServer, slot: u16) -> bool {
    let Some(nodes) = node.cli(&["CLUSTER", "NODES"]) else {
        return false;
    };
    let Some(mine) = nodes.lines().find(|line| line.contains("myself")) else {
        return false;
    };
    mine.split_whitespace().skip(8).any(|range| {
        let (low, high) = range.split_once('-').unwrap_or((range, range));
        matches!((low.parse::<u16>(), high.parse::<u16>()), (Ok(low), Ok(high)) if (low..=high).contains(&slot))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_mid_migration_is_reached_through_ask_and_then_moved() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.unwrap();
    let upstream = Upstream::start().await;
    let proxy = InProcessProxy::start(&cluster_config(&cluster, &upstream, "")).await;
    let post = |key: &str| Reply::of(keyed_post(&proxy.url, "/orders", key, "{}"));
    // A second key whose record lands in the first one's slot.
    let slot_of = |key: &str| slot(&record_name(key));
    let slot = slot_of("before");
    let fresh = (0..100_000)
        .map(|n| format!("fresh-{n}"))
        .find(|key| slot_of(key) == slot)
        .expect("a key in the same slot");
    let source = cluster
        .nodes
        .iter()
        .find(|node| owns(node, slot))
        .expect("the slot's primary");
    let target = cluster
        .nodes
        .iter()
        .find(|node| {
            node.port != source.port && node.info("replication", "role").as_deref() == Some("master")
        })
        .expect("another primary");
    let (source_id, target_id) = (node_id(source), node_id(target));
    let slot = slot.to_string();

    assert_eq!(post("before").await.status, 201);
    assert!(
        target
            .cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &source_id])
            .is_some()
    );
    assert!(
        source
            .cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target_id])
            .is_some()
    );
    let asked = asking_calls(target);

    // A new record in a migrating slot is written on the target, through ASK.
    assert_eq!(post(&fresh).await.status, 201);
    assert!(
        asking_calls(target) > asked,
        "the claim followed the source's ASK"
    );
    assert!(post(&fresh).await.is_replay(), "and is replayed from there");
    // A record moved mid-migration is found on the target, through ASK, too.
    let name = record_name("before");
    let port = target.port.to_string();
    let migrated = source.cli(&["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS", &name]);
    assert_eq!(migrated.as_deref().map(str::trim), Some("OK"));
    assert!(post("before").await.is_replay());
    // Once the slot is the target's, MOVED sends every request there.
    for node in &cluster.nodes {
        node.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &target_id]);
    }
    for key in ["before", fresh.as_str()] {
        assert!(post(key).await.is_replay(), "{key} after the migration");
        assert_eq!(upstream.executions_for_key(key), 1, "{key}");
    }
}

#[tokio::test]
async fn a_claim_no_replica_confirms_is_refused_and_given_back_never_forwarded() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let primary = RedisServer::start(dir.path(), &[]);
    let upstream = Upstream::start().await;
    // A wait long enough for a replica to acknowledge on a loaded machine, so the confirmed claim below
    // is never refused for being slow.
    let config = ProxyConfig::new(&format!("redis://{}", primary.address()), &upstream.url())
        .set("store.timeout", "5s")
        .with_toml("[store.redis]\nwait_replicas = 1\nwait_timeout = \"2s\"\n");
    let proxy = InProcessProxy::start(&config).await;

    let alone = Reply::of(keyed_post(&proxy.url, "/orders", "lonely", "{}")).await;
    alone.assert_problem(503, "store-unavailable");
    assert_eq!(
        upstream.executions(),
        0,
        "an unconfirmed claim is never forwarded"
    );
    assert_eq!(
        status_on(&primary, "lonely"),
        "failed",
        "and it is given back, so a retry need not wait for its lease"
    );

    let replica = start_replica(dir.path(), &primary).await;
    let confirmed = Reply::of(keyed_post(&proxy.url, "/orders", "lonely", "{}")).await;
    assert_eq!(confirmed.status, 201, "{}", confirmed.text());
    assert_eq!(upstream.executions_for_key("lonely"), 1);
    assert_eq!(
        status_on(&replica, "lonely"),
        "completed",
        "the replica holds the completion before the client is answered"
    );
}

/// A replica of `primary`, started in `dir`, once its link is up and the primary's `WAIT` counts it.
async fn start_replica(dir: &std::path::Path, primary: &RedisServer) -> RedisServer {
    let port = primary.port.to_string();
    let replica = RedisServer::start(
        dir,
        &[
            "--replicaof",
            "127.0.0.1",
            &port,
            "--repl-diskless-sync-delay",
            "0",
        ],
    );
    crate::support::poll_until("the replica's link to be up", || async {
        (replica.info("replication", "master_link_status").as_deref() == Some("up")).then_some(())
    })
    .await;
    // The replica's side of the link may be up before the primary's WAIT counts it: wait for a WAIT of
    // the primary's own to see it.
    crate::support::poll_until("a WAIT on the primary to count its replica", || async {
        let acknowledged = primary.cli(&["WAIT", "1", "100"])?;
        (acknowledged.trim() == "1").then_some(())
    })
    .await;
    replica
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_must_reach_a_replica_wait_for_it_once_per_batch_not_once_each() {
    const REQUESTS: usize = 32;
    let dir = tempfile::tempdir().expect("temporary directory");
    let primary = RedisServer::start(dir.path(), &[]);
    let replica = start_replica(dir.path(), &primary).await;
    let upstream = Upstream::start().await;
    let config = ProxyConfig::new(&format!("redis://{}", primary.address()), &upstream.url())
        .set("store.timeout", "20s")
        .set("server.workers", 2)
        .with_toml("[store.redis]\nwait_replicas = 1\nwait_timeout = \"15s\"\n");
    let proxy = InProcessProxy::start(&config).await;

    // The replica stalls: the first claim of each worker waits for it, and every claim sent meanwhile
    // queues behind that one WAIT.
    replica.pause();
    let waits_before = primary.calls("wait");
    let requests: Vec<_> = (0..REQUESTS)
        .map(|n| {
            let post =
                keyed_post(&proxy.url, "/slow", &format!("batched-{n}"), "{}").header("x-gate", "batched");
            tokio::spawn(Reply::of(post))
        })
        .collect();
    crate::support::metric_reaches(
        &proxy.admin_url,
        "idemproxy_in_flight_requests",
        &[],
        REQUESTS as f64,
    )
    .await;
    replica.resume();

    // Every claim is confirmed (the upstream holds the responses, so no completion has been sent yet).
    upstream.wait_until_executions(REQUESTS).await;
    let claim_waits = primary.calls("wait") - waits_before;
    assert!(
        claim_waits <= (REQUESTS / 4) as u64,
        "{REQUESTS} claims confirmed by {claim_waits} WAITs: batched, not one each"
    );

    upstream.release("batched");
    for request in requests {
        let reply = request.await.unwrap();
        assert_eq!(reply.status, 201, "{}", reply.text());
    }
    let all_waits = primary.calls("wait") - waits_before;
    assert!(
        all_waits < 2 * REQUESTS as u64,
        "{REQUESTS} claims and completions confirmed by {all_waits} WAITs"
    );
    for n in 0..REQUESTS {
        let key = format!("batched-{n}");
        assert_eq!(upstream.executions_for_key(&key), 1, "{key}");
        assert_eq!(
            status_on(&replica, &key),
            "completed",
            "{key}: the replica holds the completion before the client is answered"
        );
    }
}

#[tokio::test]
async fn a_completed_record_expires_in_redis_exactly_at_its_expiry_first_time_or_on_retry() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let server = RedisServer::start(dir.path(), &[]);
    let upstream = Upstream::start().await;
    let config = ProxyConfig::new(&format!("redis://{}", server.address()), &upstream.url())
        .with_toml("[idempotency]\nttl = \"1h\"\n");
    let proxy = InProcessProxy::start(&config).await;
    let expiry_of = |key: &str| {
        let name = record_name(key);
        let field = server.cli(&["HGET", &name, "ea"]).expect("the record's expiry");
        let ttl = server.cli(&["PEXPIRETIME", &name]).expect("the record's TTL");
        (field.trim().to_owned(), ttl.trim().to_owned())
    };

    let first = Reply::of(keyed_post(&proxy.url, "/orders", "expiring", "{}")).await;
    assert_eq!(first.status, 201);
    let (field, ttl) = expiry_of("expiring");
    assert_eq!(
        ttl, field,
        "Redis deletes the record at its expiry, to the millisecond"
    );

    // Released by a 503, then executed again by the retry: the retry's record expires at its own expiry.
    let released = Reply::of(keyed_post(&proxy.url, "/fail-first/503", "retried", "{}")).await;
    assert_eq!(released.status, 503);
    let retried = Reply::of(keyed_post(&proxy.url, "/fail-first/503", "retried", "{}")).await;
    assert_eq!(retried.status, 201, "{}", retried.text());
    assert_eq!(status_on(&server, "retried"), "completed");
    let (field, ttl) = expiry_of("retried");
    assert_eq!(ttl, field);
    let left: i64 = server
        .cli(&["PTTL", &record_name("retried")])
        .expect("TTL")
        .trim()
        .parse()
        .unwrap();
    assert!(
        (3_500_000..=3_600_000).contains(&left),
        "an hour's TTL, less the moments since: {left} ms"
    );
}
