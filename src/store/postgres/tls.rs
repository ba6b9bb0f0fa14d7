//! The PostgreSQL store's TLS client settings, built by `connect.rs` when `store.url` asks for TLS: rustls with the
//! ring provider, trusting the system's CA certificates and `store.tls_ca_file`. (The listener's and the
//! upstream's TLS are read from their files with the rest of the configuration, in `config/tls.rs`.)

use std::path::Path;

use crate::config::tls::{provider, roots};

/// What is wrong with a TLS setting, naming the file it came from.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

/// The store's TLS: the server's certificate and name are verified against the system's CA certificates
/// plus those in `ca_file`.
pub fn client_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let roots = roots(ca_file).map_err(TlsError)?;
    if roots.is_empty() {
        return Err(TlsError(
            "no trusted CA certificates; set store.tls_ca_file".into(),
        ));
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
