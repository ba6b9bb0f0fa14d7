//! What the draft (draft-ietf-httpapi-idempotency-key-header-07) asks of every resource that takes
//! `Idempotency-Key`, and what HTTP itself (RFC 9110) asks of anything that reads a header: a keyed
//! request runs once, its retries get its result, a duplicate in flight and a reused key are refused
//! without running, and the key is read as HTTP defines it.

use http::Method;

use crate::conformance::case::{
    Case, Ctx, Verdict, executions, fail, judge, not_applicable, pass, replays_nothing,
};
use crate::conformance::client::{Answer, Ask};
use crate::conformance_case as case;

/// This group's cases.
pub fn cases() -> Vec<Case> {
    vec![
        case!(
            Required,
            "first-execution",
            "draft-07 §2.6",
            "a keyed request is executed once and answered",
            first_execution
        ),
        case!(
            Required,
            "retry-same-status",
            "draft-07 §2.6",
            "a retry gets the first execution's status and does not execute",
            retry_same_status
        ),
        case!(
            Required,
            "retry-same-body",
            "draft-07 §2.6",
            "a retry gets the first execution's body, byte for byte",
            retry_same_body
        ),
        case!(
            Required,
            "retries-execute-once",
            "draft-07 §2.6",
            "ten retries in a row execute nothing more",
            retries_execute_once
        ),
        case!(
            Required,
            "error-result-replayed",
            "draft-07 §2.6",
            "a completed request that failed (the service's 400) is answered the same to its retry",
            error_result_replayed
        ),
        case!(
            Required,
            "concurrent-duplicate-not-executed",
            "draft-07 §2.6",
            "a duplicate sent while the original runs is not executed",
            concurrent_duplicate_not_executed
        ),
        case!(
            Required,
            "concurrent-duplicate-409",
            "draft-07 §2.7",
            "a duplicate sent while the original runs gets 409 (or waits for the original's result)",
            concurrent_duplicate_409
        ),
        case!(
            Required,
            "concurrent-burst-once",
            "draft-07 §2.6",
            "16 duplicates sent at once execute once",
            concurrent_burst_once
        ),
        case!(
            Required,
            "mismatch-not-executed",
            "draft-07 §2.7",
            "a key reused with another payload is refused with a 4xx and not executed",
            mismatch_not_executed
        ),
        case!(
            Required,
            "mismatch-422",
            "draft-07 §2.7",
            "a key reused with another payload gets 422",
            mismatch_422
        ),
        case!(
            Required,
            "mismatch-keeps-original",
            "draft-07 §2.7",
            "after a refused reuse, the original's retry still gets the original's result",
            mismatch_keeps_original
        ),
        case!(
            Required,
            "mismatch-in-flight-not-executed",
            "draft-07 §2.7",
            "another payload under a key whose request is running is refused, not executed",
            mismatch_in_flight_not_executed
        ),
        case!(
            Required,
            "distinct-keys-execute",
            "draft-07 §2.2",
            "two keys for the same request are two executions",
            distinct_keys_execute
        ),
        case!(
            Required,
            "distinct-keys-concurrent",
            "draft-07 §2.2",
            "8 requests with 8 keys sent at once all execute",
            distinct_keys_concurrent
        ),
        case!(
            Required,
            "keyless-not-deduplicated",
            "draft-07 §2.7",
            "requests without a key are never answered from one another (forwarded each, or refused 400)",
            keyless_not_deduplicated
        ),
        case!(
            Required,
            "key-sf-string",
            "draft-07 §2.1",
            "a key sent as a structured-field string (quoted) is a key like any other",
            key_sf_string
        ),
        case!(
            Required,
            "patch-protected",
            "draft-07 §1",
            "a keyed PATCH is executed once and its retry answered from the first",
            patch_protected
        ),
        case!(
            Required,
            "other-path-not-replayed",
            "draft-07 §2.4",
            "the same key on another path never gets the first path's response",
            other_path_not_replayed
        ),
        case!(
            Required,
            "other-method-not-replayed",
            "draft-07 §2.4",
            "the same key with another method never gets the first method's response",
            other_method_not_replayed
        ),
        case!(
            Required,
            "other-query-not-replayed",
            "draft-07 §2.4",
            "the same key with another query never gets the first query's response",
            other_query_not_replayed
        ),
        case!(
            Required,
            "header-name-any-case",
            "RFC 9110 §5.1",
            "IDEMPOTENCY-KEY and idempotency-key are one header",
            header_name_any_case
        ),
        case!(
            Required,
            "key-value-whitespace",
            "RFC 9110 §5.5",
            "spaces around the key's value are not part of the key",
            key_value_whitespace
        ),
        case!(
            Required,
            "conflict-problem-details",
            "draft-07 §2.7",
            "the 409 for a duplicate in flight is an RFC 9457 problem document",
            conflict_problem_details
        ),
        case!(
            Required,
            "mismatch-problem-details",
            "draft-07 §2.7",
            "the 422 for a reused key is an RFC 9457 problem document",
            mismatch_problem_details
        ),
        case!(
            Required,
            "missing-key-problem-details",
            "draft-07 §2.7",
            "where a key is required, its absence gets 400 as an RFC 9457 problem document",
            missing_key_problem_details
        ),
    ]
}

