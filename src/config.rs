//! Configuration, loaded once at start-up: figment layers defaults < TOML file < `IDEMPROXY_` env < flags
//! into [`RawConfig`], then `validate()` turns it into the typed [`Config`] the proxy runs with. Nothing
//! here is read again after start; the typed config is passed down, never global.
//!
//! Each TOML section lives in its own file under `config/`, with its structs, defaults, checks and tests:
//! `server.rs` (and the listener's TLS files), `upstream.rs` (and the upstream's TLS files), `store.rs` (and the PostgreSQL URL),
//! `idempotency.rs` (and a route's webhook `signature.rs`), `routes.rs`, `sweeper.rs`, `log.rs`,
//! `replay_cache.rs`, `encryption.rs` (and the keys), `traces.rs` (OTLP export); `path.rs` is the normal form of request paths
//! (`server.paths`) that routes are written in;
//! `parse.rs` holds the checks they share (and the "did you mean" of an unknown key), `tls.rs` the PEM
//! files and rustls configs; `service_links.rs` recognises the Kubernetes service-link variables the
//! `IDEMPROXY_` layer leaves out, and `warnings.rs` finds the risky settings `check-config` warns about.
//! A section whose TOML form is already its typed form is one struct; the others have a `Raw…` struct as written and a `…Config` as run. Nothing here imports from
//! the rest of the crate: the store, the proxy and the server read this, never the other way round.

mod encryption;
mod error;
mod grpc;
mod idempotency;
pub mod jwk_set;
mod jwt;
mod key_source;
mod log;
mod mask;
mod parse;
mod path;
mod redis;
mod replay_cache;
mod routes;
mod server;
mod service_links;
pub(crate) mod signature;
mod store;
mod sweeper;
pub mod tls;
mod traces;
mod upstream;
mod warnings;

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use serde::{Deserialize, Serialize};

pub use encryption::{
    CURRENT_FORMAT, EncryptionConfig, EncryptionKey, KEY_LEN, MAX_KEY_ID, RawEncryption, RecordLifetimes,
    is_key_id,
};
pub use error::ConfigError;
pub use grpc::{GrpcOutcome, GrpcOutcomes, code_name as grpc_code_name};
pub use idempotency::{
    ClaimRules, FingerprintBody, KeyRules, OnInFlight, OnUnknownOutcome, Policy, ProblemStatuses,
    REPEATABILITY_CLOCK_SKEW, RawIdempotency, ReleasePolicy, StoreRules, Unscoped,
};
pub use jwt::{JwksSource, JwtRules, RawScopeJwt};
pub use key_source::{KeyPart, KeySource};
pub use log::{LogConfig, LogFormat, Masked, MaskedStderr};
pub use mask::mask_passwords;
pub use path::{Ambiguous, NotNormal, PathMode, PathRules, normal};
pub use redis::{RawRedis, RedisTarget};
pub use replay_cache::ReplayCacheConfig;
pub use routes::{DEFAULT_ROUTE, PathMatch, RawRoute, Route, RouteTable};
pub use server::{DEFAULT_PROBLEM_TYPE_BASE, ListenAddr, ListenerTls, RawServer, RawServerTls, ServerConfig};
pub use signature::{
    Algorithm, Encoding, GenericHmac, ProcessSecrets, RawSignature, Scheme, SchemeName, Secret, SecretReader,
    SignatureConfig,
};
pub use store::{DEFAULT_STORE_URL, OnStoreError, RawStore, StoreBackend, StoreConfig};
pub use sweeper::SweeperConfig;
pub use traces::{DEFAULT_SERVICE_NAME, HTTP_PROTOBUF, RawTraces, TracesConfig};
pub use upstream::{RawUpstream, RawUpstreamTls, UpstreamAddress, UpstreamConfig, UpstreamProtocol};
pub use warnings::Warning;

/// The configuration as written, before validation. Every key has a default.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    /// Listeners and shutdown.
    pub server: RawServer,
    /// The protected service.
    pub upstream: RawUpstream,
    /// Where claims and stored responses live.
    pub store: RawStore,
    /// Which requests are protected and how.
    pub idempotency: RawIdempotency,
    /// Deleting expired records.
    pub sweeper: SweeperConfig,
    /// Log output.
    pub log: LogConfig,
    /// In-process copies of completed records, for replays without a store round trip.
    pub replay_cache: ReplayCacheConfig,
    /// Encryption at rest of stored responses.
    pub encryption: RawEncryption,
    /// OpenTelemetry traces over OTLP.
    pub traces: RawTraces,
    /// Per-endpoint policies over `[idempotency]`, first match wins.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<RawRoute>,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Listeners and shutdown.
    pub server: ServerConfig,
    /// The protected service.
    pub upstream: UpstreamConfig,
    /// The store.
    pub store: StoreConfig,
    /// The routes, and `[idempotency]` as the default route.
    pub routes: RouteTable,
    /// The expiry sweeper.
    pub sweeper: SweeperConfig,
    /// Logging.
    pub log: LogConfig,
    /// The replay cache.
    pub replay_cache: ReplayCacheConfig,
    /// Encryption at rest; `None` when no keys are configured.
    pub encryption: Option<EncryptionConfig>,
    /// OpenTelemetry traces.
    pub traces: TracesConfig,
    /// The Kubernetes service-link variables (`IDEMPROXY_PORT`, `IDEMPROXY_SERVICE_HOST`, ...) the
    /// environment layer left out, by name; empty unless loaded with [`Config::load`].
    pub service_links: Vec<String>,
    raw: RawConfig,
}

