//! The one error type of the request path. Every failure a client can see is a [`ProxyError`]; it maps to
//! its status, its stable problem type and its metrics outcome in one exhaustive `match` each, and becomes
//! an RFC 9457 `application/problem+json` response in [`ProxyError::into_response`].

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::metrics::Outcome;
use crate::proxy::body::{self, ProxyBody};

/// Base of every problem `type` URI; the slug follows.
pub const PROBLEM_BASE: &str = "https://idemproxy.dev/problems/";

/// Why a request was not answered by the upstream (or by a replay).
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A protected method came without a key while keys are required.
    #[error("this request needs an {0} header")]
    MissingKey(http::HeaderName),
    /// The key header is malformed, too long, or repeated.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(String),
    /// The keyed request body is over `max_request_body`.
    #[error("request body exceeds {limit} bytes")]
    RequestTooLarge {
        /// The configured limit.
        limit: u64,
    },
    /// The request body could not be read from the client.
    #[error("could not read the request body: {0}")]
    ClientBody(String),
    /// Another request holds the key right now.
    #[error("a request with this key is in progress")]
    KeyInFlight {
        /// Time until its lease ends.
        retry_after: Duration,
    },
    /// The key was used before with a different request.
    #[error("this key was already used with a different request")]
    KeyReused,
    /// The key's operation happened, but its response was too large to keep.
    #[error("the response to this key was not retained; the operation completed and will not run again")]
    ResponseNotRetained {
        /// Stored status of the original response.
        status: u16,
    },
    /// The store could not be reached (fail_closed).
    #[error("the idempotency store is unavailable: {0}")]
    StoreUnavailable(String),
    /// The upstream could not be reached or broke off.
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    /// The upstream did not answer in time.
    #[error("upstream timed out after {0:?}")]
    UpstreamTimeout(Duration),
    /// The client did not send its request body within `server.body_read_timeout`.
    #[error("the request body did not arrive within {0:?}")]
    RequestTimeout(Duration),
    /// The key's stored response cannot be decrypted; it is never replayed as is.
    #[error("the stored response for this key cannot be read")]
    RecordUnreadable,
    /// `server.max_buffered_bodies` stayed spent for `server.body_read_timeout`.
    #[error("too many request bodies are being buffered; try again")]
    Busy,
}

impl ProxyError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::MissingKey(_) | ProxyError::InvalidKey(_) | ProxyError::ClientBody(_) => {
                StatusCode::BAD_REQUEST
            }
            ProxyError::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::KeyInFlight { .. } => StatusCode::CONFLICT,
            ProxyError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProxyError::ResponseNotRetained { .. } => StatusCode::GONE,
            ProxyError::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::RecordUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::Busy => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The stable slug of the problem `type` URI.
    pub fn slug(&self) -> &'static str {
        match self {
            ProxyError::MissingKey(_) => "missing-key",
            ProxyError::InvalidKey(_) => "invalid-key",
            ProxyError::RequestTooLarge { .. } => "request-too-large",
            ProxyError::ClientBody(_) => "bad-request-body",
            ProxyError::KeyInFlight { .. } => "key-in-flight",
            ProxyError::KeyReused => "key-reused",
            ProxyError::ResponseNotRetained { .. } => "response-not-retained",
            ProxyError::StoreUnavailable(_) => "store-unavailable",
            ProxyError::UpstreamUnreachable(_) => "upstream-unreachable",
            ProxyError::UpstreamTimeout(_) => "upstream-timeout",
            ProxyError::RequestTimeout(_) => "request-timeout",
            ProxyError::RecordUnreadable => "record-unreadable",
            ProxyError::Busy => "busy",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ProxyError::MissingKey(_) => "Idempotency key missing",
            ProxyError::InvalidKey(_) => "Idempotency key invalid",
            ProxyError::RequestTooLarge { .. } => "Request body too large",
            ProxyError::ClientBody(_) => "Request body unreadable",
            ProxyError::KeyInFlight { .. } => "Request with this key in progress",
            ProxyError::KeyReused => "Idempotency key reused with another request",
            ProxyError::ResponseNotRetained { .. } => "Response not retained",
            ProxyError::StoreUnavailable(_) => "Idempotency store unavailable",
            ProxyError::UpstreamUnreachable(_) => "Upstream unreachable",
            ProxyError::UpstreamTimeout(_) => "Upstream timeout",
            ProxyError::RequestTimeout(_) => "Request body timeout",
            ProxyError::RecordUnreadable => "Stored response unreadable",
            ProxyError::Busy => "Proxy busy",
        }
    }

    /// The `requests_total{outcome}` this error counts as.
    pub fn outcome(&self) -> Outcome {
        match self {
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::RequestTooLarge { .. }
            | ProxyError::ClientBody(_)
            | ProxyError::RequestTimeout(_)
            | ProxyError::Busy => Outcome::Rejected,
            ProxyError::KeyInFlight { .. } => Outcome::Conflict,
            ProxyError::KeyReused => Outcome::Mismatch,
            ProxyError::ResponseNotRetained { .. } => Outcome::Replayed,
            ProxyError::StoreUnavailable(_) | ProxyError::RecordUnreadable => Outcome::StoreUnavailable,
            ProxyError::UpstreamUnreachable(_) | ProxyError::UpstreamTimeout(_) => Outcome::UpstreamError,
        }
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::KeyInFlight { retry_after } => {
                Some(retry_after.as_millis().div_ceil(1000).max(1) as u64)
            }
            ProxyError::StoreUnavailable(_) | ProxyError::Busy => Some(1),
            _ => None,
        }
    }

    /// The problem+json response for this error.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let problem = serde_json::json!({
            "type": format!("{PROBLEM_BASE}{}", self.slug()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": self.to_string(),
        });
        let mut response = Response::new(body::full(problem.to_string()));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(secs) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if matches!(self, ProxyError::ResponseNotRetained { .. }) {
            headers.insert(
                crate::proxy::replay::REPLAYED_HEADER,
                HeaderValue::from_static("true"),
            );
        }
        response
    }
}

/// An error and all its causes on one line (`outer: cause: root cause`), for logs and problem details.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_carries_retry_after_of_at_least_one_second() {
        let response = ProxyError::KeyInFlight {
            retry_after: Duration::from_millis(200),
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }

    #[test]
    fn store_unavailable_is_503_with_retry_after() {
        let response = ProxyError::StoreUnavailable("down".into()).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response.headers().contains_key(header::RETRY_AFTER));
    }
}