/// A request and its retry, and what the service counted.
async fn request_and_retry(ctx: &Ctx, slug: &str, ask: &Ask) -> Result<(Answer, Answer, u64), String> {
    let (first, retry) = ctx.twice(ask).await?;
    let count = ctx.count(slug).await?;
    Ok((first, retry, count))
}

async fn first_execution(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "first-execution";
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let count = ctx.count(slug).await?;
    let seen = format!("{}; {}", first.brief(), executions(count));
    Ok(match (first.status, count, first.execution()) {
        (201, 1, Some(1)) => pass(seen),
        _ => fail("expected the service's 201, executed once", seen),
    })
}

async fn retry_same_status(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "retry-same-status";
    let (first, retry, count) = request_and_retry(ctx, slug, &ctx.post(slug)).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.status == first.status && count == 1,
        "expected the retry to get the first status without executing",
        seen,
    ))
}

async fn retry_same_body(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "retry-same-body";
    let (first, retry, count) = request_and_retry(ctx, slug, &ctx.post(slug)).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.brief(),
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.body == first.body && count == 1,
        "expected the retry's body to be the first's, byte for byte",
        seen,
    ))
}

async fn retries_execute_once(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "retries-execute-once";
    let ask = ctx.post(slug);
    let first = ctx.client.send(&ask).await?;
    for i in 0..10 {
        let retry = ctx.retry_past_409(&ask).await?;
        if retry.body != first.body || retry.status != first.status {
            return Ok(fail(
                "expected every retry to get the first answer",
                format!(
                    "retry {} answered {}; first was {}",
                    i + 1,
                    retry.brief(),
                    first.brief()
                ),
            ));
        }
    }
    let count = ctx.count(slug).await?;
    let seen = format!("11 requests; {}", executions(count));
    Ok(judge(count == 1, "expected one execution", seen))
}

async fn error_result_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "error-result-replayed";
    let ask = ctx.post(slug).query("status=400");
    let (first, retry, count) = request_and_retry(ctx, slug, &ask).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        first.status == 400 && retry.status == 400 && retry.body == first.body && count == 1,
        "expected the service's 400 to be the answer to the retry too, without executing again",
        seen,
    ))
}

/// The original (slow) running, a duplicate sent once the service has it, and then the original's
/// answer and the count.
struct InFlight {
    original: Answer,
    duplicate: Answer,
    count: u64,
}

async fn duplicate_in_flight(ctx: &Ctx, slug: &str, duplicate: Ask) -> Result<InFlight, String> {
    let ask = ctx.post(slug).query("delay_ms=1500");
    let duplicate = Ask {
        path: ask.path.clone(),
        ..duplicate
    };
    let client = ctx.client.clone();
    let original = tokio::spawn(async move { client.send(&ask).await });
    if ctx.count_reaches(slug, 1).await? == 0 {
        return Err("the original request never reached the service".to_owned());
    }
    let duplicate = ctx.client.send(&duplicate).await?;
    let original = original.await.map_err(|e| e.to_string())??;
    let count = ctx.settled_count(slug).await?;
    Ok(InFlight {
        original,
        duplicate,
        count,
    })
}

