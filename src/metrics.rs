//! Every metric idemproxy exports, by name, in this one file. A [`Metrics`] is created once in `run()`
//! and passed down; it owns its own registry (never the global one), which `admin.rs` renders on
//! `/metrics`. This module depends on nothing else in the crate: callers count in its terms
//! ([`Outcome`], [`StoreOp`], [`RecordCounts`]).
//!
//! Each metric is written once, as a row of the [`MetricSet`] table below: its field, its name and help
//! text, and how it is built (`register.rs` makes each row a documented field and its registration).
//! Every name follows one rule (Prometheus's conventions, checked by a test over every registered
//! family): `idemproxy_` and then snake_case words for what is measured; a counter ends in `_total`; a
//! histogram ends in its base unit (`_seconds`, `_bytes`); a gauge that counts things has no suffix; no
//! name ends in `_count`, `_sum` or `_bucket`, which the exposition adds to histograms. Label names are
//! the constants in `label`; their values come from small fixed sets only (`labels.rs`): never keys,
//! paths or error text.
//!
//! `idemproxy_replays_total`, `idemproxy_conflicts_total` and `idemproxy_mismatches_total` are aliases
//! kept for existing dashboards: each equals `idemproxy_requests_total` with its outcome, because
//! [`RouteSeries::record`] counts both.
//!
//! The `route` label is on what a request's route decides, and only that: `idemproxy_requests_total`,
//! its three aliases and `idemproxy_request_duration_seconds`. Its values are the configured route names
//! and `default`, so they are as many as the configuration has routes; each route's series are resolved
//! once, at start ([`MetricSet::routes`], in `routes.rs`), and a request finds them by its route's name
//! in a [`RouteSet`]. What the route does not decide has no `route`: the store's and the upstream's
//! latency (one store, one upstream for every route), connections, budgets and limits (shared by every
//! route), the sweeper and the record counts (over the whole table).
//!
//! The `process_*` families are the standard ones every Prometheus client exports under those names
//! (`process.rs` beside this file reads them from `/proc` at each scrape); they keep their standard
//! names, without the `idemproxy_` prefix.

mod labels;
mod process;
mod register;
mod routes;

use std::ops::Deref;
use std::sync::Arc;

use prometheus::{
    Encoder, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry, TextEncoder,
};

pub use labels::{BusyReason, Outcome, RecordCounts, SignatureCheck, StoreOp, WaitResult};
pub use register::Reloads;
use register::{
    build_info, counter, counter_vec, counters_by, families, gauge, gauge_at, gauge_vec, histogram,
    histogram_vec, histograms_by, latency_buckets, reloads, request_buckets,
};
pub use routes::{RouteSeries, RouteSet};

