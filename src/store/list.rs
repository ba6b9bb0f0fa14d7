//! One page of `keys list`, whatever the store: the query ([`ListQuery`], [`ScopeFilter`]), the page
//! ([`ListPage`]), and the cursor and paging the SQL stores share. Runs when an operator lists records;
//! touches nothing but what it is given.

use super::{RecordInfo, RecordState, StoreError};

/// Which records a page of [`Store::list`](super::Store::list) walks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScopeFilter {
    /// Every record.
    All,
    /// The records of one route's scope name (`<name>:<credential hash>`), whatever the credential.
    Named(String),
    /// The records of one scope (one route's scope name and one client's credential).
    Exact(String),
}

impl ScopeFilter {
    /// Whether a record of `scope` passes.
    pub fn admits(&self, scope: &str) -> bool {
        match self {
            ScopeFilter::All => true,
            ScopeFilter::Named(name) => scope
                .strip_prefix(name.as_str())
                .is_some_and(|rest| rest.starts_with(':')),
            ScopeFilter::Exact(exact) => scope == exact,
        }
    }
}

/// One page of `keys list`: at most `limit` records, found by reading at most `examine` records after
/// `after` in the store's order.
#[derive(Debug, Clone)]
pub struct ListQuery {
    /// The scopes walked.
    pub scope: ScopeFilter,
    /// The states listed; empty lists every state.
    pub states: Vec<RecordState>,
    /// Where the previous page stopped ([`ListPage::next`]); `None` for the first page.
    pub after: Option<String>,
    /// Most records returned. A Redis page is one `SCAN` step, which may return a few more.
    pub limit: u32,
    /// Most records read, whether or not they pass the filters: the page's cost.
    pub examine: u32,
}

impl ListQuery {
    /// Whether `record` passes the query's filters.
    pub fn admits(&self, record: &RecordInfo) -> bool {
        self.scope.admits(&record.scope) && (self.states.is_empty() || self.states.contains(&record.state()))
    }
}

/// What one [`Store::list`](super::Store::list) call found.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    /// The records read that pass the query's filters, in the store's order.
    pub records: Vec<RecordInfo>,
    /// How many records were read.
    pub examined: u32,
    /// Where the next page starts (a cursor to pass back as [`ListQuery::after`]); `None` when the walk
    /// reached the end. A page may hold no records and still have a next one.
    pub next: Option<String>,
}

/// The cursor of the SQL stores: the last examined record's scope and key, as `scope/key` (a scope holds
/// no `/`: a scope name is letters, digits, `-_.`, then `:` and a hash).
pub(crate) fn sql_cursor(scope: &str, key: &str) -> String {
    format!("{scope}/{key}")
}

/// Where a SQL store's page starts: after the cursor's scope and key, or before every record. Within one
/// scope, after a key of that scope.
pub(crate) fn sql_start(query: &ListQuery) -> Result<(String, String), StoreError> {
    let after = match &query.after {
        Some(cursor) => cursor
            .split_once('/')
            .map(|(scope, key)| (scope.to_owned(), key.to_owned()))
            .ok_or_else(|| bad_cursor(cursor))?,
        None => (String::new(), String::new()),
    };
    match &query.scope {
        ScopeFilter::Exact(exact) if query.after.is_none() => Ok((exact.clone(), String::new())),
        ScopeFilter::Exact(exact) if &after.0 != exact => {
            Err(bad_cursor(query.after.as_deref().unwrap_or("")))
        }
        _ => Ok(after),
    }
}

/// The page of the SQL stores from the records one range read returned (at most `query.examine`, in the
/// primary key's order): those the filters admit, up to `query.limit`, and the cursor of the last one
/// kept or read unless the range ended. A scope name's records are filtered here rather than by a range
/// of the index, because which range `name:` covers depends on the database's collation.
pub(crate) fn page(read: Vec<RecordInfo>, query: &ListQuery) -> ListPage {
    let full = read.len() >= query.examine as usize;
    let mut page = ListPage::default();
    let mut last = None;
    for record in read {
        page.examined += 1;
        last = Some(sql_cursor(&record.scope, &record.key));
        if query.admits(&record) {
            page.records.push(record);
            if page.records.len() >= query.limit as usize {
                page.next = last;
                return page;
            }
        }
    }
    page.next = last.filter(|_| full);
    page
}

/// A cursor this store did not print.
pub(crate) fn bad_cursor(cursor: &str) -> StoreError {
    StoreError::Backend(format!(
        "{cursor:?} is not a cursor this store printed: pass --after exactly as the previous page's \
         last line gives it"
    ))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use uuid::Uuid;

    use super::*;
    use crate::store::{ClaimKind, RecordStatus};

    fn info(scope: &str, key: &str) -> RecordInfo {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        RecordInfo {
            scope: scope.into(),
            key: key.into(),
            status: RecordStatus::Completed,
            attempt: 1,
            claim_kind: ClaimKind::New,
            token: Uuid::nil(),
            created_at: now,
            updated_at: now,
            expires_at: now + Duration::from_secs(60),
            locked_until: now,
            observed_at: now,
            response_status: Some(201),
            response_bytes: Some(2),
            body_retained: Some(true),
        }
    }

    fn query(scope: ScopeFilter, limit: u32, examine: u32) -> ListQuery {
        ListQuery {
            scope,
            states: Vec::new(),
            after: None,
            limit,
            examine,
        }
    }

    #[test]
    fn a_scope_name_admits_its_own_scopes_only() {
        let orders = ScopeFilter::Named("orders".into());
        assert!(orders.admits("orders:ab"));
        assert!(!orders.admits("orders2:ab") && !orders.admits("orders"));
        assert!(ScopeFilter::Exact("orders:ab".into()).admits("orders:ab"));
        assert!(!ScopeFilter::Exact("orders:ab".into()).admits("orders:abc"));
    }

    #[test]
    fn a_sql_page_stops_at_its_limit_on_the_last_record_kept_and_ends_with_a_short_read() {
        let read = vec![
            info("a:1", "k1"),
            info("b:1", "k2"),
            info("a:1", "k3"),
            info("a:1", "k4"),
        ];
        let named = query(ScopeFilter::Named("a".into()), 2, 4);
        let page = page(read.clone(), &named);
        assert_eq!(page.records.len(), 2);
        assert_eq!(
            page.next.as_deref(),
            Some("a:1/k3"),
            "the next page starts after k3, not after k4"
        );
        assert_eq!(page.examined, 3);

        let page = super::page(read.clone(), &query(ScopeFilter::All, 10, 4));
        assert_eq!(
            page.next.as_deref(),
            Some("a:1/k4"),
            "a full read may have more after it"
        );
        let page = super::page(read, &query(ScopeFilter::All, 10, 5));
        assert_eq!(page.next, None, "a short read reached the end");
    }

    #[test]
    fn a_cursor_is_read_back_and_one_from_another_scope_is_refused() {
        let mut within = query(ScopeFilter::Exact("a:1".into()), 10, 10);
        assert_eq!(sql_start(&within).unwrap(), ("a:1".to_owned(), String::new()));
        within.after = Some(sql_cursor("a:1", "k/9"));
        assert_eq!(sql_start(&within).unwrap(), ("a:1".to_owned(), "k/9".to_owned()));
        within.after = Some(sql_cursor("b:1", "k"));
        assert!(sql_start(&within).is_err());
    }
}
