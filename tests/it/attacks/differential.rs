//! The differential corpus: odd request spellings (`differential/corpus.rs`, one line each) sent through the
//! real proxy binary to real frameworks (`differential/frameworks.rs`, one line each: Flask on Werkzeug,
//! Go's net/http, Node's http and http2, hyper), each in its own process on a real socket, over every
//! upstream protocol the framework speaks. What each framework executed must be what the proxy decided
//! (`differential/verdict.rs`): a spelling that reaches the protected handler never bypasses the key
//! requirement, the webhook runs only on a valid signature, a refusal runs nothing, nothing the proxy
//! strips (a client's `Idempotency-Attempt`, hop-by-hop headers, forbidden trailers) reaches a handler,
//! and no case hangs or leaves the proxy unable to serve the next keyed request.
//!
//! Each framework starts once; each (framework, upstream protocol) lane has its own proxy (SQLite store:
//! the store is not what is tried here) and runs the corpus in order, the lanes side by side. Executions
//! are told apart by the case id each request carries (`x-diff-case`), and judged once every lane is done,
//! so an execution that arrives late still counts. The test fails with one line per broken (case,
//! framework, upstream protocol).

mod corpus;
mod frameworks;
mod hyper_app;
mod send;
mod verdict;

use std::collections::HashSet;
use std::io::Write as _;
use std::time::{Duration, Instant};

use corpus::{CASES, Case};
use frameworks::{FRAMEWORKS, Protocol, Running};
use send::{Answer, Request};
use verdict::Outcome;

use crate::support::raw::addr_of;
use crate::support::signatures::STRIPE_SECRET;
use crate::support::{Backend, ProxyConfig, ProxyProcess, TestStore};

/// The proxy's routes, mirroring the apps': payments need a key, the Stripe webhook a valid signature
/// (keyed by the event id), everything else is the default route (a key optional).
const ROUTES: &str = r#"
[[routes]]
name = "payments"
path = "/payments"
required = true

[[routes]]
name = "stripe"
path = "/webhooks/stripe"
key = "json:/id"
required = true
unscoped = "shared"
scope_headers = []
fingerprint_body = "json"
signature = { scheme = "stripe", secrets_file = "SECRETS" }
"#;

/// How long the proxy waits for the app: the apps answer at once, so a case that makes the proxy wait
/// this long has broken the exchange (and is reported by its 504).
const UPSTREAM_TIMEOUT: &str = "10s";

/// Bound on an execution being reported once the app has answered (the report travels on a pipe).
const REPORT_BOUND: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn differential_every_framework_executes_what_the_proxy_decided() {
    let started = Instant::now();
    let mut secrets = tempfile::NamedTempFile::new().unwrap();
    writeln!(secrets, "{STRIPE_SECRET}").unwrap();
    let apps = futures_util::future::join_all(FRAMEWORKS.iter().map(frameworks::start)).await;
    let secrets = secrets.path().display().to_string();
    let secrets = secrets.as_str();
    let lanes = apps.iter().flat_map(|app| {
        let protocols = FRAMEWORKS.iter().find(|f| f.name == app.name).unwrap().protocols;
        protocols
            .iter()
            .map(move |&protocol| run_lane(app, protocol, secrets))
    });
    let outcomes: Vec<Vec<Outcome>> = futures_util::future::join_all(lanes).await;

    let mut lines = Vec::new();
    for outcome in outcomes.iter().flatten() {
        let app = apps.iter().find(|app| app.name == outcome.framework).unwrap();
        let ran = reported(app, &outcome.id, &outcome.answer).await;
        let probe_ran = reported(app, &outcome.probe_id, &outcome.probe).await;
        lines.extend(outcome.line(&ran, &probe_ran));
    }
    for app in &apps {
        lines.extend(unclaimed(app, &outcomes));
    }
    let runs: usize = outcomes.iter().map(Vec::len).sum();
    eprintln!(
        "differential: {} cases on {} lanes ({runs} runs) in {:.0?}, {} broken",
        CASES.len(),
        outcomes.len(),
        started.elapsed(),
        lines.len()
    );
    assert!(
        lines.is_empty(),
        "{} (case, framework, upstream) runs broke an invariant:\n{}",
        lines.len(),
        lines.join("\n")
    );
}

/// What `app` reported for the request `id`; when the client got the app's answer, waits (bounded) for the
/// report to arrive.
async fn reported(app: &Running, id: &str, answer: &Answer) -> Vec<frameworks::Execution> {
    match answer {
        Answer::App { .. } => app.ledger.await_of(id, REPORT_BOUND).await,
        _ => app.ledger.of(id),
    }
}

/// A line for each execution no request of the run claims (its case id missing or mangled).
fn unclaimed(app: &Running, outcomes: &[Vec<Outcome>]) -> Vec<String> {
    let ids: HashSet<&str> = outcomes
        .iter()
        .flatten()
        .flat_map(|o| [o.id.as_str(), o.probe_id.as_str()])
        .collect();
    app.ledger
        .unclaimed(&|id| ids.contains(id))
        .into_iter()
        .map(|e| {
            format!(
                "(no case) [{}]: {} ran for {} {} with no case id of this run (case id {:?})",
                app.name,
                e.handler,
                e.method,
                e.target,
                e.case()
            )
        })
        .collect()
}

/// The corpus, in order, through a proxy of its own in front of `app` over `protocol`; after each case, a
/// keyed request that the proxy must still serve.
async fn run_lane(app: &Running, protocol: Protocol, secrets: &str) -> Vec<Outcome> {
    let store = TestStore::create(Backend::Sqlite).await;
    let config = ProxyConfig::on(&store, &app.url(protocol))
        .set("upstream.protocol", protocol.as_str())
        .set("upstream.timeout", UPSTREAM_TIMEOUT)
        .with_toml(&ROUTES.replace("SECRETS", secrets));
    let proxy = ProxyProcess::spawn(&config).await;
    let addr = addr_of(&proxy.url);
    let mut outcomes = Vec::new();
    for (index, case) in CASES.iter().enumerate() {
        let id = format!("{}.{}.{index}", app.name, protocol.as_str());
        outcomes.push(run_case(case, app.name, protocol, id, addr).await);
    }
    outcomes
}

async fn run_case(
    case: &'static Case,
    framework: &'static str,
    protocol: Protocol,
    id: String,
    addr: &str,
) -> Outcome {
    let request = Request::new(case, &id, addr);
    let answer = request.send().await;
    let probe_id = format!("{id}.probe");
    let probe = Request::new(&PROBE, &probe_id, addr);
    let probe_answer = probe.send().await;
    Outcome {
        case,
        framework,
        protocol,
        key: request.key().to_owned(),
        probe_key: probe.key().to_owned(),
        id,
        answer,
        probe_id,
        probe: probe_answer,
    }
}

/// The keyed request sent after every case.
const PROBE: Case = Case {
    name: "probe",
    client: corpus::Client::H1,
    head: "POST /payments",
    headers: &["Idempotency-Key: {key}"],
    body: corpus::Body::Json,
    expect: corpus::Expect::Runs("payments"),
};
