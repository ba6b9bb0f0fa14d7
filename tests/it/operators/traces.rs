//! OpenTelemetry traces (`[traces]`) as a collector receives them: the real binary exports over OTLP/HTTP
//! protobuf to a receiver on a real socket, which decodes each `ExportTraceServiceRequest`. The request's
//! span joins the caller's trace, its claim, upstream call and completion are its children, the upstream
//! is told the proxy's span as its parent, and nothing is sent (or rewritten) while traces are off.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use tokio::net::TcpListener;

use crate::support::http::TEST_CREDENTIAL;
use crate::support::{Backend, ProxyConfig, ProxyProcess, Reply, TestEnv, keyed_post, poll_until};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const RETRY_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const KEY: &str = "order-key-never-exported";

fn traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

/// An OTLP/HTTP receiver: every span of every `POST /v1/traces`, with its service name, as decoded.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<(String, Span)>>>,
    /// Every export request's content type.
    content_types: Arc<Mutex<Vec<String>>>,
}

impl Collector {
    async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the collector");
        let url = format!("http://{}", listener.local_addr().unwrap());
        let spans = Arc::new(Mutex::new(Vec::new()));
        let content_types = Arc::new(Mutex::new(Vec::new()));
        let (kept, types) = (spans.clone(), content_types.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (kept, types) = (kept.clone(), types.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                        let (kept, types) = (kept.clone(), types.clone());
                        async move {
                            assert_eq!(request.uri().path(), "/v1/traces");
                            let content_type = request.headers().get("content-type").cloned();
                            let body = request.into_body().collect().await?.to_bytes();
                            let export = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                            types.lock().unwrap().push(
                                content_type.map_or_else(String::new, |v| v.to_str().unwrap().to_owned()),
                            );
                            kept.lock().unwrap().extend(decoded(export));
                            Ok::<_, hyper::Error>(hyper::Response::new(Full::new(Bytes::new())))
                        }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector {
            url,
            spans,
            content_types,
        }
    }

    fn spans(&self) -> Vec<(String, Span)> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of one trace, waited for until `done` says the trace is all there.
    async fn trace(&self, trace: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        poll_until(&format!("the spans of trace {trace}"), || async {
            let spans: Vec<Span> = self
                .spans()
                .into_iter()
                .map(|(_, span)| span)
                .filter(|span| hex(&span.trace_id) == trace)
                .collect();
            done(&spans).then_some(spans)
        })
        .await
    }
}

fn decoded(export: ExportTraceServiceRequest) -> Vec<(String, Span)> {
    let mut spans = Vec::new();
    for resource in export.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            spans.extend(scope.spans.into_iter().map(|span| (service.clone(), span)));
        }
    }
    spans
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::StringValue(text) => Some(text.clone()),
        Value::IntValue(number) => Some(number.to_string()),
        Value::BoolValue(flag) => Some(flag.to_string()),
        Value::DoubleValue(number) => Some(number.to_string()),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
}

fn named<'a>(spans: &'a [Span], name: &str) -> Option<&'a Span> {
    spans.iter().find(|span| span.name == name)
}

fn the<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    named(spans, name).unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

/// Test defaults with traces sent to `collector` every 50 ms.
fn traced(env: &TestEnv, collector: &Collector) -> ProxyConfig {
    env.config()
        .set("traces.enabled", true)
        .set("traces.endpoint", collector.url.as_str())
        .set("traces.batch_delay", "50ms")
}

