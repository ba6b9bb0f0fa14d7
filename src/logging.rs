//! Where log lines go and how they look, set up once by `main.rs` before anything logs: a filter that
//! SIGHUP can replace (`reload.rs`), then the formatting layer ([`format_layer`]) writing to
//! [`MaskedStderr`]; beside it, with `traces.enabled`, the layer that exports spans over OTLP
//! (`otlp.rs`), which the log filter does not limit. Touches the process's global tracing subscriber,
//! and nothing else.
//!
//! Text lines carry ANSI colours only when stderr is a terminal (and `NO_COLOR` is not set), so a file,
//! a pipe or a container's log driver gets plain text. JSON lines are flat ([`FlatJson`]): `timestamp`,
//! `level`, `target`, `message`, the event's own fields and the fields of the spans it happened in
//! (the request's `method`, `route`, `outcome`, `trace_id`) are all top-level keys, so a log pipeline
//! reads `status` and `route` rather than `fields.status` and `span.route`. Where an event's field and
//! a span's share a name, the event's wins; `span` names the innermost span.

use std::fmt;
use std::io::IsTerminal;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

use crate::config::{Config, LogConfig, LogFormat, MaskedStderr, TracesConfig};
use crate::otlp::{self, Exporting, StartError};

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

/// Sets up the process's logging from `[log]`, and beside it the export of traces from `[traces]`
/// (`otlp.rs`): the log filter is the format layer's own, so traces do not depend on it. The handle
/// changes the log filter later; the export, if any, is to be flushed at exit.
pub fn init(log: &LogConfig, traces: &TracesConfig) -> Result<(FilterHandle, Option<Exporting>), StartError> {
    let (filter, handle) = reload::Layer::new(filter_for(&log.filter));
    let exporting = match otlp::layer(traces)? {
        // Without traces the filter stays global: a per-layer filter costs about 3k instructions a
        // request (callgrind), which only the traces pay for.
        None => {
            let logs = format_layer(log.format);
            tracing_subscriber::registry().with(filter).with(logs).init();
            None
        }
        Some((traces, exporting)) => {
            let logs = format_layer(log.format).with_filter(filter);
            tracing_subscriber::registry().with(logs).with(traces).init();
            Some(exporting)
        }
    };
    Ok((FilterHandle(handle), exporting))
}

/// Whether `RUST_LOG` is set, and so overrides `log.filter`.
pub fn filter_from_environment() -> bool {
    std::env::var_os(EnvFilter::DEFAULT_ENV).is_some()
}

/// `RUST_LOG` if set (and valid), else `filter`, with [`QUIET_TARGETS`] held at INFO and the spans made
/// for traces alone kept out.
fn filter_for(filter: &str) -> EnvFilter {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(filter));
    for directive in QUIET_TARGETS.iter().chain([&otlp::NOT_LOGGED]) {
        if let Ok(directive) = directive.parse() {
            filter = filter.add_directive(directive);
        }
    }
    filter
}

/// Lines in `format` on [`MaskedStderr`].
fn format_layer<S>(format: LogFormat) -> Box<dyn Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    let layer = tracing_subscriber::fmt::layer().with_writer(MaskedStderr);
    match format {
        LogFormat::Json => layer.fmt_fields(JsonFields::new()).event_format(FlatJson).boxed(),
        LogFormat::Text => layer.with_ansi(colours()).boxed(),
    }
}

/// One JSON object per event, every field at the top level. Span fields are kept by `JsonFields` as a
/// JSON object each, read back here; the line is built as a map and written in one piece.
struct FlatJson;

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let fields = extensions.get::<FormattedFields<N>>();
                if let Some(Ok(Value::Object(fields))) = fields.map(|f| serde_json::from_str(&f.fields)) {
                    line.extend(fields);
                }
                line.insert("span".into(), span.name().into());
            }
        }
        let mut fields = Fields {
            line: &mut line,
            target: None,
        };
        event.record(&mut fields);
        let target = fields
            .target
            .take()
            .unwrap_or_else(|| event.metadata().target().to_owned());
        line.insert("target".into(), target.into());
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Records an event's fields into the line. An event bridged from the `log` crate carries its target
/// and location as `log.*` fields: its target is the line's, the rest is dropped.
struct Fields<'a> {
    line: &'a mut Map<String, Value>,
    target: Option<String>,
}

impl Fields<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        match field.name() {
            "log.target" => self.target = value.as_str().map(str::to_owned),
            name if name.starts_with("log.") => {}
            name => {
                self.line.insert(name.to_owned(), value);
            }
        }
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
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
        store = config.store.backend.kind(),
        routes = config.routes.routes.len(),
        tls = config.server.tls.is_some(),
        log_format = log_format(config.log.format),
        "idemproxy starting"
    );
}

fn log_format(format: LogFormat) -> &'static str {
    match format {
        LogFormat::Json => "json",
        LogFormat::Text => "text",
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Where the test subscriber writes.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// The JSON lines `log` writes under the JSON format.
    fn json_lines(log: impl FnOnce()) -> Vec<Value> {
        let lines = Lines::default();
        let writer = lines.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || writer.clone())
                .fmt_fields(JsonFields::new())
                .event_format(FlatJson),
        );
        tracing::subscriber::with_default(subscriber, log);
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    #[test]
    fn a_json_line_holds_the_event_and_span_fields_at_the_top_level() {
        let lines = json_lines(|| {
            let span = tracing::info_span!(
                "request",
                method = "POST",
                route = "payments",
                outcome = tracing::field::Empty
            );
            span.record("outcome", "executed");
            let _entered = span.enter();
            tracing::warn!(status = 502u16, error = %"upstream reset", route = "event's own", "request failed");
        });
        let [line] = &lines[..] else {
            panic!("one line: {lines:?}")
        };
        assert_eq!(line["message"], "request failed", "{line}");
        assert_eq!(line["level"], "WARN", "{line}");
        assert_eq!(line["status"], 502, "{line}");
        assert_eq!(line["error"], "upstream reset", "{line}");
        assert_eq!(line["method"], "POST", "{line}");
        assert_eq!(line["outcome"], "executed", "a field recorded later: {line}");
        assert_eq!(line["route"], "event's own", "the event's field wins: {line}");
        assert_eq!(line["span"], "request", "{line}");
        assert_eq!(line["target"], module_path!(), "{line}");
        assert!(
            line["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{line}"
        );
        assert!(line.get("fields").is_none(), "{line}");
    }

    #[test]
    fn a_line_outside_any_span_has_no_span_key() {
        let lines = json_lines(|| tracing::info!(n = 1, "alone"));
        assert_eq!(lines[0]["n"], 1);
        assert!(lines[0].get("span").is_none(), "{}", lines[0]);
    }
}
