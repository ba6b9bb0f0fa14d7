//! What the draft recommends, and what the practice most clients are written against (Stripe's API)
//! documents: a replay says it is one, failures the service did not process are not kept, keys have a
//! length and a character set, one client's key is not another's, and what is replayed is everything
//! the first answer was, however large or slow it came.

use crate::conformance::case::{
    Case, Ctx, Verdict, executions, fail, judge, not_applicable, pass, replays_nothing,
};
use crate::conformance::cases::required::problem_shape;
use crate::conformance::client::{Answer, Ask};
use crate::conformance_case as case;

/// This group's cases.
pub fn cases() -> Vec<Case> {
    vec![
        case!(
            Recommended,
            "replay-marked",
            "Stripe: Idempotent-Replayed",
            "a replayed answer carries Idempotent-Replayed: true",
            replay_marked
        ),
        case!(
            Recommended,
            "first-not-marked",
            "Stripe: Idempotent-Replayed",
            "the first execution's answer is not marked replayed",
            first_not_marked
        ),
        case!(
            Recommended,
            "replay-keeps-headers",
            "draft-07 §2.6",
            "a replay carries the first answer's headers (Content-Type, the service's own)",
            replay_keeps_headers
        ),
        case!(
            Recommended,
            "replay-empty-204",
            "draft-07 §2.6",
            "a 204 with no body is replayed as a 204 with no body",
            replay_empty_204
        ),
        case!(
            Recommended,
            "service-422-replayed",
            "draft-07 §2.6",
            "the service's own 422 is replayed, not confused with a reused key",
            service_422_replayed
        ),
        case!(
            Recommended,
            "503-released",
            "project contract (docs/contract.md)",
            "a 503 from the service is not kept: the retry executes again",
            released_503
        ),
        case!(
            Recommended,
            "500-released",
            "project contract (docs/contract.md)",
            "a 500 from the service is not kept: the retry executes again",
            released_500
        ),
        case!(
            Recommended,
            "429-released",
            "RFC 6585 §4",
            "a 429 from the service is not kept: the retry executes again",
            released_429
        ),
        case!(
            Recommended,
            "409-retry-after",
            "RFC 9110 §10.2.3",
            "the 409 for a duplicate in flight says when to retry (Retry-After)",
            conflict_retry_after
        ),
        case!(
            Recommended,
            "in-flight-then-replayed",
            "draft-07 §2.6",
            "the duplicate's retry, once the original has ended, gets the original's result",
            in_flight_then_replayed
        ),
        case!(
            Recommended,
            "retry-the-moment-read",
            "project contract (docs/contract.md)",
            "a retry sent the moment the answer has been read gets the replay, never 409",
            retry_the_moment_read
        ),
        case!(
            Recommended,
            "key-255-accepted",
            "Stripe: keys up to 255 characters",
            "a 255-character key works",
            key_255_accepted
        ),
        case!(
            Recommended,
            "key-oversized-refused",
            "Stripe: keys up to 255 characters",
            "a 300-character key is refused 400, not executed",
            key_oversized_refused
        ),
        case!(
            Recommended,
            "key-empty-refused",
            "draft-07 §2.2",
            "an empty key is refused 400, or taken as no key; never shared",
            key_empty_refused
        ),
        case!(
            Recommended,
            "key-non-ascii-refused",
            "draft-07 §2.1 (RFC 8941 §3.3.3)",
            "a key with bytes outside printable ASCII is refused 400, not executed",
            key_non_ascii_refused
        ),
        case!(
            Recommended,
            "scope-between-clients",
            "Stripe: keys are per account",
            "another client's request under the same key is executed for it",
            scope_between_clients
        ),
        case!(
            Recommended,
            "scope-no-cross-mismatch",
            "Stripe: keys are per account",
            "another client's other payload under the same key is not refused as a reuse",
            scope_no_cross_mismatch
        ),
        case!(
            Recommended,
            "problem-type-uri",
            "RFC 9457 §3.1.1",
            "a refusal's problem `type` is an absolute URI",
            problem_type_uri
        ),
        case!(
            Recommended,
            "large-response-replayed",
            "draft-07 §2.6",
            "a 3 MiB answer is replayed byte for byte",
            large_response_replayed
        ),
        case!(
            Recommended,
            "oversized-response-not-rerun",
            "draft-07 §2.6",
            "an answer larger than the target keeps (16 MiB) is not executed again on retry",
            oversized_response_not_rerun
        ),
        case!(
            Recommended,
            "streamed-response-replayed",
            "draft-07 §2.6",
            "an answer streamed in pieces is replayed whole",
            streamed_response_replayed
        ),
        case!(
            Recommended,
            "large-request-once",
            "draft-07 §2.4",
            "a 1 MiB request body is executed once and its retry replayed",
            large_request_once
        ),
        case!(
            Recommended,
            "mismatch-last-byte",
            "draft-07 §2.4",
            "1 MiB bodies differing in their last byte are another payload",
            mismatch_last_byte
        ),
    ]
}