/// Label names, each written once; each says which rows of [`MetricSet`] carry it.
mod label {
    /// [`super::Outcome`], on `requests` and `request_duration`.
    pub const OUTCOME: &str = "outcome";
    /// A route's name, on `requests`, its aliases, `request_duration` and `grpc_calls`.
    pub const ROUTE: &str = "route";
    /// A gRPC status code's name, on `grpc_calls`.
    pub const CODE: &str = "code";
    /// A [`super::BusyReason`], on `busy_refusals`.
    pub const REASON: &str = "reason";
    /// The crate's version, on `build_info`.
    pub const VERSION: &str = "version";
    /// `release` or `debug` (built without optimisation), on `build_info`.
    pub const PROFILE: &str = "profile";
    /// [`super::StoreOp`], on `store_errors` and `store_duration`.
    pub const OP: &str = "op";
    /// A field of [`super::RecordCounts`], on `records`.
    pub const STATUS: &str = "status";
    /// `ok` or `error`, on `tls_reloads` and `config_reloads`; a [`super::WaitResult`], on `waits`; a
    /// [`super::SignatureCheck`], on `signature_checks`.
    pub const RESULT: &str = "result";
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

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        process::register(&registry);
        Metrics(Arc::new(MetricSet::register(registry)))
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

families! {
    /// The metrics themselves, reached through [`Metrics`]: one row per family.
    /// The store's families exist from the start, so rates work before the first event; so do the route
    /// families, once [`MetricSet::routes`] has resolved the routes (at start, in `Proxy::new`). A family
    /// with a label set resolved at start is a private array by that label's values, counted through a
    /// method ([`MetricSet::busy`], [`MetricSet::wait_ended`], [`MetricSet::signature_checked`],
    /// [`MetricSet::store_op`]).
    pub struct MetricSet {
        // Requests.
        /// Counted through a [`RouteSeries`].
        requests: IntCounterVec = counter_vec(
            "idemproxy_requests_total",
            "Requests by how they ended.",
            &[label::ROUTE, label::OUTCOME],
        ),
        /// Observed through a [`RouteSeries`].
        request_duration: HistogramVec = histogram_vec(
            "idemproxy_request_duration_seconds",
            "Time from the request's head being read to the response head being handed to the client, \
            by route and outcome.",
            &[label::ROUTE, label::OUTCOME],
            request_buckets(),
        ),
        busy_refusals: [IntCounter; BusyReason::ALL.len()] = counters_by(
            "idemproxy_busy_refusals_total",
            "Requests refused 503 busy, by the limit that ran out.",
            label::REASON,
            BusyReason::ALL.map(BusyReason::as_str),
        ),
        /// An alias of `idemproxy_requests_total` for [`Outcome::Replayed`], counted through a
        /// [`RouteSeries`].
        replays: IntCounterVec = counter_vec(
            "idemproxy_replays_total",
            "Requests answered from a stored response.",
            &[label::ROUTE],
        ),
        /// An alias of `idemproxy_requests_total` for [`Outcome::Conflict`], counted through a
        /// [`RouteSeries`].
        conflicts: IntCounterVec = counter_vec(
            "idemproxy_conflicts_total",
            "Requests refused because their key was in flight.",
            &[label::ROUTE],
        ),
        /// An alias of `idemproxy_requests_total` for [`Outcome::Mismatch`], counted through a
        /// [`RouteSeries`].
        mismatches: IntCounterVec = counter_vec(
            "idemproxy_mismatches_total",
            "Requests refused because their key was used with another payload.",
            &[label::ROUTE],
        ),
        /// Counted through a [`RouteSeries`].
        grpc_calls: IntCounterVec = counter_vec(
            "idemproxy_grpc_calls_total",
            "gRPC calls by route and the grpc-status their client got (NONE: the answer ended without one).",
            &[label::ROUTE, label::CODE],
        ),
        pub in_flight: IntGauge = gauge("idemproxy_in_flight_requests", "Requests being handled now."),
        pub unprotected: IntCounter = counter(
            "idemproxy_unprotected_requests_total",
            "Keyed requests forwarded without protection while the store was down (fail_open).",
        ),
        pub replay_cache_hits: IntCounter = counter(
            "idemproxy_replay_cache_hits_total",
            "Keyed requests answered from the in-process replay cache (replays and mismatches), \
            without the store.",
        ),
        // Waiting for a key in flight (`on_in_flight = "wait"`).
        waits: [IntCounter; WaitResult::ALL.len()] = counters_by(
            "idemproxy_waits_total",
            "Requests that found their key in flight on a route with on_in_flight = \"wait\" or \
            \"attach\", by how their wait ended.",
            label::RESULT,
            WaitResult::ALL.map(WaitResult::as_str),
        ),
        pub waiting: IntGauge = gauge(
            "idemproxy_waiting_requests",
            "Requests waiting now for the original request with their key (server.max_waiting at most).",
        ),
        pub attached: IntGauge = gauge(
            "idemproxy_attached_requests",
            "Duplicates following now the live response of the original request with their key \
            (on_in_flight = \"attach\"); they count against server.max_waiting.",
        ),
        pub attach_cutoffs: IntCounter = counter(
            "idemproxy_attach_cutoffs_total",
            "Duplicates cut off because they fell behind the live response they followed by more than \
            server.attach_buffer.",
        ),
        pub attach_write_timeouts: IntCounter = counter(
            "idemproxy_attach_write_timeouts_total",
            "Duplicates cut off because they took none of the live response they followed for \
            server.write_timeout while it had bytes (or its end) ready for them, or were still reading it \
            server.write_timeout after it ended.",
        ),
        pub wait_listener_connected: IntGauge = gauge(
            "idemproxy_wait_listener_connected",
            "1 while this process listens for other replicas' completions on its PostgreSQL or Redis \
            connection for waiting requests, else 0.",
        ),
        pub wait_listener_reconnects: IntCounter = counter(
            "idemproxy_wait_listener_reconnects_total",
            "Times the connection that listens for other replicas' completions was lost or could not \
            be opened, and a new one was tried.",
        ),
        // Claims.
        pub stale_takeovers: IntCounter = counter(
            "idemproxy_stale_takeovers_total",
            "Claims taken over after the previous claim's lease ran out.",
        ),
        pub lost_claims: IntCounter = counter(
            "idemproxy_lost_claims_total",
            "Heartbeats, completions and releases refused because the claim was taken over.",
        ),
        pub unknown_outcomes: IntCounter = counter(
            "idemproxy_unknown_outcomes_total",
            "Keyed requests the upstream may have executed without a full answer coming back \
            (timeout, broken connection or body, 101).",
        ),
        pub orphan_claims_released: IntCounter = counter(
            "idemproxy_orphan_claims_released_total",
            "Claims won after their request stopped waiting for the store, given back by token.",
        ),
        // Responses kept for retries.
        pub not_retained: IntCounter = counter(
            "idemproxy_responses_not_retained_total",
            "Completed requests whose response was over max_stored_response and was not kept.",
        ),
        pub capture_budget_exhausted: IntCounter = counter(
            "idemproxy_capture_budget_exhausted_total",
            "Responses not retained because server.max_buffered_responses was spent for \
            server.capture_wait.",
        ),
        pub capture_scope_share_exhausted: IntCounter = counter(
            "idemproxy_capture_scope_share_exhausted_total",
            "Responses not retained because their scope's share of server.max_buffered_responses \
            (server.max_buffered_responses_per_scope) was spent for server.capture_wait.",
        ),
        pub capture_budget_waits: IntCounter = counter(
            "idemproxy_capture_budget_waits_total",
            "Keyed responses whose capture waited for room in server.max_buffered_responses or its \
            scope's share, whether or not room came.",
        ),
        pub completion_hold_expired: IntCounter = counter(
            "idemproxy_completion_hold_expired_total",
            "Responses let go to the client before their record was stored, because the store \
            took longer than the hold.",
        ),
        // The store and the upstream.
        pub store_opened: IntGauge = gauge(
            "idemproxy_store_opened",
            "1 once serve has opened its store (on PostgreSQL with store.migrate: reached and migrated), \
            0 while it is still trying: keyed requests follow store.on_error until then.",
        ),
        store_errors: [IntCounter; StoreOp::ALL.len()] = counters_by(
            "idemproxy_store_errors_total",
            "Failed store operations by operation.",
            label::OP,
            StoreOp::ALL.map(StoreOp::as_str),
        ),
        store_duration: [Histogram; StoreOp::ALL.len()] = histograms_by(
            "idemproxy_store_duration_seconds",
            "Store operation latency.",
            label::OP,
            latency_buckets(),
            StoreOp::ALL.map(StoreOp::as_str),
        ),
        pub upstream_duration: Histogram = histogram(
            "idemproxy_upstream_duration_seconds",
            "Time from forwarding a request to the upstream's response head.",
            latency_buckets(),
        ),
        // The proxy listener's limits.
        pub open_connections: IntGauge = gauge(
            "idemproxy_open_connections",
            "Client connections open on the proxy listener.",
        ),
        pub connection_cap_reached: IntCounter = counter(
            "idemproxy_connection_cap_reached_total",
            "Times a new connection found server.max_connections open and waited for a slot, \
            the listener accepting no other meanwhile.",
        ),
        pub connections_evicted: IntCounter = counter(
            "idemproxy_connections_evicted_total",
            "Idle client connections (no request in progress, or each one waiting on a body its \
            client stalls or trickles) closed to make room for new ones while \
            server.max_connections were open.",
        ),
        pub body_budget_waits: IntCounter = counter(
            "idemproxy_body_budget_waits_total",
            "Keyed request bodies that waited for room in server.max_buffered_bodies.",
        ),
        pub write_timeouts: IntCounter = counter(
            "idemproxy_write_timeouts_total",
            "Clients let go because they accepted no response bytes for server.write_timeout.",
        ),
        pub tls_reloads: Reloads = reloads(
            "idemproxy_tls_reloads_total",
            "Changes to the server.tls certificate or key files seen, by whether the new pair was taken \
            (ok) or refused, the old pair kept (error).",
            label::RESULT,
        ),
        pub tls_last_reload_successful: IntGauge = gauge_at(
            "idemproxy_tls_last_reload_successful",
            "0 while the last change seen to the server.tls certificate or key files was refused (the old \
            pair serving), else 1.",
            1,
        ),
        // The sweeper.
        pub expired_deleted: IntCounter = counter(
            "idemproxy_expired_keys_deleted_total",
            "Expired records deleted by the sweeper.",
        ),
        /// Its series appear at the sweeper's first count, not before.
        pub records: IntGaugeVec = gauge_vec(
            "idemproxy_records",
            "Records in the key table by state (processing, completed, failed, unknown, expired), \
            as of the sweeper's last count.",
            &[label::STATUS],
        ),
        // The process.
        #[allow(dead_code)] // registered for the exposition; never changed
        build_info: IntGauge = build_info(
            "idemproxy_build_info",
            "Always 1; its labels say which build runs.",
            label::VERSION,
            label::PROFILE,
        ),
        pub open_files_limit: IntGauge = gauge(
            "idemproxy_open_files_limit",
            "The soft limit on open files (RLIMIT_NOFILE) after serve raised it to the hard limit at start.",
        ),
        pub open_files_needed: IntGauge = gauge(
            "idemproxy_open_files_needed",
            "Files and sockets the configuration may hold open at once (server.max_connections, \
            upstream.max_connections per worker, store.pool_size and a margin); above \
            idemproxy_open_files_limit, connections fail under load.",
        ),
        pub config_reloads: Reloads = reloads(
            "idemproxy_config_reloads_total",
            "Times a reload (SIGHUP, POST /-/reload, idemproxy reload) read the configuration again, by \
            whether it was applied (ok) or refused, the running configuration kept (error); asks that come \
            while one runs are answered by the next, counted once.",
            label::RESULT,
        ),
        pub config_last_reload_successful: IntGauge = gauge_at(
            "idemproxy_config_last_reload_successful",
            "0 when the configuration read at the last reload (SIGHUP or POST /-/reload) was refused, else 1.",
            1,
        ),
        // Webhook signatures.
        signature_checks: [IntCounter; SignatureCheck::ALL.len()] = counters_by(
            "idemproxy_signature_checks_total",
            "Requests on routes with a signature, by what their signature check found: verified, or \
            refused 401 for a missing or malformed signature, a timestamp outside the tolerance, or no \
            signature matching.",
            label::RESULT,
            SignatureCheck::ALL.map(SignatureCheck::as_str),
        ),
        // Encryption.
        pub undecryptable: IntCounter = counter(
            "idemproxy_undecryptable_records_total",
            "Stored responses refused because they could not be decrypted.",
        ),
    }
}

impl MetricSet {
    /// Counts a request refused 503 `busy`, by the limit that ran out.
    pub fn busy(&self, reason: BusyReason) {
        self.busy_refusals[reason as usize].inc();
    }

