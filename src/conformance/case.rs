//! What a case is, what it finds, and what every case is given: the client, this run's paths and keys,
//! and the counting service's counts.

use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};
use serde::Serialize;

use crate::conformance::client::{Answer, Ask, Client};

/// Which promise a case checks: what the draft asks of every implementation, what it or a widely
/// followed practice (Stripe, OASIS) recommends, or what this project promises beyond them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// What the draft asks of every implementation (and HTTP of every reader of a header).
    Required,
    /// What the draft recommends, and common practice (Stripe) documents.
    Recommended,
    /// What this project promises beyond them, and OASIS Repeatable Requests where implemented.
    Beyond,
}

impl Group {
    /// The group's name in tables and reports.
    pub fn name(self) -> &'static str {
        match self {
            Group::Required => "required",
            Group::Recommended => "recommended",
            Group::Beyond => "beyond",
        }
    }
}

/// How a case ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The target kept the promise.
    Pass,
    /// It did not.
    Fail,
    /// The case does not apply to this target (it says why).
    NotApplicable,
}

/// How a case ended, what the target answered, and why it failed or did not apply.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// How it ended.
    pub outcome: Outcome,
    /// What the target answered.
    pub seen: String,
    /// What was expected (a failure), or why the case did not apply.
    pub reason: String,
}

/// Passed; `seen` says what the target did.
pub fn pass(seen: impl Into<String>) -> Verdict {
    Verdict {
        outcome: Outcome::Pass,
        seen: seen.into(),
        reason: String::new(),
    }
}

/// Failed: `reason` says what was expected, `seen` what came instead.
pub fn fail(reason: impl Into<String>, seen: impl Into<String>) -> Verdict {
    Verdict {
        outcome: Outcome::Fail,
        seen: seen.into(),
        reason: reason.into(),
    }
}

/// Passed when `kept` (the promise was kept), else failed: `expected` says what was, `seen` what came.
pub fn judge(kept: bool, expected: impl Into<String>, seen: String) -> Verdict {
    if kept { pass(seen) } else { fail(expected, seen) }
}

/// Does not apply to this target, for `reason`.
pub fn not_applicable(reason: impl Into<String>, seen: impl Into<String>) -> Verdict {
    Verdict {
        outcome: Outcome::NotApplicable,
        seen: seen.into(),
        reason: reason.into(),
    }
}

/// A case's run: a failed request is the case's failure (`Err` says which).
pub type Run = for<'a> fn(&'a Ctx) -> Pin<Box<dyn Future<Output = Result<Verdict, String>> + Send + 'a>>;

/// One check of one promise.
pub struct Case {
    /// Stable, for reports and for the contract to name.
    pub id: &'static str,
    /// Which group it is in.
    pub group: Group,
    /// Where the promise comes from: a section of the draft, Stripe's documented behaviour, OASIS
    /// Repeatable Requests, an RFC, or this project's contract.
    pub source: &'static str,
    /// What the case checks, in a line.
    pub title: &'static str,
    /// Runs the case.
    pub run: Run,
}

/// Declares a case: `case!(group, "id", "source", "title", async_fn)`.
#[macro_export]
macro_rules! conformance_case {
    ($group:ident, $id:literal, $source:literal, $title:literal, $run:path) => {
        $crate::conformance::case::Case {
            id: $id,
            group: $crate::conformance::case::Group::$group,
            source: $source,
            title: $title,
            run: |ctx| Box::pin($run(ctx)),
        }
    };
}

/// What every case is given.
pub struct Ctx {
    /// The client the cases send with.
    pub client: Client,
    /// Where the counts are asked: the counting service itself where the run was told it (`--counts`,
    /// `--demo-upstream`), else through the target, which then reports them.
    pub counts: Client,
    /// This run's id: every path and key starts with it, so runs never meet.
    pub run: String,
    /// Headers every request carries (`--header`).
    pub extra: Vec<(HeaderName, HeaderValue)>,
    /// The target's key lifetime, when the run was told it (`--ttl`).
    pub ttl: Option<Duration>,
}

/// How long a case waits for something the target does in the background (a request that goes on
/// after its client left).
pub const PATIENCE: Duration = Duration::from_secs(15);

/// How long a case that finds a request was not executed waits before it asks (see
/// [`Ctx::settled_count`]): an execution later than this is not seen.
pub const SETTLE: Duration = Duration::from_secs(1);

impl Ctx {
    /// The counting service's path for `slug`, below the target's base.
    pub fn path(&self, slug: &str) -> String {
        format!("/c/{}/{slug}", self.run)
    }

    /// A key no other case or run uses.
    pub fn key(&self, slug: &str) -> String {
        format!("{}-{slug}", self.run)
    }

    /// The credential of the suite's first client (and `b`, its second).
    pub fn credential(&self, client: &str) -> String {
        format!("Bearer conformance-{}-{client}", self.run)
    }

