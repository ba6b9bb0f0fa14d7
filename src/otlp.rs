//! OpenTelemetry traces (`[traces]`, `docs/tracing.md`). `main.rs` asks [`layer`] once at start for the
//! tracing layer that exports spans over OTLP (`otlp/export.rs`) and flushes it at exit; the request path
//! opens its spans through the functions here, each of which makes nothing while `traces.enabled` is off
//! (the `traced` flag every caller holds): no span, no allocation, no header written.
//!
//! The request's span is the `request` span `proxy.rs` opens for its logs, joined here to the caller's
//! `traceparent`; its children, made for traces alone on the target [`TARGET`] (which the log output never
//! shows), are the claim, the upstream call and the completion or release. The upstream request carries
//! the upstream span as its parent. Only what is set here is exported: never keys, credentials, paths or
//! bodies. Touches the configuration only.

#[cfg(feature = "otlp")]
mod export;
#[cfg(not(feature = "otlp"))]
mod export_off;
mod spans;

use http::{Method, StatusCode, Version};
use tracing::Span;
use tracing::field::Empty;

use crate::config::TracesConfig;

pub use self::spans::{AttributeValue, NOT_LOGGED, REQUEST_SPAN, TARGET};

#[cfg(feature = "otlp")]
pub use export::{Exporting, StartError, layer};
#[cfg(not(feature = "otlp"))]
pub use export_off::{Exporting, StartError, layer};

/// Makes the request's span the server span of a trace: joined to the caller's (its `traceparent` and
/// `tracestate`), named by method and route (`POST payments`). To be called before the span is first
/// entered, when its trace is decided. Does nothing untraced.
pub fn adopt<B>(span: &Span, traced: bool, request: &http::Request<B>, route: &str) {
    if !traced || span.is_disabled() {
        return;
    }
    let method = method_name(request.method());
    span.record("otel.kind", "server");
    span.record("otel.name", format!("{method} {route}"));
    #[cfg(feature = "otlp")]
    export::adopt(span, request.headers());
    export_attribute(span, "http.request.method", method);
    export_attribute(span, "network.protocol.version", protocol(request.version()));
}

/// Puts the answer's status on the request's span: an error for a 5xx (the proxy's or the upstream's).
pub fn answered(span: &Span, traced: bool, status: StatusCode) {
    if !traced || span.is_disabled() {
        return;
    }
    export_attribute(span, "http.response.status_code", i64::from(status.as_u16()));
    #[cfg(feature = "otlp")]
    if status.is_server_error() {
        export::fail(span);
    }
}

/// The span of a claim statement; none untraced.
pub fn claim(traced: bool) -> Span {
    if !traced {
        return Span::none();
    }
    tracing::info_span!(
        target: TARGET,
        "claim",
        idemproxy.claim = Empty,
        otel.status_code = Empty,
        error.type = Empty,
    )
}

/// What the claim statement found, on its span (`new`, `retry`, `takeover`, `completed`, `processing`, …).
pub fn claimed(span: &Span, found: &'static str) {
    if !span.is_none() {
        span.record("idemproxy.claim", found);
    }
}

/// The span of a store write that settles a won claim: `completion` (the response stored) or
/// `release` (given back); none untraced.
pub fn settlement(traced: bool, completion: bool) -> Span {
    match (traced, completion) {
        (false, _) => Span::none(),
        (true, true) => {
            tracing::info_span!(target: TARGET, "completion", otel.status_code = Empty, error.type = Empty)
        }
        (true, false) => {
            tracing::info_span!(target: TARGET, "release", otel.status_code = Empty, error.type = Empty)
        }
    }
}

/// Marks a span failed, with a short fixed word saying why (never an error's text).
pub fn failed(span: &Span, why: &'static str) {
    if !span.is_none() {
        span.record("otel.status_code", "error");
        span.record("error.type", why);
    }
}

/// The span of the upstream call (a client span, from sending the request to its response head); none
/// untraced. Its context is written into the request's headers as its `traceparent`.
pub fn upstream<B>(traced: bool, request: &mut http::Request<B>) -> Span {
    if !traced {
        return Span::none();
    }
    let span = tracing::info_span!(
        target: TARGET,
        "upstream",
        otel.kind = "client",
        http.request.method = method_name(request.method()),
        http.response.status_code = Empty,
        otel.status_code = Empty,
        error.type = Empty,
    );
    #[cfg(feature = "otlp")]
    export::inject(&span, request.headers_mut());
    span
}

/// Puts the upstream's status on its span: an error for a 4xx or 5xx, as for any HTTP client span.
pub fn upstream_answered(span: &Span, status: StatusCode) {
    if span.is_none() {
        return;
    }
    span.record("http.response.status_code", status.as_u16());
    if status.is_client_error() || status.is_server_error() {
        span.record("otel.status_code", "error");
    }
}

/// Whether this build can export traces (the `otlp` feature).
pub const BUILT_IN: bool = cfg!(feature = "otlp");

/// Whether the configuration asks for traces that this build can make.
pub fn traced(config: &TracesConfig) -> bool {
    BUILT_IN && config.enabled
}

/// The method as HTTP semantic conventions name it: one of the registered methods, else `_OTHER`
/// (a method is the client's text, and unbounded).
fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "1.1",
    }
}

/// Sets an attribute on the span's exported form only, so the log lines that carry the span do not
/// repeat it.
fn export_attribute(span: &Span, key: &'static str, value: impl Into<AttributeValue>) {
    #[cfg(feature = "otlp")]
    export::attribute(span, key, value.into());
    #[cfg(not(feature = "otlp"))]
    let _ = (span, key, value.into());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untraced_requests_get_no_span_and_their_headers_are_left_alone() {
        let mut request = http::Request::new(());
        request.headers_mut().insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let before = request.headers().clone();
        assert!(upstream(false, &mut request).is_none());
        assert!(claim(false).is_none());
        assert!(settlement(false, true).is_none());
        assert_eq!(request.headers(), &before);
    }

    #[test]
    fn methods_outside_the_registered_set_are_named_other() {
        assert_eq!(method_name(&Method::PATCH), "PATCH");
        assert_eq!(method_name(&Method::from_bytes(b"PURGE").unwrap()), "_OTHER");
    }
}
