//! The Redis key table, on one server or a Redis Cluster. Runs where the other stores do (claim on the
//! request path; heartbeat, complete, release in the forwarding task). Every operation on a record is one
//! Lua script on the record's node, so it is atomic there, and fenced by the claim's token like the SQL
//! stores' statements; the node's clock (`TIME`) is the only clock. Records expire by Redis's own TTL, set
//! by the scripts to the record's expiry (or its lease end while it runs), so no sweeper runs.
//!
//! Redis answers a write before it is on disk or on a replica. With `store.redis.wait_replicas = n` a claim,
//! completion or hold is followed by `WAIT n` on the same connection, and counts as done only once n
//! replicas have it; the store table in docs/stores.md says what each setting means when a primary dies.
//!
//! This file wires the parts into [`RedisStore`]:
//! - `connect.rs`: the connection (one server or a cluster), scripts with `WAIT`, per-node pipelines;
//! - `record.rs`: record names (one hash tag each) and the scripts' answers in the store's types;
//! - `scan.rs`: the operator's views over many records, by `SCAN` on every primary;
//! - `listen.rs`: `PUBLISH` after a record of a wait route settled, and the subscriber that wakes this
//!   process's waiting requests (`on_in_flight = "wait"`);
//! - `redis/lua/`: the scripts.

mod connect;
mod listen;
mod record;
mod scan;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::blob::encode_headers;
use super::coalesce::{BatchFuture, Coalescer, unanswered};
use super::listen::keep_listening;
use super::wake::Waiters;
use super::{
    ClaimRequest, ClaimResult, Lifecycle, ListPage, ListQuery, RecordId, RecordInfo, RecordStats, Store,
    StoreError, StoredResponse, Upkeep,
};
use crate::config::{RedisTarget, StoreConfig};
use crate::metrics::Metrics;
use connect::{Call, Redis, Script};
use redis::Value;

/// The scripts, loaded into Redis by hash at first use.
#[derive(Clone)]
struct Scripts {
    claim: Script,
    complete: Script,
    heartbeat: Script,
    settle: Script,
    read: Script,
    forget: Script,
}

/// The Redis-backed [`Store`].
pub struct RedisStore {
    redis: Redis,
    scripts: Scripts,
    prefix: String,
    /// On one server with replicas to wait for: the writes that wait, run in batches of one pipeline and
    /// one `WAIT` each (a cluster's writes each wait on their own node).
    confirmed: Option<Coalescer<Call, Result<Value, StoreError>>>,
    max_batch: usize,
}

impl RedisStore {
    /// Prepares the connection; it is made at the first operation, so this succeeds while Redis is down.
    pub fn connect(config: &StoreConfig, target: &RedisTarget) -> RedisStore {
        RedisStore::over(
            Redis::new(config, target),
            Scripts {
                claim: Script::new(include_str!("redis/lua/claim.lua")),
                complete: Script::new(include_str!("redis/lua/complete.lua")),
                heartbeat: Script::new(include_str!("redis/lua/heartbeat.lua")),
                settle: Script::new(include_str!("redis/lua/settle.lua")),
                read: Script::new(include_str!("redis/lua/read.lua")),
                forget: Script::new(include_str!("redis/lua/forget.lua")),
            },
            target,
            config.max_batch,
        )
    }

    fn over(redis: Redis, scripts: Scripts, target: &RedisTarget, max_batch: usize) -> RedisStore {
        let confirmed = (target.wait_replicas > 0 && !target.cluster).then(|| {
            let redis = redis.clone();
            Coalescer::new(max_batch, 1, move |calls: Vec<Call>| -> BatchFuture<_> {
                let redis = redis.clone();
                Box::pin(async move { redis.run_confirmed(calls).await })
            })
        });
        RedisStore {
            redis,
            scripts,
            prefix: target.key_prefix.clone(),
            confirmed,
            max_batch,
        }
    }

    /// Runs `script` on the record `name`; with `wait`, its write counts only once it reached the
    /// replicas asked for (in the next batch, on one server).
    async fn run(
        &self,
        script: &Script,
        name: &str,
        args: &[&[u8]],
        wait: bool,
    ) -> Result<Value, StoreError> {
        match &self.confirmed {
            Some(batches) if wait => {
                let call = Call {
                    script: script.clone(),
                    key: name.as_bytes().to_vec(),
                    args: args.iter().map(|arg| arg.to_vec()).collect(),
                };
                batches.submit(call).await.unwrap_or_else(|| Err(unanswered()))
            }
            _ => self.redis.run(script, name.as_bytes(), args, wait).await,
        }
    }

    fn name(&self, scope: &str, key: &str) -> String {
        record::name(&self.prefix, scope, key)
    }

    /// Settles the claim `id` as `status`: by its holder, or by an operator once it is stale. Only a hold
    /// waits for replicas: a lost release costs a retry its lease, but a lost hold would let a retry take
    /// over, and execute again, a request that may have run.
    async fn settle(&self, id: &RecordId, status: &str, by: &str) -> Result<bool, StoreError> {
        let name = self.name(&id.scope, &id.key);
        let args: [&[u8]; 3] = [id.token.as_bytes(), status.as_bytes(), by.as_bytes()];
        let wait = status == "unknown";
        let answer = self.run(&self.scripts.settle, &name, &args, wait).await?;
        record::written(answer)
    }
}

#[async_trait::async_trait]
impl Lifecycle for RedisStore {
    /// A worker's own multiplexed connection: Redis has no commit for connections to share, and its
    /// `appendfsync always` covers every connection's writes of one event-loop turn with one fsync, so a
    /// connection per worker thread costs Redis nothing and spares each operation two hops between
    /// threads (to the connection's task and back).
    fn for_worker(&self) -> Option<Arc<dyn Store>> {
        Some(Arc::new(RedisStore::over(
            self.redis.another(),
            self.scripts.clone(),
            self.redis.target(),
            self.max_batch,
        )))
    }

