//! How the table in `metrics.rs` becomes a registry: the `families!` macro, which turns each row (a field,
//! its type, the name and help text, and how it is built) into a field of `MetricSet`, documented by its
//! help text, and that field's registration; and the builders the rows name, one per kind of family,
//! with the histograms' bucket sets. Runs once, in `Metrics::new`; touches only the registry it is given.

use prometheus::core::Collector;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Declares the metric set: `pub struct $set { $field: $type = $builder("name", "help", args...), ... }`.
/// Each row's field is documented by its name and help text, and built by
/// `$builder(&registry, "name", "help", args...)`, which registers it; so a family is written once.
macro_rules! families {
    (
        $(#[$set_attr:meta])*
        pub struct $set:ident {
            $(
                $(#[$attr:meta])*
                $vis:vis $field:ident: $ty:ty =
                    $build:ident($name:literal, $help:literal $(, $arg:expr)* $(,)?),
            )*
        }
    ) => {
        $(#[$set_attr])*
        pub struct $set {
            registry: Registry,
            $(
                #[doc = concat!("`", $name, "`: ", $help)]
                #[doc = ""]
                $(#[$attr])*
                $vis $field: $ty,
            )*
        }

        impl $set {
            /// Builds every family of the table and registers it in `registry`.
            fn register(registry: Registry) -> $set {
                let r = &registry;
                $(let $field = $build(r, $name, $help $(, $arg)*);)*
                $set {
                    $($field,)*
                    registry,
                }
            }
        }
    };
}

pub(super) use families;

/// A family counted by whether something was taken (`ok`) or refused (`error`), its two series resolved.
pub struct Reloads {
    /// The `ok` series.
    pub ok: IntCounter,
    /// The `error` series.
    pub error: IntCounter,
}

/// Adds `collector` to `registry` and hands it back.
fn register<C: Collector + Clone + 'static>(registry: &Registry, collector: C) -> C {
    registry
        .register(Box::new(collector.clone()))
        .expect("metric names are unique");
    collector
}

pub(super) fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    register(registry, IntCounter::new(name, help).expect("valid metric"))
}

pub(super) fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help).expect("valid metric"))
}

/// A gauge that starts at `value`.
pub(super) fn gauge_at(registry: &Registry, name: &str, help: &str, value: i64) -> IntGauge {
    let gauge = gauge(registry, name, help);
    gauge.set(value);
    gauge
}

pub(super) fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let opts = Opts::new(name, help);
    register(registry, IntCounterVec::new(opts, labels).expect("valid metric"))
}

pub(super) fn gauge_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let opts = Opts::new(name, help);
    register(registry, IntGaugeVec::new(opts, labels).expect("valid metric"))
}

/// A counter family by `label`, its series for each of `values` resolved at once (so they exist from the
/// start), in that order.
pub(super) fn counters_by<const N: usize>(
    registry: &Registry,
    name: &str,
    help: &str,
    label: &str,
    values: [&str; N],
) -> [IntCounter; N] {
    let family = counter_vec(registry, name, help, &[label]);
    values.map(|value| family.with_label_values(&[value]))
}

/// [`counters_by`] over `ok` and `error`.
pub(super) fn reloads(registry: &Registry, name: &str, help: &str, label: &str) -> Reloads {
    let [ok, error] = counters_by(registry, name, help, label, ["ok", "error"]);
    Reloads { ok, error }
}

pub(super) fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets);
    register(registry, Histogram::with_opts(opts).expect("valid metric"))
}

pub(super) fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: Vec<f64>,
) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets);
    register(registry, HistogramVec::new(opts, labels).expect("valid metric"))
}

/// [`counters_by`] for a histogram family.
pub(super) fn histograms_by<const N: usize>(
    registry: &Registry,
    name: &str,
    help: &str,
    label: &str,
    buckets: Vec<f64>,
    values: [&str; N],
) -> [Histogram; N] {
    let family = histogram_vec(registry, name, help, &[label], buckets);
    values.map(|value| family.with_label_values(&[value]))
}

/// The build's one series, set to 1, its `version` and `profile` labels fixed.
pub(super) fn build_info(
    registry: &Registry,
    name: &str,
    help: &str,
    version: &str,
    profile: &str,
) -> IntGauge {
    let profile_value = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let opts = Opts::new(name, help)
        .const_label(version, env!("CARGO_PKG_VERSION"))
        .const_label(profile, profile_value);
    let gauge = register(registry, IntGauge::with_opts(opts).expect("valid metric"));
    gauge.set(1);
    gauge
}

/// Buckets from 0.5 ms doubling to about 16 s, for every latency.
pub(super) fn latency_buckets() -> Vec<f64> {
    prometheus::exponential_buckets(0.0005, 2.0, 16).expect("static bucket layout is valid")
}

/// Buckets for a whole request, as service level objectives are written ("99 % within 250 ms"):
/// 2.5 ms, the proxy's own work on a replay, to 10 s, beyond which a client has given up.
pub(super) fn request_buckets() -> Vec<f64> {
    vec![
        0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ]
}
