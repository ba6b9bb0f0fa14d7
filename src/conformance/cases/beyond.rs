//! What this project promises beyond the draft (docs/contract.md), and what OASIS Repeatable Requests
//! asks where a target implements it: other spellings of a key and a method, each protocol, clients
//! that leave or read slowly, problems a client can act on, and the key's lifetime.

use std::time::{Duration, SystemTime};

use http::Method;

use crate::conformance::case::{
    Case, Ctx, Verdict, executions, fail, judge, not_applicable, pass, replays_nothing,
};
use crate::conformance::client::{Answer, Ask, Reading};
use crate::conformance_case as case;

/// This group's cases.
pub fn cases() -> Vec<Case> {
    vec![
        case!(
            Beyond,
            "quoted-and-bare-same-key",
            "project contract (docs/contract.md#keys-and-headers)",
            "\"k\" and k are the same key",
            quoted_and_bare_same_key
        ),
        case!(
            Beyond,
            "comma-in-quoted-key",
            "RFC 8941 §3.3.3",
            "a quoted key may hold a comma",
            comma_in_quoted_key
        ),
        case!(
            Beyond,
            "duplicate-key-header-refused",
            "project contract (docs/contract.md#keys-and-headers)",
            "two Idempotency-Key lines are refused 400, not executed",
            duplicate_key_header_refused
        ),
        case!(
            Beyond,
            "lowercase-method",
            "project contract (docs/contract.md#keys-and-headers)",
            "`post` is refused, or read as POST: never a second execution of its POST retry",
            lowercase_method
        ),
        case!(
            Beyond,
            "bearer-scheme-case",
            "project contract (docs/contract.md#choosing-the-scope)",
            "`bearer T` and `Bearer T` are one client",
            bearer_scheme_case
        ),
        case!(
            Beyond,
            "content-type-in-payload",
            "project contract (docs/contract.md#what-each-request-gets)",
            "the same body under another Content-Type is another payload",
            content_type_in_payload
        ),
        case!(
            Beyond,
            "get-not-protected",
            "RFC 9110 §9.2.2",
            "a keyed GET (idempotent already) goes to the service each time",
            get_not_protected
        ),
        case!(
            Beyond,
            "trace-refused",
            "project contract (docs/contract.md#what-each-request-gets)",
            "TRACE is refused (405 or 501) and never reaches the service",
            trace_refused
        ),
        case!(
            Beyond,
            "keep-alive-retry",
            "RFC 9112 §9.3",
            "a retry on the same kept-alive connection gets the replay",
            keep_alive_retry
        ),
        case!(
            Beyond,
            "h2-retry-replayed",
            "project contract (docs/contract.md#keys-and-headers)",
            "a request over HTTP/1.1 and its retry over HTTP/2 (h2c) are one operation",
            h2_retry_replayed
        ),
        case!(
            Beyond,
            "h2-streams-once",
            "project contract (docs/contract.md#what-each-request-gets)",
            "8 duplicates on 8 streams of one HTTP/2 connection execute once",
            h2_streams_once
        ),
        case!(
            Beyond,
            "client-leaves-mid-request",
            "project contract (docs/contract.md#what-each-request-gets)",
            "a client that leaves before the answer: the request completes, and its retry gets the replay",
            client_leaves_mid_request
        ),
        case!(
            Beyond,
            "client-leaves-mid-response",
            "project contract (docs/contract.md#what-each-request-gets)",
            "a client that leaves mid-answer: its retry gets the whole answer, executed once",
            client_leaves_mid_response
        ),
        case!(
            Beyond,
            "slow-reader",
            "project contract (docs/contract.md#what-each-request-gets)",
            "a client reading a 2 MiB answer slowly gets it whole, and its retry the same",
            slow_reader
        ),
        case!(
            Beyond,
            "problem-operation-state",
            "project contract (docs/contract.md#problem-types)",
            "a refusal says where the operation stands (operation_state, retryable)",
            problem_operation_state
        ),
        case!(
            Beyond,
            "problem-no-store",
            "project contract (docs/contract.md#problem-types)",
            "a refusal carries Cache-Control: no-store",
            problem_no_store
        ),
        case!(
            Beyond,
            "expires-header",
            "draft-07 §2.3",
            "a key's expiry, where announced, is a future HTTP date, the same on the replay",
            expires_header
        ),
        case!(
            Beyond,
            "expired-key-executes",
            "draft-07 §2.3",
            "after the key's lifetime (--ttl) the same key executes again",
            expired_key_executes
        ),
        case!(
            Beyond,
            "repeatability-accepted",
            "OASIS Repeatable Requests 1.0 §2",
            "a Repeatability-Request-ID is executed once and its repeat answered from it",
            repeatability_accepted
        ),
        case!(
            Beyond,
            "repeatability-too-old",
            "OASIS Repeatable Requests 1.0 §2.2",
            "a request first sent long ago is refused 412, not executed",
            repeatability_too_old
        ),
    ]
}

