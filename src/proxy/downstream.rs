//! The client side of a connection, made once per connection and shared by its requests and their
//! detached work: what the upstream is told about the client (`X-Forwarded-For`, `X-Forwarded-Proto`),
//! the address the access log gives it (`access.rs`), the connection's share of keyed slots, and what its
//! connection is told of its bodies.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::header::{Entry, HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::client_body::BodyWatch;
use crate::access::Client as LoggedClient;

pub(crate) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The client side of a connection: what the upstream is told about it, and the connection's share of
/// keyed slots. Made once per connection and shared by its requests (and by their detached work).
#[derive(Debug, Clone)]
pub struct Downstream(Arc<Client>);

struct Client {
    /// How the client reached the proxy.
    peer: Peer,
    /// What `X-Forwarded-For` says of the client.
    forwarded_for: ForwardedFor,
    /// Whether the client connected over TLS.
    tls: bool,
    /// One permit per keyed request of this connection being executed (`server.max_keyed_per_connection`).
    keyed: Arc<Semaphore>,
    /// What the connection is told of its requests' bodies (`server/slots.rs`), if anything.
    watch: Option<Arc<dyn BodyWatch>>,
    /// The proxies trusted to name their client in `X-Forwarded-For` (`server.trusted_proxies`), when
    /// this TCP peer is one of them.
    trusted: Option<Arc<[IpNet]>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("forwarded_for", &self.forwarded_for)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// How a connection's client reached the proxy.
#[derive(Debug, Clone, Copy)]
pub enum Peer {
    /// Over TCP, from this address.
    Tcp(SocketAddr),
    /// Over the unix socket; its own `X-Forwarded-For` goes on only if `trusted`
    /// (`server.trust_unix_forwarded_for`).
    Unix {
        /// Whether its `X-Forwarded-For` is passed on as it came.
        trusted: bool,
    },
}

/// What the upstream's `X-Forwarded-For` is made of, for one connection's requests.
#[derive(Debug)]
enum ForwardedFor {
    /// The client's IP address, appended to the chain the client sent (a TCP client): the upstream
    /// trusts the last entry, which the proxy wrote.
    Append(HeaderValue),
    /// The chain as the client sent it: a unix-socket client trusted to write it
    /// (`server.trust_unix_forwarded_for`), such as an ingress that alone can reach the socket.
    AsSent,
    /// No chain: a unix-socket client has no address to append, and a chain it wrote is not taken as
    /// given (the upstream would read its last entry as the proxy's word).
    Removed,
}

impl Downstream {
    /// The client of a connection, over TLS or not, that may run `keyed_share` keyed requests at once
    /// and whose bodies are reported to `watch`.
    pub fn new(peer: Peer, tls: bool, keyed_share: usize, watch: Option<Arc<dyn BodyWatch>>) -> Downstream {
        let forwarded_for = match peer {
            Peer::Tcp(addr) => ForwardedFor::Append(
                HeaderValue::from_str(&addr.ip().to_string())
                    .expect("an IP address in text is a valid header value"),
            ),
            Peer::Unix { trusted: true } => ForwardedFor::AsSent,
            Peer::Unix { trusted: false } => ForwardedFor::Removed,
        };
        Downstream(Arc::new(Client {
            peer,
            forwarded_for,
            tls,
            keyed: Arc::new(Semaphore::new(keyed_share.min(Semaphore::MAX_PERMITS))),
            watch,
            trusted: None,
        }))
    }

    /// The same client, whose `X-Forwarded-For` names the client in the access log when its TCP peer is
    /// one of `proxies` (`server.trusted_proxies`). Made before the connection's requests share it.
    pub fn trusting(mut self, proxies: &Arc<[IpNet]>) -> Downstream {
        if let Peer::Tcp(addr) = self.0.peer
            && trusted(proxies, addr.ip())
            && let Some(client) = Arc::get_mut(&mut self.0)
        {
            client.trusted = Some(proxies.clone());
        }
        self
    }

