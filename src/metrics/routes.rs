//! The families the route decides (`idemproxy_requests_total`, its three aliases,
//! `idemproxy_request_duration_seconds` and `idemproxy_grpc_calls_total`), resolved once per configured
//! route at start (of the gRPC family, the `OK` series; the other codes as calls get them)
//! ([`MetricSet::routes`]) into a [`RouteSet`]; a request then finds its [`RouteSeries`] by its route's
//! name. Runs at start, and on the request path for each answered request; touches only those series.

use std::sync::Arc;
use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntCounterVec};

use super::MetricSet;
use super::labels::Outcome;

/// One route's series of `idemproxy_requests_total`, its aliases and `idemproxy_request_duration_seconds`,
/// resolved once: counting a request then costs no label lookup, no allocation and no lock.
pub struct RouteSeries {
    /// `idemproxy_requests_total{route, outcome}`, by [`Outcome`] in declaration order.
    by_outcome: [IntCounter; Outcome::ALL.len()],
    /// `idemproxy_request_duration_seconds{route, outcome}`, by [`Outcome`] in declaration order.
    durations: [Histogram; Outcome::ALL.len()],
    /// `idemproxy_replays_total{route}`, `idemproxy_conflicts_total{route}`,
    /// `idemproxy_mismatches_total{route}`.
    replays: IntCounter,
    conflicts: IntCounter,
    mismatches: IntCounter,
    /// `idemproxy_grpc_calls_total{route, code}`: the `OK` series resolved at start, others as they come.
    grpc_calls: IntCounterVec,
    route: Box<str>,
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

    /// Counts a gRPC call by the `grpc-status` its client got (`code`: the code's name, `OTHER` past the
    /// last one gRPC defines, or `NONE` for an answer that ended without one).
    pub fn grpc_answered(&self, code: &str) {
        self.grpc_calls.with_label_values(&[&*self.route, code]).inc();
    }

    /// The counter kept for existing dashboards that repeats `idemproxy_requests_total` for `outcome`, if
    /// any.
    pub(super) fn alias(&self, outcome: Outcome) -> Option<&IntCounter> {
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

impl MetricSet {
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
        let [replays, conflicts, mismatches] =
            [&self.replays, &self.conflicts, &self.mismatches].map(|alias| alias.with_label_values(&[name]));
        // Served from the start, so a rate over it works before the first call.
        self.grpc_calls.with_label_values(&[name, "OK"]);
        RouteSeries {
            by_outcome: Outcome::ALL.map(|outcome| self.requests.with_label_values(&by(outcome))),
            durations: Outcome::ALL.map(|outcome| self.request_duration.with_label_values(&by(outcome))),
            replays,
            conflicts,
            mismatches,
            grpc_calls: self.grpc_calls.clone(),
            route: name.into(),
        }
    }
}
