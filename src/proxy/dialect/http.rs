//! The HTTP dialect's rules, which every dialect starts from: what the head of the upstream's answer
//! means for the key before any body. A `101` took the request and switched protocols instead of
//! answering it: what the upstream did is not known, and a `101` can be neither relayed (nothing asked
//! for an upgrade) nor replayed. A status the route releases (`release_statuses`: by default 5xx, 408,
//! 425, 429) gives the key back. Anything else is relayed, and stored at its end.

use http::StatusCode;

use super::verdict::OnHead;
use crate::config::StoreRules;
use crate::error::ProxyError;

/// What an answer's `status` decides under the route's `rules`, before its body.
pub(crate) fn on_head(rules: &StoreRules, status: StatusCode) -> OnHead {
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return OnHead::Refused(ProxyError::UpstreamInvalidResponse(status));
    }
    if rules.release.releases(status) {
        return OnHead::Release;
    }
    OnHead::Relay
}
