//! Configuration, loaded once at start-up: figment layers defaults < TOML file < `IDEMPROXY_` env < flags
//! into [`RawConfig`], then `validate()` turns it into the typed [`Config`] the proxy runs with; `load.rs`
//! keeps going past each mistake so that one run reports them all. Nothing here is read again after
//! start; the typed config is passed down, never global.
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
mod load;
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

use figment::Figment;
use figment::providers::Serialized;
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
pub use store::{DEFAULT_STORE_URL, OnStoreError, RawStore, SslMode, StoreBackend, StoreConfig, driver_url};
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
    /// Whether any layer (the file, a variable, `--upstream`) named the upstream; without one the
    /// proxy forwards to the default `http://127.0.0.1:3000`, and [`Config::warnings`] says so.
    pub upstream_named: bool,
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
    /// The flag that set `key` (`server.listen` by `--listen`), when it was given.
    fn flag_for(&self, key: &str) -> Option<&'static str> {
        let (flag, set) = match key {
            "server.listen" => ("--listen", self.listen.is_some()),
            "server.admin_listen" => ("--admin-listen", self.admin_listen.is_some()),
            "upstream.url" => ("--upstream", self.upstream.is_some()),
            "store.url" => ("--store", self.store.is_some()),
            "store.migrate" => ("--no-migrate", self.no_migrate),
            _ => return None,
        };
        set.then_some(flag)
    }

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
    /// Checks every value and converts it to its typed form; every problem found is returned, each
    /// section checked whatever another's problems. Signature secrets are read from the process's
    /// environment and files.
    pub fn validate(self) -> Result<Config, ConfigError> {
        self.validate_with(&ProcessSecrets)
    }

    /// [`RawConfig::validate`], reading signature secrets through `secrets`.
    pub fn validate_with(self, secrets: &dyn SecretReader) -> Result<Config, ConfigError> {
        let mut found = Vec::new();
        let server = keep(&mut found, self.server.validate());
        // The sections that read `[server]` are still checked when it has a problem, under its path
        // settings and defaults for the rest, so one mistake there does not hide theirs.
        let fallback = || self.server.paths_only().validate().ok();
        let read = server.clone().or_else(fallback);
        let upstream = match &read {
            Some(s) => keep(&mut found, self.upstream.validate(s)),
            None => None,
        };
        let store = keep(&mut found, self.store.validate());
        let idempotency = keep(&mut found, self.idempotency.validate_section(secrets));
        let routes = match (&read, idempotency) {
            (Some(read), Some(idempotency)) => keep(
                &mut found,
                RouteTable::new(&self.idempotency, idempotency, &self.routes, &read.paths, secrets),
            ),
            _ => None,
        };
        keep(&mut found, self.sweeper.validate());
        let encryption = keep(&mut found, self.encryption.validate());
        let traces = keep(&mut found, self.traces.validate());
        // A section without its value has left its problem in `found`.
        let (Some(mut server), Some(routes)) = (server, routes) else {
            return Err(ConfigError::all(found).unwrap_or_else(unchecked));
        };
        found.extend(self.check_buffers(&routes, &mut server));
        found.extend(check_client_certs(&routes, &server));
        if let Some(error) = ConfigError::all(found) {
            return Err(error);
        }
        let (Some(upstream), Some(store), Some(encryption), Some(traces)) =
            (upstream, store, encryption, traces)
        else {
            return Err(unchecked());
        };
        let encryption = encryption.map(|e| e.with_lifetimes(record_lifetimes(&routes, &store)));
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
            upstream_named: true,
            raw: self,
        })
    }
}

/// What a load that found no problem but lacks a section's value says; never expected, since a section
/// without its value has its problem in the list.
fn unchecked() -> ConfigError {
    ConfigError::new("config", "a section could not be checked")
}

/// The value of a section's check, its problem kept in `found`.
fn keep<T>(found: &mut Vec<ConfigError>, result: Result<T, ConfigError>) -> Option<T> {
    result.map_err(|e| found.push(e)).ok()
}

/// A route that scopes by client certificate needs a listener that takes them (`server.tls.client_ca`).
fn check_client_certs(routes: &RouteTable, server: &ServerConfig) -> Vec<ConfigError> {
    let takes_certs = server.tls.as_ref().is_some_and(|tls| tls.client_certs);
    let all = routes
        .routes
        .iter()
        .enumerate()
        .map(|(i, route)| (Some(i), route));
    let mut found = Vec::new();
    for (index, route) in all.chain(std::iter::once((None, &routes.default))) {
        if route.policy.key.scope_client_cert && !takes_certs {
            let key = match index {
                Some(i) => format!("routes[{i}].scope_client_cert"),
                None => "idempotency.scope_client_cert".to_owned(),
            };
            found.push(ConfigError::new(
                &key,
                "needs [server.tls] with client_ca: without it no client presents a certificate",
            ));
        }
    }
    found
}

