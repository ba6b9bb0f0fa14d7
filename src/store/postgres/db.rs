//! [`Db`], the bounded statement runner every PostgreSQL store operation goes through: a pooled
//! connection, one statement within `store.timeout`, a retry when the database reports a serialization
//! failure or deadlock, and the mapping of driver errors to [`StoreError`]. Runs on every store operation; touches
//! the pool and the one connection it takes, which it detaches from the pool when the operation timed out.

use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use tokio::time::{error::Elapsed, timeout};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use super::citus::Layout;
use crate::error_chain::error_chain;
use crate::store::StoreError;

/// How often a statement hit by a serialization failure or deadlock is retried.
const SERIALIZATION_RETRIES: usize = 3;

/// The pool, the bound on every operation and the key table's layout, shared with the batch tasks.
pub(super) struct Db {
    pool: Pool,
    timeout: Duration,
    layout: Layout,
    /// Where the pool connects, for the commands its errors name.
    pg: tokio_postgres::Config,
}

impl Db {
    /// `layout` is the one the pool's connections report to (`connect::pool`); `pg`, where they
    /// connect.
    pub(super) fn new(pool: Pool, timeout: Duration, layout: Layout, pg: tokio_postgres::Config) -> Db {
        Db {
            pool,
            timeout,
            layout,
            pg,
        }
    }

    /// Whether the key table is distributed by Citus (`citus.rs`), as the newest connection found it;
    /// before any connection has opened, one is opened to find out.
    pub(super) async fn distributed(&self) -> Result<bool, StoreError> {
        if let Some(distributed) = self.layout.distributed() {
            return Ok(distributed);
        }
        drop(self.client().await?);
        self.layout.distributed().ok_or_else(|| {
            StoreError::Backend("a new connection did not report the key table's layout".into())
        })
    }

    /// `store.timeout`, the bound on every operation.
    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    pub(super) async fn client(&self) -> Result<Object, StoreError> {
        match timeout(self.timeout, self.pool.get()).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) => Err(StoreError::Backend(super::connect::pool_failure(&e, &self.pg))),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        }
    }

    /// Maps a bounded operation's result; a connection whose operation timed out may still have a
    /// statement in flight, so it is detached from the pool rather than reused.
    pub(super) fn finish<T>(
        &self,
        client: Object,
        result: Result<Result<T, tokio_postgres::Error>, Elapsed>,
    ) -> Result<T, StoreError> {
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(StoreError::Backend(super::connect::with_fix(
                error_chain(&e),
                &e,
                &self.pg,
            ))),
            Err(_) => {
                drop(Object::take(client));
                Err(StoreError::Timeout(self.timeout))
            }
        }
    }

    /// Runs one statement within `store.timeout` and returns its rows.
    pub(super) async fn query(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(sql).await?;
            retry_serialization(|| client.query(&statement, params)).await
        })
        .await;
        self.finish(client, result)
    }

    /// Runs a coalesced batch statement within `store.timeout`, prepared once per connection with the
    /// parameter types its casts name. Its plan stays an index lookup per record however the table grows,
    /// because the connection plans by index only (`connect::INDEX_PLANS`).
    pub(super) async fn query_batch(
        &self,
        sql: &'static str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let types: Vec<Type> = params.iter().map(|(_, ty)| ty.clone()).collect();
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(value, _)| *value).collect();
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_typed_cached(sql, &types).await?;
            retry_serialization(|| client.query(&statement, &values)).await
        })
        .await;
        self.finish(client, result)
    }

    /// Runs one statement within `store.timeout`, unprepared, and returns how many rows it changed. It is
    /// parsed and planned at every call, so its plan follows the table's statistics as they are now; a
    /// prepared statement keeps the plan made on its connection the first time. For the sweeper's, whose
    /// best plan depends on how many records are expired.
    pub(super) async fn execute_unprepared(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, retry_serialization(|| client.execute(sql, params))).await;
        self.finish(client, result)
    }

    /// Runs one statement within `store.timeout` and returns how many rows it changed.
    pub(super) async fn execute(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let result = timeout(self.timeout, async {
            let statement = client.prepare_cached(sql).await?;
            retry_serialization(|| client.execute(&statement, params)).await
        })
        .await;
        self.finish(client, result)
    }
}

pub(super) fn backend(e: tokio_postgres::Error) -> StoreError {
    StoreError::Backend(error_chain(&e))
}

/// Runs a statement again when the database reports a serialization failure or deadlock (40001, 40P01),
/// which distributed Postgres-compatible databases raise under contention.
pub(super) async fn retry_serialization<T, F, Fut>(statement: F) -> Result<T, tokio_postgres::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tokio_postgres::Error>>,
{
    retry_while(is_serialization_failure, statement).await
}

/// Runs `statement` up to `SERIALIZATION_RETRIES` more times while its error is `retryable`.
async fn retry_while<T, E, F, Fut>(retryable: fn(&E) -> bool, mut statement: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut attempt = 0;
    loop {
        match statement().await {
            Err(e) if attempt < SERIALIZATION_RETRIES && retryable(&e) => attempt += 1,
            result => return result,
        }
    }
}

fn is_serialization_failure(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(is_conflict)
}