async fn replay_marked(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "replay-marked";
    let (_, retry) = ctx.twice(&ctx.post(slug)).await?;
    let seen = retry.brief();
    Ok(match retry.header("idempotent-replayed") {
        Some(v) if v.eq_ignore_ascii_case("true") => pass(seen),
        _ => fail("expected Idempotent-Replayed: true on the replay", seen),
    })
}

async fn first_not_marked(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "first-not-marked";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let seen = first.brief();
    Ok(match first.header("idempotent-replayed") {
        None => pass(seen),
        Some(v) if v.eq_ignore_ascii_case("false") => pass(seen),
        Some(_) => fail("expected no Idempotent-Replayed: true on a first execution", seen),
    })
}

async fn replay_keeps_headers(ctx: &Ctx) -> Result<Verdict, String> {
    let (first, retry) = ctx.twice(&ctx.post("replay-keeps-headers")).await?;
    let pick = |a: &Answer| {
        (
            a.header("content-type").map(str::to_owned),
            a.header("x-execution").map(str::to_owned),
        )
    };
    let seen = format!("first {:?}; retry {:?}", pick(&first), pick(&retry));
    Ok(judge(
        pick(&first) == pick(&retry) && pick(&first).1.is_some(),
        "expected Content-Type and X-Execution as the first answer had them",
        seen,
    ))
}

async fn replay_empty_204(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "replay-empty-204";
    let ask = ctx.post(slug).query("status=204");
    let (first, retry) = ctx.twice(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; retry {} ({} bytes); {}",
        first.status,
        retry.status,
        retry.body.len(),
        executions(count)
    );
    Ok(judge(
        first.status == 204 && retry.status == 204 && retry.body.is_empty() && count == 1,
        "expected 204, empty, executed once",
        seen,
    ))
}

async fn service_422_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "service-422-replayed";
    let ask = ctx.post(slug).query("status=422");
    let (first, retry) = ctx.twice(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.status == 422 && retry.body == first.body && count == 1,
        "expected the service's 422 replayed, executed once",
        seen,
    ))
}

/// A request the service fails with `status` the first time, and its retry, which should run again.
async fn released(ctx: &Ctx, slug: &str, status: u16) -> Result<Verdict, String> {
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let ask = ctx
        .post(slug)
        .query(&format!("fail_first=1&fail_status={status}"));
    let first = ctx.client.send(&ask).await?;
    let retry = ctx.retry_past_409(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        first.status == status && retry.status == 201 && count == 2,
        format!("expected the {status} not to be kept and the retry to execute"),
        seen,
    ))
}

async fn released_503(ctx: &Ctx) -> Result<Verdict, String> {
    released(ctx, "503-released", 503).await
}

async fn released_500(ctx: &Ctx) -> Result<Verdict, String> {
    released(ctx, "500-released", 500).await
}

async fn released_429(ctx: &Ctx) -> Result<Verdict, String> {
    released(ctx, "429-released", 429).await
}

/// A duplicate sent while a slow original runs: the duplicate's answer and the original's task.
async fn duplicate_of_slow(
    ctx: &Ctx,
    slug: &str,
) -> Result<(Answer, tokio::task::JoinHandle<Result<Answer, String>>), String> {
    let ask = ctx.post(slug).query("delay_ms=1500");
    let client = ctx.client.clone();
    let original_ask = ask.clone();
    let original = tokio::spawn(async move { client.send(&original_ask).await });
    if ctx.count_reaches(slug, 1).await? == 0 {
        return Err("the original request never reached the service".to_owned());
    }
    Ok((ctx.client.send(&ask).await?, original))
}

