//! A retry storm, bounded: many clients hammer a few keys through the real binary, retrying every 409
//! with jitter. Nothing but 409s may go wrong, each key executes exactly once, every answer for a key
//! is the same bytes, and the proxy's resident memory stays steady.
//!
//! The short storm is part of the test suite; a long one is one command, bounded by its duration:
//!
//! ```text
//! IDEMPROXY_STORM_SECS=600 cargo test --locked --test it attacks::storm::soak -- --ignored --nocapture
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use tokio::time::Instant;

use crate::support::history::{Rng, memory_kib};
use crate::support::http::TEST_CREDENTIAL;
use crate::support::recorder::Recorder;
use crate::support::{ProxyConfig, ProxyProcess, TestDb};

struct Storm {
    clients: usize,
    keys: u64,
    /// The key set moves on every round, so each round starts with a fresh storm on new keys.
    round: Duration,
    length: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_storm_executes_each_key_once_with_steady_memory() {
    run(Storm {
        clients: 200,
        keys: 10,
        round: Duration::from_secs(1),
        length: Duration::from_secs(10),
    })
    .await;
}

/// The storm for `IDEMPROXY_STORM_SECS` (default 600, at most 3600).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak run: ten minutes by default; see the module documentation"]
async fn soak() {
    let secs = std::env::var("IDEMPROXY_STORM_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600u64);
    run(Storm {
        clients: 200,
        keys: 10,
        round: Duration::from_secs(2),
        length: Duration::from_secs(secs.min(3600)),
    })
    .await;
}

/// What the clients saw: every answer per key, and anything that was neither an answer nor a 409.
#[derive(Default)]
struct Tally {
    answers: HashMap<String, Vec<Bytes>>,
    conflicts: usize,
    errors: Vec<String>,
}

async fn run(storm: Storm) {
    let db = TestDb::create().await;
    let recorder = Recorder::start().await;
    let config = ProxyConfig::new(&db.url(), &recorder.url())
        .set("store.pool_size", 16)
        .set("store.timeout", "10s");
    let proxy = ProxyProcess::spawn(&config).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("HTTP client");
    let tally = Arc::new(Mutex::new(Tally::default()));
    let started = Instant::now();
    let deadline = started + storm.length;
    let storm = Arc::new(storm);
    let clients = (0..storm.clients).map(|n| {
        let (http, tally, storm, url) = (http.clone(), tally.clone(), storm.clone(), proxy.url.clone());
        tokio::spawn(async move {
            let mut rng = Rng::new(n as u64 + 1);
            while Instant::now() < deadline {
                let round = started.elapsed().as_millis() / storm.round.as_millis();
                let key = format!("r{round}-k{}", rng.below(storm.keys));
                hammer(&http, &url, &key, &mut rng, &tally).await;
            }
        })
    });
    let sampler = tokio::spawn(sample_rss(proxy.pid(), deadline));
    for client in join_all(clients).await {
        client.expect("client task");
    }
    let rss = sampler.await.expect("sampler task");
    let tally = tally.lock().unwrap();
    let requests: usize = tally.answers.values().map(Vec::len).sum::<usize>() + tally.conflicts;
    let (warm, late, peak) = steadiness(&rss);
    eprintln!(
        "storm: {} clients on {} keys per round over {:?}: {requests} requests, {} answers, {} 409s, \
         {} errors, {} keys, {} executions; proxy RSS KiB: warm peak {warm}, late peak {late}, \
         VmHWM {peak}",
        storm.clients,
        storm.keys,
        storm.length,
        requests - tally.conflicts,
        tally.conflicts,
        tally.errors.len(),
        tally.answers.len(),
        recorder.executions().len(),
    );
    assert!(
        tally.errors.is_empty(),
        "errors beyond 409: {:?}",
        &tally.errors[..tally.errors.len().min(10)]
    );
    for (key, answers) in &tally.answers {
        assert_eq!(
            recorder.executions_of(TEST_CREDENTIAL, key),
            1,
            "executions of {key}"
        );
        assert!(
            answers.iter().all(|a| *a == answers[0]),
            "answers for {key} differ"
        );
    }
    assert_eq!(
        recorder.execution_count(),
        tally.answers.len(),
        "executions beyond one per key"
    );
    assert!(tally.conflicts > 0, "the storm never met a key in flight");
    assert!(
        late <= warm + warm / 2 + 16 * 1024,
        "proxy memory grew during the storm: {warm} KiB warm, {late} KiB late"
    );
}

/// Sends `key` until it is answered, retrying 409s after a jittered pause.
async fn hammer(http: &reqwest::Client, url: &str, key: &str, rng: &mut Rng, tally: &Mutex<Tally>) {
    for _ in 0..1000 {
        let sent = http
            .post(format!("{url}/ops"))
            .header("idempotency-key", key)
            .header("authorization", TEST_CREDENTIAL)
            .header("content-type", "text/plain")
            .header("x-delay-ms", "150")
            .body(key.to_string())
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => return tally.lock().unwrap().errors.push(format!("{key}: {e}")),
        };
        let status = response.status().as_u16();
        let body = match response.bytes().await {
            Ok(body) => body,
            Err(e) => return tally.lock().unwrap().errors.push(format!("{key}: body: {e}")),
        };
        {
            let mut tally = tally.lock().unwrap();
            match status {
                201 => return tally.answers.entry(key.to_string()).or_default().push(body),
                409 => tally.conflicts += 1,
                other => {
                    let body = String::from_utf8_lossy(&body);
                    return tally.errors.push(format!("{key}: {other} {body}"));
                }
            }
        }
        tokio::time::sleep(rng.millis(10, 100)).await;
    }
    tally
        .lock()
        .unwrap()
        .errors
        .push(format!("{key}: still 409 after 1000 tries"));
}

/// VmRSS samples every 250 ms until `deadline`, then the process's VmHWM last.
async fn sample_rss(pid: u32, deadline: Instant) -> Vec<u64> {
    let mut samples = Vec::new();
    while Instant::now() < deadline {
        if let Some((_, rss)) = memory_kib(pid) {
            samples.push(rss);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    samples.push(memory_kib(pid).map_or(0, |(peak, _)| peak));
    samples
}

/// The peak RSS over the first third of the run (after warm-up), over the last third, and VmHWM.
fn steadiness(samples: &[u64]) -> (u64, u64, u64) {
    let (peak, samples) = samples.split_last().expect("at least the VmHWM sample");
    let third = samples.len() / 3;
    let warm = samples[..third.max(1)].iter().copied().max().unwrap_or(0);
    let late = samples[samples.len() - third.max(1)..]
        .iter()
        .copied()
        .max()
        .unwrap_or(0);
    (warm, late, *peak)
}
