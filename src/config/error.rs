//! The one error a configuration has: the key it is about, and what is wrong, on one line; for an
//! unknown key, the known key that was most likely meant.

use std::ffi::OsString;

/// A configuration error: one line naming the key and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("config error: {key}: {message}")]
pub struct ConfigError {
    /// Dotted path of the offending key (`idempotency.ttl`), or `config` when the file itself is unreadable.
    pub key: String,
    /// What is wrong, in one line.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(key: &str, message: impl std::fmt::Display) -> Self {
        ConfigError {
            key: key.to_owned(),
            message: message.to_string().replace('\n', " "),
        }
    }

    /// The error figment found, named by its key, with the nearest known key for an unknown one.
    pub(super) fn from_figment(err: figment::Error) -> Self {
        let mut path = err.path.clone();
        let source = err.metadata.as_ref().map(|m| match &m.source {
            Some(figment::Source::File(file)) => file.display().to_string(),
            _ => m.name.to_string(),
        });
        let from = source
            .as_deref()
            .map(|s| format!(" (from {s})"))
            .unwrap_or_default();
        let message = match &err.kind {
            figment::error::Kind::UnknownField(field, expected) => {
                if path.last() != Some(field) {
                    path.push(field.clone());
                }
                // The variable that set it, if one did: figment may tag the error with the layer
                // whose table holds the key rather than the one that added it.
                unknown_variable(&path, expected, std::env::vars_os())
                    .unwrap_or_else(|| format!("{}{from}", unknown_key(field, expected)))
            }
            figment::error::Kind::Message(message) => format!("{}{from}", without_source_text(message)),
            figment::error::Kind::InvalidType(actual, expected) => {
                format!(
                    "invalid type: found {}, expected {expected}{from}",
                    kind_of(actual)
                )
            }
            figment::error::Kind::InvalidValue(actual, expected) => {
                format!(
                    "invalid value: found {}, expected {expected}{from}",
                    kind_of(actual)
                )
            }
            kind => format!("{kind}{from}"),
        };
        let key = if path.is_empty() {
            "config".to_owned()
        } else {
            path.join(".")
        };
        ConfigError::new(&key, message)
    }
}

/// What a value is, never the value itself: a string set where a table is expected may be a secret
/// (`encryption.keys = "…"`, `traces.headers = "authorization=…"`), and the message goes to stderr and,
/// on a reload, to the logs.
fn kind_of(actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    match actual {
        Actual::Str(text) => format!("a string of {} characters", text.chars().count()),
        Actual::Bytes(bytes) => format!("{} bytes", bytes.len()),
        Actual::Char(_) => "a character".to_owned(),
        Actual::Bool(_) => "a boolean".to_owned(),
        Actual::Unsigned(_) | Actual::Signed(_) | Actual::Float(_) => "a number".to_owned(),
        Actual::Other(_) => "another value".to_owned(),
        other => other.to_string(),
    }
}

/// A parse error's message without the lines of the file it quotes (`  |`, `2 | keys = …`, the
/// caret): the line and column stay, the text never, since it may hold a secret (`encryption.keys`) and
/// the message goes to stderr and, on a reload, to the logs.
fn without_source_text(message: &str) -> String {
    let quoted = |line: &str| {
        let trimmed = line.trim_start();
        trimmed.starts_with('|')
            || trimmed.split_once('|').is_some_and(|(number, _)| {
                !number.trim().is_empty() && number.trim().bytes().all(|b| b.is_ascii_digit())
            })
    };
    message
        .lines()
        .filter(|line| !quoted(line) && !line.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(": ")
}

/// Least Jaro similarity for a known key to be offered as the one meant, as clap offers subcommands.
const SIMILAR: f64 = 0.7;

/// The known key nearest to `unknown`, if one is near enough to be what was meant. Jaro similarity
/// (strsim, as clap's own suggestions) weighs a transposition or a dropped letter in a short name, the
/// usual typos in config keys, as small differences.
pub(super) fn nearest<'a>(unknown: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|key| (strsim::jaro(unknown, key), *key))
        .filter(|(score, _)| *score >= SIMILAR)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, key)| key)
}

/// The message for an unknown key in a file or a route: the key meant, if one is near.
pub(super) fn unknown_key(unknown: &str, known: &[&str]) -> String {
    match nearest(unknown, known) {
        Some(meant) => format!("unknown key; did you mean {meant:?}?"),
        None => "unknown key; no known key is like it".to_owned(),
    }
}

/// The message for an unknown key set by an `IDEMPROXY_` variable, naming the variable and the one
/// meant; `None` when no variable in `vars` (the process's environment) sets it. `path` is the key's
/// path, its last part the unknown one.
pub(super) fn unknown_variable(
    path: &[String],
    known: &[&str],
    vars: impl Iterator<Item = (OsString, OsString)>,
) -> Option<String> {
    let (unknown, parents) = path.split_last()?;
    let prefix = super::service_links::PREFIX;
    let variable = vars
        .filter_map(|(name, _)| name.into_string().ok())
        .find(|name| {
            let Some(rest) = name.strip_prefix(prefix) else {
                return false;
            };
            let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            parts.len() >= path.len() && parts[..path.len()] == *path
        })?;
    let Some(meant) = nearest(unknown, known) else {
        return Some(format!("unknown key (from {variable}); no known key is like it"));
    };
    let parents: String = parents
        .iter()
        .map(|p| format!("{}__", p.to_ascii_uppercase()))
        .collect();
    let wrong = format!("{prefix}{parents}{}", unknown.to_ascii_uppercase());
    let right = format!("{prefix}{parents}{}", meant.to_ascii_uppercase());
    let fixed = variable.replacen(&wrong, &right, 1);
    Some(format!("unknown key (from {variable}); did you mean {fixed}?"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nearest_key_is_offered_and_a_far_one_is_not() {
        let known = ["listen", "admin_listen", "shutdown_grace", "workers"];
        assert_eq!(nearest("lisen", &known), Some("listen"));
        assert_eq!(nearest("admin_lisetn", &known), Some("admin_listen"));
        assert_eq!(nearest("wrokers", &known), Some("workers"));
        assert_eq!(nearest("retries", &known), None);
    }

    #[test]
    fn an_unknown_variable_is_named_with_the_one_meant() {
        let vars = || {
            [("IDEMPROXY_STORE__POOL_SIZ", "3"), ("HOME", "/root")]
                .into_iter()
                .map(|(n, v)| (OsString::from(n), OsString::from(v)))
        };
        let path = ["store".to_owned(), "pool_siz".to_owned()];
        let said = unknown_variable(&path, &["pool_size", "url"], vars()).expect("set by a variable");
        assert_eq!(
            said,
            "unknown key (from IDEMPROXY_STORE__POOL_SIZ); did you mean IDEMPROXY_STORE__POOL_SIZE?"
        );
        let from_file = ["store".to_owned(), "pool".to_owned()];
        assert_eq!(unknown_variable(&from_file, &["pool_size"], vars()), None);
    }
}