/// Command-line overrides, the top layer.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Overrides {
    /// `--listen`
    pub listen: Option<String>,
    /// `--admin-listen`
    pub admin_listen: Option<String>,
    /// `--upstream`
    pub upstream: Option<String>,
    /// `--store`
    pub store: Option<String>,
    /// `--no-migrate`
    pub no_migrate: bool,
}

impl Config {
    /// Defaults < the given TOML text. No `IDEMPROXY_` environment, no flags: for tests and embedding.
    /// Signature secrets are still read from the files and variables the text names.
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::from_toml_str_with(toml, &ProcessSecrets)
    }

    /// [`Config::from_toml_str`], reading signature secrets through `secrets`.
    pub fn from_toml_str_with(toml: &str, secrets: &dyn SecretReader) -> Result<Config, ConfigError> {
        let figment = Figment::from(Serialized::defaults(RawConfig::default())).merge(Toml::string(toml));
        let raw: RawConfig = figment.extract().map_err(ConfigError::from_figment)?;
        raw.validate_with(secrets)
    }

    /// Defaults < TOML file (if given) < `IDEMPROXY_…` environment < command-line overrides.
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(RawConfig::default()));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::new(
                    "config",
                    format!("cannot read file {}", path.display()),
                ));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        let vars: Vec<(String, String)> = std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .collect();
        let links = service_links::service_links(vars.iter().map(|(n, v)| (n.as_str(), v.as_str())));
        let ignored: Vec<&str> = links
            .iter()
            .map(|name| &name[service_links::PREFIX.len()..])
            .collect();
        let env = Env::prefixed(service_links::PREFIX)
            .ignore(&ignored)
            .split("__")
            .lowercase(true);
        figment = figment.merge(env).merge(overrides.figment());
        let mut config = Self::from_figment(figment)?;
        config.service_links = links;
        Ok(config)
    }

    fn from_figment(figment: Figment) -> Result<Config, ConfigError> {
        let raw: RawConfig = figment.extract().map_err(ConfigError::from_figment)?;
        raw.validate()
    }

    /// The effective configuration as TOML, with secrets masked: every encryption key, and every
    /// password in a URL or a `password=` setting anywhere in the text ([`mask_passwords`]).
    pub fn to_masked_toml(&self) -> String {
        let mut raw = self.raw.clone();
        for secret in raw.encryption.keys.values_mut() {
            *secret = "***".into();
        }
        for secret in raw.traces.headers.values_mut() {
            *secret = "***".into();
        }
        let mut text =
            toml::to_string_pretty(&raw).unwrap_or_else(|e| format!("# cannot render config: {e}\n"));
        text.push_str(&self.routes.describe());
        mask_passwords(&text)
    }
}

impl Overrides {
    fn figment(&self) -> Figment {
        let mut figment = Figment::new();
        let mut set = |key: &str, value: &Option<String>| {
            if let Some(value) = value {
                figment = std::mem::take(&mut figment).merge(Serialized::default(key, value));
            }
        };
        set("server.listen", &self.listen);
        set("server.admin_listen", &self.admin_listen);
        set("upstream.url", &self.upstream);
        set("store.url", &self.store);
        if self.no_migrate {
            figment = figment.merge(Serialized::default("store.migrate", false));
        }
        figment
    }
}

impl RawConfig {
    /// Checks every value and converts it to its typed form; the first problem found is returned.
    /// Signature secrets are read from the process's environment and files.
    pub fn validate(self) -> Result<Config, ConfigError> {
        self.validate_with(&ProcessSecrets)
    }

    /// [`RawConfig::validate`], reading signature secrets through `secrets`.
    pub fn validate_with(self, secrets: &dyn SecretReader) -> Result<Config, ConfigError> {
        let mut server = self.server.validate()?;
        let upstream = self.upstream.validate(&server)?;
        let store = self.store.validate()?;
        let idempotency = self.idempotency.validate_section(secrets)?;
        let routes = RouteTable::new(
            &self.idempotency,
            idempotency,
            &self.routes,
            &server.paths,
            secrets,
        )?;
        self.check_buffers(&routes, &mut server)?;
        check_client_certs(&routes, &server)?;
        self.sweeper.validate()?;
        let encryption = self.encryption.validate()?;
        let encryption = encryption.map(|e| e.with_lifetimes(record_lifetimes(&routes, &store)));
        let traces = self.traces.validate()?;
        Ok(Config {
            server,
            upstream,
            store,
            routes,
            sweeper: self.sweeper.clone(),
            log: self.log.clone(),
            replay_cache: self.replay_cache.clone(),
            encryption,
            traces,
            service_links: Vec::new(),
            raw: self,
        })
    }
}

