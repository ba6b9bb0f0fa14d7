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
                                  \"received\": \"<the request body as text, its first 64 KiB>\"}
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

/// How many cases in a row may fail for want of an answer before the run stops: a target that has
/// stopped answering is not worth 68 timeouts.
const UNANSWERED_IN_A_ROW: usize = 3;

/// Where the report goes: a file opened before the run (so a path that cannot be written is said at
/// once), or standard output.
enum ReportTo {
    File(std::fs::File),
    Stdout,
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
    let (ctx, chosen, report_to) = match prepare(args, &all).await {
        Ok(prepared) => prepared,
        Err(why) => {
            eprintln!("idemproxy conformance: {}", printable_lines(&why));
            return EXIT_CANNOT_RUN;
        }
    };
    let url = args.base_url.clone().unwrap_or_default();
    let mut out: Box<dyn std::io::Write> = match report_to {
        Some(ReportTo::Stdout) => Box::new(std::io::stderr()),
        _ => Box::new(std::io::stdout()),
    };
    let started = SystemTime::now();
    let counted_at = if ctx.counts.target.address == ctx.client.target.address {
        "through the target, which reports them".to_owned()
    } else {
        format!("from the counting service at {}", ctx.counts.target.address)
    };
    let _ = writeln!(
        out,
        "idemproxy conformance {} against {url} (run {}): {} case{}\n\
         the counting service answers behind it; executions are counted {counted_at}\n",
        env!("CARGO_PKG_VERSION"),
        ctx.run,
        chosen.len(),
        if chosen.len() == 1 { "" } else { "s" },
    );
    let mut findings = Vec::new();
    let mut unanswered = 0;
    for case in chosen {
        let began = std::time::Instant::now();
        let verdict = match (case.run)(&ctx).await {
            Ok(verdict) => {
                unanswered = 0;
                verdict
            }
            Err(e) => {
                unanswered += 1;
                case::fail("an answer to every request", e)
            }
        };
        let finding = Finding {
            case,
            verdict,
            took: began.elapsed(),
        };
        let _ = write!(out, "{}", line(&finding));
        let _ = out.flush();
        findings.push(finding);
        if unanswered >= UNANSWERED_IN_A_ROW {
            let _ = writeln!(
                out,
                "\n{UNANSWERED_IN_A_ROW} cases in a row got no answer from {url}: the run stops here"
            );
            break;
        }
    }
    let _ = write!(out, "{}", summary(&findings));
    if let Some(to) = report_to {
        let report = report(&url, started, &findings);
        let text = serde_json::to_string_pretty(&report).unwrap_or_default() + "\n";
        let written = match to {
            ReportTo::Stdout => std::io::stdout().write_all(text.as_bytes()),
            ReportTo::File(mut file) => file.write_all(text.as_bytes()),
        };
        if let Err(e) = written {
            eprintln!("idemproxy conformance: writing the report: {e}");
            return EXIT_CANNOT_RUN;
        }
    }
    if unanswered >= UNANSWERED_IN_A_ROW {
        EXIT_CANNOT_RUN
    } else if findings.iter().any(|f| f.verdict.outcome == Outcome::Fail) {
        EXIT_FAILED
    } else {
        EXIT_PASSED
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

/// The headers the suite sets itself or that change how a request is read, which `--header` may not:
/// framing and the connection, the target's host, the body's type, the key each case chooses, and the
/// credential that names each of its two clients.
const OWN_HEADERS: [&str; 14] = [
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "upgrade",
    "expect",
    "idempotency-key",
    "repeatability-request-id",
    "repeatability-first-sent",
    "authorization",
    "proxy-authorization",
];

/// The context, the cases to run and where the report goes, once the target has been found with the
/// service behind it.
async fn prepare<'a>(
    args: &ConformanceArgs,
    all: &'a [Case],
) -> Result<(Ctx, Vec<&'a Case>, Option<ReportTo>), String> {
    let url = args.base_url.as_deref().unwrap_or_default();
    let target = Target::parse(url)?;
    if args.timeout < Duration::from_millis(100) {
        return Err(format!("--timeout {:?}: at least 100ms", args.timeout));
    }
    if args.ttl.is_some_and(|t| t < Duration::from_secs(1)) {
        return Err("--ttl: the target's key lifetime, at least 1s".to_owned());
    }
    if args.demo_upstream.is_some() && args.counts.is_some() {
        return Err(
            "--demo-upstream and --counts: one of them (--demo-upstream asks its own service)".to_owned(),
        );
    }
    let mut extra = Vec::new();
    for header in &args.headers {
        let (name, value) = header_line(header)?;
        if OWN_HEADERS.contains(&name.as_str()) {
            return Err(format!(
                "--header {header:?}: the suite sets {name} itself, or it changes how a request is \
                 read (each case sends its own key and body, each of its two clients its own \
                 Authorization)"
            ));
        }
        extra.push((name, value));
    }
    let mut chosen: Vec<&Case> = Vec::new();
    for id in &args.cases {
        let case = all
            .iter()
            .find(|c| c.id == id)
            .ok_or_else(|| format!("no case `{id}` (see --list)"))?;
        if !chosen.iter().any(|c| c.id == case.id) {
            chosen.push(case);
        }
    }
    if chosen.is_empty() {
        chosen = all.iter().collect();
    }
    if let Some(path) = args.json.as_deref().filter(|p| p.as_os_str() != "-") {
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty());
        if folder.is_some_and(|f| !f.is_dir()) {
            return Err(format!("--json {}: no such folder", path.display()));
        }
        if path.exists() && !path.is_file() {
            return Err(format!("--json {}: not a regular file", path.display()));
        }
    }
    let client = Client {
        target,
        timeout: args.timeout,
        max_read: client::MAX_READ,
    };
    let mut counts = client.clone();
    if let Some(addr) = &args.demo_upstream {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("--demo-upstream {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        tokio::spawn(crate::demo::serve(listener));
        counts.target = Target::parse(&format!("http://{bound}"))?;
    }
    if let Some(service) = &args.counts {
        counts.target = Target::parse(service).map_err(|e| format!("--counts {e}"))?;
    }
    let run = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let ctx = Ctx {
        client,
        counts,
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
    if ctx.counts.target.address != ctx.client.target.address {
        // The target must reach the service the counts are asked of: one keyed request through it
        // must be counted there.
        let probe = ctx.client.send(&ctx.post("preflight-reaches")).await?;
        if ctx.count_reaches("preflight-reaches", 1).await? == 0 {
            return Err(format!(
                "a request sent to {url} (answered {}) was not counted by the service at {}: \
                 the target does not forward to it",
                probe.status, ctx.counts.target.address
            ));
        }
    }
    let report_to = match &args.json {
        None => None,
        Some(path) if path.as_os_str() == "-" => Some(ReportTo::Stdout),
        Some(path) => Some(ReportTo::File(
            std::fs::File::create(path).map_err(|e| format!("--json {}: {e}", path.display()))?,
        )),
    };
    Ok((ctx, chosen, report_to))
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

/// `text` with its control characters, and the format characters that reorder or hide text (bidi
/// overrides, zero-width ones), escaped, for a terminal: what a target answered may hold any.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            let hiding = matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}');
            if c.is_control() || hiding {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// [`printable`], line by line, keeping the line breaks of the suite's own messages.
fn printable_lines(text: &str) -> String {
    text.split('\n').map(printable).collect::<Vec<_>>().join("\n")
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
            let _ = writeln!(text, "      expected: {}", printable(&finding.verdict.reason));
            let _ = writeln!(text, "      seen:     {}", printable(&finding.verdict.seen));
        }
        Outcome::NotApplicable => {
            let _ = writeln!(text, "      because:  {}", printable(&finding.verdict.reason));
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
    fn what_a_target_answered_is_printed_without_its_control_characters() {
        assert_eq!(printable("ok\r\u{1b}[2Kpass"), "ok\\u{d}\\u{1b}[2Kpass");
        assert_eq!(printable("a\u{202e}b\u{200b}c"), "a\\u{202e}b\\u{200b}c");
        assert_eq!(printable("caf\u{e9} 201"), "caf\u{e9} 201");
        assert_eq!(printable_lines("one\ntwo\u{7}"), "one\ntwo\\u{7}");
    }

    #[test]
    fn a_header_option_is_a_name_and_a_value() {
        let (name, value) = header_line("X-Tenant:  t1 ").unwrap();
        assert_eq!((name.as_str(), value.to_str().unwrap()), ("x-tenant", "t1"));
        assert!(header_line("no colon").unwrap_err().contains("Name: value"));
        assert!(header_line("bad name: v").is_err());
    }
}
