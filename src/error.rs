//! The one error type of the request path. Every failure a client can see is a [`ProxyError`]; it maps to
//! its status, its stable problem type and its metrics outcome in one exhaustive `match` each, and becomes
//! an RFC 9457 `application/problem+json` response in [`ProxyError::into_response`], or, to a gRPC call,
//! a gRPC status in a trailers-only answer ([`ProxyError::into_grpc`]).

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::body::{self, ProxyBody};
use crate::config::ProblemStatuses;
use crate::metrics::Outcome;

/// Base of every problem `type` URI unless `server.problem_type_base` names another; the slug follows.
pub const PROBLEM_BASE: &str = crate::config::DEFAULT_PROBLEM_TYPE_BASE;

/// What ran out when the proxy answers 503 `busy`: the enum `idemproxy_busy_refusals_total{reason}`
/// counts by, which the problem's detail is chosen by too.
pub use crate::metrics::BusyReason as Busy;

impl Busy {
    fn detail(self) -> &'static str {
        match self {
            Busy::Bodies => "Too many request bodies are being received at once; try again shortly.",
            Busy::Parsing => {
                "The request's JSON body needs more working memory than the proxy has free; try again \
                 shortly."
            }
            Busy::KeyedInFlight => "Too many keyed requests are being executed at once; try again shortly.",
            Busy::KeyedOnConnection => {
                "Too many keyed requests of this connection are being executed at once; try again shortly."
            }
            Busy::UpstreamConnections => {
                "Every connection to the upstream service is in use; try again shortly."
            }
            Busy::Connections => {
                "The proxy is at its connection limit and closed this idle connection to make room; \
                 retry on a new connection."
            }
        }
    }
}

/// Why a request was not answered by the upstream (or by a replay). `Display` is for logs and may carry
/// internal error text; clients get [`ProxyError::detail`], which never does.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A protected method came without a key while keys are required.
    #[error("this request needs {0}")]
    MissingKey(String),
    /// The key header is malformed, too long, or repeated.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(String),
    /// A batch of CloudEvents (`application/cloudevents-batch+json`) on a route keyed by CloudEvents:
    /// one request carries many events, so it has no one key.
    #[error("a CloudEvents batch cannot be deduplicated as one request")]
    CloudEventsBatch,
    /// A JSON-RPC batch (a JSON array of calls) on a route keyed by `jsonrpc` whose calls cannot each be
    /// keyed on their own (two share an `id`, or it holds too many); the text says why. Nothing ran.
    #[error("a JSON-RPC batch cannot be keyed call by call: {0}")]
    JsonRpcBatch(String),
    /// A GraphQL request on a route keyed by `graphql` whose `@idempotent` fields cannot be keyed: the
    /// directive misplaced, a key missing or repeated, a document over a limit, or (where keys are
    /// required) a body that is no GraphQL request; the text says which. Nothing ran.
    #[error("a GraphQL request cannot be keyed: {0}")]
    GraphQlRequest(String),
    /// On a route keyed by `repeatability` (OASIS Repeatable Requests): a `Repeatability-Request-ID`
    /// without a valid `Repeatability-First-Sent` (an IMF-fixdate); the text says what was wrong.
    #[error("repeatability headers not valid: {0}")]
    RepeatabilityInvalid(String),
    /// On a route keyed by `repeatability`: a `Repeatability-First-Sent` outside the route's
    /// `repeatability_window` (too old to be tracked, or in the future beyond the clock skew allowed);
    /// the text says which.
    #[error("first sent outside the repeatability window: {0}")]
    RepeatabilityExpired(String),
    /// A keyed request carries none of its route's scope headers (nor its scope cookie) while
    /// `unscoped = "reject"`; the text names the setting and what it lists.
    #[error("keyed request without any of the scope headers {0}")]
    MissingScope(String),
    /// The request's webhook signature did not verify on a route with a `signature`; the text is the
    /// proxy's own words for what was wrong (never the request's content nor a secret).
    #[error("webhook signature not verified: {0}")]
    SignatureInvalid(String),
    /// On a route with `scope_jwt`: the keyed request's bearer token did not verify; the text is the
    /// proxy's own words for what was wrong (never the token).
    #[error("bearer token not valid: {0}")]
    InvalidToken(String),
    /// On a route with `scope_jwt`: the key set its tokens are verified with has not been read yet, or
    /// cannot be read now for a key the token names and the set lacks.
    #[error("the key set bearer tokens are verified with cannot be read")]
    KeysUnavailable,
    /// The keyed request body is over `max_request_body`.
    #[error("request body exceeds {limit} bytes")]
    RequestTooLarge {
        /// The configured limit.
        limit: u64,
    },
    /// The request body could not be read from the client.
    #[error("could not read the request body: {0}")]
    ClientBody(String),
    /// The path has no normal form the proxy accepts (`server.paths`, `server.escaped_slashes`,
    /// `server.path_parameters`); nothing was routed.
    #[error("path refused: {0}")]
    NonNormalPath(crate::config::NotNormal),
    /// A method the proxy never forwards (`CONNECT`, `TRACE`).
    #[error("method {0} is not forwarded")]
    MethodNotAllowed(http::Method),
    /// Another request holds the key right now.
    #[error("a request with this key is in progress")]
    KeyInFlight {
        /// When a retry is likely to succeed.
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
    /// The key's request reached the upstream, which failed before answering in full, and
    /// `on_unknown_outcome = "hold"` keeps it from running again until an operator releases it.
    #[error("the outcome of this key's request is unknown; held until released")]
    OutcomeUnknown,
    /// The store could not be reached (fail_closed).
    #[error("the idempotency store is unavailable: {0}")]
    StoreUnavailable(String),
    /// The upstream could not be reached: it never saw the request.
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    /// The upstream broke off after the request may have reached it.
    #[error("upstream broke off: {0}")]
    UpstreamBroken(String),
    /// The upstream did not answer in time.
    #[error("upstream timed out after {0:?}")]
    UpstreamTimeout(Duration),
    /// The upstream answered with something the proxy cannot relay (`101 Switching Protocols`).
    #[error("upstream answered {0}, which is not relayed")]
    UpstreamInvalidResponse(http::StatusCode),
    /// The client did not send its request body within `server.body_read_timeout`.
    #[error("the request body did not arrive within {0:?}")]
    RequestTimeout(Duration),
    /// The key's stored response cannot be decrypted; it is never replayed as is.
    #[error("the stored response for this key cannot be read")]
    RecordUnreadable,
    /// A bound of the proxy's own is reached; nothing was claimed or forwarded.
    #[error("busy: {0:?}")]
    Busy(Busy),
}

