//! A connection flood does not lock clients out: at `server.max_connections`, connections with no request
//! in progress (silent sockets, half-sent heads, idle keep-alives), or whose requests all wait on a body
//! their client stalls or trickles, are closed to make room, the idlest first, while a connection whose
//! request is being handled (or answered) is never cut. The admin listener has a cap of its own and makes
//! room the same way.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::select_all;
use rstest::rstest;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::http::client;
use crate::support::raw::{self, addr_of};
use crate::support::raw_h2;
use crate::support::{
    Backend, InProcessProxy, Reply, TestEnv, keyed_post, metric, metric_reaches, poll_until,
};

/// Far below the 60 s `header_read_timeout` the flooded proxies run with: an answer within this came
/// from making room, not from the flood's sockets timing out.
const ANSWER_BOUND: Duration = Duration::from_secs(15);

/// Bound on waiting for something that must happen soon.
const SOON: Duration = Duration::from_secs(30);

/// What each socket of the flood sends.
#[derive(Debug, Clone, Copy)]
enum Flood {
    /// Nothing at all.
    Silent,
    /// The start of a request head, never finished (slowloris).
    PartialHead,
    /// A keyed request's head and the start of its body, then nothing.
    StalledBody,
    /// A passthrough request's head, then its body a byte every 100 ms.
    TrickledBody,
}

/// Bound on how long a flood socket trickles: far longer than any test.
const TRICKLE_BYTES: usize = 10_000;

/// A proxy with `max_connections` slots whose flood sockets would hold theirs for a minute.
///
/// Its upstream pool is not the limit under test: a trickled passthrough body is forwarded as it comes,
/// so each such request holds an upstream connection of its worker while it trickles, and the default
/// pool (`max_connections / workers` per worker) is full with the flood alone. Making room on the client
/// side frees a connection of the evicted request's worker only, which need not be the worker the next
/// client lands on.
async fn crowded_proxy(env: &TestEnv, max_connections: i64) -> InProcessProxy {
    let config = env
        .config()
        .set("server.max_connections", max_connections)
        .set("upstream.max_connections", 2 * max_connections)
        .set("server.header_read_timeout", "60s")
        .set("server.body_read_timeout", "60s");
    InProcessProxy::start(&config).await
}

/// Opens `count` flood sockets.
async fn flood_with(proxy: &InProcessProxy, flood: Flood, count: usize) -> Vec<TcpStream> {
    let host = addr_of(&proxy.url);
    let mut sockets = Vec::new();
    for _ in 0..count {
        let mut socket = raw::connect(&proxy.url).await;
        let bytes = match flood {
            Flood::Silent => String::new(),
            Flood::PartialHead => format!("POST /orders HTTP/1.1\r\nhost: {host}\r\n"),
            Flood::StalledBody => {
                let key = format!("idempotency-key: stalled-{}", sockets.len());
                raw::head("POST /orders", host, &[&key, "content-length: 1000"]) + "{\"n\":"
            }
            Flood::TrickledBody => raw::head("POST /orders", host, &["content-length: 100000"]),
        };
        socket
            .write_all(bytes.as_bytes())
            .await
            .expect("write the flood's bytes");
        if let Flood::TrickledBody = flood {
            socket = trickle(socket);
        }
        sockets.push(socket);
    }
    sockets
}

/// Writes a byte every 100 ms on a second handle of `socket` until the proxy closes it; returns the first
/// handle, for reading.
fn trickle(socket: TcpStream) -> TcpStream {
    let socket = socket.into_std().expect("a std socket");
    let mut writer = TcpStream::from_std(socket.try_clone().expect("a second handle")).unwrap();
    tokio::spawn(async move {
        for _ in 0..TRICKLE_BYTES {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if writer.write_all(b"x").await.is_err() {
                return;
            }
        }
    });
    TcpStream::from_std(socket).unwrap()
}

/// Waits until exactly `count` connections are open on the proxy.
async fn open_connections_are(proxy: &InProcessProxy, count: usize) {
    poll_until(&format!("{count} open connections"), || async {
        let open = metric(&proxy.admin_url, "idemproxy_open_connections", &[]).await;
        (open == count as f64).then_some(())
    })
    .await;
}

