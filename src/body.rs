//! The one response body type every path of the proxy answers with: upstream bodies streamed through,
//! relay channels, stored bodies and problem documents, all boxed behind [`ProxyBody`].

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};

/// Errors a body may yield mid-stream.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed response (or upstream request) body.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// A body of known bytes.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into()).map_err(|never| match never {}).boxed()
}

/// A body with no bytes.
pub fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed()
}
