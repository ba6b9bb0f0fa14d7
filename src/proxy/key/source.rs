//! Reads a request's idempotency key from its route's key source: a header (the `Idempotency-Key`
//! form: an sf-string or a bare token), a CloudEvent's source and id, a JSON pointer into the body, or a
//! template joining such parts. [`from_head`] serves the sources found in the head, before the body is
//! read; [`from_body`] the rest, once it has been. Pure functions of the request.

use http::request::Parts;
use http::{HeaderMap, Method, Uri};

use super::parse_key;
use crate::config::{IdempotencyConfig, KeySource};
use crate::error::ProxyError;

/// The key of a request whose source is in its head (`KeySource::needs_body` is false). `Ok(None)`
/// when the request carries none.
pub fn from_head(
    policy: &IdempotencyConfig,
    _method: &Method,
    _uri: &Uri,
    headers: &HeaderMap,
) -> Result<Option<String>, ProxyError> {
    match &policy.key {
        KeySource::Header(name) => parse_key(headers.get_all(name), policy.max_key_length),
        other => Err(ProxyError::InvalidKey(format!(
            "key source {other} is not read yet"
        ))),
    }
}

/// The key of a request whose source needs its body. `Ok(None)` when the request carries none.
pub fn from_body(
    policy: &IdempotencyConfig,
    parts: &Parts,
    _body: &[u8],
) -> Result<Option<String>, ProxyError> {
    from_head(policy, &parts.method, &parts.uri, &parts.headers)
}

/// What a request on this source must carry, for the 400 `missing-key` detail.
pub fn describe(source: &KeySource) -> String {
    match source {
        KeySource::Header(name) => format!("an {name} header"),
        other => format!("a key from {other}"),
    }
}
