//! `[upstream]`: the protected service. Validated once at load into [`UpstreamConfig`], which
//! `proxy/forward.rs` and `proxy/pool.rs` run with. Two forms, because the URL becomes a `Uri` and the
//! connection cap's default depends on `[server]`.

use std::time::Duration;

use http::Uri;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::{positive, within};
use super::server::ServerConfig;

/// `[upstream]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawUpstream {
    /// Base URL of the protected service (`http://host:port`).
    pub url: String,
    /// Bound on establishing a TCP connection to the upstream.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bound on waiting for the response head, and on the gap between two body chunks.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Most connections each worker holds open to the upstream (in use or idle); a request that finds
    /// none free waits up to `connect_timeout`, then gets 503. Absent means `server.max_connections`
    /// divided among the workers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            url: "http://127.0.0.1:3000".into(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(60),
            max_connections: None,
        }
    }
}

/// Validated `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Scheme and authority of the upstream; requests keep their own path and query.
    pub base: Uri,
    /// TCP connect bound.
    pub connect_timeout: Duration,
    /// Response head bound and body idle bound.
    pub timeout: Duration,
    /// Most upstream connections per worker.
    pub max_connections: usize,
}

impl RawUpstream {
    /// Checks the section and converts it; `server` supplies the connection cap's default.
    pub fn validate(&self, server: &ServerConfig) -> Result<UpstreamConfig, ConfigError> {
        let base = self.base()?;
        positive("upstream.connect_timeout", self.connect_timeout)?;
        positive("upstream.timeout", self.timeout)?;
        let max_connections = match self.max_connections {
            Some(n) => within("upstream.max_connections", n, 1..=1_000_000)?,
            None => server.max_connections.div_ceil(server.workers),
        };
        Ok(UpstreamConfig {
            base,
            connect_timeout: self.connect_timeout,
            timeout: self.timeout,
            max_connections,
        })
    }

    fn base(&self) -> Result<Uri, ConfigError> {
        let key = "upstream.url";
        let uri: Uri = self
            .url
            .parse()
            .map_err(|e| ConfigError::new(key, format!("not a URL: {e}")))?;
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return Err(ConfigError::new(key, "must be an http:// URL"));
        }
        if uri.authority().is_none() {
            return Err(ConfigError::new(key, "must name a host"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(ConfigError::new(
                key,
                "must not carry a path or query; requests keep their own",
            ));
        }
        Ok(uri)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn bad_upstream_names_the_key() {
        let err = Config::from_toml_str("[upstream]\nurl = \"ftp://x\"\n").unwrap_err();
        assert_eq!(err.key, "upstream.url");
    }

    #[test]
    fn the_upstream_url_is_a_base_without_path_or_query() {
        let config = Config::from_toml_str("[upstream]\nurl = \"http://svc:3000/\"\n").unwrap();
        assert_eq!(config.upstream.base.authority().unwrap().as_str(), "svc:3000");
        for bad in ["http://svc/v1", "http://svc/?q=1", "http://", "https://svc"] {
            let err = Config::from_toml_str(&format!("[upstream]\nurl = \"{bad}\"\n")).unwrap_err();
            assert_eq!(err.key, "upstream.url", "{bad}");
        }
    }

    #[test]
    fn the_connection_cap_defaults_to_the_server_cap_shared_among_workers() {
        let config = Config::from_toml_str("[server]\nmax_connections = 100\nworkers = 3\n").unwrap();
        assert_eq!(
            config.upstream.max_connections, 34,
            "100 connections over 3 workers"
        );
        let err = Config::from_toml_str("[upstream]\nmax_connections = 0").unwrap_err();
        assert_eq!(err.key, "upstream.max_connections", "{err}");
        for (text, key) in [
            ("connect_timeout = \"0s\"", "upstream.connect_timeout"),
            ("timeout = \"0s\"", "upstream.timeout"),
        ] {
            let err = Config::from_toml_str(&format!("[upstream]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }
}