    /// Where a request with `headers` came from, for its access line: the TCP peer's address, unless
    /// the peer is a trusted proxy (`server.trusted_proxies`): then, walking its `X-Forwarded-For` from
    /// the right, the first address that is not itself a trusted proxy (the peer when the chain is
    /// missing or unreadable, its first address when every one is trusted). On the unix socket, when its
    /// client is trusted (`server.trust_unix_forwarded_for`), the last address in its `X-Forwarded-For`,
    /// the one that proxy added for its own client (the first address it does not vouch for).
    pub(crate) fn logged_client(&self, headers: &HeaderMap) -> LoggedClient {
        let ip = match self.0.peer {
            Peer::Tcp(addr) => match &self.0.trusted {
                Some(proxies) => Some(beyond_trusted(headers, proxies).unwrap_or(addr.ip())),
                None => Some(addr.ip()),
            },
            Peer::Unix { trusted: true } => last_forwarded(headers),
            Peer::Unix { trusted: false } => None,
        };
        ip.map_or(LoggedClient::Unix, LoggedClient::Ip)
    }

    /// What the connection is told of its requests' bodies.
    pub(crate) fn body_watch(&self) -> Option<Arc<dyn BodyWatch>> {
        self.0.watch.clone()
    }

    /// One of the connection's keyed slots, if one is free; held by the request's work to its end.
    pub(crate) fn keyed_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.0.keyed.clone().try_acquire_owned().ok()
    }

    /// Sets the `X-Forwarded-*` headers of a request this client sent: `host` is the host as the
    /// proxy read it (none when the request named none).
    pub(crate) fn set_forwarded(&self, headers: &mut HeaderMap, host: Option<HeaderValue>) {
        match &self.0.forwarded_for {
            // One lookup of the name both reads the chain so far and writes the new one.
            ForwardedFor::Append(ip) => match headers.entry(X_FORWARDED_FOR) {
                Entry::Occupied(mut chain) => {
                    if let Some(longer) = forwarded_chain(chain.get().as_bytes(), ip.as_bytes()) {
                        chain.insert(longer);
                    }
                }
                Entry::Vacant(none) => {
                    none.insert(ip.clone());
                }
            },
            ForwardedFor::AsSent => {}
            ForwardedFor::Removed => {
                headers.remove(X_FORWARDED_FOR);
            }
        }
        let proto = if self.0.tls { "https" } else { "http" };
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        // The host as the proxy read it, or none: never one the client wrote itself.
        match host {
            Some(host) => headers.insert(X_FORWARDED_HOST, host),
            None => headers.remove(X_FORWARDED_HOST),
        };
    }
}

/// The last address in the last `X-Forwarded-For` line, with or without a port; none when it is no
/// address (`unknown`, an obfuscated name).
fn last_forwarded(headers: &HeaderMap) -> Option<IpAddr> {
    let line = headers.get_all(X_FORWARDED_FOR).iter().next_back()?;
    address(line.to_str().ok()?.rsplit(',').next()?)
}

/// An `X-Forwarded-For` entry's address: an IP address, or one with a port.
fn address(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<SocketAddr>().ok().map(|addr| addr.ip()))
}

/// Whether `ip` is one of the trusted `proxies`.
fn trusted(proxies: &[IpNet], ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    proxies.iter().any(|net| net.contains(&ip))
}

/// Walking the `X-Forwarded-For` chain (every line, in order) from the right, the first address that is
/// not a trusted proxy; when an entry cannot be read (or every one is trusted), the last one read, the
/// nearest to the client the trusted proxies vouch for; `None` without a readable entry.
fn beyond_trusted(headers: &HeaderMap, proxies: &[IpNet]) -> Option<IpAddr> {
    let mut nearest = None;
    for line in headers.get_all(X_FORWARDED_FOR).iter().rev() {
        let Ok(line) = line.to_str() else { return nearest };
        for entry in line.rsplit(',') {
            let Some(ip) = address(entry) else { return nearest };
            if !trusted(proxies, ip) {
                return Some(ip);
            }
            nearest = Some(ip);
        }
    }
    nearest
}

