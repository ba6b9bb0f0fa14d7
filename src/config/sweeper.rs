//! `[sweeper]`: the background deletion of expired records. Read once at load; `store/sweeper.rs` runs
//! with it. The TOML form is already the typed form, so it is one struct.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::positive;

/// `[sweeper]`, as written and as run.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SweeperConfig {
    /// Run the background sweeper in `serve`.
    pub enabled: bool,
    /// Pause between sweeps.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Most records deleted by one statement (one short transaction).
    pub batch_size: u32,
}

impl Default for SweeperConfig {
    fn default() -> Self {
        SweeperConfig {
            enabled: true,
            interval: Duration::from_secs(60),
            batch_size: 1000,
        }
    }
}

impl SweeperConfig {
    /// Checks the section; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("sweeper.interval", self.interval)?;
        if self.batch_size == 0 {
            return Err(ConfigError::new("sweeper.batch_size", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;

    #[test]
    fn the_sweeper_runs_every_minute_by_default_and_reads_its_settings() {
        let default = Config::from_toml_str("").unwrap().sweeper;
        assert!(default.enabled);
        assert_eq!(
            (default.interval, default.batch_size),
            (Duration::from_secs(60), 1000)
        );
        let set =
            Config::from_toml_str("[sweeper]\nenabled = false\ninterval = \"5s\"\nbatch_size = 7\n").unwrap();
        assert!(!set.sweeper.enabled);
        assert_eq!(
            (set.sweeper.interval, set.sweeper.batch_size),
            (Duration::from_secs(5), 7)
        );
    }

    #[test]
    fn an_empty_batch_or_no_pause_names_the_key() {
        let err = Config::from_toml_str("[sweeper]\nbatch_size = 0\n").unwrap_err();
        assert_eq!(err.key, "sweeper.batch_size");
        let err = Config::from_toml_str("[sweeper]\ninterval = \"0s\"\n").unwrap_err();
        assert_eq!(err.key, "sweeper.interval");
    }
}
