//! Runs when the claim found a completed record with the same fingerprint, or the replay cache holds
//! one: rebuilds the original response from the store, byte for byte, without touching the upstream.

use http::{HeaderName, HeaderValue, Response, StatusCode};

use super::answer::Handled;
use super::cache::{Lookup, ReplayCache};
use super::expiry;
use crate::body::{self, ProxyBody};
use crate::config::Route;
use crate::error::ProxyError;
use crate::headers::REPLAYED_HEADER;
use crate::metrics::{Metrics, Outcome};
use crate::store::{ClaimRequest, StoredResponse};

/// A retry of a record this process has seen completed, answered from `cache` without the store: the
/// replay, or the refusal of a key reused with another payload; `None` when the cache does not know.
pub(crate) fn from_cache(
    cache: &ReplayCache,
    claim: &ClaimRequest,
    route: &Route,
    metrics: &Metrics,
) -> Option<Handled> {
    let answer = match cache.lookup(&claim.id.scope, &claim.id.key, &claim.fingerprint) {
        Lookup::Replay(stored, expires_at) => response(&stored).map(|mut response| {
            expiry::stamp(response.headers_mut(), &route.policy, Some(expires_at));
            (response, Outcome::Replayed)
        }),
        Lookup::Mismatch => Err(ProxyError::KeyReused),
        Lookup::Miss => return None,
    };
    metrics.replay_cache_hits.inc();
    Some(answer)
}

/// The stored response as the client first saw it, plus `Idempotent-Replayed: true`. A record kept
/// without its body (over `max_stored_response`) answers 410: the operation happened and must not run again.
pub fn response(stored: &StoredResponse) -> Result<Response<ProxyBody>, ProxyError> {
    let Some(body) = stored.body.clone() else {
        return Err(ProxyError::ResponseNotRetained {
            status: stored.status,
        });
    };
    let mut response = Response::new(body::full(body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(name), Ok(value)) => {
                headers.append(name, value);
            }
            _ => {
                tracing::warn!(header = %name, "stored header is not valid HTTP; left out of the replay")
            }
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    Ok(response)
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
        let response = response(&stored).unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.headers().get_all("set-cookie").iter().count(), 2);
        assert_eq!(response.headers()[REPLAYED_HEADER], "true");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"{\"id\":7}");
    }

    #[test]
    fn record_without_body_answers_gone() {
        let stored = StoredResponse {
            status: 200,
            headers: vec![],
            body: None,
        };
        assert!(matches!(
            response(&stored),
            Err(ProxyError::ResponseNotRetained { status: 200 })
        ));
    }
}
