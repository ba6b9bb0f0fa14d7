//! `[upstream]` and `[upstream.tls]`: the protected service. Validated once at load into
//! [`UpstreamConfig`], which `proxy/upstream.rs` and its pool run with. Reads the upstream's TLS files
//! (CA bundle, client certificate and key) here, so a bad file stops the start with a line naming its key.
//! Two forms, because the URL becomes an [`UpstreamAddress`] (TCP, TLS or a unix socket), the TLS files a
//! rustls config, and the connection cap's default depends on `[server]`.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::Uri;
use rustls_pki_types::ServerName;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::{positive, within};
use super::server::ServerConfig;
use super::tls;

/// `upstream.idle_timeout` unless set: under the shortest keep-alive timeout of the common application
/// servers (gunicorn 2 s; Node.js, uvicorn and Apache 5 s; nginx 75 s), so the proxy, not the upstream,
/// closes an idle connection, and never while a request is being written to it.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(1);
/// `upstream.max_concurrent_streams` when unset: the least RFC 9113 (§6.5.2) asks a server to allow.
pub const DEFAULT_MAX_CONCURRENT_STREAMS: usize = 100;

/// The bounds of `upstream.idle_timeout`: the pool looks for idle connections to close twice per
/// timeout, so a shorter one costs wake-ups for nothing, and a longer one outlives every upstream's.
const IDLE_TIMEOUT_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(100)..=Duration::from_secs(3600);

/// `[upstream]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawUpstream {
    /// Base URL of the protected service: `http://host:port`, `https://host:port`, or
    /// `unix:/path/to.sock` (HTTP/1.1 over a unix stream socket).
    pub url: String,
    /// Bound on establishing a connection to the upstream (including the TLS handshake).
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// Bound on waiting for the response head, and on the gap between two body chunks.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Most connections each worker holds open to the upstream (in use or idle, HTTP/1.1 or HTTP/2); a
    /// request that finds none free waits up to `connect_timeout`, then gets 503. Absent means
    /// `server.max_connections` divided among the workers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Most requests one HTTP/2 connection to the upstream carries at once, as streams; with every
    /// connection full, the next request opens another. At most the upstream's own
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`, or requests beyond that wait inside the connection.
    pub max_concurrent_streams: usize,
    /// How long an upstream connection may sit idle in the pool before the proxy closes it. Keep it
    /// shorter than the upstream's own keep-alive timeout: a request sent on a connection the upstream is
    /// closing at that moment fails after it may have been received (an unknown outcome for a keyed one).
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Which HTTP version requests go upstream in: `http1`, `h2c` (HTTP/2 without TLS, every request)
    /// or `auto` (over TLS what ALPN agrees, HTTP/2 preferred; in cleartext HTTP/2 for gRPC requests and
    /// HTTP/1.1 for the rest).
    pub protocol: UpstreamProtocol,
    /// TLS settings for an `https://` upstream; absent means the system's CA certificates, the URL's
    /// host as the name, and no client certificate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<RawUpstreamTls>,
}

/// `upstream.protocol`: the HTTP version the proxy speaks to the upstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1 only, over a pool of keep-alive connections (ALPN `http/1.1` over TLS).
    #[default]
    Http1,
    /// HTTP/2 with prior knowledge over cleartext TCP or a unix socket, for every request: one
    /// multiplexed connection per worker.
    H2c,
    /// Over TLS, the version ALPN agrees (`h2` offered first, then `http/1.1`); in cleartext, HTTP/2
    /// (h2c) for gRPC requests (`content-type: application/grpc…`, which need it) and HTTP/1.1 for the
    /// rest.
    Auto,
}

impl Default for RawUpstream {
    fn default() -> Self {
        RawUpstream {
            url: "http://127.0.0.1:3000".into(),
            connect_timeout: Duration::from_secs(2),
            timeout: Duration::from_secs(60),
            max_connections: None,
            max_concurrent_streams: DEFAULT_MAX_CONCURRENT_STREAMS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            protocol: UpstreamProtocol::Http1,
            tls: None,
        }
    }
}

