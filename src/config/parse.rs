//! The checks and conversions several sections validate with, run once at load. Each takes the dotted key
//! its error names, so the section (or, later, a route) that calls it decides the name. Touches nothing
//! but the value it is given.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::time::Duration;

use http::HeaderName;

use super::ConfigError;

/// A listener address like `0.0.0.0:8080`.
pub(super) fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    value
        .parse()
        .map_err(|_| ConfigError::new(key, format!("{value:?} is not an address like 0.0.0.0:8080")))
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

/// One header name, lower-cased as `http` keeps it.
pub(super) fn parse_header(key: &str, value: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(value.as_bytes())
        .map_err(|_| ConfigError::new(key, format!("{value:?} is not a header name")))
}

/// A list of header names; the first bad one is named.
pub(super) fn parse_headers(key: &str, values: &[String]) -> Result<Vec<HeaderName>, ConfigError> {
    values.iter().map(|v| parse_header(key, v)).collect()
}

/// A duration that may not be zero.
pub(super) fn positive(key: &str, value: Duration) -> Result<Duration, ConfigError> {
    if value.is_zero() {
        return Err(ConfigError::new(key, "must be greater than zero"));
    }
    Ok(value)
}

/// A count within `range`.
pub(super) fn within(
    key: &str,
    value: usize,
    range: std::ops::RangeInclusive<usize>,
) -> Result<usize, ConfigError> {
    if !range.contains(&value) {
        return Err(ConfigError::new(
            key,
            format!("must be between {} and {}", range.start(), range.end()),
        ));
    }
    Ok(value)
}

/// `#[serde(serialize_with = "exact_size")]`: a size printed so that reading it back gives the same
/// number of bytes (`"4 MiB"`, `"1000001 B"`), where [`bytesize::ByteSize`]'s own form rounds. A route's
/// settings are laid over its section's printed form, so the section's sizes must survive the trip.
pub(super) fn exact_size<S: serde::Serializer>(
    value: &bytesize::ByteSize,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let bytes = value.as_u64();
    let text = match bytes {
        0 => "0 B".to_owned(),
        b if b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    };
    serializer.serialize_str(&text)
}

/// `#[serde(with = "bytes")]`: a byte count held as `u64`, read and printed as [`bytesize::ByteSize`]
/// reads and prints it (`"4MiB"` in, `"4.0 MiB"` out), so a section whose only difference from its
/// typed form would be `ByteSize` against `u64` needs no second struct.
pub(super) mod bytes {
    use bytesize::ByteSize;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(in crate::config) fn serialize<S: Serializer>(value: &u64, serializer: S) -> Result<S::Ok, S::Error> {
        ByteSize(*value).serialize(serializer)
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<u64, D::Error> {
        ByteSize::deserialize(deserializer).map(|size| size.as_u64())
    }
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
