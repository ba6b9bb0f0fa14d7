//! The gRPC dialect: tells a gRPC call by its content type, and reads what its answer says of its
//! outcome: the `grpc-status` in the head of a trailers-only answer, or in the trailers after the
//! messages (gRPC over HTTP/2, PROTOCOL-HTTP2.md). The route's `grpc_release_codes` and
//! `grpc_unknown_codes` decide what the code means for the key. Also the call's own deadline
//! (`grpc-timeout`), and its answers counted by status.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body::Frame;

use super::verdict::{OnHead, Verdict};
use crate::body::{self, Inspect, ProxyBody};
use crate::config::{GrpcOutcome, StoreRules, grpc_code_name};
use crate::headers::{grpc_code, grpc_status};
use crate::metrics::RouteSeries;
use crate::store::TRAILER_PREFIX;

const STATUS: &str = "grpc-status";

/// Whether `request` is gRPC (`application/grpc`, `+proto`, `+json`, any other `+` suffix), which only
/// HTTP/2 carries. gRPC-Web (`application/grpc-web…`) is made for HTTP/1.1 and is not.
pub(crate) fn is_grpc<B>(request: &Request<B>) -> bool {
    is_grpc_headers(request.headers())
}

/// [`is_grpc`], from the request's headers.
pub(crate) fn is_grpc_headers(headers: &HeaderMap) -> bool {
    let Some(content_type) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    let bytes = content_type.as_bytes();
    let prefix = b"application/grpc";
    bytes.len() >= prefix.len()
        && bytes[..prefix.len()].eq_ignore_ascii_case(prefix)
        && matches!(bytes.get(prefix.len()), None | Some(b'+' | b';'))
}

/// The services every gRPC server may carry that are never keyed, whatever the route: health checks (a
/// Kubernetes gRPC probe calls `Check` with no key) and server reflection (a tool's bidirectional stream).
const INFRASTRUCTURE: [&str; 3] = [
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
];

/// Whether `request` is a gRPC call to health checking or reflection, which pass through untouched: the
/// path is one of those services and a method name, nothing else (no further segment, no escape that a
/// router behind the proxy might decode into one).
pub(crate) fn is_infrastructure<B>(request: &Request<B>) -> bool {
    let path = request.uri().path();
    INFRASTRUCTURE.iter().any(|service| {
        path.strip_prefix(service).is_some_and(|method| {
            !method.is_empty() && method.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        })
    }) && is_grpc(request)
}