async fn quoted_and_bare_same_key(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "quoted-and-bare-same-key";
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let quoted = ctx
        .post(slug)
        .set("idempotency-key", format!("\"{}\"", ctx.key(slug)));
    let retry = ctx.retry_past_409(&quoted).await?;
    ctx.one_operation(slug, first, retry, "bare then quoted").await
}

async fn comma_in_quoted_key(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "comma-in-quoted-key";
    let ask = ctx
        .post(slug)
        .set("idempotency-key", format!("\"{},x\"", ctx.key(slug)));
    let (first, retry) = ctx.twice(&ask).await?;
    ctx.one_operation(slug, first, retry, "\"key,x\"").await
}

async fn duplicate_key_header_refused(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "duplicate-key-header-refused";
    let ask = ctx
        .post(slug)
        .header("idempotency-key", format!("{}-other", ctx.key(slug)));
    let answer = ctx.client.send(&ask).await?;
    let count = ctx.settled_count(slug).await?;
    let seen = format!("{}; {}", answer.brief(), executions(count));
    Ok(judge(
        answer.status == 400 && count == 0,
        "expected 400 and no execution",
        seen,
    ))
}

async fn lowercase_method(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "lowercase-method";
    let ask = ctx.post(slug);
    let first = ctx
        .client
        .send_wire(&ask.to_wire(&ctx.client.target, "post", &[]))
        .await?;
    if first.status == 400 || first.status == 405 || first.status == 501 {
        let count = ctx.count(slug).await?;
        let seen = format!("`post` answered {}; {}", first.brief(), executions(count));
        return Ok(judge(count == 0, "refused, yet executed", seen));
    }
    let retry = ctx.retry_past_409(&ask).await?;
    ctx.one_operation(slug, first, retry, "`post` then `POST`").await
}

async fn bearer_scheme_case(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "bearer-scheme-case";
    let ask = ctx.post(slug);
    let first = ctx.client.send(&ask).await?;
    let lower = ctx.credential("a").replacen("Bearer", "bearer", 1);
    let retry = ctx.retry_past_409(&ask.set("authorization", lower)).await?;
    ctx.one_operation(slug, first, retry, "Bearer then bearer").await
}

async fn content_type_in_payload(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "content-type-in-payload";
    let ask = ctx.post(slug);
    ctx.client.send(&ask).await?;
    let other = ctx.retry_past_409(&ask.set("content-type", "text/plain")).await?;
    let count = ctx.settled_count(slug).await?;
    let seen = format!("as text/plain {}; {}", other.brief(), executions(count));
    Ok(judge(
        (400..500).contains(&other.status) && count == 1,
        "expected a refusal as another payload",
        seen,
    ))
}

async fn get_not_protected(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "get-not-protected";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let ask = ctx
        .post(slug)
        .method(Method::GET)
        .body("")
        .without("content-type");
    let (first, second) = (ctx.client.send(&ask).await?, ctx.client.send(&ask).await?);
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; second {}; {}",
        first.status,
        second.brief(),
        executions(count)
    );
    Ok(judge(count == 2, "expected both GETs to reach the service", seen))
}

async fn trace_refused(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "trace-refused";
    let ask = ctx
        .post(slug)
        .method(Method::TRACE)
        .body("")
        .without("content-type");
    let answer = ctx.client.send(&ask).await?;
    let count = ctx.settled_count(slug).await?;
    let seen = format!("{}; {}", answer.brief(), executions(count));
    Ok(judge(
        (answer.status == 405 || answer.status == 501) && count == 0,
        "expected 405 (or 501) and no execution",
        seen,
    ))
}

