//! Reloading the configuration without a restart, at each SIGHUP and each `POST /-/reload` on the admin
//! listener (which `idemproxy reload` sends). Runs beside `serve` for as long as it does, started by
//! `lib.rs` when `main.rs` hands it a [`Reload`]; one reload at a time. Each reads the configuration
//! again from where it came (the file, the `IDEMPROXY_` environment, the flags) and validates all of it:
//!
//! - a configuration that does not load, or whose routes do not fit the settings that keep their running
//!   values (`config::check_routes_against`: the buffers, the listener's client certificates), is refused
//!   whole: one error naming the file and the key, the running configuration kept,
//!   `idemproxy_config_last_reload_successful` 0;
//! - otherwise a new generation of the request path is built from it over the same grounds (store,
//!   budgets, permits, replay cache, attachments: `proxy.rs`'s `Grounds`) and every worker is given it at
//!   once (`server/generations.rs`): requests that arrive from then on run under the new routes,
//!   policies, signature secrets, key sets and upstream settings; a request in flight finishes under the
//!   generation it started with. Files the configuration names (signature secrets, JWKS files, the
//!   upstream's TLS files) are read again, so a rotated secret takes effect;
//! - `log.filter` takes effect at once (unless `RUST_LOG` overrides it);
//! - the settings in [`APPLIED`] take effect; every other changed setting (listeners, the store, worker
//!   threads, the process-wide budgets, `log.format`, traces, ...) is named: it takes effect at the next
//!   restart, and until then the running value stays in force ([`keep_running`]). Settings are compared
//!   as `check-config` prints them, with secrets masked;
//! - the listener certificate files are read again by `server/cert_reload.rs`, which hears the same
//!   SIGHUP, and is told of a reload asked on the admin listener.
//!
//! Never stops the process. Touches the configuration sources, the log filter, the workers' request
//! paths, the key sets and the reload metrics.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::admin::{ReloadAsk, Reloaded};
use crate::config::{Config, ConfigError, Overrides, check_routes_against, mask_passwords};
use crate::jwks::KeySets;
use crate::logging::{self, FilterHandle};
use crate::metrics::Metrics;
use crate::proxy::Grounds;
use crate::server::Generations;
use crate::shutdown::Hangups;

/// The settings a reload applies to new requests: a dotted key, or a section every key under which is
/// applied. Every other setting keeps its running value until a restart ([`keep_running`] says why
/// for each).
pub const APPLIED: [&str; 10] = [
    "routes",
    "idempotency",
    "upstream",
    "log.filter",
    "log.access",
    "server.paths",
    "server.body_read_timeout",
    "server.max_keyed_per_connection",
    "server.trusted_proxies",
    "store.on_error",
];

/// Where the configuration came from, to read it again, and the running log filter.
pub struct Reload {
    /// `--config`, if given.
    pub file: Option<PathBuf>,
    /// The command line's overrides.
    pub overrides: Overrides,
    /// The running log filter.
    pub filter: FilterHandle,
}

/// What a reload replaces or builds on: the running request path and what it was built from.
pub(crate) struct Running {
    /// The configuration in force: the last one loaded, with the settings that need a restart kept as
    /// they started.
    pub(crate) config: Config,
    /// What every generation is built over.
    pub(crate) grounds: Grounds,
    /// Each worker's request path.
    pub(crate) generations: Arc<Generations>,
    /// The key sets the running generation verifies tokens with; `/readyz` reads the same.
    pub(crate) key_sets: Arc<ArcSwap<KeySets>>,
    /// Has the listener's certificate files read again (`server/cert_reload.rs`, which hears SIGHUP
    /// itself).
    pub(crate) certificates: Arc<tokio::sync::Notify>,
    pub(crate) metrics: Metrics,
}

/// The settings as loaded at start and at the last reload, as `check-config` prints them.
struct Seen {
    started: toml::Table,
    last: toml::Table,
}

