//! The workload a profile-guided build trains idemproxy on (`deploy/pgo-build`).
//!
//! `pgo_workload PROXY [POSTGRES_URL] [REDIS_URL]` runs the proxy binary `PROXY` in front of an upstream of
//! its own, once on an embedded SQLite store and, when `POSTGRES_URL` (such as
//! `postgres://postgres@127.0.0.1:5432`; a database in it is only where it connects to create its own) is
//! given, once more on a database it creates on that server and drops afterwards; when `REDIS_URL` (a
//! `redis://` URL) is given, once more on that Redis server, under keys of its own. Each run sends the
//! requests a proxy serves in production, in proportions like theirs: passthrough GETs over keep-alive
//! connections, keyed POSTs, replays, reused keys with another payload, duplicates in flight, a response
//! larger than the stored limit, HTTP/2 cleartext and a metrics scrape.
//! Then it stops the proxy with SIGTERM, so the instrumented binary writes its profile as it exits.
//!
//! Every answer is checked: a workload that went wrong would train the build on error paths, so any
//! unexpected status stops it with a non-zero exit.

#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::process::{Child, Command};

/// Client connections, as many as a busy sidecar holds open.
const CONNECTIONS: usize = 16;
/// Requests of each kind per connection.
const PASSTHROUGH: usize = 3_000;
const KEYED: usize = 200;
const REPLAYS: usize = 1_000;
const MISMATCHES: usize = 20;
/// About the JSON an API answers with: the benchmark's upstream body is the same size.
const ANSWER: &str = r#"{"id":"ord_8f14e45fceea167a5a36dedd4bea2543","status":"accepted","amount":1000,"currency":"EUR","customer":"c_123","created_at":"2026-01-01T00:00:00Z","items":[{"sku":"sku_001","quantity":2}],"note":"b"}"#;
const ORDER: &str = r#"{"amount":1000,"currency":"EUR","customer":"c_123"}"#;
/// Larger than the default `max_stored_response` (4 MiB), so the capture stops and the rest streams.
const BIG: usize = 6 << 20;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let proxy = args
        .next()
        .context("usage: pgo_workload PROXY_BINARY [POSTGRES_SERVER_URL] [REDIS_URL]")?;
    let (mut postgres, mut redis) = (None, None);
    for arg in args {
        if arg.starts_with("redis://") {
            redis = Some(arg);
        } else {
            postgres = Some(arg);
        }
    }

    let upstream = serve_upstream().await?;
    let sqlite = tempfile::tempdir()?;
    let sqlite_url = format!("sqlite://{}", sqlite.path().join("pgo.db").display());
    train(&proxy, upstream, &sqlite_url).await.context("on SQLite")?;

    if let Some(server) = postgres {
        let database = format!("idemproxy_pgo_{}", std::process::id());
        let admin = connect(&server).await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .with_context(|| format!("creating database {database} on {server}"))?;
        let mut url = url::Url::parse(&server).with_context(|| format!("{server} is not a URL"))?;
        url.set_path(&database);
        let trained = train(&proxy, upstream, url.as_str())
            .await
            .context("on PostgreSQL");
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            .await
            .with_context(|| format!("dropping database {database}"))?;
        trained?;
    }
    if let Some(redis) = redis {
        train(&proxy, upstream, &redis).await.context("on Redis")?;
    }
    Ok(())
}

/// A client connected to a PostgreSQL server, its connection driven in the background.
async fn connect(server: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(server, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {server}"))?;
    tokio::spawn(connection);
    Ok(client)
}

/// One run of the proxy on the store at `store_url`, from start to SIGTERM.
async fn train(proxy: &str, upstream: SocketAddr, store_url: &str) -> Result<()> {
    let listen = free_port()?;
    let admin = free_port()?;
    let mut child = Command::new(proxy)
        .arg("serve")
        .args(["--listen", &listen.to_string()])
        .args(["--admin-listen", &admin.to_string()])
        .args(["--upstream", &format!("http://{upstream}")])
        .env("IDEMPROXY_STORE__URL", store_url)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {proxy}"))?;

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CONNECTIONS)
        .build()?;
    wait_ready(&client, admin, &mut child).await?;
    let base = format!("http://{listen}");
    let tag = uuid::Uuid::new_v4().simple().to_string();

    let mut connections = tokio::task::JoinSet::new();
    for n in 0..CONNECTIONS {
        let (client, base, tag) = (client.clone(), base.clone(), tag.clone());
        connections.spawn(async move { one_connection(&client, &base, &format!("{tag}-{n}")).await });
    }
    while let Some(done) = connections.join_next().await {
        done??;
    }
    rare_paths(&client, &base, &tag).await?;
    http2(&base).await?;
    let metrics = client.get(format!("http://{admin}/metrics")).send().await?;
    ensure!(
        metrics.status() == StatusCode::OK,
        "/metrics answered {}",
        metrics.status()
    );

    let pid = child.id().context("the proxy exited early")?;
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    ensure!(killed.success(), "kill -TERM {pid} failed");
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .context("the proxy did not exit within 60 s of SIGTERM")??;
    ensure!(status.success(), "the proxy exited with {status}");
    Ok(())
}