impl ProxyError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::CloudEventsBatch
            | ProxyError::JsonRpcBatch(_)
            | ProxyError::GraphQlRequest(_)
            | ProxyError::RepeatabilityInvalid(_)
            | ProxyError::MissingScope(_)
            | ProxyError::ClientBody(_)
            | ProxyError::NonNormalPath(_) => StatusCode::BAD_REQUEST,
            ProxyError::SignatureInvalid(_) | ProxyError::InvalidToken(_) => StatusCode::UNAUTHORIZED,
            ProxyError::KeysUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::KeyInFlight { .. } => StatusCode::CONFLICT,
            ProxyError::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            ProxyError::ResponseNotRetained { .. } => StatusCode::GONE,
            ProxyError::OutcomeUnknown => StatusCode::BAD_GATEWAY,
            ProxyError::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::UpstreamUnreachable(_)
            | ProxyError::UpstreamBroken(_)
            | ProxyError::UpstreamInvalidResponse(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::RecordUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            ProxyError::RepeatabilityExpired(_) => StatusCode::PRECONDITION_FAILED,
            ProxyError::Busy(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The stable slug of the problem `type` URI.
    pub fn slug(&self) -> &'static str {
        match self {
            ProxyError::MissingKey(_) => "missing-key",
            ProxyError::InvalidKey(_) => "invalid-key",
            ProxyError::CloudEventsBatch => "cloudevents-batch",
            ProxyError::JsonRpcBatch(_) => "jsonrpc-batch",
            ProxyError::GraphQlRequest(_) => "graphql-request",
            ProxyError::RepeatabilityInvalid(_) => "repeatability-invalid",
            ProxyError::RepeatabilityExpired(_) => "repeatability-expired",
            ProxyError::MissingScope(_) => "missing-scope",
            ProxyError::SignatureInvalid(_) => "signature-invalid",
            ProxyError::InvalidToken(_) => "invalid-token",
            ProxyError::KeysUnavailable => "keys-unavailable",
            ProxyError::RequestTooLarge { .. } => "request-too-large",
            ProxyError::ClientBody(_) => "bad-request-body",
            ProxyError::NonNormalPath(_) => "non-normal-path",
            ProxyError::MethodNotAllowed(_) => "method-not-allowed",
            ProxyError::KeyInFlight { .. } => "key-in-flight",
            ProxyError::KeyReused => "key-reused",
            ProxyError::ResponseNotRetained { .. } => "response-not-retained",
            ProxyError::OutcomeUnknown => "outcome-unknown",
            ProxyError::StoreUnavailable(_) => "store-unavailable",
            ProxyError::UpstreamUnreachable(_) | ProxyError::UpstreamBroken(_) => "upstream-unreachable",
            ProxyError::UpstreamTimeout(_) => "upstream-timeout",
            ProxyError::UpstreamInvalidResponse(_) => "upstream-invalid-response",
            ProxyError::RequestTimeout(_) => "request-timeout",
            ProxyError::RecordUnreadable => "record-unreadable",
            ProxyError::Busy(_) => "busy",
        }
    }

    fn title(&self) -> &'static str {
        match self {
            ProxyError::MissingKey(_) => "Idempotency key missing",
            ProxyError::InvalidKey(_) => "Idempotency key invalid",
            ProxyError::CloudEventsBatch => "CloudEvents batch not accepted",
            ProxyError::JsonRpcBatch(_) => "JSON-RPC batch not accepted",
            ProxyError::GraphQlRequest(_) => "GraphQL request not accepted",
            ProxyError::RepeatabilityInvalid(_) => "Repeatability headers not valid",
            ProxyError::RepeatabilityExpired(_) => "Request first sent outside the repeatability window",
            ProxyError::MissingScope(_) => "Client credential missing",
            ProxyError::SignatureInvalid(_) => "Webhook signature not verified",
            ProxyError::InvalidToken(_) => "Bearer token not valid",
            ProxyError::KeysUnavailable => "Token keys unavailable",
            ProxyError::RequestTooLarge { .. } => "Request body too large",
            ProxyError::ClientBody(_) => "Request body unreadable",
            ProxyError::NonNormalPath(_) => "Path not accepted",
            ProxyError::MethodNotAllowed(_) => "Method not allowed",
            ProxyError::KeyInFlight { .. } => "Request with this key in progress",
            ProxyError::KeyReused => "Idempotency key reused with another request",
            ProxyError::ResponseNotRetained { .. } => "Response not retained",
            ProxyError::OutcomeUnknown => "Outcome unknown",
            ProxyError::StoreUnavailable(_) => "Idempotency store unavailable",
            ProxyError::UpstreamUnreachable(_) | ProxyError::UpstreamBroken(_) => "Upstream unreachable",
            ProxyError::UpstreamTimeout(_) => "Upstream timeout",
            ProxyError::UpstreamInvalidResponse(_) => "Upstream response not relayed",
            ProxyError::RequestTimeout(_) => "Request body timeout",
            ProxyError::RecordUnreadable => "Stored response unreadable",
            ProxyError::Busy(_) => "Proxy busy",
        }
    }

    /// What the client is told: the proxy's own words only, never an internal error's text (that goes to
    /// the log with [`Display`](std::fmt::Display)).
    pub fn detail(&self) -> String {
        match self {
            ProxyError::MissingKey(what) => format!("This request needs {what}."),
            ProxyError::InvalidKey(why) => format!("The idempotency key is invalid: {why}."),
            ProxyError::CloudEventsBatch => {
                "This route deduplicates CloudEvents one event per request; a batch \
                 (application/cloudevents-batch+json) holds many events and has no one key. Send each \
                 event on its own, in binary or structured mode."
                    .into()
            }
            ProxyError::JsonRpcBatch(why) => format!(
                "This route keys each call of a JSON-RPC batch on its own, and this batch cannot be: \
                 {why}. None of its calls was executed."
            ),
            ProxyError::GraphQlRequest(why) => format!(
                "This route keys each @idempotent field of a GraphQL mutation on its own, and this \
                 request cannot be: {why}. Nothing was executed."
            ),
            ProxyError::RepeatabilityInvalid(why) => format!(
                "A Repeatability-Request-ID needs a Repeatability-First-Sent header, the time the \
                 request was first sent as an IMF-fixdate (Sun, 06 Nov 1994 08:49:37 GMT): {why}."
            ),
            ProxyError::RepeatabilityExpired(why) => format!(
                "This request was first sent {why}, so it is not run now: outside the window this \
                 proxy does not answer for whether an earlier attempt ran. Find out from the service \
                 whether it took effect before sending it again as a new request (a new \
                 Repeatability-Request-ID); a first-sent time ahead of the clock means the client's \
                 clock needs setting."
            ),
            ProxyError::InvalidToken(why) => format!(
                "The bearer token names who sent this keyed request, so it must verify: {why}. \
                 Nothing was claimed or forwarded; send it again with a valid token."
            ),
            ProxyError::KeysUnavailable => {
                "The keys bearer tokens are verified with here could not be read (not yet since the \
                 proxy started, or not now for the key this token names); nothing was claimed or \
                 forwarded. Try again shortly."
                    .into()
            }
            ProxyError::MissingScope(headers) => format!(
                "A request with an idempotency key must carry a credential in one of {headers}, so \
                 that one client's key never answers another's; or the proxy must be configured with \
                 unscoped = \"shared\" there."
            ),
            ProxyError::SignatureInvalid(why) => format!(
                "The request's webhook signature was not verified ({why}); nothing was executed. \
                 Check the sender's signing secret and clock against the proxy's configuration."
            ),
            ProxyError::RequestTooLarge { limit } => {
                format!("The request body is larger than {limit} bytes.")
            }
            ProxyError::ClientBody(_) => "The request body could not be read.".into(),
            ProxyError::NonNormalPath(why) => format!("The request was not forwarded: {why}."),
            ProxyError::MethodNotAllowed(method) => {
                format!("{method} requests are not forwarded by this proxy.")
            }
            ProxyError::KeyInFlight { .. } => {
                "A request with this idempotency key is being executed; retry after Retry-After \
                 seconds to get its response."
                    .into()
            }
            ProxyError::KeyReused => {
                "This idempotency key was already used with a different request (method, path, \
                 headers or body)."
                    .into()
            }
            ProxyError::ResponseNotRetained { .. } => {
                "The request with this idempotency key completed, but its response was too large to \
                 keep; it will not run again."
                    .into()
            }
            ProxyError::OutcomeUnknown => {
                "The request with this idempotency key reached the service, which failed before \
                 answering in full; it may have been executed. It will not run again until an operator \
                 releases the key."
                    .into()
            }
            ProxyError::StoreUnavailable(_) => {
                "The idempotency store is unavailable; the request was not forwarded.".into()
            }
            ProxyError::UpstreamUnreachable(_) => "The upstream service could not be reached.".into(),
            ProxyError::UpstreamBroken(_) => {
                "The upstream service broke off before answering; the request may have been executed.".into()
            }
            ProxyError::UpstreamTimeout(after) => {
                format!("The upstream service did not answer within {after:?}.")
            }
            ProxyError::UpstreamInvalidResponse(status) => {
                format!("The upstream service answered {status}, which this proxy does not relay.")
            }
            ProxyError::RequestTimeout(after) => {
                format!("The request body did not arrive within {after:?}.")
            }
            ProxyError::RecordUnreadable => {
                "The stored response for this idempotency key cannot be read.".into()
            }
            ProxyError::Busy(what) => what.detail().into(),
        }
    }

    /// The `requests_total{outcome}` this error counts as.
    pub fn outcome(&self) -> Outcome {
        match self {
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::CloudEventsBatch
            | ProxyError::JsonRpcBatch(_)
            | ProxyError::GraphQlRequest(_)
            | ProxyError::RepeatabilityInvalid(_)
            | ProxyError::RepeatabilityExpired(_)
            | ProxyError::MissingScope(_)
            | ProxyError::SignatureInvalid(_)
            | ProxyError::InvalidToken(_)
            | ProxyError::KeysUnavailable
            | ProxyError::RequestTooLarge { .. }
            | ProxyError::ClientBody(_)
            | ProxyError::NonNormalPath(_)
            | ProxyError::MethodNotAllowed(_)
            | ProxyError::RequestTimeout(_)
            | ProxyError::Busy(_) => Outcome::Rejected,
            ProxyError::KeyInFlight { .. } => Outcome::Conflict,
            ProxyError::KeyReused => Outcome::Mismatch,
            ProxyError::ResponseNotRetained { .. } => Outcome::Replayed,
            ProxyError::OutcomeUnknown => Outcome::Held,
            ProxyError::StoreUnavailable(_) | ProxyError::RecordUnreadable => Outcome::StoreUnavailable,
            ProxyError::UpstreamUnreachable(_)
            | ProxyError::UpstreamBroken(_)
            | ProxyError::UpstreamTimeout(_)
            | ProxyError::UpstreamInvalidResponse(_) => Outcome::UpstreamError,
        }
    }

    /// The gRPC status code this error answers a gRPC call with (grpc/doc/statuscodes.md): what a gRPC
    /// client can act on, as [`ProxyError::status`] is for an HTTP one.
    pub fn grpc_code(&self) -> u32 {
        const INVALID_ARGUMENT: u32 = 3;
        const DEADLINE_EXCEEDED: u32 = 4;
        const ALREADY_EXISTS: u32 = 6;
        const RESOURCE_EXHAUSTED: u32 = 8;
        const FAILED_PRECONDITION: u32 = 9;
        const ABORTED: u32 = 10;
        const UNIMPLEMENTED: u32 = 12;
        const INTERNAL: u32 = 13;
        const UNAVAILABLE: u32 = 14;
        const DATA_LOSS: u32 = 15;
        const UNAUTHENTICATED: u32 = 16;
        match self {
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::CloudEventsBatch
            | ProxyError::JsonRpcBatch(_)
            | ProxyError::GraphQlRequest(_)
            | ProxyError::RepeatabilityInvalid(_)
            | ProxyError::MissingScope(_)
            | ProxyError::ClientBody(_)
            | ProxyError::NonNormalPath(_)
            | ProxyError::KeyReused => INVALID_ARGUMENT,
            // Not to be sent again as it is: only a new request (a new id, sent now) can run.
            ProxyError::RepeatabilityExpired(_) => FAILED_PRECONDITION,
            ProxyError::SignatureInvalid(_) | ProxyError::InvalidToken(_) => UNAUTHENTICATED,
            ProxyError::RequestTooLarge { .. } => RESOURCE_EXHAUSTED,
            ProxyError::MethodNotAllowed(_) => UNIMPLEMENTED,
            // Run again later: the original is still running, and its answer will be there.
            ProxyError::KeyInFlight { .. } => ABORTED,
            // The operation happened; it will not run again.
            ProxyError::ResponseNotRetained { .. } => ALREADY_EXISTS,
            // Not to be retried until an operator has looked (statuscodes.md's own test for the code).
            ProxyError::OutcomeUnknown => FAILED_PRECONDITION,
            ProxyError::StoreUnavailable(_)
            | ProxyError::UpstreamUnreachable(_)
            | ProxyError::UpstreamBroken(_)
            | ProxyError::KeysUnavailable
            | ProxyError::Busy(_) => UNAVAILABLE,
            ProxyError::UpstreamTimeout(_) | ProxyError::RequestTimeout(_) => DEADLINE_EXCEEDED,
            ProxyError::UpstreamInvalidResponse(_) => INTERNAL,
            ProxyError::RecordUnreadable => DATA_LOSS,
        }
    }

    /// Where the key's operation stands, as the problem's `operation_state` tells the client:
    /// `not_started` (this request's effect was not applied: the upstream never had it), `in_progress`,
    /// `completed`, or `unknown` (it may have been applied).
    pub fn operation_state(&self) -> &'static str {
        match self {
            ProxyError::KeyInFlight { .. } => "in_progress",
            ProxyError::ResponseNotRetained { .. } | ProxyError::RecordUnreadable => "completed",
            ProxyError::OutcomeUnknown
            | ProxyError::UpstreamBroken(_)
            | ProxyError::UpstreamTimeout(_)
            | ProxyError::UpstreamInvalidResponse(_) => "unknown",
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::CloudEventsBatch
            | ProxyError::JsonRpcBatch(_)
            | ProxyError::GraphQlRequest(_)
            | ProxyError::RepeatabilityInvalid(_)
            | ProxyError::RepeatabilityExpired(_)
            | ProxyError::MissingScope(_)
            | ProxyError::SignatureInvalid(_)
            | ProxyError::InvalidToken(_)
            | ProxyError::KeysUnavailable
            | ProxyError::RequestTooLarge { .. }
            | ProxyError::ClientBody(_)
            | ProxyError::NonNormalPath(_)
            | ProxyError::MethodNotAllowed(_)
            | ProxyError::KeyReused
            | ProxyError::StoreUnavailable(_)
            | ProxyError::UpstreamUnreachable(_)
            | ProxyError::RequestTimeout(_)
            | ProxyError::Busy(_) => "not_started",
        }
    }

    /// Whether sending the same request again, with the same key, can get another answer: the problem's
    /// `retryable`. False where only a change to the request (or an operator) can.
    pub fn retryable(&self) -> bool {
        match self {
            ProxyError::KeyInFlight { .. }
            | ProxyError::ClientBody(_)
            | ProxyError::StoreUnavailable(_)
            | ProxyError::UpstreamUnreachable(_)
            | ProxyError::UpstreamBroken(_)
            | ProxyError::UpstreamTimeout(_)
            | ProxyError::RequestTimeout(_)
            | ProxyError::KeysUnavailable
            | ProxyError::Busy(_) => true,
            ProxyError::MissingKey(_)
            | ProxyError::InvalidKey(_)
            | ProxyError::CloudEventsBatch
            | ProxyError::JsonRpcBatch(_)
            | ProxyError::GraphQlRequest(_)
            | ProxyError::RepeatabilityInvalid(_)
            | ProxyError::RepeatabilityExpired(_)
            | ProxyError::MissingScope(_)
            | ProxyError::SignatureInvalid(_)
            | ProxyError::InvalidToken(_)
            | ProxyError::RequestTooLarge { .. }
            | ProxyError::NonNormalPath(_)
            | ProxyError::MethodNotAllowed(_)
            | ProxyError::KeyReused
            | ProxyError::ResponseNotRetained { .. }
            | ProxyError::OutcomeUnknown
            | ProxyError::UpstreamInvalidResponse(_)
            | ProxyError::RecordUnreadable => false,
        }
    }

    /// Whether the request may be sent under a new key without its effect being applied twice: true
    /// exactly where its effect was certainly not applied (the problem's `safe_new_key`, present only
    /// then).
    pub fn safe_new_key(&self) -> bool {
        self.operation_state() == "not_started"
    }

    /// The HTTP status of this error on a route with `statuses` of its own.
    pub fn status_under(&self, statuses: &ProblemStatuses) -> StatusCode {
        match self {
            ProxyError::KeyInFlight { .. } => statuses.in_flight,
            ProxyError::KeyReused => statuses.mismatch,
            _ => self.status(),
        }
    }

    pub(crate) fn retry_after(&self) -> Option<u64> {
        match self {
            ProxyError::KeyInFlight { retry_after } => {
                Some(retry_after.as_millis().div_ceil(1000).max(1) as u64)
            }
            ProxyError::StoreUnavailable(_) | ProxyError::KeysUnavailable | ProxyError::Busy(_) => Some(1),
            _ => None,
        }
    }

    /// The problem+json response for this error, its `type` under [`PROBLEM_BASE`].
    pub fn into_response(self) -> Response<ProxyBody> {
        self.into_problem(PROBLEM_BASE, &ProblemStatuses::default())
    }

    /// The problem object (RFC 9457) the client is told, as a problem+json body holds it, and as an item
    /// of a request that carries many keys carries it in its own answer (`proxy/many.rs`).
    pub fn problem(&self, base: &str, statuses: &ProblemStatuses) -> serde_json::Value {
        let mut problem = serde_json::json!({
            "type": format!("{base}{}", self.slug()),
            "title": self.title(),
            "status": self.status_under(statuses).as_u16(),
            "detail": self.detail(),
            "operation_state": self.operation_state(),
            "retryable": self.retryable(),
        });
        if self.safe_new_key() {
            problem["safe_new_key"] = serde_json::Value::Bool(true);
        }
        problem
    }

    /// The problem+json response for this error, its `type` the slug appended to `base`, its status
    /// the route's (`statuses`) where the route sets its own.
    pub fn into_problem(self, base: &str, statuses: &ProblemStatuses) -> Response<ProxyBody> {
        let status = self.status_under(statuses);
        let problem = self.problem(base, statuses);
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
        if matches!(self, ProxyError::SignatureInvalid(_)) {
            // RFC 9110 §15.5.2: a 401 carries a challenge. Senders ignore it; it names what was asked.
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(SIGNATURE_CHALLENGE),
            );
        }
        if matches!(self, ProxyError::InvalidToken(_)) {
            // RFC 6750 §3.1: the token was presented and did not verify.
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(BEARER_CHALLENGE),
            );
        }
        if matches!(self, ProxyError::MethodNotAllowed(_)) {
            headers.insert(header::ALLOW, HeaderValue::from_static(FORWARDED_METHODS));
        }
        if matches!(self, ProxyError::ResponseNotRetained { .. }) {
            headers.insert(crate::headers::REPLAYED_HEADER, HeaderValue::from_static("true"));
        }
        self.repeatability_rejected(headers);
        response
    }

    /// OASIS Repeatable Requests: a request refused for its repeatability headers says so.
    fn repeatability_rejected(&self, headers: &mut http::HeaderMap) {
        if matches!(
            self,
            ProxyError::RepeatabilityInvalid(_) | ProxyError::RepeatabilityExpired(_)
        ) {
            headers.insert(
                crate::headers::REPEATABILITY_RESULT_HEADER,
                HeaderValue::from_static("rejected"),
            );
        }
    }
}

