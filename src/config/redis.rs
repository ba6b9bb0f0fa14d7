//! `[store.redis]` and the Redis forms of `store.url`: `redis://` and `rediss://` (TLS) for one server,
//! `redis+cluster://` and `rediss+cluster://` for a Redis Cluster reached through any of its nodes.
//! Validated once at load into [`RedisTarget`], which `store/redis.rs` connects to; a bad URL or setting
//! stops the start with one line naming the key.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::positive;

/// The most replicas `wait_replicas` may ask for: a Redis primary with more is rare, and a typo such as
/// 100 would turn every request into a store timeout.
const MAX_WAIT_REPLICAS: u32 = 16;

/// `[store.redis]` as written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRedis {
    /// Replicas that must have a claim or a completion (`WAIT n`) before the proxy acts on it; 0 waits for
    /// none.
    pub wait_replicas: u32,
    /// How long `WAIT` may take before the operation counts as failed.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// The first part of every Redis key the store writes, so one Redis can hold several deployments.
    pub key_prefix: String,
}

impl Default for RawRedis {
    fn default() -> Self {
        RawRedis {
            wait_replicas: 0,
            wait_timeout: Duration::from_secs(1),
            key_prefix: "idemproxy".into(),
        }
    }
}

/// A validated Redis store: where it is and how its writes are confirmed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisTarget {
    /// One connection URL per node given, in the client library's form (`redis://` or `rediss://`,
    /// credentials and database included); a cluster discovers the rest from these.
    pub nodes: Vec<String>,
    /// A Redis Cluster (`redis+cluster://`), rather than one server.
    pub cluster: bool,
    /// TLS (`rediss://`, `rediss+cluster://`).
    pub tls: bool,
    /// See [`RawRedis::wait_replicas`].
    pub wait_replicas: u32,
    /// See [`RawRedis::wait_timeout`].
    pub wait_timeout: Duration,
    /// See [`RawRedis::key_prefix`].
    pub key_prefix: String,
}

/// Whether `url` names a Redis store.
pub fn is_redis_url(url: &str) -> bool {
    ["redis://", "rediss://", "redis+cluster://", "rediss+cluster://"]
        .iter()
        .any(|scheme| url.starts_with(scheme))
}

impl RawRedis {
    /// Checks a Redis `store.url` and this section together; `timeout` is `store.timeout`, which a
    /// `WAIT` must fit in.
    pub fn validate(&self, url: &str, timeout: Duration) -> Result<RedisTarget, ConfigError> {
        let (scheme, rest) = url.split_once("://").unwrap_or_default();
        let cluster = scheme.ends_with("+cluster");
        let tls = scheme.starts_with("rediss");
        let nodes = if cluster {
            cluster_nodes(rest, tls)?
        } else {
            vec![single_node(url)?]
        };
        if self.wait_replicas > MAX_WAIT_REPLICAS {
            return Err(ConfigError::new(
                "store.redis.wait_replicas",
                format!("must be from 0 (no wait) to {MAX_WAIT_REPLICAS}"),
            ));
        }
        positive("store.redis.wait_timeout", self.wait_timeout)?;
        if self.wait_replicas > 0 && self.wait_timeout >= timeout {
            return Err(ConfigError::new(
                "store.redis.wait_timeout",
                format!(
                    "must be shorter than store.timeout ({}), which bounds the whole operation",
                    humantime::format_duration(timeout)
                ),
            ));
        }
        check_prefix(&self.key_prefix)?;
        Ok(RedisTarget {
            nodes,
            cluster,
            tls,
            wait_replicas: self.wait_replicas,
            wait_timeout: self.wait_timeout,
            key_prefix: self.key_prefix.clone(),
        })
    }
}

