//! `[store]`: which database holds the key table and how it is reached. Validated once at load into
//! [`StoreConfig`], which `store.rs` opens; reads the PostgreSQL URL here (its `sslmode` included) and
//! checks that the CA file exists, so a bad URL stops the start with a line naming the key. Two forms,
//! because the URL decides the backend, TLS and, for SQLite, the file and pool size.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::positive;
use super::redis::{RawRedis, RedisTarget, is_redis_url};

/// The embedded store in the working directory: zero setup for a single instance.
pub const DEFAULT_STORE_URL: &str = "sqlite://idemproxy.db";

/// The largest `store.max_batch`: past a few hundred, a batch only adds latency.
const MAX_BATCH_LIMIT: usize = 1000;

/// `[store]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStore {
    /// `sqlite://path/to/file.db` (embedded, single instance),
    /// `postgres://user:password@host:port/database`, `redis://host:port` (or `rediss://`) or
    /// `redis+cluster://host1:port,host2:port`.
    pub url: String,
    /// Maximum connections in the pool.
    pub pool_size: usize,
    /// Most claims and completions sent together (to PostgreSQL in one statement, to SQLite in one
    /// transaction) when they arrive together; 1 sends each on its own.
    pub max_batch: usize,
    /// Bound on any one store operation, including waiting for a pooled connection.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// What keyed requests get while the store is unreachable.
    pub on_error: OnStoreError,
    /// Apply pending migrations when `serve` starts.
    pub migrate: bool,
    /// PEM file of CA certificates trusted for the store's TLS (with `sslmode=verify-full`, `verify-ca`,
    /// `require`, `prefer` or `allow` in the URL, or a `rediss://` URL), in addition to the system's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<PathBuf>,
    /// `[store.redis]`: only read with a Redis `url`.
    pub redis: RawRedis,
}

impl Default for RawStore {
    fn default() -> Self {
        RawStore {
            url: DEFAULT_STORE_URL.into(),
            pool_size: 16,
            max_batch: 64,
            timeout: Duration::from_secs(5),
            on_error: OnStoreError::FailClosed,
            migrate: true,
            tls_ca_file: None,
            redis: RawRedis::default(),
        }
    }
}

/// Behaviour of keyed requests while the store is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreError {
    /// Answer 503 and never forward.
    FailClosed,
    /// Forward without protection, and count it.
    FailOpen,
}

/// Which database backs the key table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// A PostgreSQL server (`url`), shared by any number of replicas.
    Postgres,
    /// An embedded SQLite file, for a single instance.
    Sqlite {
        /// The database file.
        path: PathBuf,
    },
    /// A Redis server or Redis Cluster, shared by any number of replicas.
    Redis(RedisTarget),
}

impl StoreBackend {
    /// Its name in the start-up log line: the kind of store, never its URL.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreBackend::Postgres => "postgres",
            StoreBackend::Sqlite { .. } => "sqlite",
            StoreBackend::Redis(_) => "redis",
        }
    }
}

/// The `sslmode` of a PostgreSQL `store.url`: libpq's six values, as idemproxy can honour them with
/// tokio-postgres and rustls (docs/stores.md has the table). Wherever TLS is used the server's
/// certificate chain is verified against the system's CA certificates and `store.tls_ca_file`, and its
/// host name too except under `verify-ca`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SslMode {
    /// `disable`, or no `sslmode` (libpq's default is `prefer`; idemproxy's stays clear text, as before):
    /// clear text.
    #[default]
    Disable,
    /// `allow`: TLS when the server offers it, else clear text (tokio-postgres cannot start in clear
    /// text and switch, so TLS is asked for first, as under `prefer`).
    Allow,
    /// `prefer`: TLS when the server offers it, else clear text.
    Prefer,
    /// `require`: TLS always; chain and host name verified (stricter than libpq, which verifies nothing
    /// under `require` without a root certificate file).
    Require,
    /// `verify-ca`: TLS always; the chain is verified, the host name is not.
    VerifyCa,
    /// `verify-full`: TLS always; chain and host name verified.
    VerifyFull,
}

