//! The connection to Redis: one server through a `ConnectionManager` (one multiplexed connection,
//! reconnected in the background) or a Redis Cluster through the cluster client (one multiplexed
//! connection per node, MOVED and ASK followed, the slot map refreshed). Both write every command as it
//! comes and read the answers in order, so concurrent requests share round trips without waiting for each
//! other: that is the store's batching. Connects at the first operation, so the store opens while Redis is
//! down; every operation is bounded by `store.timeout` here.
//!
//! A script runs as one `EVALSHA` on the record's node; where writes must reach replicas, as one
//! pipeline of the `EVALSHA` and a `WAIT n`, so that the `WAIT` is on the connection that wrote and
//! covers the write.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ErrorKind, Pipeline, RedisError, ServerErrorKind, TlsCertificates, Value};
use tokio::sync::OnceCell;
use tokio::time::timeout;

use crate::config::{RedisTarget, StoreConfig};
use crate::store::StoreError;

/// A Lua script: its text, for `EVAL` when the node does not know it yet, and its SHA-1, for `EVALSHA`.
#[derive(Clone)]
pub(super) struct Script {
    code: &'static str,
    hash: Arc<str>,
}

impl Script {
    pub(super) fn new(code: &'static str) -> Script {
        Script {
            code,
            hash: redis::Script::new(code).get_hash().into(),
        }
    }
}

/// One script to run on the one server in a batch whose writes must reach replicas.
pub(super) struct Call {
    pub(super) script: Script,
    pub(super) key: Vec<u8>,
    pub(super) args: Vec<Vec<u8>>,
}

/// A handle on the connection; clones share it.
#[derive(Clone)]
enum Handle {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The store's way to Redis; clones share the connection.
#[derive(Clone)]
pub(super) struct Redis {
    target: RedisTarget,
    tls_ca_file: Option<std::path::PathBuf>,
    timeout: Duration,
    handle: Arc<OnceCell<Handle>>,
}

/// A Redis node, as a primary's address (cluster) or the one server.
#[derive(Debug, Clone)]
pub(super) enum Node {
    Only,
    At { host: String, port: u16 },
}

impl Redis {
    pub(super) fn new(config: &StoreConfig, target: &RedisTarget) -> Redis {
        Redis {
            target: target.clone(),
            tls_ca_file: config.tls_ca_file.clone(),
            timeout: config.timeout,
            handle: Arc::new(OnceCell::new()),
        }
    }

    /// Another way to the same Redis, with connections of its own, made at its first operation.
    pub(super) fn another(&self) -> Redis {
        Redis {
            target: self.target.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
            timeout: self.timeout,
            handle: Arc::new(OnceCell::new()),
        }
    }

    pub(super) fn target(&self) -> &RedisTarget {
        &self.target
    }

    /// Runs `script` on `key`'s node with `args`, followed by `WAIT` when writes must reach replicas
    /// (`wait`). A `WAIT` that saw fewer replicas than asked is an error: the write may be lost with its
    /// primary.
    pub(super) async fn run(
        &self,
        script: &Script,
        key: &[u8],
        args: &[&[u8]],
        wait: bool,
    ) -> Result<Value, StoreError> {
        self.bounded(async {
            let mut handle = self.handle().await?;
            if !(wait && self.target.wait_replicas > 0) {
                // A command alone, not a pipeline of one: nothing to build around it and take apart.
                return match single(&mut handle, &eval(script, false, key, args)).await {
                    Err(e) if unknown_script(&e) => single(&mut handle, &eval(script, true, key, args)).await,
                    other => other,
                }
                .map_err(backend);
            }
            let pipeline = |by_text| {
                let mut pipe = Pipeline::with_capacity(2);
                pipe.add_command(eval(script, by_text, key, args));
                self.wait(&mut pipe);
                pipe
            };
            let mut values = match query(&mut handle, &pipeline(false)).await {
                Err(e) if unknown_script(&e) => query(&mut handle, &pipeline(true)).await,
                other => other,
            }
            .map_err(backend)?;
            self.confirmed(values.pop())?;
            values
                .pop()
                .ok_or_else(|| StoreError::Backend("Redis answered an empty pipeline".into()))
        })
        .await
    }