impl Reload {
    /// Reloads at each SIGHUP `hangups` hears and at each ask on `asks`, one at a time, until `stop`,
    /// on a task of its own.
    pub(crate) fn spawn(
        self,
        (mut hangups, mut asks): (Hangups, mpsc::Receiver<ReloadAsk>),
        mut running: Running,
        stop: CancellationToken,
    ) {
        let settings = settings(&running.config);
        let mut seen = Seen {
            started: settings.clone(),
            last: settings,
        };
        tokio::spawn(async move {
            loop {
                let mut answers = tokio::select! {
                    _ = stop.cancelled() => return,
                    () = hangups.next() => Vec::new(),
                    Some(ask) = asks.recv() => vec![ask],
                };
                let why = if answers.is_empty() {
                    "SIGHUP"
                } else {
                    "POST /-/reload"
                };
                if !answers.is_empty() {
                    running.certificates.notify_one();
                }
                // Asked again before this reload reads the configuration: this reload answers them too.
                while let Ok(ask) = asks.try_recv() {
                    answers.push(ask);
                }
                let outcome = self
                    .reload(&mut running, &mut seen, &stop, why)
                    .map_err(|error| mask_passwords(&error.to_string()));
                for answer in answers {
                    let _ = answer.send(outcome.clone());
                }
            }
        });
    }

    /// One reload: counted, logged, and its outcome returned for the admin endpoint.
    fn reload(
        &self,
        running: &mut Running,
        seen: &mut Seen,
        stop: &CancellationToken,
        why: &'static str,
    ) -> Result<Reloaded, ConfigError> {
        let metrics = running.metrics.clone();
        match self.apply(running, seen, stop, why) {
            Ok(reloaded) => {
                metrics.config_reloads.ok.inc();
                metrics.config_last_reload_successful.set(1);
                Ok(reloaded)
            }
            Err(error) => {
                metrics.config_reloads.error.inc();
                metrics.config_last_reload_successful.set(0);
                let file = self.file.as_ref().map(|f| f.display().to_string());
                tracing::error!(
                    file = file.as_deref(),
                    error = %mask_passwords(&error.to_string()),
                    "{why}: configuration not reloaded, it does not load; the running one is kept"
                );
                Err(error)
            }
        }
    }

    /// Reads and validates the configuration, installs a new generation of the request path built from
    /// it, and names what was applied and what needs a restart.
    fn apply(
        &self,
        running: &mut Running,
        seen: &mut Seen,
        stop: &CancellationToken,
        why: &'static str,
    ) -> Result<Reloaded, ConfigError> {
        let loaded = Config::load(self.file.as_deref(), &self.overrides)?;
        let read = settings(&loaded);
        let mut changed = Vec::new();
        differences("", &seen.last, &read, &mut changed);
        let mut pending = Vec::new();
        differences("", &seen.started, &read, &mut pending);
        let applied: Vec<String> = changed.into_iter().filter(|key| applies(key)).collect();
        let restart: Vec<String> = pending.into_iter().filter(|key| !applies(key)).collect();
        if let Some(error) = ConfigError::all(check_routes_against(&loaded.routes, &running.config.server)) {
            return Err(error);
        }
        if applied.iter().any(|key| key == "log.filter") {
            self.apply_filter(&loaded.log.filter);
        }
        let config = keep_running(&running.config, loaded);
        // A risky setting the reload brings is said as a start says it (`check-config`'s warnings): an
        // upstream no longer named, `fail_open`, a route whose scope is shared.
        for route in rules_changed(&running.config, &config) {
            tracing::warn!(
                route,
                "{why}: how this route reads keys, scopes or fingerprints changed: a retry of a key it \
                 completed before is judged by the new rules, so it may run again (in another scope) or \
                 get 422 (another payload), as after a restart"
            );
        }
        let before = running.config.warnings();
        for warning in config.warnings().into_iter().filter(|w| !before.contains(w)) {
            tracing::warn!(key = %warning.key, "{why}: {}", warning.message);
        }
        let key_sets = running.key_sets.load().again(&config, stop);
        let proxy = running.grounds.proxy(&config, &key_sets);
        running.generations.install(&proxy);
        crate::limits::reassess(&config, &running.metrics);
        running.key_sets.store(key_sets);
        running.config = config;
        seen.last = read;
        if applied.is_empty() {
            tracing::info!(
                "{why}: configuration reloaded; no setting changed (files it names, such as signature \
                 secrets, were read again)"
            );
        } else {
            tracing::info!(
                settings = applied.join(", "),
                "{why}: configuration reloaded; applied to new requests"
            );
        }
        if !restart.is_empty() {
            tracing::warn!(
                settings = restart.join(", "),
                "{why}: these settings differ from the running ones and take effect only after a restart"
            );
        }
        Ok(Reloaded { applied, restart })
    }

