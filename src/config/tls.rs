//! The TLS material the configuration reads from PEM files, at load and (for the listener's certificate)
//! whenever `server.rs` finds its files changed: certificate chains, private keys, trusted roots, and
//! rustls configs built from them with the ring provider. Touches only the files it is given; each error
//! names the file it came from, and the caller names the key.

use std::path::Path;
use std::sync::{Arc, RwLock};

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// The crypto provider every TLS config here is built with.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate in a PEM file, in order; none is an error.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate in {}", path.display()));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| format!("no usable private key in {}: {e}", path.display()))
}

/// The system's CA certificates (which honour `SSL_CERT_FILE` and `SSL_CERT_DIR`), plus those in
/// `ca_file`. May be empty when the system has none and no file is given.
pub fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    if let Some(path) = ca_file {
        for cert in certificates(path)? {
            roots
                .add(cert)
                .map_err(|e| format!("bad CA certificate in {}: {e}", path.display()))?;
        }
    }
    Ok(roots)
}

/// Only the authorities in `ca_file` (no system roots): whom the listener takes client certificates from.
pub fn roots_from(ca_file: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(ca_file)? {
        roots
            .add(cert)
            .map_err(|e| format!("bad CA certificate in {}: {e}", ca_file.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("no CA certificate in {}", ca_file.display()));
    }
    Ok(roots)
}

/// A certificate chain and its private key, from the PEM files' contents, checked to belong together:
/// what a listener presents. The paths only name the files in errors.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_file: &Path,
    key_file: &Path,
) -> Result<Arc<CertifiedKey>, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read certificates from {}: {e}", cert_file.display()))?;
    if chain.is_empty() {
        return Err(format!("no certificate in {}", cert_file.display()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("no usable private key in {}: {e}", key_file.display()))?;
    let certified = CertifiedKey::from_der(chain, key, &provider()).map_err(|e| {
        format!(
            "certificate {} and key {} do not fit together: {e}",
            cert_file.display(),
            key_file.display()
        )
    })?;
    Ok(Arc::new(certified))
}

/// A client config trusting `roots`, presenting `client` (chain and key) when given, offering ALPN
/// `http/1.1` only: the upstream pool speaks HTTP/1.1.
pub fn http1_client(
    roots: RootCertStore,
    client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<rustls::ClientConfig, String> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let mut config = match client {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(|e| format!("client certificate and key do not fit together: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The listener's certificate, swappable while it serves: every new TLS handshake takes the pair held
/// now; a connection already made keeps the one it was made with. `server.rs` swaps in a new pair when
/// `[server.tls]`'s files change.
#[derive(Debug)]
pub struct SwappableCert {
    current: RwLock<Arc<CertifiedKey>>,
}

impl SwappableCert {
    /// Serving `first`.
    pub fn new(first: Arc<CertifiedKey>) -> SwappableCert {
        SwappableCert {
            current: RwLock::new(first),
        }
    }

    /// The pair new handshakes get.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// New handshakes get `next` from now on.
    pub fn swap(&self, next: Arc<CertifiedKey>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
    }
}

impl ResolvesServerCert for SwappableCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// A listener config presenting whatever `cert` holds, offering ALPN `h2` then `http/1.1`.
pub fn listener(
    cert: Arc<SwappableCert>,
    client_roots: Option<RootCertStore>,
) -> Result<rustls::ServerConfig, String> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_roots {
        // A client may present a certificate, which must then chain to `client_roots`; one without
        // is served too (routes decide whether a keyed request needs one: `scope_client_cert`).
        Some(roots) => {
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                    .allow_unauthenticated()
                    .build()
                    .map_err(|e| format!("server.tls.client_ca: {e}"))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_cert_resolver(cert);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
