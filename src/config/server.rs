//! `[server]` and `[server.tls]`: the listeners, the bounds on what clients may hold, and shutdown.
//! Validated once at load into [`ServerConfig`], which `server.rs` and `proxy.rs` run with. Reads the
//! listener's certificate and key files here, so a bad file stops the start with a line naming its key.
//! Two forms, because addresses become a [`ListenAddr`] (TCP or a unix socket), sizes become `usize`,
//! absent counts get defaults that depend on the machine or on other keys, and the TLS files become a
//! rustls config whose certificate `server.rs` can swap when the files change.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytesize::ByteSize;
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::parse::{parse_addr, positive, within};
use super::path::{Ambiguous, PathMode, PathRules};
use super::tls::{self, SwappableCert};

/// The base of problem `type` URIs unless `server.problem_type_base` names another.
pub const DEFAULT_PROBLEM_TYPE_BASE: &str = "https://idemproxy.dev/problems/";

/// `server.capture_wait` unless set: long enough for a completion that is being written to hand its
/// room back (a store write, usually a few milliseconds), short enough that a client never notices it.
pub const DEFAULT_CAPTURE_WAIT: Duration = Duration::from_millis(250);

/// The longest `server.capture_wait`: it slows a client's stream, so it stays brief.
const MAX_CAPTURE_WAIT: Duration = Duration::from_secs(10);

/// The share of `max_buffered_responses` one scope may hold unless `max_buffered_responses_per_scope`
/// says otherwise: a quarter, so the budget is spent only once four clients hold all they may.
const DEFAULT_SCOPE_SHARE_DIVISOR: usize = 4;

/// `[server]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    /// Proxy listener address: `host:port`, or `unix:/path/to.sock` for a unix stream socket.
    pub listen: String,
    /// Permissions of the proxy listener's unix socket file, in octal (only with a `unix:` listen).
    pub socket_mode: String,
    /// Whether a unix-socket client's own `X-Forwarded-For` goes upstream as it came. Such a client has
    /// no address to append, so by default its chain is removed rather than passed off as the proxy's.
    pub trust_unix_forwarded_for: bool,
    /// The TCP peers (addresses or CIDR blocks) trusted to say in `X-Forwarded-For` whom they forward
    /// for: the access log names the client they name instead of them. Empty by default.
    pub trusted_proxies: Vec<String>,
    /// Admin listener address (`/metrics`, `/healthz`, `/readyz`); TCP only.
    pub admin_listen: String,
    /// How long in-flight requests may run to completion after a shutdown signal.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// TLS on the proxy listener; absent means cleartext (HTTP/1.1 and h2c).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<RawServerTls>,
    /// Bound on receiving a request's head (HTTP/1.1); the connection is closed when it runs out.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Bound on receiving a keyed request's whole body, and on the silence between two chunks of a
    /// passthrough request's body; 408 when it runs out.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// Largest request head (request line and headers; the header list on HTTP/2); larger gets 431.
    pub max_header_size: ByteSize,
    /// Most header lines in one HTTP/1.1 request head; more gets 431.
    pub max_headers: usize,
    /// Most client connections open at once on the proxy listener; further ones wait to be accepted.
    pub max_connections: usize,
    /// Memory for keyed request bodies held at once, in all; a body that does not fit waits for room, then
    /// gets 503.
    pub max_buffered_bodies: ByteSize,
    /// Threads serving client connections, each with its own runtime and upstream connections; absent
    /// means one per available core.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workers: Option<usize>,
    /// How long a client may accept no bytes of its response before the proxy lets it go (its
    /// connection ends; a keyed response is still read to the end and stored).
    #[serde(with = "humantime_serde")]
    pub write_timeout: Duration,
    /// Most keyed requests being executed at once (their work outlives their clients); more get 503.
    /// Absent means `max_connections`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keyed_in_flight: Option<usize>,
    /// Most of those keyed requests one client connection may have executing at once, detached ones
    /// included (their clients gone, or their HTTP/2 streams reset); more get 503. Absent means a quarter
    /// of `max_keyed_in_flight`, at most 100 (the streams one HTTP/2 connection may have open).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_keyed_per_connection: Option<usize>,
    /// Memory for keyed responses captured for storage at once, in all; a capture that finds no room
    /// within `capture_wait` is not retained.
    pub max_buffered_responses: ByteSize,
    /// The most of `max_buffered_responses` the captures of one scope (a route's scope and one client's
    /// credentials) may hold at once, so one client's large or slow responses cannot leave no room for
    /// everyone else's. Absent means a quarter of `max_buffered_responses`, or the largest
    /// `max_stored_response` if that is more.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_buffered_responses_per_scope: Option<ByteSize>,
    /// The longest one keyed response's capture waits, in all, for room in `max_buffered_responses` (or
    /// its scope's share) before it gives up retaining the response; the response's stream to its client
    /// is slowed by no more than this. 0 gives up at once.
    #[serde(with = "humantime_serde")]
    pub capture_wait: Duration,
    /// What every problem+json `type` URI starts with; the problem's slug (`key-in-flight`, …) follows.
    /// Point it at your own documentation of the errors clients may see.
    pub problem_type_base: String,
    /// Most requests waiting at once for the original with their key (`on_in_flight = "wait"`); more get
    /// 409 at once. Absent means `max_connections`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<usize>,
    /// The most bytes a duplicate that follows a live response may fall behind it (`on_in_flight =
    /// "attach"`); one that falls further behind is cut off, its response ended with an error. Once the
    /// response is not kept for storage, also the most kept of it for its followers.
    pub attach_buffer: ByteSize,
    /// A request path not in normal form (repeated slashes, dot segments, escaped unreserved characters,
    /// lower-case escapes): `normalize` brings it to normal form before anything reads it and forwards
    /// it so; `reject` refuses it (400 `non-normal-path`).
    pub paths: PathMode,
    /// An encoded slash or backslash in a path (`%2F`, `%5C`, a raw `\`), which upstreams read in
    /// different ways: `reject` refuses it (400 `non-normal-path`); `keep` keeps it as data (it
    /// separates no segments for routes) and forwards it escaped.
    pub escaped_slashes: Ambiguous,
    /// A `;` in a path (a path parameter, which Tomcat and Jetty cut off before routing): `reject`
    /// refuses it (400 `non-normal-path`); `keep` keeps it as part of its segment.
    pub path_parameters: Ambiguous,
}

