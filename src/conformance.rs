//! `idemproxy conformance <base-url>`: an open conformance suite for idempotency keys, run against any
//! implementation (this proxy, another proxy, a middleware in an app) with the counting service
//! (`SERVICE`) behind it. Each case names the promise it checks and where that comes from; a run
//! prints a table and can write a JSON report (docs/conformance.md).

pub mod case;
pub mod cases;
pub mod client;

use std::fmt::Write as _;
use std::io::Write as _;
use std::time::{Duration, SystemTime};

use http::{HeaderName, HeaderValue};

use crate::cmd::ConformanceArgs;
use crate::conformance::case::{Case, Ctx, Group, Outcome, Verdict};
use crate::conformance::client::{Client, Target};

/// The exit codes: no case failed, a case failed, the suite could not run.
pub const EXIT_PASSED: u8 = 0;
/// See [`EXIT_PASSED`].
pub const EXIT_FAILED: u8 = 1;
/// See [`EXIT_PASSED`].
pub const EXIT_CANNOT_RUN: u8 = 2;

/// What the suite expects behind the target (`--service`; docs/conformance.md says the same).
pub const SERVICE: &str = "\
The counting service: what the suite expects behind the target.

It is what executes requests: a process behind a proxy (idemproxy demo-upstream is one), or the
handlers of the app a middleware wraps, written to this:

  ANY /c/<anything>   an execution. Count it per path (without the query) as it arrives, read the
                      whole body, then answer:
                        status   the `status` query parameter (default 201)
                        headers  Content-Type: application/json, X-Execution: <this path's count>
                        body     {\"execution\": n, \"method\": \"POST\", \"path\": \"/c/...\",
                                  \"received\": \"<the request body as text>\"}
                      Query parameters (integers, all optional):
                        status=N              answer N
                        delay_ms=N            wait N ms after counting, before answering
                        fail_first=N          the path's first N executions answer fail_status
                        fail_status=S         (default 503) instead of status
                        size=N                pad the body (a \"pad\" member) to at least N bytes
                        chunks=N, chunk_ms=M  send the body in N pieces M ms apart (chunked)
  GET /count/<anything>
                      200 {\"count\": n}: the executions of /c/<anything> so far. Not an execution;
                      the suite sends it without a key.

Start one with `idemproxy demo-upstream [ADDR]` (default 127.0.0.1:3000), or let the suite start it:
`idemproxy conformance --demo-upstream 127.0.0.1:3000 <base-url>`.
";

/// What one case found.
pub struct Finding<'a> {
    /// The case.
    pub case: &'a Case,
    /// What it found.
    pub verdict: Verdict,
    /// How long it ran.
    pub took: Duration,
}

/// Runs the command; its exit code.
pub async fn run(args: &ConformanceArgs) -> u8 {
    if args.service {
        return written(std::io::stdout().write_all(SERVICE.as_bytes()));
    }
    let all = cases::all();
    if args.list {
        return written(std::io::stdout().write_all(listing(&all).as_bytes()));
    }
    match prepare(args, &all).await {
        Ok((ctx, chosen)) => {
            let url = args.base_url.clone().unwrap_or_default();
            let json_to_stdout = args.json.as_deref() == Some(std::path::Path::new("-"));
            let mut out: Box<dyn std::io::Write> = if json_to_stdout {
                Box::new(std::io::stderr())
            } else {
                Box::new(std::io::stdout())
            };
            let started = SystemTime::now();
            let _ = writeln!(
                out,
                "idemproxy conformance {} against {url} (run {}): {} case{}\n\
                 the counting service answers behind it (`idemproxy conformance --service` says what \
                 it does)\n",
                env!("CARGO_PKG_VERSION"),
                ctx.run,
                chosen.len(),
                if chosen.len() == 1 { "" } else { "s" }
            );
            let mut findings = Vec::new();
            for case in chosen {
                let began = std::time::Instant::now();
                let verdict = (case.run)(&ctx)
                    .await
                    .unwrap_or_else(|e| case::fail("a request failed", e));
                let finding = Finding {
                    case,
                    verdict,
                    took: began.elapsed(),
                };
                let _ = write!(out, "{}", line(&finding));
                let _ = out.flush();
                findings.push(finding);
            }
            let _ = write!(out, "{}", summary(&findings));
            if let Some(path) = &args.json {
                let report = report(&url, started, &findings);
                let text = serde_json::to_string_pretty(&report).unwrap_or_default() + "\n";
                let written = if json_to_stdout {
                    std::io::stdout().write_all(text.as_bytes())
                } else {
                    std::fs::write(path, text)
                };
                if let Err(e) = written {
                    eprintln!("idemproxy conformance: writing {}: {e}", path.display());
                    return EXIT_CANNOT_RUN;
                }
            }
            if findings.iter().any(|f| f.verdict.outcome == Outcome::Fail) {
                EXIT_FAILED
            } else {
                EXIT_PASSED
            }
        }
        Err(why) => {
            eprintln!("idemproxy conformance: {why}");
            EXIT_CANNOT_RUN
        }
    }
}

/// The exit code of a command whose output is all it does.
fn written(result: std::io::Result<()>) -> u8 {
    match result {
        Ok(()) => EXIT_PASSED,
        Err(e) => {
            eprintln!("idemproxy conformance: cannot write to standard output: {e}");
            EXIT_CANNOT_RUN
        }
    }
}

/// The context and the cases to run, once the target has been found with the service behind it.
async fn prepare<'a>(args: &ConformanceArgs, all: &'a [Case]) -> Result<(Ctx, Vec<&'a Case>), String> {
    let url = args.base_url.as_deref().unwrap_or_default();
    let target = Target::parse(url)?;
    let mut extra = Vec::new();
    for header in &args.headers {
        extra.push(header_line(header)?);
    }
    let chosen: Vec<&Case> = if args.cases.is_empty() {
        all.iter().collect()
    } else {
        let mut chosen = Vec::new();
        for id in &args.cases {
            let case = all
                .iter()
                .find(|c| c.id == id)
                .ok_or_else(|| format!("no case `{id}` (see --list)"))?;
            chosen.push(case);
        }
        chosen
    };
    if let Some(addr) = &args.demo_upstream {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("--demo-upstream {addr}: {e}"))?;
        tokio::spawn(crate::demo::serve(listener));
    }
    let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let ctx = Ctx {
        client: Client {
            target,
            timeout: args.timeout,
        },
        run,
        extra,
        ttl: args.ttl,
    };
    ctx.count("preflight").await.map_err(|e| {
        format!(
            "{e}\n\nThe suite talks to {url} and expects the counting service behind it \
             (`idemproxy conformance --service` says what it is). Start one with \
             `idemproxy demo-upstream` and point the target at it, or add `--demo-upstream ADDR`."
        )
    })?;
    Ok((ctx, chosen))
}

