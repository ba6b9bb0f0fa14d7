//! `[log]`: the log line format and filter, and the access log. Read once at start-up by `main.rs`, which sets up tracing
//! with it. The TOML form is already the typed form, and there is nothing to check that serde does not
//! (the filter is read by `tracing-subscriber`, which skips what it cannot parse), so it is one struct
//! without a `validate`.

use serde::{Deserialize, Serialize};

/// `[log]`, as written and as used.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` for people, `json` for log pipelines.
    pub format: LogFormat,
    /// Filter in `RUST_LOG` syntax; the `RUST_LOG` variable overrides it.
    pub filter: String,
    /// One line per finished request at INFO on the target `idemproxy::access` (JSON with
    /// `format = "json"`); off by default.
    pub access: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            filter: "info".into(),
            access: false,
        }
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[cfg(test)]
mod tests {
    use super::LogFormat;
    use crate::config::Config;

    #[test]
    fn text_at_info_is_the_default_and_json_can_be_asked_for() {
        let default = Config::from_toml_str("").unwrap().log;
        assert_eq!(
            (default.format, default.filter.as_str()),
            (LogFormat::Text, "info")
        );
        let json = Config::from_toml_str("[log]\nformat = \"json\"\nfilter = \"debug\"\n").unwrap();
        assert_eq!(
            (json.log.format, json.log.filter.as_str()),
            (LogFormat::Json, "debug")
        );
    }

    #[test]
    fn the_access_log_is_off_unless_asked_for() {
        assert!(!Config::from_toml_str("").unwrap().log.access);
        assert!(
            Config::from_toml_str("[log]\naccess = true\n")
                .unwrap()
                .log
                .access
        );
        let err = Config::from_toml_str("[log]\naccess = \"yes\"\n").unwrap_err();
        assert_eq!(err.key, "log.access");
    }

    #[test]
    fn an_unknown_format_names_the_key() {
        let err = Config::from_toml_str("[log]\nformat = \"xml\"\n").unwrap_err();
        assert_eq!(err.key, "log.format");
    }
}
