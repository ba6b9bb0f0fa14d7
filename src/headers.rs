//! Header names idemproxy itself writes on responses, shared by the replay and the error responses, and
//! the one gRPC field more than one layer reads.

use http::{HeaderMap, HeaderName};

/// Marks every response answered from the store, and the 410 of a record kept without its body.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The request header that tells the upstream which execution of a key this is: `1`, or `N;retry`
/// after a released attempt, `N;takeover` after one whose lease ran out (an RFC 8941 integer with a
/// boolean parameter). Set by the proxy only: a client's own is never forwarded.
pub const ATTEMPT_HEADER: HeaderName = HeaderName::from_static("idempotency-attempt");
/// Sent by an event-stream client that reconnects: the id of the last event it received
/// (`proxy/sse.rs` resumes a replayed or followed stream after it).
pub const LAST_EVENT_ID_HEADER: HeaderName = HeaderName::from_static("last-event-id");

/// OASIS Repeatable Requests (`key = "repeatability"`): the request's id, when it was first sent, and
/// what the server did with it (`accepted`, `rejected`).
pub const REPEATABILITY_ID_HEADER: HeaderName = HeaderName::from_static("repeatability-request-id");
/// See [`REPEATABILITY_ID_HEADER`].
pub const REPEATABILITY_FIRST_SENT_HEADER: HeaderName = HeaderName::from_static("repeatability-first-sent");
/// See [`REPEATABILITY_ID_HEADER`].
pub const REPEATABILITY_RESULT_HEADER: HeaderName = HeaderName::from_static("repeatability-result");

/// The `grpc-status` in a gRPC answer's head (trailers-only) or trailers, if it holds a number.
pub fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    grpc_code(headers.get("grpc-status")?.as_bytes())
}

/// A `grpc-status` value as a code, if it is a number.
pub fn grpc_code(value: &[u8]) -> Option<u32> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}
