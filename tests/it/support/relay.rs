//! A TCP relay on 127.0.0.1:0 that a test can cut and restore, or stall and resume, to take the store
//! away for real.

use std::{net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, tcp::OwnedReadHalf, tcp::OwnedWriteHalf},
    sync::watch,
};

/// Forwards every connection to `target` while open. `cut()` closes the current connections and
/// every new one at once until `restore()`. `stall()` keeps every connection open but holds every
/// byte in both directions until `resume()`: a store that stops answering without hanging up.
pub struct Relay {
    addr: SocketAddr,
    cut: Arc<watch::Sender<bool>>,
    stalled: Arc<watch::Sender<bool>>,
}

impl Relay {
    /// Starts a relay to `target` (`host:port`).
    pub async fn start(target: &str) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().expect("relay address");
        let cut = Arc::new(watch::channel(false).0);
        let stalled = Arc::new(watch::channel(false).0);
        let switches = Switches {
            cut: cut.clone(),
            stalled: stalled.clone(),
        };
        tokio::spawn(accept_loop(listener, target.to_string(), switches));
        Relay { addr, cut, stalled }
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

    /// Holds every byte, both ways, on current and new connections until `resume()`.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    pub fn resume(&self) {
        self.stalled.send_replace(false);
    }
}

#[derive(Clone)]
struct Switches {
    cut: Arc<watch::Sender<bool>>,
    stalled: Arc<watch::Sender<bool>>,
}

async fn accept_loop(listener: TcpListener, target: String, switches: Switches) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        if *switches.cut.borrow() {
            drop(inbound);
            continue;
        }
        tokio::spawn(relay(inbound, target.clone(), switches.clone()));
    }
}

async fn relay(inbound: TcpStream, target: String, switches: Switches) {
    let Ok(outbound) = TcpStream::connect(&target).await else {
        return;
    };
    let (in_read, in_write) = inbound.into_split();
    let (out_read, out_write) = outbound.into_split();
    let mut cut = switches.cut.subscribe();
    tokio::select! {
        _ = pump(in_read, out_write, switches.stalled.subscribe()) => {}
        _ = pump(out_read, in_write, switches.stalled.subscribe()) => {}
        _ = cut.wait_for(|cut| *cut) => {}
    }
}

/// Copies one direction, holding each chunk while the relay is stalled.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut stalled: watch::Receiver<bool>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(read) => read,
        };
        if stalled.wait_for(|stalled| !*stalled).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
    }
}
