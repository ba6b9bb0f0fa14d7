//! Where this process's new records are: the physical address (`ctid`) of the row version each claim of
//! a write batch inserted, by the claim's token, so that the claim's completion reaches its record
//! without looking it up by key. Written by the write batch's task, read and dropped by the operations
//! of the claim's holder (complete, heartbeat, release, hold); touches nothing else.
//!
//! An address is a hint, never trusted: the completion that uses one is still fenced by its token and
//! `processing`, so an address that no longer holds that version (the record was rewritten, taken over
//! or deleted since) matches nothing, and such a completion is tried once more by key (`write::batch`).

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Mutex, PoisonError};

use bytes::{BufMut, BytesMut};
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};
use uuid::Uuid;

/// Most addresses kept. A claim whose holder never completes, releases or holds it (its store operation
/// failed) leaves its address behind; past this many, all are dropped, which costs the completions then
/// running a lookup by key each.
const MAX_ADDRESSES: usize = 1 << 16;

/// A row version's address, PostgreSQL's `tid`: the heap block and the line pointer in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tid {
    block: u32,
    line: u16,
}

impl<'a> FromSql<'a> for Tid {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Tid, Box<dyn Error + Sync + Send>> {
        let [b0, b1, b2, b3, l0, l1] = raw else {
            return Err(format!("a tid is 6 bytes, got {}", raw.len()).into());
        };
        Ok(Tid {
            block: u32::from_be_bytes([*b0, *b1, *b2, *b3]),
            line: u16::from_be_bytes([*l0, *l1]),
        })
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TID
    }
}

impl ToSql for Tid {
    fn to_sql(&self, _: &Type, out: &mut BytesMut) -> Result<IsNull, Box<dyn Error + Sync + Send>> {
        out.put_u32(self.block);
        out.put_u16(self.line);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TID
    }

    to_sql_checked!();
}

/// The addresses of the records this process claimed in write batches and has not yet finished with.
#[derive(Default)]
pub(super) struct Addresses(Mutex<HashMap<Uuid, Tid>>);

impl Addresses {
    /// Keeps the addresses a write batch's claims inserted at.
    pub(super) fn remember(&self, inserted: impl IntoIterator<Item = (Uuid, Tid)>) {
        let mut addresses = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if addresses.len() >= MAX_ADDRESSES {
            addresses.clear();
        }
        addresses.extend(inserted);
    }

    /// The address of `token`'s record, if known, which is forgotten: the holder writes its record once.
    pub(super) fn take(&self, token: &Uuid) -> Option<Tid> {
        let mut addresses = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        addresses.remove(token)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tid_goes_to_and_from_postgres_binary_form_unchanged() {
        let tid = Tid {
            block: 0x0102_0304,
            line: 0x0506,
        };
        let mut out = BytesMut::new();
        assert!(matches!(tid.to_sql(&Type::TID, &mut out), Ok(IsNull::No)));
        assert_eq!(&out[..], [1, 2, 3, 4, 5, 6]);
        assert_eq!(Tid::from_sql(&Type::TID, &out).unwrap(), tid);
        assert!(Tid::from_sql(&Type::TID, &[1, 2, 3]).is_err());
    }

    #[test]
    fn an_address_is_given_once_and_the_store_of_them_stays_bounded() {
        let addresses = Addresses::default();
        let tid = |n: u32| Tid { block: n, line: 1 };
        addresses.remember([(Uuid::from_u128(1), tid(1)), (Uuid::from_u128(2), tid(2))]);
        assert_eq!(addresses.take(&Uuid::from_u128(1)), Some(tid(1)));
        assert_eq!(addresses.take(&Uuid::from_u128(1)), None);
        assert_eq!(addresses.take(&Uuid::from_u128(3)), None);

        addresses.remember((0..MAX_ADDRESSES as u32).map(|n| (Uuid::from_u128(n.into()), tid(n))));
        assert_eq!(addresses.len(), MAX_ADDRESSES);
        addresses.remember([(Uuid::from_u128(u128::MAX), tid(7))]);
        assert_eq!(addresses.len(), 1, "a full store starts over");
        assert_eq!(addresses.take(&Uuid::from_u128(u128::MAX)), Some(tid(7)));
    }
}