    /// Runs `calls` on the one server as one pipeline followed by one `WAIT`: a batch of writes that must
    /// reach replicas costs one round trip and one wait for them, not one each. Each call has its own
    /// answer; all fail when the `WAIT` saw fewer replicas than asked, since none of their writes is
    /// known to be on one.
    pub(super) async fn run_confirmed(&self, calls: Vec<Call>) -> Vec<Result<Value, StoreError>> {
        let count = calls.len();
        let answered = self
            .bounded(async {
                let mut handle = self.handle().await?;
                let pipeline = |calls: &mut dyn Iterator<Item = &Call>, by_text| {
                    let mut pipe = Pipeline::with_capacity(calls.size_hint().0 + 1);
                    pipe.ignore_errors();
                    for call in calls {
                        let args: Vec<&[u8]> = call.args.iter().map(Vec::as_slice).collect();
                        pipe.add_command(eval(&call.script, by_text, &call.key, &args));
                    }
                    self.wait(&mut pipe);
                    pipe
                };
                let mut values = query(&mut handle, &pipeline(&mut calls.iter(), false))
                    .await
                    .map_err(backend)?;
                let mut acked = values.pop();
                // Scripts this server does not know yet (it restarted, or was flushed) run again by text,
                // with a WAIT of their own that covers the whole batch.
                let unknown: Vec<usize> = (0..values.len()).filter(|&i| no_script(&values[i])).collect();
                if !unknown.is_empty() {
                    let mut again = unknown.iter().map(|&i| &calls[i]);
                    let mut by_text = query(&mut handle, &pipeline(&mut again, true))
                        .await
                        .map_err(backend)?;
                    acked = by_text.pop();
                    for (i, value) in unknown.into_iter().zip(by_text) {
                        values[i] = value;
                    }
                }
                self.confirmed(acked)?;
                if values.len() != count {
                    return Err(StoreError::Backend(format!(
                        "Redis answered {} of a batch of {count} scripts",
                        values.len()
                    )));
                }
                Ok(values)
            })
            .await;
        match answered {
            Ok(values) => values
                .into_iter()
                .map(|value| match value {
                    Value::ServerError(error) => Err(with_fix(
                        format!(
                            "Redis refused the script: {} {}",
                            error.code(),
                            error.details().unwrap_or_default()
                        ),
                        None,
                    )),
                    value => Ok(value),
                })
                .collect(),
            Err(error) => vec![Err(error); count],
        }
    }

    /// Appends `WAIT n timeout`, n being `store.redis.wait_replicas`.
    fn wait(&self, pipe: &mut Pipeline) {
        let wait_ms = u64::try_from(self.target.wait_timeout.as_millis()).unwrap_or(u64::MAX);
        pipe.cmd("WAIT")
            .arg(self.target.wait_replicas)
            .arg(wait_ms.max(1));
    }

    /// Whether `WAIT` answered that every replica asked for has the writes before it.
    fn confirmed(&self, acked: Option<Value>) -> Result<(), StoreError> {
        let acked = match acked {
            Some(Value::Int(n)) => n,
            other => return Err(StoreError::Backend(format!("WAIT answered {other:?}"))),
        };
        if acked < i64::from(self.target.wait_replicas) {
            return Err(StoreError::Backend(format!(
                "the write reached {acked} of the {} replicas store.redis.wait_replicas asks for \
                 within store.redis.wait_timeout",
                self.target.wait_replicas
            )));
        }
        Ok(())
    }

    /// `PING`, on the one server or on every primary of the cluster.
    pub(super) async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(async {
            let mut handle = self.handle().await?;
            // A cluster connection sends PING to every node and fails if one does not answer.
            let ping = redis::cmd("PING");
            match &mut handle {
                Handle::Single(conn) => ping.query_async::<Value>(conn).await,
                Handle::Cluster(conn) => ping.query_async::<Value>(conn).await,
            }
            .map(drop)
            .map_err(backend)
        })
        .await
    }

