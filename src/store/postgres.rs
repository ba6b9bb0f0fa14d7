//! The PostgreSQL key table. Runs on the request path (claim) and in the forwarding task (heartbeat,
//! complete, release); touches only the `idemproxy` schema. Every statement is a named constant, prepared
//! once per pooled connection, whose connection plans by index only (`connect.rs`); every operation is
//! bounded by `store.timeout`, and a connection that timed out is dropped instead of going back to the
//! pool. The database clock (`now()`) is the only clock.
//!
//! This file wires the parts into [`PostgresStore`]; each part has one job, its statements beside it:
//! - `connect.rs`: `store.url` with our defaults, TLS (its client settings in `tls.rs`), the pool and its
//!   index-only planning;
//! - `db.rs`: `Db`, which runs one bounded statement (timeout, retry on serialization failure, error
//!   mapping);
//! - `claim.rs`: the claim (CLAIM, TAKE) and how each round's row settles it;
//! - `complete.rs`: the completion (COMPLETE);
//! - `write.rs`: claims and completions that arrive together, in one statement (WRITE_BATCH);
//! - `address.rs`: where the rows the write batch's claims inserted are, for their completions;
//! - `fenced.rs`: the holder's other writes and an operator's release, fenced by the claim's token;
//! - `listen.rs`: NOTIFY after a record of a wait route settled, and the LISTEN connection that wakes
//!   this process's waiting requests (`on_in_flight = "wait"`);
//! - `maintenance.rs`: the sweeper's SWEEP and the operator tools' FIND and STATS;
//! - `citus.rs`: what changes on a key table distributed by Citus (plans, batches, the sweep by shard);
//! - `shard_claim.rs`: the claim there, as statements Citus sends whole to the key's shard;
//! - `rows.rs`: what those statements' rows mean in the store's types;
//! - `migrations.rs`: the schema, from `migrations/postgres`.

mod address;
mod citus;
#[macro_use]
mod claim;
mod complete;
mod connect;
mod db;
mod fenced;
mod listen;
mod maintenance;
mod migrations;
mod rows;
mod shard_claim;
mod tls;
mod write;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;

use super::coalesce::{BatchFuture, Coalescer, unanswered};
use super::{
    ClaimRequest, ClaimResult, Lifecycle, ListPage, ListQuery, RecordId, RecordInfo, RecordStats, StoreError,
    StoredResponse, Upkeep,
};
use crate::config::StoreConfig;
use address::Addresses;
use citus::Layout;
use complete::Completion;
use db::Db;
use write::{Write, Written};

pub use listen::listen;
pub(crate) use migrations::Unmigrated;

/// The PostgreSQL-backed [`Store`]. Claims and completions that arrive together are coalesced into one
/// statement (`store.max_batch`), and so are announcements; everything else runs one statement per
/// operation. On a key table distributed by Citus, claims and completions run alone, side by side on the
/// pool's connections: each commits on its own shard, so a batch would gain no shared commit, and its
/// statements would run one after another on one coordinator session.
pub struct PostgresStore {
    db: Arc<Db>,
    addresses: Arc<Addresses>,
    writes: Option<Coalescer<Write, Written>>,
    announcements: Option<Coalescer<String, Result<(), StoreError>>>,
}

impl PostgresStore {
    /// Builds the pool; connections open lazily, so this succeeds while the database is down.
    pub fn connect(config: &StoreConfig) -> Result<PostgresStore, StoreError> {
        let layout = Layout::default();
        let pg = connect::pg_config(config)?;
        let db = Arc::new(Db::new(
            connect::pool(config, &layout)?,
            config.timeout,
            layout,
            pg,
        ));
        let addresses = Arc::new(Addresses::default());
        if config.max_batch <= 1 {
            return Ok(PostgresStore {
                db,
                addresses,
                writes: None,
                announcements: None,
            });
        }
        let writes = Coalescer::new(config.max_batch, batches_in_flight(config.pool_size), {
            let (db, addresses) = (Arc::clone(&db), Arc::clone(&addresses));
            move |writes| {
                Box::pin(write::batch(Arc::clone(&db), Arc::clone(&addresses), writes)) as BatchFuture<_>
            }
        });
        let announcements = Coalescer::new(config.max_batch, 1, {
            let db = Arc::clone(&db);
            move |items| Box::pin(listen::announce_batch(Arc::clone(&db), items)) as BatchFuture<_>
        });
        Ok(PostgresStore {
            db,
            addresses,
            writes: Some(writes),
            announcements: Some(announcements),
        })
    }