/// `Name: value` as a header.
fn header_line(text: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| format!("--header {text:?}: expected `Name: value`"))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("--header {text:?}: {:?} is not a header name", name.trim()))?;
    let value = HeaderValue::from_str(value.trim())
        .map_err(|_| format!("--header {text:?}: the value is not a header value"))?;
    Ok((name, value))
}

/// `--list`: every case, one per line.
pub fn listing(all: &[Case]) -> String {
    let mut text = String::new();
    for case in all {
        let _ = writeln!(
            text,
            "{:<36} {:<11} {:<44} {}",
            case.id,
            case.group.name(),
            case.source,
            case.title
        );
    }
    let _ = writeln!(text, "{} cases", all.len());
    text
}

fn outcome_word(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Pass => "pass",
        Outcome::Fail => "FAIL",
        Outcome::NotApplicable => "n/a",
    }
}

/// One case's line of the table, and for a failure or a case that did not apply, why and what was seen.
fn line(finding: &Finding) -> String {
    let case = finding.case;
    let mut text = format!(
        "{:<4}  {:<11}  {:<36}  {}\n",
        outcome_word(finding.verdict.outcome),
        case.group.name(),
        case.id,
        case.source
    );
    match finding.verdict.outcome {
        Outcome::Pass => {}
        Outcome::Fail => {
            let _ = writeln!(text, "      expected: {}", finding.verdict.reason);
            let _ = writeln!(text, "      seen:     {}", finding.verdict.seen);
        }
        Outcome::NotApplicable => {
            let _ = writeln!(text, "      because:  {}", finding.verdict.reason);
        }
    }
    text
}

fn counts(findings: &[Finding], group: Option<Group>) -> (usize, usize, usize) {
    let of = |outcome| {
        findings
            .iter()
            .filter(|f| group.is_none_or(|g| f.case.group == g) && f.verdict.outcome == outcome)
            .count()
    };
    (of(Outcome::Pass), of(Outcome::Fail), of(Outcome::NotApplicable))
}

/// The totals, per group and in all.
fn summary(findings: &[Finding]) -> String {
    let mut text = String::from("\n");
    for group in [Group::Required, Group::Recommended, Group::Beyond] {
        let (pass, fail, na) = counts(findings, Some(group));
        if pass + fail + na > 0 {
            let _ = writeln!(
                text,
                "{:<11}  {pass} passed, {fail} failed, {na} not applicable",
                group.name()
            );
        }
    }
    let (pass, fail, na) = counts(findings, None);
    let _ = writeln!(
        text,
        "{:<11}  {pass} passed, {fail} failed, {na} not applicable",
        "all"
    );
    text
}

/// The JSON report (docs/conformance.md, "The report").
fn report(url: &str, started: SystemTime, findings: &[Finding]) -> serde_json::Value {
    let (pass, fail, na) = counts(findings, None);
    let cases: Vec<serde_json::Value> = findings
        .iter()
        .map(|f| {
            serde_json::json!({
                "id": f.case.id,
                "group": f.case.group,
                "source": f.case.source,
                "title": f.case.title,
                "outcome": f.verdict.outcome,
                "seen": f.verdict.seen,
                "reason": f.verdict.reason,
                "millis": u64::try_from(f.took.as_millis()).unwrap_or(u64::MAX),
            })
        })
        .collect();
    serde_json::json!({
        "suite": "idemproxy conformance",
        "version": env!("CARGO_PKG_VERSION"),
        "target": url,
        "date": humantime::format_rfc3339_seconds(started).to_string(),
        "cases": cases,
        "summary": { "pass": pass, "fail": fail, "not_applicable": na },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn there_are_at_least_sixty_cases_each_with_a_unique_id_and_a_source() {
        let all = cases::all();
        assert!(all.len() >= 60, "{} cases", all.len());
        let mut ids: Vec<&str> = all.iter().map(|c| c.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), all.len(), "an id is used twice");
        for case in &all {
            assert!(!case.source.is_empty() && !case.title.is_empty(), "{}", case.id);
            assert!(
                case.id
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{}",
                case.id
            );
        }
        for group in [Group::Required, Group::Recommended, Group::Beyond] {
            assert!(all.iter().any(|c| c.group == group), "{group:?}");
        }
    }

    #[test]
    fn a_header_option_is_a_name_and_a_value() {
        let (name, value) = header_line("X-Tenant:  t1 ").unwrap();
        assert_eq!((name.as_str(), value.to_str().unwrap()), ("x-tenant", "t1"));
        assert!(header_line("no colon").unwrap_err().contains("Name: value"));
        assert!(header_line("bad name: v").is_err());
    }
}