async fn conflict_retry_after(ctx: &Ctx) -> Result<Verdict, String> {
    let (duplicate, original) = duplicate_of_slow(ctx, "409-retry-after").await?;
    let _ = original.await;
    let seen = duplicate.brief();
    if duplicate.status != 409 {
        return Ok(not_applicable("the duplicate was not answered 409", seen));
    }
    let seen = format!("{seen}; Retry-After: {:?}", duplicate.header("retry-after"));
    let valid = duplicate
        .header("retry-after")
        .is_some_and(|v| v.trim().parse::<u64>().is_ok() || httpdate::parse_http_date(v).is_ok());
    Ok(judge(
        valid,
        "expected Retry-After with seconds or an HTTP date",
        seen,
    ))
}

async fn in_flight_then_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "in-flight-then-replayed";
    let (duplicate, original) = duplicate_of_slow(ctx, slug).await?;
    let original = original.await.map_err(|e| e.to_string())??;
    let retry = ctx.retry_past_409(&ctx.post(slug).query("delay_ms=1500")).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "duplicate {}; its retry {}; {}",
        duplicate.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        retry.body == original.body && count == 1,
        "expected the original's answer, executed once",
        seen,
    ))
}

async fn retry_the_moment_read(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "retry-the-moment-read";
    for i in 0..10 {
        let ask = ctx
            .post(slug)
            .set("idempotency-key", ctx.key(&format!("{slug}-{i}")));
        let first = ctx.client.send(&ask).await?;
        let retry = ctx.client.send(&ask).await?;
        if !retry.is_from(&first) || retry.body != first.body {
            return Ok(fail(
                "expected the replay at once",
                format!("round {}: first {}; retry {}", i + 1, first.status, retry.brief()),
            ));
        }
    }
    let count = ctx.count(slug).await?;
    let seen = format!(
        "10 keys, each retried the moment its answer was read; {}",
        executions(count)
    );
    Ok(judge(count == 10, "expected ten executions", seen))
}

async fn key_255_accepted(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "key-255-accepted";
    let key: String = format!("{}-", ctx.key(slug))
        .chars()
        .chain(std::iter::repeat('k'))
        .take(255)
        .collect();
    let (first, retry) = ctx.twice(&ctx.post(slug).set("idempotency-key", key)).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.brief(),
        executions(count)
    );
    Ok(judge(
        first.status == 201 && retry.body == first.body && count == 1,
        "expected the key to work",
        seen,
    ))
}

/// A request with `key` as its key: refused 400 without executing passes.
async fn refused_key(ctx: &Ctx, slug: &str, key: &[u8]) -> Result<Verdict, String> {
    let answer = ctx
        .client
        .send(&ctx.post(slug).set("idempotency-key", key))
        .await?;
    let count = ctx.settled_count(slug).await?;
    let seen = format!("{}; {}", answer.brief(), executions(count));
    Ok(judge(
        answer.status == 400 && count == 0,
        "expected 400 and no execution",
        seen,
    ))
}

async fn key_oversized_refused(ctx: &Ctx) -> Result<Verdict, String> {
    let key = format!("{}-{}", ctx.key("key-oversized-refused"), "k".repeat(300));
    refused_key(ctx, "key-oversized-refused", key.as_bytes()).await
}

async fn key_non_ascii_refused(ctx: &Ctx) -> Result<Verdict, String> {
    let key = format!("{}-caf\u{e9}", ctx.key("key-non-ascii-refused"));
    refused_key(ctx, "key-non-ascii-refused", key.as_bytes()).await
}