/// `redis://[user:password@]host[:port][/db]` or the same with `rediss://`.
fn single_node(raw: &str) -> Result<String, ConfigError> {
    let url = url::Url::parse(raw).map_err(|e| ConfigError::new("store.url", format!("not a URL: {e}")))?;
    if url.host_str().is_none_or(str::is_empty) {
        return Err(ConfigError::new(
            "store.url",
            "names no host, e.g. redis://127.0.0.1:6379",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(ConfigError::new(
            "store.url",
            "a Redis URL takes no query or fragment: redis://[user:password@]host[:port][/db]",
        ));
    }
    let db = url.path().trim_start_matches('/');
    if !db.is_empty() && db.parse::<u16>().is_err() {
        return Err(ConfigError::new(
            "store.url",
            format!("the path must be a database number, e.g. redis://host:6379/0, not {db:?}"),
        ));
    }
    Ok(raw.to_owned())
}

/// `redis+cluster://[user:password@]host1[:port],host2[:port],…`: the seed nodes, each as a node URL
/// carrying the credentials.
fn cluster_nodes(rest: &str, tls: bool) -> Result<Vec<String>, ConfigError> {
    let key = "store.url";
    let (credentials, hosts) = match rest.rsplit_once('@') {
        Some((credentials, hosts)) => (format!("{credentials}@"), hosts),
        None => (String::new(), rest),
    };
    let hosts = hosts.strip_suffix('/').unwrap_or(hosts);
    if hosts.contains(['/', '?', '#']) {
        return Err(ConfigError::new(
            key,
            "a Redis Cluster URL is only a list of nodes, without database, query or fragment: \
             redis+cluster://[user:password@]host1:port,host2:port",
        ));
    }
    let scheme = if tls { "rediss" } else { "redis" };
    let nodes = hosts
        .split(',')
        .map(|host| {
            let node = format!("{scheme}://{credentials}{host}");
            single_node(&node).map_err(|e| ConfigError::new(key, format!("node {host:?}: {}", e.message)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(nodes)
}

/// The prefix ends up in key names, hash tags and `SCAN` patterns, so it is kept to characters that
/// mean nothing in any of them.
fn check_prefix(prefix: &str) -> Result<(), ConfigError> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/');
    if prefix.is_empty() || prefix.len() > 64 || !prefix.chars().all(plain) {
        return Err(ConfigError::new(
            "store.redis.key_prefix",
            "must be 1 to 64 characters of letters, digits and - _ . : /",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::{Config, StoreBackend};

    fn target(toml: &str) -> super::RedisTarget {
        match Config::from_toml_str(toml).unwrap().store.backend {
            StoreBackend::Redis(target) => target,
            other => panic!("not a Redis store: {other:?}"),
        }
    }

    fn refused(toml: &str) -> (String, String) {
        let err = Config::from_toml_str(toml).unwrap_err();
        (err.key.to_string(), err.message)
    }

    #[test]
    fn one_server_with_or_without_tls_and_database() {
        let plain = target("[store]\nurl = \"redis://:pw@cache:6380/2\"\n");
        assert_eq!(plain.nodes, vec!["redis://:pw@cache:6380/2".to_owned()]);
        assert!(!plain.cluster && !plain.tls);
        assert_eq!(plain.wait_replicas, 0);
        assert_eq!(plain.key_prefix, "idemproxy");
        let tls = target("[store]\nurl = \"rediss://cache\"\n");
        assert!(tls.tls && !tls.cluster);
    }

    #[test]
    fn a_cluster_url_lists_its_seed_nodes_with_the_credentials_on_each() {
        let cluster = target("[store]\nurl = \"rediss+cluster://app:pw@a:7000,b:7001/\"\n");
        assert!(cluster.cluster && cluster.tls);
        assert_eq!(
            cluster.nodes,
            vec![
                "rediss://app:pw@a:7000".to_owned(),
                "rediss://app:pw@b:7001".to_owned()
            ]
        );
        let (key, message) = refused("[store]\nurl = \"redis+cluster://a:7000,b:7001/0\"\n");
        assert_eq!(key, "store.url");
        assert!(message.contains("without database"), "{message}");
        let (key, message) = refused("[store]\nurl = \"redis+cluster://a:7000,,b\"\n");
        assert_eq!(key, "store.url");
        assert!(message.contains("node \"\""), "{message}");
    }

    #[test]
    fn bad_urls_and_settings_name_their_key() {
        for (toml, key) in [
            ("url = \"redis://cache/x\"", "store.url"),
            ("url = \"redis://cache?db=1\"", "store.url"),
            ("url = \"redis://\"", "store.url"),
            (
                "url = \"redis://c\"\nredis.wait_replicas = 17",
                "store.redis.wait_replicas",
            ),
            (
                "url = \"redis://c\"\nredis.wait_timeout = \"0s\"",
                "store.redis.wait_timeout",
            ),
            (
                "url = \"redis://c\"\ntimeout = \"1s\"\nredis.wait_replicas = 1\nredis.wait_timeout = \"2s\"",
                "store.redis.wait_timeout",
            ),
            (
                "url = \"redis://c\"\nredis.key_prefix = \"a{b}\"",
                "store.redis.key_prefix",
            ),
            (
                "url = \"redis://c\"\nredis.key_prefix = \"\"",
                "store.redis.key_prefix",
            ),
            ("url = \"redis://c\"\nredis.bogus = 1", "store"),
            (
                "url = \"postgres://db/x\"\nredis.wait_replicas = 1",
                "store.redis",
            ),
            (
                "url = \"redis://c\"\ntls_ca_file = \"/etc/hostname\"",
                "store.tls_ca_file",
            ),
        ] {
            let (found, message) = refused(&format!("[store]\n{toml}\n"));
            assert!(found.starts_with(key), "{toml}: {found}: {message}");
        }
        let waiting =
            target("[store]\nurl = \"redis://c\"\nredis.wait_replicas = 1\nredis.wait_timeout = \"250ms\"\n");
        assert_eq!(waiting.wait_replicas, 1);
        assert_eq!(waiting.wait_timeout, Duration::from_millis(250));
    }
}