/// A reloaded configuration's routes against the server settings the process keeps until a restart
/// (`reload.rs`): each route's bodies and responses must fit the buffers the process has, and a route
/// may scope by client certificate only if the running listener takes them. What a start checks on the
/// file's own server settings, checked here on the running ones, so a reload never applies routes
/// with settings a start would refuse (a response kept by the route's rules but not by the budget
/// would be replayed as 410; a route needing certificates would refuse every keyed request).
pub(crate) fn check_routes_against(routes: &RouteTable, server: &ServerConfig) -> Vec<ConfigError> {
    let restart = "which waits for a restart: restart the proxy to apply both";
    let mut found = Vec::new();
    for route in routes.routes.iter().chain(std::iter::once(&routes.default)) {
        let field = |name: &str| match route.name.as_str() {
            DEFAULT_ROUTE => format!("idempotency.{name}"),
            route => format!("the {name} of route {route:?}"),
        };
        let body = usize::try_from(route.policy.key.max_request_body).unwrap_or(usize::MAX);
        if body > server.max_buffered_bodies {
            let msg = format!(
                "is above the running server.max_buffered_bodies ({} bytes), {restart}",
                server.max_buffered_bodies
            );
            found.push(ConfigError::new(&field("max_request_body"), msg));
        }
        let response = usize::try_from(route.policy.store.max_stored_response).unwrap_or(usize::MAX);
        let buffers = server
            .max_buffered_responses
            .min(server.max_buffered_responses_per_scope);
        if response > buffers {
            let msg = format!(
                "is above the running server.max_buffered_responses (or its per-scope share, {buffers} \
                 bytes), {restart}"
            );
            found.push(ConfigError::new(&field("max_stored_response"), msg));
        }
    }
    for mut error in check_client_certs(routes, server) {
        error.message = format!(
            "needs the running listener to take client certificates (server.tls with client_ca), {restart}"
        );
        found.push(error);
    }
    found
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
    fn check_buffers(&self, routes: &RouteTable, server: &mut ServerConfig) -> Vec<ConfigError> {
        let named = |route: &Route, field: &str| match route.name.as_str() {
            DEFAULT_ROUTE => format!("idempotency.{field}"),
            name => format!("the {field} of route {name:?}"),
        };
        let mut found = Vec::new();
        let all = routes.routes.iter().chain(std::iter::once(&routes.default));
        for route in all {
            if self.server.max_buffered_bodies.as_u64() < route.policy.key.max_request_body {
                let msg = format!("must be at least {}", named(route, "max_request_body"));
                found.push(ConfigError::new("server.max_buffered_bodies", msg));
            }
            if self.server.max_buffered_responses.as_u64() < route.policy.store.max_stored_response {
                let msg = format!("must be at least {}", named(route, "max_stored_response"));
                found.push(ConfigError::new("server.max_buffered_responses", msg));
            }
            let largest = usize::try_from(route.policy.store.max_stored_response).unwrap_or(usize::MAX);
            if server.max_buffered_responses_per_scope < largest {
                if self.server.max_buffered_responses_per_scope.is_some() {
                    let msg = format!("must be at least {}", named(route, "max_stored_response"));
                    found.push(ConfigError::new("server.max_buffered_responses_per_scope", msg));
                } else {
                    server.max_buffered_responses_per_scope = largest;
                }
            }
        }
        found
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
    fn every_section_is_checked_and_every_problem_named_in_section_order() {
        let err = Config::from_toml_str(
            "[upstream]\nurl = \"bad\"\n[store]\nurl = \"bad\"\n[sweeper]\nbatch_size = 0\n",
        )
        .unwrap_err();
        let keys: Vec<&str> = err.problems().map(|(key, _)| key).collect();
        assert_eq!(keys, ["upstream.url", "store.url", "sweeper.batch_size"]);
        assert_eq!(err.to_string().lines().count(), 3, "one line each: {err}");
    }

    #[test]
    fn wrong_types_and_unknown_keys_do_not_hide_each_other_or_a_bad_value() {
        let err = Config::from_toml_str(
            "[server]\nlisen = 1\nlistn = 2\nmax_headers = \"many\"\n\
             [store]\npool_size = -1\n[sweeper]\nbatch_size = 0\n[[routes]]\nname = \"a\"\npath = \"/a\"\nttl = 5\n",
        )
        .unwrap_err();
        let keys: Vec<&str> = err.problems().map(|(key, _)| key).collect();
        for key in [
            "server.lisen",
            "server.listn",
            "server.max_headers",
            "store.pool_size",
            "sweeper.batch_size",
            "routes[0].ttl",
        ] {
            assert!(keys.contains(&key), "{key} in {keys:?}");
        }
        assert!(!err.to_string().contains("usize"), "{err}");
    }

    #[test]
    fn a_bad_server_section_does_not_hide_a_bad_route() {
        let err = Config::from_toml_str(
            "[server]\nlisten = \"nowhere\"\n[[routes]]\nname = \"a\"\npath = \"/a\"\nmatch_methods = [\"B@D\"]\n",
        )
        .unwrap_err();
        let keys: Vec<&str> = err.problems().map(|(key, _)| key).collect();
        assert_eq!(keys.len(), 2, "{err}");
        assert_eq!(keys[0], "server.listen");
        assert!(keys[1].starts_with("routes[0]"), "{err}");
    }
}