async fn concurrent_duplicate_not_executed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "concurrent-duplicate-not-executed";
    let seen = duplicate_in_flight(ctx, slug, ctx.post(slug)).await?;
    let text = format!("duplicate {}; {}", seen.duplicate.brief(), executions(seen.count));
    let answered_from_original = seen.duplicate.is_from(&seen.original);
    Ok(judge(
        seen.count == 1
            && (seen.duplicate.status == 409
                || answered_from_original
                || (400..500).contains(&seen.duplicate.status)),
        "expected the duplicate to be refused (or answered with the original's result) without executing",
        text,
    ))
}

async fn concurrent_duplicate_409(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "concurrent-duplicate-409";
    let seen = duplicate_in_flight(ctx, slug, ctx.post(slug)).await?;
    let text = format!("duplicate {}", seen.duplicate.brief());
    Ok(if seen.duplicate.status == 409 {
        pass(text)
    } else if seen.duplicate.is_from(&seen.original) && seen.count == 1 {
        not_applicable(
            "the target makes a duplicate wait for the original's result instead",
            text,
        )
    } else {
        fail("expected 409 Conflict", text)
    })
}

async fn concurrent_burst_once(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "concurrent-burst-once";
    let ask = ctx.post(slug).query("delay_ms=300");
    let mut sent = Vec::new();
    for _ in 0..16 {
        let client = ctx.client.reading_at_most(1 << 20);
        let ask = ask.clone();
        sent.push(tokio::spawn(async move { client.send(&ask).await }));
    }
    let mut statuses = Vec::new();
    for task in sent {
        statuses.push(task.await.map_err(|e| e.to_string())??.status);
    }
    statuses.sort_unstable();
    let count = ctx.settled_count(slug).await?;
    let seen = format!("statuses {statuses:?}; {}", executions(count));
    Ok(judge(count == 1, "expected exactly one execution", seen))
}

async fn mismatch(ctx: &Ctx, slug: &str) -> Result<(Answer, Answer, u64), String> {
    let ask = ctx.post(slug);
    let first = ctx.client.send(&ask).await?;
    let other = ask.body(format!(r#"{{"case":"{slug}","amount":999}}"#));
    let reuse = ctx.retry_past_409(&other).await?;
    let count = ctx.settled_count(slug).await?;
    Ok((first, reuse, count))
}

async fn mismatch_not_executed(ctx: &Ctx) -> Result<Verdict, String> {
    let (_, reuse, count) = mismatch(ctx, "mismatch-not-executed").await?;
    let seen = format!("reuse {}; {}", reuse.brief(), executions(count));
    Ok(judge(
        (400..500).contains(&reuse.status) && count == 1,
        "expected a 4xx refusal and no second execution",
        seen,
    ))
}

async fn mismatch_422(ctx: &Ctx) -> Result<Verdict, String> {
    let (_, reuse, count) = mismatch(ctx, "mismatch-422").await?;
    let seen = format!("reuse {}; {}", reuse.brief(), executions(count));
    Ok(judge(
        reuse.status == 422,
        "expected 422 Unprocessable Content",
        seen,
    ))
}

async fn mismatch_keeps_original(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "mismatch-keeps-original";
    let (first, reuse, _) = mismatch(ctx, slug).await?;
    if !(400..500).contains(&reuse.status) {
        return Ok(not_applicable(
            "the reuse was not refused (see mismatch-not-executed)",
            reuse.brief(),
        ));
    }
    let retry = ctx.retry_past_409(&ctx.post(slug)).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "reuse {}; original's retry {}; {}",
        reuse.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.body == first.body && retry.status == first.status && count == 1,
        "expected the original's retry to get the original's answer",
        seen,
    ))
}