    /// Applies pending migrations. Several replicas may call this at once: a session advisory lock on a
    /// dedicated connection serialises them, and each applies only what is still missing. A caller that
    /// finds the lock taken waits for it at most `store.timeout`, then fails.
    pub async fn migrate(config: &StoreConfig) -> Result<usize, StoreError> {
        Ok(migrations::run(config).await?)
    }

    /// [`PostgresStore::migrate`], saying whether trying again later may succeed.
    pub(crate) async fn try_migrate(config: &StoreConfig) -> Result<usize, Unmigrated> {
        migrations::run(config).await
    }
}

impl PostgresStore {
    /// Runs `write` in the next write batch, within `store.timeout`.
    async fn write(&self, writes: &Coalescer<Write, Written>, write: Write) -> Result<Written, StoreError> {
        match timeout(self.db.timeout(), writes.submit(write)).await {
            Ok(Some(written)) => Ok(written),
            Ok(None) => Err(unanswered()),
            Err(_) => Err(StoreError::Timeout(self.db.timeout())),
        }
    }
}

/// Most write batches running at once: a quarter of the pool, so coalesced statements leave connections
/// for everything else (heartbeats, requests that claim alone). More than one runs only while a full
/// batch waits (see `coalesce`).
fn batches_in_flight(pool_size: usize) -> usize {
    (pool_size / 4).max(1)
}

#[async_trait::async_trait]
impl Lifecycle for PostgresStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let writes = match &self.writes {
            Some(writes) if !self.db.distributed().await? => writes,
            _ => return claim::alone(&self.db, request).await,
        };
        match self.write(writes, Write::Claim(request.clone())).await? {
            Written::Claim(Ok(Some(decided))) => Ok(decided),
            Written::Claim(Ok(None)) => claim::alone(&self.db, request).await,
            Written::Claim(Err(error)) => Err(error),
            Written::Complete(_) => Err(unanswered()),
        }
    }

    /// A heartbeat writes a new version of the record elsewhere, so its address is forgotten.
    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        self.addresses.take(&id.token);
        fenced::heartbeat(&self.db, id, lease).await
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let address = self.addresses.take(&id.token);
        let batched = match &self.writes {
            Some(writes) if complete::batchable(response) && !self.db.distributed().await? => Some(writes),
            _ => None,
        };
        let Some(writes) = batched else {
            return complete::alone(&self.db, id, response).await;
        };
        let completion = Completion {
            id: id.clone(),
            response: response.clone(),
            address,
        };
        match self.write(writes, Write::Complete(completion)).await? {
            Written::Complete(stored) => stored,
            Written::Claim(_) => Err(unanswered()),
        }
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.addresses.take(&id.token);
        fenced::release(&self.db, id).await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.addresses.take(&id.token);
        fenced::hold(&self.db, id).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let client = self.db.client().await?;
        let result = timeout(self.db.timeout(), client.simple_query("SELECT 1")).await;
        self.db.finish(client, result).map(drop)
    }

    async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        let Some(announcements) = &self.announcements else {
            return listen::announce(&self.db, announcement).await;
        };
        match timeout(self.db.timeout(), announcements.submit(announcement.to_owned())).await {
            Ok(Some(sent)) => sent,
            Ok(None) => Err(unanswered()),
            Err(_) => Err(StoreError::Timeout(self.db.timeout())),
        }
    }
}

#[async_trait::async_trait]
impl Upkeep for PostgresStore {
    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        fenced::release_stale(&self.db, id).await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        maintenance::sweep(&self.db, batch).await
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        maintenance::find(&self.db, key, scope).await
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        maintenance::stats(&self.db).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        maintenance::list(&self.db, query).await
    }

    async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        maintenance::forget(&self.db, id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_of_the_pool_runs_batches_and_never_less_than_one() {
        let in_flight: Vec<usize> = [1, 3, 4, 7, 8, 16, 64].map(batches_in_flight).to_vec();
        assert_eq!(in_flight, [1, 1, 1, 1, 2, 4, 16]);
    }

    #[tokio::test]
    async fn connecting_needs_no_database_and_coalesces_only_above_a_batch_of_one() {
        let toml = |max_batch: usize| {
            format!("[store]\nurl = \"postgres://127.0.0.1:9/none\"\nmax_batch = {max_batch}\n")
        };
        let single = crate::Config::from_toml_str(&toml(1)).unwrap().store;
        let store = PostgresStore::connect(&single).unwrap();
        assert!(store.writes.is_none() && store.announcements.is_none());
        let batched = crate::Config::from_toml_str(&toml(8)).unwrap().store;
        let store = PostgresStore::connect(&batched).unwrap();
        assert!(store.writes.is_some() && store.announcements.is_some());
    }
}
