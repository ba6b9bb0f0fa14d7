//! Runs on the trailers of every request body the proxy forwards (a passthrough's as they stream, a
//! keyed one's as it is read whole, both through `client_body.rs`): trailers are headers that arrive
//! late, so they are cleaned by the rules headers are cleaned by, and more. Removed are the hop-by-hop
//! fields and those the head's or the trailers' own `Connection` names (which HTTP/2 also refuses to
//! send: one such trailer made an HTTP/2 upstream's stream fail half-sent, its request neither refused
//! nor answered); the fields RFC 9110 §6.5.1 keeps out of trailers (framing, routing, request
//! modifiers, authentication, content metadata); the fields only the proxy may write
//! (`Idempotency-Attempt`, `X-Forwarded-*`, `Forwarded`, trace context); and every field the config
//! reads a key, a scope, a fingerprint or a signature from, so that what the proxy did not see in the
//! head never reaches the service behind the request it decided on. By the same rule a request whose
//! head's `Connection` names one of its route's decisive headers (`Connection: Idempotency-Key`) is
//! refused ([`names_decisive`]): the proxy would key it by a header the service never gets. Touches
//! nothing else.

use std::collections::HashSet;
use std::sync::Arc;

use http::header::{self, HeaderMap, HeaderName};

use crate::config::{Config, KeyPart, KeySource, Policy};
use crate::headers::{ATTEMPT_HEADER, LAST_EVENT_ID_HEADER, REPLAYED_HEADER};

/// Fields never forwarded in a request's trailers, whatever the config.
const NEVER: [&str; 31] = [
    // Connection-specific (RFC 9110 §7.6.1; RFC 9113 §8.2.2); `proxy-*` are caught by prefix.
    "connection",
    "keep-alive",
    "te",
    "transfer-encoding",
    "upgrade",
    // Framing, routing, request modifiers and content metadata (RFC 9110 §6.5.1).
    "content-length",
    "content-encoding",
    "content-type",
    "content-range",
    "trailer",
    "host",
    "expect",
    "max-forwards",
    "range",
    "if-match",
    "if-none-match",
    "if-modified-since",
    "if-unmodified-since",
    "if-range",
    "cache-control",
    "pragma",
    // Authentication.
    "authorization",
    "cookie",
    // Only the proxy writes these.
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "forwarded",
    "traceparent",
    "tracestate",
    "idempotency-key",
    "repeatability-request-id",
];

/// The fields the config makes decisive, and those never forwarded: one set for the process.
#[derive(Debug)]
pub(crate) struct TrailerRules {
    denied: HashSet<HeaderName, foldhash::fast::RandomState>,
}

impl TrailerRules {
    /// The rules for `config`: [`NEVER`], the proxy's own headers, and each route's key, scope,
    /// fingerprint and signature headers.
    pub(crate) fn new(config: &Config) -> Arc<TrailerRules> {
        let mut denied: HashSet<HeaderName, _> =
            NEVER.iter().map(|name| HeaderName::from_static(name)).collect();
        denied.extend([ATTEMPT_HEADER, REPLAYED_HEADER, LAST_EVENT_ID_HEADER]);
        for policy in config.routes.policies() {
            denied.extend(decisive(policy));
        }
        Arc::new(TrailerRules { denied })
    }

    /// Removes from `trailers` what may not be forwarded; `head` is the request's head, whose
    /// `Connection` may name fields of this hop.
    pub(crate) fn clean(&self, trailers: &mut HeaderMap, head: &[HeaderName]) {
        let named = connection_named(trailers);
        let doomed = |name: &HeaderName| {
            self.denied.contains(name)
                || name.as_str().starts_with("proxy-")
                || head.contains(name)
                || named.contains(name)
        };
        if !trailers.keys().any(doomed) {
            return;
        }
        while let Some(name) = trailers.keys().find(|name| doomed(name)).cloned() {
            trailers.remove(name);
        }
    }
}

/// The fields a request head's `Connection` names, which are this hop's only, in its trailers too.
pub(crate) fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|option| HeaderName::from_bytes(option.trim().as_bytes()).ok())
        .collect()
}

