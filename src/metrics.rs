//! Every metric idemproxy exports, by name, in this one file. A [`Metrics`] is created once in `run()`
//! and passed down; it owns its own registry (never the global one), which `admin.rs` renders on
//! `/metrics`. This module depends on nothing else in the crate: callers count in its terms
//! ([`Outcome`], [`StoreOp`], [`RecordCounts`]).
//!
//! Each name is written once, in the `Spec` constants below, and follows one rule (Prometheus's
//! conventions, checked by a test over every registered family): `idemproxy_` and then snake_case words
//! for what is measured; a counter ends in `_total`; a histogram ends in its base unit (`_seconds`,
//! `_bytes`); a gauge that counts things has no suffix; no name ends in `_count`, `_sum` or `_bucket`,
//! which the exposition adds to histograms. Label names are the constants in `label`; their values
//! come from small fixed sets only: never keys, paths or error text.
//!
//! `REPLAYS`, `CONFLICTS` and `MISMATCHES` are aliases kept for existing dashboards: each equals
//! `REQUESTS` with its outcome, because [`RouteSeries::record`] counts both.
//!
//! The `route` label is on what a request's route decides, and only that: `REQUESTS`, its three
//! aliases and `REQUEST_DURATION`. Its values are the configured route names and `default`, so they
//! are as many as the configuration has routes; each route's series are resolved once, at start
//! ([`MetricSet::routes`]), and a request finds them by its route's name in a [`RouteSet`]. What the
//! route does not decide has no `route`: the store's and the upstream's latency (one store, one
//! upstream for every route), connections, budgets and limits (shared by every route), the sweeper and
//! the record counts (over the whole table).
//!
//! The `process_*` families are the standard ones every Prometheus client exports under those names
//! (`process.rs` beside this file reads them from `/proc` at each scrape); they keep their standard
//! names, without the `idemproxy_` prefix.

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

mod process;

use prometheus::core::Collector;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// A metric's name and the help text the exposition gives it.
struct Spec {
    name: &'static str,
    help: &'static str,
}

// Requests.
const REQUESTS: Spec = Spec {
    name: "idemproxy_requests_total",
    help: "Requests by how they ended.",
};
const REQUEST_DURATION: Spec = Spec {
    name: "idemproxy_request_duration_seconds",
    help: "Time from the request's head being read to the response head being handed to the client, \
           by route and outcome.",
};
const BUSY_REFUSALS: Spec = Spec {
    name: "idemproxy_busy_refusals_total",
    help: "Requests refused 503 busy, by the limit that ran out.",
};
const REPLAYS: Spec = Spec {
    name: "idemproxy_replays_total",
    help: "Requests answered from a stored response.",
};
const CONFLICTS: Spec = Spec {
    name: "idemproxy_conflicts_total",
    help: "Requests refused because their key was in flight.",
};
const MISMATCHES: Spec = Spec {
    name: "idemproxy_mismatches_total",
    help: "Requests refused because their key was used with another payload.",
};
const IN_FLIGHT: Spec = Spec {
    name: "idemproxy_in_flight_requests",
    help: "Requests being handled now.",
};
const UNPROTECTED: Spec = Spec {
    name: "idemproxy_unprotected_requests_total",
    help: "Keyed requests forwarded without protection while the store was down (fail_open).",
};
const REPLAY_CACHE_HITS: Spec = Spec {
    name: "idemproxy_replay_cache_hits_total",
    help: "Keyed requests answered from the in-process replay cache (replays and mismatches), \
           without the store.",
};
// Waiting for a key in flight (`on_in_flight = "wait"`).
const WAITS: Spec = Spec {
    name: "idemproxy_waits_total",
    help: "Requests that found their key in flight on a route with on_in_flight = \"wait\", by how \
           their wait ended.",
};
const WAITING: Spec = Spec {
    name: "idemproxy_waiting_requests",
    help: "Requests waiting now for the original request with their key (server.max_waiting at most).",
};
const WAIT_LISTENER_CONNECTED: Spec = Spec {
    name: "idemproxy_wait_listener_connected",
    help: "1 while this process listens for other replicas' completions on its PostgreSQL or Redis \
           connection for waiting requests, else 0.",
};
const WAIT_LISTENER_RECONNECTS: Spec = Spec {
    name: "idemproxy_wait_listener_reconnects_total",
    help: "Times the connection that listens for other replicas' completions was lost or could not \
           be opened, and a new one was tried.",
};
// Claims.
const STALE_TAKEOVERS: Spec = Spec {
    name: "idemproxy_stale_takeovers_total",
    help: "Claims taken over after the previous claim's lease ran out.",
};
const LOST_CLAIMS: Spec = Spec {
    name: "idemproxy_lost_claims_total",
    help: "Heartbeats, completions and releases refused because the claim was taken over.",
};
const UNKNOWN_OUTCOMES: Spec = Spec {
    name: "idemproxy_unknown_outcomes_total",
    help: "Keyed requests the upstream may have executed without a full answer coming back \
           (timeout, broken connection or body, 101).",
};
const ORPHAN_CLAIMS_RELEASED: Spec = Spec {
    name: "idemproxy_orphan_claims_released_total",
    help: "Claims won after their request stopped waiting for the store, given back by token.",
};
// Responses kept for retries.
const NOT_RETAINED: Spec = Spec {
    name: "idemproxy_responses_not_retained_total",
    help: "Completed requests whose response was over max_stored_response and was not kept.",
};
const CAPTURE_BUDGET_EXHAUSTED: Spec = Spec {
    name: "idemproxy_capture_budget_exhausted_total",
    help: "Responses not retained because server.max_buffered_responses was spent for \
           server.capture_wait.",
};
const CAPTURE_SCOPE_SHARE_EXHAUSTED: Spec = Spec {
    name: "idemproxy_capture_scope_share_exhausted_total",
    help: "Responses not retained because their scope's share of server.max_buffered_responses \
           (server.max_buffered_responses_per_scope) was spent for server.capture_wait.",
};
const CAPTURE_BUDGET_WAITS: Spec = Spec {
    name: "idemproxy_capture_budget_waits_total",
    help: "Keyed responses whose capture waited for room in server.max_buffered_responses or its \
           scope's share, whether or not room came.",
};
const COMPLETION_HOLD_EXPIRED: Spec = Spec {
    name: "idemproxy_completion_hold_expired_total",
    help: "Responses let go to the client before their record was stored, because the store \
           took longer than the hold.",
};
// The store and the upstream.
const STORE_OPENED: Spec = Spec {
    name: "idemproxy_store_opened",
    help: "1 once serve has opened its store (on PostgreSQL with store.migrate: reached and migrated), \
           0 while it is still trying: keyed requests follow store.on_error until then.",
};
const STORE_ERRORS: Spec = Spec {
    name: "idemproxy_store_errors_total",
    help: "Failed store operations by operation.",
};
const STORE_DURATION: Spec = Spec {
    name: "idemproxy_store_duration_seconds",
    help: "Store operation latency.",
};
const UPSTREAM_DURATION: Spec = Spec {
    name: "idemproxy_upstream_duration_seconds",
    help: "Time from forwarding a request to the upstream's response head.",
};
// The proxy listener's limits.
const OPEN_CONNECTIONS: Spec = Spec {
    name: "idemproxy_open_connections",
    help: "Client connections open on the proxy listener.",
};
const CONNECTION_CAP_REACHED: Spec = Spec {
    name: "idemproxy_connection_cap_reached_total",
    help: "Times a new connection found server.max_connections open and waited for a slot, \
           the listener accepting no other meanwhile.",
};
const CONNECTIONS_EVICTED: Spec = Spec {
    name: "idemproxy_connections_evicted_total",
    help: "Idle client connections (no request in progress, or each one waiting on a body its \
           client stalls or trickles) closed to make room for new ones while \
           server.max_connections were open.",
};
const BODY_BUDGET_WAITS: Spec = Spec {
    name: "idemproxy_body_budget_waits_total",
    help: "Keyed request bodies that waited for room in server.max_buffered_bodies.",
};
const WRITE_TIMEOUTS: Spec = Spec {
    name: "idemproxy_write_timeouts_total",
    help: "Clients let go because they accepted no response bytes for server.write_timeout.",
};
const TLS_RELOADS: Spec = Spec {
    name: "idemproxy_tls_reloads_total",
    help: "Changes to the server.tls certificate or key files seen, by whether the new pair was taken \
           (ok) or refused, the old pair kept (error).",
};
const TLS_LAST_RELOAD_SUCCESSFUL: Spec = Spec {
    name: "idemproxy_tls_last_reload_successful",
    help: "0 while the last change seen to the server.tls certificate or key files was refused (the old \
           pair serving), else 1.",
};
// The sweeper.
const EXPIRED_DELETED: Spec = Spec {
    name: "idemproxy_expired_keys_deleted_total",
    help: "Expired records deleted by the sweeper.",
};
const RECORDS: Spec = Spec {
    name: "idemproxy_records",
    help: "Records in the key table by state (processing, completed, failed, unknown, expired), \
           as of the sweeper's last count.",
};
// The process.
const BUILD_INFO: Spec = Spec {
    name: "idemproxy_build_info",
    help: "Always 1; its labels say which build runs.",
};
const CONFIG_RELOADS: Spec = Spec {
    name: "idemproxy_config_reloads_total",
    help: "Times SIGHUP read the configuration again, by whether it was valid (ok) or refused, the running \
           configuration kept (error).",
};
const CONFIG_LAST_RELOAD_SUCCESSFUL: Spec = Spec {
    name: "idemproxy_config_last_reload_successful",
    help: "0 when the configuration read at the last SIGHUP was refused, else 1.",
};
// Webhook signatures.
const SIGNATURE_CHECKS: Spec = Spec {
    name: "idemproxy_signature_checks_total",
    help: "Requests on routes with a signature, by what their signature check found: verified, or \
           refused 401 for a missing or malformed signature, a timestamp outside the tolerance, or no \
           signature matching.",
};
// Encryption.
const UNDECRYPTABLE: Spec = Spec {
    name: "idemproxy_undecryptable_records_total",
    help: "Stored responses refused because they could not be decrypted.",
};

