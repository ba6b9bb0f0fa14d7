//! Jepsen-style histories: seeded clients drive real proxy processes on a throwaway store while a fault
//! schedule cuts and stalls each proxy's store connection, kills and restarts proxies, crashes and
//! restarts the store, and resets or stalls the upstream mid-body. The checker in `support/history.rs`
//! then judges every request against the model. The store is a throwaway PostgreSQL cluster, one Redis
//! server (append-only file, `appendfsync always`, so a crash loses nothing acknowledged), or a six-node
//! Redis Cluster with `wait_replicas = 1`, whose store faults kill a primary instead (its replica takes
//! over; the killed node rejoins as replica); or, where `IDEMPROXY_TEST_CITUS_URL` names a Citus
//! coordinator, the key table distributed there, whose crash terminates the proxies' sessions.
//!
//! The short run is part of the test suite. The soak is one command, bounded by its duration:
//!
//! ```text
//! IDEMPROXY_SOAK_SECS=600 IDEMPROXY_SOAK_SEED=7 \
//!     cargo test --locked --test it attacks::history::soak -- --ignored --nocapture
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{StreamExt, future::join_all, stream};
use tokio::time::Instant;

use crate::support::citus::{self, CitusTable};
use crate::support::cluster::Cluster;
use crate::support::history::{self, Observation, Op, Records, Rng, Seen};
use crate::support::recorder::Recorder;
use crate::support::redis::{RedisCluster, RedisServer, load_records};
use crate::support::{ProxyConfig, ProxyProcess, Relay, poll_until, unless_skipped};

/// Which store a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    Redis,
    RedisCluster,
    /// The key table distributed on a Citus coordinator (`IDEMPROXY_TEST_CITUS_URL`).
    Citus,
}

/// One run's shape.
#[derive(Debug, Clone)]
struct Params {
    backend: Backend,
    seed: u64,
    /// How long clients send and faults act.
    traffic: Duration,
    clients: usize,
    proxies: usize,
    scopes: u64,
    /// Keys in play at once; the key space moves on every `epoch`, so keys are new and old in turn.
    keys: u64,
    epoch: Duration,
}

impl Params {
    fn short() -> Params {
        Params {
            backend: Backend::Postgres,
            seed: 0x1de3_2026,
            traffic: Duration::from_secs(20),
            clients: 16,
            proxies: 2,
            scopes: 3,
            keys: 24,
            epoch: Duration::from_secs(3),
        }
    }

