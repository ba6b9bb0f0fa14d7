//! `[replay_cache]`: the in-process copies of completed records that answer retries without a store
//! round trip. Read once at load; `proxy/cache.rs` is sized by it. The TOML form is the typed form (the
//! size is read as a byte count by `parse::bytes`), and every value is allowed (0 turns the cache off), so
//! it is one struct without a `validate`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::parse::bytes;

/// `[replay_cache]`, as written and as used.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayCacheConfig {
    /// Bytes of stored responses (plus per-entry overhead) kept in memory; 0 turns the cache off.
    #[serde(with = "bytes")]
    pub max_size: u64,
    /// Longest time an entry is served without asking the store again; 0 turns the cache off.
    #[serde(with = "humantime_serde")]
    pub max_age: Duration,
}

impl Default for ReplayCacheConfig {
    fn default() -> Self {
        ReplayCacheConfig {
            max_size: 8 * 1024 * 1024,
            max_age: Duration::from_secs(60),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;

    #[test]
    fn sizes_and_ages_parse_and_zero_is_allowed() {
        let default = Config::from_toml_str("").unwrap().replay_cache;
        assert_eq!(
            (default.max_size, default.max_age),
            (8 * 1024 * 1024, Duration::from_secs(60))
        );
        let off = Config::from_toml_str("[replay_cache]\nmax_size = \"0\"\nmax_age = \"0s\"\n").unwrap();
        assert_eq!(
            (off.replay_cache.max_size, off.replay_cache.max_age),
            (0, Duration::ZERO)
        );
        let odd = Config::from_toml_str("[replay_cache]\nmax_size = \"1234567\"\n").unwrap();
        assert_eq!(odd.replay_cache.max_size, 1_234_567);
    }

    #[test]
    fn a_bad_size_names_the_key_and_the_size_prints_as_written_before() {
        let err = Config::from_toml_str("[replay_cache]\nmax_size = \"huge\"\n").unwrap_err();
        assert_eq!(err.key, "replay_cache.max_size");
        let printed = Config::from_toml_str("").unwrap().to_masked_toml();
        assert!(printed.contains("max_size = \"8.0 MiB\""), "{printed}");
    }
}