impl Default for RawServer {
    fn default() -> Self {
        RawServer {
            listen: "0.0.0.0:8080".into(),
            socket_mode: "0660".into(),
            trust_unix_forwarded_for: false,
            trusted_proxies: Vec::new(),
            admin_listen: "127.0.0.1:9090".into(),
            shutdown_grace: Duration::from_secs(30),
            tls: None,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_header_size: ByteSize::kib(64),
            max_headers: 100,
            max_connections: 1024,
            max_buffered_bodies: ByteSize::mib(256),
            workers: None,
            write_timeout: Duration::from_secs(30),
            max_keyed_in_flight: None,
            max_keyed_per_connection: None,
            max_buffered_responses: ByteSize::mib(256),
            max_buffered_responses_per_scope: None,
            capture_wait: DEFAULT_CAPTURE_WAIT,
            problem_type_base: DEFAULT_PROBLEM_TYPE_BASE.into(),
            max_waiting: None,
            attach_buffer: ByteSize::mib(1),
            paths: PathMode::Normalize,
            escaped_slashes: Ambiguous::Reject,
            path_parameters: Ambiguous::Reject,
        }
    }
}

/// `[server.tls]`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    /// PEM certificate chain, leaf first.
    pub cert_file: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// How often both files are read to see whether they changed; a changed, valid pair is used for new
    /// connections from then on, without a restart.
    #[serde(with = "humantime_serde", default = "default_reload_interval")]
    pub reload_interval: Duration,
    /// PEM certificates of the authorities client certificates are verified against; with it a client
    /// may present a certificate (routes with `scope_client_cert` scope keys by its public key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
}

fn default_reload_interval() -> Duration {
    Duration::from_secs(10)
}

/// Where the proxy listener listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A unix stream socket at this path, with these permissions (`server.socket_mode`).
    Unix {
        /// The socket file.
        path: PathBuf,
        /// Its mode bits.
        mode: u32,
    },
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Tcp(addr) => addr.fmt(f),
            ListenAddr::Unix { path, .. } => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The proxy listener's TLS: a rustls config presenting the pair `cert` holds, and the files that pair