    fn soak() -> Params {
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        Params {
            seed: env("IDEMPROXY_SOAK_SEED").unwrap_or(7),
            traffic: Duration::from_secs(env("IDEMPROXY_SOAK_SECS").unwrap_or(600).min(3600)),
            clients: 24,
            ..Params::short()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_under_faults_keeps_every_promise() {
    run(Params::short()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_on_redis_under_faults_keeps_every_promise() {
    run(Params {
        backend: Backend::Redis,
        ..Params::short()
    })
    .await;
}

/// On a key table distributed by Citus, where `IDEMPROXY_TEST_CITUS_URL` names a coordinator (skipped,
/// saying so, otherwise): relays cut and stall each proxy's connection to the coordinator, and the
/// store's crash terminates every session the proxies hold there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_on_citus_under_faults_keeps_every_promise() {
    unless_skipped!(crate::support::Backend::Citus);
    run(Params {
        backend: Backend::Citus,
        ..Params::short()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_on_a_redis_cluster_losing_primaries_keeps_every_promise() {
    run(Params {
        backend: Backend::RedisCluster,
        ..Params::short()
    })
    .await;
}

/// The soak: the same run for `IDEMPROXY_SOAK_SECS` (default 600, at most 3600).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak run: ten minutes by default; see the module documentation"]
async fn soak() {
    run(Params::soak()).await;
}

const LOCK_TIMEOUT: &str = "4s";
const STORE_TIMEOUT: &str = "500ms";
const UPSTREAM_TIMEOUT: Duration = Duration::from_millis(1500);
/// The least time between two executions of a key. A takeover is won at least a lease (4 s) after the
/// claim it takes over, and that claim's request reached the upstream at most the store timeout (its
/// answer can come that late) plus the upstream timeout (the proxy gives up then) after the claim, plus
/// 300 ms for the upstream to read it.
const SPACING: Duration = Duration::from_millis(4000 - 500 - 1500 - 300);
/// Store faults last up to twice the lease, so some claims lapse while their proxy is cut off and are
/// taken over through the other proxy, and the original's late writes must be fenced off.
const STORE_FAULT_MAX_MS: u64 = 8000;
/// Bound on one op getting its final answer once the faults have ended (a stale lease runs out in 4 s).
const SETTLE_BOUND: Duration = Duration::from_secs(30);

/// What the clients share: where the proxies are right now, and the history.
struct Shared {
    params: Params,
    urls: Mutex<Vec<Option<String>>>,
    observations: Mutex<Vec<Observation>>,
    started: Instant,
    deadline: Instant,
}

impl Shared {
    fn pick_url(&self, rng: &mut Rng) -> Option<String> {
        let urls = self.urls.lock().unwrap();
        let live: Vec<&String> = urls.iter().flatten().collect();
        (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize].clone())
    }

    fn log(&self, op: &Op, seen: Seen, url: &str) {
        let via = format!("{url} at {} ms", self.started.elapsed().as_millis());
        let observation = Observation {
            op: op.clone(),
            seen,
            via,
        };
        self.observations.lock().unwrap().push(observation);
    }
}

/// The store the proxies share, and what its faults act on.
enum Store {
    Postgres(Cluster),
    /// One server, restarted from its append-only file after a crash.
    Redis {
        server: RedisServer,
        _dir: tempfile::TempDir,
    },
    /// Taken out while a primary is killed and restarted (on a blocking thread).
    RedisCluster(Option<RedisCluster>),
    /// A coordinator the test does not run: its crash is every proxy session there terminated.
    Citus(CitusTable),
}

impl Store {
    async fn start(backend: Backend) -> Store {
        match backend {
            Backend::Postgres => Store::Postgres(Cluster::start().await),
            Backend::Redis => {
                let dir = tempfile::tempdir().expect("temporary directory");
                let durable = ["--appendonly", "yes", "--appendfsync", "always"];
                Store::Redis {
                    server: RedisServer::start(dir.path(), &durable),
                    _dir: dir,
                }
            }
            Backend::RedisCluster => {
                let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.unwrap();
                Store::RedisCluster(Some(cluster))
            }
            Backend::Citus => {
                let url = citus::url().expect("the Citus run checks for a coordinator first");
                Store::Citus(CitusTable::create(url).await)
            }
        }
    }

    /// Where a relay forwards to, for the stores a relay can stand in front of (not a cluster, whose
    /// nodes tell clients their own addresses).
    fn relay_target(&self) -> Option<String> {
        match self {
            Store::Postgres(cluster) => Some(cluster.server_addr()),
            Store::Redis { server, .. } => Some(server.address()),
            Store::RedisCluster(_) => None,
            Store::Citus(table) => {
                let url = url::Url::parse(table.url()).expect("IDEMPROXY_TEST_CITUS_URL is a URL");
                let host = url.host_str().expect("the coordinator's host");
                Some(format!("{host}:{}", url.port().unwrap_or(5432)))
            }
        }
    }

    /// The proxies' config for this store, reached through `relay` where there is one.
    fn config(&self, relay: Option<&Relay>, upstream: &str) -> ProxyConfig {
        match (self, relay) {
            (Store::Postgres(_), Some(relay)) => ProxyConfig::new(
                &format!("postgres://postgres@{}/postgres", relay.addr()),
                upstream,
            ),
            (Store::Redis { .. }, Some(relay)) => {
                ProxyConfig::new(&format!("redis://{}", relay.addr()), upstream)
            }
            (Store::Citus(table), Some(relay)) => {
                let mut url = url::Url::parse(table.url()).expect("IDEMPROXY_TEST_CITUS_URL is a URL");
                let relay = relay.addr();
                url.set_host(Some(&relay.ip().to_string()))
                    .expect("a postgres URL takes a host");
                url.set_port(Some(relay.port()))
                    .expect("a postgres URL takes a port");
                ProxyConfig::new(url.as_str(), upstream)
            }
            (Store::RedisCluster(cluster), _) => {
                let url = cluster.as_ref().expect("the cluster").url();
                ProxyConfig::new(&url, upstream)
                    .with_toml("[store.redis]\nwait_replicas = 1\nwait_timeout = \"300ms\"\n")
            }
            _ => unreachable!("a relay stands in front of every store but a cluster"),
        }
    }

    /// The store's crash: PostgreSQL restarted immediately, the Redis server killed and started again,
    /// or a cluster primary killed, failed over, and restarted as its replica's replica.
    async fn crash(&mut self) -> &'static str {
        match self {
            Store::Postgres(cluster) => {
                cluster.crash_restart().await;
                "PostgreSQL crashed and restarted"
            }
            Store::Redis { server, .. } => {
                server.kill();
                server.restart();
                "Redis crashed and restarted from its append-only file"
            }
            Store::RedisCluster(slot) => {
                let mut cluster = slot.take().expect("the cluster");
                let cluster = tokio::task::spawn_blocking(move || {
                    cluster.kill_a_primary_and_restart_it();
                    cluster
                })
                .await
                .unwrap();
                *slot = Some(cluster);
                "Redis primary killed, failed over, restarted as replica"
            }
            Store::Citus(table) => {
                table
                    .client()
                    .await
                    .execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                         WHERE application_name = 'idemproxy' AND pid <> pg_backend_pid()",
                        &[],
                    )
                    .await
                    .expect("terminate the proxies' sessions on the coordinator");
                "every proxy session on the Citus coordinator terminated"
            }
        }
    }

    /// The key table as it is now.
    async fn records(&self) -> Records {
        match self {
            Store::Postgres(cluster) => history::load_records(&cluster.client().await).await,
            Store::Citus(table) => history::load_records(&table.client().await).await,
            Store::Redis { server, .. } => {
                let port = server.port;
                tokio::task::spawn_blocking(move || load_records(&[port]))
                    .await
                    .unwrap()
            }
            Store::RedisCluster(cluster) => {
                let primaries: Vec<u16> = cluster
                    .as_ref()
                    .expect("the cluster")
                    .nodes
                    .iter()
                    .filter(|node| node.info("replication", "role").as_deref() == Some("master"))
                    .map(|node| node.port)
                    .collect();
                tokio::task::spawn_blocking(move || load_records(&primaries))
                    .await
                    .unwrap()
            }
        }
    }

    /// Claims still processing, with their lease left (`true`) or run out (`false`).
    async fn claims(&self, lease_left: bool) -> usize {
        self.records()
            .await
            .values()
            .filter(|r| r.status == "processing" && r.lease_left == lease_left)
            .count()
    }

    /// How many kinds of fault act on this store: a cluster has no relays, so its connection faults
    /// are the store's crash (a primary killed) and a proxy's.
    fn fault_kinds(&self) -> usize {
        match self {
            Store::RedisCluster(_) => FAULT_KINDS as usize - 2,
            _ => FAULT_KINDS as usize,
        }
    }
}

/// The world the faults act on.
struct World {
    store: Store,
    recorder: Recorder,
    relays: Vec<Relay>,
    configs: Vec<ProxyConfig>,
    proxies: Vec<Option<ProxyProcess>>,
    /// Killed processes, kept for their logs.
    dead: Vec<ProxyProcess>,
    peak_rss_kib: u64,
    faults: BTreeMap<&'static str, usize>,
}

impl World {
    async fn start(params: &Params) -> World {
        let store = Store::start(params.backend).await;
        let recorder = Recorder::start().await;
        let mut relays = Vec::new();
        let mut configs = Vec::new();
        for _ in 0..params.proxies {
            let relay = match store.relay_target() {
                Some(target) => Some(Relay::start(&target).await),
                None => None,
            };
            let config = store
                .config(relay.as_ref(), &recorder.url())
                .set("store.pool_size", 8)
                .set("idempotency.lock_timeout", LOCK_TIMEOUT)
                .set("store.timeout", STORE_TIMEOUT)
                .set("upstream.timeout", "1500ms");
            relays.extend(relay);
            configs.push(config);
        }
        let mut proxies = Vec::new();
        for config in &configs {
            proxies.push(Some(ProxyProcess::spawn(config).await));
        }
        World {
            store,
            recorder,
            relays,
            configs,
            proxies,
            dead: Vec::new(),
            peak_rss_kib: 0,
            faults: BTreeMap::new(),
        }
    }

    fn urls(&self) -> Vec<Option<String>> {
        self.proxies
            .iter()
            .map(|p| p.as_ref().map(|p| p.url.clone()))
            .collect()
    }

    fn sample_memory(&mut self) {
        for proxy in self.proxies.iter().flatten() {
            if let Some((peak, _)) = history::memory_kib(proxy.pid()) {
                self.peak_rss_kib = self.peak_rss_kib.max(peak);
            }
        }
    }

    /// Acts fault `which` (0 to 5) and undoes it, except the upstream's, which hit the next responses.
    async fn fault(&mut self, which: u64, rng: &mut Rng, shared: &Shared) {
        let i = rng.below(self.proxies.len() as u64) as usize;
        let kind = match which {
            // A cluster has no relays: its connection faults are a primary killed, and a proxy killed
            // (a primary's failover takes seconds, so a round of faults stays within the run).
            0 if self.relays.is_empty() => self.store.crash().await,
            1 if self.relays.is_empty() => {
                self.kill_and_restart(i, rng, shared).await;
                "proxy killed (SIGKILL) and restarted"
            }
            0 => {
                self.relays[i].cut();
                tokio::time::sleep(rng.millis(200, STORE_FAULT_MAX_MS)).await;
                self.relays[i].restore();
                "store connection cut"
            }
            1 => {
                self.relays[i].stall();
                tokio::time::sleep(rng.millis(200, STORE_FAULT_MAX_MS)).await;
                self.relays[i].resume();
                "store connection stalled"
            }
            2 => {
                self.kill_and_restart(i, rng, shared).await;
                "proxy killed (SIGKILL) and restarted"
            }
            3 => self.store.crash().await,
            4 => {
                self.recorder.reset_next(1 + rng.below(3) as usize);
                "upstream reset mid-body"
            }
            _ => {
                let pause = if rng.percent(50) {
                    UPSTREAM_TIMEOUT * 2
                } else {
                    UPSTREAM_TIMEOUT / 3
                };
                self.recorder.stall_next(1 + rng.below(2) as usize, pause);
                "upstream stalled mid-body"
            }
        };
        *self.faults.entry(kind).or_default() += 1;
    }

    async fn kill_and_restart(&mut self, i: usize, rng: &mut Rng, shared: &Shared) {
        self.sample_memory();
        let Some(mut proxy) = self.proxies[i].take() else {
            return;
        };
        shared.urls.lock().unwrap()[i] = None;
        proxy.kill().await;
        self.dead.push(proxy);
        tokio::time::sleep(rng.millis(100, 1000)).await;
        let proxy = ProxyProcess::spawn(&self.configs[i]).await;
        shared.urls.lock().unwrap()[i] = Some(proxy.url.clone());
        self.proxies[i] = Some(proxy);
    }

    /// Every log line of every process that ran, dead or alive.
    fn logs(&self) -> Vec<String> {
        let processes = self.dead.iter().chain(self.proxies.iter().flatten());
        processes
            .flat_map(|p| {
                let url = p.url.clone();
                let stderr = p.stderr();
                stderr
                    .lines()
                    .map(|line| format!("{url} {line}"))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

async fn run(params: Params) {
    let mut world = World::start(&params).await;
    let started = Instant::now();
    let shared = Arc::new(Shared {
        urls: Mutex::new(world.urls()),
        observations: Mutex::new(Vec::new()),
        started,
        deadline: started + params.traffic,
        params: params.clone(),
    });
    let clients: Vec<_> = (0..params.clients)
        .map(|n| {
            tokio::spawn(client(
                shared.clone(),
                Rng::new(params.seed ^ (n as u64 + 1) << 8),
            ))
        })
        .collect();
    let mut rng = Rng::new(params.seed);
    let mut schedule = Vec::new();
    while Instant::now() + Duration::from_secs(1) < shared.deadline {
        if schedule.is_empty() {
            schedule = shuffled(FAULT_KINDS, &mut rng);
        }
        tokio::time::sleep(rng.millis(200, 1000)).await;
        let which = schedule.pop().expect("refilled above");
        world.fault(which, &mut rng, &shared).await;
        world.sample_memory();
    }
    for client in join_all(clients).await {
        client.expect("client task");
    }
    world.sample_memory();
    // The faults have ended and the clients are gone: every claim must complete, be released, or go
    // stale within the bound, with nobody retrying it.
    let store = &world.store;
    poll_until(
        "every claim to finish or go stale once the faults ended",
        || async { (store.claims(true).await == 0).then_some(()) },
    )
    .await;
    let stale = store.claims(false).await;
    settle(&shared).await;
    world.sample_memory();
    // A client has its answer before the record is written: let the last completions land.
    let store = &world.store;
    poll_until("the settling requests' completions", || async {
        (store.claims(true).await == 0).then_some(())
    })
    .await;
    let records = store.records().await;
    let observations = shared.observations.lock().unwrap().clone();
    let logs = world.logs();
    let given_back = history::orphans_given_back(&logs);
    let report = history::check(
        &observations,
        &world.recorder.executions(),
        &records,
        SPACING,
        &given_back,
    );
    eprintln!(
        "history on {:?}, seed {} over {:?} with {} clients and {} proxies\nfaults injected: {:?}\n{report}\
         claims left stale when the faults ended (then taken over): {stale}\n\
         stale takeovers logged by the proxies: {}\norphaned claims given back: {}\n\
         peak proxy memory (VmHWM): {} KiB",
        params.backend,
        params.seed,
        params.traffic,
        params.clients,
        params.proxies,
        world.faults,
        logs.iter()
            .filter(|l| l.contains("stale claim taken over"))
            .count(),
        given_back.len(),
        world.peak_rss_kib,
    );
    if !report.violations.is_empty() {
        timelines(&report.violations, &observations, &world.recorder, &logs, started);
    }
    assert!(
        report.violations.is_empty(),
        "the history has violations (see above)"
    );
    assert!(report.executions > 0 && report.by_answer.contains_key("replayed"));
    assert_eq!(
        world.faults.len(),
        world.store.fault_kinds(),
        "every kind of fault acts: {:?}",
        world.faults
    );
}

/// For each key with a violation: what every client saw, every execution, and the proxies' log lines.
fn timelines(
    violations: &[String],
    observations: &[Observation],
    recorder: &Recorder,
    logs: &[String],
    started: Instant,
) {
    let keys: BTreeSet<&str> = violations
        .iter()
        .filter_map(|v| {
            v.split(['"', ' ', ',', '('])
                .find(|word| word.starts_with('e') && word.contains("-k"))
        })
        .collect();
    for key in keys {
        eprintln!("timeline of {key}:");
        for o in observations.iter().filter(|o| o.op.key == key) {
            let seen = match &o.seen {
                Seen::Response {
                    status,
                    replayed,
                    body,
                    ..
                } => format!("{status} replayed={replayed} {} bytes", body.len()),
                Seen::Broken => "broken".to_string(),
            };
            eprintln!("  {} {} via {}: {seen}", o.op.authorization, o.op.payload, o.via);
        }
        for e in recorder.executions().iter().filter(|e| e.key == key) {
            let at = e.at.saturating_duration_since(started.into_std()).as_millis();
            let len = e.body.len();
            eprintln!(
                "  exec {} at {at} ms for {}: {len} bytes",
                e.exec, e.authorization
            );
        }
        for line in logs.iter().filter(|l| l.contains(&format!("\"{key}\""))) {
            eprintln!("  {line}");
        }
    }
}

/// How many kinds of fault [`World::fault`] knows; the schedule acts each once per round, in random order.
const FAULT_KINDS: u64 = 6;

fn shuffled(n: u64, rng: &mut Rng) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
}

/// One client: until the deadline, picks an op and sends it once, in a burst of duplicates, or with
/// patience (retrying refusals and broken connections with jitter), sometimes with a short timeout.
async fn client(shared: Arc<Shared>, mut rng: Rng) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("HTTP client");
    while Instant::now() < shared.deadline {
        let op = pick_op(&shared, &mut rng);
        match rng.below(10) {
            0 => {
                let burst = (0..3 + rng.below(6)).map(|_| {
                    let mut rng = Rng::new(rng.next_u64());
                    let (http, shared, op) = (http.clone(), shared.clone(), op.clone());
                    async move { attempt(&http, &shared, &op, &mut rng, None).await }
                });
                join_all(burst).await;
            }
            1 => {
                let impatient = Some(rng.millis(20, 400));
                attempt(&http, &shared, &op, &mut rng, impatient).await;
            }
            _ => {
                patient(&http, &shared, &op, &mut rng, 20).await;
            }
        }
    }
}

fn pick_op(shared: &Shared, rng: &mut Rng) -> Op {
    let epoch = (shared.started.elapsed().as_millis() / shared.params.epoch.as_millis()) as u64;
    let epoch = epoch.saturating_sub(u64::from(rng.percent(20)));
    let key = format!("e{epoch}-k{}", rng.below(shared.params.keys));
    let variant = if rng.percent(1) { "b" } else { "a" };
    Op {
        authorization: format!("Bearer client-{}", rng.below(shared.params.scopes)),
        payload: format!("{key}:{variant}"),
        key,
    }
}

/// Sends until an answer that is final for this op, at most `tries` times.
async fn patient(http: &reqwest::Client, shared: &Shared, op: &Op, rng: &mut Rng, tries: usize) -> bool {
    for _ in 0..tries {
        if attempt(http, shared, op, rng, None).await {
            return true;
        }
        tokio::time::sleep(rng.millis(100, 500)).await;
    }
    false
}

/// One request; true when its answer is final (an upstream answer or a 422).
async fn attempt(
    http: &reqwest::Client,
    shared: &Shared,
    op: &Op,
    rng: &mut Rng,
    timeout: Option<Duration>,
) -> bool {
    let Some(url) = shared.pick_url(rng) else {
        return false;
    };
    // Answers differ by key: some are a stored 4xx, some come late.
    let digest = op
        .key
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
    let mut request = http
        .post(format!("{url}/ops"))
        .header("authorization", &op.authorization)
        .header("idempotency-key", &op.key)
        .header("content-type", "text/plain")
        .header("x-want-status", if digest % 5 == 0 { "404" } else { "201" })
        .header(
            "x-delay-ms",
            if digest % 10 == 1 { 1000 } else { digest % 150 }.to_string(),
        )
        .body(op.payload.clone());
    if let Some(timeout) = timeout {
        request = request.timeout(timeout);
    }
    let seen = match request.send().await {
        Ok(response) => read(response).await,
        Err(_) => Seen::Broken,
    };
    let last = matches!(&seen, Seen::Response { status, .. } if ![409, 502, 503, 504].contains(status));
    shared.log(op, seen, &url);
    last
}

async fn read(response: reqwest::Response) -> Seen {
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let content_type = header("content-type");
    let replayed = header("idempotent-replayed") == "true";
    match response.bytes().await {
        Ok(body) => Seen::Response {
            status,
            content_type,
            replayed,
            body,
        },
        Err(_) => Seen::Broken,
    }
}

/// After the faults: every op the clients tried is sent again until it gets a final answer, so every
/// stale claim is taken over and completed, and every key's answer is checked once more.
async fn settle(shared: &Arc<Shared>) {
    let ops: BTreeSet<Op> = shared
        .observations
        .lock()
        .unwrap()
        .iter()
        .map(|o| o.op.clone())
        .collect();
    let http = reqwest::Client::new();
    let settled = stream::iter(ops)
        .map(|op| {
            let (http, shared) = (http.clone(), shared.clone());
            async move {
                let mut rng = Rng::new(op.key.len() as u64);
                let patience = patient(&http, &shared, &op, &mut rng, usize::MAX);
                if tokio::time::timeout(SETTLE_BOUND, patience).await.is_err() {
                    panic!("no final answer for {op:?} within {SETTLE_BOUND:?} after the faults ended");
                }
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<()>>();
    settled.await;
}

/// The checker itself: a history with a double execution (whose first is stored), a crossed response and
/// a replay that differs from the stored one is judged to have exactly those violations; and the second
/// execution, coming at once, is a takeover before the lease ran out.
#[test]
fn checker_finds_each_kind_of_violation() {
    use crate::support::recorder::Execution;

    let op = |auth: &str, key: &str| Op {
        authorization: auth.into(),
        key: key.into(),
        payload: format!("{key}:a"),
    };
    let execution = |exec: usize, op: &Op| {
        let body = serde_json::json!({
            "exec": exec, "authorization": op.authorization, "key": op.key, "payload": op.payload,
        });
        Execution {
            exec,
            authorization: op.authorization.clone(),
            key: op.key.clone(),
            payload: op.payload.clone(),
            status: 201,
            body: body.to_string().into(),
            at: std::time::Instant::now(),
        }
    };
    let answer = |execution: &Execution, replayed: bool| Seen::Response {
        status: 201,
        content_type: "application/json".into(),
        replayed,
        body: execution.body.clone(),
    };
    let record = |execution: &Execution| history::Record {
        status: "completed".into(),
        attempt: 1,
        claim_kind: "new".into(),
        lease_left: false,
        response_status: Some(201),
        response_body: Some(execution.body.to_vec()),
    };
    let (a, b) = (op("Bearer a", "k1"), op("Bearer b", "k1"));
    let (a1, a2, b1) = (execution(1, &a), execution(2, &a), execution(3, &b));
    let records: history::Records = [
        ((history::scope_of("Bearer a"), "k1".to_string()), record(&a1)),
        ((history::scope_of("Bearer b"), "k1".to_string()), record(&b1)),
    ]
    .into();
    let seen = |op: &Op, seen: Seen| Observation {
        op: op.clone(),
        seen,
        via: "a proxy".into(),
    };
    let observations = [
        seen(&a, answer(&a1, false)),
        seen(&a, answer(&a2, true)),
        seen(&b, answer(&a1, true)),
        seen(&b, answer(&b1, true)),
    ];
    let executions = [a1, a2, b1];
    let report = history::check(
        &observations,
        &executions,
        &records,
        Duration::ZERO,
        &Default::default(),
    );
    let violations = report.violations.join("\n");
    assert_eq!(report.violations.len(), 4, "{violations}");
    assert!(violations.contains("is not its latest execution"), "{violations}");
    assert!(
        violations.contains("2 executions, but only 1 + 0 stale takeovers"),
        "{violations}"
    );
    assert!(violations.contains("crossed"), "{violations}");
    assert!(
        violations.contains("got 201 (replayed: true) exec 2"),
        "{violations}"
    );
}