/// Label names, each written once.
mod label {
    /// [`super::Outcome`], on `REQUESTS` and `REQUEST_DURATION`.
    pub const OUTCOME: &str = "outcome";
    /// A route's name, on `REQUESTS`, its aliases and `REQUEST_DURATION`.
    pub const ROUTE: &str = "route";
    /// A [`super::BusyReason`], on `BUSY_REFUSALS`.
    pub const REASON: &str = "reason";
    /// The crate's version, on `BUILD_INFO`.
    pub const VERSION: &str = "version";
    /// `release` or `debug` (built without optimisation), on `BUILD_INFO`.
    pub const PROFILE: &str = "profile";
    /// [`super::StoreOp`], on `STORE_ERRORS` and `STORE_DURATION`.
    pub const OP: &str = "op";
    /// A field of [`super::RecordCounts`], on `RECORDS`.
    pub const STATUS: &str = "status";
    /// `ok` or `error`, on `TLS_RELOADS` and `CONFIG_RELOADS`; a [`super::WaitResult`], on `WAITS`; a
    /// [`super::SignatureCheck`], on `SIGNATURE_CHECKS`.
    pub const RESULT: &str = "result";
}

/// How a request ended, for `idemproxy_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Not a protected request: forwarded as is.
    Passthrough,
    /// Claimed and forwarded to the upstream.
    Executed,
    /// Answered from the stored response.
    Replayed,
    /// Refused: another request holds the key.
    Conflict,
    /// Refused: key reused with another payload.
    Mismatch,
    /// Refused: malformed key, missing key, or body too large.
    Rejected,
    /// The store could not be reached.
    StoreUnavailable,
    /// The upstream could not be reached, broke off, or timed out.
    UpstreamError,
    /// Refused: the key's outcome is unknown and held (`on_unknown_outcome = "hold"`).
    Held,
}

impl Outcome {
    const ALL: [Outcome; 9] = [
        Outcome::Passthrough,
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::Rejected,
        Outcome::StoreUnavailable,
        Outcome::UpstreamError,
        Outcome::Held,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passthrough => "passthrough",
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::Rejected => "rejected",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::UpstreamError => "upstream_error",
            Outcome::Held => "held",
        }
    }
}

/// How a request that waited for the original with its key ended, for `idemproxy_waits_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitResult {
    /// The original completed: answered with its stored response.
    Replayed,
    /// The original was released (or its lease ran out): this request claimed the key and executed it.
    Executed,
    /// Answered otherwise once the original ended: held outcome (502), store unavailable, no slot to
    /// execute in (503), or the key meanwhile used for another request (422).
    Refused,
    /// `wait_timeout` passed with the key still in flight: 409.
    Timeout,
    /// `server.max_waiting` requests were already waiting: 409 at once, without waiting.
    RejectedFull,
    /// The proxy began shutting down: 409 at once.
    Shutdown,
    /// The client went away while waiting.
    ClientGone,
}