/// is read from again every `reload_interval`.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    /// What each connection's handshake runs with.
    pub config: Arc<rustls::ServerConfig>,
    /// Whether clients may present certificates (`server.tls.client_ca`).
    pub client_certs: bool,
    /// The certificate and key new handshakes get.
    pub cert: Arc<SwappableCert>,
    /// `server.tls.cert_file`.
    pub cert_file: PathBuf,
    /// `server.tls.key_file`.
    pub key_file: PathBuf,
    /// `server.tls.reload_interval`.
    pub reload_interval: Duration,
    /// The two files' contents as loaded, certificate then key: a change is a difference from these.
    pub loaded_pem: Arc<(Vec<u8>, Vec<u8>)>,
}

/// Validated `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Proxy listener address.
    pub listen: ListenAddr,
    /// Whether a unix-socket client's `X-Forwarded-For` goes upstream as it came.
    pub trust_unix_forwarded_for: bool,
    /// The TCP peers whose `X-Forwarded-For` names the client in the access log.
    pub trusted_proxies: Arc<[IpNet]>,
    /// Admin listener address.
    pub admin_listen: SocketAddr,
    /// Drain bound after a shutdown signal.
    pub shutdown_grace: Duration,
    /// The listener's TLS settings, when TLS is on.
    pub tls: Option<ListenerTls>,
    /// Request head bound (HTTP/1.1).
    pub header_read_timeout: Duration,
    /// Request body bound.
    pub body_read_timeout: Duration,
    /// Largest request head, bytes.
    pub max_header_size: usize,
    /// Most header lines in an HTTP/1.1 request head.
    pub max_headers: usize,
    /// Most open client connections.
    pub max_connections: usize,
    /// Bytes of keyed request bodies held at once, in all.
    pub max_buffered_bodies: usize,
    /// Threads serving client connections.
    pub workers: usize,
    /// Longest a client may accept no response bytes.
    pub write_timeout: Duration,
    /// Most keyed requests executing at once.
    pub max_keyed_in_flight: usize,
    /// Most keyed requests of one connection executing at once.
    pub max_keyed_per_connection: usize,
    /// Bytes of keyed responses captured for storage at once, in all.
    pub max_buffered_responses: usize,
    /// Bytes of those one scope may hold at once; `RawConfig::validate` raises the default to the
    /// largest `max_stored_response`.
    pub max_buffered_responses_per_scope: usize,
    /// The longest one response's capture waits for room.
    pub capture_wait: Duration,
    /// The base of problem `type` URIs.
    pub problem_type_base: String,
    /// Most requests waiting for the original with their key, or following it.
    pub max_waiting: usize,
    /// Most bytes a duplicate that follows its original may fall behind it.
    pub attach_buffer: usize,
    /// How request paths are brought to their one spelling, or refused.
    pub paths: PathRules,
}

impl RawServer {
    /// This section's path settings with every other key at its default: what the routes are checked
    /// under when another key here has a problem.
    pub(super) fn paths_only(&self) -> RawServer {
        RawServer {
            paths: self.paths,
            escaped_slashes: self.escaped_slashes,
            path_parameters: self.path_parameters,
            ..RawServer::default()
        }
    }

