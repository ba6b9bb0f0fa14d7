//! `idemproxy keys`: the operator's runbook for single records, run from the command line against the
//! configured store while proxies keep serving. Opens the store as a tool (no migrations, no instance
//! lock) and touches only the records it is asked about. Every command reports in text for people or in
//! JSON for scripts; nothing here prints request data, which the store never holds in the clear.
//! `keys/client.rs` resolves whom a command is about (a client's scope from its credential),
//! `keys/list.rs` pages through records, `keys/forget.rs` deletes one.

mod client;
mod forget;
mod list;
mod report;

use std::fmt::Write as _;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use self::client::Client;
use self::forget::Forget;
pub use self::report::{KeysError, Report};
use self::report::{Output, describe, human};
use super::KeysCommand;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::store::{self, Purpose, RecordId, RecordInfo, RecordStatus, StoreError, StoreHandle, sweeper};

/// Records deleted per statement by `keys purge`, as by the sweeper's default.
const PURGE_BATCH: u32 = 1000;

/// Runs one `keys` command against the configured store.
pub async fn run(config: &Config, command: &KeysCommand, json: bool) -> Result<Report, KeysError> {
    let backend = store::open(&config.store, Purpose::Tool).await?;
    let store = StoreHandle::new(backend, Metrics::new());
    let out = Output { json };
    match command {
        KeysCommand::Show { key, scope, client } => {
            let scope = Client::resolve(config, scope.as_deref(), client)?;
            show(&store, &out, key, &scope).await
        }
        KeysCommand::List {
            scope,
            client,
            state,
            limit,
            after,
        } => {
            let scope = Client::resolve(config, scope.as_deref(), client)?;
            self::list::list(&store, &out, scope.filter(), state.clone(), *limit, after.clone()).await
        }
        KeysCommand::Forget {
            key,
            scope,
            client,
            yes,
            force,
        } => {
            let scope = Client::resolve(config, scope.as_deref(), client)?;
            let asked = Forget {
                key,
                yes: *yes,
                force: *force,
                cache_age: self::forget::replay_cache_age(config),
            };
            self::forget::forget(&store, &out, &scope, &asked).await
        }
        KeysCommand::Release { key, scope, force } => {
            Ok(release(&store, &out, key, scope.as_deref(), *force).await?)
        }
        KeysCommand::Purge { .. } => Ok(purge(&store, &out).await?),
        KeysCommand::Stats => Ok(out.report(&store.stats().await?, true, |stats, text| {
            let _ = writeln!(text, "processing  {}", stats.processing);
            let _ = writeln!(text, "completed   {}", stats.completed);
            let _ = writeln!(text, "failed      {}", stats.failed);
            let _ = writeln!(
                text,
                "unknown     {}  (held: released only by `keys release`)",
                stats.unknown
            );
            let _ = writeln!(text, "expired     {}  (waiting for the sweeper)", stats.expired);
        })),
    }
}

async fn show(store: &StoreHandle, out: &Output, key: &str, client: &Client) -> Result<Report, KeysError> {
    let mut records = store.find(key, client.scope()).await?;
    records.retain(|record| client.filter().admits(&record.scope));
    if records.is_empty() {
        return Ok(client.not_found(out, key));
    }
    Ok(out.report(&records, true, |records, text| {
        client.describe(text);
        for (i, record) in records.iter().enumerate() {
            if i > 0 || matches!(client, Client::Credential { .. }) {
                text.push('\n');
            }
            describe(record, text);
        }
    }))
}

