//! Runs when the claim found a completed record with the same fingerprint, or the replay cache holds
//! one: rebuilds the original response from the store, byte for byte, without touching the upstream;
//! its body as the retry's dialect answers it (a JSON-RPC call's own `id`, `dialect.rs`).

use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use super::answer::Handled;
use super::cache::{Lookup, ReplayCache};
use super::dialect::{Dialect, sse};
use super::expiry;
use crate::body::{self, ProxyBody};
use crate::config::Route;
use crate::error::ProxyError;
use crate::headers::REPLAYED_HEADER;
use crate::metrics::{Metrics, Outcome};
use crate::store::{ClaimRequest, StoredResponse, TRAILER_PREFIX};

/// A retry of a record this process has seen completed, answered from `cache` without the store: the
/// replay (as the retry's `dialect` answers it), or the refusal of a key reused with another payload;
/// `None` when the cache does not know.
pub(crate) fn from_cache(
    cache: &ReplayCache,
    claim: &ClaimRequest,
    route: &Route,
    (request, dialect): (&HeaderMap, &Dialect),
    metrics: &Metrics,
) -> Option<Handled> {
    let answer = match cache.lookup(&claim.id.scope, &claim.id.key, &claim.fingerprint) {
        Lookup::Replay(stored, expires_at) => response(&stored, request, dialect).map(|mut response| {
            expiry::stamp(response.headers_mut(), &route.policy.store, Some(expires_at));
            (response, Outcome::Replayed)
        }),
        Lookup::Mismatch => Err(ProxyError::KeyReused),
        Lookup::Miss => return None,
    };
    metrics.replay_cache_hits.inc();
    Some(answer)
}

/// The stored response as the client first saw it (status, headers, body, then trailers), plus
/// `Idempotent-Replayed: true`; its body as the retry's `dialect` answers it (a JSON-RPC response
/// answers the retry's `id` instead of the original's). A record kept without its body (over
/// `max_stored_response`) answers 410: the operation happened and must not run again. An event stream
/// replayed to a `request` that carries `Last-Event-ID` resumes after that event (`sse.rs`).
pub(crate) fn response(
    stored: &StoredResponse,
    request: &HeaderMap,
    dialect: &Dialect,
) -> Result<Response<ProxyBody>, ProxyError> {
    let Some(body) = stored.body.clone() else {
        return Err(ProxyError::ResponseNotRetained {
            status: stored.status,
        });
    };
    let mut body = dialect.replayed(body, content_type(stored));
    let mut headers = HeaderMap::with_capacity(stored.headers.len() + 1);
    let mut trailers = HeaderMap::new();
    for (name, value) in &stored.headers {
        let (into, name) = match name.strip_prefix(TRAILER_PREFIX) {
            Some(trailer) => (&mut trailers, trailer),
            None => (&mut headers, name.as_str()),
        };
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(name), Ok(value)) => {
                into.append(name, value);
            }
            _ => {
                tracing::warn!(header = %name, "stored header is not valid HTTP; left out of the replay")
            }
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if let Some(id) = sse::last_event_id(request)
        && sse::resumable(&headers)
    {
        body = sse::resumed(&body, id);
    }
    let body = if trailers.is_empty() {
        body::full(body)
    } else {
        body::full_with_trailers(body, trailers)
    };
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    *response.headers_mut() = headers;
    Ok(response)
}

/// The stored `content-type`, where it has one.
fn content_type(stored: &StoredResponse) -> Option<&[u8]> {
    stored
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .map(|(_, value)| value.as_slice())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn replay_restores_status_headers_and_body() {
        let stored = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("set-cookie".into(), b"a=1".to_vec()),
                ("set-cookie".into(), b"b=2".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"id\":7}")),
        };
        let response = response(&stored, &HeaderMap::new(), &Dialect::Http).unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.headers().get_all("set-cookie").iter().count(), 2);
        assert_eq!(response.headers()[REPLAYED_HEADER], "true");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{\"id\":7}");
    }

    #[tokio::test]
    async fn stored_trailers_come_after_the_body_and_not_among_the_headers() {
        let stored = StoredResponse {
            status: 200,
            headers: vec![
                ("content-type".into(), b"application/grpc".to_vec()),
                (format!("{TRAILER_PREFIX}grpc-status"), b"0".to_vec()),
                (format!("{TRAILER_PREFIX}x-checksum"), b"abc".to_vec()),
            ],
            body: Some(Bytes::from_static(b"\0\0\0\0\x02hi")),
        };
        let response = response(&stored, &HeaderMap::new(), &Dialect::Http).unwrap();
        assert_eq!(response.headers().len(), 2, "{:?}", response.headers());
        assert!(response.headers().get("grpc-status").is_none());
        let collected = response.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers replayed");
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(trailers["x-checksum"], "abc");
        assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\x02hi");
    }

    #[test]
    fn record_without_body_answers_gone() {
        let stored = StoredResponse {
            status: 200,
            headers: vec![],
            body: None,
        };
        assert!(matches!(
            response(&stored, &HeaderMap::new(), &Dialect::Http),
            Err(ProxyError::ResponseNotRetained { status: 200 })
        ));
    }
}
