//! Redis servers the tests start themselves: one server, or a Redis Cluster of six (three primaries, a
//! replica each) made with `redis-cli --cluster create`. Each `redis-server` runs under a small shell
//! that kills it when this test process goes away (its stdin closes), so no server outlives the tests
//! even when they are killed. Suite tests share one server and one cluster, each test under its own key
//! prefix; fault tests start a cluster of their own.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const HOW_TO: &str = "Redis tests need redis-server and redis-cli on PATH (apt-get install redis-server)";

/// One `redis-server` process on a loopback port.
pub struct RedisServer {
    pub port: u16,
    pid: u32,
    args: Vec<String>,
    /// The watching shell: its stdin closing (this process exiting) kills the server.
    shell: Child,
    stdin: ChildStdin,
}

impl RedisServer {
    /// Starts a server in `dir` with `extra` arguments (`--name value` pairs), and waits for it to answer.
    pub fn start(dir: &Path, extra: &[&str]) -> RedisServer {
        RedisServer::start_at(dir, free_port(), extra)
    }

    /// [`RedisServer::start`] on a port the caller chose (see [`free_port`]).
    pub fn start_at(dir: &Path, port: u16, extra: &[&str]) -> RedisServer {
        let mut args: Vec<String> = [
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--dir",
            &dir.display().to_string(),
            "--logfile",
            &format!("redis-{port}.log"),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dbfilename",
            &format!("dump-{port}.rdb"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.replace("{port}", &port.to_string())));
        let (shell, stdin, pid) = spawn(&args);
        let server = RedisServer {
            port,
            pid,
            args,
            shell,
            stdin,
        };
        server.wait_answering();
        server
    }

    fn wait_answering(&self) {
        wait_for(&format!("redis-server on port {} to answer", self.port), || {
            self.cli(&["PING"]).is_some_and(|out| out.trim() == "PONG")
        });
    }

    /// Starts the server again after [`RedisServer::kill`], on the same port with the same files, as a
    /// supervisor would: a cluster node rejoins the cluster it was in (as a replica, if another node took
    /// over its slots meanwhile).
    pub fn restart(&mut self) {
        self.kill();
        let _ = self.stdin.write_all(b"\n");
        let _ = self.shell.wait();
        let (shell, stdin, pid) = spawn(&self.args);
        (self.shell, self.stdin, self.pid) = (shell, stdin, pid);
        self.wait_answering();
    }

    /// `redis-cli` against this server; `None` when it could not connect or failed.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect(HOW_TO);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && !text.starts_with("Could not connect") && !text.starts_with("ERR"))
            .then_some(text)
    }

    /// `INFO section` as `field:value` pairs.
    pub fn info(&self, section: &str, field: &str) -> Option<String> {
        let text = self.cli(&["INFO", section])?;
        text.lines()
            .find_map(|line| line.trim().strip_prefix(&format!("{field}:")).map(str::to_owned))
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = Command::new("kill").args(["-9", &self.pid.to_string()]).status();
    }

    /// Stops the server where it is (SIGSTOP), as a stalled host would: it neither answers nor, as a
    /// replica, acknowledges, until [`RedisServer::resume`].
    pub fn pause(&self) {
        let _ = Command::new("kill")
            .args(["-STOP", &self.pid.to_string()])
            .status();
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.pid.to_string()])
            .status();
    }

    /// How many times the server ran `command` (`INFO commandstats`); 0 before the first.
    pub fn calls(&self, command: &str) -> u64 {
        let prefix = format!("cmdstat_{command}:calls=");
        self.cli(&["INFO", "commandstats"])
            .and_then(|stats| {
                stats
                    .lines()
                    .find_map(|line| line.strip_prefix(prefix.as_str()))
                    .and_then(|rest| rest.split(',').next()?.parse().ok())
            })
            .unwrap_or(0)
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = self.stdin.write_all(b"\n");
        let _ = self.shell.wait();
    }
}

