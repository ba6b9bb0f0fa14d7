//! The upstream and clients of bench/run's `attach` case: one keyed request starts a slow event stream,
//! and duplicates with its key follow it through a proxy with `on_in_flight = "attach"`.
//!
//! `attach_bench serve ADDR [--events E] [--size S] [--before B] [--interval-ms T]` serves `POST
//! /events/RUN` on `ADDR` (`127.0.0.1:0` picks a port) and prints the address it bound on the first line
//! of stdout. Each answer is `text/event-stream`: events 0 to B - 1 (B is 1 unless given) go with the
//! head, one frame each, then the stream holds until `POST /release/RUN` comes, then sends events B to
//! E, one every T milliseconds, and ends. Each event is `id: I`, `event: tick` and one `data:` line of S
//! bytes. Holding the stream lets the duplicates attach while it runs however long that takes, and keeps
//! the bytes every run relays the same. On one thread, as bench/run's other upstreams. A large B of
//! small events (`--events 80000 --size 22 --before 79990`: about 4 MB in 50-byte frames before the
//! hold) measures what a duplicate that joins late costs: it reads everything relayed so far.
//!
//! `attach_bench drive --url PROXY --upstream UPSTREAM --run RUN --followers N [--events E] [--size S]
//! [--before B] [--pause]` sends the original `POST /events/RUN` with the idempotency key `attach-RUN`
//! through the proxy and reads events 0 to B - 1; then N duplicates, one HTTP/1.1 connection each, send
//! the same request and each reads until it has them too (the head and what was relayed so far). Then
//! it prints `attached`
//! on stdout; with `--pause` it waits for a line on stdin before going on (bench/run reads the proxy's
//! memory in between). It releases the stream at the upstream, and every client reads the response to
//! its end. The original's body must be the events the upstream sends, and every duplicate's byte for
//! byte the original's, with status 200, `text/event-stream` and `idempotent-replayed: true` (the
//! original's without it); a body that ends with an error, or anything else, fails the run. It prints one
//! JSON line: followers, bytes each client read, and the seconds the attaching and the stream took.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncBufReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;

/// What every client sends: the credential the proxy scopes keys by, as bench/wrk.lua's.
const CREDENTIAL: &str = "Bearer bench-client";
/// The request body of every client (the same request, so the duplicates follow the original).
const PROMPT: &[u8] = b"{\"prompt\":\"stream the ticks\"}";
/// Bound on anything the driver waits for, but the pause.
const BOUND: Duration = Duration::from_secs(120);
/// Duplicates connecting and waiting for their head at once: enough to keep the proxy busy, few enough
/// for the listen backlog.
const CONNECTING: usize = 64;

#[derive(Parser)]
#[command(about = "Event-stream upstream and attaching clients for bench/run's attach case")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve held event streams on ADDR, printing the bound address first.
    Serve(Serve),
    /// Send one keyed stream request and N duplicates of it through the proxy at --url.
    Drive(Drive),
}

#[derive(Args, Clone, Copy)]
struct Shape {
    /// Events after the first, sent once the stream is released.
    #[arg(long, default_value_t = 100)]
    events: usize,
    /// Bytes of each event's data line.
    #[arg(long, default_value_t = 256)]
    size: usize,
    /// Events sent with the head, before the stream holds.
    #[arg(long, default_value_t = 1)]
    before: usize,
}

#[derive(Args)]
struct Serve {
    addr: SocketAddr,
    #[command(flatten)]
    shape: Shape,
    /// Milliseconds between two events once released.
    #[arg(long, default_value_t = 10)]
    interval_ms: u64,
}

#[derive(Args)]
struct Drive {
    /// The proxy, as http://HOST:PORT.
    #[arg(long)]
    url: String,
    /// The upstream itself, as http://HOST:PORT, to release the stream.
    #[arg(long)]
    upstream: String,
    /// The run's name: its path, and its key. New to each run.
    #[arg(long)]
    run: String,
    /// Duplicates that attach to the original's response.
    #[arg(long)]
    followers: usize,
    /// The upstream's stream, as `serve` was given it.
    #[command(flatten)]
    shape: Shape,
    /// Wait for a line on stdin once every duplicate has attached.
    #[arg(long)]
    pause: bool,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Serve(serve_args) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(serve(serve_args)),
        Command::Drive(drive_args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?
            .block_on(drive(drive_args)),
    }
}

/// Event `i` of a stream whose data lines are `size` bytes.
fn event(i: usize, size: usize) -> Bytes {
    let data: String = std::iter::repeat_n(char::from(b'a' + (i % 26) as u8), size).collect();
    Bytes::from(format!("id: {i}\nevent: tick\ndata: {data}\n\n"))
}

/// The whole body of a stream of `shape`.
fn stream_body(shape: Shape) -> Vec<u8> {
    (0..=shape.events).flat_map(|i| event(i, shape.size)).collect()
}