async fn keep_alive_retry(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "keep-alive-retry";
    let ask = ctx.post(slug);
    let answers = ctx.client.send_on_one_connection(&[ask.clone(), ask]).await?;
    let [first, retry] = <[Answer; 2]>::try_from(answers).map_err(|_| "two answers expected")?;
    ctx.one_operation(slug, first, retry, "one connection").await
}

/// The verdict on an HTTP/2 exchange that failed: the target does not speak h2c where nothing more than
/// the `executed` before it reached the service; else a failure, with the count.
async fn h2_refused(ctx: &Ctx, slug: &str, executed: u64, error: String) -> Result<Verdict, String> {
    let count = ctx.settled_count(slug).await?;
    Ok(if count == executed {
        not_applicable(
            "the target does not speak HTTP/2 with prior knowledge (h2c)",
            error,
        )
    } else {
        fail(
            "expected answers over HTTP/2",
            format!("{error}; {}", executions(count)),
        )
    })
}

async fn h2_retry_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "h2-retry-replayed";
    let ask = ctx.post(slug);
    let first = ctx.client.send(&ask).await?;
    let retry = match ctx.client.send_h2(&ask).await {
        Ok(retry) => retry,
        Err(e) => return h2_refused(ctx, slug, 1, e).await,
    };
    ctx.one_operation(slug, first, retry, "HTTP/1.1 then HTTP/2")
        .await
}

async fn h2_streams_once(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "h2-streams-once";
    let ask = ctx.post(slug).query("delay_ms=300");
    let client = ctx.client.reading_at_most(1 << 20);
    let answers = match client.send_h2_at_once(&vec![ask; 8]).await {
        Ok(answers) => answers,
        Err(e) => return h2_refused(ctx, slug, 0, e).await,
    };
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    let count = ctx.count(slug).await?;
    let seen = format!("statuses {statuses:?}; {}", executions(count));
    Ok(judge(count == 1, "expected one execution", seen))
}

async fn client_leaves_mid_request(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "client-leaves-mid-request";
    let ask = ctx.post(slug).query("delay_ms=500");
    ctx.client
        .send_and_leave(&ask.to_wire(&ctx.client.target, "POST", &[]))
        .await?;
    let reached = ctx.count_reaches(slug, 1).await?;
    if reached == 0 {
        return Ok(fail(
            "expected the request to reach the service though its client left",
            "the service never saw it",
        ));
    }
    let retry = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!("retry {}; {}", retry.brief(), executions(count));
    Ok(judge(
        count == 1 && retry.execution() == Some(1) && retry.status == 201,
        "expected the retry to get the completed request's answer, executed once",
        seen,
    ))
}

async fn client_leaves_mid_response(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "client-leaves-mid-response";
    let ask = ctx.post(slug).query("size=65536&chunks=16&chunk_ms=50");
    let partial = ctx.client.send_reading(&ask, Reading::LeaveAfter(1)).await?;
    let retry = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "left after {} bytes of {}; retry {} ({} bytes); {}",
        partial.body.len(),
        partial.status,
        retry.status,
        retry.body.len(),
        executions(count)
    );
    Ok(judge(
        count == 1 && retry.status == 201 && retry.body.len() >= 65536 && retry.execution() == Some(1),
        "expected the retry to get the whole answer, executed once",
        seen,
    ))
}

async fn slow_reader(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "slow-reader";
    let ask = ctx.post(slug).query("size=2097152");
    let first = ctx
        .client
        .send_reading(&ask, Reading::Slowly(Duration::from_millis(5)))
        .await?;
    let retry = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "read slowly {} ({} bytes); retry {} ({} bytes); {}",
        first.status,
        first.body.len(),
        retry.status,
        retry.body.len(),
        executions(count)
    );
    Ok(judge(
        first.body.len() >= 2 << 20 && retry.body == first.body && count == 1,
        "expected the whole answer, and the same to the retry, executed once",
        seen,
    ))
}

async fn problem_operation_state(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "problem-operation-state";
    let reuse = match ctx.reused(slug).await? {
        Ok(reuse) => reuse,
        Err(first_not_executed) => return Ok(first_not_executed),
    };
    let json = reuse.json().unwrap_or_default();
    let seen = format!("reuse {}", reuse.brief());
    Ok(
        if json.get("operation_state").and_then(|v| v.as_str()) == Some("not_started")
            && json.get("retryable").and_then(|v| v.as_bool()) == Some(false)
        {
            pass(seen)
        } else {
            fail(
                "expected operation_state \"not_started\" and retryable false on the reuse's refusal",
                seen,
            )
        },
    )
}

