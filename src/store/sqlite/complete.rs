//! The completion: a claim's response stored for replay, fenced by the claim's token. Runs at the end of
//! the relay task, once per executed keyed request, inside the transaction its batch shares
//! (`bridge.rs`); touches only the completing record.

use rusqlite::{Connection, params};

use crate::store::blob::encode_headers;
use crate::store::{RecordId, StoredResponse};

/// Stores the response. Fenced: a slow original whose claim was taken over matches no row.
const COMPLETE: &str = "UPDATE records
    SET status = 'completed', locked_until = ?4, updated_at = ?4, response_status = ?5,
        response_headers = ?6, response_body = ?7, body_retained = ?8
    WHERE scope = ?1 AND key = ?2 AND token = ?3 AND status = 'processing'";

/// A response in the columns' form.
pub(super) struct EncodedResponse {
    status: i64,
    headers: Vec<u8>,
    body: Option<Vec<u8>>,
    retained: bool,
}

impl EncodedResponse {
    pub(super) fn new(response: &StoredResponse) -> EncodedResponse {
        EncodedResponse {
            status: i64::from(response.status),
            headers: encode_headers(&response.headers),
            body: response.body.as_ref().map(|body| body.to_vec()),
            retained: response.body.is_some(),
        }
    }
}

/// One completion, inside the batch's transaction; fenced by the token.
pub(super) fn complete_in(
    tx: &Connection,
    now: i64,
    id: &RecordId,
    r: &EncodedResponse,
) -> rusqlite::Result<bool> {
    let token = id.token.as_bytes().as_slice();
    let changed = tx.prepare_cached(COMPLETE)?.execute(params![
        id.scope, id.key, token, now, r.status, r.headers, r.body, r.retained
    ])?;
    Ok(changed == 1)
}
