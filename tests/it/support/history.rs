//! A history checker for the proxy's promise under faults. Clients log every request they sent and what
//! came back; the recording upstream logs every execution; the key table is read at the end. [`check`]
//! then judges the history against the model, per key:
//!
//! - executions after the first are stale takeovers: each reaches the upstream at least a lease after
//!   the one before (less the longest a won claim can take to reach the upstream);
//! - at most one execution per winning claim: executions <= 1 + stale takeovers, where the takeovers
//!   of a key are read from its record (`attempt` counts the winning claims of the record's life; the
//!   workload never lets a claim be released, and the checker verifies no record was re-claimed as a
//!   `retry` unless a proxy logged giving back an orphaned claim of that key — a claim its request
//!   stopped waiting for, or a Redis claim no replica confirmed, which executed nothing —, so every
//!   other claim after the first is a stale takeover);
//! - every upstream answer (2xx or 4xx) a client received is byte-identical to the stored response,
//!   except the live answer of an execution that a stale takeover superseded (counted, not hidden);
//! - no response crossed scopes or keys: the upstream echoes credentials, key and payload in the body;
//! - the stored response is that key's latest execution (the one of the claim that holds the key);
//! - 422 only for a payload other than the stored one; otherwise only the refusals a fault explains;
//! - no claim stays stuck: once the faults end, every record is completed, released or stale within a
//!   bound, and after one more request per key (which takes every stale claim over) all are completed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};

use super::recorder::Execution;