    /// Checks the section and converts it; the first problem found is returned.
    pub fn validate(&self) -> Result<ServerConfig, ConfigError> {
        let listen = self.listen()?;
        let admin_listen = self.admin_listen()?;
        if let ListenAddr::Tcp(proxy) = &listen
            && same_port(*proxy, admin_listen)
        {
            return Err(ConfigError::new(
                "server.admin_listen",
                format!(
                    "{admin_listen} takes the port of server.listen ({proxy}), so one of the two could never \
                     listen: give the admin listener a port of its own"
                ),
            ));
        }
        Ok(ServerConfig {
            listen,
            trust_unix_forwarded_for: self.trust_unix_forwarded_for,
            trusted_proxies: trusted_proxies(&self.trusted_proxies)?,
            admin_listen,
            shutdown_grace: self.shutdown_grace,
            tls: self.tls.as_ref().map(RawServerTls::validate).transpose()?,
            header_read_timeout: positive("server.header_read_timeout", self.header_read_timeout)?,
            body_read_timeout: positive("server.body_read_timeout", self.body_read_timeout)?,
            max_header_size: self.max_header_size()?,
            max_headers: within("server.max_headers", self.max_headers, 1..=10_000)?,
            max_connections: within("server.max_connections", self.max_connections, 1..=1_000_000)?,
            max_buffered_bodies: memory(self.max_buffered_bodies),
            workers: self.workers()?,
            write_timeout: positive("server.write_timeout", self.write_timeout)?,
            max_keyed_in_flight: self.max_keyed_in_flight()?,
            max_keyed_per_connection: match self.max_keyed_per_connection {
                Some(n) => within("server.max_keyed_per_connection", n, 1..=1_000_000)?,
                None => default_keyed_per_connection(self.max_keyed_in_flight()?),
            },
            max_buffered_responses: memory(self.max_buffered_responses),
            max_buffered_responses_per_scope: self.per_scope()?,
            capture_wait: self.capture_wait()?,
            problem_type_base: self.problem_type_base()?,
            max_waiting: match self.max_waiting {
                Some(n) => within("server.max_waiting", n, 1..=1_000_000)?,
                None => self.max_connections,
            },
            attach_buffer: match memory(self.attach_buffer) {
                0 => return Err(ConfigError::new("server.attach_buffer", "must be more than 0")),
                bytes => bytes,
            },
            paths: PathRules {
                mode: self.paths,
                escaped_slashes: self.escaped_slashes,
                path_parameters: self.path_parameters,
            },
        })
    }

    fn per_scope(&self) -> Result<usize, ConfigError> {
        let total = memory(self.max_buffered_responses);
        let Some(share) = self.max_buffered_responses_per_scope else {
            return Ok(total / DEFAULT_SCOPE_SHARE_DIVISOR);
        };
        let share = memory(share);
        if share == 0 || share > total {
            return Err(ConfigError::new(
                "server.max_buffered_responses_per_scope",
                "must be more than 0 and at most server.max_buffered_responses",
            ));
        }
        Ok(share)
    }

    fn capture_wait(&self) -> Result<Duration, ConfigError> {
        if self.capture_wait > MAX_CAPTURE_WAIT {
            return Err(ConfigError::new(
                "server.capture_wait",
                "must be at most 10s: it slows the client's response",
            ));
        }
        Ok(self.capture_wait)
    }

    fn max_keyed_in_flight(&self) -> Result<usize, ConfigError> {
        match self.max_keyed_in_flight {
            Some(n) => within("server.max_keyed_in_flight", n, 1..=1_000_000),
            None => Ok(self.max_connections),
        }
    }

    fn problem_type_base(&self) -> Result<String, ConfigError> {
        let base = &self.problem_type_base;
        let absolute = base
            .parse::<http::Uri>()
            .is_ok_and(|uri| matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some());
        if !absolute || base.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(ConfigError::new(
                "server.problem_type_base",
                format!("{base:?} is not an absolute http(s) URI like \"https://docs.example.com/errors/\""),
            ));
        }
        Ok(base.clone())
    }

    fn admin_listen(&self) -> Result<SocketAddr, ConfigError> {
        if self.admin_listen.starts_with("unix:") {
            return Err(ConfigError::new(
                "server.admin_listen",
                "the admin listener is TCP only: give an address like 127.0.0.1:9090",
            ));
        }
        parse_addr("server.admin_listen", &self.admin_listen)
    }

    fn listen(&self) -> Result<ListenAddr, ConfigError> {
        let mode = socket_mode(&self.socket_mode)?;
        match self.listen.strip_prefix("unix:") {
            Some("") => Err(ConfigError::new(
                "server.listen",
                "a unix socket needs a path, like unix:/run/idemproxy.sock",
            )),
            Some(path) => Ok(ListenAddr::Unix {
                path: path.into(),
                mode,
            }),
            None => parse_addr("server.listen", &self.listen).map(ListenAddr::Tcp),
        }
    }

    fn workers(&self) -> Result<usize, ConfigError> {
        match self.workers {
            Some(workers) => within("server.workers", workers, 1..=1024),
            None => Ok(std::thread::available_parallelism().map_or(1, usize::from)),
        }
    }

    fn max_header_size(&self) -> Result<usize, ConfigError> {
        let bytes = self.max_header_size.as_u64();
        if !(8 * 1024..=16 * 1024 * 1024).contains(&bytes) {
            return Err(ConfigError::new(
                "server.max_header_size",
                "must be between 8KiB and 16MiB",
            ));
        }
        Ok(bytes as usize)
    }
}