    fn apply_filter(&self, filter: &str) {
        if logging::filter_from_environment() {
            tracing::warn!("reload: log.filter changed, but RUST_LOG is set and overrides it");
            return;
        }
        match self.filter.set(filter) {
            Ok(()) => tracing::info!(filter, "reload: log filter changed"),
            Err(error) => tracing::error!(%error, "reload: log filter not changed"),
        }
    }
}

/// Whether a reload applies the setting at `key` (a dotted key, as [`differences`] names it).
fn applies(key: &str) -> bool {
    APPLIED.iter().any(|applied| {
        key == *applied
            || key
                .strip_prefix(applied)
                .is_some_and(|rest| rest.starts_with('.'))
    })
}

/// `loaded`, with every setting a reload does not apply kept as `running` has it, each for its reason:
///
/// - `server`: the listeners are bound, the worker threads started, the connection limits and the
///   listener's TLS set up at start; the process-wide budgets, seats and permits, the attachments'
///   buffer and the problem type base belong to the grounds every generation shares. Only
///   `server.paths`, `server.body_read_timeout`, `server.max_keyed_per_connection` and
///   `server.trusted_proxies` are the request path's own (the last two taken by each new connection).
/// - `store` (but `store.on_error`), `encryption`, `sweeper`: the store is opened once. The lives its
///   seals give records (`ttl` and `lock_timeout`'s) are lengthened to the reloaded routes', never
///   shortened.
/// - `replay_cache`: one cache is shared by every generation.
/// - `traces`: the exporter is set up at start.
/// - `log.format`: the log's output is set up at start (`log.filter` and `log.access` are applied).
fn keep_running(running: &Config, loaded: Config) -> Config {
    let mut config = loaded;
    let mut server = running.server.clone();
    server.paths = config.server.paths;
    server.body_read_timeout = config.server.body_read_timeout;
    server.max_keyed_per_connection = config.server.max_keyed_per_connection;
    server.trusted_proxies = config.server.trusted_proxies.clone();
    config.server = server;
    let on_error = config.store.on_error;
    config.store = running.store.clone();
    config.store.on_error = on_error;
    // The keys wait for a restart, but the lives sealed records are given follow the routes' `ttl`s.
    if let (Some(kept), Some(reloaded)) = (&running.encryption, &config.encryption) {
        kept.lifetimes().extend(reloaded.lifetimes());
    }
    config.encryption = running.encryption.clone();
    config.sweeper = running.sweeper.clone();
    config.replay_cache = running.replay_cache.clone();
    config.traces = running.traces.clone();
    config.log.format = running.log.format;
    config
}

/// The routes, by name, that both configurations have and whose key rules (source, scope, fingerprint)
/// or scope differ: their earlier keys' retries are judged anew.
fn rules_changed<'a>(running: &Config, loaded: &'a Config) -> Vec<&'a str> {
    let rules = |route: &crate::config::Route| (route.scope.clone(), format!("{:?}", route.policy.key));
    let old = &running.routes;
    let before: std::collections::HashMap<&str, (String, String)> = old
        .routes
        .iter()
        .chain(std::iter::once(&old.default))
        .map(|route| (route.name.as_str(), rules(route)))
        .collect();
    let table = &loaded.routes;
    table
        .routes
        .iter()
        .chain(std::iter::once(&table.default))
        .filter(|route| {
            before
                .get(route.name.as_str())
                .is_some_and(|old| *old != rules(route))
        })
        .map(|route| route.name.as_str())
        .collect()
}

/// The settings of `config` as `check-config` prints them (secrets masked), as a table.
fn settings(config: &Config) -> toml::Table {
    toml::from_str(&config.to_masked_toml()).unwrap_or_default()
}