/// Waits until one of `sockets` is closed by the proxy; panics if one gets anything but the close, or,
/// for a socket whose request waited on its body, anything but a 503 `busy` and the close.
async fn one_is_closed(sockets: &mut [TcpStream], flood: Flood) {
    let reads = sockets.iter_mut().map(|socket| Box::pin(raw::read_reply(socket)));
    let (reply, _, _) = tokio::time::timeout(SOON, select_all(reads))
        .await
        .expect("a flood socket is closed to make room");
    match flood {
        Flood::Silent | Flood::PartialHead => {
            assert!(reply.head.is_empty(), "a flood socket got bytes: {reply:?}");
        }
        Flood::StalledBody | Flood::TrickledBody => reply.assert_problem(503, "busy"),
    }
}

async fn answered_in_bound(request: reqwest::RequestBuilder) -> Reply {
    tokio::time::timeout(ANSWER_BOUND, Reply::of(request))
        .await
        .unwrap_or_else(|_| panic!("no answer within {ANSWER_BOUND:?} while the proxy was flooded"))
}

#[rstest]
#[tokio::test]
async fn a_flood_of_idle_sockets_makes_room_for_real_clients(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
    #[values(Flood::Silent, Flood::PartialHead, Flood::StalledBody, Flood::TrickledBody)] flood: Flood,
) {
    let env = TestEnv::on(backend).await;
    let proxy = crowded_proxy(&env, 4).await;
    let evicted = || metric(&proxy.admin_url, "idemproxy_connections_evicted_total", &[]);

    let mut sockets = flood_with(&proxy, flood, 4).await;
    open_connections_are(&proxy, 4).await;
    let keyed = answered_in_bound(keyed_post(&proxy.url, "/orders", "flooded", "{}")).await;
    assert_eq!(keyed.status, 201, "{}", keyed.text());
    assert_eq!(env.upstream.executions_for_key("flooded"), 1);
    assert!(evicted().await >= 1.0);
    one_is_closed(&mut sockets, flood).await;

    // One flood socket made room and the client has gone; with the slots full again, a passthrough
    // request makes room the same way.
    open_connections_are(&proxy, 3).await;
    let mut more = flood_with(&proxy, flood, 1).await;
    open_connections_are(&proxy, 4).await;
    let get = answered_in_bound(client().get(format!("{}/plain", proxy.url))).await;
    assert_eq!(get.status, 201, "{}", get.text());
    assert!(evicted().await >= 2.0);
    sockets.append(&mut more);
    assert_eq!(env.upstream.executions(), 2, "the flood forwarded nothing");
}

/// `GET /slow` on the gate `gate` over a raw keep-alive connection, not yet answered.
async fn held_get(proxy: &InProcessProxy, gate: &str) -> TcpStream {
    let mut socket = raw::connect(&proxy.url).await;
    let request = format!(
        "GET /slow HTTP/1.1\r\nhost: {}\r\nx-gate: {gate}\r\n\r\n",
        addr_of(&proxy.url)
    );
    socket
        .write_all(request.as_bytes())
        .await
        .expect("write the request");
    socket
}

#[rstest]
#[tokio::test]
async fn a_connection_with_a_request_in_progress_is_never_evicted(
    #[values(Backend::Postgres, Backend::Sqlite)] backend: Backend,
) {
    let env = TestEnv::on(backend).await;
    let proxy = crowded_proxy(&env, 2).await;
    let admin = proxy.admin_url.clone();

    // Both slots hold a request the upstream has not answered: a keyed one and a passthrough one.
    let keyed = tokio::spawn(Reply::of(
        keyed_post(&proxy.url, "/slow", "held", "{}").header("x-gate", "keyed"),
    ));
    let mut passthrough = held_get(&proxy, "passthrough").await;
    poll_until("both held requests at the upstream", || async {
        (env.upstream.executions() == 2).then_some(())
    })
    .await;

    // A third client has to wait: nothing is idle, so nothing is evicted however long it waits.
    let third = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/orders", "third", "{}")));
    metric_reaches(&admin, "idemproxy_connection_cap_reached_total", &[], 1.0).await;
    // Longer than a connection must be idle to be evicted (1 s plus the clock's slack): only the absence
    // of an eviction is proven here, and no signal marks that.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!third.is_finished(), "served while both slots held requests");
    assert_eq!(
        metric(&admin, "idemproxy_connections_evicted_total", &[]).await,
        0.0
    );

    // The passthrough request completes; its client keeps the connection open, idle, so it makes room.
    env.upstream.release("passthrough");
    let reply = raw::read_reply(&mut passthrough).await;
    assert_eq!(reply.status, Some(201), "the full response: {reply:?}");
    assert!(String::from_utf8_lossy(&reply.body).starts_with("slow done"));
    let third = tokio::time::timeout(ANSWER_BOUND, third)
        .await
        .expect("the third client is served once a connection is idle")
        .expect("third client task");
    assert_eq!(third.status, 201, "{}", third.text());
    assert_eq!(
        metric(&admin, "idemproxy_connections_evicted_total", &[]).await,
        1.0
    );
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(SOON, passthrough.read_to_end(&mut rest)).await;
    assert!(
        closed.is_ok() && rest.is_empty(),
        "the idle connection was closed: {rest:?}"
    );

    // The keyed request kept its connection throughout and gets its whole response.
    env.upstream.release("keyed");
    let keyed = keyed.await.expect("keyed client task");
    assert_eq!(keyed.status, 201, "{}", keyed.text());
    assert!(keyed.text().starts_with("slow done"), "{}", keyed.text());
    assert_eq!(env.upstream.executions_for_key("held"), 1);
    assert_eq!(env.upstream.executions_for_key("third"), 1);
}

