//! SIGHUP: what changes without a restart. Runs beside `serve` for as long as it does, started by
//! `lib.rs` when `main.rs` hands it a [`Reload`]. At each SIGHUP it reads the configuration again from
//! where it came (the file, the `IDEMPROXY_` environment, the flags) and validates all of it:
//!
//! - a configuration that does not load is refused whole: one error naming the file and the key, the
//!   running configuration kept, `idemproxy_config_last_reload_successful` 0;
//! - `log.filter` takes effect at once (unless `RUST_LOG` overrides it);
//! - every other changed setting (routes, upstream, store, listeners, limits, `log.format`, ...) is named
//!   in one warning: it takes effect at the next restart. Settings are compared as `check-config` prints
//!   them, with secrets masked, so a changed password is not seen;
//! - the listener certificate files are read again by `server/cert_reload.rs`, which hears the same
//!   SIGHUP.
//!
//! Never stops the process. Touches the configuration sources, the log filter and the reload metrics.

use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

use crate::config::{Config, Overrides, mask_passwords};
use crate::logging::{self, FilterHandle};
use crate::metrics::Metrics;
use crate::shutdown::Hangups;

/// The only setting a SIGHUP applies to the running process (the certificate files are not settings).
const RELOADABLE: &str = "log.filter";

/// Where the configuration came from, to read it again, and the running log filter.
pub struct Reload {
    /// `--config`, if given.
    pub file: Option<PathBuf>,
    /// The command line's overrides.
    pub overrides: Overrides,
    /// The running log filter.
    pub filter: FilterHandle,
}

impl Reload {
    /// Reads the configuration again at each SIGHUP until `stop`, on a task of its own; `running` is the
    /// configuration the process started with.
    pub(crate) fn spawn(self, running: &Config, metrics: Metrics, stop: CancellationToken) {
        let mut running = settings(running);
        // Listening starts now, not when the task first runs: a SIGHUP from here on is heard.
        let mut hangups = Hangups::listen();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    () = hangups.next() => {}
                }
                self.hangup(&mut running, &metrics);
            }
        });
    }

    fn hangup(&self, running: &mut toml::Table, metrics: &Metrics) {
        match self.reload(running) {
            Ok(()) => {
                metrics.config_reloads.ok.inc();
                metrics.config_last_reload_successful.set(1);
            }
            Err(error) => {
                metrics.config_reloads.error.inc();
                metrics.config_last_reload_successful.set(0);
                let file = self.file.as_ref().map(|f| f.display().to_string());
                tracing::error!(
                    file = file.as_deref(),
                    error = %mask_passwords(&error.to_string()),
                    "SIGHUP: configuration not reloaded, it does not load; the running one is kept"
                );
            }
        }
    }

    /// Reads and validates the configuration, applies what can be, and names what needs a restart.
    fn reload(&self, running: &mut toml::Table) -> Result<(), crate::config::ConfigError> {
        let config = Config::load(self.file.as_deref(), &self.overrides)?;
        let read = settings(&config);
        let mut changed = Vec::new();
        differences("", running, &read, &mut changed);
        let (filter, restart): (Vec<String>, Vec<String>) =
            changed.into_iter().partition(|key| key == RELOADABLE);
        if !filter.is_empty() {
            self.apply_filter(&config.log.filter, running);
        }
        if restart.is_empty() {
            tracing::info!("SIGHUP: configuration read again; nothing else changed that needs a restart");
        } else {
            tracing::warn!(
                settings = restart.join(", "),
                "SIGHUP: configuration read again; these changed settings take effect only after a restart"
            );
        }
        Ok(())
    }

    fn apply_filter(&self, filter: &str, running: &mut toml::Table) {
        if logging::filter_from_environment() {
            tracing::warn!("SIGHUP: log.filter changed, but RUST_LOG is set and overrides it");
            return;
        }
        match self.filter.set(filter) {
            Ok(()) => {
                if let Some(toml::Value::Table(log)) = running.get_mut("log") {
                    log.insert("filter".into(), filter.into());
                }
                tracing::info!(filter, "SIGHUP: log filter changed");
            }
            Err(error) => tracing::error!(%error, "SIGHUP: log filter not changed"),
        }
    }
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
}
