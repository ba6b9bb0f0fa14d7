//! The PostgreSQL store's TLS client settings, built by `connect.rs` when `store.url`'s `sslmode` may use
//! TLS: rustls with the ring provider, trusting the system's CA certificates and `store.tls_ca_file`,
//! verifying the server's certificate chain always and its host name unless the mode is `verify-ca`.
//! (The listener's and the upstream's TLS are read from their files with the rest of the configuration,
//! in `config/tls.rs`.)

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use crate::config::SslMode;
use crate::config::tls::{provider, roots, roots_from};

/// What is wrong with a TLS setting, naming the file it came from.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(String);

/// The store's TLS under `mode`: the server's certificate chain is verified against the system's CA
/// certificates plus those in `ca_file`, and its host name too unless `mode` is `verify-ca`.
pub fn client_config(ca_file: Option<&Path>, mode: SslMode) -> Result<rustls::ClientConfig, TlsError> {
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(verifier(ca_file, mode)?)
        .with_no_client_auth())
}

/// How the server's certificate is checked under `mode`: webpki's chain and host name checks against
/// the trusted CA certificates, or under `verify-ca` the chain alone, to the CAs of `ca_file` only: with
/// no name checked, a certificate any public CA of the system's signed (for any name, anyone's) would
/// do, so libpq too never takes the system's CAs for `verify-ca`.
fn verifier(ca_file: Option<&Path>, mode: SslMode) -> Result<Arc<dyn ServerCertVerifier>, TlsError> {
    let roots = match (mode.verifies_host_name(), ca_file) {
        (true, _) => roots(ca_file).map_err(TlsError)?,
        (false, Some(ca_file)) => roots_from(ca_file).map_err(TlsError)?,
        (false, None) => {
            return Err(TlsError(
                "sslmode=verify-ca trusts only the CAs of store.tls_ca_file, and none is set".into(),
            ));
        }
    };
    if roots.is_empty() {
        return Err(TlsError(
            "no trusted CA certificates; set store.tls_ca_file".into(),
        ));
    }
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| TlsError(e.to_string()))?;
    if mode.verifies_host_name() {
        return Ok(webpki);
    }
    Ok(Arc::new(ChainOnly(webpki)))
}

/// `sslmode=verify-ca`: the certificate must chain to a trusted CA, as webpki checks it, whatever name
/// it carries. webpki checks the chain before the name, so a name error means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now);
        match verified {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for `db.internal` signed by its own CA, and that CA in a file.
    fn signed() -> (CertificateDer<'static>, tempfile::NamedTempFile) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.clone().self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["db.internal".into()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), ca.pem()).unwrap();
        (leaf.der().clone(), file)
    }

    fn verify(mode: SslMode, ca: &Path, leaf: &CertificateDer<'_>, name: &str) -> bool {
        let name = ServerName::try_from(name.to_owned()).unwrap();
        verifier(Some(ca), mode)
            .unwrap()
            .verify_server_cert(leaf, &[], &name, &[], UnixTime::now())
            .is_ok()
    }

    #[test]
    fn verify_full_checks_the_host_name_and_verify_ca_only_the_chain() {
        let (leaf, ca) = signed();
        assert!(verify(SslMode::VerifyFull, ca.path(), &leaf, "db.internal"));
        assert!(!verify(SslMode::VerifyFull, ca.path(), &leaf, "other.internal"));
        assert!(!verify(SslMode::Require, ca.path(), &leaf, "other.internal"));
        assert!(verify(SslMode::VerifyCa, ca.path(), &leaf, "other.internal"));
        let (_, stranger) = signed();
        assert!(
            !verify(SslMode::VerifyCa, stranger.path(), &leaf, "db.internal"),
            "verify-ca still needs a trusted chain"
        );
    }

    #[test]
    fn verify_ca_needs_store_tls_ca_file_and_trusts_only_it() {
        let Err(error) = verifier(None, SslMode::VerifyCa) else {
            panic!("verify-ca took the system's CAs");
        };
        assert!(error.to_string().contains("store.tls_ca_file"), "{error}");
    }
}
