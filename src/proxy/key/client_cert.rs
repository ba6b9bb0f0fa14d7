//! Who a client is by its TLS client certificate (`scope_client_cert`, with `server.tls.client_ca`): the
//! SHA-256 of the certificate's subject public key info, so a certificate renewed on the same key names
//! the same client and one on another key another. Read once per connection, after the handshake
//! (`server.rs`), and carried on each of its requests. Pure functions of the certificate.

use sha2::{Digest, Sha256};

/// A client certificate's SHA-256 of its subject public key info, on the requests of the connection
/// that presented it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientCert(pub [u8; 32]);

impl ClientCert {
    /// The identity of the certificate `der` (the leaf the client presented, already verified against
    /// `server.tls.client_ca`); `None` for one that does not parse as X.509.
    pub fn of(der: &[u8]) -> Option<ClientCert> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        Some(ClientCert(
            Sha256::digest(cert.tbs_certificate.subject_pki.raw).into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(key: &rcgen::KeyPair, name: &str) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.self_signed(key).unwrap().der().to_vec()
    }

    #[test]
    fn a_certificate_renewed_on_its_key_is_the_same_client_and_another_key_another() {
        let key = rcgen::KeyPair::generate().unwrap();
        let first = ClientCert::of(&cert(&key, "client-1")).unwrap();
        let renewed = ClientCert::of(&cert(&key, "client-1-renewed")).unwrap();
        assert_eq!(first, renewed);
        let other = ClientCert::of(&cert(&rcgen::KeyPair::generate().unwrap(), "client-1")).unwrap();
        assert_ne!(first, other);
        assert_eq!(ClientCert::of(b"not a certificate"), None);
    }
}
