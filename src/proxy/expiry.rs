//! The optional response header telling a client when its key expires (`expires_header`), on responses
//! whose key is kept: an execution that will be stored and every replay. Runs as the response head is
//! built; touches only the head. The value is an HTTP date (RFC 9110 IMF-fixdate), as `Expires` and
//! `Retry-After` carry dates; it is computed from the store's time to expiry where the store reports it,
//! measured from a moment before the claim statement was sent and rounded down: the header may announce
//! an expiry up to a second early, never late, since a client trusting a late one could retry after the
//! key was gone and run the request again.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue};

use crate::config::StoreRules;

/// Sets the policy's expiry header on `headers` to `expires_at`, when the policy names one and the
/// expiry is known.
pub fn stamp(headers: &mut HeaderMap, rules: &StoreRules, expires_at: Option<SystemTime>) {
    let (Some(name), Some(at)) = (&rules.expires_header, expires_at) else {
        return;
    };
    let at = round_down(at);
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        headers.insert(name.clone(), value);
    }
}

/// The expiry of a record found `remaining` from expiry by a statement sent at `sent` (the store
/// rounds its time to expiry up to the millisecond).
pub fn after(sent: SystemTime, remaining: Duration) -> SystemTime {
    sent + remaining.saturating_sub(Duration::from_millis(1))
}

fn round_down(at: SystemTime) -> SystemTime {
    match at.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(since) => SystemTime::UNIX_EPOCH + Duration::from_secs(since.as_secs()),
        Err(_) => at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_header_is_an_http_date_rounded_up_and_only_when_asked_for() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(784_111_778_999);
        let mut headers = HeaderMap::new();
        let off = Config::from_toml_str("").unwrap();
        stamp(&mut headers, &off.routes.default.policy.store, Some(at));
        assert!(headers.is_empty());
        let on = Config::from_toml_str("[idempotency]\nexpires_header = \"Idempotency-Expires\"\n").unwrap();
        stamp(&mut headers, &on.routes.default.policy.store, None);
        assert!(headers.is_empty());
        stamp(&mut headers, &on.routes.default.policy.store, Some(at));
        assert_eq!(headers["idempotency-expires"], "Sun, 06 Nov 1994 08:49:38 GMT");
    }
}