/// `[upstream.tls]`: only with an `https://` URL.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawUpstreamTls {
    /// PEM CA certificates trusted beside the system's (which honour `SSL_CERT_FILE`); absent means
    /// the system's only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// The name the upstream's certificate must carry, also sent as SNI; absent means the URL's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// PEM client certificate chain presented to the upstream (mutual TLS), leaf first; set with
    /// `key_file` or not at all.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file` (PKCS#8, PKCS#1 or SEC1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
}

/// Where the upstream listens, and how to reach it.
#[derive(Clone)]
pub enum UpstreamAddress {
    /// Cleartext TCP to `host:port`.
    Http {
        /// `host:port` to connect to.
        authority: String,
    },
    /// TLS over TCP to `host:port`.
    Https {
        /// `host:port` to connect to.
        authority: String,
        /// The name verified in the upstream's certificate and sent as SNI.
        server_name: ServerName<'static>,
        /// Trusted roots, client certificate, ALPN (`http/1.1`, and `h2` first with protocol `auto`).
        tls: Arc<rustls::ClientConfig>,
    },
    /// Cleartext over a unix stream socket.
    Unix {
        /// The socket's path.
        path: PathBuf,
    },
}

impl fmt::Display for UpstreamAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UpstreamAddress::Http { authority } => write!(f, "http://{authority}"),
            UpstreamAddress::Https { authority, .. } => write!(f, "https://{authority}"),
            UpstreamAddress::Unix { path } => write!(f, "unix:{}", path.display()),
        }
    }
}

impl fmt::Debug for UpstreamAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// Validated `[upstream]`.
#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Where connections go.
    pub address: UpstreamAddress,
    /// Scheme and authority a request without a `Host` of its own is sent with (`http://localhost`
    /// for a unix socket); requests keep their own path and query.
    pub base: Uri,
    /// Connect (and TLS handshake) bound.
    pub connect_timeout: Duration,
    /// Response head bound and body idle bound.
    pub timeout: Duration,
    /// Most upstream connections per worker.
    pub max_connections: usize,
    /// Most streams at once on one HTTP/2 connection to the upstream.
    pub max_concurrent_streams: usize,
    /// Longest an upstream connection stays idle in the pool.
    pub idle_timeout: Duration,
    /// The HTTP version spoken to the upstream.
    pub protocol: UpstreamProtocol,
}

impl RawUpstream {
    /// Checks the section and converts it; `server` supplies the connection cap's default.
    pub fn validate(&self, server: &ServerConfig) -> Result<UpstreamConfig, ConfigError> {
        let (address, base) = self.address()?;
        positive("upstream.connect_timeout", self.connect_timeout)?;
        positive("upstream.timeout", self.timeout)?;
        let max_connections = match self.max_connections {
            Some(n) => within("upstream.max_connections", n, 1..=1_000_000)?,
            None => server.max_connections.div_ceil(server.workers),
        };
        Ok(UpstreamConfig {
            address,
            base,
            connect_timeout: self.connect_timeout,
            timeout: self.timeout,
            max_connections,
            max_concurrent_streams: within(
                "upstream.max_concurrent_streams",
                self.max_concurrent_streams,
                1..=1000,
            )?,
            idle_timeout: self.idle_timeout()?,
            protocol: self.protocol,
        })
    }

    fn idle_timeout(&self) -> Result<Duration, ConfigError> {
        if !IDLE_TIMEOUT_RANGE.contains(&self.idle_timeout) {
            return Err(ConfigError::new(
                "upstream.idle_timeout",
                "must be between 100ms and 1h, and shorter than the upstream's keep-alive timeout",
            ));
        }
        Ok(self.idle_timeout)
    }

