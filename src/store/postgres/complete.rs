//! The completion: a claim's response stored for replay, fenced by the claim's token. Runs at the end of
//! the relay task, once per executed keyed request; touches only the completing record. Completions that
//! arrive together are coalesced (`store.max_batch`) with claims into one WRITE_BATCH (`write.rs`); one
//! alone, or one whose body is large, runs COMPLETE.

use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::address::Tid;
use super::db::Db;
use super::fenced;
use super::rows::corrupt;
use crate::store::{RecordId, StoreError, StoredResponse};

/// Stores the response. Fenced: a slow original whose claim was taken over matches no row.
const COMPLETE: &str = "UPDATE idemproxy.records
    SET status = 'completed', locked_until = now(), updated_at = now(),
        response_status = $4, response_header_names = $5, response_header_values = $6,
        response_body = $7, body_retained = $8
    WHERE scope = $1 AND key = $2 AND token = $3 AND status = 'processing'";

/// Completions with a body over this size are stored alone, so one statement never carries many large
/// bodies at once.
const BATCHED_BODY_LIMIT: usize = 64 * 1024;

/// A completion waiting for its batch, with its record's address if its claim was batched.
pub(super) struct Completion {
    pub(super) id: RecordId,
    pub(super) response: StoredResponse,
    pub(super) address: Option<Tid>,
}

/// Whether a response may wait for a batch: it has no body, or one of at most `BATCHED_BODY_LIMIT`.
pub(super) fn batchable(response: &StoredResponse) -> bool {
    response
        .body
        .as_ref()
        .is_none_or(|b| b.len() <= BATCHED_BODY_LIMIT)
}

pub(super) async fn alone(db: &Db, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
    let names: Vec<&str> = response.headers.iter().map(|(n, _)| n.as_str()).collect();
    let values: Vec<&[u8]> = response.headers.iter().map(|(_, v)| v.as_slice()).collect();
    let status = response.status as i16;
    let retained = response.body.is_some();
    let body: Option<&[u8]> = response.body.as_deref();
    fenced::execute(db, COMPLETE, id, &[&status, &names, &values, &body, &retained]).await
}

/// WRITE_BATCH's completion arguments: one array per column, in the items' order, and every item's
/// headers flattened into one list of names and one of values; each item's headers are the 1-based slice
/// `first_header..=last_header` of those lists (empty when `first_header > last_header`).
pub(super) struct CompleteBatch<'a> {
    scopes: Vec<&'a str>,
    keys: Vec<&'a str>,
    tokens: Vec<Uuid>,
    statuses: Vec<i16>,
    names: Vec<&'a str>,
    values: Vec<&'a [u8]>,
    firsts: Vec<i32>,
    lasts: Vec<i32>,
    bodies: Vec<Option<&'a [u8]>>,
    retained: Vec<bool>,
    addresses: Vec<Option<Tid>>,
}

impl<'a> CompleteBatch<'a> {
    pub(super) fn new(items: impl Iterator<Item = &'a Completion>) -> Result<CompleteBatch<'a>, StoreError> {
        let items: Vec<&'a Completion> = items.collect();
        let headers = items.iter().flat_map(|c| &c.response.headers);
        let (firsts, lasts) = header_slices(items.iter().map(|c| c.response.headers.len()))?;
        Ok(CompleteBatch {
            scopes: items.iter().map(|c| c.id.scope.as_str()).collect(),
            keys: items.iter().map(|c| c.id.key.as_str()).collect(),
            tokens: items.iter().map(|c| c.id.token).collect(),
            statuses: items.iter().map(|c| c.response.status as i16).collect(),
            names: headers.clone().map(|(n, _)| n.as_str()).collect(),
            values: headers.map(|(_, v)| v.as_slice()).collect(),
            firsts,
            lasts,
            bodies: items.iter().map(|c| c.response.body.as_deref()).collect(),
            retained: items.iter().map(|c| c.response.body.is_some()).collect(),
            addresses: items.iter().map(|c| c.address).collect(),
        })
    }

    /// WRITE_BATCH's `$7` to `$17`, typed as it casts them.
    pub(super) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 11] {
        [
            (&self.scopes, Type::TEXT_ARRAY),
            (&self.keys, Type::TEXT_ARRAY),
            (&self.tokens, Type::UUID_ARRAY),
            (&self.statuses, Type::INT2_ARRAY),
            (&self.names, Type::TEXT_ARRAY),
            (&self.values, Type::BYTEA_ARRAY),
            (&self.firsts, Type::INT4_ARRAY),
            (&self.lasts, Type::INT4_ARRAY),
            (&self.bodies, Type::BYTEA_ARRAY),
            (&self.retained, Type::BOOL_ARRAY),
            (&self.addresses, Type::TID_ARRAY),
        ]
    }
}