impl ProxyError {
    /// The gRPC answer for this error: HTTP 200, trailers only (`grpc-status`, `grpc-message` with the
    /// problem's detail, percent-encoded as gRPC asks), the problem's `type` as `idemproxy-problem`
    /// metadata, and a `Retry-After` as `grpc-retry-pushback-ms` (gRFC A6). A gRPC client reads an HTTP
    /// error only as a status without its reason.
    pub fn into_grpc(self, base: &str) -> Response<ProxyBody> {
        let mut response = Response::new(body::empty());
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert("grpc-status", HeaderValue::from(self.grpc_code()));
        let message = percent_encoding::utf8_percent_encode(&self.detail(), GRPC_MESSAGE).to_string();
        if let Ok(message) = HeaderValue::try_from(message) {
            headers.insert("grpc-message", message);
        }
        if let Ok(problem) = HeaderValue::try_from(format!("{base}{}", self.slug())) {
            headers.insert("idemproxy-problem", problem);
        }
        headers.insert(
            "idemproxy-operation-state",
            HeaderValue::from_static(self.operation_state()),
        );
        headers.insert(
            "idemproxy-retryable",
            HeaderValue::from_static(if self.retryable() { "true" } else { "false" }),
        );
        if self.safe_new_key() {
            headers.insert("idemproxy-safe-new-key", HeaderValue::from_static("true"));
        }
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        self.repeatability_rejected(headers);
        if let Some(secs) = self.retry_after() {
            headers.insert("grpc-retry-pushback-ms", HeaderValue::from(secs * 1000));
        }
        if matches!(self, ProxyError::ResponseNotRetained { .. }) {
            headers.insert(crate::headers::REPLAYED_HEADER, HeaderValue::from_static("true"));
        }
        response
    }
}