/// Adds to `changed` the dotted key of every setting that differs between `old` and `new`; a table is
/// compared key by key, anything else (an array of routes included) as a whole.
fn differences(prefix: &str, old: &toml::Table, new: &toml::Table, changed: &mut Vec<String>) {
    let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
    for key in keys {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match (old.get(key), new.get(key)) {
            (Some(toml::Value::Table(old)), Some(toml::Value::Table(new))) => {
                differences(&path, old, new, changed)
            }
            (old, new) if old != new => changed.push(path),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(old: &str, new: &str) -> Vec<String> {
        let settings = |text: &str| settings(&Config::from_toml_str(text).unwrap());
        let mut changed = Vec::new();
        differences("", &settings(old), &settings(new), &mut changed);
        changed
    }

    #[test]
    fn the_changed_settings_are_named_by_their_dotted_keys() {
        assert_eq!(changed("", ""), Vec::<String>::new());
        assert_eq!(
            changed(
                "[log]\nfilter = \"info\"\n",
                "[log]\nfilter = \"debug\"\n[upstream]\nurl = \"http://127.0.0.1:4000\"\n"
            ),
            ["log.filter", "upstream.url"]
        );
        let route = "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\n";
        assert_eq!(changed("", route), ["routes"]);
    }

    #[test]
    fn a_reload_applies_the_request_path_settings_and_keeps_the_others_running() {
        let running = Config::from_toml_str(
            "[server]\nmax_waiting = 64\nbody_read_timeout = \"30s\"\n[store]\ntimeout = \"1s\"\n",
        )
        .unwrap();
        let loaded = Config::from_toml_str(
            "[server]\nmax_waiting = 2\nbody_read_timeout = \"5s\"\n[store]\ntimeout = \"9s\"\n\
             on_error = \"fail_open\"\n[upstream]\ntimeout = \"7s\"\n[log]\nformat = \"json\"\naccess = false\n",
        )
        .unwrap();
        let config = keep_running(&running, loaded);
        assert_eq!(
            config.server.max_waiting, 64,
            "a process-wide seat count waits for a restart"
        );
        assert_eq!(config.server.body_read_timeout, std::time::Duration::from_secs(5));
        assert_eq!(config.store.timeout, std::time::Duration::from_secs(1));
        assert_eq!(config.store.on_error, crate::config::OnStoreError::FailOpen);
        assert_eq!(config.upstream.timeout, std::time::Duration::from_secs(7));
        assert_eq!(config.log.format, running.log.format);
        assert!(!config.log.access);

        for key in [
            "routes",
            "upstream.timeout",
            "upstream.tls.ca_file",
            "idempotency.lock_timeout",
            "store.on_error",
        ] {
            assert!(applies(key), "{key}");
        }
        for key in [
            "server.max_waiting",
            "store.timeout",
            "log.format",
            "upstreams",
            "traces.enabled",
            "store",
        ] {
            assert!(!applies(key), "{key}");
        }
    }

    #[test]
    fn a_route_whose_key_scope_or_fingerprint_rules_change_is_named_and_no_other() {
        let route = |scope_headers: &str| {
            format!(
                "[[routes]]\nname = \"payments\"\npath_prefix = \"/payments\"\nscope_headers = [{scope_headers}]\n\
                 fingerprint_headers = [\"x-a\", \"x-b\", \"x-c\", \"x-d\"]\n\
                 [[routes]]\nname = \"orders\"\npath_prefix = \"/orders\"\nlock_timeout = \"5s\"\n"
            )
        };
        let load = |text: &str| Config::from_toml_str(text).unwrap();
        let same = route("\"authorization\", \"x-tenant\", \"x-team\"");
        for _ in 0..20 {
            assert!(
                rules_changed(&load(&same), &load(&same)).is_empty(),
                "loaded twice, nothing changed"
            );
        }
        let other = route("\"x-tenant\"");
        assert_eq!(rules_changed(&load(&same), &load(&other)), ["payments"]);
        let longer_lease = same.replace("lock_timeout = \"5s\"", "lock_timeout = \"9s\"");
        assert!(
            rules_changed(&load(&same), &load(&longer_lease)).is_empty(),
            "a lease is not a key rule"
        );
    }
}
