//! `idemproxy keys`: the operator's runbook for single records, run from the command line against the
//! configured store while proxies keep serving. Opens the store as a tool (no migrations, no instance
//! lock) and touches only the records it is asked about. Every command reports in text for people or in
//! JSON for scripts; nothing here prints request data, which the store never holds in the clear.

use std::fmt::Write as _;
use std::io::{BufRead as _, IsTerminal as _};
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::cli::{ClientArgs, KeysCommand, ListState};
use crate::config::{Config, DEFAULT_ROUTE, Route, normal};
use crate::metrics::Metrics;
use crate::proxy::key;
use crate::store::{
    self, ListQuery, Purpose, RecordId, RecordInfo, RecordState, RecordStatus, ScopeFilter, StoreError,
    StoreHandle, sweeper,
};

/// Records deleted per statement by `keys purge`, as by the sweeper's default.
const PURGE_BATCH: u32 = 1000;

/// Most records one `keys list` reads, whatever its filters: a page on a large table with few records
/// that pass them stops here and gives its cursor.
const LIST_BUDGET: u32 = 10_000;

/// Fewest records read per store call while filling a `keys list` page, so that rare matches are not
/// sought a few records at a time.
const LIST_STEP: u32 = 500;

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
            let states = state.iter().map(|s| s.state()).collect();
            list(&store, &out, scope.filter(), states, *limit, after.clone()).await
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
                cache_age: replay_cache_age(config),
            };
            forget(&store, &out, &scope, &asked).await
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

impl ListState {
    fn state(self) -> RecordState {
        match self {
            ListState::InFlight => RecordState::InFlight,
            ListState::Stale => RecordState::Stale,
            ListState::Completed => RecordState::Completed,
            ListState::Released => RecordState::Released,
            ListState::Held => RecordState::Held,
            ListState::Expired => RecordState::Expired,
        }
    }
}

/// Which scope a command looks in, and how it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Client {
    /// Every scope.
    Anyone,
    /// The scope given with --scope.
    Scope(String),
    /// Every client of a route's scope name.
    Route { route: String, scope_name: String },
    /// One client of a route: the scope the proxy computes from its credential.
    Credential {
        route: String,
        scope: String,
        /// Why the proxy would refuse this client's keyed requests, if it would.
        refused: Option<String>,
    },
}

impl Client {
    /// The scope the arguments name: --scope as given; else, with a credential, the scope the proxy
    /// computes for it on the route (named, chosen by --method and --path, or the default route); else
    /// the route's scope name, when a route is named.
    fn resolve(config: &Config, scope: Option<&str>, args: &ClientArgs) -> Result<Client, KeysError> {
        if let Some(scope) = scope {
            return Ok(Client::Scope(scope.to_owned()));
        }
        if !args.has_route() && !args.has_credential() {
            return Ok(Client::Anyone);
        }
        let route = route(config, args)?;
        if route.passthrough {
            return Err(KeysError::Usage(format!(
                "route {:?} is passthrough: the proxy keeps no records for it",
                route.name
            )));
        }
        if !args.has_credential() {
            return Ok(Client::Route {
                route: route.name.clone(),
                scope_name: route.scope.clone(),
            });
        }
        let headers = headers(args)?;
        Ok(Client::Credential {
            route: route.name.clone(),
            scope: key::scope(&route.scope, &route.policy, &headers),
            refused: refused(route, &headers),
        })
    }

    fn filter(&self) -> ScopeFilter {
        match self {
            Client::Anyone => ScopeFilter::All,
            Client::Scope(scope) | Client::Credential { scope, .. } => ScopeFilter::Exact(scope.clone()),
            Client::Route { scope_name, .. } => ScopeFilter::Named(scope_name.clone()),
        }
    }

    /// The one scope to look in, if the arguments name one.
    fn scope(&self) -> Option<&str> {
        match self {
            Client::Scope(scope) | Client::Credential { scope, .. } => Some(scope),
            Client::Anyone | Client::Route { .. } => None,
        }
    }

    /// A line saying which scope was computed, for text output.
    fn describe(&self, text: &mut String) {
        if let Client::Credential {
            route,
            scope,
            refused,
        } = self
        {
            let _ = writeln!(text, "route {route:?}: this client's scope is {scope}");
            if let Some(why) = refused {
                let _ = writeln!(text, "note: {why}");
            }
        }
    }
}

/// The route a request takes, chosen as the proxy chooses it: by name, or by method and path (brought to
/// the proxy's normal form first); the default route when neither is given.
fn route<'a>(config: &'a Config, args: &ClientArgs) -> Result<&'a Route, KeysError> {
    let routes = &config.routes;
    if let Some(name) = &args.route {
        if name == DEFAULT_ROUTE {
            return Ok(&routes.default);
        }
        let found = routes.routes.iter().find(|route| &route.name == name);
        return found.map(|route| &**route).ok_or_else(|| {
            let names: Vec<&str> = routes.routes.iter().map(|r| r.name.as_str()).collect();
            let known = match names.as_slice() {
                [] => "it has none but default; pass the proxy's --config".to_owned(),
                names => format!("its routes: {}, and default", names.join(", ")),
            };
            KeysError::Usage(format!("no route named {name:?} in the configuration ({known})"))
        });
    }
    let Some(path) = &args.path else {
        return Ok(&routes.default);
    };
    let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
        .map_err(|_| KeysError::Usage(format!("{:?} is not an HTTP method", args.method)))?;
    let path = path.split('?').next().unwrap_or_default();
    let normal = normal(path, &config.server.paths)
        .map_err(|why| KeysError::Usage(format!("the proxy refuses the path {path:?}: {why}")))?;
    Ok(&**routes.select(&method, &normal))
}