async fn mismatch_in_flight_not_executed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "mismatch-in-flight-not-executed";
    let other = ctx.post(slug).body(r#"{"other":true}"#);
    let seen = duplicate_in_flight(ctx, slug, other).await?;
    let text = format!(
        "other payload {}; {}",
        seen.duplicate.brief(),
        executions(seen.count)
    );
    Ok(judge(
        (400..500).contains(&seen.duplicate.status) && seen.count == 1,
        "expected 409 or 422 and no second execution",
        text,
    ))
}

async fn distinct_keys_execute(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "distinct-keys-execute";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let second = ctx
        .client
        .send(
            &ctx.post(slug)
                .set("idempotency-key", ctx.key("distinct-keys-execute-2")),
        )
        .await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; second {}; {}",
        first.status,
        second.brief(),
        executions(count)
    );
    Ok(judge(
        count == 2 && second.execution() == Some(2),
        "expected two executions",
        seen,
    ))
}

async fn distinct_keys_concurrent(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "distinct-keys-concurrent";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let mut sent = Vec::new();
    for i in 0..8 {
        let ask = ctx
            .post(slug)
            .query("delay_ms=200")
            .set("idempotency-key", ctx.key(&format!("{slug}-{i}")));
        let client = ctx.client.reading_at_most(1 << 20);
        sent.push(tokio::spawn(async move { client.send(&ask).await }));
    }
    let mut statuses = Vec::new();
    for task in sent {
        statuses.push(task.await.map_err(|e| e.to_string())??.status);
    }
    let count = ctx.count(slug).await?;
    let seen = format!("statuses {statuses:?}; {}", executions(count));
    Ok(judge(count == 8, "expected eight executions", seen))
}

async fn keyless_not_deduplicated(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "keyless-not-deduplicated";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let ask = ctx.post(slug).without("idempotency-key");
    let first = ctx.client.send(&ask).await?;
    let second = ctx.client.send(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; second {}; {}",
        first.status,
        second.brief(),
        executions(count)
    );
    Ok(judge(
        count == 2 || (count == 0 && first.status == 400 && second.status == 400),
        "expected both to execute (or both to be refused 400)",
        seen,
    ))
}

async fn key_sf_string(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "key-sf-string";
    let ask = ctx
        .post(slug)
        .set("idempotency-key", format!("\"{}\"", ctx.key(slug)));
    let (first, retry, count) = request_and_retry(ctx, slug, &ask).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        first.status == 201 && retry.body == first.body && count == 1,
        "expected the quoted key to be executed once and its retry answered from the first",
        seen,
    ))
}

async fn patch_protected(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "patch-protected";
    let ask = ctx.post(slug).method(Method::PATCH);
    let (first, retry, count) = request_and_retry(ctx, slug, &ask).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.body == first.body && count == 1,
        "expected one execution",
        seen,
    ))
}

/// The verdict on a second request under the first's key that differs from it: it may be refused (a
/// 4xx, unexecuted) or executed as its own, but never answered with the first's response.
fn not_the_first(first: &Answer, second: &Answer, second_count: u64, first_count: u64) -> Verdict {
    let seen = format!(
        "first {}; second {}; second executed {second_count}, first {first_count}",
        first.brief(),
        second.brief()
    );
    if second.body == first.body || (second.is_from(first) && second_count == 0) {
        fail(
            "expected a refusal or an execution of its own, not the first request's response",
            seen,
        )
    } else if (400..500).contains(&second.status) && second_count == 0 || second_count == 1 {
        pass(seen)
    } else {
        fail("expected a refusal (4xx) or an execution of its own", seen)
    }
}

async fn other_path_not_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "other-path-not-replayed";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let other_slug = "other-path-not-replayed-elsewhere";
    let mut other = ctx.post(slug);
    other.path = ctx.path(other_slug);
    let second = ctx.retry_past_409(&other).await?;
    Ok(not_the_first(
        &first,
        &second,
        ctx.count(other_slug).await?,
        ctx.count(slug).await?,
    ))
}

async fn other_method_not_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "other-method-not-replayed";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let second = ctx.retry_past_409(&ctx.post(slug).method(Method::PATCH)).await?;
    let count = ctx.count(slug).await?;
    Ok(not_the_first(
        &first,
        &second,
        count.saturating_sub(1),
        count.min(1),
    ))
}

