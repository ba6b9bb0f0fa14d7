//! The store's TLS client settings, built by `store/postgres.rs` when its URL asks for TLS: rustls with the
//! ring provider, trusting the system's CA certificates and `store.tls_ca_file`. (The listener's TLS is
//! read from its files with the rest of `[server]`, in `config/server.rs`.)

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// What is wrong with a TLS setting, naming the file it came from.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The store's TLS: the server's certificate and name are verified against the system's CA certificates
/// plus those in `ca_file`.
pub fn client_config(ca_file: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    if let Some(path) = ca_file {
        for cert in certificates(path)? {
            roots
                .add(cert)
                .map_err(|e| TlsError(format!("bad CA certificate in {}: {e}", path.display())))?;
        }
    }
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

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError(format!("cannot read certificates from {}: {e}", path.display())))
}