/// A small seeded generator (SplitMix64), so a run is replayed from its seed.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `low..high` milliseconds.
    pub fn millis(&mut self, low: u64, high: u64) -> Duration {
        Duration::from_millis(low + self.below(high - low))
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What a client asked for: credentials (the scope), key and payload.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Op {
    pub authorization: String,
    pub key: String,
    pub payload: String,
}

/// What came back.
#[derive(Debug, Clone)]
pub enum Seen {
    /// A whole response.
    Response {
        status: u16,
        content_type: String,
        replayed: bool,
        body: Bytes,
    },
    /// No whole response: connection refused or broken, body cut off, or the client's own timeout.
    Broken,
}

/// One request of the history.
#[derive(Debug, Clone)]
pub struct Observation {
    pub op: Op,
    pub seen: Seen,
    /// Which proxy, when and how it was sent, for the report.
    pub via: String,
}

/// A record of the key table as the checker needs it.
#[derive(Debug, Clone)]
pub struct Record {
    pub status: String,
    pub attempt: i32,
    pub claim_kind: String,
    pub lease_left: bool,
    pub response_status: Option<i16>,
    pub response_body: Option<Vec<u8>>,
}

/// Records by (scope, key).
pub type Records = HashMap<(String, String), Record>;

/// Reads every record of the key table.
pub async fn load_records(client: &tokio_postgres::Client) -> Records {
    let rows = client
        .query(
            "SELECT scope, key, status, attempt, claim_kind, locked_until > now() AS lease_left,
                    response_status, response_body
             FROM idemproxy.records",
            &[],
        )
        .await
        .expect("read the key table");
    rows.iter()
        .map(|row| {
            let record = Record {
                status: row.get("status"),
                attempt: row.get("attempt"),
                claim_kind: row.get("claim_kind"),
                lease_left: row.get("lease_left"),
                response_status: row.get("response_status"),
                response_body: row.get("response_body"),
            };
            ((row.get("scope"), row.get("key")), record)
        })
        .collect()
}

/// The scope the proxy derives from these credentials (default route, `authorization` only).
pub fn scope_of(authorization: &str) -> String {
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_str(authorization) {
        headers.insert(http::header::AUTHORIZATION, value);
    }
    let policy = idemproxy::config::RawIdempotency::default()
        .validate()
        .expect("the default policy is valid");
    idemproxy::proxy::key::scope("default", &policy.key, &headers)
}

/// The verdict: counts for the summary and every violation found.
#[derive(Default)]
pub struct Report {
    pub requests: usize,
    pub by_answer: BTreeMap<String, usize>,
    pub keys: usize,
    pub executions: usize,
    pub takeovers: usize,
    pub superseded_answers: usize,
    pub records_by_state: BTreeMap<String, usize>,
    pub violations: Vec<String>,
}

impl Report {
    fn count(&mut self, what: impl Into<String>) {
        *self.by_answer.entry(what.into()).or_default() += 1;
    }

    fn violation(&mut self, what: String) {
        if self.violations.len() < 1000 {
            self.violations.push(what);
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "requests: {}", self.requests)?;
        writeln!(f, "answers: {:?}", self.by_answer)?;
        writeln!(
            f,
            "keys: {}, executions: {}, stale takeovers (from records): {}, superseded live answers: {}",
            self.keys, self.executions, self.takeovers, self.superseded_answers
        )?;
        writeln!(f, "records by state: {:?}", self.records_by_state)?;
        writeln!(f, "violations: {}", self.violations.len())?;
        for violation in self.violations.iter().take(20) {
            writeln!(f, "  {violation}")?;
        }
        Ok(())
    }
}

/// Judges the history; see the module documentation for the rules. A key's executions must come at
/// least `spacing` apart: the lease less the longest a won claim may take to reach the upstream.
/// `given_back` holds the key hashes (`store::key_hash`) of which a proxy logged giving back an orphaned
/// claim.
pub fn check(
    observations: &[Observation],
    executions: &[Execution],
    records: &Records,
    spacing: Duration,
    given_back: &HashSet<String>,
) -> Report {
    let mut report = Report {
        requests: observations.len(),
        executions: executions.len(),
        ..Report::default()
    };
    let mut by_key: HashMap<(String, String), Vec<&Execution>> = HashMap::new();
    for execution in executions {
        let id = (scope_of(&execution.authorization), execution.key.clone());
        by_key.entry(id).or_default().push(execution);
    }
    for observation in observations {
        check_observation(observation, &by_key, records, &mut report);
    }
    check_keys(&by_key, records, given_back, &mut report);
    check_spacing(&by_key, spacing, &mut report);
    for ((_, key), record) in records {
        check_record_state(key, record, &mut report);
    }
    report
}

fn check_observation(
    observation: &Observation,
    by_key: &HashMap<(String, String), Vec<&Execution>>,
    records: &Records,
    report: &mut Report,
) {
    let op = &observation.op;
    let via = &observation.via;
    let Seen::Response {
        status,
        content_type,
        replayed,
        body,
    } = &observation.seen
    else {
        return report.count("broken");
    };
    let id = (scope_of(&op.authorization), op.key.clone());
    let record = records.get(&id);
    if content_type.starts_with("application/problem+json") {
        let stored = record.and_then(|r| r.response_body.as_deref());
        let stored_payload = by_key
            .get(&id)
            .and_then(|runs| runs.iter().find(|e| Some(&e.body[..]) == stored))
            .map(|e| e.payload.as_str());
        return check_refusal(op, *status, body, stored_payload, report);
    }
    if *status >= 500 {
        report.count(format!("{status}"));
        return report.violation(format!(
            "{op:?}: upstream-style {status} (the upstream never sends one)"
        ));
    }
    report.count(if *replayed { "replayed" } else { "executed" });
    if let Err(why) = echoes(op, body) {
        return report.violation(format!("{op:?} via {via}: crossed: {why}"));
    }
    let stored = record.and_then(|r| Some((r.response_status?, r.response_body.as_deref()?)));
    if stored == Some((*status as i16, &body[..])) {
        return;
    }
    let taken_over = record.is_some_and(|r| r.attempt > 1);
    let own = by_key
        .get(&id)
        .is_some_and(|list| list.iter().any(|e| e.body == *body && e.status == *status));
    if taken_over && own && !*replayed {
        report.superseded_answers += 1;
        return;
    }
    report.violation(format!(
        "{op:?} via {via}: got {status} (replayed: {replayed}) {}, stored {:?}",
        exec_of(body),
        stored.map(|(s, b)| (s, exec_of(b)))
    ));
}

fn check_refusal(op: &Op, status: u16, body: &[u8], stored_payload: Option<&str>, report: &mut Report) {
    let problem: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let kind = problem["type"]
        .as_str()
        .unwrap_or("")
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_string();
    report.count(format!("{status} {kind}"));
    match (status, kind.as_str()) {
        (409, "key-in-flight")
        | (503, "store-unavailable")
        | (502, "upstream-unreachable")
        | (504, "upstream-timeout") => {}
        (422, "key-reused") => {
            if stored_payload == Some(op.payload.as_str()) {
                report.violation(format!("{op:?}: 422 for the stored payload itself"));
            }
        }
        _ => report.violation(format!("{op:?}: unexpected refusal {status} {kind}")),
    }
}

/// Whether a body is the upstream's answer to this very op.
fn echoes(op: &Op, body: &[u8]) -> Result<(), String> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body is not the upstream's JSON: {e}"))?;
    let field = |name: &str| value[name].as_str().unwrap_or("<missing>").to_string();
    let echoed = Op {
        authorization: field("authorization"),
        key: field("key"),
        payload: field("payload"),
    };
    if echoed == *op {
        Ok(())
    } else {
        Err(format!("the body answers {echoed:?}"))
    }
}

