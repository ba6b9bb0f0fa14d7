//! The claim on a key table distributed by Citus (`citus.rs`): the decisions of CLAIM and TAKE
//! (`claim.rs`), made by statements Citus sends whole to the key's shard. Runs on the request path, once
//! per keyed request, always alone (`claim::alone`); touches only the record of the key being claimed.
//!
//! CLAIM and TAKE write in a CTE and read the record in the same statement, which Citus plans as
//! separate distributed steps exchanging intermediate results (about 20 ms a claim); an UPDATE whose
//! SET reads the clock inside CASE, or does time arithmetic on a column, it refuses. So each decision
//! here is one plain statement: INSERT_NEW, then READ, then TAKE_NEW or TAKE_AGAIN as the record read
//! asks. A new key costs one statement, as on one server; an existing one a second, to read it.

use deadpool_postgres::Object;
use tokio_postgres::types::ToSql;

use super::db::retry_serialization;
use super::rows::{CLAIM_ROUNDS, Seen, changed_under_every_round, decode, settle};
use crate::store::{ClaimResult, RecordId};

/// The row of a statement that won the key: what `rows::decode` reads of a win.
macro_rules! won_returning {
    () => {
        concat!(" RETURNING true AS won, ", won_columns!())
    };
}

/// A new key, exactly as CLAIM inserts it. `$1` to `$6`.
const INSERT_NEW: &str = concat!(insert_new!(), won_returning!());

/// The record, as CLAIM reports it. `$1` to `$3`.
const READ: &str = seen_record!();

/// TAKE for an expired record that no live claim runs on: the key starts anew. `$1` to `$6`.
const TAKE_NEW: &str = concat!(
    "UPDATE idemproxy.records AS r SET
        fingerprint = $3, status = 'processing', token = $4, attempt = 1, claim_kind = 'new',
        locked_until = now() + make_interval(secs => $5), created_at = now(),
        expires_at = now() + make_interval(secs => $6), updated_at = now(),
        response_status = NULL, response_header_names = NULL, response_header_values = NULL,
        response_body = NULL, body_retained = NULL
    WHERE r.scope = $1 AND r.key = $2 AND ",
    expired_unless_running!(),
    won_returning!()
);

/// TAKE for an unexpired record of the same request, released or whose lease ran out: a retry or a
/// takeover, whose expiry lasts at least the new lease. `$1` to `$5`.
const TAKE_AGAIN: &str = concat!(
    "UPDATE idemproxy.records AS r SET
        status = 'processing', token = $4, attempt = r.attempt + 1,
        claim_kind = CASE WHEN r.status = 'failed' THEN 'retry' ELSE 'takeover' END,
        locked_until = now() + make_interval(secs => $5),
        expires_at = greatest(r.expires_at, now() + make_interval(secs => $5)), updated_at = now(),
        response_status = NULL, response_header_names = NULL, response_header_values = NULL,
        response_body = NULL, body_retained = NULL
    WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > now() AND ",
    same_request_again!(),
    won_returning!()
);

/// Rounds of INSERT_NEW, READ and a TAKE on `client` until one decides, within the caller's bound, with
/// the claim's six arguments (`claim::alone`). A record gone between the INSERT and the READ, or changed
/// between the READ and the TAKE, is decided by the next round, as CLAIM's and TAKE's snapshots are.
pub(super) async fn rounds(
    client: &Object,
    id: &RecordId,
    params: &[&(dyn ToSql + Sync); 6],
) -> Result<ClaimResult, tokio_postgres::Error> {
    let insert = client.prepare_cached(INSERT_NEW).await?;
    let read = client.prepare_cached(READ).await?;
    let take_new = client.prepare_cached(TAKE_NEW).await?;
    let take_again = client.prepare_cached(TAKE_AGAIN).await?;
    for _ in 0..CLAIM_ROUNDS {
        let inserted = retry_serialization(|| client.query_opt(&insert, params)).await?;
        if let Some(decided) = settle(inserted.as_ref().map(decode).transpose()?) {
            return Ok(decided);
        }
        let Some(row) = client.query_opt(&read, &params[..3]).await? else {
            continue;
        };
        let seen = decode(&row)?;
        let (take, take_params) = match &seen {
            Seen::Record(view) if view.expired => (&take_new, &params[..]),
            _ => (&take_again, &params[..5]),
        };
        if let Some(decided) = settle(Some(seen)) {
            return Ok(decided);
        }
        let taken = retry_serialization(|| client.query_opt(take, take_params)).await?;
        if let Some(decided) = settle(taken.as_ref().map(decode).transpose()?) {
            return Ok(decided);
        }
    }
    Ok(changed_under_every_round(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_takes_split_takes_condition_by_expiry_and_write_what_take_writes_for_each() {
        assert!(TAKE_NEW.contains(expired_unless_running!()));
        assert!(TAKE_AGAIN.contains(concat!("r.expires_at > now() AND ", same_request_again!())));
        for (take, attempt, kind) in [
            (TAKE_NEW, "attempt = 1", "claim_kind = 'new'"),
            (
                TAKE_AGAIN,
                "attempt = r.attempt + 1",
                "CASE WHEN r.status = 'failed' THEN 'retry' ELSE 'takeover' END",
            ),
        ] {
            assert!(take.contains(attempt) && take.contains(kind), "{take}");
        }
        assert!(!TAKE_AGAIN.contains("$6"), "TAKE_AGAIN is sent five arguments");
    }

    #[test]
    fn no_statement_of_the_sharded_claim_writes_in_a_cte_or_reads_the_clock_in_a_case() {
        for sql in [INSERT_NEW, READ, TAKE_NEW, TAKE_AGAIN] {
            assert!(!sql.trim_start().starts_with("WITH"), "{sql}");
            for case in sql.split("CASE").skip(1) {
                let case = case.split("END").next().unwrap_or_default();
                assert!(!case.contains("now()"), "{sql}");
            }
        }
    }
}