/// Where each item's headers sit in the flattened lists, given how many each has: the 1-based bounds
/// `first..=last`, an empty slice (`first > last`) for an item without headers.
fn header_slices(counts: impl ExactSizeIterator<Item = usize>) -> Result<(Vec<i32>, Vec<i32>), StoreError> {
    let (mut firsts, mut lasts) = (Vec::with_capacity(counts.len()), Vec::with_capacity(counts.len()));
    let mut next = 1i32;
    for count in counts {
        let count = i32::try_from(count).map_err(|_| corrupt())?;
        firsts.push(next);
        lasts.push(next + count - 1);
        next += count;
    }
    Ok((firsts, lasts))
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn completion(token: u128, headers: &[(&str, &str)], body: Option<&str>) -> Completion {
        Completion {
            id: RecordId {
                scope: "s".into(),
                key: format!("k{token}"),
                token: Uuid::from_u128(token),
            },
            response: StoredResponse {
                status: 200 + token as u16,
                headers: headers
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                    .collect(),
                body: body.map(|b| Bytes::copy_from_slice(b.as_bytes())),
            },
            address: None,
        }
    }

    fn with_body(len: usize) -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: Vec::new(),
            body: Some(Bytes::from(vec![b'x'; len])),
        }
    }

    #[test]
    fn only_bodies_up_to_the_limit_wait_for_a_batch() {
        assert!(batchable(&completion(1, &[], None).response));
        assert!(batchable(&with_body(0)));
        assert!(batchable(&with_body(BATCHED_BODY_LIMIT)));
        assert!(!batchable(&with_body(BATCHED_BODY_LIMIT + 1)));
    }

    #[test]
    fn header_slices_are_consecutive_one_based_and_empty_for_no_headers() {
        let (firsts, lasts) = header_slices([2, 0, 3, 1].into_iter()).unwrap();
        assert_eq!(firsts, [1, 3, 3, 6]);
        assert_eq!(lasts, [2, 2, 5, 6]);
    }

    /// PostgreSQL's `array[first:last]` on a 1-based array: empty when `first > last`.
    fn slice<T: Clone>(flat: &[T], first: i32, last: i32) -> Vec<T> {
        if first > last {
            return Vec::new();
        }
        flat[first as usize - 1..last as usize].to_vec()
    }

    #[test]
    fn each_completion_gets_back_exactly_its_own_headers_from_the_flattened_lists() {
        let items = [
            completion(1, &[("a", "1"), ("b", "2")], Some("one")),
            completion(2, &[], None),
            completion(3, &[("c", "3"), ("a", ""), ("d", "4")], Some("")),
        ];
        let batch = CompleteBatch::new(items.iter()).unwrap();
        for (i, item) in items.iter().enumerate() {
            let names = slice(&batch.names, batch.firsts[i], batch.lasts[i]);
            let values = slice(&batch.values, batch.firsts[i], batch.lasts[i]);
            let headers: Vec<(String, Vec<u8>)> = names
                .into_iter()
                .map(String::from)
                .zip(values.into_iter().map(<[u8]>::to_vec))
                .collect();
            assert_eq!(headers, item.response.headers, "item {i}");
        }
        assert_eq!(batch.statuses, [201, 202, 203]);
        assert_eq!(batch.bodies, [Some(&b"one"[..]), None, Some(&b""[..])]);
        assert_eq!(batch.retained, [true, false, true]);
    }
}