/// The first header `policy` decides by that the request's `Connection` names, which would be kept
/// from the service as this hop's only.
pub(crate) fn names_decisive(policy: &Policy, headers: &HeaderMap) -> Option<HeaderName> {
    if !headers.contains_key(header::CONNECTION) {
        return None;
    }
    let named = connection_named(headers);
    decisive(policy).into_iter().find(|name| named.contains(name))
}

/// The header names `policy` reads anything from.
fn decisive(policy: &Policy) -> Vec<HeaderName> {
    let mut names = vec![policy.key.header.clone()];
    names.extend(policy.key.scope_headers.iter().cloned());
    names.extend(policy.key.fingerprint_headers.iter().cloned());
    match &policy.key.source {
        KeySource::Header(name) => names.push(name.clone()),
        KeySource::Repeatability => {
            names.push(crate::headers::REPEATABILITY_ID_HEADER);
            names.push(crate::headers::REPEATABILITY_FIRST_SENT_HEADER);
        }
        KeySource::CloudEvents => names.extend(["ce-id", "ce-source"].map(HeaderName::from_static)),
        KeySource::Template(parts) => names.extend(parts.iter().filter_map(|part| match part {
            KeyPart::Header(name) => Some(name.clone()),
            _ => None,
        })),
        KeySource::Json(_) | KeySource::JsonRpc(_) | KeySource::GraphQl => {}
    }
    if let Some(signature) = &policy.signature {
        names.extend(signature.signed_headers());
    }
    names
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn rules(toml: &str) -> Arc<TrailerRules> {
        TrailerRules::new(&Config::from_toml_str(toml).unwrap())
    }

    fn trailers(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn hop_by_hop_proxy_owned_and_decisive_trailers_are_removed_and_the_rest_kept() {
        let rules = rules("[idempotency]\nscope_headers = [\"x-tenant\"]\n");
        let mut sent = trailers(&[
            ("te", "gzip"),
            ("connection", "close, x-hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("idempotency-key", "k2"),
            ("idempotency-attempt", "7;takeover"),
            ("x-forwarded-for", "10.0.0.1"),
            ("host", "other.example"),
            ("authorization", "Bearer other"),
            ("content-length", "5"),
            ("x-tenant", "acme"),
            ("x-checksum", "sha-1234"),
            ("x-from-head", "1"),
        ]);
        rules.clean(&mut sent, &[HeaderName::from_static("x-from-head")]);
        let left: Vec<&str> = sent.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-checksum"]);
    }

    #[test]
    fn each_route_s_key_and_signature_headers_are_decisive() {
        let rules = rules(
            "[[routes]]\nname = \"hook\"\npath = \"/hook\"\nkey = \"header:x-delivery\"\n\
             unscoped = \"shared\"\nscope_headers = []\n\
             [[routes]]\nname = \"t\"\npath = \"/t\"\nkey = \"template:{header:x-op}-{method}\"\n",
        );
        let mut sent = trailers(&[("x-delivery", "d"), ("x-op", "o"), ("x-other", "kept")]);
        rules.clean(&mut sent, &[]);
        assert_eq!(
            sent.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["x-other"]
        );
    }

    #[test]
    fn a_connection_that_names_a_decisive_header_is_found() {
        let config = Config::from_toml_str("").unwrap();
        let policy = &config.routes.default.policy;
        let mut head = HeaderMap::new();
        assert_eq!(names_decisive(policy, &head), None);
        head.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, te"));
        assert_eq!(names_decisive(policy, &head), None);
        head.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, Idempotency-Key"),
        );
        assert_eq!(
            names_decisive(policy, &head),
            Some(HeaderName::from_static("idempotency-key"))
        );
        head.insert(header::CONNECTION, HeaderValue::from_static("authorization"));
        assert_eq!(names_decisive(policy, &head), Some(header::AUTHORIZATION));
    }

    #[test]
    fn the_head_s_connection_names_fields_of_this_hop() {
        let mut head = HeaderMap::new();
        head.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        assert_eq!(
            connection_named(&head),
            [
                HeaderName::from_static("keep-alive"),
                HeaderName::from_static("x-secret")
            ]
        );
    }
}