/// The most keyed slots one connection takes by default: as many as one HTTP/2 connection may have
/// streams open (`server.rs` allows 100), so an ingress that carries many clients on one connection is
/// held back by no more than HTTP/2 already holds it.
const KEYED_PER_CONNECTION_MAX: usize = 100;

/// `server.max_keyed_per_connection` when absent: a quarter of the keyed slots, so one connection (a
/// client that resets streams as fast as it opens them, and leaves their work detached) leaves at least
/// three quarters to everyone else, and at most [`KEYED_PER_CONNECTION_MAX`].
fn default_keyed_per_connection(max_keyed_in_flight: usize) -> usize {
    (max_keyed_in_flight / 4).clamp(1, KEYED_PER_CONNECTION_MAX)
}

/// A memory budget in bytes; past what the platform can address it is as good as unbounded.
fn memory(size: ByteSize) -> usize {
    usize::try_from(size.as_u64()).unwrap_or(usize::MAX)
}

/// `server.trusted_proxies`: each an IP address (one host) or a CIDR block.
fn trusted_proxies(entries: &[String]) -> Result<Arc<[IpNet]>, ConfigError> {
    entries
        .iter()
        .enumerate()
        .map(|(index, entry)| {
            let entry = entry.trim();
            entry
                .parse::<IpNet>()
                .or_else(|_| entry.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    ConfigError::new(
                        &format!("server.trusted_proxies[{index}]"),
                        format!(
                            "{entry:?} is not an IP address or a CIDR block (like \"10.0.0.0/8\" or \"192.0.2.7\")"
                        ),
                    )
                })
        })
        .collect()
}

/// `server.socket_mode`: octal permission bits, at most `0777`.
fn socket_mode(text: &str) -> Result<u32, ConfigError> {
    match u32::from_str_radix(text, 8) {
        Ok(mode) if mode <= 0o777 => Ok(mode),
        _ => Err(ConfigError::new(
            "server.socket_mode",
            format!("{text:?} is not octal permission bits like \"0660\""),
        )),
    }
}

impl RawServerTls {
    fn validate(&self) -> Result<ListenerTls, ConfigError> {
        for (key, path) in [
            ("server.tls.cert_file", &self.cert_file),
            ("server.tls.key_file", &self.key_file),
        ] {
            if !path.is_file() {
                return Err(ConfigError::new(
                    key,
                    format!("cannot read file {}", path.display()),
                ));
            }
        }
        let reload_interval = positive("server.tls.reload_interval", self.reload_interval)?;
        let read = |key: &str, path: &PathBuf| {
            std::fs::read(path)
                .map_err(|e| ConfigError::new(key, format!("cannot read {}: {e}", path.display())))
        };
        let pem = (
            read("server.tls.cert_file", &self.cert_file)?,
            read("server.tls.key_file", &self.key_file)?,
        );
        let first = tls::certified_key(&pem.0, &pem.1, &self.cert_file, &self.key_file)
            .map_err(|e| ConfigError::new("server.tls", e))?;
        let cert = Arc::new(SwappableCert::new(first));
        let client_roots = self
            .client_ca
            .as_deref()
            .map(|ca| tls::roots_from(ca).map_err(|e| ConfigError::new("server.tls.client_ca", e)))
            .transpose()?;
        let client_certs = client_roots.is_some();
        let config =
            tls::listener(cert.clone(), client_roots).map_err(|e| ConfigError::new("server.tls", e))?;
        Ok(ListenerTls {
            config: Arc::new(config),
            client_certs,
            cert,
            cert_file: self.cert_file.clone(),
            key_file: self.key_file.clone(),
            reload_interval,
            loaded_pem: Arc::new(pem),
        })
    }
}

