//! A TCP relay on 127.0.0.1:0 that a test can cut and restore, to take the store away for real.

use std::{net::SocketAddr, sync::Arc};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
};

/// Forwards every connection to `target` while open. `cut()` closes the current connections and
/// every new one at once until `restore()`.
pub struct Relay {
    addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
}

impl Relay {
    /// Starts a relay to `target` (`host:port`).
    pub async fn start(target: &str) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay address");
        let cut = Arc::new(watch::channel(false).0);
        tokio::spawn(accept_loop(listener, target.to_string(), cut.clone()));
        Relay { addr, cut }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every relayed connection and every one that arrives until `restore()`.
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn restore(&self) {
        self.cut.send_replace(false);
    }
}

async fn accept_loop(listener: TcpListener, target: String, cut: Arc<watch::Sender<bool>>) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        if *cut.borrow() {
            drop(inbound);
            continue;
        }
        tokio::spawn(relay(inbound, target.clone(), cut.subscribe()));
    }
}

async fn relay(mut inbound: TcpStream, target: String, mut cut: watch::Receiver<bool>) {
    let Ok(mut outbound) = TcpStream::connect(&target).await else {
        return;
    };
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
        _ = cut.wait_for(|cut| *cut) => {}
    }
}
