//! The claim: which request executes a key. Runs on the request path, once per keyed request, inside the
//! transaction its batch shares (`bridge.rs`); touches only the record of the key being claimed. One
//! CLAIM decides it by the primary key; a claim it did not win reads the holder (HOLDER) in the same
//! transaction, so the answer is the record that beat it.

use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};

use super::bridge::millis;
use super::rows::existing;
use crate::store::{ClaimKind, ClaimRequest, ClaimResult, Existing};

/// The claim, decided by the primary key: a new key is inserted; an existing one is taken only when it is
/// claimable (expired and not running under a live lease; or, for the same fingerprint, released or past
/// its lease), all in one statement. A takeover or retry keeps the expiry at least as late as its lease.
/// `RETURNING` yields a row only when this claim won, with the expiry as the claim left it. `?5` is now, `?6`
/// the lease end, `?7` the expiry.
const CLAIM: &str = "INSERT INTO records AS r
        (scope, key, fingerprint, status, token, attempt, claim_kind,
         locked_until, created_at, expires_at, updated_at)
    VALUES (?1, ?2, ?3, 'processing', ?4, 1, 'new', ?6, ?5, ?7, ?5)
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = excluded.fingerprint,
        status = 'processing',
        token = excluded.token,
        attempt = CASE WHEN r.expires_at <= ?5 THEN 1 ELSE r.attempt + 1 END,
        claim_kind = CASE WHEN r.expires_at <= ?5 THEN 'new'
                          WHEN r.status = 'failed' THEN 'retry'
                          ELSE 'takeover' END,
        locked_until = excluded.locked_until,
        created_at = CASE WHEN r.expires_at <= ?5 THEN ?5 ELSE r.created_at END,
        expires_at = CASE WHEN r.expires_at <= ?5 THEN excluded.expires_at
                          ELSE max(r.expires_at, excluded.locked_until) END,
        updated_at = ?5,
        response_status = NULL,
        response_headers = NULL,
        response_body = NULL,
        body_retained = NULL
    WHERE (r.expires_at <= ?5 AND NOT (r.status = 'processing' AND r.locked_until > ?5))
       OR (r.fingerprint = excluded.fingerprint
           AND (r.status = 'failed' OR (r.status = 'processing' AND r.locked_until <= ?5)))
    RETURNING attempt, claim_kind, expires_at";

/// The record a claim did not win, read in the claim's own transaction.
const HOLDER: &str = "SELECT status, fingerprint, token, locked_until, expires_at,
        response_status, response_headers, response_body, body_retained
    FROM records WHERE scope = ?1 AND key = ?2";

/// One claim, inside the batch's transaction.
pub(super) fn claim_in(tx: &Connection, now: i64, request: &ClaimRequest) -> rusqlite::Result<ClaimResult> {
    let id = &request.id;
    let won = tx
        .prepare_cached(CLAIM)?
        .query_row(
            params![
                id.scope,
                id.key,
                request.fingerprint.as_slice(),
                id.token.as_bytes().as_slice(),
                now,
                now.saturating_add(millis(request.lease)),
                now.saturating_add(millis(request.ttl)),
            ],
            |row| {
                Ok((
                    row.get::<_, i32>(0)?,
                    row.get::<_, String>(1)?,
                    row.get::<_, i64>(2)?,
                ))
            },
        )
        .optional()?;
    let result = match won {
        Some((attempt, kind, expires_at)) => ClaimResult::Won {
            attempt,
            kind: ClaimKind::parse(&kind).unwrap_or(ClaimKind::New),
            expires_in: Duration::from_millis(expires_at.saturating_sub(now).max(0) as u64),
        },
        None => ClaimResult::Held(holder(tx, now, request)?),
    };
    Ok(result)
}

/// The record that holds the key; it exists, or the claim would have inserted it.
fn holder(db: &Connection, now: i64, request: &ClaimRequest) -> rusqlite::Result<Existing> {
    let mut statement = db.prepare_cached(HOLDER)?;
    statement.query_row(params![request.id.scope, request.id.key], |row| {
        existing(row, now, &request.fingerprint)
    })
}
