//! Opens one connection to the upstream, when the pool (`pool.rs`) has no idle one and room for another:
//! TCP (no delay, keep-alive probes), TLS over TCP (rustls, the upstream's certificate verified as
//! `[upstream.tls]` says, ALPN as `upstream.protocol` says), or a unix stream socket. Touches only the socket it opens.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::AlertDescription;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use crate::config::UpstreamAddress;

/// TCP keep-alive probes on upstream connections, so a vanished upstream host is noticed.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// A connection to the upstream, whichever way it was made. An enum rather than a boxed trait object:
/// each read and write is a match, not an indirect call.
pub enum Stream {
    /// Cleartext TCP.
    Tcp(TcpStream),
    /// TLS over TCP; boxed, being much larger than the others.
    Tls(Box<TlsStream<TcpStream>>),
    /// A unix stream socket.
    Unix(UnixStream),
}

impl Stream {
    /// Whether the stream is TLS.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// Whether the upstream agreed to HTTP/2 in the TLS handshake (ALPN `h2`).
    pub fn agreed_h2(&self) -> bool {
        match self {
            Stream::Tls(tls) => tls.get_ref().1.alpn_protocol() == Some(b"h2"),
            _ => false,
        }
    }
}

/// Connects to `address`; the error says what failed, in one line (a failed TLS handshake as
/// `upstream TLS handshake failed: <rustls's reason>`).
pub async fn connect(address: &UpstreamAddress) -> Result<Stream, String> {
    match address {
        UpstreamAddress::Http { authority } => tcp(authority).await.map(Stream::Tcp),
        UpstreamAddress::Https {
            authority,
            server_name,
            tls,
        } => {
            let tcp = tcp(authority).await?;
            let tls = TlsConnector::from(tls.clone())
                .connect(server_name.clone(), tcp)
                .await
                .map_err(|e| format!("upstream TLS handshake failed: {e}"))?;
            Ok(Stream::Tls(Box::new(tls)))
        }
        UpstreamAddress::Unix { path } => UnixStream::connect(path)
            .await
            .map(Stream::Unix)
            .map_err(|e| e.to_string()),
    }
}

async fn tcp(authority: &str) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(authority).await.map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let keepalive = socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE);
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
    Ok(stream)
}

/// Whether `error` (or one of its causes) is the upstream's TLS layer refusing the handshake with an
/// alert only a handshake sends, such as `certificate_required` for a missing client certificate. Under
/// TLS 1.3 that alert arrives after the client has written its request, yet the upstream's application
/// never saw the request.
pub fn refused_handshake(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        let tls = error
            .downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .or_else(|| error.downcast_ref::<rustls::Error>());
        if let Some(rustls::Error::AlertReceived(alert)) = tls {
            return is_handshake_alert(*alert);
        }
        cause = error.source();
    }
    false
}

fn is_handshake_alert(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::HandshakeFailure
            | AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::CertificateRequired
    )
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}