/// What `grpc-message` percent-encodes: every byte outside printable ASCII, and `%` itself.
const GRPC_MESSAGE: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');

/// The challenge of a 401 `signature-invalid`: the request must carry its sender's webhook signature.
const SIGNATURE_CHALLENGE: &str = "Webhook-Signature";

/// The challenge of a bearer token that did not verify (RFC 6750 §3.1).
const BEARER_CHALLENGE: &str = "Bearer error=\"invalid_token\"";

/// The methods the proxy forwards, for the `Allow` header of a 405.
const FORWARDED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grpc_answer_is_trailers_only_with_the_status_and_the_detail_percent_encoded() {
        let response = ProxyError::KeyInFlight {
            retry_after: Duration::from_millis(1500),
        }
        .into_grpc("https://errors.example/");
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers();
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], "10");
        assert_eq!(headers["grpc-retry-pushback-ms"], "2000");
        assert_eq!(
            headers["idemproxy-problem"],
            "https://errors.example/key-in-flight"
        );
        assert!(
            http_body::Body::is_end_stream(response.body()),
            "no messages, so trailers only"
        );
        let message = ProxyError::RequestTooLarge { limit: 5 }.into_grpc("b/");
        assert_eq!(message.headers()["grpc-status"], "8");
        assert_eq!(
            message.headers()["grpc-message"],
            "The request body is larger than 5 bytes."
        );
        let encoded = ProxyError::SignatureInvalid("100% \u{e9}".into()).into_grpc("b/");
        let text = encoded.headers()["grpc-message"].to_str().unwrap().to_owned();
        assert!(text.contains("(100%25 %C3%A9)"), "{text}");
    }

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

    /// One refusal of each kind, each at the index [`kind`] gives it.
    fn one_of_each() -> Vec<ProxyError> {
        vec![
            ProxyError::MissingKey("an idempotency-key header".into()),
            ProxyError::InvalidKey("too long".into()),
            ProxyError::CloudEventsBatch,
            ProxyError::MissingScope("authorization".into()),
            ProxyError::SignatureInvalid("no signature".into()),
            ProxyError::RequestTooLarge { limit: 10 },
            ProxyError::ClientBody("reset".into()),
            ProxyError::NonNormalPath(crate::config::NotNormal::MalformedEscape),
            ProxyError::MethodNotAllowed(http::Method::TRACE),
            ProxyError::KeyInFlight {
                retry_after: Duration::from_secs(1),
            },
            ProxyError::KeyReused,
            ProxyError::ResponseNotRetained { status: 201 },
            ProxyError::OutcomeUnknown,
            ProxyError::StoreUnavailable("down".into()),
            ProxyError::UpstreamUnreachable("refused".into()),
            ProxyError::UpstreamBroken("reset".into()),
            ProxyError::UpstreamTimeout(Duration::from_secs(60)),
            ProxyError::UpstreamInvalidResponse(StatusCode::SWITCHING_PROTOCOLS),
            ProxyError::RequestTimeout(Duration::from_secs(10)),
            ProxyError::RecordUnreadable,
            ProxyError::Busy(Busy::KeyedInFlight),
            ProxyError::JsonRpcBatch("two calls have the id 1".into()),
            ProxyError::RepeatabilityInvalid("no Repeatability-First-Sent".into()),
            ProxyError::RepeatabilityExpired("10 minutes ago".into()),
            ProxyError::InvalidToken("the token has expired (exp)".into()),
            ProxyError::KeysUnavailable,
            ProxyError::GraphQlRequest("@idempotent is misplaced".into()),
        ]
    }

    /// Where each kind sits in [`one_of_each`]; a new kind fails to compile here until it is listed.
    fn kind(error: &ProxyError) -> usize {
        match error {
            ProxyError::MissingKey(_) => 0,
            ProxyError::InvalidKey(_) => 1,
            ProxyError::CloudEventsBatch => 2,
            ProxyError::MissingScope(_) => 3,
            ProxyError::SignatureInvalid(_) => 4,
            ProxyError::RequestTooLarge { .. } => 5,
            ProxyError::ClientBody(_) => 6,
            ProxyError::NonNormalPath(_) => 7,
            ProxyError::MethodNotAllowed(_) => 8,
            ProxyError::KeyInFlight { .. } => 9,
            ProxyError::KeyReused => 10,
            ProxyError::ResponseNotRetained { .. } => 11,
            ProxyError::OutcomeUnknown => 12,
            ProxyError::StoreUnavailable(_) => 13,
            ProxyError::UpstreamUnreachable(_) => 14,
            ProxyError::UpstreamBroken(_) => 15,
            ProxyError::UpstreamTimeout(_) => 16,
            ProxyError::UpstreamInvalidResponse(_) => 17,
            ProxyError::RequestTimeout(_) => 18,
            ProxyError::RecordUnreadable => 19,
            ProxyError::Busy(_) => 20,
            ProxyError::JsonRpcBatch(_) => 21,
            ProxyError::RepeatabilityInvalid(_) => 22,
            ProxyError::RepeatabilityExpired(_) => 23,
            ProxyError::InvalidToken(_) => 24,
            ProxyError::KeysUnavailable => 25,
            ProxyError::GraphQlRequest(_) => 26,
        }
    }

    /// The row of docs/contract.md's problem table for `slug`, split into its cells.
    fn contract_row(slug: &str) -> Vec<String> {
        let contract = include_str!("../docs/contract.md");
        let row = contract
            .lines()
            .find(|line| line.starts_with('|') && line.contains(&format!("/problems/{slug}`")))
            .unwrap_or_else(|| panic!("docs/contract.md has no row for {slug}"));
        row.split('|').map(|cell| cell.trim().to_owned()).collect()
    }

    #[tokio::test]
    async fn every_problem_carries_its_operation_state_and_retryable_as_the_contract_table_gives_them() {
        use http_body_util::BodyExt;
        let all = one_of_each();
        let kinds: Vec<usize> = all.iter().map(kind).collect();
        assert_eq!(
            kinds,
            (0..all.len()).collect::<Vec<_>>(),
            "one of each kind, in order"
        );
        for error in all {
            let (slug, state, retryable) = (error.slug(), error.operation_state(), error.retryable());
            let grpc_code = error.grpc_code();
            let response = error.into_response();
            assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store", "{slug}");
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let mut members: Vec<&str> = problem.as_object().unwrap().keys().map(String::as_str).collect();
            members.sort_unstable();
            let mut expected = vec![
                "detail",
                "operation_state",
                "retryable",
                "status",
                "title",
                "type",
            ];
            if state == "not_started" {
                expected.push("safe_new_key");
                assert_eq!(problem["safe_new_key"], true, "{slug}");
            }
            expected.sort_unstable();
            assert_eq!(members, expected, "{slug}");
            assert!(
                ["not_started", "in_progress", "completed", "unknown"].contains(&state),
                "{slug}: {state}"
            );
            assert_eq!(problem["operation_state"], state, "{slug}");
            assert_eq!(problem["retryable"], retryable, "{slug}");
            assert_eq!(problem["status"], status.as_u16(), "{slug}");

            // The contract says the same: | status | gRPC | operation_state | retryable | type |.
            let row = contract_row(slug);
            assert_eq!(row[1], status.as_str(), "{slug}");
            let grpc_name = crate::config::grpc_code_name(grpc_code);
            assert_eq!(row[2], grpc_name, "{slug}");
            assert!(row[3].contains(&format!("`{state}`")), "{slug}: {}", row[3]);
            assert_eq!(row[4], if retryable { "yes" } else { "no" }, "{slug}");
        }
    }

    #[test]
    fn a_route_may_set_the_status_of_key_in_flight_and_of_key_reused_and_of_nothing_else() {
        let statuses = ProblemStatuses {
            in_flight: StatusCode::TOO_MANY_REQUESTS,
            mismatch: StatusCode::BAD_REQUEST,
        };
        for error in one_of_each() {
            let expected = match error {
                ProxyError::KeyInFlight { .. } => StatusCode::TOO_MANY_REQUESTS,
                ProxyError::KeyReused => StatusCode::BAD_REQUEST,
                _ => error.status(),
            };
            let response = error.into_problem(PROBLEM_BASE, &statuses);
            assert_eq!(response.status(), expected);
        }
    }

    #[tokio::test]
    async fn details_never_carry_internal_error_text() {
        use http_body_util::BodyExt;
        let internal = "db error: connection to 10.0.0.7:5432 refused";
        for error in [
            ProxyError::StoreUnavailable(internal.into()),
            ProxyError::UpstreamUnreachable(internal.into()),
            ProxyError::ClientBody(internal.into()),
        ] {
            let logged = error.to_string();
            assert!(logged.contains(internal), "the log keeps the cause: {logged}");
            let body = error
                .into_response()
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let detail = problem["detail"].as_str().unwrap();
            assert!(
                !detail.contains("10.0.0.7") && !detail.contains("db error"),
                "{detail}"
            );
        }
    }

    #[test]
    fn a_signature_refusal_is_401_with_a_challenge_and_no_store() {
        let response = ProxyError::SignatureInvalid("no signature matched".into()).into_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], SIGNATURE_CHALLENGE);
        assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
        assert!(!response.headers().contains_key(header::RETRY_AFTER));
    }

    #[test]
    fn store_unavailable_is_503_with_retry_after() {
        let response = ProxyError::StoreUnavailable("down".into()).into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(response.headers().contains_key(header::RETRY_AFTER));
    }
}