impl WaitResult {
    const ALL: [WaitResult; 7] = [
        WaitResult::Replayed,
        WaitResult::Executed,
        WaitResult::Refused,
        WaitResult::Timeout,
        WaitResult::RejectedFull,
        WaitResult::Shutdown,
        WaitResult::ClientGone,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WaitResult::Replayed => "replayed",
            WaitResult::Executed => "executed",
            WaitResult::Refused => "refused",
            WaitResult::Timeout => "timeout",
            WaitResult::RejectedFull => "rejected_full",
            WaitResult::Shutdown => "shutdown",
            WaitResult::ClientGone => "client_gone",
        }
    }
}

/// What a webhook signature check found, for `idemproxy_signature_checks_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureCheck {
    /// A signature matched one of the route's secrets: the request goes on.
    Verified,
    /// A header the scheme needs was absent.
    Missing,
    /// A header was malformed, sent twice, or too long.
    Malformed,
    /// The signed timestamp was further from the proxy's clock than the route's tolerance.
    Timestamp,
    /// No signature matched any secret: a forged, tampered or wrongly configured delivery.
    Mismatch,
}

impl SignatureCheck {
    const ALL: [SignatureCheck; 5] = [
        SignatureCheck::Verified,
        SignatureCheck::Missing,
        SignatureCheck::Malformed,
        SignatureCheck::Timestamp,
        SignatureCheck::Mismatch,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            SignatureCheck::Verified => "verified",
            SignatureCheck::Missing => "missing",
            SignatureCheck::Malformed => "malformed",
            SignatureCheck::Timestamp => "timestamp",
            SignatureCheck::Mismatch => "mismatch",
        }
    }
}

/// Which limit ran out when a request was refused 503 `busy` (`error::Busy`, whose problem detail says
/// so), for `idemproxy_busy_refusals_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyReason {
    /// `server.max_buffered_bodies` stayed spent for `server.body_read_timeout`.
    Bodies,
    /// Reading a JSON body (its key or its fingerprint) needs more working memory than
    /// `server.max_buffered_bodies` has left.
    Parsing,
    /// `server.max_keyed_in_flight` keyed requests are being executed.
    KeyedInFlight,
    /// `server.max_keyed_per_connection` keyed requests of this connection are being executed (some
    /// perhaps detached, their clients gone).
    KeyedOnConnection,
    /// The worker's `upstream.max_connections` stayed busy for `upstream.connect_timeout`.
    UpstreamConnections,
    /// `server.max_connections` are open and this idle connection was closed to make room; the request
    /// arrived just as it was.
    Connections,
}

impl BusyReason {
    const ALL: [BusyReason; 6] = [
        BusyReason::Bodies,
        BusyReason::Parsing,
        BusyReason::KeyedInFlight,
        BusyReason::KeyedOnConnection,
        BusyReason::UpstreamConnections,
        BusyReason::Connections,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            BusyReason::Bodies => "bodies",
            BusyReason::Parsing => "parsing",
            BusyReason::KeyedInFlight => "keyed_in_flight",
            BusyReason::KeyedOnConnection => "keyed_on_connection",
            BusyReason::UpstreamConnections => "upstream_connections",
            BusyReason::Connections => "connections",
        }
    }
}

/// A store operation, for the `op` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    /// The claim statement (and its follow-up read).
    Claim,
    /// Lease extension.
    Heartbeat,
    /// Storing the response.
    Complete,
    /// Releasing a claim after a retryable failure.
    Release,
    /// Holding a claim whose outcome is unknown.
    Hold,
    /// Readiness probe.
    Ping,
    /// Deleting a batch of expired records.
    Sweep,
    /// Looking up records for an operator.
    Find,
    /// Counting records by state.
    Stats,
    /// Telling other replicas that a record on a wait route settled (PostgreSQL `NOTIFY`, Redis `PUBLISH`).
    Notify,
}

impl StoreOp {
    const ALL: [StoreOp; 10] = [
        StoreOp::Claim,
        StoreOp::Heartbeat,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::Hold,
        StoreOp::Ping,
        StoreOp::Sweep,
        StoreOp::Find,
        StoreOp::Stats,
        StoreOp::Notify,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreOp::Claim => "claim",
            StoreOp::Heartbeat => "heartbeat",
            StoreOp::Complete => "complete",
            StoreOp::Release => "release",
            StoreOp::Hold => "hold",
            StoreOp::Ping => "ping",
            StoreOp::Sweep => "sweep",
            StoreOp::Find => "find",
            StoreOp::Stats => "stats",
            StoreOp::Notify => "notify",
        }
    }
}

/// How many records the key table holds by state, for `RECORDS`: the sweeper converts the store's count
/// into this.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Unexpired records being executed.
    pub processing: u64,
    /// Unexpired records with a stored response.
    pub completed: u64,
    /// Unexpired released records.
    pub failed: u64,
    /// Unexpired records held with an unknown outcome.
    pub unknown: u64,
    /// Records past their expiry, waiting for the sweeper.
    pub expired: u64,
}

impl RecordCounts {
    /// Each count under its `status` label value.
    fn by_status(&self) -> [(&'static str, u64); 5] {
        [
            ("processing", self.processing),
            ("completed", self.completed),
            ("failed", self.failed),
            ("unknown", self.unknown),
            ("expired", self.expired),
        ]
    }
}

/// One route's series of `REQUESTS`, its aliases and `REQUEST_DURATION`, resolved once: counting a request
/// then costs no label lookup, no allocation and no lock.
pub struct RouteSeries {
    /// `REQUESTS{route, outcome}`, by [`Outcome`] in declaration order.
    by_outcome: [IntCounter; Outcome::ALL.len()],
    /// `REQUEST_DURATION{route, outcome}`, by [`Outcome`] in declaration order.
    durations: [Histogram; Outcome::ALL.len()],
    /// `REPLAYS{route}`, `CONFLICTS{route}`, `MISMATCHES{route}`.
    replays: IntCounter,
    conflicts: IntCounter,
    mismatches: IntCounter,
}

impl RouteSeries {
    /// Counts a finished request, and its alias if the outcome has one.
    pub fn record(&self, outcome: Outcome) {
        self.by_outcome[outcome as usize].inc();
        if let Some(alias) = self.alias(outcome) {
            alias.inc();
        }
    }

    /// Counts a request whose response head was handed to its client `elapsed` after its head was read.
    pub fn answered(&self, outcome: Outcome, elapsed: Duration) {
        self.record(outcome);
        self.durations[outcome as usize].observe(elapsed.as_secs_f64());
    }

