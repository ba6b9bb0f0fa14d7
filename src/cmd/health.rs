//! `idemproxy health`: a probe for a container's HEALTHCHECK (a scratch image has no curl). Runs in its own
//! short-lived process beside a running proxy: one GET of the admin listener's `/readyz` (or `/healthz`)
//! over hyper's HTTP/1.1 client, within a timeout. Reads only the admin address from the configuration;
//! never opens the store.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use http::{HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::Empty;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::config::{Config, ConfigError, Overrides};

/// Why the probe failed, in one line.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// The configuration does not load, so there is no admin address to probe.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Nothing answered the connection.
    #[error("{url}: cannot connect: {source}")]
    Connect {
        /// The probed URL.
        url: String,
        /// The socket error (connection refused, ...).
        source: std::io::Error,
    },
    /// The listener took the connection but said nothing useful.
    #[error("{url}: {source}")]
    Http {
        /// The probed URL.
        url: String,
        /// What hyper saw.
        source: hyper::Error,
    },
    /// No answer within the timeout.
    #[error("{url}: no answer within {}", humantime::format_duration(*timeout))]
    Timeout {
        /// The probed URL.
        url: String,
        /// The bound.
        timeout: Duration,
    },
    /// An answer other than 200.
    #[error("{url}: status {status}")]
    Status {
        /// The probed URL.
        url: String,
        /// What it answered.
        status: StatusCode,
    },
}

/// Which endpoint to probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// `/readyz`: 200 only while the store answers.
    Ready,
    /// `/healthz`: 200 while the process runs.
    Live,
}

impl Probe {
    fn path(self) -> &'static str {
        match self {
            Probe::Ready => "/readyz",
            Probe::Live => "/healthz",
        }
    }
}

/// Where to reach a listener bound to `addr`: an unspecified address (`0.0.0.0`, `[::]`) is reached
/// on the loopback address of its family.
pub fn reachable(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

/// Loads the configuration from `file` and `overrides` (as `serve` would) and probes its admin listener.
pub async fn run(
    file: Option<&Path>,
    overrides: &Overrides,
    probe: Probe,
    timeout: Duration,
) -> Result<(), HealthError> {
    let config = Config::load(file, overrides)?;
    check(config.server.admin_listen, probe, timeout).await
}

/// GETs the probe's path on the admin listener at `admin` (as configured); `Ok` on 200.
pub async fn check(admin: SocketAddr, probe: Probe, timeout: Duration) -> Result<(), HealthError> {
    let addr = reachable(admin);
    let url = format!("http://{addr}{}", probe.path());
    match tokio::time::timeout(timeout, call(addr, Method::GET, probe.path(), &url)).await {
        Ok(Ok(response)) if response.status() == StatusCode::OK => Ok(()),
        Ok(Ok(response)) => Err(HealthError::Status {
            url,
            status: response.status(),
        }),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(HealthError::Timeout { url, timeout }),
    }
}

/// Sends `method` `path` to the admin listener at `addr` (`url` names it in errors) and returns the
/// answer, its body unread.
pub(crate) async fn call(
    addr: SocketAddr,
    method: Method,
    path: &'static str,
    url: &str,
) -> Result<Response<Incoming>, HealthError> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|source| HealthError::Connect {
            url: url.to_owned(),
            source,
        })?;
    let http = |source| HealthError::Http {
        url: url.to_owned(),
        source,
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    tokio::spawn(connection);
    let mut request = Request::new(Empty::<bytes::Bytes>::new());
    *request.method_mut() = method;
    *request.uri_mut() = Uri::from_static(path);
    if let Ok(host) = HeaderValue::from_str(&addr.to_string()) {
        request.headers_mut().insert(header::HOST, host);
    }
    sender.send_request(request).await.map_err(http)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_address_is_reached_on_loopback() {
        let cases = [
            ("0.0.0.0:9090", "127.0.0.1:9090"),
            ("[::]:9090", "[::1]:9090"),
            ("10.1.2.3:9090", "10.1.2.3:9090"),
            ("127.0.0.1:1", "127.0.0.1:1"),
        ];
        for (bound, reached) in cases {
            let bound: SocketAddr = bound.parse().unwrap();
            assert_eq!(reachable(bound).to_string(), reached);
        }
    }
}