    /// A keyed POST of a small JSON body to `slug`'s path, as client `a`.
    pub fn post(&self, slug: &str) -> Ask {
        let mut headers = self.extra.clone();
        headers.push((
            HeaderName::from_static("authorization"),
            HeaderValue::from_str(&self.credential("a")).unwrap_or(HeaderValue::from_static("")),
        ));
        headers.push((
            HeaderName::from_static("content-type"),
            HeaderValue::from_static("application/json"),
        ));
        let ask = Ask {
            method: Method::POST,
            path: self.path(slug),
            headers,
            body: Bytes::from(format!(r#"{{"case":"{slug}","amount":100}}"#)),
        };
        ask.header("idempotency-key", self.key(slug))
    }

    /// `post(slug)` as the suite's second client.
    pub fn post_as_b(&self, slug: &str) -> Ask {
        self.post(slug).set("authorization", self.credential("b"))
    }

    /// How many times the counting service has executed `slug`'s path.
    pub async fn count(&self, slug: &str) -> Result<u64, String> {
        let mut ask = self.post(slug).without("idempotency-key").method(Method::GET);
        ask.path = format!("/count/{}/{slug}", self.run);
        ask.body = Bytes::new();
        let answer = self.counts.send(&ask.without("content-type")).await?;
        if answer.status != 200 {
            return Err(format!(
                "GET /count/… answered {} (is the counting service behind the target?)",
                answer.brief()
            ));
        }
        answer
            .json()
            .and_then(|j| j.get("count").and_then(serde_json::Value::as_u64))
            .ok_or_else(|| format!("GET /count/… answered {}", answer.brief()))
    }

    /// How many times the service has executed `slug`, asked once [`SETTLE`] has passed: for a case
    /// whose verdict is that a request did not execute, which a target could otherwise pass by
    /// refusing it and executing it anyway a moment later.
    pub async fn settled_count(&self, slug: &str) -> Result<u64, String> {
        tokio::time::sleep(SETTLE).await;
        self.count(slug).await
    }

    /// Waits until the service has executed `slug` at least `n` times (at most [`PATIENCE`]); the
    /// count last seen.
    pub async fn count_reaches(&self, slug: &str, n: u64) -> Result<u64, String> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let count = self.count(slug).await?;
            if count >= n || Instant::now() > deadline {
                return Ok(count);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether the target answers a plain retry from its first request (one execution, the same
    /// answer): what a case that checks the target does not overreach (keeps two keys, two clients, a
    /// released failure apart) needs first, since a target that replays nothing passes it for nothing.
    pub async fn replays(&self, slug: &str) -> Result<bool, String> {
        let probe = format!("{slug}-probe");
        let (first, retry) = self.twice(&self.post(&probe)).await?;
        Ok(retry.is_from(&first) && self.count(&probe).await? == 1)
    }

    /// The verdict on a first request and a retry meant to be one operation (`what` says how they
    /// were sent): executed once, the retry answered from the first.
    pub async fn one_operation(
        &self,
        slug: &str,
        first: Answer,
        retry: Answer,
        what: &str,
    ) -> Result<Verdict, String> {
        let count = self.count(slug).await?;
        let seen = format!(
            "{what}: first {}; retry {}; {}",
            first.status,
            retry.brief(),
            executions(count)
        );
        Ok(judge(
            first.status == 201 && count == 1 && retry.is_from(&first),
            "expected one execution, the retry answered from the first",
            seen,
        ))
    }

    /// A keyed request, then its key reused with another payload: the reuse's answer, or the verdict
    /// that the first did not execute (so the reuse's refusal would tell nothing).
    pub async fn reused(&self, slug: &str) -> Result<Result<Answer, Verdict>, String> {
        let ask = self.post(slug);
        let first = self.client.send(&ask).await?;
        if first.status != 201 {
            return Ok(Err(fail(
                "expected the first request to execute before its key is reused",
                first.brief(),
            )));
        }
        Ok(Ok(self
            .retry_past_409(&ask.body(r#"{"another":"payload"}"#))
            .await?))
    }

    /// Sends `ask`, then the same again once it is answered (past any `409`): a request and its retry.
    pub async fn twice(&self, ask: &Ask) -> Result<(Answer, Answer), String> {
        let first = self.client.send(ask).await?;
        let retry = self.retry_past_409(ask).await?;
        Ok((first, retry))
    }

    /// Sends `ask` until it is answered other than `409` for a request still running, for at most
    /// [`PATIENCE`]: what a client that retries such a `409` ends up with. A `409` that says nothing of a
    /// request running (no `Retry-After`, no `operation_state: in_progress`) is retried for two seconds
    /// only, since it may be a refusal that no retry changes (a reused key answered `409`).
    pub async fn retry_past_409(&self, ask: &Ask) -> Result<Answer, String> {
        let started = Instant::now();
        loop {
            let answer = self.client.send(ask).await?;
            let running = answer.header("retry-after").is_some()
                || answer
                    .json()
                    .is_some_and(|j| j["operation_state"] == "in_progress");
            let patience = if running { PATIENCE } else { Duration::from_secs(2) };
            if answer.status != 409 || started.elapsed() > patience {
                return Ok(answer);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The verdict for a case that checks the target keeps apart what it should, on a target that replays
/// nothing ([`Ctx::replays`]).
pub fn replays_nothing() -> Verdict {
    not_applicable(
        "the target executed a plain retry again, so whether it keeps this apart cannot be told",
        "a keyed request and its retry: two executions",
    )
}

/// `label: n executions`, for what was seen.
pub fn executions(n: u64) -> String {
    match n {
        1 => "the service executed it once".to_owned(),
        n => format!("the service executed it {n} times"),
    }
}