    /// The nodes holding records: the one server, or every primary of the cluster.
    pub(super) async fn primaries(&self) -> Result<Vec<Node>, StoreError> {
        self.bounded(async {
            match self.handle().await? {
                Handle::Single(_) => Ok(vec![Node::Only]),
                Handle::Cluster(mut conn) => {
                    let nodes = redis::cmd("CLUSTER").arg("NODES").to_owned();
                    let random = RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary);
                    let answer = conn.route_command(nodes, random).await.map_err(backend)?;
                    let text: String = redis::from_redis_value(answer)
                        .map_err(|e| StoreError::Backend(format!("unexpected CLUSTER NODES answer: {e}")))?;
                    Ok(cluster_primaries(&text))
                }
            }
        })
        .await
    }

    /// Runs `pipe` on `node`, each command's answer or error apart.
    pub(super) async fn on_node(&self, node: &Node, pipe: &Pipeline) -> Result<Vec<Value>, StoreError> {
        self.bounded(async {
            match (self.handle().await?, node) {
                (Handle::Single(mut conn), _) => pipe.query_async(&mut conn).await,
                (Handle::Cluster(mut conn), Node::At { host, port }) => {
                    let route = SingleNodeRoutingInfo::ByAddress {
                        host: host.clone(),
                        port: *port,
                    };
                    conn.route_pipeline(pipe.clone(), 0, pipe.len(), route).await
                }
                (Handle::Cluster(_), Node::Only) => Err(RedisError::from((
                    ErrorKind::Client,
                    "a cluster has no single node",
                ))),
            }
            .map_err(backend)
        })
        .await
    }

    /// `PUBLISH channel payload`. On a cluster any node takes it and the cluster bus carries it to
    /// every node, so a subscriber on any node hears it.
    pub(super) async fn publish(&self, channel: &str, payload: &str) -> Result<(), StoreError> {
        self.bounded(async {
            let publish = redis::cmd("PUBLISH").arg(channel).arg(payload).to_owned();
            match &mut self.handle().await? {
                Handle::Single(conn) => publish.query_async::<Value>(conn).await,
                Handle::Cluster(conn) => publish.query_async::<Value>(conn).await,
            }
            .map(drop)
            .map_err(backend)
        })
        .await
    }

    /// A client of one node, for a subscriber's own connection: the server, or the seed nodes of a
    /// cluster in turn (`attempt`), so a dead node is passed over on the next attempt.
    pub(super) fn node_client(&self, attempt: u64) -> Result<redis::Client, StoreError> {
        let nodes = &self.target.nodes;
        let url = nodes[(attempt % nodes.len() as u64) as usize].as_str();
        match self.certificates()? {
            Some(certificates) => redis::Client::build_with_tls(url, certificates),
            None => redis::Client::open(url),
        }
        .map_err(backend)
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn bounded<T>(&self, work: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        timeout(self.timeout, work)
            .await
            .unwrap_or(Err(StoreError::Timeout(self.timeout)))
    }

    /// The shared connection, made at the first call that needs it (and again after a failed attempt).
    async fn handle(&self) -> Result<Handle, StoreError> {
        self.handle.get_or_try_init(|| self.open()).await.cloned()
    }

    async fn open(&self) -> Result<Handle, StoreError> {
        if self.target.cluster {
            let certificates = self.certificates()?;
            let mut builder = ClusterClientBuilder::new(self.target.nodes.clone())
                .connection_timeout(self.timeout)
                .response_timeout(self.timeout);
            if let Some(certificates) = certificates {
                builder = builder.certs(certificates);
            }
            let client = builder.build().map_err(backend)?;
            let conn = client.get_async_connection().await.map_err(backend)?;
            return Ok(Handle::Cluster(conn));
        }
        let client = self.node_client(0)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(1);
        let conn = ConnectionManager::new_lazy_with_config(client, config).map_err(backend)?;
        Ok(Handle::Single(conn))
    }

    /// With `store.tls_ca_file`, the CAs Redis's certificate is checked against: the file's and the
    /// system's (the client library would otherwise trust the file's alone).
    fn certificates(&self) -> Result<Option<TlsCertificates>, StoreError> {
        let Some(path) = &self.tls_ca_file else {
            return Ok(None);
        };
        let mut pem = std::fs::read(path).map_err(|e| {
            StoreError::Backend(format!("cannot read store.tls_ca_file {}: {e}", path.display()))
        })?;
        for cert in rustls_native_certs::load_native_certs().certs {
            pem.extend_from_slice(pem_certificate(cert.as_ref()).as_bytes());
        }
        Ok(Some(TlsCertificates {
            client_tls: None,
            root_cert: Some(pem),
        }))
    }
}

/// The command that runs `script` with `key` and `args`, by its hash or (`by_text`) by its text. It is
/// sized up front: it is built for every operation, and would otherwise grow once per argument.
fn eval(script: &Script, by_text: bool, key: &[u8], args: &[&[u8]]) -> redis::Cmd {
    let (name, body) = if by_text {
        ("EVAL", script.code)
    } else {
        ("EVALSHA", &*script.hash)
    };
    let size = name.len() + body.len() + 1 + key.len() + args.iter().map(|arg| arg.len()).sum::<usize>();
    let mut eval = redis::Cmd::with_capacity(4 + args.len(), size);
    eval.arg(name).arg(body).arg(1).arg(key);
    for arg in args {
        eval.arg(*arg);
    }
    eval
}

/// Whether a command failed because the server does not know its script (sent by hash).
fn unknown_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// Whether a pipeline's answer is a script the server does not know.
fn no_script(value: &Value) -> bool {
    matches!(value, Value::ServerError(error) if error.kind() == Some(ServerErrorKind::NoScript))
}