async fn other_query_not_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "other-query-not-replayed";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug).query("order=1")).await?;
    let second = ctx.retry_past_409(&ctx.post(slug).query("order=2")).await?;
    let count = ctx.count(slug).await?;
    Ok(not_the_first(
        &first,
        &second,
        count.saturating_sub(1),
        count.min(1),
    ))
}

async fn header_name_any_case(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "header-name-any-case";
    let ask = ctx.post(slug);
    let wire = ask.to_wire(
        &ctx.client.target,
        "POST",
        &[("idempotency-key", "IDEMPOTENCY-KEY")],
    );
    let first = ctx.client.send_wire(&wire).await?;
    let retry = ctx.retry_past_409(&ask).await?;
    ctx.one_operation(slug, first, retry, "IDEMPOTENCY-KEY, then idempotency-key")
        .await
}

async fn key_value_whitespace(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "key-value-whitespace";
    let ask = ctx.post(slug);
    let spaced = ask
        .clone()
        .set("idempotency-key", format!("  {}\t ", ctx.key(slug)));
    let wire = spaced.to_wire(&ctx.client.target, "POST", &[]);
    let first = ctx.client.send_wire(&wire).await?;
    let retry = ctx.retry_past_409(&ask).await?;
    ctx.one_operation(slug, first, retry, "spaced, then bare").await
}

/// Whether `answer` is an RFC 9457 problem document: its media type, and a JSON object with `type`
/// (or none, meaning `about:blank`) and `title` strings and, where present, `status` numbers.
pub fn problem_shape(answer: &Answer) -> Result<(), String> {
    if !answer.is_problem() {
        return Err("not application/problem+json".to_owned());
    }
    let json = answer.json().ok_or("a body that is not JSON")?;
    let object = json.as_object().ok_or("a body that is not a JSON object")?;
    for member in ["type", "title", "detail"] {
        if object.get(member).is_some_and(|v| !v.is_string()) {
            return Err(format!("`{member}` is not a string"));
        }
    }
    if object
        .get("status")
        .is_some_and(|v| v.as_u64() != Some(u64::from(answer.status)))
    {
        return Err("`status` is not the response's status".to_owned());
    }
    if !object.contains_key("title") && !object.contains_key("type") {
        return Err("neither `type` nor `title`".to_owned());
    }
    Ok(())
}

async fn conflict_problem_details(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "conflict-problem-details";
    let seen = duplicate_in_flight(ctx, slug, ctx.post(slug)).await?;
    let text = seen.duplicate.brief();
    if seen.duplicate.status != 409 {
        return Ok(not_applicable("the duplicate was not answered 409", text));
    }
    Ok(match problem_shape(&seen.duplicate) {
        Ok(()) => pass(text),
        Err(why) => fail(format!("expected a problem document: {why}"), text),
    })
}

async fn mismatch_problem_details(ctx: &Ctx) -> Result<Verdict, String> {
    let (first, reuse, _) = mismatch(ctx, "mismatch-problem-details").await?;
    if first.status != 201 {
        return Ok(fail(
            "expected the first request to execute before its key is reused",
            first.brief(),
        ));
    }
    let text = reuse.brief();
    if !(400..500).contains(&reuse.status) {
        return Ok(fail(
            "expected the reuse to be refused with a problem document",
            text,
        ));
    }
    Ok(match problem_shape(&reuse) {
        Ok(()) => pass(text),
        Err(why) => fail(format!("expected a problem document: {why}"), text),
    })
}

async fn missing_key_problem_details(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "missing-key-problem-details";
    let answer = ctx
        .client
        .send(&ctx.post(slug).without("idempotency-key"))
        .await?;
    let text = answer.brief();
    if answer.status != 400 {
        return Ok(not_applicable(
            "keys are optional here: a request without one was not refused",
            text,
        ));
    }
    Ok(match problem_shape(&answer) {
        Ok(()) => pass(text),
        Err(why) => fail(format!("expected a problem document: {why}"), text),
    })
}
