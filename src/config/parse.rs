//! The checks and conversions several sections validate with, run once at load. Each takes the dotted key
//! its error names, so the section (or, later, a route) that calls it decides the name. Touches nothing
//! but the value it is given.

use std::net::SocketAddr;
use std::time::Duration;

use http::HeaderName;

use super::error::ConfigError;

/// A listener address: `0.0.0.0:8080`, `[::1]:8080`, or as Go and Caddy write them `:8080` (every IPv4
/// interface, 0.0.0.0; IPv6 needs `[::]:8080`) and `localhost:8080` (127.0.0.1).
pub(super) fn parse_addr(key: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    let spelled = if let Some(port) = value.strip_prefix(':') {
        format!("0.0.0.0:{port}")
    } else if let Some((host, port)) = value.split_once(':')
        && host.eq_ignore_ascii_case("localhost")
    {
        // A host name is the same name in any case.
        format!("127.0.0.1:{port}")
    } else {
        value.to_owned()
    };
    spelled.parse().map_err(|_| {
        ConfigError::new(
            key,
            format!("{value:?} is not an address like 0.0.0.0:8080, :8080 or localhost:8080"),
        )
    })
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
    fn a_listen_address_may_be_a_bare_port_or_localhost() {
        let addr = |text: &str| parse_addr("server.listen", text).map(|a| a.to_string());
        assert_eq!(addr(":8080").unwrap(), "0.0.0.0:8080");
        assert_eq!(addr(":0").unwrap(), "0.0.0.0:0");
        assert_eq!(addr("localhost:9090").unwrap(), "127.0.0.1:9090");
        assert_eq!(addr("LocalHost:9090").unwrap(), "127.0.0.1:9090");
        assert_eq!(addr("[::]:8080").unwrap(), "[::]:8080");
        assert_eq!(addr("10.0.0.1:80").unwrap(), "10.0.0.1:80");
        for bad in [":", ":http", "localhost", "localhost:", "example.com:80", "8080"] {
            let err = addr(bad).unwrap_err();
            assert_eq!(err.key, "server.listen", "{bad}");
            assert!(err.message.contains(":8080 or localhost:8080"), "{bad}: {err}");
        }
    }
}