/// The request headers the arguments give, as the proxy receives them.
fn headers(args: &ClientArgs) -> Result<HeaderMap, KeysError> {
    let mut headers = HeaderMap::new();
    for line in &args.headers {
        let bad = |why: &str| KeysError::Usage(format!("--header {line:?}: {why}"));
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| bad("write it as 'Name: value'"))?;
        let name = HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| bad("not a header name"))?;
        let value = HeaderValue::from_str(value.trim()).map_err(|_| bad("not a header value"))?;
        headers.append(name, value);
    }
    if let Some(cookie) = &args.cookie {
        let value = HeaderValue::from_str(cookie)
            .map_err(|_| KeysError::Usage(format!("--cookie {cookie:?}: not a header value")))?;
        headers.append(http::header::COOKIE, value);
    }
    Ok(headers)
}

/// Why the proxy would refuse a keyed request with these headers on `route` for naming no client.
fn refused(route: &Route, headers: &HeaderMap) -> Option<String> {
    let policy = &route.policy;
    if policy.unscoped == crate::config::Unscoped::Shared || key::has_scope(policy, headers) {
        return None;
    }
    let mut names: Vec<String> = policy.scope_headers.iter().map(|h| h.to_string()).collect();
    names.extend(policy.scope_cookie.iter().map(|c| format!("cookie {c}")));
    Some(format!(
        "these headers name no client on route {:?} (it reads {}): the proxy refuses such keyed \
         requests (400 missing-scope), so no record can have this scope",
        route.name,
        names.join(", ")
    ))
}

async fn show(store: &StoreHandle, out: &Output, key: &str, client: &Client) -> Result<Report, KeysError> {
    let mut records = store.find(key, client.scope()).await?;
    records.retain(|record| client.filter().admits(&record.scope));
    if records.is_empty() {
        return Ok(out.not_found(key, client));
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
async fn list(
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

/// What `keys forget` was asked.
struct Forget<'a> {
    key: &'a str,
    yes: bool,
    force: bool,
    /// How long a proxy may still replay a forgotten response from its memory.
    cache_age: Option<Duration>,
}

/// What `keys forget` did, for JSON output.
#[derive(Serialize)]
struct Forgotten<'a> {
    forgotten: bool,
    reason: &'a str,
    record: Option<RecordInfo>,
}

async fn forget(
    store: &StoreHandle,
    out: &Output,
    client: &Client,
    asked: &Forget<'_>,
) -> Result<Report, KeysError> {
    let mut records = store.find(asked.key, client.scope()).await?;
    records.retain(|record| client.filter().admits(&record.scope));
    let record = match records.len() {
        0 => return Ok(out.not_found(asked.key, client)),
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
fn replay_cache_age(config: &Config) -> Option<Duration> {
    let cache = &config.replay_cache;
    (cache.max_size > 0 && !cache.max_age.is_zero()).then_some(cache.max_age)
}

/// What `keys release` did, for JSON output.
#[derive(Serialize)]
struct Released<'a> {
    released: bool,
    reason: &'a str,
    record: Option<RecordInfo>,
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
        0 => return Ok(out.not_found(key, &Client::Anyone)),
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

/// One record, one line per fact.
fn describe(record: &RecordInfo, text: &mut String) {
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

fn status_line(record: &RecordInfo) -> String {
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

fn response_line(record: &RecordInfo) -> String {
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

fn timestamp(at: SystemTime, now: SystemTime) -> String {
    let stamp = humantime::format_rfc3339_seconds(at);
    match at.duration_since(now) {
        Ok(ahead) => format!("{stamp} (in {})", human(ahead)),
        Err(behind) => format!("{stamp} ({} ago)", human(behind.duration())),
    }
}

/// A duration to the second, as people read it ("1h 2m 3s").
fn human(duration: Duration) -> String {
    let seconds = Duration::from_secs(duration.as_secs().max(u64::from(!duration.is_zero())));
    humantime::format_duration(seconds).to_string()
}

/// Renders reports as text or JSON.
struct Output {
    json: bool,
}

impl Output {
    fn report<T: Serialize>(&self, value: &T, success: bool, text: impl FnOnce(&T, &mut String)) -> Report {
        let mut output = String::new();
        if self.json {
            output = serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
            output.push('\n');
        } else {
            text(value, &mut output);
        }
        Report { output, success }
    }

    fn not_found(&self, key: &str, client: &Client) -> Report {
        let empty: [RecordInfo; 0] = [];
        self.report(&empty, false, |_, text| {
            client.describe(text);
            match client.scope() {
                Some(scope) => {
                    let _ = writeln!(text, "no record for key {key:?} in scope {scope}");
                }
                None => {
                    let _ = writeln!(text, "no record for key {key:?}");
                }
            }
        })
    }

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

    fn released(&self, released: bool, reason: &str, record: Option<RecordInfo>) -> Report {
        self.outcome(released, reason, record, true)
    }

    fn refused(&self, reason: &str, record: Option<RecordInfo>) -> Report {
        self.outcome(false, reason, record, false)
    }

    fn outcome(&self, released: bool, reason: &str, record: Option<RecordInfo>, success: bool) -> Report {
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

#[cfg(test)]
mod tests {
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
