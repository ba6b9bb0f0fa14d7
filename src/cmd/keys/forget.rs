//! `idemproxy keys forget`: deletes one record so the next request with its key executes again, after
//! the person at the terminal types the key back (or `--yes`), never a claim in flight without
//! `--force`, and fenced by the claim token shown, so a record claimed again meanwhile is kept. Touches
//! that one record.

use std::fmt::Write as _;
use std::io::{BufRead as _, IsTerminal as _};
use std::time::Duration;

use serde::Serialize;

use super::client::Client;
use super::report::{KeysError, Output, Report, describe, human};
use crate::config::Config;
use crate::store::{RecordId, RecordInfo, RecordStatus, StoreHandle};

/// What `keys forget` was asked.
pub(super) struct Forget<'a> {
    pub(super) key: &'a str,
    pub(super) yes: bool,
    pub(super) force: bool,
    /// How long a proxy may still replay a forgotten response from its memory.
    pub(super) cache_age: Option<Duration>,
}

/// What `keys forget` did, for JSON output.
#[derive(Serialize)]
struct Forgotten<'a> {
    forgotten: bool,
    reason: &'a str,
    record: Option<RecordInfo>,
}

pub(super) async fn forget(
    store: &StoreHandle,
    out: &Output,
    client: &Client,
    asked: &Forget<'_>,
) -> Result<Report, KeysError> {
    let mut records = store.find(asked.key, client.scope()).await?;
    records.retain(|record| client.filter().admits(&record.scope));
    let record = match records.len() {
        0 => return Ok(client.not_found(out, asked.key)),
        1 => records.remove(0),
        _ => return Ok(out.forget_refused(&several_scopes(asked.key, &records), None)),
    };
    if let Some(why) = forget_refusal(&record, asked.force) {
        return Ok(out.forget_refused(&why, Some(record)));
    }
    if !asked.yes
        && let Some(refusal) = confirm(&record)?
    {
        return Ok(out.forget_refused(&refusal, Some(record)));
    }
    let id = RecordId {
        scope: record.scope.clone(),
        key: record.key.clone(),
        token: record.token,
    };
    if !store.forget(&id).await? {
        let why = "the record changed since it was read (claimed again, or already gone); nothing was \
                   forgotten: run the command again to see it as it is now";
        let now = store
            .find(asked.key, Some(&record.scope))
            .await?
            .into_iter()
            .next();
        return Ok(out.forget_refused(why, now));
    }
    let mut reason = String::from("forgotten: the next request with this key executes again, as new");
    if let (Some(age), RecordStatus::Completed) = (asked.cache_age, record.status) {
        let _ = write!(
            reason,
            " (a proxy that replayed it lately may replay it from memory for up to {}, replay_cache.max_age)",
            human(age)
        );
    }
    Ok(out.forgotten(&reason, record))
}

/// Why a record must not be forgotten, if it must not: a claim in flight is executing on a proxy right
/// now, and forgetting it would let a retry execute the request again beside it.
fn forget_refusal(record: &RecordInfo, force: bool) -> Option<String> {
    let left = record.lease_remaining().filter(|_| !force)?;
    Some(format!(
        "the key is in flight: a running proxy is executing it (lease live for {}); forgetting it now \
         lets a retry execute the request a second time while the first runs. Wait for it to settle, or \
         pass --force if its proxy is known to be stuck",
        human(left)
    ))
}

/// Asks the person at the terminal to type the key back. `Some(reason)` when they did not, or when there
/// is no terminal to ask at.
fn confirm(record: &RecordInfo) -> Result<Option<String>, KeysError> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() || !std::io::stderr().is_terminal() {
        return Ok(Some(
            "refusing to forget without confirmation: there is no terminal to ask at; pass --yes to \
             forget from a script"
                .into(),
        ));
    }
    let mut shown = String::new();
    describe(record, &mut shown);
    eprint!(
        "{shown}\nForgetting deletes this record: the next request with key {:?} executes again, as new.\n\
         Type the key to confirm: ",
        record.key
    );
    let mut typed = String::new();
    stdin
        .lock()
        .read_line(&mut typed)
        .map_err(KeysError::Confirmation)?;
    if typed.trim_end_matches(['\r', '\n']) == record.key {
        return Ok(None);
    }
    Ok(Some("the key typed does not match; nothing was forgotten".into()))
}

fn several_scopes(key: &str, records: &[RecordInfo]) -> String {
    let scopes: Vec<&str> = records.iter().map(|r| r.scope.as_str()).collect();
    format!(
        "key {key:?} exists in {} scopes; pass --scope with one of: {}, or the client's credential \
         (--header, --cookie) and route",
        records.len(),
        scopes.join(", ")
    )
}

/// How long proxies may keep replaying a response from memory, when they keep copies.
pub(super) fn replay_cache_age(config: &Config) -> Option<Duration> {
    let cache = &config.replay_cache;
    (cache.max_size > 0 && !cache.max_age.is_zero()).then_some(cache.max_age)
}

impl Output {
    fn forgotten(&self, reason: &str, record: RecordInfo) -> Report {
        let value = Forgotten {
            forgotten: true,
            reason,
            record: Some(record),
        };
        self.report(&value, true, |value, text| {
            let _ = writeln!(text, "{}", value.reason);
        })
    }

    fn forget_refused(&self, reason: &str, record: Option<RecordInfo>) -> Report {
        let value = Forgotten {
            forgotten: false,
            reason,
            record,
        };
        self.report(&value, false, |value, text| {
            let _ = writeln!(text, "{}", value.reason);
            if let Some(record) = &value.record {
                text.push('\n');
                describe(record, text);
            }
        })
    }
}