/// A route that scopes by client certificate needs a listener that takes them (`server.tls.client_ca`).
fn check_client_certs(routes: &RouteTable, server: &ServerConfig) -> Result<(), ConfigError> {
    let takes_certs = server.tls.as_ref().is_some_and(|tls| tls.client_certs);
    let all = routes
        .routes
        .iter()
        .enumerate()
        .map(|(i, route)| (Some(i), route));
    for (index, route) in all.chain(std::iter::once((None, &routes.default))) {
        if route.policy.key.scope_client_cert && !takes_certs {
            let key = match index {
                Some(i) => format!("routes[{i}].scope_client_cert"),
                None => "idempotency.scope_client_cert".to_owned(),
            };
            return Err(ConfigError::new(
                &key,
                "needs [server.tls] with client_ca: without it no client presents a certificate",
            ));
        }
    }
    Ok(())
}

/// How long a record of each route's scope can live after its completion is sealed.
fn record_lifetimes(routes: &RouteTable, store: &StoreConfig) -> RecordLifetimes {
    let all = routes.routes.iter().chain(std::iter::once(&routes.default));
    RecordLifetimes::new(all.filter(|route| !route.passthrough).map(|route| {
        let policy = &route.policy;
        let life = policy.claim.ttl.saturating_add(policy.claim.lock_timeout);
        (route.scope.as_str(), life.saturating_add(store.timeout))
    }))
}

impl RawConfig {
    /// The buffers every request shares must hold the largest body and response of any one route, and so
    /// must one scope's share of the responses' buffer: a written share that cannot is refused, the
    /// default share is raised to it.
    fn check_buffers(&self, routes: &RouteTable, server: &mut ServerConfig) -> Result<(), ConfigError> {
        let named = |route: &Route, field: &str| match route.name.as_str() {
            DEFAULT_ROUTE => format!("idempotency.{field}"),
            name => format!("the {field} of route {name:?}"),
        };
        let all = routes.routes.iter().chain(std::iter::once(&routes.default));
        for route in all {
            if self.server.max_buffered_bodies.as_u64() < route.policy.key.max_request_body {
                let msg = format!("must be at least {}", named(route, "max_request_body"));
                return Err(ConfigError::new("server.max_buffered_bodies", msg));
            }
            if self.server.max_buffered_responses.as_u64() < route.policy.store.max_stored_response {
                let msg = format!("must be at least {}", named(route, "max_stored_response"));
                return Err(ConfigError::new("server.max_buffered_responses", msg));
            }
            let largest = usize::try_from(route.policy.store.max_stored_response).unwrap_or(usize::MAX);
            if server.max_buffered_responses_per_scope < largest {
                if self.server.max_buffered_responses_per_scope.is_some() {
                    let msg = format!("must be at least {}", named(route, "max_stored_response"));
                    return Err(ConfigError::new("server.max_buffered_responses_per_scope", msg));
                }
                server.max_buffered_responses_per_scope = largest;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Method;

    use super::*;

    #[test]
    fn defaults_validate() {
        let config = Config::from_toml_str("").expect("defaults are valid");
        assert_eq!(
            config.routes.default.policy.claim.lock_timeout,
            Duration::from_secs(30)
        );
        assert_eq!(
            config.routes.default.policy.key.max_request_body,
            10 * 1024 * 1024
        );
        assert_eq!(
            config.routes.default.policy.key.methods,
            vec![Method::POST, Method::PATCH]
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml_str("[store]\npool = 3\n").unwrap_err();
        assert!(err.to_string().contains("pool"), "{err}");
    }

    #[test]
    fn buffers_shared_by_all_requests_must_hold_the_largest_one() {
        for (text, key) in [
            (
                "[idempotency]\nmax_request_body = \"300MiB\"",
                "server.max_buffered_bodies",
            ),
            (
                "[idempotency]\nmax_stored_response = \"300MiB\"",
                "server.max_buffered_responses",
            ),
        ] {
            let err = Config::from_toml_str(text).unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(err.message.contains("idempotency.max_"), "{err}");
        }
    }

    #[test]
    fn sections_are_checked_in_file_order_and_the_first_problem_is_named() {
        let err = Config::from_toml_str(
            "[upstream]\nurl = \"bad\"\n[store]\nurl = \"bad\"\n[sweeper]\nbatch_size = 0\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "upstream.url");
        let err = Config::from_toml_str("[sweeper]\nbatch_size = 0\n[encryption]\nactive_key = \"k\"\n")
            .unwrap_err();
        assert_eq!(err.key, "sweeper.batch_size");
    }
}