/// The deadline a gRPC client set on its call (`grpc-timeout`: up to 8 digits and a unit, `H`, `M`,
/// `S`, `m`, `u` or `n`), if it sent a valid one.
pub(crate) fn timeout(headers: &HeaderMap) -> Option<std::time::Duration> {
    use std::time::Duration;
    let value = headers.get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = value.split_at_checked(value.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Puts the proxy's deadline on a keyed call as it goes upstream, in place of the client's: the
/// service enforces `grpc-timeout` itself, and the execution of a key runs to its end (and is stored)
/// whenever its client gives up, under `upstream.timeout`.
pub(crate) fn set_deadline(headers: &mut HeaderMap, deadline: std::time::Duration) {
    if !headers.contains_key("grpc-timeout") {
        return;
    }
    // A TimeoutValue has at most 8 digits: milliseconds up to a day and more, else seconds.
    let millis = deadline.as_millis();
    let value = if millis < 100_000_000 {
        format!("{millis}m")
    } else {
        format!("{}S", deadline.as_secs().min(99_999_999))
    };
    if let Ok(value) = http::HeaderValue::from_str(&value) {
        headers.insert("grpc-timeout", value);
    }
}

/// What a trailers-only answer's head says for the key (an answer with messages says it in its
/// trailers, [`on_end`]): the route's codes decide.
pub(crate) fn on_head(rules: &StoreRules, status: StatusCode, headers: &HeaderMap) -> OnHead {
    let Some(code) = grpc_status(headers).filter(|_| status == StatusCode::OK) else {
        return OnHead::Relay;
    };
    match rules.grpc.of(code) {
        GrpcOutcome::Store => OnHead::Relay,
        GrpcOutcome::Release => OnHead::Release,
        GrpcOutcome::Unknown => OnHead::Unknown(format!("gRPC status {code}")),
    }
}

/// What a whole answer's status says for the key, in its stored headers (trailers-only) or trailers:
/// the route's codes decide, and an answer without a status is a broken call. An HTTP status other
/// than 200 is an HTTP answer, stored as such.
pub(crate) fn on_end(rules: &StoreRules, status: u16, stored: &[(String, Vec<u8>)]) -> Verdict {
    if status != 200 {
        return Verdict::Store;
    }
    let Some(code) = stored_status(stored) else {
        return Verdict::Unknown("a gRPC answer without grpc-status".into());
    };
    match rules.grpc.of(code) {
        GrpcOutcome::Store => Verdict::Store,
        GrpcOutcome::Release => Verdict::Release,
        GrpcOutcome::Unknown => Verdict::Unknown(format!("gRPC status {code}")),
    }
}

/// The status code of a response as it is to be stored: in its headers (trailers-only) or its trailers.
fn stored_status(entries: &[(String, Vec<u8>)]) -> Option<u32> {
    entries
        .iter()
        .find(|(name, _)| name == STATUS || name.strip_prefix(TRAILER_PREFIX) == Some(STATUS))
        .and_then(|(_, value)| grpc_code(value))
}

/// `response`, counted in `idemproxy_grpc_calls_total` by the status its client gets: now, from a
/// trailers-only head, or as its trailers pass; `NONE` if its body ends, or its client goes, without one.
pub(crate) fn counted(response: Response<ProxyBody>, series: Arc<RouteSeries>) -> Response<ProxyBody> {
    if let Some(code) = grpc_status(response.headers()) {
        series.grpc_answered(grpc_code_name(code));
        return response;
    }
    response.map(|body| body::inspected(body, Uncounted(Some(series))))
}

/// A gRPC answer's route while its status is not counted yet: counted when the trailers pass, or as
/// `NONE` when dropped before them.
struct Uncounted(Option<Arc<RouteSeries>>);

impl Inspect for Uncounted {
    fn frame(&mut self, frame: &Frame<Bytes>) {
        if let Some(trailers) = frame.trailers_ref()
            && let Some(series) = self.0.take()
        {
            series.grpc_answered(grpc_status(trailers).map_or("NONE", grpc_code_name));
        }
    }
}

impl Drop for Uncounted {
    fn drop(&mut self) {
        if let Some(series) = self.0.take() {
            series.grpc_answered("NONE");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_calls_are_told_by_their_content_type_and_grpc_web_is_not_one() {
        let with = |content_type: &'static str| {
            is_grpc(
                &Request::post("/s/M")
                    .header(header::CONTENT_TYPE, content_type)
                    .body(())
                    .unwrap(),
            )
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc;x=1",
        ] {
            assert!(with(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpcx",
            "application/json",
        ] {
            assert!(!with(no), "{no}");
        }
        assert!(!is_grpc(&Request::post("/s/M").body(()).unwrap()));
    }

    #[test]
    fn health_and_reflection_calls_are_infrastructure_and_other_calls_are_not() {
        let call = |path: &str| {
            Request::post(path)
                .header(header::CONTENT_TYPE, "application/grpc")
                .body(())
                .unwrap()
        };
        assert!(is_infrastructure(&call("/grpc.health.v1.Health/Check")));
        assert!(is_infrastructure(&call("/grpc.health.v1.Health/Watch")));
        assert!(is_infrastructure(&call(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
        )));
        assert!(!is_infrastructure(&call("/payments.Payments/CreatePayment")));
        assert!(!is_infrastructure(&call("/grpc.health.v1.HealthX/Check")));
        // Other spellings that a router behind the proxy might take for another method are not.
        for path in [
            "/grpc.health.v1.Health/",
            "/grpc.health.v1.Health/Check/../../payments.Payments/CreatePayment",
            "/grpc.health.v1.Health/Check%2F..%2F..%2Fpayments.Payments%2FCreatePayment",
            "/grpc.health.v1.Health/Check;x=1",
        ] {
            assert!(!is_infrastructure(&call(path)), "{path}");
        }
        let not_grpc = Request::post("/grpc.health.v1.Health/Check").body(()).unwrap();
        assert!(!is_infrastructure(&not_grpc), "only gRPC calls");
    }

    #[test]
    fn grpc_timeout_is_read_in_each_unit_and_anything_else_is_ignored() {
        use std::time::Duration;
        let read = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert("grpc-timeout", value.parse().unwrap());
            timeout(&headers)
        };
        assert_eq!(read("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(read("3M"), Some(Duration::from_secs(180)));
        assert_eq!(read("10S"), Some(Duration::from_secs(10)));
        assert_eq!(read("250m"), Some(Duration::from_millis(250)));
        assert_eq!(read("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(read("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "m", "100", "123456789m", "1.5S", "-1S", "10s", "1 S", "1Sé"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
        assert_eq!(timeout(&HeaderMap::new()), None);
    }

    #[test]
    fn the_status_is_read_from_the_head_or_from_the_stored_trailers() {
        let mut headers = HeaderMap::new();
        assert_eq!(grpc_status(&headers), None);
        headers.insert(STATUS, "14".parse().unwrap());
        assert_eq!(grpc_status(&headers), Some(14));
        headers.insert(STATUS, "fourteen".parse().unwrap());
        assert_eq!(grpc_status(&headers), None, "not a number");

        let trailer = |value: &str| (format!("{TRAILER_PREFIX}grpc-status"), value.as_bytes().to_vec());
        let head = ("content-type".to_owned(), b"application/grpc".to_vec());
        assert_eq!(stored_status(&[head.clone(), trailer("0")]), Some(0));
        assert_eq!(
            stored_status(&[head.clone(), ("grpc-status".into(), b"5".to_vec())]),
            Some(5)
        );
        assert_eq!(
            stored_status(&[head, ("x-grpc-status".into(), b"5".to_vec())]),
            None
        );
    }

    #[test]
    fn a_keyed_call_goes_upstream_under_the_proxy_s_deadline() {
        let mut headers = HeaderMap::new();
        set_deadline(&mut headers, std::time::Duration::from_secs(60));
        assert!(
            headers.get("grpc-timeout").is_none(),
            "a call without a deadline is sent without one"
        );
        headers.insert("grpc-timeout", http::HeaderValue::from_static("300m"));
        set_deadline(&mut headers, std::time::Duration::from_secs(60));
        assert_eq!(headers["grpc-timeout"], "60000m");
        assert_eq!(timeout(&headers), Some(std::time::Duration::from_secs(60)));
        set_deadline(&mut headers, std::time::Duration::from_secs(200_000));
        assert_eq!(headers["grpc-timeout"], "200000S");
    }
}