fn exec_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .map(|v| format!("exec {}", v["exec"]))
        .unwrap_or_else(|_| format!("{} bytes", body.len()))
}

fn check_keys(
    by_key: &HashMap<(String, String), Vec<&Execution>>,
    records: &Records,
    given_back: &HashSet<String>,
    report: &mut Report,
) {
    report.keys = records.len();
    for (id, record) in records {
        let runs = by_key.get(id).map_or(&[][..], Vec::as_slice);
        report.takeovers += (record.attempt - 1).max(0) as usize;
        if record.claim_kind == "retry" && !given_back.contains(&idemproxy::store::key_hash(&id.0, &id.1)) {
            report.violation(format!(
                "{id:?}: re-claimed as a retry, but nothing in the workload releases a claim and no \
                 proxy gave back an orphaned claim of it"
            ));
        }
        if runs.len() > record.attempt.max(0) as usize {
            report.violation(format!(
                "{id:?}: {} executions, but only 1 + {} stale takeovers",
                runs.len(),
                record.attempt - 1
            ));
        }
        check_stored(id, record, runs, report);
    }
    for (id, runs) in by_key {
        if !records.contains_key(id) {
            report.violation(format!("{id:?}: {} executions but no record", runs.len()));
        }
    }
}

/// A claim is taken over only once its lease has run out, and the lease runs from the claim statement,
/// after which the request is forwarded at once: so a key's next execution reaches the upstream at least
/// a lease after the one before, less the time from claim statement to upstream (at most the store's
/// operation bound, plus the upstream timeout after which the proxy gives up, plus the upstream's read).
fn check_spacing(by_key: &HashMap<(String, String), Vec<&Execution>>, floor: Duration, report: &mut Report) {
    for (id, runs) in by_key {
        for pair in runs.windows(2) {
            let gap = pair[1].at.saturating_duration_since(pair[0].at);
            if gap < floor {
                report.violation(format!(
                    "{id:?}: exec {} only {gap:?} after exec {}: taken over before its lease ran out",
                    pair[1].exec, pair[0].exec
                ));
            }
        }
    }
}

/// The stored response must be this key's latest execution, byte for byte. A later claim is only won
/// once the earlier one's lease has run out, and a claim's request reaches the upstream well within a
/// lease (see `check_spacing`), so the last claim's execution is the last to reach the upstream; every
/// earlier claim's write is fenced off.
fn check_stored(id: &(String, String), record: &Record, runs: &[&Execution], report: &mut Report) {
    let (Some(status), Some(body)) = (record.response_status, record.response_body.as_deref()) else {
        return;
    };
    let latest = runs.iter().max_by_key(|e| e.exec);
    if !latest.is_some_and(|e| e.status as i16 == status && e.body == body && e.key == id.1) {
        report.violation(format!(
            "{id:?}: stored {status} {} is not its latest execution ({:?})",
            exec_of(body),
            latest.map(|e| e.exec)
        ));
    }
}

fn check_record_state(key: &str, record: &Record, report: &mut Report) {
    let state = match (record.status.as_str(), record.lease_left) {
        ("processing", true) => "processing (live)",
        ("processing", false) => "processing (stale)",
        (other, _) => other,
    };
    *report.records_by_state.entry(state.to_string()).or_default() += 1;
    // Every op was sent once more after the faults, and nothing in the workload releases a claim.
    if state != "completed" {
        report.violation(format!("{key}: {state} after every op was sent again"));
    }
}

/// The key hashes (`store::key_hash`, as the logs name records) of which a proxy logged giving back an
/// orphaned claim (a claim won after its request stopped waiting for the store, or a Redis claim no
/// replica confirmed), or sending a give-back whose answer was lost (it may have been applied), from the
/// proxies' JSON logs.
pub fn orphans_given_back(logs: &[String]) -> HashSet<String> {
    logs.iter()
        .filter(|line| {
            line.contains("a claim won after its request gave up waiting was given back")
                || line.contains("an orphaned claim's give-back went unanswered")
                || line.contains("a claim no replica confirmed was given back")
                || line.contains("the give-back of a claim no replica confirmed went unanswered")
        })
        .filter_map(|line| {
            let json = &line[line.find('{')?..];
            let event: serde_json::Value = serde_json::from_str(json).ok()?;
            Some(event["key_hash"].as_str()?.to_string())
        })
        .collect()
}

/// The peak resident set (`VmHWM`) and current resident set (`VmRSS`) of a process, in KiB.
pub fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}
