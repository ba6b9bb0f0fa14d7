//! The invariants, held against one case's answer and what the framework reported: a handler that ran is
//! one the proxy let through as the proxy decided (a protected handler keyed with the case's key, the
//! webhook only on a valid signature), nothing the proxy strips reached it, a refusal ran nothing, the
//! case was answered, and the proxy served a keyed request after it. Each broken one is a phrase; a case's
//! phrases make its one line of the report.

use super::corpus::{Case, Client, Expect};
use super::frameworks::{Execution, Protocol};
use super::send::Answer;

/// One case as it went on one lane: the answer, and the answer of the keyed request sent after it.
pub struct Outcome {
    pub case: &'static Case,
    pub framework: &'static str,
    pub protocol: Protocol,
    pub id: String,
    pub key: String,
    pub answer: Answer,
    pub probe_id: String,
    pub probe_key: String,
    pub probe: Answer,
}

/// The header the proxy adds to keyed executions, with the first attempt's value.
const ATTEMPT: &str = "idempotency-attempt";
const FIRST_ATTEMPT: &[&str] = &["1"];

/// Hop-by-hop headers (and those the corpus names in `Connection`), which never reach a handler. `Trailer`
/// is end to end (RFC 9110 does not list it; the proxy relays it so the trailers it announces arrive).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "upgrade",
    "transfer-encoding",
    "http2-settings",
    "x-hop-canary",
];

/// What a request's trailers never carry to a handler: besides hop-by-hop headers, the proxy's own
/// headers, and fields that frame, route or authenticate a request.
const NOT_IN_TRAILERS: &[&str] = &[
    "idempotency-key",
    "idempotency-attempt",
    "host",
    "authorization",
    "content-length",
    "trailer",
];

impl Outcome {
    /// The report line, when an invariant broke.
    pub fn line(&self, ran: &[Execution], probe_ran: &[Execution]) -> Option<String> {
        let mut broken = self.broken(ran);
        broken.extend(self.probe_broken(probe_ran));
        if broken.is_empty() {
            return None;
        }
        let client = match self.case.client {
            Client::H1 => "HTTP/1.1",
            Client::H2 => "HTTP/2",
        };
        Some(format!(
            "{:?} [{}, {} upstream, {client} client]: {}; the client got {}",
            self.case.name,
            self.framework,
            self.protocol.as_str(),
            broken.join("; "),
            self.answer
        ))
    }

    fn broken(&self, ran: &[Execution]) -> Vec<String> {
        let mut broken: Vec<String> = ran.iter().flat_map(|e| self.execution_broken(e)).collect();
        let answered_by_app = matches!(self.answer, Answer::App { .. });
        if !ran.is_empty() && !answered_by_app {
            broken.push(format!("{} ran, yet the answer was not the app's", names(ran)));
        }
        if ran.is_empty() && answered_by_app {
            broken.push("the app answered, but reported no execution".to_owned());
        }
        if ran.len() > 1 {
            broken.push(format!("{} ran {} times", names(ran), ran.len()));
        }
        if let Some(slug) = self.answer.upstream_problem() {
            broken.push(format!(
                "the proxy forwarded it and its exchange with the app failed ({slug}; the app answers at once)"
            ));
        }
        if self.answer == Answer::Hung {
            broken.push("the case hung".to_owned());
        }
        match self.case.expect {
            Expect::Any => {}
            Expect::Runs(handler) => {
                if !(answered_by_app && ran.len() == 1 && ran[0].handler == handler) {
                    broken.push(format!("{handler} should have run once (ran: {})", names(ran)));
                }
            }
            Expect::Refused => {
                if answered_by_app {
                    broken.push("the proxy should have refused it".to_owned());
                }
            }
        }
        broken
    }

    fn execution_broken(&self, e: &Execution) -> Vec<String> {
        let mut broken = Vec::new();
        let attempt = e.values(ATTEMPT);
        let keys = e.values("idempotency-key");
        let keyed = attempt == FIRST_ATTEMPT;
        let body = e
            .body_error
            .as_deref()
            .map(|error| format!(", its body failed: {error}"))
            .unwrap_or_default();
        let seen = format!(
            "{} as {} {} (key {keys:?}, Idempotency-Attempt {attempt:?}{body})",
            e.handler, e.method, e.target
        );
        match e.handler.as_str() {
            "payments" if !keyed => broken.push(format!("ran {seen}: the protected handler, unkeyed")),
            "webhook" if !self.case.signed() => {
                broken.push(format!("ran {seen}: the webhook, on a forged signature"));
            }
            "webhook" if !keyed => broken.push(format!("ran {seen}: the webhook, unkeyed")),
            _ => {}
        }
        if keyed && e.handler != "webhook" && keys != [self.key.as_str()] {
            broken.push(format!(
                "ran {seen}: keyed, but not under the case's key {:?}",
                self.key
            ));
        }
        if !attempt.is_empty() && !keyed {
            broken.push(format!(
                "{} saw Idempotency-Attempt {attempt:?}: a client's own",
                e.handler
            ));
        }
        for (name, value) in &e.headers {
            if hop_by_hop(name, value) {
                broken.push(format!("{} saw the header {name}: {value}", e.handler));
            }
        }
        for (name, value) in &e.trailers {
            if hop_by_hop(name, value) || not_in_trailers(name) {
                broken.push(format!("{} saw the trailer {name}: {value}", e.handler));
            }
        }
        broken
    }

    fn probe_broken(&self, ran: &[Execution]) -> Option<String> {
        let served = matches!(&self.probe, Answer::App { handler, .. } if handler == "payments")
            && ran.len() == 1
            && ran[0].values(ATTEMPT) == FIRST_ATTEMPT
            && ran[0].values("idempotency-key") == [self.probe_key.as_str()];
        (!served).then(|| {
            format!(
                "after it, a keyed POST /payments ({}) got {} and ran {}",
                self.probe_id,
                self.probe,
                names(ran)
            )
        })
    }
}

/// The handlers that ran, for a report line.
fn names(ran: &[Execution]) -> String {
    if ran.is_empty() {
        return "nothing".to_owned();
    }
    let names: Vec<&str> = ran.iter().map(|e| e.handler.as_str()).collect();
    names.join(", ")
}

fn hop_by_hop(name: &str, value: &str) -> bool {
    match name {
        // What the proxy itself may send: `te: trailers` (a client that takes trailers), and the
        // chunked framing of a streamed body over HTTP/1.1.
        "te" => !value.eq_ignore_ascii_case("trailers"),
        "transfer-encoding" => !value.eq_ignore_ascii_case("chunked"),
        _ => HOP_BY_HOP.contains(&name) || name.starts_with("proxy-"),
    }
}

fn not_in_trailers(name: &str) -> bool {
    NOT_IN_TRAILERS.contains(&name)
        || name.starts_with("x-forwarded-")
        || name == "te"
        || name == "transfer-encoding"
}