async fn key_empty_refused(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "key-empty-refused";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx
        .client
        .send(&ctx.post(slug).set("idempotency-key", ""))
        .await?;
    let second = ctx
        .client
        .send(&ctx.post(slug).set("idempotency-key", "").body(r#"{"other":1}"#))
        .await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; second (another body) {}; {}",
        first.status,
        second.brief(),
        executions(count)
    );
    let own = second.received().as_deref() == Some(r#"{"other":1}"#);
    Ok(judge(
        (first.status == 400 && second.status == 400 && count == 0)
            || (count == 2 && own && second.execution() == Some(2)),
        "expected 400 (or both executed as keyless), never one empty key shared by two requests",
        seen,
    ))
}

async fn scope_between_clients(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "scope-between-clients";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let other = ctx.retry_past_409(&ctx.post_as_b(slug)).await?;
    // The first client's retry, after the second's request: still its own first answer.
    let again = ctx.retry_past_409(&ctx.post(slug)).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "client a {}; client b {}; client a again {}; {}",
        first.status,
        other.brief(),
        again.brief(),
        executions(count)
    );
    Ok(judge(
        count == 2
            && other.execution() == Some(2)
            && other.received() == first.received()
            && again.is_from(&first),
        "expected the second client's request to execute for it, and the first client's retry to get the first answer",
        seen,
    ))
}

async fn scope_no_cross_mismatch(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "scope-no-cross-mismatch";
    if !ctx.replays(slug).await? {
        return Ok(replays_nothing());
    }
    let first = ctx.client.send(&ctx.post(slug)).await?;
    let other = ctx
        .retry_past_409(&ctx.post_as_b(slug).body(r#"{"client":"b"}"#))
        .await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "client a {}; client b (another payload) {}; {}",
        first.status,
        other.brief(),
        executions(count)
    );
    let own = other.received().as_deref() == Some(r#"{"client":"b"}"#);
    Ok(judge(
        count == 2 && other.status == 201 && own && other.execution() == Some(2),
        "expected the second client's request to execute",
        seen,
    ))
}

async fn problem_type_uri(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "problem-type-uri";
    let reuse = match ctx.reused(slug).await? {
        Ok(reuse) => reuse,
        Err(first_not_executed) => return Ok(first_not_executed),
    };
    let seen = reuse.brief();
    if problem_shape(&reuse).is_err() {
        return Ok(fail(
            "expected the reuse to be refused with a problem document",
            seen,
        ));
    }
    let kind = reuse
        .json()
        .and_then(|j| j.get("type").and_then(|t| t.as_str().map(str::to_owned)));
    Ok(match kind {
        Some(kind) if kind == "about:blank" || url::Url::parse(&kind).is_ok_and(|u| u.has_host()) => {
            pass(seen)
        }
        _ => fail("expected `type` to be an absolute URI", seen),
    })
}

/// A request answered `query`, its retry, and whether the retry was the first byte for byte.
async fn replayed_whole(ctx: &Ctx, slug: &str, ask: &Ask, least: usize) -> Result<Verdict, String> {
    let (first, retry) = ctx.twice(ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {} ({} bytes); retry {} ({} bytes); {}",
        first.status,
        first.body.len(),
        retry.status,
        retry.body.len(),
        executions(count)
    );
    Ok(judge(
        first.body.len() >= least && retry.body == first.body && retry.status == first.status && count == 1,
        "expected the whole answer replayed byte for byte, executed once",
        seen,
    ))
}

async fn large_response_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "large-response-replayed";
    replayed_whole(ctx, slug, &ctx.post(slug).query("size=3145728"), 3 << 20).await
}

async fn oversized_response_not_rerun(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "oversized-response-not-rerun";
    let ask = ctx.post(slug).query("size=16777216");
    let (first, retry) = ctx.twice(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {} ({} bytes); retry {}; {}",
        first.status,
        first.body.len(),
        retry.brief(),
        executions(count)
    );
    let replayed = retry.body == first.body && retry.status == first.status;
    let refused = (400..500).contains(&retry.status);
    Ok(judge(
        first.body.len() >= 16 << 20 && count == 1 && (replayed || refused),
        "expected the retry to be replayed, or refused (410), never executed again",
        seen,
    ))
}

async fn streamed_response_replayed(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "streamed-response-replayed";
    replayed_whole(
        ctx,
        slug,
        &ctx.post(slug).query("size=65536&chunks=8&chunk_ms=50"),
        65536,
    )
    .await
}

fn megabyte_body(last: u8) -> Vec<u8> {
    let mut body = b"{\"pad\":\"".to_vec();
    body.resize((1 << 20) - 3, b'x');
    body.extend_from_slice(&[last, b'"', b'}']);
    body
}

async fn large_request_once(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "large-request-once";
    let ask = ctx.post(slug).body(megabyte_body(b'a'));
    let (first, retry) = ctx.twice(&ask).await?;
    let count = ctx.count(slug).await?;
    let seen = format!(
        "first {}; retry {}; {}",
        first.status,
        retry.status,
        executions(count)
    );
    Ok(judge(
        first.status == 201 && retry.body == first.body && count == 1,
        "expected one execution and the replay",
        seen,
    ))
}

async fn mismatch_last_byte(ctx: &Ctx) -> Result<Verdict, String> {
    let slug = "mismatch-last-byte";
    let ask = ctx.post(slug).body(megabyte_body(b'a'));
    ctx.client.send(&ask).await?;
    let other = ctx.retry_past_409(&ask.body(megabyte_body(b'b'))).await?;
    let count = ctx.settled_count(slug).await?;
    let seen = format!("other body {}; {}", other.brief(), executions(count));
    Ok(judge(
        (400..500).contains(&other.status) && count == 1,
        "expected a refusal and one execution",
        seen,
    ))
}
