//! What a `keys` command answers: its [`Report`] (text or JSON, and whether it did what was asked), the
//! errors that stop it, and the words every command prints a record in.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::store::{RecordInfo, RecordStatus, StoreError};

/// Why a `keys` command could not run.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The command names a route, path or credential that cannot be used.
    #[error("{0}")]
    Usage(String),
    /// The confirmation could not be read.
    #[error("cannot read the confirmation: {0}")]
    Confirmation(std::io::Error),
}

/// What a command has to say, and whether it did what was asked (the exit status).
#[derive(Debug)]
pub struct Report {
    /// Text or JSON, ending with a newline.
    pub output: String,
    /// False when the key was not found or the command refused to act.
    pub success: bool,
}

/// What `keys release` did, for JSON output.
#[derive(Serialize)]
struct Released<'a> {
    released: bool,
    reason: &'a str,
    record: Option<RecordInfo>,
}

/// One record, one line per fact.
pub(super) fn describe(record: &RecordInfo, text: &mut String) {
    let now = record.observed_at;
    let mut line = |label: &str, value: String| {
        let _ = writeln!(text, "{label:<10}{value}");
    };
    line("key", record.key.clone());
    line("scope", record.scope.clone());
    line("status", status_line(record));
    line(
        "attempt",
        format!("{} ({})", record.attempt, record.claim_kind.as_str()),
    );
    line("token", record.token.to_string());
    line("created", timestamp(record.created_at, now));
    line("updated", timestamp(record.updated_at, now));
    line("expires", timestamp(record.expires_at, now));
    line("response", response_line(record));
}

pub(super) fn status_line(record: &RecordInfo) -> String {
    let status = record.status.as_str();
    match (record.status, record.lease_remaining()) {
        (RecordStatus::Processing, Some(left)) => {
            format!("{status}, lease live for {} (a proxy holds it)", human(left))
        }
        _ if record.expired() => {
            format!("{status}, expired (claimable as new; the sweeper deletes it)")
        }
        (RecordStatus::Processing, None) => {
            format!("{status}, lease ran out (stale: the next retry takes it over, or release it)")
        }
        (RecordStatus::Failed, _) => format!("{status} (released: the next retry executes)"),
        (RecordStatus::Unknown, _) => format!(
            "{status} (held: the request may have executed; retries get 502 outcome-unknown until \
             `keys release`)"
        ),
        (RecordStatus::Completed, _) => format!("{status} (retries replay the stored response)"),
    }
}

pub(super) fn response_line(record: &RecordInfo) -> String {
    match (
        record.response_status,
        record.body_retained,
        record.response_bytes,
    ) {
        (None, _, _) => "none".into(),
        (Some(status), Some(true), bytes) => format!("{status}, {} bytes stored", bytes.unwrap_or(0)),
        (Some(status), _, _) => {
            format!("{status}, body not retained (over max_stored_response; retries get 410)")
        }
    }
}

pub(super) fn timestamp(at: SystemTime, now: SystemTime) -> String {
    let stamp = humantime::format_rfc3339_seconds(at);
    match at.duration_since(now) {
        Ok(ahead) => format!("{stamp} (in {})", human(ahead)),
        Err(behind) => format!("{stamp} ({} ago)", human(behind.duration())),
    }
}

/// A duration to the second, as people read it ("1h 2m 3s").
pub(super) fn human(duration: Duration) -> String {
    let seconds = Duration::from_secs(duration.as_secs().max(u64::from(!duration.is_zero())));
    humantime::format_duration(seconds).to_string()
}

/// Renders reports as text or JSON.
pub(super) struct Output {
    pub(super) json: bool,
}

impl Output {
    pub(super) fn report<T: Serialize>(
        &self,
        value: &T,
        success: bool,
        text: impl FnOnce(&T, &mut String),
    ) -> Report {
        let mut output = String::new();
        if self.json {
            output = serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
            output.push('\n');
        } else {
            text(value, &mut output);
        }
        Report { output, success }
    }

    pub(super) fn released(&self, released: bool, reason: &str, record: Option<RecordInfo>) -> Report {
        self.outcome(released, reason, record, true)
    }

    pub(super) fn refused(&self, reason: &str, record: Option<RecordInfo>) -> Report {
        self.outcome(false, reason, record, false)
    }

    pub(super) fn outcome(
        &self,
        released: bool,
        reason: &str,
        record: Option<RecordInfo>,
        success: bool,
    ) -> Report {
        let value = Released {
            released,
            reason,
            record,
        };
        self.report(&value, success, |value, text| {
            let _ = writeln!(text, "{}", value.reason);
            if let Some(record) = &value.record {
                text.push('\n');
                describe(record, text);
            }
        })
    }
}
