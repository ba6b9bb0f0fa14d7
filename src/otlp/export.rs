//! The OTLP/HTTP export of `[traces]`, built once by `main.rs` through [`layer`]: the OpenTelemetry SDK's
//! batch processor and OTLP exporter, sending protobuf over the hyper client the proxy already has, on a
//! one-thread runtime of its own so that exports never share the workers' time and a flush at exit works
//! after the proxy's runtime has stopped. Also the W3C Trace Context read from a request and written into
//! the upstream request. Touches the configuration only.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry::{KeyValue, Value};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::FilterFn;
use tracing_subscriber::registry::LookupSpan;

use super::spans::{AttributeValue, REQUEST_SPAN, TARGET};
use crate::config::tls::{self, roots};
use crate::config::{DEFAULT_SERVICE_NAME, TracesConfig};

/// The instrumentation scope the spans are exported under.
const SCOPE: &str = "idemproxy";

/// Bound on one export when neither the configuration nor the environment sets one (the OTLP default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the export could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The runtime the exports run on could not be started.
    #[error("traces: cannot start the export thread: {0}")]
    Runtime(std::io::Error),
    /// The TLS settings for https:// collectors could not be made.
    #[error("traces: TLS: {0}")]
    Tls(String),
    /// The exporter refused its settings.
    #[error("traces: {0}")]
    Exporter(String),
}

/// The running export; [`Exporting::shutdown`] sends what is still queued.
pub struct Exporting {
    provider: SdkTracerProvider,
    /// The runtime the exporter's requests run on, stopped after the last flush.
    runtime: tokio::runtime::Runtime,
}

impl Exporting {
    /// Sends every span still queued (within the export timeout) and stops the export. Not to be called
    /// from async code: it waits for the last export.
    pub fn shutdown(self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "traces: the last spans could not be sent");
        }
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

/// The layer to add to the subscriber, and the export it feeds; `None` while `traces.enabled` is off.
/// The layer sees the request's span and the spans of [`TARGET`], never an event: only what
/// `otlp.rs` puts on those spans is exported.
pub fn layer<S>(config: &TracesConfig) -> Result<Option<(impl Layer<S>, Exporting)>, StartError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    if !config.enabled {
        return Ok(None);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("idemproxy-otlp")
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let provider = provider(config, runtime.handle().clone())?;
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_location(false)
        .with_threads(false)
        .with_level(false)
        .with_tracked_inactivity(false)
        .with_target(false)
        .with_context_activation(false)
        .with_filter(FilterFn::new(|meta| {
            meta.is_span() && (meta.target() == TARGET || (meta.target(), meta.name()) == REQUEST_SPAN)
        }));
    Ok(Some((layer, Exporting { provider, runtime })))
}

fn provider(config: &TracesConfig, runtime: tokio::runtime::Handle) -> Result<SdkTracerProvider, StartError> {
    let client = HyperClient::new(runtime, export_timeout(config))?;
    let mut exporter = SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_http_client(client);
    if let Some(endpoint) = &config.endpoint {
        exporter = exporter.with_endpoint(endpoint);
    }
    if let Some(timeout) = config.timeout {
        exporter = exporter.with_timeout(timeout);
    }
    if !config.headers.is_empty() {
        let headers = config
            .headers
            .iter()
            .filter_map(|(name, value)| Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned())));
        exporter = exporter.with_headers(headers.collect());
    }
    let exporter = exporter
        .build()
        .map_err(|e| StartError::Exporter(e.to_string()))?;
    let batch = BatchConfigBuilder::default()
        .with_scheduled_delay(config.batch_delay)
        .with_max_export_batch_size(config.max_batch)
        .with_max_queue_size(config.max_queue)
        .build();
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch)
        .build();
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio)));
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler)
        .with_resource(resource(config))
        .build())
}

/// The bound on one export, as the exporter reads it: the configuration's, else the standard variables'
/// (milliseconds), else 10 s. The client holds each request to it.
fn export_timeout(config: &TracesConfig) -> Duration {
    let from_environment = ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .iter()
        .find_map(|name| std::env::var(name).ok()?.parse().ok())
        .map(Duration::from_millis);
    config.timeout.or(from_environment).unwrap_or(DEFAULT_TIMEOUT)
}

/// `service.name` (the configuration's, else `OTEL_SERVICE_NAME`'s, else `idemproxy`), `service.version`,
/// and what `OTEL_RESOURCE_ATTRIBUTES` adds.
fn resource(config: &TracesConfig) -> Resource {
    let builder =
        Resource::builder().with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    let from_environment = std::env::var_os("OTEL_SERVICE_NAME").is_some_and(|name| !name.is_empty());
    match (&config.service_name, from_environment) {
        (Some(name), _) => builder.with_service_name(name.clone()),
        (None, true) => builder,
        (None, false) => builder.with_service_name(DEFAULT_SERVICE_NAME),
    }
    .build()
}

/// Joins the request's span, not entered yet, to the trace its headers carry.
pub(super) fn adopt(span: &Span, headers: &HeaderMap) {
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    // Fails only for a span that was entered already or that the layer does not see (then untraced).
    let _ = span.set_parent(parent);
}

/// Writes the span's context as the request's `traceparent` (and `tracestate`), replacing the caller's.
pub(super) fn inject(span: &Span, headers: &mut HeaderMap) {
    let context = span.context();
    TraceContextPropagator::new().inject_context(&context, &mut HeadersMut(headers));
}

/// An attribute on the span's exported form.
pub(super) fn attribute(span: &Span, key: &'static str, value: AttributeValue) {
    let value = match value {
        AttributeValue::Str(text) => Value::from(text),
        AttributeValue::Int(number) => Value::from(number),
    };
    span.set_attribute(key, value);
}

/// Marks the span's exported form failed.
pub(super) fn fail(span: &Span) {
    span.set_status(Status::error(""));
}

/// A request's headers as the propagator reads them: a repeated `traceparent` is no trace context, as
/// `proxy/trace_context.rs` reads it.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let mut values = self.0.get_all(key).iter();
        let value = values.next()?;
        if values.next().is_some() {
            return None;
        }
        value.to_str().ok()
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// The exporter's HTTP client: hyper over the runtime of the export thread (plain HTTP, or TLS with the
/// system's roots), each send bounded by the export timeout.
#[derive(Debug, Clone)]
struct HyperClient {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    runtime: tokio::runtime::Handle,
    timeout: Duration,
}

impl HyperClient {
    fn new(runtime: tokio::runtime::Handle, timeout: Duration) -> Result<HyperClient, StartError> {
        // https:// collectors are verified against the system's CA certificates; with none found, an
        // https:// export fails (and says so in the log) while http:// ones still work.
        let roots = roots(None).map_err(StartError::Tls)?;
        let tls = rustls::ClientConfig::builder_with_provider(tls::provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| StartError::Tls(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(HyperClient {
            client,
            runtime,
            timeout,
        })
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HyperClient {
    async fn send_bytes(
        &self,
        request: Request<Bytes>,
    ) -> Result<Response<Bytes>, opentelemetry_http::HttpError> {
        let client = self.client.clone();
        let send = async move {
            let response = client.request(request.map(Full::new)).await?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await?.to_bytes();
            Ok::<_, opentelemetry_http::HttpError>(Response::from_parts(parts, body))
        };
        let timeout = self.timeout;
        let bounded = async move {
            tokio::time::timeout(timeout, send)
                .await
                .map_err(|_| "the collector did not answer in time")?
        };
        self.runtime.spawn(bounded).await?
    }
}