/// `prior`, then `ip`, as one `X-Forwarded-For` value.
fn forwarded_chain(prior: &[u8], ip: &[u8]) -> Option<HeaderValue> {
    let mut chain = Vec::with_capacity(prior.len() + 2 + ip.len());
    chain.extend_from_slice(prior);
    chain.extend_from_slice(b", ");
    chain.extend_from_slice(ip);
    HeaderValue::from_bytes(&chain).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwarded_for_appends_the_peer() {
        let mut headers = HeaderMap::new();
        headers.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        let peer = Downstream::new(Peer::Tcp("127.0.0.1:5000".parse().unwrap()), false, 1, None);
        peer.set_forwarded(&mut headers, Some(HeaderValue::from_static("api")));
        assert_eq!(headers[&X_FORWARDED_FOR], "10.0.0.1, 127.0.0.1");
        assert_eq!(headers[&X_FORWARDED_HOST], "api");
        assert_eq!(headers[&X_FORWARDED_PROTO], "http");
        let tls = Downstream::new(Peer::Tcp("127.0.0.1:5000".parse().unwrap()), true, 1, None);
        tls.set_forwarded(&mut headers, None);
        assert_eq!(headers[&X_FORWARDED_PROTO], "https");
    }

    #[test]
    fn a_unix_socket_client_s_forwarded_for_goes_on_only_when_trusted() {
        let forwarded = |peer: &Downstream| {
            let mut headers = HeaderMap::new();
            peer.set_forwarded(&mut headers, None);
            assert!(headers.get(&X_FORWARDED_FOR).is_none(), "nothing is added");
            assert_eq!(headers[&X_FORWARDED_PROTO], "http");
            headers.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
            headers.insert(X_FORWARDED_HOST, HeaderValue::from_static("forged"));
            peer.set_forwarded(&mut headers, None);
            assert!(headers.get(&X_FORWARDED_HOST).is_none(), "no host, so none");
            headers.get(&X_FORWARDED_FOR).cloned()
        };
        assert_eq!(
            forwarded(&Downstream::new(Peer::Unix { trusted: false }, false, 1, None)),
            None
        );
        assert_eq!(
            forwarded(&Downstream::new(Peer::Unix { trusted: true }, false, 1, None)).unwrap(),
            "10.0.0.1"
        );
    }

    #[test]
    fn the_logged_client_is_the_tcp_peer_or_what_a_trusted_unix_client_adds_last() {
        let mut headers = HeaderMap::new();
        headers.append(X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.9"));
        headers.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("10.0.0.1, [2001:db8::7]:4711"),
        );
        let tcp = Downstream::new(Peer::Tcp("192.0.2.1:5000".parse().unwrap()), false, 1, None);
        assert_eq!(tcp.logged_client(&headers).to_string(), "192.0.2.1");
        let trusted = Downstream::new(Peer::Unix { trusted: true }, false, 1, None);
        assert_eq!(trusted.logged_client(&headers).to_string(), "2001:db8::7");
        let untrusted = Downstream::new(Peer::Unix { trusted: false }, false, 1, None);
        assert_eq!(untrusted.logged_client(&headers), LoggedClient::Unix);
        headers.insert(X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1, unknown"));
        assert_eq!(trusted.logged_client(&headers), LoggedClient::Unix);
        assert_eq!(trusted.logged_client(&HeaderMap::new()), LoggedClient::Unix);
    }

    #[test]
    fn a_trusted_proxy_s_chain_names_the_client_beyond_the_trusted_hops() {
        let proxies: Arc<[IpNet]> = ["10.0.0.0/8".parse().unwrap(), "192.0.2.7/32".parse().unwrap()].into();
        let logged = |peer: &str, chain: &[&str]| {
            let mut headers = HeaderMap::new();
            for line in chain {
                headers.append(X_FORWARDED_FOR, HeaderValue::from_str(line).unwrap());
            }
            let client = Downstream::new(Peer::Tcp(peer.parse().unwrap()), false, 1, None).trusting(&proxies);
            match client.logged_client(&headers) {
                LoggedClient::Ip(ip) => ip.to_string(),
                LoggedClient::Unix => "unix".into(),
            }
        };
        // A peer not trusted: its own chain is never believed.
        assert_eq!(logged("203.0.113.9:5000", &["198.51.100.1"]), "203.0.113.9");
        // A trusted peer: the first untrusted address from the right, across lines.
        assert_eq!(
            logged("10.1.1.1:5000", &["198.51.100.1, 10.2.2.2"]),
            "198.51.100.1"
        );
        assert_eq!(
            logged("10.1.1.1:5000", &["6.6.6.6, 198.51.100.1", "192.0.2.7"]),
            "198.51.100.1"
        );
        assert_eq!(
            logged("[::ffff:10.1.1.1]:5000", &["198.51.100.1:4711"]),
            "198.51.100.1"
        );
        // Nothing readable: the peer; an unreadable entry: the nearest hop read.
        assert_eq!(logged("10.1.1.1:5000", &[]), "10.1.1.1");
        assert_eq!(logged("10.1.1.1:5000", &["junk, 10.3.3.3"]), "10.3.3.3");
        assert_eq!(logged("10.1.1.1:5000", &["10.3.3.3, 10.4.4.4"]), "10.3.3.3");
    }
}