/// What one client connection sends: mostly passthrough, then keyed requests, their replays and a few
/// reused keys.
async fn one_connection(client: &reqwest::Client, base: &str, tag: &str) -> Result<()> {
    for _ in 0..PASSTHROUGH {
        expect(
            client.get(format!("{base}/orders/1")),
            StatusCode::OK,
            "passthrough",
        )
        .await?;
    }
    for i in 0..KEYED {
        expect(
            keyed(client, base, &format!("{tag}-k{i}"), ORDER),
            StatusCode::OK,
            "keyed",
        )
        .await?;
    }
    let replayed = format!("{tag}-k0");
    for _ in 0..REPLAYS {
        let response = keyed(client, base, &replayed, ORDER).send().await?;
        ensure!(
            response.status() == StatusCode::OK,
            "replay answered {}",
            response.status()
        );
        ensure!(
            response.headers().contains_key("idempotent-replayed"),
            "a replay came without Idempotent-Replayed"
        );
        response.bytes().await?;
    }
    for i in 0..MISMATCHES {
        let other = r#"{"amount":2000,"currency":"EUR","customer":"c_123"}"#;
        expect(
            keyed(client, base, &format!("{tag}-k{i}"), other),
            StatusCode::UNPROCESSABLE_ENTITY,
            "mismatch",
        )
        .await?;
    }
    Ok(())
}

/// Paths a proxy takes now and then: a duplicate while the first is in flight, and a response too large
/// to keep, retried.
async fn rare_paths(client: &reqwest::Client, base: &str, tag: &str) -> Result<()> {
    // The upstream holds these for 300 ms; a duplicate sent well inside that finds the first in flight.
    let slow = format!("{base}/orders?delay_ms=300");
    for i in 0..5 {
        let key = format!("{tag}-slow{i}");
        let first = keyed_to(client, &slow, &key, ORDER);
        let first = tokio::spawn(async move { first.send().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let duplicate = keyed_to(client, &slow, &key, ORDER).send().await?;
        ensure!(
            duplicate.status() == StatusCode::CONFLICT,
            "duplicate answered {}",
            duplicate.status()
        );
        let first = first.await??;
        ensure!(
            first.status() == StatusCode::OK,
            "slow request answered {}",
            first.status()
        );
    }
    for i in 0..3 {
        let response = keyed_to(client, &format!("{base}/big"), &format!("{tag}-big{i}"), ORDER)
            .send()
            .await?;
        ensure!(
            response.status() == StatusCode::OK,
            "big answered {}",
            response.status()
        );
        let body = response.bytes().await?;
        ensure!(body.len() == BIG, "big body of {} bytes, not {BIG}", body.len());
        // Too large to keep: a retry learns the response was not retained.
        expect(
            keyed_to(client, &format!("{base}/big"), &format!("{tag}-big{i}"), ORDER),
            StatusCode::GONE,
            "big retry",
        )
        .await?;
    }
    Ok(())
}

/// Passthrough and keyed requests over HTTP/2 cleartext (prior knowledge).
async fn http2(base: &str) -> Result<()> {
    let client = reqwest::Client::builder().http2_prior_knowledge().build()?;
    for i in 0..500 {
        expect(
            client.get(format!("{base}/orders/1")),
            StatusCode::OK,
            "h2 passthrough",
        )
        .await?;
        if i % 10 == 0 {
            expect(
                keyed(&client, base, &format!("h2-{i}-{}", uuid::Uuid::new_v4()), ORDER),
                StatusCode::OK,
                "h2 keyed",
            )
            .await?;
        }
    }
    Ok(())
}

/// A keyed POST of `body` under `key` to `{base}/orders`.
fn keyed(client: &reqwest::Client, base: &str, key: &str, body: &'static str) -> reqwest::RequestBuilder {
    keyed_to(client, &format!("{base}/orders"), key, body)
}

/// A keyed POST of `body` under `key` to `url`.
fn keyed_to(client: &reqwest::Client, url: &str, key: &str, body: &'static str) -> reqwest::RequestBuilder {
    client
        .post(url)
        .header("idempotency-key", key)
        .header(header::AUTHORIZATION, "Bearer pgo-client")
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
}

/// Sends `request`, reads its body, and fails unless it answered `status`.
async fn expect(request: reqwest::RequestBuilder, status: StatusCode, what: &str) -> Result<()> {
    let response = request.send().await.with_context(|| format!("{what} request"))?;
    let got = response.status();
    response.bytes().await?;
    if got != status {
        bail!("{what} answered {got}, not {status}");
    }
    Ok(())
}

/// Polls `/readyz` until the proxy is ready, or fails if it exits or takes over 30 s.
async fn wait_ready(client: &reqwest::Client, admin: SocketAddr, child: &mut Child) -> Result<()> {
    for _ in 0..300 {
        if let Some(status) = child.try_wait()? {
            bail!("the proxy exited at start with {status}");
        }
        let ready = client.get(format!("http://{admin}/readyz")).send().await;
        if ready.is_ok_and(|r| r.status() == StatusCode::OK) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the proxy was not ready within 30 s")
}

/// A loopback address with a port free a moment ago.
fn free_port() -> Result<SocketAddr> {
    Ok(StdListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// The upstream, over HTTP/1.1 as the proxy speaks to it: `/big` answers `BIG` bytes, everything else
/// the JSON answer, after `?delay_ms=N` if given.
async fn serve_upstream() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service_fn(answer))
                    .await;
            });
        }
    });
    Ok(addr)
}

async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let delay = request
        .uri()
        .query()
        .and_then(|q| q.strip_prefix("delay_ms="))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0);
    let big = request.uri().path() == "/big";
    let _ = request.into_body().collect().await;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let body = if big {
        Bytes::from(vec![b'x'; BIG])
    } else {
        Bytes::from_static(ANSWER.as_bytes())
    };
    // The head of a typical HTTP/1.1 service (nginx's, say), `Connection` included: the proxy strips it.
    let response = Response::builder()
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::SERVER, "pgo-upstream")
        .header(header::CONNECTION, "keep-alive")
        .body(Full::new(body))
        .expect("a static response head is valid");
    Ok(response)
}