async fn release(
    store: &StoreHandle,
    out: &Output,
    key: &str,
    scope: Option<&str>,
    force: bool,
) -> Result<Report, StoreError> {
    let mut records = store.find(key, scope).await?;
    let record = match records.len() {
        0 => return Ok(Client::Anyone.not_found(out, key)),
        1 => records.remove(0),
        _ => {
            let scopes: Vec<&str> = records.iter().map(|r| r.scope.as_str()).collect();
            let reason = format!(
                "key {key:?} exists in {} scopes; pass --scope with one of: {}",
                records.len(),
                scopes.join(", ")
            );
            return Ok(out.refused(&reason, None));
        }
    };
    if let Some(refusal) = refusal(&record, force) {
        return Ok(out.refused(&refusal, Some(record)));
    }
    if record.status == RecordStatus::Failed {
        return Ok(out.released(false, "already released: the next retry executes", Some(record)));
    }
    let id = RecordId {
        scope: record.scope.clone(),
        key: record.key.clone(),
        token: record.token,
    };
    // Fenced by the token just read: a completion, takeover or heartbeat since then makes this a no-op.
    // A held (unknown) record has no holder, so it is released as a stale one, without --force.
    let released = if force && record.status == RecordStatus::Processing {
        store.release(&id).await?
    } else {
        store.release_stale(&id).await?
    };
    let now = store.find(key, Some(&record.scope)).await?.into_iter().next();
    if released {
        Ok(out.released(
            true,
            "released: the next retry with the same payload executes",
            now,
        ))
    } else {
        let reason =
            "the claim changed while releasing (completed, taken over or heartbeated); nothing was released";
        Ok(out.refused(reason, now))
    }
}

/// Why a record must not be released, if it must not.
fn refusal(record: &RecordInfo, force: bool) -> Option<String> {
    match record.status {
        RecordStatus::Completed => Some(
            "the key is completed: retries replay its stored response; there is no claim to release".into(),
        ),
        RecordStatus::Processing => match record.lease_remaining() {
            Some(left) if !force => Some(format!(
                "the claim's lease is live for {}: a running proxy is executing it and extending the lease; \
                 releasing it now could execute the request twice. Wait for the lease to run out, or pass \
                 --force if its proxy is known to be stuck",
                human(left)
            )),
            _ => None,
        },
        RecordStatus::Failed | RecordStatus::Unknown => None,
    }
}

async fn purge(store: &StoreHandle, out: &Output) -> Result<Report, StoreError> {
    #[derive(Serialize)]
    struct Purged {
        deleted: u64,
    }
    let metrics = Metrics::new();
    let deleted = sweeper::sweep_expired(
        store,
        PURGE_BATCH,
        sweeper::Pace::Flat,
        &metrics,
        &CancellationToken::new(),
    )
    .await?;
    Ok(out.report(&Purged { deleted }, true, |purged, text| {
        let _ = writeln!(text, "deleted {} expired records", purged.deleted);
    }))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::store::ClaimKind;

    fn record(status: RecordStatus, lease: i64, expiry: i64) -> RecordInfo {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let at = |offset: i64| {
            if offset >= 0 {
                now + Duration::from_secs(offset as u64)
            } else {
                now - Duration::from_secs(offset.unsigned_abs())
            }
        };
        RecordInfo {
            scope: "default:abc".into(),
            key: "k".into(),
            status,
            attempt: 1,
            claim_kind: ClaimKind::New,
            token: uuid::Uuid::nil(),
            created_at: at(-10),
            updated_at: at(-5),
            expires_at: at(expiry),
            locked_until: at(lease),
            observed_at: now,
            response_status: None,
            response_bytes: None,
            body_retained: None,
        }
    }

    #[test]
    fn a_live_lease_is_released_only_when_forced() {
        let live = record(RecordStatus::Processing, 20, 3600);
        let why = refusal(&live, false).expect("refused without --force");
        assert!(why.contains("20s"), "{why}");
        assert!(refusal(&live, true).is_none());
        assert!(refusal(&record(RecordStatus::Processing, -1, 3600), false).is_none());
    }

    #[test]
    fn a_completed_record_is_never_released() {
        let done = record(RecordStatus::Completed, -1, 3600);
        assert!(refusal(&done, false).is_some());
        assert!(refusal(&done, true).is_some());
    }

    #[test]
    fn text_report_names_the_state_and_times() {
        let mut text = String::new();
        describe(&record(RecordStatus::Processing, 20, 3600), &mut text);
        assert!(text.contains("lease live for 20s"), "{text}");
        assert!(text.contains("(in 1h)"), "{text}");
        assert!(text.contains("(10s ago)"), "{text}");
        assert!(text.contains("response  none"), "{text}");
    }
}
