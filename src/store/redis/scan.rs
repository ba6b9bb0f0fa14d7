//! The operator's views that cover many records: `keys show` without a scope, `keys stats` and `keys list`.
//! They walk every primary with `SCAN` (a cluster's records are spread over its primaries), in pages, so
//! Redis is never blocked by one long command; records written or moved during the walk may be missed or
//! counted twice, as with any `SCAN`. A `keys list` page is one `SCAN` step on one primary, its cursor
//! `<primary>.<SCAN cursor>` with the primaries numbered in address order.

use redis::Value;

use super::connect::{Node, Redis, Script};
use super::record::{self, parse_name};
use crate::store::{ListPage, ListQuery, RecordInfo, RecordStats, StoreError, bad_cursor};

/// Names asked for per `SCAN` page.
const PAGE: u32 = 1000;

/// Every record name matching `pattern`, on every primary.
async fn names(redis: &Redis, pattern: &str) -> Result<Vec<(Node, Vec<Vec<u8>>)>, StoreError> {
    let mut found = Vec::new();
    for node in redis.primaries().await? {
        let mut cursor = 0u64;
        let mut names = Vec::new();
        loop {
            let (next, page) = scan_step(redis, &node, cursor, pattern, PAGE).await?;
            names.extend(page);
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        found.push((node, names));
    }
    Ok(found)
}

/// The records holding `key` in every scope, ordered by scope.
pub(super) async fn find_everywhere(
    redis: &Redis,
    read: &Script,
    prefix: &str,
    key: &str,
) -> Result<Vec<RecordInfo>, StoreError> {
    let mut records = Vec::new();
    for (_, names) in names(redis, &record::pattern(prefix, Some(key))).await? {
        for name in names {
            let Some((scope, found_key)) = parse_name(prefix, &name) else {
                continue;
            };
            let answer = redis.run(read, &name, &[], false).await?;
            records.extend(record::record_info(scope, found_key, answer)?);
        }
    }
    records.sort_by(|a, b| a.scope.cmp(&b.scope));
    Ok(records)
}

/// One page of `keys list`: one `SCAN` step on one primary, asking for as many names as the page may
/// hold (`SCAN`'s `COUNT` is a hint, so a page may hold a few more), each record then read with the
/// node's clock. A record gone since the `SCAN` is left out.
pub(super) async fn list(
    redis: &Redis,
    read: &Script,
    prefix: &str,
    query: &ListQuery,
) -> Result<ListPage, StoreError> {
    let (index, cursor) = match &query.after {
        Some(after) => parse_cursor(after)?,
        None => (0, 0),
    };
    let mut primaries = redis.primaries().await?;
    primaries.sort_by_key(address);
    let Some(node) = primaries.get(index) else {
        return Err(bad_cursor(query.after.as_deref().unwrap_or_default()));
    };
    let pattern = record::list_pattern(prefix, &query.scope);
    let (next, names) = scan_step(
        redis,
        node,
        cursor,
        &pattern,
        query.limit.min(query.examine).max(1),
    )
    .await?;
    let mut records = Vec::new();
    let examined = u32::try_from(names.len()).unwrap_or(u32::MAX);
    for name in names {
        let Some((scope, key)) = parse_name(prefix, &name) else {
            continue;
        };
        let answer = redis.run(read, &name, &[], false).await?;
        let record = record::record_info(scope, key, answer)?;
        records.extend(record.filter(|record| query.admits(record)));
    }
    let next = match (next, index + 1 < primaries.len()) {
        (0, false) => None,
        (0, true) => Some(format!("{}.0", index + 1)),
        (next, _) => Some(format!("{index}.{next}")),
    };
    Ok(ListPage {
        records,
        examined,
        next,
    })
}

/// A primary's place in the order pages walk them.
fn address(node: &Node) -> (String, u16) {
    match node {
        Node::Only => (String::new(), 0),
        Node::At { host, port } => (host.clone(), *port),
    }
}

/// Reads a `keys list` cursor: `<primary>.<SCAN cursor>`.
fn parse_cursor(cursor: &str) -> Result<(usize, u64), StoreError> {
    let parsed = cursor
        .split_once('.')
        .and_then(|(node, scan)| Some((node.parse().ok()?, scan.parse().ok()?)));
    parsed.ok_or_else(|| bad_cursor(cursor))
}

/// One `SCAN` step on `node`: the next cursor (0 at the end) and the names it returned.
async fn scan_step(
    redis: &Redis,
    node: &Node,
    cursor: u64,
    pattern: &str,
    count: u32,
) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    let mut pipe = redis::pipe();
    pipe.cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(count);
    let page = redis.on_node(node, &pipe).await?;
    page.into_iter()
        .next()
        .map(redis::from_redis_value)
        .transpose()
        .map_err(|e| StoreError::Backend(format!("unexpected SCAN answer: {e}")))?
        .ok_or_else(|| StoreError::Backend("SCAN answered nothing".into()))
}

/// Counts every record by state, reading each one's status and expiry on its node with that node's
/// clock.
pub(super) async fn stats(redis: &Redis, prefix: &str) -> Result<RecordStats, StoreError> {
    let mut stats = RecordStats::default();
    for (node, names) in names(redis, &record::pattern(prefix, None)).await? {
        for chunk in names.chunks(PAGE as usize) {
            let mut pipe = redis::pipe();
            pipe.cmd("TIME");
            for name in chunk {
                pipe.cmd("HMGET").arg(name).arg("st").arg("ea");
            }
            let mut answers = redis.on_node(&node, pipe.ignore_errors()).await?.into_iter();
            let (seconds, micros): (i64, i64) = answers
                .next()
                .map(redis::from_redis_value)
                .transpose()
                .map_err(|e| StoreError::Backend(format!("unexpected TIME answer: {e}")))?
                .unwrap_or_default();
            let now = seconds * 1000 + micros / 1000;
            for answer in answers {
                count(&mut stats, answer, now);
            }
        }
    }
    Ok(stats)
}

/// Adds one record's `HMGET st ea` to `stats`; a record gone since the `SCAN` (or moved to another
/// node) is not counted.
fn count(stats: &mut RecordStats, answer: Value, now: i64) {
    let Ok((Some(status), Some(expires))) = redis::from_redis_value::<(Option<String>, Option<i64>)>(answer)
    else {
        return;
    };
    let bucket = if expires <= now {
        &mut stats.expired
    } else {
        match status.as_str() {
            "processing" => &mut stats.processing,
            "completed" => &mut stats.completed,
            "failed" => &mut stats.failed,
            "unknown" => &mut stats.unknown,
            _ => return,
        }
    };
    *bucket += 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: &str, expires: i64) -> Value {
        Value::Array(vec![
            Value::BulkString(status.as_bytes().to_vec()),
            Value::BulkString(expires.to_string().into_bytes()),
        ])
    }

    #[test]
    fn records_are_counted_by_state_with_expired_ones_apart() {
        let mut stats = RecordStats::default();
        for (status, expires) in [
            ("processing", 20),
            ("completed", 20),
            ("completed", 5),
            ("failed", 20),
        ] {
            count(&mut stats, record(status, expires), 10);
        }
        count(&mut stats, Value::Array(vec![Value::Nil, Value::Nil]), 10);
        assert_eq!(
            stats,
            RecordStats {
                processing: 1,
                completed: 1,
                failed: 1,
                unknown: 0,
                expired: 1
            }
        );
    }
}