// ----------------------------------------------------------------------------------------------------
// The upstream
// ----------------------------------------------------------------------------------------------------

/// The streams' releases, by run: `true` once released. Either side may come first.
#[derive(Clone, Default)]
struct Releases(Arc<Mutex<HashMap<String, watch::Sender<bool>>>>);

impl Releases {
    fn of(&self, run: &str) -> watch::Sender<bool> {
        let mut runs = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        runs.entry(run.to_owned())
            .or_insert_with(|| watch::channel(false).0)
            .clone()
    }

    fn forget(&self, run: &str) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).remove(run);
    }
}

async fn serve(args: Serve) -> Result<()> {
    let listener = TcpListener::bind(args.addr)
        .await
        .with_context(|| format!("binding {}", args.addr))?;
    println!("{}", listener.local_addr()?);
    let releases = Releases::default();
    let interval = Duration::from_millis(args.interval_ms);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        stream.set_nodelay(true)?;
        let releases = releases.clone();
        let service = hyper::service::service_fn(move |request: Request<Incoming>| {
            answer(request, releases.clone(), args.shape, interval)
        });
        tokio::spawn(
            hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service),
        );
    }
}

type StreamResponse = Response<http_body_util::combinators::BoxBody<Bytes, Infallible>>;

async fn answer(
    request: Request<Incoming>,
    releases: Releases,
    shape: Shape,
    interval: Duration,
) -> Result<StreamResponse, hyper::Error> {
    let path = request.uri().path().to_owned();
    request.into_body().collect().await?;
    if let Some(run) = path.strip_prefix("/release/") {
        releases.of(run).send_replace(true);
        let mut response = Response::new(Empty::new().boxed());
        *response.status_mut() = StatusCode::NO_CONTENT;
        return Ok(response);
    }
    let Some(run) = path.strip_prefix("/events/").map(str::to_owned) else {
        let mut response = Response::new(Empty::new().boxed());
        *response.status_mut() = StatusCode::NOT_FOUND;
        return Ok(response);
    };
    let released = releases.of(&run).subscribe();
    // The events before the hold at once; the rest once released, one every `interval`.
    let frames = futures_util::stream::unfold((0, released), move |(i, mut released)| {
        let releases = releases.clone();
        let run = run.clone();
        async move {
            if i > shape.events {
                releases.forget(&run);
                return None;
            }
            if i == shape.before {
                // A stream nobody releases ends here, short: the driver then fails the run.
                released.wait_for(|released| *released).await.ok()?;
            }
            if i > shape.before {
                tokio::time::sleep(interval).await;
            }
            Some((Ok(Frame::data(event(i, shape.size))), (i + 1, released)))
        }
    });
    let mut response = Response::new(StreamBody::new(frames).boxed());
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("text/event-stream"));
    headers.insert("cache-control", HeaderValue::from_static("no-cache"));
    Ok(response)
}

// ----------------------------------------------------------------------------------------------------
// The clients
// ----------------------------------------------------------------------------------------------------

async fn drive(args: Drive) -> Result<()> {
    let expected = stream_body(args.shape);
    ensure!(
        (1..=args.shape.events + 1).contains(&args.shape.before),
        "--before must be from 1 to --events + 1"
    );
    let first: usize = (0..args.shape.before)
        .map(|i| event(i, args.shape.size).len())
        .sum();
    let path = format!("/events/{}", args.run);
    let key = format!("attach-{}", args.run);
    let started = Instant::now();

    // The original: its head, then the events before the hold, before any duplicate is sent.
    let (beginnings, mut begun) = mpsc::unbounded_channel();
    let response = post(&args.url, &path, &key)
        .await
        .context("the original request")?;
    check_head(&response, false).context("the original's head")?;
    let original = tokio::spawn(read(response, first, beginnings.clone()));
    attached_one(&mut begun, "the original").await?;

    // The duplicates: each counts as attached once it has the head and the events before the hold.
    let connecting = Arc::new(Semaphore::new(CONNECTING));
    let followers: Vec<_> = (0..args.followers)
        .map(|_| {
            let (connecting, beginnings) = (connecting.clone(), beginnings.clone());
            let (url, path, key) = (args.url.clone(), path.clone(), key.clone());
            tokio::spawn(async move {
                let attaching = async {
                    let permit = connecting.acquire_owned().await?;
                    let response = post(&url, &path, &key).await?;
                    drop(permit);
                    check_head(&response, true)?;
                    Ok::<_, anyhow::Error>(response)
                };
                match attaching.await {
                    Ok(response) => read(response, first, beginnings).await,
                    Err(error) => {
                        let _ = beginnings.send(Err(format!("{error:#}")));
                        Err(error)
                    }
                }
            })
        })
        .collect();
    drop(beginnings);
    for n in 0..args.followers {
        attached_one(&mut begun, &format!("duplicate {n} of {}", args.followers)).await?;
    }
    let attached = started.elapsed();
    println!("attached");
    if args.pause {
        let mut line = String::new();
        tokio::io::BufReader::new(tokio::io::stdin())
            .read_line(&mut line)
            .await?;
    }

    let releasing = Instant::now();
    let release = format!("/release/{}", args.run);
    let released = post(&args.upstream, &release, &key)
        .await
        .context("releasing the stream")?;
    ensure!(
        released.status() == StatusCode::NO_CONTENT,
        "the upstream answered the release {}",
        released.status()
    );
    let original = within(original, "the original's body")
        .await??
        .context("the original's body")?;
    ensure!(
        original == expected,
        "the original's body is not the upstream's stream: {} bytes against {}",
        original.len(),
        expected.len()
    );
    for (n, follower) in followers.into_iter().enumerate() {
        let body = within(follower, "a duplicate's body")
            .await??
            .with_context(|| format!("duplicate {n}"))?;
        if body != original {
            let at = body.iter().zip(&original).position(|(a, b)| a != b);
            bail!(
                "duplicate {n}'s body differs from the original's: {} bytes against {}, first \
                 difference at {at:?}",
                body.len(),
                original.len()
            );
        }
    }
    let line = serde_json::json!({
        "followers": args.followers,
        "bytes": original.len(),
        "events": args.shape.events + 1,
        "attach_seconds": attached.as_secs_f64(),
        "stream_seconds": releasing.elapsed().as_secs_f64(),
    });
    println!("{line}");
    Ok(())
}

