//! Every metric idemproxy exports, by name, in this one file. A [`Metrics`] owns its own registry (never the
//! global one) and is created once in `run()` and passed down. It depends on nothing else in the crate:
//! callers count in its terms ([`Outcome`], [`StoreOp`], [`RecordCounts`]). Labels come from small fixed
//! sets only: never keys, paths or error text.

use std::ops::Deref;
use std::sync::Arc;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

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
}

impl StoreOp {
    const ALL: [StoreOp; 9] = [
        StoreOp::Claim,
        StoreOp::Heartbeat,
        StoreOp::Complete,
        StoreOp::Release,
        StoreOp::Hold,
        StoreOp::Ping,
        StoreOp::Sweep,
        StoreOp::Find,
        StoreOp::Stats,
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
        }
    }
}

/// How many records the key table holds by state, for `idemproxy_records{status}`: the sweeper converts
/// the store's count into this.
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

/// The registry and every metric in it; clones share them.
#[derive(Clone)]
pub struct Metrics(Arc<MetricSet>);

impl Deref for Metrics {
    type Target = MetricSet;

    fn deref(&self) -> &MetricSet {
        &self.0
    }
}

/// The metrics themselves, reached through [`Metrics`].
pub struct MetricSet {
    registry: Registry,
    /// `idemproxy_requests_total{outcome}`
    pub requests: IntCounterVec,
    /// Its series, by [`Outcome`] in declaration order, resolved once: counting a request then costs
    /// no label lookup.
    by_outcome: [IntCounter; Outcome::ALL.len()],
    /// `idemproxy_replays_total`
    pub replays: IntCounter,
    /// `idemproxy_conflicts_total`
    pub conflicts: IntCounter,
    /// `idemproxy_stale_takeovers_total`
    pub stale_takeovers: IntCounter,
    /// `idemproxy_mismatches_total`
    pub mismatches: IntCounter,
    /// `idemproxy_lost_claims_total`: fenced-out heartbeats, completions and releases.
    pub lost_claims: IntCounter,
    /// `idemproxy_unprotected_requests_total`: keyed requests forwarded without a claim (fail_open).
    pub unprotected: IntCounter,
    /// `idemproxy_responses_not_retained_total`: completions whose body was over the storage cap.
    pub not_retained: IntCounter,
    /// `idemproxy_store_errors_total{op}`
    pub store_errors: IntCounterVec,
    /// `idemproxy_store_duration_seconds{op}`
    pub store_duration: HistogramVec,
    /// The series of `store_errors` and `store_duration`, by [`StoreOp`] in declaration order.
    by_op: [(IntCounter, Histogram); StoreOp::ALL.len()],
    /// `idemproxy_upstream_duration_seconds`: time to the upstream's response head.
    pub upstream_duration: Histogram,
    /// `idemproxy_in_flight_requests`
    pub in_flight: IntGauge,
    /// `idemproxy_expired_keys_deleted_total`: records deleted by the sweeper.
    pub expired_deleted: IntCounter,
    /// `idemproxy_records{status}`: records in the table by state, as of the sweeper's last count.
    pub records: IntGaugeVec,
    /// `idemproxy_replay_cache_hits_total`: keyed requests answered from the replay cache.
    pub replay_cache_hits: IntCounter,
    /// `idemproxy_undecryptable_records_total`: stored responses refused because they did not decrypt.
    pub undecryptable: IntCounter,
    /// `idemproxy_open_connections`: client connections open on the proxy listener.
    pub open_connections: IntGauge,
    /// `idemproxy_connection_cap_reached_total`: times a new connection on the proxy listener found
    /// `server.max_connections` open and waited for a slot (the listener accepts no other meanwhile).
    pub connection_cap_reached: IntCounter,
    /// `idemproxy_connections_evicted_total`: idle client connections closed to make room for new ones
    /// while `server.max_connections` were open.
    pub connections_evicted: IntCounter,
    /// `idemproxy_body_budget_waits_total`: keyed request bodies that waited for room in
    /// `server.max_buffered_bodies`.
    pub body_budget_waits: IntCounter,
    /// `idemproxy_unknown_outcomes_total`: keyed requests the upstream may have executed without a full
    /// answer coming back.
    pub unknown_outcomes: IntCounter,
    /// `idemproxy_write_timeouts_total`: clients let go for accepting no response bytes for
    /// `server.write_timeout`.
    pub write_timeouts: IntCounter,
    /// `idemproxy_capture_budget_exhausted_total`: responses not retained because
    /// `server.max_buffered_responses` was spent.
    pub capture_budget_exhausted: IntCounter,
    /// `idemproxy_completion_hold_expired_total`: responses let go to the client before their record was
    /// stored, because the store took longer than the hold.
    pub completion_hold_expired: IntCounter,
    /// `idemproxy_orphan_claims_released_total`: claims that a request won after it stopped waiting for
    /// the store, given back by their token.
    pub orphan_claims_released: IntCounter,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let latency =
            prometheus::exponential_buckets(0.0005, 2.0, 16).expect("static bucket layout is valid");
        let requests = IntCounterVec::new(
            Opts::new("idemproxy_requests_total", "Requests by how they ended."),
            &["outcome"],
        )
        .expect("valid metric");
        let store_errors = IntCounterVec::new(
            Opts::new(
                "idemproxy_store_errors_total",
                "Failed store operations by operation.",
            ),
            &["op"],
        )
        .expect("valid metric");
        let store_duration = HistogramVec::new(
            HistogramOpts::new("idemproxy_store_duration_seconds", "Store operation latency.")
                .buckets(latency.clone()),
            &["op"],
        )
        .expect("valid metric");
        // Every labelled series exists from the start, so rates work before the first event.
        let by_outcome = Outcome::ALL.map(|outcome| requests.with_label_values(&[outcome.as_str()]));
        let by_op = StoreOp::ALL.map(|op| {
            (
                store_errors.with_label_values(&[op.as_str()]),
                store_duration.with_label_values(&[op.as_str()]),
            )
        });
        let set = MetricSet {
            requests,
            by_outcome,
            replays: counter(
                "idemproxy_replays_total",
                "Requests answered from a stored response.",
            ),
            conflicts: counter(
                "idemproxy_conflicts_total",
                "Requests refused because their key was in flight.",
            ),
            stale_takeovers: counter(
                "idemproxy_stale_takeovers_total",
                "Claims taken over after the previous claim's lease ran out.",
            ),
            mismatches: counter(
                "idemproxy_mismatches_total",
                "Requests refused because their key was used with another payload.",
            ),
            lost_claims: counter(
                "idemproxy_lost_claims_total",
                "Heartbeats, completions and releases refused because the claim was taken over.",
            ),
            unprotected: counter(
                "idemproxy_unprotected_requests_total",
                "Keyed requests forwarded without protection while the store was down (fail_open).",
            ),
            not_retained: counter(
                "idemproxy_responses_not_retained_total",
                "Completed requests whose response was over max_stored_response and was not kept.",
            ),
            store_errors,
            store_duration,
            by_op,
            upstream_duration: Histogram::with_opts(
                HistogramOpts::new(
                    "idemproxy_upstream_duration_seconds",
                    "Time from forwarding a request to the upstream's response head.",
                )
                .buckets(latency),
            )
            .expect("valid metric"),
            in_flight: IntGauge::new("idemproxy_in_flight_requests", "Requests being handled now.")
                .expect("valid metric"),
            expired_deleted: counter(
                "idemproxy_expired_keys_deleted_total",
                "Expired records deleted by the sweeper.",
            ),
            records: IntGaugeVec::new(
                Opts::new(
                    "idemproxy_records",
                    "Records in the key table by state (processing, completed, failed, expired), \
                     as of the sweeper's last count.",
                ),
                &["status"],
            )
            .expect("valid metric"),
            replay_cache_hits: counter(
                "idemproxy_replay_cache_hits_total",
                "Keyed requests answered from the in-process replay cache (replays and mismatches), without the store.",
            ),
            undecryptable: counter(
                "idemproxy_undecryptable_records_total",
                "Stored responses refused because they could not be decrypted.",
            ),
            open_connections: IntGauge::new(
                "idemproxy_open_connections",
                "Client connections open on the proxy listener.",
            )
            .expect("valid metric"),
            connection_cap_reached: counter(
                "idemproxy_connection_cap_reached_total",
                "Times a new connection found server.max_connections open and waited for a slot, \
                 the listener accepting no other meanwhile.",
            ),
            connections_evicted: counter(
                "idemproxy_connections_evicted_total",
                "Idle client connections closed to make room for new ones while server.max_connections were open.",
            ),
            body_budget_waits: counter(
                "idemproxy_body_budget_waits_total",
                "Keyed request bodies that waited for room in server.max_buffered_bodies.",
            ),
            unknown_outcomes: counter(
                "idemproxy_unknown_outcomes_total",
                "Keyed requests the upstream may have executed without a full answer coming back \
                 (timeout, broken connection or body, 101).",
            ),
            write_timeouts: counter(
                "idemproxy_write_timeouts_total",
                "Clients let go because they accepted no response bytes for server.write_timeout.",
            ),
            capture_budget_exhausted: counter(
                "idemproxy_capture_budget_exhausted_total",
                "Responses not retained because server.max_buffered_responses was spent.",
            ),
            completion_hold_expired: counter(
                "idemproxy_completion_hold_expired_total",
                "Responses let go to the client before their record was stored, because the store \
                 took longer than the hold.",
            ),
            orphan_claims_released: counter(
                "idemproxy_orphan_claims_released_total",
                "Claims won after their request stopped waiting for the store, given back by token.",
            ),
            registry,
        };
        set.register_all();
        Metrics(Arc::new(set))
    }
}

