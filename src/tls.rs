//! TLS settings, built once at start-up from the configuration: the proxy listener's server config (with
//! ALPN for HTTP/2 and HTTP/1.1) and the store's client config. Both use rustls with the ring provider.

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// What is wrong with a TLS setting, naming the file it came from.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The listener's TLS: the certificate chain and private key from PEM files, ALPN offering `h2` then
/// `http/1.1`.
pub fn server_config(cert_file: &Path, key_file: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = certificates(cert_file)?;
    if chain.is_empty() {
        return Err(TlsError(format!("no certificate in {}", cert_file.display())));
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .map_err(|e| TlsError(format!("no usable private key in {}: {e}", key_file.display())))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError(format!("certificate and key do not fit together: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
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
