//! Where log lines go and how they look, set up once by `main.rs` before anything logs: a filter that
//! SIGHUP can replace (`reload.rs`), then the formatting layer ([`format_layer`]) writing to
//! [`MaskedStderr`]. A layer that exports spans elsewhere is one more `.with(...)` in [`init`]. Touches
//! the process's global tracing subscriber, and nothing else.
//!
//! Text lines carry ANSI colours only when stderr is a terminal (and `NO_COLOR` is not set), so a file,
//! a pipe or a container's log driver gets plain text. JSON lines are flat: the event's fields (and
//! `message`) are top-level keys beside `timestamp`, `level` and `target`, so a log pipeline reads
//! `status` rather than `fields.status`; the request span's fields (`method`, `route`, `outcome`,
//! `trace_id`) are under `span`.

use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

use crate::config::{Config, LogConfig, LogFormat, MaskedStderr, StoreBackend};

/// Targets of dependencies whose lines would carry keys or bodies in clear, held at INFO whatever the
/// filter asks: tokio-postgres logs every statement's parameters (scope, key, fingerprint) at DEBUG.
const QUIET_TARGETS: [&str; 1] = ["tokio_postgres::query=info"];

/// Replaces the running log filter.
pub struct FilterHandle(reload::Handle<EnvFilter, Registry>);

impl FilterHandle {
    /// Puts the filter `log.filter` (`RUST_LOG` when set) into effect for every line from now on.
    pub fn set(&self, filter: &str) -> Result<(), String> {
        self.0.reload(filter_for(filter)).map_err(|e| e.to_string())
    }
}

/// Sets up the process's logging from `[log]`; the handle changes its filter later.
pub fn init(log: &LogConfig) -> FilterHandle {
    let (filter, handle) = reload::Layer::new(filter_for(&log.filter));
    tracing_subscriber::registry()
        .with(filter)
        .with(format_layer(log.format))
        .init();
    FilterHandle(handle)
}

/// Whether `RUST_LOG` is set, and so overrides `log.filter`.
pub fn filter_from_environment() -> bool {
    std::env::var_os(EnvFilter::DEFAULT_ENV).is_some()
}

/// `RUST_LOG` if set (and valid), else `filter`, with [`QUIET_TARGETS`] held at INFO.
fn filter_for(filter: &str) -> EnvFilter {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(filter));
    for directive in QUIET_TARGETS {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    filter
}

/// Lines in `format` on [`MaskedStderr`].
fn format_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(MaskedStderr);
    match format {
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .boxed(),
        LogFormat::Text => layer.with_ansi(colours()).boxed(),
    }
}

/// ANSI colours only on a terminal, and not when `NO_COLOR` asks for none (no-color.org).
fn colours() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// The line `serve` logs first: the version, and what this configuration makes of the process, without
/// a credential (the store's kind, not its URL).
pub fn announce(config: &Config) {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        listen = %config.server.listen,
        admin_listen = %config.server.admin_listen,
        upstream = %config.upstream.address,
        store = store_kind(&config.store.backend),
        routes = config.routes.routes.len(),
        tls = config.server.tls.is_some(),
        log_format = log_format(config.log.format),
        "idemproxy starting"
    );
}

fn store_kind(backend: &StoreBackend) -> &'static str {
    match backend {
        StoreBackend::Postgres => "postgres",
        StoreBackend::Sqlite { .. } => "sqlite",
        StoreBackend::Redis(_) => "redis",
    }
}

fn log_format(format: LogFormat) -> &'static str {
    match format {
        LogFormat::Json => "json",
        LogFormat::Text => "text",
    }
}