/// Whether the proxy has closed `socket`: it reads as ended (nothing is ever sent on a flood socket).
fn is_closed(socket: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    match socket.try_read(&mut byte) {
        Ok(n) => n == 0,
        Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
    }
}

#[tokio::test]
async fn a_flood_on_the_admin_port_does_not_lock_out_probes() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = crowded_proxy(&env, 4).await;
    // 16 more silent sockets than the admin listener's 64 slots; the rest wait in the backlog.
    let mut sockets = Vec::new();
    for _ in 0..80 {
        sockets.push(raw::connect(&proxy.admin_url).await);
    }
    let ready = answered_in_bound(client().get(format!("{}/readyz", proxy.admin_url))).await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    // The sockets ahead of the probe in the backlog and the probe itself each took an idle one's slot.
    poll_until("17 flood sockets closed by the admin listener", || async {
        (sockets.iter().filter(|socket| is_closed(socket)).count() >= 17).then_some(())
    })
    .await;
}

#[tokio::test]
async fn an_h2_connection_makes_room_only_once_every_stream_of_it_waits_on_its_client() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let proxy = crowded_proxy(&env, 1).await;
    let admin = proxy.admin_url.clone();
    let evicted = || metric(&admin, "idemproxy_connections_evicted_total", &[]);

    // One connection, two streams: one waits on a body its client stalls, one is at the upstream.
    let mut h2 = raw_h2::connect(&proxy.url).await;
    let stalled_length = [("content-length", "100")];
    let (_stalled, mut body) =
        raw_h2::open_post(&mut h2, &proxy.url, "/orders", Some("stalled"), &stalled_length).await;
    body.send_data(Bytes::from_static(b"{\"n\":"), false).unwrap();
    let gate = [("x-gate", "h2")];
    let (held, mut held_body) = raw_h2::open_post(&mut h2, &proxy.url, "/slow", Some("held"), &gate).await;
    held_body.send_data(Bytes::from_static(b"{}"), true).unwrap();
    env.upstream.wait_until_executions(1).await;

    // Another client has to wait: a request of the connection is being handled.
    let other = tokio::spawn(Reply::of(keyed_post(&proxy.url, "/orders", "other", "{}")));
    metric_reaches(&admin, "idemproxy_connection_cap_reached_total", &[], 1.0).await;
    // Longer than a connection must be idle to be evicted (1 s plus the clock's slack): only the absence
    // of an eviction is proven here, and no signal marks that.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!other.is_finished(), "served while a stream was being handled");
    assert_eq!(evicted().await, 0.0);

    // The held request is answered in full; then only the stalled stream is left, and it makes room.
    env.upstream.release("h2");
    let held = raw_h2::reply(held).await.expect("the whole response");
    assert_eq!(held.status, 201, "{}", held.text());
    assert!(held.text().starts_with("slow done"), "{}", held.text());
    let other = tokio::time::timeout(ANSWER_BOUND, other)
        .await
        .expect("the other client is served once every stream waits on its client")
        .expect("other client task");
    assert_eq!(other.status, 201, "{}", other.text());
    assert_eq!(evicted().await, 1.0);
    assert_eq!(env.upstream.executions_for_key("stalled"), 0);
    assert_eq!(env.upstream.executions(), 2);
}