async fn single(handle: &mut Handle, cmd: &redis::Cmd) -> Result<Value, RedisError> {
    match handle {
        Handle::Single(conn) => cmd.query_async(conn).await,
        Handle::Cluster(conn) => cmd.query_async(conn).await,
    }
}

async fn query(handle: &mut Handle, pipe: &Pipeline) -> Result<Vec<Value>, RedisError> {
    match handle {
        Handle::Single(conn) => pipe.query_async(conn).await,
        Handle::Cluster(conn) => pipe.query_async(conn).await,
    }
}

/// The primaries in `CLUSTER NODES` output that are up and own slots: `id host:port@bus[,name] flags …`.
fn cluster_primaries(text: &str) -> Vec<Node> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            let primary = flags.split(',').any(|f| f == "master")
                && !flags
                    .split(',')
                    .any(|f| matches!(f, "fail" | "noaddr" | "handshake"));
            if !primary || fields.len() < 9 {
                return None;
            }
            let address = fields[1].split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some(Node::At {
                host: host.to_owned(),
                port: port.parse().ok()?,
            })
        })
        .collect()
}

/// One DER certificate as a PEM block.
fn pem_certificate(der: &[u8]) -> String {
    use base64::Engine;
    let encoded = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in encoded.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// A Redis failure on one line: the client's reason, or the server's as Redis wrote it (`NOAUTH`,
/// `NOPERM` and the rest), followed by what mends it where the cause is the operator's ([`fix`]).
pub(super) fn backend(e: RedisError) -> StoreError {
    let text = crate::error_chain::error_chain(&e);
    with_fix(text, Some(&e))
}

/// `text`, followed by what mends the failure it says (and `e`'s kind, where there is a client error),
/// if the cause is the operator's.
fn with_fix(text: String, e: Option<&RedisError>) -> StoreError {
    StoreError::Backend(match fix(e, &text) {
        Some(fix) => format!("{text} ({fix})"),
        None => text,
    })
}

/// What mends a Redis failure whose cause is the configuration or the server's setup: the login
/// (`store.url`'s user and password, refused or missing), an ACL permission the store's commands need,
/// or the address, where nothing accepts connections.
fn fix(e: Option<&RedisError>, text: &str) -> Option<&'static str> {
    let kind = e.map(RedisError::kind);
    if kind == Some(ErrorKind::AuthenticationFailed) || text.contains("WRONGPASS") {
        Some(
            "Redis refused the user and password in store.url (AUTH): check the user and the \
             password that store.url gives before its host",
        )
    } else if text.contains("NOAUTH") {
        Some(
            "Redis requires a password (requirepass, or ACL users): give the user and password in \
             store.url, before its host",
        )
    } else if kind == Some(ErrorKind::Server(ServerErrorKind::NoPerm)) || text.contains("NOPERM") {
        Some(
            "the store.url user lacks an ACL permission the store needs: give it the store's commands, \
             keys and channel, `ACL SETUSER <user> +@scripting +@hash +@keyspace +@pubsub +@connection \
             +time +cluster|nodes ~<key_prefix>:* &<key_prefix>:*` (store.redis.key_prefix)",
        )
    } else if e.is_some_and(RedisError::is_connection_refusal) {
        Some("nothing accepts connections at store.url's address: start Redis there, or correct store.url")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_nodes_yield_the_live_primaries_that_own_slots() {
        let text = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001,host-b master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7002@17002 master,fail - 0 0 3 connected 10923-16383
d4 127.0.0.1:7003@17003 slave a1 0 0 1 connected
e5 127.0.0.1:7004@17004 master - 0 0 4 connected
";
        let found: Vec<String> = cluster_primaries(text)
            .into_iter()
            .map(|node| match node {
                Node::At { host, port } => format!("{host}:{port}"),
                Node::Only => "only".into(),
            })
            .collect();
        assert_eq!(found, ["127.0.0.1:7000", "127.0.0.1:7001"]);
    }

    #[test]
    fn a_certificate_becomes_one_pem_block_of_64_column_lines() {
        let pem = pem_certificate(&[7u8; 100]);
        let lines: Vec<&str> = pem.lines().collect();
        assert_eq!(lines.first(), Some(&"-----BEGIN CERTIFICATE-----"));
        assert_eq!(lines.last(), Some(&"-----END CERTIFICATE-----"));
        assert!(lines[1..lines.len() - 1].iter().all(|l| l.len() <= 64));
    }
}
