//! Reads one key set from its source: a file, or a GET over the proxy's own HTTP client (hyper with
//! rustls, verifying https against the system's authorities and the set's `ca_file`), one connection
//! per read (reads are minutes apart), bounded in time and size. A redirect is not followed: the URL
//! configured is the one trusted.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::RootCertStore;

use crate::config::JwksSource;
use crate::config::jwk_set::{Keys, MAX_BYTES};
use crate::config::tls;

/// The longest a scheduled read may take, connection and body included.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The set `source` holds now, read within `limit`.
pub async fn read(source: &JwksSource, limit: Duration) -> Result<Keys, String> {
    let bytes = match source {
        JwksSource::File(path) => tokio::fs::read(path).await.map_err(|e| e.to_string())?.into(),
        JwksSource::Url { url, ca_file } => tokio::time::timeout(limit, get(url, ca_file.as_deref()))
            .await
            .map_err(|_| format!("no whole answer within {limit:?}"))??,
    };
    Keys::parse(&bytes)
}

async fn get(url: &url::Url, ca_file: Option<&std::path::Path>) -> Result<Bytes, String> {
    // The system's authorities are read only for https: an http set (on a loopback address) needs none.
    let roots = if url.scheme() == "https" {
        tls::roots(ca_file)?
    } else {
        RootCertStore::empty()
    };
    let config = rustls::ClientConfig::builder_with_provider(tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_or_http()
        .enable_http1()
        .build();
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
    let request = Request::get(url.as_str())
        .header(header::ACCEPT, "application/jwk-set+json, application/json")
        .header(
            header::USER_AGENT,
            concat!("idemproxy/", env!("CARGO_PKG_VERSION")),
        )
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let response = client
        .request(request)
        .await
        .map_err(|e| crate::error_chain::error_chain(&e))?;
    if response.status() != StatusCode::OK {
        return Err(format!("answered {}", response.status()));
    }
    let body = Limited::new(response.into_body(), MAX_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?;
    Ok(body.to_bytes())
}
