//! `idemproxy reload`: asks a running proxy to read its configuration again (`POST /-/reload` on its
//! admin listener, which does what SIGHUP does, for a container image with no `kill`), and prints what
//! was applied and what waits for a restart. Runs in its own short-lived process; reads only the admin
//! address from the configuration.

use std::path::Path;
use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;

use super::health::{self, HealthError};
use crate::config::{Config, Overrides};

/// The admin listener's answer to `POST /-/reload`.
#[derive(Debug, Deserialize)]
pub struct Answer {
    /// Whether the configuration was reloaded.
    pub reloaded: bool,
    /// The settings applied to new requests.
    #[serde(default)]
    pub applied: Vec<String>,
    /// The changed settings that wait for a restart.
    #[serde(default)]
    pub restart: Vec<String>,
    /// Why the configuration was refused.
    #[serde(default)]
    pub error: Option<String>,
}

/// Why the reload was not done, in one line.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The admin listener could not be asked (not running, another port, no answer).
    #[error(transparent)]
    Admin(#[from] HealthError),
    /// The proxy refused the configuration it read; it keeps the running one.
    #[error("{url}: configuration not reloaded, the running one is kept: {error}")]
    Refused {
        /// The endpoint asked.
        url: String,
        /// The proxy's reason.
        error: String,
    },
    /// The address is not an idemproxy admin listener (the proxy's own port, whose requests go to the
    /// app, or another program): nothing was asked of it.
    #[error(
        "{url}: does not answer as idemproxy's admin listener (GET answered {status}, not 405 with Allow: \
         POST), so no reload was asked of it: give the admin address (server.admin_listen, \
         --admin-listen), not the proxy's own port"
    )]
    NotAdmin {
        /// The endpoint probed.
        url: String,
        /// What the GET answered.
        status: StatusCode,
    },
    /// An answer this command does not understand (another program on that port?).
    #[error("{url}: unexpected answer: status {status}: {body}")]
    Unexpected {
        /// The endpoint asked.
        url: String,
        /// Its status.
        status: StatusCode,
        /// Its body, cut short.
        body: String,
    },
}

/// Loads the configuration from `file` and `overrides` (as `serve` would) for the admin address, and
/// asks the proxy there to reload, waiting at most `timeout` for its answer.
pub async fn run(
    file: Option<&Path>,
    overrides: &Overrides,
    timeout: Duration,
) -> Result<Answer, ReloadError> {
    let config = Config::load(file, overrides).map_err(HealthError::from)?;
    let addr = health::reachable(config.server.admin_listen);
    let url = format!("http://{addr}/-/reload");
    let asked = async {
        // A GET first, which an admin listener refuses and which is safe to send anywhere: on the
        // proxy's own port a POST would be forwarded to the app, and run there.
        let probe = health::call(addr, Method::GET, "/-/reload", &url).await?;
        let allow = probe.headers().get(http::header::ALLOW).map(|v| v.as_bytes());
        if probe.status() != StatusCode::METHOD_NOT_ALLOWED || allow != Some(b"POST".as_slice()) {
            return Ok(Err(probe.status()));
        }
        let response = health::call(addr, Method::POST, "/-/reload", &url).await?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Ok::<_, HealthError>(Ok((status, body)))
    };
    let answered = tokio::time::timeout(timeout, asked)
        .await
        .map_err(|_| HealthError::Timeout {
            url: url.clone(),
            timeout,
        })??;
    let (status, body) = answered.map_err(|status| ReloadError::NotAdmin {
        url: url.clone(),
        status,
    })?;
    let answer: Option<Answer> = serde_json::from_slice(&body).ok();
    match answer {
        Some(answer) if answer.reloaded && status == StatusCode::OK => Ok(answer),
        Some(Answer {
            reloaded: false,
            error: Some(error),
            ..
        }) => Err(ReloadError::Refused { url, error }),
        _ => Err(ReloadError::Unexpected {
            url,
            status,
            body: String::from_utf8_lossy(&body[..body.len().min(200)])
                .trim()
                .to_owned(),
        }),
    }
}