/// The SQLSTATEs after which the same statement may simply run again.
fn is_conflict(code: &SqlState) -> bool {
    *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED
}

/// Checks a planned statement's arguments against its text: one argument per placeholder, each cast in
/// the SQL (`$n::elem[]`) to the type it is sent as, and each value encodable as that type.
#[cfg(test)]
pub(super) fn assert_typed_params(sql: &str, params: &[(&(dyn ToSql + Sync), Type)]) {
    let mut placeholders: Vec<usize> = sql
        .split('$')
        .skip(1)
        .filter_map(|rest| {
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            rest[..digits].parse().ok()
        })
        .collect();
    placeholders.sort_unstable();
    placeholders.dedup();
    assert_eq!(
        placeholders,
        (1..=params.len()).collect::<Vec<_>>(),
        "placeholders of {sql}"
    );
    for (i, (value, ty)) in params.iter().enumerate() {
        let cast = format!("${}::{}[]", i + 1, ty.name().trim_start_matches('_'));
        assert!(
            sql.contains(&cast),
            "${} is sent as {ty} but the statement has no {cast}",
            i + 1
        );
        value
            .to_sql_checked(ty, &mut bytes::BytesMut::new())
            .unwrap_or_else(|e| panic!("${} does not encode as {ty}: {e}", i + 1));
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod};
    use tokio::time::Instant;
    use tokio_postgres::NoTls;

    use super::*;

    #[test]
    fn only_serialization_failures_and_deadlocks_are_conflicts() {
        assert!(is_conflict(&SqlState::T_R_SERIALIZATION_FAILURE));
        assert!(is_conflict(&SqlState::T_R_DEADLOCK_DETECTED));
        for other in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::QUERY_CANCELED,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::T_R_INTEGRITY_CONSTRAINT_VIOLATION,
            SqlState::T_R_STATEMENT_COMPLETION_UNKNOWN,
            SqlState::LOCK_NOT_AVAILABLE,
        ] {
            assert!(!is_conflict(&other), "{other:?} is not retried");
        }
    }

    /// Runs `retry_while(is_conflict, ..)` over a statement that fails with each of `errors` in turn,
    /// then succeeds; returns the result and how many times the statement ran.
    async fn run_failing(errors: &[SqlState]) -> (Result<&'static str, SqlState>, usize) {
        let runs = Cell::new(0);
        let result = retry_while(is_conflict, || {
            let run = runs.get();
            runs.set(run + 1);
            let outcome = errors.get(run).cloned().map_or(Ok("rows"), Err);
            async move { outcome }
        })
        .await;
        (result, runs.get())
    }

    #[tokio::test]
    async fn a_statement_that_conflicts_runs_again_and_returns_what_it_finally_got() {
        let conflicts = [
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::T_R_SERIALIZATION_FAILURE,
        ];
        assert_eq!(run_failing(&conflicts).await, (Ok("rows"), 3));
    }

    #[tokio::test]
    async fn a_statement_runs_at_most_three_more_times() {
        let conflicts = [SqlState::T_R_SERIALIZATION_FAILURE; 5];
        let (result, runs) = run_failing(&conflicts).await;
        assert_eq!(result, Err(SqlState::T_R_SERIALIZATION_FAILURE));
        assert_eq!(runs, 1 + SERIALIZATION_RETRIES);
    }

    #[tokio::test]
    async fn any_other_error_is_returned_at_once() {
        let errors = [SqlState::UNIQUE_VIOLATION, SqlState::T_R_SERIALIZATION_FAILURE];
        assert_eq!(run_failing(&errors).await, (Err(SqlState::UNIQUE_VIOLATION), 1));
    }

    /// A pool with no connection to give (every one in use), without a database behind it.
    fn exhausted(timeout: Duration) -> Db {
        let pg: tokio_postgres::Config = "postgres://idemproxy@127.0.0.1/idemproxy".parse().unwrap();
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = Manager::from_config(pg, NoTls, manager_config);
        let pool = Pool::builder(manager).max_size(0).build().unwrap();
        let pg = "postgres://idemproxy@127.0.0.1/idemproxy".parse().unwrap();
        Db::new(pool, timeout, Layout::default(), pg)
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_a_connection_is_bounded_by_the_store_timeout() {
        let db = exhausted(Duration::from_secs(5));
        let started = Instant::now();
        let Err(error) = db.client().await else {
            panic!("an exhausted pool gave a connection");
        };
        assert!(
            matches!(error, StoreError::Timeout(t) if t == Duration::from_secs(5)),
            "{error}"
        );
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn every_statement_kind_times_out_waiting_for_a_connection() {
        let db = exhausted(Duration::from_millis(250));
        let timed_out = |error: StoreError| matches!(error, StoreError::Timeout(t) if t == db.timeout());
        assert!(timed_out(db.query("SELECT 1", &[]).await.unwrap_err()));
        assert!(timed_out(db.execute("SELECT 1", &[]).await.unwrap_err()));
        assert!(timed_out(
            db.execute_unprepared("SELECT 1", &[]).await.unwrap_err()
        ));
        assert!(timed_out(db.query_batch("SELECT 1", &[]).await.unwrap_err()));
    }
}
