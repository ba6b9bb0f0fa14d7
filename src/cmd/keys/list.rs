//! `idemproxy keys list`: one page of records, filled from the store's bounded pages
//! ([`Store::list`](crate::store::Store::list)) until it holds `--limit` records or has read
//! [`LIST_BUDGET`] of them, then the cursor of the next. Touches only the records it reads.

use std::fmt::Write as _;

use serde::Serialize;

use super::report::{KeysError, Output, Report};
use crate::store::{ListQuery, RecordInfo, RecordState, ScopeFilter, StoreHandle};

/// Most records one `keys list` reads, whatever its filters: a page on a large table with few records
/// that pass them stops here and gives its cursor.
const LIST_BUDGET: u32 = 10_000;

/// Fewest records read per store call while filling a `keys list` page, so that rare matches are not
/// sought a few records at a time.
const LIST_STEP: u32 = 500;

/// A `keys list` page, for JSON output.
#[derive(Serialize)]
struct Listed {
    records: Vec<ListedRecord>,
    /// The cursor of the next page (`--after`), or null at the end.
    next: Option<String>,
    /// How many records were read to fill the page.
    examined: u32,
}

#[derive(Serialize)]
struct ListedRecord {
    state: RecordState,
    #[serde(flatten)]
    record: RecordInfo,
}

/// Fills one page: up to `limit` records that pass the filters, reading at most [`LIST_BUDGET`].
pub(super) async fn list(
    store: &StoreHandle,
    out: &Output,
    scope: ScopeFilter,
    states: Vec<RecordState>,
    limit: u32,
    after: Option<String>,
) -> Result<Report, KeysError> {
    let mut listed = Listed {
        records: Vec::new(),
        next: after,
        examined: 0,
    };
    loop {
        let wanted = limit.saturating_sub(listed.records.len() as u32);
        let query = ListQuery {
            scope: scope.clone(),
            states: states.clone(),
            after: listed.next.take(),
            limit: wanted,
            examine: wanted
                .max(LIST_STEP)
                .min(LIST_BUDGET.saturating_sub(listed.examined)),
        };
        let page = store.list(&query).await?;
        listed.examined = listed.examined.saturating_add(page.examined);
        let records = page.records.into_iter().map(|record| ListedRecord {
            state: record.state(),
            record,
        });
        listed.records.extend(records);
        listed.next = page.next;
        let full = listed.records.len() >= limit as usize;
        if listed.next.is_none() || full || listed.examined >= LIST_BUDGET {
            break;
        }
    }
    Ok(out.report(&listed, true, list_text))
}

fn list_text(listed: &Listed, text: &mut String) {
    if !listed.records.is_empty() {
        let _ = writeln!(
            text,
            "{:<10} {:<8} {:<26} {:<32} SCOPE",
            "STATE", "ATTEMPT", "EXPIRES", "KEY"
        );
    }
    for ListedRecord { state, record } in &listed.records {
        let expires = humantime::format_rfc3339_seconds(record.expires_at).to_string();
        let _ = writeln!(
            text,
            "{:<10} {:<8} {:<26} {:<32} {}",
            state.as_str(),
            record.attempt,
            expires,
            record.key,
            record.scope
        );
    }
    let count = listed.records.len();
    match &listed.next {
        None => {
            let _ = writeln!(text, "{count} records; end of the list");
        }
        Some(next) => {
            let _ = writeln!(
                text,
                "{count} records ({} read); next page: --after '{}'",
                listed.examined,
                next.replace('\'', "'\\''")
            );
        }
    }
}