    /// The counter kept for existing dashboards that repeats `REQUESTS` for `outcome`, if any.
    fn alias(&self, outcome: Outcome) -> Option<&IntCounter> {
        match outcome {
            Outcome::Replayed => Some(&self.replays),
            Outcome::Conflict => Some(&self.conflicts),
            Outcome::Mismatch => Some(&self.mismatches),
            Outcome::Passthrough
            | Outcome::Executed
            | Outcome::Rejected
            | Outcome::StoreUnavailable
            | Outcome::UpstreamError
            | Outcome::Held => None,
        }
    }
}

/// Every route's [`RouteSeries`], by route name, and the default route's for any other name.
pub struct RouteSet {
    by_name: foldhash::HashMap<Box<str>, Arc<RouteSeries>>,
    default: Arc<RouteSeries>,
}

impl RouteSet {
    /// The series of the route named `name`: the default route's if no route has that name.
    pub fn get(&self, name: &str) -> &Arc<RouteSeries> {
        self.by_name.get(name).unwrap_or(&self.default)
    }
}

/// The registry and every metric in it; clones share them.
#[derive(Clone)]
pub struct Metrics(Arc<MetricSet>);

impl Deref for Metrics {
    type Target = MetricSet;

    fn deref(&self) -> &MetricSet {
        &self.0
    }
}

/// The metrics themselves, reached through [`Metrics`]. Each field's doc names the `Spec` it is
/// registered from.
pub struct MetricSet {
    registry: Registry,
    /// `REQUESTS`, by `route` and `outcome`; counted through a [`RouteSeries`].
    requests: IntCounterVec,
    /// `REQUEST_DURATION`, by `route` and `outcome`; observed through a [`RouteSeries`].
    request_duration: HistogramVec,
    /// `REPLAYS`, `CONFLICTS`, `MISMATCHES`, by `route`: aliases of `REQUESTS` for [`Outcome::Replayed`],
    /// [`Outcome::Conflict`] and [`Outcome::Mismatch`].
    aliases: [IntCounterVec; 3],
    /// `STALE_TAKEOVERS`
    pub stale_takeovers: IntCounter,
    /// `LOST_CLAIMS`: fenced-out heartbeats, completions and releases.
    pub lost_claims: IntCounter,
    /// `UNPROTECTED`: keyed requests forwarded without a claim (fail_open).
    pub unprotected: IntCounter,
    /// `NOT_RETAINED`: completions whose body was over the storage cap.
    pub not_retained: IntCounter,
    /// `STORE_ERRORS`, by `op`.
    pub store_errors: IntCounterVec,
    /// `STORE_DURATION`, by `op`.
    pub store_duration: HistogramVec,
    /// The series of `store_errors` and `store_duration`, by [`StoreOp`] in declaration order.
    by_op: [(IntCounter, Histogram); StoreOp::ALL.len()],
    /// `UPSTREAM_DURATION`: time to the upstream's response head.
    pub upstream_duration: Histogram,
    /// `IN_FLIGHT`
    pub in_flight: IntGauge,
    /// `EXPIRED_DELETED`: records deleted by the sweeper.
    pub expired_deleted: IntCounter,
    /// `RECORDS`, by `status`: records in the table by state, as of the sweeper's last count. Its series
    /// appear at that first count, not before.
    pub records: IntGaugeVec,
    /// `REPLAY_CACHE_HITS`: keyed requests answered from the replay cache.
    pub replay_cache_hits: IntCounter,
    /// `UNDECRYPTABLE`: stored responses refused because they did not decrypt.
    pub undecryptable: IntCounter,
    /// `OPEN_CONNECTIONS`: client connections open on the proxy listener.
    pub open_connections: IntGauge,
    /// `CONNECTION_CAP_REACHED`: times a new connection on the proxy listener found
    /// `server.max_connections` open and waited for a slot (the listener accepts no other meanwhile).
    pub connection_cap_reached: IntCounter,
    /// `CONNECTIONS_EVICTED`: idle client connections closed to make room for new ones while
    /// `server.max_connections` were open.
    pub connections_evicted: IntCounter,
    /// `BODY_BUDGET_WAITS`: keyed request bodies that waited for room in `server.max_buffered_bodies`.
    pub body_budget_waits: IntCounter,
    /// `UNKNOWN_OUTCOMES`: keyed requests the upstream may have executed without a full answer coming
    /// back.
    pub unknown_outcomes: IntCounter,
    /// `WRITE_TIMEOUTS`: clients let go for accepting no response bytes for `server.write_timeout`.
    pub write_timeouts: IntCounter,
    /// `TLS_RELOADS{result="ok"}`: new listener certificates taken from changed files.
    pub tls_reloads_ok: IntCounter,
    /// `TLS_RELOADS{result="error"}`: changed listener certificate files refused, the old pair kept.
    pub tls_reloads_error: IntCounter,
    /// `CAPTURE_BUDGET_EXHAUSTED`: responses not retained because `server.max_buffered_responses` was
    /// spent for `server.capture_wait`.
    pub capture_budget_exhausted: IntCounter,
    /// `CAPTURE_SCOPE_SHARE_EXHAUSTED`: responses not retained because their scope's share of the
    /// capture budget was spent for `server.capture_wait`.
    pub capture_scope_share_exhausted: IntCounter,
    /// `CAPTURE_BUDGET_WAITS`: keyed responses whose capture waited for room.
    pub capture_budget_waits: IntCounter,
    /// `COMPLETION_HOLD_EXPIRED`: responses let go to the client before their record was stored,
    /// because the store took longer than the hold.
    pub completion_hold_expired: IntCounter,
    /// `ORPHAN_CLAIMS_RELEASED`: claims that a request won after it stopped waiting for the store,
    /// given back by their token.
    pub orphan_claims_released: IntCounter,
    /// The series of `WAITS`, by [`WaitResult`] in declaration order.
    by_wait_result: [IntCounter; WaitResult::ALL.len()],
    /// `WAITING`: requests waiting for the original with their key.
    pub waiting: IntGauge,
    /// `WAIT_LISTENER_CONNECTED`: 1 while the wait listener's connection listens.
    pub wait_listener_connected: IntGauge,
    /// `WAIT_LISTENER_RECONNECTS`: the wait listener's lost or failed connections.
    pub wait_listener_reconnects: IntCounter,
    /// The series of `SIGNATURE_CHECKS`, by [`SignatureCheck`] in declaration order.
    by_signature_check: [IntCounter; SignatureCheck::ALL.len()],
    /// `STORE_OPENED`: 1 once `serve` has opened its store.
    pub store_opened: IntGauge,
    /// The series of `BUSY_REFUSALS`, by [`BusyReason`] in declaration order.
    by_busy_reason: [IntCounter; BusyReason::ALL.len()],
    /// `TLS_LAST_RELOAD_SUCCESSFUL`: 0 while the last certificate change seen was refused.
    pub tls_last_reload_successful: IntGauge,
    /// `CONFIG_RELOADS{result="ok"}`: configurations read again at SIGHUP and found valid.
    pub config_reloads_ok: IntCounter,
    /// `CONFIG_RELOADS{result="error"}`: configurations read again at SIGHUP and refused.
    pub config_reloads_error: IntCounter,
    /// `CONFIG_LAST_RELOAD_SUCCESSFUL`: 0 when the last SIGHUP's configuration was refused.
    pub config_last_reload_successful: IntGauge,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        Metrics(Arc::new(MetricSet::register(Registry::new())))
    }
}

