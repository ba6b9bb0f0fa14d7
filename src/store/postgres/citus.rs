//! What changes when the key table is distributed by Citus (`create_distributed_table` on `key`; see
//! docs/stores.md). Runs as each pooled connection opens (the check, whose answer every claim,
//! completion and sweep reads) and in the sweeper; touches the Citus catalog (read only) and, through the
//! coordinator, every shard of the key table.
//!
//! Citus routes a statement to one shard when it names one `key`, which every statement of the request
//! path does. What cannot run there as it runs on one PostgreSQL server:
//! - generic plans: Citus cannot plan the store's statements without their arguments ("could not create
//!   distributed plan"), so connections to a distributed table keep PostgreSQL's own plan choice
//!   (`connect::INDEX_PLANS`);
//! - CLAIM and TAKE: a write in a CTE read in the same statement becomes distributed steps exchanging
//!   intermediate results, so the claim runs as plain single-shard statements (`shard_claim.rs`);
//! - WRITE_BATCH: its lists of claims and completions would be sent to every shard, and its header
//!   slices crash a Citus 13.2 coordinator (SIGSEGV while planning). Claims and completions run alone
//!   instead, side by side on the pool's connections (`PostgresStore::claim` and `complete`): each
//!   commits on its own shard, so a batch would share no commit, and pipelined on one connection its
//!   statements ran one after another in one coordinator session (about half the rate of alone);
//! - SWEEP: a distributed table refuses `FOR UPDATE SKIP LOCKED` across shards, so the same statement
//!   runs on each shard, all shards at once, through `run_command_on_shards` (SWEEP_SHARDS).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio_postgres::{Client, Row};

use crate::store::StoreError;

/// Whether the Citus extension is in the connection's database.
const CITUS_INSTALLED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')";

/// Whether the key table is distributed. Asked only where the extension is installed: the catalog table
/// exists nowhere else.
const DISTRIBUTED: &str = "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition
    WHERE logicalrelid = to_regclass('idemproxy.records'))";

/// One sweep batch on every shard of the key table at once, each deleting up to its own batch. The
/// command is built from the sweeper's statement (`maintenance::SWEEP`), so both delete exactly the same
/// records; `%1$s` is where `run_command_on_shards` writes each shard's table.
pub(super) const SWEEP_SHARDS: &str = "SELECT shardid, success, result
    FROM run_command_on_shards('idemproxy.records', $1)";

/// Whether the key table is distributed, as the newest pooled connection found it; unknown until a
/// connection has opened. Shared by the pool's connection hook, which checks, and the store's
/// operations, which choose their statements by it (`Db::distributed`).
#[derive(Clone, Default)]
pub(super) struct Layout(Arc<AtomicU8>);

const UNKNOWN: u8 = 0;
const LOCAL: u8 = 1;
const DISTRIBUTED_TABLE: u8 = 2;

impl Layout {
    /// `None` until a connection has checked.
    pub(super) fn distributed(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            UNKNOWN => None,
            layout => Some(layout == DISTRIBUTED_TABLE),
        }
    }

    /// Checks the table from a connection that just opened; says so once when it is distributed.
    pub(super) async fn check(&self, client: &Client) -> Result<bool, tokio_postgres::Error> {
        let distributed = client
            .query_one(CITUS_INSTALLED, &[])
            .await?
            .try_get::<_, bool>(0)?
            && client.query_one(DISTRIBUTED, &[]).await?.try_get::<_, bool>(0)?;
        let layout = if distributed { DISTRIBUTED_TABLE } else { LOCAL };
        if self.0.swap(layout, Ordering::Relaxed) != layout && distributed {
            tracing::info!(
                "the key table is distributed (Citus): claims and completions run alone, one shard \
                 each, and the sweeper deletes shard by shard"
            );
        }
        Ok(distributed)
    }
}

/// How many records SWEEP_SHARDS deleted in all, from its row per shard; a shard that failed fails the
/// sweep, naming the shard.
pub(super) fn swept(rows: &[Row]) -> Result<u64, StoreError> {
    let mut deleted = 0;
    for row in rows {
        let (shard, success, result): (i64, bool, Option<String>) = (row.get(0), row.get(1), row.get(2));
        let result = result.unwrap_or_default();
        let count = success.then(|| result.parse::<u64>().ok()).flatten();
        let Some(count) = count else {
            return Err(StoreError::Backend(format!("sweeping shard {shard}: {result}")));
        };
        deleted += count;
    }
    Ok(deleted)
}

/// The sweeper's statement for one shard: its table, its limit written in (the command takes no
/// parameters), and the count of deleted rows as its one value.
pub(super) fn shard_command(sweep: &str, batch: u32) -> String {
    let on_shard = sweep
        .replace("idemproxy.records", "%1$s")
        .replace("$1", &batch.to_string());
    format!("WITH swept AS ({on_shard} RETURNING 1) SELECT count(*) FROM swept")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shards_sweep_is_the_sweepers_statement_on_that_shard_with_its_limit_written_in() {
        let sweep = "DELETE FROM idemproxy.records AS r WHERE r.key IN (
            SELECT key FROM idemproxy.records WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED)";
        let command = shard_command(sweep, 500);
        assert_eq!(
            command,
            "WITH swept AS (DELETE FROM %1$s AS r WHERE r.key IN (
            SELECT key FROM %1$s WHERE expires_at <= now() LIMIT 500 FOR UPDATE SKIP LOCKED) \
             RETURNING 1) SELECT count(*) FROM swept"
        );
    }
}
