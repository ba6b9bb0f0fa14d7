//! The operator's views that cover many records: `keys show` without a scope and `keys stats`. Both walk
//! every primary with `SCAN` (a cluster's records are spread over its primaries), in pages, so Redis is
//! never blocked by one long command; records written or moved during the walk may be missed or counted
//! twice, as with any `SCAN`.

use redis::Value;

use super::connect::{Node, Redis, Script};
use super::record::{self, parse_name};
use crate::store::{RecordInfo, RecordStats, StoreError};

/// Names asked for per `SCAN` page.
const PAGE: u32 = 1000;

/// Every record name matching `pattern`, on every primary.
async fn names(redis: &Redis, pattern: &str) -> Result<Vec<(Node, Vec<Vec<u8>>)>, StoreError> {
    let mut found = Vec::new();
    for node in redis.primaries().await? {
        let mut cursor = 0u64;
        let mut names = Vec::new();
        loop {
            let mut pipe = redis::pipe();
            pipe.cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(PAGE);
            let page = redis.on_node(&node, &pipe).await?;
            let (next, page): (u64, Vec<Vec<u8>>) = page
                .into_iter()
                .next()
                .map(redis::from_redis_value)
                .transpose()
                .map_err(|e| StoreError::Backend(format!("unexpected SCAN answer: {e}")))?
                .ok_or_else(|| StoreError::Backend("SCAN answered nothing".into()))?;
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
