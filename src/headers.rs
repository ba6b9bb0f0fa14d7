//! Header names idemproxy itself writes on responses, shared by the replay and the error responses.

use http::HeaderName;

/// Marks every response answered from the store, and the 410 of a record kept without its body.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");