/// `redis-server args` under a shell that kills it when its stdin closes; the shell, its stdin and the
/// server's pid.
fn spawn(args: &[String]) -> (Child, ChildStdin, u32) {
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg("redis-server \"$@\" & pid=$!; echo $pid; read line; kill -9 $pid")
        .arg("sh")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect(HOW_TO);
    let stdin = shell.stdin.take().expect("piped stdin");
    let mut line = String::new();
    BufReader::new(shell.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("the shell prints the server's pid");
    (shell, stdin, line.trim().parse().expect("a pid"))
}

/// A Redis Cluster of three primaries with one replica each.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    /// Starts six servers, joins them with `redis-cli --cluster create`, and waits until every node
    /// reports `cluster_state:ok` and every replica's link to its primary is up. Failover is quick
    /// (`cluster-node-timeout` 1 s) and starts replicating at once (`repl-diskless-sync-delay 0`), so a
    /// primary killed early is replaced.
    pub fn start() -> RedisCluster {
        let dir = tempfile::tempdir().expect("temporary directory");
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start(
                    dir.path(),
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes-{port}.conf",
                        "--cluster-node-timeout",
                        "1000",
                        "--repl-diskless-sync",
                        "yes",
                        "--repl-diskless-sync-delay",
                        "0",
                        "--cluster-replica-validity-factor",
                        "0",
                    ],
                )
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(node.address());
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .expect(HOW_TO);
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let cluster = RedisCluster { nodes, _dir: dir };
        cluster.wait_healthy();
        cluster
    }

    /// Waits until node `dead` (killed) has been failed over: the replica that followed it is a primary
    /// now, and every other node says `cluster_state:ok`.
    pub fn wait_failed_over(&self, dead: usize, replica: usize) {
        wait_for("the dead primary's replica to take over its slots", || {
            self.nodes[replica].info("replication", "role").as_deref() == Some("master")
                && self
                    .nodes
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != dead)
                    .all(|(_, node)| {
                        node.cli(&["CLUSTER", "INFO"])
                            .is_some_and(|info| info.contains("cluster_state:ok"))
                    })
        });
    }

    /// Kills a primary (SIGKILL), waits until its replica has taken over, restarts it and waits until
    /// it has rejoined as that replica's replica and the cluster is whole: a crash and its supervisor's
    /// restart. Blocking; returns the killed node.
    pub fn kill_a_primary_and_restart_it(&mut self) -> usize {
        let victim = self
            .nodes
            .iter()
            .position(|node| node.info("replication", "role").as_deref() == Some("master"))
            .expect("a primary");
        let replica = self.replica_of(victim);
        self.nodes[victim].kill();
        self.wait_failed_over(victim, replica);
        self.nodes[victim].restart();
        self.wait_healthy();
        victim
    }

    /// The node replicating node `primary`.
    pub fn replica_of(&self, primary: usize) -> usize {
        let port = self.nodes[primary].port.to_string();
        self.nodes
            .iter()
            .position(|node| node.info("replication", "master_port").as_deref() == Some(port.as_str()))
            .expect("every primary has a replica")
    }

    /// Waits until every live node says `cluster_state:ok` and every replica's primary link is up.
    pub fn wait_healthy(&self) {
        wait_for("the Redis Cluster to be healthy", || {
            self.nodes.iter().all(|node| {
                node.cli(&["CLUSTER", "INFO"])
                    .is_some_and(|info| info.contains("cluster_state:ok"))
                    && match node.info("replication", "role").as_deref() {
                        Some("master") => true,
                        Some("slave") => {
                            node.info("replication", "master_link_status").as_deref() == Some("up")
                        }
                        _ => false,
                    }
            })
        });
    }

    /// The store URL naming every node.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self.nodes.iter().map(RedisServer::address).collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}

/// The standalone server the suite shares.
pub fn shared_server() -> &'static RedisServer {
    static SERVER: OnceLock<(RedisServer, tempfile::TempDir)> = OnceLock::new();
    &SERVER
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("temporary directory");
            (RedisServer::start(dir.path(), &[]), dir)
        })
        .0
}

/// The cluster the suite shares.
pub fn shared_cluster() -> &'static RedisCluster {
    static CLUSTER: OnceLock<RedisCluster> = OnceLock::new();
    static STARTING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    CLUSTER.get_or_init(RedisCluster::start)
}

/// A key prefix no other test uses.
pub fn unique_prefix() -> String {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    format!(
        "t{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// A loopback port that is free, and whose cluster bus port (+10000) is free too.
pub fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        let port = listener.local_addr().expect("local address").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Polls `ready` every 50 ms for up to 60 s (blocking: it runs before any runtime work).
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    for _ in 0..1200 {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("gave up after 60 s waiting for {what}");
}

/// Every record the proxy wrote on the primaries at `ports` (under the default key prefix), as the
/// history checker reads them, each judged by its own node's clock.
pub fn load_records(ports: &[u16]) -> super::history::Records {
    use redis::Commands;
    let mut records = super::history::Records::new();
    for port in ports {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("a Redis URL");
        let mut conn = client.get_connection().expect("connect to a Redis primary");
        let (seconds, micros): (i64, i64) = redis::cmd("TIME").query(&mut conn).expect("TIME");
        let now = seconds * 1000 + micros / 1000;
        let names: Vec<String> = conn
            .scan_match::<_, String>("idemproxy:{*}")
            .expect("SCAN")
            .collect::<Result<_, _>>()
            .expect("SCAN pages");
        for name in names {
            let fields: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
                .arg(&name)
                .query(&mut conn)
                .expect("HGETALL");
            let Some(id) = record_id(&name) else {
                continue;
            };
            if fields.is_empty() {
                continue;
            }
            let text =
                |field: &str| String::from_utf8_lossy(fields.get(field).map_or(&[][..], |v| v)).into_owned();
            let number = |field: &str| text(field).parse::<i64>().ok();
            let retained = text("br") == "1";
            records.insert(
                id,
                super::history::Record {
                    status: text("st"),
                    attempt: number("at").unwrap_or(0) as i32,
                    claim_kind: text("ck"),
                    lease_left: number("lu").is_some_and(|until| until > now),
                    response_status: number("rs").map(|s| s as i16),
                    response_body: retained.then(|| fields.get("rb").cloned().unwrap_or_default()),
                },
            );
        }
    }
    records
}

/// The (scope, key) of a record's Redis name, `idemproxy:{<scope>:<key>}`, each percent-encoded.
fn record_id(name: &str) -> Option<(String, String)> {
    let tag = name.strip_prefix("idemproxy:{")?.strip_suffix('}')?;
    let (scope, key) = tag.split_once(':')?;
    Some((percent_decoded(scope)?, percent_decoded(key)?))
}

fn percent_decoded(text: &str) -> Option<String> {
    let mut bytes = Vec::new();
    let mut rest = text.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        if first == b'%' {
            let hex = std::str::from_utf8(tail.get(..2)?).ok()?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            rest = &tail[2..];
        } else {
            bytes.push(first);
            rest = tail;
        }
    }
    String::from_utf8(bytes).ok()
}
