//! Certificates for TLS tests, made in the test with rcgen: a CA, and leaves it signs for servers and
//! clients, written to PEM files in a temporary directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

/// A test certificate authority.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate the CA issued, with its key.
pub struct Leaf {
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        TestCa { issuer }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf for `names` (DNS names or IP addresses) with the common name `subject`.
    pub fn issue(&self, subject: &str, names: &[&str]) -> Leaf {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, subject);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A leaf for the client `subject` on the key `key_pem` (PEM): a certificate renewed on its key is
    /// this again with the same key.
    pub fn issue_on_key(&self, subject: &str, key_pem: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, subject);
        let key = KeyPair::from_pem(key_pem).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Trust in this CA alone.
    pub fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.issuer.der().clone()).unwrap();
        roots
    }

    /// A client config trusting this CA alone.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.roots())
            .with_no_client_auth();
        Arc::new(config)
    }
}

impl Leaf {
    /// The certificate as DER, as a peer sees it.
    pub fn der(&self) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).unwrap()
    }

    /// A server config presenting this leaf; with `client_ca`, requiring a client certificate it signed.
    pub fn server_config(&self, client_ca: Option<&TestCa>) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = match client_ca {
            Some(ca) => {
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(ca.roots()),
                    provider,
                )
                .build()
                .unwrap();
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).unwrap();
        Arc::new(builder.with_single_cert(vec![self.der()], key).unwrap())
    }

    /// Writes `<stem>.crt` and `<stem>.key` in `dir`, each by an atomic rename, and returns their paths.
    pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        write_atomically(&cert, &self.cert_pem);
        write_atomically(&key, &self.key_pem);
        (cert, key)
    }
}

/// Replaces `path` with `contents` in one rename, as Kubernetes and most deploy tools do.
pub fn write_atomically(path: &Path, contents: &str) {
    let staged = PathBuf::from(format!("{}.staged", path.display()));
    std::fs::write(&staged, contents).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// `path` as a TOML string value.
pub fn toml_path(path: &Path) -> String {
    path.to_str().expect("UTF-8 temp path").to_owned()
}