async fn problem_no_store(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "problem-no-store";
    let reuse = match ctx.reused(slug).await? {
        Ok(reuse) => reuse,
        Err(first_not_executed) => return Ok(first_not_executed),
    };
    let seen = format!(
        "reuse {}; Cache-Control: {:?}",
        reuse.status,
        reuse.header("cache-control")
    );
    Ok(judge(
        reuse
            .header("cache-control")
            .is_some_and(|v| v.to_ascii_lowercase().contains("no-store")),
        "expected Cache-Control: no-store",
        seen,
    ))
}

/// The header a target announces a key's expiry in, if any (the draft names none).
const EXPIRY_HEADERS: [&str; 2] = ["idempotency-expires", "idempotency-key-expires"];

async fn expires_header(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "expires-header";
    let (first, retry) = ctx.twice(&ctx.post(slug)).await?;
    let Some(name) = EXPIRY_HEADERS.into_iter().find(|n| first.header(n).is_some()) else {
        return Ok(not_applicable(
            "no expiry header (Idempotency-Expires); the draft defines none, it asks for the policy in the documentation",
            first.brief(),
        ));
    };
    let value = first.header(name).unwrap_or_default();
    let seen = format!("{name}: {value}; on the replay: {:?}", retry.header(name));
    let future = httpdate::parse_http_date(value).is_ok_and(|t| t > SystemTime::now());
    Ok(judge(
        future && retry.header(name) == Some(value),
        "expected a future HTTP date, the same on the replay",
        seen,
    ))
}

async fn expired_key_executes(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "expired-key-executes";
    let Some(ttl) = ctx.ttl.filter(|t| *t <= Duration::from_secs(60)) else {
        return Ok(not_applicable(
            "needs --ttl with the target's key lifetime, at most 60s",
            "",
        ));
    };
    let ask = ctx.post(slug);
    let first = ctx.client.send(&ask).await?;
    tokio::time::sleep(ttl + Duration::from_secs(2)).await;
    let again = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; after {ttl:?} {}; {}",
        first.status,
        again.brief(),
        executions(count)
    );
    Ok(judge(
        count == 2 && again.execution() == Some(2),
        "expected a second execution after the key's lifetime",
        seen,
    ))
}

/// A request keyed the OASIS way, first sent `ago` ago.
fn repeatable(ctx: &Ctx, slug: &str, ago: Duration) -> Ask {
    let sent = httpdate::fmt_http_date(SystemTime::now() - ago);
    ctx.post(slug)
        .without("idempotency-key")
        .header("repeatability-request-id", ctx.key(slug))
        .header("repeatability-first-sent", sent)
}

async fn repeatability_accepted(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "repeatability-accepted";
    let ask = repeatable(ctx, slug, Duration::ZERO);
    let first = ctx.client.send(&ask).await?;
    if first.header("repeatability-result").is_none() {
        return Ok(not_applicable(
            "no Repeatability-Result: the target does not read OASIS Repeatable Requests here",
            first.brief(),
        ));
    }
    let retry = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first Repeatability-Result: {:?}; retry {}; {}",
        first.header("repeatability-result"),
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        first.header("repeatability-result") == Some("accepted") && count == 1 && retry.is_from(&first),
        "expected accepted, one execution, the repeat answered from the first",
        seen,
    ))
}

async fn repeatability_too_old(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "repeatability-too-old";
    let answer = ctx
        .client
        .send(&repeatable(ctx, slug, Duration::from_secs(30 * 24 * 3600)))
        .await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "{}; Repeatability-Result: {:?}; {}",
        answer.brief(),
        answer.header("repeatability-result"),
        executions(count)
    );
    if answer.header("repeatability-result").is_none() && answer.status != 412 {
        return Ok(not_applicable(
            "no Repeatability-Result: the target does not read OASIS Repeatable Requests here",
            seen,
        ));
    }
    Ok(judge(
        answer.status == 412 && count == 0,
        "expected 412 and no execution",
        seen,
    ))
}