impl SslMode {
    /// The mode libpq spells `text`, if it is one.
    fn parse(text: &str) -> Option<SslMode> {
        Some(match text {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// Whether a connection may be made in clear text: yes under `disable`, and under `allow` and
    /// `prefer` whenever the server does not offer TLS (which an attacker on the path can arrange).
    pub fn may_be_clear(self) -> bool {
        matches!(self, SslMode::Disable | SslMode::Allow | SslMode::Prefer)
    }

    /// Whether the connection may use TLS, so needs a TLS connector.
    pub fn may_use_tls(self) -> bool {
        self != SslMode::Disable
    }

    /// Whether the server's certificate must carry the host name connected to.
    pub fn verifies_host_name(self) -> bool {
        self != SslMode::VerifyCa
    }

    /// The `sslmode` tokio-postgres is given, which knows only `disable`, `prefer` and `require`: what
    /// it cannot tell apart is told apart by the TLS connector.
    fn driver_value(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow | SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

/// `url` as tokio-postgres reads it: each libpq `sslmode` replaced by the one the driver knows
/// ([`SslMode`]); everything else as written.
pub fn driver_url(url: &str) -> String {
    let Ok(mut parsed) = url::Url::parse(url) else {
        return url.to_owned();
    };
    if !parsed.query_pairs().any(|(name, _)| name == "sslmode") {
        return url.to_owned();
    }
    let pairs: Vec<(String, String)> = parsed
        .query_pairs()
        .map(|(name, value)| {
            let value = match SslMode::parse(&value) {
                Some(mode) if name == "sslmode" => mode.driver_value().to_owned(),
                _ => value.into_owned(),
            };
            (name.into_owned(), value)
        })
        .collect();
    parsed.query_pairs_mut().clear().extend_pairs(pairs);
    parsed.into()
}

/// Validated `[store]`.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Which database, from the URL's scheme.
    pub backend: StoreBackend,
    /// Connection settings parsed from the URL.
    pub url: String,
    /// Maximum pooled connections.
    pub pool_size: usize,
    /// Most claims and completions coalesced into one statement (PostgreSQL) or transaction (SQLite, each
    /// kind apart); 1 turns coalescing off.
    pub max_batch: usize,
    /// Bound on one store operation.
    pub timeout: Duration,
    /// Behaviour while the store is down.
    pub on_error: OnStoreError,
    /// Migrate at `serve` start.
    pub migrate: bool,
    /// Whether every connection uses TLS (`sslmode=require`, `verify-ca`, `verify-full`; `rediss://`).
    pub tls: bool,
    /// A PostgreSQL URL's `sslmode` ([`SslMode::Disable`] for the other stores).
    pub ssl_mode: SslMode,
    /// Extra trusted CA certificates for the store's TLS.
    pub tls_ca_file: Option<PathBuf>,
}

impl RawStore {
    /// Checks the section and converts it; the first problem found is returned.
    pub fn validate(&self) -> Result<StoreConfig, ConfigError> {
        if let Some(path) = self.url.strip_prefix("sqlite://") {
            self.redis_unused()?;
            return self.validate_sqlite(path);
        }
        if is_redis_url(&self.url) {
            return self.validate_redis();
        }
        self.redis_unused()?;
        let key = "store.url";
        let url = url::Url::parse(&self.url).map_err(|e| ConfigError::new(key, format!("not a URL: {e}")))?;
        if !matches!(url.scheme(), "postgres" | "postgresql") {
            return Err(ConfigError::new(
                key,
                format!(
                    "unsupported scheme {:?}; use sqlite://path/to/file.db, \
                     postgres://user@host:port/database, redis://host:port or \
                     redis+cluster://host1:port,host2:port",
                    url.scheme()
                ),
            ));
        }
        // tokio-postgres reads a URL without sslmode as `prefer`, so what the URL wrote is read here.
        let mode = ssl_mode(&url)?;
        if mode == SslMode::VerifyCa && self.tls_ca_file.is_none() {
            return Err(ConfigError::new(
                key,
                "sslmode=verify-ca checks no host name, so it trusts only the CAs of store.tls_ca_file, \
                 never the system's (a public CA signs certificates for anyone's names): set \
                 store.tls_ca_file to your database's CA, or write sslmode=verify-full",
            ));
        }
        driver_url(&self.url)
            .parse::<tokio_postgres::Config>()
            .map_err(|e| ConfigError::new(key, format!("invalid PostgreSQL URL: {e}")))?;
        self.check_ca_file(mode.may_use_tls(), "add sslmode=verify-full to store.url")?;
        if self.pool_size == 0 {
            return Err(ConfigError::new("store.pool_size", "must be at least 1"));
        }
        positive("store.timeout", self.timeout)?;
        let mut config = self.config(StoreBackend::Postgres, self.pool_size, !mode.may_be_clear())?;
        config.ssl_mode = mode;
        Ok(config)
    }

    /// The validated section for `backend`, whose URL (and TLS) has been checked.
    fn config(&self, backend: StoreBackend, pool_size: usize, tls: bool) -> Result<StoreConfig, ConfigError> {
        Ok(StoreConfig {
            ssl_mode: SslMode::Disable,
            backend,
            url: self.url.clone(),
            pool_size,
            max_batch: self.max_batch()?,
            timeout: self.timeout,
            on_error: self.on_error,
            migrate: self.migrate,
            tls,
            tls_ca_file: self.tls_ca_file.clone(),
        })
    }

    fn max_batch(&self) -> Result<usize, ConfigError> {
        if !(1..=MAX_BATCH_LIMIT).contains(&self.max_batch) {
            return Err(ConfigError::new(
                "store.max_batch",
                format!("must be from 1 (no coalescing) to {MAX_BATCH_LIMIT}"),
            ));
        }
        Ok(self.max_batch)
    }

    /// A Redis server or cluster; `pool_size` does not apply (one multiplexed connection per node).
    fn validate_redis(&self) -> Result<StoreConfig, ConfigError> {
        positive("store.timeout", self.timeout)?;
        let target = self.redis.validate(&self.url, self.timeout)?;
        self.check_ca_file(target.tls, "write rediss:// (or rediss+cluster://) in store.url")?;
        let tls = target.tls;
        self.config(StoreBackend::Redis(target), 1, tls)
    }

    /// `store.tls_ca_file`, when set, needs TLS (`how_to_tls` says how to ask for it) and a readable file.
    fn check_ca_file(&self, tls: bool, how_to_tls: &str) -> Result<(), ConfigError> {
        let Some(path) = &self.tls_ca_file else {
            return Ok(());
        };
        if !tls {
            return Err(ConfigError::new(
                "store.tls_ca_file",
                format!("only used with TLS: {how_to_tls}"),
            ));
        }
        if !path.is_file() {
            return Err(ConfigError::new(
                "store.tls_ca_file",
                format!("cannot read file {}", path.display()),
            ));
        }
        Ok(())
    }

    /// `[store.redis]` set for a store that is not Redis is a mistake worth a line, not silence.
    fn redis_unused(&self) -> Result<(), ConfigError> {
        if self.redis != RawRedis::default() {
            return Err(ConfigError::new(
                "store.redis",
                "only used with a Redis store (store.url = \"redis://...\" or \"redis+cluster://...\")",
            ));
        }
        Ok(())
    }

    /// `sqlite://idemproxy.db` is relative to the working directory, `sqlite:///var/lib/x.db` absolute.
    fn validate_sqlite(&self, path: &str) -> Result<StoreConfig, ConfigError> {
        let key = "store.url";
        if path.is_empty() || path.ends_with('/') {
            return Err(ConfigError::new(
                key,
                "sqlite:// needs a file path, e.g. sqlite://idemproxy.db or sqlite:///var/lib/idemproxy/keys.db",
            ));
        }
        if path.contains('?') || path.contains('#') {
            return Err(ConfigError::new(
                key,
                "sqlite:// takes a plain file path, without query or fragment",
            ));
        }
        if self.tls_ca_file.is_some() {
            return Err(ConfigError::new(
                "store.tls_ca_file",
                "only used with a PostgreSQL store over TLS",
            ));
        }
        positive("store.timeout", self.timeout)?;
        // tls_ca_file was refused above, so the config carries none.
        self.config(
            StoreBackend::Sqlite {
                path: PathBuf::from(path),
            },
            1,
            false,
        )
    }
}

/// The `sslmode` a PostgreSQL `store.url` writes (the last one, as the driver reads it); none is
/// [`SslMode::Disable`]. A value libpq does not know is refused, naming the six it does.
fn ssl_mode(url: &url::Url) -> Result<SslMode, ConfigError> {
    let mut mode = SslMode::Disable;
    for (_, text) in url.query_pairs().filter(|(name, _)| name == "sslmode") {
        mode = SslMode::parse(&text).ok_or_else(|| {
            ConfigError::new(
                "store.url",
                format!(
                    "sslmode={text} is not one of libpq's: write verify-full (TLS, certificate and host \
                     name verified), verify-ca (certificate only), require, prefer, allow or disable"
                ),
            )
        })?;
    }
    Ok(mode)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::{SslMode, StoreBackend, driver_url};
    use crate::config::{Config, ConfigError};

    #[test]
    fn the_embedded_store_is_the_default_and_its_url_is_a_file_path() {
        let default = Config::from_toml_str("").unwrap();
        assert_eq!(
            default.store.backend,
            StoreBackend::Sqlite {
                path: PathBuf::from("idemproxy.db")
            }
        );
        let absolute = Config::from_toml_str("[store]\nurl = \"sqlite:///var/lib/k.db\"\n").unwrap();
        assert_eq!(
            absolute.store.backend,
            StoreBackend::Sqlite {
                path: PathBuf::from("/var/lib/k.db")
            }
        );
        for bad in ["sqlite://", "sqlite://dir/", "sqlite://k.db?mode=ro"] {
            let err = Config::from_toml_str(&format!("[store]\nurl = \"{bad}\"\n")).unwrap_err();
            assert_eq!(err.key, "store.url", "{bad}");
        }
        let err = Config::from_toml_str("[store]\ntls_ca_file = \"/etc/hostname\"\n").unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
    }

    #[test]
    fn store_ca_file_needs_tls_and_a_readable_file() {
        let err = Config::from_toml_str("[store]\ntls_ca_file = \"/etc/hostname\"\n").unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
        let err = Config::from_toml_str(
            "[store]\nurl = \"postgres://db/idem?sslmode=require\"\ntls_ca_file = \"/nonexistent.pem\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "store.tls_ca_file");
        let config =
            Config::from_toml_str("[store]\nurl = \"postgres://db/idem?sslmode=require\"\n").unwrap();
        assert!(config.store.tls);
        assert!(!Config::from_toml_str("").unwrap().store.tls);
    }

    fn store_url(url: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!("[store]\nurl = \"{url}\"\n"))
    }

    #[test]
    fn sslmode_require_is_tls_and_disable_or_none_is_clear_text() {
        assert!(store_url("postgres://db/idem?sslmode=require").unwrap().store.tls);
        assert!(!store_url("postgres://db/idem?sslmode=disable").unwrap().store.tls);
        assert!(!store_url("postgres://db/idem").unwrap().store.tls);
        assert!(
            !store_url("postgres://db/idem?application_name=x")
                .unwrap()
                .store
                .tls
        );
        // The driver reads the last one; so does the check.
        assert!(
            store_url("postgres://db/idem?sslmode=disable&sslmode=require")
                .unwrap()
                .store
                .tls
        );
    }

    #[test]
    fn every_libpq_sslmode_is_read_with_its_meaning_and_others_are_refused() {
        for (mode, want, tls) in [
            ("disable", SslMode::Disable, false),
            ("allow", SslMode::Allow, false),
            ("prefer", SslMode::Prefer, false),
            ("require", SslMode::Require, true),
            ("verify-ca", SslMode::VerifyCa, true),
            ("verify-full", SslMode::VerifyFull, true),
        ] {
            // verify-ca trusts only store.tls_ca_file, which needs a mode that may use TLS.
            let ca = if mode == "disable" {
                ""
            } else {
                "tls_ca_file = \"/etc/hostname\"\n"
            };
            let store = Config::from_toml_str(&format!(
                "[store]\nurl = \"postgres://db/idem?sslmode={mode}\"\n{ca}"
            ))
            .unwrap()
            .store;
            assert_eq!(store.ssl_mode, want, "{mode}");
            assert_eq!(store.tls, tls, "{mode}: TLS on every connection");
            assert_eq!(want.may_use_tls(), mode != "disable", "{mode}");
            assert_eq!(want.verifies_host_name(), mode != "verify-ca", "{mode}");
        }
        let err = store_url("postgres://db/idem?sslmode=verify-ca").unwrap_err();
        assert_eq!(err.key, "store.url");
        assert!(err.message.contains("store.tls_ca_file"), "{err}");
        for mode in ["Require", "bogus", "verify_full"] {
            let err = store_url(&format!("postgres://db/idem?sslmode={mode}")).unwrap_err();
            assert_eq!(err.key, "store.url", "{mode}");
            assert!(err.message.contains("verify-full"), "{mode}: {err}");
        }
    }

    #[test]
    fn the_driver_is_given_the_sslmode_it_knows_and_the_rest_of_the_url_as_written() {
        for (mode, driver) in [
            ("verify-full", "require"),
            ("verify-ca", "require"),
            ("require", "require"),
            ("prefer", "prefer"),
            ("allow", "prefer"),
            ("disable", "disable"),
        ] {
            let url = format!("postgres://u:p@db:5433/idem?application_name=a&sslmode={mode}");
            assert_eq!(
                driver_url(&url),
                format!("postgres://u:p@db:5433/idem?application_name=a&sslmode={driver}")
            );
        }
        assert_eq!(driver_url("postgres://db/idem"), "postgres://db/idem");
    }

    #[test]
    fn pool_batch_and_timeout_bounds_name_the_key_and_sqlite_keeps_one_connection() {
        for (text, key) in [
            ("url = \"postgres://db/idem\"\npool_size = 0", "store.pool_size"),
            ("max_batch = 0", "store.max_batch"),
            ("max_batch = 1001", "store.max_batch"),
            ("timeout = \"0s\"", "store.timeout"),
            ("url = \"mysql://db/idem\"", "store.url"),
        ] {
            let err = Config::from_toml_str(&format!("[store]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
        let sqlite = Config::from_toml_str("[store]\npool_size = 8\n").unwrap();
        assert_eq!(sqlite.store.pool_size, 1);
    }

    #[test]
    fn every_form_of_store_url_is_printed_without_its_password() {
        for url in [
            "postgres://app:s3cret@db/idem",
            "postgres://app@db/idem?password=s3cret",
            "postgresql://app:s3cret@db/idem?sslmode=disable&password=s3cret",
            "redis://:s3cret@cache:6379",
            "rediss://app:s3cret@cache",
            "redis+cluster://app:s3cret@a:7000,b:7001",
        ] {
            let config = Config::from_toml_str(&format!("[store]\nurl = \"{url}\"\n")).unwrap();
            let printed = config.to_masked_toml();
            assert!(!printed.contains("s3cret"), "{printed}");
            assert!(printed.contains("***"), "{printed}");
        }
    }
}