/// Whether listeners on `a` and `b` would take the same port: the same fixed port on the same address,
/// or on an address one of them covers (`0.0.0.0` every IPv4 one, `[::]` every one, IPv4 included).
fn same_port(a: SocketAddr, b: SocketAddr) -> bool {
    let covers = |wide: SocketAddr, other: SocketAddr| {
        wide.ip().is_unspecified() && (wide.is_ipv6() || other.is_ipv4())
    };
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || covers(a, b) || covers(b, a))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;

    #[test]
    fn listener_tls_files_are_checked_at_load() {
        let err = Config::from_toml_str(
            "[server.tls]\ncert_file = \"/nonexistent/cert.pem\"\nkey_file = \"/nonexistent/key.pem\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "server.tls.cert_file");
        let err = Config::from_toml_str(
            "[server.tls]\ncert_file = \"/etc/hostname\"\nkey_file = \"/etc/hostname\"\n",
        )
        .unwrap_err();
        assert_eq!(err.key, "server.tls", "{err}");
        let err = Config::from_toml_str("[server.tls]\ncert_file = \"/etc/hostname\"\n").unwrap_err();
        assert!(err.to_string().contains("key_file"), "{err}");
    }

    #[test]
    fn a_route_scoped_by_client_certificate_needs_a_listener_that_takes_them() {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        let ca_file = dir.path().join("clients.pem");
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        std::fs::write(&ca_file, cert.cert.pem()).unwrap();
        let tls = format!("[server.tls]\ncert_file = {cert_file:?}\nkey_file = {key_file:?}\n");
        let route = "[[routes]]\nname = \"mtls\"\npath = \"/t\"\nscope_client_cert = true\n";
        let refused = Config::from_toml_str(&format!("{tls}{route}")).unwrap_err();
        assert_eq!(refused.key, "routes[0].scope_client_cert", "{refused}");
        let refused = Config::from_toml_str("[idempotency]\nscope_client_cert = true\n").unwrap_err();
        assert_eq!(refused.key, "idempotency.scope_client_cert", "{refused}");
        let taken = Config::from_toml_str(&format!("{tls}client_ca = {ca_file:?}\n{route}")).unwrap();
        assert!(taken.server.tls.expect("TLS is on").client_certs);
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let refused = Config::from_toml_str(&format!("{tls}client_ca = {empty:?}\n")).unwrap_err();
        assert_eq!(refused.key, "server.tls.client_ca", "{refused}");
    }

    #[test]
    fn a_matching_certificate_and_key_turn_tls_on_with_h2_offered_first() {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        let toml = |cert: &std::path::Path, key: &std::path::Path| {
            format!(
                "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\n",
                cert.display().to_string(),
                key.display().to_string()
            )
        };
        let config = Config::from_toml_str(&toml(&cert_file, &key_file)).unwrap();
        let tls = config.server.tls.expect("TLS is on");
        assert_eq!(tls.reload_interval, Duration::from_secs(10));
        assert_eq!(
            tls.config.alpn_protocols,
            vec![b"h2".to_vec(), b"http/1.1".to_vec()]
        );
        assert!(Config::from_toml_str("").unwrap().server.tls.is_none());
        let swapped = Config::from_toml_str(&toml(&key_file, &cert_file)).unwrap_err();
        assert_eq!(swapped.key, "server.tls", "{swapped}");
    }

    #[test]
    fn client_bounds_parse_and_bad_ones_name_the_key() {
        let config = Config::from_toml_str(
            "[server]\nheader_read_timeout = \"2s\"\nbody_read_timeout = \"5s\"\n\
             max_header_size = \"32KiB\"\nmax_headers = 20\nmax_connections = 10\n",
        )
        .unwrap();
        assert_eq!(config.server.header_read_timeout, Duration::from_secs(2));
        assert_eq!(config.server.body_read_timeout, Duration::from_secs(5));
        assert_eq!(config.server.max_header_size, 32 * 1024);
        assert_eq!(
            (config.server.max_headers, config.server.max_connections),
            (20, 10)
        );
        for (text, key) in [
            ("header_read_timeout = \"0s\"", "server.header_read_timeout"),
            ("body_read_timeout = \"0s\"", "server.body_read_timeout"),
            ("max_header_size = \"1KiB\"", "server.max_header_size"),
            ("max_headers = 0", "server.max_headers"),
            ("max_connections = 0", "server.max_connections"),
            ("max_buffered_bodies = \"1MiB\"", "server.max_buffered_bodies"),
            ("workers = 0", "server.workers"),
            ("workers = 1025", "server.workers"),
        ] {
            let err = Config::from_toml_str(&format!("[server]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn paths_are_normalised_and_ambiguous_spellings_refused_unless_the_operator_says_otherwise() {
        use crate::config::{Ambiguous, PathMode, PathRules};
        assert_eq!(
            Config::from_toml_str("").unwrap().server.paths,
            PathRules::default()
        );
        let default = PathRules::default();
        assert_eq!(
            (default.mode, default.escaped_slashes, default.path_parameters),
            (PathMode::Normalize, Ambiguous::Reject, Ambiguous::Reject)
        );
        let config = Config::from_toml_str(
            "[server]\npaths = \"reject\"\nescaped_slashes = \"keep\"\npath_parameters = \"keep\"\n",
        )
        .unwrap();
        let want = PathRules {
            mode: PathMode::Reject,
            escaped_slashes: Ambiguous::Keep,
            path_parameters: Ambiguous::Keep,
        };
        assert_eq!(config.server.paths, want);
        for key in ["paths", "escaped_slashes", "path_parameters"] {
            let err = Config::from_toml_str(&format!("[server]\n{key} = \"sometimes\"\n")).unwrap_err();
            assert_eq!(err.key, format!("server.{key}"), "{err}");
            assert_eq!(err.to_string().lines().count(), 1, "{err}");
        }
    }

    #[test]
    fn workers_default_to_the_available_cores() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(Config::from_toml_str("").unwrap().server.workers, cores);
        let config = Config::from_toml_str("[server]\nworkers = 3\n").unwrap();
        assert_eq!(config.server.workers, 3);
    }

    #[test]
    fn guarantee_bounds_have_safe_defaults_and_named_errors() {
        let config = Config::from_toml_str("[server]\nmax_connections = 100\nworkers = 3\n").unwrap();
        assert_eq!(config.server.write_timeout, Duration::from_secs(30));
        assert_eq!(config.server.max_keyed_in_flight, 100);
        assert_eq!(config.server.max_waiting, 100);
        assert_eq!(config.server.max_keyed_per_connection, 25, "a quarter");
        let share = |text: &str| {
            Config::from_toml_str(&format!("[server]\n{text}\n"))
                .unwrap()
                .server
                .max_keyed_per_connection
        };
        assert_eq!(
            share(""),
            100,
            "1024 slots: no more than one HTTP/2 connection's streams"
        );
        assert_eq!(share("max_keyed_in_flight = 2"), 1);
        assert_eq!(share("max_keyed_per_connection = 7"), 7);
        for (text, key) in [
            ("[server]\nwrite_timeout = \"0s\"", "server.write_timeout"),
            ("[server]\nmax_keyed_in_flight = 0", "server.max_keyed_in_flight"),
            (
                "[server]\nmax_keyed_per_connection = 0",
                "server.max_keyed_per_connection",
            ),
            ("[server]\nmax_waiting = 0", "server.max_waiting"),
            (
                "[server]\nmax_buffered_responses = \"1MiB\"",
                "server.max_buffered_responses",
            ),
            (
                "[server]\nmax_buffered_responses_per_scope = \"0B\"",
                "server.max_buffered_responses_per_scope",
            ),
            (
                "[server]\nmax_buffered_responses_per_scope = \"300MiB\"",
                "server.max_buffered_responses_per_scope",
            ),
            (
                "[server]\nmax_buffered_responses_per_scope = \"1MiB\"",
                "server.max_buffered_responses_per_scope",
            ),
            ("[server]\ncapture_wait = \"11s\"", "server.capture_wait"),
            ("[server]\ncapture_wait = \"briefly\"", "server.capture_wait"),
        ] {
            let err = Config::from_toml_str(text).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn each_scope_gets_a_quarter_of_the_capture_budget_unless_told_otherwise() {
        let config = Config::from_toml_str("").unwrap();
        assert_eq!(config.server.max_buffered_responses_per_scope, 64 << 20);
        assert_eq!(config.server.capture_wait, Duration::from_millis(250));
        let small = Config::from_toml_str(
            "[server]\nmax_buffered_responses = \"8MiB\"\n[idempotency]\nmax_stored_response = \"4MiB\"\n",
        )
        .unwrap();
        assert_eq!(
            small.server.max_buffered_responses_per_scope,
            4 << 20,
            "never less than the largest response"
        );
        let written = Config::from_toml_str(
            "[server]\nmax_buffered_responses_per_scope = \"128MiB\"\ncapture_wait = \"0s\"\n",
        )
        .unwrap();
        assert_eq!(written.server.max_buffered_responses_per_scope, 128 << 20);
        assert_eq!(written.server.capture_wait, Duration::ZERO);
    }

    #[test]
    fn the_admin_listener_may_not_take_the_proxy_listeners_port() {
        for (listen, admin) in [
            (":8080", ":8080"),
            (":8080", "localhost:8080"),
            ("localhost:8080", "127.0.0.1:8080"),
            ("127.0.0.1:8080", "[::]:8080"),
        ] {
            let toml = format!("[server]\nlisten = \"{listen}\"\nadmin_listen = \"{admin}\"\n");
            let err = crate::Config::from_toml_str(&toml).unwrap_err();
            assert_eq!(err.key, "server.admin_listen", "{listen} {admin}: {err}");
            assert!(err.message.contains("a port of its own"), "{err}");
        }
        for (listen, admin) in [
            (":0", ":0"),
            (":8080", "127.0.0.1:9090"),
            ("127.0.0.2:8080", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "[::1]:8080"),
            ("unix:/run/idemproxy.sock", "127.0.0.1:8080"),
        ] {
            let toml = format!("[server]\nlisten = \"{listen}\"\nadmin_listen = \"{admin}\"\n");
            assert!(crate::Config::from_toml_str(&toml).is_ok(), "{listen} {admin}");
        }
    }

    #[test]
    fn a_unix_listener_takes_the_socket_mode_and_the_admin_listener_stays_tcp() {
        use super::ListenAddr;
        let config = Config::from_toml_str("[server]\nlisten = \"unix:/run/idemproxy.sock\"\n").unwrap();
        assert_eq!(
            config.server.listen,
            ListenAddr::Unix {
                path: "/run/idemproxy.sock".into(),
                mode: 0o660
            }
        );
        let config = Config::from_toml_str(
            "[server]\nlisten = \"unix:/run/idemproxy.sock\"\nsocket_mode = \"0600\"\n",
        )
        .unwrap();
        assert!(matches!(
            config.server.listen,
            ListenAddr::Unix { mode: 0o600, .. }
        ));
        for (text, key) in [
            ("listen = \"unix:\"", "server.listen"),
            ("admin_listen = \"unix:/run/admin.sock\"", "server.admin_listen"),
            ("socket_mode = \"0999\"", "server.socket_mode"),
            ("socket_mode = \"1777\"", "server.socket_mode"),
            ("socket_mode = \"rw\"", "server.socket_mode"),
        ] {
            let err = Config::from_toml_str(&format!("[server]\n{text}\n")).unwrap_err();
            assert_eq!(err.key, key, "{err}");
        }
    }

    #[test]
    fn trusted_proxies_are_addresses_or_cidr_blocks() {
        let config = Config::from_toml_str(
            "[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"192.0.2.7\", \"2001:db8::/32\"]\n",
        )
        .unwrap();
        let nets: Vec<String> = config
            .server
            .trusted_proxies
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(nets, ["10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"]);
        for bad in ["10.0.0.0/33", "example.com", ""] {
            let err = Config::from_toml_str(&format!(
                "[server]\ntrusted_proxies = [\"10.0.0.1\", \"{bad}\"]\n"
            ))
            .unwrap_err();
            assert_eq!(err.key, "server.trusted_proxies[1]", "{err}");
            assert!(
                err.to_string().contains("is not an IP address or a CIDR block"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_certificate_reload_interval_must_be_positive() {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).unwrap();
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).unwrap();
        let toml = |interval: &str| {
            format!(
                "[server.tls]\ncert_file = {:?}\nkey_file = {:?}\nreload_interval = \"{interval}\"\n",
                cert_file.display().to_string(),
                key_file.display().to_string()
            )
        };
        let config = Config::from_toml_str(&toml("2s")).unwrap();
        assert_eq!(config.server.tls.unwrap().reload_interval, Duration::from_secs(2));
        let err = Config::from_toml_str(&toml("0s")).unwrap_err();
        assert_eq!(err.key, "server.tls.reload_interval", "{err}");
    }
}