    fn address(&self) -> Result<(UpstreamAddress, Uri), ConfigError> {
        if let Some(path) = self.url.strip_prefix("unix:") {
            return Ok((self.unix(path)?, Uri::from_static("http://localhost")));
        }
        let base = self.base()?;
        let host = base.host().unwrap_or_default();
        let https = base.scheme() == Some(&http::uri::Scheme::HTTPS);
        let authority = format!(
            "{host}:{}",
            base.port_u16().unwrap_or(if https { 443 } else { 80 })
        );
        if !https {
            self.no_tls_section("an http:// URL")?;
            return Ok((UpstreamAddress::Http { authority }, base));
        }
        if self.protocol == UpstreamProtocol::H2c {
            return Err(ConfigError::new(
                "upstream.protocol",
                "\"h2c\" is HTTP/2 without TLS; with an https:// upstream.url, \"auto\" agrees on \
                 HTTP/2 through ALPN",
            ));
        }
        let section = self.tls.clone().unwrap_or_default();
        let mut tls = section.client_config()?;
        if self.protocol == UpstreamProtocol::Auto {
            tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        }
        let address = UpstreamAddress::Https {
            authority,
            server_name: section.server_name(host)?,
            tls: Arc::new(tls),
        };
        Ok((address, base))
    }

    fn unix(&self, path: &str) -> Result<UpstreamAddress, ConfigError> {
        if path.is_empty() {
            return Err(ConfigError::new(
                "upstream.url",
                "a unix socket URL needs a path, like unix:/run/app.sock",
            ));
        }
        self.no_tls_section("a unix: URL")?;
        Ok(UpstreamAddress::Unix { path: path.into() })
    }

    fn no_tls_section(&self, what: &str) -> Result<(), ConfigError> {
        if self.tls.is_some() {
            return Err(ConfigError::new(
                "upstream.tls",
                format!("is only for an https:// upstream.url, not {what}"),
            ));
        }
        Ok(())
    }

