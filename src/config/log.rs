//! `[log]`: the log line format and filter, and the access log. Read once at start-up by `main.rs`, which sets up tracing
//! with it. The TOML form is already the typed form, and there is nothing to check that serde does not
//! (the filter is read by `tracing-subscriber`, which skips what it cannot parse), so it is one struct
//! without a `validate`. Also where every log line goes: [`MaskedStderr`], which masks passwords
//! (`config/mask.rs`) in each line before it is written, whatever a dependency's error put in it.

use std::io::{self, Write};

use serde::{Deserialize, Serialize};

use super::mask::{mask_passwords, may_hold_a_password};

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

/// The log writer `main.rs` gives tracing: stderr, every line masked by [`mask_passwords`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MaskedStderr;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for MaskedStderr {
    type Writer = Masked<io::Stderr>;

    fn make_writer(&'a self) -> Self::Writer {
        Masked(io::stderr())
    }
}

/// A writer that masks passwords in what it is given before passing it on. tracing writes each event
/// as one formatted line in one `write_all`, so a URL is never split between two writes.
#[derive(Debug)]
pub struct Masked<W>(pub W);

impl<W: Write> Write for Masked<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match std::str::from_utf8(buf) {
            Ok(text) if may_hold_a_password(text) => self.0.write_all(mask_passwords(text).as_bytes())?,
            _ => self.0.write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::{LogFormat, Masked};
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

    #[test]
    fn a_log_line_is_written_with_its_passwords_masked() {
        use std::io::Write;
        let mut out = Masked(Vec::new());
        out.write_all(b"WARN store error: connect to redis://:s3cret@cache:6379 refused\n")
            .unwrap();
        out.write_all(b"INFO plain line\n").unwrap();
        let written = String::from_utf8(out.0).unwrap();
        assert_eq!(
            written,
            "WARN store error: connect to redis://:***@cache:6379 refused\nINFO plain line\n"
        );
    }
}