impl MetricSet {
    /// Registers every metric in `registry`, one line each. The store's families exist from the start, so
    /// rates work before the first event; so do the route families, once [`MetricSet::routes`] has
    /// resolved the routes (at start, in `Proxy::new`).
    fn register(registry: Registry) -> MetricSet {
        let r = &registry;
        let route_outcome = [label::ROUTE, label::OUTCOME];
        let requests = counter_vec_with(r, &REQUESTS, &route_outcome);
        let request_duration = register(
            r,
            HistogramVec::new(request_duration_opts(), &route_outcome).expect("valid metric"),
        );
        let aliases = [&REPLAYS, &CONFLICTS, &MISMATCHES].map(|spec| counter_vec(r, spec, label::ROUTE));
        let busy = counter_vec(r, &BUSY_REFUSALS, label::REASON);
        let config_reloads = counter_vec(r, &CONFIG_RELOADS, label::RESULT);
        register_build_info(r);
        process::register(r);
        let store_errors = counter_vec(r, &STORE_ERRORS, label::OP);
        let store_duration = latency_histogram_vec(r, &STORE_DURATION, label::OP);
        let tls_reloads = counter_vec(r, &TLS_RELOADS, label::RESULT);
        let waits = counter_vec(r, &WAITS, label::RESULT);
        let signature_checks = counter_vec(r, &SIGNATURE_CHECKS, label::RESULT);
        MetricSet {
            by_signature_check: SignatureCheck::ALL
                .map(|check| signature_checks.with_label_values(&[check.as_str()])),
            by_wait_result: WaitResult::ALL.map(|result| waits.with_label_values(&[result.as_str()])),
            waiting: gauge(r, &WAITING),
            wait_listener_connected: gauge(r, &WAIT_LISTENER_CONNECTED),
            wait_listener_reconnects: counter(r, &WAIT_LISTENER_RECONNECTS),
            store_opened: gauge(r, &STORE_OPENED),
            tls_reloads_ok: tls_reloads.with_label_values(&["ok"]),
            tls_reloads_error: tls_reloads.with_label_values(&["error"]),
            by_op: StoreOp::ALL.map(|op| op_series(&store_errors, &store_duration, op)),
            by_busy_reason: BusyReason::ALL.map(|reason| busy.with_label_values(&[reason.as_str()])),
            tls_last_reload_successful: gauge_set(r, &TLS_LAST_RELOAD_SUCCESSFUL, 1),
            config_reloads_ok: config_reloads.with_label_values(&["ok"]),
            config_reloads_error: config_reloads.with_label_values(&["error"]),
            config_last_reload_successful: gauge_set(r, &CONFIG_LAST_RELOAD_SUCCESSFUL, 1),
            requests,
            request_duration,
            aliases,
            in_flight: gauge(r, &IN_FLIGHT),
            unprotected: counter(r, &UNPROTECTED),
            replay_cache_hits: counter(r, &REPLAY_CACHE_HITS),
            stale_takeovers: counter(r, &STALE_TAKEOVERS),
            lost_claims: counter(r, &LOST_CLAIMS),
            unknown_outcomes: counter(r, &UNKNOWN_OUTCOMES),
            orphan_claims_released: counter(r, &ORPHAN_CLAIMS_RELEASED),
            not_retained: counter(r, &NOT_RETAINED),
            capture_budget_exhausted: counter(r, &CAPTURE_BUDGET_EXHAUSTED),
            capture_scope_share_exhausted: counter(r, &CAPTURE_SCOPE_SHARE_EXHAUSTED),
            capture_budget_waits: counter(r, &CAPTURE_BUDGET_WAITS),
            completion_hold_expired: counter(r, &COMPLETION_HOLD_EXPIRED),
            store_errors,
            store_duration,
            upstream_duration: latency_histogram(r, &UPSTREAM_DURATION),
            open_connections: gauge(r, &OPEN_CONNECTIONS),
            connection_cap_reached: counter(r, &CONNECTION_CAP_REACHED),
            connections_evicted: counter(r, &CONNECTIONS_EVICTED),
            body_budget_waits: counter(r, &BODY_BUDGET_WAITS),
            write_timeouts: counter(r, &WRITE_TIMEOUTS),
            expired_deleted: counter(r, &EXPIRED_DELETED),
            records: gauge_vec(r, &RECORDS, label::STATUS),
            undecryptable: counter(r, &UNDECRYPTABLE),
            registry,
        }
    }