    fn base(&self) -> Result<Uri, ConfigError> {
        let key = "upstream.url";
        let uri: Uri = self
            .url
            .parse()
            .map_err(|e| ConfigError::new(key, format!("not a URL: {e}")))?;
        let scheme = uri.scheme();
        if scheme != Some(&http::uri::Scheme::HTTP) && scheme != Some(&http::uri::Scheme::HTTPS) {
            return Err(ConfigError::new(
                key,
                "must be an http:// or https:// URL, or unix:/path/to.sock",
            ));
        }
        let Some(authority) = uri.authority() else {
            return Err(ConfigError::new(key, "must name a host"));
        };
        // The proxy sends no credentials of its own, and the authority becomes the `Host` of a request
        // that came without one: `user:password@` would be sent to the upstream in clear.
        if authority.as_str().contains('@') {
            return Err(ConfigError::new(
                key,
                "must not carry credentials (user:password@): the proxy sends none; clients' own \
                 Authorization headers are forwarded as sent",
            ));
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

impl RawUpstreamTls {
    /// `server_name`, else the URL's host (an IP address is verified as one).
    fn server_name(&self, host: &str) -> Result<ServerName<'static>, ConfigError> {
        let (key, name) = match &self.server_name {
            Some(name) => ("upstream.tls.server_name", name.as_str()),
            None => ("upstream.url", host.trim_start_matches('[').trim_end_matches(']')),
        };
        ServerName::try_from(name.to_owned())
            .map_err(|e| ConfigError::new(key, format!("{name:?} is not a TLS server name: {e}")))
    }

    fn client_config(&self) -> Result<rustls::ClientConfig, ConfigError> {
        let roots =
            tls::roots(self.ca_file.as_deref()).map_err(|e| ConfigError::new("upstream.tls.ca_file", e))?;
        if roots.is_empty() {
            return Err(ConfigError::new(
                "upstream.tls.ca_file",
                "no trusted CA certificates: the system has none (see SSL_CERT_FILE); set this file",
            ));
        }
        let client = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((
                tls::certificates(cert).map_err(|e| ConfigError::new("upstream.tls.cert_file", e))?,
                tls::private_key(key).map_err(|e| ConfigError::new("upstream.tls.key_file", e))?,
            )),
            (Some(_), None) => {
                return Err(ConfigError::new(
                    "upstream.tls.key_file",
                    "must be set with upstream.tls.cert_file",
                ));
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "upstream.tls.cert_file",
                    "must be set with upstream.tls.key_file",
                ));
            }
        };
        tls::http1_client(roots, client).map_err(|e| ConfigError::new("upstream.tls.key_file", e))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Config, UpstreamAddress, UpstreamProtocol};

    #[test]
    fn bad_upstream_names_the_key() {
        let err = Config::from_toml_str("[upstream]\nurl = \"ftp://x\"\n").unwrap_err();
        assert_eq!(err.key, "upstream.url");
    }

    #[test]
    fn the_protocol_is_http1_unless_set_and_h2c_is_refused_over_tls() {
        let config = Config::from_toml_str("").unwrap();
        assert_eq!(config.upstream.protocol, UpstreamProtocol::Http1);
        let config = Config::from_toml_str("[upstream]\nprotocol = \"h2c\"\n").unwrap();
        assert_eq!(config.upstream.protocol, UpstreamProtocol::H2c);
        let err =
            Config::from_toml_str("[upstream]\nurl = \"https://svc\"\nprotocol = \"h2c\"\n").unwrap_err();
        assert_eq!(err.key, "upstream.protocol");
        let config =
            Config::from_toml_str("[upstream]\nurl = \"https://svc\"\nprotocol = \"auto\"\n").unwrap();
        let UpstreamAddress::Https { tls, .. } = &config.upstream.address else {
            panic!("an https upstream");
        };
        assert_eq!(tls.alpn_protocols, vec![b"h2".to_vec(), b"http/1.1".to_vec()]);
        let err = Config::from_toml_str("[upstream]\nprotocol = \"h3\"\n").unwrap_err();
        assert_eq!(err.key, "upstream.protocol");
    }

    #[test]
    fn the_idle_timeout_defaults_under_the_common_keep_alive_timeouts() {
        let config = Config::from_toml_str("").unwrap();
        assert_eq!(config.upstream.idle_timeout, std::time::Duration::from_secs(1));
        let config = Config::from_toml_str("[upstream]\nidle_timeout = \"250ms\"\n").unwrap();
        assert_eq!(
            config.upstream.idle_timeout,
            std::time::Duration::from_millis(250)
        );
    }

    #[test]
    fn an_upstream_url_with_credentials_is_refused_without_echoing_them() {
        for url in [
            "http://app:s3cret@svc:3000",
            "https://:s3cret@svc",
            "http://s3cret@svc",
        ] {
            let err = Config::from_toml_str(&format!("[upstream]\nurl = \"{url}\"\n")).unwrap_err();
            assert_eq!(err.key, "upstream.url", "{url}");
            assert!(!err.to_string().contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn the_upstream_url_is_a_base_without_path_or_query() {
        let config = Config::from_toml_str("[upstream]\nurl = \"http://svc:3000/\"\n").unwrap();
        assert_eq!(config.upstream.base.authority().unwrap().as_str(), "svc:3000");
        for bad in [
            "http://svc/v1",
            "https://svc/?q=1",
            "http://",
            "ftp://svc",
            "unix:",
        ] {
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
            ("idle_timeout = \"0s\"", "upstream.idle_timeout"),
            ("idle_timeout = \"1ms\"", "upstream.idle_timeout"),
            ("idle_timeout = \"2h\"", "upstream.idle_timeout"),
            ("idle_timeout = \"soon\"", "upstream.idle_timeout"),
            ("idle_timeout = 5", "upstream.idle_timeout"),
            ("max_concurrent_streams = 0", "upstream.max_concurrent_streams"),
            ("max_concurrent_streams = 1001", "upstream.max_concurrent_streams"),
            ("max_concurrent_streams = -1", "upstream.max_concurrent_streams"),
        ] {
            let err = Config::from_toml_str(&format!("[upstream]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    /// `[upstream]` with `url` and an `[upstream.tls]` of `tls` lines.
    fn with_tls(url: &str, tls: &str) -> String {
        format!("[upstream]\nurl = \"{url}\"\n[upstream.tls]\n{tls}\n")
    }

    fn path(path: &std::path::Path) -> String {
        format!("{:?}", path.display().to_string())
    }

    #[test]
    fn an_https_upstream_verifies_the_url_host_or_server_name_on_port_443_by_default() {
        use super::UpstreamAddress;
        let dir = tempfile::tempdir().unwrap();
        let ca = rcgen::generate_simple_self_signed(vec!["ca.test".into()]).unwrap();
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, ca.cert.pem()).unwrap();
        let ca_line = format!("ca_file = {}", path(&ca_file));
        let config = Config::from_toml_str(&with_tls("https://10.0.0.1", &ca_line)).unwrap();
        let UpstreamAddress::Https {
            authority,
            server_name,
            tls,
        } = &config.upstream.address
        else {
            panic!("{:?}", config.upstream.address)
        };
        assert_eq!(authority, "10.0.0.1:443");
        assert_eq!(server_name.to_str(), "10.0.0.1");
        assert_eq!(tls.alpn_protocols, vec![b"http/1.1".to_vec()]);
        let named = with_tls(
            "https://10.0.0.1:8443",
            &format!("{ca_line}\nserver_name = \"api.internal\""),
        );
        let config = Config::from_toml_str(&named).unwrap();
        let UpstreamAddress::Https { server_name, .. } = &config.upstream.address else {
            panic!()
        };
        assert_eq!(server_name.to_str(), "api.internal");
        assert_eq!(config.upstream.address.to_string(), "https://10.0.0.1:8443");
    }

    #[test]
    fn a_unix_upstream_is_a_socket_path_and_takes_no_tls_section() {
        let config = Config::from_toml_str("[upstream]\nurl = \"unix:/run/app.sock\"\n").unwrap();
        assert_eq!(config.upstream.address.to_string(), "unix:/run/app.sock");
        assert_eq!(config.upstream.base, "http://localhost/");
        for url in ["unix:/run/app.sock", "http://svc"] {
            let err = Config::from_toml_str(&with_tls(url, "server_name = \"svc\"")).unwrap_err();
            assert_eq!(err.key, "upstream.tls", "{err}");
        }
    }

    #[test]
    fn bad_upstream_tls_settings_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let pair = rcgen::generate_simple_self_signed(vec!["client.test".into()]).unwrap();
        let (cert, key, junk) = (
            dir.path().join("cert.pem"),
            dir.path().join("key.pem"),
            dir.path().join("junk.pem"),
        );
        std::fs::write(&cert, pair.cert.pem()).unwrap();
        std::fs::write(&key, pair.signing_key.serialize_pem()).unwrap();
        std::fs::write(&junk, "not PEM\n").unwrap();
        let other = rcgen::generate_simple_self_signed(vec!["other.test".into()]).unwrap();
        let other_key = dir.path().join("other-key.pem");
        std::fs::write(&other_key, other.signing_key.serialize_pem()).unwrap();
        let ca = format!("ca_file = {}", path(&cert));
        let ok = format!("{ca}\ncert_file = {}\nkey_file = {}", path(&cert), path(&key));
        assert!(Config::from_toml_str(&with_tls("https://svc", &ok)).is_ok());
        for (tls, key_name) in [
            (
                "ca_file = \"/nonexistent/ca.pem\"".to_owned(),
                "upstream.tls.ca_file",
            ),
            (format!("ca_file = {}", path(&junk)), "upstream.tls.ca_file"),
            (
                format!("{ca}\ncert_file = {}", path(&cert)),
                "upstream.tls.key_file",
            ),
            (
                format!("{ca}\nkey_file = {}", path(&key)),
                "upstream.tls.cert_file",
            ),
            (
                format!("{ca}\ncert_file = {}\nkey_file = {}", path(&junk), path(&key)),
                "upstream.tls.cert_file",
            ),
            (
                format!("{ca}\ncert_file = {}\nkey_file = {}", path(&cert), path(&junk)),
                "upstream.tls.key_file",
            ),
            (
                format!(
                    "{ca}\ncert_file = {}\nkey_file = {}",
                    path(&cert),
                    path(&other_key)
                ),
                "upstream.tls.key_file",
            ),
            (
                format!("{ca}\nserver_name = \"not a name\""),
                "upstream.tls.server_name",
            ),
            (format!("{ca}\nunknown = 1"), "upstream.tls.unknown"),
        ] {
            let err = Config::from_toml_str(&with_tls("https://svc", &tls)).unwrap_err();
            assert_eq!(err.key, key_name, "{tls}: {err}");
        }
    }
}