/// Says whether one more client (`which`) has the head and the events before the hold; an error if one failed first.
async fn attached_one(begun: &mut mpsc::UnboundedReceiver<Result<(), String>>, which: &str) -> Result<()> {
    match within(begun.recv(), &format!("the events before the hold for {which}")).await? {
        Some(Ok(())) => Ok(()),
        Some(Err(error)) => bail!("a client failed before it had the events before the hold: {error}"),
        None => bail!("every client ended before {which} had the events before the hold"),
    }
}

/// `future`, or an error naming `what` after `BOUND`.
async fn within<F: Future>(future: F, what: &str) -> Result<F::Output> {
    tokio::time::timeout(BOUND, future)
        .await
        .with_context(|| format!("{what}: nothing after {} s", BOUND.as_secs()))
}

/// A keyed `POST path` to `url` over a connection of its own: its head, its body unread.
async fn post(url: &str, path: &str, key: &str) -> Result<Response<Incoming>> {
    let authority = url.trim_start_matches("http://");
    let stream = TcpStream::connect(authority)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    stream.set_nodelay(true)?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let request = Request::post(path)
        .header("host", authority)
        .header("authorization", CREDENTIAL)
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(PROMPT)))?;
    Ok(within(sender.send_request(request), "a response head").await??)
}

/// Checks a stream's head: 200, an event stream, and a replay where `replayed`.
fn check_head(response: &Response<Incoming>, replayed: bool) -> Result<()> {
    let headers = response.headers();
    ensure!(
        response.status() == StatusCode::OK,
        "status {} ({:?})",
        response.status(),
        headers.get("content-type")
    );
    ensure!(
        headers
            .get("content-type")
            .is_some_and(|v| v == "text/event-stream"),
        "content-type {:?}",
        headers.get("content-type")
    );
    let marked = headers.get("idempotent-replayed").is_some_and(|v| v == "true");
    ensure!(
        marked == replayed,
        "idempotent-replayed {:?}, expected it {}",
        headers.get("idempotent-replayed"),
        if replayed { "true" } else { "absent" }
    );
    Ok(())
}

/// Where the clients say they have the events before the hold, or why they never will.
type Beginnings = mpsc::UnboundedSender<Result<(), String>>;

/// Reads `response`'s body to its end, saying on `beginnings` once it has `first` bytes (or why not); an
/// error if the body ends with one or carries trailers.
async fn read(response: Response<Incoming>, first: usize, beginnings: Beginnings) -> Result<Vec<u8>> {
    let mut body = response.into_body();
    let mut data = Vec::new();
    let mut told = false;
    let reading = async {
        while let Some(frame) = body.frame().await {
            let frame = frame.context("the body ended with an error")?;
            let Ok(chunk) = frame.into_data() else {
                bail!("trailers in an event stream that has none");
            };
            data.extend_from_slice(&chunk);
            if !told && data.len() >= first {
                told = true;
                let _ = beginnings.send(Ok(()));
            }
        }
        ensure!(told, "the body ended after {} bytes, before the hold", data.len());
        Ok(())
    };
    if let Err(error) = reading.await {
        if !told {
            let _ = beginnings.send(Err(format!("{error:#}")));
        }
        return Err(error);
    }
    Ok(data)
}