    /// Resolves the series of every route in `names` and of `default`, the route a request takes when it
    /// is refused before routing or matches no configured route. Called once, at start.
    pub fn routes<'a>(&self, names: impl IntoIterator<Item = &'a str>, default: &str) -> RouteSet {
        let by_name = names
            .into_iter()
            .map(|name| (name.into(), Arc::new(self.route(name))))
            .collect();
        RouteSet {
            by_name,
            default: Arc::new(self.route(default)),
        }
    }

    /// The series of the route named `name`.
    fn route(&self, name: &str) -> RouteSeries {
        let by = |outcome: Outcome| [name, outcome.as_str()];
        let [replays, conflicts, mismatches] = self
            .aliases
            .each_ref()
            .map(|alias| alias.with_label_values(&[name]));
        RouteSeries {
            by_outcome: Outcome::ALL.map(|outcome| self.requests.with_label_values(&by(outcome))),
            durations: Outcome::ALL.map(|outcome| self.request_duration.with_label_values(&by(outcome))),
            replays,
            conflicts,
            mismatches,
        }
    }

    /// Counts a request refused 503 `busy`, by the limit that ran out.
    pub fn busy(&self, reason: BusyReason) {
        self.by_busy_reason[reason as usize].inc();
    }

    /// Counts a request's wait for the original with its key, by how it ended.
    pub fn wait_ended(&self, result: WaitResult) {
        self.by_wait_result[result as usize].inc();
    }

    /// Counts a webhook signature check, by what it found.
    pub fn signature_checked(&self, check: SignatureCheck) {
        self.by_signature_check[check as usize].inc();
    }

    /// Observes one store operation's latency, and counts it if it failed.
    pub fn store_op(&self, op: StoreOp, seconds: f64, ok: bool) {
        let (errors, duration) = &self.by_op[op as usize];
        duration.observe(seconds);
        if !ok {
            errors.inc();
        }
    }

    /// Failed store operations of every kind so far.
    pub fn store_failures(&self) -> u64 {
        self.by_op.iter().map(|(errors, _)| errors.get()).sum()
    }

    /// Publishes a count of the records by state.
    pub fn set_records(&self, counts: &RecordCounts) {
        for (status, count) in counts.by_status() {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            self.records.with_label_values(&[status]).set(count);
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut buffer = Vec::new();
        if let Err(error) = TextEncoder::new().encode(&self.registry.gather(), &mut buffer) {
            tracing::error!(%error, "cannot encode metrics");
        }
        buffer
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Adds `collector` to `registry` and hands it back.
fn register<C: Collector + Clone + 'static>(registry: &Registry, collector: C) -> C {
    registry
        .register(Box::new(collector.clone()))
        .expect("metric names are unique");
    collector
}

fn counter(registry: &Registry, spec: &Spec) -> IntCounter {
    register(
        registry,
        IntCounter::new(spec.name, spec.help).expect("valid metric"),
    )
}

fn gauge(registry: &Registry, spec: &Spec) -> IntGauge {
    register(
        registry,
        IntGauge::new(spec.name, spec.help).expect("valid metric"),
    )
}

fn counter_vec(registry: &Registry, spec: &Spec, label: &str) -> IntCounterVec {
    counter_vec_with(registry, spec, &[label])
}

fn counter_vec_with(registry: &Registry, spec: &Spec, labels: &[&str]) -> IntCounterVec {
    let opts = Opts::new(spec.name, spec.help);
    register(registry, IntCounterVec::new(opts, labels).expect("valid metric"))
}

/// A gauge that starts at `value`.
fn gauge_set(registry: &Registry, spec: &Spec, value: i64) -> IntGauge {
    let gauge = gauge(registry, spec);
    gauge.set(value);
    gauge
}

/// `BUILD_INFO`, its one series set to 1.
fn register_build_info(registry: &Registry) {
    let opts = Opts::new(BUILD_INFO.name, BUILD_INFO.help)
        .const_label(label::VERSION, env!("CARGO_PKG_VERSION"))
        .const_label(
            label::PROFILE,
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
        );
    register(registry, IntGauge::with_opts(opts).expect("valid metric")).set(1);
}

fn gauge_vec(registry: &Registry, spec: &Spec, label: &str) -> IntGaugeVec {
    let opts = Opts::new(spec.name, spec.help);
    register(registry, IntGaugeVec::new(opts, &[label]).expect("valid metric"))
}

fn latency_histogram(registry: &Registry, spec: &Spec) -> Histogram {
    let opts = latency_opts(spec);
    register(registry, Histogram::with_opts(opts).expect("valid metric"))
}

fn latency_histogram_vec(registry: &Registry, spec: &Spec, label: &str) -> HistogramVec {
    let opts = latency_opts(spec);
    register(registry, HistogramVec::new(opts, &[label]).expect("valid metric"))
}

/// Buckets from 0.5 ms doubling to about 16 s, for every latency.
fn latency_opts(spec: &Spec) -> HistogramOpts {
    let buckets = prometheus::exponential_buckets(0.0005, 2.0, 16).expect("static bucket layout is valid");
    HistogramOpts::new(spec.name, spec.help).buckets(buckets)
}

/// Buckets for a whole request, as service level objectives are written ("99 % within 250 ms"):
/// 2.5 ms, the proxy's own work on a replay, to 10 s, beyond which a client has given up.
fn request_duration_opts() -> HistogramOpts {
    let buckets = vec![
        0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    HistogramOpts::new(REQUEST_DURATION.name, REQUEST_DURATION.help).buckets(buckets)
}

/// The store's series for `op`, resolved once.
fn op_series(errors: &IntCounterVec, durations: &HistogramVec, op: StoreOp) -> (IntCounter, Histogram) {
    let op = [op.as_str()];
    (errors.with_label_values(&op), durations.with_label_values(&op))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use prometheus::proto::{MetricFamily, MetricType};

    use super::*;

    /// The metric reference: the table under `## Metrics` in the operations guide.
    const REFERENCE: &str = include_str!("../docs/operations.md");

    /// Every page of the documentation, by path: none may name a metric the proxy does not serve.
    const DOCS: [(&str, &str); 13] = [
        ("README.md", include_str!("../README.md")),
        ("docs/contract.md", include_str!("../docs/contract.md")),
        ("docs/routes.md", include_str!("../docs/routes.md")),
        ("docs/configuration.md", include_str!("../docs/configuration.md")),
        ("docs/stores.md", include_str!("../docs/stores.md")),
        ("docs/security.md", include_str!("../docs/security.md")),
        ("docs/deploying.md", include_str!("../docs/deploying.md")),
        ("docs/development.md", include_str!("../docs/development.md")),
        ("docs/operations.md", REFERENCE),
        ("docs/on-call.md", include_str!("../docs/on-call.md")),
        ("docs/tracing.md", include_str!("../docs/tracing.md")),
        ("docs/kubernetes.md", include_str!("../docs/kubernetes.md")),
        ("docs/LIFECYCLE.md", include_str!("../docs/LIFECYCLE.md")),
    ];

    /// Words the documentation writes with the metric prefix that are not metrics.
    const NOT_METRICS: [&str; 1] = [
        "idemproxy_owner", // the role that owns the schema (docs/operations.md, Database roles)
    ];

    #[test]
    fn every_outcome_and_store_op_is_counted_under_its_own_label() {
        let metrics = Metrics::new();
        let routes = metrics.routes(["payments"], "default");
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                routes.get("payments").record(outcome);
            }
            routes.get("no such route").record(outcome);
        }
        for (n, op) in StoreOp::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.store_op(op, 0.001, false);
            }
        }
        let served = families(&metrics);
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            let requests = &served[REQUESTS.name];
            let by = |route| [(label::ROUTE, route), (label::OUTCOME, outcome.as_str())];
            assert_eq!(
                series_value(requests, &by("payments")),
                (n + 1) as f64,
                "{outcome:?}"
            );
            assert_eq!(series_value(requests, &by("default")), 1.0, "{outcome:?}");
        }
        let text = String::from_utf8(metrics.render()).unwrap();
        for (n, op) in StoreOp::ALL.into_iter().enumerate() {
            let errors = format!("idemproxy_store_errors_total{{op=\"{}\"}} {}", op.as_str(), n + 1);
            let timed = format!(
                "idemproxy_store_duration_seconds_count{{op=\"{}\"}} {}",
                op.as_str(),
                n + 1
            );
            assert!(text.contains(&errors), "{errors} missing from {text}");
            assert!(text.contains(&timed), "{timed} missing from {text}");
        }
    }

    #[test]
    fn an_answered_request_is_timed_under_its_route_and_outcome() {
        let metrics = Metrics::new();
        let routes = metrics.routes(["payments"], "default");
        routes
            .get("payments")
            .answered(Outcome::Replayed, Duration::from_millis(3));
        routes
            .get("payments")
            .answered(Outcome::Executed, Duration::from_millis(300));
        let served = families(&metrics);
        let durations = &served[REQUEST_DURATION.name];
        let histogram = |outcome: Outcome| {
            let by = [(label::ROUTE, "payments"), (label::OUTCOME, outcome.as_str())];
            let series = durations
                .get_metric()
                .iter()
                .find(|s| has_labels(s, &by))
                .unwrap();
            series.get_histogram().clone()
        };
        let replayed = histogram(Outcome::Replayed);
        assert_eq!(replayed.get_sample_count(), 1);
        let within = |h: &prometheus::proto::Histogram, bound: f64| {
            let bucket = h.get_bucket().iter().find(|b| b.upper_bound() == bound).unwrap();
            bucket.cumulative_count()
        };
        assert_eq!((within(&replayed, 0.0025), within(&replayed, 0.005)), (0, 1));
        let executed = histogram(Outcome::Executed);
        assert_eq!((within(&executed, 0.25), within(&executed, 0.5)), (0, 1));
        assert_eq!(histogram(Outcome::Conflict).get_sample_count(), 0);
        let requests = &served[REQUESTS.name];
        let replays = [(label::ROUTE, "payments"), (label::OUTCOME, "replayed")];
        assert_eq!(series_value(requests, &replays), 1.0, "answered also counts");
    }

    #[test]
    fn build_info_is_one_with_the_crate_version() {
        let text = String::from_utf8(Metrics::new().render()).unwrap();
        let line = text
            .lines()
            .find(|line| line.starts_with("idemproxy_build_info{"))
            .expect("build_info is served");
        assert!(line.ends_with("} 1"), "{line}");
        let version = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
        assert!(line.contains(&version), "{line}");
        assert!(
            line.contains("profile=\"debug\""),
            "tests build without optimisation: {line}"
        );
    }

    #[test]
    fn every_busy_reason_is_counted_under_its_own_label() {
        let metrics = Metrics::new();
        for (n, reason) in BusyReason::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.busy(reason);
            }
        }
        let served = families(&metrics);
        for (n, reason) in BusyReason::ALL.into_iter().enumerate() {
            let by = [(label::REASON, reason.as_str())];
            assert_eq!(series_value(&served[BUSY_REFUSALS.name], &by), (n + 1) as f64);
        }
    }

    #[test]
    fn every_wait_result_is_counted_under_its_own_label() {
        let metrics = Metrics::new();
        for (n, result) in WaitResult::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.wait_ended(result);
            }
        }
        let text = String::from_utf8(metrics.render()).unwrap();
        for (n, result) in WaitResult::ALL.into_iter().enumerate() {
            let line = format!(
                "idemproxy_waits_total{{result=\"{}\"}} {}",
                result.as_str(),
                n + 1
            );
            assert!(text.contains(&line), "{line} missing from {text}");
        }
    }

    #[test]
    fn every_signature_check_is_counted_under_its_own_label() {
        let metrics = Metrics::new();
        for (n, check) in SignatureCheck::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.signature_checked(check);
            }
        }
        let text = String::from_utf8(metrics.render()).unwrap();
        for (n, check) in SignatureCheck::ALL.into_iter().enumerate() {
            let line = format!(
                "idemproxy_signature_checks_total{{result=\"{}\"}} {}",
                check.as_str(),
                n + 1
            );
            assert!(text.contains(&line), "{line} missing from {text}");
        }
    }

    #[test]
    fn each_alias_equals_its_outcome_series() {
        let metrics = Metrics::new();
        let routes = metrics.routes(["payments"], "default");
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                routes.get("payments").record(outcome);
            }
        }
        let served = families(&metrics);
        let aliases = [
            (REPLAYS.name, Outcome::Replayed),
            (CONFLICTS.name, Outcome::Conflict),
            (MISMATCHES.name, Outcome::Mismatch),
        ];
        for (alias, outcome) in aliases {
            let by = [(label::ROUTE, "payments"), (label::OUTCOME, outcome.as_str())];
            let by_outcome = series_value(&served[REQUESTS.name], &by);
            assert!(by_outcome > 0.0);
            let route = [(label::ROUTE, "payments")];
            assert_eq!(series_value(&served[alias], &route), by_outcome, "{alias}");
        }
        let series = routes.get("payments");
        let with_alias = Outcome::ALL
            .iter()
            .filter(|outcome| series.alias(**outcome).is_some());
        assert_eq!(with_alias.count(), aliases.len());
    }

    #[test]
    fn every_name_follows_the_naming_rule() {
        for (name, family) in served() {
            if PROCESS_FAMILIES.contains(&name.as_str()) {
                continue;
            }
            let words = name.strip_prefix("idemproxy_");
            assert!(
                words.is_some_and(is_snake_case),
                "{name}: idemproxy_ and snake_case"
            );
            for reserved in ["_count", "_sum", "_bucket"] {
                assert!(!name.ends_with(reserved), "{name}: ends in {reserved}");
            }
            let total = name.ends_with("_total");
            match family.get_field_type() {
                MetricType::COUNTER => assert!(total, "{name}: a counter ends in _total"),
                MetricType::GAUGE => assert!(!total, "{name}: a gauge does not end in _total"),
                MetricType::HISTOGRAM => assert!(
                    name.ends_with("_seconds") || name.ends_with("_bytes"),
                    "{name}: a histogram ends in its base unit"
                ),
                other => panic!("{name}: {other:?} is not a type idemproxy uses"),
            }
            for label in label_names(&family) {
                assert!(
                    [
                        label::OUTCOME,
                        label::OP,
                        label::STATUS,
                        label::RESULT,
                        label::ROUTE,
                        label::REASON,
                        label::VERSION,
                        label::PROFILE
                    ]
                    .contains(&label),
                    "{name}: {label}"
                );
            }
        }
    }

    /// Why [`served`] counts the records and resolves a route first: a labelled family with no series yet
    /// is left out of the exposition; the route families get theirs when the proxy resolves its routes at
    /// start, and every other labelled family resolves its series at registration.
    #[test]
    fn only_the_record_counts_and_route_families_are_absent_before_the_first_count() {
        let fresh = families(&Metrics::new());
        let absent: BTreeSet<String> = served()
            .into_keys()
            .filter(|name| !fresh.contains_key(name))
            .collect();
        let expected = [
            RECORDS.name,
            REQUESTS.name,
            REQUEST_DURATION.name,
            REPLAYS.name,
            CONFLICTS.name,
            MISMATCHES.name,
        ];
        assert_eq!(absent, expected.map(String::from).into());
    }

    #[test]
    fn the_process_families_are_served_under_their_standard_names() {
        let served = served();
        for name in PROCESS_FAMILIES {
            assert!(served.contains_key(name), "{name}");
        }
    }

    #[test]
    fn the_metric_reference_lists_exactly_the_served_families() {
        let served = served();
        let reference = reference();
        let unlisted: Vec<&String> = served
            .keys()
            .filter(|name| !reference.contains_key(name.as_str()))
            .collect();
        let not_served: Vec<&&str> = reference
            .keys()
            .filter(|name| !served.contains_key(**name))
            .collect();
        assert!(
            unlisted.is_empty(),
            "served but not in the reference (docs/operations.md): {unlisted:?}"
        );
        assert!(
            not_served.is_empty(),
            "in the reference (docs/operations.md) but not served: {not_served:?}"
        );
        for (name, row) in reference {
            let family = &served[name];
            assert_eq!(row.kind, kind(family), "{name}: type");
            assert_eq!(row.labels, label_names(family), "{name}: label names");
            for value in label_values(family) {
                assert!(
                    row.text.contains(&format!("`{value}`")),
                    "{name}: the reference omits `{value}`"
                );
            }
        }
    }

    #[test]
    fn the_docs_mention_no_metric_that_is_not_served() {
        let served = served();
        for (page, text) in DOCS {
            for mention in text.split("idemproxy_").skip(1) {
                let word: String = mention
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                let name = format!("idemproxy_{word}");
                if word.is_empty() || NOT_METRICS.contains(&name.as_str()) {
                    continue; // the prefix alone, as in a grep pattern, or a role's name
                }
                let family = ["_bucket", "_count", "_sum"]
                    .into_iter()
                    .filter_map(|series| name.strip_suffix(series))
                    .find(|base| served.contains_key(*base))
                    .unwrap_or(&name);
                assert!(
                    served.contains_key(family),
                    "{page} mentions {name}, which is not served"
                );
            }
        }
    }

    /// A row of the metric reference.
    #[derive(Debug)]
    struct Row {
        kind: &'static str,
        labels: BTreeSet<&'static str>,
        text: &'static str,
    }

    /// The table in the `## Metrics` section of docs/operations.md, by metric name.
    fn reference() -> BTreeMap<&'static str, Row> {
        let section = REFERENCE
            .split("\n## Metrics\n")
            .nth(1)
            .expect("docs/operations.md has a ## Metrics section");
        // The section ends at the next heading (the access log has a table of its own, elsewhere).
        let section = section.split("\n#").next().unwrap_or(section);
        section.lines().filter_map(reference_row).collect()
    }

    /// `| `name{label}` | type | meaning | normal | when it moves |`; the header and the rule under it have
    /// no backtick.
    fn reference_row(line: &'static str) -> Option<(&'static str, Row)> {
        let mut cells = line.strip_prefix("| `")?.splitn(3, '|');
        let metric = cells.next()?.trim().strip_suffix('`')?;
        let (name, labels) = metric.split_once('{').unwrap_or((metric, "}"));
        let labels = labels.trim_end_matches('}').split(',');
        let row = Row {
            kind: cells.next()?.trim(),
            labels: labels.filter(|label| !label.is_empty()).collect(),
            text: cells.next()?,
        };
        Some((name, row))
    }

    /// The standard process families, which keep their names without the `idemproxy_` prefix.
    const PROCESS_FAMILIES: [&str; 7] = [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_threads",
        "process_start_time_seconds",
    ];

    /// Every family a running proxy can serve, by name, each labelled one with at least one series.
    fn served() -> BTreeMap<String, MetricFamily> {
        let metrics = Metrics::new();
        metrics.set_records(&RecordCounts::default());
        let _routes = metrics.routes([], "default");
        families(&metrics)
    }

    fn families(metrics: &Metrics) -> BTreeMap<String, MetricFamily> {
        let gathered = metrics.registry.gather().into_iter();
        gathered
            .map(|family| (family.name().to_owned(), family))
            .collect()
    }

    fn kind(family: &MetricFamily) -> &'static str {
        match family.get_field_type() {
            MetricType::COUNTER => "counter",
            MetricType::GAUGE => "gauge",
            MetricType::HISTOGRAM => "histogram",
            other => panic!("{other:?} is not a type idemproxy uses"),
        }
    }

    fn label_names(family: &MetricFamily) -> BTreeSet<&str> {
        let labels = family.get_metric().iter().flat_map(|series| series.get_label());
        labels.map(|label| label.name()).collect()
    }

    /// The values of every label but `version`, which changes with each release.
    fn label_values(family: &MetricFamily) -> BTreeSet<&str> {
        let labels = family.get_metric().iter().flat_map(|series| series.get_label());
        let labels = labels.filter(|label| label.name() != label::VERSION);
        labels.map(|label| label.value()).collect()
    }

    /// The counter series with exactly these labels.
    fn series_value(family: &MetricFamily, labels: &[(&str, &str)]) -> f64 {
        let series = family
            .get_metric()
            .iter()
            .find(|series| has_labels(series, labels))
            .expect("the series exists");
        series.get_counter().get_value()
    }

    fn has_labels(series: &prometheus::proto::Metric, labels: &[(&str, &str)]) -> bool {
        let pairs = series.get_label();
        pairs.len() == labels.len()
            && labels
                .iter()
                .all(|(name, value)| pairs.iter().any(|p| p.name() == *name && p.value() == *value))
    }

    fn is_snake_case(words: &str) -> bool {
        let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
        words.chars().all(allowed)
            && !words.starts_with('_')
            && !words.ends_with('_')
            && !words.contains("__")
    }
}