    /// Counts a request's wait for the original with its key, by how it ended.
    pub fn wait_ended(&self, result: WaitResult) {
        self.waits[result as usize].inc();
    }

    /// Counts a webhook signature check, by what it found.
    pub fn signature_checked(&self, check: SignatureCheck) {
        self.signature_checks[check as usize].inc();
    }

    /// Observes one store operation's latency, and counts it if it failed.
    pub fn store_op(&self, op: StoreOp, seconds: f64, ok: bool) {
        self.store_duration[op as usize].observe(seconds);
        if !ok {
            self.store_errors[op as usize].inc();
        }
    }

    /// Failed store operations of every kind so far.
    pub fn store_failures(&self) -> u64 {
        self.store_errors.iter().map(IntCounter::get).sum()
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

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use prometheus::proto::{MetricFamily, MetricType};

    use std::time::Duration;

    use super::*;

    /// The families these tests look up by name.
    const REQUESTS: &str = "idemproxy_requests_total";
    const REQUEST_DURATION: &str = "idemproxy_request_duration_seconds";
    const REPLAYS: &str = "idemproxy_replays_total";
    const CONFLICTS: &str = "idemproxy_conflicts_total";
    const MISMATCHES: &str = "idemproxy_mismatches_total";
    const GRPC_CALLS: &str = "idemproxy_grpc_calls_total";
    const BUSY_REFUSALS: &str = "idemproxy_busy_refusals_total";
    const RECORDS: &str = "idemproxy_records";

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
            let requests = &served[REQUESTS];
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
        let durations = &served[REQUEST_DURATION];
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
        let requests = &served[REQUESTS];
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
            assert_eq!(series_value(&served[BUSY_REFUSALS], &by), (n + 1) as f64);
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
            (REPLAYS, Outcome::Replayed),
            (CONFLICTS, Outcome::Conflict),
            (MISMATCHES, Outcome::Mismatch),
        ];
        for (alias, outcome) in aliases {
            let by = [(label::ROUTE, "payments"), (label::OUTCOME, outcome.as_str())];
            let by_outcome = series_value(&served[REQUESTS], &by);
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
                        label::PROFILE,
                        label::CODE
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
            RECORDS,
            REQUESTS,
            REQUEST_DURATION,
            REPLAYS,
            CONFLICTS,
            MISMATCHES,
            GRPC_CALLS,
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