    /// A claim that won is confirmed by `WAIT` before it is reported won; one that could not be confirmed
    /// is released again (best effort) and reported as a store failure, so its request is not forwarded.
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimResult, StoreError> {
        let id = &request.id;
        let name = self.name(&id.scope, &id.key);
        let (lease, ttl) = (millis(request.lease), millis(request.ttl));
        let args: [&[u8]; 4] = [
            &request.fingerprint,
            id.token.as_bytes(),
            lease.as_bytes(),
            ttl.as_bytes(),
        ];
        match self.run(&self.scripts.claim, &name, &args, true).await {
            Ok(answer) => record::claim_result(answer),
            Err(error) => {
                // With replicas to wait for, the claim may have been written and only its WAIT have
                // failed: give it back, so the client's retry executes at once instead of after the lease.
                // Said in the log, since the retry is then counted as one (`claim_kind` "retry").
                let target = self.redis.target();
                if target.wait_replicas > 0 {
                    let given_back =
                        tokio::time::timeout(target.wait_timeout, self.settle(id, "failed", "holder")).await;
                    match given_back {
                        Ok(Ok(false)) => {}
                        Ok(Ok(true)) => {
                            tracing::info!(key_hash = %id.key_hash(), "a claim no replica confirmed was given back")
                        }
                        Ok(Err(_)) | Err(_) => tracing::info!(
                            key_hash = %id.key_hash(),
                            "the give-back of a claim no replica confirmed went unanswered; it may have been given back"
                        ),
                    }
                }
                Err(error)
            }
        }
    }

    async fn heartbeat(&self, id: &RecordId, lease: Duration) -> Result<bool, StoreError> {
        let name = self.name(&id.scope, &id.key);
        let lease = millis(lease);
        let args: [&[u8]; 2] = [id.token.as_bytes(), lease.as_bytes()];
        record::written(self.run(&self.scripts.heartbeat, &name, &args, false).await?)
    }

    async fn complete(&self, id: &RecordId, response: &StoredResponse) -> Result<bool, StoreError> {
        let name = self.name(&id.scope, &id.key);
        let status = response.status.to_string();
        let headers = encode_headers(&response.headers);
        let (retained, body): (&[u8], &[u8]) = match &response.body {
            Some(body) => (b"1", body),
            None => (b"0", b""),
        };
        let args: [&[u8]; 5] = [id.token.as_bytes(), status.as_bytes(), &headers, retained, body];
        record::written(self.run(&self.scripts.complete, &name, &args, true).await?)
    }

    async fn release(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.settle(id, "failed", "holder").await
    }

    async fn hold(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.settle(id, "unknown", "holder").await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.redis.ping().await
    }

    async fn announce(&self, announcement: &str) -> Result<(), StoreError> {
        self.redis
            .publish(&listen::channel(&self.prefix), announcement)
            .await
    }
}

#[async_trait::async_trait]
impl Upkeep for RedisStore {
    async fn release_stale(&self, id: &RecordId) -> Result<bool, StoreError> {
        self.settle(id, "failed", "stale").await
    }

    /// Redis deletes expired records itself (each record's TTL), so there is never a backlog to sweep.
    async fn sweep(&self, _batch: u32) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn find(&self, key: &str, scope: Option<&str>) -> Result<Vec<RecordInfo>, StoreError> {
        let Some(scope) = scope else {
            return scan::find_everywhere(&self.redis, &self.scripts.read, &self.prefix, key).await;
        };
        let name = self.name(scope, key);
        let answer = self.run(&self.scripts.read, &name, &[], false).await?;
        Ok(record::record_info(scope.to_owned(), key.to_owned(), answer)?
            .into_iter()
            .collect())
    }

    async fn stats(&self) -> Result<RecordStats, StoreError> {
        scan::stats(&self.redis, &self.prefix).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        scan::list(&self.redis, &self.scripts.read, &self.prefix, query).await
    }

    /// Waits for replicas like a hold: a lost deletion would bring back a response the operator was told
    /// is gone.
    async fn forget(&self, id: &RecordId) -> Result<bool, StoreError> {
        let name = self.name(&id.scope, &id.key);
        let args: [&[u8]; 1] = [id.token.as_bytes()];
        let answer = self.run(&self.scripts.forget, &name, &args, true).await?;
        record::written(answer)
    }
}

/// Hears other replicas' announcements on the Redis store `target` and wakes this process's waiters,
/// from now until `shutdown`, subscribing again (to the next node) whenever the connection is lost.
pub async fn listen(
    config: StoreConfig,
    target: RedisTarget,
    waiters: Arc<Waiters>,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let redis = Redis::new(&config, &target);
    let channel = listen::channel(&target.key_prefix);
    let (sessions, metered) = (waiters.clone(), metrics.clone());
    keep_listening(waiters, metrics, shutdown, |attempt| {
        listen::session(&redis, &channel, attempt, &sessions, &metered)
    })
    .await;
}

fn millis(duration: Duration) -> String {
    duration.as_millis().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connecting_needs_no_server_and_a_dead_one_is_a_store_error() {
        let config =
            crate::Config::from_toml_str("[store]\nurl = \"redis://127.0.0.1:9\"\ntimeout = \"2s\"\n")
                .unwrap()
                .store;
        let crate::config::StoreBackend::Redis(target) = &config.backend else {
            panic!("not a Redis store");
        };
        let store = RedisStore::connect(&config, target);
        assert!(matches!(
            store.ping().await,
            Err(StoreError::Backend(_) | StoreError::Timeout(_))
        ));
    }
}