impl MetricSet {
    fn register_all(&self) {
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(self.requests.clone()),
            Box::new(self.replays.clone()),
            Box::new(self.conflicts.clone()),
            Box::new(self.stale_takeovers.clone()),
            Box::new(self.mismatches.clone()),
            Box::new(self.lost_claims.clone()),
            Box::new(self.unprotected.clone()),
            Box::new(self.not_retained.clone()),
            Box::new(self.store_errors.clone()),
            Box::new(self.store_duration.clone()),
            Box::new(self.upstream_duration.clone()),
            Box::new(self.in_flight.clone()),
            Box::new(self.expired_deleted.clone()),
            Box::new(self.records.clone()),
            Box::new(self.replay_cache_hits.clone()),
            Box::new(self.undecryptable.clone()),
            Box::new(self.open_connections.clone()),
            Box::new(self.connection_cap_reached.clone()),
            Box::new(self.connections_evicted.clone()),
            Box::new(self.body_budget_waits.clone()),
            Box::new(self.unknown_outcomes.clone()),
            Box::new(self.write_timeouts.clone()),
            Box::new(self.capture_budget_exhausted.clone()),
            Box::new(self.completion_hold_expired.clone()),
            Box::new(self.orphan_claims_released.clone()),
        ];
        for collector in collectors {
            self.registry
                .register(collector)
                .expect("metric names are unique");
        }
    }

    /// Counts a finished request.
    pub fn record(&self, outcome: Outcome) {
        self.by_outcome[outcome as usize].inc();
        match outcome {
            Outcome::Replayed => self.replays.inc(),
            Outcome::Conflict => self.conflicts.inc(),
            Outcome::Mismatch => self.mismatches.inc(),
            _ => {}
        }
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

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("valid metric")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_and_store_op_is_counted_under_its_own_label() {
        let metrics = Metrics::new();
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.record(outcome);
            }
        }
        for (n, op) in StoreOp::ALL.into_iter().enumerate() {
            for _ in 0..=n {
                metrics.store_op(op, 0.001, false);
            }
        }
        let text = String::from_utf8(metrics.render()).unwrap();
        for (n, outcome) in Outcome::ALL.into_iter().enumerate() {
            let line = format!(
                "idemproxy_requests_total{{outcome=\"{}\"}} {}",
                outcome.as_str(),
                n + 1
            );
            assert!(text.contains(&line), "{line} missing from {text}");
        }
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
    fn replay_counts_in_both_series() {
        let metrics = Metrics::new();
        metrics.record(Outcome::Replayed);
        let text = String::from_utf8(metrics.render()).unwrap();
        assert!(text.contains("idemproxy_replays_total 1"), "{text}");
        assert!(
            text.contains("idemproxy_requests_total{outcome=\"replayed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("idemproxy_requests_total{outcome=\"conflict\"} 0"),
            "{text}"
        );
    }
}