#[tokio::test]
async fn a_keyed_request_is_traced_under_the_callers_span_and_its_replay_never_reaches_upstream() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let collector = Collector::start().await;
    let proxy = ProxyProcess::spawn(&traced(&env, &collector)).await;

    let executed = Reply::of(
        keyed_post(&proxy.url, "/orders", KEY, "{}")
            .header("traceparent", traceparent(CALLER_TRACE, CALLER_SPAN)),
    )
    .await;
    assert_eq!(executed.status, 201);
    let spans = collector
        .trace(CALLER_TRACE, |spans| {
            ["POST default", "claim", "upstream", "completion"]
                .iter()
                .all(|name| named(spans, name).is_some())
        })
        .await;

    let request = the(&spans, "POST default");
    assert_eq!(
        hex(&request.parent_span_id),
        CALLER_SPAN,
        "the caller's span is the parent"
    );
    assert_eq!(request.kind, SpanKind::Server as i32);
    assert_eq!(attribute(request, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(
        attribute(request, "http.response.status_code").as_deref(),
        Some("201")
    );
    assert_eq!(attribute(request, "outcome").as_deref(), Some("executed"));
    assert_eq!(attribute(request, "route").as_deref(), Some("default"));
    for child in ["claim", "upstream", "completion"] {
        let child = the(&spans, child);
        assert_eq!(
            child.parent_span_id, request.span_id,
            "{} is the request's child",
            child.name
        );
        assert!(
            child.start_time_unix_nano >= request.start_time_unix_nano
                && child.end_time_unix_nano <= request.end_time_unix_nano,
            "{} lies within the request",
            child.name
        );
    }
    assert_eq!(
        attribute(the(&spans, "claim"), "idemproxy.claim").as_deref(),
        Some("new")
    );
    let upstream = the(&spans, "upstream");
    assert_eq!(upstream.kind, SpanKind::Client as i32);
    assert_eq!(
        attribute(upstream, "http.response.status_code").as_deref(),
        Some("201")
    );

    let received = &env.upstream.requests()[0];
    let sent = received
        .headers
        .get("traceparent")
        .expect("a traceparent upstream");
    assert_eq!(
        sent.to_str().unwrap(),
        traceparent(CALLER_TRACE, &hex(&upstream.span_id)),
        "the upstream's parent is the proxy's upstream span"
    );

    let replay = Reply::of(
        keyed_post(&proxy.url, "/orders", KEY, "{}")
            .header("traceparent", traceparent(RETRY_TRACE, CALLER_SPAN)),
    )
    .await;
    assert!(replay.is_replay());
    let retry = collector
        .trace(RETRY_TRACE, |spans| named(spans, "POST default").is_some())
        .await;
    let request = the(&retry, "POST default");
    assert_eq!(attribute(request, "outcome").as_deref(), Some("replayed"));
    assert_eq!(hex(&request.parent_span_id), CALLER_SPAN);
    assert!(
        named(&retry, "upstream").is_none(),
        "a replay calls no upstream: {retry:#?}"
    );
    assert_eq!(env.upstream.executions(), 1);

    let (services, spans): (Vec<String>, Vec<Span>) = collector.spans().into_iter().unzip();
    assert!(services.iter().all(|s| s == "idemproxy"), "{services:?}");
    let everything = format!("{spans:?}");
    for secret in [KEY, TEST_CREDENTIAL, "/orders"] {
        assert!(
            !everything.contains(secret),
            "{secret:?} was exported: {everything}"
        );
    }
    let types = collector.content_types.lock().unwrap().clone();
    assert!(types.iter().all(|t| t == "application/x-protobuf"), "{types:?}");
}

#[tokio::test]
async fn refusals_get_a_span_of_their_own_with_no_upstream_child_whatever_the_log_filter() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let collector = Collector::start().await;
    // The request spans' target is below WARN in the logs; the listening lines still come.
    let quiet = "warn,idemproxy=info,idemproxy::proxy=warn";
    let proxy = ProxyProcess::spawn(&traced(&env, &collector).set("log.filter", quiet)).await;
    let first = Reply::of(keyed_post(&proxy.url, "/orders", KEY, "{}")).await;
    assert_eq!(first.status, 201);
    let mismatch = Reply::of(
        keyed_post(&proxy.url, "/orders", KEY, r#"{"other":1}"#)
            .header("traceparent", traceparent(RETRY_TRACE, CALLER_SPAN)),
    )
    .await;
    assert_eq!(mismatch.status, 422);
    let spans = collector
        .trace(RETRY_TRACE, |spans| named(spans, "POST default").is_some())
        .await;
    let request = the(&spans, "POST default");
    assert_eq!(attribute(request, "outcome").as_deref(), Some("mismatch"));
    assert_eq!(
        attribute(request, "http.response.status_code").as_deref(),
        Some("422")
    );
    assert!(named(&spans, "upstream").is_none(), "{spans:#?}");
}

#[tokio::test]
async fn sampling_follows_the_callers_decision_and_queued_spans_are_sent_when_the_proxy_stops() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let collector = Collector::start().await;
    let config = traced(&env, &collector)
        .set("traces.batch_delay", "1h")
        .set("traces.sample_ratio", 0.0)
        .set("traces.service_name", "payments-proxy");
    let mut proxy = ProxyProcess::spawn(&config).await;
    let unsampled = format!("00-{RETRY_TRACE}-{CALLER_SPAN}-00");
    for (key, trace) in [
        ("sampled", Some(traceparent(CALLER_TRACE, CALLER_SPAN))),
        ("unsampled", Some(unsampled)),
        ("root", None),
    ] {
        let mut request = keyed_post(&proxy.url, "/orders", key, "{}");
        if let Some(trace) = trace {
            request = request.header("traceparent", trace);
        }
        assert_eq!(Reply::of(request).await.status, 201);
    }
    proxy.terminate();
    assert!(proxy.wait().await.success(), "{}", proxy.stderr());

    let spans = collector.spans();
    let traces: std::collections::BTreeSet<String> =
        spans.iter().map(|(_, span)| hex(&span.trace_id)).collect();
    assert_eq!(
        traces,
        [CALLER_TRACE.to_owned()].into(),
        "the caller's sampled trace is kept whatever the ratio; an unsampled one and a root at ratio 0 \
         are not: {spans:#?}"
    );
    assert!(
        spans.iter().all(|(service, _)| service == "payments-proxy"),
        "{spans:#?}"
    );
    assert!(
        spans.iter().any(|(_, span)| span.name == "POST default"),
        "{spans:#?}"
    );
    let upstream = env.upstream.requests();
    let told = upstream[1].headers["traceparent"].to_str().unwrap();
    assert!(
        told.starts_with(&format!("00-{RETRY_TRACE}-"))
            && told.ends_with("-00")
            && !told.contains(CALLER_SPAN),
        "an unsampled request still tells the upstream the proxy's span: {told}"
    );
}

#[tokio::test]
async fn with_traces_off_nothing_is_sent_and_the_callers_traceparent_goes_upstream_untouched() {
    let env = TestEnv::on(Backend::Sqlite).await;
    let collector = Collector::start().await;
    let config = env.config().set("traces.endpoint", collector.url.as_str());
    let mut proxy = ProxyProcess::spawn(&config).await;
    let caller = traceparent(CALLER_TRACE, CALLER_SPAN);
    let reply = Reply::of(keyed_post(&proxy.url, "/orders", KEY, "{}").header("traceparent", &caller)).await;
    assert_eq!(reply.status, 201);
    assert_eq!(env.upstream.requests()[0].headers["traceparent"], caller.as_str());
    proxy.terminate();
    assert!(proxy.wait().await.success(), "{}", proxy.stderr());
    assert!(collector.spans().is_empty(), "{:#?}", collector.spans());
}
