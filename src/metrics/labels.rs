//! The label values: the small fixed sets each labelled family's values come from, one enum per label,
//! each value's text written once in its `as_str`. Callers count in these terms; `metrics.rs` resolves
//! one series per value at start. Touches nothing.

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
    pub(super) const ALL: [Outcome; 9] = [
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
    /// The original's response was being relayed here: this request followed it (`on_in_flight =
    /// "attach"`).
    Attached,
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
    pub(super) const ALL: [WaitResult; 8] = [
        WaitResult::Replayed,
        WaitResult::Executed,
        WaitResult::Attached,
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
            WaitResult::Attached => "attached",
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
    pub(super) const ALL: [SignatureCheck; 5] = [
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
    pub(super) const ALL: [BusyReason; 6] = [
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
    pub(super) const ALL: [StoreOp; 10] = [
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

/// How many records the key table holds by state, for `idemproxy_records`: the sweeper converts the
/// store's count into this.
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
    pub(super) fn by_status(&self) -> [(&'static str, u64); 5] {
        [
            ("processing", self.processing),
            ("completed", self.completed),
            ("failed", self.failed),
            ("unknown", self.unknown),
            ("expired", self.expired),
        ]
    }
}
